"""sequence: seed context parallelism, where the sequence is cut over cp.

Graph inputs shaped like the sequence that hybrid attention or a recurrence runs over (or a
part of a joint one) arrive sharded along it: the runtime slices them, no communication.
Sequences made inside the graph are cut where they are made (``sequence_start``). The plan
then carries these placements through every node (``plan_pass``).

A length only proposes a candidate; which ones hold the sequence is traced, not guessed from
sizes: each one's cut, carried by the plan's own rules (``plan.traced_cuts``), must reach
attention's q, k or v (or a recurrence's inputs) along their sequence, or reach neither
without meeting the sequence on another dim (``traced_sequences``).
"""

from __future__ import annotations

import torch
import torch.fx as fx

from ..ops.recurrence import kind_of, named_arguments
from ..placements import Shard, shard_dim
from ..sequence_pieces import sequence_piece
from ..symbolic import same_size
from .batch import Carrier
from .context import ParallelContext, at_node
from .detect.heads import TO_ATTENTION
from .detect.walk import find_producers
from .edits import with_val
from .nodes import arguments, tensor_inputs, tensor_val
from .plan import traced_cuts
from .rules.indexing import cat_dim
from .rules.registry import op_kind
from .rules.views import sequence_start
from .sites import AttentionSite


def sequence_pass(gm: fx.GraphModule, ctx: ParallelContext) -> fx.GraphModule:
    """Fill ``ctx.input_cuts["cp"]`` and cut the sequences the graph makes (with cp only). An
    input given as its piece over cp (``sequence_pieces``) is cut as given."""
    if ctx.mesh.size("cp") == 1:
        return gm
    ctx.input_cuts["cp"] = given_pieces(gm, ctx)
    lengths = [tensor_val(node.args[1]).shape[1] for node in _recurrences(gm)]
    for site in ctx.sites:
        if isinstance(site, AttentionSite) and op_kind(site.core) == "hybrid_attention":
            with at_node("sequence", site.core):
                lengths += sequence_lengths(site, ctx)
    if not lengths:
        if ctx.input_cuts["cp"]:
            return gm  # a stage of a pipeline without attention (the head): it takes its input's pieces as given
        if any(isinstance(s, AttentionSite) and op_kind(s.core) == "cached_attention" for s in ctx.sites):
            return gm  # decode against a kv cache held cut over cp: the queries are whole
        ctx.warn(f"no attention runs sequence-parallel: mesh dims 'ring' x 'ulysses' = {ctx.mesh.size('cp')} "
                 "shard nothing")
        return gm
    masks = mask_only_nodes(gm)
    inputs = sequence_inputs(gm, ctx, lengths, masks)
    starts = sequence_start_candidates(gm, lengths, masks | made_of_parameters(gm, ctx))
    cut = traced_sequences(gm, ctx, inputs + starts)
    ctx.input_cuts["cp"].update({node.name: Shard(1) for node in inputs if node in cut})
    mark_sequence_starts(gm, [node for node in starts if node in cut])
    gm.recompile()
    return gm


def given_pieces(gm: fx.GraphModule, ctx: ParallelContext) -> dict[str, Shard]:
    """Placeholder name -> its cut, for the inputs given as their piece over cp."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    pieces = [(node, sequence_piece(value)) for node, value in zip(placeholders, ctx.example_inputs)]
    return {node.name: Shard(piece.dim) for node, piece in pieces if piece is not None}


def sequence_inputs(gm: fx.GraphModule, ctx: ParallelContext, lengths: list[int], masks: set[fx.Node]) -> list[fx.Node]:
    """Graph inputs that may hold the sequence: sequence-shaped ones whose dim 1 has one of the
    ``lengths``, except parameters, kv caches, inputs that only build attention masks and those
    given as their pieces (already cut)."""
    return [node for node in gm.graph.nodes
            if node.op == "placeholder" and node.name not in ctx.params and node.name not in ctx.cache_inputs
            and node.name not in ctx.input_cuts["cp"]
            and node not in masks and _is_sequence(tensor_val(node), lengths)]


def _recurrences(gm: fx.GraphModule) -> list[fx.Node]:
    """The linear recurrences over the sequence from zeros (``ops.recurrence``): cp runs them on
    each rank's rows. One from a given state (a decode step's, from the cache's) runs whole."""
    return [node for node in gm.graph.nodes
            if op_kind(node) == "recurrence" and "state" not in named_arguments(node.args[0], node.args[1:])]


