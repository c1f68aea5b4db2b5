"""Each pass on its own, on a fake process group."""

from __future__ import annotations

import operator
import re

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

import dtensor_par
from dtensor_par.errors import InvalidPlan
from dtensor_par.passes.capture import capture_graphs
from dtensor_par.planning import parallelize_graph
from dtensor_par.mesh import MeshInfo
from dtensor_par.ops.position_bias import PositionBias
from dtensor_par.passes.sites import AttentionSite, MLPSite
from dtensor_par.passes.meta import buffer_value
from dtensor_par.passes.nodes import arguments, target_name, tensor_inputs, tensor_val
from dtensor_par.passes.rewrite import gqa_repeat
from dtensor_par.passes.rules.registry import op_kind
from dtensor_par.passes.rules.views import sequence_start
from dtensor_par.passes.rules.indexing import _index_map
from dtensor_par.passes.rules.views import view_target
from dtensor_par.passes.steps import named, steps
from dtensor_par.placements import InterleavedShard, Replicate, Shard, local_chunk
from dtensor_par._testing import models, patterns
from tests.conftest import plan_graph

CAPTURED = steps(last="specialize")
"""The steps that read Dynamo's graph: capture, expert_loop, specialize."""


def test_capture_names_parameters_and_specializes_symbolic_sizes(fake_world):
    fake_world(2)
    (gm, inputs), = capture_graphs(models.GPTBlock(), torch.randn(2, 8, 32), dynamic=True)
    sizes = iter([3, 5])
    concrete = [next(sizes) if isinstance(i, torch.SymInt) else
                torch.randn(3, 5, 32) if isinstance(i, torch.Tensor) and i.dim() == 3 else i for i in inputs]
    gm, ctx = parallelize_graph(gm, concrete, MeshInfo.from_mesh(dtensor_par.init_mesh(tp=2)), steps=CAPTURED)
    assert sorted(p.fqn for p in ctx.params.values()) == sorted(
        ["ln1.weight", "ln1.bias", "qkv.weight", "qkv.bias", "proj.weight", "proj.bias",
         "ln2.weight", "ln2.bias", "fc.weight", "fc.bias", "fc_out.weight", "fc_out.bias"])
    views = [n for n in gm.graph.nodes if n.target == "view"]
    assert len(views) == 3 and all(n.args[1:3] == (3, 5) for n in views)
    assert not any(isinstance(n.meta.get("val"), torch.SymInt) for n in gm.graph.nodes if n.op != "placeholder")


class CountingMaskedAttention(patterns.BufferMaskedAttention):
    """A causal mask kept in a buffer, beside a buffer the forward writes (a step counter)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("steps", torch.zeros(()))

    def forward(self, x):
        self.steps.add_(1)
        return super().forward(x)


def test_capture_keeps_the_values_of_the_buffers_the_graph_only_reads():
    """A buffer's value may be read as a constant (``meta.BufferValue``) only if the graph never
    writes it, and only where it has one (not on the meta device)."""
    gm, _ = _passes_on(CountingMaskedAttention(), (torch.randn(2, 8, 32),), CAPTURED)
    kept = {n.name: buffer_value(n) for n in gm.graph.nodes if n.op == "placeholder" and buffer_value(n)}
    assert [b.fqn for b in kept.values()] == ["bias"] and not any(b.read for b in kept.values())
    assert torch.equal(next(iter(kept.values())).value, torch.ones(64, 64).tril())
    with torch.device("meta"):
        on_meta = patterns.BufferMaskedAttention()
    gm, _ = _passes_on(on_meta, (torch.randn(2, 8, 32, device="meta"),), CAPTURED)
    assert not any(buffer_value(n) for n in gm.graph.nodes)


def test_detect_finds_fused_qkv_attention_and_mlp(fake_world):
    _, ctx = plan_graph(models.GPTBlock(), [torch.randn(2, 8, 32)], tp=2, steps=CAPTURED + named("detect"))
    attention, mlp = ctx.sites
    assert isinstance(attention, AttentionSite) and isinstance(mlp, MLPSite)
    names = lambda nodes: [ctx.params[n.args[1].name].fqn for n in nodes]  # noqa: E731
    assert names(attention.q) == names(attention.k) == names(attention.v) == ["qkv.weight"]
    assert names(attention.out) == ["proj.weight"]
    assert (attention.num_heads, attention.num_kv_heads) == (4, 4)
    assert names(mlp.up) == ["fc.weight"] and names([mlp.down]) == ["fc_out.weight"]


def test_detect_finds_gated_mlp_and_gqa_heads(fake_world):
    ids = [torch.randint(0, 50, (2, 8))]
    _, ctx = plan_graph(models.Llama(layers=1), ids, tp=2, steps=CAPTURED + named("detect"))
    attention, mlp = ctx.sites
    names = lambda nodes: sorted(ctx.params[n.args[1].name].fqn for n in nodes)  # noqa: E731
    assert (attention.num_heads, attention.num_kv_heads) == (8, 2)
    assert names(attention.k) == ["blocks.0.k_proj.weight"]
    assert names(mlp.up) == ["blocks.0.gate_proj.weight", "blocks.0.up_proj.weight"]
    assert names([mlp.down]) == ["blocks.0.down_proj.weight"]
    assert "lm_head.weight" not in {ctx.params[n.args[1].name].fqn for s in ctx.sites for n in s.colwise + s.rowwise}


class _DenseExperts(nn.Module):
    """Llama 4's experts: every token through every expert (``bmm`` by ``[E, in, out]`` weights),
    summed back over the experts; and a lone product by an ``[E, in, out]`` parameter."""

    def __init__(self, experts: int = 4, hidden: int = 16, inter: int = 8):
        super().__init__()
        self.gate_up = nn.Parameter(torch.randn(experts, hidden, 2 * inter))
        self.down = nn.Parameter(torch.randn(experts, inter, hidden))
        self.lone = nn.Parameter(torch.randn(experts, hidden, hidden))

    def forward(self, x):
        tiled = x.repeat(self.gate_up.shape[0], 1).view(self.gate_up.shape[0], -1, x.shape[-1])
        gate, up = torch.bmm(tiled, self.gate_up).chunk(2, dim=-1)
        out = torch.bmm(up * F.silu(gate), self.down).sum(0)
        return out + torch.bmm(tiled, self.lone).sum(0)


def test_detect_reads_experts_run_on_every_token_as_an_mlp_of_batched_linears(fake_world):
    _, ctx = plan_graph(_DenseExperts(), [torch.randn(6, 16)], tp=2)
    mlp, = ctx.sites
    assert isinstance(mlp, MLPSite)
    assert [ctx.params[n.args[1].name].fqn for n in mlp.up + [mlp.down]] == ["gate_up", "down"]
    placements = {ctx.params[name].fqn: p for name, p in ctx.param_placements.items()}
    assert placements == {"gate_up": InterleavedShard(2, (8, 8)), "down": Shard(1)}
    assert any(w.startswith("bmm_2: the batched product by lone is not read as part of an MLP") for w in ctx.warnings)


def test_rewrite_splits_rowwise_bias_and_expands_gqa_kv(fake_world):
    _, ctx = plan_graph(models.GPTBlock(), [torch.randn(2, 8, 32)], tp=2,
                        steps=CAPTURED + named("detect", "rewrite"))
    attention, mlp = ctx.sites
    for linear in attention.out + [mlp.down]:
        assert len(linear.args) == 2 and not linear.kwargs
        (add,) = linear.users
        assert add.target is operator.add and add.args[1].op == "placeholder"
    model = models.Llama(layers=1, gqa="enable_gqa")
    gm, ctx = plan_graph(model, [torch.randint(0, 50, (2, 8))], tp=4, steps=CAPTURED + named("detect", "rewrite"))
    core = ctx.sites[0].core
    # 2 kv heads for 8 query heads at tp=4: each kv head repeated twice (4 kv heads, one per
    # rank, each serving that rank's 2 query heads), not four times.
    assert core.kwargs["enable_gqa"] is True
    assert [(a.target, a.args[1]) for a in core.args[1:3]] == [("repeat_interleave", 2)] * 2


def _interleaved(t):
    return t.repeat_interleave(2, dim=1)


# Each spelling: (k, v) of 4 heads -> the key and value the attention of 8 query heads reads.
REPEATED_KV = {
    "repeat_kv": lambda k, v: [t[:, :, None, :, :].expand(2, 4, 2, 6, 4).reshape(2, 8, 6, 4) for t in (k, v)],
    "unsqueeze_flatten": lambda k, v: [t.unsqueeze(2).expand(-1, -1, 2, -1, -1).flatten(1, 2) for t in (k, v)],
    "repeat_interleave": lambda k, v: [_interleaved(k), _interleaved(v)],
    "torch.repeat_interleave": lambda k, v: [torch.repeat_interleave(t, 2, dim=-3) for t in (k, v)],
    "read_elsewhere": lambda k, v: [_interleaved(k), _interleaved(v)],  # the key's repeat is read again
    "tiled": lambda k, v: [t[:, None].expand(2, 2, 4, 6, 4).reshape(2, 8, 6, 4) for t in (k, v)],  # head i % 4
    "enable_gqa_set": lambda k, v: [_interleaved(k), _interleaved(v)],
    "different_factors": lambda k, v: [_interleaved(k), v[:, :2].repeat_interleave(4, dim=1)],
    "value_not_repeated": lambda k, v: [_interleaved(k), torch.cat([v, v], dim=1)],
}
LEFT_AS_IS = {"tiled", "enable_gqa_set", "different_factors", "value_not_repeated"}


class RepeatedKV(torch.nn.Module):
    """Attention of 8 query heads on 4 kv heads, repeated as ``REPEATED_KV[spelling]`` does."""

    def __init__(self, spelling: str):
        super().__init__()
        self.spelling = spelling

    def forward(self, q, k, v):
        key, value = REPEATED_KV[self.spelling](k, v)
        out = F.scaled_dot_product_attention(q, key, value, enable_gqa=self.spelling == "enable_gqa_set")
        return out + key.mean() if self.spelling == "read_elsewhere" else out


def _passes_on(model, inputs, run, **sizes):
    """``model``'s graph after the steps ``run``, planned for a mesh of ``sizes`` (no process group)."""
    (gm, example_inputs), = capture_graphs(model, *inputs)
    return parallelize_graph(gm, example_inputs, MeshInfo.for_planning(sizes, "cpu"), steps=run)


