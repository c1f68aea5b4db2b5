"""How much of a planned graph actually runs split: the numbers behind every report.

A linear (or matmul) runs sharded on a mesh dim when its output there is not Replicate
(sharded, or partial sums): each rank then does 1/size of its work on that dim. Block
linears are those whose weight lives in a numbered module (``layers.3.mlp.up_proj``), the
repeated transformer blocks; the LM head or an embedding projection outside them is
reported on its own. A fallback gather is a node whose inputs the plan had to gather
because no rule could keep them split.
"""

from __future__ import annotations

import math
import re

import torch.fx as fx

from ..ops.ring_schedule import ring_step_flops
from ..placements import Replicate, local_shape_on, shard_dim, shard_length
from ..symbolic import hint
from .context import Coverage, ParallelContext, at_node
from .detect import AttentionSite
from .meta import shardings, weight_name
from .nodes import arguments, tensor_val, weight_param
from .rules.registry import op_kind

_IN_BLOCK = re.compile(r"\.\d+\.")


def _linear_flops(node: fx.Node) -> int:
    """2 x output elements x contracted length, for a linear or matmul node."""
    out = tensor_val(node)
    contracted = tensor_val(arguments(node)["input"]).shape[-1]
    return hint(2 * math.prod(out.shape) * contracted)  # at the planned sizes, if symbolic


def _weight_fqn(node: fx.Node, ctx: ParallelContext) -> str | None:
    """The module path of a linear's (or ``x @ weight``'s) parameter weight, if it has one."""
    weight, _ = weight_param(node)
    return ctx.params[weight.name].fqn if isinstance(weight, fx.Node) and weight.name in ctx.params else None


def record_coverage(gm: fx.GraphModule, ctx: ParallelContext) -> None:
    """Measure ``ctx.coverage`` once the graph is planned (before localize drops the values it
    reads), and warn when no site runs parallel."""
    ctx.coverage = measure_coverage(gm, ctx)
    if ctx.mesh.plan_dims and ctx.sites and not ctx.coverage.parallel_sites:
        ctx.warn(f"none of the {len(ctx.sites)} attention and MLP sites runs parallel: every rank computes the whole "
                 f"model (see the warnings above for why)")


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
        if op_kind(node) not in ("linear", "matmul") or tensor_val(node) is None:
            continue
        with at_node("coverage", node):
            flops, fqn = _linear_flops(node), _weight_fqn(node, ctx)
        sharded = bool(plans) and all(s.out != Replicate() for d, s in plans.items() if d not in _own_slice(ctx))
        cov.linear_flops += flops
        cov.sharded_linear_flops += flops * sharded
        if fqn is not None and _IN_BLOCK.search(fqn):
            cov.block_linear_flops += flops
            cov.sharded_block_linear_flops += flops * sharded
    for name, info in ctx.params.items():
        cov.parameters += info.tensor.numel()
        cov.sharded_parameters += info.tensor.numel() * (name in ctx.param_placements)
    cov.parallel_sites = sum(_runs_parallel(site, ctx) for site in ctx.sites)
    cov.cache_bytes_per_rank, cov.cache_bytes = held_cache_bytes(gm, ctx)
    if ctx.mesh.size("ring") > 1:
        cov.ring_attention_flops = {site.name: ring_rank_flops(site, ctx) for site in ctx.sites
                                    if isinstance(site, AttentionSite) and op_kind(site.core) == "hybrid_attention"}
    return cov


def ring_rank_flops(site: AttentionSite, ctx: ParallelContext) -> list[int]:
    """Attention FLOPs each ring rank spends on one attention, following the ring schedule
    (zigzag; causal blocks computed in part, masked blocks computed whole, blocks outside a
    sliding window skipped and the rest computed over their box)."""
    given = arguments(site.core)
    batch, heads, seq, head_dim = (hint(n) for n in tensor_val(given["q"]).shape)
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
    sharded = any(weight_name(linear) in ctx.param_placements for linear in site.colwise + site.rowwise)
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
