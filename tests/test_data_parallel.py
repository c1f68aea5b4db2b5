"""The data-parallel mesh dims: the batch cut over dp_replicate x dp_shard (batch="global"), each
dp rank given its own slice with gradients averaged (batch="local"), the inputs check, and
the errors. Two launches (world 2 and world 4) run every multi-process case."""

from __future__ import annotations

import copy
import importlib.util
import os
from collections import Counter

import pytest
import torch

import dtensor_par
from dtensor_par.mesh import MESH_DIMS, MeshInfo
from dtensor_par._testing import models, patterns
from dtensor_par._testing.harness import (dp_rows, loss_of, max_rel, reported_collectives, run_ranks_together,
                                          step_collectives, whole)
from tests import tiers
from tests.background import in_background
from tests.cases import case_matches, run_cases

GLOBAL_CASES = ["gpt_fused_qkv", "bool_mask", "joint_attention", "mean_loss", "seq_first_table"]


def _local_batch(rank: int, world: int, *, mesh_sizes: dict, model: str) -> dict:
    """batch="local": each dp coordinate computes on its quarter of a batch of 4 with a mean loss;
    its output equals one device's rows of it, every gradient one device's on the whole batch."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    net = models.Llama(layers=1) if model == "llama" else models.GPT(layers=1)
    reference = copy.deepcopy(net)
    batch = torch.randint(0, 50, (4, 8)) if model == "llama" else torch.randn(4, 8, 32)
    mesh = dtensor_par.init_mesh(**mesh_sizes)
    rows = dp_rows(mesh, 4)
    compiled = torch.compile(net, backend=dtensor_par.hybrid_parallel(mesh, inner_backend="aot_eager", batch="local"))
    out = compiled(batch[rows])
    out.pow(2).mean().backward()
    want = reference(batch)
    want.pow(2).mean().backward()
    grad = max(max_rel(p.grad, q.grad) for p, q in zip(net.parameters(), reference.parameters()))
    return {model: {"forward_abs": (out - want[rows]).abs().max().item(), "grad_rel": grad}}


def _mismatch_errors(rank: int, world: int, *, mesh_sizes: dict) -> dict:
    """What each rank is told when ranks are given different inputs: under batch="global" any
    difference, under batch="local" a difference between ranks of one dp coordinate, or
    inputs of different shapes on different dp ranks, or the same inputs traced with a symbolic
    size on one rank only (it saw another size first); nothing with check_inputs=False."""
    mesh = dtensor_par.init_mesh(**mesh_sizes)
    dp = MeshInfo.from_mesh(mesh).dims["dp"]
    torch.manual_seed(0)
    block = models.GPTBlock()
    x = torch.randn(2, 8, 32)
    nudged = x.clone()
    nudged[1, 3, 5] += 1e-6  # one element, well below any tolerance a result would be checked with
    runs = {"global": ({}, nudged if rank == world - 1 else x),
            "global_unchecked": ({"check_inputs": False}, nudged if rank == world - 1 else x),
            "local_same_coordinate": ({"batch": "local"}, nudged if rank == world - 1 else x),
            "local_other_sizes": ({"batch": "local"}, x[:1] if dp.rank == 1 else x),
            "symbolic_on_one_rank": ({"batch": "local"}, x)}
    told = {}
    for label, (options, given) in runs.items():
        torch._dynamo.reset()
        backend = dtensor_par.hybrid_parallel(mesh, inner_backend="eager", **options)  # the inputs are checked
        if label == "symbolic_on_one_rank" and rank == world - 1:  # it saw another size: its batch is symbolic
            torch.compile(block, backend="eager")(x[:1])
        try:
            torch.compile(block, backend=backend)(given)
            told[label] = None
        except ValueError as e:
            told[label] = str(e)
    return told


def _cfg_example(rank: int, world: int) -> dict:
    """examples/cfg_parallel.py's guided sampling at dp_replicate=2 x ulysses=2: its latents after
    every step against one device's (the example's own model, inputs and loop)."""
    torch._dynamo.reset()
    path = os.path.join(os.path.dirname(os.path.dirname(__file__)), "examples", "cfg_parallel.py")
    spec = importlib.util.spec_from_file_location("cfg_parallel", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    torch.manual_seed(0)
    model = example.DiT().eval()
    noise, labels = torch.randn(example.IMAGES, example.TOKENS, example.HIDDEN), torch.tensor([3, 7])
    mesh = dtensor_par.init_mesh(dp_replicate=2, ulysses=2)
    compiled = torch.compile(model, backend=dtensor_par.hybrid_parallel(mesh, inner_backend="eager"))
    with torch.no_grad():
        steps = zip(example.sample(compiled, noise, labels, 3), example.sample(model, noise, labels, 3))
        return {"latents": {"forward_abs": max((a - b).abs().max().item() for a, b in steps), "grad_rel": 0.0}}


def _fsdp_class_token(rank: int, world: int) -> dict:
    """ViT's class token expanded over the batch that dp_shard cuts, the token held by FSDP over
    dp_shard beside tp (``parallelize``): one device's output and gradients."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, images = patterns.ClassTokenBlock(), torch.randn(2, 3, 12, 20)
    reference = copy.deepcopy(model)
    mesh = dtensor_par.init_mesh(dp_shard=2, tp=2)
    dtensor_par.parallelize(model, mesh, (images,))
    out = torch.compile(model, backend=dtensor_par.hybrid_parallel(mesh, inner_backend="aot_eager"))(images)
    expected = reference(images)
    loss_of(out).backward()
    loss_of(expected).backward()
    return {"class_token": {"forward_abs": (whole(out) - expected).abs().max().item(),
                            "grad_rel": max(max_rel(whole(p.grad), q.grad)
                                            for p, q in zip(model.parameters(), reference.parameters()))}}


