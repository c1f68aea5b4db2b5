"""Planning: one captured graph in, this rank's graph out, by the steps of ``passes.steps``."""

from __future__ import annotations

import copy
import dataclasses
import time
import warnings

import torch.fx as fx
from torch.fx._lazy_graph_module import _LazyGraphModule

from .config import ParallelConfig
from .dump import GraphDump
from .errors import USER_ERRORS, PlanningError
from .logs import logger
from .mesh import MeshInfo
from .params import WHOLE, WholeParameters
from .placements import Placement
from .passes.context import ParallelContext
from .passes.localize import graph_communications
from .passes.steps import STEPS, Step
from .symbolic import Specialization, recording_guards


def on_captured(gm: fx.GraphModule, graph: fx.Graph) -> fx.GraphModule:
    """``graph`` as a module over the captured ``gm``: its attributes and meta (Dynamo's, which
    the compile reads). It is a lazy graph module, as Dynamo makes them: each pass's
    ``recompile`` only marks its code stale, and the code is generated once, when the graph is
    first called or printed."""
    module = _LazyGraphModule(gm, graph)
    module.meta.update(gm.meta)
    return module


def copy_graph_module(gm: fx.GraphModule, copies: dict[fx.Node, fx.Node] | None = None) -> fx.GraphModule:
    """A copy whose graph the passes may mutate; node meta is copied shallowly. ``copies``, if
    given, is filled with each node's copy."""
    graph = fx.Graph()
    out = graph.graph_copy(gm.graph, {} if copies is None else copies)
    graph.output(out)
    return on_captured(gm, graph)


def fork(gm: fx.GraphModule, ctx: ParallelContext, mesh: MeshInfo) -> tuple[fx.GraphModule, ParallelContext]:
    """A copy of a partly planned ``gm`` and its ``ctx``, over ``mesh``, for the rest of the
    passes to go on from (``choose_mesh`` runs what two meshes plan alike once): the sites
    point into the copy, and the copy fills containers of its own."""
    copies: dict[fx.Node, fx.Node] = {}
    copied = copy_graph_module(gm, copies)

    def remap(value):
        """``value`` with each node its copy's, in lists, sets, dicts and dataclasses (a site and
        its parts: a mixture's region, its biases, attention's sinks)."""
        if isinstance(value, fx.Node):
            return copies[value]
        if isinstance(value, (list, frozenset)):
            return type(value)(map(remap, value))
        if isinstance(value, dict):
            return {remap(k): remap(v) for k, v in value.items()}
        if dataclasses.is_dataclass(value):
            return dataclasses.replace(value, **{f.name: remap(getattr(value, f.name))
                                                 for f in dataclasses.fields(value)})
        return value

    sites = [remap(s) for s in ctx.sites]
    containers = {f.name: copy.copy(value) for f in dataclasses.fields(ctx)
                  if isinstance(value := getattr(ctx, f.name), (dict, list))}
    return copied, dataclasses.replace(ctx, **{**containers, "mesh": mesh, "sites": sites})


def run_steps(gm: fx.GraphModule, ctx: ParallelContext, steps: tuple[Step, ...],
              dump: GraphDump | None = None) -> fx.GraphModule:
    """``steps`` in order on ``gm`` itself."""
    for step in steps:
        gm = _run(step, gm, ctx)
        if dump is not None:
            dump.after(step.name, gm, ctx)
    return gm


def _run(step: Step, gm: fx.GraphModule, ctx: ParallelContext) -> fx.GraphModule:
    """The step on ``gm``, timed, its guards attributed to it; an internal error becomes a
    PlanningError naming the step."""
    t0 = time.perf_counter()
    try:
        with recording_guards(ctx.specialization, step.name), warnings.catch_warnings():
            # symbolic sizes sit in arguments until localize turns them into nodes (materialize_sizes)
            warnings.filterwarnings("ignore", "Raw SymInt value", UserWarning)
            result = step.run(gm, ctx)
    except USER_ERRORS:
        raise
    except Exception as e:
        raise PlanningError(f"{step.name}: {type(e).__name__}: {e}. This is a dtensor_par bug: please report "
                            f"it with this message, or set DTENSOR_PAR_DUMP=DIR to see the graph") from e
    logger.debug("%s: %.1f ms", step.name, 1e3 * (time.perf_counter() - t0))
    return result


def parallelize_graph(gm: fx.GraphModule, example_inputs: list, mesh: MeshInfo,
                      config: ParallelConfig | None = None, *, feeding: WholeParameters = WHOLE,
                      steps: tuple[Step, ...] = STEPS, dump: GraphDump | None = None,
                      specialization: Specialization | None = None, sent_outputs: dict[int, int] | None = None,
                      vocab_cuts: dict[str, Placement] | None = None) -> tuple[fx.GraphModule, ParallelContext]:
    """Run ``steps`` in order on a copy of ``gm`` for concrete ``example_inputs`` over ``mesh``,
    the parameters fed as ``feeding`` says; with a ``specialization``
    (``symbolic.SymbolicInputs.fake_inputs``), on its symbolic sizes. ``sent_outputs``: the
    outputs returned cut over cp (output index -> the dim), a pipeline stage's pieces. ``vocab_cuts``:
    a pipeline stage's, decided on the whole graph (by FQN: ``plan.vocab_cuts``)."""
    ctx = ParallelContext(config or ParallelConfig(), mesh, list(example_inputs), feeding,
                          specialization=specialization, sent_outputs=dict(sent_outputs or {}),
                          decided_vocab_cuts=vocab_cuts,
                          fake_inputs=specialization.global_inputs if specialization else None)
    if dump is not None:
        dump.captured(gm)
    gm = copy_graph_module(gm)
    start = time.perf_counter()
    gm = run_steps(gm, ctx, steps, dump)
    logger.info("planned a graph of %d nodes: %d sites, %d ops that communicate, %s, %d warnings, %.1f ms",
                len(gm.graph.nodes), len(ctx.sites), len(graph_communications(gm)),
                ctx.coverage.summary() if ctx.coverage else "not planned", len(ctx.warnings),
                1e3 * (time.perf_counter() - start))
    return gm, ctx
