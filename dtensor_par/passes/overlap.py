"""overlap: let the collectives of an AOTAutograd graph run while it computes.

AOTAutograd traces a collective's wait right after its issue, where autograd ran it. A
gradient bucket's all-reduce (``ops.collectives.grad_all_reduce_bucket``) is read only by
the gradients backward returns, so waiting at once would stall backward on the network.
``sink_waits`` moves each wait, with the views and copies taken of its result (a bucket's
gradients), to just before the first other op that reads them: the all-reduce is in flight
while the rest of backward computes, and waited before backward ends. Nothing else moves;
a wait whose result is read at once stays where it is.

Used on the backward graph of the ``"aot_eager"`` inner backend (``overlapped_aot_eager``).
Inductor schedules waits itself (its ``reorder_for_compute_comm_overlap`` passes).
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

aten = torch.ops.aten
WAIT = torch.ops._c10d_functional.wait_tensor.default
FOLLOWERS = {operator.getitem, aten.clone.default, aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.alias.default,
         aten.split.Tensor, aten.split_with_sizes.default, aten.slice.Tensor, aten.as_strided.default,
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


def overlapped_aot_eager(gm: fx.GraphModule, example_inputs):
    """torch's ``aot_eager`` with ``sink_waits`` run on its backward graph."""
    from torch._dynamo.backends.debugging import aot_eager, boxed_nop

    def backward_compiler(bw: fx.GraphModule, inputs):
        return boxed_nop(sink_waits(bw), inputs)

    return aot_eager(gm, example_inputs, bw_compiler=backward_compiler)
