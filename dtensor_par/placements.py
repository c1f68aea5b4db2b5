"""Placements used by the planner: DTensor's Shard/Replicate/Partial plus InterleavedShard.

A fused projection (one linear whose output is then chunked into q, k, v, or gate and up)
is sharded part by part: each rank holds its slice of every part, laid side by side. That is
not a DTensor ``Shard`` (whose local slice is one contiguous range), so it gets its own type.
Only the chunk/split that undoes the fusion may consume it as sharded; any other consumer
gathers it, with the parts put back in order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

if TYPE_CHECKING:
    from .mesh import MeshInfo

__all__ = ["Partial", "Replicate", "Shard", "InterleavedShard", "Placement",
           "shard_dim", "interleaved_parts", "parts_of", "shard_length", "is_padded", "local_shape", "local_shape_on",
           "local_chunk", "describe"]


@dataclass(frozen=True)
class InterleavedShard(Placement):
    """Sharded along ``dim`` part by part; ``parts`` are the global part sizes along ``dim``."""

    dim: int
    parts: tuple[int, ...]

    def __repr__(self) -> str:
        return f"IS({self.dim},{list(self.parts)})"

    def __reduce__(self):
        return InterleavedShard, (self.dim, self.parts)  # its pybind base does not pickle (the plan cache does)


def shard_dim(p: Placement) -> int | None:
    """The tensor dim a placement splits, or None for Replicate/Partial."""
    if isinstance(p, (Shard, InterleavedShard)):
        return p.dim
    return None


def interleaved_parts(p: Placement) -> tuple[int, ...] | None:
    """The part sizes of an InterleavedShard, None for any other placement."""
    return p.parts if isinstance(p, InterleavedShard) else None


def parts_of(p: Placement, full_size: int) -> tuple[int, ...]:
    return interleaved_parts(p) or (full_size,)


def shard_length(length: int, size: int, chunks_per_rank: int = 1) -> int:
    """Local length of a dim cut into ``size * chunks_per_rank`` equal chunks, ``chunks_per_rank``
    to a rank. A length that does not divide is padded at the end first (only sequence dims
    sharded over cp are; see ``ops.collectives``)."""
    chunks = size * chunks_per_rank
    return -(-length // chunks) * chunks_per_rank


def is_padded(length: int | torch.SymInt, size: int, chunks_per_rank: int = 1) -> bool:
    """Whether ``shard_length`` pads a dim of this length: always for a symbolic length,
    since padding by zero is exact and a plan must serve every length its symbol takes."""
    if isinstance(length, torch.SymInt) and length.node.expr.free_symbols:
        return True
    return length % (size * chunks_per_rank) != 0


def local_shape(shape: torch.Size | tuple[int, ...], p: Placement, size: int,
                chunks_per_rank: int = 1) -> tuple[int, ...]:
    d = shard_dim(p)
    shape = tuple(shape)
    if d is None:
        return shape
    return shape[:d] + (shard_length(shape[d], size, chunks_per_rank),) + shape[d + 1:]


def local_shape_on(shape, placements: dict[str, Placement], mesh: MeshInfo) -> tuple[int, ...]:
    """A global shape cut by the placement on every planned dim (``{"tp": ..., "cp": ...}``)."""
    shape = tuple(shape)
    for name, p in placements.items():
        shape = local_shape(shape, p, mesh.size(name), mesh.dims[name].chunks_per_rank)
    return shape


def local_chunk(full: torch.Tensor, p: Placement, rank: int, size: int) -> torch.Tensor:
    """This rank's piece of a full tensor under placement ``p`` (a view where one part)."""
    d = shard_dim(p)
    if d is None:
        return full
    pieces = [part.chunk(size, dim=d)[rank] for part in full.split(list(parts_of(p, full.shape[d])), dim=d)]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=d)


def describe(p: Placement | tuple | list | None) -> str:
    if p is None:
        return "-"
    if isinstance(p, (tuple, list)):
        return "(" + ", ".join(describe(x) for x in p) + ")"
    return str(p)
