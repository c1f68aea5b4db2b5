"""canonicalize: rewrite equivalent spellings of one computation into the one the rules know.

- A ``Conv1D`` linear (GPT-2: ``addmm(bias, x.view(-1, k), weight).view(*lead, n)`` with the
  weight stored ``[in, out]``) becomes ``linear(x, weight.t(), bias)``: the batch and
  sequence dims are never flattened together, so a sequence sharded over cp stays sharded,
  and the projection is found and sharded like any other (its weight transposed).
- Any other ``addmm``/``baddbmm`` (function or method) becomes
  ``beta * input + alpha * (a @ b)``: a matmul and an add, which have rules.
- ``x.narrow(dim, start, length)`` becomes the slice ``x[..., start:start + length, ...]``, so
  a fused projection cut by ``narrow`` is cut part by part as by indexing.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
import torch.nn.functional as F

from .capture import with_val
from .context import ParallelContext
from .patterns import arg, tensor_val
from .rules.registry import op_kind


def _flattened_source(view: fx.Node) -> fx.Node | None:
    """``x`` when ``view`` is ``x.view(-1, k)`` merging every leading dim of ``x``."""
    if op_kind(view) != "view" or not isinstance(view.args[0], fx.Node):
        return None
    x, out = tensor_val(view.args[0]), tensor_val(view)
    if x is None or out is None or out.dim() != 2 or x.dim() < 3 or out.shape[1] != x.shape[-1]:
        return None
    return view.args[0]


def conv1d_linear(gm: fx.GraphModule, addmm: fx.Node) -> bool:
    """Rewrite one ``addmm`` of the Conv1D form; False when it is not one."""
    if addmm.kwargs or len(addmm.args) != 3:
        return False  # beta/alpha given: not a plain linear
    bias, flat, weight = addmm.args
    x = _flattened_source(flat)
    users = list(addmm.users)
    if x is None or len(users) != 1 or op_kind(users[0]) != "view":
        return False
    unflatten = users[0]
    if tuple(tensor_val(unflatten).shape) != tuple(tensor_val(x).shape[:-1]) + (tensor_val(addmm).shape[-1],):
        return False
    graph = gm.graph
    with graph.inserting_before(addmm):
        transposed = with_val(graph.call_method("t", (weight,)), tensor_val(weight).t())
        linear = graph.call_function(F.linear, (x, transposed, bias))
    with_val(linear, tensor_val(unflatten))
    unflatten.replace_all_uses_with(linear)
    for node in (unflatten, addmm):
        graph.erase_node(node)
    if not flat.users:
        graph.erase_node(flat)
    return True


_ADD_PRODUCT = {torch.addmm, torch.baddbmm, "addmm", "baddbmm"}


def add_product_as_matmul(gm: fx.GraphModule, node: fx.Node) -> None:
    """Rewrite ``addmm(input, a, b, beta=, alpha=)`` (or ``baddbmm``) into a matmul and an add."""
    (x, a, b), beta, alpha = node.args[:3], node.kwargs.get("beta", 1), node.kwargs.get("alpha", 1)
    graph = gm.graph

    def call(fn, args, value):
        return with_val(graph.call_function(fn, args), value)

    with graph.inserting_before(node):
        product = call(torch.matmul, (a, b), tensor_val(a) @ tensor_val(b))
        if alpha != 1:
            product = call(operator.mul, (product, alpha), tensor_val(product) * alpha)
        if beta != 0:
            scaled = x if beta == 1 else call(operator.mul, (x, beta), tensor_val(x) * beta)
            product = call(operator.add, (scaled, product), tensor_val(node))
    node.replace_all_uses_with(product)
    graph.erase_node(node)


def narrow_as_slice(gm: fx.GraphModule, node: fx.Node) -> None:
    x, dim, start, length = (arg(node, i, name) for i, name in enumerate(("input", "dim", "start", "length")))
    if not all(isinstance(v, int) for v in (dim, start, length)):
        return  # bounds computed in the graph: left to the fallback
    dim = dim % tensor_val(x).dim()
    index = (slice(None),) * dim + (slice(start, start + length),)
    with gm.graph.inserting_before(node):
        sliced = with_val(gm.graph.call_function(operator.getitem, (x, index)), tensor_val(node))
    node.replace_all_uses_with(sliced)
    gm.graph.erase_node(node)


def canonicalize_pass(gm: fx.GraphModule, ctx: ParallelContext) -> fx.GraphModule:
    for node in list(gm.graph.nodes):
        if node.op in ("call_function", "call_method") and node.target in (torch.narrow, "narrow"):
            narrow_as_slice(gm, node)
        if node.op in ("call_function", "call_method") and node.target in _ADD_PRODUCT:
            if not (node.target is torch.addmm and conv1d_linear(gm, node)):
                add_product_as_matmul(gm, node)
    gm.recompile()
    return gm
