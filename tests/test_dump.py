"""Graph dumps, explain, the CLI and the verbosity switch."""

from __future__ import annotations

import json
from collections import Counter
import logging
import os
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest
import torch
import torch.distributed as dist

import dtensor_par
from dtensor_par.passes.steps import STEPS
from dtensor_par._testing import models, patterns
from dtensor_par._testing.harness import reported_collectives, step_collectives
from tests import factories
from tests.conftest import GoldenTestCase, _init_fake


def _dumped_after(step: str) -> str:
    """The file of the graph a dump writes after ``step``: numbered in the order of ``STEPS``."""
    return f"{[s.name for s in STEPS].index(step) + 1}_{step}.py"


PASS_FILES = sorted(["0_dynamo.py", *(_dumped_after(step.name) for step in STEPS), f"{len(STEPS) + 1}_aten.py",
                     "collectives.md",
                     "mesh.svg", "plan.json", "sites.txt"])


def _compile_and_run(tmp_path, world: int, **options) -> None:
    _init_fake(world)
    mesh = dtensor_par.init_mesh(tp=world)
    model = models.GPTBlock(hidden=64, heads=8, mlp=128)
    compiled = torch.compile(model, backend=dtensor_par.hybrid_parallel(mesh, inner_backend="eager", **options))
    compiled(torch.randn(2, 16, 64))


