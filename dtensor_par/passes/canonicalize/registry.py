"""How canonicalize's rewrites are marked, matched, ordered and run on a node.

A rewrite is a function ``(gm, node, ctx) -> None`` marked with ``rewrite(order, match)``: it
changes the graph around ``node``, or leaves it as it is where the node is not the form it
rewrites. ``rewrites_in`` collects the marked functions of the family modules, in their order;
``rewrite_node`` runs them on one node.
"""

from __future__ import annotations

import inspect
from types import ModuleType
from typing import Callable, NamedTuple

import torch.fx as fx

from ..context import ParallelContext
from ..rules.registry import op_kind

Match = Callable[[fx.Node], bool]
When = Callable[[fx.Node, ParallelContext], bool]
Apply = Callable[[fx.GraphModule, fx.Node, ParallelContext], None]


class Rewrite(NamedTuple):
    """A rewrite, at its place in the order, of the nodes it matches."""

    order: int  # lower first; numbers left between for the next ones
    match: Match  # the nodes it applies to (the op called)
    when: When | None  # and only where this holds too (the mesh, the node's neighbours)
    exclusive: bool  # a node it matches is left to no exclusive rewrite after it
    apply: Apply

    def matches(self, node: fx.Node, ctx: ParallelContext) -> bool:
        return self.match(node) and (self.when is None or self.when(node, ctx))


def rewrite(order: int, match: Match, *, when: When | None = None, exclusive: bool = True) -> Callable[[Apply], Apply]:
    """Mark a function ``(gm, node, ctx) -> None`` as the rewrite of the nodes ``match`` (and
    ``when``, given the context) hold for, run at ``order`` among the others. An exclusive
    rewrite (the default) is the only exclusive one to run on a node it matches, whether it
    rewrites it or not: a form that two rewrites match goes to the first. One that is not runs
    on every node it matches (as long as the node is in the graph), rewritten or not before."""
    def mark(fn: Apply) -> Apply:
        fn.rewrite = Rewrite(order, match, when, exclusive, fn)
        return fn
    return mark


def calls(*targets) -> Match:
    """A call of one of ``targets``, as a function or a method (by name)."""
    return lambda node: node.op in ("call_function", "call_method") and node.target in targets


def functions(*targets) -> Match:
    """A ``call_function`` of one of ``targets``."""
    return lambda node: node.op == "call_function" and node.target in targets


def methods(*names: str) -> Match:
    """A ``call_method`` of one of ``names``."""
    return lambda node: node.op == "call_method" and node.target in names


def of_kind(name: str) -> Match:
    """An op of the kind ``name`` of the rules' registry, however it is spelled."""
    return lambda node: op_kind(node) == name


def rewrites_in(*modules: ModuleType) -> tuple[Rewrite, ...]:
    """The rewrites marked in ``modules``, in their order. Two at one place would leave their
    order to the modules': refused."""
    found = list(dict.fromkeys(fn.rewrite for module in modules for fn in vars(module).values()
                               if inspect.isfunction(fn) and isinstance(getattr(fn, "rewrite", None), Rewrite)))
    orders = [r.order for r in found]
    if len(set(orders)) != len(orders):
        raise ValueError(f"canonicalize: two rewrites at one place of the order: "
                         f"{sorted((r.order, r.apply.__name__) for r in found if orders.count(r.order) > 1)}")
    return tuple(sorted(found, key=lambda r: r.order))


def rewrite_node(rewrites: tuple[Rewrite, ...], gm: fx.GraphModule, node: fx.Node, ctx: ParallelContext) -> None:
    """Run on ``node`` each of ``rewrites`` that matches it, in order, until one erases it: of
    the exclusive ones, only the first that matches."""
    taken = False
    for r in rewrites:
        if node._erased:
            return
        if not (taken and r.exclusive) and r.matches(node, ctx):
            r.apply(gm, node, ctx)
            taken = taken or r.exclusive