class WrittenRows(nn.Module):
    """A row written in place by index (``operator.setitem``, which returns None) before a linear."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(32, 32)

    def forward(self, x):
        x = x.clone()
        x[:, 0] = 0.0
        return self.fc(x)


def test_specialize_takes_dynamos_values_past_calls_that_return_none(monkeypatch):
    """Dynamo records no value for a call that returns None; the graph still needs no second run
    on fakes (``_propagate``), and every node but those calls has its value."""
    def fail(gm, ctx):
        raise AssertionError("specialize ran the graph on fakes again")
    monkeypatch.setattr("dtensor_par.passes.capture._propagate", fail)
    gm, _ = _passes_on(WrittenRows(), (torch.randn(2, 8, 32),), CAPTURED, tp=2)
    assert any(n.target is operator.setitem for n in gm.graph.nodes)
    assert all("val" in n.meta for n in gm.graph.nodes if n.op != "output" and n.target is not operator.setitem)
    assert list(gm.graph.output_node().meta["val"][0].shape) == [2, 8, 32]


class PatchTokens(torch.nn.Module):
    """Tokens made inside the graph: a patch embedding's [B, C, H, W] transposed to [B, S, C]."""

    def __init__(self):
        super().__init__()
        self.embed, self.block = torch.nn.Conv2d(4, 32, 2, stride=2), models.GPTBlock()

    def forward(self, pixels, positions):
        return self.block(self.embed(pixels).flatten(2).transpose(1, 2) + positions)


SEQUENCE_STEPS = CAPTURED + named("detect", "rewrite", "sequence")


def test_parts_concatenated_before_the_projections_are_cut_part_by_part():
    """CogVideoX concatenates text and image tokens before the projections: the text input is cut
    as a part of the joint sequence, so the concatenation holds each rank's piece of each part
    and the split after attention takes them back, nothing gathered."""
    model, inputs = patterns.JointBeforeProjection(), [torch.randn(2, 16, 32), torch.randn(2, 8, 32)]
    _, ctx = _passes_on(model, inputs, SEQUENCE_STEPS, ulysses=2)
    assert ctx.input_cuts.get("cp", {}) == {"l_image_": Shard(1), "l_text_": Shard(1)}, ctx.input_cuts.get("cp", {})
    (graph,) = dtensor_par.explain(model, inputs, ulysses=2).graphs
    assert graph.coverage.fallback_gathers == [] and graph.warnings == [], graph.warnings



def test_sequence_pass_shards_sequence_inputs_and_cuts_sequences_made_inside():
    keep = torch.ones(2, 16, dtype=torch.bool)
    _, ctx = _passes_on(patterns.MaskedAttention("additive"), [torch.randn(2, 16, 32), keep], SEQUENCE_STEPS, ring=2)
    assert ctx.input_cuts.get("cp", {}) == {"l_x_": Shard(1)}  # keep only builds the mask: it stays whole
    gm, ctx = _passes_on(PatchTokens(), [torch.randn(2, 4, 8, 8), torch.randn(16, 32)], SEQUENCE_STEPS, ulysses=2)
    assert ctx.input_cuts.get("cp", {}) == {}  # no input has the sequence's shape: 4 x 4 patches are made inside
    tokens = next(n for n in gm.graph.nodes if n.target == "transpose")  # [2, 16, 32], out of the patches
    (start,) = tokens.users
    assert start.target is sequence_start and [u.target for u in start.users] == [operator.add]
    _, ctx = _passes_on(models.GPTBlock(), [torch.randn(2, 16, 32)], SEQUENCE_STEPS, tp=2)
    assert ctx.input_cuts.get("cp", {}) == {}  # without cp it does nothing


class RotaryTable(nn.Module):
    """Rotary angles read from a table of every position's pairs, as wide (8 pairs) as the
    sequence is long: QwenImage's complex ``[positions, pairs]``, or its real pairs
    ``[positions, pairs, 2]``."""

    def __init__(self, hidden: int = 32, heads: int = 2):
        super().__init__()
        self.heads, self.qkv, self.out = heads, nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)

    def forward(self, x, table):
        b, s, h = x.shape
        freqs = (table if table.is_complex() else torch.view_as_complex(table))[:s, None]
        q, k, v = (t.view(b, s, self.heads, -1) for t in self.qkv(x).chunk(3, dim=-1))
        q, k = (torch.view_as_real(torch.view_as_complex(t.reshape(b, s, self.heads, -1, 2)) * freqs).flatten(3)
                for t in (q, k))
        a = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)))
        return x + self.out(a.transpose(1, 2).reshape(b, s, h))


class PatchesByView(nn.Module):
    """AuraFlow's patches: ``[B, C, H, W]`` viewed into 2 x 2 patches and flattened to
    ``[B, tokens, C x 4]``, embedded by a linear."""

    def __init__(self):
        super().__init__()
        self.embed, self.block = nn.Linear(32, 32), models.GPTBlock()

    def forward(self, pixels, positions):
        b, c, h, w = pixels.shape
        patches = pixels.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).flatten(3).flatten(1, 2)
        return self.block(self.embed(patches) + positions)


def test_sequence_candidates_are_traced_to_the_attention_sequence():
    """A size proposes a sequence; the trace of its cut decides: a rotary table as wide as the
    sequence is long stays whole (complex, or real pairs whose cut meets the sequence's on
    q's head dim), and patches as many as their features (``[2, 32, 32]``) are cut where they
    are made."""
    angles = torch.outer(torch.arange(64.0), torch.arange(8.0) / 8)
    table = torch.polar(torch.ones_like(angles), angles)  # [64, 8]: 8 pairs for 8 tokens
    for spelling in (table, torch.view_as_real(table)):
        _, ctx = _passes_on(RotaryTable(), [torch.randn(2, 8, 32), spelling], SEQUENCE_STEPS, ring=2)
        assert ctx.input_cuts.get("cp", {}) == {"l_x_": Shard(1)}, (spelling.shape, ctx.input_cuts.get("cp", {}))
    gm, _ = _passes_on(PatchesByView(), [torch.randn(2, 8, 8, 16), torch.randn(32, 32)], SEQUENCE_STEPS, ulysses=2)
    (start,) = [n for n in gm.graph.nodes if n.target is sequence_start]
    assert list(tensor_val(start).shape) == [2, 32, 32] and start.args[0].target == "flatten", start.args


BATCH_STEPS = steps(last="batch")


class TimestepBlock(torch.nn.Module):
    """A block modulated by a ``[batch]`` timestep, which reaches attention only through a broadcast."""

    def __init__(self):
        super().__init__()
        self.time, self.block = torch.nn.Linear(16, 64), models.GPTBlock()

    def forward(self, x, t):
        scale, shift = self.time((t[:, None] * torch.arange(1, 17)).sin()).chunk(2, dim=-1)
        return self.block(x * (1 + scale[:, None]) + shift[:, None])


