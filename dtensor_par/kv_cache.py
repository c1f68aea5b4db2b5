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
from .placements import Placement, describe, shard_dim

CACHE_OF = "_dtensor_par_cache"
"""The attribute of a stand-in holding its CacheShard."""


@dataclass
class CacheShard:
    """This rank's piece of one cache tensor, and how it was cut from the global one."""

    local: torch.Tensor
    placements: dict[str, Placement]  # plan dim -> how ``local`` is cut (tp: heads)
    mesh: MeshInfo  # the mesh it is cut over: a plan over another mesh cannot read it

    def describe(self) -> str:
        return ", ".join(f"{d}: {describe(p)}" for d, p in self.placements.items()) or "whole"


def global_shape(local: torch.Size, placements: dict[str, Placement], mesh: MeshInfo) -> tuple[int, ...]:
    """The shape of the tensor ``local`` is an even piece of."""
    shape = list(local)
    for d, p in placements.items():
        shape[shard_dim(p)] *= mesh.size(d)
    return tuple(shape)


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
