"""Rank-side test cases: each builds a model, runs it through the backend and compares."""

from __future__ import annotations

import logging
from unittest import mock

import torch
from torch.distributed.device_mesh import DeviceMesh

import dtensor_par
from dtensor_par.choose import Ranking
from dtensor_par.sharded import sharded_state
from dtensor_par._testing import models, patterns
from dtensor_par._testing.harness import assert_matches, compare, logged, loss_of, max_rel, run_ranks_together, whole

def _keep(seq: int) -> torch.Tensor:
    """Key padding: the second sequence of the batch ends in 5 padding positions."""
    keep = torch.ones(2, seq, dtype=torch.bool)
    keep[1, -5:] = False
    return keep


def _rows_hidden(seq: int, rows: int) -> torch.Tensor:
    """A causal mask whose first ``rows`` query rows see no key: a left-padded batch's keys."""
    position = torch.arange(seq)
    keep = (position[None, :] <= position[:, None]) & (position[None, :] >= rows)
    return keep.expand(2, 1, seq, seq)


CASES = {
    # One block: every path a case compiles, at half or less a 2-layer model's compile time (CI time on 2 cores).
    "gpt_fused_qkv": (lambda: models.GPT(layers=1), lambda: [(torch.randn(2, 8, 32),)]),
    "llama_gqa_rope": (lambda: models.Llama(layers=1), lambda: [(torch.randint(0, 50, (2, 8)),)]),
    # Two layers where the test is about what crosses layers (gradient buckets).
    "llama_gqa_rope_2_layers": (lambda: models.Llama(layers=2), lambda: [(torch.randint(0, 50, (2, 8)),)]),
    "llama_enable_gqa": (lambda: models.Llama(layers=1, gqa="enable_gqa"), lambda: [(torch.randint(0, 50, (2, 8)),)]),
    # kv heads repeated by repeat_interleave (llama_gqa_rope: by transformers' repeat_kv) run as enable_gqa
    "llama_repeat_interleave_kv4": (lambda: models.Llama(layers=1, kv_heads=4, gqa="repeat_interleave"),
                                    lambda: [(torch.randint(0, 50, (2, 8)),)]),
    "parts_first_qkv": (models.PartsFirstBlock, lambda: [(torch.randn(2, 8, 48),)]),
    "graph_break": (patterns.GraphBreakModel, lambda: [(torch.randn(2, 8, 32),)]),
    "odd_mlp_width": (patterns.OddMLPBlock, lambda: [(torch.randn(2, 8, 32),)]),
    "unshardable_op": (patterns.UnruledOpMLP, lambda: [(torch.randn(2, 4, 16),)]),
    "keyword_sdpa_scale": (patterns.KeywordAttention, lambda: [(torch.randn(2, 8, 32),)]),
    "uneven_heads_14": (lambda: models.Llama(layers=1, hidden=56, heads=14, kv_heads=2, mlp=64),
                        lambda: [(torch.randint(0, 50, (2, 8)),)]),
    "bool_mask": (lambda: patterns.MaskedAttention("bool"), lambda: [(torch.randn(2, 16, 32), _keep(16))]),
    "additive_mask": (lambda: patterns.MaskedAttention("additive"), lambda: [(torch.randn(2, 16, 32), _keep(16))]),
    # scores filled with the lowest finite value where an input hides them, the first 5 query rows hidden entirely
    "rows_hidden_by_an_input": (patterns.RowsHiddenByAnInput, lambda: [(torch.randn(2, 16, 32), _rows_hidden(16, 5))]),
    # Sequence length 30: not divisible into the 8 chunks of ring=2 x ulysses=2.
    "uneven_seq_30": (lambda: models.Llama(layers=1), lambda: [(torch.randint(0, 50, (2, 30)),)]),
    "uneven_seq_30_masked": (lambda: patterns.MaskedAttention("additive"), lambda: [(torch.randn(2, 30, 32), _keep(30))]),
    "uneven_seq_30_bidirectional": (lambda: patterns.MaskedAttention(None), lambda: [(torch.randn(2, 30, 32),)]),
    "uneven_seq_30_pooling": (patterns.SequencePooling, lambda: [(torch.randn(2, 30, 32),)]),
    "mean_loss": (patterns.MeanLoss, lambda: [(torch.randn(2, 16, 32),)]),
    "conv1d": (patterns.Conv1DBlock, lambda: [(torch.randn(2, 16, 32),)]),
    "joint_attention": (patterns.JointBlock, lambda: [(torch.randn(2, 16, 32), torch.randn(2, 8, 32))]),
    # the text's padding hidden: each rank's slices of text and image, the mask put in their order
    "joint_attention_masked": (patterns.JointBlock,
                               lambda: [(torch.randn(2, 16, 32), torch.randn(2, 8, 32), _keep(8))]),
    "complex_rope_pad": (patterns.ComplexRoPEAttention, lambda: [(torch.randn(2, 16, 32),)]),
    "qk_norm_across_heads": (patterns.CrossHeadQKNorm, lambda: [(torch.randn(2, 16, 32),)]),
    "flatten_tokens": (patterns.TokenMLP, lambda: [(torch.randn(2, 16, 32),)]),
    # [seq, batch, hidden] beside a table of 2 rows at a batch of 2: the batch is dim 1, the table whole
    "seq_first_table": (patterns.SequenceFirst, lambda: [(torch.randn(8, 2, 32), torch.randn(2, 32))]),
    # experts in an nn.ModuleList looped over: the loop's torch.where breaks the graph; each expert's MLP a graph
    "looped_experts": (lambda: patterns.LoopedExperts(32, 64, 4, 2), lambda: [(torch.randn(2, 8, 32),)]),
    "looped_moe_block": (patterns.LoopedMoEBlock, lambda: [(torch.randn(2, 16, 32),)]),
    # one projection for qkv and a gated MLP's pair, split, then chunked and sliced (Flux.2's single blocks)
    "fused_attention_mlp": (patterns.FusedAttentionMLP, lambda: [(torch.randn(2, 16, 32),)]),
    # running sums along the sequence: integer position ids of the kept tokens, a running mean with a gradient
    "running_positions": (patterns.RunningPositions, lambda: [(torch.randn(2, 16, 32), _keep(16))]),
    # experts picked by a mask each and written back in place (DeepSeek's reference MoE, HiDream's)
    "masked_loop_experts": (lambda: patterns.MaskedLoopExperts(32, 64, 4, 2), lambda: [(torch.randn(2, 8, 32),)]),
    "folded_heads_attention": (patterns.FoldedHeadsAttention, lambda: [(torch.randn(2, 8, 32),)]),
    # Sana's block written small: linear attention and a feed-forward of convolutions, each cut over tp as an MLP
    "linear_attention_conv": (patterns.LinearAttentionConvBlock, lambda: [(torch.randn(2, 16, 32),)]),
    # Sana-Video's feed-forward: a partial sum over tp summed, then a convolution over frames cut over cp
    "temporal_conv": (patterns.TemporalConvBlock, lambda: [(torch.randn(2, 16, 32),)]),
    # a UNet's group norms, downsampling and nearest upsampling over an image's rows cut over cp, its resnet
    # block's convolutions colwise and rowwise over tp
    "small_unet": (patterns.SmallUNet, lambda: [(torch.randn(2, 16, 16, 16),)]),
    # the gated delta rule (by rows, float64: exact) over the sequence: each rank's rows from the state the rows
    # before leave; at 30 rows over 8 runs, the 2 that pad the last leave it as it is
    "gated_delta_rule": (lambda: patterns.GatedDeltaRuleBlock().double(),
                         lambda: [(torch.randn(2, 16, 32, dtype=torch.float64),)]),
    "gated_delta_rule_uneven_30": (lambda: patterns.GatedDeltaRuleBlock().double(),
                                   lambda: [(torch.randn(2, 30, 32, dtype=torch.float64),)]),
    # Mamba-2's mixer (its scan by rows, float64: exact): one projection fused [z, x, B, C, dt] cut part by part
    # over tp, B and C of 1 group whole on every rank, of 2 cut by group; over cp, each rank's rows from the state
    # the rows before leave; at 30 rows over 8 runs, the 2 that pad the last leave it as it is
    "state_space_scan": (lambda: patterns.StateSpaceBlock().double(),
                         lambda: [(torch.randn(2, 16, 32, dtype=torch.float64),)]),
    "state_space_scan_groups_2": (lambda: patterns.StateSpaceBlock(groups=2).double(),
                                  lambda: [(torch.randn(2, 16, 32, dtype=torch.float64),)]),
    "state_space_scan_uneven_30": (lambda: patterns.StateSpaceBlock().double(),
                                   lambda: [(torch.randn(2, 30, 32, dtype=torch.float64),)]),
    # Mamba-1's mixer (its scan by rows, float64: exact): in_proj and dt_proj cut by features over tp, x_proj and
    # out_proj by input features, B and C whole on every rank; over cp, each rank's rows from the state the rows
    # before leave; at 30 rows over 8 runs, the 2 that pad the last leave it as it is
    "selective_scan": (lambda: patterns.SelectiveScanBlock().double(),
                       lambda: [(torch.randn(2, 16, 32, dtype=torch.float64),)]),
    "selective_scan_uneven_30": (lambda: patterns.SelectiveScanBlock().double(),
                                 lambda: [(torch.randn(2, 30, 32, dtype=torch.float64),)]),
    # Qwen3-Next's gated norm: heads flattened with the batch and sequence, viewed back
    "gated_head_norm": (patterns.GatedHeadNorm, lambda: [(torch.randn(2, 16, 32),)]),
    # ViT's class token concatenated before the patches a convolution made: cut over cp where they meet
    "class_token": (patterns.ClassTokenBlock, lambda: [(torch.randn(2, 3, 12, 20),)]),
    # PyTorch's nn.TransformerEncoderLayer (key padding, causal mask) and nn.MultiheadAttention with kdim and vdim
    "torch_encoder": (patterns.TorchEncoder, lambda: [(torch.randn(2, 16, 32), ~_keep(16), torch.randn(2, 16, 16))]),
    # causal masks kept in a module buffer (nanoGPT's, GPT-Neo's local window): read as causal attention
    "causal_mask_in_a_buffer": (patterns.BufferMaskedAttention, lambda: [(torch.randn(2, 16, 32),)]),
    "window_mask_in_a_buffer": (lambda: patterns.BufferMaskedAttention("gpt_neo", window=5),
                                lambda: [(torch.randn(2, 16, 32),)]),
    # text and image concatenated before the projections (CogVideoX): each cut as a part of the joint sequence
    "joint_before_projection": (patterns.JointBeforeProjection,
                                lambda: [(torch.randn(2, 16, 32), torch.randn(2, 8, 32))]),
}