class SwappedAttention(torch.nn.Module):
    """Attention along dim 1 of ``x``, then along its dim 0: both dims are batches."""

    def __init__(self):
        super().__init__()
        self.first, self.second = models.GPTBlock(), models.GPTBlock()

    def forward(self, x):
        return self.second(self.first(x).transpose(0, 1))


def test_batch_pass_cuts_each_input_along_the_dim_its_batch_traces_to():
    """The batch is traced from the sites, not guessed by size: dim 1 of a [seq, batch, hidden]
    input, a [batch] timestep and a key-padding mask cut with it; a 2-row table beside a batch
    of 2 whole; with the batch as long as the sequence, the token ids' dim 0."""
    keep = torch.ones(2, 16, dtype=torch.bool)
    cases = [(patterns.SequenceFirst(), [torch.randn(8, 2, 32), torch.randn(2, 32)], {"l_x_": Shard(1)}, ["l_table_"]),
             (TimestepBlock(), [torch.randn(2, 8, 32), torch.rand(2)], {"l_x_": Shard(0), "l_t_": Shard(0)}, []),
             (patterns.MaskedAttention("bool"), [torch.randn(2, 16, 32), keep], {"l_x_": Shard(0), "l_keep_": Shard(0)},
              []),
             (models.Llama(layers=1), [torch.randint(0, 50, (4, 4))], {"l_ids_": Shard(0)}, [])]
    for model, inputs, cut, whole in cases:
        _, ctx = _passes_on(model, inputs, BATCH_STEPS, dp_shard=2)
        assert (ctx.input_cuts.get("dp", {}), ctx.batch_sized_whole) == (cut, whole), type(model).__name__


def test_batch_pass_refuses_an_input_whose_batch_dim_cannot_be_told():
    with pytest.raises(InvalidPlan, match=r"batch: input 'l_x_' of shape \[2, 2, 32\]: the sites' batch traces back "
                                          r"to more than one of its dims \(dim 0 of size 2 to attention0; dim 1 of "
                                          r"size 2 to attention1\).*batch='local'"):
        _passes_on(SwappedAttention(), [torch.randn(2, 2, 32)], BATCH_STEPS, dp_replicate=2)


def _gated_rows(x, w):
    """Qwen3-Next's gated norm: heads flattened with the rows ``[B * S * H, d]``, normed per row,
    gated by a projection's features flattened alike (``[B, S, H * d]`` viewed ``[-1, d]``)."""
    rows = F.rms_norm(x.view(2, 16, 4, 8).reshape(-1, 8), (8,), w, 1e-6)
    return (rows * F.silu(x.reshape(-1, 8).float())).reshape(2, 16, -1)


def test_rows_flattened_for_ops_row_by_row_run_unflattened():
    """Rows flattened for a norm and a gate, then viewed back, are normed and gated unflattened
    (``[B, S, H, d]``): the same values; no ``[B * S * H, d]`` tensor is left. Rows read by an op
    across them (a softmax over the rows) or not viewed back to sizes given stay flattened."""
    inputs = [torch.randn(2, 16, 32), torch.randn(8)]
    gm, ctx = _passes_on(Spelled(_gated_rows), inputs, steps(last="canonicalize"), ulysses=2)
    assert all(tuple(tensor_val(n).shape) != (128, 8) for n in gm.graph.nodes if tensor_val(n) is not None)
    torch.testing.assert_close(gm(*ctx.example_inputs)[0], _gated_rows(*inputs))
    for kept in (lambda x: x.reshape(-1, 8).softmax(0).reshape(2, 16, -1),  # across the rows
                 lambda x: x.reshape(-1, 8).float().unsqueeze(0)):  # read as rows: not viewed back
        gm, ctx = _passes_on(Spelled(kept), inputs[:1], steps(last="canonicalize"), ulysses=2)
        assert any(tuple(tensor_val(n).shape) == (128, 8) for n in gm.graph.nodes if tensor_val(n) is not None)
        torch.testing.assert_close(gm(*ctx.example_inputs)[0], kept(inputs[0]))


@pytest.mark.parametrize("block, unlike_transformers", [
    (patterns.GatedDeltaRuleBlock, {"normalized": False}), (patterns.StateSpaceBlock, {"dt_softplus": False}),
    (patterns.SelectiveScanBlock, {"dt_softplus": False})])
def test_a_recurrence_traced_from_the_module_wrapping_it_becomes_one_op(block, unlike_transformers):
    """The gated delta rule's, Mamba-2's and Mamba-1's scan's ops, traced from the module
    transformers wraps each in (here their rows one by one, ``dtensor_par._testing.recurrences``), become one
    ``linear_recurrence``, computing the same (Mamba-1's channels-first tensors laid out rows
    first for it, its output laid out back). Called otherwise than transformers calls it (without
    q's and k's l2 norms; time steps without a softplus), its ops stay as traced: the one op calls
    it as transformers does. The output and the final state are told apart by what reads the
    read-out tensor (q; C), not by their shapes: at 4 rows, Mamba-1's are alike."""
    model = block()
    for inputs in ([torch.randn(2, 16, 32)], [torch.randn(2, 4, 32)]):
        gm, ctx = _passes_on(model, inputs, steps(last="canonicalize"), ulysses=2)
        ops = [op_kind(n) for n in gm.graph.nodes if n.op in ("call_function", "call_method")]
        assert ops.count("recurrence") == 1 and len(ops) < 40, ops
        torch.testing.assert_close(gm(*ctx.example_inputs)[0], model(*inputs), atol=1e-6, rtol=1e-6)
    gm, _ = _passes_on(block(**unlike_transformers), inputs, steps(last="canonicalize"), ulysses=2)
    assert "recurrence" not in [op_kind(n) for n in gm.graph.nodes]


@pytest.mark.parametrize("spelling", REPEATED_KV)
def test_canonicalize_turns_repeated_kv_heads_into_enable_gqa(spelling):
    inputs = [torch.randn(2, 8, 6, 4), torch.randn(2, 4, 6, 4), torch.randn(2, 4, 6, 4)]
    model = RepeatedKV(spelling)
    captured, _ = _passes_on(model, inputs, CAPTURED)
    gm, ctx = _passes_on(model, inputs, steps(last="canonicalize"), ulysses=2)
    # Without cp (nothing to send) every spelling is left as it is.
    assert _passes_on(model, inputs, steps(last="canonicalize"), tp=2)[0].code == captured.code
    if spelling in LEFT_AS_IS:
        assert gm.code == captured.code
    else:
        (core,) = [n for n in gm.graph.nodes if n.target is torch._C._nn.scaled_dot_product_attention]
        key, value = core.args[1:3]
        assert key.op == value.op == "placeholder" and core.kwargs["enable_gqa"] is True, core.format_node()
        repeats = [n for n in gm.graph.nodes if n.target in ("expand", "repeat_interleave", torch.repeat_interleave)]
        assert len(repeats) == (1 if spelling == "read_elsewhere" else 0), repeats
    torch.testing.assert_close(gm(*ctx.example_inputs)[0], model(*inputs), atol=1e-6, rtol=1e-6)


class Spelled(torch.nn.Module):
    """A module whose forward is ``fn``: one spelling of an op for canonicalize."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *inputs):
        return self.fn(*inputs)


def _repeat_heads_by_keyword(q, k, v):
    key, value = k.repeat_interleave(repeats=2, dim=1), torch.repeat_interleave(v, repeats=2, dim=1)
    return F.scaled_dot_product_attention(query=q, key=key, value=value)


def _experts_read_per_row(product):
    """transformers' ``batched_mm`` experts (``top-2`` of 4, ``[E, out, in]`` weights), ``product``
    spelling its ``bmm(W[expert_ids], rows[..., None])``."""

    def experts(tokens, logits, gate_up, down):
        weights, chosen = logits.softmax(-1).topk(2)
        ids = chosen.reshape(-1)
        rows = product(gate_up[ids], tokens.repeat_interleave(2, dim=0).unsqueeze(-1)).squeeze(-1)
        gate, up = rows.chunk(2, dim=-1)
        out = product(down[ids], (F.silu(gate) * up).unsqueeze(-1)).squeeze(-1)
        return (out * weights.reshape(-1, 1)).view(tokens.shape[0], 2, -1).sum(1)
    return experts


EXPERTS = [torch.randn(12, 8), torch.randn(12, 4), torch.randn(4, 32, 8) / 8 ** 0.5, torch.randn(4, 8, 16) / 16 ** 0.5]
"""Tokens, router logits, gate_up and down weights scaled as initialized: outputs near 1, where
the grouped matmul's sums (another order than bmm's) stay within a few ulps."""

# Each canonicalize rule: its inputs, and its op spelled by position, by keyword, as a method.
def _mixed(q, k, v):
    """One tensor of a query's 8 heads and a key's and value's one (broadcast)."""
    return q * k + v


