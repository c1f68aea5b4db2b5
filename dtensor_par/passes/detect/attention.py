"""Attention sites: SDPA calls and attention written out by hand (``softmax(q @ kT) @ v``, with
sink logits concatenated to its scores), each with the projections that make its q, k and v, the
projections its output feeds and those beside it that reach them (``find_attention_sites``,
``attention_site``)."""

from __future__ import annotations

import torch.fx as fx

from ..context import ParallelContext, at_node
from ..nodes import arguments, tensor_inputs, tensor_val
from ..rules.indexing import cat_dim, per_dim
from ..rules.registry import kinds_in, op_kind
from ..sites import AttentionSite, SinkLogits
from .heads import find_head_projections, projected_heads, unfolded_heads
from .mlp import INSIDE_MLP
from .walk import find_consumers, find_producers, walk_through, written_from


# Ops allowed between attention output and its out projection: head merges, output gates, norms
# of heads (DiffLlama's per head pair).
_FROM_ATTENTION = kinds_in("pointwise", "views", "indexing") | {"norm"}


# Ops through which a projection beside attention reaches its out projection, not through the
# residual stream (no add): an output gate (Qwen3-Next's gated norm: ``norm(a) * silu(gate(x))``).
_TO_OUT_PROJECTION = _FROM_ATTENTION - {"add"}


# Ops allowed between attention written out by hand's q @ kT and its softmax: scale, soft-capping
# (tanh), an additive bias or mask, masked_fill, where, upcasts; and between softmax and @ v.
# Views fold the heads into the batch and back (Bloom's [batch * heads, seq, keys] scores).
_SCORE_MODIFIERS = kinds_in("pointwise") | {"cast", "view"}
_AFTER_SOFTMAX = {"cast", "dropout", "view"}


# Ops through which a softmax that is not read as attention may still be made from a matmul's
# output: enough to name it in a warning.
_NEAR_SCORES = _SCORE_MODIFIERS | kinds_in("views", "indexing", "reductions")


def _heads_of(x: fx.Node) -> int:
    """The heads of ``[batch, heads, seq, dim]`` attention operands; 1 without a heads dim."""
    return tensor_val(x).shape[-3] if tensor_val(x).dim() >= 4 else 1


def _written_heads(scores: fx.Node, softmax: fx.Node) -> int | None:
    """The heads attention written out by hand runs: its probabilities' ``[batch, heads, seq,
    keys]``, or, folded into the batch (``[batch * heads, seq, keys]``: XGLM), the heads its
    query was viewed from; None for neither."""
    if tensor_val(softmax).dim() >= 4:
        return tensor_val(softmax).shape[-3]
    source = unfolded_heads(tensor_inputs(scores)[0]) if tensor_val(softmax).dim() == 3 else None
    return None if source is None else tensor_val(source).shape[1]


def _score_products(scores: fx.Node) -> list[fx.Node]:
    """The matmuls a softmax's input is made from through score modifiers."""
    return walk_through([scores], written_from, _SCORE_MODIFIERS, {"matmul"})[0]


def _drops_last_column(node: fx.Node) -> bool:
    """Whether ``node`` is ``x[..., :-1]``: every column of ``x``'s last dim but the last."""
    entries = per_dim(arguments(node)["index"], tensor_val(node).dim()) if op_kind(node) == "getitem" else None
    if not entries or any(e != slice(None) for e in entries[:-1]) or not isinstance(entries[-1], slice):
        return False
    columns = tensor_val(arguments(node)["input"]).shape[-1]
    return range(columns)[entries[-1]] == range(columns - 1)


def find_sink_logits(softmax: fx.Node) -> SinkLogits | None:
    """The sink logits of a softmax over ``cat([scores, column], -1)`` whose column is a
    ``[1, heads, 1, 1]`` tensor expanded, and whose probabilities are read without it."""
    logits, ndim = tensor_inputs(softmax)[0], tensor_val(softmax).dim()
    if op_kind(logits) != "cat" or cat_dim(logits) != ndim - 1 or len(logits.users) != 1 or ndim != 4 \
            or len(arguments(logits)["tensors"]) != 2 or len(softmax.users) != 1:
        return None
    scores, column = arguments(logits)["tensors"]
    per_head = tensor_inputs(column)[0] if op_kind(column) == "expand" else None
    if per_head is None or tuple(tensor_val(per_head).shape) != (1, tensor_val(scores).shape[1], 1, 1):
        return None
    dropped = next(iter(softmax.users))
    return SinkLogits(scores, per_head, dropped) if _drops_last_column(dropped) else None


def weighted_values(softmax: fx.Node, sinks: SinkLogits | None) -> fx.Node | None:
    """The matmul that weighs values by a softmax's probabilities (through casts, dropout and
    views, and without the sinks' column)."""
    probabilities = softmax if sinks is None else sinks.dropped
    while len(probabilities.users) == 1 and op_kind(next(iter(probabilities.users))) in _AFTER_SOFTMAX:
        probabilities = next(iter(probabilities.users))
    users = [u for u in probabilities.users if op_kind(u) == "matmul" and tensor_inputs(u)[0] is probabilities]
    return users[0] if len(users) == 1 and len(probabilities.users) == 1 else None