class TestDumpGolden(GoldenTestCase):

    def test_dump_of_a_gpt_block_at_8_ranks(self):
        folder = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"dtensor_par_dump_{os.getpid()}")
        shutil.rmtree(folder, ignore_errors=True)
        _compile_and_run(None, 8, dump_dir=folder)
        (graph,) = os.listdir(os.path.join(folder, "ring0_ulysses0_tp0"))
        out = os.path.join(folder, "ring0_ulysses0_tp0", graph)
        assert sorted(os.listdir(out)) == PASS_FILES
        read = lambda name: open(os.path.join(out, name)).read()  # noqa: E731
        self.assertExpectedInline(read("sites.txt"), """\
attention0: attention a, 8 heads, 8 kv heads; q=['qkv'] k=['qkv'] v=['qkv'] out=['proj']
mlp0: mlp up=['fc'] down=['fc_out'] activations=['gelu']
""")
        self.assertExpectedInline(read("collectives.md"), """\
| direction | op | mesh dims | group size | bytes per rank | count | site |
| --- | --- | --- | --- | --- | --- | --- |
| backward | all_gather | tp | 8 | 6144 | 1 | parameter gradient |
| backward | all_gather | tp | 8 | 96 | 1 | parameter gradient |
| backward | all_gather | tp | 8 | 2048 | 1 | parameter gradient |
| backward | all_gather | tp | 8 | 4096 | 2 | parameter gradient |
| backward | all_gather | tp | 8 | 64 | 1 | parameter gradient |
| backward | all_reduce | tp | 8 | 8192 | 1 | attention0.colwise |
| forward | all_reduce | tp | 8 | 8192 | 1 | attention0.rowwise |
| backward | all_reduce | tp | 8 | 8192 | 1 | mlp0.colwise |
| forward | all_reduce | tp | 8 | 8192 | 1 | mlp0.rowwise |
""")
        lowered = read(f"{len(STEPS) + 1}_aten.py")
        assert lowered.count("torch.ops._c10d_functional.all_reduce.default") == 2
        assert lowered.count("torch.ops._c10d_functional.wait_tensor.default") == 2
        self.assertExpectedInline(read(_dumped_after("plan")), """\
l_x_ = input('L_x_')  # [2, 16, 64]  tp: R
l_self_modules_ln1_parameters_weight_ = input('L_self_modules_ln1_parameters_weight_')  # ln1.weight  [64]  tp: R
l_self_modules_ln1_parameters_bias_ = input('L_self_modules_ln1_parameters_bias_')  # ln1.bias  [64]  tp: R
l_self_modules_qkv_parameters_weight_ = input('L_self_modules_qkv_parameters_weight_')  # qkv.weight  [192, 64]  tp: IS(0,[64, 64, 64])
l_self_modules_qkv_parameters_bias_ = input('L_self_modules_qkv_parameters_bias_')  # qkv.bias  [192]  tp: IS(0,[64, 64, 64])
l_self_modules_proj_parameters_weight_ = input('L_self_modules_proj_parameters_weight_')  # proj.weight  [64, 64]  tp: S(1)
l_self_modules_proj_parameters_bias_ = input('L_self_modules_proj_parameters_bias_')  # proj.bias  [64]  tp: R
l_self_modules_ln2_parameters_weight_ = input('L_self_modules_ln2_parameters_weight_')  # ln2.weight  [64]  tp: R
l_self_modules_ln2_parameters_bias_ = input('L_self_modules_ln2_parameters_bias_')  # ln2.bias  [64]  tp: R
l_self_modules_fc_parameters_weight_ = input('L_self_modules_fc_parameters_weight_')  # fc.weight  [128, 64]  tp: S(0)
l_self_modules_fc_parameters_bias_ = input('L_self_modules_fc_parameters_bias_')  # fc.bias  [128]  tp: S(0)
l_self_modules_fc_out_parameters_weight_ = input('L_self_modules_fc_out_parameters_weight_')  # fc_out.weight  [64, 128]  tp: S(1)
l_self_modules_fc_out_parameters_bias_ = input('L_self_modules_fc_out_parameters_bias_')  # fc_out.bias  [64]  tp: R
layer_norm = torch.nn.functional.layer_norm(l_x_, (64,), l_self_modules_ln1_parameters_weight_, l_self_modules_ln1_parameters_bias_, 1e-05)  # [2, 16, 64]  tp: R <- (R, R, R)
linear = torch.linear(layer_norm, l_self_modules_qkv_parameters_weight_, l_self_modules_qkv_parameters_bias_)  # [2, 16, 192]  tp: IS(2,[64, 64, 64]) <- (R, IS(0,[64, 64, 64]), IS(0,[64, 64, 64]))  attention0.colwise
chunk = linear.chunk(3, dim=-1)  # tp: (S(2), S(2), S(2)) <- (IS(2,[64, 64, 64]))
q = _operator.getitem(chunk, 0)  # [2, 16, 64]  tp: S(2)
k = _operator.getitem(chunk, 1)  # [2, 16, 64]  tp: S(2)
v = _operator.getitem(chunk, 2)  # [2, 16, 64]  tp: S(2)
view = q.view(2, 16, 8, 8)  # [2, 16, 8, 8]  tp: S(2) <- (S(2))
q_1 = view.transpose(1, 2)  # [2, 8, 16, 8]  tp: S(1) <- (S(2))
view_1 = k.view(2, 16, 8, 8)  # [2, 16, 8, 8]  tp: S(2) <- (S(2))
k_1 = view_1.transpose(1, 2)  # [2, 8, 16, 8]  tp: S(1) <- (S(2))
view_2 = v.view(2, 16, 8, 8)  # [2, 16, 8, 8]  tp: S(2) <- (S(2))
v_1 = view_2.transpose(1, 2)  # [2, 8, 16, 8]  tp: S(1) <- (S(2))
a = torch.scaled_dot_product_attention(q_1, k_1, v_1, is_causal=True)  # [2, 8, 16, 8]  tp: S(1) <- (S(1), S(1), S(1))  attention0.core
transpose_3 = a.transpose(1, 2)  # [2, 16, 8, 8]  tp: S(2) <- (S(1))
reshape = transpose_3.reshape(2, 16, 64)  # [2, 16, 64]  tp: S(2) <- (S(2))
linear_1 = torch.linear(reshape, l_self_modules_proj_parameters_weight_)  # [2, 16, 64]  tp: P(sum) <- (S(2), S(1))  attention0.rowwise
add = _operator.add(linear_1, l_self_modules_proj_parameters_bias_)  # [2, 16, 64]  tp: R <- (R, R)  attention0.rowwise
x = _operator.add(l_x_, add)  # [2, 16, 64]  tp: R <- (R, R)
layer_norm_1 = torch.nn.functional.layer_norm(x, (64,), l_self_modules_ln2_parameters_weight_, l_self_modules_ln2_parameters_bias_, 1e-05)  # [2, 16, 64]  tp: R <- (R, R, R)
linear_2 = torch.linear(layer_norm_1, l_self_modules_fc_parameters_weight_, l_self_modules_fc_parameters_bias_)  # [2, 16, 128]  tp: S(2) <- (R, S(0), S(0))  mlp0.colwise
gelu = torch.gelu(linear_2, approximate='tanh')  # [2, 16, 128]  tp: S(2) <- (S(2))
linear_3 = torch.linear(gelu, l_self_modules_fc_out_parameters_weight_)  # [2, 16, 64]  tp: P(sum) <- (S(2), S(1))  mlp0.rowwise
add_2 = _operator.add(linear_3, l_self_modules_fc_out_parameters_bias_)  # [2, 16, 64]  tp: R <- (R, R)  mlp0.rowwise
add_1 = _operator.add(x, add_2)  # [2, 16, 64]  tp: R <- (R, R)
return (add_1,)  # tp: - <- (R)
""")
        plan = json.loads(read("plan.json"))
        assert sorted(plan) == ["activations", "batch", "collectives", "collectives_lowering", "coverage", "fsdp", "mesh",
                                "nodes",
                                "parameter_state", "parameters", "replica_group_sets", "sites", "version", "warnings",
                                "world_size"]
        assert plan["batch"] is None and plan["fsdp"] is None  # no dp dims; not parallelized
        assert plan["coverage"]["fallback_gathers"] == [] and plan["coverage"]["parallel_sites"] == 2
        assert plan["coverage"]["sharded_linear_flops"] == plan["coverage"]["linear_flops"] > 0
        assert plan["collectives_lowering"] == "functional"
        assert plan["replica_group_sets"] == {"tp groups": [list(range(8))]}
        assert plan["activations"]["policy"] is None and plan["activations"]["regions"] == []
        assert plan["activations"]["kept_bytes"] == plan["activations"]["kept_bytes_without_checkpointing"] > 0
        assert plan["version"] == 6 and plan["parameter_state"].startswith("full (model not parallelized)")
        assert plan["mesh"] == {"tp": 8, "ring": 1, "ulysses": 1} and plan["world_size"] == 8
        assert {p["name"]: p["placement"]["tp"] for p in plan["parameters"]}["qkv.weight"] == "IS(0,[64, 64, 64])"
        ET.fromstring(read("mesh.svg"))
        shutil.rmtree(folder)


