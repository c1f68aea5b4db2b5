"""The cost model (passes.cost), machine profiles and choose_mesh: all in one process, no process group
but the fake one init_mesh is checked on."""

import dataclasses
import math

import pytest
import torch
import torch.fx as fx

import dtensor_par
from dtensor_par.choose import choose_mesh, factorizations
from dtensor_par.config import ParallelConfig
from dtensor_par.machines import H100_SXM, KINDS, MACHINES, Link, Machine, machine
from dtensor_par.mesh import MeshInfo
from dtensor_par.ops import collectives as C
from dtensor_par.passes.context import ParallelContext
from dtensor_par.passes.cost import cost_pass, link_classes
from dtensor_par.passes.capture import capture_graphs
from dtensor_par.passes.meta import Communication, Work, set_communications, set_work, work
from dtensor_par.planning import parallelize_graph
from dtensor_par.calibrate import measure
from dtensor_par._testing import models, patterns
from dtensor_par._testing.harness import run_ranks_together
from tests.background import in_background
from tests.cases import AUTO, auto_mesh

LAUNCH = in_background(run_ranks_together, 2, {
    "calibrate": (measure, dict(sizes=(2**10, 2**14), reps=2, matmul_size=64, attention_length=64)),
    "auto": (auto_mesh, {})})
"""At world 2: calibrate's measurement in small sizes (its CLI spawns the same on its own ranks),
then ``parallel(auto=True)`` (``cases.auto_mesh``)."""

RATE = 1e12  # FLOP/s
INTRA, INTER = Link(1e9, 1e-6), Link(1e8, 1e-5)  # bytes/s, s
TOY = Machine("toy", "cuda", devices_per_node=4, memory_per_device=2**30, matmul_flops={"float32": RATE},
              attention_flops={"float32": RATE},
              links={"intra_node": {k: INTRA for k in KINDS}, "inter_node": {k: INTER for k in KINDS}})
SIZES = {"tp": 4, "dp_replicate": 2}
INNER_TP = MeshInfo.for_planning(SIZES, "cuda", ("dp_replicate", "ring", "ulysses", "tp"))
OUTER_TP = MeshInfo.for_planning(SIZES, "cuda", ("ring", "ulysses", "tp", "dp_replicate"))


def _graph(independent_flops: int = 0, *, backward: str | None = None) -> fx.GraphModule:
    """x -> a = matmul (1e9 FLOPs) -> r = all_reduce over tp of 1e6 bytes -> b = matmul (2e9 FLOPs)
    reading r and c, c = matmul (``independent_flops``) of x alone, made after r is issued."""
    graph = fx.Graph()
    x = graph.placeholder("x")

    def op(flops, *args):
        node = graph.call_function(torch.matmul, args)
        set_work(node, Work(flops, "matmul", "float32", 0))
        return node

    a = op(10**9, x, x)
    r = graph.call_function(C.all_reduce, (a, None))
    set_communications(r, [Communication("all_reduce", backward, "tp", 4, 10**6, 10**6, None)])
    c = op(independent_flops, x, x)
    graph.output(op(2 * 10**9, r, c))
    return fx.GraphModule(torch.nn.Module(), graph)


def _context(mesh: MeshInfo = INNER_TP) -> ParallelContext:
    return ParallelContext(ParallelConfig(), mesh, [])


def _all_reduce(link: Link) -> float:
    return link.latency + 2 * 3 / 4 * 10**6 / link.bandwidth


def test_cost_pass_adds_compute_and_a_collective_its_reader_waits_for():
    step = cost_pass(_graph(), _context(), TOY, training=False)
    assert step.compute == pytest.approx(3e9 / RATE)
    assert step.exposed_communication == pytest.approx(_all_reduce(INTRA))
    assert step.total == pytest.approx(3e-3 + 1e-6 + 1.5e-3)
    traffic = step.traffic["tp"]
    assert (traffic.link, traffic.collectives, traffic.bytes) == ("intra_node", 1, 10**6)


def test_cost_pass_training_adds_twice_the_compute_and_the_backward_collectives():
    step = cost_pass(_graph(backward="all_reduce"), _context(), TOY, training=True)
    assert step.compute == pytest.approx(3 * 3e9 / RATE)
    assert step.exposed_communication == pytest.approx(2 * _all_reduce(INTRA))
    assert step.traffic["tp"].collectives == 2


