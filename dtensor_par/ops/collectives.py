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
======================  =====================  ==========================

A sequence dim whose length does not divide over cp is padded at the end to equal chunks
(``_pad``); every gather cuts the padding off again, so an op that mixes along the sequence
sees exactly the real positions, and attention masks the padded keys.

The forwards are ``torch.ops._c10d_functional`` ops, so a traced graph shows each collective
and inductor may schedule it. Each public function is what a localized graph calls.
"""

from __future__ import annotations

import torch

from ..mesh import chunk_order, zigzag_ring
from ..placements import InterleavedShard, Placement, Shard, interleaved_parts, parts_of, shard_dim, shard_length
from .ring import zigzag_indices

_c10d = torch.ops._c10d_functional


def _placement(dim: int, parts: tuple[int, ...] | None) -> Placement:
    return Shard(dim) if parts is None else InterleavedShard(dim, parts)


def _sequence_index(length: int, group: str) -> torch.Tensor | None:
    """Positions of a dim sharded over ``group`` in shard order, for the zigzag layout.

    The dim is cut into 2 * ring chunks; ring rank r holds chunks r and 2 * ring - 1 - r (so
    causal attention costs every ring rank the same), split further among its ulysses ranks.
    None for a contiguous layout.
    """
    ring = zigzag_ring(group)
    if ring is None:
        return None
    return torch.cat([zigzag_indices(length, ring, r) for r in range(ring)])


def _laid_out_length(length: int, group: str, size: int) -> int:
    """The length a dim of ``length`` sharded over ``group`` is laid out with: padded at the end
    to equal chunks, two per rank in the zigzag layout."""
    return size * shard_length(length, size, 2 if zigzag_ring(group) else 1)


def _pad(x: torch.Tensor, dim: int, length: int, *, edge: bool) -> torch.Tensor:
    """``x`` padded at the end of ``dim`` to ``length``.

    Values are padded with copies of the last position (``edge``): padding tokens then look
    like real ones, so no per-token op turns them into inf or NaN, which a backward would
    spread through 0 * NaN. Gradients are padded with zeros: padding never reaches a result.
    """
    extra = length - x.shape[dim]
    if extra == 0:
        return x
    last = x.narrow(dim, x.shape[dim] - 1, 1)
    tail = (last if edge else torch.zeros_like(last)).expand(*x.shape[:dim], extra, *x.shape[dim + 1:])
    return torch.cat([x, tail], dim=dim)


def _part_piece(x: torch.Tensor, dim: int, group: str, chunk: int, size: int, edge: bool) -> torch.Tensor:
    """Chunk ``chunk`` of one sharded run of ``dim``: padded, in the zigzag order if any."""
    x = _pad(x, dim, _laid_out_length(x.shape[dim], group, size), edge=edge)
    index = _sequence_index(x.shape[dim], group)
    if index is None:
        return x.chunk(size, dim=dim)[chunk]
    n = x.shape[dim] // size
    return x.index_select(dim, index[chunk * n:(chunk + 1) * n].to(x.device))


def _piece(x: torch.Tensor, p: Placement, group: str, chunk: int, size: int, *, edge: bool = True) -> torch.Tensor:
    """Chunk ``chunk`` of a full tensor under placement ``p`` over ``group``: its piece of
    each part of an InterleavedShard, every part laid out as a Shard is."""
    if shard_dim(p) is None:
        return x
    parts = x.split(list(parts_of(p, x.shape[p.dim])), dim=p.dim)
    pieces = [_part_piece(part, p.dim, group, chunk, size, edge) for part in parts]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=p.dim)


def _in_order(full: torch.Tensor, dim: int, group: str, length: int | None) -> torch.Tensor:
    """A run of ``dim`` gathered in chunk order, put in sequence order and cut to ``length``."""
    index = _sequence_index(full.shape[dim], group)
    if index is not None:
        full = full.index_select(dim, torch.argsort(index).to(full.device))
    return full if length is None or length == full.shape[dim] else full.narrow(dim, 0, length)


def _assemble(by_chunk: list[torch.Tensor], dim: int, parts: tuple[int, ...] | None, group: str,
              size: int, length: int | None) -> torch.Tensor:
    """The full tensor from every chunk, in chunk order, cut to ``length`` if it was padded;
    an InterleavedShard part by part."""
    if parts is None:
        return _in_order(torch.cat(by_chunk, dim=dim), dim, group, length)
    local_parts = [_laid_out_length(part, group, size) // size for part in parts]
    per_chunk = [c.split(local_parts, dim=dim) for c in by_chunk]
    return torch.cat([_in_order(torch.cat([per_chunk[c][i] for c in range(size)], dim=dim), dim, group, part)
                      for i, part in enumerate(parts)], dim=dim)


def _by_chunk(pieces, group: str, size: int) -> list[torch.Tensor]:
    """Pieces received by group rank, reordered by the chunk each group rank holds."""
    by_chunk = [None] * size
    for piece, chunk in zip(pieces, chunk_order(group, size)):
        by_chunk[chunk] = piece
    return by_chunk


def _gather(x: torch.Tensor, dim: int, parts: tuple[int, ...] | None, group: str, size: int,
            length: int | None = None) -> torch.Tensor:
    out = _c10d.wait_tensor(_c10d.all_gather_into_tensor(x.contiguous(), size, group))
    return _assemble(_by_chunk(out.chunk(size, dim=0), group, size), dim, parts, group, size, length)


def _reduce_scatter(x: torch.Tensor, p: Placement, group: str, size: int, *, edge: bool = True) -> torch.Tensor:
    """Sum over ranks, keeping this rank's piece under placement ``p``."""
    pieces = [_piece(x, p, group, c, size, edge=edge) for c in chunk_order(group, size)]
    return _c10d.wait_tensor(_c10d.reduce_scatter_tensor(torch.cat(pieces, dim=0).contiguous(), "sum", size, group))


