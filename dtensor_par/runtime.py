"""What Dynamo calls: slices inputs and parameters, runs the per-rank graph for each input size.

``hybrid_parallel`` returns a ``ParallelBackend``; Dynamo calls it once per captured graph and
gets a ``ParallelRuntime``, which plans and compiles at the first call with concrete inputs.
How parameters reach the graph (whole and sliced per call, or DTensor shards) is the plan's
``params.WholeParameters`` strategy.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch._inductor.config
import torch.fx as fx
import torch.nn as nn
from torch._dynamo.backends.registry import lookup_backend
from torch._dynamo.eval_frame import OptimizedModule, innermost_backend
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate
from torch.fx._lazy_graph_module import _use_lazy_graph_module
from torch.fx.experimental.symbolic_shapes import ShapeEnv
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from .planning import parallelize_graph
from .config import ParallelConfig
from .dump import GraphDump
from .logs import logger
from .mesh import PLAN_DIMS_DECLARED, MeshInfo
from .kv_cache import cache_shard, hold, laid_out
from .params import WholeParameters, feeding_for, standin_param
from .passes import meta
from .passes.capture import frames_compiled, handed_over, scalar_inputs
from .passes.recompute import allow_side_effects_in_regions
from .errors import PlanningError
from .passes.kv_cache import CacheOutput
from .passes.overlap import overlapped_aot_eager
from .plancache import ConstantInput, Plan, PlanStore, plan_key, source_digest
from .same_inputs import check_same_inputs
from .placements import Placement, shard_dim
from .symbolic import NotSymbolic, Specialization, SymbolicInputs, fresh_size, static_fakes

INDUCTOR_OVERLAP = {"reorder_for_compute_comm_overlap": True,
                    "reorder_for_compute_comm_overlap_passes": ["raise_comms", "sink_waits"]}
"""Inductor's own form of ``passes.overlap``: each collective issued as early as its inputs
allow, each wait at its first reader."""


def _overlapped_inductor(gm: torch.fx.GraphModule, example_inputs):
    """Inductor with ``INDUCTOR_OVERLAP``, unless its comm/compute reordering is configured."""
    from torch._inductor.compile_fx import compile_fx

    configured = torch._inductor.config.reorder_for_compute_comm_overlap
    return compile_fx(gm, example_inputs, config_patches=None if configured else INDUCTOR_OVERLAP)


def resolve_backend(inner_backend: str | Callable) -> Callable:
    """The inner backend by name; ``"aot_eager"`` and ``"inductor"`` issue each collective as
    early as its inputs allow and wait for it at its first reader (``passes.overlap``)."""
    if inner_backend == "aot_eager":
        return overlapped_aot_eager
    if inner_backend == "inductor":
        return _overlapped_inductor
    return inner_backend if callable(inner_backend) else lookup_backend(inner_backend)


class ParallelBackend:
    """What ``hybrid_parallel`` returns: the ``torch.compile`` backend over one mesh and config.

    Dynamo calls it once per captured graph; it numbers the graphs it is handed (log lines)
    and the plans made for them (dump folders), and warns of each graph break Dynamo met on
    the way: the code between two graphs runs whole on every rank, which no graph's plan shows.
    """

    def __init__(self, mesh: DeviceMesh, config: ParallelConfig, sent_outputs: dict[int, int] | None = None,
                 vocab_cuts: dict[str, Placement] | None = None):
        self.mesh, self.config = mesh, config
        self.sent_outputs = dict(sent_outputs or {})  # a pipeline stage's outputs returned cut over cp (passes.plan)
        self.vocab_cuts = vocab_cuts  # a pipeline stage's, decided on the whole graph (plan.vocab_cuts); None: its own
        self.info = MeshInfo.from_mesh(mesh, "hybrid_parallel")
        config.check_mesh(self.info, "hybrid_parallel")
        self.inner = resolve_backend(config.inner_backend)
        self.graph_ids = itertools.count()
        self.plan_ids = itertools.count()
        self.last_frame, self.graph_frame, self.breaks_warned = frames_compiled()[0], None, set()
        _route_generate_of_compiled_modules()
        allow_side_effects_in_regions()

    def __call__(self, gm: fx.GraphModule, example_inputs) -> ParallelRuntime:
        self._warn_of_graph_breaks()
        return ParallelRuntime(handed_over(gm), self)

    def _warn_of_graph_breaks(self) -> None:
        """Warn once of each graph break of the frames this backend compiles: the frame it is handed a
        graph of now, the one it was last handed a graph of, and those between that handed over no
        graph (Dynamo gave up on the frame and runs it eagerly, compiling the calls it makes). A
        frame whose graphs went to another backend is not this model's."""
        number, breaks, frames = frames_compiled()
        for frame in frames:
            if frame.number > self.last_frame and (frame.number == self.graph_frame or frame.graphs == 0):
                breaks += frame.breaks
        self.last_frame, self.graph_frame = number - 1, number
        for reason in map(_break_summary, breaks):
            if reason not in self.breaks_warned:
                self.breaks_warned.add(reason)
                logger.warning("hybrid_parallel: Dynamo broke the graph (%s): the code between two graphs runs "
                               "eagerly, whole on every rank, and the graphs are planned each on its own%s", reason,
                               _EXPERT_LOOP_HINT if "capture_dynamic_output_shape_ops" in reason else "")