def _rotated_tail(x, spelled: str = "dims"):
    """CogView4's rotary embedding of the image tokens after 3 text tokens, written in place
    into a fresh tensor."""
    y = x * 2
    if spelled == "dims":
        y[:, :, 3:, :] = y[:, :, 3:, :].flip(-1) * 0.5
    else:
        y[..., 3:, :] = y[:, :, 3:, :].flip(-1) * 0.5
    return y + 1


def _read_beside_the_write(x):
    """A slice read after the write, taken before it: it sees the write, so stays as written."""
    y = x * 2
    head = y[:, :, :4]
    y[:, :, 3:] = y[:, :, 3:] * 0.5
    return y + head.sum()


def _written_reshaped_back(x):
    """A reshape back to the shape it came from, written in place: a reshape may copy, so it stays."""
    y = (x * 2).flatten(1).view(x.shape)
    y.mul_(3)
    return y


def _written_through_a_view(x):
    """A write into a view of a tensor read after it: the tensor sees the write, so stays as written."""
    y = x * 2
    t = y.transpose(1, 2)
    t[:, 3:] = t[:, 3:] * 0.5
    return y + 1


def _sink_scaled(logsumexp, sigmoid):
    """Granite-SWA's attention: a learned logit per head applied after it, as a scale
    ``sigmoid(logsumexp(scores) - sink)`` of the output."""
    def attention(q, k, v, sinks):
        scores = q @ k.transpose(2, 3) * 0.5
        scale = sigmoid((logsumexp(scores) - sinks.view(1, -1, 1)).to(torch.float32))
        return (F.softmax(scores, dim=-1, dtype=torch.float32) @ v) * scale.unsqueeze(-1)
    return attention


CANONICALIZED = {
    "keywords_as_positions": ([torch.randn(4, 3), torch.randn(3, 5)], [
        lambda a, b: torch.matmul(a, b),
        lambda a, b: torch.matmul(other=b, input=a),  # the rules read a call's tensors in its schema's order
        lambda a, b: a.matmul(other=b)]),
    "conv1d_linear": ([torch.randn(2, 6, 8), torch.randn(8, 4), torch.randn(4)], [
        lambda x, w, b: torch.addmm(b, x.view(-1, 8), w).view(2, 6, 4),
        lambda x, w, b: torch.addmm(input=b, mat1=x.view(-1, 8), mat2=w).view(2, 6, 4),
        lambda x, w, b: b.addmm(mat1=x.view(-1, 8), mat2=w).view(2, 6, 4)]),
    "add_product_as_matmul": ([torch.randn(8, 6, 6), torch.randn(8, 6, 4), torch.randn(8, 4, 6)], [
        lambda bias, q, k: torch.baddbmm(bias, q, k, beta=1.0, alpha=0.25),
        lambda bias, q, k: torch.baddbmm(input=bias, batch1=q, batch2=k, alpha=0.25),
        lambda bias, q, k: bias.baddbmm(batch1=q, batch2=k, beta=1.0, alpha=0.25)]),  # Bloom's ALiBi scores
    "add_product_as_matmul (addmm)": ([torch.randn(12, 4), torch.randn(12, 8), torch.randn(8, 4)], [
        lambda b, x, w: torch.addmm(b, x, w, beta=0.5, alpha=2.0),
        lambda b, x, w: torch.addmm(input=b, mat1=x, mat2=w, beta=0.5, alpha=2.0),
        lambda b, x, w: b.addmm(x, mat2=w, beta=0.5, alpha=2.0)]),
    "outer_as_product": ([torch.randn(8), torch.randn(4)], [  # Flux.2's rotary frequencies
        lambda pos, freqs: torch.outer(pos, freqs),
        lambda pos, freqs: torch.outer(input=pos, vec2=freqs),
        lambda pos, freqs: pos.outer(vec2=freqs)]),
    "sink_scale_as_sink_logits": ([torch.randn(2, 4, 6, 8), torch.randn(2, 4, 6, 8), torch.randn(2, 4, 6, 8),
                                   torch.randn(4)], [
        _sink_scaled(lambda s: torch.logsumexp(s, dim=-1), torch.sigmoid),
        _sink_scaled(lambda s: s.logsumexp(-1, keepdim=False), lambda x: x.sigmoid()),
        _sink_scaled(lambda s: torch.logsumexp(input=s, dim=[3]), F.sigmoid)]),
    "tensor_split_as_split": ([torch.randn(2, 8, 6)], [  # Qwen3-Next's chunks of its padded sequence
        lambda x: _weighted_cat(torch.tensor_split(x, [3, 6], dim=1)),
        lambda x: _weighted_cat(torch.tensor_split(x, indices=[3, 6], dim=1)),
        lambda x: _weighted_cat(x.tensor_split(3, dim=-2))]),  # 8 into 3 sections: [3, 3, 2]
    # weights small enough that outputs are of order 1: the packed projection's rounding stays under the tolerance
    "mha_as_attention": ([torch.randn(6, 2, 8), torch.randn(24, 8) / 5, torch.randn(24) / 5, torch.randn(8, 8) / 5], [
        lambda x, w, b, o: F.multi_head_attention_forward(x, x, x, 8, 2, w, b, None, None, False, 0.0, o, None,
                                                          need_weights=False)[0],
        lambda x, w, b, o: F.multi_head_attention_forward(
            query=x, key=x, value=x, embed_dim_to_check=8, num_heads=2, in_proj_weight=w, in_proj_bias=b, bias_k=None,
            bias_v=None, add_zero_attn=False, dropout_p=0.0, out_proj_weight=o, out_proj_bias=None, need_weights=False)[0]]),
    "mha_as_attention (cross)": ([torch.randn(1, 2, 8), torch.randn(6, 2, 8), torch.randn(24, 8) / 5, torch.randn(24) / 5,
                                  torch.randn(8, 8) / 5], [  # SigLIP's pooling probe over its patches: q apart from k, v
        lambda p, x, w, b, o: F.multi_head_attention_forward(p, x, x, 8, 2, w, b, None, None, False, 0.0, o, None,
                                                             need_weights=False)[0],
        lambda p, x, w, b, o: F.multi_head_attention_forward(
            query=p, key=x, value=x, embed_dim_to_check=8, num_heads=2, in_proj_weight=w, in_proj_bias=b, bias_k=None,
            bias_v=None, add_zero_attn=False, dropout_p=0.0, out_proj_weight=o, out_proj_bias=None, need_weights=False)[0]]),
    "cropped_conv_as_padded": ([torch.randn(2, 4, 8), torch.randn(4, 1, 3)], [  # a causal depthwise convolution
        lambda x, w: F.conv1d(x, w, padding=2, groups=4)[:, :, :8],
        lambda x, w: F.conv1d(input=x, weight=w, padding=2, groups=4)[:, :, :x.shape[-1]],
        lambda x, w: torch.conv1d(x, w, None, 1, 2, 1, 4)[..., :8]]),
    "reshaped_back": ([torch.randn(2, 4, 8), torch.randn(4, 1, 3)], [  # transformers' causal convolution's weight
        lambda x, w: F.conv1d(x, w.squeeze(1).unsqueeze(1), groups=4),
        lambda x, w: F.conv1d(x, torch.unsqueeze(torch.squeeze(w, dim=1), dim=1), groups=4),
        lambda x, w: F.conv1d(x, w.view(4, 3).reshape(4, 1, 3), groups=4)]),
    "copy_into_fresh_out_of_place": ([torch.randn(2, 4)], [  # a linear attention cache's state, made and written
        lambda x: torch.zeros(2, 4).copy_(x * 2) + 1,
        lambda x: torch.zeros_like(x).copy_(x * 2, non_blocking=False) + 1,
        lambda x: x.new_zeros(2, 4).copy_(x * 2) + 1]),
    "narrow_as_slice": ([torch.randn(2, 6, 8)], [
        lambda x: torch.narrow(x, 2, 2, 4),
        lambda x: torch.narrow(x, dim=2, start=2, length=4),
        lambda x: x.narrow(dim=-1, start=2, length=4)]),
    "grouped_kv_attention": ([torch.randn(2, 8, 6, 4), torch.randn(2, 4, 6, 4), torch.randn(2, 4, 6, 4)], [
        lambda q, k, v: F.scaled_dot_product_attention(q, torch.repeat_interleave(k, 2, 1), v.repeat_interleave(2, 1)),
        _repeat_heads_by_keyword]),
    "experts_as_grouped": (EXPERTS, [
        _experts_read_per_row(torch.bmm),
        _experts_read_per_row(lambda w, x: torch.bmm(mat2=x, input=w)),
        _experts_read_per_row(lambda w, x: w.bmm(mat2=x))]),
    "split_features_before_views": ([torch.randn(2, 8, 16), torch.randn(80, 16)], [  # Falcon-7B's multi-query qkv
        lambda x, w: _mixed(*F.linear(x, w).view(2, 8, 10, 8).split([8, 1, 1], dim=2)),
        lambda x, w: _mixed(*torch.split(F.linear(weight=w, input=x).view(2, 8, 10, 8), split_size_or_sections=[8, 1, 1],
                                         dim=2)),
        lambda x, w: _mixed(*F.linear(x, w).view(2, 8, 10, 8).split(split_size=[8, 1, 1], dim=-2))]),
    "slice_write_as_cat": ([torch.randn(2, 4, 8, 6)], [_rotated_tail, lambda x: _rotated_tail(x, "ellipsis")]),
    "elementwise_extreme": ([torch.randn(2, 4, 6, 7), torch.randn(6, 7)], [  # XGLM's clamp of its scores
        lambda x, y: torch.max(x, y) + torch.min(x, y),
        lambda x, y: torch.max(input=x, other=y) + torch.min(other=y, input=x),
        lambda x, y: x.max(other=y) + x.min(y)]),
    "softmax_of_unshifted": ([torch.randn(2, 4, 6, 7)], [  # GPT-OSS's logits less their rows' max
        lambda x: F.softmax(x - x.max(dim=-1, keepdim=True).values, dim=-1),
        lambda x: F.softmax(x - torch.max(x, -1, True)[0], -1),
        lambda x: F.softmax(x - x.amax(dim=3, keepdim=True), dim=-1)]),
}


