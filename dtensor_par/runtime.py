"""What Dynamo calls: slices inputs and parameters, runs the per-rank graph for each input size.

Parameters come in two modes. A model passed through ``parallelize`` holds DTensor shards:
Dynamo hands the graph their stand-ins and the runtime feeds ``param.to_local()`` (the
gradient comes back as a DTensor shard; nothing is gathered). Any other model holds full
parameters: the runtime slices this rank's piece at every call (a view where it can) and
all-gathers each sharded parameter's gradient back to full size in backward.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import glob
import hashlib
import itertools
import os
from dataclasses import dataclass
from typing import Callable

import torch
import torch._inductor.config
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate
from torch.fx._lazy_graph_module import _use_lazy_graph_module
from torch.fx.experimental.symbolic_shapes import ShapeEnv
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from .backend import parallelize_graph
from .dump import GraphDump
from .logs import logger
from .mesh import MeshDim, MeshInfo
from .ops.collectives import gather_param_grad, shard_local
from .passes.capture import SYMBOLIC, scalar_inputs
from .passes.context import ParallelConfig, ParallelContext, PlanningError
from .placements import Placement, describe, interleaved_parts, local_chunk, shard_dim
from .sharded import dtensor_placements, standin_param
from .symbolic import NotSymbolic, Specialization, SymbolicInputs, static_fakes


_graph_ids = itertools.count()  # names dump folders: one per planned graph and input signature
_runtime_ids = itertools.count()  # names captured graphs in log lines


class _LocalShard(torch.autograd.Function):
    """Hands the graph a full parameter's local piece; sends the full gradient back to it."""

    @staticmethod
    def forward(ctx, param, local, placement, dim, comm):
        ctx.args = (placement, dim, comm)
        return local.view_as(local)

    @staticmethod
    def backward(ctx, grad):
        return gather_param_grad(grad, *ctx.args), None, None, None, None


def local_param(param: torch.nn.Parameter, placement: Placement, dim: MeshDim, comm: str) -> torch.Tensor:
    """This rank's piece of a full parameter, sliced at every call: a stale piece cannot be
    served, whatever changed the parameter (``.data`` writes and replacements included).
    ``comm``: the lowering of the gradient's gather."""
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


@functools.cache
def _source_digest() -> str:
    """A digest of dtensor_par's source: what its functions in a graph do, for the compile caches."""
    root = os.path.dirname(os.path.abspath(__file__))
    digest = hashlib.sha256()
    for path in sorted(glob.glob(os.path.join(root, "**", "*.py"), recursive=True)):
        with open(path, "rb") as f:
            digest.update(os.path.relpath(path, root).encode() + b"\0" + f.read())
    return digest.hexdigest()


def cacheable_functions(gm: fx.GraphModule) -> dict[str, str]:
    """Inductor's ``unsafe_marked_cacheable_functions`` with dtensor_par's functions ``gm`` calls
    (the collectives localize inserts) added, each keyed by ``_source_digest``. AOTAutograd's
    cache refuses a graph that calls a function it does not know; these are pure functions of
    their arguments, which the graph's code (the cache key) spells out."""
    ours = sorted({f"{n.target.__module__}.{n.target.__name__}" for n in gm.graph.nodes if n.op == "call_function"
                   and (getattr(n.target, "__module__", None) or "").startswith(f"{__package__}.")})
    return {**torch._inductor.config.unsafe_marked_cacheable_functions, **dict.fromkeys(ours, _source_digest())}


def record_example_values(gm: fx.GraphModule, examples: list, fake_mode: FakeTensorMode) -> None:
    """Each node's ``example_value`` for these (fake) inputs, as Dynamo's graphs carry them
    (localize drops the global ones): AOTAutograd's cache refuses a graph with a method called
    on a node that has none. A graph some op of which runs on fakes only when traced (ring
    attention's merge on symbolic sizes) gets none: the cache passes it by, as it did before."""
    try:
        FakeTensorProp(gm, fake_mode).propagate_dont_convert_inputs(*examples)
        complete = True
    except Exception as e:  # noqa: BLE001  (whatever an op raises, the inner backend's trace still runs it)
        logger.debug("hybrid_parallel: no example values for the compile caches: %s: %s", type(e).__name__, e)
        complete = False
    for node in gm.graph.nodes:
        value = node.meta.pop("val", None)
        if complete and value is not None:
            node.meta["example_value"] = value


