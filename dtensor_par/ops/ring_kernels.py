"""What one ring block computes, with no communication: its attention output and per-row
log-sum-exp on the fused SDPA kernels (CPU flash; CUDA flash, or memory-efficient with a mask
or in float32), the online-softmax merge into the running result, its exact share of the
gradients, and its mask.

A given mask holds this rank's query rows against every key position; each block takes the
columns of the keys it holds, and a row that a block's mask hides entirely weighs nothing in
the merge. A causal window and a key-padding mask (``key_padding``, ``[B, keys]``) need no
mask of the sequence: a block's mask covers its box alone, built from the global positions
(and the key-padding columns it holds), and so does a bias built from positions
(``ops.position_bias``), added to the mask. A ring of one (``tiled_attention``) cuts the
sequence into query tiles the same way.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .position_bias import PositionBias
from .ring_schedule import Block
from .score_mod import ScoreMod
from .sequence_layout import block_positions

aten = torch.ops.aten

# The CUDA memory-efficient kernel pads its log-sum-exp to this many query rows, and its
# backward checks the alignment that padding gives.
_CUDA_LSE_ROW_ALIGNMENT = 32


def repeat_kv_heads(x: torch.Tensor, groups: int) -> torch.Tensor:
    """The fused kernels need one key/value head per query head (SDPA's GQA head order)."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def _sum_kv_head_grads(grad: torch.Tensor, groups: int) -> torch.Tensor:
    """Gradient of ``repeat_kv_heads``: each kv head collects the grads of its copies."""
    if groups == 1:
        return grad
    batch, heads, seq, dim = grad.shape
    return grad.view(batch, heads // groups, groups, seq, dim).sum(2)


def _cuda_bias(mask: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor | None:
    """The memory-efficient kernel takes its bias whole, [B, H, Sq, Skv], with rows aligned to
    16 elements (padded and cut back, as SDPA itself prepares it)."""
    if mask is None:
        return None
    keys = k.shape[-2]
    bias = mask.expand(q.shape[0], q.shape[1], q.shape[2], keys)
    return F.pad(bias, (0, -keys % 16))[..., :keys]


def _flash_fits(q: torch.Tensor, mask: torch.Tensor | None) -> bool:
    """Whether CUDA's flash kernel takes this block: half precision with no mask, a head dim that
    is a multiple of 8 up to 256, on Ampere or later. It gives the log-sum-exp unpadded and runs
    faster than the memory-efficient kernel, which takes the rest."""
    if mask is not None or q.dtype not in (torch.float16, torch.bfloat16) or q.shape[-1] % 8 or q.shape[-1] > 256:
        return False
    return q.device.type != "cuda" or torch.cuda.get_device_capability(q.device) >= (8, 0)


def modified_scores(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None, *, is_causal: bool,
                    scale: float | None, score_mod: ScoreMod, derivative: bool = False
                    ) -> tuple[torch.Tensor, torch.Tensor | float | None]:
    """One tile's float32 scores: ``q @ kT`` scaled, then its score function, then the additive
    ``mask`` and the causal mask of the tile; with ``derivative``, also the score function's
    derivative by the scaled scores (for the backward)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    raw = (q.float() @ k.float().transpose(-2, -1)) * scale
    scores, slope = score_mod.with_derivative(raw) if derivative else (score_mod(raw), None)
    if mask is not None:
        scores = scores + as_additive(mask, scores.dtype)
    if is_causal:
        above = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(above, float("-inf"))
    return scores, slope


def scored_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, *,
                     is_causal: bool, scale: float | None, score_mod: ScoreMod) -> torch.Tensor:
    """Attention with a score function over whole keys, in plain differentiable ops (autograd
    derives its backward): what a ring of one runs per query tile."""
    scores, _ = modified_scores(q, k, mask, is_causal=is_causal, scale=scale, score_mod=score_mod)
    return (scores.softmax(-1) @ v.float()).to(q.dtype)


def _scored_block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, *,
                          is_causal: bool, scale: float | None, score_mod: ScoreMod) -> tuple[torch.Tensor, torch.Tensor]:
    """``block_forward`` with a score function, on the scores themselves: no fused kernel takes one."""
    scores, _ = modified_scores(q, k, mask, is_causal=is_causal, scale=scale, score_mod=score_mod)
    lse = scores.logsumexp(-1)
    probs = torch.exp(scores - lse.masked_fill(lse.isneginf(), 0.0).unsqueeze(-1))  # a hidden row: all 0
    return (probs @ v.float()).to(q.dtype), lse


def _scored_block_backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           mask: torch.Tensor | None, out: torch.Tensor, lse: torch.Tensor, *, is_causal: bool,
                           scale: float | None, score_mod: ScoreMod
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``block_backward`` with a score function: the softmax's gradient by the global output
    and log-sum-exp, through the score function's derivative (soft-capping's ``1 - tanh^2``);
    and the gradient of the additive mask (a bias built from positions takes its table's from it)."""
    scores, slope = modified_scores(q, k, mask, is_causal=is_causal, scale=scale, score_mod=score_mod,
                                    derivative=True)
    probs = torch.exp(scores - lse.unsqueeze(-1))
    grad_out = grad_out.float()
    grad_probs = grad_out @ v.float().transpose(-2, -1)
    grad_masked = probs * (grad_probs - (grad_out * out.float()).sum(-1, keepdim=True))
    grad_scores = grad_masked * slope * (q.shape[-1] ** -0.5 if scale is None else scale)
    return (grad_scores @ k.float(), grad_scores.transpose(-2, -1) @ q.float(),
            probs.transpose(-2, -1) @ grad_out, grad_masked)


def _one_head_dim(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:
    """``q``, ``k``, ``v`` padded with zeros to one head dim, and the scale of ``q``'s own: the
    fused kernels take no value head dim other than the query's (multi-head latent attention:
    values of 128 against queries and keys of 192). Zeros appended change no score (q . k) and
    add only output columns of zeros."""
    d, dv = q.shape[-1], v.shape[-1]
    scale = d ** -0.5 if scale is None else scale
    if dv < d:
        return q, k, F.pad(v, (0, d - dv)), scale
    return F.pad(q, (0, dv - d)), F.pad(k, (0, dv - d)), v, scale


def block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, *,
                  is_causal: bool, scale: float | None, groups: int,
                  score_mod: ScoreMod | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One block's attention output and per-row log-sum-exp ([B, H, Sq], float32); ``mask`` is
    additive. A row the mask hides entirely gets log-sum-exp -inf (the CPU kernel reports 0),
    so it weighs nothing in the merge."""
    k, v = repeat_kv_heads(k, groups), repeat_kv_heads(v, groups)
    if score_mod is not None:
        return _scored_block_forward(q, k, v, mask, is_causal=is_causal, scale=scale, score_mod=score_mod)
    dv = v.shape[-1]
    if dv != q.shape[-1]:
        q, k, v, scale = _one_head_dim(q, k, v, scale)
    if q.device.type == "cpu":
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, is_causal, attn_mask=mask,
                                                                    scale=scale)
    elif _flash_fits(q, mask):
        out, lse = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, is_causal, scale=scale)[:2]
    else:
        out, lse, _, _ = aten._scaled_dot_product_efficient_attention(q, k, v, _cuda_bias(mask, q, k), True, 0.0,
                                                                      is_causal, scale=scale)
        lse = lse[..., : q.shape[-2]]
    out = out[..., :dv]
    if mask is not None:
        visible = ~mask.isneginf()
        if is_causal:  # the kernel's causal mask hides the rest
            visible = visible & torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
        hidden = ~visible.any(-1)
        out, lse = out.masked_fill(hidden.unsqueeze(-1), 0.0), lse.masked_fill(hidden, float("-inf"))
    return out, lse


def block_backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   mask: torch.Tensor | None, out: torch.Tensor, lse: torch.Tensor, *, is_causal: bool,
                   scale: float | None, groups: int,
                   score_mod: ScoreMod | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One block's exact share of dq, dk, dv, and with a ``score_mod`` the gradient of its
    additive mask (float32; else None).

    Given the *final* output and *global* log-sum-exp, the kernel's softmax probabilities are
    the global ones, so the per-block gradients sum to the full-attention gradients.
    """
    k_rep, v_rep = repeat_kv_heads(k, groups), repeat_kv_heads(v, groups)
    if score_mod is None and v.shape[-1] != q.shape[-1]:
        qk_dim, v_dim = q.shape[-1], v.shape[-1]
        q, k_rep, v_rep, scale = _one_head_dim(q, k_rep, v_rep, scale)
        grad_out, out = (F.pad(x, (0, v_rep.shape[-1] - v_dim)) for x in (grad_out, out))
        dq, dk, dv, _ = block_backward(grad_out, q, k_rep, v_rep, mask, out, lse, is_causal=is_causal, scale=scale,
                                       groups=1)
        return (dq[..., :qk_dim], _sum_kv_head_grads(dk[..., :qk_dim], groups),
                _sum_kv_head_grads(dv[..., :v_dim], groups), None)
    grad_mask = None
    if score_mod is not None:
        dq, dk, dv, grad_mask = _scored_block_backward(grad_out, q, k_rep, v_rep, mask, out, lse, is_causal=is_causal,
                                            scale=scale, score_mod=score_mod)
    elif q.device.type == "cpu":
        dq, dk, dv = aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, q, k_rep, v_rep, out, lse, 0.0, is_causal, attn_mask=mask, scale=scale)
    else:  # CUDA: without dropout its kernels read no RNG state
        no_rng = torch.empty((), dtype=torch.long)
        if _flash_fits(q, mask):
            dq, dk, dv = aten._scaled_dot_product_flash_attention_backward(
                grad_out, q, k_rep, v_rep, out, lse.contiguous(), None, None, q.shape[-2], k_rep.shape[-2], 0.0,
                is_causal, no_rng, no_rng, scale=scale)
        else:
            rows = q.shape[-2]
            padded_rows = -(-rows // _CUDA_LSE_ROW_ALIGNMENT) * _CUDA_LSE_ROW_ALIGNMENT
            lse = F.pad(lse, (0, padded_rows - rows)).contiguous()
            # Its half-precision backward reads ``out`` in the layout its forward writes ([B, S, H, D]
            # in memory), whatever its strides say: a merged output laid out [B, H, S, D] gave dq and
            # dk errors as large as themselves (H200, torch 2.11; in float32 it reads the strides).
            out = out.transpose(1, 2).contiguous().transpose(1, 2)
            dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
                grad_out, q, k_rep, v_rep, _cuda_bias(mask, q, k_rep), out, lse, no_rng, no_rng, 0.0,
                [True, True, True, False], is_causal, scale=scale)
    return dq, _sum_kv_head_grads(dk, groups), _sum_kv_head_grads(dv, groups), grad_mask


def every_row(rows: slice, length: int) -> bool:
    """Whether ``rows`` are all ``length`` rows of their dim."""
    return rows == slice(0, length)


def part(x: torch.Tensor, rows: slice, dim: int = -2) -> torch.Tensor:
    """``rows`` of ``x`` along ``dim``; ``x`` itself when they are all of it (a full slice is
    traced as one more op)."""
    return x if every_row(rows, x.shape[dim]) else x.narrow(dim, rows.start, rows.stop - rows.start)


def merge_block(out: torch.Tensor, lse: torch.Tensor, rows: slice, block_out: torch.Tensor, block_lse: torch.Tensor,
                masked: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The running output and log-sum-exp with one block's output folded into ``rows`` (online
    softmax): new tensors when the block holds every row, else ``out`` and ``lse`` written in
    place (an in-place write is traced as a copy more).

    The block's share of the merged softmax mass is ``exp(block_lse - merged)``, which is
    ``sigmoid(block_lse - lse)``: one interpolation folds it in."""
    lse_rows = part(lse, rows, -1)
    merged = torch.logaddexp(lse_rows, block_lse)
    share = torch.sigmoid(block_lse - lse_rows)
    if masked:  # a row may have met no visible key yet: -inf on both sides, and its output stays 0
        share = share.nan_to_num(0.0)
    # the weight expanded to the outputs' shape: torch 2.13's lerp meta cannot broadcast symbolic sizes
    folded = torch.lerp(part(out, rows), block_out.to(out.dtype), share.unsqueeze(-1).expand_as(block_out))
    if every_row(rows, out.shape[-2]):
        return folded, merged
    out[..., rows, :] = folded
    lse[..., rows] = merged
    return out, lse


def add_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The output and log-sum-exp with a sink logit per head folded in (GPT-OSS's attention
    sinks: a key every query sees, whose value is zero). The sink takes its share of the softmax
    mass, so the keys keep ``exp(lse - merged)``, ``sigmoid(lse - sink)``, of it. The backward
    reads the merged log-sum-exp as it reads a ring's: the sink's column adds nothing to the
    gradients of q, k and v."""
    sink = sinks.float().view(1, -1, 1)
    return out * torch.sigmoid(lse - sink).unsqueeze(-1), torch.logaddexp(lse, sink)


def sinks_grad(grad_out: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """The sinks' gradient from these query rows: each row's probability of its sink times minus
    ``rowsum(dO * O)`` (the softmax's backward at a column whose value is zero), summed per head."""
    delta = (grad_out.float() * out.float()).sum(-1)
    return -(torch.exp(sinks.float().view(1, -1, 1) - lse) * delta).sum((0, 2)).to(sinks.dtype)


def add_rows(total: torch.Tensor | None, rows: slice, share: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """``total`` (fp32, of ``shape``; zeros if None) with ``share`` added to ``rows`` of dim -2:
    out of place when ``share`` holds every row."""
    if every_row(rows, shape[-2]):
        return share.float() if total is None else total + share
    if total is None:
        total = torch.zeros(shape, dtype=torch.float32, device=share.device)
    total[..., rows, :] += share
    return total


def as_4d(mask: torch.Tensor) -> torch.Tensor:
    """A mask with its broadcast dims made explicit: [B|1, H|1, Sq|1, Skv|1], as SDPA aligns it."""
    return mask.view((1,) * (4 - mask.dim()) + tuple(mask.shape))


def as_additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask (True = attend) as the additive mask the kernels take."""
    if mask.dtype != torch.bool:
        return mask.to(dtype)
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, float("-inf"))


def _visible(rows: torch.Tensor, cols: torch.Tensor, *, causal: bool, window: int | None,
             key_padding: torch.Tensor | None) -> torch.Tensor:
    """Which (query, key) pairs of these global positions attend: [B|1, 1, rows, cols]."""
    visible = torch.ones(len(rows), len(cols), dtype=torch.bool, device=cols.device)
    if causal:
        distance = rows[:, None] - cols[None, :]
        visible = (distance >= 0) if window is None else (distance >= 0) & (distance < window)
    visible = visible[None, None]
    if key_padding is not None:
        visible = visible & key_padding.index_select(-1, cols)[:, None, None, :]
    return visible


def slice_mask(mask: torch.Tensor | None, block: Block, source: int, size: int, block_len: int, *,
               zigzag: bool) -> torch.Tensor | None:
    """The given ``mask``'s part for one block: its query rows, and the columns of the global key
    positions ``source``'s block holds (``block.kv_rows``, a prefix of the block)."""
    if mask is None:
        return None
    if mask.shape[-2] > 1:
        mask = part(mask, block.q_rows)
    if mask.shape[-1] == 1:
        return mask
    count = block.kv_rows.stop
    if not zigzag:
        return mask.narrow(-1, source * block_len, count)
    chunk = block_len // 2
    first = mask.narrow(-1, source * chunk, min(count, chunk))
    if count <= chunk:
        return first
    return torch.cat([first, mask.narrow(-1, (2 * size - 1 - source) * chunk, count - chunk)], dim=-1)


def box_positions(block: Block, *, rank: int, source: int, size: int, block_len: int, zigzag: bool,
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The global positions of one block's query rows and key columns."""
    rows = block_positions(rank, size, block_len, zigzag=zigzag)[block.q_rows].to(device)
    cols = block_positions(source, size, block_len, zigzag=zigzag)[block.kv_rows].to(device)
    return rows, cols


def positional_mask(block: Block, key_padding: torch.Tensor | None, *, rank: int, source: int, size: int,
                    block_len: int, zigzag: bool, window: int | None, dtype: torch.dtype,
                    device: torch.device) -> torch.Tensor | None:
    """The additive mask of one block's box, built from global positions (the causal window)
    and the key-padding columns of the keys it holds: [B|1, 1, rows|1, columns] of the box,
    never the sequence's. None when the box needs no mask. The kernel's own causal mask
    (``block.is_causal``) applies on top of it."""
    if not block.positional and key_padding is None:
        return None
    rows, cols = box_positions(block, rank=rank, source=source, size=size, block_len=block_len, zigzag=zigzag,
                               device=device)
    if not block.positional:
        rows = rows[:1]  # key padding alone: one row broadcasts to all
    return as_additive(_visible(rows, cols, causal=block.positional, window=window, key_padding=key_padding), dtype)


def tiled_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, is_causal: bool, window: int | None,
                    key_padding: torch.Tensor | None, scale: float | None, score_mod: ScoreMod | None = None,
                    position_bias: PositionBias | None = None, table: torch.Tensor | None = None,
                    tile: int = 512) -> torch.Tensor:
    """SDPA (or ``scored_attention`` with a ``score_mod``) of whole sequences (a ring of one)
    under a causal window and/or a key padding, without a mask of the sequence: each tile of
    ``tile`` query rows attends, in one call, to the keys its (causal) window reaches, with
    the mask of that tile alone, and the bias its positions make from ``table`` (with a
    ``score_mod``). A padded query row (past the real keys) takes the last real row's keys, so
    none is left without a key."""
    q_len, kv_len = q.shape[-2], k.shape[-2]
    out = []
    for start in range(0, q_len, tile):
        stop = min(start + tile, q_len)
        first, last = min(start, kv_len - 1), min(stop - 1, kv_len - 1)
        lo = max(0, first - window + 1) if window is not None else 0
        hi = last + 1 if is_causal else kv_len
        rows = torch.arange(start, stop, device=q.device).clamp(max=kv_len - 1)
        cols = torch.arange(lo, hi, device=q.device)
        mask = _visible(rows, cols, causal=is_causal, window=window, key_padding=key_padding)
        if position_bias is not None:
            mask = as_additive(mask, torch.float32) + position_bias.tile(table, rows, cols)
        tiles = (q[..., start:stop, :], k[..., lo:hi, :], v[..., lo:hi, :])
        out.append(F.scaled_dot_product_attention(*tiles, attn_mask=mask, scale=scale) if score_mod is None
                   else scored_attention(*tiles, mask, is_causal=False, scale=scale, score_mod=score_mod))
    return torch.cat(out, dim=-2)