def _weighted_cat(pieces) -> torch.Tensor:
    """The pieces of a split concatenated back, each times its place: a wrong cut changes it."""
    return torch.cat([piece * (i + 1) for i, piece in enumerate(pieces)], dim=1)


def _canonical_form(gm) -> list:
    """Each call of a graph as its op (the kind the rules know it as), its arguments by name and
    its tensor inputs in the order the rules take them: inputs by name, the other nodes by their
    position (Dynamo orders the inputs as the code first reads them)."""
    position = {n: n.name if n.op == "placeholder" else i for i, n in enumerate(gm.graph.nodes)}
    return [(op_kind(n) or target_name(n), fx.node.map_arg(arguments(n), position.__getitem__), [position[i] for i in tensor_inputs(n)])
            for n in gm.graph.nodes if n.op in ("call_function", "call_method")]


def _read_then_written(x):
    """Mamba's decode step: a state cloned, read through ``.float()`` (the clone itself: float32
    already) into a new tensor, then written whole with it."""
    state = x.clone()
    state.copy_(state.float() * 2 + 1)
    return state + 1


def _aliased_then_written(x):
    """The clone's alias read after the write: it sees the written values."""
    state = x.clone()
    alias = state.float()
    state.copy_(x * 2)
    return alias + 1


@pytest.mark.parametrize("rule", CANONICALIZED)
def test_each_canonicalize_rule_reads_keywords_as_positions(rule):
    """A rule's op called by position, by keyword or as a method canonicalizes alike (Bloom's
    ``alibi.baddbmm(batch1=..., batch2=...)`` included), and the result computes the same."""
    inputs, spellings = CANONICALIZED[rule]
    forms = []
    for fn in spellings:
        gm, ctx = _passes_on(Spelled(fn), inputs, steps(last="canonicalize"), ulysses=2)
        forms.append(_canonical_form(gm))
        torch.testing.assert_close(gm(*ctx.example_inputs)[0], fn(*inputs), atol=1e-6, rtol=1e-6)
    assert all(form == forms[0] for form in forms[1:]), forms
    ops = [op for op, _, _ in forms[0]]
    assert not {"torch.addmm", "torch.baddbmm", "torch.narrow", "torch.outer", "Tensor.outer",
                "torch.tensor_split", "Tensor.tensor_split", "torch.nn.functional.multi_head_attention_forward"} & set(ops), ops
    if rule == "experts_as_grouped":  # sorted by expert, counted, two grouped matmuls, sorted back; no bmm
        assert ops.count("grouped_mm") == 2 and "matmul" not in ops and "histc" in ops, ops
    if rule == "cropped_conv_as_padded":  # padded before only, nothing cropped: a halo before each run over cp
        assert ops == ["conv"] and forms[0][0][1]["pad"] == (2, 0), forms[0]
    if rule == "reshaped_back":  # the convolution reads the weight itself
        assert ops == ["conv"] and forms[0][0][2] == ["l_inputs_0_", "l_inputs_1_"], forms[0]
        gm, ctx = _passes_on(Spelled(_written_reshaped_back), inputs[:1], steps(last="canonicalize"), ulysses=2)
        assert [op for op, _, _ in _canonical_form(gm)].count("view") == 2
        torch.testing.assert_close(gm(*ctx.example_inputs)[0], _written_reshaped_back(*inputs[:1]))
    if rule == "sink_scale_as_sink_logits":  # GPT-OSS's sink logits: a column concatenated, dropped after the softmax
        assert "logsumexp" not in ops and ops.count("softmax") == 1 and "cat" in ops, ops
    if rule == "copy_into_fresh_out_of_place":  # the value written, read in place of the buffer
        assert ops == ["mul", "add"], ops
        for read, rewritten in ((_read_then_written, True), (_aliased_then_written, False)):
            gm, ctx = _passes_on(Spelled(read), inputs, steps(last="canonicalize"), ulysses=2)
            assert any(n.target == "copy_" for n in gm.graph.nodes) != rewritten, gm.graph
            torch.testing.assert_close(gm(*ctx.example_inputs)[0], read(*inputs))
    if rule == "elementwise_extreme":  # of two tensors: no reduction
        assert ops.count("maximum") == 2 and "extreme" not in ops, ops
    if rule == "softmax_of_unshifted":  # a shift along another dim than the softmax's would change it
        assert ops == ["softmax"], ops
        gm, _ = _passes_on(Spelled(lambda x: F.softmax(x - x.amax(2, keepdim=True), -1)), inputs,
                           steps(last="canonicalize"), ulysses=2)
        assert [op for op, _, _ in _canonical_form(gm)] == ["reduce", "sub", "softmax"]
    if rule == "split_features_before_views":  # the projection's features split, each part viewed as its piece
        assert ops[:8] == ["linear", "split", "getitem", "view", "getitem", "view", "getitem", "view"], ops
        assert forms[0][1][1]["split_size"] == [64, 8, 8], forms[0][1]
        gm, _ = _passes_on(Spelled(lambda x, w: _mixed(*F.linear(x, w).view(2, 8, 8, 10).split([8, 1, 1], dim=-1))),
                           inputs,
                           steps(last="canonicalize"), ulysses=2)  # split inside each group: as written
        assert [op for op, _, _ in _canonical_form(gm)][:3] == ["linear", "view", "split"]
    if rule == "slice_write_as_cat":  # out of place: the untouched slice and the value concatenated
        assert "cat" in ops and "setitem" not in ops, ops
        for kept in (_read_beside_the_write, _written_through_a_view):
            gm, ctx = _passes_on(Spelled(kept), inputs, steps(last="canonicalize"), ulysses=2)
            assert "setitem" in [op for op, _, _ in _canonical_form(gm)], kept
            torch.testing.assert_close(gm(*ctx.example_inputs)[0], kept(*inputs))
    if rule == "grouped_kv_attention":
        (_, sdpa, _), = forms[0]
        assert sdpa["enable_gqa"] is True and (sdpa["key"], sdpa["value"]) == ("l_inputs_1_", "l_inputs_2_"), sdpa


def _filled_key(nope, rot):
    """DeepSeek's key: an empty tensor, its first features copied from one piece, the rest from another."""
    key = nope.new_empty(*nope.shape[:-1], nope.shape[-1] + rot.shape[-1])
    key[..., :nope.shape[-1]].copy_(nope)
    key[..., nope.shape[-1]:].copy_(rot.expand(-1, nope.shape[1], -1, -1))
    return key * 2


def _filled_and_read_between(nope, rot):
    """Read before it is filled: not a concatenation, left as written."""
    key = nope.new_empty(*nope.shape[:-1], nope.shape[-1] + rot.shape[-1])
    key[..., :nope.shape[-1]].copy_(nope)
    early = key[..., :1].sum()
    key[..., nope.shape[-1]:].copy_(rot.expand(-1, nope.shape[1], -1, -1))
    return key * early


