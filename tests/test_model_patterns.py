"""Structures real models emit, planned on their own without hardware: Conv1D linears, joint
(text + image) attention, an MLP beside attention, fused projections sliced by index, masks
built from positions. Their numerics run in tests/test_cp_gloo.py."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx

import dtensor_par
from dtensor_par.errors import InvalidPlan
from dtensor_par.passes.rewrite import PositionalMask, positional_mask
from dtensor_par._testing import models, patterns


def _explain(model, inputs, **mesh):
    report = dtensor_par.explain(model, inputs, **mesh)
    (graph,) = report.graphs
    return graph


def test_conv1d_is_a_linear_with_a_transposed_weight():
    graph = _explain(patterns.Conv1DBlock(), (torch.randn(2, 16, 32),), tp=2, ring=2)
    assert graph.placements == ["attention0: c_attn_w=IS(1,[32, 32, 32]), c_proj_w=S(0)"], graph.placements
    assert graph.coverage.fallback_gathers == [] and graph.coverage.sharded_linear_flops == graph.coverage.linear_flops


def test_joint_attention_single_stream_mlp_and_sliced_fused_qkv_stay_split():
    inputs = (torch.randn(2, 16, 32), torch.randn(2, 8, 32))
    for mesh in ({"tp": 2, "ulysses": 2}, {"tp": 2, "ring": 2}, {"tp": 2, "ring": 2, "ulysses": 2}):
        graph = _explain(patterns.JointBlock(), inputs, **mesh)
        assert graph.coverage.fallback_gathers == [], (mesh, graph.coverage.fallback_gathers)
        assert graph.coverage.parallel_sites == len(graph.sites) == 2, graph.sites
    assert any("proj_mlp.weight=S(0)" in p and "proj_out.weight=IS(1,[32, 64])" in p for p in graph.placements)
    assert any("qkv.weight=IS(0,[32, 16, 16])" in p for p in graph.placements)


def test_a_projection_split_into_parts_split_again_is_cut_part_by_part():
    """Flux.2's single block: qkv and the MLP's pair split off one projection, qkv chunked into
    q, k and v, the pair sliced into gate and up. Each of the five parts is cut over tp (before:
    the two pieces only, so the chunk and the slices gathered them: 3 fallback gathers)."""
    for mesh in ({"tp": 2}, {"tp": 2, "ulysses": 2}):
        graph = _explain(patterns.FusedAttentionMLP(), (torch.randn(2, 16, 32),), **mesh)
        assert graph.coverage.fallback_gathers == [], (mesh, graph.coverage.fallback_gathers)
        assert graph.coverage.sharded_linear_flops == graph.coverage.linear_flops, graph.coverage.summary()
    assert any("fused.weight=IS(0,[32, 32, 32, 64, 64])" in p and "out.weight=IS(1,[32, 64])" in p
               for p in graph.placements), graph.placements


def test_parts_are_read_past_ops_that_keep_each_feature_apart():
    """Mamba-2's projection ``[z, x, B, C, dt]`` split, x, B and C transposed, convolved, SiLU,
    transposed back and split again: five parts (before: the second split gathered). Zamba2's
    gate and up with a low-rank adapter's added, then chunked: both projections cut in two parts
    (before: the chunk gathered); the adapter's first projection, to its rank, lies outside the
    site, whole on every rank, and is named (a fifth of this block's linear FLOPs)."""
    graph = _explain(patterns.StateSpaceBlock(), (torch.randn(2, 16, 32),), tp=2)
    assert graph.coverage.fallback_gathers == [] and graph.warnings == [], graph.warnings
    assert any("mixer.in_proj.weight=IS(0,[32, 32, 4, 4, 4])" in p for p in graph.placements), graph.placements
    graph = _explain(patterns.AdaptedGateUp(), (torch.randn(2, 16, 32),), tp=2)
    assert graph.coverage.fallback_gathers == [] and graph.warnings == [
        "1 block linears outside every attention and MLP site run whole on every rank of some mesh dim, 20.0% of the "
        "block linears' FLOPs; the largest: adapter.0.weight (20.0%)"], graph.warnings
    assert any("gate_up.weight=IS(0,[64, 64])" in p and "adapter.1.weight=IS(0,[64, 64])" in p
               for p in graph.placements), graph.placements


def test_mamba1s_mixer_is_one_site_with_x_proj_inside():
    """Mamba-1's mixer: in_proj and dt_proj (``dt_proj.weight @ x``, read as a linear) cut by
    their output features, x_proj (B and C for every channel, dt_proj's input) and out_proj by
    their input features, one site (``MLPSite.inner``): x_proj's partial sums reduced once, the
    scan on each rank's channels. Before, in_proj to x_proj was a site, dt_proj ran whole on every
    rank and out_proj was gathered."""
    graph = _explain(patterns.SelectiveScanBlock(), (torch.randn(2, 16, 32),), tp=2)
    assert graph.coverage.fallback_gathers == [] and graph.warnings == [], graph.warnings
    assert graph.coverage.sharded_linear_flops == graph.coverage.linear_flops, graph.coverage.summary()
    assert graph.placements == ["mlp0: mixer.in_proj.weight=IS(0,[64, 64]), mixer.dt_proj.weight=S(0), "
                                "mixer.conv1d.weight=R, mixer.x_proj.weight=S(1), mixer.out_proj.weight=S(1)"], \
        graph.placements


def test_a_model_without_any_parallel_site_is_reported():
    odd_mlp = torch.nn.Sequential(torch.nn.Linear(32, 18), torch.nn.GELU(), torch.nn.Linear(18, 32))
    graph = _explain(odd_mlp, (torch.randn(2, 8, 32),), tp=4)
    assert graph.coverage.parallel_sites == 0
    assert any("none of the 1 attention and MLP sites runs parallel" in w for w in graph.warnings)


def _mask_node(build) -> fx.Node:
    """The node computing ``build()`` in the graph Dynamo captures around it."""
    graphs = []

    def keep(gm, inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(lambda x: (x, build()), backend=keep)(torch.ones(1))
    output = next(n for n in graphs[0].graph.nodes if n.op == "output")
    return output.args[0][-1]


def _mask_graph(build, keep: torch.Tensor) -> fx.Node:
    """The mask node ``build(keep)`` makes in the graph Dynamo captures, ``keep`` a graph input."""
    graphs = []

    def capture(gm, inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(lambda k: build(k), backend=capture)(keep)
    for node in graphs[0].graph.nodes:  # the values capture_pass gives every node
        node.meta["val"] = node.meta.get("example_value")
    output = next(n for n in graphs[0].graph.nodes if n.op == "output")
    return output.args[0][0]


def test_masks_built_from_positions_are_recognized_exactly():
    def causal():
        i = torch.arange(6)
        return (i[None, :] <= i[:, None])[None, None].expand(2, 1, 6, 6)

    def window():
        i = torch.arange(6)
        return (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < 3)

    def additive():
        i = torch.arange(6)
        return torch.zeros(6, 6).masked_fill(i[None, :] > i[:, None], float("-inf"))

    def biased():
        i = torch.arange(6)
        return (i[None, :] - i[:, None]).float().clamp(max=0)

    def bidirectional_window():
        i = torch.arange(6)
        return (i[:, None] - i[None, :]).abs() < 3

    assert positional_mask(_mask_node(causal), 6, 6) == positional_mask(_mask_node(additive), 6, 6) == PositionalMask()
    assert positional_mask(_mask_node(window), 6, 6) == PositionalMask(window=3)
    for build in (biased, bidirectional_window):
        assert positional_mask(_mask_node(build), 6, 6) is None, build
    assert positional_mask(_mask_node(causal), 6, 5) is None


def test_masks_with_key_padding_are_recognized_exactly():
    """transformers' spelling: ``window & keep[batch_indices, kv_indices]``; also ``keep[:, None, None, :]``."""
    def transformers_style(keep):
        q, kv, b = torch.arange(6)[None, None, :, None], torch.arange(6)[None, None, None, :], torch.arange(2)
        positions = (kv <= q) & (kv > q - 3)
        return (positions & keep[b[:, None, None, None], kv]).expand(2, 1, 6, 6)

    def sliced(keep):
        i = torch.arange(6)
        return keep[:, None, None, :] & (i[None, :] <= i[:, None])

    def wrong_columns(keep):  # keys reversed: not the key padding
        i = torch.arange(6)
        return (i[None, :] <= i[:, None]) & keep[torch.arange(2)[:, None, None, None], i.flip(0)[None, None, None, :]]

    def by_query(keep):  # a query padding: not exact key padding
        i = torch.arange(6)
        return (i[None, :] <= i[:, None]) & keep[:, None, :, None]

    def or_padding(keep):
        i = torch.arange(6)
        return (i[None, :] <= i[:, None]) | keep[:, None, None, :]

    keep = torch.ones(2, 6, dtype=torch.bool)
    found = positional_mask(_mask_graph(transformers_style, keep), 6, 6)
    assert found.window == 3 and found.key_padding.op == "placeholder", found
    found = positional_mask(_mask_graph(sliced, keep), 6, 6)
    assert found.window is None and found.key_padding.op == "placeholder", found
    for build in (wrong_columns, by_query, or_padding):
        assert positional_mask(_mask_graph(build, keep), 6, 6) is None, build
    assert positional_mask(_mask_graph(sliced, keep.long()), 6, 6) is None  # integer & is bitwise


def test_complex_rope_pad_and_like_ops_stay_split():
    for mesh in ({"tp": 2, "ulysses": 2}, {"tp": 2, "ring": 2}):
        graph = _explain(patterns.ComplexRoPEAttention(), (torch.randn(2, 16, 32),), **mesh)
        assert graph.coverage.fallback_gathers == [], (mesh, graph.coverage.fallback_gathers)
        assert graph.coverage.parallel_sites == 1


def test_attention_flops_per_ring_rank_are_reported_and_balanced_when_causal():
    causal = _explain(models.Llama(layers=1), (torch.randint(0, 50, (2, 32)),), ring=4).coverage
    masked = _explain(patterns.MaskedAttention("additive"), (torch.randn(2, 32, 32), torch.ones(2, 32, dtype=torch.bool)),
                      ring=4).coverage
    (per_rank,), (whole,) = causal.ring_attention_flops.values(), masked.ring_attention_flops.values()
    assert len(per_rank) == 4 and len(set(per_rank)) == 1  # zigzag: every ring rank does the same work
    pairs = 32 * 32  # (query, key) pairs of one head; 4 FLOPs per pair and head dim
    assert sum(whole) == 4 * 2 * 4 * 8 * pairs  # a mask: every block computed whole (batch 2, 4 heads of 8)
    full = 4 * 2 * 8 * 8 * pairs  # Llama: batch 2, 8 heads of 8
    assert full / 2 < sum(per_rank) < full  # causal: about half


def test_a_causal_mask_kept_in_a_buffer_runs_as_causal_attention():
    """nanoGPT's ``tril`` buffer and GPT-Neo's (a local window too) are read at their values: the
    ring then skips the blocks they hide (and, causal, balances the rest: zigzag), and keeps no
    mask. A
    model on the meta device has no values to read: its mask is kept, or (GPT-Neo's lowest
    finite fill, which could hide a row entirely) its attention runs as written, saying why."""
    x = torch.randn(2, 32, 32)
    whole = 4 * 2 * 4 * 8 * 32 * 32  # every block computed whole (batch 2, 4 heads of 8)
    for spelling, window in (("nanogpt", None), ("gpt_neo", None), ("gpt_neo", 5)):
        graph = _explain(patterns.BufferMaskedAttention(spelling, window), (x,), ring=4)
        (per_rank,) = graph.coverage.ring_attention_flops.values()
        balanced, skipped = len(set(per_rank)) == 1, sum(per_rank) < (whole / 4 if window else whole * 5 / 8)
        assert skipped and (balanced or window), (spelling, window, per_rank)  # a window skips unevenly
        assert graph.warnings == [], graph.warnings
    # under dynamic=True the scale is made of sizes (head_dim ** 0.5): read at its value, the plan pinned to it
    graph = _explain(patterns.BufferMaskedAttention(), (x,), ring=4, dynamic=True)
    assert graph.warnings == [] and graph.coverage.ring_attention_flops, graph.warnings
    with torch.device("meta"):
        nanogpt, gpt_neo = patterns.BufferMaskedAttention(), patterns.BufferMaskedAttention("gpt_neo")
    (per_rank,) = _explain(nanogpt, (x.to("meta"),), ring=4).coverage.ring_attention_flops.values()
    assert sum(per_rank) == whole
    graph = _explain(gpt_neo, (x.to("meta"),), ring=4)
    assert any("runs op by op" in w and "meta device" in w for w in graph.warnings), graph.warnings


def test_linear_attention_and_a_feed_forward_of_convolutions_are_cut_over_tp():
    """Sana's block: linear attention is an MLP site (relu of q and k viewed as heads, their
    products with v head by head), cut by heads from its q, k, v projections to its out one; the
    feed-forward's pointwise convolutions are colwise (its gate chunked off after the depthwise
    convolution: part by part) and rowwise, the depthwise one cut with the channels. One
    all-reduce each in forward; before, both ran whole (15% of Sana's block FLOPs sharded)."""
    graph = _explain(patterns.LinearAttentionConvBlock(), (torch.randn(2, 16, 32),), tp=2)
    assert graph.placements == ["mlp0: q.weight=S(0), k.weight=S(0), v.weight=S(0), out.weight=S(1)",
                                "mlp1: up.weight=IS(0,[48, 48]), depthwise.weight=IS(0,[48, 48]), down.weight=S(1)"]
    cov = graph.coverage
    assert cov.sharded_linear_flops == cov.linear_flops and cov.fallback_gathers == [], cov.summary()
    forward = [(c["op"], c["site"]) for c in graph.collectives if c["direction"] == "forward"]
    assert sorted(forward) == [("all_reduce", "mlp0.rowwise"), ("all_reduce", "mlp1.rowwise")], forward


def test_heads_flattened_with_the_batch_and_sequence_for_a_norm_stay_cut_over_tp_and_cp():
    """Qwen3-Next's gated norm: attention's heads and a gate's, each viewed ``[B * S * H, d]``,
    normed per row and gated, then viewed back ``[B, S, H * d]``. Canonicalize runs the norm and
    the gate on the rows unflattened, ``[B, S, H, d]``: the heads stay cut over tp and the
    sequence over cp (before: its rows would be cut part by part over both at once, and cp
    gathered them; exact: test_cp_gloo, case gated_head_norm)."""
    inputs = (torch.randn(2, 16, 32),)
    for sizes in ({"tp": 2}, {"tp": 2, "ulysses": 2}):
        graph = _explain(patterns.GatedHeadNorm(), inputs, **sizes)
        cov = graph.coverage
        assert graph.warnings == [] and cov.sharded_linear_flops == cov.linear_flops, (sizes, graph.warnings)


def test_a_norm_between_a_projection_and_an_mlp_makes_no_mlp_of_them():
    """An MLP's activation lies on the path between its projections. A written-out RMSNorm's
    ``rsqrt`` of a mean lies beside the residual stream: before, a projection before the norm
    (DiffLlama's out projection, not then read as attention's) was taken with the MLP's gate as
    an MLP (colwise, rowwise), and the MLP's down projection gathered its input."""
    graph = _explain(patterns.NormBetweenLinears(), (torch.randn(2, 8, 32),), tp=2)
    assert graph.placements == ["mlp0: up.weight=S(0), gate.weight=S(0), down.weight=S(1)"], graph.placements
    assert graph.warnings == [], graph.warnings


def test_a_class_token_concatenated_before_the_patches_is_cut_with_them_where_they_meet():
    """ViT: a class token concatenated before patches a convolution made, a sequence of 16. The
    patches alone (15) cannot be cut beside the one class token, but their concatenation can:
    cut over cp where it is made, every linear after it runs on each rank's tokens, the patch
    convolution alone whole (before: the block's q, k, v projections ran whole too)."""
    graph = _explain(patterns.ClassTokenBlock(), (torch.randn(2, 3, 12, 20),), ulysses=2)
    cov = graph.coverage
    assert graph.warnings == [] and cov.linear_flops - cov.sharded_linear_flops == 2 * 2 * 15 * 32 * (3 * 4 * 4)


def test_pytorchs_own_multihead_attention_is_written_out_and_sharded():
    """``nn.TransformerEncoderLayer`` and ``nn.MultiheadAttention`` (keys and values of their own
    width) call ``F.multi_head_attention_forward``, one opaque op: its projections ran whole on
    every rank, and coverage counted none of their FLOPs (it read 100% sharded). Written out, each
    is an attention site (exact: test_tp_gloo and test_cp_gloo, case torch_encoder). In eval
    without gradients PyTorch takes a fused fast path instead: a warning says so and how to
    avoid it."""
    inputs = (torch.randn(2, 16, 32), torch.zeros(2, 16, dtype=torch.bool), torch.randn(2, 16, 16))
    graph = _explain(patterns.TorchEncoder(), inputs, tp=2, ring=2)
    assert graph.placements[:2] == [
        "attention0: layer.self_attn.in_proj_weight=IS(0,[32, 32, 32]), layer.self_attn.out_proj.weight=S(1)",
        "attention1: cross.q_proj_weight=S(0), cross.k_proj_weight=S(0), cross.v_proj_weight=S(0), "
        "cross.out_proj.weight=S(1)"], graph.placements
    assert graph.warnings == [] and graph.coverage.sharded_linear_flops == graph.coverage.linear_flops
    model = torch.nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True).eval()
    with torch.no_grad():
        (warning,) = _explain(model, inputs[:1], tp=2).warnings
    assert "fused fast path" in warning and "set_fastpath_enabled(False)" in warning, warning


def test_a_convolution_over_frames_after_a_rowwise_mlp_sums_it_then_fetches_its_halo():
    """Sana-Video's feed-forward: the MLP's partial sums, viewed as a frames x positions grid, are
    all-reduced over tp (the MLP's own all-reduce, named by its site, not a fallback), then the
    convolution over frames cut over cp fetches one halo frame each side. Before, localize
    crashed: the all-reduce it had inserted carried no global shape."""
    graph = _explain(patterns.TemporalConvBlock(), (torch.randn(2, 16, 32),), tp=2, ulysses=2)
    assert graph.warnings == [] and graph.coverage.fallback_gathers == []
    forward = [(c["op"], c["mesh_dims"], c["site"]) for c in graph.collectives if c["direction"] == "forward"]
    assert ("all_reduce", "tp", "mlp1.rowwise") in forward and ("all_gather", "cp", "-") in forward, forward


def test_a_resnet_block_is_an_mlp_site_over_tp_and_the_residual_stream_is_not():
    """A UNet's resnet block (group norm, activation, 3 x 3 convolution, group norm, activation,
    3 x 3 convolution) is an MLP site over tp: its first convolution colwise, its group norm on
    each rank's groups (weight and bias cut with them), its second rowwise, one all-reduce. A
    convolution whose output also feeds a residual is no up projection: the downsampling one,
    whose output the half-resolution attention adds to, stays whole, as does the last one.
    Before, only 1 x 1 convolutions were projections: every convolution here ran whole."""
    graph = _explain(patterns.SmallUNet(), (torch.randn(2, 16, 16, 16),), tp=2)
    assert graph.warnings == [] and graph.coverage.fallback_gathers == []
    assert "mlp0: mlp up=['conv1'] down=['conv2'] activations=['silu_1']" in graph.sites, graph.sites
    held = {p["name"]: p["placement"]["tp"] for p in graph.parameters}
    cut = [held[name] for name in ("conv1.weight", "norm2.weight", "norm2.bias", "conv2.weight")]
    assert cut == ["S(0)", "S(0)", "S(0)", "S(1)"], held
    assert held["down.weight"] == held["conv_out.weight"] == "R", held


def test_parts_of_unequal_sizes_are_held_whole_and_sliced_under_parallelize():
    """No DTensor placement cuts a fused qkv part by part into unequal parts (GQA's [32, 16, 16]):
    under parallelize it is held whole and sliced at each call, its gradient all-gathered over
    tp, and its site runs cut (before: the site stayed replicated)."""
    inputs = (torch.randn(2, 16, 32), torch.randn(2, 8, 32))
    graph = _explain(patterns.JointBlock(), inputs, tp=2, parallelized=True)
    unequal = [w for w in graph.warnings if "no DTensor placement describes" in w]
    assert any("qkv" in w and "[32, 16, 16]" in w and "held whole" in w for w in unequal), graph.warnings
    assert graph.coverage.parallel_sites == 2
    (held,) = [p for p in graph.parameters if p["name"] == "qkv.weight"]
    assert held["bytes_per_rank"] == held["bytes"] and held["local_shape"] == [32, 32], held
    assert held["placement"]["tp"] == "whole, sliced IS(0,[32, 16, 16]) at each call", held
    gathered = [c["bytes_per_rank"] for c in graph.collectives if c["site"] == "parameter gradient"]
    # qkv's weight and bias pieces, and proj_out's, whose input features are cut part by part too
    # (the attention's 32 and the MLP's 64)
    assert gathered == [32 * 32 * 4, 32 * 4, 32 * 48 * 4], graph.collectives


class _NarrowedQKV(torch.nn.Module):
    """A fused GQA projection cut by ``narrow`` into parts of unequal sizes."""

    def __init__(self):
        super().__init__()
        self.qkv, self.out = torch.nn.Linear(32, 64), torch.nn.Linear(32, 32)

    def forward(self, x):
        b, s, _ = x.shape
        qkv = self.qkv(x)
        q, k, v = qkv.narrow(-1, 0, 32), qkv.narrow(-1, 32, 16), qkv.narrow(2, 48, 16)
        q, k, v = (t.view(b, s, -1, 8).transpose(1, 2) for t in (q, k, v))
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        return self.out(a.transpose(1, 2).reshape(b, s, 32))


def test_a_fused_projection_cut_by_narrow_is_cut_part_by_part():
    graph = _explain(_NarrowedQKV(), (torch.randn(2, 8, 32),), tp=2)
    assert graph.placements == ["attention0: qkv.weight=IS(0,[32, 16, 16]), out.weight=S(1)"], graph.placements
    assert graph.coverage.fallback_gathers == []


class _GroupedQKV(torch.nn.Module):
    """Falcon's fused qkv: per kv group, its query heads then a key and a value, viewed into
    (groups, members, head_dim) at once, or first into (heads, head_dim) as transformers 5.25
    does."""

    def __init__(self, at_once: bool):
        super().__init__()
        self.at_once = at_once
        self.qkv, self.out = torch.nn.Linear(32, 48), torch.nn.Linear(32, 32)  # 2 groups of 4 + 2 heads of 4

    def forward(self, x):
        b, s, _ = x.shape
        qkv = self.qkv(x)
        grouped = qkv.view(b, s, 2, -1, 4) if self.at_once else qkv.view(b, s, -1, 4).view(b, s, 2, -1, 4)
        q = grouped[..., :-2, :].flatten(-3, -2).transpose(1, 2)
        k, v = (grouped[..., i, :].transpose(1, 2) for i in (-2, -1))
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        return self.out(a.transpose(1, 2).reshape(b, s, 32))


@pytest.mark.parametrize("at_once", [True, False])
def test_a_grouped_qkv_viewed_in_one_view_or_two_is_cut_by_group(at_once):
    graph = _explain(_GroupedQKV(at_once), (torch.randn(2, 8, 32),), tp=2)
    assert graph.placements == ["attention0: qkv.weight=S(0), out.weight=S(1)"], graph.placements
    assert graph.coverage.fallback_gathers == [] and "8 heads, 2 kv heads" in graph.sites[0], graph.sites


class _RotaryPairsBeforeHeads(torch.nn.Module):
    """Rotary embedding on pairs of the projection's features, split before its heads are
    (LTX-Video's ``unflatten(2, (-1, 2))``): 16 pairs inside the 4 heads."""

    def __init__(self):
        super().__init__()
        self.qkv, self.out = torch.nn.Linear(32, 96), torch.nn.Linear(32, 32)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        re, im = q.unflatten(2, (-1, 2)).unbind(-1)
        q = q * 0.5 + torch.stack([-im, re], dim=-1).flatten(2) * 0.25
        q, k, v = (t.unflatten(2, (4, -1)).transpose(1, 2) for t in (q, k, v))
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        return self.out(a.transpose(1, 2).reshape(b, s, 32))


def test_a_split_inside_the_heads_beside_them_leaves_them_cut_by_head():
    graph = _explain(_RotaryPairsBeforeHeads(), (torch.randn(2, 8, 32),), tp=2)
    assert graph.placements == ["attention0: qkv.weight=IS(0,[32, 32, 32]), out.weight=S(1)"], graph.placements
    assert graph.coverage.fallback_gathers == [] and "4 heads, 4 kv heads" in graph.sites[0], graph.sites


class _HeadDimOuterProjection(torch.nn.Module):
    """A projection viewed with its head dim outermost, ``(head_dim, heads)``: no grouping of
    heads that tp could shard by."""

    def __init__(self):
        super().__init__()
        self.qkv, self.out = torch.nn.Linear(32, 96), torch.nn.Linear(32, 32)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (t.view(b, s, 8, 4).permute(0, 3, 1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        return self.out(a.transpose(1, 2).reshape(b, s, 32))


def test_a_head_layout_that_cannot_be_read_names_its_view_under_tp():
    with pytest.raises(InvalidPlan, match=r"attention 'a': the head layout of 'q' cannot be read: .* split by the "
                                          r"view 'view' \[2, 8, 32\] -> \[2, 8, 8, 4\], whose outer sizes \[8\] do not "
                                          r"group the 4 heads the attention reads, so tp=2 cannot shard them"):
        _explain(_HeadDimOuterProjection(), (torch.randn(2, 8, 32),), tp=2)
    assert _explain(_HeadDimOuterProjection(), (torch.randn(2, 8, 32),), ulysses=2).sites  # no heads sharded by tp