def sequence_carriers(gm: fx.GraphModule, ctx: ParallelContext) -> list[Carrier]:
    """q, k and v of each attention that runs sequence-parallel, along their sequence dim, and
    the tensors each recurrence runs along the sequence, along dim 1."""
    carriers = [Carrier(node.name, x, 1) for node in _recurrences(gm)
                for x in node.args[1:1 + len(kind_of(node.args[0]).rows)]]
    for site in ctx.sites:
        if isinstance(site, AttentionSite) and op_kind(site.core) == "hybrid_attention":
            given = arguments(site.core)
            carriers += [Carrier(site.name, given[x], tensor_val(given[x]).dim() - 2) for x in ("q", "k", "v")]
    return carriers


def traced_sequences(gm: fx.GraphModule, ctx: ParallelContext, candidates: list[fx.Node]) -> set[fx.Node]:
    """The candidates that hold the sequence, told by tracing each one's cut along dim 1 with the
    plan's rules: one that reaches an attention's q, k or v along its sequence does; one that
    reaches them only on other dims does not (its length merely equals a sequence's); one that
    reaches no attention (labels for a loss) does unless its cut meets a sequence's on another
    dim of some node (a rotary table as wide as the text is long, cut along its pairs), or it
    is made inside the graph with a dim of its length besides dim 1 (hidden size = tokens) or
    its cut is gathered on the way (LTX's grid of frame positions, its frames cut, then flattened
    with the rows: cutting it would only gather it back)."""
    carriers = sequence_carriers(gm, ctx)
    gathered: dict[fx.Node, set[fx.Node]] = {node: set() for node in candidates}
    traces = {node: traced_cuts(gm, ctx, "cp", {node.name: Shard(1)}, gathered[node]) for node in candidates}
    reached = {node: [shard_dim(cuts[c.node]) == c.dim for c in carriers if shard_dim(cuts.get(c.node)) is not None]
               for node, cuts in traces.items()}
    sequence_dims = {n: shard_dim(p) for node, cuts in traces.items() if any(reached[node])
                     for n, p in cuts.items() if shard_dim(p) is not None}

    def holds_sequence(node: fx.Node) -> bool:
        if reached[node]:
            return any(reached[node])
        meets_another = any(sequence_dims.get(n, shard_dim(p)) != shard_dim(p) for n, p in traces[node].items())
        val = tensor_val(node)
        made = node.op != "placeholder"
        ambiguous = made and any(same_size(val.shape[1], n) for n in val.shape[2:])
        return not meets_another and not ambiguous and not (made and gathered[node])
    return {node for node in candidates if holds_sequence(node)}


def mask_only_nodes(gm: fx.GraphModule) -> set[fx.Node]:
    """Nodes whose every use ends in an attention mask or key padding. Hybrid attention takes
    them whole and every rank holds the graph inputs whole, so these stay whole on cp: no
    gather of a [B, H, S, S] mask built from a [B, S] key-padding input."""
    only: set[fx.Node] = set()
    for node in reversed(gm.graph.nodes):
        with at_node("sequence", node):
            if node.users and all(u in only or _mask_of(u, node) for u in node.users):
                only.add(node)
    return only


