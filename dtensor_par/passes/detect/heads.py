"""Attention heads read off the graph: the projections that make an attention input's heads
(``find_head_projections``), the heads (or groups of heads) their views split the features into
(``projected_heads``, ``parts_major_split``), and heads folded into the batch dim
(``folds_heads``, ``unfolded_heads``)."""

from __future__ import annotations

import math

import torch
import torch.fx as fx

from ..context import ParallelContext
from ..nodes import arguments, tensor_inputs, tensor_val
from ..rules.indexing import per_dim, split_dim
from ..rules.registry import kinds_in, op_kind
from ..rules.views import dim_order
from .walk import walk_to_linears, written_from


# Ops allowed between a projection and the attention call: head reshapes, RoPE, QK-norm.
TO_ATTENTION = kinds_in("pointwise", "views", "indexing") | {"norm"}


def _broadcast_over_heads(node: fx.Node) -> bool:
    """A 4-d ``expand`` of one head to many (DeepSeek's rotary key part, shared by every head)."""
    if op_kind(node) != "expand":
        return False
    src, dst = tensor_val(tensor_inputs(node)[0]), tensor_val(node)
    return src is not None and src.dim() == dst.dim() == 4 and src.shape[1] == 1 != dst.shape[1]


def _per_head_inputs(node: fx.Node) -> list[fx.Node]:
    """What ``node`` is computed from head by head: ``written_from``, but nothing past a
    broadcast over the heads, whose source no head owns: the projection making it serves every
    head and stays whole."""
    return [] if _broadcast_over_heads(node) else written_from(node)


def find_head_projections(attention_input: fx.Node, ctx: ParallelContext) -> tuple[list[fx.Node], list[fx.Node]]:
    """Walk back from an attention input to the projections making its heads; return (linears,
    nodes walked)."""
    return walk_to_linears([attention_input], _per_head_inputs, TO_ATTENTION, ctx)


def _feature_split(node: fx.Node) -> tuple[int, ...] | None:
    """The sizes a view splits the feature (last) dim of activations into: ``(heads, head_dim)``,
    or a grouped layout's ``(groups, members, head_dim)`` (Falcon's fused qkv; Bloom's
    ``(heads, 3, head_dim)``), through the views before it that split the same features (Falcon
    in transformers 5.25: ``(heads, head_dim)``, then ``(groups, members, head_dim)``). Integer
    positions viewed on the way to RoPE are no heads."""
    if op_kind(node) != "view" or not tensor_val(node).is_floating_point():
        return None
    source = arguments(node)["input"]
    while _regroups(source, node):
        source = arguments(source)["input"]
    src, dst = tensor_val(source).shape, tensor_val(node).shape
    lead = len(src) - 1
    if len(dst) > len(src) and src[:-1] == dst[:lead] and math.prod(dst[lead:]) == src[-1]:
        return tuple(dst[lead:])
    return None


def _regroups(view: fx.Node, user: fx.Node) -> bool:
    """Whether ``user`` views the features ``view`` split, their last dim kept: it can only
    split their outer parts finer, ``(heads, head_dim)`` into ``(groups, members, head_dim)``,
    not ``head_dim`` into the pairs of a rotary embedding."""
    return (_feature_split(view) is not None and op_kind(user) == "view"
            and tensor_val(user).shape[-1] == tensor_val(view).shape[-1])


def _selects_along(node: fx.Node, dim: int) -> bool:
    """Whether the first op past views and copies that picks pieces of ``node``'s value picks
    them along ``dim`` (``unbind``, an integer index, ``split``/``chunk``)."""
    ndim = tensor_val(node).dim()
    for user in node.users:
        kind = op_kind(user)
        if kind in ("permute", "transpose"):
            if not _selects_along(user, dim_order(user, ndim).index(dim)):
                return False
        elif kind == "cast":
            if not _selects_along(user, dim):
                return False
        elif kind in ("unbind", "split"):
            if split_dim(user) != dim:
                return False
        elif kind == "getitem":
            entries = per_dim(arguments(user)["index"], ndim)
            if entries is None or not isinstance(entries[dim], int):
                return False
        else:
            return False
    return bool(node.users)