_EXPERT_LOOP_HINT = ("; a loop over an nn.ModuleList's experts that finds each one's tokens with torch.where, or "
                     "picks its rows by a mask (out[ids == e] = expert(rows[ids == e])), runs sharded in one graph "
                     "under torch._dynamo.config.capture_dynamic_output_shape_ops = True")


def _break_summary(reason: str) -> str:
    """Dynamo's break reason in one line: its first, with the explanation and hint it gives."""
    lines = [line.strip() for line in reason.splitlines()]
    said = [line for line in lines if line.startswith(("Explanation:", "Hint:"))][:2]
    return "; ".join([lines[0], *said])


def _parallel_backend(dynamo_ctx) -> ParallelBackend | None:
    """The ``ParallelBackend`` a Dynamo context compiles with, if it is one (``torch.compile``
    wraps a backend callable in a ``_TorchCompileWrapper``, ``torch._dynamo.optimize`` does not)."""
    backend = innermost_backend(dynamo_ctx.callback)
    backend = getattr(backend, "compiler_fn", backend)
    return backend if isinstance(backend, ParallelBackend) else None


def _generate_compiled(module: nn.Module, dynamo_ctx, *args, **kwargs):
    """``module.generate`` with every call of ``module`` compiled by ``dynamo_ctx`` while it runs,
    as ``module.compile()`` compiles them: ``generate`` calls the module itself, which
    ``torch.compile(module)`` leaves as it was."""
    own_call = module._compiled_call_impl
    module._compiled_call_impl = dynamo_ctx(module._call_impl)
    try:
        return module.generate(*args, **kwargs)
    finally:
        module._compiled_call_impl = own_call


@functools.cache
def _route_generate_of_compiled_modules() -> None:
    """Make ``torch.compile(model, backend=hybrid_parallel(mesh)).generate(...)`` run parallel.

    The ``OptimizedModule`` ``torch.compile`` returns compiles only its own call; any other
    attribute, ``generate`` too, is the wrapped module's, and its ``generate`` would run the
    plain forward on one device's whole model. Installed once, by the first ``ParallelBackend``:
    ``OptimizedModule.__init__`` gives an instance compiled with a ``ParallelBackend`` (and only
    those) a ``generate`` of its own, ``_generate_compiled``. Nothing else changes:
    other instances, attribute lookups and calls are as torch makes them.
    """
    init = OptimizedModule.__init__

    @functools.wraps(init)
    def __init__(self, mod, dynamo_ctx, *args, **kwargs):
        init(self, mod, dynamo_ctx, *args, **kwargs)
        if _parallel_backend(dynamo_ctx) is not None and callable(getattr(mod, "generate", None)):
            self.__dict__["generate"] = functools.partial(_generate_compiled, mod, dynamo_ctx)

    OptimizedModule.__init__ = __init__


def cacheable_functions(gm: fx.GraphModule) -> dict[str, str]:
    """Inductor's ``unsafe_marked_cacheable_functions`` with dtensor_par's functions ``gm`` calls
    (the collectives localize inserts) added, each keyed by ``source_digest``. AOTAutograd's
    cache refuses a graph that calls a function it does not know; these are pure functions of
    their arguments, which the graph's code (the cache key) spells out."""
    ours = sorted({f"{n.target.__module__}.{n.target.__name__}" for n in gm.graph.nodes if n.op == "call_function"
                   and (getattr(n.target, "__module__", None) or "").startswith(f"{__package__}.")})
    return {**torch._inductor.config.unsafe_marked_cacheable_functions, **dict.fromkeys(ours, source_digest())}


