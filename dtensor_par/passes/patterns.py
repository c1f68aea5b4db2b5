"""What each node of a Dynamo torch-IR graph does, spelled one way.

Dynamo keeps the user's spelling (``x.view``, ``torch.reshape``, ``operator.add``,
``torch._C._nn.linear``); ``op_kind`` folds them into one name per rule.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
import torch.nn.functional as F

from ..ops.attention import hybrid_attention

_FUNCTION_KINDS = {
    "add": [operator.add, operator.iadd, torch.add],
    "sub": [operator.sub, operator.isub, torch.sub],
    "mul": [operator.mul, operator.imul, torch.mul],
    "div": [operator.truediv, operator.itruediv, torch.div],
    "neg": [operator.neg, torch.neg],
    "unary": [torch.exp, torch.tanh, torch.sigmoid, torch.rsqrt, torch.sqrt, torch.sin, torch.cos,
              torch.erf, torch.abs, torch.relu, torch.clamp, torch.pow, operator.pow, torch.square,
              F.gelu, F.silu, F.relu, F.tanh, F.sigmoid, F.dropout, torch._C._nn.gelu,
              torch._C._nn.silu, torch.zeros_like, torch.ones_like, torch.full_like, torch.empty_like],
    "where": [torch.where, torch.masked_fill],
    "logical": [operator.and_, operator.or_, operator.xor, operator.invert, operator.lt, operator.le, operator.gt,
                operator.ge, operator.eq, operator.ne, torch.logical_and, torch.logical_or, torch.logical_not],
    "matmul": [operator.matmul, torch.matmul, torch.bmm],
    "linear": [torch._C._nn.linear, F.linear],
    "sdpa": [torch._C._nn.scaled_dot_product_attention, F.scaled_dot_product_attention],
    "hybrid_attention": [hybrid_attention],
    "norm": [F.layer_norm, F.rms_norm, torch.layer_norm, torch.rms_norm],
    "softmax": [F.softmax, torch.softmax, F.log_softmax, torch.log_softmax],
    "reduce": [torch.sum, torch.mean, torch.amax],
    "view": [torch.reshape, torch.flatten, torch.unflatten, torch.squeeze, torch.unsqueeze],
    "transpose": [torch.transpose, torch.swapaxes, torch.t],
    "permute": [torch.permute],
    "complex": [torch.view_as_complex, torch.view_as_real],
    "pad": [F.pad, torch._C._nn.pad],
    "split": [torch.chunk, torch.split],
    "unbind": [torch.unbind],
    "cat": [torch.cat, torch.concat],
    "stack": [torch.stack],
    "getitem": [operator.getitem],
    "embedding": [F.embedding],
}
_FUNCTIONS = {fn: kind for kind, fns in _FUNCTION_KINDS.items() for fn in fns}

_METHOD_KINDS = {
    "add": ["add", "__add__", "__radd__"], "sub": ["sub", "__sub__", "__rsub__"],
    "mul": ["mul", "__mul__", "__rmul__"], "div": ["div", "__truediv__"], "neg": ["neg"],
    "unary": ["exp", "tanh", "sigmoid", "rsqrt", "sqrt", "sin", "cos", "pow", "abs", "relu",
              "clamp", "square", "erf"],
    "cast": ["contiguous", "clone", "float", "half", "bfloat16", "double", "to", "type_as", "detach"],
    "where": ["masked_fill"],
    "logical": ["logical_and", "logical_or", "logical_not", "lt", "le", "gt", "ge", "eq", "ne"],
    "matmul": ["matmul", "bmm"],
    "softmax": ["softmax", "log_softmax"],
    "reduce": ["sum", "mean", "amax"],
    "view": ["view", "reshape", "flatten", "unflatten", "squeeze", "unsqueeze", "view_as", "reshape_as"],
    "expand": ["expand", "expand_as"],
    "transpose": ["transpose", "swapaxes", "t"],
    "permute": ["permute"],
    "split": ["chunk", "split", "split_with_sizes"],
    "unbind": ["unbind"],
    "repeat_interleave": ["repeat_interleave"],
}
_METHODS = {m: kind for kind, ms in _METHOD_KINDS.items() for m in ms}

POINTWISE = {"add", "sub", "mul", "div", "neg", "unary", "cast", "where", "logical"}
LAYOUT = {"view", "expand", "transpose", "permute", "split", "unbind", "getitem", "cat", "stack"}
ACTIVATIONS = {F.gelu, F.silu, F.relu, F.tanh, F.sigmoid, torch._C._nn.gelu, torch._C._nn.silu,
               torch.relu, torch.tanh, torch.sigmoid, "relu", "tanh", "sigmoid"}


def op_kind(node: fx.Node) -> str | None:
    if node.op == "call_function":
        return _FUNCTIONS.get(node.target)
    if node.op == "call_method":
        return _METHODS.get(node.target)
    return None


def target_name(node: fx.Node) -> str:
    """``torch.cumsum``, ``Tensor.view``, ``operator.add``: how a user would spell the op."""
    if node.op == "call_method":
        return f"Tensor.{node.target}"
    if node.op == "call_function":
        module = getattr(node.target, "__module__", None) or "torch"
        module = "torch" if module.startswith("torch") and module != "torch.nn.functional" else module
        return f"{module}.{getattr(node.target, '__name__', node.target)}"
    return str(node.target)


def is_activation(node: fx.Node) -> bool:
    return node.op in ("call_function", "call_method") and node.target in ACTIVATIONS


def tensor_val(node) -> torch.Tensor | None:
    value = node.meta.get("val") if isinstance(node, fx.Node) else None
    return value if isinstance(value, torch.Tensor) else None


def arg(node: fx.Node, index: int, name: str, default=None):
    """An argument given by position or keyword."""
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


_SDPA_DEFAULTS = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}


def sdpa_arguments(core: fx.Node) -> dict:
    """Every argument of a scaled_dot_product_attention call by name, positional or keyword."""
    names = ["query", "key", "value", *_SDPA_DEFAULTS]
    return {**_SDPA_DEFAULTS, **dict(zip(names, core.args)), **core.kwargs}


def is_linear(node: fx.Node) -> bool:
    return op_kind(node) == "linear"
