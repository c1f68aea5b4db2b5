"""Dropout of a sharded tensor: one mask per distinct shard.

Run as written on every rank, ``F.dropout`` of a shard draws the same mask on every rank
(every rank's generator is in the same state), so all shards repeat one pattern. Here each
rank draws the mask of the shard it holds, keyed by its coordinates on the mesh dims the
tensor is sharded over (``dims``): ranks holding different elements draw different masks,
ranks holding the same elements (they differ only along dims the tensor is replicated or
partial over) draw the same mask. Every rank's generator advances alike, so later random ops
stay in step across ranks, and the masks are deterministic given the seed when every rank
seeds alike (as with DTensor's RNG tracker).

- CPU (and any device but CUDA): a seed drawn from the global CPU generator, mixed with the
  shard index, seeds a private generator; the mask is drawn on the CPU and moved. The masks
  are independent per shard, not the single-device mask's slices.
- CUDA (tested on a GPU where one is present; CI has none): offset-based Philox, as
  ``torch.distributed.tensor._random.OffsetBasedRNGTracker``: the shard draws from the
  device generator's seed at offset ``offset + shard * round4(numel)``, and the device
  generator then advances past every shard's draws. Streams never overlap; the single-device
  mask's slice is not reproduced, because Philox's element-to-counter mapping in torch's
  kernels depends on the launch grid, which the tensor's size decides.

The mask op is opaque to tracing and tagged nondeterministic-seeded, so a compiler neither
merges two draws nor recomputes one in the backward (which would draw another mask).
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..mesh import MeshDim

_MIX = 0x9E3779B97F4A7C15  # an odd 64-bit constant: shard indices land far apart among seeds


@torch.library.custom_op("dtensor_par::dropout_keep_mask", mutates_args=(),
                         tags=(torch.Tag.nondeterministic_seeded,))
def dropout_keep_mask(x: torch.Tensor, p: float, shard: int, shards: int) -> torch.Tensor:
    """Boolean keep-mask (True with probability ``1 - p``) of shard ``shard`` of ``shards``."""
    if x.device.type == "cuda":
        generator = torch.cuda.default_generators[x.device.index if x.device.index is not None
                                                  else torch.cuda.current_device()]
        offset, stride = generator.get_offset(), (x.numel() + 3) // 4 * 4
        own = torch.Generator(device=x.device)
        own.manual_seed(generator.initial_seed())
        own.set_offset(offset + shard * stride)
        keep = torch.rand(x.shape, generator=own, device=x.device) >= p
        generator.set_offset(offset + shards * stride)
        return keep
    seed = int(torch.randint(0, 2**62, ()))  # the global generator advances alike on every rank
    own = torch.Generator().manual_seed((seed + shard * _MIX) % 2**63)
    return (torch.rand(x.shape, generator=own) >= p).to(x.device)


@dropout_keep_mask.register_fake
def _(x, p, shard, shards):
    return torch.empty_like(x, dtype=torch.bool)


def shard_index(dims: Sequence[MeshDim]) -> tuple[int, int]:
    """This rank's shard among all of them, over the mesh dims a tensor is sharded along."""
    index, count = 0, 1
    for dim in dims:
        index, count = index * dim.size + dim.rank, count * dim.size
    return index, count


def sharded_dropout(input: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False, *,
                    dims: tuple[MeshDim, ...]) -> torch.Tensor:
    """``F.dropout`` of this rank's shard of a tensor sharded along ``dims``, with this shard's
    own mask (module docstring). The same scaling as ``F.dropout``: kept elements / (1 - p)."""
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
    if not training or p == 0.0:
        return input
    if p == 1.0:
        out = input * 0.0
    else:
        shard, shards = shard_index(dims)
        out = input * dropout_keep_mask(input, p, shard, shards) / (1.0 - p)
    return input.copy_(out) if inplace else out
