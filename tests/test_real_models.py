"""Real models (transformers, diffusers) from small configs: every attention and MLP parallel,
no fallback gathers, exact against one device. Needs the ``models`` extra."""

from __future__ import annotations

import copy
import logging
import sys
from collections import Counter

import pytest
import torch

import dtensor_par
from dtensor_par.passes.meta import global_shape, placements, shardings
from dtensor_par.passes.nodes import tensor_inputs
from dtensor_par.placements import Replicate, Shard
from dtensor_par._testing.harness import FORWARD_ATOL, GRAD_RTOL, logged, loss_of, max_rel, run_ranks_together
from tests import tiers
from tests.background import in_background

pytest.importorskip("transformers", reason="the models extra (pip install -e '.[models]') is not installed")
pytest.importorskip("diffusers", reason="the models extra (pip install -e '.[models]') is not installed")

from dtensor_par._testing import real_models  # noqa: E402
from tests import xm_gloo  # noqa: E402

MODELS = ["llama", "gpt2", "qwen2", "mistral", "flux"]
BACKWARD = {"llama", "gemma2", "flux", "mistral_padded", "wan", "sd3", "bloom", "t5", "falcon", "mixtral", "mixtral_batched_mm",
            "mixtral_aux", "qwen2_moe", "deepseek_v3", "gemma2_left_padded", "t5_padded", "mixtral_eager", "gpt_oss",
            "mpt", "apertus", "llama4", "falcon_multi_query", "gpt_bigcode", "cogview4", "sana", "phimoe",
            "hidream", "flux2", "qwen3_next", "qwen3_5", "diffllama", "unet", "lfm2", "granite_hybrid", "jamba",
            "granite_swa", "mimo_v2_flash"}
GRAD_RTOL_OF = {"qwen3_5": 1e-3}
"""Qwen3.5's decay parameters (A_log, dt_bias, the projection of a) get gradients summed over
every position through the recurrence's cumulative gates, which rounding moves far: one device's
own move 2.8e-4 relative when its chunks are 16 rows long instead of 64 (measured). Over cp the
chunks start at each rank's runs, a change of that kind (3.2e-4 at tp2-ring2; every other
parameter within 1e-6). The state passing itself is exact in float64 (test_cp_gloo, cases
gated_delta_rule)."""
MESHES = {"tp2-ulysses2": {"tp": 2, "ulysses": 2}, "tp2-ring2": {"tp": 2, "ring": 2}}
# transformers repeats kv heads to the query heads before SDPA (repeat_kv); attention runs on
# the model's own kv heads (canonicalize), so Ulysses and the ring send each once.
KV_HEADS = {"llama": 4, "qwen2": 2, "mistral": 4, "mistral_padded": 4, "modernbert": 8}


EXPLAINED = [(name, "tp2-ulysses2") for name in MODELS + ["mistral_padded", "phi3", "wan", "sd3", "gemma2", "bloom",
                                                          "t5", "mixtral", "mixtral_batched_mm", "qwen2_moe",
                                                          "deepseek_v3_published", "gpt_oss",
                                                          "gptj", "bert", "modernbert", "mpt", "apertus", "llama4",
                                                          "falcon_multi_query", "gpt_bigcode", "cogview4", "sana",
                                                          "phimoe", "hidream", "ltx", "flux2"]]
# At tp2-ring2 the models whose attention the ring runs otherwise than Llama's (CI time: the others plan alike).
EXPLAINED += [(name, "tp2-ring2") for name in ["llama", "mistral_padded", "flux", "wan", "gemma2", "bloom", "t5",
                                               "mixtral", "qwen2_moe", "deepseek_v3_published", "gpt_oss", "bert",
                                               "modernbert", "mpt", "llama4", "falcon_multi_query", "gpt_bigcode",
                                               "cogview4", "sana", "phimoe", "hidream", "ltx", "flux2",
                                               "granite_swa", "mimo_v2_flash"]]


@pytest.mark.parametrize("name, mesh", [(name, MESHES[mesh]) for name, mesh in EXPLAINED],
                         ids=[f"{name}-{mesh}" for name, mesh in EXPLAINED])
def test_every_block_runs_sharded_without_fallback_gathers(name, mesh):
    report = real_models.explained(name, tuple(mesh.items()))
    for graph in report.graphs:
        cov = graph.coverage
        assert cov.fallback_gathers == [], cov.fallback_gathers
        assert cov.sharded_block_linear_flops >= 0.95 * cov.block_linear_flops > 0, cov.summary()
        assert cov.parallel_sites == len(graph.sites), cov.summary()
        if name == "wan" and mesh.get("ring"):  # its unpatchify views the zigzag sequence apart: the output's gather
            assert [g.split(":")[0] for g in cov.output_gathers] == ["hidden_states_23 on 'cp'"], cov.output_gathers
        if name in KV_HEADS:
            attention = [site for site in graph.sites if site.startswith("attention")]
            assert attention and all(f"8 heads, {KV_HEADS[name]} kv heads" in site for site in attention), attention


def compare_models(rank: int, world: int, *, sizes: dict, names: list[str], options: dict | None = None) -> dict:
    """Each model against one device: forward, and every gradient where asked; ``options`` of
    ``hybrid_parallel``."""
    logging.getLogger("transformers").setLevel(logging.ERROR)
    mesh = dtensor_par.init_mesh(**sizes)
    results = {}
    for name in names:
        torch._dynamo.reset()
        torch.manual_seed(0)
        model, args, kwargs = real_models.FACTORIES[name]()
        reference = copy.deepcopy(model)
        # The local graphs run as they are ("eager"): AOT tracing is covered by the other suites,
        # and skipping it keeps 8 ranks x 5 models within CI's time on 2 cores.
        compiled = torch.compile(model, backend=dtensor_par.hybrid_parallel(mesh, inner_backend="eager",
                                                                            **(options or {})))
        one_graph = name in real_models.ONE_GRAPH
        with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=one_graph), logged(logging.WARNING) as records:
            out = compiled(*args, **kwargs)[0]
        expected = reference(*args, **kwargs)[0]
        result = {"forward": (out - expected).abs().max().item(), "warnings": [r.getMessage() for r in records]}
        if name in BACKWARD:
            loss_of(out).backward()
            loss_of(expected).backward()
            result["grad"] = max(max_rel(p.grad, q.grad) for p, q in zip(model.parameters(), reference.parameters())
                                 if q.grad is not None)
        results[name] = result
    return results


def compare_models_over_xm(rank: int, world: int, **kwargs) -> dict:
    """``compare_models`` with the xm stand-in in place of torch_xla's (``collectives="xla"``)."""
    xm_gloo.install()
    return compare_models(rank, world, **kwargs)


def decorated_llama(rank: int, world: int) -> dict:
    """``parallel(tp=2)(LlamaForCausalLM)``: a third-party class, loaded with a full state dict
    before its first call, called with keywords as transformers models are; its embedding tied
    to the LM head (``real_models.llama``) and untied. The pieces each rank holds of q_proj, the
    token table and the LM head, and whether they stay tied."""
    from transformers import LlamaForCausalLM

    results = {}
    for tied in (True, False):
        torch._dynamo.reset()
        torch.manual_seed(0)
        reference, args, kwargs = real_models.llama()
        if not tied:
            reference.config.tie_word_embeddings = False
            reference = LlamaForCausalLM(reference.config)
        model = dtensor_par.parallel(tp=2, inner_backend="eager")(LlamaForCausalLM)(reference.config)
        model.load_state_dict(reference.state_dict())
        out = model(input_ids=args[0], **kwargs)[0]
        expected = reference(input_ids=args[0], **kwargs)[0]
        loss_of(out).backward()
        loss_of(expected).backward()
        q = model.model.layers[0].self_attn.q_proj.weight
        table, head = model.model.embed_tokens.weight, model.lm_head.weight
        results["tied" if tied else "untied"] = {
            "forward": (out - expected).abs().max().item(), "local_rows": q.to_local().shape[0],
            "table": list(table.to_local().shape), "head": list(head.to_local().shape), "tied": head is table,
            "grad": max(max_rel(p.grad.full_tensor(), r.grad) for p, r in zip(model.parameters(),
                                                                               reference.parameters()))}
    return results


