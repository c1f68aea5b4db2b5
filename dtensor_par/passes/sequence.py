"""sequence: seed context parallelism, where the sequence is cut over cp.

Graph inputs shaped like the sequence that hybrid attention runs over (or a part of a joint
one) arrive sharded along it: the runtime slices them, no communication. Sequences made
inside the graph are cut where they are made (``sequence_start``). The plan then carries
these placements through every node (``plan_pass``).
"""

from __future__ import annotations

import torch.fx as fx

from ..placements import Placement, Shard
from ..symbolic import same_size
from .capture import with_val
from .context import ParallelContext, at_node
from .detect import TO_ATTENTION, AttentionSite, find_producers
from .nodes import arguments, tensor_inputs, tensor_val
from .rules.indexing import cat_dim
from .rules.registry import op_kind
from .rules.views import sequence_start


def sequence_pass(gm: fx.GraphModule, ctx: ParallelContext) -> fx.GraphModule:
    """Fill ``ctx.sequence_placements`` and cut the sequences the graph makes (with cp only)."""
    if ctx.mesh.size("cp") == 1:
        return gm
    lengths = []
    for site in ctx.sites:
        if isinstance(site, AttentionSite) and op_kind(site.core) == "hybrid_attention":
            with at_node("sequence", site.core):
                lengths += sequence_lengths(site, ctx)
    if not lengths:
        if any(isinstance(s, AttentionSite) and op_kind(s.core) == "cached_attention" for s in ctx.sites):
            return gm  # decode against a kv cache held cut over cp: the queries are whole
        ctx.warn(f"no attention runs sequence-parallel: mesh dims 'ring' x 'ulysses' = {ctx.mesh.size('cp')} "
                 "shard nothing")
        return gm
    masks = mask_only_nodes(gm)
    ctx.sequence_placements = sequence_input_placements(gm, ctx, lengths, masks)
    mark_sequence_starts(gm, lengths, masks | made_of_parameters(gm, ctx))
    gm.recompile()
    return gm


def sequence_input_placements(gm: fx.GraphModule, ctx: ParallelContext, lengths: list[int],
                              masks: set[fx.Node]) -> dict[str, Placement]:
    """Graph inputs sharded along the sequence over cp: sequence-shaped ones whose dim 1 has
    one of the ``lengths``, except parameters and inputs that only build attention masks."""
    return {node.name: Shard(1) for node in gm.graph.nodes
            if node.op == "placeholder" and node.name not in ctx.params and node.name not in ctx.cache_inputs
            and node not in masks and _is_sequence(tensor_val(node), lengths)}


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
    for node in find_producers(query, TO_ATTENTION, ctx)[1]:
        if op_kind(node) == "cat" and same_size(tensor_val(node).shape[cat_dim(node)], length):
            lengths += [tensor_val(i).shape[cat_dim(node)] for i in tensor_inputs(node)]
    return lengths


def _sequence_shaped(val) -> bool:
    """``[batch, seq, ...]`` activations, or ``[batch, seq]`` token ids or positions (integers:
    a float ``[batch, features]`` input, a pooled embedding, is no sequence)."""
    return val.dim() >= 3 or (val.dim() == 2 and not val.is_floating_point())


def _is_sequence(val, lengths: list[int]) -> bool:
    return val is not None and _sequence_shaped(val) and any(same_size(val.shape[1], n) for n in lengths)


def mark_sequence_starts(gm: fx.GraphModule, lengths: list[int], whole: set[fx.Node]) -> None:
    """Activations made inside the graph (a patch embedding's tokens, transposed out of a conv)
    are cut over cp where they are made, as an input sequence is, so the ops after them run on
    shards too, not only the attention: a ``sequence_start`` after each floating-point
    sequence-shaped node none of whose inputs is one, unless it stays ``whole`` (masks, weights).
    Positions stay whole: masks are built from them. A node whose dim 1 has the length of
    another of its dims too (hidden size = tokens) is ambiguous and left to the attention."""
    def starts_sequence(node: fx.Node) -> bool:
        val = tensor_val(node)
        if node.op not in ("call_function", "call_method") or node in whole or op_kind(node) == "hybrid_attention":
            return False
        if not _is_sequence(val, lengths) or not val.is_floating_point():
            return False
        ambiguous = any(same_size(val.shape[1], n) for n in val.shape[2:])
        return not ambiguous and not any(_is_sequence(tensor_val(i), lengths) for i in node.all_input_nodes)

    starts = []
    for node in gm.graph.nodes:
        with at_node("sequence", node):
            if starts_sequence(node):
                starts.append(node)
    for node in starts:
        with gm.graph.inserting_after(node):
            start = with_val(gm.graph.call_function(sequence_start, (node,)), tensor_val(node))
        node.replace_all_uses_with(start, delete_user_cb=lambda user: user is not start)
