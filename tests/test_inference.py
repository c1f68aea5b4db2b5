"""Inference as users run it: planning never runs the model (no side effect twice), and
``generate()`` through every entry point gives one device's tokens."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.nn as nn

import dtensor_par
from dtensor_par._testing import models
from dtensor_par._testing.harness import FORWARD_ATOL, logged, run_ranks_together
from tests import tiers
from tests.background import in_background

pytest.importorskip("transformers", reason="the models extra (pip install -e '.[models]') is not installed")


class StatefulBlock(models.GPTBlock):
    """A block whose forward changes its own state three ways, as kv caches and step counters do:
    a Python counter, a list it appends to, and a buffer written in place."""

    def __init__(self):
        super().__init__()
        self.calls = 0
        self.seen: list[int] = []
        self.register_buffer("steps", torch.zeros(()))

    def forward(self, x):
        self.calls += 1
        self.seen.append(x.shape[1])
        self.steps.add_(1)
        return super().forward(x)


def _state(block: StatefulBlock) -> dict:
    return {"calls": block.calls, "seen": list(block.seen), "steps": block.steps.item()}


def _run(block: nn.Module, reference: nn.Module, call, sizes: list[int]) -> dict:
    """Call ``call`` and the one-device ``reference`` on inputs of each sequence length: the
    largest difference, and the block's state and the reference's afterwards."""
    worst = 0.0
    for seq in sizes:
        x = torch.randn(2, seq, 32)
        worst = max(worst, (call(x) - reference(x)).abs().max().item())
    return {"forward": worst, "state": _state(block), "expected": _state(reference)}


def side_effects_once(rank: int, world: int) -> dict:
    """Every entry point, each from a fresh block: its output and its state after the calls
    against one device's; explain's, whose state after planning must be the fresh block's."""
    mesh = dtensor_par.init_mesh(tp=world)
    torch.manual_seed(0)
    diffs = {}
    block = StatefulBlock()  # torch.compile with the backend; a second length plans again
    reference = copy.deepcopy(block)
    compiled = torch.compile(block, backend=dtensor_par.hybrid_parallel(mesh, inner_backend="aot_eager"))
    diffs["compile, replan"] = _run(block, reference, compiled, [8, 12])
    block = StatefulBlock()
    reference = copy.deepcopy(block)
    dtensor_par.parallelize(block, mesh, (torch.randn(2, 8, 32),))
    compiled = torch.compile(block, backend=dtensor_par.hybrid_parallel(mesh, inner_backend="aot_eager"))
    diffs["parallelize + compile"] = _run(block, reference, compiled, [8])
    block = dtensor_par.parallel(tp=world, mesh=mesh, inner_backend="aot_eager")(StatefulBlock)()
    reference = StatefulBlock()
    reference.load_state_dict(block.state_dict())
    diffs["decorator"] = _run(block, reference, block, [8])
    block = StatefulBlock()
    dtensor_par.explain(block, (torch.randn(2, 8, 32),), tp=world)
    diffs["explain"] = {"forward": 0.0, "state": _state(block), "expected": {"calls": 0, "seen": [], "steps": 0.0}}
    return diffs


GENERATED = ["decorated ring", "written out ring", "alibi ring", "recurrence tp", "recurrence ring", "scan tp",
             "scan ring", "selective scan tp", "selective scan ring"]
"""The world-2 runs of ``decorated_generate`` (the first) and ``decorated_written_out_generate``."""
CP_DECODE = [({"ring": 2}, "mistral"), ({"ulysses": 2}, "llama")]
"""``cp_decode``'s runs at world 2: a mesh's sizes and a model family."""


SWEPT = {"written out ring", "alibi ring", "recurrence tp", "scan tp", "scan ring", "selective scan tp", "selective scan ring",
         "generate", "decode falcon_multi_query {'tp': 2, 'ring': 2}", "llama {'ulysses': 2}"}
"""Runs ``tests.tiers`` leaves to ``--sweep``: CI decodes a recurrence under ring=2 (its cache
of states as a scan's), the decorator's generate under ring=2 and dp x ring, a kv cache cut over the ring
(Mistral's window) and beside tp (Llama)."""