def _all_to_all(x: torch.Tensor, src_dim: int, dst_dim: int, group: str, size: int, length: int | None = None,
                *, edge: bool = True) -> torch.Tensor:
    """Local shard of ``src_dim`` (global ``length`` if padded) -> local shard of ``dst_dim``."""
    pieces = [_piece(x, Shard(dst_dim), group, c, size, edge=edge) for c in chunk_order(group, size)]
    send = torch.stack(pieces).contiguous()
    flat = send.flatten(0, 1)
    split = [flat.shape[0] // size] * size
    recv = _c10d.wait_tensor(_c10d.all_to_all_single(flat, split, split, group)).view(send.shape)
    return _assemble(_by_chunk(recv.unbind(0), group, size), src_dim, None, group, size, length)


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _c10d.wait_tensor(_c10d.all_reduce(x.contiguous(), "sum", group))

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GradAllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _c10d.wait_tensor(_c10d.all_reduce(grad.contiguous(), "sum", ctx.group)), None


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, parts, group, rank, size, length):
        ctx.args, ctx.group = (dim, parts, rank, size), group
        return _gather(x, dim, parts, group, size, length)

    @staticmethod
    def backward(ctx, grad):
        dim, parts, rank, size = ctx.args
        piece = _piece(grad, _placement(dim, parts), ctx.group, rank, size, edge=False)
        return piece, None, None, None, None, None, None


class _ShardLocal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, parts, group, rank, size):
        ctx.args = (dim, parts, group, size, x.shape[dim])
        return _piece(x, _placement(dim, parts), group, rank, size).contiguous()

    @staticmethod
    def backward(ctx, grad):
        dim, parts, group, size, length = ctx.args
        return _gather(grad, dim, parts, group, size, length), None, None, None, None, None


class _AllGatherPartialGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, parts, group, size, length):
        ctx.args = (dim, parts, group, size)
        return _gather(x, dim, parts, group, size, length)

    @staticmethod
    def backward(ctx, grad):
        dim, parts, group, size = ctx.args
        return _reduce_scatter(grad, _placement(dim, parts), group, size, edge=False), None, None, None, None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group, size):
        ctx.args = (dim, group, size, x.shape[dim])
        return _reduce_scatter(x, Shard(dim), group, size)

    @staticmethod
    def backward(ctx, grad):
        dim, group, size, length = ctx.args
        return _gather(grad, dim, None, group, size, length), None, None, None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, src_dim, dst_dim, group, size, length):
        ctx.args = (src_dim, dst_dim, group, size, x.shape[dst_dim])
        return _all_to_all(x, src_dim, dst_dim, group, size, length)

    @staticmethod
    def backward(ctx, grad):
        src_dim, dst_dim, group, size, dst_length = ctx.args
        return _all_to_all(grad, dst_dim, src_dim, group, size, dst_length, edge=False), None, None, None, None, None


def all_reduce(x: torch.Tensor, group: str) -> torch.Tensor:
    return _AllReduce.apply(x, group)


def grad_all_reduce(x: torch.Tensor, group: str) -> torch.Tensor:
    return _GradAllReduce.apply(x, group)


# ``length``: the global length of a sharded dim that was padded to lay it out (see _pad);
# None when it divides evenly.

def all_gather(x: torch.Tensor, dim: int, parts: tuple[int, ...] | None, group: str, rank: int,
               size: int, length: int | None = None) -> torch.Tensor:
    return _AllGather.apply(x, dim, parts, group, rank, size, length)


def all_gather_partial_grad(x: torch.Tensor, dim: int, parts: tuple[int, ...] | None, group: str,
                            size: int, length: int | None = None) -> torch.Tensor:
    return _AllGatherPartialGrad.apply(x, dim, parts, group, size, length)


def shard_local(x: torch.Tensor, dim: int, parts: tuple[int, ...] | None, group: str, rank: int,
                size: int) -> torch.Tensor:
    return _ShardLocal.apply(x, dim, parts, group, rank, size)


def reduce_scatter(x: torch.Tensor, dim: int, group: str, size: int) -> torch.Tensor:
    return _ReduceScatter.apply(x, dim, group, size)


def all_to_all(x: torch.Tensor, src_dim: int, dst_dim: int, group: str, size: int,
               length: int | None = None) -> torch.Tensor:
    return _AllToAll.apply(x, src_dim, dst_dim, group, size, length)


def gather_param_grad(grad: torch.Tensor, p: Placement, group: str, size: int) -> torch.Tensor:
    """Full gradient of a parameter from every rank's gradient of its local shard."""
    return _gather(grad, p.dim, interleaved_parts(p), group, size)


COMMUNICATION = {
    all_reduce: ("all_reduce", None),
    reduce_scatter: ("reduce_scatter", "all_gather"),
    all_gather: ("all_gather", None),
    all_gather_partial_grad: ("all_gather", "reduce_scatter"),
    shard_local: (None, "all_gather"),
    all_to_all: ("all_to_all", "all_to_all"),
    grad_all_reduce: (None, "all_reduce"),
}
"""The collective each function a localized graph calls issues in (forward, backward)."""
