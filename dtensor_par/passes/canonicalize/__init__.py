"""canonicalize: rewrite equivalent spellings of one computation into the one the rules know.

Dynamo's graph keeps the model's own spelling: a linear as ``addmm`` or ``x @ W.T``, attention
as ``nn.MultiheadAttention``'s one call or with its kv heads repeated, a tensor written in place
slice by slice, experts read a row at a time, a recurrence as its many traced ops. The rules,
detect and the planner know one spelling of each; this pass rewrites the others into it,
computing the same values. Each module holds a family of rewrites:

- ``overloads``: a call's arguments and op read as the rules read them (tensors by keyword);
- ``linear``: products and convolutions (linears, ``addmm``, ``outer``, a causal convolution);
- ``views``: slices, splits and reshapes;
- ``in_place``: tensors written in place, made out of place;
- ``attention``: attention, its kv heads, its softmax, its sinks;
- ``experts``: experts read a row at a time, as grouped matmuls;
- ``recurrence``: a linear recurrence's traced ops, as one op.

The pass visits each node once, in graph order (nodes a rewrite adds are not visited), and
runs on it the rewrites that match it, in their order (``registry.rewrite_node``).

To add a rewrite: write ``fn(gm, node, ctx) -> None`` in its family's module, its docstring
saying what it rewrites into what and why the two are the same, and mark it
``@rewrite(order, match)`` (``registry``): ``match`` the op it applies to (``calls``,
``functions``, ``methods``, ``of_kind`` or a predicate), ``when`` what else must hold, ``order``
its place among the rewrites that match the same node (a number not taken). A new family's
module goes into ``REWRITES`` below.
"""

from __future__ import annotations

import torch.fx as fx

from ..context import ParallelContext, at_node
from . import attention, experts, in_place, linear, overloads, recurrence, views
from .registry import rewrite_node, rewrites_in

REWRITES = rewrites_in(attention, experts, in_place, linear, overloads, recurrence, views)
"""Every rewrite, in its order."""


def canonicalize_node(gm: fx.GraphModule, node: fx.Node, ctx: ParallelContext) -> None:
    """Rewrite ``node`` into the spelling the rules know, if it has another."""
    rewrite_node(REWRITES, gm, node, ctx)


def canonicalize_pass(gm: fx.GraphModule, ctx: ParallelContext) -> fx.GraphModule:
    for node in list(gm.graph.nodes):
        if node._erased:  # by a rewrite at an earlier node (its crop, its view)
            continue
        with at_node("canonicalize", node):
            canonicalize_node(gm, node, ctx)
    gm.recompile()
    return gm
