"""Where a rank's piece of a DTensor lies in the whole tensor, and DCP shown it so.

A fused projection's piece (``_StridedShard`` on tp: this rank's slice of each of its equal
parts) is not one block of the whole tensor, but ``torch.distributed.checkpoint`` (torch 2.13)
records each DTensor as one block from its first offset (``compute_local_shape_and_global_offset``):
saving one fails DCP's check for overlapping chunks, and loading one reads other rows than it
holds. ``parallelize``'s state dicts hand DCP such a piece as ``Blocks``: one chunk per block
of consecutive indices, so a checkpoint holds the whole fused tensor in plain chunks, and loads
into any layout (tp of another size, FSDP, one device).
"""

from __future__ import annotations

import functools
import itertools

import torch
import torch.nn as nn
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard


def held_indices(tensor: torch.Tensor) -> list[torch.Tensor | None]:
    """For each dim of ``tensor``, the global indices along it of what this rank holds, in the
    order it holds them (None: all). DTensor places a dim's indices as it places the dim:
    ``distribute_tensor`` of an ``arange`` with the placements on that dim moved to dim 0
    (``src_data_rank=None``: split locally, nothing sent); cuts of different dims are independent,
    so the piece is the outer product of these."""
    if not isinstance(tensor, DTensor):
        return [None] * tensor.dim()
    mesh, indices = tensor.device_mesh, []
    for dim, size in enumerate(tensor.shape):
        placements = [_on_dim0(p) if isinstance(p, Shard | _StridedShard) and p.dim == dim else Replicate()
                      for p in tensor.placements]
        if all(isinstance(p, Replicate) for p in placements):
            indices.append(None)
            continue
        arange = torch.arange(size, device=mesh.device_type)
        indices.append(distribute_tensor(arange, mesh, placements, src_data_rank=None).to_local().cpu())
    return indices


def _on_dim0(p: Shard | _StridedShard) -> Shard | _StridedShard:
    return _StridedShard(0, split_factor=p.split_factor) if isinstance(p, _StridedShard) else Shard(0)


def runs(index: torch.Tensor) -> list[tuple[int, int]]:
    """``index`` as its stretches of consecutive ascending values: (first, stop) each, in order."""
    if not len(index):
        return []
    breaks = (torch.nonzero(index[1:] - index[:-1] != 1).flatten() + 1).tolist()
    return [(int(index[a]), int(index[b - 1]) + 1) for a, b in zip([0] + breaks, breaks + [len(index)])]


def held_runs(tensor: torch.Tensor) -> list[list[tuple[int, int]]]:
    """For each dim of ``tensor``, the runs of global indices (first, stop) this rank holds, in
    the order it holds them: ``held_indices`` in a form small enough to send to another rank."""
    return [[(0, size)] if index is None else runs(index) for size, index in zip(tensor.shape, held_indices(tensor))]


def piece_blocks(held: list[list[tuple[int, int]]]) -> list[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]:
    """(offsets in the whole tensor, sizes, offsets in the piece) of each block of consecutive
    indices of every dim, for a piece held as ``held`` (``held_runs``'s, of a tensor of 1 dim or more)."""
    per_dim = []
    for dim_runs in held:
        found, at = [], 0
        for first, stop in dim_runs:
            found.append((first, stop - first, at))
            at += stop - first
        per_dim.append(found)
    return [tuple(zip(*block)) for block in itertools.product(*per_dim)]


class Blocks(DTensor):
    """A DTensor whose piece is not one block of the whole tensor (a ``_StridedShard`` one), as
    DCP's ``_Checkpointable`` protocol should show it: one chunk, and one view of the piece, per
    block of consecutive indices of every dim. DCP saves and loads each chunk as a shard of its own."""

    def blocks(self) -> list[tuple[ChunkStorageMetadata, torch.Tensor]]:
        """(chunk of the whole tensor, the view of this rank's piece holding it), for each block."""
        found = []
        for offsets, sizes, at in piece_blocks(held_runs(self)):
            piece = self.to_local()
            for dim, (first, length) in enumerate(zip(at, sizes)):
                piece = piece.narrow(dim, first, length)
            found.append((ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)), piece))
        return found

    def __create_write_items__(self, fqn: str, object) -> list[WriteItem]:
        properties = TensorProperties.create_from_tensor(self.to_local())
        return [WriteItem(index=MetadataIndex(fqn, chunk.offsets), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=chunk, properties=properties, size=self.size()))
                for chunk, _ in self.blocks()]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [chunk for chunk, _ in self.blocks()]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        pieces = [piece for chunk, piece in self.blocks() if chunk.offsets == index.offset]
        if not pieces:
            raise ValueError(f"{index.fqn!r} ({list(self.shape)}, {self.placements}): this rank holds no block at "
                             f"offsets {list(index.offset)}")
        return pieces[0]


def _strided(value) -> bool:
    return isinstance(value, DTensor) and any(isinstance(p, _StridedShard) for p in value.placements)


def blocks_for_dcp(module: nn.Module, state_dict: dict, prefix: str, local_metadata) -> None:
    """A state dict post-hook: each DTensor whose piece is not one block, as ``Blocks`` of the
    same piece (the parameters themselves stay where ``keep_vars`` asks for them)."""
    for key, value in state_dict.items():
        if key.startswith(prefix) and _strided(value) and not isinstance(value, nn.Parameter):
            state_dict[key] = Blocks(value.to_local(), value._spec, requires_grad=False)


_HOOKED = "_dtensor_par_blocks_for_dcp"
"""The attribute of an optimizer whose state dicts show DCP ``Blocks`` (``optimizer_blocks_for_dcp``)."""


def optimizer_blocks_for_dcp(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    """A global optimizer step pre-hook: once per optimizer, its state dicts show a fused
    projection's moments (pieces as its parameter's) to DCP as ``Blocks``, and loading takes them
    back as plain DTensors, so the optimizer never keeps a DCP view as its state. Registered at a
    step: DCP's ``get_optimizer_state_dict`` makes one before it reads a fresh optimizer's state."""
    if getattr(optimizer, _HOOKED, False):
        return
    setattr(optimizer, _HOOKED, True)
    optimizer.register_state_dict_post_hook(functools.partial(_each_state, Blocks))
    optimizer.register_load_state_dict_pre_hook(functools.partial(_each_state, DTensor))


def _each_state(kind: type, optimizer: torch.optim.Optimizer, state_dict: dict) -> dict:
    """``state_dict`` with each strided DTensor of its state held as ``kind`` (same piece, same spec)."""
    for state in state_dict["state"].values():
        for key, value in state.items():
            if _strided(value):
                state[key] = kind(value.to_local(), value._spec, requires_grad=False)
    return state_dict
