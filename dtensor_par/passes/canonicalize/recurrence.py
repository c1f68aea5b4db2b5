"""The rewrite of a linear recurrence's traced ops into one call of the model's own function."""

from __future__ import annotations

import operator
import re
from functools import partial

import torch
import torch.fx as fx
import torch.nn.functional as F

from ...ops.recurrence import (RECURRENCES, GatedDeltaRule, SelectiveScan, StateSpaceScan, kind_of, linear_recurrence,
                               recurrence)
from ...symbolic import same_size
from ..context import ParallelContext
from ..edits import emitted, with_val
from ..nodes import arguments, is_vmap_level, tensor_val, writes_in_place
from ..rules.registry import op_kind
from .registry import rewrite


_WRAPPED_FUNCTION = re.compile(r"G\['__import_(\w+)'\]\.(\w+)")
"""How Dynamo names a module transformers wraps a module-level function in (its kernel hub)."""


def _recurrence_module(node: fx.Node) -> str | None:
    """``module:name`` of the chunked recurrence whose wrapping module ``node`` was traced in."""
    stack = node.meta.get("nn_module_stack")
    found = _WRAPPED_FUNCTION.fullmatch(list(stack.values())[-1][0]) if stack else None
    if found is None or found[2] not in RECURRENCES:
        return None
    return f"{found[1].replace('_dot_', '.')}:{found[2]}"


def _starts_recurrence(node: fx.Node) -> bool:
    """Whether ``node`` is the first op traced in a recurrence's wrapping module: the node before
    it was traced in none, or in another recurrence's."""
    rule = _recurrence_module(node)
    return rule is not None and _recurrence_module(node.prev) != rule


def _delta_rule_read(given: dict, region: list[fx.Node]) -> tuple[dict, torch.Tensor, tuple] | None:
    """The gated delta rule's shapes (q, k, v ``[B, S, H, d]``, g ``[B, S, H]`` or
    ``[B, S, H, d]``, beta ``[B, S, H]``), its output and no options; None where its ops do not
    normalize q and k (as every transformers model asks)."""
    if not any(n.target in (torch.rsqrt, "rsqrt", torch.sqrt, "sqrt") for n in region):
        return None
    (b, s, k_heads, k_dim), (heads, v_dim) = tensor_val(given["key"]).shape, tensor_val(given["value"]).shape[2:]
    shapes = {"query": (b, s, k_heads, k_dim), "key": (b, s, k_heads, k_dim), "value": (b, s, heads, v_dim),
              "beta": (b, s, heads),
              "g": (b, s, heads, k_dim)[:tensor_val(given["g"]).dim()]}  # a decay per head, or per key channel (Kimi's)
    return shapes, tensor_val(given["query"]).new_empty(b, s, heads, v_dim), ()


def _scan_read(given: dict, region: list[fx.Node]) -> tuple[dict, torch.Tensor, tuple] | None:
    """Mamba-2's scan's shapes (x ``[B, S, H, P]``, dt ``[B, S, H]``, B and C ``[B, S, G, N]``, A,
    D and dt_bias ``[H]``), its output and its options: the chunk size its rows are viewed in, and
    ``dt_limit`` (its clamp's bounds); None unless it applies a softplus to the time steps
    (``dt_softplus``, as every transformers model asks)."""
    (b, s, heads, head_dim), (groups, size) = tensor_val(given["hidden_states"]).shape, tensor_val(given["B"]).shape[2:]
    clamps = [n for n in region if n.target in (torch.clamp, "clamp")]
    chunks = [tensor_val(n).shape[2] for n in region if op_kind(n) == "view" and tensor_val(n).dim() == 5
              and same_size(tuple(tensor_val(n).shape[3:]), (heads, head_dim))]
    if not any(n.target is F.softplus for n in region) or len(clamps) != 1 or not chunks:
        return None
    bounds = arguments(clamps[0])
    shapes = {"hidden_states": (b, s, heads, head_dim), "dt": (b, s, heads), "B": (b, s, groups, size),
              "C": (b, s, groups, size), "A": (heads,), "D": (heads,), "dt_bias": (heads,)}
    x = tensor_val(given["hidden_states"])
    return shapes, x.new_empty(b, s, heads, head_dim, dtype=torch.promote_types(x.dtype, torch.float32)), \
        (("chunk_size", chunks[0]), ("dt_limit", (bounds.get("min"), bounds.get("max"))))


def _selective_scan_read(given: dict, region: list[fx.Node]) -> tuple[dict, torch.Tensor, tuple] | None:
    """Mamba-1's scan's shapes in the function's layout (x, dt and z ``[B, D, S]``, B and C
    ``[B, N, S]``, A ``[D, N]``, D and delta_bias ``[D]``), its output and no options; None unless
    it applies a softplus to the time steps (``delta_softplus``, as every transformers model asks)."""
    x, A = tensor_val(given["hidden_states"]), tensor_val(given["A"])
    if not any(n.target is F.softplus for n in region) or x.dim() != 3 or A.dim() != 2:
        return None
    (b, d, s), n = x.shape, A.shape[1]
    shapes = {"hidden_states": (b, d, s), "dt": (b, d, s), "z": (b, d, s), "B": (b, n, s), "C": (b, n, s),
              "A": (d, n), "D": (d,), "delta_bias": (d,)}
    return shapes, x.new_empty(b, d, s, dtype=torch.promote_types(x.dtype, torch.float32)), ()


_READS = {GatedDeltaRule: _delta_rule_read, StateSpaceScan: _scan_read, SelectiveScan: _selective_scan_read}
"""How the ops traced from each kind of recurrence are checked and read (``recurrence_as_one_op``):
the shapes of its arguments but the state, in the function's layout, its output, its options. The
state, the one it starts from and the final one, is the kind's own (``state``)."""


