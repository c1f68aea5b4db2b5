"""The shared device mesh (dims "pp", "dp_replicate", "dp_shard", "tp", "ring", "ulysses") and a
read-only view of it for the passes."""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass
from typing import Callable, NamedTuple, Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

@dataclass(frozen=True)
class PlanDim:
    """A dim the planner cuts tensors over: one or more mesh dims, flattened (the last fastest)."""

    name: str
    mesh_dims: tuple[str, ...]  # the mesh dims it flattens, outermost first; each a degree of init_mesh
    cuts: str  # what it cuts: "features" (heads, hidden), "sequence" or "batch"
    pads: bool  # a length that does not divide is padded at the end to equal shards (else refused)
    seeded_by: str | None  # the step that chooses which inputs it cuts (passes.steps); None: the plan's weights
    fsdp: tuple[str, ...]  # its mesh dims ``parallelize`` may also cut parameters over (FSDP)
    help: str  # what one of its mesh dims does, for the CLI and errors


PLAN_DIMS_DECLARED = (
    PlanDim("tp", ("tp",), "features", pads=False, seeded_by=None, fsdp=(),
            help="tensor parallelism: heads and features cut Megatron-style"),
    PlanDim("cp", ("ring", "ulysses"), "sequence", pads=True, seeded_by="sequence", fsdp=("ring", "ulysses"),
            help="context parallelism: the sequence cut; attention runs as ring attention over ring, Ulysses over "
                 "ulysses"),
    PlanDim("dp", ("dp_replicate", "dp_shard"), "batch", pads=True, seeded_by="batch", fsdp=("dp_shard",),
            help="data parallelism: the batch cut; parameters replicated over dp_replicate, cut over dp_shard (FSDP)"),
)
"""Every dim the planner cuts over, in the order it plans them: each declared once, with what
it cuts; the mesh dims, their names and degrees, the CLI's flags and the groups are read off it."""
PLAN = {d.name: d for d in PLAN_DIMS_DECLARED}
PLAN_DIMS = tuple(PLAN)
"""The dims the planner shards over: tp (heads, features), cp = ring x ulysses (sequence) and
dp = dp_replicate x dp_shard (the batch)."""
DP_DIMS = PLAN["dp"].mesh_dims
"""The data-parallel mesh dims: replicas (DDP) and, with ``parallelize``, parameter shards (FSDP)."""
MESH_DIMS = (*DP_DIMS, *(n for d in PLAN_DIMS_DECLARED if d.name != "dp" for n in d.mesh_dims))
"""Every mesh dim, the data-parallel ones first: the degrees of ``init_mesh``, in order."""
FSDP_DIMS = tuple(n for n in MESH_DIMS if any(n in d.fsdp for d in PLAN_DIMS_DECLARED))
"""The mesh dims ``parallelize`` may shard parameters over (FSDP): every rank of them holds the
same parameters, as tp cuts them."""
SPANS = {**{n: (n,) for n in MESH_DIMS}, **{d.name: d.mesh_dims for d in PLAN_DIMS_DECLARED if len(d.mesh_dims) > 1},
         "fsdp": FSDP_DIMS}
"""The mesh dims each dim of MeshInfo flattens, the last fastest: cp is ring-major, dp replicate-major,
fsdp in the mesh's own order (the order in which DTensor nests Shard placements on them)."""
FLATTENED = tuple(name for name, spans in SPANS.items() if spans != (name,))


@dataclass(frozen=True)
class StageDim:
    """A mesh dim the model is cut over into stages (pipeline parallelism), not tensors: the planner
    never sees it. Each rank plans and compiles its stage over the mesh without it (its slice,
    ``mesh[other dims]``); only ``dtensor_par.pipeline`` takes a mesh that has it."""

    name: str
    help: str