def _over_last_dim(softmax: fx.Node) -> bool:
    return arguments(softmax).get("dim") in (-1, tensor_val(softmax).dim() - 1)


def find_written_attention(gm: fx.GraphModule, ctx: ParallelContext
                           ) -> list[tuple[fx.Node, fx.Node, fx.Node, SinkLogits | None]]:
    """``(q @ kT, softmax, probabilities @ v, sink logits)`` of each attention written out by hand:
    a softmax over the last dim of ``[batch, heads, seq, keys]`` scores made from one matmul's
    output (through score modifiers and views folding the heads into the batch, as Bloom's
    ``baddbmm`` does; with sink logits concatenated last) whose probabilities are multiplied with
    the values. A softmax over a matmul's output that does not read so is warned of by name: a
    report must not look complete when it is not."""
    found = []
    for softmax in (n for n in gm.graph.nodes if op_kind(n) == "softmax"):
        sinks = find_sink_logits(softmax)
        products = _score_products(tensor_inputs(softmax)[0] if sinks is None else sinks.scores)
        weighted = weighted_values(softmax, sinks)
        if len(products) == 1 and weighted is not None and _over_last_dim(softmax) \
                and _written_heads(products[0], softmax) is not None:
            found.append((products[0], softmax, weighted, sinks))
            continue
        products = products or walk_through([tensor_inputs(softmax)[0]], written_from, _NEAR_SCORES, {"matmul"})[0]
        if products:
            ctx.warn(f"{softmax.name}: a softmax over the product {products[0].name} is not read as attention "
                     f"(softmax(q @ kT) @ v, the scores [batch, heads, seq, keys]); it is planned op by op, its heads "
                     f"not sharded as a site's")
    return found


def find_attention_sites(gm: fx.GraphModule, ctx: ParallelContext) -> list[AttentionSite]:
    """SDPA calls and attention written out by hand, in graph order, each with the heads its
    query and key are read with."""
    cores = []
    for sdpa in (n for n in gm.graph.nodes if op_kind(n) == "sdpa"):
        inputs = arguments(sdpa)
        cores.append((sdpa, inputs, (_heads_of(inputs["query"]), _heads_of(inputs["key"])), (None, None, None)))
    for scores, softmax, weighted, sinks in find_written_attention(gm, ctx):
        (query, key), value = tensor_inputs(scores), tensor_inputs(weighted)[1]
        inputs = {"query": query, "key": key, "value": value}
        cores.append((weighted, inputs, (_written_heads(scores, softmax),) * 2, (scores, softmax, sinks)))
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    sites = []
    for node, inputs, heads, (scores, softmax, sinks) in sorted(cores, key=lambda c: order[c[0]]):
        with at_node("detect", node):
            site = attention_site(f"attention{len(sites)}", node, inputs, heads, ctx)
        site.scores, site.softmax, site.sinks = scores, softmax, sinks
        sites.append(site)
    return sites


def attention_site(site_name: str, node: fx.Node, sdpa: dict, heads: tuple[int, int],
                   ctx: ParallelContext) -> AttentionSite:
    """The site of one attention call (its ``query``, ``key`` and ``value`` inputs in ``sdpa``,
    read with ``heads`` query and key heads): the projections it reads, the heads they make and
    the projections its output feeds."""
    q, k, v = (find_head_projections(sdpa[name], ctx)[0] for name in ("query", "key", "value"))
    layouts = {name: projected_heads(sdpa[name], heads[0], ctx) for name in ("query", "key", "value")}
    problem = next((problem for _, problem in layouts.values() if problem), None)
    kv_heads = layouts["key"][0] or heads[1]
    out = find_consumers(node, _FROM_ATTENTION, ctx)
    branch = [linear for o in out for part in (concatenated_features(o) or ())
              for linear in find_producers(part, INSIDE_MLP, ctx)[0]]
    gates = [linear for o in out for linear in find_producers(arguments(o)["input"], _TO_OUT_PROJECTION, ctx)[0]]
    branch = list(dict.fromkeys(branch + [g for g in gates if g not in q + k + v]))
    return AttentionSite(site_name, node, q, k, v, out, heads[0], kv_heads, branch, problem)


def concatenated_features(linear: fx.Node) -> list[fx.Node] | None:
    """The inputs of a ``cat`` along the feature dim that a linear reads (Flux's single-stream
    blocks: ``proj_out(cat([attention, mlp], -1))``), else None."""
    x = arguments(linear)["input"]
    if op_kind(x) != "cat" or cat_dim(x) != tensor_val(x).dim() - 1:
        return None
    return tensor_inputs(x)
