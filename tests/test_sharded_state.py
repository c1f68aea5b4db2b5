"""Sharded state (``parallelize``): each rank holds 1/tp of the parameters tp shards, and of
every parameter 1/(dp_shard x ring x ulysses) more (FSDP), of their gradients and optimizer state;
it trains exactly like one device and checkpoints with stock PyTorch."""

from __future__ import annotations

import copy
import glob
import json
import math
import os
import tempfile
from collections import Counter

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

import dtensor_par
from dtensor_par.mesh import FSDP_DIMS
from dtensor_par._testing import models, patterns
from dtensor_par._testing.harness import FUNCTIONAL_OPS, dp_rows, executed_collectives, loss_of, max_rel, run_ranks_together, whole
from tests import tiers
from tests.background import in_background

PARAM_RTOL = 1e-5

# Block weights the plan shards on tp (the rest, norms and rowwise biases, stays replicated).
SHARDED = {
    "gpt": ("qkv.weight", "qkv.bias", "proj.weight", "fc.weight", "fc.bias", "fc_out.weight"),
    "llama": ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight", "gate_proj.weight",
              "up_proj.weight", "down_proj.weight"),
}
BY_VOCAB = {"gpt": (), "llama": ("embed.weight", "lm_head.weight")}
"""The token embedding and LM head the plan cuts by the vocabulary on tp, once per model (GPT's
input is hidden states, its output too)."""


LAYERS = 1
"""Layers of each test model: nothing the sharded state does crosses layers, and one layer
compiles in about half the time of two (CI time on 2 cores)."""


def _model(name: str):
    torch.manual_seed(0)
    if name == "gpt":  # fused qkv: a _StridedShard parameter
        return models.GPT(layers=LAYERS), torch.randn(2, 8, 32)
    return models.Llama(layers=LAYERS), torch.randint(0, 50, (4, 8))


def _storage_bytes(t) -> int:
    local = t.to_local() if isinstance(t, DTensor) else t
    return local.untyped_storage().nbytes()


def _check_storage(model: nn.Module, optimizer, name: str, tp: int, fsdp: int) -> tuple[int, list]:
    """Whether every parameter, gradient and AdamW state tensor holds exactly its share: 1/tp
    where tp shards it, and 1/fsdp more, but for a tp-sharded bias (its only dim is tp's; every
    other parameter of these models has a dim that divides). How many are tp-sharded, and
    ``[parameter, tensor, bytes held, bytes expected]`` for each that holds another share."""
    sharded, wrong = 0, []
    for fqn, p in model.named_parameters():
        full = p.numel() * p.element_size()
        on_tp = fqn.endswith(SHARDED[name] + BY_VOCAB[name])
        expected = full // (tp if on_tp else 1) // (1 if on_tp and p.dim() == 1 else fsdp)
        sharded += on_tp
        state = optimizer.state[p]
        for what, t in (("parameter", p), ("gradient", p.grad), ("exp_avg", state["exp_avg"]),
                        ("exp_avg_sq", state["exp_avg_sq"])):
            if _storage_bytes(t) != expected:
                wrong.append([fqn, what, _storage_bytes(t), expected])
    return sharded, wrong


def _rows_loss(out: torch.Tensor, rows: slice, batch_size: int) -> torch.Tensor:
    """``loss_of`` the whole batch's output, over this rank's ``rows`` of it: the mean over the dp
    ranks (what batch="local" averages gradients by) is one device's ``loss_of``."""
    weights = torch.linspace(-1.0, 1.0, out[0].numel() * batch_size, dtype=out.dtype)
    return (out * weights.view(batch_size, *out.shape[1:])[rows]).mean()