def test_cost_pass_hides_a_collective_behind_the_compute_issued_after_it():
    hidden = cost_pass(_graph(independent_flops=2 * 10**9), _context(), TOY, training=False)
    assert hidden.exposed_communication == pytest.approx(0, abs=1e-12)
    assert hidden.compute == pytest.approx(5e9 / RATE)
    part = cost_pass(_graph(independent_flops=10**9), _context(), TOY, training=False)  # 1 ms of 1.501 ms
    assert part.exposed_communication == pytest.approx(_all_reduce(INTRA) - 1e-3)


def test_cost_pass_pays_the_share_of_a_collective_that_compute_beside_it_does_not_hide():
    """The all-reduce of 1.501 ms runs beside 2 ms of compute: hidden at share 0, half paid at 0.5,
    all at 1 (gloo's on ranks that oversubscribe the CPU cores)."""
    for share in (0.0, 0.5, 1.0):
        step = cost_pass(_graph(independent_flops=2 * 10**9), _context(),
                         dataclasses.replace(TOY, collective_compute_share=share), training=False)
        assert step.exposed_communication == pytest.approx(share * _all_reduce(INTRA), abs=1e-12), share
        assert step.compute == pytest.approx(5e9 / RATE)


def _other_ops_graph() -> fx.GraphModule:
    """x -> relu writing 1 MB of float32 -> a comparison writing 1 MB of booleans."""
    graph = fx.Graph()
    relu = graph.call_function(torch.relu, (graph.placeholder("x"),))
    set_work(relu, Work(0, None, "float32", 10**6))
    positive = graph.call_function(torch.gt, (relu, 0))
    set_work(positive, Work(0, None, "bool", 10**6))
    graph.output(positive)
    return fx.GraphModule(torch.nn.Module(), graph)


def test_cost_pass_times_other_ops_by_the_bytes_they_write_where_the_profile_does():
    """Forward: latency + bytes / bandwidth per op; backward: twice that, for the floating output only."""
    assert cost_pass(_other_ops_graph(), _context(), TOY, training=True).total == 0
    timed = dataclasses.replace(TOY, elementwise=Link(1e9, 1e-5))
    op = 1e-5 + 10**6 / 1e9
    assert cost_pass(_other_ops_graph(), _context(), timed, training=False).compute == pytest.approx(2 * op)
    assert cost_pass(_other_ops_graph(), _context(), timed, training=True).compute == pytest.approx(2 * op + 2 * op)


def test_collectives_of_a_smaller_group_use_its_links_inside_a_node(tmp_path):
    pairs = dataclasses.replace(TOY, intra_node_by_group_size={2: {k: Link(4e9, 1e-7) for k in KINDS}})
    assert pairs.collective_seconds("all_reduce", 10**6, 2, "intra_node") == pytest.approx(1e-7 + 10**6 / 4e9)
    assert pairs.collective_seconds("all_reduce", 10**6, 4, "intra_node") == pytest.approx(_all_reduce(INTRA))
    assert pairs.collective_seconds("all_reduce", 10**6, 2, "inter_node") == pytest.approx(1e-5 + 10**6 / 1e8)
    path = str(tmp_path / "pairs.json")
    measured = dataclasses.replace(pairs, elementwise=Link(1e9, 1e-5), collective_compute_share=0.5,
                                   ring_attention_flops={"float32": 2e9})
    measured.save(path)
    assert machine(path) == measured


SHARED_CORES = Machine("shared-cores", "cpu", devices_per_node=2, memory_per_device=2**30,
                       matmul_flops={"float32": 3e9}, attention_flops={"float32": 3e9},
                       links={c: {k: Link(3e8, 1e-5) for k in KINDS} for c in ("intra_node", "inter_node")})
"""Two ranks of a CPU: without the fields calibrate measures, tp=2 ranks ahead of Ulysses and
behind ring attention for the GPT below."""


