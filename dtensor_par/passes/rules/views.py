"""Ops that change the shape or order of dims, not the values: a shard follows its dim."""

from __future__ import annotations

import math

import torch
import torch.fx as fx
import torch.nn.functional as F

from ...mesh import MeshInfo
from ...placements import InterleavedShard, Placement, Shard, parts_of, shard_dim
from ..meta import NodeSharding, planned_local_shape, shardings
from ..nodes import arguments, tensor_val
from .core import R, moved, norm_dim, replaced_by, replicate_all, resolve_partial
from .registry import op_kind, register


def view_groups(src: tuple[int, ...], dst: tuple[int, ...]) -> list[tuple[list[int], list[int]]]:
    """Pair runs of source and destination dims whose sizes have equal products."""
    groups, i, j = [], 0, 0
    while i < len(src) and j < len(dst):
        gi, gj, pi, pj = [i], [j], src[i], dst[j]
        i, j = i + 1, j + 1
        while pi != pj:
            if pi < pj:
                gi.append(i); pi *= src[i]; i += 1
            else:
                gj.append(j); pj *= dst[j]; j += 1
        groups.append((gi, gj))
    if groups:  # trailing size-1 dims join the last group
        groups[-1][0].extend(range(i, len(src)))
        groups[-1][1].extend(range(j, len(dst)))
    return groups


def _refinement(src: tuple[int, ...], dst: tuple[int, ...]) -> tuple[int, ...] | None:
    """The shape that both ``src`` and ``dst`` are made from by merging dims (``[2, 16, 32]`` and
    ``[128, 8]``: ``[2, 16, 4, 8]``), if there is one: a view is then a split followed by a merge."""
    if not all(isinstance(n, int) and n > 0 for n in (*src, *dst)):
        return None  # a symbolic or empty dim: read as it is
    src, dst, mid = [n for n in src if n != 1], [n for n in dst if n != 1], []
    while src and dst:
        a, b = src[0], dst[0]
        if a % b and b % a:
            return None
        mid.append(min(a, b))
        src[0], dst[0] = a // mid[-1], b // mid[-1]
        src, dst = src[src[0] == 1:], dst[dst[0] == 1:]
    return tuple(mid) if not src and not dst else None


def view_target(src: tuple[int, ...], dst: tuple[int, ...], p: Placement, pieces: int) -> Placement | None:
    """Placement of a view's output given its input's, cut into ``pieces`` (ranks times the
    chunks each holds: a zigzag sequence's two), or None when no shard survives. A view that
    both splits and merges the shard's dims is read as the split, then the merge (Qwen3-Next's
    gate, ``[B, S, H * d] -> [B * S * H, d]``: the heads cut, then parts of the rows)."""
    out = _view_target(src, dst, p, pieces)
    mid = _refinement(src, dst) if out is None else None
    if not mid or mid in (tuple(src), tuple(dst)):
        return out
    split = _view_target(src, mid, p, pieces)
    return _view_target(mid, dst, split, pieces) if split is not None else None


def _view_target(src: tuple[int, ...], dst: tuple[int, ...], p: Placement, pieces: int) -> Placement | None:
    for gi, gj in view_groups(src, dst):
        if p.dim not in gi:
            continue
        outer = [d for d in gj if dst[d] != 1]
        before = [src[d] for d in gi[:gi.index(p.dim)] if src[d] != 1]
        if before:  # merged into the dims before it: (batch, seq) -> batch * seq, seq sharded
            if len(outer) != 1:
                return None
            # This rank holds its piece of each part of each batch entry's run: those are the parts.
            after = math.prod(src[d] for d in gi[gi.index(p.dim) + 1:])
            return InterleavedShard(outer[0], tuple(part * after for part in parts_of(p, src[p.dim]))
                                    * math.prod(before))
        if not outer:
            return None
        if isinstance(p, InterleavedShard):
            if dst[outer[0]] == src[p.dim]:
                return InterleavedShard(outer[0], p.parts)
            after = math.prod(src[d] for d in gi[gi.index(p.dim) + 1:])
            return _interleaved_units(p, after, dst, outer, pieces) or \
                _split_repeated_parts(p, dst, outer, pieces)
        keeps_length = dst[outer[0]] == src[p.dim]  # the shard's layout is the input's: even or padded
        return Shard(outer[0]) if keeps_length or dst[outer[0]] % pieces == 0 else None
    return None


