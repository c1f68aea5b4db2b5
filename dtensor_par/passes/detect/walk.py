"""The walks over the graph that every detector makes: from nodes through ops of given kinds to
ops of others (``walk_through``), back to the parameter linears a value is made from
(``find_producers``) and forward to those it feeds (``find_consumers``), a node's inputs with what
is written into it in place (``written_from``)."""

from __future__ import annotations

import torch.fx as fx

from ..context import ParallelContext
from ..nodes import arguments, stacked_params, weight_param, writes_in_place
from ..rules.registry import op_kind


def has_param_weight(linear: fx.Node, ctx: ParallelContext) -> bool:
    weight, _ = weight_param(linear)
    return isinstance(weight, fx.Node) and all(w.name in ctx.params for w in stacked_params(weight))


def walk_through(stack: list[fx.Node], step, through: set[str], ends: set[str]) -> tuple[list[fx.Node], list[fx.Node]]:
    """Walk from the nodes in ``stack`` through ops of the given kinds (and what is written into
    them), ``step(node)`` giving the next ones; return (the ops of the kinds ``ends`` reached,
    the nodes walked through)."""
    reached, walked, seen = [], [], set()
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if op_kind(node) in ends:
            reached.append(node)
        elif op_kind(node) in through or _written_into(node):
            walked.append(node)
            stack.extend(step(node))
    return reached, walked


def walk_to_linears(stack: list[fx.Node], step, through: set[str], ctx: ParallelContext):
    """``walk_through`` to linears; return (the parameter linears reached, the nodes walked through)."""
    linears, walked = walk_through(stack, step, through, {"linear"})
    return [n for n in linears if has_param_weight(n, ctx)], walked


def _written_into(node: fx.Node) -> list[fx.Node]:
    """What is written into ``node`` in place (a static kv cache's buffer gets its keys by
    ``index_copy_``): the writes' other inputs."""
    return [i for u in node.users if writes_in_place(u) and arguments(u)["input"] is node for i in u.all_input_nodes
            if i is not node]


def written_from(node: fx.Node) -> list[fx.Node]:
    """What ``node`` is computed from: its inputs, and what is written into it in place."""
    return node.all_input_nodes + _written_into(node)


def find_producers(start: fx.Node, through: set[str], ctx: ParallelContext) -> tuple[list[fx.Node], list[fx.Node]]:
    """Walk back from ``start`` through ops of the given kinds; return (linears, nodes walked)."""
    return walk_to_linears([start], written_from, through, ctx)


def find_consumers(start: fx.Node, through: set[str], ctx: ParallelContext) -> list[fx.Node]:
    """Walk forward from ``start`` through ops of the given kinds to the linears it feeds."""
    return walk_to_linears(list(start.users), lambda n: n.users, through, ctx)[0]
