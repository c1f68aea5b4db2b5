"""The kv cache a model keeps between calls, held sharded: each rank keeps only its piece.

A captured graph returns the keys and values its attention read (``DynamicCache`` appends to
them with a ``cat``) and Dynamo stores them in the model's cache object; the next call hands
them back as graph inputs. The runtime keeps this rank's piece of each (its heads over tp,
its sequence positions over cp) in a ``CacheShard``, and the cache object holds a stand-in:
a NaN expanded to the global shape, which owns no memory. Dynamo traces the model on global
shapes as ever; when a stand-in comes back as an input, the graph is fed its shard. Code that
reads the cache's values outside the compiled model reads NaN, never a wrong number; its
shape (``get_seq_length()``) is the global one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .mesh import MeshInfo
from .ops.collectives import shard_positions
from .placements import Placement, shard_dim

CACHE_OF = "_dtensor_par_cache"
"""The attribute of a stand-in holding its CacheShard."""


@dataclass
class CacheShard:
    """This rank's piece of one cache tensor, and how it was cut from the global one."""

    local: torch.Tensor
    placements: dict[str, Placement]  # plan dim -> how ``local`` is cut (tp: heads, cp: sequence positions)
    mesh: MeshInfo  # the mesh it is cut over: a plan over another mesh cannot read it
    positions: torch.Tensor | None = None  # cut over cp: the global sequence position of each local row
    dropped: int = 0  # rows a sliding-window cache dropped before its first: round robin counts from there

    def appended(self, new: torch.Tensor, past: int) -> CacheShard:
        """This shard with the rows of ``new`` (global positions ``past, past + 1, ...``) it
        owns appended: cp rank ``p % cp`` owns the ``p``-th row the cache was ever given
        (round robin)."""
        seq, cp = shard_dim(self.placements["cp"]), self.mesh.dims["cp"]
        positions = torch.arange(past, past + new.shape[seq], device=self.positions.device)
        mine = ((positions + self.dropped) % cp.size == cp.rank).nonzero().squeeze(1)
        return CacheShard(torch.cat([self.local, new.index_select(seq, mine.to(new.device))], seq),
                          self.placements, self.mesh, torch.cat([self.positions, positions[mine]]), self.dropped)


    def kept_last(self, n: int, length: int, seq: int) -> CacheShard:
        """The shard of the last ``n`` rows of the ``length`` its cache holds (a sliding-window
        cache), positions counted from the first row kept."""
        start = max(0, length - n)
        if self.positions is None:
            return CacheShard(self.local.narrow(seq, start, length - start), self.placements, self.mesh)
        kept = (self.positions >= start).nonzero().squeeze(1)
        return CacheShard(self.local.index_select(seq, kept.to(self.local.device)), self.placements, self.mesh,
                          self.positions[kept] - start, self.dropped + start)


def laid_out(local: torch.Tensor, placements: dict[str, Placement], mesh: MeshInfo, length: int | None) -> CacheShard:
    """The shard of a cache computed cut as ``placements`` say: along a sequence of ``length``
    over cp, its rows in the sequence layout (``ops.sequence_layout``), padding dropped."""
    seq = shard_dim(placements.get("cp"))
    if seq is None:
        return CacheShard(local, placements, mesh)
    positions = shard_positions(length, mesh.dims["cp"]).to(local.device)
    real = (positions < length).nonzero().squeeze(1)
    if len(real) < len(positions):
        local, positions = local.index_select(seq, real), positions[real]
    return CacheShard(local, placements, mesh, positions)


def hold(shard: CacheShard, global_shape: tuple[int, ...], grows_along: int | None) -> torch.Tensor:
    """The stand-in the model's cache keeps for ``shard``. ``grows_along``: the sequence dim a
    ``DynamicCache`` appends to, marked dynamic so that the first decode step is already
    planned for every cache length (one plan, not one per length before Dynamo's automatic
    dynamic shapes step in)."""
    local = shard.local
    standin = torch.full((), float("nan"), dtype=local.dtype, device=local.device).expand(global_shape)
    setattr(standin, CACHE_OF, shard)
    if grows_along is not None:
        torch._dynamo.maybe_mark_dynamic(standin, grows_along)
    return standin


def cache_shard(value) -> CacheShard | None:
    """The shard a graph input stands for, or None for any other input."""
    return getattr(value, CACHE_OF, None) if isinstance(value, torch.Tensor) else None
