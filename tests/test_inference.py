"""Inference as users run it: planning never runs the model (no side effect twice), and
``generate()`` through every entry point gives one device's tokens."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.nn as nn

import dtensor_par
from tests import models
from tests.harness import FORWARD_ATOL, logged, run_ranks

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


def _run(block: nn.Module, reference: nn.Module, call, sizes: list[int]) -> float:
    """Call ``call`` and the one-device ``reference`` on inputs of each sequence length; the
    largest difference. Afterwards the block's state must equal the reference's."""
    worst = 0.0
    for seq in sizes:
        x = torch.randn(2, seq, 32)
        worst = max(worst, (call(x) - reference(x)).abs().max().item())
    assert _state(block) == _state(reference), (_state(block), _state(reference))
    return worst


def side_effects_once(rank: int, world: int) -> dict:
    """Every entry point, each from a fresh block: its state after the calls equals one device's."""
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
    assert _state(block) == {"calls": 0, "seen": [], "steps": 0.0}, _state(block)
    return diffs


def test_planning_runs_no_side_effect_twice():
    for diffs in run_ranks(2, side_effects_once):
        assert all(d <= FORWARD_ATOL for d in diffs.values()), diffs


GREEDY = {"max_new_tokens": 16, "do_sample": False, "pad_token_id": 0}


def _tiny_llama():
    """A 2-layer transformers Llama (GQA: 8 heads, 4 kv heads), its config and a prompt of 8 tokens."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=4)
    return config, LlamaForCausalLM(config).eval(), torch.randint(0, 128, (1, 8))


def decorated_generate(rank: int, world: int) -> dict:
    """``parallel(tp=2)(LlamaForCausalLM)``: ``generate`` as the first call (greedy, 16 new
    tokens, a DynamicCache), and a prefill's cache length, against one device."""
    from transformers import DynamicCache, LlamaForCausalLM

    config, reference, ids = _tiny_llama()
    Parallel = dtensor_par.parallel(tp=world, inner_backend="aot_eager")(LlamaForCausalLM)
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


def test_decorated_transformers_llama_generates_one_devices_tokens():
    for result in run_ranks(2, decorated_generate):
        assert result["tokens"] == result["expected"], result
        assert len(result["tokens"][0]) == 8 + 16, result
        assert result["cache"] == result["expected_cache"] == 8, result
        assert result["logits"] <= FORWARD_ATOL, result


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
    generates twice (the second plans nothing) and leaves ``model`` itself uncompiled."""
    _, reference, ids = _tiny_llama()
    mesh = dtensor_par.init_mesh(tp=world)
    expected = reference.generate(ids, **GREEDY).tolist()

    def backend():
        return dtensor_par.hybrid_parallel(mesh, inner_backend="aot_eager")

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


def test_every_generate_entry_point_gives_one_devices_tokens():
    for result in run_ranks(2, generate_entry_points):
        assert result.pop("model left uncompiled"), result
        assert result.pop("torch.compile(model).generate, again") == {"same tokens": True, "planned": False}, result
        assert all(outcome == {"same tokens": True, "planned": True} for outcome in result.values()), result
