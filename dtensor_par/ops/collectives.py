"""Redistributions between placements, with the autograd of a replicated loss.

Every rank computes the same loss, so gradients follow DTensor's (Megatron's f/g) rules, not
the sum-of-per-rank-losses rules of torch's functional-collective autograd:

======================  =====================  ==========================
forward                 placement change       backward
======================  =====================  ==========================
all_reduce              Partial -> Replicate   identity
reduce_scatter          Partial -> Shard       all_gather
all_gather              Shard -> Replicate     local slice
all_gather_partial_grad Shard -> Replicate,    reduce_scatter
                        used by a rank-local
                        computation
shard_local             Replicate -> Shard     all_gather
all_to_all              Shard(a) -> Shard(b)   all_to_all back
grad_all_reduce         Replicate used by a    all_reduce (the gradient
(identity)              rank-local computation is a per-rank partial)
grad_all_reduce_bucket  as grad_all_reduce,    one all_reduce of the
(identity)              for several inputs     gradients, flattened into
                                               one bucket
grad_as_partial         Replicate used where   the gradient on coordinate
(identity)              its gradient is summed 0, zeros elsewhere
gather_params           FSDP: parameter        one reduce_scatter of the
                        pieces -> whole        gradients, flattened
gather_stacked          every rank's piece,    reduce_scatter (each rank's
                        stacked by rank (a     piece is read by others)
                        conv's halo rows)
======================  =====================  ==========================

A sequence dim whose length does not divide over cp is padded at the end to equal chunks
(``_pad``); every gather cuts the padding off again, so an op that mixes along the sequence
sees exactly the real positions, and attention masks the padded keys.

Each public function is what a localized graph calls; its primitives come from
``ops.lowerings``, picked by its ``comm`` argument: with the functional lowering a traced graph
shows each collective as a ``torch.ops._c10d_functional`` op, which inductor may schedule.
"""

from __future__ import annotations

import itertools
import math

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ..mesh import MeshDim
from ..placements import InterleavedShard, Placement, Shard, interleaved_parts, parts_of, shard_dim, shard_length
from .lowerings import FUNCTIONAL, LOWERINGS
from .sequence_layout import zigzag_indices


def _placement(dim: int, parts: tuple[int, ...] | None) -> Placement:
    return Shard(dim) if parts is None else InterleavedShard(dim, parts)


def _sequence_index(length: int, mesh_dim: MeshDim) -> torch.Tensor | None:
    """Positions of a dim sharded over ``mesh_dim`` in shard order, for the zigzag layout.

    The dim is cut into 2 * ring chunks; ring rank r holds chunks r and 2 * ring - 1 - r (so
    causal attention costs every ring rank the same), split further among its ulysses ranks.
    None for a contiguous layout.
    """
    if not mesh_dim.zigzag:
        return None
    return torch.cat([zigzag_indices(length, mesh_dim.zigzag, r) for r in range(mesh_dim.zigzag)])


def _laid_out_length(length: int, mesh_dim: MeshDim) -> int:
    """The length a dim of ``length`` sharded over ``mesh_dim`` is laid out with: padded at the
    end to equal chunks, two per rank in the zigzag layout."""
    return mesh_dim.size * shard_length(length, mesh_dim.size, mesh_dim.chunks_per_rank)


def _rank_positions(laid_out: int, mesh_dim: MeshDim) -> torch.Tensor:
    """``[ranks, rows]``: the global positions each rank holds of a dim laid out ``laid_out`` long."""
    order = _sequence_index(laid_out, mesh_dim)
    return (torch.arange(laid_out) if order is None else order).view(mesh_dim.size, -1)


def every_rank_positions(length: int, mesh_dim: MeshDim) -> torch.Tensor:
    """``[ranks, rows]``: the global position of each row each rank holds of a dim of ``length``
    sharded over ``mesh_dim``, in local order; the padding that evens out a sequence sits at
    ``>= length``."""
    return _rank_positions(_laid_out_length(length, mesh_dim), mesh_dim)