def parts_major_split(view: fx.Node) -> tuple[int, int, int] | None:
    """``(parts, heads, head_dim)`` when ``view`` splits a fused projection's features part
    first, every part (q, k, v) holding all the heads, and what reads it takes one part each:
    ``qkv.view(b, s, 3, heads, head_dim)``, then ``permute`` and ``unbind`` (timm's attention,
    ModernBERT). Its units of heads are the heads; the projection is cut part by part."""
    sizes = _feature_split(view)
    if sizes is None or len(sizes) != 3 or not _selects_along(view, tensor_val(view).dim() - 3):
        return None
    return sizes


def _head_units(view: fx.Node) -> int:
    """What tp cuts a view of a projection's features into: heads, or groups of heads."""
    parts_major = parts_major_split(view)
    return parts_major[1] if parts_major else _feature_split(view)[0]


def _head_splits(linear: fx.Node, path: set[fx.Node]) -> list[fx.Node]:
    """The view splitting features on each way from a projection through ``path``: the last of
    a chain of views that split them finer."""
    splits, stack, seen = [], list(linear.users), set()
    while stack:
        node = stack.pop()
        if node in seen or node not in path:
            continue
        seen.add(node)
        finer = [u for u in node.users if u in path and _regroups(node, u) and _feature_split(u) is not None]
        if _feature_split(node) is not None and not finer:
            splits.append(node)
        else:
            stack.extend(node.users)
    return splits


def projected_heads(attention_input: fx.Node, heads: int, ctx: ParallelContext) -> tuple[int | None, str | None]:
    """``(units, problem)``: the heads (or groups of heads) one attention input's projections
    make, read off the views that split their features (None without such a view). tp shards
    them unit by unit, so each unit must group whole heads of the ``heads`` the attention reads;
    where they do not, the layout cannot be read, and ``problem`` names the views and sizes.
    Beside a view that groups heads, a split into a multiple of the heads cuts inside each head
    (rotary pairs: LTX-Video's ``unflatten(2, (-1, 2))`` before the heads are split) and says
    nothing of how heads group."""
    linears, walked = find_head_projections(attention_input, ctx)
    views = list(dict.fromkeys(v for linear in linears for v in _head_splits(linear, set(walked))))
    if any(heads % _head_units(v) == 0 for v in views):
        views = [v for v in views if _head_units(v) <= heads or _head_units(v) % heads]
    units = {_head_units(v) for v in views}
    if not views:
        return None, None
    if len(units) == 1 and heads % next(iter(units)) == 0:
        return units.pop(), None
    seen = ", ".join(f"{v.name!r} {list(tensor_val(arguments(v)['input']).shape)} -> {list(tensor_val(v).shape)}"
                     for v in views)
    return None, (f"the head layout of {attention_input.name!r} cannot be read: its projection's features are split "
                  f"by the view {seen}, whose outer sizes {sorted(units)} do not group the {heads} heads the attention "
                  f"reads")


def folds_heads(unfolded: torch.Size, folded: torch.Size) -> bool:
    """Whether ``folded`` is ``[batch * heads, seq, dim]`` of an ``unfolded`` ``[batch, heads, seq, dim]``."""
    return len(unfolded) == 4 and len(folded) == 3 and unfolded[0] * unfolded[1] == folded[0] \
        and tuple(unfolded[2:]) == tuple(folded[1:])


def unfolded_heads(node: fx.Node) -> fx.Node | None:
    """The ``[batch, heads, seq, dim]`` tensor a ``[batch * heads, seq, dim]`` one is viewed from."""
    if op_kind(node) != "view":
        return None
    source = tensor_inputs(node)[0]
    return source if folds_heads(tensor_val(source).shape, tensor_val(node).shape) else None
