"""Elementwise ops: a shard passes through; broadcast operands stay whole; partial sums stay
partial through the ops linear in them."""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
import torch.nn.functional as F

from ...errors import NotSupported
from ...mesh import MeshInfo
from ...ops.cache_attention import cache_buffer
from ...ops.dropout import sharded_dropout
from ...placements import Partial, Placement, Shard, shard_dim
from ...symbolic import hint
from ..meta import NodeSharding, placements, planned_local_shape
from ..nodes import arguments, tensor_inputs, tensor_val
from .core import R, moved, replicate_all, resolve_partial
from .registry import op_kind, register

def is_activation(node: fx.Node) -> bool:
    """Whether ``node`` is a nonlinear elementwise op (GeLU, SiLU, ``tanh``, ``expm1``, a
    ``where`` picking between branches: Apertus' xIELU), as an MLP has between its projections."""
    return op_kind(node) in ("unary", "where") or elementwise_function(node)


_ELEMENTWISE = {"add", "sub", "mul", "div", "neg", "unary", "where", "logical", "cast"}
"""The pointwise kinds that take no sizes and draw no random numbers: computed alike on any shard."""


def elementwise_function(node: fx.Node) -> bool:
    """Whether a node applies a custom autograd Function (Dynamo's ``autograd_function_apply``)
    to one tensor whose forward and backward compute elementwise (Bloom's GeLU): pointwise
    ops only, so each rank applies it to its shard."""
    if node.op != "call_function" or node.target is not torch.ops.higher_order.autograd_function_apply:
        return False
    bodies = [getattr(node.graph.owning_module, body.target) for body in node.args[:2]]
    return len(tensor_inputs(node)) == 1 and all(
        n.op in ("placeholder", "output", "get_attr") or n.target is torch._C._set_grad_enabled
        or op_kind(n) in _ELEMENTWISE for body in bodies for n in body.graph.nodes)


def _partial_passes(node: fx.Node, ins: list[fx.Node], cur: list[Placement]) -> bool:
    """Whether the op is linear in its Partial inputs, so partial sums stay partial sums."""
    kind = op_kind(node)
    partial = [i for i, p in zip(ins, cur) if isinstance(p, Partial)]
    others_replicated = all(p == R for p in cur if not isinstance(p, Partial))
    if kind in ("neg", "div"):
        return partial == [arguments(node)["input"]] and others_replicated
    if kind in ("add", "sub"):
        given = arguments(node)
        return all(isinstance(a, fx.Node) and a in partial for a in (given["input"], given["other"]))
    if kind == "mul":
        return len(partial) == 1 and others_replicated
    return False


def pointwise_rule(node, ins, cur, env):
    if any(isinstance(p, Partial) for p in cur):
        if _partial_passes(node, ins, cur):
            return NodeSharding(Partial(), tuple(cur))
        cur = resolve_partial(ins, cur, env)
    out_val = tensor_val(node)
    sharded = [(i, p) for i, p in zip(ins, cur) if shard_dim(p) is not None]
    if not sharded:
        return NodeSharding(R, tuple(R for _ in ins))
    # Inputs sharded unlike each other follow the largest (the first of equals): the smaller
    # ones are the cheaper to send (rotary frequencies, not the heads they turn).
    i, p = max(sharded, key=lambda s: hint(tensor_val(s[0]).numel()))
    target = moved(p, p.dim + out_val.dim() - tensor_val(i).dim())
    expected = []
    for i in ins:
        val = tensor_val(i)
        d = target.dim - (out_val.dim() - val.dim())
        broadcast = d < 0 or (val.shape[d] == 1 and out_val.shape[target.dim] != 1)
        expected.append(R if broadcast else moved(target, d))
    return NodeSharding(target, tuple(expected))


def cast_rule(node, ins, cur, env):
    """``x.to(...)``, ``x.type_as(other)``, ``x.float()``: the values are ``x``'s, placed as
    ``x`` is (partial sums too, while they stay floating point); a tensor argument lends only
    its dtype and stays as it is."""
    p = cur[0]
    if isinstance(p, Partial) and not tensor_val(node).is_floating_point():
        p = resolve_partial(ins[:1], cur[:1], env)[0]
    return NodeSharding(p, (p,) + tuple(cur[1:]))


def elementwise_function_rule(node, ins, cur, env):
    """Each output of an elementwise Function is placed as its input; any other Function gathers."""
    if not elementwise_function(node):
        return replicate_all(node, ins, cur, "a custom autograd Function that is not elementwise")
    p = resolve_partial(ins, cur, env)[0]
    return NodeSharding(tuple(p for _ in node.meta["val"]), (p,))


def new_tensor_rule(node, ins, cur, env):
    """``x.new_zeros(size)`` and kin: a fresh tensor of the given (global) size, whole on every
    rank; ``x`` lends only its dtype and device, so it stays as it is."""
    return NodeSharding(R, tuple(cur))


