"""Tensor parallelism on gloo ranks: forward and every gradient equal the single-device run."""

from __future__ import annotations

import pytest
import torch

from tests.cases import run_cases
from tests.harness import FORWARD_ATOL, GRAD_RTOL, run_ranks


def _check(results: list[dict]) -> dict:
    first = results[0]
    for rank_result in results:
        for name, metrics in rank_result.items():
            assert metrics["forward_abs"] <= FORWARD_ATOL and metrics["grad_rel"] <= GRAD_RTOL, (name, metrics)
    return first


TP_CASES = ["gpt_fused_qkv", "llama_gqa_rope", "llama_enable_gqa", "graph_break", "odd_mlp_width", "unshardable_op"]


@pytest.mark.parametrize("world", [2, 4])
def test_tensor_parallel_matches_single_device(world):
    """Two optimizer steps at world 2 (the second runs on re-sliced weight shards); one at 4."""
    result = _check(run_ranks(world, run_cases, TP_CASES, {}, 2 if world == 2 else 1))
    assert set(result) == set(TP_CASES)
    if world == 4:
        assert any("fc" in w and "18" in w and "replicated" in w for w in result["odd_mlp_width"]["warnings"])
        assert any("2 kv heads" in w and "k_proj" in w for w in result["llama_gqa_rope"]["warnings"])
    else:
        assert result["odd_mlp_width"]["warnings"] == []


@pytest.mark.parametrize("world, cases", [(2, ["gpt_fused_qkv", "llama_gqa_rope"]), (4, ["gpt_fused_qkv"])])
def test_sequence_parallel_matches_single_device(world, cases):
    _check(run_ranks(world, run_cases, cases, {"sequence_parallel": True}))


def test_inductor_matches_single_device():
    _check(run_ranks(2, run_cases, ["gpt_fused_qkv"], {"inner_backend": "inductor"}, 1))


@pytest.mark.parametrize("dynamic", [None, True])
def test_new_batch_and_sequence_sizes_stay_correct(dynamic):
    """Automatic dynamic shapes recompile with symbolic sizes; ``dynamic=True`` also lifts
    float attributes to inputs. Each size is planned on its own."""
    shapes = [(2, 8, 32), (3, 8, 32), (3, 12, 32), (3, 12, 32), (1, 4, 32)]
    inputs = [(torch.randn(*s),) for s in shapes]
    _check(run_ranks(2, run_cases, ["gpt_fused_qkv"], {}, 1, inputs, False, dynamic))


def test_local_output_is_dtensor_of_the_same_values():
    _check(run_ranks(2, run_cases, ["gpt_fused_qkv"], {"output": "local", "sequence_parallel": True}, 1,
                     None, True))