def test_what_calibrate_measures_of_shared_cores_moves_the_ranking_its_way():
    """Norms and residuals, whole on every tp rank, put tp=2 behind Ulysses once other ops are
    timed; ring attention's rotations, hidden behind its blocks, put it behind tp=2 once
    collectives and compute take turns; a ring rate a third of SDPA's puts it last."""
    torch.manual_seed(0)
    model, inputs = models.GPT(layers=1, hidden=64, heads=4, mlp=128), (torch.randn(4, 64, 64),)

    def ranked(profile) -> list[str]:
        return [next(d for d, n in c.degrees.items() if n > 1) for c in choose_mesh(model, inputs, 2,
                                                                                   machine=profile, top=50)]

    plain = ranked(SHARED_CORES)
    assert plain.index("ring") < plain.index("tp") < plain.index("ulysses"), plain
    timed = ranked(dataclasses.replace(SHARED_CORES, elementwise=Link(1e9, 1e-6)))
    assert timed.index("ulysses") < timed.index("tp"), timed
    taking_turns = ranked(dataclasses.replace(SHARED_CORES, collective_compute_share=1.0))
    assert taking_turns.index("tp") < taking_turns.index("ring"), taking_turns
    slow_ring = ranked(dataclasses.replace(SHARED_CORES, ring_attention_flops={"float32": 1e9}))
    assert slow_ring == [d for d in plain if d != "ring"] + ["ring"], slow_ring


def test_link_classes_follow_the_mesh_order():
    inner, outer = link_classes(INNER_TP, 4), link_classes(OUTER_TP, 4)
    assert (inner["tp"], inner["dp"]) == ("intra_node", "inter_node")  # tp groups (0..3), (4..7)
    assert (outer["tp"], outer["dp"]) == ("inter_node", "intra_node")  # tp groups (0, 2, 4, 6), (1, 3, 5, 7)
    across = cost_pass(_graph(), _context(), TOY, layout=OUTER_TP, training=False)
    assert across.exposed_communication == pytest.approx(_all_reduce(INTER))
    assert across.traffic["tp"].link == "inter_node"


def test_machine_profiles_round_trip_as_json_and_unknown_names_list_the_known(tmp_path):
    path = str(tmp_path / "profile.json")
    TOY.save(path)
    assert machine(path) == TOY and machine(TOY) is TOY and machine("h200-8") is MACHINES["h200-8"]
    with pytest.raises(ValueError, match="h100-sxm-8"):
        machine("h300")
    seconds = H100_SXM.collective_seconds("all_gather", 2**20, 8, "inter_node")
    assert seconds == pytest.approx(25.5e-6 + 7 * 2**20 / 50e9)


def test_work_is_each_ranks_share_of_the_flops_coverage_counts():
    """Every linear of a GPT is cut 8 ways at tp=2 x ring=2 x ulysses=2 (as the coverage's per-rank
    share says), and zigzag gives every ring rank the same attention; at tp=2 alone, SDPA runs half the heads; dp=2 x ring=2 cuts
    the batch too (each rank's attention: a quarter). Over a ring, attention runs at the ring's rate."""
    torch.manual_seed(0)
    (gm, inputs), = capture_graphs(models.GPT(layers=1, hidden=64, heads=8, mlp=128), torch.randn(2, 16, 64))
    flops = {}
    for sizes in ({"tp": 2, "ring": 2, "ulysses": 2}, {"dp_replicate": 2, "ring": 2}, {"tp": 2}, {"tp": 1}):
        local, ctx = parallelize_graph(gm, inputs, MeshInfo.for_planning(sizes, "cuda"))
        done = [work(n) for n in local.graph.nodes if work(n) is not None]
        ranks = math.prod(sizes.values())
        attention = "ring_attention" if sizes.get("ring", 1) > 1 else "attention"
        assert {w.engine for w in done if w.flops} == {"matmul", attention}, sizes
        flops[ranks] = {"matmul": sum(w.flops for w in done if w.engine == "matmul"),
                        "attention": sum(w.flops for w in done if w.engine == attention)}
        assert ctx.coverage.rank_linear_flops == flops[ranks]["matmul"], sizes  # the report's share: the same
        if ctx.coverage.ring_attention_flops:
            (per_ring_rank,) = ctx.coverage.ring_attention_flops.values()
            assert flops[ranks]["attention"] == max(per_ring_rank) == min(per_ring_rank)
    assert flops[8]["matmul"] * 8 == flops[4]["matmul"] * 4 == flops[2]["matmul"] * 2 == ctx.coverage.linear_flops
    whole = 4 * 2 * 8 * 8 * 16 * 17 // 2  # batch 2, 8 heads of 8, 16 x 17 / 2 causal pairs
    assert flops[8]["attention"] * 8 == flops[4]["attention"] * 4 == flops[2]["attention"] * 2 == whole
    assert flops[1] == {"matmul": ctx.coverage.linear_flops, "attention": whole}


