"""Rewrites of a call's arguments and op into the overload the rules read."""

from __future__ import annotations

import torch
import torch.fx as fx

from ..context import ParallelContext
from ..nodes import arguments, keywords_as_positions, tensor_val
from .registry import calls, rewrite


def _tensor_by_keyword(node: fx.Node) -> bool:
    """Whether a call is given a tensor by keyword (``x.baddbmm(batch1=a, batch2=b)``)."""
    if node.op not in ("call_function", "call_method"):
        return False
    given = []
    fx.node.map_arg(node.kwargs, given.append)
    return any(tensor_val(n) is not None for n in given)


@rewrite(0, _tensor_by_keyword, exclusive=False)
def tensors_at_positions(gm: fx.GraphModule, node: fx.Node, ctx: ParallelContext) -> None:
    """A call given a tensor by keyword gets the arguments its op's schema takes by position at
    their positions (``nodes.keywords_as_positions``): the rules read a call's tensors in its
    schema's order, whatever order its keywords came in (``torch.matmul(other=b, input=a)``).
    First, and on every call: the rewrites after it read the call as the rules will."""
    node.args, node.kwargs = keywords_as_positions(node) or (node.args, node.kwargs)


@rewrite(170, calls(torch.max, torch.min, "max", "min"))
def elementwise_extreme(gm: fx.GraphModule, node: fx.Node, ctx: ParallelContext) -> None:
    """``torch.max(a, b)`` and ``a.min(b)`` of two tensors are ``torch.maximum`` and ``torch.minimum``:
    elementwise ops (XGLM clamps its scores with ``torch.max(scores, full((), finfo.min))``), not
    reductions."""
    given = arguments(node)
    if isinstance(given.get("other"), fx.Node):
        node.target = torch.maximum if node.target in (torch.max, "max") else torch.minimum
        node.op, node.args, node.kwargs = "call_function", (given["input"], given["other"]), {}
