"""Reading a Dynamo torch-IR node: its value, its arguments, its tensor inputs, a linear's
weight, the op as a user spells it. What an op *is* (its kind and rule) is the op registry's:
``passes.rules.registry``; what the passes learned about a node is in ``passes.meta``."""

from __future__ import annotations

import torch
import torch.fx as fx


def target_name(node: fx.Node) -> str:
    """``torch.cumsum``, ``Tensor.view``, ``operator.add``: how a user would spell the op."""
    if node.op == "call_method":
        return f"Tensor.{node.target}"
    if node.op == "call_function":
        module = getattr(node.target, "__module__", None) or "torch"
        module = "torch" if module.startswith("torch") and module != "torch.nn.functional" else module
        return f"{module}.{getattr(node.target, '__name__', node.target)}"
    return str(node.target)


def writes_in_place(node: fx.Node) -> bool:
    """``x.add_(y)``, ``x.copy_(y)``: Tensor methods named with a trailing underscore. FX's
    dead-code elimination thinks every method pure; these are not."""
    return node.op == "call_method" and node.target.endswith("_") and not node.target.startswith("_")


def tensor_val(node) -> torch.Tensor | None:
    value = node.meta.get("val") if isinstance(node, fx.Node) else None
    return value if isinstance(value, torch.Tensor) else None


def arg(node: fx.Node, index: int, name: str, default=None):
    """An argument given by position or keyword."""
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def tensor_inputs(node: fx.Node) -> list[fx.Node]:
    """The nodes among a node's arguments whose values are tensors, in argument order."""
    found = []
    fx.node.map_arg((node.args, node.kwargs), lambda n: found.append(n) if tensor_val(n) is not None else None)
    return found


def weight_param(linear: fx.Node) -> tuple[fx.Node, bool]:
    """The tensor a linear's weight is read from, and whether it is stored transposed
    (``[in, out]``, read through ``t()``: GPT-2's Conv1D after canonicalize)."""
    weight = linear.args[1]
    if isinstance(weight, fx.Node) and weight.op == "call_method" and weight.target == "t":
        return weight.args[0], True
    return weight, False