def shard_positions(length: int, mesh_dim: MeshDim) -> torch.Tensor:
    """This rank's row of ``every_rank_positions``."""
    return every_rank_positions(length, mesh_dim)[mesh_dim.rank]


def joint_order(parts: tuple[int, ...], mesh_dim: MeshDim) -> torch.Tensor:
    """For a joint sequence (text and image tokens) whose parts are each sharded over
    ``mesh_dim`` on their own (unpadded) and concatenated per rank: the global position of each position
    of one plain sequence of their total length laid out alike (``order[believed] = held``).
    A mask of the joint sequence indexed by it is the mask of the sequence the ranks hold, read
    as a plain one."""
    offsets = [sum(parts[:i]) for i in range(len(parts))]
    held = torch.cat([offset + _rank_positions(part, mesh_dim) for offset, part in zip(offsets, parts)], dim=1)
    order = torch.empty(sum(parts), dtype=torch.long)
    order[_rank_positions(sum(parts), mesh_dim).flatten()] = held.flatten()
    return order


def _pad(x: torch.Tensor, dim: int, length: int, *, edge: bool) -> torch.Tensor:
    """``x`` padded at the end of ``dim`` to ``length``.

    Values are padded with copies of the last position (``edge``): padding tokens then look
    like real ones, so no per-token op turns them into inf or NaN, which a backward would
    spread through 0 * NaN. Gradients are padded with zeros: padding never reaches a result.
    """
    extra = length - x.shape[dim]
    if statically_known_true(extra == 0):
        return x
    if isinstance(extra, torch.SymInt):  # padded by 0 or more for different lengths: no branch on which
        return _pad_symbolic(x, dim, length, edge=edge)
    last = x.narrow(dim, x.shape[dim] - 1, 1)
    tail = (last if edge else torch.zeros_like(last)).expand(*x.shape[:dim], extra, *x.shape[dim + 1:])
    return torch.cat([x, tail], dim=dim)


def _pad_symbolic(x: torch.Tensor, dim: int, length: torch.SymInt, *, edge: bool) -> torch.Tensor:
    """``_pad`` for a symbolic length, one graph for every amount of padding: gather each
    position, the last one repeated (edge), or with zeros past the end."""
    positions = torch.arange(length, device=x.device)
    padded = x.index_select(dim, positions.clamp(max=x.shape[dim] - 1))
    if edge:
        return padded
    real = (positions < x.shape[dim]).view([-1 if d == dim else 1 for d in range(x.dim())])
    return torch.where(real, padded, torch.zeros((), dtype=x.dtype, device=x.device))


def _part_piece(x: torch.Tensor, dim: int, mesh_dim: MeshDim, chunk: int, edge: bool) -> torch.Tensor:
    """Chunk ``chunk`` of one sharded run of ``dim``: padded, in the zigzag order if any."""
    x = _pad(x, dim, _laid_out_length(x.shape[dim], mesh_dim), edge=edge)
    index = _sequence_index(x.shape[dim], mesh_dim)
    n = x.shape[dim] // mesh_dim.size
    if index is None:
        return x.narrow(dim, chunk * n, n)
    return x.index_select(dim, index[chunk * n:(chunk + 1) * n].to(x.device))


def _piece(x: torch.Tensor, p: Placement, mesh_dim: MeshDim, chunk: int, *, edge: bool = True) -> torch.Tensor:
    """Chunk ``chunk`` of a full tensor under placement ``p`` over ``mesh_dim``: its piece of
    each part of an InterleavedShard, every part laid out as a Shard is."""
    if shard_dim(p) is None:
        return x
    sizes = list(parts_of(p, x.shape[p.dim]))
    if len(sizes) == 1:  # a plain Shard: no split (each op here is one more for AOTAutograd to trace)
        return _part_piece(x, p.dim, mesh_dim, chunk, edge)
    pieces = [_part_piece(part, p.dim, mesh_dim, chunk, edge) for part in x.split(sizes, dim=p.dim)]
    return torch.cat(pieces, dim=p.dim)


