"""How much of a planned graph actually runs split: the numbers behind every report.

A linear (or matmul, an expert's grouped matmul, a convolution)
runs sharded on a mesh dim when its output there is not Replicate (sharded, or partial sums):
each rank then does 1/size of its work on that dim. "Sharded" counts the ones sharded on every
planned dim; one rank's share divides each by the sizes of the dims it is split on (a linear cut
over tp beside a cp that cuts nothing is not sharded, yet a rank does half). Block linears are those whose weight lives
in a numbered module (``layers.3.mlp.up_proj``), the repeated transformer blocks; the LM head
or an embedding projection outside them is reported on its own. A fallback gather is a node
whose inputs the plan had to gather because no rule could keep them split.
"""

from __future__ import annotations

import math
import re

import torch.fx as fx

from ..ops.recurrence import kind_of, named_arguments
from ..ops.ring_schedule import ring_step_flops
from ..placements import Partial, Replicate, local_shape_on, shard_dim, shard_length
from ..symbolic import hint
from .context import Coverage, ParallelContext, at_node
from .meta import Work, global_shape, placements, planned_local_shape, set_work, shardings, site_role
from .nodes import arguments, stacked_params, tensor_inputs, tensor_val, weight_param
from .rules.registry import lookup, op_kind
from .sites import AttentionSite, MoESite, site_weight_names

_IN_BLOCK = re.compile(r"\.\d+\.")


CONTRACTIONS = ("linear", "matmul", "grouped_mm", "conv")
"""The ops whose FLOPs coverage counts: a grouped matmul is each expert's linear on its tokens,
a convolution a linear at each position."""


def _linear_flops(node: fx.Node, ctx: ParallelContext) -> int:
    """2 x output elements x contracted length, for a linear, matmul, grouped matmul or
    convolution node (contracted: a group's input channels times the kernel's positions). A
    grouped matmul at its experts' ranks (ep) counts the rows its tokens send, not the
    worst case its rows are laid out for (``ep_size`` times them): a rank's share is then what
    it computes when the routing is even."""
    out = tensor_val(node)
    if op_kind(node) == "conv":
        contracted = math.prod(tensor_val(arguments(node)["weight"]).shape[1:])
    else:
        contracted = tensor_val(tensor_inputs(node)[0]).shape[-1]
    worst_case = next((s.ep_size for s in ctx.sites if isinstance(s, MoESite) and node in s.at_experts), 1)
    return hint(2 * math.prod(out.shape) * contracted) // worst_case  # at the planned sizes, if symbolic


def _weight_fqn(node: fx.Node, ctx: ParallelContext) -> str | None:
    """The module path of a linear's (or ``x @ weight``'s) parameter weight, if it has one (of
    experts stacked from an ``nn.ModuleList``, the first expert's)."""
    weight, _ = weight_param(node)
    weight = stacked_params(weight)[0] if isinstance(weight, fx.Node) else weight
    return ctx.params[weight.name].fqn if isinstance(weight, fx.Node) and weight.name in ctx.params else None


def coverage_pass(gm: fx.GraphModule, ctx: ParallelContext) -> fx.GraphModule:
    """Measure ``ctx.coverage`` once the graph is planned (before localize drops the values it
    reads), record each op's Work, and warn when no site runs parallel."""
    ctx.coverage = measure_coverage(gm, ctx)
    record_work(gm, ctx)
    recurrences_cut = any(op_kind(n) == "recurrence" and any(shard_dim(s.inputs[0]) is not None
                                                            for s in shardings(n).values()) for n in gm.graph.nodes)
    if ctx.mesh.plan_dims and ctx.sites and not ctx.coverage.parallel_sites and not recurrences_cut:
        ctx.warn(f"none of the {len(ctx.sites)} attention and MLP sites runs parallel: every rank computes the whole "
                 f"model (see the warnings above for why)")
    else:
        warn_whole_block_linears(ctx)
    return gm


WHOLE_BLOCK_SHARE = 0.05
"""The share of the block linears' FLOPs outside every site that runs whole above which the
largest of them are named: a report must not look complete when it is not."""


def warn_whole_block_linears(ctx: ParallelContext) -> None:
    """Name the largest block linears outside every site that run whole (not sharded on every
    planned mesh dim) where together they are more than ``WHOLE_BLOCK_SHARE`` of the block
    linears' FLOPs (DeepSeek-V3.2's indexer beside its attention). A site left replicated says
    why itself."""
    cov = ctx.coverage
    whole = sum(cov.whole_block_linears.values())
    if not cov.block_linear_flops or whole <= WHOLE_BLOCK_SHARE * cov.block_linear_flops:
        return
    largest = sorted(cov.whole_block_linears.items(), key=lambda item: -item[1])[:3]
    ctx.warn(f"{len(cov.whole_block_linears)} block linears outside every attention and MLP site run whole on "
             f"every rank of some mesh dim, {whole / cov.block_linear_flops:.1%} of the block linears' FLOPs; the "
             f"largest: " + ", ".join(f"{name} ({flops / cov.block_linear_flops:.1%})" for name, flops in largest))