def _world2_launch() -> list[dict]:
    """Every world-2 case of this module in one launch of 2 gloo ranks, each rank's results
    by case (``parallelize`` resets Dynamo's caches: its case runs last)."""
    return run_ranks_together(2, tiers.running({
        "side effects": (side_effects_once, {}),
        "decorated ring": (decorated_generate, {"ring": 2}),
        "written out ring": (decorated_written_out_generate, {"name": "gpt_oss", "ring": 2}),
        "alibi ring": (decorated_written_out_generate, {"name": "bloom", "ring": 2}),
        "recurrence tp": (decorated_written_out_generate, {"name": "qwen3_5", "tp": 2}),
        "recurrence ring": (decorated_written_out_generate, {"name": "qwen3_5", "ring": 2}),
        "scan tp": (decorated_written_out_generate, {"name": "granite_hybrid", "tp": 2}),
        "scan ring": (decorated_written_out_generate, {"name": "granite_hybrid", "ring": 2}),
        "selective scan tp": (decorated_written_out_generate, {"name": "jamba", "tp": 2}),
        "selective scan ring": (decorated_written_out_generate, {"name": "jamba", "ring": 2}),
        "decode plans": (decode_plans, {}),
        "cp decode": (cp_decode, {"runs": tiers.running(CP_DECODE, SWEPT, key=lambda run: f"{run[1]} {run[0]}")}),
        "entry points": (generate_entry_points, {}),
    }, SWEPT))


WORLD2 = in_background(_world2_launch)


@pytest.mark.parametrize("entry", ["compile, replan", "parallelize + compile", "decorator", "explain"])
def test_planning_runs_no_side_effect_twice(entry):
    for rank, result in enumerate(r["side effects"][entry] for r in WORLD2.result()):
        assert result["forward"] <= FORWARD_ATOL and result["state"] == result["expected"], (rank, result)


GREEDY = {"max_new_tokens": 16, "do_sample": False, "pad_token_id": 0}


LAYERS = 1
"""Every path of the cache runs in one layer (CI time: each layer is compiled per rank)."""


