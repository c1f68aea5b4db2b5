"""capture and specialize: name the parameter placeholders and keep the buffers' values; give
every node its concrete shape. Also what reads Dynamo's graph as it hands it over."""

from __future__ import annotations

import operator
import re
import types
from collections import Counter, deque
from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch._dynamo.utils import counters
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.experimental.proxy_tensor import snapshot_fake
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from ..errors import NotSupported
from ..symbolic import SymbolicInputs, is_symbolic, recording_guards
from .context import ParallelContext, ParamInfo, at_node
from .coverage import CONTRACTIONS
from .meta import BufferValue, module_paths, record_capture, set_buffer_value, set_param_fqn
from .nodes import acts_beyond_value, target_name, writes_in_place
from .recompute import allow_side_effects_in_regions, inline_checkpoints
from .rules.registry import lookup, op_kind

_SOURCE_PART = re.compile(r"_(?:modules|parameters|buffers)(?:'\])?\['([^']+)'\]")


def record_module_names(gm: fx.GraphModule) -> fx.GraphModule:
    """Keep each placeholder's module path while Dynamo's sources are there, and which input
    sizes are symbolic (``symbolic.SymbolicInputs``, from its example values): ``meta.record_capture``.

    ``L['self']._modules['attn']._parameters['weight']`` -> ``attn.weight`` (also when Dynamo
    spells the first step ``L['self'].__dict__['_modules']['attn']``). Dynamo drops the
    sources from node meta once its compile returns, and planning happens later.
    """
    names = {}
    for node in gm.graph.nodes:
        grapharg = node.meta.get("grapharg")
        parts = _SOURCE_PART.findall(grapharg.source.name) if grapharg is not None else []
        if node.op == "placeholder" and parts:
            names[node.name] = ".".join(parts)
    record_capture(gm, names, SymbolicInputs(gm))
    return gm


def handed_over(gm: fx.GraphModule) -> fx.GraphModule:
    """A graph as Dynamo hands it to a backend, made ready to plan: its module names recorded
    (``record_module_names``) and its checkpointed regions inlined (``recompute.inline_checkpoints``)."""
    return inline_checkpoints(record_module_names(gm))


class _Captured(BaseException):
    """Raised in place of running a captured graph: planning only needs the graph. Not an
    ``Exception``, so a model's own ``except Exception`` (transformers has some) cannot catch it
    and carry on eagerly."""


def graph_breaks() -> Counter:
    """Dynamo's graph breaks so far, by reason. A break where it cannot split the frame (inside
    an inlined call) makes it run the whole frame eagerly and compile the calls it makes:
    counted as unimplemented, not as a break."""
    return Counter(counters["graph_break"]) + Counter(counters["unimplemented"])


@dataclass(frozen=True)
class FrameCompile:
    """One frame Dynamo compiled: the graph breaks it counted and the graphs it handed to a backend."""
    number: int
    breaks: Counter
    graphs: int


_FRAMES: deque[FrameCompile] = deque(maxlen=256)
"""The frames Dynamo compiled last, oldest first."""
_AT_FRAME_START: list = [0, Counter(), 0]
"""The number of the frame Dynamo compiles now (or last), and the breaks and graphs counted when it started."""


def _graphs() -> int:
    return counters["stats"]["unique_graphs"]


def _frame_started(_args) -> None:
    _AT_FRAME_START[:] = [_AT_FRAME_START[0] + 1, graph_breaks(), _graphs()]


def _frame_ended(_args) -> None:
    number, breaks, graphs = _AT_FRAME_START
    _FRAMES.append(FrameCompile(number, graph_breaks() - breaks, _graphs() - graphs))


def frames_compiled() -> tuple[int, Counter, list[FrameCompile]]:
    """(the number of the frame Dynamo compiles now, the breaks it counted so far, the frames
    compiled before it). Dynamo counts graph breaks for the whole process; which frame counted a
    break tells whose it is (a VAE compiled with inductor beside the parallel transformer breaks
    in frames of its own). Dynamo's reset drops the callbacks that record the frames: a backend
    calls this at its construction and at each graph, which registers them again."""
    handler = torch._dynamo.callback_handler
    if _frame_started not in handler.start_callbacks:
        handler.register_start_callback(_frame_started)
        handler.register_end_callback(_frame_ended)
    number, breaks, _ = _AT_FRAME_START
    return number, graph_breaks() - breaks, list(_FRAMES)