def compile_local(backend: Callable, gm: fx.GraphModule, examples: list, fake_mode=None) -> Callable:
    """``backend(gm, examples)`` under the context Dynamo gives a backend: the runtime compiles
    at the first call, outside Dynamo.

    - Its tracing context: without it, dead-code elimination keeps random-tagged ops (SDPA is
      one) whose results nobody reads, and AOTAutograd's default partitioner copied the ring's
      forward attention kernels into the backward. Its ``fake_mode`` (with a ShapeEnv) lets the
      compile caches serve the graph.
    - Lazy graph modules: the graphs AOTAutograd builds generate their Python code when first
      called, not each time one is built or edited (a tenth of the first call's time).
    - ``cacheable_functions`` and ``record_example_values``: a job run again reuses what the
      caches kept of this graph.
    """
    if fake_mode is None:  # real examples (tests): fake copies of them carry the example values
        fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    record_example_values(gm, static_fakes(fake_mode, examples), fake_mode)
    with torch._guards.tracing(torch._guards.TracingContext(fake_mode)), \
            _use_lazy_graph_module(torch._dynamo.config.use_lazy_graph_module), \
            torch._inductor.config.patch(unsafe_marked_cacheable_functions=cacheable_functions(gm)):
        return backend(gm, examples)


@dataclass
class LocalGraph:
    """One specialization: the compiled per-rank graph and its input/output placements."""

    fn: Callable
    input_placements: list[dict[str, Placement]]
    output_placements: list[dict[str, Placement] | None]
    comm: str  # the lowering of the runtime's own collectives, as the graph's
    key: tuple = ()  # the input signature it serves (symbolic sizes left out)
    specialization: Specialization | None = None  # a symbolic plan's guards; None: static sizes

    def serves(self, key: tuple, args) -> bool:
        return key == self.key and (self.specialization is None or self.specialization.holds(args))


def _signature(args, scalars: list[int]) -> tuple:
    """What a specialization depends on: tensor metadata, Python numbers, lifted scalars' values."""
    key = tuple((tuple(a.shape), a.dtype, a.device, a.requires_grad) if isinstance(a, torch.Tensor) else
                (type(a), a if isinstance(a, (int, float, bool)) else None) for a in args)
    return key + tuple(args[i].item() for i in scalars)


def _changes(old: tuple, new: tuple, names: list[str]) -> str:
    """The inputs whose part of the signature differs, as Dynamo's recompile reasons read."""
    changed = [f"{name}: {a} -> {b}" for name, a, b in zip(names, old, new) if a != b]
    return "; ".join(changed) or "lifted scalar values"