def made_of_parameters(gm: fx.GraphModule, ctx: ParallelContext) -> set[fx.Node]:
    """Nodes computed from parameters only (an expert weight ``[E, inter, hidden]`` transposed
    for a grouped matmul): weights, whatever length a dim of theirs has, are no sequence."""
    made = {n for n in gm.graph.nodes if n.name in ctx.params}
    for node in gm.graph.nodes:
        if node.all_input_nodes and all(i in made for i in node.all_input_nodes):
            made.add(node)
    return made


def _mask_of(attention: fx.Node, node: fx.Node) -> bool:
    """Whether ``node`` is a hybrid attention's mask or key padding, and not its q, k or v."""
    if op_kind(attention) != "hybrid_attention":
        return False
    given = arguments(attention)
    return node not in (given["q"], given["k"], given["v"]) and node in (given["attn_mask"], given["key_padding"])


def sequence_lengths(site: AttentionSite, ctx: ParallelContext) -> list[int]:
    """The length of the sequence an attention runs over, and of each part of it when it is
    a joint sequence concatenated from several (text and image tokens)."""
    query = arguments(site.core)["q"]
    length = tensor_val(query).shape[-2]
    lengths = [length]
    projections, walked = find_producers(query, TO_ATTENTION, ctx)
    for projection in projections:  # the parts concatenated before the projection (CogVideoX)
        walked += find_producers(arguments(projection)["input"], TO_ATTENTION, ctx)[1]
    for node in walked:
        if op_kind(node) == "cat" and same_size(tensor_val(node).shape[cat_dim(node)], length):
            lengths += [tensor_val(i).shape[cat_dim(node)] for i in tensor_inputs(node)]
    return lengths


def _sequence_shaped(val) -> bool:
    """``[batch, seq, ...]`` activations, or ``[batch, seq]`` token ids or positions (integers:
    a float ``[batch, features]`` input, a pooled embedding, or a complex rotary table
    ``[positions, pairs]`` is no sequence)."""
    return val.dim() >= 3 or (val.dim() == 2 and not (val.is_floating_point() or val.is_complex()))


def _is_sequence(val, lengths: list[int]) -> bool:
    return val is not None and _sequence_shaped(val) and any(same_size(val.shape[1], n) for n in lengths)


def sequence_start_candidates(gm: fx.GraphModule, lengths: list[int], whole: set[fx.Node]) -> list[fx.Node]:
    """Activations made inside the graph (a patch embedding's tokens, transposed out of a conv)
    that may start a sequence: each floating-point sequence-shaped node none of whose inputs
    holds one as long (nor is attention's output), unless it stays ``whole`` (masks, weights):
    a concatenation of shorter parts is one too (ViT's class token before its patches, which a
    cut of the patches alone would gather). Positions stay whole: masks are built from them."""
    def holds(node: fx.Node, length) -> bool:
        val = node.meta.get("val")
        return op_kind(node) == "hybrid_attention" or any(
            isinstance(v, torch.Tensor) and _is_sequence(v, [length]) for v in (val if isinstance(val, (tuple, list)) else [val]))

    def may_start(node: fx.Node) -> bool:
        val = tensor_val(node)
        if node.op not in ("call_function", "call_method") or node in whole or op_kind(node) == "hybrid_attention":
            return False
        return (_is_sequence(val, lengths) and val.is_floating_point()
                and not any(holds(i, val.shape[1]) for i in node.all_input_nodes))

    candidates = []
    for node in gm.graph.nodes:
        with at_node("sequence", node):
            if may_start(node):
                candidates.append(node)
    return candidates


def mark_sequence_starts(gm: fx.GraphModule, starts: list[fx.Node]) -> None:
    """Cut each of ``starts`` over cp where it is made, as an input sequence is, so the ops after
    it run on shards too, not only the attention: a ``sequence_start`` after it."""
    for node in starts:
        with gm.graph.inserting_after(node):
            start = with_val(gm.graph.call_function(sequence_start, (node,)), tensor_val(node))
        node.replace_all_uses_with(start, delete_user_cb=lambda user: user is not start)