def _pieces(x: torch.Tensor, p: Placement, mesh_dim: MeshDim, *, edge: bool = True) -> torch.Tensor:
    """Every chunk of ``x``, stacked in chunk order."""
    return torch.stack([_piece(x, p, mesh_dim, c, edge=edge) for c in range(mesh_dim.size)])


def _in_order(full: torch.Tensor, dim: int, mesh_dim: MeshDim, length: int | None) -> torch.Tensor:
    """A run of ``dim`` gathered in chunk order, put in sequence order and cut to ``length``."""
    index = _sequence_index(full.shape[dim], mesh_dim)
    if index is not None:
        full = full.index_select(dim, torch.argsort(index).to(full.device))
    if length is None or statically_known_true(length == full.shape[dim]):
        return full
    if isinstance(length, torch.SymInt):  # a narrow would branch on whether it cuts anything
        return full.index_select(dim, torch.arange(length, device=full.device))
    return full.narrow(dim, 0, length)


def _assemble(by_chunk: torch.Tensor, dim: int, parts: tuple[int, ...] | None, mesh_dim: MeshDim,
              length: int | None) -> torch.Tensor:
    """The full tensor from every chunk (stacked in chunk order), cut to ``length`` if it was
    padded; an InterleavedShard part by part."""
    if parts is None:  # chunk c's rows follow chunk c - 1's: one copy, not a cat of every chunk
        dim %= by_chunk.dim() - 1
        return _in_order(by_chunk.movedim(0, dim).flatten(dim, dim + 1), dim, mesh_dim, length)
    by_chunk = by_chunk.unbind(0)
    local_parts = [_laid_out_length(part, mesh_dim) // mesh_dim.size for part in parts]
    per_chunk = [c.split(local_parts, dim=dim) for c in by_chunk]
    return torch.cat([_in_order(torch.cat([c[i] for c in per_chunk], dim=dim), dim, mesh_dim, part)
                      for i, part in enumerate(parts)], dim=dim)


def _gather(x: torch.Tensor, dim: int, parts: tuple[int, ...] | None, mesh_dim: MeshDim, length: int | None,
            comm: str) -> torch.Tensor:
    return _assemble(LOWERINGS[comm].all_gather(x, mesh_dim), dim, parts, mesh_dim, length)


def _reduce_scatter(x: torch.Tensor, p: Placement, mesh_dim: MeshDim, comm: str, *, edge: bool = True) -> torch.Tensor:
    """Sum over ranks, keeping this rank's piece under placement ``p``."""
    return LOWERINGS[comm].reduce_scatter(_pieces(x, p, mesh_dim, edge=edge), mesh_dim)


def _all_to_all(x: torch.Tensor, src_dim: int, dst_dim: int, mesh_dim: MeshDim, length: int | None, comm: str,
                *, edge: bool = True) -> torch.Tensor:
    """Local shard of ``src_dim`` (global ``length`` if padded) -> local shard of ``dst_dim``."""
    received = LOWERINGS[comm].all_to_all(_pieces(x, Shard(dst_dim), mesh_dim, edge=edge), mesh_dim)
    return _assemble(received, src_dim, None, mesh_dim, length)


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, mesh_dim, comm):
        return LOWERINGS[comm].all_reduce(x, mesh_dim)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


def _reduced_grad(grad: torch.Tensor, mesh_dim: MeshDim, comm: str, divisor: int) -> torch.Tensor:
    """The sum over ``mesh_dim`` of every rank's gradient, divided by ``divisor`` (DDP's average
    over dp: each rank's loss is the mean over its own slice of the batch); over a mesh dim of
    one rank, only divided."""
    total = grad if mesh_dim.size == 1 else LOWERINGS[comm].all_reduce(grad, mesh_dim)
    return total if divisor == 1 else total / divisor


class _GradAllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, mesh_dim, comm, divisor):
        ctx.args = (mesh_dim, comm, divisor)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _reduced_grad(grad, *ctx.args), None, None, None