def test_dump_folder_from_environment(tmp_path, monkeypatch, fake_world):
    monkeypatch.setenv("DTENSOR_PAR_DUMP", str(tmp_path))
    _compile_and_run(tmp_path, 2)
    (graph,) = os.listdir(tmp_path / "ring0_ulysses0_tp0")
    assert sorted(os.listdir(tmp_path / "ring0_ulysses0_tp0" / graph)) == PASS_FILES


def test_explain_56_heads_at_tp8_without_hardware():
    model, inputs = factories.minimax_like()
    report = dtensor_par.explain(model, inputs, tp=8, parallelized=True)
    text = str(report)
    assert report.world_size == 8 and not dist.is_initialized()
    (graph,) = report.graphs
    assert len(graph.sites) == 4
    assert "attention0: blocks.0.q_proj.weight=S(0), blocks.0.k_proj.weight=S(0)" in text
    forward = sorted((c["op"], c["site"], c["count"]) for c in graph.collectives if c["direction"] == "forward")
    # the LM head's logits gathered (cut by vocab, 125 of 1000 a rank, as the token embedding's rows), each
    # rowwise output's partial sums, and the token embedding's
    assert forward == [("all_gather", "-", 1)] + [("all_reduce", f"{site}.rowwise", 1) for site in (
        "attention0", "attention1", "mlp0", "mlp1")] + [("all_reduce", "token embedding", 1)]
    assert "cut by vocabulary (token embeddings, LM heads): embed.weight=S(0), lm_head.weight=S(0)" in text
    local, full = report.parameter_bytes
    assert local < full / 4 and graph.warnings == []
    assert "state sharded (dtensor_par.parallelize)" in text
    unparallelized = dtensor_par.explain(model, inputs, tp=8)
    assert unparallelized.parameter_bytes == (full, full) and "state full (model not parallelized)" in str(unparallelized)
    gathers = [c for c in unparallelized.graphs[0].collectives if c["site"] == "parameter gradient"]
    assert gathers and all(c["direction"] == "backward" and c["op"] == "all_gather" for c in gathers)
    assert not any(c["site"] == "parameter gradient" for c in graph.collectives)