def _world2() -> dict:
    return {
        "dp_replicate2": (run_cases, {"names": GLOBAL_CASES, "mesh_sizes": {"dp_replicate": 2}}),
        "dp_shard2_batch3": (run_cases, {"names": ["gpt_fused_qkv"], "mesh_sizes": {"dp_shard": 2},
                                         "inputs": [(torch.randn(3, 8, 32),)]}),
        "local_dp_replicate2": (_local_batch, {"mesh_sizes": {"dp_replicate": 2}, "model": "gpt"}),
        "mismatch_dp2": (_mismatch_errors, {"mesh_sizes": {"dp_replicate": 2}}),
    }


def _world4() -> dict:
    return {
        "dp_shard2_tp2": (run_cases, {"names": ["llama_gqa_rope", "gpt_fused_qkv"],
                                      "mesh_sizes": {"dp_shard": 2, "tp": 2}}),
        "dp_replicate2_ulysses2": (run_cases, {"names": ["llama_gqa_rope", "bool_mask"],
                                               "mesh_sizes": {"dp_replicate": 2, "ulysses": 2}}),
        "dp_replicate2_ring2": (run_cases, {"names": ["uneven_seq_30"], "mesh_sizes": {"dp_replicate": 2, "ring": 2}}),
        "dp_shard2_tp2_batch3": (run_cases, {"names": ["llama_gqa_rope"], "mesh_sizes": {"dp_shard": 2, "tp": 2},
                                             "inputs": [(torch.randint(0, 50, (3, 8)),)]}),
        "local_dp_shard2_tp2": (_local_batch, {"mesh_sizes": {"dp_shard": 2, "tp": 2}, "model": "llama"}),
        "local_dp_replicate2_ring2": (_local_batch, {"mesh_sizes": {"dp_replicate": 2, "ring": 2}, "model": "llama"}),
        "mismatch_dp2_tp2": (_mismatch_errors, {"mesh_sizes": {"dp_replicate": 2, "tp": 2}}),
        "cfg_example": (_cfg_example, {}),
        "fsdp_class_token": (_fsdp_class_token, {}),
    }


