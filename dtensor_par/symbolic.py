"""Symbolic sizes: one plan and one inner compile for every size a dynamic graph meets.

Dynamo hands the backend a graph with symbolic sizes (``dynamic=True``, ``mark_dynamic``, or
its automatic dynamic shapes at the second size it sees): SymInt placeholders and fake
``example_value``s whose sizes are its symbols. ``SymbolicInputs`` mirrors those symbols in a
ShapeEnv of our own, so the passes plan on fake tensors whose sizes are symbols and every local
size becomes an expression in them (``materialize_sizes`` turns those into graph nodes over the
SymInt placeholders). Whatever a pass or the inner backend decides on a symbol's value (a
Python ``if`` on a size) becomes a guard of our ShapeEnv: the plan serves exactly the sizes
that satisfy its guards (``Specialization``), and the runtime plans again, naming the failed
guard, for a size that does not.
"""

from __future__ import annotations

import contextlib
import contextvars
import operator
from dataclasses import dataclass, field

import sympy
import torch
import torch.fx as fx
from torch._dynamo.source import ConstantSource
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, statically_known_true, sym_eq
from torch.utils._sympy.functions import FloorDiv, Max, Min, Mod, PythonMod


def _symbol(x) -> sympy.Symbol | None:
    if isinstance(x, torch.SymInt) and isinstance(x.node.expr, sympy.Symbol):
        return x.node.expr
    return None


def is_symbolic(x) -> bool:
    """Whether ``x`` (a size) is an expression in symbols rather than a number."""
    return isinstance(x, torch.SymInt) and bool(x.node.expr.free_symbols)


def hint(x):
    """A size's value at the sizes a plan was made for: for reports, without adding a guard."""
    return x.node.hint if isinstance(x, torch.SymInt) else x


def same_size(a, b) -> bool:
    """``a == b`` for sizes; symbolic ones only when equal for every value of their symbols
    (asking the value would pin the plan to it)."""
    if is_symbolic(a) or is_symbolic(b):
        return statically_known_true(sym_eq(a, b))
    return a == b


class NotSymbolic(NotImplementedError):
    """This graph cannot be planned on its symbols; it is planned per size instead."""


@dataclass
class Specialization:
    """What a symbolic plan was decided on: the guards its sizes must satisfy, and where each
    came from (the pass, and the node it was at, or the inner backend)."""

    fake_mode: FakeTensorMode
    global_inputs: list  # the fake inputs the plan was made on (guards are checked against them)
    names: dict  # our symbol -> the user's name for it (``x.size(1)``)
    positions: dict  # our symbol -> (input index, dim, or None for a SymInt input) it is read from
    origins: list[str] = field(default_factory=list)  # one per guard of shape_env.guards
    code: str | None = None

    @property
    def shape_env(self) -> ShapeEnv:
        return self.fake_mode.shape_env

    def seal(self) -> None:
        self.origins += ["the inner backend"] * (len(self.shape_env.guards) - len(self.origins))
        placeholders = [x for x in self.global_inputs if isinstance(x, (torch.Tensor, torch.SymInt))]
        self.code = self.shape_env.produce_guards_expression(placeholders)

    def unconstrained(self) -> bool:
        """Whether nothing was decided on the sizes (no guard, replacement, runtime assert or
        data-dependent size): a fresh specialization of the same inputs is then this one."""
        env = self.shape_env
        return not (env.guards or env.replacements or env.deferred_runtime_asserts) and env.var_to_range.keys() == \
            self.names.keys()

    def _placeholder_args(self, args) -> list:
        return [a for a, x in zip(args, self.global_inputs) if isinstance(x, (torch.Tensor, torch.SymInt))]

    def holds(self, args) -> bool:
        return self.code is None or self.shape_env.evaluate_guards_expression(self.code, self._placeholder_args(args))

    def _values(self, args) -> dict:
        return {sym: int(args[i]) if d is None else args[i].shape[d] for sym, (i, d) in self.positions.items()}

    def sizes_at(self, sizes, args) -> tuple[int, ...]:
        """``sizes``, expressions in this plan's symbols, at the sizes of ``args``."""
        values = self._values(args)
        return tuple(int(s.node.expr.xreplace(values)) if isinstance(s, torch.SymInt) else s for s in sizes)

    def failed(self, args) -> str:
        """The first guard ``args`` break, in the names of the user's sizes, and its origin."""
        values = self._values(args)
        for guard, origin in zip(self.shape_env.guards, self.origins):
            expr = guard.expr
            if not bool(expr.xreplace(values)):
                return f"{_named(expr, self.names)} (from {origin}) is false for {_named_values(values, self.names)}"
        return "a size relation Dynamo's guards assumed"  # duck-sized dims that differ now

    def symbolic_names(self) -> list[str]:
        """The sizes the plan serves every value of: those no guard pinned to one."""
        pinned = {sym for sym, value in self.shape_env.replacements.items() if not value.free_symbols}
        return [name for sym, name in self.names.items() if sym not in pinned]

    def named(self, size) -> str:
        """A size in the names of the user's sizes (``L['x'].size(1)``)."""
        return _named(size.node.expr, self.names) if isinstance(size, torch.SymInt) else str(size)

    def specialized(self) -> list[str]:
        """Each guard that pins a symbol to a set of values, with its origin (for ``explain``)."""
        return [f"{_named(g.expr, self.names)} (from {o})" for g, o in zip(self.shape_env.guards, self.origins)
                if g.expr.free_symbols]