@pytest.mark.parametrize("block", [patterns.SelectiveScanBlock, patterns.StateSpaceBlock, patterns.GatedDeltaRuleBlock])
def test_a_recurrences_work_is_its_kinds_flops_on_each_ranks_heads_and_rows(block):
    """A recurrence over the sequence counts its kind's FLOPs at attention's rate: at tp=2 half
    the heads', at ring=2 the two calls a rank makes on half the rows (each kind's ``cp`` count),
    at tp=2 x ring=2 a quarter of those. Mamba-1's scan: 12 a channel, state number and row."""
    torch.manual_seed(0)
    (gm, inputs), = capture_graphs(block(), torch.randn(2, 16, 32))
    flops = {}
    for sizes in ({"tp": 1}, {"tp": 2}, {"ring": 2}, {"tp": 2, "ring": 2}):
        local, _ = parallelize_graph(gm, inputs, MeshInfo.for_planning(sizes, "cpu"))
        (flops[tuple(sizes.items())],) = [work(n).flops for n in local.graph.nodes
                                          if work(n) is not None and work(n).engine == "attention"]
    whole, cp = flops[(("tp", 1),)], flops[(("ring", 2),)] * 2
    assert flops[(("tp", 2),)] * 2 == whole and flops[(("tp", 2), ("ring", 2))] * 4 == cp and whole < cp < 3 * whole
    if block is patterns.SelectiveScanBlock:  # batch 2, 16 rows, 64 channels, states of 4
        assert whole == 12 * 2 * 16 * 64 * 4 and cp == 18 * 2 * 16 * 64 * 4


@pytest.fixture(scope="module")
def gpt_ranking():
    """A GPT of 4 heads over 8 ranks of an H100 node: tp=8 does not divide the heads."""
    torch.manual_seed(0)
    model = models.GPT(layers=1, hidden=64, heads=4, mlp=128)
    inputs = (torch.randn(2, 16, 64),)
    return model, inputs, choose_mesh(model, inputs, 8, machine="h100-sxm-8", top=50)


def test_choose_mesh_rejects_indivisible_heads_and_ranks_the_rest(gpt_ranking):
    _, _, ranking = gpt_ranking
    (tp8,) = [r for r in ranking.rejected if r.degrees["tp"] == 8]
    assert tp8.order is None and "4 heads, not divisible by mesh dim 'tp' of size 8" in tp8.reason
    totals = [c.predicted.total for c in ranking]
    assert len(ranking) > 5 and totals == sorted(totals) and totals[0] > 0
    assert all(math.prod(c.degrees.values()) == 8 for c in ranking)
    assert any("padded" in w for c in ranking for w in c.warnings)  # ulysses=8 pads 4 heads, legal
    assert "rejected" in str(ranking) and str(ranking[0]) in str(ranking)


def _explained_bytes(graph) -> dict[str, int]:
    """Bytes per rank into each mesh dim's collectives in a step, as explain's table lists them."""
    by_dim = {}
    for row in graph.collectives:
        by_dim[row["mesh_dims"]] = by_dim.get(row["mesh_dims"], 0) + row["bytes_per_rank"] * row["count"]
    return by_dim


