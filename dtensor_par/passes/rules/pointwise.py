"""Elementwise ops: a shard passes through; broadcast operands stay whole; partial sums stay
partial through the ops linear in them."""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
import torch.nn.functional as F

from ...placements import Partial, Placement, shard_dim
from .core import R, NodeSharding, moved, resolve_partial
from .registry import op_kind, register
from ..patterns import tensor_val

ACTIVATIONS = {F.gelu, F.silu, F.relu, F.tanh, F.sigmoid, torch._C._nn.gelu, torch._C._nn.silu,
               torch.relu, torch.tanh, torch.sigmoid, "relu", "tanh", "sigmoid"}


def is_activation(node: fx.Node) -> bool:
    return node.op in ("call_function", "call_method") and node.target in ACTIVATIONS


def _partial_passes(node: fx.Node, ins: list[fx.Node], cur: list[Placement]) -> bool:
    """Whether the op is linear in its Partial inputs, so partial sums stay partial sums."""
    kind = op_kind(node)
    partial = [i for i, p in zip(ins, cur) if isinstance(p, Partial)]
    others_replicated = all(p == R for p in cur if not isinstance(p, Partial))
    if kind in ("neg", "cast"):
        return partial == [node.args[0]] and others_replicated
    if kind in ("add", "sub"):
        operands = node.args[:2]
        return all(isinstance(a, fx.Node) and a in partial for a in operands)
    if kind == "mul":
        return len(partial) == 1 and others_replicated
    if kind == "div":
        return partial == [node.args[0]] and others_replicated
    return False


def pointwise_rule(node, ins, cur, env):
    if any(isinstance(p, Partial) for p in cur):
        if _partial_passes(node, ins, cur):
            return NodeSharding(Partial(), tuple(cur))
        cur = resolve_partial(ins, cur, env)
    out_val = tensor_val(node)
    target = None
    for i, p in zip(ins, cur):
        if shard_dim(p) is not None:
            target = moved(p, p.dim + out_val.dim() - tensor_val(i).dim())
            break
    if target is None:
        return NodeSharding(R, tuple(R for _ in ins))
    expected = []
    for i in ins:
        val = tensor_val(i)
        d = target.dim - (out_val.dim() - val.dim())
        broadcast = d < 0 or (val.shape[d] == 1 and out_val.shape[target.dim] != 1)
        expected.append(R if broadcast else moved(target, d))
    return NodeSharding(target, tuple(expected))


_SPELLINGS = {  # kind: (functions, Tensor methods)
    "add": ([operator.add, operator.iadd, torch.add], ["add", "__add__", "__radd__"]),
    "sub": ([operator.sub, operator.isub, torch.sub], ["sub", "__sub__", "__rsub__"]),
    "mul": ([operator.mul, operator.imul, torch.mul], ["mul", "__mul__", "__rmul__"]),
    "div": ([operator.truediv, operator.itruediv, torch.div], ["div", "__truediv__"]),
    "neg": ([operator.neg, torch.neg], ["neg"]),
    "unary": ([torch.exp, torch.tanh, torch.sigmoid, torch.rsqrt, torch.sqrt, torch.sin, torch.cos, torch.erf,
               torch.abs, torch.relu, torch.clamp, torch.pow, operator.pow, torch.square, F.gelu, F.silu, F.relu,
               F.tanh, F.sigmoid, F.dropout, torch._C._nn.gelu, torch._C._nn.silu, torch.zeros_like,
               torch.ones_like, torch.full_like, torch.empty_like],
              ["exp", "tanh", "sigmoid", "rsqrt", "sqrt", "sin", "cos", "pow", "abs", "relu", "clamp", "square",
               "erf"]),
    "cast": ([], ["contiguous", "clone", "float", "half", "bfloat16", "double", "to", "type_as", "detach"]),
    "where": ([torch.where, torch.masked_fill], ["masked_fill"]),
    "logical": ([operator.and_, operator.or_, operator.xor, operator.invert, operator.lt, operator.le, operator.gt,
                 operator.ge, operator.eq, operator.ne, torch.logical_and, torch.logical_or, torch.logical_not],
                ["logical_and", "logical_or", "logical_not", "lt", "le", "gt", "ge", "eq", "ne"]),
}
for _kind, (_functions, _methods) in _SPELLINGS.items():
    register(_kind, "pointwise", pointwise_rule, functions=_functions, methods=_methods)
