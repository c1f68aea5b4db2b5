"""Ring attention on gloo ranks: each rank's output rows and its q/k/v gradients equal the
single-device SDPA run on the full sequences."""

from __future__ import annotations

import contextlib
import functools
from collections import Counter

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.utils._python_dispatch import TorchDispatchMode

from dtensor_par.mesh import MeshDim, MeshInfo
from dtensor_par.ops.position_bias import PositionBias
from dtensor_par.ops.ring import ring_attention
from dtensor_par.ops.ring_schedule import ring_step_flops
from dtensor_par.ops.score_mod import ScoreMod
from dtensor_par.ops.sequence_layout import zigzag_indices
from dtensor_par._testing.harness import FORWARD_ATOL, GRAD_RTOL, capturing_backend, max_rel, run_ranks
from tests.background import in_background
from tests.conftest import DEVICES

BATCH, HEAD_DIM, SEQ = 2, 8, 16

CASES = {
    "full": dict(),
    "full_longer_kv": dict(kv_seq=2 * SEQ),
    "causal": dict(is_causal=True),
    "causal_zigzag": dict(is_causal=True, zigzag=True),
    "causal_zigzag_gqa": dict(is_causal=True, zigzag=True, heads=4, kv_heads=2, enable_gqa=True),
    "gqa": dict(heads=4, kv_heads=2, enable_gqa=True),
    "causal_scale": dict(is_causal=True, scale=0.3),
    # Masks: per-block rows the mask hides entirely, merged and differentiated exactly.
    "bool_mask_zigzag": dict(mask="bool", zigzag=True),
    "additive_mask": dict(mask="additive", heads=4, kv_heads=4),
    # 14 real positions laid out as 16 (padding at the end): padded keys are masked.
    "padded_zigzag": dict(real=14, zigzag=True),
    "padded_causal_zigzag": dict(real=14, zigzag=True, is_causal=True),
    "padded_additive_mask_zigzag_gqa": dict(real=14, zigzag=True, mask="additive", heads=4, kv_heads=2,
                                            enable_gqa=True),
    # A causal sliding window and key padding, without a mask of the sequence: each block
    # builds its box's mask from positions; blocks outside the window are skipped.
    "window_zigzag": dict(is_causal=True, window=3, zigzag=True),
    "window_contiguous_gqa": dict(is_causal=True, window=5, heads=4, kv_heads=2, enable_gqa=True),
    "causal_key_padding_zigzag": dict(is_causal=True, key_padding=True, zigzag=True),
    "padded_window_key_padding_zigzag": dict(real=14, is_causal=True, window=4, key_padding=True, zigzag=True),
    # Ring coordinate r is global rank world-1-r: rotations follow coordinates, not group ranks.
    "causal_zigzag_reversed_ring": dict(is_causal=True, zigzag=True, reversed_ring=True),
    # Soft-capping (Gemma2's tanh(s / c) * c) as a score function each block applies to its
    # own scores, forward and backward, with a window, GQA, an additive bias and padding.
    "softcap_causal_zigzag": dict(softcap=2.0, is_causal=True, zigzag=True),
    "softcap_window_zigzag_gqa": dict(softcap=2.0, is_causal=True, window=3, zigzag=True, heads=4, kv_heads=2,
                                      enable_gqa=True),
    "softcap_padded_additive_mask_zigzag": dict(softcap=2.0, real=14, zigzag=True, mask="additive", heads=4,
                                                kv_heads=4),
    # Values of another head dim than queries and keys (DeepSeek's latent attention): narrower, then
    # wider (the fused kernel takes one head dim: the shorter side is padded with zeros).
    "value_dim_6_causal_zigzag": dict(v_dim=6, is_causal=True, zigzag=True),
    "value_dim_12_padded_additive_mask_gqa": dict(v_dim=12, real=14, zigzag=True, mask="additive", heads=4,
                                                  kv_heads=2, enable_gqa=True),
    # A sink logit per head (GPT-OSS): a key every query sees, with no value, folded in after the
    # blocks merge; its gradient summed over the ranks. A boolean mask hides some rows entirely:
    # there the sink takes all the mass and the output is zero.
    "sinks_causal_zigzag_gqa": dict(sinks=True, is_causal=True, zigzag=True, heads=4, kv_heads=2, enable_gqa=True),
    "sinks_softcap_bool_mask_padded_zigzag": dict(sinks=True, softcap=2.0, mask="bool", real=14, zigzag=True),
}

_FORWARD_KERNEL = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
_BACKWARD_KERNEL = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
_ROTATION = torch.ops._c10d_functional.all_to_all_single.default