def _own_slice(ctx: ParallelContext) -> tuple[str, ...]:
    """Planned dims over which every rank computes on its own inputs: dp under ``batch="local"``."""
    return ("dp",) if ctx.config.batch == "local" else ()


def measure_coverage(gm: fx.GraphModule, ctx: ParallelContext) -> Coverage:
    """The coverage of a planned graph (after ``plan_pass``)."""
    cov = Coverage()
    for node in gm.graph.nodes:
        plans = shardings(node)
        for dim, sharding in plans.items():
            if sharding.note:
                cov.fallback_gathers.append(f"{node.name} on {dim!r}: {sharding.note}")
            if sharding.for_output:
                cov.output_gathers.append(f"{node.name} on {dim!r}: {sharding.for_output}")
        if op_kind(node) not in CONTRACTIONS or tensor_val(node) is None:
            continue
        with at_node("coverage", node):
            flops, fqn = _linear_flops(node, ctx), _weight_fqn(node, ctx)
        sharded = bool(plans) and all(s.out != Replicate() for d, s in plans.items() if d not in _own_slice(ctx))
        split = [d for d, s in plans.items() if d not in _own_slice(ctx) and s.out != Replicate()]
        cov.linear_flops += flops
        cov.sharded_linear_flops += flops * sharded
        cov.rank_linear_flops += flops // math.prod(ctx.mesh.size(d) for d in split)
        if fqn is not None and _IN_BLOCK.search(fqn):
            cov.block_linear_flops += flops
            cov.sharded_block_linear_flops += flops * sharded
            if not sharded and site_role(node) is None:
                cov.whole_block_linears[fqn] = cov.whole_block_linears.get(fqn, 0) + flops
    for name, info in ctx.params.items():
        cov.parameters += info.tensor.numel()
        cov.sharded_parameters += info.tensor.numel() * (name in ctx.param_placements or name in ctx.expert_placements)
    cov.parallel_sites = sum(_runs_parallel(site, ctx) for site in ctx.sites)
    cov.cache_bytes_per_rank, cov.cache_bytes = held_cache_bytes(gm, ctx)
    if ctx.mesh.size("ring") > 1:
        cov.ring_attention_flops = {site.name: ring_rank_flops(site, ctx) for site in ctx.sites
                                    if isinstance(site, AttentionSite) and op_kind(site.core) == "hybrid_attention"}
    return cov


ENGINES = {"linear": "matmul", "matmul": "matmul", "grouped_mm": "matmul", "conv": "matmul", "sdpa": "attention",
           "hybrid_attention": "attention", "recurrence": "attention"}
"""The ops whose FLOPs the cost model counts, and the machine rate each runs at (hybrid
attention over a ring of more than one rank: ``"ring_attention"``; a recurrence's small
products within chunks: attention's)."""


def _engine(kind_name: str, ctx: ParallelContext) -> str | None:
    if kind_name == "hybrid_attention" and ctx.mesh.size("ring") > 1:
        return "ring_attention"
    return ENGINES.get(kind_name)


def record_work(gm: fx.GraphModule, ctx: ParallelContext) -> None:
    """Annotate every planned op with a tensor output with the Work one rank does there."""
    sites = {site.core: site for site in ctx.sites if isinstance(site, AttentionSite)}
    for node in gm.graph.nodes:
        val = tensor_val(node)
        if op_kind(node) == "recurrence":  # its output and final state: its getitems' bytes count
            set_work(node, Work(_recurrence_rank_flops(node, ctx), "attention",
                                str(node.meta["val"][0].dtype).removeprefix("torch."), 0))
            continue
        if node.op not in ("call_function", "call_method") or val is None or global_shape(node) is None:
            continue
        kind = lookup(node)
        with at_node("coverage", node):
            flops = rank_flops(node, sites, ctx)
            aliases = kind is not None and kind.family == "views"
            out_bytes = 0 if aliases else hint(math.prod(planned_local_shape(node, ctx.mesh))) * val.element_size()
        set_work(node, Work(flops, _engine(kind.name, ctx) if kind else None, str(val.dtype).removeprefix("torch."),
                            out_bytes))


def rank_flops(node: fx.Node, sites: dict, ctx: ParallelContext) -> int:
    """FLOPs one rank spends on a node's forward: a linear's or matmul's share of
    ``_linear_flops`` (its piece of the output, over the ranks a Partial output splits the
    contraction among), an attention's by the ring schedule; 0 for any other op."""
    kind, mesh = op_kind(node), ctx.mesh
    if kind in CONTRACTIONS:
        split = math.prod(mesh.size(d) for d, p in placements(node).items() if isinstance(p, Partial))
        local, whole = (hint(math.prod(shape)) for shape in (planned_local_shape(node, mesh), global_shape(node)))
        return _linear_flops(node, ctx) * local // (whole * split)
    if kind == "hybrid_attention":
        return max(ring_rank_flops(sites[node], ctx))
    if kind == "sdpa":
        return _sdpa_rank_flops(node, ctx)
    return 0