def run_cases(rank: int, world: int, *, names: list[str], options: dict | None = None, steps: int = 2,
              inputs: list | None = None, full_tensor: bool = False, dynamic: bool | None = None,
              mesh_sizes: dict | None = None, order: tuple | None = None, mesh_ranks: tuple | None = None,
              dynamo_config: dict | None = None) -> dict:
    """Compare each named case against one device; return metrics and warnings per case.
    ``mesh_ranks``: (global ranks by mesh coordinate, dim names) for a mesh of one's own;
    ``dynamo_config``: Dynamo's options to capture with."""
    if mesh_ranks is not None:
        mesh = DeviceMesh("cpu", mesh_ranks[0], mesh_dim_names=mesh_ranks[1])
    else:
        mesh = dtensor_par.init_mesh(**(mesh_sizes or {"tp": world}), order=order)
    results = {}
    for name in names:
        torch._dynamo.reset()
        torch.manual_seed(0)
        make_model, make_inputs = CASES[name]
        model = make_model()
        backend = dtensor_par.hybrid_parallel(mesh, **{"inner_backend": "aot_eager", **(options or {})})

        def compiled_fn(m):
            compiled = torch.compile(m, backend=backend, dynamic=dynamic)
            return (lambda *a: compiled(*a).full_tensor()) if full_tensor else compiled

        with logged(logging.WARNING) as records, torch._dynamo.config.patch(**(dynamo_config or {})):
            metrics = compare(model, inputs or make_inputs(), compiled_fn, steps=steps)
        results[name] = {**metrics, "warnings": [r.getMessage() for r in records]}
    return results


