"""Exact ring attention: each rank keeps its query block while the key/value blocks travel
around the ring, so no rank ever holds the full sequence.

Partial results merge by log-sum-exp (online softmax), so the output equals full SDPA. The
backward recomputes each block from the saved output and global log-sum-exp, on the key/value
blocks the forward received (kept for it: ``ring - 1`` blocks, the memory of the keys and
values of the whole sequence but one block, traded for sending them again); each key/value
block's gradient is the sum of every rank's share: the other ranks' shares follow the block
around the ring and arrive at its owner in ``ring - 1`` rotations. AOTAutograd would keep the
blocks anyway: it merges a backward rotation with the forward's identical one (CSE).

Every rotation sends this rank's block to the next rank of the ring (by ring coordinate) and
receives the previous one's, through ``ops.lowerings``: with the functional lowering one
``_c10d_functional.all_to_all_single`` whose only non-empty split goes to the next rank, which
Dynamo and AOTAutograd trace like any other op. The next rotation is issued before the current
block is computed and waited on after it, so communication overlaps compute.

This module holds the loop of rotations, its autograd and the checks of its arguments; what
each step computes comes from ``ring_schedule`` (which box of the block, from positions in
the layouts of ``sequence_layout``) and ``ring_kernels`` (the block's mask, attention and
merge).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..mesh import MeshDim
from .lowerings import FUNCTIONAL, LOWERINGS
from .position_bias import PositionBias, TableBias
from .ring_kernels import (add_rows, add_sinks, as_4d, as_additive, block_backward, block_forward, box_positions,
                           every_row, merge_block, part, positional_mask, repeat_kv_heads, scored_attention,
                           sinks_grad, slice_mask, tiled_attention)
from .ring_schedule import Block, plan_block, source_at
from .score_mod import ScoreMod
from .sequence_layout import count_real_keys


def _consume(result: torch.Tensor, received: torch.Tensor) -> torch.Tensor:
    """``result``, made to depend on the last block received, adding an exact zero.

    A rank whose last block the causal mask hides never reads it, and a graph partitioner
    then drops the rotation that brought it. But the same collective also carries this rank's
    block to its peer, which would wait forever.
    """
    return result + received[..., :0, :].sum()


def _blocks_at(step: int, q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None,
               key_padding: torch.Tensor | None, bias: TableBias | None, *, ring: MeshDim, is_causal: bool,
               zigzag: bool, kv_len: int | None, window: int | None
               ) -> tuple[Block | None, torch.Tensor | None, tuple[torch.Tensor, torch.Tensor] | None]:
    """What this rank computes at ring step ``step``: the block (None: skipped), its additive
    mask (with the bias its positions make, if any), and, with a bias, the global positions of
    its rows and columns. The same in forward and backward."""
    rank, size, block_len = ring.rank, ring.size, k.shape[-2]
    source = source_at(step, rank, size)
    block = plan_block(rank, source, q.shape[-2], block_len, is_causal=is_causal, zigzag=zigzag,
                       real_keys=count_real_keys(source, size, block_len, kv_len, zigzag=zigzag), window=window,
                       size=size)
    if block is None:
        return None, None, None
    if mask is not None:
        block_mask = slice_mask(mask, block, source, size, block_len, zigzag=zigzag)
    else:
        block_mask = positional_mask(block, key_padding, rank=rank, source=source, size=size, block_len=block_len,
                                     zigzag=zigzag, window=window, dtype=q.dtype, device=q.device)
    if bias is None:
        return block, block_mask, None
    positions = box_positions(block, rank=rank, source=source, size=size, block_len=block_len, zigzag=zigzag,
                              device=q.device)
    tile = bias.tile(*positions)
    return block, tile if block_mask is None else block_mask + tile, positions


def _ring_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                  key_padding: torch.Tensor | None, bias: TableBias | None, sinks: torch.Tensor | None, *,
                  ring: MeshDim, comm: str, is_causal: bool, scale: float | None, zigzag: bool, kv_len: int | None,
                  window: int | None, score_mod: ScoreMod | None = None, overlap: bool = True,
                  keep_blocks: bool = False) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """Output (q's dtype) and global log-sum-exp (float32) of this rank's query rows, with the
    ``sinks`` (a logit per head) folded in last, and, with ``keep_blocks``, the stacked
    key/value block of each step (the backward's; without, each block is freed once computed).
    ``overlap=False`` waits for each rotation before computing (for benchmarks)."""
    size, net = ring.size, LOWERINGS[comm]
    groups = q.shape[1] // k.shape[1]
    masked = mask is not None or key_padding is not None or window is not None
    kv = torch.cat([k, v], -1)  # one rotation carries both (their head dims may differ: latent attention)
    split = k.shape[-1]
    blocks = [kv] if keep_blocks else []
    out = lse = None
    for step in range(size):
        incoming = net.start_rotation(kv, ring) if step + 1 < size else None
        if incoming is not None and not overlap:
            incoming = net.finish_rotation(incoming)
        block, block_mask, _ = _blocks_at(step, q, k, mask, key_padding, bias, ring=ring, is_causal=is_causal,
                                          zigzag=zigzag, kv_len=kv_len, window=window)
        if block is not None:
            block_out, block_lse = block_forward(
                part(q, block.q_rows), part(kv[..., :split], block.kv_rows), part(kv[..., split:], block.kv_rows),
                block_mask,
                is_causal=block.is_causal, scale=scale, groups=groups, score_mod=score_mod)
            if out is None and every_row(block.q_rows, q.shape[-2]):
                out, lse = block_out.float(), block_lse.float()
            else:
                if out is None:  # a window over padded keys can leave padded query rows no key
                    out = torch.zeros(block_out.shape[:-2] + (q.shape[-2], v.shape[-1]), dtype=torch.float32,
                                      device=q.device)
                    lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
                out, lse = merge_block(out, lse, block.q_rows, block_out, block_lse, masked)
        if incoming is not None:
            kv = net.finish_rotation(incoming)
            if keep_blocks:
                blocks.append(kv)
    if sinks is not None:
        out, lse = add_sinks(out, lse, sinks)
    read_last = block is not None  # else the rotation that brought it must still be kept
    return (out if read_last else _consume(out, kv)).to(q.dtype), lse, blocks


def _ring_backward(grad_out: torch.Tensor, q: torch.Tensor, blocks: list[torch.Tensor],
                   mask: torch.Tensor | None, key_padding: torch.Tensor | None, bias: TableBias | None,
                   out: torch.Tensor, lse: torch.Tensor, *, ring: MeshDim, comm: str, is_causal: bool,
                   scale: float | None, zigzag: bool, kv_len: int | None, window: int | None,
                   score_mod: ScoreMod | None = None, grad_table: bool = False
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """dq stays here, and so does this rank's share of its own key/value gradient (step 0).
    ``blocks``: the key/value block of each step (keys and values side by side along the last
    dim), as the forward received them. With ``grad_table``, the bias table's gradient from
    this rank's query rows, which needs no rotation: the table is whole on every rank, and the
    graph sums the ranks' shares.

    The other ranks' shares travel in one fp32 accumulator per block: block ``r - 1``'s
    starts on rank ``r`` at step 1, each later holder adds its share and sends it on, and the
    send at step ``ring - 1`` lands at the block's owner, which adds it to its own share.
    ``ring - 1`` dk/dv rotations, the fewest that bring every share home. Every rank issues
    the same rotations in the same order, whatever its mask skips.
    """
    net = LOWERINGS[comm]
    groups, split = q.shape[1] // blocks[0].shape[1], q.shape[-1]
    if mask is not None or key_padding is not None or window is not None:
        # A row the mask hides entirely has output 0 and no gradient; 0 keeps its kernel finite.
        lse = lse.masked_fill(lse.isneginf(), 0.0)
    dq = dtable = None
    dkv_incoming = None  # the accumulator on its way here, from step 2 on
    for step, kv in enumerate(blocks):
        block, block_mask, positions = _blocks_at(step, q, kv, mask, key_padding, bias, ring=ring,
                                                  is_causal=is_causal, zigzag=zigzag, kv_len=kv_len, window=window)
        if block is not None:
            rows, cols = block.q_rows, block.kv_rows
            dq_block, dk_block, dv_block, dmask_block = block_backward(
                part(grad_out, rows), part(q, rows), part(kv[..., :split], cols), part(kv[..., split:], cols),
                block_mask,
                part(out, rows), part(lse, rows, -1), is_causal=block.is_causal, scale=scale, groups=groups,
                score_mod=score_mod)
            dq = add_rows(dq, rows, dq_block, q.shape)
            if grad_table:
                share = bias.table_grad(dmask_block, *positions)
                dtable = share if dtable is None else dtable + share
        # step 0: this rank's own share; step 1: block (rank - 1)'s accumulator starts here;
        # later: waited only now, so its transfer overlapped this step's compute
        dkv = None if dkv_incoming is None else net.finish_rotation(dkv_incoming)
        if block is not None:
            dkv = add_rows(dkv, cols, torch.cat([dk_block, dv_block], -1), kv.shape)
        if dkv is None:
            dkv = torch.zeros_like(kv, dtype=torch.float32)
        if step == 0:
            dkv_own = dkv
        else:
            dkv_incoming = net.start_rotation(dkv, ring)
    dkv = dkv_own if dkv_incoming is None else dkv_own + net.finish_rotation(dkv_incoming)
    if dq is None:  # every block skipped (only padding here)
        dq = torch.zeros_like(q, dtype=torch.float32)
    if grad_table and dtable is None:
        dtable = torch.zeros_like(bias.table, dtype=torch.float32)
    dtable = dtable.to(bias.table.dtype) if grad_table else None
    return dq.to(q.dtype), dkv[..., :split].to(blocks[0].dtype), dkv[..., split:].to(blocks[0].dtype), dtable


class _RingAttention(torch.autograd.Function):
    """Autograd wrapper: the backward is the ring backward, not autograd through the forward's
    collectives (which would rebuild every block's attention matrix)."""

    @staticmethod
    def forward(ctx, q, k, v, mask, key_padding, table, sinks, position_bias, ring, comm, is_causal, scale, zigzag,
                kv_len, window, score_mod, overlap, keep_blocks):
        options = dict(ring=ring, comm=comm, is_causal=is_causal, scale=scale, zigzag=zigzag, kv_len=kv_len,
                       window=window, score_mod=score_mod)
        bias = None if position_bias is None else TableBias(position_bias, table)
        out, lse, blocks = _ring_forward(q, k, v, mask, key_padding, bias, sinks, **options, overlap=overlap,
                                         keep_blocks=keep_blocks)
        ctx.save_for_backward(q, mask, key_padding, table, sinks, out, lse, *blocks)
        ctx.options, ctx.position_bias = options, position_bias
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, mask, key_padding, table, sinks, out, lse, *blocks = ctx.saved_tensors
        bias = None if ctx.position_bias is None else TableBias(ctx.position_bias, table)
        dq, dk, dv, dtable = _ring_backward(grad_out, q, blocks, mask, key_padding, bias, out, lse, **ctx.options,
                                            grad_table=ctx.needs_input_grad[5])
        dsinks = sinks_grad(grad_out, out, lse, sinks) if ctx.needs_input_grad[6] else None
        return (dq, dk, dv, None, None, dtable, dsinks) + (None,) * 11


def _check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                  key_padding: torch.Tensor | None, sinks: torch.Tensor | None, *, rank: int, size: int,
                  is_causal: bool, enable_gqa: bool, zigzag: bool, kv_len: int | None, window: int | None) -> None:
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} is outside a ring of size {size}")
    if q.dim() != 4 or k.dim() != 4 or k.shape[:-1] != v.shape[:-1] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"ring_attention expects q [B, H, S, D], k [B, Hkv, S, D] and v [B, Hkv, S, Dv]; "
                         f"got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    q_heads, kv_heads = q.shape[1], k.shape[1]
    if sinks is not None and tuple(sinks.shape) != (q_heads,):
        raise ValueError(f"the sinks must be one logit per query head, [{q_heads}]; got {tuple(sinks.shape)}")
    if q_heads % kv_heads:
        raise ValueError(f"{q_heads} query heads are not a multiple of {kv_heads} key/value heads")
    if q_heads != kv_heads and not enable_gqa:
        raise ValueError(f"{q_heads} query heads and {kv_heads} key/value heads need enable_gqa=True")
    q_len, block_len = q.shape[-2], k.shape[-2]
    if is_causal and q_len != block_len:
        raise ValueError(f"causal ring attention needs equal query and key/value block lengths; "
                         f"got {q_len} and {block_len}")
    if is_causal and mask is not None:
        raise ValueError("ring attention takes a mask or is_causal, not both (as SDPA)")
    if window is not None and (not is_causal or not isinstance(window, int) or window < 1):
        raise ValueError(f"a sliding window is causal and at least 1 key wide; got window={window!r}, "
                         f"is_causal={is_causal}")
    if key_padding is not None and mask is not None:
        raise ValueError("ring attention takes a mask or a key padding, not both")
    if zigzag and (is_causal or kv_len is not None or mask is not None or key_padding is not None) and block_len % 2:
        raise ValueError(f"zigzag needs an even local block length (two chunks); got {block_len}")
    keys = block_len * size if kv_len is None else kv_len
    if mask is not None and (mask.dim() != 4 or mask.shape[-2] not in (1, q_len) or mask.shape[-1] not in (1, keys)):
        raise ValueError(f"the mask must be [B|1, H|1, {q_len}|1, {keys}|1] (this rank's query rows, every "
                         f"key position); got {tuple(mask.shape)}")
    if key_padding is not None and (key_padding.dim() != 2 or key_padding.dtype != torch.bool
                                    or key_padding.shape[0] not in (1, q.shape[0]) or key_padding.shape[1] != keys):
        raise ValueError(f"the key padding must be boolean [B|1, {keys}] (True = attend); got "
                         f"{key_padding.dtype} {tuple(key_padding.shape)}")
    if kv_len is not None:
        empty = [r for r in range(size) if count_real_keys(r, size, block_len, kv_len, zigzag=zigzag) == 0]
        if kv_len > block_len * size or empty:
            raise ValueError(f"kv_len {kv_len} leaves ring ranks {empty} with only padding in blocks of "
                             f"{block_len} x {size}")


def _hide_padded_keys(mask: torch.Tensor | None, kv_len: torch.SymInt, laid_out: int, is_causal: bool,
                      device: torch.device) -> torch.Tensor | None:
    """A symbolic ``kv_len`` (one graph for every length) as a mask, not a branch on how much
    of each block is padding: causal attention needs none (the padded keys follow every real
    query); otherwise the mask, over all ``laid_out`` key positions, hides those past ``kv_len``."""
    if is_causal:
        return mask
    positions = torch.arange(laid_out, device=device)
    real = positions < kv_len
    if mask is None:
        return real.view(1, 1, 1, laid_out)
    if mask.shape[-1] != 1:
        mask = mask.index_select(-1, positions.clamp(max=kv_len - 1))
    if mask.dtype == torch.bool:
        return mask & real
    return mask.masked_fill(~real, float("-inf"))


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, ring: MeshDim,
                   attn_mask: torch.Tensor | None = None, is_causal: bool = False, scale: float | None = None,
                   enable_gqa: bool = False, zigzag: bool = False, kv_len: int | None = None,
                   window: int | None = None, key_padding: torch.Tensor | None = None,
                   score_mod: ScoreMod | None = None, position_bias: PositionBias | None = None,
                   table: torch.Tensor | None = None, sinks: torch.Tensor | None = None, overlap: bool = True,
                   comm: str = FUNCTIONAL) -> torch.Tensor:
    """This rank's rows of ``F.scaled_dot_product_attention`` over the full sequences, in
    forward and backward. ``overlap=False`` serializes communication and compute in the
    forward (only to measure what overlap saves). ``score_mod``: a score function applied to
    the scaled scores before the masks (attention written out by hand, ``ops.score_mod``).
    ``position_bias``: a bias built from positions (``ops.position_bias``) and the ``table``
    ``[rows, heads]`` it reads, added with the masks; each block evaluates its own tile, and
    the table gets its gradient. ``sinks``: a logit per query head (GPT-OSS's attention sinks:
    a key every query sees, whose value is zero), folded in after the blocks merge, with its
    gradient from this rank's query rows.

    ``ring``: the ring's layout (its groups and this rank's coordinate ``rank`` of ``size``);
    ``comm``: the lowering of its rotations (``ops.lowerings``).
    q: [B, Hq, Sq, D], k and v: [B, Hkv, Skv, D], this rank's sequence block (dim -2) of
    equal-length blocks, in ring order, or in the zigzag layout (chunks ``rank`` and
    ``2*size-1-rank``) when ``zigzag``. Key/value blocks travel with their own kv heads.
    ``kv_len``: the real key length when the blocks hold an uneven sequence padded at its end
    (the padding is masked). ``attn_mask`` (boolean, True = attend, or additive):
    [B|1, H|1, Sq|1, keys|1], this rank's query rows against every real key position in
    global order; each block takes its columns. ``window`` (with ``is_causal``): query ``p``
    sees only keys ``p - window < k <= p``. ``key_padding``: boolean [B|1, keys] (True =
    attend), every real key position in global order; it combines with ``is_causal`` and
    ``window``, which need no mask of the sequence.
    """
    if attn_mask is not None:
        attn_mask = as_4d(attn_mask)
    if position_bias is not None and score_mod is None:
        score_mod = ScoreMod(())  # the scores themselves: no fused kernel adds the bias
    if isinstance(kv_len, torch.SymInt):  # only without a window or key padding: those pin the length
        attn_mask, kv_len = _hide_padded_keys(attn_mask, kv_len, k.shape[-2] * ring.size, is_causal, k.device), None
    _check_inputs(q, k, v, attn_mask, key_padding, sinks, rank=ring.rank, size=ring.size, is_causal=is_causal,
                  enable_gqa=enable_gqa, zigzag=zigzag, kv_len=kv_len, window=window)
    if ring.size == 1 and sinks is None:  # the fused kernels; with sinks the ring's, which gives the log-sum-exp
        if kv_len is not None:
            k, v = k[..., :kv_len, :], v[..., :kv_len, :]
        # kv heads repeated here, after the exchange, as each ring block does: with grouped kv,
        # CUDA's SDPA has only its flash kernel (half precision, no mask), else the math one.
        groups = q.shape[1] // k.shape[1]
        k, v = repeat_kv_heads(k, groups), repeat_kv_heads(v, groups)
        if score_mod is not None and attn_mask is not None:
            if position_bias is not None:
                positions = torch.arange(q.shape[-2], device=q.device), torch.arange(k.shape[-2], device=q.device)
                attn_mask = as_additive(attn_mask, torch.float32) + position_bias.tile(table, *positions)
            return scored_attention(q, k, v, attn_mask, is_causal=is_causal, scale=scale, score_mod=score_mod)
        if window is not None or key_padding is not None or score_mod is not None:
            return tiled_attention(q, k, v, is_causal=is_causal, window=window, key_padding=key_padding, scale=scale,
                                   score_mod=score_mod, position_bias=position_bias, table=table)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale)
    mask = None if attn_mask is None else as_additive(attn_mask, q.dtype)
    backward = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, table, sinks) if t is not None)
    return _RingAttention.apply(q, k, v, mask, key_padding, table, sinks, position_bias, ring, comm, is_causal, scale,
                                zigzag, kv_len, window, score_mod, overlap, backward)
