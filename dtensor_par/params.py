"""Parameter feeding: how a plan hands each rank's graph its pieces of the model's parameters.

Two strategies, one chosen per plan (``feeding_for``, from the graph's inputs):

- ``WHOLE`` (``hybrid_parallel`` alone): every rank holds each parameter whole. This rank's
  piece is sliced at every call, so any change to a parameter (``.data`` writes and
  replacements included) is seen, and the gradient of a sharded parameter is all-gathered
  back to full size in backward.
- ``SHARDED`` (after ``parallelize``): parameters are ``nn.Parameter(DTensor)`` shards. Dynamo
  hands the graph their stand-ins (``sharded.py``); the graph is fed ``param.to_local()``, so
  the gradient comes back as a DTensor shard and nothing is gathered.

Inputs that are not parameters are sliced to this rank's shard the same way in both.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement as DTensorPlacement
from torch.distributed.tensor import Replicate as DTensorReplicate
from torch.distributed.tensor import Shard as DTensorShard
from torch.distributed.tensor.placement_types import _StridedShard

from .kv_cache import cache_shard
from .mesh import MeshDim, MeshInfo
from .ops.collectives import gather_param_grad, shard_local
from .placements import InterleavedShard, Placement, Replicate, Shard, describe, interleaved_parts, local_chunk, \
    shard_dim

STANDIN_OF = "_dtensor_par_param"
"""The attribute of a stand-in (``sharded.py``) naming the DTensor parameter it stands for."""


def standin_param(value) -> nn.Parameter | None:
    """The DTensor parameter a graph input stands for, or None for any other input."""
    return getattr(value, STANDIN_OF, None) if isinstance(value, nn.Parameter) else None


def dtensor_placements(p: Placement, mesh: DeviceMesh) -> tuple[DTensorPlacement, ...]:
    """DTensor placements over ``mesh`` of a parameter planned ``p`` on tp, replicated elsewhere.

    An InterleavedShard of equal parts is a ``_StridedShard``: rank r holds chunks r, r + tp,
    ... of the tensor cut into parts x tp chunks, which is its slice of every part.
    """
    if isinstance(p, InterleavedShard):
        if len(set(p.parts)) != 1:
            raise ValueError(f"parallelize: a fused projection with unequal parts {list(p.parts)} has no DTensor "
                             f"placement")
        tp = _StridedShard(p.dim, split_factor=len(p.parts))
    elif isinstance(p, Shard):
        tp = DTensorShard(p.dim)
    else:
        tp = DTensorReplicate()
    return tuple(tp if name == "tp" else DTensorReplicate() for name in mesh.mesh_dim_names)


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


def local_value(full: torch.Tensor, placements: dict[str, Placement], mesh: MeshInfo, comm: str) -> torch.Tensor:
    """This rank's piece of a full (replicated) input; its gradient is gathered back whole."""
    for name, p in placements.items():
        d = shard_dim(p)
        if d is not None:
            full = shard_local(full, d, interleaved_parts(p), mesh.dims[name], comm)
    return full


class WholeParameters:
    """Every rank holds each parameter whole; the graph gets this rank's slice of it."""

    sharded = False
    state = ("full (model not parallelized): each rank holds every parameter whole, computes on its slice and "
             "all-gathers sharded parameters' gradients; dtensor_par.parallelize holds only the slices")

    def local_input(self, value, placements: dict[str, Placement], mesh: MeshInfo, comm: str):
        """This rank's piece of one graph input (parameters are only ever sharded on tp; a kv
        cache stand-in's piece is the shard the runtime holds)."""
        shard = cache_shard(value)
        if shard is not None:
            return shard.local
        if isinstance(value, nn.Parameter) and shard_dim(placements.get("tp")) is not None:
            return local_param(value, placements["tp"], mesh.dims["tp"], comm)
        if isinstance(value, torch.Tensor):
            return local_value(value, placements, mesh, comm)
        return value

    def check(self, params: dict, param_placements: dict[str, Placement], args, mesh: DeviceMesh) -> None:
        """Whole parameters fit any plan."""


class ShardedParameters(WholeParameters):
    """Parameters are DTensor shards (``parallelize``); the graph gets ``param.to_local()``."""

    sharded = True
    state = "sharded (dtensor_par.parallelize): each rank holds its DTensor piece of every sharded parameter"

    def local_input(self, value, placements: dict[str, Placement], mesh: MeshInfo, comm: str):
        param = standin_param(value)
        return param.to_local() if param is not None else super().local_input(value, placements, mesh, comm)

    def check(self, params: dict, param_placements: dict[str, Placement], args, mesh: DeviceMesh) -> None:
        """DTensor parameters must be laid out as this plan needs them, on this mesh."""
        for name, info in params.items():
            param = standin_param(args[info.index])
            if param is None:
                continue
            planned = param_placements.get(name, Replicate())
            needed = dtensor_placements(planned, mesh)
            if param.device_mesh != mesh or tuple(param.placements) != needed:
                raise ValueError(
                    f"hybrid_parallel: parameter {info.fqn!r} is a DTensor with placements {param.placements} over "
                    f"{param.device_mesh}, but this plan needs {needed} (tp: {describe(planned)}) over {mesh}; "
                    f"parallelize the model with the mesh and options you compile it with")


WHOLE = WholeParameters()
SHARDED = ShardedParameters()


def feeding_for(args) -> WholeParameters:
    """``SHARDED`` when the graph's inputs hold a DTensor parameter's stand-in, else ``WHOLE``."""
    return SHARDED if any(standin_param(a) is not None for a in args) else WHOLE