NO_COMPILE_CACHES = ("aot_eager", "eager")
"""Inner backends that never read the compile caches (AOTAutograd's serves inductor's compiler
only): a graph compiled by one needs no example values, unless the plan cache keeps it."""


def record_example_values(gm: fx.GraphModule, examples: list, fake_mode: FakeTensorMode) -> None:
    """Each node's ``example_value`` for these (fake) inputs, as Dynamo's graphs carry them
    (localize drops the global ones): AOTAutograd's cache refuses a graph with a method called
    on a node that has none. A graph some op of which runs on fakes only when traced (ring
    attention's merge on symbolic sizes) gets none: the cache passes it by, as it did before."""
    try:
        FakeTensorProp(gm, fake_mode).propagate_dont_convert_inputs(*examples)
        complete = True
    except Exception as e:  # noqa: BLE001  (whatever an op raises, the inner backend's trace still runs it)
        logger.info("hybrid_parallel: the compile caches will not serve this graph: it does not run on fakes "
                    "outside a trace (%s: %s)", type(e).__name__, e)
        complete = False
    for node in gm.graph.nodes:
        value = node.meta.pop("val", None)
        if complete and value is not None:
            node.meta["example_value"] = value


def compile_local(backend: Callable, gm: fx.GraphModule, examples: list, fake_mode=None) -> Callable:
    """``record_example_values``, then ``compile_recorded``: how the runtime compiles a graph it planned.
    ``fake_mode`` None: real examples (tests), whose fake copies carry the example values."""
    if fake_mode is None:
        fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    record_example_values(gm, static_fakes(fake_mode, examples), fake_mode)
    return compile_recorded(backend, gm, examples, fake_mode)


def compile_recorded(backend: Callable, gm: fx.GraphModule, examples: list, fake_mode: FakeTensorMode) -> Callable:
    """``backend(gm, examples)`` under the context Dynamo gives a backend: the runtime compiles
    at the first call, outside Dynamo.

    - Its tracing context: without it, dead-code elimination keeps random-tagged ops (SDPA is
      one) whose results nobody reads, and AOTAutograd's default partitioner copied the ring's
      forward attention kernels into the backward. Its ``fake_mode`` (with a ShapeEnv) lets the
      compile caches serve the graph.
    - Lazy graph modules: the graphs AOTAutograd builds generate their Python code when first
      called, not each time one is built or edited (a tenth of the first call's time).
    - ``cacheable_functions`` and the nodes' example values (``record_example_values``, or a
      cached plan's): a job run again reuses what the caches kept of this graph.
    """
    with torch._guards.tracing(torch._guards.TracingContext(fake_mode)), \
            _use_lazy_graph_module(torch._dynamo.config.use_lazy_graph_module), \
            torch._inductor.config.patch(unsafe_marked_cacheable_functions=cacheable_functions(gm)):
        return backend(gm, examples)


def _held_rows_examples(fake_mode: FakeTensorMode, args, examples: list, positions_of: tuple[int, ...]) -> list:
    """``examples`` with each kv cache shard held cut over cp given a row count of its own (it
    differs between ranks and grows at every step; one compile serves them all), then the
    positions of those rows that ``positions_of`` asks for."""
    examples, rows = list(examples), {}
    for i, a in enumerate(args):
        shard = cache_shard(a)
        if shard is not None and shard.owners is not None:
            seq = shard_dim(shard.placements["cp"])
            shape = list(shard.local.shape)
            shape[seq] = rows[i] = fresh_size(fake_mode.shape_env, shape[seq], f"held_rows{i}")
            with fake_mode:
                examples[i] = torch.empty(shape, dtype=shard.local.dtype, device=shard.local.device)
    with fake_mode:
        return examples + [torch.empty(rows[i], dtype=torch.long, device=args[i].device) for i in positions_of]


