"""The pipeline's table (``passes.steps``): each step writes only the node annotations it declares,
the dumps and choose_mesh's stages are read off it."""

from __future__ import annotations

import pytest
import torch

from dtensor_par.choose import STAGES
from dtensor_par.config import ParallelConfig
from dtensor_par.mesh import MeshInfo
from dtensor_par.params import SHARDED
from dtensor_par.passes.capture import capture_graphs
from dtensor_par.passes.context import ParallelContext
from dtensor_par.passes.meta import ANNOTATIONS
from dtensor_par.passes.steps import STEPS
from dtensor_par.planning import copy_graph_module
from dtensor_par._testing import models

KEYS = {key for keys in ANNOTATIONS.values() for key in keys}


def _annotations(gm) -> dict:
    """Node -> {annotation key: the value object it holds}, for the keys steps may write."""
    return {node: {k: id(v) for k, v in node.meta.items() if k in KEYS} for node in gm.graph.nodes}


def _mixtral():
    real_models = pytest.importorskip("dtensor_par._testing.real_models")
    model, args, kwargs = real_models.FACTORIES["mixtral"]()
    return model, args, kwargs


CASES = {
    # FSDP over the ring, checkpointed blocks: localize's gathers and recompute's tags
    "checkpointed gpt, tp2 x ring2, parallelized": (
        lambda: (models.CheckpointedGPT(layers=2), (torch.randn(2, 16, 32),), {}), {"tp": 2, "ring": 2}, {},
        {"localize": {"custom", "dtensor_par_comm"}, "recompute": {"recompute", "ac_graph_id"}}),
    # experts over cp: rewrite's exchanges
    "mixtral, tp2 x ring2, ep over cp": (_mixtral, {"tp": 2, "ring": 2}, {"ep": "cp"},
                                         {"rewrite": {"dtensor_par_comm"}}),
}
"""Name -> (model factory, mesh, options, some annotations a step is expected to write)."""


@pytest.mark.parametrize("case", CASES)
def test_each_step_writes_only_the_annotations_it_declares(case):
    make, sizes, options, expected = CASES[case]
    model, args, kwargs = make()
    (captured, inputs), = capture_graphs(model, *args, **kwargs)
    ctx = ParallelContext(ParallelConfig.of("test", options), MeshInfo.for_planning(sizes, "cpu"), list(inputs),
                          SHARDED)
    gm, written = copy_graph_module(captured), {}
    for step in STEPS:
        before = _annotations(gm)
        gm = step.run(gm, ctx)
        changed = {k for node, now in _annotations(gm).items() for k, v in now.items()
                   if before.get(node, {}).get(k) != v}
        declared = {k for name in step.writes for k in ANNOTATIONS[name]}
        assert changed <= declared, (step.name, changed - declared)
        written[step.name] = changed
    assert all(written[name] >= keys for name, keys in expected.items()), written


def test_choose_mesh_plans_in_stages_read_off_the_table():
    """A stage starts where a step reads another thing of the mesh, or can refuse a split on less
    than it reads; steps reading nothing join the stage before; lower, judged for each mesh order,
    is not among them."""
    assert [[s.name for s in stage.steps] for stage in STAGES] == [
        ["capture", "expert_loop", "specialize", "canonicalize", "detect"], ["kv_cache", "rewrite"], ["experts"],
        ["sequence"], ["batch"], ["plan", "coverage", "localize", "recompute"]]
    degrees = {"dp_replicate": 1, "dp_shard": 2, "tp": 2, "ring": 1, "ulysses": 2}
    other_dp = {**degrees, "dp_replicate": 2, "dp_shard": 1}
    assert STAGES[1].reads(degrees) == STAGES[1].reads(other_dp)  # dp as one before plan
    assert STAGES[2].reads(degrees) != STAGES[2].reads(other_dp)  # the experts' group: fsdp's or cp's
    assert STAGES[5].reads(degrees) != STAGES[5].reads(other_dp)