def train_against_one_device(rank: int, world: int, *, sizes: dict, names: list[str], checkpoint_dir: str | None,
                             batch: str = "global", reshard_after_forward: bool = True):
    """3 AdamW steps with clipping, parallelized vs one device on the whole batch (a mean loss);
    storage shares; state dicts; whether the parameters and gradients are held as plain tensors."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict, set_model_state_dict,
                                                         set_optimizer_state_dict)

    mesh = dtensor_par.init_mesh(**sizes)
    results = {}
    for name in names:
        torch._dynamo.reset()
        model, x = _model(name)
        reference = copy.deepcopy(model)
        options = {"batch": batch, "reshard_after_forward": reshard_after_forward}
        rows = slice(None) if batch == "global" else dp_rows(mesh, len(x))
        dtensor_par.parallelize(model, mesh, (x[rows],), **options)
        compiled = torch.compile(model, backend=dtensor_par.hybrid_parallel(mesh, inner_backend="aot_eager",
                                                                            **options))
        # eps bounds Adam's normalization of near-zero gradient entries: an entry at fp32 rounding
        # noise (reordered sums) would otherwise get a full-size step of either sign on each side.
        make_opt = lambda params: torch.optim.AdamW(params, lr=1e-2, eps=1e-3, foreach=True)  # noqa: E731
        opt, opt_ref = make_opt(model.parameters()), make_opt(reference.parameters())
        worst = Counter()
        for _ in range(3):
            loss, loss_ref = _rows_loss(compiled(x[rows]), rows, len(x)), loss_of(reference(x))
            loss.backward()
            loss_ref.backward()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            norm_ref = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05)
            plain = {not isinstance(t, DTensor) for p in model.parameters() for t in (p, p.grad)}
            opt.step()
            opt_ref.step()
            if batch == "global":  # under "local" each rank's loss is its rows' (their mean is one device's)
                worst["loss"] = max(worst["loss"], abs(loss.item() - loss_ref.item()) / abs(loss_ref.item()))
            worst["norm"] = max(worst["norm"], abs(whole(norm).item() - norm_ref.item()) / norm_ref.item())
            worst["param"] = max(worst["param"], max(max_rel(whole(p), q)
                                                     for p, q in zip(model.parameters(), reference.parameters())))
            if _ == 2:
                fsdp = math.prod(mesh[n].size() for n in mesh.mesh_dim_names if n in FSDP_DIMS)
                worst["sharded_params"], storage = _check_storage(model, opt, name, mesh["tp"].size(), fsdp)
            opt.zero_grad()
            opt_ref.zero_grad()

        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
        worst["full_state_dict"] = max(max_rel(full[k], v) for k, v in reference.state_dict().items())
        fresh, _ = _model(name)
        torch.nn.init.zeros_(next(fresh.parameters()))
        dtensor_par.parallelize(fresh, mesh, (x,))
        set_model_state_dict(fresh, dict(reference.state_dict()), options=StateDictOptions(full_state_dict=True))
        worst["loaded_full"] = max(max_rel(whole(p), q) for p, q in zip(fresh.parameters(), reference.parameters()))

        if checkpoint_dir is not None:  # DCP: sharded files, optimizer included (gpt's fused qkv: pieces.Blocks)
            import torch.distributed.checkpoint as dcp
            saved = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
            dcp.save(saved, checkpoint_id=os.path.join(checkpoint_dir, name))
            expected = {k: whole(v).clone() for k, v in model.state_dict().items()}
            expected_avg = [whole(opt.state[p]["exp_avg"]).clone() for p in model.parameters()]
            loss_of(compiled(x)).backward()
            opt.step()  # move weights and state away from the checkpoint
            state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
            dcp.load(state, checkpoint_id=os.path.join(checkpoint_dir, name))
            set_model_state_dict(model, state["model"])
            set_optimizer_state_dict(model, opt, state["optim"])
            worst["dcp_params"] = max(max_rel(whole(v), expected[k]) for k, v in model.state_dict().items())
            worst["dcp_exp_avg"] = max(max_rel(whole(opt.state[p]["exp_avg"]), e)
                                       for p, e in zip(model.parameters(), expected_avg))
            worst["dcp_state_types"] = sorted({type(v).__name__ for s in opt.state.values() for v in s.values()})
        results[name] = {**worst, "plain": sorted(plain), "other_storage": storage}
    return results


def mixed_precision(rank: int, world: int) -> dict:
    """``param_dtype`` (FSDP2's MixedPrecisionPolicy) over FSDP (dp_shard) and over DDP
    (dp_replicate, fsdp_dims=()): computing in float64 from float32 pieces equals one device
    computing in float64, output and gradients (every cast and reduction in its place); in
    bfloat16, gradients reduced in float32, no further from one device in float32 than that
    device is in bfloat16. Gradients come back in the parameters' float32."""
    results = {}
    for label, sizes, options in (("fsdp", {"dp_shard": 2}, {}), ("ddp", {"dp_replicate": 2}, {"fsdp_dims": ()}),
                                  ("fsdp bf16", {"dp_shard": 2}, {"reduce_dtype": torch.float32})):
        torch._dynamo.reset()
        dtype = torch.bfloat16 if "bf16" in label else torch.float64
        model, x = _model("gpt")
        reference = copy.deepcopy(model)
        mesh = dtensor_par.init_mesh(**sizes)
        options = {"param_dtype": dtype, **options}
        dtensor_par.parallelize(model, mesh, (x,), **options)
        out = torch.compile(model, backend=dtensor_par.hybrid_parallel(mesh, inner_backend="aot_eager", **options))(x)
        loss_of(out.float()).backward()
        grads = [whole(p.grad) for p in model.parameters()]

        def one_device(dtype):
            params = {n: p.to(dtype) for n, p in reference.named_parameters()}
            want = torch.func.functional_call(reference, params, (x.to(dtype),))
            grads = torch.autograd.grad(loss_of(want.float()), list(reference.parameters()))
            return want, grads
        want, want_grads = one_device(dtype)
        result = {"dtypes": sorted({str(out.dtype)} | {str(g.dtype) for g in grads}),
                  "plain": sorted({not isinstance(p, DTensor) for p in model.parameters()})}
        if dtype == torch.float64:
            result.update(forward=(out - want).abs().max().item(), grad=max(map(max_rel, grads, want_grads)))
        else:
            exact, exact_grads = one_device(torch.float32)
            result.update(grad=max(map(max_rel, grads, exact_grads)),
                          one_device_grad=max(map(max_rel, want_grads, exact_grads)))
        results[label] = result
    return results


def sliced_unequal_parts(rank: int, world: int) -> dict:
    """JointBlock parallelized at tp2 x ulysses2 and trained 3 AdamW steps against one device:
    its single-stream qkv, cut part by part into unequal parts (GQA: [32, 16, 16]), is held
    whole (replicated) and sliced at each call; its site runs cut."""
    torch.manual_seed(0)
    model, inputs = patterns.JointBlock(), (torch.randn(2, 16, 32), torch.randn(2, 8, 32))
    reference = copy.deepcopy(model)
    mesh = dtensor_par.init_mesh(tp=2, ulysses=2)
    dtensor_par.parallelize(model, mesh, inputs)
    compiled = torch.compile(model, backend=dtensor_par.hybrid_parallel(mesh, inner_backend="aot_eager"))
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2, eps=1e-3) for m in (model, reference)]
    worst = 0.0
    for _ in range(3):
        loss_of(compiled(*inputs)).backward()
        loss_of(reference(*inputs)).backward()
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
        worst = max(worst, *(max_rel(whole(p), q) for p, q in zip(model.parameters(), reference.parameters())))
    return {"param": worst, "qkv": [str(p) for p in model.qkv.weight.placements],
            "img_qkv": [str(p) for p in model.img_qkv.weight.placements]}


