"""Rewrites of slices, splits and reshapes: ``narrow`` and ``tensor_split`` as the slice and split the
rules know, a split of a projection's viewed features as a split of its features, reshapes back to
their source dropped, rows flattened for row-wise ops left unflattened."""

from __future__ import annotations

import math
import operator

import torch
import torch.fx as fx

from ...symbolic import is_symbolic, same_size
from ..context import ParallelContext
from ..edits import emitted, erase_unused, with_val
from ..nodes import arguments, tensor_inputs, tensor_val, value_from_inputs, writes_in_place
from ..rules.indexing import split_dim
from ..rules.registry import kinds_in, op_kind
from .registry import calls, of_kind, rewrite


@rewrite(10, calls(torch.narrow, "narrow"))
def narrow_as_slice(gm: fx.GraphModule, node: fx.Node, ctx: ParallelContext) -> None:
    """``x.narrow(dim, start, length)`` becomes the slice ``x[..., start:start + length, ...]``, so a
    fused projection cut by ``narrow`` is cut part by part as by indexing."""
    given = arguments(node)
    x, dim, start, length = (given[name] for name in ("input", "dim", "start", "length"))
    if not all(isinstance(v, int) for v in (dim, start, length)):
        return  # bounds computed in the graph: left to the fallback
    dim = dim % tensor_val(x).dim()
    index = (slice(None),) * dim + (slice(start, start + length),)
    with gm.graph.inserting_before(node):
        sliced = with_val(gm.graph.call_function(operator.getitem, (x, index)), tensor_val(node))
    node.replace_all_uses_with(sliced)
    gm.graph.erase_node(node)


@rewrite(40, calls(torch.tensor_split, "tensor_split"))
def tensor_split_as_split(gm: fx.GraphModule, node: fx.Node, ctx: ParallelContext) -> None:
    """``torch.tensor_split`` (at indices, or into a number of sections) becomes ``torch.split``
    into the sizes its pieces have (symbolic ones too: Mamba's scan cut at the rows before a
    cache's; Qwen3-Next's gated delta rule cuts its padded sequence so), which the split rule
    places."""
    given = arguments(node)
    dim = given.get("dim", 0) % tensor_val(given["input"]).dim()
    sizes = [piece.shape[dim] for piece in node.meta["val"]]
    with gm.graph.inserting_before(node):
        split = with_val(gm.graph.call_function(torch.split, (given["input"], sizes, dim)), node.meta["val"])
    node.replace_all_uses_with(split)
    gm.graph.erase_node(node)


def _viewed_features(split: fx.Node) -> tuple[fx.Node, int] | None:
    """``(linear, inner)`` when ``split`` cuts views of a linear's output (each read once) along
    a dim that, with the ``inner`` elements after it, is the linear's feature dim regrouped."""
    x, views = arguments(split)["input"], 0
    while op_kind(x) == "view" and len(x.users) == 1:  # views keep the elements' order
        x, views = arguments(x)["input"], views + 1
    if not views or op_kind(x) != "linear" or len(x.users) != 1:
        return None
    viewed, dim = tensor_val(arguments(split)["input"]).shape, split_dim(split)
    inner = math.prod(viewed[dim + 1:])
    features = tensor_val(x).shape
    if math.prod(viewed[:dim]) != math.prod(features[:-1]) or viewed[dim] * inner != features[-1]:
        return None
    return x, inner


@rewrite(180, of_kind("split"))
def split_features_before_views(gm: fx.GraphModule, split: fx.Node, ctx: ParallelContext) -> None:
    """A split of a fused projection's features after views of them (Falcon-7B's multi-query
    ``qkv.view(b, s, heads + 2, d).split([heads, 1, 1], dim=2)``, GPTBigCode's
    ``qkv.unsqueeze(1).split([h, d, d], dim=3)``) becomes the split of its features, each part
    then reshaped to its piece's shape: the same elements, since views keep their order, and the
    projection is read as fused parts (q, k, v) whose heads the views of each part tell."""
    found = _viewed_features(split)
    if found is None or any(u.target is not operator.getitem for u in split.users):
        return
    linear, inner = found
    pieces = split.meta["val"]
    features = [t.shape[split_dim(split)] * inner for t in pieces]
    with gm.graph.inserting_before(split):
        parts = gm.graph.call_method("split", (linear, features, -1))
        parts.meta = {**linear.meta, "val": tuple(tensor_val(linear).split(features, -1))}
    for user in list(split.users):
        with gm.graph.inserting_before(user):
            part = with_val(gm.graph.call_function(operator.getitem, (parts, user.args[1])),
                            parts.meta["val"][user.args[1]])
            piece = with_val(gm.graph.call_method("reshape", (part, tuple(pieces[user.args[1]].shape))),
                             pieces[user.args[1]])
        user.replace_all_uses_with(piece)
        gm.graph.erase_node(user)
    erase_unused(gm, split)


@rewrite(190, of_kind("view"))
def reshaped_back(gm: fx.GraphModule, node: fx.Node, ctx: ParallelContext) -> None:
    """A chain of reshapes (``view``, ``squeeze``, ``unsqueeze``...) ending at ``node`` that gives
    back its source's shape: ``node``'s readers read the source, the same elements in the same
    order (transformers' causal convolution reads its weight as ``w.squeeze(1)``, then
    ``.unsqueeze(1)``: the parameter is then read as the weight); not where one writes in place,
    for a reshape may have copied."""
    source = node
    while op_kind(source) == "view":
        source = tensor_inputs(source)[0]
    if source is node or any(writes_in_place(u) for u in node.users) \
            or not same_size(tensor_val(source).shape, tensor_val(node).shape):
        return
    node.replace_all_uses_with(source)
    erase_unused(gm, node)