def test_explain_at_64_ranks():
    with torch.device("meta"):
        model = models.Llama(vocab=1000, layers=2, hidden=64 * 64, heads=64, kv_heads=8, mlp=4096)
        ids = torch.randint(0, 1000, (1, 128))
    report = dtensor_par.explain(model, (ids,), tp=64)
    assert report.world_size == 64
    assert any("8 kv heads do not divide by tp=64" in w for w in report.graphs[0].warnings)


def test_explain_56_heads_at_64_ranks_tp8_ulysses4_ring2():
    model, inputs = factories.minimax_like()
    report = dtensor_par.explain(model, inputs, tp=8, ulysses=4, ring=2)
    assert report.world_size == 64
    (graph,) = report.graphs
    assert graph.warnings == [
        f"attention{i} (a{suffix}): 7 query / 7 kv heads per tp rank (tp=8) do not divide by mesh dim 'ulysses' "
        "of size 4; padded to 8 heads (1 zero heads computed per 7)" for i, suffix in ((0, ""), (1, "_1"))]
    per_attention = Counter((c["direction"], c["op"], c["mesh_dims"]) for c in graph.collectives
                            for _ in range(c["count"]) if c["site"] == "attention0")
    assert per_attention[("forward", "all_to_all", "ulysses")] == 3
    assert per_attention[("forward", "ring_rotate", "ring")] == 1
    # q, then k/v packed, then the output: one sequence shard (seq 256 / cp 8 = 32 tokens) of 8
    # padded heads of 64 floats each.
    exchanges = [c["bytes_per_rank"] for c in graph.collectives for _ in range(c["count"])
                 if c["site"] == "attention0" and c["op"] == "all_to_all" and c["direction"] == "forward"]
    assert sorted(exchanges) == sorted([8 * 32 * 64 * 4, 2 * 8 * 32 * 64 * 4, 8 * 32 * 64 * 4])
    assert "ring=2 x ulysses=4 x tp=8 (64 ranks" in str(report)