RUNS = {
    # diffusers' in-graph tokens: once, on tp2-ulysses2; a window and key padding as ring blocks.
    # gemma2's attention is written out (soft-capping): tp shards its heads, cp runs it as hybrid attention with
    # its score function, at both meshes (Ulysses' ring of one, and ring blocks).
    # Bloom's attention (ALiBi by a keyword baddbmm, heads folded into the batch) is written out too, T5's
    # relative position bias a learned table passed as SDPA's mask: tp shards their heads and the bias tables'
    # with them, cp evaluates each bias per ring block (both meshes). Falcon's fused qkv is sharded by kv group,
    # once, beside ulysses (CI time): its attention is SDPA, as every model's at tp2-ring2.
    # DeepSeek-V3: latent attention (values of another head dim, through the ring's kernels) and its experts.
    # GPT-OSS: sink logits per head (tp shards them with the heads; cp folds them in after the ring, Ulysses' ring
    # of one too) beside a sliding window.
    # Mixtral and Qwen2-MoE: experts split over tp, each rank's tokens dispatched on their own over cp; Mixtral's
    # load-balancing loss (graphs broken by transformers' router-logit hooks) once, beside ulysses. Mixtral's
    # experts read a row at a time (batched_mm, made grouped matmuls by canonicalize) at both meshes and with ep.
    # GPT-2's and Qwen2's SDPA attention (no mask beyond causal) once, beside ulysses (CI time): at tp2-ring2 it
    # is Llama's, whose ring runs at world 8; Mistral's window runs in the ring as Mistral's padded batch's does.
    # Masks that fill the lowest finite value where a padding hides keys (a left-padded batch's first rows see
    # none and attend to every key evenly): Gemma2's over Ulysses and (gathered) the ring, T5's around its bias.
    # MPT's ALiBi counted from the last key in the ring; Apertus' MLP, its xIELU activation a where of two branches.
    # Llama 4's experts run on every token: cut over tp by their features, each rank's tokens tiled per expert over cp.
    # CogView4's rotary embedding written in place into the image part of its joint q and k: a cat (canonicalize).
    # HiDream's experts, an nn.ModuleList looped over by masks, in one graph: cut over tp; its joint sequence of
    # image and three text parts cut part by part over the ring, its rotary positions following it.
    # FLUX.2's single blocks: q, k, v and the MLP's gate and up, one projection cut in five parts over tp.
    # DiffLlama's differential attention: the heads cut half by half over tp (plan.head_groups), beside ulysses.
    # LFM2's short convolution, causal: each rank's runs of rows with the rows before them (beside the ring).
    # Qwen3.5's gated delta rule: on each rank's heads (tp) and runs of rows (the ring's zigzag), from the state
    # the runs before leave; Granite 4's Mamba-2 scan so too, its one group of B and C whole on every rank; Jamba's
    # Mamba-1 scan so too, on each rank's channels. Wan's unpatchify at tp2-ring2: the output gathered before it.
    4: {"tp2-ulysses2": dict(sizes=MESHES["tp2-ulysses2"],
                             names=MODELS + ["mistral_padded", "wan", "sd3", "gemma2", "gemma2_left_padded", "bloom",
                                             "t5", "t5_padded", "falcon", "mixtral", "mixtral_aux",
                                             "mixtral_batched_mm", "qwen2_moe", "deepseek_v3", "gpt_oss", "apertus",
                                             "diffllama"]),
        "tp2-ring2": dict(sizes=MESHES["tp2-ring2"], names=["flux", "wan", "mistral_padded", "gemma2",
                                                            "gemma2_left_padded", "bloom", "t5", "t5_padded", "mixtral",
                                                            "mixtral_batched_mm", "qwen2_moe", "deepseek_v3", "mpt",
                                                            "llama4", "falcon_multi_query", "gpt_bigcode",
                                                            "cogview4", "sana", "hidream", "flux2", "lfm2",
                                                            "qwen3_5", "granite_hybrid", "jamba", "granite_swa",
                                                            "mimo_v2_flash"]),
        # Expert parallelism: the experts cut over cp, each rank's rows sent to them and back (the ring's zigzag
        # layout beside plain expert chunks; Ulysses' once, on Qwen2-MoE's shared expert beside them). GPT-OSS's
        # experts (per-row biases gathered by local expert ids at the experts) beside its sinks' ring attention.
        "tp2-ring2 ep": dict(sizes=MESHES["tp2-ring2"], names=["mixtral", "mixtral_batched_mm", "deepseek_v3",
                                                              "gpt_oss", "phimoe"], options={"ep": "cp"}),
        "tp2-ulysses2 ep": dict(sizes=MESHES["tp2-ulysses2"], names=["qwen2_moe"], options={"ep": "cp"}),
        # ... and lowered to xm calls (the stand-in's), each rank's rows sent padded by even all-to-alls over
        # contiguous cp groups, as Neuron needs them.
        "tp2-ring2 ep xla": dict(sizes={**MESHES["tp2-ring2"], "order": ("tp", "ring", "ulysses")}, names=["mixtral"],
                                 options={"ep": "cp", "collectives": "xla"})},
    # Ulysses x ring beside tp: causal GQA, joint attention (each model's own layers run at world 4; a window's
    # ring blocks too, Mistral's there).
    8: {"tp2-ring2-ulysses2": dict(sizes={"tp": 2, "ring": 2, "ulysses": 2}, names=["llama", "flux"])},
    # transformers' eager experts: Dynamo breaks the graph at the loop's nonzero, and the experts run between the
    # planned graphs (an nn.ModuleList looped over: _testing.patterns.LoopedExperts, in test_tp_gloo and test_cp_gloo).
    # Multi-query fused qkv (Falcon-7B, GPTBigCode): cut part by part with the query heads, the key and value
    # gathered whole as they are split off (beside the ring at world 4; GPTBigCode's repeated kv heads on tp alone).
    # Qwen3-Next's gated delta rule: its convolution, chunked recurrence and gated norm on each rank's heads;
    # Qwen3.5's too, its q, k and v from one projection of unequal parts, the rest from projections of their own.
    # Stable Diffusion's UNet: its resnet blocks MLP sites over tp; over cp its image's rows cut through group
    # norms, convolutions and resampling.
    2: {"tp2": dict(sizes={"tp": 2}, names=["mixtral_eager", "gpt_oss", "gpt_bigcode", "qwen3_next", "qwen3_5",
                                            "unet"]),
        "ulysses2": dict(sizes={"ulysses": 2}, names=["unet"])},
}
"""World size -> mesh label -> ``compare_models``' keyword arguments; one launch per world size
(world 2's launch runs the ``parallel`` decorator's check too)."""
SWEPT = {("tp2-ulysses2", name) for name in ["gpt2", "qwen2", "mistral", "mistral_padded", "wan", "sd3", "gemma2",
                                              "bloom", "t5", "t5_padded", "mixtral", "mixtral_batched_mm",
                                              "qwen2_moe", "deepseek_v3", "apertus", "diffllama"]}
SWEPT |= {("tp2-ring2", name) for name in ["flux", "wan", "gemma2", "gemma2_left_padded", "t5", "mixtral", "bloom",
                                           "mixtral_batched_mm",
                                           "qwen2_moe", "mpt", "llama4", "gpt_bigcode", "sana", "flux2",
                                           "granite_swa", "mimo_v2_flash", "lfm2", "cogview4", "falcon_multi_query",
                                           "jamba"]}
SWEPT |= {("tp2-ring2 ep", name) for name in ["mixtral_batched_mm", "deepseek_v3", "gpt_oss", "phimoe"]}
SWEPT |= {("tp2", name) for name in ["gpt_oss", "gpt_bigcode", "qwen3_5", "unet"]}
SWEPT |= {("tp2-ring2-ulysses2", name) for name in ["llama", "flux"]}  # world 8: test_cp_gloo's non-default order
"""(mesh, model) numerics ``tests.tiers`` leaves to ``--sweep``: CI runs each kind of site
(attention written out, masks, position biases, experts with and without ep, latent attention,
joint sequences, recurrences, scans) on one model at one mesh at least, and plans every model in
process (``EXPLAINED``: ``test_every_block_runs_sharded_without_fallback_gathers``)."""