CALLS = {2: _world2(), 4: _world4()}
"""World size -> label -> (rank function, its keyword arguments)."""
SWEPT = {"dp_replicate2_ulysses2", "dp_shard2_tp2_batch3"}
"""Runs ``tests.tiers`` leaves to ``--sweep``: CI cuts the batch over dp beside tp and the ring,
and pads a batch of 3 over dp alone."""
LAUNCHES = {world: in_background(run_ranks_together, world, tiers.running(calls, SWEPT))
            for world, calls in CALLS.items()}
"""Every multi-process case of this file, one launch per world size (``tests.background``)."""


def _case(world: int, label: str, name: str) -> dict:
    """Case ``name`` of run ``label`` within the tolerances on every rank; rank 0's metrics."""
    return case_matches(LAUNCHES[world], world, label, name)


GLOBAL_BATCH = [(2, "dp_replicate2"), (2, "dp_shard2_batch3"), (4, "dp_shard2_tp2"), (4, "dp_replicate2_ulysses2"),
                (4, "dp_replicate2_ring2"), (4, "dp_shard2_tp2_batch3")]
"""The runs of ``run_cases`` (world size, label): the whole batch given to every rank."""


@pytest.mark.parametrize("world, label, name", [tiers.case(world, label, name, sweep=label in SWEPT)
                                                for world, label in GLOBAL_BATCH
                                                for name in CALLS[world][label][1]["names"]])
def test_global_batch_is_cut_over_dp_and_matches_one_device(world, label, name):
    """Every rank is given the whole batch and gets one device's result and gradients, with the
    batch cut over dp beside tp, ulysses or ring (a batch of 3 padded to 4 rows over dp=2)."""
    warnings = _case(world, label, name)["warnings"]
    assert not any("gathered on mesh dim 'dp'" in w for w in warnings), warnings
    assert not any("none of the" in w for w in warnings), warnings


@pytest.mark.parametrize("world,label", [(2, "local_dp_replicate2"), (4, "local_dp_shard2_tp2"),
                                         (4, "local_dp_replicate2_ring2")])
def test_local_batch_averages_gradients_over_dp(world, label):
    """Each dp coordinate given its own rows: its rows of one device's output, and one device's
    gradients of the mean loss over the whole batch."""
    _case(world, label, CALLS[world][label][1]["model"])


@pytest.mark.parametrize("world,label", [(2, "mismatch_dp2"), (4, "mismatch_dp2_tp2")])
def test_ranks_given_different_inputs_are_told_which(world, label):
    last = world - 1
    for told in (r[label] for r in LAUNCHES[world].result()):
        assert f"'l_x_': ranks [{last}] hold other values than rank 0" in told["global"]
        assert "batch='local'" in told["global"] and "check_inputs=False" in told["global"]
        assert told["global_unchecked"] is None
        # the last rank is alone at its dp coordinate with tp=1; with tp=2 it shares it with the rank before
        if world == 2:
            assert told["local_same_coordinate"] is None
        else:
            assert f"ranks [{last}] hold other values than rank {last - 1}" in told["local_same_coordinate"]
        assert "were given inputs of other shapes than rank 0" in told["local_other_sizes"]
        assert "'l_x_': [1, 8, 32]" in told["local_other_sizes"] or "'l_x_': [2, 8, 32]" in told["local_other_sizes"]
        assert "some ranks' graphs take more inputs: a symbolic size is one" in told["symbolic_on_one_rank"], told


@pytest.mark.parametrize("sizes,batch", [({"dp_replicate": 2}, "global"), ({"dp_shard": 2}, "local"),
                                         ({"dp_shard": 2, "tp": 2}, "global"),
                                         ({"dp_replicate": 2, "ring": 2}, "local")])