class _GradAllReduceBucket(torch.autograd.Function):
    """Many grad_all_reduces as one: its backward runs once every gradient of the bucket is
    produced, and reduces them all in one flat all_reduce."""

    @staticmethod
    def forward(ctx, mesh_dim, comm, divisor, *xs):
        ctx.args = (mesh_dim, comm, divisor)
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx, *grads):
        flat = _reduced_grad(_flatten(grads), *ctx.args)
        return None, None, None, *_unflatten(flat, [g.shape for g in grads])


def _cat_flat(xs: list[torch.Tensor]) -> torch.Tensor:
    """``xs`` flattened and concatenated into one new 1-D tensor."""
    return torch.cat([x.reshape(-1) for x in xs])


def _split_copies(flat: torch.Tensor, shapes: list) -> list[torch.Tensor]:
    """``flat`` cut into consecutive pieces of ``shapes``, each in its own storage: a view would
    keep the whole bucket alive while any one gradient is held."""
    pieces = torch.split_with_sizes_copy(flat, [math.prod(shape) for shape in shapes])
    return [piece.view(shape) for piece, shape in zip(pieces, shapes)]


# The same two steps as one custom op each, where a reshape, a split piece and a view per
# gradient would each cost AOTAutograd a traced op (a third of a ring graph's nodes). Only the
# compilers that run custom ops get them (aot_eager and inductor, on CPU and CUDA); Neuron's
# StableHLO lowering and XLA know aten ops only.
OPAQUE_DEVICES = ("cpu", "cuda")


@torch.library.custom_op("dtensor_par::flatten_cat", mutates_args=())
def flatten_cat(xs: list[torch.Tensor]) -> torch.Tensor:
    return _cat_flat(xs)


@flatten_cat.register_fake
def _(xs):
    return xs[0].new_empty(sum(x.numel() for x in xs))


def _shapes(sizes: list[int], ndims: list[int]) -> list[list[int]]:
    """The shapes ``unflatten_copy`` is given flat: ``ndims[i]`` sizes each, in order."""
    return [sizes[end - n:end] for end, n in zip(itertools.accumulate(ndims), ndims)]


@torch.library.custom_op("dtensor_par::unflatten_copy", mutates_args=())
def unflatten_copy(flat: torch.Tensor, sizes: list[int], ndims: list[int]) -> list[torch.Tensor]:
    return _split_copies(flat, _shapes(sizes, ndims))


@unflatten_copy.register_fake
def _(flat, sizes, ndims):
    return [flat.new_empty(shape) for shape in _shapes(sizes, ndims)]


def _flatten(xs: list[torch.Tensor]) -> torch.Tensor:
    return flatten_cat(xs) if xs[0].device.type in OPAQUE_DEVICES else _cat_flat(xs)


def _unflatten(flat: torch.Tensor, shapes: list) -> list[torch.Tensor]:
    if flat.device.type in OPAQUE_DEVICES:
        return unflatten_copy(flat, [size for shape in shapes for size in shape], [len(shape) for shape in shapes])
    return _split_copies(flat, shapes)


class _GradAsPartial(torch.autograd.Function):
    """Identity; in backward only coordinate 0 of ``mesh_dim`` keeps the gradient, the others
    send zeros: a gradient every rank holds whole becomes a partial sum that equals it."""

    @staticmethod
    def forward(ctx, x, mesh_dim):
        ctx.keeps = mesh_dim.rank == 0
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return (grad if ctx.keeps else torch.zeros_like(grad)), None


