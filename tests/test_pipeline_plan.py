"""Where pipeline cuts stages and what explain and choose_mesh predict of them (``pipeline_plan``):
all in one process, no process group (explain and choose_mesh plan without one)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import dtensor_par
from dtensor_par.choose import choose_mesh
from dtensor_par.machines import H100_SXM, KINDS, Link
from dtensor_par._testing import models

BATCH, SEQ, HIDDEN = 4, 8, 64


def _llama(vocab: int = 50, layers: int = 4, device: str = "cpu"):
    torch.manual_seed(0)
    with torch.device(device):
        return models.Llama(vocab=vocab, layers=layers), torch.randint(0, vocab, (BATCH, SEQ))


def _blocks(report) -> list[list[str]]:
    return [stage.blocks for stage in report.pipeline.stages]


def test_the_time_model_moves_a_cut_toward_a_heavy_head():
    """Equal blocks, a head of 4096 x 64 (as costly as about 1.3 blocks, and no block's
    parameters): by parameter count the cut would be 2 + 2 blocks; by time, the head's stage
    takes one block less. Its stage's time holds the head's, and the memory its parameters."""
    model, ids = _llama(vocab=4096)
    report = dtensor_par.explain(model, (ids,), device_type="cpu", pp=2, microbatches=2, machine="h100-sxm-8")
    assert _blocks(report) == [["blocks.0", "blocks.1", "blocks.2"], ["blocks.3"]]
    first, last = report.pipeline.stages
    assert last.seconds > first.seconds / 3 * 2  # the head's time is in the last stage's
    head = 4096 * HIDDEN * 4
    block = sum(p.numel() for p in model.blocks[0].parameters()) * 4
    assert (first.parameter_bytes, last.parameter_bytes) == (head + 3 * block, block + HIDDEN * 4 + head)

    model, ids = _llama()
    even = dtensor_par.explain(model, (ids,), device_type="cpu", pp=2, microbatches=2)
    assert _blocks(even) == [["blocks.0", "blocks.1"], ["blocks.2", "blocks.3"]]


@pytest.mark.parametrize("schedule, virtual", [("GPipe", 1), ("1F1B", 1), ("Interleaved1F1B", 2)])
def test_explain_reports_stages_bubble_memory_and_what_crosses_each_cut(schedule, virtual):
    """pp2 x ulysses2 over 4 microbatches: pp x v stages, the schedule's bubble, the activations each
    stage holds at once, and per cut a microbatch's hidden states, each rank's sequence piece as
    the plan cuts it and ``pipeline`` sends it; the step: the slowest rank's microbatches over 1 - bubble."""
    model, ids = _llama()
    report = dtensor_par.explain(model, (ids,), device_type="cpu", pp=2, ulysses=2, microbatches=4,
                                 schedule=schedule, machine="h100-sxm-8")
    plan = report.pipeline
    assert report.world_size == 4 and len(plan.stages) == 2 * virtual
    assert [b for stage in _blocks(report) for b in stage] == [f"blocks.{i}" for i in range(4)]
    assert plan.schedule.bubble == pytest.approx(1 / (4 * virtual + 1))
    hidden = BATCH // 4 * SEQ * HIDDEN * 4
    assert plan.sent_bytes == plan.piece_bytes == [hidden // 2] * (2 * virtual - 1), plan.sent_bytes
    assert plan.sent_whole == [[]] * (2 * virtual - 1), plan.sent_whole
    in_flight = [s.in_flight for s in plan.stages]
    assert in_flight == {"GPipe": [4, 4], "1F1B": [2, 1], "Interleaved1F1B": [3, 2, 3, 2]}[schedule]
    for s in plan.stages:
        assert s.memory == s.parameter_bytes + 3 * s.trained_bytes + s.in_flight * s.activation_bytes > 0
    slowest = max(sum(s.seconds for s in plan.rank_stages(r)) for r in range(2))
    assert plan.step_seconds == pytest.approx(slowest * 4 / (1 - plan.schedule.bubble)
                                              + 2 * (2 * virtual - 1) * plan.send_seconds)
    text = str(report)
    assert text.startswith("dtensor_par plan: mesh pp=2 x ") and "(4 ranks, cpu" in text
    assert f"pipeline: {schedule}, pp=2 x {virtual} stage" in text
    assert f"cut 0->1: {hidden // 2:,} bytes a microbatch a rank (intra_node)," in text
    assert "predicted training step" in text


def test_the_runtime_cuts_what_explain_reports(fake_world):
    """``pipeline`` cuts by the same function on the same plan (the whole graph over one stage's
    mesh, as rank 0 of the first stage sees it): on a heavy head, the same uneven stages. Each
    stage's parameters are those the runtime's stage holds."""
    from dtensor_par.config import ParallelConfig
    from dtensor_par.passes.capture import capture_graphs
    from dtensor_par.dump import parameter_rows
    from dtensor_par.pipeline_plan import ScheduleRun, blocks_of, plan_stages
    from dtensor_par.pipelining import _planned_whole, cut_by_cost

    fake_world(2)
    mesh = dtensor_par.init_mesh(pp=2)
    model, ids = _llama(vocab=4096)
    (gm, inputs), = capture_graphs(model, ids[:2], dynamic=False)
    planned = _planned_whole(gm, inputs, mesh["ring", "ulysses", "tp"], ParallelConfig())
    stages = plan_stages("Llama", *planned, blocks_of(model, gm), ScheduleRun("1F1B", 2, 1, 2), None)
    report = dtensor_par.explain(model, (ids,), device_type="cpu", pp=2, microbatches=2)
    assert [s.blocks for s in stages] == _blocks(report) == [[f"blocks.{i}" for i in range(3)], ["blocks.3"]]

    # beside dp_shard and tp, localize merges collectives of many parameters (one FSDP gather of all those outside
    # the blocks, at the graph's start; gradient buckets across blocks): each stage's parameters are still the
    # pieces its runtime holds, those its ops read (the table the first stage's, the norm and head the last's)
    fake_world(8)
    mesh = dtensor_par.init_mesh(pp=2, dp_shard=2, tp=2)
    dit, owners = models.DiT(layers=4, dim=32, heads=4, mlp=64, qk_norm=True), []
    for model, first, schedule in ((model, ids[:2], ScheduleRun("1F1B", 2, 1, 2)),
                                   (dit, torch.randn(2, SEQ, 32), ScheduleRun("Interleaved1F1B", 2, 2, 2))):
        (gm, inputs), = capture_graphs(model, first, dynamic=False)
        planned = _planned_whole(gm, inputs, mesh["dp_shard", "ring", "ulysses", "tp"], ParallelConfig())
        stages, cut = cut_by_cost(model, gm, inputs, [first], planned, schedule, None)
        pieces = {row["name"]: row["bytes_per_rank"] for row in parameter_rows(planned[1])}
        held = [sum(n for fqn, n in pieces.items() if cut.owners[fqn] == stage) for stage in range(len(stages))]
        assert [s.parameter_bytes for s in stages] == held, ([s.parameter_bytes for s in stages], held)
        owners.append(cut.owners)
    assert (owners[0]["embed.weight"], owners[0]["norm.weight"], owners[0]["lm_head.weight"]) == (0, 1, 1)
    assert owners[1]["blocks.3.up.weight"] == 3 and len(set(held)) == 1  # the DiT's equal blocks, one a stage


def test_explain_with_pp_refuses_what_pipeline_does_not_run():
    model, ids = _llama()
    with pytest.raises(ValueError, match=r"explain: pp=2 needs microbatches= \(a positive int"):
        dtensor_par.explain(model, (ids,), device_type="cpu", pp=2)
    with pytest.raises(ValueError, match=r"unknown schedule 'ZBV'; the schedules are \['GPipe', '1F1B'"):
        dtensor_par.explain(model, (ids,), device_type="cpu", pp=2, microbatches=2, schedule="ZBV")
    with pytest.raises(ValueError, match=r"parallelized=False, dynamic=True and training=False do not apply"):
        dtensor_par.explain(model, (ids,), device_type="cpu", pp=2, microbatches=2, training=False)
    with pytest.raises(ValueError, match=r"input 0 of shape \[4, 8\] has a batch \(dim 0\) of 4, not divisible by "
                                         r"microbatches=3"):
        dtensor_par.explain(model, (ids,), device_type="cpu", pp=2, microbatches=3)
    with pytest.raises(ValueError, match=r"Llama has 4 blocks \(blocks\) but 8 stages were asked for"):
        dtensor_par.explain(model, (ids,), device_type="cpu", pp=4, microbatches=2, schedule="Interleaved1F1B")


SLOW_LINKS = dataclasses.replace(H100_SXM, name="slow-links", links={
    link: {kind: Link(1e8, 1e-3) for kind in KINDS} for link in ("intra_node", "inter_node")})
"""A machine whose every collective is slow: pp, sending a microbatch's activations, beats the
dims whose collectives move the gradients (dp) or every block's activations (tp, cp)."""


def test_choose_mesh_ranks_pp_only_where_allowed_and_predicts_what_explain_does():
    model, ids = _llama(device="meta")
    plain = choose_mesh(model, (ids,), 4, machine=SLOW_LINKS, top=50)
    assert plain and all(c.pipeline is None and "pp" not in c.degrees for c in plain)
    ranking = choose_mesh(model, (ids,), 4, machine=SLOW_LINKS, pp=(1, 2, 4), microbatches=2, top=50)
    best = ranking[0]
    assert best.pipeline is not None and best.degrees["pp"] > 1, str(ranking)
    assert best.predicted.total < plain[0].predicted.total
    assert {c.pipeline.schedule.name for c in ranking if c.pipeline} == {"GPipe", "1F1B", "Interleaved1F1B"}
    assert f"({best.pipeline.schedule.name}, 2 microbatches, bubble" in str(ranking)
    others = {d: n for d, n in best.degrees.items() if d != "pp"}
    report = dtensor_par.explain(model, (ids,), machine=SLOW_LINKS, pp=best.degrees["pp"], microbatches=2,
                                 schedule=best.pipeline.schedule.name, order=best.order[1:], **others)
    assert report.pipeline.step_seconds == pytest.approx(best.predicted.total)
    assert _blocks(report) == [s.blocks for s in best.pipeline.stages]
    interleaved_pp4 = [r for r in ranking.rejected if r.degrees["pp"] == 4 and "Interleaved1F1B" in r.reason]
    assert interleaved_pp4 and "Llama has 4 blocks (blocks) but 8 stages" in interleaved_pp4[0].reason
    with pytest.raises(ValueError, match=r"choose_mesh: pp=\(3,\) must name degrees that divide the world size 4"):
        choose_mesh(model, (ids,), 4, machine=SLOW_LINKS, pp=(3,), microbatches=2)
    with pytest.raises(ValueError, match=r"needs training=True and microbatches="):
        choose_mesh(model, (ids,), 4, machine=SLOW_LINKS, pp=(2,))


def test_explain_plans_a_32_layer_llama_at_pp4_tp8_dp_shard4_on_128_ranks():
    """Planning only, on the meta device, no process group: what the report says (its time is
    measured by ``python -m benchmarks.pipeline``, not asserted here)."""
    model, inputs = models.meta_llama_32_layers()
    report = dtensor_par.explain(model, inputs, pp=4, tp=8, dp_shard=4, microbatches=8, machine="h100-sxm-8")
    plan = report.pipeline
    assert report.world_size == 128 and len(plan.stages) == 4
    assert [b for stage in _blocks(report) for b in stage] == [f"blocks.{i}" for i in range(32)]
    assert plan.schedule.bubble == pytest.approx(3 / 11)
    rows, seq, hidden = inputs[0].shape[0] // 8, inputs[0].shape[1], 8192
    assert plan.sent_bytes == [rows * seq * hidden * 4] * 3  # a microbatch's hidden states, whole (no cp)
    assert plan.sent_whole == [[]] * 3
    assert plan.piece_bytes == [rows // 4 * seq * hidden * 4] * 3  # this rank's batch rows (dp_shard)
    # the table and the head cut by the vocabulary over tp, as the first and the head's stage hold them (the
    # whole graph's cuts handed to each stage's plan), and so in the plan that balances the stages
    assert report.graphs[0].placements[-1] == "cut by vocabulary (token embeddings, LM heads): embed.weight=S(0), " \
                                              "lm_head.weight=S(0)", report.graphs[0].placements[-1]
    assert [len(blocks) for blocks in _blocks(report)] == [8] * 4  # the head's 1/8 costs less than a block
    # each stage's parameters are those its runtime holds, each a rank's piece (the matrices' over tp x dp_shard,
    # the norms' over dp_shard): the table the first stage's, the final norm and the head the last's, though
    # the one FSDP gather of all three runs first in the whole graph
    def piece(p):
        return p.numel() * 4 // (32 if p.dim() == 2 else 4)

    block = sum(piece(p) for p in model.blocks[0].parameters())
    table, head = piece(model.embed.weight), piece(model.norm.weight) + piece(model.lm_head.weight)
    assert [s.parameter_bytes for s in plan.stages] == [8 * block + table, 8 * block, 8 * block, 8 * block + head]
    assert report.pipeline.stages[-1].seconds > report.pipeline.stages[1].seconds  # the head's time is in it
    assert "pp rank 3" in str(report) and "predicted training step on h100-sxm-8" in str(report)