def capture_graphs(model, *example_inputs, dynamic: bool | None = None, **example_kwargs) -> list[tuple]:
    """The (graph, example inputs) pairs Dynamo hands a backend for ``model(*example_inputs, **example_kwargs)``.

    Nothing of the model runs. Dynamo traces the call on fakes and applies a frame's side
    effects (a kv cache appended to, a counter incremented, an input written in place) only
    after its graph has run; the graph's compiled function stops the call instead, so the
    model, its inputs and the RNG are left as they were. A module is captured as
    ``torch.compile(module)`` captures it (hooks included), through ``nn.Module.__call__``
    whatever its class's own ``__call__`` does.
    A model whose graph Dynamo breaks is refused: reaching its next graph means running the
    first. Resets Dynamo's caches before and after (so repeated captures never hit its
    recompile limit, and a later compile of the model starts fresh).
    """
    captured = []

    def record(gm, inputs):
        captured.append((handed_over(gm), list(inputs)))

        def stop(*args):
            raise _Captured
        return stop

    call = model
    if isinstance(model, torch.nn.Module) and type(model).__call__ is not torch.nn.Module.__call__:
        call = types.MethodType(torch.nn.Module.__call__, model)  # a parallel-decorated class: not its own __call__
    torch._dynamo.reset()
    allow_side_effects_in_regions()
    breaks = graph_breaks()
    try:
        torch.compile(call, backend=record, dynamic=dynamic)(*example_inputs, **example_kwargs)
    except _Captured:
        pass
    finally:
        new_breaks = list((graph_breaks() - breaks).keys())
        torch._dynamo.reset()
    if new_breaks:
        raise NotImplementedError(
            f"{type(model).__name__}: Dynamo breaks its graph ({'; '.join(new_breaks)}). Planning without a "
            f"process group captures the model without running it, and the graphs after a break are only reached "
            f"by running the ones before (which would change the model's caches, buffers or inputs). Remove the "
            f"graph break (torch._dynamo.explain lists them), or compile with hybrid_parallel alone: it plans each "
            f"graph as Dynamo hands it over")
    if not captured:
        raise RuntimeError(f"capture_graphs: Dynamo captured no graph of {type(model).__name__}")
    return captured