def _launched(world: int, runs: dict) -> dict:
    """The world's launch this session: each mesh's models ``tiers.running``, the decorator's check at world 2."""
    calls = {label: (compare_models_over_xm if label.endswith("xla") else compare_models,
                     {**kwargs, "names": tiers.running(kwargs["names"], SWEPT, key=lambda name: (label, name))})
             for label, kwargs in runs.items()}
    calls = {label: call for label, call in calls.items() if call[1]["names"]}
    if world == 2:
        calls["decorated"] = (decorated_llama, {})
    return calls


LAUNCHES = {world: in_background(run_ranks_together, world, calls) for world, runs in RUNS.items()
            if (calls := _launched(world, runs))}


@pytest.mark.parametrize("world, mesh, name", [tiers.case(world, mesh, name, sweep=(mesh, name) in SWEPT,
                                                          id=f"{mesh}-{name}")
                                               for world, runs in RUNS.items() for mesh, run in runs.items()
                                               for name in run["names"]])
def test_real_models_match_one_device(world, mesh, name):
    """Forward within FORWARD_ATOL and, for the models of BACKWARD, every gradient within
    GRAD_RTOL (GRAD_RTOL_OF's where given), on every rank."""
    for rank, rank_results in enumerate(LAUNCHES[world].result()):
        assert name in rank_results[mesh], (mesh, name, rank)
        metrics = rank_results[mesh][name]
        assert metrics["forward"] <= FORWARD_ATOL and metrics.get("grad", 0.0) <= GRAD_RTOL_OF.get(name, GRAD_RTOL), \
            (mesh, name, rank, metrics)
        assert ("grad" in metrics) == (name in BACKWARD), (mesh, name, rank, metrics)


def test_eager_experts_run_between_graphs_and_their_router_is_named():
    """transformers' ``eager`` experts run where Dynamo breaks the graph, between the planned
    graphs, whole on every rank (exact: ``test_real_models_match_one_device``), and leave the
    router's choice as a graph output: a warning names the router and the implementations that
    run sharded."""
    for rank_results in LAUNCHES[2].result():
        warnings = rank_results["tp2"]["mixtral_eager"]["warnings"]
        assert any("the choice of router gate.weight leaves the graph: the experts it routes to run outside it" in w
                   and "'grouped_mm' or 'batched_mm' experts run sharded" in w for w in warnings), warnings


@pytest.mark.parametrize("tied", ["tied", "untied"])
def test_parallel_decorator_on_transformers_llama(tied):
    """Each rank holds half of q_proj's rows, of the token table's (vocab 128 / tp 2, hidden 64)
    and of the LM head's, tied ones still one tensor; forward and every gradient as one device's."""
    for result in (rank_results["decorated"][tied] for rank_results in LAUNCHES[2].result()):
        assert result["forward"] <= FORWARD_ATOL and result["grad"] <= GRAD_RTOL, result
        assert result["local_rows"] == 32 and result["table"] == result["head"] == [64, 64], result
        assert result["tied"] == (tied == "tied"), result


def _local_graph(config, seq: int, ring: int, **kwargs):
    from transformers import AutoModel

    from dtensor_par.planning import parallelize_graph
    from dtensor_par.mesh import MeshInfo
    from dtensor_par.passes.capture import capture_graphs

    with torch.device("meta"):
        model, ids = AutoModel.from_config(config), torch.randint(0, 128, (2, seq))
    (gm, inputs), = capture_graphs(model, ids, use_cache=False, **kwargs)
    return parallelize_graph(gm, inputs, MeshInfo.for_planning({"ring": ring}, "cuda"))


def _right_padded(seq: int) -> dict:
    attention_mask = torch.ones(2, seq, dtype=torch.long)
    attention_mask[1, -100:] = 0
    return {"attention_mask": attention_mask}


@pytest.mark.parametrize("model, seq, padded, window", [
    ("llama", 4096, False, None), ("mistral", 1024, False, 256), ("llama", 1024, True, None),
    ("mistral", 1024, True, 256)], ids=["llama-causal-4096", "mistral-window-1024", "llama-padded-1024",
                                        "mistral-window-padded-1024"])
def test_masks_from_positions_hold_no_square_tensor_on_ring_4(model, seq, padded, window):
    """transformers builds a [B, 1, S, S] mask under Dynamo (causal, sliding-window, ANDed with
    the key padding of ``attention_mask``); it is recognized, so no rank holds an S x S tensor:
    attention runs as is_causal (zigzag balanced) with the window and a [B, S] key padding."""
    from transformers import LlamaConfig, MistralConfig

    sizes = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                 num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=seq)
    config = LlamaConfig(**sizes) if model == "llama" else MistralConfig(**sizes, sliding_window=window)
    local, ctx = _local_graph(config, seq, 4, **(_right_padded(seq) if padded else {}))
    attention = [n for n in local.graph.nodes if n.target is dtensor_par.ops.attention.hybrid_attention]
    assert attention and all(n.kwargs["is_causal"] and n.kwargs["attn_mask"] is None for n in attention)
    assert all(n.kwargs.get("window") == window for n in attention)
    for n in attention:
        key_padding = n.kwargs.get("key_padding")
        assert (key_padding is not None) == padded
        if padded:
            assert global_shape(key_padding) == (2, seq)
            assert placements(key_padding)["cp"] == dtensor_par.placements.Replicate()
    shapes = [global_shape(n) or () for n in local.graph.nodes]
    assert not any(shape[-2:] == (seq, seq) for shape in shapes), [s for s in shapes if s[-2:] == (seq, seq)]
    # explain's FLOPs per ring rank: causal halves the work (zigzag: alike on every rank); a
    # window skips blocks and cuts boxes, yet covers every pair it leaves visible.
    (flops,) = ctx.coverage.ring_attention_flops.values()
    per_pair = 4 * 2 * 8 * 8  # batch 2, 8 heads of 8
    if window is None:
        assert len(set(flops)) == 1 and per_pair * seq * (seq + 1) // 2 <= sum(flops) < 0.55 * per_pair * seq * seq
    else:
        visible = sum(min(i + 1, window) for i in range(seq))
        assert per_pair * visible <= sum(flops) < 0.7 * per_pair * seq * (seq + 1) // 2, flops


def test_attention_written_out_by_hand_is_a_site_sharded_on_heads():
    """Gemma2's soft-capped attention (matmul, scale, tanh, mask, softmax, matmul) is read as an
    attention site: tp=2 shards its q/k/v colwise and o rowwise by heads (4 heads, 2 kv heads),
    every block linear sharded."""
    torch.manual_seed(0)
    model, args, kwargs = real_models.gemma2()
    (graph,) = dtensor_par.explain(model, args, example_kwargs=kwargs, tp=2).graphs
    attention = [s for s in graph.sites if s.startswith("attention")]
    assert len(attention) == 2 and all("4 heads, 2 kv heads" in s and "o_proj" in s for s in attention), attention
    assert graph.coverage.sharded_block_linear_flops == graph.coverage.block_linear_flops > 0
    assert graph.coverage.fallback_gathers == [] and graph.coverage.parallel_sites == 4


def _written_out_as_hybrid_attention(name: str, mesh: dict) -> list:
    """The hybrid attention nodes a model's attention written out by hand is planned as over
    ``mesh`` (2 layers: a sliding window of 12, then none), after asserting what every such
    model shares: no attention left op by op, its masks built from positions run as is_causal
    with the window and without, and no rank holds an ``S x S`` tensor."""
    from dtensor_par.mesh import MeshInfo
    from dtensor_par.passes.capture import capture_graphs
    from dtensor_par.passes.steps import steps
    from dtensor_par.planning import parallelize_graph

    torch.manual_seed(0)
    model, _, kwargs = real_models.FACTORIES[name]()
    seq = 40  # no other dim of the model has this size
    (gm, inputs), = capture_graphs(model, torch.randint(0, real_models.VOCAB, (2, seq)), **kwargs)
    local, ctx = parallelize_graph(gm, inputs, MeshInfo.for_planning(mesh, "cpu"), steps=steps(last="coverage"))
    assert not any("op by op" in w or "softmax" in w for w in ctx.warnings), ctx.warnings
    attention = [n for n in local.graph.nodes if n.target is dtensor_par.ops.attention.hybrid_attention]
    assert [n.kwargs.get("window") for n in attention] == [12, None]
    assert all(n.kwargs["is_causal"] and n.kwargs["attn_mask"] is None for n in attention), [n.kwargs for n in attention]
    shapes = [global_shape(n) or () for n in local.graph.nodes]
    assert not any(shape[-2:] == (seq, seq) for shape in shapes), [s for s in shapes if s[-2:] == (seq, seq)]
    return attention


