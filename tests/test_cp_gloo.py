"""Context parallelism (Ulysses x ring) with TP on gloo ranks: exact against one device."""

from __future__ import annotations

import pytest

from tests.cases import run_cases
from tests.harness import FORWARD_ATOL, GRAD_RTOL, run_ranks


def _check(results: list[dict]) -> dict:
    for rank_result in results:
        for name, metrics in rank_result.items():
            assert metrics["forward_abs"] <= FORWARD_ATOL and metrics["grad_rel"] <= GRAD_RTOL, (name, metrics)
    return results[0]


@pytest.mark.parametrize("sizes, cases", [
    ({"tp": 2, "ring": 2}, ["gpt_fused_qkv", "llama_gqa_rope"]),
    ({"tp": 2, "ulysses": 2}, ["llama_enable_gqa", "uneven_heads_14"]),
    ({"ring": 2, "ulysses": 2}, ["gpt_fused_qkv", "sequence_mixing", "keyword_sdpa_scale"]),
], ids=["tp2-ring2", "tp2-ulysses2", "ring2-ulysses2"])
def test_each_pair_of_mesh_dims_at_world_4(sizes, cases):
    result = _check(run_ranks(4, run_cases, cases, {}, 1, None, False, None, sizes))
    if "uneven_heads_14" in result:
        assert any("padded to 8 heads" in w for w in result["uneven_heads_14"]["warnings"])
    if "sequence_mixing" in result:
        gathered = " ".join(result["sequence_mixing"]["warnings"])
        assert "mean" in gathered and "getitem" in gathered and "'cp'" in gathered


def test_tp_ring_ulysses_at_world_8_in_a_non_default_order():
    """Default order (ring, ulysses, tp) is covered at world 4; here ulysses sits outside ring,
    so the flattened sequence group's rank order differs from its chunk order."""
    _check(run_ranks(8, run_cases, ["gpt_fused_qkv", "llama_gqa_rope"], {}, 1, None, False, None,
                     {"tp": 2, "ring": 2, "ulysses": 2}, ("tp", "ulysses", "ring")))