class _CountOps(TorchDispatchMode):
    """Counts the ``ops`` that actually run (default: the CPU attention kernels and ring rotations)."""

    def __init__(self, ops=(_FORWARD_KERNEL, _BACKWARD_KERNEL, _ROTATION)):
        super().__init__()
        self.ops = set(ops)
        self.counts = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.ops:
            self.counts[func.name()] += 1
        return func(*args, **(kwargs or {}))


def _full_inputs(heads: int, kv_heads: int, kv_seq: int, v_dim: int = HEAD_DIM) -> tuple[torch.Tensor, ...]:
    """The same full tensors on every rank."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(BATCH, heads, SEQ, HEAD_DIM, generator=gen)
    k = torch.randn(BATCH, kv_heads, kv_seq, HEAD_DIM, generator=gen)
    v = torch.randn(BATCH, kv_heads, kv_seq, v_dim, generator=gen)
    weights = torch.randn(BATCH, heads, SEQ, v_dim, generator=gen)
    return q, k, v, weights


def _mask(kind: str | None, heads: int, length: int) -> torch.Tensor | None:
    """A sliding window of width 3 (boolean) or a per-head distance bias (additive), both
    hiding the last 3 keys of the second sequence."""
    if kind is None:
        return None
    pos = torch.arange(length)
    distance = (pos[:, None] - pos[None, :]).abs()
    keep = torch.ones(BATCH, 1, 1, length, dtype=torch.bool)
    keep[1, ..., -3:] = False
    if kind == "bool":
        return (distance <= 3) & keep
    slopes = torch.arange(1, heads + 1).float().view(heads, 1, 1) / heads
    return torch.where(keep, -distance * slopes, float("-inf"))


def _keep(length: int) -> torch.Tensor:
    """Key padding: the second sequence's last 3 keys hidden."""
    keep = torch.ones(BATCH, length, dtype=torch.bool)
    keep[1, -3:] = False
    return keep


def _positional_mask(length: int, window: int | None, keep: torch.Tensor | None) -> torch.Tensor:
    """The causal (sliding-window) mask of the whole sequence, with its key padding."""
    pos = torch.arange(length)
    distance = pos[:, None] - pos[None, :]
    visible = (distance >= 0) & (distance < (window or length))
    return visible if keep is None else visible & keep[:, None, None, :]


def _softcap(cap: float) -> ScoreMod:
    return ScoreMod((("div", cap), ("tanh", 0.0), ("mul", cap)))


def _written_out(q, k, v, *, attn_mask, is_causal, scale, enable_gqa, softcap, sinks=None):
    """Attention as Gemma2 (soft-capped) and GPT-OSS (sink logits concatenated to the scores, their
    probabilities dropped) write it out, op by op: the reference of a score function and of sinks."""
    if enable_gqa:
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    scores = q @ k.transpose(-2, -1) * (scale or q.shape[-1] ** -0.5)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if is_causal:
        attn_mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else scores + attn_mask
    if sinks is not None:
        logits = torch.cat([scores, sinks.view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)], -1)
        return logits.softmax(-1)[..., :-1] @ v
    return scores.softmax(-1) @ v


def _blocks_in_window(seq: int, world: int, rank: int, window: int, zigzag: bool) -> int:
    """Ring blocks holding a key within the window of one of this rank's queries."""
    q = _rank_positions(seq, world, rank, zigzag)
    return sum(bool(((q[:, None] - k[None, :] >= 0) & (q[:, None] - k[None, :] < window)).any())
               for k in (_rank_positions(seq, world, r, zigzag) for r in range(world)))


def _rank_positions(seq: int, world: int, rank: int, zigzag: bool) -> torch.Tensor:
    if zigzag:
        return zigzag_indices(seq, world, rank)
    block = seq // world
    return torch.arange(rank * block, (rank + 1) * block)


@functools.cache
def _ring(world: int, reversed_ring: bool) -> MeshDim:
    """The world as one ring, in rank order or reversed."""
    ranks = list(range(world))[::-1] if reversed_ring else list(range(world))
    return MeshInfo.from_mesh(DeviceMesh("cpu", ranks, mesh_dim_names=("ring",))).dims["ring"]


