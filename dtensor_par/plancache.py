"""A disk cache of plans: a job run again on the same machine skips planning.

What the runtime compiles for a captured graph (this rank's graph with each node's local
``example_value``, and the placements around it: ``Plan``) depends only on what ``plan_key``
hashes: the captured graph's code and module paths, its inputs' signature, the plan options,
this rank's place in the mesh, how parameters are fed, the grad mode, dtensor_par's source and
torch's version. Any change is another key, so a stale plan is never read. The values of the
buffers a plan read (``Plan.constants``) are not in the key: the runtime compares them with
the inputs before it uses a plan, read from here or not. Plans live next to
inductor's caches (its ``cache_dir()``, ``TORCHINDUCTOR_CACHE_DIR``), one file per key, written
whole or not at all; an entry that cannot be read is planned again.

Not stored, so planned at every start as before: a graph with submodules or attributes, one
with an example value that is not a tensor, size or number (or has a size outside the plan's
symbols), one whose meta does not pickle, and a symbolic plan once anything was
decided on its sizes (a guard): a fresh specialization of the same inputs would not hold it.
"""

from __future__ import annotations

import functools
import glob
import hashlib
import os
import pickle
import tempfile
from dataclasses import dataclass

import sympy
import torch
import torch.fx as fx
from torch._inductor.runtime.cache_dir_utils import cache_dir
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.experimental.symbolic_shapes import statically_known_true

from .logs import logger
from .params import HeldLayout, fed_placements, held_layouts
from .passes import meta
from .passes.context import ParallelContext, ParamInfo
from .planning import on_captured
from .placements import Placement
from .same_inputs import fingerprint
from .sequence_pieces import sequence_piece
from .symbolic import Specialization

PLANS_DIR = "dtensor_par_plans"


@functools.cache
def source_digest() -> str:
    """A digest of dtensor_par's source: what its passes plan and its functions in a graph do."""
    root = os.path.dirname(os.path.abspath(__file__))
    digest = hashlib.sha256()
    for path in sorted(glob.glob(os.path.join(root, "**", "*.py"), recursive=True)):
        with open(path, "rb") as f:
            digest.update(os.path.relpath(path, root).encode() + b"\0" + f.read())
    return digest.hexdigest()


def plan_key(gm: fx.GraphModule, args, signature: tuple, symbolic: bool, config, mesh, feeding,
             sent_outputs: dict[int, int], vocab_cuts: dict | None) -> str:
    """Everything a plan of ``gm`` for ``args`` (``signature``: the runtime's key for them) depends
    on; an input given as its piece over cp (``sequence_pieces``), ``sent_outputs`` (a
    pipeline stage's pieces) and ``vocab_cuts`` (a stage's, decided on the whole graph) too."""
    pieces = [getattr(sequence_piece(a), "dim", None) for a in args]
    parts = (gm.code, meta.module_paths(gm), [type(a).__name__ for a in args], signature, symbolic,
             meta.symbolic_inputs(gm).inputs, config.plan_key(), mesh, type(feeding).__name__,
             torch.is_grad_enabled(), source_digest(), torch.__version__, pieces, sorted(sent_outputs.items()),
             None if vocab_cuts is None else sorted(vocab_cuts.items()))
    return hashlib.sha256(repr(parts).encode()).hexdigest()


@dataclass(frozen=True)
class ConstantInput:
    """A module buffer whose values the plan read (``meta.BufferValue``: a causal mask kept in a
    buffer, planned as causal attention): the plan holds only while the buffer's fingerprint
    (``same_inputs.fingerprint``) is this one."""

    fqn: str
    index: int  # position among the graph's inputs
    fingerprint: tuple[int, ...]

    def holds(self, args) -> bool:
        return tuple(fingerprint(args[self.index]).tolist()) == self.fingerprint


