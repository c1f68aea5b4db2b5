"""Context parallelism (Ulysses x ring) with TP on gloo ranks: exact against one device."""

from __future__ import annotations

import pytest

from tests.background import in_background
from tests.cases import run_labelled_cases

PAIRS = {
    "tp2-ring2": dict(mesh_sizes={"tp": 2, "ring": 2}, traced=["llama_gqa_rope", "additive_mask", "gated_delta_rule",
                                                                "state_space_scan"],
                      names=["gpt_fused_qkv", "llama_gqa_rope", "additive_mask", "conv1d", "joint_attention",
                             "flatten_tokens", "causal_mask_in_a_buffer", "torch_encoder", "small_unet",
                             "gated_delta_rule", "state_space_scan", "selective_scan"]),
    # conv1d and flatten_tokens plan alike over ulysses: once, at tp2-ring2 (CI time).
    # Repeated kv heads run as enable_gqa: 4 kv heads split over tp x ulysses as they are; 2
    # (llama_gqa_rope) are each repeated twice first, the fewest that split.
    "tp2-ulysses2": dict(mesh_sizes={"tp": 2, "ulysses": 2}, traced=["llama_gqa_rope", "uneven_heads_14",
                                                                      "complex_rope_pad"], names=[
        "llama_enable_gqa", "llama_repeat_interleave_kv4", "llama_gqa_rope", "uneven_heads_14", "bool_mask",
        "joint_attention", "complex_rope_pad", "qk_norm_across_heads", "looped_experts", "temporal_conv",
        "gated_head_norm", "state_space_scan_groups_2"]),
    # Sequence length 30 in 8 chunks (zigzag over ring=2, split by ulysses=2): padded to 32.
    "ring2-ulysses2": dict(mesh_sizes={"ring": 2, "ulysses": 2}, traced=["uneven_seq_30", "uneven_seq_30_masked",
                                                                        "running_positions",
                                                                        "gated_delta_rule_uneven_30",
                                                                        "state_space_scan_uneven_30"],
                           names=["keyword_sdpa_scale", "uneven_seq_30", "uneven_seq_30_masked",
                                  "uneven_seq_30_bidirectional", "uneven_seq_30_pooling", "mean_loss",
                                  "joint_attention_masked", "rows_hidden_by_an_input", "joint_before_projection",
                                  "folded_heads_attention", "window_mask_in_a_buffer", "running_positions",
                                  "class_token", "small_unet", "gated_delta_rule_uneven_30",
                                  "state_space_scan_uneven_30", "selective_scan_uneven_30"]),
}
ONE_GRAPH = {"capture_dynamic_output_shape_ops": True}
"""Dynamo's option under which a loop over an nn.ModuleList's experts is one graph (``passes.expert_loop``)."""
"""Each pair of mesh dims at world 4: label -> the mesh, the cases, and those ``traced`` through
AOTAutograd (``aot_eager``): the ones whose local graphs hold the inserted ops of the pair (the
ring's and Ulysses' autograd, padded heads, a padded zigzag sequence, a mask cut per ring
block). The others differ from them in planning only and run their local graphs as they are
(``eager``): AOT's trace is most of a case's time (CI time)."""


def _pair_runs(label: str, mesh_sizes: dict, traced: list[str], names: list[str]) -> dict:
    """A pair's two runs: its traced cases through ``aot_eager``, the others ``eager``."""
    return {label: dict(mesh_sizes=mesh_sizes, names=traced, steps=1),
            f"{label} eager": dict(mesh_sizes=mesh_sizes, names=[n for n in names if n not in traced], steps=1,
                                   options={"inner_backend": "eager"})}