def scalar_inputs(gm: fx.GraphModule) -> list[int]:
    """Inputs only read as Python scalars (``.item()``): floats that Dynamo lifted to tensors
    under ``dynamic=True``. Planning specializes on their values."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    return [i for i, n in enumerate(placeholders)
            if n.users and all(u.op == "call_method" and u.target == "item" for u in n.users)]


def capture_pass(gm: fx.GraphModule, ctx: ParallelContext) -> fx.GraphModule:
    """Record parameters and the values of the buffers the graph only reads; scalars read with
    ``.item()`` become constants (their readers lose Dynamo's values: ``specialize_pass`` finds
    them again)."""
    names = module_paths(gm)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(ctx.example_inputs):
        raise ValueError(f"capture: graph has {len(placeholders)} inputs, got {len(ctx.example_inputs)}")
    for i, (node, value) in enumerate(zip(placeholders, ctx.example_inputs)):
        if isinstance(value, torch.nn.Parameter):
            ctx.params[node.name] = ParamInfo(names.get(node.name, node.target), i, value)
            set_param_fqn(node, ctx.params[node.name].fqn)
        elif node.name in names and _known_value(value) and not _written(node):
            set_buffer_value(node, BufferValue(names[node.name], i, value))
    for i in scalar_inputs(gm):
        for item in list(placeholders[i].users):
            for reader in item.users:
                reader.meta.pop("example_value", None)
            item.replace_all_uses_with(ctx.example_inputs[i].item())
            gm.graph.erase_node(item)
    gm.recompile()
    return gm


def specialize_pass(gm: fx.GraphModule, ctx: ParallelContext) -> fx.GraphModule:
    """Specialize the graph to the concrete example inputs: every node gets ``meta["val"]``, a
    fake tensor with static sizes, or, planning symbolically (``ctx.fake_inputs``), sizes in the
    symbols. Integer-valued nodes (sizes of dynamic graphs) are replaced by their values (ints,
    or SymInts that localize turns back into nodes), so later passes see global sizes only."""
    refuse_data_dependent_sizes(gm)
    warn_of_unentered_subgraphs(gm, ctx)
    if ctx.fake_inputs is not None or not _values_from_dynamo(gm):
        _propagate(gm, ctx)
    for node in list(gm.graph.nodes):
        value = node.meta.get("val")
        if node.op == "output" or not isinstance(value, (int, torch.SymInt)) or isinstance(value, bool):
            continue
        node.replace_all_uses_with(value if is_symbolic(value) else int(value))
        if node.op != "placeholder" and not acts_beyond_value(node):
            gm.graph.erase_node(node)
    gm.graph.eliminate_dead_code(is_impure_node=lambda n: n.is_impure() or acts_beyond_value(n))
    _mark_requires_grad(gm, ctx.example_inputs)
    gm.recompile()
    return gm


def _known_value(value) -> bool:
    """Whether ``value`` is a tensor whose elements are known now: not a fake, nor on the meta
    device (a model built there has none), nor one autograd differentiates."""
    return isinstance(value, torch.Tensor) and not isinstance(value, FakeTensor) and value.device.type != "meta" \
        and not value.requires_grad


def _written(node: fx.Node) -> bool:
    """Whether the graph writes ``node``, or a view of it, in place (a buffer it updates)."""
    views = [node]
    while views:
        viewed = views.pop()
        for user in viewed.users:
            if user.args and user.args[0] is viewed and (writes_in_place(user) or user.target is operator.setitem):
                return True
            kind = lookup(user)
            if user.target is operator.getitem or kind is not None and kind.family == "views":
                views.append(user)
    return False


def refuse_data_dependent_sizes(gm: fx.GraphModule) -> None:
    """An op whose output size depends on its input's values (``nonzero``, ``torch.where(mask)``
    outside a loop over experts, which ``expert_loop`` reads first; ``.item()`` of a computed
    tensor), captured under Dynamo's
    ``capture_dynamic_output_shape_ops`` or ``capture_scalar_outputs``, has no size to plan with:
    every placement and local shape is laid out by sizes. Dynamo marks the node that makes such a
    size (``unbacked_bindings``); an input's ``.item()`` is a constant by then (``scalar_inputs``)."""
    for node in gm.graph.nodes:
        if node.meta.get("unbacked_bindings"):
            shapes = [list(i.meta["example_value"].shape) for i in node.all_input_nodes
                      if isinstance(i.meta.get("example_value"), torch.Tensor)]
            code = [line.strip() for line in node.meta.get("stack_trace", "").splitlines() if line.strip(" ^")]
            raise NotSupported(
                f"capture: {node.name} ({target_name(node)}) of inputs {shapes}"
                f"{f' ({code[-2]}: {code[-1]})' if len(code) >= 2 else ''} makes a size (or number) that depends "
                f"on the values of its input (Dynamo's capture_dynamic_output_shape_ops or capture_scalar_outputs), "
                f"which no plan can lay out. Compile without those options: Dynamo then breaks the graph there and "
                f"runs the code around it whole on every rank, between the planned graphs (a loop over every expert of "
                f"an nn.ModuleList, one torch.where of the one-hot choice each or one mask of the chosen ids each, is "
                f"read as experts and runs sharded; so do transformers' experts_implementation='grouped_mm' experts)")


_ENTERED = {torch.ops.higher_order.autograd_function_apply}
"""Calls of a subgraph the planner reads (``rules.pointwise.elementwise_function_rule``)."""


def warn_of_unentered_subgraphs(gm: fx.GraphModule, ctx: ParallelContext) -> None:
    """Warn of each call of a subgraph that computes linears or attention which the planner
    does not enter (``torch.cond``, a nested compile region): it runs whole on every rank.
    A checkpointed region is entered: it was inlined (``recompute.inline_checkpoints``)."""
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target in _ENTERED:
            continue
        bodies = [getattr(gm, a.target) for a in node.all_input_nodes if a.op == "get_attr"
                  and isinstance(getattr(gm, a.target), fx.GraphModule)]
        computed = [n for body in bodies for n in body.graph.nodes if op_kind(n) in CONTRACTIONS + ("sdpa",)]
        if computed:
            ctx.warn(f"capture: {node.name} ({target_name(node)}) runs a subgraph the planner does not enter, whole on "
                     f"every rank: {len(computed)} of its ops are linears or attention "
                     f"({', '.join(sorted({target_name(n) for n in computed}))})")