def _compare(world: int, attention, *, heads: int = 2, kv_heads: int = 2, kv_seq: int = SEQ,
             is_causal: bool = False, zigzag: bool = False, enable_gqa: bool = False, scale: float | None = None,
             mask: str | None = None, real: int | None = None, reversed_ring: bool = False,
             window: int | None = None, key_padding: bool = False, softcap: float | None = None,
             sinks: bool = False, v_dim: int = HEAD_DIM, count_ops: bool = True) -> dict:
    """Run ``attention`` on this rank's blocks; return its differences to the single-device
    SDPA forward and gradients and, if ``count_ops`` (eager only: torch.compile refuses
    dispatch modes), the kernels and rotations it ran.

    ``real``: only the first ``real`` positions are the sequence; the rest is padding, whose
    output rows are not compared and whose gradients must be zero. ``softcap``: soft-capped
    scores (a score function), against the attention written out. ``sinks``: a sink logit per
    head, likewise, and its gradient summed over the ranks. ``v_dim``: the values' head dim
    (latent attention's differs from the queries')."""
    q, k, v, weights = _full_inputs(heads, kv_heads, kv_seq, v_dim)
    n, n_kv = real or SEQ, real or kv_seq
    full = [t[:, :, :length].clone().requires_grad_() for t, length in ((q, n), (k, n_kv), (v, n_kv))]
    sink_logits = torch.randn(heads, generator=torch.Generator().manual_seed(2)).requires_grad_() if sinks else None
    full_mask = _mask(mask, heads, n)
    keep = _keep(n) if key_padding else None
    positional = window is not None or key_padding
    attend = F.scaled_dot_product_attention if softcap is None and not sinks else functools.partial(
        _written_out, softcap=softcap, sinks=sink_logits)
    reference = attend(*full, attn_mask=_positional_mask(n, window, keep) if positional else full_mask,
                       is_causal=is_causal and not positional, scale=scale, enable_gqa=enable_gqa)
    (reference * weights[:, :, :n]).sum().backward()
    grads = [F.pad(t.grad, (0, 0, 0, length - t.shape[2])) for t, length in zip(full, (SEQ, kv_seq, kv_seq))]

    ring = _ring(world, reversed_ring)
    q_pos = _rank_positions(SEQ, world, ring.rank, zigzag)
    kv_pos = _rank_positions(kv_seq, world, ring.rank, zigzag)
    real_rows = q_pos < n
    local = [t[:, :, pos].clone().requires_grad_() for t, pos in ((q, q_pos), (k, kv_pos), (v, kv_pos))]
    local_mask = None if full_mask is None else full_mask[..., q_pos.clamp(max=n - 1), :]
    counter = _CountOps()
    with counter if count_ops else contextlib.nullcontext():
        extra = {"window": window, "key_padding": keep} if positional else {}
        if softcap is not None:
            extra["score_mod"] = _softcap(softcap)
        if sinks:
            extra["sinks"] = local_sinks = sink_logits.detach().clone().requires_grad_()
        out = attention(*local, ring=ring, attn_mask=local_mask, is_causal=is_causal, scale=scale,
                        enable_gqa=enable_gqa, zigzag=zigzag, kv_len=real, **extra)
        (out * weights[:, :, q_pos] * real_rows.view(-1, 1)).sum().backward()
    result = {"forward_abs": (out - reference[:, :, q_pos.clamp(max=n - 1)])[:, :, real_rows].abs().max().item(),
              "counts": dict(counter.counts)}
    for name, got, want, pos in zip("qkv", local, grads, (q_pos, kv_pos, kv_pos)):
        result[f"d{name}_rel"] = max_rel(got.grad, want[:, :, pos])
    if sinks:
        dist.all_reduce(local_sinks.grad)
        result["dsinks_rel"] = max_rel(local_sinks.grad, sink_logits.grad)
    return result


# A bias built from positions (ALiBi's slope x (k - q), and MPT's slope x (k - S + 1), counted
# from the last key; T5-like buckets of k - q, a learned table) evaluated per block, with
# causality, GQA and padding; the table's gradient summed over the ranks.
_BUCKETS = PositionBias("buckets", (-3, -1, 0, 1, 4), (0, 1, 2, 3, 4))
BIAS_CASES = {
    "alibi_relative_causal_zigzag_gqa": dict(form=PositionBias("alibi_relative"), is_causal=True, zigzag=True),
    "alibi_from_last_causal_zigzag": dict(form=PositionBias("alibi", offset=1 - SEQ), is_causal=True, zigzag=True),
    "buckets_padded_zigzag": dict(form=_BUCKETS, real=14, zigzag=True),
    "buckets_causal_contiguous": dict(form=_BUCKETS, is_causal=True),
}