def _tiny_llama():
    """A one-layer transformers Llama (GQA: 8 heads, 4 kv heads), its config and a prompt of 8 tokens."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
                         num_attention_heads=8, num_key_value_heads=4)
    return config, LlamaForCausalLM(config).eval(), torch.randint(0, 128, (1, 8))


def decorated_generate(rank: int, world: int, batch: int = 1, **sizes) -> dict:
    """``parallel(**sizes)(LlamaForCausalLM)``: ``generate`` as the first call (greedy, 16 new
    tokens, a DynamicCache), and a prefill's cache length, against one device; ``batch``
    prompts (cut over the dp dims, whose ranks keep the whole cache). The local graphs run as
    they are (``eager``): ``cp_decode`` traces prefill and decode under cp through AOTAutograd."""
    from transformers import DynamicCache, LlamaForCausalLM

    config, reference, ids = _tiny_llama()
    ids = torch.cat([ids, torch.randint(0, 128, (batch - 1, ids.shape[1]))]) if batch > 1 else ids
    Parallel = dtensor_par.parallel(**sizes, inner_backend="eager")(LlamaForCausalLM)
    model = Parallel(config).eval()
    model.load_state_dict(reference.state_dict())
    tokens, expected = model.generate(ids, **GREEDY), reference.generate(ids, **GREEDY)

    model = Parallel(config).eval()
    model.load_state_dict(reference.state_dict())
    cache, reference_cache = DynamicCache(config=config), DynamicCache(config=config)
    logits = model(ids, past_key_values=cache, use_cache=True).logits
    expected_logits = reference(ids, past_key_values=reference_cache, use_cache=True).logits
    return {"tokens": tokens.tolist(), "expected": expected.tolist(),
            "cache": cache.get_seq_length(), "expected_cache": reference_cache.get_seq_length(),
            "logits": (logits - expected_logits).abs().max().item()}


def decorated_written_out_generate(rank: int, world: int, name: str, **sizes) -> dict:
    """``parallel(**sizes)`` on the class of ``real_models``' ``name``, whose attention is written
    out by hand: GPT-OSS's with sink logits, on a sliding window and not; Bloom's with ALiBi; or
    is a recurrence in some layers: Qwen3.5's, Granite 4's. A cp prefill, then each decode step's
    query against the cache rows each rank holds (``cached_attention`` with the score function,
    the sinks, the bias evaluated at the held rows' positions). Greedy tokens and every step's
    logits against one device."""
    from dtensor_par._testing import real_models

    torch.manual_seed(0)
    reference, _, _ = real_models.FACTORIES[name]()
    reference.eval()
    model = dtensor_par.parallel(**sizes, inner_backend="eager")(type(reference))(reference.config).eval()
    model.load_state_dict(reference.state_dict())
    ids, scored = torch.randint(0, 128, (1, 8)), {**GREEDY, "output_scores": True, "return_dict_in_generate": True}
    got, expected = model.generate(ids, **scored), reference.generate(ids, **scored)
    return {"tokens": got.sequences.tolist(), "expected": expected.sequences.tolist(), "steps": len(got.scores),
            "logits": max((a - b).abs().max().item() for a, b in zip(got.scores, expected.scores))}


def _check_decorated_generate(result: dict) -> None:
    assert result["tokens"] == result["expected"], result
    assert len(result["tokens"][0]) == 8 + 16, result
    assert result["cache"] == result["expected_cache"] == 8, result
    assert result["logits"] <= FORWARD_ATOL, result


@pytest.mark.parametrize("run", [tiers.case(run, sweep=run in SWEPT) for run in GENERATED])
def test_decorated_transformers_llama_generates_one_devices_tokens(run):
    """Under ring=2 here; under tp (beside ulysses) at world 4. Attention written out by hand
    decodes under ring=2 too: GPT-OSS's (sink logits, a sliding window) and Bloom's (ALiBi).
    So does Qwen3.5's linear attention, its cache's convolution and recurrent states made whole
    (a fresh buffer written whole becomes the value written), under tp2 (each decode step's
    recurrence on each rank's heads, the states gathered into the cache's, warned) and under
    ring=2 (the prompt's recurrence on each rank's rows, each decode step's whole). So does
    Granite 4's Mamba-2 layer: the prompt's scan on each rank's heads or rows, its final state
    the cache's; each decode step's state, cloned and written whole, read as the value written.
    So does Jamba's Mamba-1 layer: its prompt's 8 rows as many as its state's size (the output
    and the state told apart by what reads C), its decode step's state read through an alias
    (``state.float()``) before the write."""
    for rank, result in enumerate(r[run] for r in WORLD2.result()):
        if run == "decorated ring":
            _check_decorated_generate(result)
        else:
            assert result["tokens"] == result["expected"] and result["steps"] == 16, (rank, result)
            assert result["logits"] <= FORWARD_ATOL, (rank, result)


def _decoder(family: str):
    """A one-layer transformers Llama or Mistral (sliding window of 6) with GQA, or a model of
    ``real_models``, and its config."""
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

    from dtensor_par._testing import real_models

    torch.manual_seed(0)
    if family not in ("llama", "mistral"):
        model = real_models.FACTORIES[family]()[0].eval()
        return model.config, model
    sizes = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": LAYERS,
             "num_attention_heads": 8, "num_key_value_heads": 4}
    if family == "llama":
        config = LlamaConfig(**sizes)
        return config, LlamaForCausalLM(config).eval()
    config = MistralConfig(**sizes, sliding_window=6)
    return config, MistralForCausalLM(config).eval()


def _decode_steps(model, reference, config) -> dict:
    """Prefill 9 tokens of a batch of two (the second padded by 3), then 8 steps of one token
    and one of 3 (a speculative draft), feeding both models one device's tokens; the worst
    logit difference, the cache length and the kv cache bytes held per rank."""
    from transformers import DynamicCache

    from dtensor_par.kv_cache import cache_shard

    cache, reference_cache = DynamicCache(config=config), DynamicCache(config=config)
    ids = torch.randint(0, 128, (2, 9))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, :3] = 0
    worst = 0.0
    with torch.no_grad():
        for step in range(10):
            kwargs = {"attention_mask": mask, "past_key_values": cache, "use_cache": True}
            logits = model(ids, **kwargs).logits
            expected = reference(ids, **{**kwargs, "past_key_values": reference_cache}).logits
            worst = max(worst, (logits - expected).abs().max().item())
            ids = torch.randint(0, 128, (2, 3)) if step == 8 else expected[:, -1:].argmax(-1)
            mask = torch.cat([mask, torch.ones_like(ids)], dim=1)
    layers = [(layer.keys, layer.values) for layer in cache.layers]
    return {"logits": worst, "cache": cache.get_seq_length(), "expected_cache": reference_cache.get_seq_length(),
            "held": sum(cache_shard(t).local.nbytes for kv in layers for t in kv),
            "whole": sum(t.nbytes for layer in reference_cache.layers for t in (layer.keys, layer.values))}


def cp_decode(rank: int, world: int, runs: list[tuple[dict, str]], inner_backend: str = "aot_eager") -> dict:
    """Decode with the kv cache cut over cp (and tp): each run a mesh's sizes and a model family.
    Decode is alike over ring and ulysses (both cut the cache over cp); their prefills differ."""
    results = {}
    for sizes, family in runs:
        mesh = dtensor_par.init_mesh(**sizes)
        torch._dynamo.reset()  # each case compiles from scratch, as a fresh job would
        config, reference = _decoder(family)
        model = copy.deepcopy(reference)
        backend = dtensor_par.hybrid_parallel(mesh, inner_backend=inner_backend)
        model.forward = torch.compile(model.forward, backend=backend)
        results[f"{family} {sizes}"] = {**_decode_steps(model, reference, config), "ranks": mesh.size(),
                                        "cp": sizes.get("ring", 1) * sizes.get("ulysses", 1)}
    return results


def decode_plans(rank: int, world: int) -> dict:
    """``generate`` through a compiled forward at tp, with a DynamicCache, a StaticCache and a
    sliding-window cache (Mistral): one device's tokens, the plans made, and the cache bytes
    each rank holds."""
    from transformers import DynamicCache, StaticCache

    from dtensor_par.kv_cache import cache_shard

    mesh = dtensor_par.init_mesh(tp=world)
    results = {}
    ids = torch.randint(0, 128, (1, 8))
    for name, family, make in (("dynamic", "llama", lambda c: DynamicCache(config=c)),
                               ("static", "llama", lambda c: StaticCache(config=c, max_cache_len=32)),
                               ("sliding window", "mistral", lambda c: DynamicCache(config=c))):
        torch._dynamo.reset()
        config, reference = _decoder(family)
        model = _compiled_forward(copy.deepcopy(reference), dtensor_par.hybrid_parallel(mesh, inner_backend="aot_eager"))
        cache = make(config)
        with logged(logging.INFO) as records:
            tokens = model.generate(ids, past_key_values=cache, **GREEDY).tolist()
        tensors = [t for layer in cache.layers for t in (layer.keys, layer.values)]
        results[name] = {"same": tokens == reference.generate(ids, past_key_values=make(config), **GREEDY).tolist(),
                         "plans": [r.getMessage() for r in records if "planned graph" in r.getMessage()],
                         "held": sum(cache_shard(t).local.nbytes for t in tensors),
                         "whole": sum(t.nbytes for t in tensors)}
    return results


@pytest.mark.parametrize("name", ["dynamic", "static", "sliding window"])
def test_decode_is_one_plan_and_holds_this_ranks_heads(name):
    """Prefill and decode plan once each (decode symbolic in the cache length for a
    DynamicCache; a StaticCache's shapes do not change), and each rank holds half the cache."""
    for rank, results in enumerate(r["decode plans"] for r in WORLD2.result()):
        assert set(results) == {"dynamic", "static", "sliding window"}, results.keys()
        r = results[name]
        assert r["same"] and r["held"] * 2 == r["whole"], (rank, r)
        assert len(r["plans"]) == 2, (rank, r["plans"])
        if name != "static":
            assert "symbolic in" in r["plans"][1], (rank, r["plans"])


def _check_cp_decode(r: dict) -> None:
    assert r["logits"] <= FORWARD_ATOL, r
    assert r["cache"] == r["expected_cache"], r
    block = 2 * LAYERS * 4 * 8 * 4 * 2  # one row of every layer's keys and values, batch 2
    assert r["held"] <= r["whole"] / r["ranks"] + block, r


@pytest.mark.parametrize("name", [tiers.case(name, sweep=name in SWEPT)
                                  for name in (f"{family} {sizes}" for sizes, family in CP_DECODE)])
def test_decode_with_the_kv_cache_cut_over_cp_matches_one_device(name):
    """Prefill under cp leaves each rank its sequence rows; decode (1 and 3 new tokens, a
    padded batch, a sliding window) attends to them and merges: one device's logits, and
    at most 1/(tp x cp) of one device's cache bytes per rank (+ one row per layer)."""
    for rank, result in enumerate(r["cp decode"] for r in WORLD2.result()):
        assert name in result, (rank, result.keys())
        _check_cp_decode({**result[name], "rank": rank})


CP_DECODE_BESIDE_TP = [({"tp": 2, "ring": 2}, "llama"), ({"tp": 2, "ring": 2}, "falcon_multi_query")]
"""``cp_decode``'s runs at world 4."""
WORLD4_RUNS = [f"decode {family} {sizes}" for sizes, family in CP_DECODE_BESIDE_TP] + ["generate", "generate dp"]
WORLD4 = in_background(run_ranks_together, 4, tiers.running({
    # Mistral's window under cp: at world 2 (ring); under tp: decode_plans. The cp decode graphs are
    # traced through AOTAutograd at world 2; beside tp they run as they are (CI time).
    "decode": (cp_decode, {"runs": tiers.running(CP_DECODE_BESIDE_TP, SWEPT, key=lambda run: f"decode {run[1]} {run[0]}"),
                           "inner_backend": "eager"}),
    "generate": (decorated_generate, {"tp": 2, "ulysses": 2}),
    "generate dp": (decorated_generate, {"dp_replicate": 2, "ring": 2, "batch": 2})}, SWEPT))


@pytest.mark.parametrize("run", [tiers.case(run, sweep=run in SWEPT) for run in WORLD4_RUNS])
def test_decode_at_tp_x_ring_and_decorated_generate_under_cp(run):
    """tp=2 x ring=2 decode (Llama, and Falcon-7B's multi-query fused qkv, whose one key and value
    head every tp rank holds whole: gathered as they are split off, in prefill and decode alike,
    so the cache is cut over cp only); the decorator's ``generate`` with a cp prefill and cp
    decode, also with two prompts cut over dp_replicate=2 beside ring=2."""
    for rank, result in enumerate(WORLD4.result()):
        if run.startswith("decode "):
            decoded = {**result["decode"][run.removeprefix("decode ")], "rank": rank}
            if "falcon_multi_query" in run:
                assert decoded["held"] * decoded["cp"] == decoded["whole"], decoded
                decoded["ranks"] = decoded["cp"]
            _check_cp_decode(decoded)
        else:
            _check_decorated_generate({**result[run], "rank": rank})


def _compiled_forward(model: nn.Module, backend) -> nn.Module:
    """transformers' advice for ``generate``: compile ``forward``, call the module."""
    model.forward = torch.compile(model.forward, backend=backend)
    return model


def _compiled_in_place(model: nn.Module, backend) -> nn.Module:
    model.compile(backend=backend)
    return model


def _generate(model: nn.Module, ids: torch.Tensor) -> tuple[list, int]:
    """``model.generate`` (greedy, 16 new tokens, a DynamicCache): its tokens and the plans it made."""
    with logged(logging.INFO) as records:
        tokens = model.generate(ids, **GREEDY).tolist()
    return tokens, sum("hybrid_parallel: planned graph" in r.getMessage() for r in records)


def generate_entry_points(rank: int, world: int) -> dict:
    """``generate`` through each entry point, on a fresh copy of one model: whether it gives one
    device's tokens, and whether it planned (no plan: the plain forward ran). ``torch.compile(model)``
    generates twice (the second plans nothing) and leaves ``model`` itself uncompiled. The local
    graphs run as they are (``eager``): what differs between entry points is before them."""
    torch._dynamo.reset()  # the compiles of the cases before would count towards Dynamo's recompile limit
    _, reference, ids = _tiny_llama()
    mesh = dtensor_par.init_mesh(tp=world)
    expected = reference.generate(ids, **GREEDY).tolist()

    def backend():
        return dtensor_par.hybrid_parallel(mesh, inner_backend="eager")

    results = {}
    compiled = torch.compile(copy.deepcopy(reference), backend=backend())
    for name in ("torch.compile(model).generate", "torch.compile(model).generate, again"):
        tokens, plans = _generate(compiled, ids)
        results[name] = {"same tokens": tokens == expected, "planned": plans > 0}
    results["model left uncompiled"] = compiled._orig_mod._compiled_call_impl is None
    entry_points = {  # parallelize resets Dynamo's caches: after the compiled module's second generate
        "compiled forward": _compiled_forward,
        "model.compile()": _compiled_in_place,
        "parallelize + compiled forward": lambda m, b: _compiled_forward(dtensor_par.parallelize(m, mesh, (ids,)), b),
    }
    for name, entry_point in entry_points.items():
        tokens, plans = _generate(entry_point(copy.deepcopy(reference), backend()), ids)
        results[name] = {"same tokens": tokens == expected, "planned": plans > 0}
    return results


ENTRY_POINTS = ["torch.compile(model).generate", "torch.compile(model).generate, again", "model left uncompiled",
                "compiled forward", "model.compile()", "parallelize + compiled forward"]
"""What ``generate_entry_points`` returns, by entry point."""


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_every_generate_entry_point_gives_one_devices_tokens(entry):
    for rank, result in enumerate(r["entry points"] for r in WORLD2.result()):
        assert set(result) == set(ENTRY_POINTS), result.keys()
        if entry == "model left uncompiled":
            assert result[entry], (rank, result)
        elif entry == "torch.compile(model).generate, again":
            assert result[entry] == {"same tokens": True, "planned": False}, (rank, result)
        else:
            assert result[entry] == {"same tokens": True, "planned": True}, (rank, result)