@pytest.mark.parametrize("mesh", MESHES.values(), ids=MESHES.keys())
def test_soft_capped_attention_runs_as_hybrid_attention_without_a_square_mask(mesh):
    """Under cp, Gemma2's written-out attention becomes hybrid attention: its scale and
    soft-capping a score function each ring block (or Ulysses' ring of one) applies to its own
    scores."""
    from dtensor_par.ops.score_mod import ScoreMod

    soft_capping = ScoreMod((("mul", 256 ** -0.5), ("div", 0.02), ("tanh", 0.0), ("mul", 0.02)))  # query_pre_attn_scalar 256
    attention = _written_out_as_hybrid_attention("gemma2", mesh)
    assert all(n.kwargs["score_mod"] == soft_capping for n in attention), [n.kwargs for n in attention]


@pytest.mark.parametrize("mesh", MESHES.values(), ids=MESHES.keys())
def test_attention_sinks_run_as_hybrid_attention_with_each_ranks_heads(mesh):
    """GPT-OSS's attention concatenates a sink logit per head to its scores, subtracts the rows'
    max and drops the sinks' probabilities before ``@ v``. Under cp it becomes hybrid attention
    given the sinks, one per head of this tp rank, folded in after the ring."""
    for node in _written_out_as_hybrid_attention("gpt_oss", mesh):  # tp's heads: each rank's own sinks
        taken = dict(zip(tensor_inputs(node), shardings(node)["tp"].inputs))
        assert taken[node.kwargs["sinks"]] == Shard(0) and global_shape(node.kwargs["sinks"]) == (8,), taken


def test_a_decode_step_against_a_cache_no_cp_prefill_cut_is_refused_saying_what_runs():
    """A decode step (one query against a kv cache) whose cache no prefill under cp left cut (the
    model's own, planned alone) has no cut over cp: refused, the error saying what does run
    (``test_inference``: GPT-OSS's generate under ring=2)."""
    from transformers import DynamicCache

    from dtensor_par.errors import InvalidPlan
    from dtensor_par.mesh import MeshInfo
    from dtensor_par.passes.capture import capture_graphs
    from dtensor_par.passes.steps import steps
    from dtensor_par.planning import parallelize_graph

    model, _, _ = real_models.gpt_oss()
    cache = DynamicCache(config=model.config)
    model(torch.randint(0, real_models.VOCAB, (1, 8)), past_key_values=cache, use_cache=True)
    (gm, inputs), = capture_graphs(model, torch.randint(0, real_models.VOCAB, (1, 1)), past_key_values=cache,
                                   use_cache=True)
    with pytest.raises(InvalidPlan, match=r"sequence length 1 \(keys 9\).*a decode step \(queries against a longer kv "
                                          r"cache\) runs over cp against the cache rows a prefill under cp left on each "
                                          r"rank \(ops.cache_attention\)"):
        parallelize_graph(gm, inputs, MeshInfo.for_planning({"ring": 2}, "cpu"), steps=steps(last="coverage"))


def test_llama4s_tiled_tokens_have_their_gradient_summed_before_the_tiling():
    """Llama 4 tiles its tokens once per expert and scales the tiles by the router's weights
    before the experts' colwise product: under tp the backward sums the tokens' gradient and the
    weights' (16,384 and 1,024 B a rank), not the 4 experts' tiles' (65,536 B)."""
    model, args, kwargs = real_models.llama4()
    (graph,) = dtensor_par.explain(model, args, example_kwargs=kwargs, tp=2).graphs
    sums = sorted(c["bytes_per_rank"] for c in graph.collectives
                  if c["direction"] == "backward" and c["op"] == "all_reduce" and c["site"] == "mlp0.colwise")
    assert sums == [1024, 16384], graph.collectives


def test_a_kv_head_repeated_to_the_query_heads_is_expanded_to_each_ranks_heads():
    """GPTBigCode at tp2 repeats its one kv head to the 8 query heads (expand, then a view) before
    attention: each rank expands it to its own 4, and the backward all-reduces the kv head's
    gradient (2,048 B a rank, key and value), where cutting the repeated heads gathered every
    head's (8,192 B)."""
    model, args, kwargs = real_models.gpt_bigcode()
    (graph,) = dtensor_par.explain(model, args, example_kwargs=kwargs, tp=2).graphs
    core = [(c["direction"], c["op"], c["bytes_per_rank"], c["count"]) for c in graph.collectives
            if c["site"] == "attention0.core"]
    assert core == [("backward", "all_reduce", 2048, 2)], graph.collectives


def test_a_gated_delta_rule_runs_on_each_ranks_heads_over_tp_and_on_each_ranks_rows_over_cp():
    """Qwen3-Next's linear attention under tp: its projection viewed per key-head group, the
    depthwise convolution over q, k and v concatenated, the chunked delta rule (one op,
    canonicalize) and its norm over heads flattened with the rows, all on each rank's heads
    (before: 4 fallback gathers, and the recurrence ran whole on every rank). Over cp its causal
    convolution runs on each rank's rows (a halo), then its recurrence (before: on the gathered
    sequence, 5 gathers): each run's end state and how it carries a state are gathered, 2 runs x 8
    heads x 8 x (8 + 8) float32 numbers a rank. Over tp and cp at once, its gated norm's rows,
    flattened with the heads, run unflattened (canonicalize): nothing is gathered (before: 2)."""
    model, args, kwargs = real_models.qwen3_next()
    (graph,) = dtensor_par.explain(model, args, example_kwargs=kwargs, tp=2).graphs
    cov = graph.coverage
    assert graph.warnings == [] and cov.sharded_block_linear_flops >= 0.95 * cov.block_linear_flops, cov.summary()
    (graph,) = dtensor_par.explain(model, args, example_kwargs=kwargs, ring=2, ulysses=2).graphs
    assert graph.warnings == [] and graph.coverage.fallback_gathers == [], graph.warnings
    states = 2 * real_models.BATCH * 8 * 8 * (8 + 8) * 4
    assert ("all_gather", states) in [(c["op"], c["bytes_per_rank"]) for c in graph.collectives
                                      if c["mesh_dims"] == "cp" and c["direction"] == "forward"], graph.collectives
    (graph,) = dtensor_par.explain(model, args, example_kwargs=kwargs, tp=2, ulysses=2).graphs
    assert graph.warnings == [] and graph.coverage.fallback_gathers == [], graph.warnings


def test_a_gated_delta_rule_from_projections_of_its_own_is_one_site_over_tp():
    """Qwen3.5's gated delta rule reads q, k and v from one projection (transposed, convolved
    causally, SiLU, transposed back, split into unequal parts), and the gate, beta and decay from
    projections of their own: one site from all four to the out projection, through the chunked
    recurrence, the causal convolution's weight cut as q, k and v are. Before, only the gate and
    the out projection were cut and the recurrence ran whole on every rank."""
    model, args, kwargs = real_models.qwen3_5()
    (graph,) = dtensor_par.explain(model, args, example_kwargs=kwargs, tp=2).graphs
    cov = graph.coverage
    assert graph.warnings == [] and cov.sharded_block_linear_flops == cov.block_linear_flops, cov.summary()
    layer = "model.layers.0.linear_attn"
    assert f"{layer}.in_proj_b.weight=S(0), {layer}.in_proj_a.weight=S(0), {layer}.in_proj_qkv.weight=IS(0,[32, 32, " \
           f"64]), {layer}.conv1d.weight=IS(0,[32, 32, 64]), {layer}.out_proj.weight=S(1)" in graph.placements[1]