def _biased(world: int, *, form: PositionBias, is_causal: bool = False, zigzag: bool = False,
            real: int | None = None) -> dict:
    """Ring attention with a position bias against the bias of the whole sequence, written out:
    the forward, q/k/v's gradients and the bias table's (4 heads, 2 kv heads)."""
    q, k, v, weights = _full_inputs(4, 2, SEQ)
    table = torch.randn(1 if form.kind != "buckets" else 5, 4, generator=torch.Generator().manual_seed(1))
    n = real or SEQ
    full = [t[:, :, :n].clone().requires_grad_() for t in (q, k, v)] + [table.clone().requires_grad_()]
    positions = torch.arange(n)
    scores = full[0] @ full[1].repeat_interleave(2, 1).transpose(-2, -1) * HEAD_DIM ** -0.5
    scores = scores + form.tile(full[3], positions, positions)
    if is_causal:
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    reference = scores.softmax(-1) @ full[2].repeat_interleave(2, 1)
    (reference * weights[:, :, :n]).sum().backward()
    grads = [F.pad(t.grad, (0, 0, 0, SEQ - n)) for t in full[:3]]

    ring = _ring(world, False)
    pos = _rank_positions(SEQ, world, ring.rank, zigzag)
    real_rows = pos < n
    local = [t[:, :, pos].clone().requires_grad_() for t in (q, k, v)] + [table.clone().requires_grad_()]
    out = ring_attention(*local[:3], ring=ring, is_causal=is_causal, enable_gqa=True, zigzag=zigzag, kv_len=real,
                         position_bias=form, table=local[3])
    (out * weights[:, :, pos] * real_rows.view(-1, 1)).sum().backward()
    table_grad = local[3].grad.clone()
    dist.all_reduce(table_grad)
    result = {"forward_abs": (out - reference[:, :, pos.clamp(max=n - 1)])[:, :, real_rows].abs().max().item(),
              "dtable_rel": max_rel(table_grad, full[3].grad)}
    for name, got, want in zip("qkv", local, grads):
        result[f"d{name}_rel"] = max_rel(got.grad, want[:, :, pos])
    return result


def _compiled_case(rank: int, world: int) -> dict:
    """One causal zigzag GQA case under ``aot_eager``, plus the rotations AOTAutograd traces
    into the forward and backward graphs."""
    options = CASES["causal_zigzag_gqa"]
    compiled = torch.compile(ring_attention, backend="aot_eager", fullgraph=True)
    result = _compare(world, compiled, count_ops=False, **options)

    graphs = {}
    capture = capturing_backend(graphs)
    _compare(world, torch.compile(ring_attention, backend=capture, fullgraph=True), count_ops=False, **options)
    result["traced_rotations"] = {name: sum(node.target is _ROTATION for node in gm.graph.nodes)
                                  for name, gm in graphs.items()}
    return result


def _rank_cases(rank: int, world: int, *, with_compiled: bool) -> dict:
    results = {"eager": {name: _compare(world, ring_attention, **options) for name, options in CASES.items()},
               "biased": {name: _biased(world, **options) for name, options in BIAS_CASES.items()}}
    if with_compiled:
        results["compiled"] = _compiled_case(rank, world)
    return results


LAUNCHES = {world: in_background(run_ranks, world, _rank_cases, with_compiled=world == 2) for world in (2, 4)}
"""One launch per world size serves all of that size's tests."""


def _assert_close(rank: int, name: str, metrics: dict) -> None:
    assert metrics["forward_abs"] <= FORWARD_ATOL, (rank, name, metrics)
    for grad in ("dq_rel", "dk_rel", "dv_rel", "dsinks_rel", "dtable_rel"):
        assert metrics.get(grad, 0.0) <= GRAD_RTOL, (rank, name, grad, metrics)
    assert ("dsinks_rel" in metrics) == name.startswith("sinks"), (rank, name, metrics)


def _every_rank(world: int, group: str, name: str) -> list[dict]:
    """Case ``name`` of ``group`` (``eager``, ``biased``) as each rank of the launch returned it."""
    results = LAUNCHES[world].result()
    assert all(name in rank_results[group] for rank_results in results), (group, name, world)
    return [rank_results[group][name] for rank_results in results]


@pytest.mark.parametrize("world, name", [(world, name) for world in (2, 4) for name in CASES])
def test_ring_attention_matches_single_device(world, name):
    for rank, metrics in enumerate(_every_rank(world, "eager", name)):
        _assert_close(rank, name, metrics)
        # Contiguous causal: blocks of later ranks are skipped, not computed masked.
        computed = {"full": world, "causal": rank + 1, "causal_zigzag": world,
                    "window_zigzag": _blocks_in_window(SEQ, world, rank, 3, zigzag=True),
                    "window_contiguous_gqa": _blocks_in_window(SEQ, world, rank, 5, zigzag=False)}
        assert computed["window_zigzag"] < world or world == 2
        if name in computed:
            assert metrics["counts"] == {
                "aten::_scaled_dot_product_flash_attention_for_cpu": computed[name],
                "aten::_scaled_dot_product_flash_attention_for_cpu_backward": computed[name],
                # Forward: kv rotates world-1 times; backward reuses those blocks, dkv rotates world-1 times.
                "_c10d_functional::all_to_all_single": 2 * (world - 1),
            }, (rank, name, metrics["counts"])


