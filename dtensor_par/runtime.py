"""What Dynamo calls: slices inputs, caches local weight shards, runs the per-rank graph."""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass
from typing import Callable

import torch
import torch.fx as fx
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

from .backend import parallelize_graph
from .dump import GraphDump
from .mesh import MeshDim, MeshInfo
from .ops.collectives import gather_param_grad, shard_local
from .passes.capture import scalar_inputs
from .passes.context import ParallelConfig
from .placements import Placement, interleaved_parts, local_chunk, shard_dim


_graph_ids = itertools.count()  # names dump folders: one per planned graph and input signature


class _LocalShard(torch.autograd.Function):
    """Hands the graph a cached local shard; sends the full gradient back to the parameter."""

    @staticmethod
    def forward(ctx, param, local, placement, dim):
        ctx.placement, ctx.dim = placement, dim
        return local.view_as(local)

    @staticmethod
    def backward(ctx, grad):
        full = gather_param_grad(grad, ctx.placement, ctx.dim.group_name, ctx.dim.size)
        return full, None, None, None


def local_value(full: torch.Tensor, placements: dict[str, Placement], mesh: MeshInfo) -> torch.Tensor:
    """This rank's piece of a full (replicated) input; its gradient is gathered back whole."""
    for name, p in placements.items():
        d = shard_dim(p)
        if d is not None:
            dim = mesh.dims[name]
            full = shard_local(full, d, interleaved_parts(p), dim.group_name, dim.rank, dim.size)
    return full


class LocalShards:
    """Local shards of sharded parameters, re-sliced only when a parameter changes in place."""

    def __init__(self, dim: MeshDim):
        self.dim = dim
        self._cache: dict[int, tuple[torch.Tensor, int, Placement, torch.Tensor]] = {}

    def get(self, param: torch.Tensor, placement: Placement) -> torch.Tensor:
        entry = self._cache.get(id(param))
        if entry is None or entry[0] is not param or entry[1] != param._version or entry[2] != placement:
            local = local_chunk(param.detach(), placement, self.dim.rank, self.dim.size).contiguous()
            entry = (param, param._version, placement, local)
            self._cache[id(param)] = entry
        local = entry[3]
        if param.requires_grad and torch.is_grad_enabled():
            return _LocalShard.apply(param, local, placement, self.dim)
        return local


@dataclass
class LocalGraph:
    """One specialization: the compiled per-rank graph and its input/output placements."""

    fn: Callable
    input_placements: list[dict[str, Placement]]
    output_placements: list[dict[str, Placement] | None]


def _signature(args, scalars: list[int]) -> tuple:
    """What a specialization depends on: tensor metadata, Python numbers, lifted scalars' values."""
    key = tuple((tuple(a.shape), a.dtype, a.device, a.requires_grad) if isinstance(a, torch.Tensor) else
                (type(a), a if isinstance(a, (int, float, bool)) else None) for a in args)
    return key + tuple(args[i].item() for i in scalars)


class ParallelRuntime:
    """The callable the backend hands Dynamo, one per captured graph.

    Planning happens at the first call of each input signature with concrete inputs, so a
    graph Dynamo captured with symbolic sizes is specialized to each size it meets.
    """

    def __init__(self, gm: fx.GraphModule, config: ParallelConfig, mesh: DeviceMesh,
                 inner_backend: Callable):
        self.gm, self.config, self.mesh, self.inner_backend = gm, config, mesh, inner_backend
        self.shards = LocalShards(config.mesh.dims["tp"])
        self.graphs: dict[tuple, LocalGraph] = {}
        self.scalars = scalar_inputs(gm)

    def __call__(self, *args):
        key = _signature(args, self.scalars)
        local_graph = self.graphs.get(key) or self.graphs.setdefault(key, self._build(args))
        local_args = self._local_args(args, local_graph.input_placements)
        outs = local_graph.fn(*local_args)
        if self.config.output == "local":
            outs = type(outs)(self._as_dtensor(o, p) for o, p in zip(outs, local_graph.output_placements))
        return outs

    def _local_args(self, args, placements: list[dict[str, Placement]]) -> list:
        local = []
        for a, p in zip(args, placements):
            if isinstance(a, torch.nn.Parameter) and shard_dim(p.get("tp")) is not None:
                a = self.shards.get(a, p["tp"])  # parameters are only ever sharded on tp
            elif isinstance(a, torch.Tensor):
                a = local_value(a, p, self.config.mesh)
            local.append(a)
        return local

    def _check_devices(self, args) -> None:
        placeholders = [n.name for n in self.gm.graph.nodes if n.op == "placeholder"]
        for name, a in zip(placeholders, args):
            if isinstance(a, torch.Tensor) and a.device.type != self.config.mesh.device_type:
                raise ValueError(
                    f"hybrid_parallel: input {name!r} is on {a.device.type} but the mesh is on "
                    f"{self.config.mesh.device_type}; move the model and inputs to the mesh's device type"
                )

    def _dump(self) -> GraphDump | None:
        if self.config.dump_dir is None:
            return None
        dims = self.config.mesh.dims  # this rank's coordinates name its folder
        coords = "_".join(f"{d}{dims[d].rank}" for d in self.config.mesh.order)
        folder = os.path.join(self.config.dump_dir, coords, f"graph{next(_graph_ids)}")
        return GraphDump(folder, self.config.mesh.order)

    def _build(self, args) -> LocalGraph:
        self._check_devices(args)
        local_gm, ctx = parallelize_graph(self.gm, args, self.config, dump=self._dump())
        placeholders = [n for n in local_gm.graph.nodes if n.op == "placeholder"]
        input_placements = [{d: s.out for d, s in n.meta["dtensor_par"].items()} for n in placeholders]
        with torch.no_grad():
            local = self._local_args(args, input_placements)
        examples = [x.detach().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else x
                    for x, a in zip(local, args)]
        fn = self.inner_backend(local_gm, examples)
        return LocalGraph(fn, input_placements, ctx.output_placements)

    def _as_dtensor(self, out, placements: dict[str, Placement] | None):
        """A local output as a DTensor: tp as planned, the sequence shard on ulysses (the plan
        refuses zigzag and padded sequence shards)."""
        if not isinstance(out, torch.Tensor) or placements is None:
            return out
        names = self.mesh.mesh_dim_names
        cp = placements.get("cp", Replicate())
        per_dim = {"tp": placements.get("tp", Replicate()), "ring": cp, "ulysses": cp}
        return DTensor.from_local(out, self.mesh, [per_dim[n] for n in names], run_check=False)
