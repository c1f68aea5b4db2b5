"""Rewrites of tensors written in place into the same values made out of place: filled slice by
slice, a slice written, a product's output added to, a fresh tensor copied into. Out of place,
each value keeps the placement the rules give it, where a write in place would have to take the
placement of the tensor it writes into."""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ...symbolic import is_symbolic, same_size
from ..context import ParallelContext
from ..edits import erase_unused, with_val
from ..nodes import arguments, tensor_inputs, tensor_val, writes_in_place
from ..rules.registry import kinds_in, op_kind
from .registry import calls, functions, methods, rewrite


def _one_dim_slice(index, ndim: int) -> tuple[int, slice] | None:
    """``(dim, slice)`` when ``index`` cuts one dim by a static unit-step slice and leaves
    every other whole (``x[..., 2:5]``, ``x[:, :4]``); None otherwise."""
    index = index if isinstance(index, tuple) else (index,)
    if index.count(Ellipsis) > 1 or not all(isinstance(i, slice) or i is Ellipsis for i in index):
        return None
    if Ellipsis in index:
        at = index.index(Ellipsis)
        index = index[:at] + (slice(None),) * (ndim - len(index) + 1) + index[at + 1:]
    cut = [(dim, i) for dim, i in enumerate(index) if i != slice(None)]
    if len(index) > ndim or len(cut) != 1 or cut[0][1].step not in (None, 1) \
            or not all(isinstance(b, int) or b is None for b in (cut[0][1].start, cut[0][1].stop)):
        return None
    return cut[0]


def _slice_fills(empty: fx.Node) -> tuple[int, list[fx.Node], fx.Node] | None:
    """The dim, the ``copy_`` nodes in slice order and the last of them in graph order, that
    fill ``empty`` (a tensor made uninitialized) along one dim: each slice copied into once, by
    a piece of its shape, the slices covering the dim exactly, and every other reader of
    ``empty`` after the last copy. None when it is not filled so."""
    val = tensor_val(empty)
    if val is None or is_symbolic(val.shape):
        return None
    pieces, readers = {}, []
    for user in empty.users:
        cut = _one_dim_slice(user.args[1], val.dim()) if user.target is operator.getitem else None
        if cut is None:
            readers.append(user)
            continue
        copies = list(user.users)
        if len(copies) != 1 or copies[0].target != "copy_" or copies[0].args[0] is not user or copies[0].users \
                or getattr(tensor_val(copies[0].args[1]), "shape", None) != tensor_val(user).shape:
            return None
        dim, (start, stop, _) = cut[0], cut[1].indices(val.shape[cut[0]])
        pieces[(dim, start)] = (stop, copies[0])
    dims = {dim for dim, _ in pieces}
    if len(dims) != 1:
        return None
    dim, at, fills = dims.pop(), 0, []
    while (dim, at) in pieces:
        at, copy = pieces.pop((dim, at))
        fills.append(copy)
    order = {n: i for i, n in enumerate(empty.graph.nodes)}
    last = max(fills, key=order.get) if fills else None
    if last is None or pieces or at != val.shape[dim] or any(order[r] < order[last] for r in readers):
        return None
    return dim, fills, last


@rewrite(100, calls("new_empty", torch.empty_like, "empty_like"))
def slice_fills_as_cat(gm: fx.GraphModule, empty: fx.Node, ctx: ParallelContext) -> None:
    """A tensor made empty and then filled slice by slice along one dim (DeepSeek's multi-head
    latent attention: ``k = kv.new_empty(...); k[..., :d].copy_(k_nope); k[..., d:].copy_(k_rot)``)
    becomes the ``torch.cat`` of its pieces, placed after the last copy (so after every piece,
    before every reader): out of place, so each piece keeps its placement and the rules shard the
    concatenation (a write into a gathered copy would be lost)."""
    found = _slice_fills(empty)
    if found is None:
        return
    dim, fills, last = found
    pieces = [copy.args[1] for copy in fills]
    with gm.graph.inserting_after(last):
        joined = with_val(gm.graph.call_function(torch.cat, (pieces, dim)),
                          torch.cat([tensor_val(p) for p in pieces], dim))
    empty.replace_all_uses_with(joined, delete_user_cb=lambda user: user.target is not operator.getitem)
    for copy in fills:
        view = copy.args[0]
        gm.graph.erase_node(copy)
        gm.graph.erase_node(view)
    gm.graph.erase_node(empty)


@rewrite(110, methods("add_"))
def in_place_add_out_of_place(gm: fx.GraphModule, node: fx.Node, ctx: ParallelContext) -> None:
    """``y.add_(b)`` becomes ``y + b`` read in place of ``y`` (and of the write's result), where
    ``y`` is a product's output (fresh: no other tensor shares its storage) that nothing reads
    before the write and ``y + b`` keeps its dtype: the same values everywhere (transformers'
    grouped linear with biases, GPT-OSS's experts: ``out.add_(bias[expert_ids])``). The rules
    place it as any add, and detect reads the bias."""
    given = arguments(node)
    y, other = given["input"], given["other"]
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    if op_kind(y) not in kinds_in("matmul") or given.get("alpha", 1) != 1 or not isinstance(other, fx.Node) \
            or any(order[u] < order[node] for u in y.users) or tensor_val(other) is None \
            or torch.result_type(tensor_val(y), tensor_val(other)) != tensor_val(y).dtype:
        return
    with gm.graph.inserting_before(node):
        added = with_val(gm.graph.call_function(operator.add, (y, other)), tensor_val(y))
    _read_in_place(gm, y, node, added)