def test_choose_mesh_top_choice_builds_and_matches_explain(gpt_ranking, fake_world):
    model, inputs, ranking = gpt_ranking
    best = ranking[0]
    fake_world(8)
    mesh = dtensor_par.init_mesh(**best.degrees, order=best.order, device_type="cpu")
    assert dict(zip(mesh.mesh_dim_names, mesh.shape)) == {d: best.degrees[d] for d in best.order}
    report = dtensor_par.explain(model, inputs, **best.degrees, order=best.order, parallelized=True,
                                 machine="h100-sxm-8")
    (graph,) = report.graphs
    assert _explained_bytes(graph) == {d: t.bytes for d, t in best.collectives.items()}
    assert report.parameter_bytes[0] == best.memory.parameters
    assert graph.predicted == best.predicted
    assert f"predicted training step on h100-sxm-8: {best.predicted}" in str(report)


def test_choose_cli_with_a_json_profile_rejects_every_mesh_over_its_memory(tmp_path, capsys):
    from dtensor_par.__main__ import main

    path = str(tmp_path / "small.json")
    dataclasses.replace(H100_SXM, name="small", memory_per_device=1000).save(path)
    assert main(["choose", "tests/factories.py:gpt", "--world", "2", "--machine", path]) == 0
    out = capsys.readouterr().out
    assert "meshes of 2 ranks on small, by predicted training step time:\n  none is legal" in out
    rejected = out.splitlines()[out.splitlines().index("rejected (5):") + 1:]
    assert len(rejected) == 5, rejected
    assert all(" per rank (parameters " in r and "over the 1000 B of a small device" in r for r in rejected), rejected


def test_choose_mesh_on_neuron_keeps_ulysses_groups_contiguous():
    torch.manual_seed(0)
    model = models.GPT(layers=1, hidden=64, heads=4, mlp=128)
    ranking = choose_mesh(model, (torch.randn(1, 16, 64),), 4, machine="trn2-48xl", top=50)
    hybrid = {"dp_replicate": 1, "dp_shard": 1, "tp": 2, "ring": 1, "ulysses": 2}
    (legal,) = [c for c in ranking if c.degrees == hybrid]
    assert legal.order[-1] == "ulysses"
    (illegal,) = [r for r in ranking.rejected if r.degrees == hybrid]
    assert illegal.order[-1] == "tp" and "needs groups of contiguous ranks on Neuron" in illegal.reason


def test_every_legal_mesh_predicts_the_collectives_explain_lists(gpt_ranking):
    """Ring attention and Ulysses issue several collectives from one op: each is counted once."""
    model, inputs, ranking = gpt_ranking
    for choice in ranking:
        (graph,) = dtensor_par.explain(model, inputs, **choice.degrees, order=choice.order, parallelized=True,
                                       machine="h100-sxm-8").graphs
        assert _explained_bytes(graph) == {d: t.bytes for d, t in choice.collectives.items()}, choice
        counts = {d: sum(row["count"] for row in graph.collectives if row["mesh_dims"] == d)
                  for d in choice.collectives}
        assert counts == {d: t.collectives for d, t in choice.collectives.items()}, choice


@pytest.mark.parametrize("name", ["mixtral", "gpt_oss"])
def test_a_graph_forked_after_detect_plans_as_a_straight_run(name):
    """choose_mesh plans forks of a graph detected once: a site's nodes in sets and dataclasses
    (a mixture's dispatch region and biases, attention's sink logits) are the fork's, so expert
    parallelism and sinks plan there as in one straight run (before: the fork's collectives
    were not explain's)."""
    from dtensor_par.passes.localize import graph_communications
    from dtensor_par.passes.steps import steps
    from dtensor_par.planning import copy_graph_module, fork, run_steps

    real_models = pytest.importorskip("dtensor_par._testing.real_models")
    model, args, kwargs = real_models.FACTORIES[name]()
    (gm, inputs), = capture_graphs(model, *args, **kwargs)
    mesh, config = MeshInfo.for_planning({"tp": 2, "ring": 2}, "cpu"), ParallelConfig.of("test", {"ep": "cp"})
    straight, _ = parallelize_graph(gm, inputs, mesh, config, steps=steps(last="localize"))
    ctx = ParallelContext(config, mesh, list(inputs))
    forked, forked_ctx = fork(run_steps(copy_graph_module(gm), ctx, steps(last="detect")), ctx, mesh)
    communicated = [[c for _, c in graph_communications(g)]
                    for g in (run_steps(forked, forked_ctx, steps("kv_cache", "localize")), straight)]
    sites = {"mixtral": {"moe0.experts"}, "gpt_oss": {"moe0.experts", "attention0"}}[name]
    assert communicated[0] == communicated[1] and sites <= {c.site for c in communicated[0]}


