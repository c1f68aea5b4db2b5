"""Rewrites of products and convolutions: linears spelled as ``addmm`` or a product with a
parameter, other ``addmm``/``baddbmm``, ``outer``, a causal convolution cropped."""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
import torch.nn.functional as F

from ...ops.halo import padded_conv1d
from ...symbolic import is_symbolic
from ..context import ParallelContext
from ..edits import emitted, erase_unused, with_val
from ..nodes import arguments, tensor_val
from ..rules.registry import op_kind
from .registry import calls, functions, rewrite


@rewrite(20, calls(torch.outer, torch.ger, "outer", "ger"))
def outer_as_product(gm: fx.GraphModule, node: fx.Node, ctx: ParallelContext) -> None:
    """``torch.outer(a, b)`` (``ger``): ``a.unsqueeze(-1) * b``, the same products, which the
    pointwise rule places: cut positions stay cut (Flux.2's rotary frequencies: positions times
    inverse frequencies)."""
    given = arguments(node)
    with gm.graph.inserting_before(node):
        product = emitted(gm.graph, operator.mul, emitted(gm.graph, torch.unsqueeze, given["input"], -1), given["vec2"])
    node.replace_all_uses_with(product)
    gm.graph.erase_node(node)


@rewrite(30, functions(operator.getitem))
def cropped_conv_as_padded(gm: fx.GraphModule, crop: fx.Node, ctx: ParallelContext) -> None:
    """``conv1d(x, padding=p)[:, :, :L]``, ``L`` the length of ``x``, with stride 1 and dilation 1:
    ``padded_conv1d(x, pad=(p, k - 1 - p))``. A 1-d convolution padded alike at both ends and
    cropped to its input's length is a causal one (transformers' ``causal_conv1d_fn``, Mamba's,
    LFM2's short convolution, the gated delta rule's): the same rows, each reading the rows it
    read. The convolution and its crop apart give more rows than the sequence has, which cp could
    not lay out, where this one gives back its input's length and reads ``p`` rows before each
    run, a halo (``rules.matmul.reach_of``)."""
    conv, index = crop.args
    if not (isinstance(conv, fx.Node) and conv.target in (torch.conv1d, F.conv1d) and len(conv.users) == 1):
        return
    if isinstance(index, tuple) and len(index) == 2 and index[0] is Ellipsis:  # x[..., :L]
        index = (slice(None), slice(None), index[1])
    given = arguments(conv)
    length, kernel = tensor_val(given["input"]).shape[-1], tensor_val(given["weight"]).shape[-1]
    stride, padding, dilation = ((v,) if isinstance(v, int) else tuple(v)
                                 for v in (given["stride"], given["padding"], given["dilation"]))
    if not (isinstance(index, tuple) and len(index) == 3 and index[:2] == (slice(None),) * 2
            and index[2] in (slice(None, length), slice(0, length)) and not is_symbolic(length)
            and stride == dilation == (1,) and isinstance(padding[0], int) and 0 < padding[0] < kernel):
        return
    with gm.graph.inserting_before(crop):
        padded = emitted(gm.graph, padded_conv1d, given["input"], given["weight"], given["bias"],
                         (padding[0], kernel - 1 - padding[0]), given["groups"])
    crop.replace_all_uses_with(padded)
    gm.graph.erase_node(crop)
    gm.graph.erase_node(conv)


def _flattened_source(view: fx.Node) -> fx.Node | None:
    """``x`` when ``view`` is ``x.view(-1, k)`` merging every leading dim of ``x``."""
    if op_kind(view) != "view":
        return None
    source = arguments(view)["input"]
    x, out = tensor_val(source), tensor_val(view)
    if x is None or out is None or out.dim() != 2 or x.dim() < 3 or out.shape[1] != x.shape[-1]:
        return None
    return source