def test_canonicalize_reads_a_tensor_filled_slice_by_slice_as_their_concatenation():
    inputs = [torch.randn(2, 4, 6, 16), torch.randn(2, 1, 6, 8)]
    gm, ctx = _passes_on(Spelled(_filled_key), inputs, steps(last="canonicalize"), tp=2)
    ops = [op for op, _, _ in _canonical_form(gm)]
    assert "cat" in ops and not {"new_tensor", "Tensor.copy_"} & set(ops), ops
    torch.testing.assert_close(gm(*ctx.example_inputs)[0], _filled_key(*inputs))
    gm, _ = _passes_on(Spelled(_filled_and_read_between), inputs, steps(last="canonicalize"), tp=2)
    assert "Tensor.copy_" in [op for op, _, _ in _canonical_form(gm)]


def _experts_stored_in_out(tokens, logits, up, down, read_between=False):
    """Experts stored ``[E, in, out]`` (``is_transposed``): ``rows.unsqueeze(1) @ W[expert_ids]``."""
    weights, chosen = logits.topk(2)
    ids = chosen.view(-1)
    hidden = torch.relu((tokens.repeat_interleave(2, dim=0).unsqueeze(1) @ up[ids]).squeeze(1))
    out = (hidden.unsqueeze(1) @ down[ids]).squeeze(1).view(tokens.shape[0], 2, -1)
    return (out * weights[..., None]).sum(1) + (hidden.sum() if read_between else 0)


def test_canonicalize_groups_experts_read_a_row_at_a_time():
    """Experts stored ``[E, in, out]`` too, exact forward and backward; a pair whose rows between
    are read elsewhere (their order would change) stays as written, with a warning that says why."""
    tokens, logits = EXPERTS[:2]
    up, down = (torch.randn(*shape) / shape[1] ** 0.5 for shape in [(4, 8, 16), (4, 16, 8)])
    up, down = up.requires_grad_(), down.requires_grad_()
    gm, ctx = _passes_on(Spelled(_experts_stored_in_out), [tokens, logits, up, down], steps(last="canonicalize"))
    ops = [op for op, _, _ in _canonical_form(gm)]
    assert ops.count("grouped_mm") == 2 and "matmul" not in ops, ops
    out = gm(*ctx.example_inputs)[0]
    expected = _experts_stored_in_out(tokens, logits, up, down)
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-6)
    grads = torch.autograd.grad(out.square().sum(), ctx.example_inputs[2:])
    torch.testing.assert_close(grads, torch.autograd.grad(expected.square().sum(), (up, down)), atol=1e-5, rtol=1e-5)
    read_between = Spelled(lambda *xs: _experts_stored_in_out(*xs, read_between=True))
    gm, ctx = _passes_on(read_between, [tokens, logits, up, down], steps(last="canonicalize"))
    assert [op for op, _, _ in _canonical_form(gm)].count("matmul") == 2
    assert any("experts read a row at a time through" in w and "between them" in w for w in ctx.warnings), ctx.warnings


class _MixtralLoop(patterns.LoopedExperts):
    """The loop as transformers wrote Mixtral's from 4.36: ``hidden[None, top_x].reshape(-1, hidden)``,
    the rows cast back to the output's dtype."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        weights, chosen = torch.topk(torch.softmax(self.gate(tokens), dim=1, dtype=torch.float), self.top_k, dim=-1)
        weights = (weights / weights.sum(dim=-1, keepdim=True)).to(x.dtype)
        out = torch.zeros_like(tokens)
        expert_mask = F.one_hot(chosen, num_classes=len(self.experts)).permute(2, 1, 0)
        for expert_idx in range(len(self.experts)):
            idx, top_x = torch.where(expert_mask[expert_idx])
            current = tokens[None, top_x].reshape(-1, x.shape[-1])
            current = self.experts[expert_idx](current) * weights[top_x, idx, None]
            out.index_add_(0, top_x, current.to(x.dtype))
        return out.reshape(x.shape)


def test_capture_makes_a_loop_over_experts_the_experts_read_a_row_at_a_time():
    """Under Dynamo's ``capture_dynamic_output_shape_ops`` an ``nn.ModuleList`` of experts looped
    over is one graph, each expert's ``torch.where`` or mask a size its values make. Capture makes
    each loop (three here, spelled three ways) the experts read a row at a time, their weights
    stacked, and canonicalize the grouped chain: no such size is left, and forward and gradients
    are the loops'."""
    torch.manual_seed(0)
    model = nn.Sequential(patterns.LoopedExperts(32, 64, 4, 2), _MixtralLoop(32, 48, 4, 2), patterns.MaskedLoopExperts(32, 40, 4, 2))
    x = torch.randn(2, 8, 32)
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        gm, ctx = _passes_on(model, [x], steps(last="canonicalize"))
    ops = [op for op, _, _ in _canonical_form(gm)]
    assert ops.count("stack") == 9 and ops.count("grouped_mm") == 9, ops
    assert not any(n.target in (torch.where, operator.setitem) or n.meta.get("unbacked_bindings")
                   for n in gm.graph.nodes)
    out, expected = gm(*ctx.example_inputs)[0], model(x)
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-6)
    params = list(model.parameters())
    torch.testing.assert_close(torch.autograd.grad(out.square().sum(), params),
                               torch.autograd.grad(expected.square().sum(), params), atol=1e-5, rtol=1e-5)