@pytest.mark.parametrize("world, name", [(world, name) for world in (2, 4) for name in BIAS_CASES])
def test_ring_attention_with_a_position_bias_matches_single_device(world, name):
    for rank, metrics in enumerate(_every_rank(world, "biased", name)):
        _assert_close(rank, name, metrics)
        assert "dtable_rel" in metrics, (rank, name, metrics)


def test_ring_attention_traces_under_aot_eager():
    for rank, results in enumerate(LAUNCHES[2].result()):
        _assert_close(rank, "compiled", results["compiled"])
        assert results["compiled"]["traced_rotations"] == {"forward": 1, "backward": 1}


_FLASH_KERNELS = {torch.ops.aten._scaled_dot_product_flash_attention.default,
                  torch.ops.aten._scaled_dot_product_flash_attention_backward.default}
_EFFICIENT_KERNELS = {torch.ops.aten._scaled_dot_product_efficient_attention.default,
                      torch.ops.aten._scaled_dot_product_efficient_attention_backward.default}


@pytest.mark.parametrize("options, kernels", [
    (dict(), _FLASH_KERNELS), (dict(is_causal=True, zigzag=True), _FLASH_KERNELS),
    (dict(mask=True), _EFFICIENT_KERNELS), (dict(is_causal=True, enable_gqa=True), _FLASH_KERNELS),
    (dict(is_causal=True, window=3), _EFFICIENT_KERNELS), (dict(dtype=torch.float32), _EFFICIENT_KERNELS)],
    ids=["full", "causal_zigzag", "mask", "causal_gqa", "window", "float32"])
def test_cuda_kernel_path_runs_on_meta_tensors(options, kernels, fake_world):
    """The path a GPU takes on meta tensors, which have shapes and dtypes but no values: in half
    precision with no mask the flash kernel, else the efficient-attention kernel (its log-sum-exp
    padded to 32 rows, its additive bias). Forward and backward run those kernels, none of the CPU
    ones, and give each input's gradient its shape and dtype. Only the interfaces are checked here;
    the numbers need a GPU (``test_ring_blocks_run_by_hand_equal_one_attention``). 40 query rows
    per rank: not a multiple of 32."""
    fake_world(2)
    ring = MeshInfo.from_mesh(DeviceMesh("cpu", [0, 1], mesh_dim_names=("ring",))).dims["ring"]
    kv_heads = 2 if options.get("enable_gqa") else 4
    dtype = options.pop("dtype", torch.bfloat16)
    q, k, v = (torch.randn(1, h, 40, 16, device="meta", dtype=dtype, requires_grad=True)
               for h in (4, kv_heads, kv_heads))
    if options.pop("mask", False):
        options["attn_mask"] = torch.ones(1, 1, 40, 80, dtype=torch.bool, device="meta")
    with _CountOps(_FLASH_KERNELS | _EFFICIENT_KERNELS | {_FORWARD_KERNEL, _BACKWARD_KERNEL}) as counted:
        out = ring_attention(q, k, v, ring=ring, **options)
        out.sum().backward()
    assert set(counted.counts) == {op.name() for op in kernels}, counted.counts
    assert out.shape == q.shape and out.dtype == dtype
    assert [(t.grad.shape, t.grad.dtype) for t in (q, k, v)] == [(t.shape, t.dtype) for t in (q, k, v)]