def _conv1d_form(addmm: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """``(x, unflatten)`` when ``addmm`` is ``addmm(bias, x.view(-1, k), weight)`` unscaled, read
    only by ``unflatten``, its view back to ``[*lead, n]``."""
    given = arguments(addmm)
    if given["beta"] != 1 or given["alpha"] != 1:
        return None  # scaled: not a plain linear
    x = _flattened_source(given["mat1"])
    users = list(addmm.users)
    if x is None or len(users) != 1 or op_kind(users[0]) != "view":
        return None
    unflatten = users[0]
    if tuple(tensor_val(unflatten).shape) != tuple(tensor_val(x).shape[:-1]) + (tensor_val(addmm).shape[-1],):
        return None
    return x, unflatten


@rewrite(70, calls(torch.addmm, "addmm"), when=lambda node, _: _conv1d_form(node) is not None)
def conv1d_linear(gm: fx.GraphModule, addmm: fx.Node, ctx: ParallelContext) -> None:
    """A ``Conv1D`` linear (GPT-2: ``addmm(bias, x.view(-1, k), weight).view(*lead, n)`` with the
    weight stored ``[in, out]``) becomes ``linear(x, weight.t(), bias)``: the batch and sequence
    dims are never flattened together, so a sequence sharded over cp stays sharded, and the
    projection is found and sharded like any other (its weight transposed). Before any other
    ``addmm`` (``add_product_as_matmul``)."""
    (x, unflatten), given = _conv1d_form(addmm), arguments(addmm)
    bias, flat, weight = given["input"], given["mat1"], given["mat2"]
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


_FACTORS = {"addmm": ("mat1", "mat2"), "baddbmm": ("batch1", "batch2")}  # by the op's name


@rewrite(75, calls(torch.addmm, torch.baddbmm, "addmm", "baddbmm"))
def add_product_as_matmul(gm: fx.GraphModule, node: fx.Node, ctx: ParallelContext) -> None:
    """``addmm(input, a, b, beta=, alpha=)`` (or ``baddbmm``, function or method) becomes
    ``beta * input + alpha * (a @ b)``: a matmul and an add, which have rules."""
    given = arguments(node)
    a, b = (given[name] for name in _FACTORS[getattr(node.target, "__name__", node.target)])
    x, beta, alpha = given["input"], given["beta"], given["alpha"]
    graph = gm.graph
    with graph.inserting_before(node):
        product = emitted(graph, torch.matmul, a, b)
        if alpha != 1:
            product = emitted(graph, operator.mul, product, alpha)
        if beta != 0:
            scaled = x if beta == 1 else emitted(graph, operator.mul, x, beta)
            product = emitted(graph, operator.add, scaled, product)
    node.replace_all_uses_with(product)
    graph.erase_node(node)


def _transposed_parameter(node, ctx: ParallelContext) -> fx.Node | None:
    """``W`` when ``node`` is ``W.T`` of a 2-d parameter (as Dynamo records it: ``getattr(W, "T")``;
    from torch 2.14, ``torch.ops.aten.numpy_T(W)``)."""
    if not (isinstance(node, fx.Node) and node.op == "call_function"
            and (node.target is getattr and node.args[1] == "T" or node.target is torch.ops.aten.numpy_T)):
        return None
    weight = node.args[0]
    return weight if isinstance(weight, fx.Node) and weight.name in ctx.params and tensor_val(weight).dim() == 2 \
        else None


@rewrite(90, calls(operator.matmul, torch.matmul, "matmul"))
def parameter_product_as_linear(gm: fx.GraphModule, matmul: fx.Node, ctx: ParallelContext) -> None:
    """``x @ W.T`` of a 2-d parameter ``W`` (Falcon's ``FalconLinear``) becomes ``linear(x, W)``,
    and ``W @ x``, x's features at dim -2 (Mamba's ``dt_proj.weight @ x``), ``linear(x.mT, W).mT``:
    found and sharded as any projection. Anything else (``x @ W.t()`` too) stays the matmul it
    is."""
    given = arguments(matmul)
    left, right = given["input"], given["other"]
    transposed = _transposed_parameter(right, ctx)
    on_the_left = transposed is None and isinstance(left, fx.Node) and left.name in ctx.params \
        and tensor_val(left).dim() == 2
    x = right if on_the_left else left
    if not (transposed is not None or on_the_left) or tensor_val(x).dim() < 2:
        return
    with gm.graph.inserting_before(matmul):
        if on_the_left:
            rows = emitted(gm.graph, torch.transpose, x, -1, -2)
            linear = emitted(gm.graph, torch.transpose, emitted(gm.graph, F.linear, rows, left), -1, -2)
        else:
            linear = with_val(gm.graph.call_function(F.linear, (x, transposed)), tensor_val(matmul))
    matmul.replace_all_uses_with(linear)
    gm.graph.erase_node(matmul)
    if transposed is not None:
        erase_unused(gm, right)