def _check_param_dtype(param_dtype: torch.dtype | None, feeding: WholeParameters, args) -> None:
    """``param_dtype`` is how ``parallelize`` holds parameters: it makes Dynamo trace stand-ins
    of that dtype. A model's own parameters were traced in theirs, and the graph computes in it."""
    whole = [a for a in args if isinstance(a, torch.nn.Parameter) and standin_param(a) is None]
    if param_dtype is not None and not feeding.sharded and any(a.dtype != param_dtype for a in whole
                                                               if a.is_floating_point()):
        raise ValueError(f"hybrid_parallel: param_dtype={param_dtype} needs the model parallelized with it: "
                         f"dtensor_par.parallelize(model, mesh, example_inputs, param_dtype={param_dtype}) (or "
                         f"the dtensor_par.parallel decorator), then torch.compile; this graph's parameters are "
                         f"held and traced in {sorted({str(a.dtype) for a in whole})}")


def _local_inputs(args, cuts: list[dict[str, Placement]], feeding: WholeParameters, mesh: MeshInfo,
                  comm: str) -> list:
    """This rank's piece of each input, ``cuts[i]`` the placements that shard input ``i``."""
    return [feeding.local_input(a, c, mesh, comm) for a, c in zip(args, cuts)]


def _append(held, shape: list, new: torch.Tensor, c: CacheOutput):
    """``held`` (of global ``shape``) with the rows ``new`` appended, and its new shape. A
    sliding-window cache first drops the rows the window will lose, so that the new rows
    keep the rows that remain balanced over the ranks."""
    seq, added = c.grows_along, new.shape[c.grows_along]
    if c.keep_last is not None:
        kept = min(shape[seq], max(c.keep_last - added, 0))
        held, shape[seq] = held.kept_last(kept, shape[seq], seq), kept
    shape[seq] += added
    return held.appended(new), shape


