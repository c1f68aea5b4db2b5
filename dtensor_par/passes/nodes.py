"""Reading a Dynamo torch-IR node: its value, its arguments, its tensor inputs, a linear's
weight, the op as a user spells it. What an op *is* (its kind and rule) is the op registry's:
``passes.rules.registry``; what the passes learned about a node is in ``passes.meta``."""

from __future__ import annotations

import functools
import inspect
import operator
import typing
from typing import Any

import torch
import torch.fx as fx
from torch.fx.operator_schemas import get_signature_for_torch_op, type_matches

from ..ops.experts import experts_from_rows


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


_VMAP_LEVELS = {torch._functorch.predispatch._vmap_increment_nesting,
                torch._functorch.predispatch._vmap_decrement_nesting}


def is_vmap_level(node: fx.Node) -> bool:
    """Whether ``node`` opens or closes a level of vmap: Dynamo traces ``torch.vmap`` (transformers'
    associative scan) as a level opened (an int, which the batched ops read as a constant), the
    batched ops, the level closed."""
    return node.op == "call_function" and node.target in _VMAP_LEVELS


def acts_beyond_value(node: fx.Node) -> bool:
    """Whether ``node`` does more than give its value: it writes in place (``writes_in_place``)
    or opens or closes a level of vmap. FX's dead-code elimination thinks both pure; without
    the level, the batched ops fail."""
    return writes_in_place(node) or is_vmap_level(node)


def called(node: fx.Node, args: tuple, kwargs: dict):
    """What ``node``'s call (a function, or a Tensor method) gives on ``args`` and ``kwargs``."""
    return node.target(*args, **kwargs) if node.op == "call_function" else getattr(args[0], node.target)(*args[1:],
                                                                                                         **kwargs)


def value_from_inputs(node: fx.Node):
    """What ``node``'s call gives on its inputs' values (``meta["val"]``): its value again after a
    rewrite of its inputs."""
    return called(node, *fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta["val"]))


def tensor_val(node) -> torch.Tensor | None:
    value = node.meta.get("val") if isinstance(node, fx.Node) else None
    return value if isinstance(value, torch.Tensor) else None


def arguments(node: fx.Node) -> dict[str, Any]:
    """A call's arguments by the names its schema gives them, defaults filled in, so that a
    keyword call and a positional one read alike (``x.baddbmm(batch1=a, batch2=b)`` and
    ``torch.baddbmm(x, a, b)``: ``input``, ``batch1``, ``batch2``, ``beta``, ``alpha``).

    Tensor methods read as their aten op (``self`` is ``input``), sizes given one by one
    (``x.view(b, s, -1)``) as the one list they are; of an overloaded op, the first overload
    the values' types fit. ``operator``'s functions take positions only: ``input`` and
    ``other`` (``index`` for ``getitem``), as ``torch.add`` names them.
    """
    match = _schema_match(node)
    if match is None:
        raise TypeError(f"{target_name(node)}: no schema of it takes ({len(node.args)} positional arguments, "
                        f"keywords {sorted(node.kwargs)})")
    return match[2]


def keywords_as_positions(node: fx.Node) -> tuple[tuple, dict] | None:
    """A call's arguments with those given by keyword that its schema takes by position too
    moved to their positions, as far as none is left out: ``torch.matmul(other=b, input=a)`` is
    ``(a, b), {}``, ``x.baddbmm(batch1=a, batch2=b, alpha=0.5)`` ``(x, a, b), {"alpha": 0.5}``.
    None for a call no schema takes."""
    match = _schema_match(node)
    if match is None:
        return None
    signature, args, _ = match
    args, kwargs = list(args), dict(node.kwargs)
    for param in list(signature.parameters.values())[len(args):]:
        if param.kind is not inspect.Parameter.POSITIONAL_OR_KEYWORD or param.name not in kwargs:
            break
        args.append(kwargs.pop(param.name))
    return tuple(args), kwargs


def _schema_match(node: fx.Node) -> tuple[inspect.Signature, tuple, dict[str, Any]] | None:
    """(the signature, the positional arguments as it takes them, every argument by name) of
    the first overload that takes the call, or None."""
    spellings = [(signature, args) for signature in _signatures(node.op, node.target)
                 for args in _spellings(node, signature)]
    for typed in (True, False):  # an overload the types fit, else (a Python function's annotations) any
        for signature, args in spellings:
            bound = _bound(signature, args, node.kwargs, typed)
            if bound is not None:
                return signature, args, bound
    return None