class ParallelRuntime:
    """The callable the backend hands Dynamo, one per captured graph.

    Planning happens at the first call with concrete inputs. A graph Dynamo captured with
    symbolic sizes is planned and compiled once on its symbols (``symbolic.py``), again only for
    sizes that break that plan's guards; a static graph once per input signature. At most
    ``config.cache_limit`` plans are kept (least recently used dropped, with a warning); each
    new one is logged with what triggered it.
    """

    def __init__(self, gm: fx.GraphModule, config: ParallelConfig, mesh: DeviceMesh,
                 inner_backend: Callable):
        self.gm, self.config, self.mesh, self.inner_backend = gm, config, mesh, inner_backend
        self.graphs: list[LocalGraph] = []  # most recently used last
        self.scalars = scalar_inputs(gm)
        self.symbolic = gm.meta[SYMBOLIC]
        self.input_names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
        self.id = next(_runtime_ids)
        self.plans = 0

    def _key(self, args) -> tuple:
        if self.symbolic.symbolic:
            return self.symbolic.static_key(args) + tuple(args[i].item() for i in self.scalars)
        return _signature(args, self.scalars)

    def _lookup(self, args) -> LocalGraph:
        key = self._key(args)
        for i in range(len(self.graphs) - 1, -1, -1):
            if self.graphs[i].serves(key, args):
                if i != len(self.graphs) - 1:
                    self.graphs.append(self.graphs.pop(i))
                return self.graphs[-1]
        reason = self._reason(key, args)
        if len(self.graphs) >= self.config.cache_limit:
            dropped = self.graphs.pop(0)
            logger.warning("hybrid_parallel: graph %d reached cache_limit=%d plans; dropping the least recently "
                           "used (signature %s). Mark the varying sizes dynamic, or raise cache_limit",
                           self.id, self.config.cache_limit, dropped.key)
        self.graphs.append(self._build(args, key))
        self.plans += 1
        spec = self.graphs[-1].specialization
        sizes = spec.symbolic_names() if spec else []
        logger.info("hybrid_parallel: planned graph %d (plan %d, %s)%s", self.id, self.plans,
                    f"symbolic in {', '.join(sizes)}" if sizes else "static sizes",
                    f", triggered by: {reason}" if reason else "")
        return self.graphs[-1]

    def _reason(self, key: tuple, args) -> str | None:
        """Why no kept plan serves these inputs (None for the first plan)."""
        if not self.graphs:
            return None
        same = [g for g in self.graphs if g.key == key and g.specialization is not None]
        if same:
            return "guard failed: " + same[-1].specialization.failed(args)
        return _changes(self.graphs[-1].key, key, self.input_names + ["scalar"] * len(self.scalars))

    def __call__(self, *args):
        local_graph = self._lookup(args)
        local_args = self._local_args(args, local_graph.input_placements, local_graph.comm)
        outs = local_graph.fn(*local_args)
        if self.config.output == "local":
            outs = type(outs)(self._as_dtensor(o, p) for o, p in zip(outs, local_graph.output_placements))
        return outs

    def _local_args(self, args, placements: list[dict[str, Placement]], comm: str) -> list:
        local = []
        for a, p in zip(args, placements):
            param = standin_param(a)
            if param is not None:
                a = param.to_local()
            elif isinstance(a, torch.nn.Parameter) and shard_dim(p.get("tp")) is not None:
                a = local_param(a, p["tp"], self.config.mesh.dims["tp"], comm)  # parameters are only ever sharded on tp
            elif isinstance(a, torch.Tensor):
                a = local_value(a, p, self.config.mesh, comm)
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

    def _check_sharded_params(self, ctx: ParallelContext, args) -> None:
        """DTensor parameters must be laid out as this plan needs them, on this mesh."""
        for name, info in ctx.params.items():
            param = standin_param(args[info.index])
            if param is None:
                continue
            planned = ctx.param_placements.get(name, Replicate())
            needed = dtensor_placements(planned, self.mesh)
            if param.device_mesh != self.mesh or tuple(param.placements) != needed:
                raise ValueError(
                    f"hybrid_parallel: parameter {info.fqn!r} is a DTensor with placements {param.placements} over "
                    f"{param.device_mesh}, but this plan needs {needed} (tp: {describe(planned)}) over {self.mesh}; "
                    f"parallelize the model with the mesh and options you compile it with")

    def _build(self, args, key: tuple) -> LocalGraph:
        self._check_devices(args)
        if self.symbolic.symbolic:
            try:
                return self._compile(args, key, self.symbolic.specialization(args))
            except (NotSymbolic, PlanningError) as e:
                logger.warning("hybrid_parallel: graph %d cannot be planned on symbolic sizes, so it is planned for "
                               "each size it meets: %s", self.id, e)
                self.symbolic = SymbolicInputs.static()
                key = self._key(args)
        return self._compile(args, key, None)

    def _compile(self, args, key: tuple, spec: Specialization | None) -> LocalGraph:
        """Plan and compile for ``args``; with ``spec``, on its symbolic sizes."""
        config = self.config
        if any(standin_param(a) is not None for a in args):
            config = dataclasses.replace(config, parallelized=True)
        local_gm, ctx = parallelize_graph(self.gm, args, config, dump=self._dump(), specialization=spec)
        self._check_sharded_params(ctx, args)
        placeholders = [n for n in local_gm.graph.nodes if n.op == "placeholder"]
        input_placements = [{d: s.out for d, s in n.meta["dtensor_par"].items()} for n in placeholders]
        examples = args
        if spec is not None:  # the inner backend compiles for the symbolic sizes; parameters are sliced as at run time
            examples = [a if isinstance(a, torch.nn.Parameter) or standin_param(a) is not None else x
                        for a, x in zip(args, spec.global_inputs)]
        with torch.no_grad(), (spec.fake_mode if spec else contextlib.nullcontext()):
            local = self._local_args(examples, input_placements, ctx.comm)
        # static sizes are compiled on fakes too, as Dynamo hands them over: the compile caches need a ShapeEnv
        fake_mode = spec.fake_mode if spec else FakeTensorMode(shape_env=ShapeEnv(), allow_non_fake_inputs=True)
        examples = [x.detach().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else x
                    for x, a in zip(static_fakes(fake_mode, local), args)]
        fn = compile_local(self.inner_backend, local_gm, examples, fake_mode)
        if spec is not None:
            spec.seal()
        return LocalGraph(fn, input_placements, ctx.output_placements, ctx.comm, key, spec)

    def _as_dtensor(self, out, placements: dict[str, Placement] | None):
        """A local output as a DTensor: tp as planned, the sequence shard on ulysses (the plan
        refuses zigzag and padded sequence shards)."""
        if not isinstance(out, torch.Tensor) or placements is None:
            return out
        names = self.mesh.mesh_dim_names
        cp = placements.get("cp", Replicate())
        per_dim = {"tp": placements.get("tp", Replicate()), "ring": cp, "ulysses": cp}
        return DTensor.from_local(out, self.mesh, [per_dim[n] for n in names], run_check=False)
