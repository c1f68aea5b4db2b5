"""The rewrite of experts read a row at a time (each row's product with its own expert's weight,
``W[ids]``) into grouped matmuls over the rows sorted by expert: the chain the planner knows."""

from __future__ import annotations

import operator
from typing import NamedTuple

import torch
import torch.fx as fx

from ...ops.grouped import GROUPED_MM
from ...symbolic import same_size
from ..context import ParallelContext
from ..detect.experts import is_topk
from ..edits import erase_unused, with_val
from ..nodes import arguments, tensor_val
from ..rules.indexing import split_dim
from ..rules.registry import kinds_in, op_kind
from .registry import of_kind, rewrite


class _RowProduct(NamedTuple):
    """An expert product read a row at a time: ``out [S, N]`` is each row of ``rows [S, K]`` times
    its own expert's weight, ``weight[ids]`` (``weight`` stored ``[E, K, N]`` when ``stored_in_out``,
    else ``[E, N, K]``), through ``column``, the rows viewed as the product reads them."""

    product: fx.Node
    out: fx.Node
    weight: fx.Node
    ids: fx.Node
    rows: fx.Node
    column: fx.Node
    stored_in_out: bool


def _top_k_indices(ids: fx.Node) -> bool:
    """Whether ``ids`` are a top-k's indices (through views): each names an expert, in range, as
    the histogram that groups them counts it."""
    while op_kind(ids) == "view":
        ids = arguments(ids)["input"]
    return op_kind(ids) == "getitem" and is_topk(arguments(ids)["input"]) and arguments(ids)["index"] == 1


def _gathered_experts(node) -> tuple[fx.Node, fx.Node] | None:
    """``(W, ids)`` when ``node`` is ``W[ids]``: a 3-d tensor's experts, one a row, picked by a
    top-k's indices ``[S]``."""
    if op_kind(node) != "getitem":
        return None
    given = arguments(node)
    weight, ids = given["input"], given["index"]
    if not isinstance(ids, fx.Node) or getattr(tensor_val(weight), "ndim", 0) != 3 \
            or getattr(tensor_val(ids), "ndim", 0) != 1 or not _top_k_indices(ids):
        return None
    return weight, ids


def row_product(node: fx.Node) -> _RowProduct | None:
    """The expert product ``node`` computes a row at a time, if it is one (transformers'
    ``_batched_linear``): a ``bmm`` or ``matmul`` of ``W[ids]`` and the rows as columns
    (``W[ids] @ x.unsqueeze(-1)``, W ``[E, N, K]``) or as rows (``x.unsqueeze(1) @ W[ids]``, W
    ``[E, K, N]``), both views, read only through a view back to ``[S, N]``."""
    if op_kind(node) != "matmul" or getattr(tensor_val(node), "ndim", 0) != 3 or len(node.users) != 1:
        return None
    given, (out,) = arguments(node), node.users
    a, b = given["input"], given.get("mat2", given.get("other"))
    for gathered, column, stored_in_out in ((a, b, False), (b, a, True)):
        found = _gathered_experts(gathered)
        if found is None or op_kind(column) != "view" or op_kind(out) != "view":
            continue
        rows, weight = arguments(column)["input"], tensor_val(found[0])
        if getattr(tensor_val(rows), "ndim", 0) != 2:
            continue
        (s, k), n = tensor_val(rows).shape, weight.shape[2 if stored_in_out else 1]
        shapes = (((s, 1, k), (s, 1, n)) if stored_in_out else ((s, k, 1), (s, n, 1))) + ((s, n),)
        if same_size(weight.shape[1 if stored_in_out else 2], k) and all(
                same_size(tuple(tensor_val(v).shape), shape) for v, shape in zip((column, node, out), shapes)):
            return _RowProduct(node, out, found[0], found[1], rows, column, stored_in_out)
    return None


_PER_ROW = kinds_in("pointwise") | {"split", "getitem"}
"""Ops that may run between the experts' up and down products on rows in any order: the
activation and gate, elementwise, and the pieces of a fused gate and up split along features."""


def _keeps_rows(node: fx.Node) -> bool:
    """Whether a per-row op keeps each row to itself: a split along features, a piece of one."""
    if op_kind(node) == "split":
        return split_dim(node) != 0
    if op_kind(node) == "getitem":
        return isinstance(arguments(node)["input"].meta.get("val"), (tuple, list))
    return True


def _row_aligned(node: fx.Node, rows) -> bool:
    """Whether ``node`` holds one row per expert row (a split of them, pieces and all)."""
    val = node.meta.get("val")
    return isinstance(val, (tuple, list)) or (isinstance(val, torch.Tensor) and val.dim() >= 2
                                              and same_size(val.shape[0], rows))