def _propagate(gm: fx.GraphModule, ctx: ParallelContext) -> None:
    """``meta["val"]`` of every node, by running the graph on fake inputs: static copies of the
    example inputs, or, planning symbolically, ``ctx.fake_inputs``."""
    if ctx.fake_inputs is not None:
        fake_inputs = ctx.fake_inputs
        mode = detect_fake_mode([x for x in fake_inputs if isinstance(x, torch.Tensor)])
    else:
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        fake_inputs = [mode.from_tensor(v, static_shapes=True) if isinstance(v, torch.Tensor) else v
                       for v in ctx.example_inputs]
    with mode, recording_guards(ctx.specialization, "capture"):
        _GuardedProp(gm, mode, ctx.specialization).propagate_dont_convert_inputs(*fake_inputs)


def _values_from_dynamo(gm: fx.GraphModule) -> bool:
    """``meta["val"]`` of every node from the fake value Dynamo traced it with, snapshotted as
    ``FakeTensorProp`` records it: the values ``_propagate`` would find, without running every
    op again (two thirds of the passes' time on a 24-layer graph). False, changing nothing, where
    a node has none (a graph Dynamo did not make) or one has symbolic sizes."""
    nodes = [n for n in gm.graph.nodes if n.op != "output" and n.target not in _RETURN_NONE]
    if not all("example_value" in n.meta for n in nodes):
        return False
    values = [fx.node.map_aggregate(n.meta["example_value"], _static_snapshot) for n in nodes]
    if any(v is _NEEDS_PROPAGATION for value in values for v in pytree.tree_leaves(value)):
        return False
    for node, value in zip(nodes, values):
        if value is not None:
            node.meta["val"] = value
    output = gm.graph.output_node()
    output.meta["val"] = fx.node.map_aggregate(
        output.args[0], lambda a: _static_snapshot(a.meta["example_value"] if isinstance(a, fx.Node) else a))
    return True


_RETURN_NONE = {operator.setitem, torch._C._log_api_usage_once}
"""Calls Dynamo records without an example value: they return None, which ``FakeTensorProp``
records as no value either."""

_NEEDS_PROPAGATION = object()  # a value with symbolic sizes, or a real tensor: _propagate's to find


def _static_snapshot(value):
    """What ``FakeTensorProp`` records for an op's result: a detached fake tensor, a number, or None."""
    if isinstance(value, FakeTensor):
        sizes = (*value.shape, *value.stride(), value.storage_offset())
        return _NEEDS_PROPAGATION if any(isinstance(s, torch.SymInt) for s in sizes) else snapshot_fake(value)
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool, torch.Tensor)):
        return _NEEDS_PROPAGATION
    return value if isinstance(value, (int, float, bool)) else None


class _GuardedProp(FakeTensorProp):
    """Fake propagation that attributes each guard it adds to the op that needed it."""

    def __init__(self, gm, mode, spec):
        super().__init__(gm, mode)
        self.spec = spec

    def run_node(self, n):
        with at_node("capture", n), \
                recording_guards(self.spec, f"{n.name} ({n.target if isinstance(n.target, str) else n.target.__name__})"):
            return super().run_node(n)


def _mark_requires_grad(gm: fx.GraphModule, example_inputs: list) -> None:
    """``meta["requires_grad"]``: whether autograd will want the node's gradient.

    Fake values cannot tell (their snapshots are detached), and localize needs it to add a
    backward collective only where a gradient flows.
    """
    placeholders = iter(example_inputs)
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if node.op == "placeholder":
            example = next(placeholders)
            flows = isinstance(example, torch.Tensor) and example.requires_grad
        else:
            flows = (node.target != "detach" and _differentiable(val)
                     and any(i.meta.get("requires_grad") for i in node.all_input_nodes))
        node.meta["requires_grad"] = flows


def _differentiable(val) -> bool:
    """A floating (or complex) tensor, or a tuple holding one: integers (sort's indices, an
    expert's token counts) never have a gradient."""
    if isinstance(val, (tuple, list)):
        return any(map(_differentiable, val))
    return isinstance(val, torch.Tensor) and (val.is_floating_point() or val.is_complex())