class _GatherParams(torch.autograd.Function):
    """FSDP's gather of parameter pieces, many in one flat all-gather, sent cast to ``dtype``
    (FSDP2's ``param_dtype``); backward reduce-scatters their gradients in one flat bucket in
    ``grad_dtype`` (``reduce_dtype``), divided by ``divisor`` (the dp size, under
    ``batch="local"``: DDP's average), and hands each back in its piece's dtype."""

    @staticmethod
    def forward(ctx, dims, mesh_dim, comm, divisor, dtype, grad_dtype, *pieces):
        ctx.args = (dims, mesh_dim, comm, divisor, grad_dtype, [p.shape for p in pieces], [p.dtype for p in pieces])
        pieces = [p if dtype is None else p.to(dtype) for p in pieces]
        by_chunk = LOWERINGS[comm].all_gather(_flatten(pieces), mesh_dim)
        columns = by_chunk.split([p.numel() for p in pieces], dim=1)
        return tuple(_assemble(c.reshape(mesh_dim.size, *p.shape), d, None, mesh_dim, None)
                     for c, p, d in zip(columns, pieces, dims))

    @staticmethod
    def backward(ctx, *grads):
        dims, mesh_dim, comm, divisor, grad_dtype, shapes, dtypes = ctx.args
        grads = [g if grad_dtype is None else g.to(grad_dtype) for g in grads]
        by_chunk = torch.cat([_pieces(g, Shard(d), mesh_dim, edge=False).reshape(mesh_dim.size, -1)
                              for g, d in zip(grads, dims)], dim=1)
        flat = LOWERINGS[comm].reduce_scatter(by_chunk, mesh_dim)
        flat = flat / divisor if divisor != 1 else flat
        return None, None, None, None, None, None, *(g.to(t) for g, t in zip(_unflatten(flat, shapes), dtypes))


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, parts, mesh_dim, length, comm):
        ctx.args = (dim, parts, mesh_dim)
        return _gather(x, dim, parts, mesh_dim, length, comm)

    @staticmethod
    def backward(ctx, grad):
        dim, parts, mesh_dim = ctx.args
        piece = _piece(grad, _placement(dim, parts), mesh_dim, mesh_dim.rank, edge=False)
        return piece, None, None, None, None, None


class _ShardLocal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, parts, mesh_dim, comm):
        ctx.args = (dim, parts, mesh_dim, x.shape[dim], comm)
        return _piece(x, _placement(dim, parts), mesh_dim, mesh_dim.rank).contiguous()

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, *ctx.args), None, None, None, None


class _AllGatherPartialGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, parts, mesh_dim, length, comm):
        ctx.args = (_placement(dim, parts), mesh_dim, comm)
        return _gather(x, dim, parts, mesh_dim, length, comm)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, *ctx.args, edge=False), None, None, None, None, None


class _GatherStacked(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, mesh_dim, comm):
        ctx.args = (mesh_dim, comm)
        return LOWERINGS[comm].all_gather(x, mesh_dim)

    @staticmethod
    def backward(ctx, grad):
        mesh_dim, comm = ctx.args
        return LOWERINGS[comm].reduce_scatter(grad, mesh_dim), None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, mesh_dim, comm):
        ctx.args = (dim, None, mesh_dim, x.shape[dim], comm)
        return _reduce_scatter(x, Shard(dim), mesh_dim, comm)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, *ctx.args), None, None, None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, src_dim, dst_dim, mesh_dim, length, comm):
        ctx.args = (dst_dim, src_dim, mesh_dim, x.shape[dst_dim], comm)
        return _all_to_all(x, src_dim, dst_dim, mesh_dim, length, comm)

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all(grad, *ctx.args, edge=False), None, None, None, None, None


# ``mesh_dim``: the layout of the mesh dim communicated over (its groups, this rank's chunk,
# zigzag); ``length``: the global length of a sharded dim that was padded to lay it out (see
# _pad), None when it divides evenly; ``comm``: the lowering (``ops.lowerings.LOWERINGS``), which
# the lower pass sets.

def all_reduce(x: torch.Tensor, mesh_dim: MeshDim, comm: str = FUNCTIONAL) -> torch.Tensor:
    return _AllReduce.apply(x, mesh_dim, comm)


def grad_all_reduce(x: torch.Tensor, mesh_dim: MeshDim, comm: str = FUNCTIONAL, divisor: int = 1) -> torch.Tensor:
    return _GradAllReduce.apply(x, mesh_dim, comm, divisor)