def _up_products(down: _RowProduct) -> tuple[list[_RowProduct], fx.Node, int] | str | None:
    """The up (and gate) products (in graph order) whose outputs ``down``'s rows are made from,
    row by row, the tokens whose rows they read and each token's count of rows (top-k); None when
    ``down``'s rows come from no such product (it is no down projection), else why the rows
    between cannot run in expert order."""
    ups, between, leaves, stack = {}, set(), [], [down.rows]
    rows = tensor_val(down.rows).shape[0]
    while stack:
        node = stack.pop()
        if node in between or node in ups:
            continue
        up = row_product(arguments(node)["input"]) if op_kind(node) == "view" else None
        if up is not None and up.out is node:
            ups[node] = up
        elif op_kind(node) in _PER_ROW and _keeps_rows(node):
            between.add(node)
            stack.extend(i for i in node.all_input_nodes if _row_aligned(i, rows))
        else:
            leaves.append(node)
    if not ups:
        return None
    ups = sorted(ups.values(), key=lambda up: _position(up.product))
    outside = [(n, u) for n in between | {up.out for up in ups} for u in n.users
               if u not in between and u is not down.column]
    if leaves:
        return f"{leaves[0].name} is read row by row between them, and is no expert product's output"
    if outside:
        return f"{outside[0][1].name} reads {outside[0][0].name} between them"
    if any(up.ids is not down.ids or up.rows is not ups[0].rows for up in ups):
        return "they pick their experts by other indices, or read other rows"
    repeated = _repeated_tokens(ups[0].rows)
    if repeated is None:
        return f"their rows {ups[0].rows.name} are not each token repeated top-k times in a row " \
               f"(repeat_interleave along dim 0)"
    return ups, *repeated


def _position(node: fx.Node) -> int:
    return next(i for i, n in enumerate(node.graph.nodes) if n is node)


def _repeated_tokens(rows: fx.Node) -> tuple[fx.Node, int] | None:
    """``(tokens, k)`` when ``rows`` are each token repeated ``k`` times in a row
    (``tokens.repeat_interleave(k, dim=0)``), as transformers lays out a token's top-k rows."""
    if rows.target not in (torch.repeat_interleave, "repeat_interleave"):
        return None
    given = arguments(rows)
    tokens, k = given["input"], given["repeats"]
    if given["dim"] != 0 or not isinstance(k, int) or getattr(tensor_val(tokens), "ndim", 0) != 2:
        return None
    return tokens, k


@rewrite(80, of_kind("matmul"), when=lambda node, _: row_product(node) is not None)
def experts_as_grouped(gm: fx.GraphModule, node: fx.Node, ctx: ParallelContext) -> None:
    """Experts read a row at a time (transformers' ``batched_mm``: ``W[expert_ids]`` then ``bmm``
    with each row), an up (and gate) product, per-row ops, then ``node``, the down product, become
    the grouped chain the planner knows (transformers' ``grouped_mm`` one): the ids sorted
    (stable), the tokens' rows gathered in that order, ``histc`` counts, their running sum as
    offsets, a grouped matmul for each product (``ops.grouped``) and the rows put back by
    ``argsort`` of the order. Each row's dot products are the same; detect, the tp plan and
    expert parallelism then apply unchanged, and no ``[S, out, in]`` copy of the weights is made.
    A pair that cannot be reordered stays as it is, with a warning that says why. Before the
    matmuls with a parameter (``linear.parameter_product_as_linear``)."""
    down = row_product(node)
    found = _up_products(down)
    if isinstance(found, str):
        ctx.warn(f"{down.product.name}: experts read a row at a time through {down.ids.name} stay so (whole on every "
                 f"rank): {found}")
    if not isinstance(found, tuple):
        return
    (ups, tokens, top_k), graph, ids = found, gm.graph, tensor_val(down.ids)

    def call(fn, args, value, kwargs=None, method=False):
        return with_val((graph.call_method if method else graph.call_function)(fn, args, kwargs or {}), value)

    experts = tensor_val(down.weight).shape[0]
    with graph.inserting_before(ups[0].product):
        order = call(torch.sort, (down.ids,), (ids.new_empty(ids.shape), ids.new_empty(ids.shape)), {"stable": True})
        by_expert, perm = (call(operator.getitem, (order, i), ids.new_empty(ids.shape)) for i in (0, 1))
        source = call(operator.floordiv, (perm, top_k), tensor_val(perm))
        rows = call(operator.getitem, (tokens, source), tensor_val(ups[0].rows))
        float_ids = call("float", (by_expert,), ids.new_empty(ids.shape, dtype=torch.float32), method=True)
        counts = call(torch.histc, (float_ids,), float_ids.meta["val"].new_empty(experts),
                      {"bins": experts, "min": 0, "max": experts - 1})
        offs = call(torch.cumsum, (counts, 0), ids.new_empty(experts, dtype=torch.int32), {"dtype": torch.int32})
        for up in ups:
            up.out.replace_all_uses_with(_grouped(graph, up, rows, offs))
    with graph.inserting_before(down.product):
        product = _grouped(graph, down, down.rows, offs)
        back = call(operator.getitem, (product, call(torch.argsort, (perm,), tensor_val(perm))), tensor_val(down.out))
    down.out.replace_all_uses_with(back)
    for old in ups + [down]:
        erase_unused(gm, old.out)


def _grouped(graph: fx.Graph, old: _RowProduct, rows: fx.Node, offs: fx.Node) -> fx.Node:
    """The grouped matmul of ``rows`` in expert order with ``old``'s experts read ``[E, K, N]``."""
    weight = old.weight
    if not old.stored_in_out:
        weight = with_val(graph.call_method("transpose", (weight, -2, -1)), tensor_val(weight).transpose(-2, -1))
    return with_val(graph.call_function(GROUPED_MM, (rows, weight, offs)), tensor_val(old.out))
