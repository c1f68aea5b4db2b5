"""Attention: SDPA shards over batch or heads; hybrid attention also over the sequence (cp)."""

from __future__ import annotations

import math

import torch
import torch.fx as fx
import torch.nn.functional as F

from ...mesh import MeshInfo
from ...ops.attention import hybrid_attention
from ...ops.cache_attention import cached_attention
from ...ops.collectives import joint_order
from ...placements import InterleavedShard, Shard, local_shape_on
from ...symbolic import hint
from ..meta import Communication, NodeSharding, set_communications, shardings
from ..nodes import arguments, tensor_val
from .core import R, replicate_all, resolve_partial
from .registry import register

def sdpa_rule(node, ins, cur, env):
    """Attention is independent per batch entry and per head: shard either, gather the rest.
    A mask broadcasts against the scores from the right; hybrid attention's key padding is
    ``[B|1, keys]``, its batch on dim 0 and no heads; its bias table ``[rows, heads]`` has the
    heads on dim 1 and its sinks ``[heads]`` on dim 0, and neither a batch. Heads cut group by
    group (``plan.head_groups``) are cut so in every input, kv heads in as many groups."""
    cur = resolve_partial(ins, cur, env)
    q_val = tensor_val(ins[0])
    nd = q_val.dim()
    batch_like = set(range(nd - 2))
    chosen = next((p for p in cur[:3] if isinstance(p, (Shard, InterleavedShard)) and p.dim in batch_like), None)
    if chosen is None:
        return replicate_all(node, ins, cur, "attention sharded along the sequence or head dim")
    cut = next(v.shape[chosen.dim - (nd - v.dim())] for p, v in zip(cur, map(tensor_val, ins)) if p == chosen)
    given = arguments(node)
    key_padding, bias_table, sinks = (given.get(name) for name in ("key_padding", "bias_table", "sinks"))
    expected = []
    for i in ins:
        val = tensor_val(i)
        if i is key_padding:
            d = 0 if chosen.dim == 0 else None
        elif i is bias_table or i is sinks:
            d = (1 if i is bias_table else 0) if chosen.dim == nd - 3 else None
        else:
            d = chosen.dim - (nd - val.dim())
        if d is None or d < 0 or val.shape[d] == 1:
            expected.append(R)
        elif isinstance(chosen, InterleavedShard):
            parts = tuple(part * val.shape[d] // cut for part in chosen.parts)
            if any(part * val.shape[d] % cut or p % env.size for part, p in zip(chosen.parts, parts)):
                return replicate_all(node, ins, cur, f"heads cut in groups {list(chosen.parts)} that {i.name}'s "
                                                     f"{val.shape[d]} do not fall into")
            expected.append(InterleavedShard(d, parts))
        else:
            expected.append(Shard(d))
    return NodeSharding(expected[0] if isinstance(chosen, InterleavedShard) else chosen, tuple(expected))


def hybrid_attention_rule(node, ins, cur, env):
    """Heads split on tp as for SDPA; on cp q, k, v and the output are sequence shards and a
    mask is whole (each ring block takes its rows and columns).

    A joint sequence (text and image tokens, each sharded on its own and concatenated per
    rank) stays as it is when only a mask depends on token order (not causal, no window, bias
    or sinks): every rank then holds its slice of each part, attention over a permuted sequence
    is the same attention permuted alike, and the mask is permuted to the order the ranks hold
    (``localize_joint_mask``).
    """
    if not env.cuts_sequence:
        return sdpa_rule(node, ins, cur, env)
    seq_dim = tensor_val(ins[0]).dim() - 2
    joint, given = cur[0], arguments(node)
    masked_only = len(ins) == 3 or (len(ins) == 4 and ins[3] is given["attn_mask"])
    if (isinstance(joint, InterleavedShard) and joint.dim == seq_dim and cur[1] == joint and cur[2] == joint
            and masked_only and not given["is_causal"] and given.get("window") is None):
        return NodeSharding(joint, (joint, joint, joint) + (R,) * (len(ins) - 3))
    seq = Shard(seq_dim)
    return NodeSharding(seq, (seq, seq, seq) + (R,) * (len(ins) - 3))


def cached_attention_rule(node, ins, cur, env):
    """Heads split on tp as for SDPA; on cp the queries and new rows are whole and the held
    cache rows are this rank's (``ops.cache_attention``)."""
    if not env.cuts_sequence:
        return sdpa_rule(node, ins, cur, env)
    held = Shard(tensor_val(ins[3]).dim() - 2)
    return NodeSharding(R, (R, R, R, held, held) + (R,) * (len(ins) - 5))


def localize_cached_attention(gm: fx.GraphModule, node: fx.Node, mesh: MeshInfo) -> None:
    """Record the all-gather of each rank's partial output and log-sum-exp across cp."""
    q = tensor_val(arguments(node)["q"])
    rows = hint(math.prod(local_shape_on(q.shape, {d: s.out for d, s in shardings(node).items()}, mesh)[:-1]))
    cp = mesh.dims["cp"]
    set_communications(node, [Communication("all_gather", None, "cp", cp.size, nbytes, nbytes * cp.size, "decode")
                              for nbytes in (rows * q.shape[-1] * q.element_size(), rows * 4)])


def localize_joint_mask(gm: fx.GraphModule, node: fx.Node, mesh: MeshInfo) -> None:
    """The mask of attention over a joint sequence, its query and key dims indexed into the
    order the ranks hold the sequence in (``collectives.joint_order``): hybrid attention
    reads it as the mask of a plain sequence shard."""
    joint, mask = shardings(node)["cp"].out if "cp" in shardings(node) else None, arguments(node).get("attn_mask")
    if not isinstance(joint, InterleavedShard) or mask is None:
        return
    order = joint_order(joint.parts, mesh.dims["cp"])
    graph, meta = gm.graph, dict(mask.meta)  # a permutation: the mask's shape, dtype and needs
    with graph.inserting_before(node):
        index = graph.call_method("new_tensor", (mask, order.tolist()), {"dtype": torch.long})
        index.meta = {**meta, "val": order}
        for dim in (-1, -2):
            if meta["val"].shape[dim] == len(order):
                mask = graph.call_method("index_select", (mask, dim, index))
                mask.meta = dict(meta)
    node.update_kwarg("attn_mask", mask)


def kv_whole_on_tp(x: torch.Tensor) -> torch.Tensor:
    """Where a fused projection's key or value part, cut over tp with its query part, is
    gathered whole (``rewrite.gather_fused_kv``): fewer kv heads than tp ranks are held whole
    by every rank, as Megatron replicates them. An identity in the local graph."""
    return x


def kv_whole_on_tp_rule(node, ins, cur, env):
    p = R if env.cuts_features else cur[0]
    return NodeSharding(p, (p,))


register("sdpa", "attention", sdpa_rule,
         functions=[torch._C._nn.scaled_dot_product_attention, F.scaled_dot_product_attention])
register("hybrid_attention", "attention", hybrid_attention_rule, functions=[hybrid_attention],
         localize=localize_joint_mask)
register("cached_attention", "attention", cached_attention_rule, functions=[cached_attention],
         localize=localize_cached_attention)
register("kv_whole_on_tp", "attention", kv_whole_on_tp_rule, functions=[kv_whole_on_tp])