@dataclass
class Plan:
    """What the runtime needs around a planned graph: its inputs' and outputs' placements, the
    lowering of its collectives, what the parameter feeding checks, the warnings planning gave."""

    input_placements: list[dict[str, Placement]]
    output_placements: list[dict[str, Placement] | None]
    comm: str
    param_layouts: dict[str, HeldLayout]  # how each parameter is held once parallelized
    param_positions: dict[str, tuple[str, int]]  # parameter placeholder -> (fqn, input index)
    warnings: list[str]
    cache_outputs: tuple = ()  # passes.kv_cache.CacheOutput per output held as a kv cache shard
    positions_of: tuple[int, ...] = ()  # per input after the graph's own: the held cache whose positions it is
    constants: tuple[ConstantInput, ...] = ()  # the buffers whose values it read

    @classmethod
    def of(cls, gm: fx.GraphModule, ctx: ParallelContext) -> Plan:
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        index = {n.name: i for i, n in enumerate(placeholders)}
        positions_of = tuple(index[ctx.positions_of[n.name]] for n in placeholders if n.name in ctx.positions_of)
        layouts = held_layouts(ctx)
        return cls([fed_placements(meta.placements(n), layouts.get(n.name)) for n in placeholders],
                   ctx.output_placements, ctx.comm, layouts, {name: (p.fqn, p.index) for name, p in ctx.params.items()},
                   list(ctx.warnings), ctx.cache_outputs, positions_of, _constants_read(placeholders))

    def params(self, args) -> dict[str, ParamInfo]:
        """The parameters among ``args``, as capture records them."""
        return {name: ParamInfo(fqn, i, args[i]) for name, (fqn, i) in self.param_positions.items()}


def _constants_read(placeholders: list[fx.Node]) -> tuple[ConstantInput, ...]:
    read = [b for b in map(meta.buffer_value, placeholders) if b is not None and b.read]
    return tuple(ConstantInput(b.fqn, b.index, tuple(fingerprint(b.value).tolist())) for b in read)


@dataclass(frozen=True)
class _SizeValue:
    expr: sympy.Expr


@dataclass(frozen=True)
class _TensorValue:
    shape: tuple
    stride: tuple
    dtype: torch.dtype
    device: torch.device
    requires_grad: bool
    view: tuple | None  # (storage offset, storage size in elements) of a view; None: it spans a storage of its own


class _Unstorable(Exception):
    """A value the example values cannot be rebuilt from."""


def _stored_size(size, symbols: set):
    if not isinstance(size, torch.SymInt):
        return size
    expr = size.node.expr
    if not expr.free_symbols <= symbols:
        raise _Unstorable(f"size {expr} is not in the plan's symbols")
    return int(expr) if expr.is_number else _SizeValue(expr)


def _spans_storage(value: FakeTensor) -> bool:
    """Whether ``value`` starts its storage and ends it, as ``empty_strided`` makes one: then
    one fake op rebuilds it, not two (a warm start of the DiT: 0.05 s of CPU per rank, not 0.10 s)."""
    if not all(statically_known_true(s >= 1) for s in value.shape):
        return False
    extent = 1 + sum((size - 1) * stride for size, stride in zip(value.shape, value.stride()))
    return statically_known_true(value.storage_offset() == 0) and \
        statically_known_true(value.untyped_storage().nbytes() == extent * value.element_size())