def grad_all_reduce_bucket(xs: list[torch.Tensor], mesh_dim: MeshDim, comm: str = FUNCTIONAL,
                           divisor: int = 1) -> tuple:
    return _GradAllReduceBucket.apply(mesh_dim, comm, divisor, *xs)


def all_gather(x: torch.Tensor, dim: int, parts: tuple[int, ...] | None, mesh_dim: MeshDim,
               length: int | None = None, comm: str = FUNCTIONAL) -> torch.Tensor:
    return _AllGather.apply(x, dim, parts, mesh_dim, length, comm)


def all_gather_partial_grad(x: torch.Tensor, dim: int, parts: tuple[int, ...] | None, mesh_dim: MeshDim,
                            length: int | None = None, comm: str = FUNCTIONAL) -> torch.Tensor:
    return _AllGatherPartialGrad.apply(x, dim, parts, mesh_dim, length, comm)


def shard_local(x: torch.Tensor, dim: int, parts: tuple[int, ...] | None, mesh_dim: MeshDim,
                comm: str = FUNCTIONAL) -> torch.Tensor:
    return _ShardLocal.apply(x, dim, parts, mesh_dim, comm)


def gather_stacked(x: torch.Tensor, mesh_dim: MeshDim, comm: str = FUNCTIONAL) -> torch.Tensor:
    """``[size, *x.shape]``: every rank's ``x``, by coordinate, for computations on this rank that
    read others' pieces (their gradients summed back to the rank that sent each)."""
    return _GatherStacked.apply(x, mesh_dim, comm)


def reduce_scatter(x: torch.Tensor, dim: int, mesh_dim: MeshDim, comm: str = FUNCTIONAL) -> torch.Tensor:
    return _ReduceScatter.apply(x, dim, mesh_dim, comm)


def all_to_all(x: torch.Tensor, src_dim: int, dst_dim: int, mesh_dim: MeshDim, length: int | None = None,
               comm: str = FUNCTIONAL) -> torch.Tensor:
    return _AllToAll.apply(x, src_dim, dst_dim, mesh_dim, length, comm)


def grad_as_partial(x: torch.Tensor, mesh_dim: MeshDim, comm: str = FUNCTIONAL) -> torch.Tensor:
    return _GradAsPartial.apply(x, mesh_dim)


def gather_params(xs: list[torch.Tensor], dims: list[int], mesh_dim: MeshDim, comm: str = FUNCTIONAL,
                  divisor: int = 1, dtype: torch.dtype | None = None, grad_dtype: torch.dtype | None = None) -> tuple:
    """Each piece ``xs[i]`` (this rank's chunk of dim ``dims[i]``) gathered whole over ``mesh_dim``,
    in ``dtype`` if given; the gradients reduced in ``grad_dtype`` if given."""
    return _GatherParams.apply(tuple(dims), mesh_dim, comm, divisor, dtype, grad_dtype, *xs)


def cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A parameter cast to the dtype the graph computes in or reduces its gradient in
    (``param_dtype``, ``reduce_dtype``): its gradient comes back in the parameter's dtype."""
    return x.to(dtype)


def gather_param_grad(grad: torch.Tensor, p: Placement, mesh_dim: MeshDim, comm: str = FUNCTIONAL) -> torch.Tensor:
    """Full gradient of a parameter from every rank's gradient of its local shard."""
    return _gather(grad, p.dim, interleaved_parts(p), mesh_dim, None, comm)


COMMUNICATION = {
    all_reduce: ("all_reduce", None),
    reduce_scatter: ("reduce_scatter", "all_gather"),
    all_gather: ("all_gather", None),
    all_gather_partial_grad: ("all_gather", "reduce_scatter"),
    shard_local: (None, "all_gather"),
    all_to_all: ("all_to_all", "all_to_all"),
    grad_all_reduce: (None, "all_reduce"),
    grad_all_reduce_bucket: (None, "all_reduce"),
    grad_as_partial: (None, None),
    gather_params: ("all_gather", "reduce_scatter"),
    cast: (None, None),
}
"""The collective each function a localized graph calls issues in (forward, backward)."""