def test_choose_mesh_plans_a_mixtures_experts_over_dp_shard_apart_from_dp_replicate():
    """With ``ep="cp"`` the experts are cut over dp_shard x cp where the mesh has dp_shard, over
    cp beside dp_replicate: a split planned after the other plans its own exchange (before: dp's
    two splits shared one, and choose_mesh priced the second's all-to-alls over the first's group)."""
    from dtensor_par.choose import _plan
    from dtensor_par.passes.localize import graph_communications

    real_models = pytest.importorskip("dtensor_par._testing.real_models")
    model, args, kwargs = real_models.FACTORIES["mixtral"]()
    captured, config = capture_graphs(model, *args, **kwargs), ParallelConfig.of("test", {"ep": "cp"})
    done, exchanged = {}, {}
    for split in ("dp_replicate", "dp_shard"):
        degrees = {"dp_replicate": 1, "dp_shard": 1, "tp": 1, "ring": 2, "ulysses": 1, split: 2}
        planned = _plan(captured, degrees, machine("h100-sxm-8"), config, done)
        exchanged[split] = {(c.mesh_dim, c.group_size) for gm, _ in planned for _, c in graph_communications(gm)
                            if c.site == "moe0.experts"}
    assert exchanged == {"dp_replicate": {("cp", 2)}, "dp_shard": {("fsdp", 4)}}


def test_calibrate_measures_a_profile_that_machine_loads_and_choose_ranks_on(tmp_path):
    first, second = (rank["calibrate"] for rank in LAUNCH.result())
    assert first == second  # every rank returns the slowest rank's figures
    path = str(tmp_path / "profile.json")
    Machine.from_dict(first).save(path)
    profile = machine(path)
    assert (profile.devices_per_node, profile.device_type) == (2, "cpu")
    assert set(profile.links["intra_node"]) == set(KINDS)
    assert all(link.bandwidth > 0 and link.latency >= 0 for kinds in profile.links.values() for link in kinds.values())
    assert profile.flops_per_second("matmul", "float32") > 0 and profile.flops_per_second("attention", "bfloat16") > 0
    assert profile.flops_per_second("ring_attention", "float32") > 0
    assert profile.elementwise.bandwidth > 0 and 0 <= profile.collective_compute_share <= 1
    assert profile.intra_node_by_group_size == {}  # no group smaller than the world of 2
    torch.manual_seed(0)
    ranking = choose_mesh(models.GPT(layers=1, hidden=64, heads=4, mlp=128), (torch.randn(2, 16, 64),), 2,
                          machine=path, top=50)
    assert ranking and ranking.machine == profile


def test_calibrate_fits_each_kind_over_the_pairs_of_a_world_of_4_too(fake_world):
    """On a fake group nothing moves: only the profile's shape is checked."""
    fake_world(4)
    profile = Machine.from_dict(measure(0, 4, sizes=(2**10, 2**14), reps=1, matmul_size=16, attention_length=16))
    assert profile.devices_per_node == 4 and set(profile.intra_node_by_group_size) == {2}
    assert set(profile.intra_node_by_group_size[2]) == set(KINDS)


def test_a_world_with_no_legal_mesh_names_why_each_was_refused():
    """4 heads, 4 tokens, one sequence: no split of 32 ranks fits (tp divides no more than the
    heads, cp no more than the tokens, dp no more than the batch)."""
    torch.manual_seed(0)
    ranking = choose_mesh(models.GPT(layers=1, hidden=64, heads=4, mlp=128), (torch.randn(1, 4, 64),), 32,
                          machine="h100-sxm-8")
    assert list(ranking) == []
    splits = [tuple(d.values()) for d in factorizations(32)]
    assert sorted(tuple(r.degrees.values()) for r in ranking.rejected) == sorted(splits)
    reasons = [r.reason for r in ranking.rejected]
    assert all(reasons), ranking.rejected
    assert any("not divisible by mesh dim 'tp'" in r for r in reasons)
    assert any("shorter than mesh dims 'ring' x 'ulysses'" in r for r in reasons)
    assert any("smaller than mesh dims 'dp_replicate' x 'dp_shard'" in r for r in reasons)
    text = str(ranking)
    assert "none is legal" in text and f"rejected ({len(splits)}):" in text
    assert all(str(r) in text for r in ranking.rejected)