def test_a_step_runs_what_explain_reports(sizes, batch, fake_world):
    """Collective by collective and byte by byte: the output gathered over dp (global), the
    gradient buckets over dp (summed, or averaged under batch="local") and over cp."""
    torch.manual_seed(0)
    model = models.Llama(layers=1)
    ids = torch.randint(0, 50, (4, 8))
    report = dtensor_par.explain(model, (ids,), device_type="cpu", batch=batch, **sizes)
    dp_buckets = [c for c in report.graphs[0].collectives if c["mesh_dims"] == "dp" and c["direction"] == "backward"]
    assert len(dp_buckets) == 1 and dp_buckets[0]["site"].startswith("gradient bucket of")
    assert report.graphs[0].batch.startswith(f"batch: {batch}")
    _assert_a_step_runs(model, ids, report, fake_world, batch=batch, inner_backend="aot_eager", **sizes)


def _assert_a_step_runs(model, ids, report, fake_world, **options) -> None:
    """One step of ``model`` compiled on a fake world runs exactly the collectives ``report`` lists."""
    sizes = {d: options.pop(d) for d in MESH_DIMS if d in options}
    fake_world(report.world_size)
    mesh = dtensor_par.init_mesh(**sizes)
    if report.parameter_state.startswith("sharded"):
        dtensor_par.parallelize(model, mesh, (ids,), **options)
    compiled = torch.compile(model, backend=dtensor_par.hybrid_parallel(mesh, **options))
    ran = step_collectives(compiled, ids)
    assert ran == reported_collectives(report.graphs[0])


