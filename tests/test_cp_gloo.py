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
    ({"tp": 2, "ring": 2}, ["gpt_fused_qkv", "llama_gqa_rope", "additive_mask", "conv1d", "joint_attention",
                            "flatten_tokens"]),
    # Repeated kv heads run as enable_gqa: 4 kv heads split over tp x ulysses as they are; 2
    # (llama_gqa_rope) are each repeated twice first, the fewest that split.
    ({"tp": 2, "ulysses": 2}, ["llama_enable_gqa", "llama_repeat_interleave_kv4", "llama_gqa_rope",
                               "uneven_heads_14", "bool_mask", "conv1d", "joint_attention", "complex_rope_pad",
                               "qk_norm_across_heads", "flatten_tokens"]),
    # Sequence length 30 in 8 chunks (zigzag over ring=2, split by ulysses=2): padded to 32.
    ({"ring": 2, "ulysses": 2}, ["keyword_sdpa_scale", "uneven_seq_30", "uneven_seq_30_masked",
                                 "uneven_seq_30_bidirectional", "uneven_seq_30_pooling", "mean_loss"]),
], ids=["tp2-ring2", "tp2-ulysses2", "ring2-ulysses2"])
def test_each_pair_of_mesh_dims_at_world_4(sizes, cases):
    result = _check(run_ranks(4, run_cases, cases, {}, 1, None, False, None, sizes))
    for name, metrics in result.items():
        # Masked attention runs as hybrid attention too, never gathered.
        assert not any("gathered" in w and "attention" in w for w in metrics["warnings"]), (name, metrics)
        padded = any("sequence length 30 does not divide into 8 equal chunks" in w for w in metrics["warnings"])
        assert padded == name.startswith("uneven_seq_30"), (name, metrics["warnings"])
    if "uneven_heads_14" in result:
        assert any("padded to 8 heads" in w for w in result["uneven_heads_14"]["warnings"])
    if "mean_loss" in result:  # means over the even sequence shards: partial sums, nothing gathered
        assert not any("gathered" in w for w in result["mean_loss"]["warnings"]), result["mean_loss"]
    if "uneven_seq_30_pooling" in result:
        gathered = " ".join(result["uneven_seq_30_pooling"]["warnings"])
        for op in ("conv1d", "cumsum", "mean", "getitem"):
            assert op in gathered and "'cp'" in gathered, (op, gathered)


def test_tp_ring_ulysses_at_world_8_in_a_non_default_order():
    """Default order (ring, ulysses, tp) is covered at world 4; here ulysses sits outside ring,
    so the flattened sequence group's rank order differs from its chunk order. The masked
    case has a per-head mask split by tp, then ulysses, over a padded sequence."""
    _check(run_ranks(8, run_cases, ["gpt_fused_qkv", "uneven_seq_30_masked"], {}, 1, None, False, None,
                     {"tp": 2, "ring": 2, "ulysses": 2}, ("tp", "ulysses", "ring")))


def test_small_gradient_buckets_at_world_2():
    """Parameter gradients in many small buckets (1 KiB), each waited for late in backward
    (aot_eager's backward through passes.overlap.sink_waits): still exact."""
    _check(run_ranks(2, run_cases, ["llama_gqa_rope"], {"grad_bucket_mb": 2**-10}, 2, None, False, None,
                     {"ulysses": 2}))
