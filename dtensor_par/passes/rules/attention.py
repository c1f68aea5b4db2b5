"""Attention: SDPA shards over batch or heads; hybrid attention also over the sequence (cp)."""

from __future__ import annotations

import math

import torch
import torch.fx as fx
import torch.nn.functional as F

from ...mesh import MeshInfo
from ...ops.attention import hybrid_attention
from ...ops.cache_attention import cached_attention
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
    heads on dim 1 and its sinks ``[heads]`` on dim 0, and neither a batch."""
    cur = resolve_partial(ins, cur, env)
    q_val = tensor_val(ins[0])
    nd = q_val.dim()
    batch_like = set(range(nd - 2))
    chosen = next((p for p in cur[:3] if isinstance(p, Shard) and p.dim in batch_like), None)
    if chosen is None:
        return replicate_all(node, ins, cur, "attention sharded along the sequence or head dim")
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
        broadcast = d is None or d < 0 or val.shape[d] == 1
        expected.append(R if broadcast else Shard(d))
    return NodeSharding(chosen, tuple(expected))


def hybrid_attention_rule(node, ins, cur, env):
    """Heads split on tp as for SDPA; on cp q, k, v and the output are sequence shards and a
    mask is whole (each ring block takes its rows and columns).

    A joint sequence (text and image tokens, each sharded on its own and concatenated per
    rank) stays as it is when nothing depends on token order (no mask, not causal): every
    rank then holds its slice of each part, and attention over a permuted sequence is the
    same attention, permuted alike.
    """
    if env.dim != "cp":
        return sdpa_rule(node, ins, cur, env)
    seq_dim = tensor_val(ins[0]).dim() - 2
    joint = cur[0]
    if (isinstance(joint, InterleavedShard) and joint.dim == seq_dim and cur[1] == joint and cur[2] == joint
            and len(ins) == 3 and not arguments(node)["is_causal"]):
        return NodeSharding(joint, (joint, joint, joint))
    seq = Shard(seq_dim)
    return NodeSharding(seq, (seq, seq, seq) + (R,) * (len(ins) - 3))


def cached_attention_rule(node, ins, cur, env):
    """Heads split on tp as for SDPA; on cp the queries and new rows are whole and the held
    cache rows are this rank's (``ops.cache_attention``)."""
    if env.dim != "cp":
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


register("sdpa", "attention", sdpa_rule,
         functions=[torch._C._nn.scaled_dot_product_attention, F.scaled_dot_product_attention])
register("hybrid_attention", "attention", hybrid_attention_rule, functions=[hybrid_attention])
register("cached_attention", "attention", cached_attention_rule, functions=[cached_attention],
         localize=localize_cached_attention)