def run_labelled_cases(world: int, runs: dict[str, dict]) -> list[dict]:
    """Each ``label: run_cases' keyword arguments`` of ``runs`` in one launch of ``world`` gloo
    ranks; each rank's results by label and case, checked by the tests that read them
    (``case_matches``)."""
    return run_ranks_together(world, {label: (run_cases, kwargs) for label, kwargs in runs.items()})


def labelled_cases(runs: dict[int, dict[str, dict]], *labels: str) -> list[tuple[int, str, str]]:
    """``(world, label, case)`` of every case ``runs`` (world size -> label -> ``run_cases``'
    keyword arguments) names under ``labels`` (default: every label), for pytest's parametrize."""
    return [(world, label, name) for world, by_label in runs.items() for label, run in by_label.items()
            if not labels or label in labels for name in run["names"]]


def case_matches(launch, world: int, label: str, name: str, **tolerances) -> dict:
    """Case ``name`` of run ``label`` within the tolerances on every rank of ``launch`` (a
    background job that returns each rank's results by label and case); rank 0's metrics. A
    failure names the run, the case and the world, and prints every rank's numbers."""
    results = launch.result()
    missing = [rank for rank, rank_results in enumerate(results) if name not in rank_results[label]]
    assert not missing, f"{label}: case {name} at world {world} did not run on ranks {missing}"
    return assert_matches(f"{label}: {name} at world {world}", [rank_results[label][name] for rank_results in results],
                          **tolerances)