TRAINING = {"tp2-ulysses2": (4, "training", ["gpt", "llama"]), "dp_shard2-ring2-tp2": (8, "training", ["llama"]),
            "local-hsdp2x2": (4, "hsdp_local", ["llama"]), "ddp2": (2, "ddp", ["llama"])}
"""The runs of ``train_against_one_device``: id -> world size, label and models. The fused
(strided) case once, at world 4: CI time on 2 cores."""


def _calls(world: int, folder: str) -> dict:
    """The rank functions one launch of ``world`` ranks runs, by label, with their arguments."""
    if world == 2:  # DDP's layout: every parameter held whole, as a plain tensor, DCP included
        return {"fresh": (full_parameters_stay_fresh, {}), "decorated": (decorated_model, {}),
                "mixed precision": (mixed_precision, {}),
                "ddp": (train_against_one_device, dict(sizes={"dp_replicate": 2}, names=TRAINING["ddp2"][2],
                                                       checkpoint_dir=os.path.join(folder, "checkpoint")))}
    if world == 8:  # FSDP over dp_shard x ring beside tp, on causal attention
        return {"training": (train_against_one_device, dict(sizes={"dp_shard": 2, "ring": 2, "tp": 2},
                                                            names=TRAINING["dp_shard2-ring2-tp2"][2],
                                                            checkpoint_dir=None))}
    return {"training": (train_against_one_device, dict(sizes={"tp": 2, "ulysses": 2},
                                                        names=TRAINING["tp2-ulysses2"][2],
                                                        checkpoint_dir=os.path.join(folder, "checkpoint"))),
            # each dp rank given its own rows: HSDP keeping gathered weights (FSDP beside tp: world 8)
            "hsdp_local": (train_against_one_device, dict(sizes={"dp_replicate": 2, "dp_shard": 2},
                                                          names=TRAINING["local-hsdp2x2"][2],
                                                          checkpoint_dir=None, batch="local",
                                                          reshard_after_forward=False)),
            **({"collectives": (count_collectives, dict(dump_dir=os.path.join(folder, "dump")))}
               if tiers.kept("collectives", SWEPT) else {}),
            "sliced": (sliced_unequal_parts, {})}