def _interleaved_units(p: InterleavedShard, after: int, dst: tuple[int, ...], outer: list[int],
                       pieces: int) -> Placement | None:
    """An interleaved dim (with the ``after`` elements of the dims it merges with) viewed as
    ``outer`` dims where each part is whole units of the first, and each rank's piece of a part
    too: the parts counted in those units (a projection's features cut in halves, viewed as
    heads of ``d``: DiffLlama's ``[B, S, H * d] -> [B, S, H, d]``; kv heads merged with their
    repeats: ``[B, KV, rep, S, d] -> [B, KV * rep, S, d]``)."""
    unit = math.prod(dst[d] for d in outer[1:])
    if any(part * after % unit or part * after // unit % pieces for part in p.parts):
        return None
    return InterleavedShard(outer[0], tuple(part * after // unit for part in p.parts))


def _split_repeated_parts(p: InterleavedShard, dst: tuple[int, ...], outer: list[int], pieces: int) -> Placement | None:
    """An interleaved dim whose parts repeat once per entry of the leading ``outer`` dims of
    ``dst`` (one or more), split into them: each entry holds its whole parts, cut alike, along
    the next dim (tokens of every batch entry tiled once per expert, ``[E * B * S] -> [E, B * S]``;
    a joint text + image sequence flattened with its batch and viewed back; heads flattened
    with the batch and sequence, ``[B * S * H, d] -> [B, S, H, d]``: Qwen3-Next's gated norm);
    None when the split cuts a part."""
    count = len(p.parts)
    for k in range(1, len(outer)):
        entries = math.prod(dst[d] for d in outer[:k])
        if count % entries:
            continue
        entry, run = p.parts[:count // entries], dst[outer[k]]
        if entry * entries == p.parts and len(entry) == 1 and run % pieces == 0:
            return Shard(outer[k])
        if entry * entries == p.parts and len(entry) > 1 and run == sum(entry):
            return InterleavedShard(outer[k], entry)
    return None


def view_rule(node, ins, cur, env):
    p = cur[0]
    if shard_dim(p) is None:
        return NodeSharding(p, tuple(cur))
    src, dst = tuple(tensor_val(ins[0]).shape), tuple(tensor_val(node).shape)
    out = view_target(src, dst, p, env.size * env.chunks_per_rank)
    if out is not None and env.padded(src[p.dim]) and dst[out.dim] != src[p.dim]:
        out = None  # the padding sits at the end of the sharded dim, not of a merged one
    if out is None:
        return replicate_all(node, ins, cur, f"view {list(src)} -> {list(dst)} splits the sharded dim {p.dim}")
    return NodeSharding(out, tuple(cur))


def expand_rule(node, ins, cur, env):
    p = cur[0]
    if shard_dim(p) is None:
        return NodeSharding(p, tuple(cur))
    offset = tensor_val(node).dim() - tensor_val(ins[0]).dim()
    return NodeSharding(moved(p, p.dim + offset), tuple(cur))


def repeat_rule(node, ins, cur, env):
    """``x.repeat(*repeats)``, which tiles each dim (new ones in front): a shard stays where its
    dim is tiled once (LTX-Video's rotary grid of positions, ``grid.repeat(batch, 1, 1, 1)``).
    Tiled more, each tile holds this rank's parts: the shard's parts, once per tile (Llama 4's
    tokens tiled once per expert, ``x.repeat(E, 1)``); a padded dim is gathered (its padding
    would sit inside the tiles)."""
    p = resolve_partial(ins, cur, env)[0]
    if shard_dim(p) is None:
        return NodeSharding(p, (p,))
    repeats = arguments(node)["repeats"]
    offset = len(repeats) - tensor_val(ins[0]).dim()
    tiles, length = repeats[p.dim + offset], tensor_val(ins[0]).shape[p.dim]
    if tiles == 1:
        return NodeSharding(moved(p, p.dim + offset), (p,))
    if env.padded(length):
        return replicate_all(node, ins, [p], f"repeat {list(repeats)} along the padded dim {p.dim}")
    return NodeSharding(InterleavedShard(p.dim + offset, parts_of(p, length) * tiles), (p,))


def repeat_interleave_rule(node, ins, cur, env):
    """Each element repeated in place: the shard of the repeated tensor is the repeated shard."""
    p, dim = cur[0], arguments(node)["dim"]
    if len(ins) != 1 or dim is None:
        return replicate_all(node, ins, cur, "repeat_interleave of a flattened tensor or with tensor repeats")
    repeated = shard_dim(p) == norm_dim(dim, tensor_val(ins[0]).dim())
    if repeated and isinstance(p, InterleavedShard):
        return replicate_all(node, ins, cur, "repeat_interleave along an interleaved dim")
    if repeated and env.padded(tensor_val(ins[0]).shape[p.dim]):
        return replicate_all(node, ins, cur, "repeat_interleave along the padded sequence dim")
    return NodeSharding(p, (p,))


def interpolate_rule(node, ins, cur, env):
    """Resampling keeps a shard of the batch or the channels. Nearest upsampling by a whole
    factor repeats each row in place, so an equal shard of a spatial dim stays as well (a UNet's
    image rows cut over cp); any other resampling along a cut dim mixes rows: gathered."""
    p = resolve_partial(ins, cur, env)[0]
    if shard_dim(p) is None or (isinstance(p, Shard) and p.dim < 2):
        return NodeSharding(p, (p,))
    mode, rows = arguments(node).get("mode", "nearest"), tensor_val(ins[0]).shape[p.dim]
    if isinstance(p, Shard) and mode in ("nearest", "nearest-exact") and tensor_val(node).shape[p.dim] % rows == 0 \
            and not env.padded(rows):
        return NodeSharding(p, (p,))
    return replicate_all(node, ins, [p], f"interpolate ({mode}) along the cut dim {p.dim}: not nearest by a whole "
                                         f"factor, or its rows padded or cut part by part")


def localize_interpolate(gm: fx.GraphModule, node: fx.Node, mesh: MeshInfo) -> None:
    """An output ``size`` given is this rank's."""
    given = arguments(node)
    if given.get("size") is not None:
        given["size"] = tuple(planned_local_shape(node, mesh)[2:])
        node.args, node.kwargs = (), given


def dim_order(node: fx.Node, ndim: int) -> list[int]:
    """Output dim i comes from input dim order[i]."""
    if op_kind(node) == "transpose":
        if node.target in ("t", torch.t, torch.ops.aten.numpy_T):
            return list(reversed(range(ndim)))
        given = arguments(node)
        swapped = ("axis0", "axis1") if "axis0" in given else ("dim0", "dim1")  # swapaxes names them axes
        a, b = (norm_dim(given[name], ndim) for name in swapped)
        order = list(range(ndim))
        order[a], order[b] = order[b], order[a]
        return order
    if op_kind(node) == "movedim":  # read off a tensor whose dim i is i + 1 long
        given, sizes = arguments(node), torch.empty(tuple(range(1, ndim + 1)), device="meta")
        return [n - 1 for n in sizes.movedim(given["source"], given["destination"]).shape]
    dims = arguments(node)["dims"]
    return [norm_dim(d, ndim) for d in ((dims,) if isinstance(dims, int) else dims)]


def permute_rule(node, ins, cur, env):
    p = cur[0]
    if shard_dim(p) is None:
        return NodeSharding(p, tuple(cur))
    order = dim_order(node, tensor_val(ins[0]).dim())
    return NodeSharding(moved(p, order.index(p.dim)), tuple(cur))


def complex_rule(node, ins, cur, env):
    """``view_as_complex`` folds the last dim (the real/imaginary pair), ``view_as_real``
    unfolds it: a shard of any other dim stays where it is."""
    p = resolve_partial(ins, cur, env)[0]
    if shard_dim(p) is not None and p.dim == tensor_val(ins[0]).dim() - 1:
        return replicate_all(node, ins, [p], "view_as_complex of the sharded last dim")
    return NodeSharding(p, (p,))


def pad_rule(node, ins, cur, env):
    """``F.pad`` pads trailing dims: a shard of an unpadded dim stays where it is."""
    p = resolve_partial(ins, cur, env)[0]
    widths = arguments(node)["pad"]
    ndim = tensor_val(ins[0]).dim()
    padded = {ndim - 1 - i // 2 for i, w in enumerate(widths) if w}
    if shard_dim(p) is not None and p.dim in padded:
        return replicate_all(node, ins, [p], f"padding of the sharded dim {p.dim}")
    return NodeSharding(p, (p,))


def localize_view(gm: fx.GraphModule, node: fx.Node, mesh: MeshInfo) -> None:
    """A view or expand of a sharded tensor takes this rank's sizes of its output."""
    if all(shard_dim(s.out) is None and shard_dim(s.inputs[0]) is None for s in shardings(node).values()):
        return
    local = planned_local_shape(node, mesh)
    method = "expand" if op_kind(node) == "expand" else "reshape"
    replaced_by(gm, node, "call_method", method, (arguments(node)["input"], *local))


def sequence_start(x: torch.Tensor) -> torch.Tensor:
    """Where a sequence made inside the graph (a patch embedding's tokens) starts to be
    sharded over cp. sequence_pass inserts it; it asks for its input cut along the sequence, which
    localize does as for any other edge (``shard_local``: nothing sent). It stays in the local
    graph, an identity that shows where the cut is."""
    return x


def sequence_start_rule(node, ins, cur, env):
    p = Shard(1) if env.cuts_sequence and cur[0] == R else cur[0]
    return NodeSharding(p, (p,))


register("view", "views", view_rule, functions=[torch.reshape, torch.flatten, torch.unflatten, torch.squeeze,
                                                 torch.unsqueeze],
         methods=["view", "reshape", "flatten", "unflatten", "squeeze", "unsqueeze", "view_as", "reshape_as"],
         localize=localize_view)
register("repeat", "views", repeat_rule, methods=["repeat"])
register("expand", "views", expand_rule, functions=[torch.broadcast_to], methods=["expand", "expand_as"],
         localize=localize_view)
register("transpose", "views", permute_rule, functions=[torch.transpose, torch.swapaxes, torch.t,
                                                        torch.ops.aten.numpy_T],  # w.T, as torch 2.14 records it
         methods=["transpose", "swapaxes", "t"])
register("permute", "views", permute_rule, functions=[torch.permute], methods=["permute"])
register("movedim", "views", permute_rule, functions=[torch.movedim, torch.moveaxis], methods=["movedim", "moveaxis"])
register("repeat_interleave", "views", repeat_interleave_rule, functions=[torch.repeat_interleave],
         methods=["repeat_interleave"])
register("interpolate", "views", interpolate_rule, functions=[F.interpolate], localize=localize_interpolate)
register("complex", "views", complex_rule, functions=[torch.view_as_complex, torch.view_as_real])
register("pad", "views", pad_rule, functions=[F.pad, torch._C._nn.pad])
register("sequence_start", "views", sequence_start_rule, functions=[sequence_start])
