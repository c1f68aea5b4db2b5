"""overlap: let the collectives of an AOTAutograd graph run while it computes.

AOTAutograd traces a collective where the program called it and its wait right after, so the
network and the compute take turns. Two passes, the policy of inductor's ``raise_comms`` and
``sink_waits`` on the FX graph, and one that spares a copy as inductor's in-place reuse does:

- ``raise_issues`` issues each collective as soon as its inputs exist: it moves the issue, with
  only the nodes it needs, ahead of everything else that does not feed it, collectives kept in
  their order (every rank issues the same sequence). Ulysses exchanges q alone
  (``ops.attention``), so q's all-to-all then runs while k and v are projected; in backward,
  a gradient bucket's all-reduce is issued as soon as its last gradient exists.
- ``sink_waits`` moves each wait, with the views and copies taken of its result, to just
  before the first other op that reads them.
- ``reinplace_all_reduces`` reduces in place a tensor that nothing else reads (a matmul's
  output, a gradient bucket): the functional ``all_reduce`` copies its input first, a
  pass over the whole tensor.

Random ops keep their order among themselves (which numbers one draws depends on how many
were drawn before), and so do ops with side effects. Used on both graphs of the
``"aot_eager"`` inner backend (``overlapped_aot_eager``); with inductor, ``hybrid_parallel``
turns on inductor's own passes instead (``runtime.INDUCTOR_OVERLAP``).
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch.fx._lazy_graph_module import _LazyGraphModule

from ..ops.collectives import unflatten_copy
from .meta import is_fsdp_gather
from .nodes import arguments

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
WAIT = c10d.wait_tensor.default
FOLLOWERS = {operator.getitem, aten.clone.default, aten.view.default, aten._unsafe_view.default,
             aten.reshape.default, aten.alias.default, aten.split.Tensor, aten.split_with_sizes.default,
             unflatten_copy._opoverload, aten.slice.Tensor, aten.as_strided.default,
             aten.t.default, aten.permute.default, aten.squeeze.dim, aten.unsqueeze.default}
"""Ops that only view or copy their input: moved along with the wait whose result they read."""


def _followers(wait: fx.Node) -> list[fx.Node]:
    """``wait`` and every node that only views or copies its result, in graph order."""
    group, i = [wait], 0
    while i < len(group):
        group += [u for u in group[i].users if u.target in FOLLOWERS and u not in group]
        i += 1
    order = {n: k for k, n in enumerate(wait.graph.nodes)}
    return sorted(group, key=order.__getitem__)


def _is_issue(node: fx.Node) -> bool:
    return (isinstance(node.target, torch._ops.OpOverload) and node.target.namespace == "_c10d_functional"
            and node.target is not WAIT)


def _keeps_its_place(node: fx.Node) -> bool:
    """A node whose order among its kind matters: it draws random numbers (which numbers
    depends on how many were drawn before) or has side effects."""
    seeded = isinstance(node.target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in node.target.tags
    return node.op == "call_function" and (seeded or node.is_impure())


def _prefetch_points(nodes: list[fx.Node], position: dict[fx.Node, int]) -> dict[fx.Node, fx.Node]:
    """FSDP gather issue -> the node it must follow: the first op reading the previous FSDP
    gather's result. Each block's parameters are gathered while the block before computes, not
    all at once (FSDP2's prefetch of one block); in backward, the recomputed gathers likewise.
    Only a reader that comes before the gather in the graph is a point: every dependency then
    points back in graph order, so the schedule has no cycle."""
    gathers = [n for n in nodes if n.target is c10d.all_gather_into_tensor.default and is_fsdp_gather(n)]
    points = {}
    for previous, gather in zip(gathers, gathers[1:]):
        readers = []
        for wait in (u for u in previous.users if u.target is WAIT):
            group = _followers(wait)
            readers += [u for n in group for u in n.users if u not in group]
        first = min(readers, key=position.__getitem__, default=None)
        if first is not None and position[first] < position[gather]:
            points[gather] = first
    return points


def raise_issues(gm: fx.GraphModule) -> fx.GraphModule:
    """Move each collective's issue, and the nodes it needs, ahead of every node it does not
    need, but an FSDP gather no further than the block before it (``_prefetch_points``).
    Collectives keep their order (FSDP gathers aside), and so do random and side-effecting ops
    among themselves (each is placed after the one before it)."""
    graph = gm.graph
    nodes = list(graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    ordered = [n for n in nodes if _keeps_its_place(n)]
    after = dict(zip(ordered[1:], ordered))
    prefetch = _prefetch_points(nodes, position)
    order: list[fx.Node] = []
    placed: set[fx.Node] = set()

    def place(node: fx.Node) -> None:
        """``node`` after its not yet placed inputs (depth first, inputs in graph order)."""
        stack = [(node, False)]
        while stack:
            n, inputs_placed = stack.pop()
            if n in placed:
                continue
            if inputs_placed:
                placed.add(n)
                order.append(n)
                continue
            stack.append((n, True))
            needs = n.all_input_nodes + [m for m in (after.get(n), prefetch.get(n)) if m is not None]
            stack += [(i, False) for i in sorted(needs, key=position.__getitem__, reverse=True) if i not in placed]

    # FSDP gathers first: each is issued as soon as its block's predecessor starts, ahead of that
    # block's own collectives (over other groups; every rank runs this same order)
    for n in list(prefetch) + [n for n in nodes if _is_issue(n)] + nodes:
        place(n)
    output = next(n for n in reversed(nodes) if n.op == "output")
    for n in order:
        if n.op != "placeholder" and n is not output:
            output.prepend(n)
    graph.lint()
    gm.recompile()
    return gm


def sink_waits(gm: fx.GraphModule) -> fx.GraphModule:
    """Move each collective's wait (and the views and copies of its result) to just before
    its first other reader."""
    graph = gm.graph
    for wait in [n for n in graph.nodes if n.target is WAIT]:
        group = _followers(wait)
        readers = {u for n in group for u in n.users if u not in group}
        if not readers:
            continue
        first_reader = next(n for n in graph.nodes if n in readers)
        for n in group:
            first_reader.prepend(n)
    graph.lint()
    gm.recompile()
    return gm


UNDECLARED_VIEWS = {aten._unsafe_view.default, WAIT}
"""Ops whose output is their first input's storage though their schemas do not say so."""


def _read_only_here(node: fx.Node) -> bool:
    """``node``'s storage is new to this graph and read by its single user alone: ``node``
    and the views it is taken through each have one user, down to the op that made it."""
    while True:
        if node.op != "call_function" or len(node.users) != 1 or not isinstance(node.target, torch._ops.OpOverload):
            return False
        schema = node.target._schema
        if schema.is_mutable or len(schema.returns) != 1:
            return False
        if node.target in UNDECLARED_VIEWS:
            node = next(iter(arguments(node).values()))  # its first argument's storage
            continue
        alias = schema.returns[0].alias_info
        if alias is None:
            return True
        viewed = [a for a, arg in zip(node.args, schema.arguments)
                  if arg.alias_info is not None and arg.alias_info.before_set == alias.before_set]
        if len(viewed) != 1 or not isinstance(viewed[0], fx.Node):
            return False
        node = viewed[0]


def reinplace_all_reduces(gm: fx.GraphModule) -> fx.GraphModule:
    """Turn ``all_reduce(x)`` into ``all_reduce_(x)`` where nothing else reads ``x``'s storage
    and it is known contiguous (the in-place collective reduces the memory as it lies)."""
    for node in gm.graph.nodes:
        if node.target is c10d.all_reduce.default:
            x = arguments(node)["input"]
            val = x.meta.get("val")
            if isinstance(val, torch.Tensor) and val.is_contiguous() and _read_only_here(x):
                node.target = c10d.all_reduce_.default
    gm.recompile()
    return gm


def overlap_pass(gm: fx.GraphModule) -> fx.GraphModule:
    return reinplace_all_reduces(sink_waits(raise_issues(gm)))


def overlapped_aot_eager(gm: fx.GraphModule, example_inputs):
    """torch's ``aot_eager`` with ``overlap_pass`` run on its forward and backward graphs."""
    from torch._dynamo.backends.debugging import aot_eager, boxed_nop

    def compiler(graph: fx.GraphModule, inputs):
        # lazy: the passes' recompiles only mark the code stale; boxed_nop generates it once
        return boxed_nop(overlap_pass(_LazyGraphModule.from_graphmodule(graph)), inputs)

    return aot_eager(gm, example_inputs, fw_compiler=compiler, bw_compiler=compiler)