class _RoutedPerPosition(patterns.MaskedLoopExperts):
    """The router run on ``[batch, seq, hidden]``: its weights, and the rows summed over the k
    slots, never shaped ``[tokens, hidden]`` as the rows the experts read."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, chosen = torch.topk(torch.softmax(self.gate(x), dim=-1), self.top_k, dim=-1)
        ids, rows = chosen.view(-1), x.view(-1, x.shape[-1]).repeat_interleave(self.top_k, dim=0)
        out = torch.empty_like(rows)
        for e, expert in enumerate(self.experts):
            out[ids == e] = expert(rows[ids == e])
        return (out.view(*weights.shape, -1) * weights.unsqueeze(-1)).sum(dim=-2)


def test_experts_not_read_as_a_mixture_are_warned_of_by_their_modules():
    """An nn.ModuleList's experts, read a row at a time, whose mixture the planner does not read:
    each grouped matmul is warned of with its experts' modules (before: an internal KeyError
    on the stacked weight)."""
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        (graph,) = dtensor_par.explain(_RoutedPerPosition(32, 64, 4, 2), (torch.randn(2, 8, 32),), tp=2).graphs
    named = [w for w in graph.warnings if "of experts.*.w" in w and "is not read as a mixture of experts" in w]
    cov = graph.coverage
    assert len(named) == 3 and cov.sharded_linear_flops == 0 and cov.rank_linear_flops == cov.linear_flops, named


def test_a_ranks_share_of_the_linear_flops_counts_cuts_on_some_mesh_dims():
    """Experts cut over tp beside a ring that cuts nothing (no attention): no linear is sharded on
    every mesh dim, yet a rank computes half of each expert's FLOPs and all of the router's, and
    the summary says so."""
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        report = dtensor_par.explain(patterns.MaskedLoopExperts(32, 64, 4, 2), (torch.randn(2, 8, 32),), tp=2, ring=2)
    cov, router = report.graphs[0].coverage, 2 * 16 * 32 * 4  # 16 tokens, 32 features, 4 experts
    assert cov.sharded_linear_flops == 0 and cov.rank_linear_flops == router + (cov.linear_flops - router) // 2
    assert f"per rank {cov.rank_linear_flops / cov.linear_flops:.1%} of one device's" in cov.summary(), cov.summary()


def test_attention_with_its_heads_folded_around_a_3d_softmax_is_a_site_of_its_heads():
    """XGLM's attention: heads folded into the batch for ``bmm``, unfolded for the mask, clamped by
    ``torch.max``, folded again for the softmax. It is a site of the heads its query was viewed
    from, which tp cuts (before: no site, its weights replicated, a warning), and over cp it is
    hybrid attention: the clamp changes nothing after a constant finite mask. After a mask given
    as an input, which may hold -inf, or after two (the lowest value added twice is -inf), it
    runs as written over cp, saying why."""
    model, x = patterns.FoldedHeadsAttention(), torch.randn(2, 8, 32)
    (graph,) = dtensor_par.explain(model, (x,), tp=2).graphs
    assert graph.sites[0].startswith("attention0: attention") and "4 heads, 4 kv heads" in graph.sites[0], graph.sites
    assert graph.warnings == [] and graph.coverage.sharded_linear_flops == graph.coverage.linear_flops
    (graph,) = dtensor_par.explain(model, (x,), ulysses=2).graphs
    assert graph.warnings == [] and "attention0: attention hybrid_attention" in graph.sites[0], graph.sites
    mask = torch.full((8, 8), torch.finfo(x.dtype).min).triu(1)
    (graph,) = dtensor_par.explain(model, (x, mask), ulysses=2).graphs
    assert any("runs op by op on the whole sequence over cp: the scores are clamped at the lowest value after a "
               "mask" in w for w in graph.warnings), graph.warnings
    (graph,) = dtensor_par.explain(patterns.FoldedHeadsAttention(masks=2), (x,), ulysses=2).graphs
    assert any("clamped at the lowest value after 2 masks, whose sum may be -inf" in w for w in graph.warnings), \
        graph.warnings


class TransposedWeight(torch.nn.Module):
    """Falcon's ``FalconLinear``: ``x @ self.weight.T``; Mamba's ``dt_proj.weight @ x``, x's
    features at dim -2 (``on_the_left``)."""

    def __init__(self, on_the_left: bool = False):
        super().__init__()
        self.weight, self.on_the_left = torch.nn.Parameter(torch.randn(16, 8)), on_the_left

    def forward(self, x):
        return self.weight @ x.transpose(1, 2) if self.on_the_left else x @ self.weight.T


@pytest.mark.parametrize("on_the_left", [False, True])
def test_canonicalize_turns_a_product_with_a_weight_into_a_linear(on_the_left):
    model, x = TransposedWeight(on_the_left), torch.randn(2, 6, 8)
    gm, ctx = _passes_on(model, (x,), steps(last="canonicalize"), tp=2)
    assert [op for op, _, _ in _canonical_form(gm)].count("linear") == 1
    assert not any(n.target in (operator.matmul, torch.matmul, "matmul") for n in gm.graph.nodes)
    torch.testing.assert_close(gm(*ctx.example_inputs)[0], model(x), atol=1e-6, rtol=1e-6)


class Vmapped(torch.nn.Module):
    """``torch.vmap`` in a forward (transformers' associative scan under Dynamo)."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x):
        return torch.vmap(lambda row: row * row.sum())(self.proj(x))


def test_capture_keeps_the_levels_of_vmap():
    """Dynamo traces ``torch.vmap`` as a level opened (an int), the batched ops, the level
    closed. Capture keeps both calls; before, it folded the level into the ops reading it and
    dropped the calls, and the batched ops failed when run."""
    model, x = Vmapped(), torch.randn(2, 6, 8)
    gm, ctx = _passes_on(model, (x,), CAPTURED, tp=2)
    levels = [n.target.__name__ for n in gm.graph.nodes if "nesting" in getattr(n.target, "__name__", "")]
    assert levels == ["_vmap_increment_nesting", "_vmap_decrement_nesting"], levels
    torch.testing.assert_close(gm(*ctx.example_inputs)[0], model(x), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("heads, kv_heads, divisor, repeat", [
    (8, 2, 2, 1), (8, 2, 4, 2), (8, 2, 8, 4), (12, 3, 2, 2), (8, 1, 4, 4), (12, 4, 8, 3),
])
def test_gqa_repeat_is_the_fewest_that_splits_evenly(heads, kv_heads, divisor, repeat):
    assert gqa_repeat(heads, kv_heads, divisor) == repeat


@pytest.mark.parametrize("src, dst, placement, expected", [
    ((2, 8, 64), (2, 8, 8, 8), Shard(2), Shard(2)),           # split features into heads
    ((2, 8, 8, 8), (2, 8, 64), Shard(2), Shard(2)),           # merge heads back
    ((2, 8, 8, 8), (2, 8, 64), Shard(3), InterleavedShard(2, (8,) * 8)),  # a head_dim shard: its piece of each head
    ((2, 8, 64), (16, 64), Shard(1), InterleavedShard(0, (8, 8))),          # (batch, seq) flattened, seq sharded
    ((16, 64), (2, 8, 64), InterleavedShard(0, (8, 8)), Shard(1)),          # and back
    ((2, 8, 64), (2, 512), Shard(1), Shard(1)),                             # outermost of its run: contiguous
    ((2, 8, 48), (2, 8, 6, 8), Shard(2), None),               # 6 heads do not divide by 4
    ((2, 8, 96), (2, 8, 3, 4, 8), InterleavedShard(2, (32, 32, 32)), Shard(3)),  # fused qkv view
    ((2, 8, 96), (16, 96), InterleavedShard(2, (32, 32, 32)), InterleavedShard(1, (32, 32, 32))),
    ((2, 1, 64), (2, 64), Shard(2), Shard(1)),
])
def test_view_rule(src, dst, placement, expected):
    assert view_target(src, dst, placement, 4) == expected


def test_a_zigzag_sequence_split_into_rows_is_cut_by_its_chunks():
    """16 tokens unpatchified into a 4 x 4 grid (HunyuanVideo's output): over 4 ranks each
    holds one row; in the zigzag layout (4 ranks, 8 chunks of 2 tokens) half rows, which no
    shard of the grid is (before: planned as rows, and the local reshape failed)."""
    assert view_target((2, 16, 16), (2, 1, 4, 4, 16), Shard(1), 4) == Shard(2)
    assert view_target((2, 16, 16), (2, 1, 4, 4, 16), Shard(1), 8) is None


def test_basic_index_keeps_whole_dims():
    assert _index_map((Ellipsis, slice(None, 4)), (2, 3, 5, 8)) == {0: 0, 1: 1, 2: 2}
    assert _index_map((Ellipsis, slice(None, 8)), (2, 3, 5, 8)) == {0: 0, 1: 1, 2: 2, 3: 3}  # whole
    assert _index_map((slice(None), slice(None), None), (2, 3, 5, 8)) == {0: 0, 1: 1, 2: 3, 3: 4}
    assert _index_map((slice(None), -1), (2, 3, 5)) == {0: 0, 2: 1}
    assert _index_map((slice(None), slice(0, None), slice(-5, None)), (2, 3, 5)) == {0: 0, 1: 1, 2: 2}
    assert _index_map((slice(None), slice(1, None)), (2, 3)) == {0: 0}


def test_interleaved_local_chunk_takes_each_part():
    full = torch.arange(12)
    assert local_chunk(full, InterleavedShard(0, (4, 4, 4)), 1, 2).tolist() == [2, 3, 6, 7, 10, 11]
    assert local_chunk(full, Shard(0), 1, 2).tolist() == list(range(6, 12))
    assert local_chunk(full, Replicate(), 1, 2) is full


def test_zigzag_layout_balances_causal_work_across_ring_ranks():
    """16 positions at ring=2 x ulysses=2: ring rank 0 holds chunks 0 and 3 of 4, ring rank 1
    chunks 1 and 2; ulysses splits each ring block. Pieces and assembly are inverse, also
    for a length that needs padding."""
    from dtensor_par.ops.collectives import _assemble, _piece

    cp = MeshInfo.for_planning({"ring": 2, "ulysses": 2}, "cpu").dims["cp"]
    assert cp.zigzag == 2 and cp.size == 4
    x = torch.arange(16)
    pieces = [_piece(x, Shard(0), cp, c).tolist() for c in range(4)]
    assert pieces == [[0, 1, 2, 3], [12, 13, 14, 15], [4, 5, 6, 7], [8, 9, 10, 11]]
    assert _assemble(torch.tensor(pieces), 0, None, cp, None).tolist() == list(range(16))
    # 14 positions are laid out as 16: values padded with copies of the last, gradients
    # with zeros; assembly cuts the padding off.
    pieces = [_piece(torch.arange(14), Shard(0), cp, c).tolist() for c in range(4)]
    assert pieces == [[0, 1, 2, 3], [12, 13, 13, 13], [4, 5, 6, 7], [8, 9, 10, 11]]
    assert _piece(torch.arange(1, 15), Shard(0), cp, 1, edge=False).tolist() == [13, 14, 0, 0]
    assert _assemble(torch.tensor(pieces), 0, None, cp, 14).tolist() == list(range(14))


class SoftmaxGate(nn.Module):
    """A softmax over a matmul's output that is no attention: a gate over experts' scores."""

    def __init__(self):
        super().__init__()
        self.score = nn.Linear(32, 4)

    def forward(self, x):
        return torch.softmax(x @ self.score.weight.t(), dim=-1) * 2.0


class ScoresBesideTheirMean(nn.Module):
    """Scores with a column made from them concatenated before the softmax: no sink logits (one a
    head, the same for every query), so no attention the planner reads."""

    def forward(self, q, k, v):
        scores = q @ k.transpose(-2, -1)
        logits = torch.cat([scores, scores.mean(-1, keepdim=True)], dim=-1)
        return torch.softmax(logits, dim=-1)[..., :-1] @ v


@pytest.mark.parametrize("module, inputs", [(SoftmaxGate, [(2, 8, 32)]), (ScoresBesideTheirMean, [(2, 4, 8, 16)] * 3)])
def test_a_softmax_over_a_product_not_read_as_attention_is_warned_of_by_name(planned, module, inputs):
    _, ctx = planned(module(), [torch.randn(shape) for shape in inputs], tp=2)
    assert any(re.match(r"softmax: a softmax over the product \w+ is not read as attention", w)
               for w in ctx.warnings), ctx.warnings


class WrittenOutAttention(nn.Module):
    """Attention written out by hand as research code has it: scaled, soft-capped scores, a
    causal mask by ``masked_fill`` (or, ``fill="where"``, GPT-Neo's ``where(kept, scores,
    torch.tensor(finfo.min))``; ``"two_masks"``: then a window of 6 keys added as transformers'
    additive mask, as GPT-Neo's local layers apply their two), and a dropout of the probabilities.
    Its values' heads are ``values`` wide (MiMo-V2-Flash's: narrower than q's and k's)."""

    def __init__(self, dropout: float, fill: str = "masked_fill", values: int = 8):
        super().__init__()
        self.q, self.k = nn.Linear(32, 32), nn.Linear(32, 32)
        self.v, self.o = nn.Linear(32, 4 * values), nn.Linear(4 * values, 32)
        self.dropout, self.fill = dropout, fill

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, s, 4, -1).transpose(1, 2) for p in (self.q, self.k, self.v))
        scores = 5.0 * torch.tanh(q @ k.transpose(-2, -1) / 8 ** 0.5 / 5.0)
        hidden = torch.ones(s, s, dtype=torch.bool).triu(1)
        if self.fill == "where":
            scores = torch.where(~hidden, scores, torch.tensor(torch.finfo(scores.dtype).min, dtype=scores.dtype))
        else:
            scores = scores.masked_fill(hidden, float("-inf"))
        if self.fill == "two_masks":
            position = torch.arange(s)
            window = (position[:, None] - position[None, :]).abs() < 6
            scores = scores + torch.where(window, 0.0, torch.finfo(scores.dtype).min)
        probs = F.dropout(scores.softmax(-1), self.dropout, self.training)
        return self.o((probs @ v).transpose(1, 2).reshape(b, s, -1))