def _blocks_by_hand(q, k, v, mask, *, causal: bool, groups: int, blocks: int):
    """A contiguous ring of ``blocks`` ranks run on one device, with no communication: query block
    i against key block j, causal on the diagonal, whole below it and skipped above it; merged by
    log-sum-exp; then each block's share of the gradients from the final output and log-sum-exp,
    for an output gradient that differs in every element."""
    from dtensor_par.ops.ring_kernels import block_backward, block_forward, merge_block

    rows, cols = q.shape[-2] // blocks, k.shape[-2] // blocks
    kv = torch.cat([k, v], -1)  # as the ring holds them: one tensor rotated
    qs, ks, vs = q.split(rows, -2), kv[..., :k.shape[-1]].split(cols, -2), kv[..., k.shape[-1]:].split(cols, -2)
    grad_out = torch.linspace(-1, 1, q.shape[-2] * v.shape[-1], device=q.device).view(1, 1, -1, v.shape[-1])
    grad_out = grad_out.expand(q.shape[0], q.shape[1], -1, -1).to(q.dtype)
    pairs = [(i, j) for i in range(blocks) for j in range(blocks) if not causal or j <= i]
    tile = {pair: None if mask is None else mask[..., pair[0] * rows:(pair[0] + 1) * rows,
                                               pair[1] * cols:(pair[1] + 1) * cols] for pair in pairs}
    outs, lses = [], []
    for i in range(blocks):
        out = torch.zeros(*qs[i].shape[:-1], v.shape[-1], device=q.device)
        lse = torch.full(qs[i].shape[:-1], float("-inf"), device=q.device)
        for j in (j for i_, j in pairs if i_ == i):
            block = block_forward(qs[i], ks[j], vs[j], tile[i, j], is_causal=causal and i == j, scale=None,
                                  groups=groups)
            out, lse = merge_block(out, lse, slice(0, rows), block[0].float(), block[1], mask is not None)
        outs.append(out.to(q.dtype))
        lses.append(lse)
    grads = [torch.zeros(t.shape, device=q.device) for t in (q, k, v)]
    for i, j in pairs:
        g = grad_out[..., i * rows:(i + 1) * rows, :]
        dq, dk, dv, _ = block_backward(g, qs[i], ks[j], vs[j], tile[i, j], outs[i], lses[i],
                                       is_causal=causal and i == j, scale=None, groups=groups)
        grads[0][..., i * rows:(i + 1) * rows, :] += dq.float()
        grads[1][..., j * cols:(j + 1) * cols, :] += dk.float()
        grads[2][..., j * cols:(j + 1) * cols, :] += dv.float()
    return torch.cat(outs, -2).float(), grads, grad_out


