"""The pass pipeline: one captured graph in, this rank's graph out."""

from __future__ import annotations

import torch.fx as fx

from .passes.capture import capture_pass
from .passes.context import ParallelConfig, ParallelContext
from .passes.detect import detect_pass
from .passes.localize import localize_pass
from .passes.plan import plan_pass
from .passes.rewrite import rewrite_pass

PASSES = (capture_pass, detect_pass, rewrite_pass, plan_pass, localize_pass)


def copy_graph_module(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy whose graph the passes may mutate; node meta is copied shallowly."""
    graph = fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    copy = fx.GraphModule(gm, graph)
    copy.meta.update(gm.meta)
    return copy


def parallelize_graph(gm: fx.GraphModule, example_inputs: list, config: ParallelConfig,
                      passes=PASSES) -> tuple[fx.GraphModule, ParallelContext]:
    """Run ``passes`` in order on a copy of ``gm`` for concrete ``example_inputs``."""
    ctx = ParallelContext(config, list(example_inputs))
    gm = copy_graph_module(gm)
    for run in passes:
        gm = run(gm, ctx)
    return gm, ctx
