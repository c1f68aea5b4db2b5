"""rewrite: reshape the graph around sites so that every op can be sharded exactly.

- The bias of a rowwise projection is added once, after the partial sums are reduced:
  ``linear(x, w, b)`` becomes ``linear(x, w) + b``.
- ``enable_gqa`` attention whose kv heads cannot be split over tp (x ulysses) gets each kv
  head repeated, the fewest times that make them split evenly, so each rank takes exactly
  the kv heads of its own query heads; otherwise kv travels with its own heads.
- With context parallelism, each attention call becomes ``hybrid_attention`` (Ulysses
  all-to-all, ring attention, all-to-all back) over sequence shards, with its mask, and with
  the padded keys of an uneven sequence masked. Attention with dropout or a mask that needs
  a gradient stays as it is and runs on the gathered sequence, with a warning.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ..logs import logger
from ..ops.attention import hybrid_attention
from ..placements import is_padded, shard_length
from ..symbolic import guards_at, hint, is_symbolic
from .capture import with_val
from .context import ParallelContext
from .detect import AttentionSite
from .localize import Communication
from .patterns import arg, tensor_val
from .rules.attention import sdpa_arguments


def split_rowwise_bias(gm: fx.GraphModule, linear: fx.Node) -> None:
    bias = arg(linear, 2, "bias")
    if bias is None:
        return
    graph = gm.graph
    with graph.inserting_after(linear):
        add = graph.call_function(operator.add, (linear, bias))
    linear.replace_all_uses_with(add, delete_user_cb=lambda user: user is not add)
    linear.args = linear.args[:2]
    linear.kwargs = {}
    with_val(add, linear.meta["val"])
    add.meta["dtensor_par_site"] = linear.meta.get("dtensor_par_site")


def gqa_repeat(heads: int, kv_heads: int, divisor: int) -> int:
    """Fewest repeats of each kv head after which they split evenly over ``divisor`` ranks
    and still group the query heads (``enable_gqa`` maps query head i to kv head i // group)."""
    return next(r for r in range(1, heads // kv_heads + 1)
                if (kv_heads * r) % divisor == 0 and heads % (kv_heads * r) == 0 or kv_heads * r == heads)


def expand_gqa_kv(gm: fx.GraphModule, site: AttentionSite, repeat: int) -> None:
    core, graph = site.core, gm.graph
    sdpa = sdpa_arguments(core)
    for name in ("key", "value"):
        kv = sdpa[name]
        with graph.inserting_before(core):
            expanded = graph.call_method("repeat_interleave", (kv, repeat), {"dim": -3})
        with_val(expanded, tensor_val(kv).repeat_interleave(repeat, dim=-3))
        sdpa[name] = expanded
    sdpa["enable_gqa"] = site.num_kv_heads * repeat != site.num_heads
    core.args, core.kwargs = (sdpa.pop("query"), sdpa.pop("key"), sdpa.pop("value")), sdpa


def hybrid_attention_communication(site: AttentionSite, q, k, mesh, ulysses_impl: str) -> list[Communication]:
    """The collectives one hybrid attention issues, per rank, forward and backward.

    Ulysses: one all-to-all for q/k/v (packed) and one for the output, each mirrored in the
    backward; or, with ``ulysses_impl="all_gather"``, an all-gather of each whose backward
    reduce-scatters ``ulysses`` times the bytes. Ring: ring-1 kv rotations forward; backward
    ring-1 kv rotations plus ring fp32 dk/dv rotations. Sizes include the zero heads padding adds.
    """
    tp, ulysses, ring, cp = (mesh.size(n) for n in ("tp", "ulysses", "ring", "cp"))
    batch, heads, seq, head_dim = q.shape
    q_heads = heads // tp
    kv_heads = k.shape[-3] // tp if k.shape[-3] % tp == 0 else k.shape[-3]
    if q_heads % ulysses or kv_heads % ulysses:
        q_heads = kv_heads = -(-q_heads // ulysses) * ulysses
    local_seq = shard_length(seq, cp, mesh.dims["cp"].chunks_per_rank)
    per_head = hint(batch * local_seq * head_dim * q.element_size())  # one head of a (padded) sequence shard
    comms = []
    if ulysses > 1:
        gathers = ulysses_impl == "all_gather"
        forward, backward = ("all_gather", "reduce_scatter") if gathers else ("all_to_all", "all_to_all")
        for nbytes in (per_head * (q_heads + 2 * kv_heads), per_head * q_heads):
            comms.append(Communication(forward, backward, "ulysses", ulysses, nbytes,
                                       nbytes * ulysses if gathers else nbytes, site.name))
    if ring > 1:
        kv_block = 2 * (kv_heads // ulysses) * per_head * ulysses  # k and v of one ring block
        comms += [Communication("ring_rotate", "ring_rotate", "ring", ring, kv_block, kv_block, site.name)
                  for _ in range(ring - 1)]
        fp32_block = kv_block * 4 // q.element_size()
        comms += [Communication(None, "ring_rotate", "ring", ring, 0, fp32_block, site.name) for _ in range(ring)]
    return comms


def _sequence_lengths(site: AttentionSite, q, k, mesh, ctx: ParallelContext) -> dict:
    """``{"kv_len": n}`` when the keys' length does not divide over cp and hybrid attention
    must mask the padding; raises when a rank would hold nothing but padding."""
    cp, per_rank = mesh.size("cp"), mesh.dims["cp"].chunks_per_rank
    q_len, kv_len = q.shape[-2], k.shape[-2]
    if min(q_len, kv_len) < cp:
        raise ValueError(
            f"hybrid_parallel: attention {site.core.name!r} has sequence length {q_len} (keys {kv_len}), "
            f"shorter than mesh dims 'ring' x 'ulysses' = {mesh.size('ring')} x {mesh.size('ulysses')} = {cp}: "
            f"some ranks would hold only padding; use smaller 'ring' or 'ulysses' dims")
    if is_symbolic(q_len) or is_symbolic(kv_len):
        ctx.warn(f"{site.name} ({site.core.name}): sequence length {ctx.specialization.named(q_len)} is symbolic: it is padded at the end to "
                 f"a multiple of {cp * per_rank} chunks (ring={mesh.size('ring')}, ulysses={mesh.size('ulysses')}), "
                 f"by nothing where it divides, so one plan serves every length")
    elif is_padded(q_len, cp, per_rank) or is_padded(kv_len, cp, per_rank):
        keys = f" (keys {kv_len})" if kv_len != q_len else ""
        ctx.warn(f"{site.name} ({site.core.name}): sequence length {q_len}{keys} does not divide into "
                 f"{cp * per_rank} equal chunks (ring={mesh.size('ring')}, ulysses={mesh.size('ulysses')}); padded at "
                 f"the end to a multiple of {cp * per_rank}")
    return {"kv_len": kv_len} if is_padded(kv_len, cp, per_rank) else {}


def _constant_ancestors(node: fx.Node) -> list[fx.Node] | None:
    """The nodes ``node`` is computed from, in graph order, when no graph input is among them."""
    seen, stack = set(), [node]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        if n.op not in ("call_function", "call_method"):
            return None
        seen.add(n)
        stack.extend(n.all_input_nodes)
    return [n for n in node.graph.nodes if n in seen]


def _concrete(a):
    """An argument the subgraph can run on now: the CPU for the meta device; a symbolic size
    at its value, which pins the plan to that value (a guard, reported by ``explain``)."""
    if isinstance(a, torch.SymInt):
        return int(a)
    return torch.device("cpu") if isinstance(a, torch.device) and a.type == "meta" else a


def _evaluate(nodes: list[fx.Node]) -> torch.Tensor:
    """Run a constant subgraph now, on the device its constants name (the CPU for a model
    planned on the meta device)."""
    env: dict[fx.Node, object] = {}
    for n in nodes:
        args, kwargs = fx.node.map_aggregate(fx.node.map_arg((n.args, n.kwargs), env.__getitem__), _concrete)
        env[n] = n.target(*args, **kwargs) if n.op == "call_function" else getattr(args[0], n.target)(*args[1:], **kwargs)
    return env[nodes[-1]]


def is_causal_mask(mask: fx.Node, q_len: int, kv_len: int) -> bool:
    """Whether an attention mask built from positions alone is exactly the causal one.

    transformers builds a ``[B, 1, S, S]`` mask from aranges while Dynamo traces instead of
    passing ``is_causal``. Such a mask depends on no input: it is evaluated here, once, and
    compared with the causal pattern, so recognizing it is exact, never a guess.
    """
    nodes = _constant_ancestors(mask)
    if nodes is None or q_len != kv_len:
        return False
    with guards_at(f"rewrite at {mask.name} (a mask built from positions, evaluated for one length)"):
        value = _evaluate(nodes)
    if value.dtype != torch.bool:
        hidden = torch.isneginf(value) | (value == torch.finfo(value.dtype).min)
        if not bool((hidden | (value == 0)).all()):
            return False  # an additive bias, not only a mask
        value = ~hidden
    causal = torch.ones(value.shape[-2:], dtype=torch.bool, device=value.device).tril()
    return value.shape[-2] == value.shape[-1] and bool((value == causal).all())


def _erase_unused(gm: fx.GraphModule, node: fx.Node) -> None:
    """Erase ``node`` and then every input it leaves without users (a dead mask subgraph)."""
    stack, erased = [node], set()
    while stack:
        n = stack.pop()
        if n in erased or n.users or n.op not in ("call_function", "call_method"):
            continue
        inputs = n.all_input_nodes
        gm.graph.erase_node(n)
        erased.add(n)
        stack.extend(inputs)


def to_hybrid_attention(gm: fx.GraphModule, site: AttentionSite, ctx: ParallelContext) -> None:
    """Replace the site's SDPA call by ``hybrid_attention`` over the cp mesh dims."""
    mesh, core = ctx.mesh, site.core
    sdpa = sdpa_arguments(core)
    mask = original_mask = sdpa["attn_mask"]
    if sdpa["dropout_p"] or tensor_val(sdpa["query"]).dim() != 4 or (mask is not None and mask.meta["requires_grad"]):
        ctx.warn(f"{site.name} ({core.name}): attention with dropout, a mask that needs a gradient or no batch dim "
                 f"runs on the gathered sequence (mesh dims 'ring' x 'ulysses' = {mesh.size('cp')})")
        return
    q_len, kv_len = tensor_val(sdpa["query"]).shape[-2], tensor_val(sdpa["key"]).shape[-2]
    if mask is not None and not sdpa["is_causal"] and is_causal_mask(mask, q_len, kv_len):
        logger.info("%s (%s): its attention mask is the causal one: runs as is_causal, without the mask",
                    site.name, core.name)
        sdpa["attn_mask"], sdpa["is_causal"], mask = None, True, None
    tp, ulysses = mesh.size("tp"), mesh.size("ulysses")
    kv_heads = tensor_val(sdpa["key"]).shape[-3]
    kv_heads = kv_heads // tp if kv_heads % tp == 0 else kv_heads
    heads = site.num_heads // tp
    if heads % ulysses or kv_heads % ulysses:
        padded = -(-heads // ulysses) * ulysses
        ctx.warn(f"{site.name} ({core.name}): {heads} query / {kv_heads} kv heads per tp rank (tp={tp}) do not "
                 f"divide by mesh dim 'ulysses' of size {ulysses}; padded to {padded} heads "
                 f"({padded - heads} zero heads computed per {heads})")
    kwargs = {"attn_mask": mask, "is_causal": sdpa["is_causal"], "scale": sdpa["scale"],
              "enable_gqa": sdpa["enable_gqa"], "ulysses": mesh.dims["ulysses"], "ring": mesh.dims["ring"],
              "ulysses_impl": ctx.config.ulysses_impl,
              **_sequence_lengths(site, tensor_val(sdpa["query"]), tensor_val(sdpa["key"]), mesh, ctx)}
    with gm.graph.inserting_before(core):
        hybrid = gm.graph.call_function(hybrid_attention, (sdpa["query"], sdpa["key"], sdpa["value"]), kwargs)
    hybrid.meta.update(core.meta)
    hybrid.meta["dtensor_par_comm"] = hybrid_attention_communication(site, tensor_val(sdpa["query"]),
                                                                     tensor_val(sdpa["key"]), mesh,
                                                                     ctx.config.ulysses_impl)
    core.replace_all_uses_with(hybrid)
    gm.graph.erase_node(core)
    site.core = hybrid
    if original_mask is not None and mask is None:
        _erase_unused(gm, original_mask)


def rewrite_pass(gm: fx.GraphModule, ctx: ParallelContext) -> fx.GraphModule:
    tp = ctx.mesh.size("tp")
    for site in ctx.sites:
        for linear in site.rowwise:
            split_rowwise_bias(gm, linear)
        if not isinstance(site, AttentionSite):
            continue
        if sdpa_arguments(site.core)["enable_gqa"] and site.num_kv_heads != site.num_heads:
            divisor = tp * (ctx.mesh.size("ulysses") if ctx.mesh.size("cp") > 1 else 1)
            repeat = gqa_repeat(site.num_heads, site.num_kv_heads, divisor)
            if repeat > 1:
                expand_gqa_kv(gm, site, repeat)
        if ctx.mesh.size("cp") > 1:
            to_hybrid_attention(gm, site, ctx)
    gm.recompile()
    return gm