def _stored_value(value, symbols: set):
    """An example value as (picklable) metadata: fake tensors' sizes, strides, dtype, device."""
    if isinstance(value, FakeTensor):
        view = None if _spans_storage(value) else (value.storage_offset(),
                                                   value.untyped_storage().nbytes() // value.element_size())
        return _TensorValue(_stored_value(tuple(value.shape), symbols), _stored_value(value.stride(), symbols),
                            value.dtype, value.device, value.requires_grad, _stored_value(view, symbols))
    if isinstance(value, torch.SymInt):
        return _stored_size(value, symbols)
    if isinstance(value, (tuple, list)):
        return type(value)(_stored_value(v, symbols) for v in value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise _Unstorable(f"a value of type {type(value).__name__}")


def _example_value(stored, mode: FakeTensorMode):
    """The value ``_stored_value`` kept, as a fake tensor (or size) of ``mode``."""
    if isinstance(stored, _SizeValue):
        env = mode.shape_env
        return env.create_symintnode(stored.expr, hint=int(stored.expr.xreplace(env.backed_var_to_val)))
    if isinstance(stored, _TensorValue):
        shape, stride = _example_value(stored.shape, mode), _example_value(stored.stride, mode)
        with mode:
            if stored.view is None:
                value = torch.empty_strided(shape, stride, dtype=stored.dtype, device=stored.device)
            else:
                offset, size = _example_value(stored.view, mode)
                value = torch.empty(size, dtype=stored.dtype, device=stored.device).as_strided(shape, stride, offset)
        return value.requires_grad_(stored.requires_grad)
    if isinstance(stored, (tuple, list)):
        return type(stored)(_example_value(s, mode) for s in stored)
    return stored


def _stored_graph(gm: fx.GraphModule) -> fx.Graph:
    """A copy of ``gm``'s graph on its own (no module to pickle with it), its nodes keeping the
    meta the compile reads (Dynamo's), not the planning's."""
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    for node in graph.nodes:
        node.meta = {k: v for k, v in node.meta.items() if not k.startswith("dtensor_par") and k != "example_value"}
    return graph


class PlanStore:
    """The cache entry of one plan key."""

    def __init__(self, key: str):
        self.path = os.path.join(cache_dir(), PLANS_DIR, f"{key}.pkl")

    def load(self, captured: fx.GraphModule, spec: Specialization | None,
             mode: FakeTensorMode) -> tuple[fx.GraphModule, Plan] | None:
        """The stored graph (over the ``captured`` one, as planning makes it), its example values
        made in ``mode``, and its plan; None if not stored."""
        try:
            with open(self.path, "rb") as f:
                entry = pickle.load(f)
        except FileNotFoundError:
            return None
        except Exception as e:  # noqa: BLE001  (an unreadable entry is planned again, as a missing one)
            logger.warning("hybrid_parallel: ignoring the unreadable plan cache entry %s (%s: %s)", self.path,
                           type(e).__name__, e)
            return None
        if entry["symbols"] != (list(spec.names) if spec else []):
            return None
        gm = on_captured(captured, entry["graph"])
        for node in gm.graph.nodes:
            if node.name in entry["example_values"]:
                node.meta["example_value"] = _example_value(entry["example_values"][node.name], mode)
        return gm, entry["plan"]

    def save(self, gm: fx.GraphModule, plan: Plan, spec: Specialization | None) -> None:
        """Store ``gm`` (its example values recorded) and ``plan``, where a later start can use them as they are."""
        try:
            if spec is not None and not spec.unconstrained():
                raise _Unstorable("planning decided on its sizes")
            if any(n.op in ("get_attr", "call_module") for n in gm.graph.nodes):
                raise _Unstorable("it has attributes or submodules")
            if any(isinstance(n, torch.SymInt) for c in plan.cache_outputs for n in c.global_shape):
                raise _Unstorable("the shape of its kv cache is symbolic")
            symbols = list(spec.names) if spec else []
            values = {n.name: _stored_value(n.meta["example_value"], set(symbols))
                      for n in gm.graph.nodes if "example_value" in n.meta}
            data = pickle.dumps({"graph": _stored_graph(gm), "plan": plan, "symbols": symbols,
                                 "example_values": values})
        except (_Unstorable, pickle.PicklingError, AttributeError, TypeError, RuntimeError) as e:
            # RuntimeError: a custom op's packet (transformers' grouped_mm_fallback) refuses pickling so
            logger.info("hybrid_parallel: the plan cache will not keep this plan: %s", e)
            return
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=os.path.dirname(self.path), delete=False) as f:
            f.write(data)
        os.replace(f.name, self.path)