STAGE_DIMS_DECLARED = (
    StageDim("pp", help="pipeline parallelism: the model cut at block boundaries into stages, one per pp rank, "
                        "run by dtensor_par.pipeline"),
)
"""The dims that cut the model into stages, outermost in the default order: a degree of
``init_mesh`` each, but no plan dim, no degree of ``parallel`` (``explain`` and ``choose_mesh``
take pp as a keyword of their own and plan one stage's mesh)."""
STAGE_DIMS = tuple(d.name for d in STAGE_DIMS_DECLARED)


def split_degrees(options: dict) -> tuple[dict[str, int], dict]:
    """(the degree of every mesh dim, 1 where ``options`` names none, in MESH_DIMS' order; the
    other options): how an entry point that takes both as keywords reads them."""
    return {n: options.get(n, 1) for n in MESH_DIMS}, {k: v for k, v in options.items() if k not in MESH_DIMS}


def default_device_type() -> str:
    if torch.cuda.is_available():
        return "cuda"
    return "cpu"


def default_order(device_type: str) -> tuple[str, ...]:
    """Last name = fastest-varying (contiguous ranks).

    TP is the most bandwidth-hungry dim, so it goes innermost (one NVLink domain) on CUDA
    and CPU; Neuron's all-to-all wants contiguous rank groups, so Ulysses goes innermost.
    Ring only moves point-to-point traffic and tolerates the slowest links; the data-parallel
    dims exchange once a step (gradients, or nothing at inference): outermost.
    """
    if device_type == "neuron":
        return (*DP_DIMS, "ring", "tp", "ulysses")
    return (*DP_DIMS, "ring", "ulysses", "tp")


def mesh_order(entry: str, sizes: dict[str, int], device_type: str, order: Sequence[str] | None) -> tuple[str, ...]:
    """The layout of a mesh of these degrees, the last dim fastest: ``order``, or the device's
    default. Every dim must have a positive degree; ``order`` names each of tp, ring and
    ulysses and every data-parallel dim of degree > 1 once. Data-parallel dims of degree 1 that
    ``order`` leaves out are left out of the mesh."""
    for name in MESH_DIMS:
        size = sizes.get(name, 1)
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f"{entry}: mesh dim {name!r} must be a positive int, got {size!r}")
    needed = [n for n in MESH_DIMS if n not in DP_DIMS or sizes.get(n, 1) > 1]
    if order is None:
        return tuple(n for n in default_order(device_type) if n in needed)
    order = tuple(order)
    unknown = [n for n in order if n not in MESH_DIMS]
    if unknown or len(set(order)) != len(order) or not set(needed) <= set(order):
        raise ValueError(f"{entry}: order must name each of {tuple(needed)} once (and may name {DP_DIMS}), "
                         f"got {order}" + (f"; unknown names {unknown}" if unknown else ""))
    return order


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


def default_world_size(device_type: str | None = None) -> int:
    """The default process group's size, the group started from the torchrun environment if
    none is (as ``init_mesh`` starts it)."""
    _init_default_group(device_type or default_device_type())
    return dist.get_world_size()


def init_mesh(*, device_type: str | None = None, order: tuple[str, ...] | None = None, **degrees: int) -> DeviceMesh:
    """Build the mesh over the default process group: a degree for each mesh dim (``tp=2,
    ulysses=4``; MESH_DIMS, 1 where not given), dims "tp", "ring", "ulysses" always and the
    data-parallel ones where their degree is above 1.

    ``order`` lists the dim names, the last varying fastest across ranks (``mesh_order``).
    """
    device_type = device_type or default_device_type()
    stages = {n: degrees.pop(n) for n in STAGE_DIMS if n in degrees}
    sizes, unknown = split_degrees(degrees)
    if unknown:
        raise TypeError(f"init_mesh: unknown mesh dims {sorted(unknown)}; the mesh dims are {STAGE_DIMS + MESH_DIMS}")
    order = stage_order("init_mesh", stages, mesh_order("init_mesh", sizes, device_type, _without_stages(order)),
                        order)
    sizes.update({n: stages.get(n, 1) for n in STAGE_DIMS})
    world = default_world_size(device_type)
    total = math.prod(sizes.values())
    if total != world:
        degrees = " x ".join(f"{n}={sizes[n]}" for n in STAGE_DIMS + MESH_DIMS if n in order or n in MESH_DIMS)
        raise ValueError(f"init_mesh: {degrees} = {total} ranks, but the world size is {world}")
    return init_device_mesh(device_type, tuple(sizes[n] for n in order), mesh_dim_names=order)