def _rows_flattened(view: fx.Node) -> tuple[fx.Node, tuple[int, ...]] | None:
    """``(x, lead)`` when ``view`` makes ``[prod(lead), d]`` rows of ``x``, whose last dims hold
    ``lead``'s last ones and ``d`` (``[*lead, d]``, or ``[b, s, h * d]``), all sizes static, at
    least two of ``lead`` merged."""
    x = tensor_inputs(view)[0] if op_kind(view) == "view" else None
    out, given = tensor_val(view), tensor_val(x) if x is not None else None
    if given is None or out is None or out.dim() != 2 or given.dim() < 2 or is_symbolic(given.shape):
        return None
    rows, d = out.shape
    *outer, last = given.shape
    lead = (*outer, last // d) if last != d else tuple(outer)
    merged = sum(n > 1 for n in lead) >= 2  # not a squeeze
    return (x, lead) if last % d == 0 and math.prod(lead) == rows and merged else None


def _row_wise(node: fx.Node) -> bool:
    """Whether ``node`` computes each row alone from its last dim: pointwise, a reduction over
    the last dim spelled ``-1`` and kept, a norm over it."""
    if op_kind(node) in kinds_in("pointwise"):
        return True
    if op_kind(node) == "norm":
        return len(arguments(node)["normalized_shape"]) == 1
    if op_kind(node) != "reduce":
        return False
    given = arguments(node)
    dims = given.get("dim")
    return given.get("keepdim", False) and list(dims if isinstance(dims, (list, tuple)) else [dims]) == [-1]


def _rows_region(first: fx.Node, lead: tuple[int, ...]) -> tuple[list, list, list] | None:
    """(the views flattening rows of ``lead``, the row-wise ops on them, the views that read
    them back) from ``first`` on, or None where anything else reads them or they read a tensor
    that is neither flattened alike nor broadcast over every row (``[d]`` weights)."""
    roots, region, ends, stack = [first], [], [], [first]
    while stack:
        for user in stack.pop().users:
            if user in roots or user in region or user in ends:
                continue
            if user.target in _RESHAPES:
                ends.append(user)
                continue
            if not _row_wise(user):
                return None
            region.append(user)
            stack.append(user)
            for other in tensor_inputs(user):  # rows flattened alike, maybe through row-wise ops (a gate's silu)
                root = _flattened_above(other, lead)
                if root is not None and root not in roots:
                    roots.append(root)
                    stack.append(root)
    inside = {*roots, *region}
    if any(i not in inside and tensor_val(i).dim() > 1 for n in region for i in tensor_inputs(n)):
        return None
    return roots, region, ends


_RESHAPES = {"view", "reshape", torch.reshape}
"""Views to sizes given: the same elements in the same order from the rows flattened or not (a
squeeze or unsqueeze of the rows would give another shape)."""


def _flattened_above(node: fx.Node, lead: tuple[int, ...]) -> fx.Node | None:
    """The view flattening rows of ``lead`` that ``node`` is made from through row-wise ops of
    one input each, if any."""
    while _rows_flattened(node) is None and _row_wise(node) and len(tensor_inputs(node)) == 1:
        node = tensor_inputs(node)[0]
    found = _rows_flattened(node)
    return node if found is not None and found[1] == lead else None


@rewrite(200, of_kind("view"), exclusive=False)
def rows_unflattened(gm: fx.GraphModule, view: fx.Node, ctx: ParallelContext) -> None:
    """Rows flattened for ops that work row by row and viewed back (Qwen3-Next's gated norm:
    ``a.reshape(-1, d)``, a norm over ``d`` gated by ``silu(z.reshape(-1, d))``, then
    ``.reshape(b, s, -1)``) run on the rows unflattened, ``[*lead, d]``: the rows ``view``
    flattens, and those flattened alike beside them, read unflattened by the row-wise ops between
    them and the views back. The same values per row, and the views back read the same elements
    in the same order. Flattened, the rows of a sequence cut over cp and heads cut over tp would
    be cut part by part over both at once, which no redistribution lays out (gathered). After
    ``reshaped_back``, on the views it leaves."""
    found = _rows_flattened(view)
    region = _rows_region(view, found[1]) if found is not None else None
    if region is None or not region[2]:
        return
    roots, ops, ends = region
    for root in roots:
        x, lead = _rows_flattened(root)
        d = tensor_val(root).shape[1]
        with gm.graph.inserting_before(root):
            rows = x if tensor_val(x).shape == (*lead, d) else emitted(gm.graph, torch.reshape, x, (*lead, d))
        root.replace_all_uses_with(rows)
        gm.graph.erase_node(root)
    region = set(ops)
    for node in [n for n in gm.graph.nodes if n in region]:  # each value again, from its inputs' new ones
        node.meta["val"] = value_from_inputs(node)
    for end in ends:  # a view of rows an op may have left strided: a reshape reads them alike
        if end.op == "call_method" and end.target == "view":
            end.target = "reshape"