def _launch(world: int) -> list[dict]:
    """Each rank's results by label of ``world``'s calls, the checkpoint and dump in a temporary folder."""
    with tempfile.TemporaryDirectory() as folder:
        return run_ranks_together(world, _calls(world, folder))


SWEPT = {"dp_shard2-ring2-tp2", "collectives"}
"""Runs ``tests.tiers`` leaves to ``--sweep``: CI holds FSDP beside tp at pp x dp_shard x tp
(``test_pipeline_checkpoints``) and over dp_shard x tp (``test_data_parallel``), and checks the
collectives a training step runs against the dumped table with experts over dp_shard x cp
(``test_experts``)."""
LAUNCHES = {world: in_background(_launch, world) for world in (4, 8, 2)
            if world != 8 or tiers.kept("dp_shard2-ring2-tp2", SWEPT)}
"""One launch per world size serves all of that size's tests (in the order they read them)."""


@pytest.mark.parametrize("world, label, name", [tiers.case(world, label, name, sweep=run in SWEPT, id=f"{run}-{name}")
                                                for run, (world, label, names) in TRAINING.items() for name in names])
def test_training_matches_one_device_holding_one_tp_and_fsdp_share(world, label, name):
    """At dp_replicate alone no mesh dim cuts a parameter: each is held whole, as DDP holds it,
    a plain tensor (as its gradient and optimizer state), and trains and checkpoints alike."""
    for rank, worst in enumerate(rank_results[label][name] for rank_results in LAUNCHES[world].result()):
        assert worst["sharded_params"] == LAYERS * len(SHARDED[name]) + len(BY_VOCAB[name]), (rank, worst)
        assert worst["other_storage"] == [], (rank, worst["other_storage"])
        assert worst["plain"] == [label == "ddp"], (rank, worst)
        for key in ("loss", "norm", "param", "full_state_dict", "loaded_full", "dcp_params", "dcp_exp_avg"):
            assert worst.get(key, 0.0) <= PARAM_RTOL, (rank, key, worst)
        if label == "ddp" or (label == "training" and world == 4):
            assert "dcp_params" in worst, (rank, worst)
            assert worst["dcp_state_types"] == ["Tensor"] if label == "ddp" else ["DTensor", "Tensor"], (rank, worst)


def test_a_projection_cut_into_unequal_parts_is_held_whole_and_sliced_at_each_call():
    for rank_results in LAUNCHES[4].result():
        result = rank_results["sliced"]
        assert result["param"] <= PARAM_RTOL, result
        assert result["qkv"] == ["R", "R"], result  # no DTensor placement cuts [32, 16, 16]
        assert result["img_qkv"] == ["S(1)", "_S(0, 3)"], result  # equal parts: held cut (_StridedShard)