def _named(expr, names: dict) -> str:
    return str(expr.xreplace({s: sympy.Symbol(n, integer=True) for s, n in names.items()}))


def _named_values(values: dict, names: dict) -> str:
    return ", ".join(f"{names.get(s, s)}={v}" for s, v in values.items())


class SymbolicInputs:
    """Which of a captured graph's inputs Dynamo made symbolic, read at capture time (Dynamo
    drops ``example_value`` later), and how to make fake inputs of the same symbols."""

    def __init__(self, gm: fx.GraphModule):
        self.inputs = []  # per placeholder: "symint", a tuple of (dynamo symbol or None) per dim, or None
        self.names: dict[sympy.Symbol, str] = {}  # dynamo symbol -> a name the user knows (``x.size(1)``)
        self.unsupported: str | None = None  # why these inputs cannot be planned on their symbols
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        for node in placeholders:
            value = node.meta.get("example_value")
            if isinstance(value, torch.SymInt):
                self.inputs.append("symint")
                sym = _symbol(value)
                if sym is not None:
                    self.names.setdefault(sym, str(sym))
            elif isinstance(value, torch.Tensor):
                dims = tuple(_symbol(s) if is_symbolic(s) else None for s in value.shape)
                self.inputs.append(dims)
                grapharg = node.meta.get("grapharg")
                source = grapharg.source.name if grapharg is not None else node.name
                for d, s in enumerate(dims):
                    if s is not None:
                        self.names[s] = f"{source}.size({d})"  # a tensor's name wins over the SymInt's
                if any(is_symbolic(s) and _symbol(s) is None for s in value.shape):
                    self.unsupported = f"a size of {source} is an expression, not a symbol: {list(value.shape)}"
            else:
                self.inputs.append(None)
        self.placeholder_symbols = [_symbol(n.meta["example_value"]) if kind == "symint" else None
                                    for n, kind in zip(placeholders, self.inputs)]
        self.symints = {s for s in self.placeholder_symbols if s is not None}
        missing = [name for s, name in self.names.items() if s not in self.symints]
        if missing:
            self.unsupported = f"sizes {missing} reach the graph without a SymInt input"
        if any(kind == "symint" and s is None for kind, s in zip(self.inputs, self.placeholder_symbols)):
            self.unsupported = "a SymInt input is an expression, not a symbol"

    @property
    def symbolic(self) -> bool:
        return bool(self.names)

    def static_key(self, args) -> tuple:
        """What a symbolic plan still depends on: everything in the input signature but the
        symbolic sizes (and the SymInt inputs that carry them)."""
        key = []
        for kind, a in zip(self.inputs, args):
            if kind == "symint":
                key.append("symint")
            elif isinstance(kind, tuple) and isinstance(a, torch.Tensor):
                shape = tuple(None if s is not None else n for s, n in zip(kind, a.shape))
                key.append((shape, a.dtype, a.device, a.requires_grad))
            elif isinstance(a, torch.Tensor):
                key.append((tuple(a.shape), a.dtype, a.device, a.requires_grad))
            else:
                key.append((type(a), a if isinstance(a, (int, float, bool)) else None))
        return tuple(key)

    @classmethod
    def static(cls) -> SymbolicInputs:
        """Inputs planned for each size they take."""
        self = cls.__new__(cls)
        self.inputs, self.names, self.placeholder_symbols, self.symints = [], {}, [], set()
        self.unsupported = None
        return self

    def specialization(self, args, held: frozenset[int] = frozenset()) -> Specialization:
        """Fake inputs with one fresh symbol of our ShapeEnv per Dynamo symbol, in the
        Specialization that collects the guards a plan on them makes. ``held``: the inputs
        standing in for a shard the runtime holds (a kv cache): the graph is fed the shard,
        so the stand-in's strides do not matter."""
        if self.unsupported:
            raise NotSymbolic(self.unsupported)
        shape_env = ShapeEnv()
        mode = FakeTensorMode(shape_env=shape_env, allow_non_fake_inputs=True)
        ours, names, positions = {}, {}, {}

        def symint(dynamo_sym, value: int, position: tuple):
            if dynamo_sym not in ours:
                source = ConstantSource(f"dtensor_par_s{len(ours)}")
                expr = shape_env.create_symbol(value, source, dynamic_dim=DimDynamic.DYNAMIC)
                ours[dynamo_sym] = shape_env.create_symintnode(expr, hint=value, source=source)
                names[expr], positions[expr] = self.names[dynamo_sym], position
            return ours[dynamo_sym]

        for i, (kind, a) in enumerate(zip(self.inputs, args)):  # tensor sizes first: they name the symbols
            if isinstance(kind, tuple) and isinstance(a, torch.Tensor):
                for d, (s, n) in enumerate(zip(kind, a.shape)):
                    if s is not None:
                        symint(s, n, (i, d))
        fakes = []
        for i, (kind, a, sym) in enumerate(zip(self.inputs, args, self.placeholder_symbols)):
            if kind == "symint":
                fakes.append(symint(sym, int(a), (i, None)))
            elif isinstance(kind, tuple) and isinstance(a, torch.Tensor) and any(s is not None for s in kind):
                if not a.is_contiguous() and i not in held:
                    raise NotSymbolic("a symbolic input is not contiguous")
                sizes = [symint(s, n, (i, d)) if s is not None else n for d, (s, n) in enumerate(zip(kind, a.shape))]
                with mode:  # a held input's stand-in is one element expanded (its guards check its strides)
                    fakes.append(torch.empty((), dtype=a.dtype, device=a.device).expand(sizes) if i in held else
                                 torch.empty(sizes, dtype=a.dtype, device=a.device).requires_grad_(a.requires_grad))
            else:
                fakes.append(a)
        spec = Specialization(mode, fakes, names, positions)
        spec.global_inputs = static_fakes(mode, fakes)
        return spec