def _read_in_place(gm: fx.GraphModule, written: fx.Node, write: fx.Node, value: fx.Node) -> None:
    """``value`` read in place of ``written`` and of the in-place ``write``'s result, by every
    reader after the write (those before read ``written`` as it was); the write erased."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for reader in (written, write):
        reader.replace_all_uses_with(value, delete_user_cb=lambda user: user not in (value, write)
                                     and order[user] > order[write])
    gm.graph.erase_node(write)


_FRESH = {torch.zeros, torch.empty, torch.ones, torch.zeros_like, torch.empty_like, torch.ones_like, torch.clone,
          "new_zeros", "new_empty", "new_ones", "clone"}
"""Factories and copies: a tensor they make shares its storage with no other."""


def _read_before(reader: fx.Node, write: fx.Node, order: dict[fx.Node, int]) -> bool:
    """Whether ``reader`` makes a new tensor before ``write``, or casts (an alias where the dtype
    is the same: Mamba's ``state.float()``) that only such readers read before it."""
    if order[reader] > order[write]:
        return False
    if op_kind(reader) == "cast":
        return all(_read_before(user, write, order) for user in reader.users)
    return op_kind(reader) in kinds_in("pointwise")


@rewrite(120, methods("copy_"))
def copy_into_fresh_out_of_place(gm: fx.GraphModule, node: fx.Node, ctx: ParallelContext) -> None:
    """Rewrite ``fresh.copy_(src)``, ``fresh`` a tensor a factory or a copy just made and ``src``
    as large (a linear attention cache's state, made zeros, then written whole; Mamba-2's decode
    step's, cloned, read, then written whole), into ``src`` (cast to ``fresh``'s dtype) read in
    place of ``fresh`` and of the write's result after it, where only ops making new tensors
    read ``fresh`` before (``_read_before``: no view of it sees the write) and nothing writes
    into ``src`` after it: the same values everywhere. Out of place, it keeps the value's
    placement, where a cut value written into a replicated buffer would be refused."""
    given = arguments(node)
    fresh, src = given["input"], given["src"]
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    if fresh.target not in _FRESH or not isinstance(src, fx.Node) or tensor_val(src) is None \
            or any(order[u] < order[node] and not _read_before(u, node, order) for u in fresh.users) \
            or any(writes_in_place(u) and order[u] > order[node] for u in src.users) \
            or not same_size(tuple(tensor_val(src).shape), tuple(tensor_val(fresh).shape)):
        return
    value = src
    if tensor_val(src).dtype != tensor_val(fresh).dtype:
        with gm.graph.inserting_before(node):
            value = with_val(gm.graph.call_method("to", (src, tensor_val(fresh).dtype)), tensor_val(fresh))
    _read_in_place(gm, fresh, node, value)
    erase_unused(gm, fresh)


_ALIASING = {"view", "transpose", "permute", "expand", "cast"}
"""Op kinds whose output may share its input's storage (a cast to the dtype it has)."""


def _written_alone(target: fx.Node, write: fx.Node, order: dict[fx.Node, int]) -> bool:
    """Whether a write into ``target`` reaches no tensor read after it but ``target``: the tensors
    it views are read by nothing else, and what reads ``target`` before the write is read before
    it too (a slice of it read to make the written value). ``order``: each node's place in the graph."""
    for reader in target.users:
        if order[reader] < order[write] and any(order[u] > order[write] for u in reader.users):
            return False
    node = target
    while op_kind(node) in _ALIASING:
        node = tensor_inputs(node)[0]
        if len(node.users) != 1:
            return False
    return True


@rewrite(130, functions(operator.setitem))
def slice_write_as_cat(gm: fx.GraphModule, write: fx.Node, ctx: ParallelContext) -> None:
    """``x[..., a:b, ...] = value``, a slice along one dim written with a new value (CogView4's
    rotary embedding of the image part of a joint sequence: ``q[:, :, text:] =
    rope(q[:, :, text:])``), becomes the ``cat`` of ``x``'s slices before and after and
    ``value``, read in place of ``x`` by the nodes after the write, where no other view of ``x``
    is read after it: out of place, each slice of a sequence cut part by part over cp stays
    local."""
    target, index, value = write.args
    val = tensor_val(target)
    cut = _one_dim_slice(index, val.dim()) if val is not None and not is_symbolic(val.shape) else None
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    if cut is None or getattr(tensor_val(value), "shape", None) != val[index].shape \
            or tensor_val(value).dtype != val.dtype or not _written_alone(target, write, order):
        return
    dim, (start, stop, _) = cut[0], cut[1].indices(val.shape[cut[0]])
    graph, before = gm.graph, (slice(None),) * dim
    later = [u for u in target.users if order[u] > order[write]]
    with graph.inserting_before(write):
        pieces = [with_val(graph.call_function(operator.getitem, (target, before + (slice(a, b),))),
                           val[before + (slice(a, b),)]) if (a, b) != (start, stop) else value
                  for a, b in ((0, start), (start, stop), (stop, val.shape[dim])) if b > a]
        whole = with_val(graph.call_function(torch.cat, (pieces, dim)), val.clone())
    for user in later:
        user.replace_input_with(target, whole)
    graph.erase_node(write)