def _reference(q, k, v, mask, grad_out, *, causal: bool, groups: int):
    """The same attention in float64, op by op, and its gradients by autograd."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    out = _written_out(q, k, v, attn_mask=None if mask is None else mask.double(), is_causal=causal, scale=None,
                       enable_gqa=groups > 1, softcap=None)
    return out, torch.autograd.grad((out * grad_out.double()).sum(), (q, k, v))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", ["full", "causal", "mask_hiding_rows", "causal_gqa", "value_dim_8_mask"])
def test_ring_blocks_run_by_hand_equal_one_attention(device, case):
    """The kernels a ring runs on this device (CPU flash; on CUDA flash in bf16 with no mask, else
    the memory-efficient kernel, its log-sum-exp padded to 32 rows and its bias to 16 columns),
    block by block with the merge and the per-block backward, against float64 attention: 40 query
    rows a block (no multiple of 32). A boolean mask, as additive, hides whole rows of some blocks.
    bf16 is held to twice the error of one bf16 SDPA call against the same float64 reference."""
    gen = torch.Generator().manual_seed(0)
    heads, groups = 4, 2 if case == "causal_gqa" else 1
    v_dim = 8 if case == "value_dim_8_mask" else 16
    mask = None
    if case in ("mask_hiding_rows", "value_dim_8_mask"):
        keep = torch.rand(1, heads, 80, 80, generator=gen) < 0.5
        keep[..., :40, 40:] = False  # the first block's rows see none of the second block's keys
        keep[..., 40:, :40] &= torch.arange(40).view(40, 1) % 3 != 0  # a third of rows see none of the first
        keep |= torch.eye(80, dtype=torch.bool)
        mask = torch.zeros(keep.shape).masked_fill(~keep, float("-inf")).to(device)
    causal = "causal" in case
    full = [torch.randn(1, h, 80, d, generator=gen).to(device)
            for h, d in ((heads, 16), (heads // groups, 16), (heads // groups, v_dim))]
    for dtype in (torch.float32, torch.bfloat16):
        q, k, v = (t.to(dtype) for t in full)
        additive = None if mask is None else mask.to(dtype)
        out, grads, grad_out = _blocks_by_hand(q, k, v, additive, causal=causal, groups=groups, blocks=2)
        want, want_grads = _reference(q, k, v, additive, grad_out, causal=causal, groups=groups)
        if dtype == torch.float32:
            assert (out - want).abs().max() <= FORWARD_ATOL, (device, case)
            for got, expected in zip(grads, want_grads):
                assert max_rel(got.double(), expected) <= GRAD_RTOL, (device, case)
        else:  # SDPA's values padded to the query's head dim, as its fused kernels need
            inputs = [t.detach().requires_grad_() for t in (q, k, F.pad(v, (0, 16 - v_dim)))]
            sdpa = F.scaled_dot_product_attention(*inputs, attn_mask=additive, is_causal=causal,
                                                  enable_gqa=groups > 1)[..., :v_dim]
            sdpa_grads = torch.autograd.grad((sdpa * grad_out).sum(), inputs)
            sdpa_grads = (*sdpa_grads[:2], sdpa_grads[2][..., :v_dim])
            assert (out - want).abs().max() <= 2 * (sdpa.double() - want).abs().max() + 1e-3, (device, case)
            for got, theirs, expected in zip(grads, sdpa_grads, want_grads):
                assert max_rel(got.double(), expected) <= 2 * max_rel(theirs.double(), expected) + 1e-3, (device, case)


def test_zigzag_balances_causal_work_and_contiguous_does_not():
    seq, size, head_dim = 16, 4, 8
    # Local blocks of 4 tokens (zigzag: two chunks of 2). Own block: causal 4*5/2 = 10 pairs;
    # zigzag off-diagonal: half the block on one side, 2*4 = 8 pairs; contiguous: 4*4 = 16 or 0.
    zigzag = [ring_step_flops(seq, size, r, zigzag=True, is_causal=True, head_dim=head_dim) for r in range(size)]
    assert zigzag == [[4 * 8 * p for p in (10, 8, 8, 8)]] * size
    contiguous = [ring_step_flops(seq, size, r, zigzag=False, is_causal=True, head_dim=head_dim)
                  for r in range(size)]
    assert contiguous == [[4 * 8 * p for p in pairs] for pairs in
                          ([10, 0, 0, 0], [10, 16, 0, 0], [10, 16, 16, 0], [10, 16, 16, 16])]
    # Either way, all ranks together compute exactly the causal mask's seq*(seq+1)/2 pairs.
    assert sum(map(sum, zigzag)) == sum(map(sum, contiguous)) == 4 * head_dim * seq * (seq + 1) // 2
    assert ring_step_flops(seq, size, 1, zigzag=False, is_causal=False, batch=2, heads=3) == [4 * 2 * 3 * 16] * size


def test_window_flops_skip_blocks_outside_the_window_and_cover_every_visible_pair():
    seq, size, window = 64, 4, 6
    for zigzag in (True, False):
        for rank in range(size):
            steps = ring_step_flops(seq, size, rank, zigzag=zigzag, is_causal=True, window=window)
            causal = ring_step_flops(seq, size, rank, zigzag=zigzag, is_causal=True)
            q = _rank_positions(seq, size, rank, zigzag)
            distance = q[:, None] - torch.cat([_rank_positions(seq, size, r, zigzag) for r in range(size)])[None, :]
            visible = int(((distance >= 0) & (distance < window)).sum())
            assert sum(f > 0 for f in steps) == _blocks_in_window(seq, size, rank, window, zigzag), (zigzag, rank)
            assert 4 * visible <= sum(steps) <= sum(causal), (zigzag, rank, steps, causal)
    # Zigzag, rank 0 holds positions 0-7 and 56-63: its own block runs causal (16 * 17 / 2
    # pairs, the window's mask on top); of rank 1's block (8-15, 48-55, at step 3) only keys
    # 51-55 lie within 6 of queries 56-60 (a 5 x 5 box); rank 3's and 2's blocks are skipped.
    assert ring_step_flops(seq, size, 0, zigzag=True, is_causal=True, window=window) == [4 * 136, 0, 0, 4 * 25]


@pytest.mark.parametrize("window, key_padding, real, tile, softcap", [
    (3, False, None, 5, None), (4, True, 14, 5, None), (None, True, None, 6, None), (5, True, 14, 512, None),
    (4, True, 14, 5, 2.0), (None, False, None, 512, 2.0)])
def test_a_ring_of_one_runs_windows_and_key_padding_by_query_tiles(window, key_padding, real, tile, softcap):
    """Ulysses alone (a ring of one): query tiles, each with the keys its window reaches; a
    padded sequence's extra query rows see the last real row's keys. A score function
    (soft-capping) is applied to each tile's scores, and autograd derives its backward."""
    from dtensor_par.ops.ring_kernels import tiled_attention

    q, k, v, weights = (t.requires_grad_() for t in _full_inputs(2, 2, SEQ))
    n = real or SEQ
    keep = _keep(n) if key_padding else None
    attend = F.scaled_dot_product_attention if softcap is None else functools.partial(
        _written_out, is_causal=False, scale=None, enable_gqa=False, softcap=softcap)
    reference = attend(q[:, :, :n], k[:, :, :n], v[:, :, :n], attn_mask=_positional_mask(n, window, keep))
    expected = torch.autograd.grad((reference * weights[:, :, :n]).sum(), (q, k, v))
    score_mod = None if softcap is None else _softcap(softcap)
    if tile == 512:
        one = MeshInfo.for_planning({}, "cpu").dims["ring"]
        out = ring_attention(q, k, v, ring=one, is_causal=True, window=window, key_padding=keep, kv_len=real,
                             score_mod=score_mod)
    else:
        out = tiled_attention(q, k[:, :, :n], v[:, :, :n], is_causal=True, window=window, key_padding=keep,
                              scale=None, score_mod=score_mod, tile=tile)
    assert out.shape == q.shape and (out[:, :, :n] - reference).abs().max() <= FORWARD_ATOL
    grads = torch.autograd.grad((out[:, :, :n] * weights[:, :, :n]).sum(), (q, k, v))
    for got, want in zip(grads, expected):
        assert max_rel(got, want) <= GRAD_RTOL