def localize_arange(gm: fx.GraphModule, node: fx.Node, mesh: MeshInfo) -> None:
    """``arange(n)`` planned cut (an expert dispatch run on each rank's tokens numbers its
    ``tokens x top_k`` rows: ``plan.token_local_sharding``) counts this rank's rows."""
    if all(p == R for p in placements(node).values()):
        return
    if len(node.args) != 1:
        raise NotSupported(f"localize: {node.name} = arange{tuple(node.args)} is planned cut: only arange(end) is "
                           f"counted on each rank")
    node.args = (planned_local_shape(node, mesh)[0],)


def cache_buffer_rule(node, ins, cur, env):
    """A static kv cache's buffer is cut as the rows written into it are, on a dim it has whole
    (heads; the sequence it is written along stays whole)."""
    p, size = cur[0], arguments(node)["size"]
    d = shard_dim(p)
    keep = isinstance(p, Shard) and d is not None and size[d] == tensor_val(ins[0]).shape[d]
    return NodeSharding(p if keep else R, (p,))


def localize_cache_buffer(gm: fx.GraphModule, node: fx.Node, mesh: MeshInfo) -> None:
    given = arguments(node)
    node.args, node.kwargs = (given["source"], list(planned_local_shape(node, mesh)), given["dtype"]), {}


def localize_dropout(gm: fx.GraphModule, node: fx.Node, mesh: MeshInfo) -> None:
    """A dropout of a sharded tensor draws its shard's own mask (``ops.dropout``), not the
    mask every rank would draw alike; a replicated one stays as it is (the single-device mask)."""
    sharded = tuple(mesh.dims[d] for d, p in placements(node).items() if shard_dim(p) is not None)
    if sharded:
        node.target = sharded_dropout
        node.kwargs = {**node.kwargs, "dims": sharded}


_SPELLINGS = {  # kind: (functions, Tensor methods)
    "add": ([operator.add, operator.iadd, torch.add], ["add", "__add__", "__radd__"]),
    "sub": ([operator.sub, operator.isub, torch.sub], ["sub", "__sub__", "__rsub__"]),
    "mul": ([operator.mul, operator.imul, torch.mul], ["mul", "__mul__", "__rmul__"]),
    "div": ([operator.truediv, operator.itruediv, torch.div], ["div", "__truediv__"]),
    "neg": ([operator.neg, torch.neg], ["neg"]),
    "unary": ([torch.exp, torch.expm1, torch.log, torch.log1p, torch.tanh, torch.sigmoid, torch.rsqrt, torch.sqrt,
               torch.reciprocal, torch.sin, torch.cos, torch.erf, torch.abs, torch.sign, torch.relu, torch.clamp,
               torch.clip, torch.clamp_min, torch.clamp_max, torch.pow, operator.pow, torch.square, F.gelu, F.silu,
               F.relu, F.tanh, F.sigmoid, F.softplus, F.elu, F.leaky_relu, F.mish, torch._C._nn.gelu, torch._C._nn.silu,
               torch.zeros_like, torch.ones_like, torch.full_like, torch.empty_like],
              ["exp", "expm1", "log", "log1p", "tanh", "sigmoid", "rsqrt", "sqrt", "reciprocal", "sin", "cos", "pow",
               "abs", "sign", "relu", "clamp", "clip", "clamp_min", "clamp_max", "square", "erf"]),
    "where": ([torch.where, torch.masked_fill], ["masked_fill"]),
    "maximum": ([torch.maximum, torch.minimum, torch.fmax, torch.fmin], ["maximum", "minimum", "fmax", "fmin"]),
    "logical": ([operator.and_, operator.or_, operator.xor, operator.invert, operator.lt, operator.le, operator.gt,
                 operator.ge, operator.eq, operator.ne, torch.logical_and, torch.logical_or, torch.logical_not],
                ["logical_and", "logical_or", "logical_not", "lt", "le", "gt", "ge", "eq", "ne"]),
}
for _kind, (_functions, _methods) in _SPELLINGS.items():
    register(_kind, "pointwise", pointwise_rule, functions=_functions, methods=_methods)
register("elementwise_function", "pointwise", elementwise_function_rule,
         functions=[torch.ops.higher_order.autograd_function_apply])
register("new_tensor", "pointwise", new_tensor_rule, methods=["new_zeros", "new_ones", "new_full", "new_empty"])
register("arange", "pointwise", new_tensor_rule, functions=[torch.arange], localize=localize_arange)
register("cast", "pointwise", cast_rule, functions=[torch.clone],
         methods=["contiguous", "clone", "float", "half", "bfloat16", "double", "to", "type", "type_as", "bool", "long",
                  "int", "detach"])

register("cache_buffer", "pointwise", cache_buffer_rule, functions=[cache_buffer], localize=localize_cache_buffer)
register("dropout", "pointwise", pointwise_rule, functions=[F.dropout], localize=localize_dropout)
