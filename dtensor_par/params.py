"""Parameter feeding: how a plan hands each rank's graph its pieces of the model's parameters.

Two strategies, one chosen per plan (``feeding_for``, from the graph's inputs):

- ``WHOLE`` (``hybrid_parallel`` alone): every rank holds each parameter whole. This rank's
  piece is sliced at every call, so any change to a parameter (``.data`` writes and
  replacements included) is seen, and the gradient of a sharded parameter is all-gathered
  back to full size in backward.
- ``SHARDED`` (after ``parallelize``): parameters are ``nn.Parameter(DTensor)`` shards. Dynamo
  hands the graph their stand-ins (``sharded.py``); the graph is fed ``param.to_local()``, so
  the gradient comes back as a DTensor shard and nothing is gathered. Where no mesh dim cuts
  a parameter (``holds_whole``), they are plain parameters held whole, fed as they are.

Inputs that are not parameters are sliced to this rank's shard the same way in both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Placement as DTensorPlacement
from torch.distributed.tensor import Replicate as DTensorReplicate
from torch.distributed.tensor import Shard as DTensorShard
from torch.distributed.tensor.placement_types import _StridedShard

from .kv_cache import cache_shard
from .sequence_pieces import sequence_piece
from .mesh import MeshDim, MeshInfo
from .ops.collectives import gather_param_grad, shard_local
from .placements import InterleavedShard, Placement, Replicate, Shard, describe, interleaved_parts, local_chunk, \
    local_shape, shard_dim

if TYPE_CHECKING:
    from .config import ParallelConfig

STANDIN_OF = "_dtensor_par_param"
"""The attribute of a stand-in (``sharded.py``) naming the held parameter it stands for."""


def standin_param(value) -> nn.Parameter | None:
    """The held parameter (``parallelize``'s) a graph input stands for, or None for any other input."""
    return getattr(value, STANDIN_OF, None) if isinstance(value, nn.Parameter) else None


def held_tensor(value: torch.Tensor) -> torch.Tensor:
    """What a rank holds for a graph input: the parameter a stand-in stands for, else the input."""
    param = standin_param(value)
    return value if param is None else param


def unequal_parts(p: Placement | None) -> bool:
    """Whether ``p`` cuts a fused projection part by part into unequal parts, which no DTensor
    placement describes."""
    return isinstance(p, InterleavedShard) and len(set(p.parts)) > 1


@dataclass(frozen=True)
class HeldLayout:
    """How each rank holds a parameter once parallelized: its tp piece (``tp``), an expert
    weight cut along ``ep_dim`` over ``ep`` (expert parallelism: a stacked weight's experts, dim
    0, which the graph computes on; or the rows of one expert of an ``nn.ModuleList``, which the
    graph sends to its expert's rank: ``ops.experts.experts_from_rows``), then cut further into
    equal chunks along ``fsdp_dim`` over the mesh dim ``fsdp`` (FSDP), or not (``fsdp_dim``
    None). A tp piece that no DTensor placement describes (a fused projection cut part by part
    into unequal parts: multi-query qkv) is not held: the parameter is held whole and sliced at
    each call, as ``WholeParameters`` slices them (``sliced``).

    FSDP cuts a dim that tp and ep do not, so the placements never nest on one tensor dim (no
    ``_StridedShard``), and only a dim whose length divides: no padding to keep in step.
    """

    tp: Placement
    tp_size: int
    fsdp: MeshDim | None = None
    fsdp_dim: int | None = None
    ep: MeshDim | None = None
    ep_dim: int = 0

    @property
    def sliced(self) -> bool:
        return unequal_parts(self.tp)

    @classmethod
    def of(cls, shape, tp: Placement | None, mesh: MeshInfo, fsdp: MeshDim | None,
           ep: MeshDim | None = None, ep_dim: int = 0) -> HeldLayout:
        """The layout of a parameter of ``shape`` planned ``tp`` on tp (and cut along ``ep_dim``
        over ``ep``); FSDP over the mesh dim ``fsdp`` (``MeshInfo.fsdp``) cuts the first dim that
        neither cuts and that divides over it (none: held as they cut it)."""
        tp = tp or Replicate()
        local = cls(tp, mesh.size("tp"), ep=ep, ep_dim=ep_dim).computed_shape(shape)
        cut = {shard_dim(tp), ep_dim if ep is not None else None}
        dim = None if fsdp is None or unequal_parts(tp) else next(
            (d for d, n in enumerate(local) if d not in cut and n and n % fsdp.size == 0), None)
        return cls(tp, mesh.size("tp"), fsdp if dim is not None else None, dim, ep, ep_dim)

    def computed_shape(self, shape) -> tuple[int, ...]:
        """The shape the graph is fed: the tp piece (its cut over ep), gathered over fsdp."""
        local = list(local_shape(shape, self.tp, self.tp_size))
        if self.ep is not None:
            local[self.ep_dim] //= self.ep.size
        return tuple(local)

    def held_shape(self, shape) -> tuple[int, ...]:
        if self.sliced:
            return tuple(shape)
        local = list(self.computed_shape(shape))
        if self.fsdp_dim is not None:
            local[self.fsdp_dim] //= self.fsdp.size
        return tuple(local)

    def held_piece(self, full: torch.Tensor, tp_rank: int) -> torch.Tensor:
        """This rank's piece of the whole parameter ``full``."""
        if self.sliced:
            return full
        local = local_chunk(full, self.tp, tp_rank, self.tp_size)
        if self.ep is not None:
            local = local.chunk(self.ep.size, self.ep_dim)[self.ep.rank]
        if self.fsdp_dim is None:
            return local
        return local.chunk(self.fsdp.size, self.fsdp_dim)[self.fsdp.rank]

    def dtensor_placements(self, mesh: DeviceMesh, info: MeshInfo) -> tuple[DTensorPlacement, ...]:
        """DTensor placements over ``mesh``: the tp placement on tp, ``Shard(fsdp_dim)`` on each
        mesh dim of fsdp (DTensor nests them in the mesh's order, as the fsdp group is laid out),
        Replicate elsewhere. An InterleavedShard of equal parts is a ``_StridedShard``: rank r
        holds chunks r, r + tp, ... of the tensor cut into parts x tp chunks, which is its slice
        of every part."""
        per_dim = {"tp": DTensorReplicate() if self.sliced else _tp_dtensor_placement(self.tp)}
        if self.ep is not None:  # nested in the mesh's order, "fsdp"'s; cp's is ring-major (passes.experts checks)
            per_dim.update((n, DTensorShard(self.ep_dim)) for n in info.spanned(self.ep.name))
        if self.fsdp_dim is not None:
            per_dim.update((n, DTensorShard(self.fsdp_dim)) for n in info.spanned(self.fsdp.name))
        return tuple(per_dim.get(name, DTensorReplicate()) for name in mesh.mesh_dim_names)

    def describe(self) -> dict[str, str]:
        tp = f"whole, sliced {describe(self.tp)} at each call" if self.sliced else describe(self.tp)
        return {"tp": tp, **({"ep": describe(Shard(self.ep_dim))} if self.ep is not None else {}),
                **({"fsdp": describe(Shard(self.fsdp_dim))} if self.fsdp_dim is not None else {})}


def held_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh DTensor parameters live on: ``mesh``'s dims of size > 1 (``mesh`` if none is).
    DTensor's sharding propagation enumerates strategies over every dim of the mesh: on
    ``init_mesh``'s five dims for HSDP (three of size 1), the first ``clip_grad_norm_`` and
    foreach AdamW step of a one-layer model took 20 s of CPU, against 0.3 s on its two."""
    names = tuple(n for n, size in zip(mesh.mesh_dim_names, mesh.shape) if size > 1)
    return mesh if len(names) in (0, mesh.ndim) else mesh[names]


def holds_whole(info: MeshInfo, config: ParallelConfig) -> bool:
    """Whether ``parallelize`` holds every parameter whole, as a plain tensor: no mesh dim cuts
    one (tp is 1, FSDP cuts over no dim of size > 1 and no expert is cut (ep): dp_replicate
    alone is DDP). DDP's own state: AdamW and ``clip_grad_norm_`` then run on plain tensors, and
    no gradient is wrapped back into a DTensor at every step."""
    experts_cut = config.ep is not None and expert_group(info).size > 1
    return info.size("tp") == 1 and info.fsdp(config.fsdp_dims) is None and not experts_cut


def expert_group(mesh: MeshInfo) -> MeshDim:
    """The ranks ``ep="cp"`` cuts each mixture's experts over, expert ``e`` at coordinate
    ``e // (E / size)``, laid out in the mesh's order, the order in which DTensor nests
    ``Shard(0)`` on them: dp_shard x ring x ulysses ("fsdp") where the mesh has dp_shard (each of
    its ranks holds batch rows of its own; beside dp_replicate each replica holds every expert
    once); without it, ring x ulysses: cp where cp's ring-major order is the mesh's (reports then
    name its collectives cp's), else "fsdp"."""
    fsdp, cp = mesh.dims["fsdp"], mesh.dims["cp"]._replace(zigzag=0)
    return fsdp if mesh.size("dp_shard") > 1 or fsdp.groups != cp.groups else cp


def _tp_dtensor_placement(p: Placement) -> DTensorPlacement:
    if isinstance(p, InterleavedShard):  # of equal parts: one of unequal parts is held whole (HeldLayout.sliced)
        return _StridedShard(p.dim, split_factor=len(p.parts))
    return DTensorShard(p.dim) if isinstance(p, Shard) else DTensorReplicate()


def fed_placements(placements: dict[str, Placement], layout: HeldLayout | None) -> dict[str, Placement]:
    """How the runtime cuts a graph input (``WholeParameters.local_input``): as the plan places
    it, but an expert weight (with ep) on tp, then at once over its group, by this rank's
    coordinate there: the experts ``parallelize`` holds, where a cut plan dim by plan dim (cp,
    then dp) would hand a rank of "fsdp" another rank's."""
    if layout is None or layout.ep is None:
        return placements
    return {**{d: p for d, p in placements.items() if d == "tp"}, layout.ep.name: Shard(layout.ep_dim)}


def layout_maker(mesh: MeshInfo, config: ParallelConfig, sharded: bool) -> Callable[..., HeldLayout]:
    """``layout(shape, tp, ep_dim)``: how a parameter planned ``tp`` on tp is held, FSDP over
    ``config.fsdp_dims`` once parallelized (``sharded``; whole parameters are only sliced). An
    expert weight cut over its group (with ep: ``expert_group``) along ``ep_dim`` (None: not an
    expert weight) is held in plain chunks there, and no FSDP: the group spans every dim FSDP
    may cut (of size > 1)."""
    ep = expert_group(mesh)
    fsdp = mesh.fsdp(config.fsdp_dims) if sharded else None

    def layout(shape, tp: Placement | None, ep_dim: int | None) -> HeldLayout:
        return HeldLayout.of(shape, tp, mesh, fsdp) if ep_dim is None else HeldLayout.of(shape, tp, mesh, None, ep,
                                                                                          ep_dim)
    return layout


def expert_dim(ctx, name: str) -> int | None:
    """The dim ep cuts graph input ``name`` along over its group (``ctx.expert_placements``), or
    None where it cuts none."""
    cut = ctx.expert_placements.get(name)
    return None if cut is None else shard_dim(next(iter(cut.values())))


def held_layouts(ctx) -> dict[str, HeldLayout]:
    """Each parameter placeholder's layout, as the plan's parameters are held."""
    layout = layout_maker(ctx.mesh, ctx.config, ctx.feeding.sharded)
    return {name: layout(info.tensor.shape, ctx.param_placements.get(name), expert_dim(ctx, name))
            for name, info in ctx.params.items()}


class _LocalShard(torch.autograd.Function):
    """Hands the graph a full parameter's local piece; sends the full gradient back to it."""

    @staticmethod
    def forward(ctx, param, local, placement, dim, comm):
        ctx.args = (placement, dim, comm)
        return local.view_as(local)

    @staticmethod
    def backward(ctx, grad):
        return gather_param_grad(grad, *ctx.args), None, None, None, None


def local_param(param: nn.Parameter, placement: Placement, dim: MeshDim, comm: str) -> torch.Tensor:
    """This rank's piece of a full parameter, sliced at every call: a stale piece cannot be
    served, whatever changed the parameter. ``comm``: the lowering of the gradient's gather."""
    local = local_chunk(param.detach(), placement, dim.rank, dim.size)
    if param.requires_grad and torch.is_grad_enabled():
        return _LocalShard.apply(param, local, placement, dim, comm)
    return local


def local_value(full: torch.Tensor, placements: dict[str, Placement], mesh: MeshInfo, comm: str, *,
                parameter: bool = False) -> torch.Tensor:
    """This rank's piece of a full (replicated) input; its gradient is gathered back whole. A
    parameter is cut in plain chunks (an expert weight over cp, with ep): the zigzag layout is a
    sequence's."""
    for name, p in placements.items():
        d = shard_dim(p)
        if d is not None:
            dim = mesh.dims[name]._replace(zigzag=0) if parameter else mesh.dims[name]
            full = shard_local(full, d, interleaved_parts(p), dim, comm)
    return full


class WholeParameters:
    """Every rank holds each parameter whole; the graph gets this rank's slice of it."""

    sharded = False
    state = ("full (model not parallelized): each rank holds every parameter whole, computes on its slice and "
             "all-gathers sharded parameters' gradients; dtensor_par.parallelize holds only the slices")

    def local_input(self, value, cuts: dict[str, Placement], mesh: MeshInfo, comm: str):
        """This rank's piece of one graph input, ``cuts`` its placements that shard it
        (``sharding_placements``): a parameter's tp piece sliced from it, then cut on the other
        dims as any input (expert weights over cp, with ep); a kv cache stand-in's piece is the
        shard the runtime holds; a sequence piece's stand-in (``sequence_pieces``) its piece, cut
        on the dims but cp; an input nothing cuts is fed as it is."""
        shard = cache_shard(value)
        if shard is not None:
            return shard.local
        piece = sequence_piece(value)
        if piece is not None:  # already cut over cp (the plan seeded it so): cut on the other dims alone
            value, cuts = piece.local, {name: p for name, p in cuts.items() if name != "cp"}
        if not cuts or not isinstance(value, torch.Tensor):
            return value
        parameter = isinstance(value, nn.Parameter)
        if parameter and "tp" in cuts:
            value = local_param(value, cuts["tp"], mesh.dims["tp"], comm)
            cuts = {name: p for name, p in cuts.items() if name != "tp"}
        return local_value(value, cuts, mesh, comm, parameter=parameter)

    def cuts(self, placements: list[dict[str, Placement]], args) -> list[dict[str, Placement]]:
        """Per graph input, the placements ``local_input`` slices it by at every call (those that
        shard it), derived once per plan from its inputs ``placements`` and first ``args``."""
        return [sharding_placements(p) for p in placements]

    def check(self, params: dict, layouts: dict[str, HeldLayout], args, mesh: DeviceMesh, info: MeshInfo) -> None:
        """Whole parameters fit any plan."""

    def state_on(self, info: MeshInfo, config: ParallelConfig) -> str:
        """What each rank holds of the parameters on this mesh, as reports say it."""
        return self.state


class ShardedParameters(WholeParameters):
    """Parameters held by ``parallelize``: DTensor shards, fed as ``param.to_local()``; whole plain
    ones (``holds_whole``) as they are."""

    sharded = True
    state = "sharded (dtensor_par.parallelize): each rank holds its DTensor piece of every sharded parameter"
    whole_state = ("sharded (dtensor_par.parallelize): no mesh dim cuts a parameter, so each rank holds every "
                   "parameter whole, as a plain tensor (DDP's state)")

    def local_input(self, value, cuts: dict[str, Placement], mesh: MeshInfo, comm: str):
        """A held parameter's piece (``held_local``), sliced on tp where the plan cuts a parameter
        held whole there (``HeldLayout.sliced``); any other input as ``WholeParameters`` cuts it."""
        param = standin_param(value)
        if param is None:
            return super().local_input(value, cuts, mesh, comm)
        held = held_local(param)
        return local_param(held, cuts["tp"], mesh.dims["tp"], comm) if "tp" in cuts else held

    def cuts(self, placements: list[dict[str, Placement]], args) -> list[dict[str, Placement]]:
        """A held parameter is fed its held piece as it is, unless held whole on tp where the plan
        cuts it (``HeldLayout.sliced``): then sliced on tp alone. ``check`` verified the layouts."""
        cuts = super().cuts(placements, args)
        for i, value in enumerate(args):
            param = standin_param(value)
            if param is not None:
                cuts[i] = {"tp": cuts[i]["tp"]} if "tp" in cuts[i] and _whole_on_tp(param) else {}
        return cuts

    def check(self, params: dict, layouts: dict[str, HeldLayout], args, mesh: DeviceMesh, info: MeshInfo) -> None:
        """Held parameters must be laid out as this plan needs them, on this mesh: a DTensor with
        its placements, a plain one (held whole) where the plan cuts none."""
        held = held_mesh(mesh)
        for name, param_info in params.items():
            param = standin_param(args[param_info.index])
            if param is None:
                continue
            needed = layouts[name].dtensor_placements(held, info)
            if not isinstance(param, DTensor):
                if any(not isinstance(p, DTensorReplicate) for p in needed):
                    raise ValueError(
                        f"hybrid_parallel: parameter {param_info.fqn!r} is held whole (a plain tensor: it was "
                        f"parallelized over a mesh that cuts no parameter), but this plan needs {needed} "
                        f"({layouts[name].describe()}) over {held}; parallelize the model with the mesh and options "
                        f"you compile it with")
            elif param.device_mesh != held or tuple(param.placements) != needed:
                raise ValueError(
                    f"hybrid_parallel: parameter {param_info.fqn!r} is a DTensor with placements {param.placements} "
                    f"over {param.device_mesh}, but this plan needs {needed} ({layouts[name].describe()}) over "
                    f"{held}; parallelize the model with the mesh and options you compile it with")

    def state_on(self, info: MeshInfo, config: ParallelConfig) -> str:
        return self.whole_state if holds_whole(info, config) else self.state


def held_local(param: nn.Parameter) -> torch.Tensor:
    """What a held parameter feeds the graph: its local tensor. ``to_local()`` only where a
    gradient flows back through it (its autograd node returns the gradient as a DTensor):
    elsewhere it is a Python call per parameter and call that makes a fresh view of a
    ``Parameter(DTensor)`` and marks it as a parameter, an op one device's graph does not run."""
    if not isinstance(param, DTensor):
        return param
    if param.requires_grad and torch.is_grad_enabled():
        return param.to_local()
    return param._local_tensor


def sharding_placements(placements: dict[str, Placement]) -> dict[str, Placement]:
    """The placements of a graph input that cut it (``Shard``, ``InterleavedShard``): what the
    runtime slices it by at each call; Replicate and Partial leave it as it is."""
    return {name: p for name, p in placements.items() if shard_dim(p) is not None}


def _whole_on_tp(param) -> bool:
    """Whether a held parameter is whole along tp: a plain one, or a DTensor replicated there."""
    if not isinstance(param, DTensor):
        return True
    names = param.device_mesh.mesh_dim_names
    return "tp" not in names or isinstance(param.placements[names.index("tp")], DTensorReplicate)


WHOLE = WholeParameters()
SHARDED = ShardedParameters()


def feeding_for(args) -> WholeParameters:
    """``SHARDED`` when the graph's inputs hold a DTensor parameter's stand-in, else ``WHOLE``."""
    return SHARDED if any(standin_param(a) is not None for a in args) else WHOLE