@functools.cache
def _signatures(op: str, target) -> tuple[inspect.Signature, ...]:
    """The signatures of a call's overloads, in the order its schema lists them, then a
    Python function's own (``torch.einsum(*args)``; ``torch.split(tensor, ...)``'s tensor
    named ``input``, as its schema names it); for ``operator``'s functions and methods
    without a schema (``x.__radd__(y)``, ``x.float()``), positions named as ``torch.add``
    names them."""
    if op == "call_method":
        method = getattr(torch.Tensor, target, None)
        if inspect.isfunction(method):  # defined in Python (Tensor.split)
            return (_first_named_input(inspect.signature(method)),)
        packet = getattr(torch.ops.aten, target, None)
        schemas = tuple(get_signature_for_torch_op(packet) or ()) if packet is not None else ()
        return schemas or (_positional(("input", "other") if target.startswith("__") else ("input",)),)
    if getattr(target, "__module__", None) == "_operator":
        arity = len(inspect.signature(target).parameters)
        return (_positional(_OPERATOR_PARAMETERS.get(target) or ("input", "other")[:arity]),)
    schemas = tuple(get_signature_for_torch_op(target) or ())
    if not inspect.isfunction(target):
        return schemas
    signature = inspect.signature(target)  # torch.split(tensor, ...): its tensor read as input, as the schema's
    return (*schemas, _first_named_input(signature) if "tensor" in signature.parameters else signature)


_OPERATOR_PARAMETERS = {operator.getitem: ("input", "index"), operator.setitem: ("input", "index", "value")}


def _positional(names: tuple[str, ...]) -> inspect.Signature:
    """Positional-only parameters of these names; all but the first may be left out (``__neg__``)."""
    return inspect.Signature([inspect.Parameter(n, inspect.Parameter.POSITIONAL_ONLY,
                                                default=inspect.Parameter.empty if i == 0 else None)
                              for i, n in enumerate(names)])


def _first_named_input(signature: inspect.Signature) -> inspect.Signature:
    first, *rest = signature.parameters.values()
    return signature.replace(parameters=[first.replace(name="input"), *rest])


def _spellings(node: fx.Node, signature: inspect.Signature) -> list[tuple]:
    """A call's positional arguments as given, and for a Tensor method whose second
    parameter is a list, its sizes given one by one packed into that list."""
    spellings = [tuple(node.args)]
    params = list(signature.parameters.values())
    if node.op == "call_method" and len(node.args) > 2 and len(params) > 1 and _is_list(params[1].annotation):
        spellings.append((node.args[0], tuple(node.args[1:])))
    return spellings


def _is_list(annotation) -> bool:
    """``List[int]``, ``Optional[List[int]]``."""
    return typing.get_origin(annotation) is list or any(_is_list(a) for a in typing.get_args(annotation))


def _bound(signature: inspect.Signature, args: tuple, kwargs: dict, typed: bool) -> dict[str, Any] | None:
    """``args`` and ``kwargs`` by parameter name when ``signature`` takes them (and, if
    ``typed``, their types fit it); None otherwise."""
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError:
        return None
    if typed and not all(_fits(signature.parameters[name].annotation, value) for name, value in bound.arguments.items()):
        return None
    bound.apply_defaults()
    return dict(bound.arguments)


def _fits(annotation, value) -> bool:
    """Whether a value may be passed as a parameter of this type; an unknown one fits any."""
    kind = _type_of(value)
    return annotation in (inspect.Parameter.empty, Any) or kind is None or type_matches(annotation, kind)


def _type_of(value):
    if isinstance(value, fx.Node):
        value = value.meta.get("val", value.meta.get("example_value"))
        if value is None:
            return None
    if isinstance(value, (list, tuple)):
        kinds = tuple(_type_of(v) for v in value)
        return None if None in kinds else tuple[kinds] if kinds else tuple[()]
    if isinstance(value, torch.Tensor):
        return torch.Tensor
    return _SCHEMA_TYPES.get(type(value), type(value))


_SCHEMA_TYPES = {torch.SymInt: int, torch.SymFloat: float, torch.SymBool: bool, torch.memory_format: int,
                 torch.layout: int}
"""Python types as schemas spell them (a memory format is an int there)."""


def tensor_inputs(node: fx.Node) -> list[fx.Node]:
    """The nodes among a node's arguments whose values are tensors, in argument order."""
    found = []
    fx.node.map_arg((node.args, node.kwargs), lambda n: found.append(n) if tensor_val(n) is not None else None)
    return found