def count_collectives(rank: int, world: int, *, dump_dir: str):
    """One training step's executed collectives against the dumped table, for a parallelized
    model and for one that is not (whose table lists the parameter-gradient gathers)."""
    mesh = dtensor_par.init_mesh(tp=2, ulysses=2)
    results = {}
    for parallelized in (True, False):
        torch._dynamo.reset()
        model, x = _model("llama")
        if parallelized:
            dtensor_par.parallelize(model, mesh, (x,))
        folder = os.path.join(dump_dir, str(parallelized))
        compiled = torch.compile(model, backend=dtensor_par.hybrid_parallel(mesh, inner_backend="aot_eager",
                                                                            dump_dir=folder))
        loss_of(compiled(x)).backward()  # compiles
        ran = Counter(name for name, _ in executed_collectives(lambda: loss_of(compiled(x)).backward()))
        table = Counter()
        for plan in glob.glob(os.path.join(folder, f"ring0_ulysses{rank // 2}_tp{rank % 2}", "*", "plan.json")):
            with open(plan) as f:
                for row in json.load(f)["collectives"]:
                    table[FUNCTIONAL_OPS[row["op"]]] += row["count"]
        gathers = sum(row["count"] for plan in glob.glob(os.path.join(folder, "*", "*", "plan.json"))
                      for row in json.load(open(plan))["collectives"] if row["site"] == "parameter gradient")
        results[str(parallelized)] = {"ran": dict(ran), "table": dict(table), "param_grad_gathers": gathers}
    return results


@tiers.MARK
def test_every_collective_a_step_runs_is_in_the_table():
    result = LAUNCHES[4].result()[0]["collectives"]
    for mode in ("True", "False"):
        assert result[mode]["ran"] == result[mode]["table"], (mode, result[mode])
    assert result["True"]["param_grad_gathers"] == 0
    assert result["False"]["param_grad_gathers"] > 0
    assert result["False"]["ran"]["all_gather_into_tensor"] > result["True"]["ran"].get("all_gather_into_tensor", 0)


def full_parameters_stay_fresh(rank: int, world: int):
    """Without parallelize the runtime slices full parameters at every call: in-place changes
    through ``.data``, ``.data =`` and a replaced parameter are all seen (a stale piece would be
    off by the whole change; random weights make outputs large, so the error is relative)."""
    mesh = dtensor_par.init_mesh(tp=2)
    model, x = _model("gpt")
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend=dtensor_par.hybrid_parallel(mesh, inner_backend="aot_eager"))
    diffs = [max_rel(compiled(x), reference(x))]
    for m in (model, reference):
        m.blocks[0].fc.weight.data.add_(0.5)
    diffs.append(max_rel(compiled(x), reference(x)))
    new = torch.randn_like(model.blocks[0].proj.weight)
    model.blocks[0].proj.weight.data, reference.blocks[0].proj.weight.data = new.clone(), new.clone()
    diffs.append(max_rel(compiled(x), reference(x)))
    new = torch.randn_like(model.blocks[0].qkv.weight)
    model.blocks[0].qkv.weight = nn.Parameter(new.clone())
    reference.blocks[0].qkv.weight = nn.Parameter(new.clone())
    diffs.append(max_rel(compiled(x), reference(x)))
    return diffs


def test_full_parameters_changed_in_any_way_are_seen():
    for diffs in (rank_results["fresh"] for rank_results in LAUNCHES[2].result()):
        assert max(diffs) <= 1e-6, diffs


@pytest.mark.parametrize("label", ["fsdp", "ddp", "fsdp bf16"])
def test_mixed_precision_computes_in_param_dtype_and_reduces_in_reduce_dtype(label):
    for rank, result in enumerate(rank_results["mixed precision"][label] for rank_results in LAUNCHES[2].result()):
        if label == "fsdp bf16":
            assert result["dtypes"] == ["torch.bfloat16", "torch.float32"], (rank, result)
            assert 0 < result["grad"] <= 2 * result["one_device_grad"], (rank, result)
        else:
            assert result["dtypes"] == ["torch.float32", "torch.float64"], (rank, result)
            assert result["plain"] == [label == "ddp"], (rank, result)
            assert result["forward"] <= 1e-12 and result["grad"] <= 1e-6, (rank, result)


# --- bad input, planned on a fake process group (nothing is sent) ----------------------------

