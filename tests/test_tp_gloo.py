"""Tensor parallelism on gloo ranks: forward and every gradient equal the single-device run."""

from __future__ import annotations

import pytest
import torch

from tests import tiers
from tests.background import in_background
from tests.cases import case_matches, labelled_cases, run_labelled_cases

TP_CASES = ["gpt_fused_qkv", "parts_first_qkv", "llama_gqa_rope", "llama_enable_gqa", "graph_break", "odd_mlp_width",
            "unshardable_op"]
SEQUENCE_PARALLEL = {"sequence_parallel": True}
# New batch and sequence sizes: automatic dynamic shapes recompile with symbolic sizes.
NEW_SIZES = [(torch.randn(*s),) for s in [(2, 8, 32), (3, 8, 32), (3, 12, 32), (3, 12, 32), (1, 4, 32)]]

RUNS = {
    # Two optimizer steps at world 2 (the second runs on re-sliced weight shards); one at 4.
    # Experts in an nn.ModuleList looped over (each expert's MLP a graph of its own) at world 2 only: CI time;
    # captured in one graph under Dynamo's capture_dynamic_output_shape_ops, each expert's features cut.
    2: {"tp": dict(names=TP_CASES + ["looped_experts", "folded_heads_attention", "linear_attention_conv",
                                     "fused_attention_mlp", "torch_encoder"], steps=2),
        "experts_in_one_graph": dict(names=["looped_experts", "looped_moe_block", "masked_loop_experts"], steps=2,
                                     dynamo_config={"capture_dynamic_output_shape_ops": True}),
        "experts_in_one_graph new sizes": dict(names=["looped_moe_block"], steps=1, inputs=NEW_SIZES[:3],
                                               dynamo_config={"capture_dynamic_output_shape_ops": True}),
        "sequence_parallel": dict(names=["gpt_fused_qkv", "llama_gqa_rope"], options=SEQUENCE_PARALLEL),
        "inductor": dict(names=["gpt_fused_qkv"], options={"inner_backend": "inductor"}, steps=1),
        "dynamic=None": dict(names=["gpt_fused_qkv"], steps=1, inputs=NEW_SIZES),
        "dynamic=True": dict(names=["gpt_fused_qkv"], steps=1, inputs=NEW_SIZES, dynamic=True),
        "local_output": dict(names=["gpt_fused_qkv"], options={"output": "local", **SEQUENCE_PARALLEL}, steps=1,
                             full_tensor=True)},
    # At 4 ranks the cases differ from 2 in their sizes only, which planning reads: their local graphs run as they are.
    4: {"tp": dict(names=TP_CASES, steps=1, options={"inner_backend": "eager"}),
        "sequence_parallel": dict(names=["gpt_fused_qkv"], options=SEQUENCE_PARALLEL)},
}
"""World size -> label -> ``run_cases``' keyword arguments; each world's runs share one launch."""
SWEPT = {(4, "tp"), (4, "sequence_parallel"), (2, "experts_in_one_graph new sizes"), (2, "dynamic=True")}
"""(world, run) ``tests.tiers`` leaves to ``--sweep``: world 4 plans as world 2 does at other
sizes; symbolic sizes run at world 2 under automatic dynamic shapes and in test_dynamic_shapes."""
LAUNCHES = {world: in_background(run_labelled_cases, world, kept) for world, runs in RUNS.items()
            if (kept := tiers.running(runs, SWEPT, key=lambda label: (world, label)))}


def _cases(*labels: str) -> list:
    """``labelled_cases`` of ``labels`` for parametrize, as ``(world, label, name)``, each repeat marked."""
    return [tiers.case(world, label, name, sweep=(world, label) in SWEPT)
            for world, label, name in labelled_cases(RUNS, *labels)]


def _case(world: int, label: str, name: str) -> dict:
    """Case ``name`` of run ``label`` within the tolerances on every rank; rank 0's metrics."""
    return case_matches(LAUNCHES[world], world, label, name)


@pytest.mark.parametrize("world, label, name", _cases("tp"))
def test_tensor_parallel_matches_single_device(world, label, name):
    warnings = _case(world, label, name)["warnings"]
    if name == "odd_mlp_width" and world == 4:
        assert any("fc" in w and "18" in w and "replicated" in w for w in warnings), warnings
    if name == "llama_gqa_rope" and world == 4:
        assert any("2 kv heads" in w and "k_proj" in w for w in warnings), warnings
    if name == "looped_experts":  # the loop's torch.where breaks the graph: the router runs whole between graphs
        breaks = [w for w in warnings if "Dynamo broke the graph" in w]
        assert len(breaks) == 1 and "nonzero" in breaks[0] and "capture_dynamic_output_shape_ops = True" in breaks[0]
    if name == "graph_break":
        assert [w for w in warnings if "Dynamo broke the graph" in w], warnings
    # parts_first_qkv: its 12 heads read as heads, not as 3 kv heads; fused_attention_mlp: its parts cut where they
    # are split off; torch_encoder: nn.MultiheadAttention written out, attention sites
    if name in ("parts_first_qkv", "linear_attention_conv", "fused_attention_mlp", "torch_encoder") or (
            name == "odd_mlp_width" and world == 2):
        assert warnings == [], warnings


@pytest.mark.parametrize("world, label, name", _cases("sequence_parallel"))
def test_sequence_parallel_matches_single_device(world, label, name):
    _case(world, label, name)


@pytest.mark.parametrize("name", RUNS[2]["inductor"]["names"])
def test_inductor_matches_single_device(name):
    _case(2, "inductor", name)


@pytest.mark.parametrize("world, label, name", _cases("dynamic=None", "dynamic=True"))
def test_new_batch_and_sequence_sizes_stay_correct(world, label, name):
    """Automatic dynamic shapes recompile with symbolic sizes; ``dynamic=True`` also lifts
    float attributes to inputs. Each size is planned on its own."""
    _case(world, label, name)


@pytest.mark.parametrize("name", RUNS[2]["local_output"]["names"])
def test_local_output_is_dtensor_of_the_same_values(name):
    _case(2, "local_output", name)


@pytest.mark.parametrize("world, label, name", _cases("experts_in_one_graph", "experts_in_one_graph new sizes"))
def test_a_loop_over_experts_in_one_graph_matches_single_device(world, label, name):
    """Each expert's w1 and w3 colwise, w2 rowwise (``passes.expert_loop``), with no warning: nothing
    runs whole between graphs; at new batch and sequence sizes too (symbolic token counts)."""
    warnings = _case(world, label, name)["warnings"]
    assert warnings == [], warnings