_RIGHT_OPERAND = ("weight", "other", "mat2", "mat_b")
"""A linear's weight, ``matmul``'s and ``bmm``'s right operand, a grouped matmul's experts:
what ``weight_param`` reads."""


def _swaps_last_two_dims(node: fx.Node) -> bool:
    """``w.t()``, ``w.transpose(-2, -1)`` (an expert weight ``[E, out, in]`` read as ``[E, in, out]``)."""
    if node.op != "call_method" or node.target not in ("t", "transpose"):
        return False
    if node.target == "t":
        return True
    given, ndim = arguments(node), tensor_val(node).dim()
    return {given["dim0"] % ndim, given["dim1"] % ndim} == {ndim - 2, ndim - 1}


_CASTS = ("to", "type", "float", "double", "half", "bfloat16")
"""Tensor methods that convert a weight's dtype as it is read (DeepSeek's router:
``F.linear(x.type(torch.float32), self.weight.type(torch.float32))``)."""


def stacked_params(weight: fx.Node) -> list[fx.Node]:
    """The placeholders a weight is: itself, or the experts' weights a ``torch.stack`` of them
    holds (an ``nn.ModuleList``'s experts, ``passes.expert_loop``)."""
    if weight.target is torch.stack and all(isinstance(w, fx.Node) and w.op == "placeholder" for w in weight.args[0]):
        return list(weight.args[0])
    return [weight]


def weight_param(linear: fx.Node) -> tuple[fx.Node, bool]:
    """The tensor a linear's weight is read from (through dtype casts, and the exchange that
    sends each rank its experts whole from their rows, ``experts_from_rows``), and whether it is
    stored with its last two dims swapped (``[in, out]``, read through ``t()``: GPT-2's Conv1D
    after canonicalize; an expert weight ``[E, out, in]`` read through ``transpose(-2, -1)``)."""
    given = arguments(linear)
    weight = _read_from(next(given[name] for name in _RIGHT_OPERAND if name in given))
    if isinstance(weight, fx.Node) and _swaps_last_two_dims(weight):
        return _read_from(arguments(weight)["input"]), True
    return weight, False


def _read_from(weight):
    """What ``weight`` is read from through dtype casts and ``experts_from_rows``."""
    while isinstance(weight, fx.Node) and (weight.op == "call_method" and weight.target in _CASTS
                                           or weight.target is experts_from_rows):
        weight = weight.args[0]
    return weight


_ALIASING_METHODS = frozenset({"view", "transpose", "permute", "unsqueeze", "squeeze", "expand", "select", "t",
                               "movedim", "unflatten", "split", "chunk", "unbind", "view_as_real", "view_as_complex"})
_ALIASING_FUNCTIONS = frozenset({torch.transpose, torch.permute, torch.unsqueeze, torch.squeeze, torch.select, torch.t,
                                 torch.movedim, torch.unflatten, torch.split, torch.chunk, torch.unbind,
                                 torch.view_as_real, torch.view_as_complex})
"""Ops whose every output is a view of their input (``reshape`` and ``flatten`` may copy)."""


def _is_view(node: fx.Node) -> bool:
    """Whether ``node`` only views its input: an aliasing op, or indexing by ints, slices,
    ``None`` and ``...`` (indexing by a tensor copies)."""
    if node.op == "call_method":
        return node.target in _ALIASING_METHODS
    if node.op == "call_function" and node.target is operator.getitem:
        index = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
        return all(i is None or i is Ellipsis or isinstance(i, (int, slice)) or
                   (isinstance(i, fx.Node) and tensor_val(i) is None) for i in index)
    return node.op == "call_function" and node.target in _ALIASING_FUNCTIONS


def repeated_views(gm: fx.GraphModule) -> dict[fx.Node, fx.Node]:
    """Each view taken again alike of the same tensor (diffusers' rotary embedding takes
    ``freqs[..., 0]`` for q and again for k, in every block) -> the first such view. A view
    aliases its input, so the two hold the same values at every point of the graph, even after
    a write into the input; the graph keeps both (detect reads each reader's own)."""
    first: dict[tuple, fx.Node] = {}
    same: dict[fx.Node, fx.Node] = {}
    for node in gm.graph.nodes:
        if _is_view(node):
            args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: same.get(n, n))
            key = (node.op, node.target, repr(args), repr(kwargs))  # a node's repr is its name
            same[node] = first.setdefault(key, node)
    return {node: view for node, view in same.items() if view is not node}
