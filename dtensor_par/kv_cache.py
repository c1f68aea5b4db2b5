"""The kv cache a model keeps between calls, held sharded: each rank keeps only its piece.

A captured graph returns the keys and values its attention read (``DynamicCache`` appends to
them with a ``cat``) and Dynamo stores them in the model's cache object; the next call hands
them back as graph inputs. The runtime keeps this rank's piece of each (its heads over tp,
its sequence positions over cp) in a ``CacheShard``, and the cache object holds a stand-in:
a NaN expanded to the global shape, which owns no memory. Dynamo traces the model on global
shapes as ever; when a stand-in comes back as an input, the graph is fed its shard. Code that
reads the cache's values outside the compiled model gets an error (``HeldCache``), never a
wrong number; its shape (``get_seq_length()``) is the global one.
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
    owners: torch.Tensor | None = None  # cut over cp: the cp rank holding each row of the global cache

    @property
    def positions(self) -> torch.Tensor | None:
        """The global row of each local row (local rows keep the global order)."""
        return None if self.owners is None else (self.owners == self.mesh.dims["cp"].rank).nonzero().squeeze(1)

    def appended(self, new: torch.Tensor) -> CacheShard:
        """This shard with the rows of ``new`` it owns appended: each new row goes to the cp
        rank holding the fewest (the lowest of those tied), so the ranks stay balanced."""
        seq, cp = shard_dim(self.placements["cp"]), self.mesh.dims["cp"]
        counts = torch.bincount(self.owners, minlength=cp.size).tolist()
        added = []
        for _ in range(new.shape[seq]):
            added.append(counts.index(min(counts)))
            counts[added[-1]] += 1
        added = torch.tensor(added, dtype=self.owners.dtype, device=self.owners.device)
        mine = (added == cp.rank).nonzero().squeeze(1)
        return CacheShard(torch.cat([self.local, new.index_select(seq, mine.to(new.device))], seq),
                          self.placements, self.mesh, torch.cat([self.owners, added]))

    def kept_last(self, n: int, length: int, seq: int) -> CacheShard:
        """The shard of the last ``n`` of the ``length`` rows its cache holds (a sliding-window cache)."""
        start = max(0, length - n)
        if self.owners is None:
            return CacheShard(self.local.narrow(seq, start, length - start), self.placements, self.mesh)
        kept = (self.positions >= start).nonzero().squeeze(1)
        return CacheShard(self.local.index_select(seq, kept.to(self.local.device)), self.placements, self.mesh,
                          self.owners[start:])


def laid_out(local: torch.Tensor, placements: dict[str, Placement], mesh: MeshInfo, length: int | None) -> CacheShard:
    """The shard of a cache computed cut as ``placements`` say: along a sequence of ``length``
    over cp, its rows in the sequence layout (``ops.sequence_layout``), padding dropped."""
    seq = shard_dim(placements.get("cp"))
    if seq is None:
        return CacheShard(local, placements, mesh)
    cp = mesh.dims["cp"]
    owners = torch.empty(length, dtype=torch.long)
    for rank in range(cp.size):
        positions = shard_positions(length, cp._replace(rank=rank))
        owners[positions[positions < length]] = rank
    real = (shard_positions(length, cp) < length).nonzero().squeeze(1)
    if len(real) < local.shape[seq]:
        local = local.index_select(seq, real.to(local.device))
    return CacheShard(local, placements, mesh, owners.to(local.device))


class HeldCache(torch.Tensor):
    """A stand-in's type: inside a compiled call it is a plain tensor of the global shape;
    outside, any op that reads it raises, so a cache the compiled model holds can never feed
    an eager computation (a graph break, Dynamo's recompile limit, an edit of the cache) a NaN.
    Its metadata (shape, dtype, device) reads as the global tensor's."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if not torch.compiler.is_compiling() and getattr(func, "__name__", None) not in _METADATA:
            raise RuntimeError(
                f"dtensor_par: {getattr(func, '__name__', func)} read a kv cache tensor that a compiled model holds "
                f"sharded (its ranks keep the pieces; the cache keeps a stand-in): it runs only inside the compiled "
                f"model. Dynamo ran part of the model eagerly (a graph break, or torch._dynamo's recompile limit: "
                f"see its warnings), or the cache was edited outside the model (cropped, reordered, copied)")
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))


_METADATA = {"__get__", "size", "dim", "numel", "stride", "is_contiguous", "element_size", "is_floating_point",
             "__len__", "__repr__", "__format__"}
"""What code outside the compiled model may ask a stand-in: ``cache.get_seq_length()`` reads its shape."""


def hold(shard: CacheShard, global_shape: tuple[int, ...], grows_along: int | None) -> torch.Tensor:
    """The stand-in the model's cache keeps for ``shard``. ``grows_along``: the sequence dim a
    ``DynamicCache`` appends to, marked dynamic so that the first decode step is already
    planned for every cache length (one plan, not one per length before Dynamo's automatic
    dynamic shapes step in)."""
    local = shard.local
    standin = torch.full((), float("nan"), dtype=local.dtype, device=local.device).expand(global_shape)
    standin = standin.as_subclass(HeldCache)
    setattr(standin, CACHE_OF, shard)
    if grows_along is not None:
        torch._dynamo.maybe_mark_dynamic(standin, grows_along)
    return standin


def cache_shard(value) -> CacheShard | None:
    """The shard a graph input stands for, or None for any other input."""
    return getattr(value, CACHE_OF, None) if isinstance(value, torch.Tensor) else None