def _rows_first(kind, name: str) -> list[tuple]:
    """The ops, with their arguments after the tensor, that lay the function's argument ``name``
    out as ``linear_recurrence`` takes it: rows at dim 1 (``kind.channels_first``: from dim 2),
    key heads or groups at dim 2 (``kind.ungrouped``: one)."""
    return [(torch.movedim, (2, 1))] * (name in kind.channels_first) \
        + [(torch.unsqueeze, (2,))] * (name in kind.ungrouped)


def _laid_out(x, ops: list[tuple], emit=None):
    """``x`` (a tensor, or a node ``emit``ted into its graph) through ``ops``."""
    for fn, args in ops:
        x = emit(fn, x, *args) if emit else fn(x, *args)
    return x


@rewrite(210, _starts_recurrence, exclusive=False)
def recurrence_as_one_op(gm: fx.GraphModule, first: fx.Node, ctx: ParallelContext) -> None:
    """The ops of a linear recurrence over the sequence, traced from inside the module
    transformers wraps it in (``torch_chunk_gated_delta_rule``: Qwen3-Next's, Qwen3.5's,
    OLMo-hybrid's linear attention; a decode step's, by rows; ``ops.recurrence.RECURRENCES``),
    from ``first`` on, become one call of the model's own function
    (``ops.recurrence.linear_recurrence``): its rules run it on each rank's heads over tp and on
    each rank's rows over cp, where its ops one by one would have gathered the sequence. Only
    where they read exactly its tensor arguments, shaped as its kind's are (``_READS``), give
    only its output and final state and show it called as transformers calls it; otherwise, or
    where the function cannot be imported, they stay as traced. Last, on every node: the
    other rewrites of ``first`` have run."""
    rule = _recurrence_module(first)
    region, node = [], first
    while node.op in ("call_function", "call_method") and (_recurrence_module(node) == rule or is_vmap_level(node)):
        region.append(node)  # a level of vmap closed is traced without the module (Mamba-1's associative scan)
        node = node.next
    inside = set(region)
    kind, reads = RECURRENCES[rule.split(":")[1]]
    read = list(dict.fromkeys(i for n in region for i in n.all_input_nodes if i not in inside))
    given = dict(zip(reads, read))
    if len(read) not in (len(reads) - (reads[-1] == "state"), len(reads)) or any(tensor_val(n) is None for n in read):
        return
    found = _READS[kind](given, region)
    if found is None:
        return
    shapes, output, options = found
    if not all(same_size(tuple(tensor_val(given[name]).shape), shapes[name]) for name in given if name != "state"):
        return
    final = kind.state({name: _laid_out(tensor_val(n), _rows_first(kind, name)) for name, n in given.items()})
    if "state" in given and not same_size(tuple(tensor_val(given["state"]).shape), tuple(final.shape)):
        return
    values = [output, final]
    kept = _values_read(region, given[kind.read_out], values)
    if kept is None:
        return
    for n, i in kept.items():
        values[i] = tensor_val(n)
    try:
        recurrence(rule)
    except (ImportError, AttributeError):
        return
    _recurrence_call(gm, first, rule, given, kept, values, options)
    for n in reversed(region):
        gm.graph.erase_node(n)


def _values_read(region: list[fx.Node], read_out: fx.Node, values: list) -> dict[fx.Node, int] | None:
    """The nodes of ``region`` read after it, each the recurrence's output (0) or its final state
    (1), as their shapes tell, or where both are alike (Mamba-1's when the rows are as many as its
    state's size), as what they are made from does: the output from the read-out tensor
    (``kind.read_out``), which the state never reads. None where one is neither, or two are the
    same value."""
    inside = set(region)
    from_read_out, stack = set(), [read_out]
    while stack:
        for user in stack.pop().users:
            written = user.args[0] if writes_in_place(user) or user.target is operator.setitem else None
            for reached in (user, written):  # a write reaches the tensor written into
                if reached in inside and reached not in from_read_out:
                    from_read_out.add(reached)
                    stack.append(reached)
    kept = {}
    for n in (n for n in region if any(u not in inside for u in n.users)):
        fits = [i for i, value in enumerate(values)
                if tensor_val(n) is not None and same_size(tuple(tensor_val(n).shape), tuple(value.shape))]
        kept[n] = fits[0] if len(fits) == 1 else int(n not in from_read_out) if fits else None
    return kept if None not in kept.values() and len(set(kept.values())) == len(kept) else None


def _recurrence_call(gm: fx.GraphModule, first: fx.Node, rule: str, given: dict, kept: dict, values: list,
                     options: tuple) -> None:
    """One ``linear_recurrence`` of ``rule`` before ``first``, its tensors ``given`` laid out as it
    takes them, read by the nodes ``kept`` maps to its output (0, laid out back as the function's)
    or final state (1); ``values`` are theirs, in the function's layout."""
    kind = kind_of(rule)
    emit, back = partial(emitted, gm.graph), [(torch.movedim, (1, 2))] if kind.channels_first else []
    with gm.graph.inserting_before(first):
        tensors = [_laid_out(given[name], _rows_first(kind, name), emit)
                   for name in kind.rows + kind.per_head + ("state",) if name in given]
        call = gm.graph.call_function(linear_recurrence, (rule, *tensors), {"options": options} if options else {})
        with_val(call, (values[0].movedim(2, 1).contiguous() if back else values[0], values[1]))
        for n, i in kept.items():
            got = with_val(gm.graph.call_function(operator.getitem, (call, i)), call.meta["val"][i])
            n.replace_all_uses_with(_laid_out(got, back, emit) if i == 0 else got)