def test_a_ring_of_one_folds_in_sinks():
    """Ulysses alone with GPT-OSS's sinks: at a ring of one the ring's kernel runs (the fused ones
    give no log-sum-exp to fold the sinks into), causal with grouped kv heads, and the sinks get
    their gradient."""
    q, k, v, weights = (t.requires_grad_() for t in _full_inputs(4, 2, SEQ))
    sinks = torch.randn(4, generator=torch.Generator().manual_seed(2)).requires_grad_()
    reference = _written_out(q, k, v, attn_mask=None, is_causal=True, scale=None, enable_gqa=True, softcap=None,
                             sinks=sinks)
    expected = torch.autograd.grad((reference * weights).sum(), (q, k, v, sinks))
    one = MeshInfo.for_planning({}, "cpu").dims["ring"]
    out = ring_attention(q, k, v, ring=one, is_causal=True, enable_gqa=True, sinks=sinks)
    assert (out - reference).abs().max() <= FORWARD_ATOL
    for got, want in zip(torch.autograd.grad((out * weights).sum(), (q, k, v, sinks)), expected):
        assert max_rel(got, want) <= GRAD_RTOL


def test_zigzag_indices():
    assert zigzag_indices(16, 4, 1).tolist() == [2, 3, 12, 13]
    held = torch.cat([zigzag_indices(16, 4, r) for r in range(4)])
    assert sorted(held.tolist()) == list(range(16))
    with pytest.raises(ValueError, match="12.*2 \\* 4"):
        zigzag_indices(12, 4, 0)


@pytest.mark.parametrize("q_shape, kv_shape, options, message", [
    ((1, 3, 4, 8), (1, 2, 4, 8), dict(enable_gqa=True), "3 query heads are not a multiple of 2"),
    ((1, 4, 4, 8), (1, 2, 4, 8), dict(), "4 query heads and 2 key/value heads need enable_gqa"),
    ((1, 2, 4, 8), (1, 2, 6, 8), dict(is_causal=True), "got 4 and 6"),
    ((1, 2, 3, 8), (1, 2, 3, 8), dict(is_causal=True, zigzag=True), "even local block length.*got 3"),
    ((1, 2, 4, 8), (1, 2, 4, 8), dict(kv_len=4), r"kv_len 4 leaves ring ranks \[1\] with only padding"),
    ((1, 2, 4, 8), (1, 2, 4, 8), dict(kv_len=6, attn_mask=torch.ones(4, 8, dtype=torch.bool)),
     r"mask must be \[B\|1, H\|1, 4\|1, 6\|1\].*got \(1, 1, 4, 8\)"),
    ((1, 2, 4, 8), (1, 2, 4, 8), dict(is_causal=True, attn_mask=torch.ones(4, 8, dtype=torch.bool)),
     "a mask or is_causal, not both"),
    ((1, 2, 4, 8), (1, 2, 4, 8), dict(window=3), "sliding window is causal.*window=3, is_causal=False"),
    ((1, 2, 4, 8), (1, 2, 4, 8), dict(is_causal=True, window=0), "at least 1 key wide"),
    ((1, 2, 4, 8), (1, 2, 4, 8), dict(key_padding=torch.ones(1, 8, dtype=torch.bool),
                                      attn_mask=torch.ones(4, 8, dtype=torch.bool)), "a mask or a key padding"),
    ((1, 2, 4, 8), (1, 2, 4, 8), dict(is_causal=True, key_padding=torch.ones(1, 6)),
     r"key padding must be boolean \[B\|1, 8\].*torch.float32 \(1, 6\)"),
    ((1, 4, 4, 8), (1, 2, 4, 8), dict(enable_gqa=True, sinks=torch.zeros(2)),
     r"sinks must be one logit per query head, \[4\]; got \(2,\)"),
])
def test_clear_errors(q_shape, kv_shape, options, message):
    q, k = torch.zeros(q_shape), torch.zeros(kv_shape)
    with pytest.raises(ValueError, match=message):
        ring_attention(q, k, k, ring=MeshInfo.for_planning({"ring": 2}, "cpu").dims["ring"], **options)