def test_mamba2s_mixer_is_one_site_over_tp_and_its_scan_runs_on_each_ranks_rows_over_cp():
    """Granite 4's Mamba-2 layer: one projection fused ``[z, x, B, C, dt]``, split, x, B and C
    convolved and split again, is cut part by part (before: its second split was gathered, 2 per
    layer). The scan (one op, canonicalize) runs on each rank's heads; B and C, one group shared
    by every head, are gathered whole (2 x 2 x 32 x 8 float32 numbers a rank). Over cp each rank
    runs its rows from the state the rows before leave: each run's end state and its decay are
    gathered, 2 runs x 2 rows x 4 heads x (16 + 1) x 16 float32 numbers at tp2 x ring2 (before: 3
    fallback gathers in the scan's traced ops)."""
    model, args, kwargs = real_models.granite_hybrid()
    (graph,) = dtensor_par.explain(model, args, example_kwargs=kwargs, tp=2).graphs
    cov = graph.coverage
    assert graph.warnings == [] and cov.sharded_block_linear_flops >= 0.95 * cov.block_linear_flops, cov.summary()
    assert "model.layers.0.mamba.in_proj.weight=IS(0,[128, 128, 16, 16, 8])" in graph.placements[3], graph.placements
    forward = [(c["op"], c["mesh_dims"], c["bytes_per_rank"], c["count"]) for c in graph.collectives
               if c["direction"] == "forward" and c["op"] == "all_gather"]
    logits = real_models.BATCH * real_models.SEQ * real_models.VOCAB // 2 * 4  # the LM head's, cut by the vocabulary
    assert sorted(forward) == [("all_gather", "tp", 2 * 32 * 8 * 4, 2), ("all_gather", "tp", logits, 1)], \
        graph.collectives
    for mesh in ({"tp": 2, "ulysses": 2}, {"tp": 2, "ring": 2}):
        (graph,) = dtensor_par.explain(model, args, example_kwargs=kwargs, **mesh).graphs
        assert graph.warnings == [] and graph.coverage.fallback_gathers == [], graph.warnings
    states = 2 * real_models.BATCH * 4 * (16 + 1) * 16 * 4  # the ring's zigzag: 2 runs a rank
    assert ("all_gather", states) in [(c["op"], c["bytes_per_rank"]) for c in graph.collectives
                                      if c["mesh_dims"] == "cp" and c["direction"] == "forward"], graph.collectives


def test_mamba1s_mixer_is_one_site_over_tp_and_its_scan_runs_on_each_ranks_rows_over_cp():
    """Jamba's Mamba-1 layer: in_proj and dt_proj cut by their output features, x_proj and
    out_proj by their input features, one site (before: in_proj to x_proj a site, out_proj
    gathered, dt_proj whole). Its scan (one op, canonicalize; before: traced as an associative
    scan, whose slices were gathered) runs on each rank's channels; over cp each rank runs its
    rows from the state the rows before leave: each run's end state and decay are gathered, 2
    runs x 2 rows x 64 channels x (8 + 8) float32 numbers at tp2 x ring2."""
    model, args, kwargs = real_models.jamba()
    (graph,) = dtensor_par.explain(model, args, example_kwargs=kwargs, tp=2).graphs
    cov = graph.coverage
    assert graph.warnings == [] and cov.sharded_block_linear_flops >= 0.95 * cov.block_linear_flops, cov.summary()
    layer = "model.layers.0.mamba"
    assert f"mlp0: {layer}.in_proj.weight=IS(0,[128, 128]), {layer}.dt_proj.weight=S(0), {layer}.conv1d.weight=R, " \
           f"{layer}.x_proj.weight=S(1), {layer}.out_proj.weight=S(1)" in graph.placements, graph.placements
    for mesh in ({"tp": 2, "ulysses": 2}, {"tp": 2, "ring": 2}):
        (graph,) = dtensor_par.explain(model, args, example_kwargs=kwargs, **mesh).graphs
        assert graph.warnings == [] and graph.coverage.fallback_gathers == [], graph.warnings
    states = 2 * real_models.BATCH * 64 * (8 + 8) * 4  # the ring's zigzag: 2 runs a rank
    assert ("all_gather", states) in [(c["op"], c["bytes_per_rank"]) for c in graph.collectives
                                      if c["mesh_dims"] == "cp" and c["direction"] == "forward"], graph.collectives


def test_heads_split_into_groups_after_attention_are_cut_group_by_group():
    """DiffLlama's differential attention chunks its value heads and its output heads into two
    halves and pairs head i with head i + heads / 2. Cut plainly over tp, both chunks gathered;
    cut half by half (each rank its heads of each half), both stay local, and the out projection,
    read through the per-pair norm, is rowwise."""
    model, args, kwargs = real_models.diffllama()
    (graph,) = dtensor_par.explain(model, args, example_kwargs=kwargs, tp=2).graphs
    assert graph.warnings == [] and graph.coverage.fallback_gathers == [], graph.warnings
    layer = "model.layers.0.self_attn"
    assert f"{layer}.q_proj.weight=IS(0,[32, 32]), {layer}.k_proj.weight=IS(0,[16, 16]), " \
           f"{layer}.v_proj.weight=IS(0,[16, 16]), {layer}.o_proj.weight=S(1)" in graph.placements[0], graph.placements


def test_sanas_convolutions_run_on_each_ranks_rows_of_the_image_over_cp():
    """Sana's feed-forward convolves the image grid its sequence makes: the 1 x 1 convolutions on
    each rank's rows as they are, the depthwise 3 x 3 with one halo row each side of each run of
    rows fetched (an all-gather of 2 rows per run: one run a rank at ulysses2 x ring2). Before,
    the first gathered the sequence and the feed-forward ran whole."""
    model, args, kwargs = real_models.sana()
    (graph,) = dtensor_par.explain(model, args, example_kwargs=kwargs, ulysses=2, ring=2).graphs
    cov = graph.coverage
    assert cov.fallback_gathers == [] and cov.sharded_block_linear_flops >= 0.95 * cov.block_linear_flops, cov.summary()
    halo = [c for c in graph.collectives if c["op"] == "all_gather" and c["direction"] == "forward"]
    rows = 2 * 1 * real_models.BATCH * 160 * 8 * 4  # 2 edge rows a run x batch x channels x width x float32
    assert ("cp", rows, 1) in [(c["mesh_dims"], c["bytes_per_rank"], c["count"]) for c in halo], halo
    back = [(c["mesh_dims"], c["bytes_per_rank"]) for c in graph.collectives if c["op"] == "reduce_scatter"]
    assert back == [("cp", 4 * rows)], back  # the gradients of the 4 ranks' edges go in, as the profiler counts


def test_a_unets_image_rows_stay_cut_over_cp_through_group_norms_and_resampling():
    """Stable Diffusion's UNet over cp: its 18 group norms each all-reduce their groups' sums
    twice (mean, then variance: batch x 8 groups x float32), its 3 x 3 convolutions and its
    downsampling one of stride 2 fetch their halo rows, its nearest upsampling repeats rows in
    place: nothing gathered. Before, 10 fallback gathers and 27% of linear FLOPs sharded; what
    is left whole is the input convolution and the first resnet block, before the first
    attention cuts the image's rows."""
    model, args, kwargs = real_models.unet()
    (graph,) = dtensor_par.explain(model, args, example_kwargs=kwargs, ulysses=2).graphs
    cov = graph.coverage
    assert graph.warnings == [] and cov.fallback_gathers == [], graph.warnings
    assert cov.sharded_linear_flops >= 0.9 * cov.linear_flops, cov.summary()
    forward = [(c["op"], c["bytes_per_rank"], c["count"]) for c in graph.collectives
               if c["direction"] == "forward" and c["mesh_dims"] == "cp"]
    assert ("all_reduce", real_models.BATCH * 8 * 4, 36) in forward, forward
    assert sum(count for op, _, count in forward if op == "all_gather") == 18, forward  # each convolution's halo


def test_a_causal_convolution_runs_on_each_ranks_rows_with_the_rows_before_them():
    """LFM2's short convolution (``causal_conv1d_fn``: padded by k - 1 at both ends, cropped to the
    sequence) is canonicalized into one padded before only, which over cp runs on each rank's runs
    of rows, the 2 rows before each run fetched (one all-gather) of the rank's channels (tp cuts
    them: the block is an MLP site). Before, it gathered the sequence."""
    model, args, kwargs = real_models.lfm2()
    (graph,) = dtensor_par.explain(model, args, example_kwargs=kwargs, tp=2, ring=2).graphs
    assert graph.warnings == [] and graph.coverage.fallback_gathers == [], graph.warnings
    halo = 2 * real_models.BATCH * 32 * 2 * 4  # 2 runs a rank (zigzag) x batch x 64 / tp channels x 2 rows before
    forward = [(c["op"], c["bytes_per_rank"]) for c in graph.collectives if c["mesh_dims"] == "cp"
               and c["direction"] == "forward"]
    assert ("all_gather", halo) in forward, forward


