"""biases: read a bias built from positions (``ops.position_bias``) off the graph, exactly.

A tensor added to attention's scores is read as ALiBi when it depends on no graph input and
equals, value for value, one slope per head times the key's position (or times ``k - q``):
it is evaluated here, once, and compared with what ``PositionBias`` computes. It is read as
T5's relative position bias when it is ``embedding(buckets, table)`` permuted to
``[1, heads, q, k]``, with ``buckets`` depending on no input and on ``k - q`` alone
(evaluated and compared too). Anything else is no position bias: it stays a mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.nn.functional as F

from ..ops.position_bias import PositionBias
from ..ops.ring_kernels import as_4d
from .meta import buffer_value
from .nodes import arguments, called, tensor_val
from .rules.registry import op_kind


def constant_ancestors(node: fx.Node) -> list[fx.Node] | None:
    """The nodes ``node`` is computed from, in graph order, when no graph input is among them
    but module buffers the graph only reads (``meta.BufferValue``): those are then marked read,
    so that the plan holds only while they keep their values."""
    seen, stack = set(), [node]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        if n.op not in ("call_function", "call_method") and buffer_value(n) is None:
            return None
        seen.add(n)
        stack.extend(n.all_input_nodes)
    ancestors = [n for n in node.graph.nodes if n in seen]
    for buffer in filter(None, map(buffer_value, ancestors)):
        buffer.read = True
    return ancestors


def _concrete(a):
    """An argument the subgraph can run on now: the CPU for the meta device; a symbolic size
    at its value, which pins the plan to that value (a guard, reported by ``explain``)."""
    if isinstance(a, torch.SymInt):
        return int(a)
    return torch.device("cpu") if isinstance(a, torch.device) and a.type == "meta" else a


def evaluate_constant(nodes: list[fx.Node]) -> torch.Tensor:
    """Run a constant subgraph now, its buffers at their values, on the device its constants
    name (the CPU for a model planned on the meta device)."""
    env: dict[fx.Node, object] = {}
    for n in nodes:
        if n.op == "placeholder":
            env[n] = buffer_value(n).value
            continue
        args, kwargs = fx.node.map_aggregate(fx.node.map_arg((n.args, n.kwargs), env.__getitem__), _concrete)
        env[n] = called(n, args, kwargs)
    return env[nodes[-1]]


@dataclass(frozen=True)
class FoundBias:
    """A position bias and the table it reads: a graph node (T5's learned embedding) or a
    constant ``[1, heads]`` (ALiBi's slopes), which rewrite puts into the graph."""

    form: PositionBias
    table: fx.Node | torch.Tensor


def _alibi(value: torch.Tensor, heads: int, q_len: int, kv_len: int) -> FoundBias | None:
    """ALiBi, if the bias ``value`` ([B|1, heads, q_len|1, kv_len]) is exactly one: zero at one
    key of query 0's row (its offset: MPT's is the last key), the slope one key on."""
    value = as_4d(value)
    if not value.is_floating_point() or value.shape[1] != heads or value.shape[-2] not in (1, q_len) \
            or value.shape[-1] != kv_len or kv_len < 2:
        return None
    zeros = (value[0, 0, 0] == 0).nonzero().flatten().tolist()
    origin = zeros[0] if len(zeros) == 1 else 0  # every head's row is zero at the same key
    step = 1 if origin + 1 < kv_len else -1
    table = (value[0, :, 0, origin + step] * step).reshape(1, heads)  # one key from the origin: the slope
    rows, cols = torch.arange(value.shape[-2]), torch.arange(kv_len)
    for form in (PositionBias("alibi", offset=-origin), PositionBias("alibi_relative")):
        expected, found = torch.broadcast_tensors(form.tile(table, rows, cols), value)
        if torch.equal(expected, found):
            return FoundBias(form, table)
    return None


def _bucket_runs(buckets: torch.Tensor) -> PositionBias | None:
    """The buckets ``[q, k]`` as a step function of ``k - q``, if they are one."""
    q_len, kv_len = buckets.shape
    by_distance = torch.cat([buckets[:, 0].flip(0), buckets[0, 1:]])  # distances -(q_len - 1) .. kv_len - 1
    distance = torch.arange(kv_len)[None, :] - torch.arange(q_len)[:, None]
    if not torch.equal(by_distance[distance + q_len - 1], buckets):
        return None
    starts = [0] + [i for i in range(1, len(by_distance)) if by_distance[i] != by_distance[i - 1]]
    return PositionBias("buckets", tuple(s - (q_len - 1) for s in starts),
                        tuple(int(by_distance[s]) for s in starts))


def _relative_buckets(node: fx.Node, heads: int, q_len: int, kv_len: int) -> FoundBias | None:
    """T5's bias, if ``node`` is ``embedding(buckets, table).permute(2, 0, 1).unsqueeze(0)``."""
    if node.op == "call_method" and node.target == "unsqueeze" and node.args[1:] in ((0,), ()) \
            and node.kwargs.get("dim", 0) == 0:
        node = node.args[0]
    dims = node.args[1:] if node.op == "call_method" and node.target == "permute" else None
    if dims not in (((2, 0, 1),), ([2, 0, 1],), (2, 0, 1)):
        return None
    lookup = node.args[0]
    if lookup.op != "call_function" or lookup.target is not F.embedding:
        return None
    given = arguments(lookup)
    table, index = given["weight"], given["input"]
    nodes = constant_ancestors(index)
    if given["max_norm"] is not None or nodes is None or tuple(tensor_val(table).shape[1:]) != (heads,):
        return None
    buckets = evaluate_constant(nodes)
    if buckets.is_floating_point() or tuple(buckets.shape) != (q_len, kv_len):
        return None
    form = _bucket_runs(buckets.cpu())
    return None if form is None else FoundBias(form, table)


def position_bias(node: fx.Node, heads: int, q_len: int, kv_len: int,
                  folded_batch: int | None = None) -> FoundBias | None:
    """The position bias ``node`` is, if it is exactly one: added to scores of ``heads`` heads,
    ``q_len`` queries and ``kv_len`` keys; ``folded_batch``: the batch, where the bias holds the
    heads folded into it (Bloom's ``[batch * heads, 1, keys]``)."""
    while op_kind(node) == "cast" and node.target == "contiguous":
        node = node.args[0]
    shape = tuple(tensor_val(node).shape) if tensor_val(node) is not None else ()
    per_head = shape[0] in (1, folded_batch * heads) if folded_batch is not None else shape[-3:-2] == (heads,)
    if len(shape) < 3 or not per_head:
        return None  # not one bias per head: nothing to evaluate (a causal mask's [B, 1, S, S])
    nodes = constant_ancestors(node)
    if nodes is None:
        return _relative_buckets(node, heads, q_len, kv_len)
    value = evaluate_constant(nodes).cpu()
    if folded_batch is not None:
        if value.dim() != 3 or value.shape[0] not in (1, folded_batch * heads):
            return None
        value = value.expand(folded_batch * heads, *value.shape[1:]).reshape(folded_batch, heads, *value.shape[1:])
    return _alibi(value, heads, q_len, kv_len)
