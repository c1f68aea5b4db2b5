"""Ops that select or join pieces of tensors: indexing, split, unbind, cat, stack, embedding.

A fused projection's output cut back into its parts, or a joint sequence cut back into
text and image, keeps each part sharded: the slice bounds become this rank's part bounds.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
import torch.nn.functional as F

from ...errors import NotSupported
from ...mesh import MeshInfo
from ...placements import InterleavedShard, Partial, Placement, Shard, parts_of, shard_dim, shard_length
from ...symbolic import is_symbolic
from ...ops.collectives import shard_positions
from ...ops.vocab import vocab_rows_embedding
from ..meta import NodeSharding, global_shape, shardings
from ..nodes import arguments, tensor_val
from .core import R, moved, norm_dim, replicate_all, resolve_partial
from .registry import op_kind, register


def _static_slice(e) -> bool:
    """A slice whose bounds are Python ints or None (not sizes computed in the graph)."""
    return isinstance(e, slice) and all(isinstance(v, (int, type(None))) for v in (e.start, e.stop, e.step))


def _whole(e: slice, size: int) -> bool:
    """Whether a slice keeps every position of a dim of ``size`` (``x[:, 0:]`` as ``x[:, :]``);
    of a symbolic size, only when it does for every value (asking would pin the plan to one)."""
    if is_symbolic(size):
        return e.start in (None, 0) and e.stop is None and e.step in (None, 1)
    return e.indices(size) == (0, size, 1)


def _picks(e) -> bool:
    """Whether an index entry picks positions by a list of ints (Falcon's ``qkv[:, :, :, [-2]]``)."""
    return isinstance(e, list) and all(isinstance(i, int) for i in e)


def _index_map(index, shape: tuple[int, ...]) -> dict[int, int] | None:
    """Input dim -> output dim for the dims an index keeps whole; None unless it is basic, or
    picks positions by a list on one dim only among slices (which keeps that dim in place)."""
    ndim = len(shape)
    entries = index if isinstance(index, tuple) else (index,)
    picks = sum(map(_picks, entries))
    if picks > 1 or (picks and any(isinstance(e, int) for e in entries)):
        return None
    consumed = sum(1 for e in entries if e is not None and e is not Ellipsis)
    kept, src, dst = {}, 0, 0
    for e in entries:
        if e is None:
            dst += 1
        elif e is Ellipsis:
            for _ in range(ndim - consumed):
                kept[src] = dst; src += 1; dst += 1
        elif isinstance(e, int):
            src += 1
        elif isinstance(e, slice):
            if _static_slice(e) and _whole(e, shape[src]):
                kept[src] = dst
            src += 1; dst += 1
        elif _picks(e):
            src += 1; dst += 1
        else:
            return None
    for s in range(src, ndim):
        kept[s] = dst; dst += 1
    return kept


def getitem_rule(node, ins, cur, env):
    given = arguments(node)
    source, index = given["input"], given["index"]
    if isinstance(source.meta.get("val"), (tuple, list)):
        return NodeSharding(env.out_of(source)[index], ())
    kept = _index_map(index, tuple(tensor_val(source).shape))
    if isinstance(cur[0], Partial) and ins[0] is source and all(p == R for p in cur[1:]):
        return NodeSharding(cur[0], tuple(cur))  # picking elements of summands: partial sums of the picks
    if _row_index(index) and shard_dim(cur[0]) not in (None, 0) and cur[1:] == [R]:
        # rows picked by a whole index, cut off the rows (an expert bias table's [E, N] cut along N)
        return NodeSharding(moved(cur[0], cur[0].dim - 1 + tensor_val(index).dim()), tuple(cur))
    if kept is None or len(ins) != 1:
        return replicate_all(node, ins, cur, "advanced indexing")
    p = cur[0]
    if isinstance(p, Partial) or p == R:
        return NodeSharding(p, (p,))
    if p.dim not in kept:
        return _indexed_along(node, ins, cur, env)
    return NodeSharding(moved(p, kept[p.dim]), (p,))


def _row_index(index) -> bool:
    """Whether an index is one tensor of integers: it picks rows (dim 0), each a new position."""
    return isinstance(index, fx.Node) and tensor_val(index) is not None \
        and not tensor_val(index).is_floating_point() and tensor_val(index).dtype != torch.bool


def _indexed_along(node: fx.Node, ins: list[fx.Node], cur: list[Placement], env) -> NodeSharding:
    """An index that does not keep the dim ``cur[0]`` cuts whole: a position picked, whole parts
    sliced off, or every step-th position kept; anything else is gathered."""
    given, p = arguments(node), cur[0]
    if _picked_position(node, p) is not None:
        return NodeSharding(Partial(), (p,))  # the rank holding it picks it, the others zeros
    entries = per_dim(given["index"], tensor_val(given["input"]).dim())
    if entries is None:
        return replicate_all(node, ins, cur, f"indexing into the sharded dim {p.dim}")
    out_dim = p.dim - sum(1 for e in entries[:p.dim] if isinstance(e, int))
    strided = strided_slice(node, p, env)
    if strided is not None:
        return replicate_all(node, ins, cur, strided) if isinstance(strided, str) else \
            NodeSharding(moved(p, out_dim) if isinstance(p, Shard) else InterleavedShard(out_dim, strided), (p,))
    kept_parts = sliced_part_range(node, p)
    if kept_parts is None:
        return replicate_all(node, ins, cur, f"indexing into the sharded dim {p.dim}")
    parts = p.parts[kept_parts[0]:kept_parts[1]]
    return NodeSharding(Shard(out_dim) if len(parts) == 1 else InterleavedShard(out_dim, parts), (p,))


def strided_slice(node: fx.Node, p: Placement, env) -> tuple[int, ...] | str | None:
    """The parts kept (each ``part // step``) where ``node`` keeps every step-th position of the
    dim ``p`` cuts, from one of the first ``step`` to its end (GPT-OSS's interleaved gate and up:
    ``gate_up[..., ::2]``, ``gate_up[..., 1::2]``), and each rank's piece of each part holds a
    multiple of ``step`` positions: every piece then starts at a multiple of ``step``, so the
    positions a rank keeps are its piece's own ``start::step``, the same slice. Why not, where
    the pieces do not hold such a multiple; None for any other index."""
    given = arguments(node)
    shape = tensor_val(given["input"]).shape
    entries = per_dim(given["index"], len(shape))
    if entries is None or not _static_slice(entries[p.dim]) or is_symbolic(shape[p.dim]):
        return None
    start, stop, step = entries[p.dim].indices(shape[p.dim])
    if step <= 1 or start >= step or stop != shape[p.dim]:
        return None
    pieces = env.size * env.chunks_per_rank
    parts = parts_of(p, shape[p.dim])
    if any(env.padded(part) or part % (pieces * step) for part in parts):
        return (f"a slice of step {step} of dim {p.dim} (of {list(parts)}) cut over mesh dim {env.dim!r} of size "
                f"{env.size} into {pieces} pieces: a piece's length is not a multiple of the step")
    return tuple(part // step for part in parts)


def _picked_position(node: fx.Node, p: Placement) -> int | None:
    """The one position an integer index picks along the dim ``p`` shards evenly (not part by
    part), of a static length, from floating values (``x[:, 0]``: BERT's pooler; ``x[:, -1]``);
    else None. Integers and booleans are not summed over ranks: they are gathered."""
    given = arguments(node)
    shape = global_shape(given["input"]) or tensor_val(given["input"]).shape
    entries = per_dim(given["index"], len(shape))
    if (isinstance(p, InterleavedShard) or entries is None or not isinstance(entries[p.dim], int)
            or not tensor_val(given["input"]).is_floating_point()):
        return None
    length = shape[p.dim]
    return None if is_symbolic(length) else entries[p.dim] % length


def setitem_rule(node, ins, cur, env):
    """``target[index] = value`` writes into ``target`` in place, so ``target`` must stay as it
    is (a write into a gathered copy would be lost): the index must keep its sharded dim whole,
    and the value then comes sharded alike. Anything else is refused, never gathered."""
    target, index, value = (arguments(node)[name] for name in ("input", "index", "value"))
    p = env.out_of(target)
    if p == R:
        return NodeSharding(None, tuple(R for _ in ins))
    kept = _index_map(index, tuple(tensor_val(target).shape))
    if isinstance(p, Partial) or kept is None or p.dim not in kept or ins[0] is not target or len(ins) > 2:
        raise NotSupported(
            f"plan: {node.name} writes in place into {target.name} {list(tensor_val(target).shape)}, "
            f"which is {p} on mesh dim {env.dim!r}, at index {index}: a write that does not keep the sharded dim "
            f"whole cannot run on shards; write it out of place (torch.cat, torch.where)")
    if len(ins) == 1:
        return NodeSharding(None, (p,))
    written = tensor_val(target)[index]
    d = kept[p.dim] - (written.dim() - tensor_val(value).dim())
    broadcast = d < 0 or tensor_val(value).shape[d] == 1 != written.shape[kept[p.dim]]
    return NodeSharding(None, (p, R if broadcast else moved(p, d)))


def index_copy_rule(node, ins, cur, env):
    """``target.index_copy_(dim, index, source)`` (a static kv cache's write of new rows)
    writes in place, so ``target`` stays as it is: whole, it takes ``source`` whole; cut off
    ``dim``, it takes ``source`` cut alike. Anything else is refused, never gathered."""
    p = cur[0]
    if p == R:
        return NodeSharding(R, tuple(R for _ in ins))
    given = arguments(node)
    dim = norm_dim(given["dim"], tensor_val(given["input"]).dim())
    if isinstance(p, Partial) or shard_dim(p) == dim or len(ins) != 3:
        raise NotSupported(
            f"plan: {node.name} ({node.target}) writes in place along dim {dim} into {ins[0].name} "
            f"{list(tensor_val(ins[0]).shape)}, which is {p} on mesh dim {env.dim!r}: a write along a sharded dim "
            f"cannot run on shards")
    return NodeSharding(p, (p, R, p))


def per_dim(index, ndim: int) -> list | None:
    """One entry per input dim (Ellipsis spelled out), or None when the index adds dims."""
    entries = list(index if isinstance(index, tuple) else (index,))
    if any(e is None for e in entries):
        return None
    if Ellipsis in entries:
        at = entries.index(Ellipsis)
        entries[at:at + 1] = [slice(None)] * (ndim - len(entries) + 1)
    return entries + [slice(None)] * (ndim - len(entries))


def sliced_part_range(node: fx.Node, p: Placement) -> tuple[int, int] | None:
    """``(first, stop)``: the parts an index keeps, ``p.parts[first:stop]``, when it slices
    whole parts off an InterleavedShard dim (``qkv[..., :q_size]`` of a fused projection;
    ``x[:, text_len:]`` of a joint sequence)."""
    given = arguments(node)
    entries = per_dim(given["index"], tensor_val(given["input"]).dim())
    if not isinstance(p, InterleavedShard) or entries is None or not _static_slice(entries[p.dim]):
        return None
    start, stop, step = entries[p.dim].indices(sum(p.parts))
    bounds = [sum(p.parts[:i]) for i in range(len(p.parts) + 1)]
    if step != 1 or start not in bounds or stop not in bounds or start >= stop:
        return None
    return bounds.index(start), bounds.index(stop)


def split_dim(node: fx.Node) -> int:
    given = arguments(node)
    return norm_dim(given["dim"], tensor_val(given["input"]).dim())


def split_rule(node, ins, cur, env):
    p, pieces = cur[0], node.meta["val"]
    if shard_dim(p) is None:
        return NodeSharding(tuple(p for _ in pieces), (p,))
    dim = split_dim(node)
    if p.dim != dim:
        return NodeSharding(tuple(p for _ in pieces), (p,))
    sizes = tuple(t.shape[dim] for t in pieces)
    if sorted(sizes)[:-1] == [0] * (len(sizes) - 1):  # one piece is all of it, the others empty (Qwen3.5's
        return NodeSharding(tuple(p if size else R for size in sizes), (p,))  # rows kept for states: none)
    bounds = [sum(p.parts[:i]) for i in range(len(p.parts) + 1)] if isinstance(p, InterleavedShard) else None
    starts = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
    if bounds is None or not set(starts) <= set(bounds):
        return replicate_all(node, ins, cur, f"split {list(sizes)} of the sharded dim {dim}")
    # Each piece is whole parts (a joint sequence split back into text and image): each rank
    # splits its piece of every part.
    kept = [p.parts[bounds.index(start):bounds.index(stop)] for start, stop in zip(starts, starts[1:])]
    return NodeSharding(tuple(Shard(dim) if len(k) == 1 else InterleavedShard(dim, k) for k in kept), (p,))


def unbind_rule(node, ins, cur, env):
    p, pieces = cur[0], node.meta["val"]
    dim = norm_dim(arguments(node)["dim"], tensor_val(ins[0]).dim())
    if shard_dim(p) is None:
        return NodeSharding(tuple(p for _ in pieces), (p,))
    if p.dim == dim:
        return replicate_all(node, ins, cur, f"unbind of the sharded dim {dim}")
    out = moved(p, p.dim - 1) if p.dim > dim else p
    return NodeSharding(tuple(out for _ in pieces), (p,))


def cat_dim(node: fx.Node) -> int:
    return norm_dim(arguments(node)["dim"], tensor_val(node).dim())


def cat_rule(node, ins, cur, env):
    """Empty inputs (an empty kv cache: ``cat([torch.tensor([]), k])``) add nothing and stay
    as they are; the others must share one placement, sharded off the concatenated dim."""
    stack = op_kind(node) == "stack"
    dim = cat_dim(node)
    empty = [not stack and tensor_val(i).numel() == 0 for i in ins]
    real = [(i, p) for i, p, e in zip(ins, cur, empty) if not e]
    as_given = lambda required: tuple(p if e else required for p, e in zip(cur, empty))  # noqa: E731
    if all(isinstance(p, Partial) for _, p in real):
        return NodeSharding(Partial(), tuple(cur))
    resolved = resolve_partial([i for i, _ in real], [p for _, p in real], env)
    sharded = [p for p in resolved if shard_dim(p) is not None]
    if not sharded:
        return NodeSharding(R, as_given(R))
    p = sharded[0]
    if len(real) == 1:  # nothing but empties beside it: the concatenation is the tensor itself
        return NodeSharding(p, as_given(p))
    out_dim = p.dim + 1 if stack and p.dim >= dim else p.dim
    if not stack and p.dim == dim:
        if any(q != R and shard_dim(q) != dim for q in resolved):
            return replicate_all(node, ins, cur, f"concatenation along the sharded dim {dim}")
        # Each rank concatenates its piece of every input (a whole one is cut, which sends
        # nothing): its piece of every part (a joint text + image sequence, an attention
        # output beside an MLP branch), an input cut part by part adding its parts.
        cuts = iter(q if isinstance(q, InterleavedShard) else Shard(dim) for q in resolved)  # one per real input
        required = tuple(given if e else next(cuts) for given, e in zip(cur, empty))
        parts = sum((parts_of(q, tensor_val(i).shape[dim]) for i, q in zip(ins, required) if shard_dim(q) == dim), ())
        return NodeSharding(InterleavedShard(dim, parts), required)
    return NodeSharding(moved(p, out_dim), as_given(p))


def embedding_rule(node, ins, cur, env):
    """A table whole looks ids up where they are; a table cut by rows (the vocabulary, from the
    plan: ``plan.vocab_cuts``) looks every id up on each rank, giving partial sums
    (``localize_embedding``)."""
    ids_p, w_p = cur
    if type(w_p) is Shard and w_p.dim == 0 and ids_p == R and not env.pads:
        return NodeSharding(Partial(), (R, w_p))
    if w_p != R or isinstance(ids_p, Partial):
        return replicate_all(node, ins, cur, "sharded embedding table")
    return NodeSharding(ids_p, (ids_p, R))


def localize_embedding(gm: fx.GraphModule, node: fx.Node, mesh: MeshInfo) -> None:
    """A table cut by rows over a mesh dim: this rank's rows looked up, zeros for the other ids
    (``ops.vocab.vocab_rows_embedding``); the planned all-reduce (or reduce-scatter) sums them."""
    for name, sharding in shardings(node).items():
        if isinstance(sharding.out, Partial) and sharding.inputs[1] == Shard(0):
            given = arguments(node)
            node.target, node.kwargs = vocab_rows_embedding, {}
            node.args = (given["input"], given["weight"], mesh.dims[name].rank, given["padding_idx"])


def localize_getitem(gm: fx.GraphModule, node: fx.Node, mesh: MeshInfo) -> None:
    """A slice of whole parts of an interleaved dim takes this rank's bounds of those parts; a
    position picked along a sharded dim is this rank's row of it where it holds it, else zeros
    (the partial sums ``getitem_rule`` planned)."""
    given = arguments(node)
    if not isinstance(given["index"], (tuple, slice, int)) or isinstance(given["input"].meta.get("val"), (tuple, list)):
        return  # an item of a tuple (a split's pieces) is as planned
    entries = None
    for name, sharding in shardings(node).items():
        p = sharding.inputs[0] if sharding.inputs else None
        picked = _picked_position(node, p) if isinstance(sharding.out, Partial) and shard_dim(p) is not None else None
        if picked is not None:
            shape = global_shape(given["input"])
            held = shard_positions(shape[p.dim], mesh.dims[name]).tolist()
            entries = entries or per_dim(given["index"], len(shape))
            if picked in held:
                entries[p.dim] = held.index(picked)
            else:
                entries[p.dim] = 0  # any row of this rank's: its readers get zeros
                _zeros_in_place_of(gm, node)
            continue
        kept_parts = sliced_part_range(node, p)
        if kept_parts is None:
            continue
        entries = entries or per_dim(given["index"], tensor_val(given["input"]).dim())
        local = [shard_length(part, mesh.size(name), mesh.dims[name].chunks_per_rank) for part in p.parts]
        entries[p.dim] = slice(sum(local[:kept_parts[0]]), sum(local[:kept_parts[1]]))
    if entries is not None:
        node.args = (given["input"], tuple(entries))


def _zeros_in_place_of(gm: fx.GraphModule, node: fx.Node) -> None:
    """Every reader of ``node`` reads zeros of its shape instead, computed from it: its
    gradient is then zeros too, and a rank's output that is only zeros still has a backward."""
    with gm.graph.inserting_after(node):
        nowhere = gm.graph.call_function(torch.zeros_like, (node,), {"dtype": torch.bool})
        with gm.graph.inserting_after(nowhere):
            zeros = gm.graph.call_function(torch.where, (nowhere, node, 0.0))
    nowhere.meta.update(node.meta)
    zeros.meta.update(node.meta)
    node.replace_all_uses_with(zeros, delete_user_cb=lambda user: user not in (zeros, nowhere))


def localize_split(gm: fx.GraphModule, node: fx.Node, mesh: MeshInfo) -> None:
    """Split sizes along a sharded dim become this rank's sizes (chunk counts stay)."""
    if node.target not in ("split", "split_with_sizes", torch.split):
        return
    given = arguments(node)
    sizes = given.get("split_sizes", given.get("split_size"))  # split_with_sizes names them sizes
    for name, sharding in shardings(node).items():
        if shard_dim(sharding.inputs[0]) == split_dim(node):
            n, chunks = mesh.size(name), mesh.dims[name].chunks_per_rank
            sizes = sizes // n if isinstance(sizes, int) else \
                [sum(shard_length(part, n, chunks) for part in parts_of(piece, size))
                 for piece, size in zip(sharding.out, sizes)]
    node.args, node.kwargs = (given["input"], sizes, given["dim"]), {}


register("getitem", "indexing", getitem_rule, functions=[operator.getitem], localize=localize_getitem)
register("setitem", "indexing", setitem_rule, functions=[operator.setitem])
register("index_copy", "indexing", index_copy_rule, methods=["index_copy_", "index_copy"])
register("split", "indexing", split_rule, functions=[torch.chunk, torch.split],
         methods=["chunk", "split", "split_with_sizes"], localize=localize_split)
register("unbind", "indexing", unbind_rule, functions=[torch.unbind], methods=["unbind"])
register("cat", "indexing", cat_rule, functions=[torch.cat, torch.concat, torch.concatenate])
register("stack", "indexing", cat_rule, functions=[torch.stack])
register("embedding", "indexing", embedding_rule, functions=[F.embedding, vocab_rows_embedding],
         localize=localize_embedding)