def _without_stages(order: Sequence[str] | None) -> tuple[str, ...] | None:
    return None if order is None else tuple(n for n in order if n not in STAGE_DIMS)


def stage_order(entry: str, stages: dict[str, int], inner: tuple[str, ...], order: Sequence[str] | None
                ) -> tuple[str, ...]:
    """The layout ``inner`` (``mesh_order``'s) with the stage dims of degree > 1 of ``stages`` put in:
    outermost by default (a stage sends its neighbour one activation a microbatch, the least
    traffic of any dim), else where ``order`` names them. A degree must be a positive int."""
    for name, size in stages.items():
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f"{entry}: mesh dim {name!r} must be a positive int, got {size!r}")
    needed = [n for n in STAGE_DIMS if stages.get(n, 1) > 1]
    if order is None:
        return (*needed, *inner)
    missing = [n for n in needed if n not in order]
    if missing:
        raise ValueError(f"{entry}: order must name {missing} (degree > 1), got {tuple(order)}")
    return tuple(n for n in order if n in inner or n in needed)


def partition(ranks: torch.Tensor, names: Sequence[str], spans: Sequence[str]) -> tuple[tuple[int, ...], ...]:
    """Every group of the mesh dims ``spans`` flattened (the last fastest): the global ranks
    whose other coordinates agree, each group in coordinate order. ``ranks`` holds the global
    rank at each mesh coordinate, its dims named ``names``; a dim it lacks has size 1."""
    inner = [names.index(d) for d in spans if d in names]
    outer = [i for i in range(len(names)) if i not in inner]
    size = math.prod(ranks.shape[i] for i in inner)
    return tuple(tuple(g) for g in ranks.permute(outer + inner).reshape(-1, size).tolist())


class MeshDim(NamedTuple):
    """One dim of the mesh as this rank sees it, with every layout fact a collective over it needs.

    Localize hands it to each collective it inserts, so the local graph states what each
    collective does and a lowering can rewrite it from the graph alone. Plain values only:
    FX prints it as code.
    """

    name: str
    size: int
    rank: int  # this rank's coordinate along the dim: the chunk it holds of a tensor sharded here
    group_name: str | None  # this rank's process group, for functional collectives; None for size 1
    groups: tuple[tuple[int, ...], ...]  # every group of the dim, each its global ranks in coordinate order
    group: int  # which of ``groups`` holds this rank
    zigzag: int = 0  # ring size when a sequence sharded here is in the zigzag layout (two chunks a rank)

    @property
    def ranks(self) -> tuple[int, ...]:
        """This rank's group: the global rank that holds each chunk."""
        return self.groups[self.group]

    @property
    def chunks_per_rank(self) -> int:
        return 2 if self.zigzag else 1


_INFO_OF = "_dtensor_par_mesh_info"
"""The attribute of a DeviceMesh holding its MeshInfo: built once per mesh, dropped with it."""


