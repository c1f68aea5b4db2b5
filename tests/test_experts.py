"""Expert parallelism (``ep="cp"``) on gloo ranks, against one device: the row exchange alone
(``ops.experts``: forward, the rows' gradients and the experts'), and a mixture of experts
parallelized, trained with AdamW, its experts held cut over dp_shard x cp, one step of it over
dp_shard x ring, parallelized and held whole, and one over a mesh that puts ulysses before ring."""

from __future__ import annotations

import copy
import functools
import glob
import json
import logging
import os
import tempfile
from collections import Counter

import pytest
import torch
import torch.distributed as dist

import dtensor_par
from dtensor_par.mesh import MeshDim
from dtensor_par.ops.experts import combine_rows, dispatch_rows, exchange_counts, local_offsets
from dtensor_par._testing.harness import FUNCTIONAL_OPS, dp_rows, executed_collectives, loss_of, max_rel, run_ranks, whole
from tests import xm_gloo
from tests import tiers
from tests.background import in_background

EXPERTS, WIDTH, OUT = 6, 5, 3


def _routing(rank: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s rows sorted by expert and its rows per expert (some experts get none)."""
    g = torch.Generator().manual_seed(rank)
    experts = torch.randint(0, EXPERTS - 1 + rank % 2, (rows,), generator=g).sort().values
    return torch.randn(rows, WIDTH, generator=g, dtype=torch.float64), experts


def _row_count(rank: int, comm: str) -> int:
    return 4 + 3 * rank if comm == "functional" else 7


def exchange_rows(rank: int, world: int, *, coordinates: tuple[int, ...], comm: str) -> dict:
    """Each rank's rows through the experts it does not hold, by ``dispatch_rows`` and
    ``combine_rows`` over a mesh dim whose coordinates are not the ranks' order, with the
    lowering ``comm``: functional's, ranks of different row counts; xla's (the padded exchange,
    over the xm stand-in), of equal ones, as the plan's equal token shares are."""
    xm_gloo.calls.clear()
    ep = MeshDim("cp", world, coordinates.index(rank), dist.group.WORLD.group_name, (coordinates,), 0)
    weights = torch.randn(EXPERTS, WIDTH, OUT, generator=torch.Generator().manual_seed(99), dtype=torch.float64)
    per_rank = EXPERTS // world
    mine = weights[ep.rank * per_rank:(ep.rank + 1) * per_rank].clone().requires_grad_()
    rows, experts = _routing(rank, _row_count(rank, comm))
    rows.requires_grad_()
    counts = torch.histc(experts.float(), bins=EXPERTS, min=0, max=EXPERTS - 1)
    received = exchange_counts(counts, ep, comm)
    arrived = dispatch_rows(rows, counts, received, ep, comm)
    ends = local_offsets(received).tolist()
    out = torch.cat([arrived[start:end] @ mine[j] for j, (start, end) in enumerate(zip([0] + ends, ends))]
                    + [arrived.new_zeros(arrived.shape[0] - ends[-1], OUT)])
    back = combine_rows(out, counts, received, ep, comm)
    (back * torch.arange(back.numel(), dtype=back.dtype).view_as(back)).sum().backward()
    # One device: every rank's rows through every expert, the same loss summed over ranks.
    full = weights.clone().requires_grad_()
    total, own = 0.0, None
    for r in range(world):
        r_rows, r_experts = _routing(r, _row_count(r, comm))
        r_rows.requires_grad_(r == rank)
        expected = torch.einsum("nd,ndo->no", r_rows, full[r_experts])
        total = total + (expected * torch.arange(expected.numel(), dtype=expected.dtype).view_as(expected)).sum()
        own = (expected, r_rows) if r == rank else own
    total.backward()
    return {"shape": list(arrived.shape), "forward": (back - own[0]).abs().max().item(),
            "rows_grad": (rows.grad - own[1].grad).abs().max().item(),
            "experts_grad": (mine.grad - full.grad[ep.rank * per_rank:(ep.rank + 1) * per_rank]).abs().max().item(),
            "padding": arrived[ends[-1]:].abs().max().item() if ends[-1] < arrived.shape[0] else 0.0,
            "xm": sorted({c.split()[0] for c in xm_gloo.calls})}


def exchanges(rank: int, world: int, *, coordinates: tuple[int, ...]) -> dict:
    """``exchange_rows`` with each lowering, in one launch."""
    xm_gloo.install()
    return {comm: exchange_rows(rank, world, coordinates=coordinates, comm=comm) for comm in ("functional", "xla")}


LAUNCH = in_background(run_ranks, 3, exchanges, coordinates=(2, 0, 1))


@pytest.mark.parametrize("comm, xm", [("functional", []), ("xla", ["all_to_all"])])
def test_rows_reach_their_experts_and_come_back_exactly(comm, xm):
    """The uneven exchange (functional) and the padded one (xla, every call an xm all-to-all):
    forward, the rows' and the experts' gradients exact; past the rows that came, zeros."""
    for rank, results in enumerate(LAUNCH.result()):
        result = results[comm]
        assert result["shape"] == [3 * _row_count(rank, comm), WIDTH], result
        assert result["forward"] < 1e-12 and result["rows_grad"] < 1e-12 and result["experts_grad"] < 1e-12, result
        assert result["padding"] == 0.0 and result["xm"] == xm, result


def _collectives_table(dump_dir: str, rank_folder: str) -> Counter:
    """The functional collectives a rank's dumped plans say a step runs, by name."""
    table = Counter()
    for plan in glob.glob(os.path.join(dump_dir, rank_folder, "*", "plan.json")):
        with open(plan) as f:
            for row in json.load(f)["collectives"]:
                table[FUNCTIONAL_OPS[row["op"]]] += row["count"]
    return table


def _train_against_one_device(model, reference, outputs, inspect=lambda opt: None, steps: int = 2) -> Counter:
    """``steps`` foreach AdamW steps with clipping of ``model`` and of ``reference`` on one device
    (``outputs()``: both outputs): the worst forward, gradient and parameter differences.
    ``inspect(opt)`` after the first update, before its gradients are zeroed."""
    make_opt = lambda params: torch.optim.AdamW(params, lr=1e-2, eps=1e-3, foreach=True)  # noqa: E731
    opt, opt_ref = make_opt(model.parameters()), make_opt(reference.parameters())
    worst = Counter()
    for step in range(steps):
        out, expected = outputs()
        worst["forward"] = max(worst["forward"], (out - expected).abs().max().item())
        loss_of(out).backward()
        loss_of(expected).backward()
        worst["grad"] = max(worst["grad"], max(max_rel(whole(p.grad), q.grad)
                                               for p, q in zip(model.parameters(), reference.parameters())))
        for params in (model.parameters(), reference.parameters()):
            torch.nn.utils.clip_grad_norm_(params, 0.05)
        opt.step()
        opt_ref.step()
        worst["param"] = max(worst["param"], max(max_rel(whole(p), q)
                                                 for p, q in zip(model.parameters(), reference.parameters())))
        if step == 0:
            inspect(opt)
        opt.zero_grad()
        opt_ref.zero_grad()
    return worst


def train_with_ep(rank: int, world: int, *, dump_dir: str, runs: list[str]) -> dict:
    """Mixtral parallelized at dp_shard2 x ulysses2 with ``ep="cp"``, its 4 experts cut over all
    4 ranks (dp_shard x cp): 2 AdamW steps with clipping against one device, the storage each
    rank holds of an expert weight and of its gradient and AdamW state, and the collectives a
    step runs against the dumped table; then the ``runs`` of ``EP_RUNS``, by name."""
    from dtensor_par._testing import real_models

    logging.getLogger("transformers").setLevel(logging.ERROR)
    mesh = dtensor_par.init_mesh(dp_shard=2, ulysses=2)
    torch.manual_seed(0)
    model, args, kwargs = real_models.mixtral()
    reference = copy.deepcopy(model)
    dtensor_par.parallelize(model, mesh, args, example_kwargs=kwargs, ep="cp")
    compiled = torch.compile(model, backend=dtensor_par.hybrid_parallel(mesh, inner_backend="aot_eager", ep="cp",
                                                                        dump_dir=dump_dir))
    experts, held = model.model.layers[0].mlp.experts.gate_up_proj, []

    def held_storage(opt):
        held.extend(t.to_local().untyped_storage().nbytes()
                    for t in (experts, experts.grad, opt.state[experts]["exp_avg"]))
    worst = _train_against_one_device(model, reference, lambda: (compiled(*args, **kwargs)[0],
                                                                 reference(*args, **kwargs)[0]), held_storage)
    executed = executed_collectives(lambda: loss_of(compiled(*args, **kwargs)[0]).backward())
    ran = Counter(name for name, _ in executed)
    exchanges = [nbytes for name, nbytes in executed if name == "all_to_all_single"]
    counts = exchanges.index(4 * 8)  # the 4 experts' counts, int64: then the rows sent, then the rows back
    routing = None
    if rank == 0:  # explain's routing, measured on one device holding the same weights
        (graph,) = dtensor_par.explain(reference, args, example_kwargs=kwargs, dp_shard=2, ulysses=2, ep="cp",
                                       measure_routing=True).graphs
        routing = [s for s in graph.sites if s.startswith("moe0")]
    table = _collectives_table(dump_dir, f"dp_shard{rank // 2}_ring0_ulysses{rank % 2}_tp0")
    return {**worst, "held": held, "whole": experts.numel() * experts.element_size(), "ran": dict(ran),
            "table": dict(table), "back": exchanges[counts + 2], "routing": routing,
            **{name: EP_RUNS[name](os.path.join(dump_dir, name)) for name in runs}}


EP_RUNS = {
    # one step at dp_shard2 x ring2, parallelized and held whole (``one_step``)
    "ring": lambda folder: one_step(folder, dp_shard=2, ring=2),
    # parallelized at dp_replicate2 x dp_shard2, and with a local batch at dp_shard2 x ulysses2 and there
    "replicas": lambda folder: one_step(folder, rows=4, modes=(True,), dp_replicate=2, dp_shard=2),
    "local": lambda folder: one_step(folder, rows=4, batch="local", modes=(True,), dp_shard=2, ulysses=2),
    "local_replicas": lambda folder: one_step(folder, rows=4, batch="local", modes=(True,), dp_replicate=2,
                                              dp_shard=2),
    "ulysses_first": lambda folder: one_step_ulysses_first(),
    # an nn.ModuleList mixture trained at dp_shard2 x ulysses2 and tp2 x ring2
    "module_list": lambda folder: train_module_list_with_ep(folder, dp_shard=2, ulysses=2),
    "module_list_tp": lambda folder: train_module_list_with_ep(folder, tp=2, ring=2)}
"""``train_with_ep``'s runs after Mixtral's two steps at dp_shard2 x ulysses2, by name."""
SWEPT = {"ring", "replicas", "local_replicas", "ulysses_first", "module_list"}
"""Runs ``tests.tiers`` leaves to ``--sweep``: CI cuts the experts over dp_shard beside Ulysses,
with a global and a local batch, and a ModuleList's over tp x ring."""


def train_module_list_with_ep(dump_dir: str, **sizes) -> dict:
    """An ``nn.ModuleList`` mixture beside attention (``_testing.patterns.LoopedMoEBlock``, captured in
    one graph) parallelized on the mesh of ``sizes`` with ``ep="cp"``: 2 foreach AdamW steps with
    clipping against one device, each expert weight's piece held, the collectives a step runs
    against the dumped table, and explain's routing measured on one device against what the
    ranks get back."""
    from dtensor_par._testing import patterns

    mesh = dtensor_par.init_mesh(**sizes)
    folder = "_".join(f"{n}{c}" for n, c in zip(mesh.mesh_dim_names, mesh.get_coordinate()))
    torch.manual_seed(0)
    model, x = patterns.LoopedMoEBlock(), torch.randn(2, 16, 32)
    reference = copy.deepcopy(model)
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        dtensor_par.parallelize(model, mesh, (x,), ep="cp")
        compiled = torch.compile(model, backend=dtensor_par.hybrid_parallel(mesh, inner_backend="aot_eager", ep="cp",
                                                                            dump_dir=dump_dir))
        worst = _train_against_one_device(model, reference, lambda: (compiled(x), reference(x)))
        executed = executed_collectives(lambda: loss_of(compiled(x)).backward())
        routing = None
        if dist.get_rank() == 0:  # explain's routing, measured on one device holding the same weights
            (graph,) = dtensor_par.explain(reference, (x,), ep="cp", measure_routing=True, **sizes).graphs
            routing = [s for s in graph.sites if s.startswith("moe0")]
    exchanges = [nbytes for name, nbytes in executed if name == "all_to_all_single"]
    experts = {n: list(p.to_local().shape) for n, p in model.named_parameters() if n.startswith("moe.experts.0.")}
    return {**worst, "local": experts, "ran": dict(Counter(name for name, _ in executed)),
            "table": dict(_collectives_table(dump_dir, folder)), "routing": routing,
            "back": exchanges[exchanges.index(4 * 8) + 2]}  # the 4 experts' counts, the rows sent, the rows back


def one_step(dump_dir: str, rows: int = 2, batch: str = "global", modes=(True, False), **sizes) -> dict:
    """One step of Mixtral with ``ep="cp"`` on the mesh of ``sizes`` against one device on
    ``rows`` batch rows: parallelized (each rank's local expert weights, the collectives run
    against the dumped table), and with the model held whole (hybrid_parallel alone slices each
    rank's experts and gathers their gradients back), as ``modes`` says. With a local batch
    each dp coordinate runs its own rows, its loss scaled so that dp's average of the gradients
    is one device's on every row."""
    from dtensor_par._testing import real_models

    mesh = dtensor_par.init_mesh(**sizes)
    folder = "_".join(f"{n}{c}" for n, c in zip(mesh.mesh_dim_names, mesh.get_coordinate()))
    mine = dp_rows(mesh, rows) if batch == "local" else slice(None)
    results = {}
    for parallelized in modes:
        torch.manual_seed(0)
        model, _, kwargs = real_models.mixtral()
        args = (torch.randint(0, real_models.VOCAB, (rows, real_models.SEQ)),)
        reference = copy.deepcopy(model)
        if parallelized:
            dtensor_par.parallelize(model, mesh, args, example_kwargs=kwargs, ep="cp", batch=batch)
        backend = dtensor_par.hybrid_parallel(mesh, inner_backend="aot_eager", ep="cp", batch=batch,
                                              dump_dir=dump_dir if parallelized else None)
        compiled = torch.compile(model, backend=backend)
        out, expected = compiled(args[0][mine], **kwargs)[0], reference(*args, **kwargs)[0]
        weights = torch.linspace(-1.0, 1.0, expected.numel()).view(expected.shape)
        (out * weights[mine]).sum().mul(rows / out.shape[0] / expected.numel()).backward()
        (expected * weights).mean().backward()
        results["parallelized" if parallelized else "whole"] = {
            "forward": (out - expected[mine]).abs().max().item(),
            "grad": max(max_rel(whole(p.grad), q.grad) for p, q in zip(model.parameters(), reference.parameters()))}
        if parallelized:  # a step compiled already
            executed = executed_collectives(lambda: compiled(args[0][mine], **kwargs)[0].sum().backward())
            results["parallelized"].update(
                local={n: list(p.to_local().shape) for n, p in model.named_parameters() if ".experts." in n},
                ran=dict(Counter(name for name, _ in executed)),
                table=dict(_collectives_table(dump_dir, folder)))
    return results


def one_step_ulysses_first() -> dict:
    """One step of Mixtral's 8 experts parallelized at ring2 x ulysses2 on a mesh that puts
    ulysses first, against one device: the experts are cut over the ranks in the mesh's order,
    as DTensor nests them, which is not cp's ring-major order. Each rank's local expert weights
    and their gradients against the chunk of its mesh coordinate (its rank, without tp)."""
    from dtensor_par._testing import real_models

    mesh = dtensor_par.init_mesh(ring=2, ulysses=2, order=("ulysses", "ring", "tp"))
    torch.manual_seed(0)
    model, args, kwargs = real_models.mixtral(experts=8)
    reference = copy.deepcopy(model)
    dtensor_par.parallelize(model, mesh, args, example_kwargs=kwargs, ep="cp")
    compiled = torch.compile(model, backend=dtensor_par.hybrid_parallel(mesh, inner_backend="aot_eager", ep="cp"))
    out, expected = compiled(*args, **kwargs)[0], reference(*args, **kwargs)[0]
    loss_of(out).backward()
    loss_of(expected).backward()
    mine = slice(2 * dist.get_rank(), 2 * dist.get_rank() + 2)
    experts = [(p, q) for (n, p), q in zip(model.named_parameters(), reference.parameters()) if ".experts." in n]
    return {"forward": (out - expected).abs().max().item(),
            "grad": max(max_rel(whole(p.grad), q.grad) for p, q in zip(model.parameters(), reference.parameters())),
            "local": [list(p.to_local().shape) for p, _ in experts],
            "local_weight": max((p.to_local() - q.detach()[mine]).abs().max().item() for p, q in experts),
            "local_grad": max(max_rel(p.grad.to_local(), q.grad[mine]) for p, q in experts)}


def _train_launch() -> list:
    with tempfile.TemporaryDirectory() as folder:
        return run_ranks(4, train_with_ep, dump_dir=folder, runs=tiers.running(list(EP_RUNS), SWEPT))


TRAINED = in_background(_train_launch)


def _measured(routing: list[str]) -> int:
    """The bytes back explain's routing line (rank 0's ``routing``: the lines of its moe0 sites)
    says it measured on one device."""
    (line,) = routing
    return int(line.split("measured on the example inputs: ")[1].split(" B")[0])


def test_experts_cut_over_dp_shard_and_cp_train_as_on_one_device():
    """And explain's routing measured on one device is what the ranks get back from their experts."""
    pytest.importorskip("transformers", reason="the models extra (pip install -e '.[models]') is not installed")
    results = TRAINED.result()
    (line,) = results[0]["routing"]
    assert "experts per rank: 1 of 4 (ep over dp_shard=2 x cp=2), each whole" in line, line
    assert "(all-to-alls over dp_shard=2 x cp=2)" in line, line
    assert _measured(results[0]["routing"]) == max(r["back"] for r in results), results
    for rank, result in enumerate(results):
        assert result["forward"] <= 1e-5 and result["grad"] <= 1e-5 and result["param"] <= 1e-5, (rank, result)
        assert result["held"] == [result["whole"] // 4] * 3, result  # 1 of the 4 experts, no FSDP cut
        assert result["ran"] == result["table"] and result["ran"]["all_to_all_single"] >= 5, result


def _check_one_step(result: dict, experts: int) -> dict:
    """``one_step``'s result: every mode exact against one device; parallelized, ``experts`` of
    Mixtral's 4 held a rank and the collectives run those of the dumped table. Returns the
    parallelized mode's."""
    for mode, case in result.items():
        assert case["forward"] <= 1e-5 and case["grad"] <= 1e-5, (mode, result)
    held = result["parallelized"]
    assert held["local"] == {"model.layers.0.mlp.experts.gate_up_proj": [experts, 256, 64],
                             "model.layers.0.mlp.experts.down_proj": [experts, 64, 128]}, held["local"]
    assert held["ran"] == held["table"] and held["ran"]["all_to_all_single"] >= 5, held
    return held


@tiers.MARK
def test_experts_cut_over_dp_shard_and_ring_as_on_one_device():
    """At dp_shard2 x ring2 (the ring's zigzag sequence): each rank holds 1 of the 4 experts whole,
    parallelized; held whole, each rank's slice is the same one."""
    pytest.importorskip("transformers", reason="the models extra (pip install -e '.[models]') is not installed")
    for result in (r["ring"] for r in TRAINED.result()):
        _check_one_step(result, experts=1)


@tiers.MARK
def test_experts_cut_over_dp_shard_beside_dp_replicate_as_on_one_device():
    """At dp_replicate2 x dp_shard2, parallelized: each replica holds the 4 experts once, 2 a
    rank, and its rows reach only its own replica's experts; the experts' gradients are summed
    over the replicas (dp_replicate's all-reduce, in the dumped table and run)."""
    pytest.importorskip("transformers", reason="the models extra (pip install -e '.[models]') is not installed")
    for result in (r["replicas"] for r in TRAINED.result()):
        held = _check_one_step(result, experts=2)
        assert held["ran"]["all_reduce"] == 1, held  # the replicas' sums, the experts' in the others' bucket


@pytest.mark.parametrize("run, experts", [tiers.case(run, experts, sweep=run in SWEPT)
                                          for run, experts in [("local", 1), ("local_replicas", 2)]])
def test_experts_cut_over_dp_shard_with_a_local_batch_as_on_one_device(run, experts):
    """With a local batch (each dp coordinate its own rows) the experts are cut over dp_shard too,
    parallelized: at dp_shard2 x ulysses2 one expert a rank; at dp_replicate2 x dp_shard2 two a
    rank, their gradients summed over the replicas. The experts' gradients are averaged over dp
    as every other parameter's: one device's on the whole batch."""
    pytest.importorskip("transformers", reason="the models extra (pip install -e '.[models]') is not installed")
    for result in TRAINED.result():
        _check_one_step(result[run], experts=experts)


@pytest.mark.parametrize("run, w1, w2", [tiers.case(*run, sweep=run[0] in SWEPT)
                                         for run in [("module_list", [64, 8], [8, 64]),
                                                     ("module_list_tp", [32, 16], [16, 32])]])
def test_module_list_experts_held_cut_by_ep_train_as_on_one_device(run, w1, w2):
    """Each of an ``nn.ModuleList``'s experts held cut along its hidden features over the expert
    group (a quarter of it at dp_shard2 x ulysses2; at tp2 x ring2 a half of its tp half) and sent
    whole to the rank computing it: stock foreach AdamW and ``clip_grad_norm_`` step them as on
    one device; the routing explain measures off the graph is what the ranks get back."""
    pytest.importorskip("transformers", reason="the models extra (pip install -e '.[models]') is not installed")
    results = [r[run] for r in TRAINED.result()]
    assert _measured(results[0]["routing"]) == max(r["back"] for r in results), results
    for rank, result in enumerate(results):
        assert result["forward"] <= 1e-5 and result["grad"] <= 1e-5 and result["param"] <= 1e-5, (rank, result)
        assert result["local"] == {"moe.experts.0.w1.weight": w1, "moe.experts.0.w3.weight": w1,
                                   "moe.experts.0.w2.weight": w2}, result
        assert result["ran"] == result["table"] and result["ran"]["all_to_all_single"] >= 8, result


@tiers.MARK
def test_experts_cut_in_the_mesh_order_where_ulysses_comes_before_ring():
    """Parallelized at ring2 x ulysses2 on a mesh that puts ulysses first: each rank holds the 2
    of the 8 experts at its coordinate in the mesh's order, and computes as one device does."""
    pytest.importorskip("transformers", reason="the models extra (pip install -e '.[models]') is not installed")
    for result in (r["ulysses_first"] for r in TRAINED.result()):
        assert result["forward"] <= 1e-5 and result["grad"] <= 1e-5, result
        assert result["local"] == [[2, 256, 64], [2, 64, 128]], result
        assert result["local_weight"] == 0 and result["local_grad"] <= 1e-5, result


def test_experts_cut_in_the_mesh_order_over_ulysses_then_ring():
    """On a mesh that puts ulysses before ring the experts are cut over the ranks in the mesh's
    order ("fsdp"), not cp's ring-major one: their exchanges run over "fsdp"."""
    pytest.importorskip("transformers", reason="the models extra (pip install -e '.[models]') is not installed")
    from dtensor_par._testing import real_models

    logging.getLogger("transformers").setLevel(logging.ERROR)
    model, args, kwargs = real_models.mixtral(experts=8)
    (graph,) = dtensor_par.explain(model, args, example_kwargs=kwargs, ring=2, ulysses=2, ep="cp", parallelized=True,
                                   device_type="cpu", order=("ulysses", "ring", "tp")).graphs
    (line,) = [s for s in graph.sites if s.startswith("moe0")]
    assert graph.warnings == [] and "experts per rank: 2 of 8 (ep over cp=4), each whole" in line, (graph.warnings, line)
    exchanged = {c["mesh_dims"] for c in graph.collectives if c["site"] == "moe0.experts"}
    assert exchanged == {"fsdp"}, exchanged  # ulysses x ring, the mesh's order, not cp's


def test_routing_measured_per_replica_and_not_guessed_for_a_local_batch():
    """``measure_routing`` at dp_replicate2 x dp_shard2: each replica's rows reach only its own
    experts, so the most a rank gets back is the most over the replicas' groups, counted here by
    hand from the choice the experts module is given, and the same with symbolic sizes (at
    ulysses2); with a local batch the other ranks' rows are not given, and the report says it
    did not measure."""
    pytest.importorskip("transformers", reason="the models extra (pip install -e '.[models]') is not installed")
    from dtensor_par._testing import real_models

    logging.getLogger("transformers").setLevel(logging.ERROR)
    torch.manual_seed(0)
    model, _, kwargs = real_models.mixtral()
    args = (torch.randint(0, real_models.VOCAB, (4, real_models.SEQ)),)
    seen = []
    hook = model.model.layers[0].mlp.experts.register_forward_pre_hook(
        lambda module, args, kwargs: seen.extend(a for a in args if not a.is_floating_point()), with_kwargs=True)
    with torch.no_grad():
        model(*args, **kwargs)
    hook.remove()
    chosen = seen[0].view(2, 2 * real_models.SEQ, 2)  # per replica: its two dp_shard ranks' rows, top-2
    rows = max(torch.bincount(c.flatten(), minlength=4).view(2, 2).sum(1).max().item() for c in chosen)
    explain = functools.partial(dtensor_par.explain, model, args, example_kwargs=kwargs, ep="cp", measure_routing=True,
                                dp_shard=2)
    (graph,) = explain(dp_replicate=2).graphs
    (line,) = [s for s in graph.sites if s.startswith("moe0")]
    assert line.endswith(f"measured on the example inputs: {rows * 64 * 4} B back at most"), (line, rows)
    static, symbolic = (explain(ulysses=2, dp_shard=1, dynamic=dynamic).graphs[0].sites[-1]
                        for dynamic in (False, True))
    assert static == symbolic and "measured on the example inputs" in static, (static, symbolic)
    (graph,) = explain(batch="local").graphs
    (line,) = [s for s in graph.sites if s.startswith("moe0")]
    assert line.endswith("not measured: with a local batch the experts' rows come from each dp_shard rank's own "
                         "batch"), line