AUTO = {"machine": "h100-sxm-8", "inner_backend": "aot_eager"}
"""``parallel(auto=True)``'s arguments in ``auto_mesh``."""


def auto_mesh(rank: int, world: int) -> dict:
    """``parallel(auto=True)`` on a 1-layer GPT: its forward and gradients against one device,
    the mesh it built, what it logged; then the error when rank 1 chooses another mesh."""
    torch.manual_seed(0)
    reference = models.GPT(layers=1)
    model = dtensor_par.parallel(auto=True, **AUTO)(models.GPT)(layers=1)
    model.load_state_dict(reference.state_dict())
    x = torch.randn(2, 8, 32)
    with logged(logging.INFO) as records:
        out = model(x)
    loss_of(out).backward()
    loss_of(reference(x)).backward()
    mesh = sharded_state(model).mesh
    result = {"forward": (out - reference(x)).abs().max().item(),
              "grad": max(max_rel(whole(p.grad), q.grad) for p, q in zip(model.parameters(),
                                                                                  reference.parameters())),
              "mesh": dict(zip(mesh.mesh_dim_names, mesh.shape)), "chosen": str(model.mesh_ranking[0]),
              "logged": [r.getMessage() for r in records if "auto=True" in r.getMessage()]}

    def other_on_rank_1(*args, **kwargs):
        ranking = choose(*args, **kwargs)
        mine = ranking[::-1] if rank == 1 else ranking
        return Ranking(mine, ranking.rejected, ranking.machine, ranking.world_size, ranking.training)

    choose = dtensor_par.api.choose_mesh
    with mock.patch.object(dtensor_par.api, "choose_mesh", other_on_rank_1):
        try:
            dtensor_par.parallel(auto=True, **AUTO)(models.GPT)(layers=1)(x)
        except RuntimeError as e:
            result["disagreement"] = str(e)
    return result