def test_an_unknown_machine_name_lists_the_known_ones(capsys):
    from dtensor_par.__main__ import main

    with pytest.raises(ValueError, match="unknown machine 'h300'.*'h100-sxm-8', 'h200-8', 'trn2-48xl'"):
        choose_mesh(models.GPT(layers=1, hidden=64, heads=4, mlp=128), (torch.randn(1, 16, 64),), 2, machine="h300")
    assert main(["choose", "tests/factories.py:gpt", "--world", "2", "--machine", "h300"]) == 2
    err = capsys.readouterr().err
    assert "unknown machine 'h300'" in err and all(name in err for name in MACHINES), err


def test_parallel_auto_builds_choose_meshs_top_choice_and_matches_one_device():
    results = [rank["auto"] for rank in LAUNCH.result()]
    torch.manual_seed(0)
    best = choose_mesh(models.GPT(layers=1), (torch.randn(2, 8, 32),), 2, machine=AUTO["machine"])[0]
    for result in results:
        assert result["forward"] <= 1e-5 and result["grad"] <= 1e-4, result
        assert list(result["mesh"].items()) == [(d, best.degrees[d]) for d in best.order], result
        assert result["chosen"] == str(best)
        (line,) = result["logged"]
        assert f"GPT runs on {dtensor_par.choose.mesh_text(best.degrees, best.order)} of 2 ranks" in line
        assert f"predicted on h100-sxm-8: {best.predicted}" in line and "mesh_ranking" in line
    for rank, result in enumerate(results):  # rank 1 was handed choose_mesh's ranking reversed
        assert result["disagreement"].startswith("parallel(auto=True): the ranks do not agree on the mesh chosen "
                                                 "(rank 0: "), result
        assert "; rank 1: " in result["disagreement"]


@pytest.mark.parametrize("arguments, message", [
    (dict(auto=True, tp=2, machine="h100-sxm-8"), r"auto=True chooses the mesh; it cannot also be given \(tp=2\)"),
    (dict(auto=True, machine="h300"), r"parallel: unknown machine 'h300'.*'h100-sxm-8', 'h200-8', 'trn2-48xl'"),
    (dict(auto=True), r"auto=True needs machine=.*'h100-sxm-8'"),
    (dict(machine="h100-sxm-8"), r"parallel: machine='h100-sxm-8' only serve auto=True"),
    (dict(tp=2, training=False), r"parallel: training=False only serve auto=True"),
])
def test_parallel_auto_refuses_contradictory_arguments(arguments, message):
    with pytest.raises(ValueError, match=message):
        dtensor_par.parallel(**arguments)


def test_parallel_auto_refuses_a_given_mesh(fake_world):
    fake_world(2)
    with pytest.raises(ValueError, match=r"cannot also be given \(mesh=\)"):
        dtensor_par.parallel(auto=True, machine="h100-sxm-8", mesh=dtensor_par.init_mesh(tp=2))


def test_parallel_auto_with_no_legal_mesh_names_why_each_was_refused(fake_world):
    """2 heads, 2 tokens, one sequence: tp and cp stop at 2 each, dp at 1, short of 8 ranks."""
    fake_world(8)
    model = dtensor_par.parallel(auto=True, machine="h100-sxm-8")(models.GPT)(layers=1, hidden=32, heads=2, mlp=64)
    with pytest.raises(dtensor_par.errors.InvalidPlan) as refused:
        model(torch.randn(1, 2, 32))
    message = str(refused.value)
    assert message.startswith("parallel(auto=True): no mesh of 8 ranks is legal for GPT on h100-sxm-8; each was "
                              "refused:\n"), message
    assert message.count("\n") == len(factorizations(8)), message
    assert "not divisible by mesh dim 'tp'" in message and "shorter than mesh dims 'ring' x 'ulysses'" in message
    assert "mesh_ranking" not in model.__dict__