def test_a_short_convolution_block_gated_without_activation_is_an_mlp_site_over_tp():
    """LFM2's short-convolution block (one projection chunked into B, C and x, ``B * x`` convolved,
    times C, an out projection) has no activation: its bilinear gates make it a site, the
    projection cut part by part. Before, both projections ran whole on every rank."""
    model, args, kwargs = real_models.lfm2()
    (graph,) = dtensor_par.explain(model, args, example_kwargs=kwargs, tp=2).graphs
    cov = graph.coverage
    assert graph.warnings == [] and cov.sharded_block_linear_flops == cov.block_linear_flops, cov.summary()
    assert "mlp0: model.layers.0.conv.in_proj.weight=IS(0,[64, 64, 64])" in graph.placements[1], graph.placements


def test_a_model_whose_frames_dynamo_runs_eagerly_is_refused_by_explain():
    """Mochi's graph breaks where Dynamo cannot split the frame: the frames around the break run
    eagerly, each call they make compiled on its own (counted as unimplemented, not as a break).
    ``explain`` refuses it as a graph break (before: it reported the first inner graph, the time
    embedding, as if it were the model)."""
    model, args, kwargs = real_models.mochi()
    with pytest.raises(NotImplementedError, match=r"MochiTransformer3DModel: Dynamo breaks its graph \(Dynamic shape "
                                                  r"operator"):
        dtensor_par.explain(model, args, example_kwargs=kwargs, ulysses=2)


def test_attention_with_sinks_is_a_site_sharded_on_heads():
    """At tp2 GPT-OSS's attention, sinks and all, is a site whose heads tp shards: its softmax is
    named in no warning (before: "not read as attention", its heads whole)."""
    model, args, kwargs = real_models.gpt_oss()
    (graph,) = dtensor_par.explain(model, args, example_kwargs=kwargs, tp=2).graphs
    attention = [s for s in graph.sites if s.startswith("attention")]
    assert len(attention) == 2 and all("8 heads, 4 kv heads" in s for s in attention), attention
    assert not any("softmax" in w for w in graph.warnings), graph.warnings


@pytest.mark.parametrize("mesh", MESHES.values(), ids=MESHES.keys())
def test_masks_filled_with_the_lowest_finite_value_over_a_padding_run_whole_where_rows_may_see_no_key(mesh):
    """A mask that is the lowest finite value where a left padding hides keys leaves the padded
    sequence's first query rows no key, and on one device they attend to every key evenly.
    Gemma2's (written out, soft-capped) runs as hybrid attention over Ulysses, whose ring of one
    normalizes whole rows as one device does; over the ring, whose blocks cannot, it runs on
    the gathered sequence, said so. T5 keeps its bias inside such a mask (one that needs its
    table's gradient: gathered, said so) rather than as a position bias beside a key padding,
    under which those rows would attend to no key."""
    from dtensor_par.mesh import MeshInfo
    from dtensor_par.passes.capture import capture_graphs
    from dtensor_par.passes.steps import steps
    from dtensor_par.planning import parallelize_graph

    planned = {}
    for name in ("gemma2_left_padded", "t5_padded"):
        torch.manual_seed(0)
        model, args, kwargs = real_models.FACTORIES[name]()
        (gm, inputs), = capture_graphs(model, *args, **kwargs)
        planned[name] = parallelize_graph(gm, inputs, MeshInfo.for_planning(mesh, "cpu"), steps=steps(last="coverage"))
    local, ctx = planned["gemma2_left_padded"]
    attention = [n for n in local.graph.nodes if n.target is dtensor_par.ops.attention.hybrid_attention]
    finite = [w for w in ctx.warnings if "fills with the lowest finite value where an input hides keys" in w]
    assert (len(attention), len(finite)) == ((0, 2) if "ring" in mesh else (2, 0)), (attention, ctx.warnings)
    local, ctx = planned["t5_padded"]
    biases = [n.kwargs["position_bias"].kind for n in local.graph.nodes
              if n.target is dtensor_par.ops.attention.hybrid_attention and "position_bias" in n.kwargs]
    assert "buckets" not in biases, biases  # neither self-attention splits its bias off a padded mask
    assert sum("a mask that needs a gradient" in w for w in ctx.warnings) == 2, ctx.warnings


@pytest.mark.parametrize("mesh", MESHES.values(), ids=MESHES.keys())
@pytest.mark.parametrize("name, forms", [("bloom", ["alibi"]), ("t5", ["buckets", "buckets", "alibi"])])
def test_position_biases_are_evaluated_per_block_without_a_square_tensor(name, forms, mesh):
    """Under tp x cp, Bloom's ALiBi (slopes x key position, added by a keyword baddbmm to heads
    folded into the batch) and T5's relative position bias (a learned embedding of buckets of
    k - q, passed as SDPA's mask; in the decoder kept where the causal mask attends) become
    hybrid attention's position bias: each ring block, or Ulysses' query tile, evaluates it from
    its positions and its rank's heads of the table (cut over tp), and the local graph holds no
    S x S tensor. T5's cross-attention adds zeros: ALiBi of slope 0, never a tensor of the
    sequences."""
    from dtensor_par.mesh import MeshInfo
    from dtensor_par.passes.capture import capture_graphs
    from dtensor_par.planning import parallelize_graph

    torch.manual_seed(0)
    model, _, kwargs = real_models.FACTORIES[name]()
    seq = 40  # no other dim of the model has this size
    ids = torch.randint(0, real_models.VOCAB, (2, seq))
    if "decoder_input_ids" in kwargs:
        kwargs = {**kwargs, "decoder_input_ids": ids.flip(1)}
    (gm, inputs), = capture_graphs(model, ids, **kwargs)
    local, ctx = parallelize_graph(gm, inputs, MeshInfo.for_planning(mesh, "cpu"))
    assert not any("op by op" in w or "gathered sequence" in w for w in ctx.warnings), ctx.warnings
    attention = [n for n in local.graph.nodes if n.target is dtensor_par.ops.attention.hybrid_attention]
    assert [n.kwargs["position_bias"].kind for n in attention] == forms, [n.kwargs for n in attention]
    assert all(n.kwargs["attn_mask"] is None for n in attention), [n.kwargs for n in attention]
    # The table's heads (its dim 1) cut over tp, whole over cp (Ulysses cuts it inside the kernel).
    assert all(shardings(n)["tp"].inputs[-1] == Shard(1) and shardings(n)["cp"].inputs[-1] == Replicate()
               for n in attention), [shardings(n) for n in attention]
    shapes = [global_shape(n) or () for n in local.graph.nodes]
    assert not any(shape[-2:] == (seq, seq) for shape in shapes), [s for s in shapes if s[-2:] == (seq, seq)]


@pytest.mark.parametrize("name, heads", [("falcon", "8 heads, 2 kv heads"), ("bloom", "4 heads, 4 kv heads")])
def test_head_layouts_are_read_from_the_graph(name, heads):
    """Falcon's fused qkv viewed as (2 kv groups, 4 query heads + key + value, head_dim) is
    sharded by group, whole groups to a rank; Bloom's (heads, q/k/v, head_dim), its attention
    written out with the heads folded into the batch, by head: every block linear sharded at
    tp=2. At tp=4 Falcon's 2 groups do not divide, and its fused qkv stays replicated, said so."""
    torch.manual_seed(0)
    model, args, kwargs = real_models.FACTORIES[name]()
    (graph,) = dtensor_par.explain(model, args, example_kwargs=kwargs, tp=2).graphs
    cov = graph.coverage
    assert cov.fallback_gathers == [] and cov.sharded_block_linear_flops >= 0.95 * cov.block_linear_flops > 0, cov
    attention = [s for s in graph.sites if s.startswith("attention")]
    assert len(attention) == 1 and heads in attention[0], attention
    assert cov.parallel_sites == len(graph.sites) == 2, graph.sites  # attention and MLP
    attention_weights = [p for p in graph.placements if p.startswith("attention")]
    assert all("query_key_value.weight=S(0)" in p for p in attention_weights), attention_weights
    if name == "falcon":
        (graph,) = dtensor_par.explain(model, args, example_kwargs=kwargs, tp=4).graphs
        assert any("fused projection with 2 kv heads at tp=4 stays replicated" in w for w in graph.warnings), \
            graph.warnings