def _recurrence_rank_flops(node: fx.Node, ctx: ParallelContext) -> int:
    """A recurrence's FLOPs (its kind's ``flops``) on this rank's batch rows, heads and rows, as
    its output is cut; cut along the rows (cp), the two calls each rank makes on its own."""
    rule, mesh = node.args[0], ctx.mesh
    cuts = {dim: sharding.out[0] for dim, sharding in shardings(node).items()}
    t = named_arguments(rule, tuple(a.meta["val"] for a in node.args[1:]))
    options = dict(node.kwargs.get("options", ()))
    whole = kind_of(rule).flops(t, options, cp=any(shard_dim(p) == 1 for p in cuts.values()))
    out = tuple(node.meta["val"][0].shape)
    return whole * hint(math.prod(local_shape_on(out, cuts, mesh))) // hint(math.prod(out))


def _sdpa_rank_flops(node: fx.Node, ctx: ParallelContext) -> int:
    """This rank's rows of an SDPA (heads and batch entries it holds) against every key: the
    schedule of a ring of one where queries and keys are as long, else every pair."""
    given = arguments(node)
    *lead, q_len, _ = (hint(n) for n in planned_local_shape(node, ctx.mesh))
    head_dim, kv_len = (hint(n) for n in (tensor_val(given["query"]).shape[-1], tensor_val(given["key"]).shape[-2]))
    if q_len != kv_len:
        return 4 * math.prod(lead) * head_dim * q_len * kv_len
    return sum(ring_step_flops(q_len, 1, 0, zigzag=False, is_causal=given.get("is_causal", False),
                               batch=math.prod(lead), head_dim=head_dim))


def ring_rank_flops(site: AttentionSite, ctx: ParallelContext) -> list[int]:
    """Attention FLOPs each ring rank spends on one attention, following the ring schedule
    (zigzag; causal blocks computed in part, masked blocks computed whole, blocks outside a
    sliding window skipped and the rest computed over their box), on the batch entries the
    rank holds."""
    given = arguments(site.core)
    _, heads, seq, head_dim = (hint(n) for n in tensor_val(given["q"]).shape)
    batch = hint(planned_local_shape(site.core, ctx.mesh)[0])  # cut over dp, if the plan cuts the batch
    mesh, cp = ctx.mesh, ctx.mesh.dims["cp"]
    ring = mesh.size("ring")
    local_heads = -(-heads // (mesh.size("tp") * mesh.size("ulysses")))  # padded heads are computed too
    laid_out = cp.size * shard_length(seq, cp.size, cp.chunks_per_rank)
    causal, window = given["is_causal"], given["window"]
    return [sum(ring_step_flops(laid_out, ring, r, zigzag=True, is_causal=causal, batch=batch, heads=local_heads,
                                head_dim=head_dim, window=window)) for r in range(ring)]


def _runs_parallel(site, ctx: ParallelContext) -> bool:
    """A site runs parallel when tp shards one of its weights, cp runs its attention (over
    the sequence, or over a kv cache cut along it) or dp cuts its batch (or, under
    ``batch="local"``, each dp rank is given its own)."""
    sharded = any(name in ctx.param_placements for name in site_weight_names(site))
    first = site.core if isinstance(site, AttentionSite) else site.colwise[0]
    batch_cut = ("dp" in shardings(first) and shard_dim(shardings(first)["dp"].out) is not None
                 or "dp" in _own_slice(ctx) and ctx.mesh.size("dp") > 1)
    return sharded or batch_cut or (isinstance(site, AttentionSite)
                                    and op_kind(site.core) in ("hybrid_attention", "cached_attention"))


def held_cache_bytes(gm: fx.GraphModule, ctx: ParallelContext) -> tuple[int, int]:
    """(bytes this rank holds, bytes one device holds) of the kv cache the graph returns: each
    cache output cut as planned or, when it is rows appended to a cache held cut over cp, as
    that cache is (this rank's share of the rows: the runtime keeps the ranks balanced)."""
    outputs = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    placeholders = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    held = whole = 0
    for c in ctx.cache_outputs:
        size = tensor_val(outputs[c.index]).element_size()
        cut = ctx.output_placements[c.index] if c.appends_to is None else ctx.cache_inputs[placeholders[c.appends_to]]
        shape = [hint(n) for n in c.global_shape]
        if c.keep_last is not None:
            shape[c.grows_along] = min(shape[c.grows_along], c.keep_last)
        whole += math.prod(shape) * size
        held += math.prod(local_shape_on(shape, cut, ctx.mesh)) * size
    return held, whole