def test_parallelize_errors(fake_world):
    fake_world(4)
    mesh = dtensor_par.init_mesh(tp=2, ulysses=2)
    model, x = _model("llama")
    early = torch.optim.AdamW(model.parameters())
    assert dtensor_par.parallelize(model, mesh, (x,)) is model
    assert dtensor_par.parallelize(model, mesh, (x,)) is model  # again with the same mesh: nothing to do
    with pytest.raises(ValueError, match="already parallelized"):
        dtensor_par.parallelize(model, dtensor_par.init_mesh(tp=4), (x,))
    with pytest.raises(RuntimeError, match=r"holds parameter 'embed.weight' as it was before"):
        early.step()
    with pytest.raises(RuntimeError, match="was parallelized .* torch.compile"):
        model(x)
    other = torch.compile(model, backend=dtensor_par.hybrid_parallel(dtensor_par.init_mesh(tp=4),
                                                                     inner_backend="aot_eager"))
    with pytest.raises(Exception, match=r"parameter 'embed.weight' is a DTensor .* over DeviceMesh\(\(ulysses=2, "
                                        r"tp=2\).* but this plan needs .* over DeviceMesh\(\(tp=4\)"):
        other(x)


def test_a_mesh_that_cuts_no_parameter_holds_them_whole_as_plain_tensors(fake_world):
    """dp_replicate alone: parallelize holds every parameter whole, a plain tensor (DDP's state),
    explain says so, and a plan that cuts a parameter refuses them."""
    fake_world(2)
    model, x = _model("llama")
    report = dtensor_par.explain(model, (x,), device_type="cpu", parallelized=True, dp_replicate=2)
    assert "each rank holds every parameter whole, as a plain tensor" in report.parameter_state
    assert report.parameter_bytes[0] == report.parameter_bytes[1]
    dtensor_par.parallelize(model, dtensor_par.init_mesh(dp_replicate=2), (x,))
    assert not any(isinstance(p, DTensor) for p in model.parameters())
    other = torch.compile(model, backend=dtensor_par.hybrid_parallel(dtensor_par.init_mesh(tp=2),
                                                                     inner_backend="aot_eager"))
    with pytest.raises(Exception, match=r"parameter 'embed.weight' is held whole \(a plain tensor: .* "
                                        r"but this plan needs .*Shard"):
        other(x)


def test_replaced_parallelized_parameter_is_refused(fake_world):
    fake_world(2)
    mesh = dtensor_par.init_mesh(tp=2)
    model, x = _model("gpt")
    dtensor_par.parallelize(model, mesh, (x,))
    model.blocks[0].fc.weight = nn.Parameter(torch.zeros(64, 32))
    compiled = torch.compile(model, backend=dtensor_par.hybrid_parallel(mesh, inner_backend="aot_eager"))
    with pytest.raises(RuntimeError, match=r"parameter 'blocks.0.fc.weight' of parallelized GPT was replaced"):
        compiled(x)


def test_swap_hooks_cost_no_frame_and_no_graph_break(fake_world):
    """The hooks that put stand-ins in the DTensor parameters' place: ``torch.compile(model)``
    calls them as frames of their own, which run eagerly (Dynamo traces the forward alone); a
    traced caller (an outer compiled function, the decorator's) inlines them, with no break."""
    from torch._dynamo.utils import counters

    fake_world(2)
    mesh = dtensor_par.init_mesh(tp=2)
    backend = dtensor_par.hybrid_parallel(mesh, inner_backend="eager")
    model, x = _model("gpt")
    dtensor_par.parallelize(model, mesh, (x,))
    for name, fn in (("module", model), ("outer function", lambda x: model(x).sum())):
        torch._dynamo.reset()
        counters.clear()
        torch.compile(fn, backend=backend)(x)
        assert counters["frames"]["ok"] == 1 and not counters["graph_break"], (name, counters)