RUNS = {
    4: {**{label: run for pair, spec in PAIRS.items() for label, run in _pair_runs(pair, **spec).items()},
        # An nn.ModuleList's experts looped over in one graph beside attention, with ep='cp': each expert's
        # features cut over tp, the tokens' rows over ring, each expert's weights held cut over ring along the dim
        # tp does not cut and sent whole to the rank computing that expert.
        "tp2-ring2 experts in one graph": dict(mesh_sizes={"tp": 2, "ring": 2}, names=["looped_moe_block"], steps=1,
                                               dynamo_config=ONE_GRAPH, options={"ep": "cp"})},
    # Default order (ring, ulysses, tp) is covered at world 4; here ulysses sits outside ring,
    # so the flattened sequence group's rank order differs from its chunk order. The masked
    # case has a per-head mask split by tp, then ulysses, over a padded sequence. The order
    # changes the groups, not the local graphs' ops: they run as they are.
    8: {"non_default_order": dict(names=["gpt_fused_qkv", "uneven_seq_30_masked"], steps=1,
                                  mesh_sizes={"tp": 2, "ring": 2, "ulysses": 2}, order=("tp", "ulysses", "ring"),
                                  options={"inner_backend": "eager"})},
    # Parameter gradients in many small buckets (1 KiB), each waited for late in backward
    # (aot_eager's backward through passes.overlap.sink_waits): still exact.
    2: {"small_buckets": dict(names=["llama_gqa_rope_2_layers"], options={"grad_bucket_mb": 2**-10}, steps=2,
                              mesh_sizes={"ulysses": 2}),
        # An nn.ModuleList's experts looped over in one graph beside attention, without ep: each rank runs its
        # tokens' rows through every expert.
        "looped_experts_ulysses2": dict(names=["looped_moe_block"], steps=1, mesh_sizes={"ulysses": 2},
                                        dynamo_config=ONE_GRAPH)},
}
"""World size -> label -> ``run_cases``' keyword arguments; each world's runs share one launch."""
LAUNCHES = {world: in_background(run_labelled_cases, world, runs) for world, runs in RUNS.items()}


@pytest.mark.parametrize("pair", PAIRS)
def test_each_pair_of_mesh_dims_at_world_4(pair):
    launched = LAUNCHES[4].result()
    result = {**launched[pair], **launched[f"{pair} eager"]}
    assert set(result) == set(PAIRS[pair]["names"]), result.keys()
    for name, metrics in result.items():
        # Masked attention runs as hybrid attention too, never gathered.
        assert not any("gathered" in w and "attention" in w for w in metrics["warnings"]), (name, metrics)
        padded = any("sequence length 30 does not divide into 8 equal chunks" in w for w in metrics["warnings"])
        assert padded == name.startswith("uneven_seq_30"), (name, metrics["warnings"])
    if "uneven_heads_14" in result:
        assert any("padded to 8 heads" in w for w in result["uneven_heads_14"]["warnings"])
    if "rows_hidden_by_an_input" in result:  # as written (hybrid attention gave these rows NaN or 0.25 off)
        assert any("it may hide a query row entirely" in w for w in result["rows_hidden_by_an_input"]["warnings"])
    if "mean_loss" in result:  # means over the even sequence shards: partial sums, nothing gathered
        assert not any("gathered" in w for w in result["mean_loss"]["warnings"]), result["mean_loss"]
    if "uneven_seq_30_pooling" in result:
        gathered = " ".join(result["uneven_seq_30_pooling"]["warnings"])
        for op in ("conv1d", "mean"):
            assert op in gathered and "'cp'" in gathered, (op, gathered)
        assert "getitem" not in gathered, gathered  # the last token: picked by its rank, the others add zeros
        assert "cumsum" not in gathered, gathered  # each rank's runs summed, the totals before them added
    if "temporal_conv" in result:  # the MLP's sum reduced before the convolution over frames: not a fallback
        assert result["temporal_conv"]["warnings"] == [], result["temporal_conv"]
    if "gated_head_norm" in result:  # heads flattened with the rows for a norm: run unflattened, nothing gathered
        assert result["gated_head_norm"]["warnings"] == [], result["gated_head_norm"]
    if "small_unet" in result:  # group norms, a stride-2 convolution and nearest upsampling over rows cut
        assert result["small_unet"]["warnings"] == [], result["small_unet"]
    if "running_positions" in result:  # position ids and a running mean summed along the sequence cut over cp
        assert result["running_positions"]["warnings"] == [], result["running_positions"]
    # float64: exact to its rounding, each rank's rows run from the state the rows before leave (the padding's leave
    # it as it is), nothing gathered
    for name in ("gated_delta_rule", "gated_delta_rule_uneven_30", "state_space_scan", "state_space_scan_groups_2",
                 "state_space_scan_uneven_30", "selective_scan", "selective_scan_uneven_30"):
        if name in result:
            case = result[name]
            assert case["forward_abs"] <= 1e-12 and case["grad_rel"] <= 1e-12 and case["warnings"] == [], case


def test_tp_ring_ulysses_at_world_8_in_a_non_default_order():
    assert LAUNCHES[8].result()["non_default_order"]


def test_small_gradient_buckets_at_world_2():
    assert LAUNCHES[2].result()["small_buckets"]


def test_a_loop_over_experts_in_one_graph_beside_attention_matches_single_device():
    """At tp2 x ring2 with ``ep='cp'`` and at ulysses2 without, with no warning."""
    assert LAUNCHES[4].result()["tp2-ring2 experts in one graph"]["looped_moe_block"]["warnings"] == []
    assert LAUNCHES[2].result()["looped_experts_ulysses2"]["looped_moe_block"]["warnings"] == []