def fresh_size(shape_env: ShapeEnv, hint: int, name: str) -> torch.SymInt:
    """A size of its own, for a dim a compiled graph must take at any value that no input of
    the global graph gives. Its hint is at least 2, so it is not specialized to 0 or 1."""
    source = ConstantSource(f"dtensor_par_{name}")
    hint = max(hint, 2)
    return shape_env.create_symintnode(shape_env.create_symbol(hint, source, dynamic_dim=DimDynamic.DYNAMIC),
                                       hint=hint, source=source)


def static_fakes(fake_mode: FakeTensorMode, values: list) -> list:
    """``values`` with every real tensor (parameters, static inputs) made a fake tensor of
    static sizes in ``fake_mode``: otherwise the inner backend would give its sizes symbols."""
    return [fake_mode.from_tensor(v, static_shapes=True)
            if isinstance(v, torch.Tensor) and not isinstance(v, FakeTensor) else v for v in values]


_recording: contextvars.ContextVar = contextvars.ContextVar("dtensor_par_guard_origins", default=None)


@contextlib.contextmanager
def recording_guards(spec: Specialization | None, where: str):
    """Attribute the guards added inside to ``where`` (a pass, or a pass at one node)."""
    if spec is None:
        yield
        return
    outer = _recording.get()
    token = _recording.set(spec)
    try:
        yield
    finally:
        _recording.reset(token)
        if outer is None or outer is spec:
            spec.origins += [where] * (len(spec.shape_env.guards) - len(spec.origins))


def guards_at(where: str):
    """Inside a pass that records guards: attribute the guards added inside to ``where``."""
    return recording_guards(_recording.get(), where)


def materialize_sizes(gm: fx.GraphModule) -> None:
    """Turn every symbolic size in a node's arguments into nodes computing it from the SymInt
    placeholders, so the graph runs at any size."""
    graph = gm.graph
    symint_nodes = {v.node.expr: n for n in graph.nodes if n.op == "placeholder"
                    for v in [n.meta.get("val")] if is_symbolic(v)}
    cache: dict = {}

    def emit(expr, before: fx.Node):
        if isinstance(expr, (sympy.Integer, int)):
            return int(expr)
        if expr in cache:
            return cache[expr]
        if isinstance(expr, sympy.Symbol):
            if expr not in symint_nodes:
                raise NotSymbolic(f"size symbol {expr} has no SymInt input")
            return symint_nodes[expr]
        if isinstance(expr, (sympy.Add, sympy.Mul)):
            fn, args = (operator.add if isinstance(expr, sympy.Add) else operator.mul), list(expr.args)
        elif isinstance(expr, FloorDiv):
            fn, args = operator.floordiv, list(expr.args)
        elif isinstance(expr, (Mod, PythonMod)):
            fn, args = operator.mod, list(expr.args)
        elif isinstance(expr, (Max, Min)):  # a sliding window's first key: max(0, n - window)
            fn, args = (torch.sym_max if isinstance(expr, Max) else torch.sym_min), list(expr.args)
        else:
            raise NotSymbolic(f"cannot compute size {expr} in the graph")
        with graph.inserting_before(before):
            value = emit(args[0], before)
            for a in args[1:]:
                value = graph.call_function(fn, (value, emit(a, before)))
        cache[expr] = value
        return value

    first = next(n for n in graph.nodes if n.op != "placeholder")

    def convert(a):
        return emit(a.node.expr, first) if isinstance(a, torch.SymInt) else a

    for node in list(graph.nodes):
        if node.op in ("call_function", "call_method", "call_module", "output"):
            node.args, node.kwargs = fx.node.map_aggregate(node.args, convert), fx.node.map_aggregate(node.kwargs, convert)