@dataclass
class LocalGraph:
    """One specialization: the compiled per-rank graph, how its inputs are cut and its outputs placed."""

    fn: Callable
    cuts: list[dict[str, Placement]]  # per input, the placements it is sliced by at each call (feeding.cuts)
    output_placements: list[dict[str, Placement] | None]
    comm: str  # the lowering of the runtime's own collectives, as the graph's
    feeding: WholeParameters  # how this plan's parameters reach the graph
    key: tuple = ()  # the input signature it serves (symbolic sizes left out)
    specialization: Specialization | None = None  # a symbolic plan's guards; None: static sizes
    cache_outputs: tuple[CacheOutput, ...] = ()  # outputs held as kv cache shards (passes.kv_cache)
    positions_of: tuple[int, ...] = ()  # per input after the graph's own: the held cache whose positions it is
    constants: tuple[ConstantInput, ...] = ()  # the buffers whose values the plan read
    seen_unchanged: dict[int, tuple] = field(default_factory=dict)  # input index -> (storage, version) last found equal

    def local_args(self, args, mesh: MeshInfo) -> list:
        """This rank's piece of each graph input, as this plan feeds them, then the positions
        of the held kv cache shards that ``cached_attention`` reads."""
        return (_local_inputs(args, self.cuts, self.feeding, mesh, self.comm)
                + [cache_shard(args[i]).positions for i in self.positions_of])

    def hold_caches(self, outs, args, mesh: MeshInfo) -> list:
        """The graph's outputs, each kv cache shard replaced by the stand-in the model keeps;
        new rows for a cache held cut over cp are appended to its shards."""
        outs = list(outs)
        for c in self.cache_outputs:
            out = outs[c.index]
            if c.appends_to is not None:
                shard, shape = _append(cache_shard(args[c.appends_to]), list(args[c.appends_to].shape), out, c)
            else:
                shape = list(self.specialization.sizes_at(c.global_shape, args) if self.specialization
                             else c.global_shape)
                cut = {d: p for d, p in self.output_placements[c.index].items() if shard_dim(p) is not None}
                shard = laid_out(out, cut, mesh, shape[shard_dim(cut["cp"])] if "cp" in cut else None)
            if c.keep_last is not None:
                shard = shard.kept_last(c.keep_last, shape[c.grows_along], c.grows_along)
                shape[c.grows_along] = min(shape[c.grows_along], c.keep_last)
            outs[c.index] = hold(shard, tuple(shape), c.grows_along)
        return outs

    def serves(self, key: tuple, args) -> bool:
        return key == self.key and (self.specialization is None or self.specialization.holds(args)) \
            and not self.changed_constants(args)

    def changed_constants(self, args) -> list[str]:
        """The buffers the plan read whose values differ now: compared when the tensor or its
        version counter (bumped by every in-place write) is not the one last found equal."""
        changed = []
        for c in self.constants:
            value = args[c.index]
            stamp = None if value.is_inference() else (value.data_ptr(), value._version)
            if stamp is not None and self.seen_unchanged.get(c.index) == stamp:
                continue
            if not c.holds(args):
                changed.append(c.fqn)
            elif stamp is not None:
                self.seen_unchanged[c.index] = stamp
        return changed


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

    def __init__(self, gm: fx.GraphModule, backend: ParallelBackend):
        self.gm, self.backend = gm, backend
        self.config, self.mesh, self.info = backend.config, backend.mesh, backend.info
        self.graphs: list[LocalGraph] = []  # most recently used last
        self.scalars = scalar_inputs(gm)
        self.symbolic = meta.symbolic_inputs(gm)
        self.input_names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
        self.id = next(backend.graph_ids)
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
        if self.config.check_inputs:
            self._check_same_inputs(args)
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
        same = [g for g in self.graphs if g.key == key]
        if same and same[-1].specialization is not None and not same[-1].specialization.holds(args):
            return "guard failed: " + same[-1].specialization.failed(args)
        if same and (changed := same[-1].changed_constants(args)):
            return f"the values of {', '.join(changed)}, which the plan read (a buffer planned as a constant), changed"
        return _changes(self.graphs[-1].key, key, self.input_names + ["scalar"] * len(self.scalars))

    def __call__(self, *args):
        local_graph = self._lookup(args)
        local_args = local_graph.local_args(args, self.info)
        outs = local_graph.fn(*local_args)
        if local_graph.cache_outputs:
            outs = type(outs)(local_graph.hold_caches(outs, args, self.info))
        if self.config.output == "local":
            outs = type(outs)(self._as_dtensor(o, p) for o, p in zip(outs, local_graph.output_placements))
        return outs

    def _check_same_inputs(self, args) -> None:
        """Every rank holds the same inputs (``same_inputs``); parameters and held kv cache
        shards are each rank's own."""
        inputs = {name: a for name, a in zip(self.input_names, args) if isinstance(a, (torch.Tensor, int, float))
                  and not isinstance(a, nn.Parameter) and cache_shard(a) is None}
        dp = self.info.dims["dp"]
        if self.config.batch == "local":  # the ranks at one dp coordinate share its slice
            peers = [[group[c] for group in dp.groups] for c in range(dp.size)]
            hint = "Under batch='local' the ranks of one data-parallel coordinate must be given the same slice"
        else:
            peers = [list(range(self.info.world_size))]
            hint = ("Give every rank the same inputs" + (", or each data-parallel rank its own slice with "
                                                         "batch='local'" if dp.size > 1 else ""))
        check_same_inputs(f"hybrid_parallel (graph {self.id})", inputs, peers,
                          f"{hint}; check_inputs=False turns this check off")

    def _check_devices(self, args) -> None:
        for name, a in zip(self.input_names, args):
            if isinstance(a, torch.Tensor) and a.device.type != self.info.device_type:
                raise ValueError(
                    f"hybrid_parallel: input {name!r} is on {a.device.type} but the mesh is on "
                    f"{self.info.device_type}; move the model and inputs to the mesh's device type"
                )

    def _dump(self) -> GraphDump | None:
        if self.config.dump_dir is None:
            return None
        dims = self.info.dims  # this rank's coordinates name its folder
        coords = "_".join(f"{d}{dims[d].rank}" for d in self.info.order)
        folder = os.path.join(self.config.dump_dir, coords, f"graph{next(self.backend.plan_ids)}")
        return GraphDump(folder, self.info.order)

    def _build(self, args, key: tuple) -> LocalGraph:
        self._check_devices(args)
        if self.symbolic.symbolic:
            try:
                held = frozenset(i for i, a in enumerate(args) if cache_shard(a) is not None)
                return self._compile(args, key, self.symbolic.specialization(args, held))
            except (NotSymbolic, PlanningError) as e:
                logger.warning("hybrid_parallel: graph %d cannot be planned on symbolic sizes, so it is planned for "
                               "each size it meets: %s", self.id, e)
                self.symbolic = SymbolicInputs.static()
                key = self._key(args)
        return self._compile(args, key, None)

    def _compile(self, args, key: tuple, spec: Specialization | None) -> LocalGraph:
        """Plan (or read the plan from the plan cache) and compile for ``args``; with ``spec``, on
        its symbolic sizes."""
        feeding = feeding_for(args)
        _check_param_dtype(self.config.param_dtype, feeding, args)
        # static sizes are compiled on fakes too, as Dynamo hands them over: the compile caches need a ShapeEnv
        fake_mode = spec.fake_mode if spec else FakeTensorMode(shape_env=ShapeEnv(), allow_non_fake_inputs=True)
        store = self._plan_store(args, key, spec, feeding)
        cached = store.load(self.gm, spec, fake_mode) if store else None
        if cached and not all(c.holds(args) for c in cached[1].constants):
            cached = None  # planned for other values of a buffer it read
        local_gm, plan = cached or self._plan(args, spec, feeding)
        feeding.check(plan.params(args), plan.param_layouts, args, self.mesh, self.info)
        cuts = feeding.cuts(plan.input_placements, args)
        examples = self._local_examples(args, spec, plan, feeding, cuts, fake_mode)
        if cached:
            logger.info("hybrid_parallel: graph %d: plan read from the plan cache (%s)", self.id, store.path)
            for warning in plan.warnings:
                logger.warning(warning)
        else:
            if store or self.config.inner_backend not in NO_COMPILE_CACHES:
                record_example_values(local_gm, examples, fake_mode)
            if store:
                store.save(local_gm, plan, spec)
        fn = compile_recorded(self.backend.inner, local_gm, examples, fake_mode)
        if spec is not None:
            spec.seal()
        return LocalGraph(fn, cuts, plan.output_placements, plan.comm, feeding, key, spec, plan.cache_outputs,
                          plan.positions_of, plan.constants)

    def _plan_store(self, args, key: tuple, spec: Specialization | None, feeding: WholeParameters) -> PlanStore | None:
        """Where the plan cache keeps this plan; None when it is off (``plan_cache``, or a dump
        folder: the dump needs the passes)."""
        if not self.config.plan_cache or self.config.dump_dir is not None:
            return None
        return PlanStore(plan_key(self.gm, args, key, spec is not None, self.config, self.info, feeding,
                                  self.backend.sent_outputs, self.backend.vocab_cuts))

    def _plan(self, args, spec: Specialization | None, feeding: WholeParameters) -> tuple[fx.GraphModule, Plan]:
        local_gm, ctx = parallelize_graph(self.gm, args, self.info, self.config, feeding=feeding, dump=self._dump(),
                                          specialization=spec, sent_outputs=self.backend.sent_outputs,
                                          vocab_cuts=self.backend.vocab_cuts)
        return local_gm, Plan.of(local_gm, ctx)

    def _local_examples(self, args, spec: Specialization | None, plan: Plan, feeding: WholeParameters,
                        cuts: list[dict[str, Placement]], fake_mode: FakeTensorMode) -> list:
        """This rank's pieces of the inputs, as fakes of ``fake_mode``: what the inner backend compiles for."""
        examples = args
        if spec is not None:  # the inner backend compiles for the symbolic sizes; parameters are sliced as at run time
            examples = [a if isinstance(a, torch.nn.Parameter) or standin_param(a) is not None else x
                        for a, x in zip(args, spec.global_inputs)]
        with torch.no_grad(), (spec.fake_mode if spec else contextlib.nullcontext()):
            local = _local_inputs(examples, cuts, feeding, self.info, plan.comm)
            # a held kv cache shard is fed as the runtime holds it: contiguous, not its stand-in's strides
            local = [x.contiguous() if cache_shard(a) is not None else x for x, a in zip(local, args)]
        examples = [x.detach().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else x
                    for x, a in zip(static_fakes(fake_mode, local), args)]
        return _held_rows_examples(fake_mode, args, examples, plan.positions_of)

    def _as_dtensor(self, out, placements: dict[str, Placement] | None):
        """A local output as a DTensor: tp as planned, the sequence shard on ring and ulysses,
        the batch shard on the dp dims (the plan refuses zigzag and padded shards)."""
        if not isinstance(out, torch.Tensor) or placements is None or cache_shard(out) is not None:
            return out
        per_dim = {n: placements.get(d.name, Replicate()) for d in PLAN_DIMS_DECLARED for n in d.mesh_dims}
        return DTensor.from_local(out, self.mesh, [per_dim[n] for n in self.mesh.mesh_dim_names], run_check=False)