@pytest.mark.parametrize("dropout, fill, values", [(0.0, "masked_fill", 8), (0.1, "masked_fill", 8), (0.0, "where", 8),
                                                   (0.0, "two_masks", 8), (0.0, "masked_fill", 6)])
def test_written_out_attention_on_cp_is_hybrid_attention_with_its_score_function(dropout, fill, values):
    """Its scale and soft-capping become the score function, its mask (filled by a number or a
    tensor made of one; two masks applied in a row, as one) ``is_causal`` (with the window), and
    no softmax is left, values narrower than q and k too (before: run op by op); a dropout that
    drops something keeps it as written, with a warning naming the dropout."""
    from dtensor_par.ops.attention import hybrid_attention
    from dtensor_par.ops.score_mod import ScoreMod

    (gm, inputs), = capture_graphs(WrittenOutAttention(dropout, fill, values), torch.randn(2, 16, 32))
    local, ctx = parallelize_graph(gm, inputs, MeshInfo.for_planning({"ulysses": 2}, "cpu"), steps=steps(last="coverage"))
    attention = [n for n in local.graph.nodes if n.target is hybrid_attention]
    if dropout:
        assert not attention and any("attention written out by hand runs op by op on the whole sequence over cp: "
                                     "probs (dropout) between the softmax and @ v" in w for w in ctx.warnings), \
            ctx.warnings
        return
    (hybrid,) = attention
    assert hybrid.kwargs["score_mod"] == ScoreMod((("div", 8 ** 0.5), ("div", 5.0), ("tanh", 0.0), ("mul", 5.0)))
    assert hybrid.kwargs["is_causal"] and hybrid.kwargs["attn_mask"] is None
    assert hybrid.kwargs.get("window") == (6 if fill == "two_masks" else None), hybrid.kwargs
    assert not any(op_kind(n) == "softmax" for n in local.graph.nodes)


@pytest.mark.parametrize("cp", ["ring", "ulysses"])
def test_scores_filled_with_the_lowest_finite_value_by_an_input_are_not_hybrid_attention(cp):
    """Hybrid attention cannot reproduce a row such a fill hides entirely (its kernels lose the
    row's log-sum-exp, an additive mask would pass the gradient on): it runs as written, with a
    warning naming the condition. (A boolean mask gave such rows NaN at ulysses2 and an error of
    0.25 at ring2; ``tests.test_cp_gloo`` runs it exactly.)"""
    from dtensor_par.ops.attention import hybrid_attention

    (gm, inputs), = capture_graphs(patterns.RowsHiddenByAnInput(), torch.randn(2, 16, 32), torch.ones(2, 1, 16, 16).bool())
    local, ctx = parallelize_graph(gm, inputs, MeshInfo.for_planning({cp: 2}, "cpu"), steps=steps(last="coverage"))
    assert not any(n.target is hybrid_attention for n in local.graph.nodes)
    assert any(re.search(r"runs op by op on the whole sequence over cp: \w+: the scores are filled with the lowest "
                         r"finite value where it hides them, and it may hide a query row entirely", w)
               for w in ctx.warnings), ctx.warnings


class AlibiAttention(nn.Module):
    """Attention written out with a per-head ALiBi bias built from positions: ``slope * (k - q)``
    computed as ``slope * distance`` ("relative"), or as ``slope * k - slope * q``, which rounds
    otherwise ("rounded": not ALiBi as ``PositionBias`` computes it, so a mask kept whole), or
    MPT's ``slope * (k - S + 1)`` ("from_last": ALiBi plus a constant a softmax does not see)."""

    def __init__(self, form: str):
        super().__init__()
        self.qkv, self.o = nn.Linear(32, 96), nn.Linear(32, 32)
        self.form = form

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, 4, 8).permute(2, 0, 3, 1, 4)
        slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625]).view(4, 1, 1) * 1.37
        position = torch.arange(s)
        if self.form == "relative":
            bias = slopes * (position[None, :] - position[:, None])
        elif self.form == "rounded":
            bias = slopes * position[None, :] - slopes * position[:, None]
        else:
            bias = slopes * torch.arange(1 - s, 1).view(1, 1, s)
        probs = (q @ k.transpose(-2, -1) / 8 ** 0.5 + bias).softmax(-1)
        return self.o((probs @ v).transpose(1, 2).reshape(b, s, 32))


@pytest.mark.parametrize("form, read", [("relative", PositionBias("alibi_relative")), ("rounded", None),
                                        ("from_last", PositionBias("alibi", offset=-15))])
def test_alibi_is_read_as_a_position_bias_only_where_it_is_exactly_one(form, read):
    """``slope * (k - q)`` becomes hybrid attention's position bias (its slopes a [1, heads]
    table), with no mask of the sequence, and so does ``slope * (k - S + 1)`` (MPT's, counted
    from the last key: an offset); a bias that only equals one in exact arithmetic stays the
    attention's mask, whole."""
    from dtensor_par.ops.attention import hybrid_attention

    (gm, inputs), = capture_graphs(AlibiAttention(form), torch.randn(2, 16, 32))
    local, ctx = parallelize_graph(gm, inputs, MeshInfo.for_planning({"ring": 2}, "cpu"), steps=steps(last="coverage"))
    (hybrid,) = [n for n in local.graph.nodes if n.target is hybrid_attention]
    if read is None:
        assert "position_bias" not in hybrid.kwargs and hybrid.kwargs["attn_mask"] is not None
        return
    assert hybrid.kwargs["position_bias"] == read and hybrid.kwargs["attn_mask"] is None
    table = hybrid.kwargs["bias_table"]
    assert table.target is torch.tensor and torch.equal(torch.tensor(table.args[0]),
                                                         torch.tensor([[0.5, 0.25, 0.125, 0.0625]]) * 1.37)
    assert not any(tuple(tensor_val(n).shape[-2:]) == (16, 16) for n in local.graph.nodes
                   if tensor_val(n) is not None), "an S x S tensor is left in the local graph"


def test_t5_buckets_are_read_as_runs_of_the_distance():
    """T5's bucket of ``k - q`` (bidirectional and causal, distances past max_distance included)
    read back from its ``[q, k]`` table as runs of the distance, every entry equal."""
    transformers = pytest.importorskip("transformers")
    from dtensor_par.passes.biases import _bucket_runs

    bucket = transformers.models.t5.modeling_t5.T5Attention._relative_position_bucket
    position = torch.arange(300)
    distance = position[None, :] - position[:, None]
    for bidirectional in (True, False):
        buckets = bucket(distance, bidirectional=bidirectional, num_buckets=32, max_distance=128)
        form = _bucket_runs(buckets)
        assert form is not None and len(form.starts) <= 32
        assert torch.equal(form.bucket_of(distance), buckets)
    assert _bucket_runs(torch.arange(16).view(4, 4)) is None  # not a function of k - q