@dataclass(frozen=True)
class MeshInfo:
    """The mesh as the passes need it: sizes, this rank's coordinates, groups and their names.

    ``dims`` holds every mesh dim, "cp": ring x ulysses flattened ring-major (cp rank = ring
    rank * ulysses + ulysses rank, whatever the mesh order), so the sequence shard a rank holds
    outside attention is the one hybrid attention expects, and "dp": dp_replicate x dp_shard,
    over which the batch is cut.
    """

    device_type: str
    dims: dict[str, MeshDim]
    order: tuple[str, ...]  # the mesh's dim names (tp, ring, ulysses at least), the last varying fastest
    stages: int = 1  # a pipeline stage's slice: how many slices of these ranks the world holds (pp)

    def size(self, name: str) -> int:
        return self.dims[name].size

    @property
    def world_size(self) -> int:
        """The ranks of the world: every stage's (the groups of each dim cover them all)."""
        return math.prod(self.size(n) for n in MESH_DIMS) * self.stages

    def fsdp(self, names: tuple[str, ...] | None) -> MeshDim | None:
        """The mesh dim ``parallelize`` shards parameters over for FSDP over the mesh dims ``names``
        (None: every one of FSDP_DIMS the mesh has); None where no two ranks share parameters.

        The group must be one MeshInfo holds, with the ranks in the mesh's order: "fsdp" (all of
        FSDP_DIMS of size > 1), cp (ring and ulysses, where ring is the outer) or a single dim.
        """
        if names is None:
            names = tuple(n for n in FSDP_DIMS if n in self.order)
        lacking = [n for n in names if n not in self.order]
        if lacking:
            raise ValueError(f"fsdp_dims names {lacking}, which the mesh {self.described()} lacks")
        wanted = {n for n in names if self.size(n) > 1}
        if not wanted:
            return None
        for name in ("fsdp", "cp", *FSDP_DIMS):
            ring_major = name != "cp" or self.order.index("ring") < self.order.index("ulysses")
            if ring_major and wanted == set(self.spanned(name)):
                return self.dims[name]
        raise NotImplementedError(
            f"fsdp_dims={names} on the mesh {self.described()}: parameters can be sharded over all of "
            f"{list(self.spanned('fsdp'))} or over one of them, not over {sorted(wanted)} alone")

    def spanned(self, name: str) -> tuple[str, ...]:
        """The mesh dims of size > 1 that dim ``name`` flattens (SPANS)."""
        return tuple(n for n in SPANS[name] if self.size(n) > 1)

    def described(self) -> str:
        """``dp_shard=2 x ring=1 x ulysses=2 x tp=2``: the mesh's dims in order, with their sizes."""
        return " x ".join(f"{n}={self.size(n)}" for n in self.order)

    @property
    def plan_dims(self) -> list[MeshDim]:
        """The planner's dims that shard anything (size > 1)."""
        return [self.dims[n] for n in PLAN_DIMS if self.size(n) > 1]

    @staticmethod
    def check_names(mesh: DeviceMesh, entry: str) -> None:
        """A user mesh must name its dims from MESH_DIMS and span the whole world; errors name
        the entry point ``entry`` that was given the mesh."""
        names = mesh.mesh_dim_names
        if names is None:
            raise ValueError(f"{entry}: the mesh needs dim names drawn from {MESH_DIMS}")
        unknown = [n for n in names if n not in MESH_DIMS]
        staged = [n for n, size in zip(names, mesh.shape) if n in STAGE_DIMS and size > 1]
        if staged:
            raise ValueError(
                f"{entry}: the mesh {dict(zip(names, mesh.shape))} cuts the model into stages over {staged}: run it "
                f"with dtensor_par.pipeline, which compiles each stage over the mesh without them "
                f"(mesh[{tuple(n for n in names if n not in STAGE_DIMS)}])")
        if unknown:
            raise ValueError(
                f"{entry}: unknown mesh dim names {unknown} (mesh dims {tuple(names)} with "
                f"sizes {tuple(mesh.shape)}); allowed names are {MESH_DIMS}"
            )
        root = MeshInfo.stages_root(mesh)
        if dist.get_world_size() != (root or mesh).size():
            raise ValueError(
                f"{entry}: the mesh {dict(zip(names, mesh.shape))} holds {mesh.size()} "
                f"ranks but the world size is {dist.get_world_size()}"
            )

    @staticmethod
    def stages_root(mesh: DeviceMesh) -> DeviceMesh | None:
        """The mesh with stage dims that ``mesh`` is one stage's slice of (``mesh[every other dim]``),
        or None where it is not such a slice."""
        root = mesh._get_root_mesh()
        if root is mesh or root.mesh_dim_names is None:
            return None
        dropped = set(root.mesh_dim_names) - set(mesh.mesh_dim_names)
        return root if dropped and dropped <= set(STAGE_DIMS) and root.size() == dist.get_world_size() else None

    @staticmethod
    def full_order(names: tuple[str, ...]) -> tuple[str, ...]:
        """The mesh's dims in layout order, tp, ring and ulysses always: those it lacks (size 1)
        go outermost."""
        return tuple(n for n in MESH_DIMS if n not in names and n not in DP_DIMS) + tuple(names)

    @staticmethod
    def build(device_type: str, ranks: torch.Tensor, names: tuple[str, ...], me: int,
              group_name: Callable[[str, tuple[tuple[int, ...], ...], int], str | None]) -> MeshInfo:
        """The view of global rank ``me`` of the mesh ``ranks`` (dims ``names``); ``group_name(dim,
        groups, index)`` names the process group of ``groups[index]``."""
        dims: dict[str, MeshDim] = {}
        for name, spans in SPANS.items():
            if name == "fsdp":
                spans = tuple(sorted(spans, key=lambda d: names.index(d) if d in names else -1))
            groups = partition(ranks, names, spans)
            index = next(i for i, g in enumerate(groups) if me in g)
            ring = dims["ring"].size if name == "cp" else 1  # zigzag: load-balanced causal attention (ops.sequence_layout)
            same = [d.group_name for d in dims.values() if d.groups == groups] if name == "fsdp" else []
            dims[name] = MeshDim(name, len(groups[index]), groups[index].index(me),
                                 same[0] if same else group_name(name, groups, index), groups, index,
                                 zigzag=ring if ring > 1 else 0)
        stages = math.prod(ranks.shape[names.index(n)] for n in STAGE_DIMS if n in names)
        return MeshInfo(device_type, dims, MeshInfo.full_order(tuple(n for n in names if n not in STAGE_DIMS)), stages)

    @staticmethod
    def from_mesh(mesh: DeviceMesh, entry: str = "hybrid_parallel") -> MeshInfo:
        """Built once per mesh, with the cp process groups, and kept on the mesh for every
        ``hybrid_parallel`` call and recompile over it.

        ``mesh`` may be one pipeline stage's slice of a mesh with stage dims (``pipeline``): its
        groups are then built over the whole mesh (every rank builds every stage's, in one order),
        the stage dims outermost coordinates no group spans."""
        info = getattr(mesh, _INFO_OF, None)
        if info is None:
            MeshInfo.check_names(mesh, entry)
            whole = MeshInfo.stages_root(mesh) or mesh
            info = MeshInfo.build(mesh.device_type, whole.mesh, tuple(whole.mesh_dim_names), dist.get_rank(),
                                  functools.partial(_group_name, whole))
            setattr(mesh, _INFO_OF, info)
        return info

    @staticmethod
    def for_planning(sizes: dict[str, int], device_type: str, order: tuple[str, ...] | None = None) -> MeshInfo:
        """A mesh seen from rank 0 without any process group: enough to plan at any size."""
        order = mesh_order("explain", sizes, device_type, order)
        sizes = {**{n: 1 for n in MESH_DIMS}, **sizes}
        ranks = torch.arange(math.prod(sizes.values())).reshape([sizes[n] for n in order])
        return MeshInfo.build(device_type, ranks, order, 0,
                              lambda name, groups, i: name if len(groups[i]) > 1 else None)


def _group_name(mesh: DeviceMesh, name: str, groups: tuple[tuple[int, ...], ...], index: int) -> str | None:
    """The mesh's own process group for a mesh dim; for cp and dp, one new group per group of
    the dims they flatten."""
    if len(groups[index]) == 1:
        return None
    if name not in FLATTENED:
        return mesh.get_group(name).group_name
    return [dist.new_group(list(g)) for g in groups][index].group_name  # every rank creates every group, in order
