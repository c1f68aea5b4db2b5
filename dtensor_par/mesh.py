"""The shared ("tp", "ring", "ulysses") device mesh and a read-only view of it for the passes."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

MESH_DIMS = ("tp", "ring", "ulysses")
PLAN_DIMS = ("tp", "cp")
"""The dims the planner shards over: tp (heads, features) and cp = ring x ulysses (sequence)."""


_CHUNK_OF_GROUP_RANK: dict[str, tuple[int, ...]] = {}


def register_chunk_order(group: str, chunks: list[int]) -> None:
    """Declare that group rank g holds chunk ``chunks[g]`` of a tensor sharded over the group.

    Process groups order their ranks by global rank; the flattened (ring, ulysses) group,
    whose shards follow ring-major order, declares that order here, and the collectives
    send and assemble chunks by it.
    """
    if list(chunks) != sorted(chunks):
        _CHUNK_OF_GROUP_RANK[group] = tuple(chunks)


def chunk_order(group: str, size: int):
    """The chunk each rank of ``group`` holds, by group rank."""
    return _CHUNK_OF_GROUP_RANK.get(group, range(size))


_ZIGZAG_RING: dict[str, int] = {}


def zigzag_ring(group: str) -> int | None:
    """The ring size when tensors sharded over ``group`` use the zigzag layout, else None."""
    return _ZIGZAG_RING.get(group)


def default_device_type() -> str:
    if torch.cuda.is_available():
        return "cuda"
    return "cpu"


def default_order(device_type: str) -> tuple[str, ...]:
    """Last name = fastest-varying (contiguous ranks).

    TP is the most bandwidth-hungry dim, so it goes innermost (one NVLink domain) on CUDA
    and CPU; Neuron's all-to-all wants contiguous rank groups, so Ulysses goes innermost.
    Ring only moves point-to-point traffic and tolerates the slowest links: outermost.
    """
    if device_type == "neuron":
        return ("ring", "tp", "ulysses")
    return ("ring", "ulysses", "tp")


def _init_default_group(device_type: str) -> None:
    if dist.is_initialized():
        return
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise RuntimeError(
            "init_mesh: no default process group is initialized and the torchrun environment "
            f"variables {missing} are not set; run under torchrun or call "
            "torch.distributed.init_process_group first"
        )
    backend = {"cuda": "nccl", "neuron": "neuron"}.get(device_type, "gloo")
    dist.init_process_group(backend)


def init_mesh(tp: int = 1, ring: int = 1, ulysses: int = 1, *, device_type: str | None = None,
              order: tuple[str, ...] | None = None) -> DeviceMesh:
    """Build the ("tp", "ring", "ulysses") mesh over the default process group.

    ``order`` lists the three dim names, the last varying fastest across ranks.
    """
    device_type = device_type or default_device_type()
    sizes = {"tp": tp, "ring": ring, "ulysses": ulysses}
    for name, size in sizes.items():
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"init_mesh: mesh dim {name!r} must be a positive int, got {size!r}")
    order = tuple(order) if order is not None else default_order(device_type)
    if sorted(order) != sorted(MESH_DIMS):
        raise ValueError(f"init_mesh: order must name each of {MESH_DIMS} once, got {order}")
    _init_default_group(device_type)
    world = dist.get_world_size()
    total = math.prod(sizes.values())
    if total != world:
        raise ValueError(
            f"init_mesh: tp={tp} x ring={ring} x ulysses={ulysses} = {total} ranks, "
            f"but the world size is {world}"
        )
    return init_device_mesh(device_type, tuple(sizes[n] for n in order), mesh_dim_names=order)


@dataclass(frozen=True)
class MeshDim:
    """One named mesh dim as this rank sees it."""

    name: str
    size: int
    rank: int  # this rank's coordinate along the dim
    group_name: str | None  # None when size == 1: no collective is ever issued
    chunks_per_rank: int = 1  # a dim sharded here is cut into size * chunks_per_rank equal chunks (2: zigzag)


@dataclass(frozen=True)
class MeshInfo:
    """The mesh as the passes need it: sizes, this rank's coordinates and group names.

    ``dims`` holds "tp", "ring", "ulysses" and "cp": ring x ulysses flattened ring-major
    (cp rank = ring rank * ulysses + ulysses rank, whatever the mesh order), so the sequence
    shard a rank holds outside attention is the one hybrid attention expects.
    """

    device_type: str
    dims: dict[str, MeshDim]
    order: tuple[str, ...]  # the three mesh dim names, the last varying fastest across ranks

    def size(self, name: str) -> int:
        return self.dims[name].size

    @property
    def world_size(self) -> int:
        return math.prod(self.size(n) for n in MESH_DIMS)

    @property
    def plan_dims(self) -> list[MeshDim]:
        """The planner's dims that shard anything (size > 1)."""
        return [self.dims[n] for n in PLAN_DIMS if self.size(n) > 1]

    @staticmethod
    def check_names(mesh: DeviceMesh) -> None:
        """A user mesh must name its dims from MESH_DIMS and span the whole world."""
        names = mesh.mesh_dim_names
        if names is None:
            raise ValueError(f"hybrid_parallel: the mesh needs dim names drawn from {MESH_DIMS}")
        unknown = [n for n in names if n not in MESH_DIMS]
        if unknown:
            raise ValueError(
                f"hybrid_parallel: unknown mesh dim names {unknown} (mesh dims {tuple(names)} with "
                f"sizes {tuple(mesh.shape)}); allowed names are {MESH_DIMS}"
            )
        if dist.get_world_size() != mesh.size():
            raise ValueError(
                f"hybrid_parallel: the mesh {dict(zip(names, mesh.shape))} holds {mesh.size()} "
                f"ranks but the world size is {dist.get_world_size()}"
            )

    @staticmethod
    def full_order(names: tuple[str, ...]) -> tuple[str, ...]:
        """All of MESH_DIMS in layout order: dims a mesh lacks (size 1) go outermost."""
        return tuple(n for n in MESH_DIMS if n not in names) + tuple(names)

    @staticmethod
    def from_mesh(mesh: DeviceMesh) -> MeshInfo:
        MeshInfo.check_names(mesh)
        names = mesh.mesh_dim_names
        coords = mesh.get_coordinate()
        dims = {}
        for name in MESH_DIMS:
            if name not in names:
                dims[name] = MeshDim(name, 1, 0, None)
                continue
            i = names.index(name)
            size = mesh.shape[i]
            group = mesh.get_group(name).group_name if size > 1 else None
            dims[name] = MeshDim(name, size, coords[i], group)
        dims["cp"] = _cp_dim(mesh, dims)
        return MeshInfo(mesh.device_type, dims, MeshInfo.full_order(names))

    @staticmethod
    def for_planning(sizes: dict[str, int], device_type: str, order: tuple[str, ...] | None = None) -> MeshInfo:
        """A mesh seen from rank 0 without any process group: enough to plan at any size."""
        order = tuple(order) if order is not None else default_order(device_type)
        sizes = {**{n: 1 for n in MESH_DIMS}, **sizes}
        sizes["cp"] = sizes["ring"] * sizes["ulysses"]
        dims = {n: MeshDim(n, sizes[n], 0, n if sizes[n] > 1 else None) for n in MESH_DIMS}
        dims["cp"] = MeshDim("cp", sizes["cp"], 0, "cp" if sizes["cp"] > 1 else None, 2 if sizes["ring"] > 1 else 1)
        return MeshInfo(device_type, dims, order)


def _cp_dim(mesh: DeviceMesh, dims: dict[str, MeshDim]) -> MeshDim:
    """A process group per tp index over its ring x ulysses ranks, ordered ring-major."""
    ring, ulysses = dims["ring"], dims["ulysses"]
    size = ring.size * ulysses.size
    if size == 1:
        return MeshDim("cp", 1, 0, None)
    names = list(mesh.mesh_dim_names)
    ranks = mesh.mesh.reshape(mesh.shape)
    present = [n for n in ("tp", "ring", "ulysses") if n in names]
    ranks = ranks.permute([names.index(n) for n in present]).reshape(-1, size)  # one row per tp index: ring-major, ulysses fastest
    mine = None
    for row in ranks.tolist():
        group = dist.new_group(row)  # every rank creates every group, in the same order
        if dist.get_rank() in row:
            mine = group
            register_chunk_order(group.group_name, [row.index(r) for r in sorted(row)])
            if ring.size > 1:  # load-balanced causal attention: see ops.collectives._sequence_index
                _ZIGZAG_RING[group.group_name] = ring.size
    return MeshDim("cp", size, ring.rank * ulysses.size + ulysses.rank, mine.group_name, 2 if ring.size > 1 else 1)