@pytest.mark.parametrize("name, weight", [("falcon_multi_query", "self_attention.query_key_value.weight"),
                                          ("gpt_bigcode", "attn.c_attn.weight")])
def test_a_multi_query_fused_qkv_is_cut_with_its_query_heads_and_gathers_its_kv(name, weight):
    """One key and one value head beside 8 query heads in one fused projection (Falcon-7B,
    GPTBigCode), at tp=2: cut part by part, each rank computing its 4 query heads and half of the
    key's and value's features, which are gathered whole as they are split off: 2 all-gathers of
    [2, 32, 4] float halves, 1,024 B a rank. Exact: ``test_real_models_match_one_device``."""
    torch.manual_seed(0)
    model, args, kwargs = real_models.FACTORIES[name]()
    (graph,) = dtensor_par.explain(model, args, example_kwargs=kwargs, tp=2).graphs
    assert graph.warnings == [] and graph.coverage.fallback_gathers == [], (graph.warnings, graph.coverage)
    assert graph.coverage.sharded_block_linear_flops == graph.coverage.block_linear_flops > 0, graph.coverage
    assert any(f"transformer.h.0.{weight}=IS(0,[64, 8, 8])" in p for p in graph.placements), graph.placements
    gathers = [c for c in graph.collectives if c["site"] == "attention0.kv"]
    assert [(c["direction"], c["op"], c["bytes_per_rank"], c["count"]) for c in gathers] == \
        [("forward", "all_gather", 1024, 2)], gathers


@pytest.mark.parametrize("name, shared", [("mixtral", False), ("mixtral_batched_mm", False), ("qwen2_moe", True)])
def test_experts_split_over_tp_and_dispatched_per_rank_over_cp(name, shared):
    """Each expert's gate_up colwise (gate and up, each cut) and down rowwise over tp: one
    all-reduce per MoE layer in forward, with a shared expert's (Qwen2-MoE) partial sums added
    before it, and one of the tokens' gradient in backward; the router replicated. Over cp each rank sorts and runs its own tokens: nothing
    is sent inside the dispatch, and the experts' gradients join the one bucket."""
    torch.manual_seed(0)
    model, args, kwargs = real_models.FACTORIES[name]()
    layers = model.config.num_hidden_layers
    (graph,) = dtensor_par.explain(model, args, example_kwargs=kwargs, tp=2).graphs
    experts = [s for s in graph.sites if s.startswith("moe")]
    assert len(experts) == layers and all("4 experts, top-2" in s and "experts per rank: 4, each 1/2 of its features (tp)"
                                     in s and "mlp.gate'] (replicated)" in s for s in experts), experts
    assert all(f"experts.gate_up_proj=IS(1,[{w}, {w}])" in p and "experts.down_proj=S(2)" in p
               for p in graph.placements if p.startswith("moe") for w in [32 if shared else 128]), graph.placements
    forward = [c for c in graph.collectives if c["direction"] == "forward"]
    # attention and experts, each layer; the token embedding's sums (its table cut by vocab rows) and the
    # logits' gather (the LM head cut by the vocabulary)
    assert sum(c["count"] for c in forward) == 2 * layers + 2, forward
    # backward: the tokens' gradient summed, not their top-2 rows' (localize.hoist_grad_reduction)
    colwise = [(c["op"], c["bytes_per_rank"]) for c in graph.collectives if c["site"] == "moe0.colwise"]
    assert colwise == [("all_reduce", real_models.BATCH * real_models.SEQ * model.config.hidden_size * 4)], colwise
    cov = graph.coverage
    assert cov.fallback_gathers == [] and cov.sharded_block_linear_flops >= 0.95 * cov.block_linear_flops, cov.summary()
    assert sum(s.startswith("mlp") for s in graph.sites) == (layers if shared else 0), graph.sites
    (graph,) = dtensor_par.explain(model, args, example_kwargs=kwargs, ulysses=2).graphs
    assert graph.coverage.fallback_gathers == [] and graph.coverage.sharded_linear_flops == graph.coverage.linear_flops
    assert all("experts per rank: 4, each whole" in s for s in graph.sites if s.startswith("moe"))
    backward = [c for c in graph.collectives if c["direction"] == "backward" and c["op"] == "all_reduce"]
    assert [c["site"] for c in backward] == [f"gradient bucket of {len(list(model.parameters()))} inputs"], backward


@pytest.mark.parametrize("name", ["mixtral", "mixtral_batched_mm", "qwen2_moe", "deepseek_v3_published", "phimoe"])
@pytest.mark.parametrize("mesh", ["tp2-ulysses2", "tp2-ring2"])
def test_experts_cut_over_cp_with_ep(name, mesh):
    """``ep="cp"``: each rank holds E / cp of the experts, each 1/tp of its features, and sends its
    tokens' rows to them and back (per layer: the counts, the rows, the results, the last two
    again in backward); the expert weights are held cut so (parameter bytes a quarter of one
    device's at cp2 x tp2), their gradients stay on their rank, and every block still runs
    sharded with no fallback gather."""
    torch.manual_seed(0)
    model, args, kwargs = real_models.FACTORIES[name]()
    (graph,) = dtensor_par.explain(model, args, example_kwargs=kwargs, ep="cp", parallelized=True,
                                   **MESHES[mesh]).graphs
    cov = graph.coverage
    assert cov.fallback_gathers == [] and cov.sharded_block_linear_flops >= 0.95 * cov.block_linear_flops, cov.summary()
    (experts,) = [s for s in graph.sites if s.startswith("moe")]
    count = int(experts.split(": ")[1].split(" experts")[0])
    assert f"experts per rank: {count // 2} of {count} (ep over cp=2), each 1/2 of its features (tp)" in experts, experts
    exchanged = Counter((c["direction"], c["mesh_dims"]) for c in graph.collectives for _ in range(c["count"])
                        if c["site"] == "moe0.experts" and c["op"] == "all_to_all")
    assert exchanged == {("forward", "cp"): 3, ("backward", "cp"): 2}, exchanged
    held = {p["name"]: p for p in graph.parameters if ".experts." in p["name"] and "shared" not in p["name"]}
    assert len(held) == 2 and all(p["placement"]["ep"] == "S(0)" and "fsdp" not in p["placement"]
                                  and 4 * p["bytes_per_rank"] == p["bytes"] for p in held.values()), held
    assert not any(name in str(c["site"]) for c in graph.collectives for name in held), graph.collectives


def test_experts_exchange_padded_rows_under_the_xla_lowering(monkeypatch):
    """Lowered to xm calls, which have no uneven all-to-all, a rank sends its rows for each rank
    of the ring in a block of its rows' length, both ways: explain's rows sent are the ring's 2
    times the uneven exchange's, and the rows back its worst case, in forward and in backward.
    localize counts them so, before lower: choose_mesh, which stops there, prices them alike."""
    from dtensor_par.choose import PLANNING
    from dtensor_par.config import ParallelConfig
    from dtensor_par.mesh import MeshInfo
    from dtensor_par.passes.capture import capture_graphs
    from dtensor_par.passes.localize import graph_communications
    from dtensor_par.planning import parallelize_graph

    xm_gloo.install(lambda name, module: monkeypatch.setitem(sys.modules, name, module))
    model, args, kwargs = real_models.mixtral()
    lines, rows = {}, {}
    for comm in ("functional", "xla"):
        (graph,) = dtensor_par.explain(model, args, example_kwargs=kwargs, ep="cp", ring=2, collectives=comm).graphs
        (lines[comm],) = [s for s in graph.sites if s.startswith("moe0")]
        rows[comm] = Counter((c["direction"], c["bytes_per_rank"]) for c in graph.collectives for _ in range(c["count"])
                             if c["site"] == "moe0.experts" and c["op"] == "all_to_all" and c["bytes_per_rank"] > 64)
    own = min(nbytes for _, nbytes in rows["functional"])  # the rows a rank sends (all go in); twice that back at most
    assert rows["functional"] == {("forward", own): 1, ("forward", 2 * own): 1, ("backward", own): 1,
                                  ("backward", 2 * own): 1}, rows
    assert rows["xla"] == {("forward", 2 * own): 2, ("backward", 2 * own): 2}, rows
    (gm, inputs), = capture_graphs(model, *args, **kwargs)
    planned, _ = parallelize_graph(gm, inputs, MeshInfo.for_planning({"ring": 2}, "cpu"),
                                   ParallelConfig.of("test", {"ep": "cp", "collectives": "xla"}), steps=PLANNING)
    priced = Counter((direction, nbytes) for _, c in graph_communications(planned) if c.site == "moe0.experts"
                     for direction, nbytes in (("forward", c.forward_bytes), ("backward", c.backward_bytes)) if nbytes > 64)
    assert priced == rows["xla"], priced
    assert f"rows to the experts per layer: {own} B sent, {own} B back with even routing" in lines["functional"]
    assert (f"rows to the experts per layer: {2 * own} B sent and {2 * own} B back, padded to the worst case "
            f"(even all-to-alls over cp=2: the xla lowering)") in lines["xla"], lines