@pytest.mark.parametrize("sizes,reshard", [({"dp_shard": 2, "tp": 2}, True), ({"dp_replicate": 2, "dp_shard": 2}, False)])
def test_fsdp_gathers_each_block_once_and_a_step_runs_what_explain_reports(sizes, reshard, fake_world):
    """Parallelized, each parameter is cut over the fsdp dims too: one flat all-gather per block
    (and one for the rest of the model), again in backward unless reshard_after_forward=False,
    and one reduce-scatter of its gradients; HSDP all-reduces the pieces over dp_replicate.
    explain reports the bytes held, and a step runs exactly the collectives it reports (FSDP
    over ulysses: tests/test_sharded_state.py, on gloo)."""
    torch.manual_seed(0)
    model = models.Llama(layers=2)
    ids = torch.randint(0, 50, (2, 8))
    options = {"batch": "local", "reshard_after_forward": reshard, **sizes}
    report = dtensor_par.explain(model, (ids,), device_type="cpu", parallelized=True, **options)
    graph = report.graphs[0]
    fsdp = [c for c in graph.collectives if c["mesh_dims"] == "fsdp"]
    assert Counter((c["direction"], c["op"]) for c in fsdp for _ in range(c["count"])) == Counter(
        {("forward", "all_gather"): 3, ("backward", "reduce_scatter"): 3, **({("backward", "all_gather"): 3} if reshard
                                                                           else {})})
    assert {c["site"].split(" (")[0] for c in fsdp} == {"fsdp parameters of blocks.0", "fsdp parameters of blocks.1",
                                                         "fsdp parameters of the model outside its blocks"}
    shard = sizes.get("dp_shard", 1) * sizes.get("ulysses", 1)
    assert graph.fsdp.startswith("fsdp: 21 of 21 parameters cut over ") and graph.fsdp.endswith(f"= {shard}, "
                                                                                                  "gathered at use one "
                                                                                                  "block at a time")
    held, full = report.parameter_bytes
    tp_cut = sum(r["bytes"] for r in graph.parameters if r["placement"]["tp"] != "R")
    assert held == (tp_cut // sizes.get("tp", 1) + full - tp_cut) // shard
    replicate = [c for c in graph.collectives if c["mesh_dims"] == "dp_replicate"]
    assert [c["site"] for c in replicate] == (["gradient bucket of 21 inputs"] if "dp_replicate" in sizes else [])
    _assert_a_step_runs(model, ids, report, fake_world, inner_backend="aot_eager", **options)


def test_mixed_precision_sends_what_explain_reports(fake_world):
    """param_dtype=bfloat16, reduce_dtype=float32: the FSDP gathers and the activations' all-reduces
    send half the float32 plan's bytes, the gradients' reduce-scatters and all-reduces as many;
    a step runs exactly that."""
    torch.manual_seed(0)
    model, x = models.GPT(layers=1), torch.randn(2, 8, 32)
    sizes = {"dp_shard": 2, "tp": 2}
    plain = dtensor_par.explain(model, (x,), device_type="cpu", parallelized=True, **sizes)
    options = {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32}
    mixed = dtensor_par.explain(model, (x,), device_type="cpu", **sizes, **options)
    assert mixed.parameter_state.startswith("sharded") and mixed.parameter_bytes == plain.parameter_bytes
    halved = {("forward", "all_gather"), ("backward", "all_gather"), ("forward", "all_reduce"),
              ("backward", "all_reduce")}
    pairs = list(zip(plain.graphs[0].collectives, mixed.graphs[0].collectives))
    assert len(pairs) == len(plain.graphs[0].collectives) == len(mixed.graphs[0].collectives) > 0
    for p, m in pairs:
        gradients = p["site"].startswith("gradient bucket")  # of the parameters no fsdp dim cuts: in float32
        share = 2 if (p["direction"], p["op"]) in halved and not gradients else 1
        assert (p["op"], p["site"], p["bytes_per_rank"]) == (m["op"], m["site"], m["bytes_per_rank"] * share), (p, m)
    _assert_a_step_runs(model, x, mixed, fake_world, inner_backend="aot_eager", **sizes, **options)


def test_mixed_precision_needs_the_parameters_held_by_parallelize(fake_world):
    fake_world(2)
    model, x = models.GPT(layers=1), torch.randn(2, 8, 32)
    mesh = dtensor_par.init_mesh(dp_shard=2)
    compiled = torch.compile(model, backend=dtensor_par.hybrid_parallel(mesh, param_dtype=torch.bfloat16,
                                                                        inner_backend="aot_eager"))
    with pytest.raises(ValueError, match=r"param_dtype=torch.bfloat16 needs the model parallelized with it: .*"
                                         r"held and traced in \['torch.float32'\]"):
        compiled(x)
    with pytest.raises(ValueError, match="parallelized=False contradicts it"):
        dtensor_par.explain(model, (x,), dp_shard=2, parallelized=False, param_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="reduce_dtype=torch.float32 needs param_dtype"):
        dtensor_par.hybrid_parallel(mesh, reduce_dtype=torch.float32)


def test_explain_names_the_batch_cut_and_the_default_order_puts_dp_outermost():
    """The dp dims outermost; explain names the dim each input is cut along (dim 1 of a [seq,
    batch, hidden] one), and the inputs of the batch's size that stay whole."""
    torch.manual_seed(0)
    model = patterns.JointBlock()
    report = dtensor_par.explain(model, (torch.randn(4, 16, 32), torch.randn(4, 8, 32)), dp_replicate=2, dp_shard=2,
                                 tp=2, device_type="cpu")
    assert report.order == ("dp_replicate", "dp_shard", "ring", "ulysses", "tp")
    text = str(report)
    assert "mesh dp_replicate=2 x dp_shard=2 x ring=1 x ulysses=1 x tp=2 (8 ranks" in text
    assert "batch: global, cut over dp_replicate x dp_shard = 4 along l_txt_ dim 0, l_img_ dim 0" in text
    assert "0 fallback gathers" in text
    svg = report.svg()
    assert "dp_replicate=1,dp_shard=1,ring=0" in svg and "same cell across panels: dp_replicate x dp_shard x ring" in svg
    report = dtensor_par.explain(patterns.SequenceFirst(), (torch.randn(8, 2, 32), torch.randn(2, 32)), dp_shard=2,
                                 device_type="cpu")
    assert report.graphs[0].batch == ("batch: global, cut over dp_replicate x dp_shard = 2 along l_x_ dim 1; other inputs "
                                      "whole (of the batch's size, but no dim of theirs reaches the sites' batch: l_table_)")


def test_bad_data_parallel_input_is_named(fake_world):
    model = models.GPTBlock()
    with pytest.raises(ValueError, match=r"input 'l_x_' of shape \[1, 8, 32\] holds a batch of 1, smaller than "
                                         r"mesh dims 'dp_replicate' x 'dp_shard' = 2"):
        dtensor_par.explain(model, (torch.randn(1, 8, 32),), dp_shard=2, device_type="cpu")
    with pytest.raises(ValueError, match="batch must be one of"):
        dtensor_par.explain(model, (torch.randn(2, 8, 32),), dp_shard=2, batch="per_rank")
    fake_world(4)
    with pytest.raises(ValueError, match=r"init_mesh: dp_replicate=2 x dp_shard=1 x tp=1 x ring=1 x ulysses=1 = 2 "
                                         r"ranks, but the world size is 4"):
        dtensor_par.init_mesh(dp_replicate=2)
    with pytest.raises(ValueError, match=r"order must name each of \('dp_shard', 'tp', 'ring', 'ulysses'\) once"):
        dtensor_par.init_mesh(dp_shard=2, tp=2, order=("tp", "ring", "ulysses"))
    with pytest.raises(TypeError, match="dp_shards"):
        dtensor_par.init_mesh(dp_shards=2, tp=2)
    mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shrad", "tp"))
    with pytest.raises(ValueError, match=r"unknown mesh dim names \['dp_shrad'\].*allowed names are \('dp_replicate', "
                                         r"'dp_shard', 'tp', 'ring', 'ulysses'\)"):
        dtensor_par.hybrid_parallel(mesh)
    mesh = dtensor_par.init_mesh(dp_shard=2, tp=2)
    assert mesh.mesh_dim_names == ("dp_shard", "ring", "ulysses", "tp")
    with pytest.raises(ValueError, match=r"parallelize: fsdp_dims names \['dp_shard'\], which the mesh "
                                         r"ring=1 x ulysses=1 x tp=4 lacks"):
        dtensor_par.parallelize(model, dtensor_par.init_mesh(tp=4), (torch.randn(2, 8, 32),), fsdp_dims=("dp_shard",))
    with pytest.raises(ValueError, match=r"fsdp_dims must be a tuple of names from \('dp_shard', 'ring', 'ulysses'\), "
                                         r"got \('tp',\)"):
        dtensor_par.hybrid_parallel(mesh, fsdp_dims=("tp",))
    with pytest.raises(NotImplementedError, match=r"explain: fsdp_dims=\('dp_shard', 'ring'\) on the mesh dp_shard=2 x "
                                                  r"ring=2 x ulysses=2 x tp=1: parameters can be sharded over all of "
                                                  r"\['dp_shard', 'ring', 'ulysses'\] or over one of them, not over "
                                                  r"\['dp_shard', 'ring'\] alone"):
        dtensor_par.explain(model, (torch.randn(2, 8, 32),), dp_shard=2, ring=2, ulysses=2, fsdp_dims=("dp_shard", "ring"),
                            device_type="cpu")


def test_a_parameter_fsdp_holds_expanded_over_the_batch_dp_cuts_equals_one_device():
    """The class token gathered by FSDP, then expanded over this rank's rows: each rank sums its
    rows' gradient and the ranks all-reduce the token's (before: planning failed sizing that
    all-reduce, the gathered token having no planned shape)."""
    _case(4, "fsdp_class_token", "class_token")


def test_cfg_example_latents_equal_one_device():
    """The guided batch's halves on two dp_replicate groups, each Ulysses-parallel: every step's
    latents within 1e-5 of one device's (no gradient in inference)."""
    _case(4, "cfg_example", "latents")