@pytest.mark.parametrize("ring", [2, 4])
def test_ring_step_runs_what_explain_reports(ring, fake_world):
    """A training step at ring 2 and 4, under eager and aot_eager alike, runs, collective by
    collective and byte by byte, what explain reports: forward ring - 1 kv rotations, whose
    blocks the backward reuses; backward ring - 1 rotations of the fp32 dk/dv accumulators
    (each rank keeps its share of its own block's gradient). bf16 activations tell the kv
    blocks from the fp32 accumulators."""
    fake_world(ring)
    model = models.GPTBlock(hidden=32, heads=4, mlp=64).to(torch.bfloat16)
    x = torch.randn(2, 16, 32, dtype=torch.bfloat16)
    reported = reported_collectives(dtensor_par.explain(model, (x,), ring=ring, device_type="cpu").graphs[0])
    kv_block = 2 * 2 * 4 * (16 // ring) * 8 * 2  # k and v: batch 2, 4 heads, 16 / ring positions of 8, bf16
    assert reported["forward"]["all_to_all_single", kv_block] == ring - 1
    assert reported["backward"]["all_to_all_single", 2 * kv_block] == ring - 1  # fp32 dk, dv
    assert reported["backward"]["all_to_all_single", kv_block] == 0
    mesh = dtensor_par.init_mesh(ring=ring)
    for inner in ("eager", "aot_eager"):
        torch._dynamo.reset()
        compiled = torch.compile(model, backend=dtensor_par.hybrid_parallel(mesh, inner_backend=inner))
        ran = step_collectives(compiled, x)
        assert ran == reported, inner


def test_running_sums_along_the_sequence_send_their_totals_as_explain_reports(fake_world):
    """``cumsum`` along the sequence cut over the ring (``ops.scan``): each rank gathers the totals
    of every run, one number per run and row (the zigzag layout's two runs a rank), never the
    tensor; the floating sum's gradient comes back through their reduce-scatter. A training
    step runs, collective by collective and byte by byte, what explain reports."""
    fake_world(2)
    model, (x, keep) = patterns.RunningPositions(), (torch.randn(2, 16, 32), torch.ones(2, 16, dtype=torch.bool))
    reported = reported_collectives(dtensor_par.explain(model, (x, keep), ring=2, device_type="cpu").graphs[0])
    ids, means = 2 * 2 * 8, 2 * 2 * 32 * 4  # batch 2 x 2 runs: int64 counts, then 32 float32 features
    assert reported["forward"]["all_gather_into_tensor", ids] == reported["forward"]["all_gather_into_tensor", means] == 1
    assert reported["backward"]["reduce_scatter_tensor", 2 * means] == 1
    compiled = torch.compile(model, backend=dtensor_par.hybrid_parallel(dtensor_par.init_mesh(ring=2),
                                                                        inner_backend="aot_eager"))
    ran = step_collectives(compiled, x, keep)
    assert ran == reported


def test_a_view_taken_again_alike_is_recut_once_as_explain_reports(fake_world):
    """HiDream's rotary halves: the angles, cut as their positions are ([16, 16]), are re-cut to
    the tokens' parts ([16, 8, 8]) where they turn q, and each half, taken again alike for k,
    shares that re-cut: 2 gathers of [2, 16, 1, 8] float32 halves, as a training step under
    aot_eager runs them (before: explain reported 4, one for each take)."""
    fake_world(2)
    model = patterns.JointRotary()
    inputs = (torch.randn(2, 16, 32), torch.randn(2, 8, 32), torch.randn(2, 8, 32), torch.arange(16.0).expand(2, 16),
              torch.zeros(2, 16))
    reported = reported_collectives(dtensor_par.explain(model, inputs, ring=2, device_type="cpu").graphs[0])
    assert reported["forward"]["all_gather_into_tensor", 2 * 16 * 8 * 4] == 2, reported
    compiled = torch.compile(model, backend=dtensor_par.hybrid_parallel(dtensor_par.init_mesh(ring=2),
                                                                        inner_backend="aot_eager"))
    ran = step_collectives(compiled, *inputs)
    assert ran == reported


@pytest.mark.parametrize("sizes", [{"ulysses": 2}, {"ring": 2}], ids=str)
def test_cross_attention_exchanges_what_explain_reports(sizes, fake_world):
    """Cross-attention's keys and values have the context's length (4), not the queries' (16):
    the Ulysses all-to-alls and the ring's rotations carry that many rows, and a training step
    runs, collective by collective and byte by byte, what explain reports."""
    fake_world(2)
    model = models.CrossAttention(dim=32, context_dim=24, heads=4)
    x, context = torch.randn(2, 16, 32), torch.randn(2, 4, 24)
    reported = reported_collectives(dtensor_par.explain(model, (x, context), device_type="cpu", **sizes).graphs[0])
    q_rows, kv_rows = (2 * 4 * (length // 2) * 8 * 4 for length in (16, 4))  # batch 2, 4 heads, 8 floats
    if "ulysses" in sizes:  # q, then k and v packed, then the output
        exchanges = {("all_to_all_single", q_rows): 2, ("all_to_all_single", 2 * kv_rows): 1}
    else:  # k and v of the other rank's block
        exchanges = {("all_to_all_single", 2 * kv_rows): 1}
    assert reported["forward"] == Counter({**exchanges, ("all_gather_into_tensor", q_rows): 1})  # the output's rows
    compiled = torch.compile(model, backend=dtensor_par.hybrid_parallel(dtensor_par.init_mesh(**sizes),
                                                                        inner_backend="aot_eager"))
    ran = step_collectives(compiled, x, context)
    assert ran == reported


def test_explain_cuts_a_loop_over_experts_by_features_and_sums_its_tokens_once():
    """An nn.ModuleList's experts looped over, in one graph (``passes.expert_loop``): each expert's
    w1 and w3 colwise, w2 rowwise, and one forward all-reduce for the mixture, of the tokens' rows
    (2 x 16 x 32 floats, as the attention's), not of their top-2 rows."""
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        report = dtensor_par.explain(patterns.LoopedMoEBlock(), (torch.randn(2, 16, 32),), tp=2)
    (graph,) = report.graphs
    text = str(report)
    assert graph.warnings == [] and "moe0: 4 experts, top-2" in text and "each 1/2 of its features (tp)" in text
    for e in range(4):
        assert f"moe.experts.{e}.w1.weight=S(0)" in text and f"moe.experts.{e}.w3.weight=S(0)" in text
        assert f"moe.experts.{e}.w2.weight=S(1)" in text
    forward = Counter((c["op"], c["bytes_per_rank"]) for c in graph.collectives for _ in range(c["count"])
                      if c["direction"] == "forward")
    assert forward == Counter({("all_reduce", 2 * 16 * 32 * 4): 2}), forward


def test_explain_holds_a_loop_over_experts_cut_by_rows_with_ep_and_sends_each_rank_its_experts():
    """With ``ep="cp"`` at tp2 x ring2, parallelized: each expert weight held cut over tp as without
    ep and over cp along the dim tp does not cut, a quarter of it a rank; one all-to-all per
    stacked weight sends each rank its 2 experts whole, ``[2, 32, 32]`` floats of this rank's
    pieces each way. A hidden size that does not divide over the group leaves them whole, warned."""
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        report = dtensor_par.explain(patterns.LoopedMoEBlock(), (torch.randn(1, 16, 32),), tp=2, ring=2, ep="cp",
                                     parallelized=True)
        uneven = dtensor_par.explain(patterns.LoopedMoEBlock(hidden=30, heads=2), (torch.randn(2, 16, 30),),
                                     dp_shard=2, ulysses=2, ep="cp")
    (graph,) = report.graphs
    text, rows = str(report), [r for r in graph.parameters if ".experts." in r["name"]]
    assert graph.warnings == [] and "experts per rank: 2 of 4 (ep over cp=2), each 1/2 of its features" in text
    assert "moe.experts.0.w1.weight=S(0) (S(1) over cp=2, sent whole to its expert's rank at each use)" in text
    assert "moe.experts.3.w2.weight=S(1) (S(0) over cp=2, sent whole to its expert's rank at each use)" in text
    assert {r["bytes_per_rank"] for r in rows} == {64 * 32 * 4 // 4} and len(rows) == 12, rows
    pieces = 4 * 32 * 16 * 4  # 4 experts x (64 / tp) x (32 / cp) floats
    sent = [(c["direction"], c["count"]) for c in graph.collectives if c["op"] == "all_to_all"
            and c["bytes_per_rank"] == pieces and c["site"] == "moe0.experts"]
    assert sorted(sent) == [("backward", 3), ("forward", 3)], graph.collectives
    (warning,) = uneven.graphs[0].warnings
    assert "the experts stay whole on every rank of dp_shard=2 x cp=2" in warning, warning
    assert "dim 2 of stack" in warning and "[4, 64, 30] does not divide over 4 ranks" in warning, warning


def test_explain_counts_repeated_kv_heads_once_in_the_ulysses_exchange(tmp_path, fake_world):
    """A Llama repeating its 4 kv heads to 8 before attention (as the benchmarks'); canonicalize makes
    that ``enable_gqa``, so the Ulysses exchange carries 8 query and 4 + 4 kv heads (q alone,
    k/v packed), the graph holds no repeat, the report says so, and a training step runs,
    collective by collective and byte by byte, what it says."""
    torch.manual_seed(0)
    model = models.Llama(vocab=64, layers=1, hidden=64, heads=8, kv_heads=4, mlp=96)
    ids = torch.randint(0, 64, (1, 32))
    report = dtensor_par.explain(model, (ids,), ulysses=2, device_type="cpu", dump_dir=str(tmp_path))
    (graph,) = report.graphs
    per_head = 1 * 16 * 8 * 4  # batch x (sequence 32 / ulysses 2) x head_dim x fp32
    exchanges = [c["bytes_per_rank"] for c in graph.collectives if c["direction"] == "forward"
                 and c["mesh_dims"] == "ulysses" for _ in range(c["count"])]
    assert sorted(exchanges) == [per_head * 8, per_head * 2 * 4, per_head * 8]  # q, k/v, the output back
    assert "attention0: attention hybrid_attention, 8 heads, 4 kv heads" in graph.sites[0]
    rewritten = (tmp_path / "graph0" / _dumped_after("rewrite")).read_text()
    (attention,) = [line for line in rewritten.splitlines() if "hybrid_attention(" in line]
    assert "enable_gqa=True" in attention
    assert "expand(" not in rewritten and "repeat_interleave" not in rewritten and "reshape(" in rewritten
    reported = reported_collectives(graph)
    fake_world(2)
    compiled = torch.compile(model, backend=dtensor_par.hybrid_parallel(dtensor_par.init_mesh(ulysses=2),
                                                                        inner_backend="aot_eager"))
    ran = step_collectives(compiled, ids)
    assert ran == reported


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "dtensor_par", "explain", *args], capture_output=True, text=True,
                          cwd=os.path.dirname(os.path.dirname(__file__)), timeout=120)


def test_cli_end_to_end(tmp_path):
    svg = tmp_path / "mesh.svg"
    result = _cli("tests/factories.py:gpt", "--tp", "8", "--svg", str(svg), "--dump-dir", str(tmp_path / "dump"))
    assert result.returncode == 0, result.stderr
    assert "dtensor_par plan: mesh ring=1 x ulysses=1 x tp=8 (8 ranks, cuda" in result.stdout
    assert "forward  all_reduce" in result.stdout
    root = ET.fromstring(svg.read_text())
    assert sum(1 for e in root.iter() if e.tag.endswith("text") and e.text and e.text.isdigit()) == 8
    assert sorted(os.listdir(tmp_path / "dump" / "graph0")) == PASS_FILES
    if shutil.which("rsvg-convert"):
        png = tmp_path / "mesh.png"
        subprocess.run(["rsvg-convert", str(svg), "-o", str(png)], check=True)
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("spec, message", [
    ("tests/nowhere.py:gpt", "explain: no file 'tests/nowhere.py'"),
    ("tests/factories.py:missing", "explain: 'tests/factories.py' has no factory 'missing'"),
    ("tests/factories.py", "explain: expected MODULE:FACTORY"),
])
def test_cli_bad_factory(spec, message, monkeypatch):
    """In process (the end-to-end test covers the real command line)."""
    from dtensor_par.__main__ import main

    monkeypatch.chdir(os.path.dirname(os.path.dirname(__file__)))
    with pytest.raises(SystemExit, match=message):
        main(["explain", spec, "--tp", "2"])


def test_cli_plans_a_transformers_checkpoint_folder_on_the_meta_device(tmp_path, capsys):
    """A folder with only a config.json (no weights: the model is built on meta), in its dtype,
    with --batch-size x --seq input ids; the plan is the same as the model's own at that size."""
    transformers = pytest.importorskip("transformers", reason="the models extra is not installed")
    from dtensor_par.__main__ import main

    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=8, num_key_value_heads=4,
                                      architectures=["LlamaForCausalLM"], dtype="bfloat16")
    config.save_pretrained(tmp_path)
    for spec in (str(tmp_path), str(tmp_path / "config.json")):
        assert main(["explain", spec, "--tp", "2", "--ulysses", "2", "--seq", "64"]) == 0
        out = capsys.readouterr().out
        # the LM head too (cut by the vocabulary, as the token embedding)
        assert "graph 0: 4 sites; linear FLOPs sharded 100.0% (in blocks 100.0%" in out and "0 fallback gathers" in out
        params = 128 * 64 * 2 + 2 * (2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128 + 2 * 64) + 64
        assert f"parameters: {2 * params:,} bytes held per rank" in out, out  # bfloat16
    assert main(["explain", str(tmp_path), "--dp-shard", "2", "--seq", "64", "--batch-size", "2"]) == 0
    assert "batch: global, cut over dp_replicate x dp_shard = 2 along l_args_1_ dim 0" in capsys.readouterr().out


@pytest.mark.parametrize("config, message", [
    (None, "is neither MODULE:FACTORY nor a checkpoint folder with a config.json"),
    ({"hidden_size": 64}, "is neither a transformers config .'model_type'. nor a diffusers one"),
])
def test_cli_refuses_a_folder_it_cannot_build_saying_why(tmp_path, config, message):
    from dtensor_par.__main__ import main

    if config is not None:
        (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(SystemExit, match=message):
        main(["explain", str(tmp_path), "--tp", "2"])


def test_cli_mesh_larger_than_heads_allow(monkeypatch, capsys):
    from dtensor_par.__main__ import main

    monkeypatch.chdir(os.path.dirname(os.path.dirname(__file__)))
    assert main(["explain", "tests/factories.py:gpt", "--tp", "16"]) == 2
    assert "attention 'a' has 8 heads, not divisible by mesh dim 'tp' of size 16" in capsys.readouterr().err


def test_verbosity_switch(caplog):
    dtensor_par.set_verbosity("info")
    try:
        with caplog.at_level(logging.INFO, logger="dtensor_par"):
            model, inputs = factories.gpt()
            dtensor_par.explain(model, inputs, tp=2)
        assert any("planned a graph of" in r.getMessage() for r in caplog.records)
    finally:
        dtensor_par.set_verbosity("warning")


def test_a_graph_break_is_warned_of_by_the_backend_whose_frame_it_broke(fake_world, caplog):
    """Dynamo counts graph breaks for the whole process: a break in a function another backend
    compiled (a VAE under inductor beside the transformer) is not the parallel model's, which
    still runs as one planned graph; a break in the parallel model's own frame is warned of."""
    fake_world(2)
    mesh = dtensor_par.init_mesh(tp=2)
    model, x = models.GPTBlock(hidden=32, heads=4, mlp=64), torch.randn(2, 8, 32)

    def broken(t):
        t = t + 1
        torch._dynamo.graph_break()
        return t * 2

    def with_break(t):
        t = model(t)
        torch._dynamo.graph_break()
        return model(t)

    backend = dtensor_par.hybrid_parallel(mesh, inner_backend="eager")
    compiled = torch.compile(model, backend=backend)
    with caplog.at_level(logging.WARNING, logger="dtensor_par"):
        torch.compile(broken, backend="eager")(x)
        compiled(x)
        assert not [r for r in caplog.records if "broke the graph" in r.getMessage()], caplog.text
        torch.compile(with_break, backend=backend)(x)
    assert [r for r in caplog.records if "broke the graph" in r.getMessage()], caplog.text


def test_flux_forward_at_ulysses2_runs_the_attentions_exchanges_and_the_outputs_gather_alone(fake_world):
    """Every collective of a no_grad forward of diffusers' Flux (one joint and one single-stream
    block, 4 heads x 16, 32 image + 16 text tokens: 24 joint rows a rank) at ulysses2, parameters
    held whole on every rank (as diffusers' own ulysses holds them), is one of:

    - per attention (2), the Ulysses exchange: q by heads (24 rows x 64 floats), k and v packed
      by heads (twice that), the output back by rows (as q): 3 all-to-alls;
    - the output's rows gathered whole (16 of 32 image tokens x 16 channels), as the model
      returns it whole (diffusers gathers it too).

    Nothing else: the text stream, the timestep and pooled embeddings and the modulation vectors
    run cut or whole where they are made; the rotary tables, built whole on every rank from the
    joint positions, are cut where they start as the joint sequence is (text and image halves a
    rank), not cut evenly, gathered and cut again at each of q and k (before: 8 more gathers of
    24 x 16 floats). A compiled forward runs what explain reports, collective by collective."""
    pytest.importorskip("diffusers")
    from dtensor_par._testing import real_models
    from dtensor_par._testing.harness import executed_collectives

    fake_world(2)
    torch.manual_seed(0)
    model, _, kwargs = real_models.flux()
    with torch.no_grad():
        report = dtensor_par.explain(model, (), example_kwargs=kwargs, ulysses=2, device_type="cpu", training=False)
    reported = reported_collectives(report.graphs[0])["forward"]
    rows = 24 * 64 * 4  # a rank's 24 joint rows of 4 heads x 16 float32
    assert reported == Counter({("all_to_all_single", rows): 4, ("all_to_all_single", 2 * rows): 2,
                                ("all_gather_into_tensor", 16 * 16 * 4): 1}), reported
    compiled = torch.compile(model, backend=dtensor_par.hybrid_parallel(dtensor_par.init_mesh(ulysses=2),
                                                                        inner_backend="aot_eager"))
    with torch.no_grad():
        compiled(**kwargs)
        ran = Counter(executed_collectives(lambda: compiled(**kwargs)))
    assert ran == reported