def test_experts_with_per_row_biases_and_interleaved_gate_and_up_run_split():
    """GPT-OSS's experts (``out.add_(bias[expert_ids])`` after each grouped matmul, gate and up
    interleaved, ``gate_up[..., ::2]``): at tp2 gate_up colwise, its bias table cut along the same
    features (each rank's even share keeps its (gate, up) pairs), down rowwise, its bias whole and
    added after the rows are weighted and summed per token (``experts.sink_expert_bias``), so one
    all-reduce of the tokens' rows per layer, not of their top-2 rows, and in backward one of the
    tokens' gradient; the router replicated, every expert FLOP sharded, no grouped matmul named as
    left whole. With ep over cp the bias tables are cut along their experts with the weights."""
    model, args, kwargs = real_models.gpt_oss()
    (graph,) = dtensor_par.explain(model, args, example_kwargs=kwargs, tp=2).graphs
    assert not any("grouped matmul" in w or "experts" in w for w in graph.warnings), graph.warnings
    experts = [s for s in graph.sites if s.startswith("moe")]
    assert len(experts) == 2 and all("4 experts, top-2, router=['model.layers." in s and "(replicated)" in s
                                     and "experts per rank: 4, each 1/2 of its features (tp)" in s for s in experts)
    (placed,) = [p for p in graph.placements if p.startswith("moe0")]
    assert all(f"model.layers.0.mlp.experts.{p}" in placed for p in ("gate_up_proj=S(2)", "down_proj=S(1)",
                                                                    "gate_up_proj_bias=S(1)"))
    tokens, hidden, inner = real_models.BATCH * real_models.SEQ, 64, 64
    cov = graph.coverage
    assert cov.fallback_gathers == [] and cov.sharded_block_linear_flops >= 4 * 2 * tokens * 3 * hidden * inner, \
        cov.summary()
    reduced = [(c["direction"], c["op"], c["bytes_per_rank"], c["site"], c["count"]) for c in graph.collectives
               if str(c["site"]).startswith("moe0")]
    assert reduced == [("backward", "all_reduce", tokens * hidden * 4, "moe0.colwise", 1),
                       ("forward", "all_reduce", tokens * hidden * 4, "moe0.rowwise", 1)], reduced
    (graph,) = dtensor_par.explain(model, args, example_kwargs=kwargs, ep="cp", parallelized=True,
                                   **MESHES["tp2-ring2"]).graphs
    assert graph.coverage.fallback_gathers == [], graph.coverage.fallback_gathers
    assert sum("experts per rank: 2 of 4 (ep over cp=2), each 1/2 of its features (tp)" in s for s in graph.sites) == 2
    tables = {p["name"].rpartition(".")[2]: p for p in graph.parameters if p["name"].endswith("_bias")
              and ".layers.0.mlp.experts." in p["name"]}
    assert {name: (p["placement"]["ep"], p["bytes"] // p["bytes_per_rank"]) for name, p in tables.items()} == \
        {"gate_up_proj_bias": ("S(0)", 4), "down_proj_bias": ("S(0)", 2)}, tables


def test_experts_read_a_row_at_a_time_are_planned_as_grouped_ones():
    """transformers' ``batched_mm`` experts (``W[expert_ids]`` then ``bmm``) are made the grouped
    chain by canonicalize: at tp2 the same sites, placements and collectives as the default
    ``grouped_mm`` experts', and no warning of a weight read a row at a time."""
    graphs = {}
    for name in ("mixtral", "mixtral_batched_mm"):
        model, args, kwargs = real_models.FACTORIES[name]()
        (graphs[name],) = dtensor_par.explain(model, args, example_kwargs=kwargs, tp=2).graphs
    grouped, batched = graphs.values()
    assert not any("a row at a time" in w for w in batched.warnings), batched.warnings
    assert (batched.sites, batched.placements, batched.collectives) == \
        (grouped.sites, grouped.placements, grouped.collectives)


def test_experts_that_cannot_be_cut_over_cp_stay_whole_or_are_refused():
    """``ep="cp"`` where the experts do not split into the cp ranks' chunks (4 experts over a ring
    of 4, two zigzag chunks a rank; and beside dp_shard): whole on every rank, with a warning that
    says why; with a local batch they are cut over dp_shard x cp too. Where the
    tokens reach the mixture gathered over cp (a view that splits a padded sequence), an error
    that names the node and says what to do."""
    model, args, kwargs = real_models.mixtral()
    (graph,) = dtensor_par.explain(model, args, example_kwargs=kwargs, ep="cp", ring=4).graphs
    assert any("moe0: ep='cp': the experts stay whole on every rank of cp=4: 4 experts do not divide into 8 equal "
               "chunks over cp=4" in w for w in graph.warnings), graph.warnings
    assert any("experts per rank: 4, each whole" in s for s in graph.sites), graph.sites
    (graph,) = dtensor_par.explain(model, args, example_kwargs=kwargs, ep="cp", dp_shard=2, ring=4).graphs
    assert any("4 experts do not divide into 8 equal chunks over dp_shard=2 x cp=4" in w for w in graph.warnings)
    # a local batch, which the plan does not cut over dp: its rows still reach the experts over dp_shard x cp
    (graph,) = dtensor_par.explain(model, args, example_kwargs=kwargs, ep="cp", dp_shard=2, ulysses=2, batch="local",
                                   parallelized=True).graphs
    assert graph.warnings == [], graph.warnings
    assert any("experts per rank: 1 of 4 (ep over dp_shard=2 x cp=2)" in s for s in graph.sites), graph.sites
    with pytest.raises(NotImplementedError, match=r"exchange_counts .*: expert parallelism \(ep='cp'\) runs on each "
                                                  r"cp rank's own tokens.*run it with ep=None"):
        dtensor_par.explain(model, (args[0][:, :30],), example_kwargs=kwargs, ep="cp", ring=2)


@pytest.mark.parametrize("mesh", [{"tp": 2}, {"ulysses": 2}, {"tp": 2, "ring": 2}], ids=["tp2", "ulysses2", "tp2-ring2"])
def test_latent_attention_shards_heads_and_keeps_the_latents_whole(mesh):
    """DeepSeek-V3's multi-head latent attention: q and kv made per head from low-rank latents
    (``q_b_proj``, ``kv_b_proj``: colwise), the latents themselves and the rotary key part every
    head shares (``q_a_proj``, ``kv_a_proj_with_mqa``: replicated, as no head owns them), the key
    filled slice by slice read as a concatenation; its experts, whose router reads the hidden
    states before they are flattened to tokens, split over tp and dispatched per rank over cp.
    No fallback gather on any mesh."""
    torch.manual_seed(0)
    model, args, kwargs = real_models.deepseek_v3()
    (graph,) = dtensor_par.explain(model, args, example_kwargs=kwargs, **mesh).graphs
    assert graph.coverage.fallback_gathers == [], graph.coverage.fallback_gathers
    attention, moe = ([s for s in graph.sites if s.startswith(kind)] for kind in ("attention", "moe"))
    assert len(attention) == 1 and "4 heads, 4 kv heads" in attention[0], attention
    assert "k=['model.layers.0.self_attn.kv_b_proj']" in attention[0], attention  # not the shared latent
    assert len(moe) == 1 and "4 experts, top-2" in moe[0] and "mlp.gate'] (replicated)" in moe[0], moe
    if "tp" in mesh:
        (placed,) = [p for p in graph.placements if p.startswith("attention")]
        assert placed == ("attention0: model.layers.0.self_attn.q_b_proj.weight=S(0), "
                          "model.layers.0.self_attn.kv_b_proj.weight=S(0), model.layers.0.self_attn.o_proj.weight=S(1)")