def test_meta_model_materializes_only_local_pieces(fake_world):
    fake_world(4)
    mesh = dtensor_par.init_mesh(tp=4)
    with torch.device("meta"):
        model = models.Llama(layers=1, hidden=64, heads=8, kv_heads=4, mlp=128)
        ids = torch.randint(0, 50, (1, 16))
    dtensor_par.parallelize(model, mesh, (ids,))
    q = model.blocks[0].q_proj.weight
    assert q.shape == (64, 64) and q.to_local().shape == (16, 64) and q.to_local().device.type == "cpu"
    assert _storage_bytes(q) == 16 * 64 * 4
    assert model.embed.weight.to_local().shape == (50, 64)
    assert not any(b.is_meta for b in model.buffers())


@pytest.mark.parametrize("name", ["gpt", "transformers_llama"])
def test_a_meta_model_is_planned_on_real_example_inputs(name, fake_world):
    """A model built on meta (``from_pretrained``'s) planned on real inputs: a layer norm of a real
    input by a meta weight, and transformers' kv cache built on the inputs' device, trace as on one
    device; the parameters stay on meta until the pieces are materialized, and tied ones stay tied."""
    fake_world(2)
    mesh = dtensor_par.init_mesh(tp=2)
    if name == "gpt":
        with torch.device("meta"):
            model = models.GPT(layers=1)
        inputs, weight = (torch.randn(2, 8, 32),), "blocks.0.qkv.weight"
    else:
        transformers = pytest.importorskip("transformers")
        config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                          num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
        with torch.device("meta"):
            model = transformers.LlamaForCausalLM(config)  # use_cache: the call builds a DynamicCache
        inputs, weight = (torch.randint(0, 64, (1, 8)),), "model.layers.0.self_attn.q_proj.weight"
    dtensor_par.parallelize(model, mesh, inputs)
    held = model.get_parameter(weight)
    assert held.to_local().device.type == "cpu" and held.to_local().shape[0] == held.shape[0] // 2
    assert not any(p.is_meta for p in model.parameters()) and not any(b.is_meta for b in model.buffers())
    if name != "gpt":
        assert model.lm_head.weight is model.model.embed_tokens.weight


def test_a_tied_weight_is_held_as_the_graph_reads_it_under_another_name(fake_world):
    """T5's token table is registered first as ``shared`` and read by the graph as
    ``encoder.embed_tokens``: held cut by the vocabulary as the plan cuts it, and the compiled
    call takes it (before: held whole, and the first call refused it)."""
    pytest.importorskip("transformers")
    from torch.distributed.tensor import Shard

    from dtensor_par._testing import real_models

    fake_world(2)
    mesh = dtensor_par.init_mesh(tp=2)
    model, args, kwargs = real_models.t5()
    dtensor_par.parallelize(model, mesh, args, example_kwargs=kwargs)
    assert model.shared.weight is model.encoder.embed_tokens.weight and model.shared.weight.placements == (Shard(0),)
    torch.compile(model, backend=dtensor_par.hybrid_parallel(mesh, inner_backend="eager"))(*args, **kwargs)


def test_parallel_decorator_refuses_a_non_module():
    with pytest.raises(TypeError, match="decorates torch.nn.Module subclasses"):
        dtensor_par.parallel(tp=2)(object)


def decorated_model(rank: int, world: int):
    """A decorated class (third-party style): loads a full state dict before its first call,
    then trains exactly like one device."""
    Parallel = dtensor_par.parallel(tp=2, inner_backend="aot_eager")(models.Llama)
    torch.manual_seed(0)
    reference = models.Llama(layers=1)
    model = Parallel(layers=1)
    model.load_state_dict(reference.state_dict())
    x = torch.randint(0, 50, (2, 8))
    out = model(x)
    loss_of(out).backward()
    loss_of(reference(x)).backward()
    sharded = model.blocks[0].q_proj.weight
    return {"forward": (out - reference(x)).abs().max().item(),
            "grad": max(max_rel(p.grad.full_tensor(), q.grad) for p, q in zip(model.parameters(), reference.parameters())),
            "local_rows": sharded.to_local().shape[0], "name": type(model).__name__}


def test_parallel_decorator_on_a_model_class():
    for result in (rank_results["decorated"] for rank_results in LAUNCHES[2].result()):
        assert result["forward"] <= 1e-5 and result["grad"] <= 1e-4, result
        assert result["local_rows"] == 32 and result["name"] == "Llama"
