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

A mask holds this rank's query rows against every key position; each block takes the
columns of the keys it holds, and a row that a block's mask hides entirely weighs nothing in
the merge. An uneven sequence padded at its end (``kv_len`` real keys) leaves the padded keys
out of every block.

A causal sliding window (``window``: query ``p`` sees keys ``p - window < k <= p``, as
Mistral's) and a key-padding mask (``key_padding``, ``[B, keys]``) need no mask of the
sequence: each block computes only the box of rows and columns where the window leaves
something visible (a block outside the window is skipped, forward and backward) and builds
the mask of that box alone from the global positions (and the key-padding columns it holds).

Layouts (``S`` = full sequence length, ``n`` = ring size):

- contiguous: rank ``r`` holds positions ``[r*S/n, (r+1)*S/n)``. Under a causal mask rank
  ``r`` attends to ``r + 1`` blocks, so late ranks do most of the work.
- zigzag: the sequence is cut into ``2n`` chunks and rank ``r`` holds chunks ``r`` and
  ``2n-1-r``. Under a causal mask every rank does the same work at every ring step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..mesh import MeshDim
from .lowerings import FUNCTIONAL, LOWERINGS

aten = torch.ops.aten

# The CUDA memory-efficient kernel pads its log-sum-exp to this many query rows, and its
# backward checks the alignment that padding gives.
_CUDA_LSE_ROW_ALIGNMENT = 32


@dataclass(frozen=True)
class _Block:
    """The part of (this rank's queries) x (one source rank's keys) that is computed.

    Rows are local sequence positions; ``is_causal`` means the two ranges hold the same
    global positions, so the kernel's own causal mask is the global one.
    """

    q_rows: slice
    kv_rows: slice
    is_causal: bool
    positional: bool = False  # the box holds hidden pairs: its mask is built from the global positions


def _real_keys(source: int, size: int, block_len: int, kv_len: int | None, *, zigzag: bool) -> int:
    """How many of ``source``'s key rows are real positions (< ``kv_len``), not the padding that
    ends an uneven sequence. They are a prefix of the block: local positions increase with
    global ones in both layouts."""
    if kv_len is None:
        return block_len
    if not zigzag:
        return min(block_len, max(0, kv_len - source * block_len))
    chunk = block_len // 2
    return sum(min(chunk, max(0, kv_len - c * chunk)) for c in (source, 2 * size - 1 - source))


def _plan_block(rank: int, source: int, q_block: int, kv_block: int, *, is_causal: bool, zigzag: bool,
                real_keys: int | None = None, window: int | None = None, size: int = 1) -> _Block | None:
    """What this rank computes against the key/value block of ``source`` (block lengths
    ``q_block`` and ``kv_block``), whose first ``real_keys`` rows are real; None if causality,
    the window or padding hides all of it. ``size``: the ring size (needed with a window)."""
    if window is not None:
        return _window_block(rank, source, size, q_block, kv_block if real_keys is None else real_keys,
                             window=window, zigzag=zigzag)
    block = _causal_block(rank, source, q_block, kv_block, is_causal=is_causal, zigzag=zigzag)
    if block is None or real_keys is None or real_keys >= block.kv_rows.stop:
        return block
    # Every block's key rows start at 0, so the real ones are a prefix of them.
    return _Block(block.q_rows, slice(0, real_keys), block.is_causal) if real_keys else None


def _causal_block(rank: int, source: int, q_block: int, kv_block: int, *, is_causal: bool,
                  zigzag: bool) -> _Block | None:
    """The part causality leaves of this rank's queries against ``source``'s keys."""
    everything = _Block(slice(0, q_block), slice(0, kv_block), False)
    if not is_causal:
        return everything
    if source == rank:
        # Local positions increase with global ones in both layouts, so the local causal
        # mask is the global one.
        return _Block(slice(0, q_block), slice(0, kv_block), True)
    if not zigzag:
        return everything if source < rank else None
    half = q_block // 2
    if source < rank:
        # Our chunks are r and 2n-1-r. The source's first chunk precedes both; its second
        # chunk follows both.
        return _Block(slice(0, q_block), slice(0, half), False)
    # Both source chunks follow our first chunk and precede our second one.
    return _Block(slice(half, q_block), slice(0, kv_block), False)


def _spans(rank: int, size: int, block_len: int, *, zigzag: bool,
           count: int | None = None) -> list[tuple[int, int, int]]:
    """``(local start, global start, length)`` of each contiguous run of global positions in
    ``rank``'s block, cut to its first ``count`` rows."""
    if zigzag:
        chunk = block_len // 2
        spans = [(0, rank * chunk, chunk), (chunk, (2 * size - 1 - rank) * chunk, chunk)]
    else:
        spans = [(0, rank * block_len, block_len)]
    count = block_len if count is None else count
    return [(local, start, min(length, count - local)) for local, start, length in spans if local < count]


def _window_block(rank: int, source: int, size: int, q_block: int, kv_real: int, *, window: int,
                  zigzag: bool) -> _Block | None:
    """The box of this rank's queries x ``source``'s first ``kv_real`` keys in which the causal
    window (``p - window < k <= p``) leaves a pair visible; None when it leaves none. This
    rank's own block runs with the kernel's causal mask (and the window's where it cuts);
    another block runs plain when the window hides nothing in its box, else with its mask."""
    q_spans = _spans(rank, size, q_block, zigzag=zigzag)
    kv_spans = _spans(source, size, q_block, zigzag=zigzag, count=kv_real)
    rows, cols = [], []
    for q_local, qa, q_len in q_spans:
        for k_local, ka, k_len in kv_spans:
            qb, kb = qa + q_len, ka + k_len
            row_lo, row_hi = max(qa, ka), min(qb, kb - 1 + window)
            col_lo, col_hi = max(ka, qa - window + 1), min(kb, qb)
            if row_lo < row_hi and col_lo < col_hi:
                rows += [q_local + row_lo - qa, q_local + row_hi - qa]
                cols += [k_local + col_lo - ka, k_local + col_hi - ka]
    if not rows:
        return None
    q_rows, kv_rows = slice(min(rows), max(rows)), slice(min(cols), max(cols))

    def clipped(spans, box):
        return [(start + max(box.start, local) - local, start + min(box.stop, local + length) - local)
                for local, start, length in spans if max(box.start, local) < min(box.stop, local + length)]

    q_ranges, kv_ranges = clipped(q_spans, q_rows), clipped(kv_spans, kv_rows)
    if source == rank:
        # Both boxes start at row 0 of the same positions (every query sees itself), so the
        # kernel's causal mask is the global one; the window's mask only where it cuts.
        return _Block(q_rows, kv_rows, True, positional=q_ranges[-1][1] - 1 - kv_ranges[0][0] >= window)
    if all(kb - 1 <= qa and qb - 1 - ka < window for qa, qb in q_ranges for ka, kb in kv_ranges):
        return _Block(q_rows, kv_rows, False)
    return _Block(q_rows, kv_rows, False, positional=True)


def _block_positions(rank: int, size: int, block_len: int, *, zigzag: bool) -> torch.Tensor:
    """Global positions of ``rank``'s block, in local order."""
    return (zigzag_indices(block_len * size, size, rank) if zigzag
            else torch.arange(rank * block_len, (rank + 1) * block_len))


def _positional_mask(block: _Block, key_padding: torch.Tensor | None, *, rank: int, source: int, size: int,
                     block_len: int, zigzag: bool, window: int | None, dtype: torch.dtype,
                     device: torch.device) -> torch.Tensor | None:
    """The additive mask of one block's box, built from global positions (the causal window)
    and the key-padding columns of the keys it holds: [B|1, 1, rows|1, columns] of the box,
    never the sequence's. None when the box needs no mask. The kernel's own causal mask
    (``block.is_causal``) applies on top of it."""
    if not block.positional and key_padding is None:
        return None
    rows = _block_positions(rank, size, block_len, zigzag=zigzag)[block.q_rows].to(device)
    cols = _block_positions(source, size, block_len, zigzag=zigzag)[block.kv_rows].to(device)
    if not block.positional:
        rows = rows[:1]  # key padding alone: one row broadcasts to all
    return _additive(_visible(rows, cols, causal=block.positional, window=window, key_padding=key_padding), dtype)


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


def _source_at(step: int, rank: int, size: int) -> int:
    """Whose key/value block this rank holds at ring step ``step``."""
    return (rank - step) % size


def zigzag_indices(seq_len: int, size: int, rank: int) -> torch.Tensor:
    """Global positions rank ``rank`` holds in the zigzag layout, in local order."""
    if seq_len % (2 * size):
        raise ValueError(f"zigzag needs the sequence length ({seq_len}) to divide into 2 * {size} chunks")
    chunk = seq_len // (2 * size)
    first, second = rank, 2 * size - 1 - rank
    return torch.cat([torch.arange(first * chunk, (first + 1) * chunk),
                      torch.arange(second * chunk, (second + 1) * chunk)])


def ring_step_flops(seq_len: int, size: int, rank: int, *, zigzag: bool, is_causal: bool,
                    batch: int = 1, heads: int = 1, head_dim: int = 1, window: int | None = None) -> list[int]:
    """Attention FLOPs this rank spends at each ring step, following the schedule
    ``ring_attention`` runs: 4 FLOPs per (query, key) pair per head dim (two matmuls,
    QK^T and PV, each a multiply-add), counting only the pairs the kernel computes (a
    block's whole box under a mask, a skipped block nothing)."""
    if seq_len % size:
        raise ValueError(f"sequence length {seq_len} does not divide into {size} ring blocks")
    local = seq_len // size
    per_step = []
    for step in range(size):
        block = _plan_block(rank, _source_at(step, rank, size), local, local, is_causal=is_causal,
                            zigzag=zigzag, window=window, size=size)
        pairs = 0
        if block is not None:
            rows = block.q_rows.stop - block.q_rows.start
            cols = block.kv_rows.stop - block.kv_rows.start
            pairs = rows * (rows + 1) // 2 if block.is_causal else rows * cols
        per_step.append(4 * batch * heads * head_dim * pairs)
    return per_step


def _repeat_kv_heads(x: torch.Tensor, groups: int) -> torch.Tensor:
    """The fused kernels need one key/value head per query head (SDPA's GQA head order)."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def _sum_kv_head_grads(grad: torch.Tensor, groups: int) -> torch.Tensor:
    """Gradient of ``_repeat_kv_heads``: each kv head collects the grads of its copies."""
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


def _block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, *,
                   is_causal: bool, scale: float | None, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One block's attention output and per-row log-sum-exp ([B, H, Sq], float32); ``mask`` is
    additive. A row the mask hides entirely gets log-sum-exp -inf (the CPU kernel reports 0),
    so it weighs nothing in the merge."""
    k, v = _repeat_kv_heads(k, groups), _repeat_kv_heads(v, groups)
    if q.device.type == "cpu":
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, is_causal, attn_mask=mask,
                                                                    scale=scale)
    else:
        out, lse, _, _ = aten._scaled_dot_product_efficient_attention(q, k, v, _cuda_bias(mask, q, k), True, 0.0,
                                                                      is_causal, scale=scale)
        lse = lse[..., : q.shape[-2]]
    if mask is not None:
        visible = ~mask.isneginf()
        if is_causal:  # the kernel's causal mask hides the rest
            visible = visible & torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
        hidden = ~visible.any(-1)
        out, lse = out.masked_fill(hidden.unsqueeze(-1), 0.0), lse.masked_fill(hidden, float("-inf"))
    return out, lse


def _block_backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    mask: torch.Tensor | None, out: torch.Tensor, lse: torch.Tensor, *, is_causal: bool,
                    scale: float | None, groups: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One block's exact share of dq, dk, dv.

    Given the *final* output and *global* log-sum-exp, the kernel's softmax probabilities are
    the global ones, so the per-block gradients sum to the full-attention gradients.
    """
    k_rep, v_rep = _repeat_kv_heads(k, groups), _repeat_kv_heads(v, groups)
    if q.device.type == "cpu":
        dq, dk, dv = aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, q, k_rep, v_rep, out, lse, 0.0, is_causal, attn_mask=mask, scale=scale)
    else:
        rows = q.shape[-2]
        padded_rows = -(-rows // _CUDA_LSE_ROW_ALIGNMENT) * _CUDA_LSE_ROW_ALIGNMENT
        lse = F.pad(lse, (0, padded_rows - rows)).contiguous()
        # Without dropout the kernel ignores the RNG state; these match what its forward returns.
        no_rng = torch.empty((), dtype=torch.long)
        dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
            grad_out, q, k_rep, v_rep, _cuda_bias(mask, q, k_rep), out, lse, no_rng, no_rng, 0.0,
            [True, True, True, False], is_causal, scale=scale)
    return dq, _sum_kv_head_grads(dk, groups), _sum_kv_head_grads(dv, groups)


def _block_mask(mask: torch.Tensor | None, block: _Block, source: int, size: int, block_len: int, *,
                zigzag: bool) -> torch.Tensor | None:
    """The mask's part for one block: its query rows, and the columns of the global key
    positions ``source``'s block holds (``block.kv_rows``, a prefix of the block)."""
    if mask is None:
        return None
    if mask.shape[-2] > 1:
        mask = _part(mask, block.q_rows)
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


def _consume(result: torch.Tensor, received: torch.Tensor) -> torch.Tensor:
    """``result``, made to depend on the last block received, adding an exact zero.

    A rank whose last block the causal mask hides never reads it, and a graph partitioner
    then drops the rotation that brought it. But the same collective also carries this rank's
    block to its peer, which would wait forever.
    """
    return result + received[..., :0, :].sum()


def _every_row(rows: slice, length: int) -> bool:
    return rows == slice(0, length)


def _part(x: torch.Tensor, rows: slice, dim: int = -2) -> torch.Tensor:
    """``rows`` of ``x`` along ``dim``; ``x`` itself when they are all of it (a full slice is
    traced as one more op)."""
    return x if _every_row(rows, x.shape[dim]) else x.narrow(dim, rows.start, rows.stop - rows.start)


def _merge(out: torch.Tensor, lse: torch.Tensor, rows: slice, block_out: torch.Tensor, block_lse: torch.Tensor,
           masked: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The running output and log-sum-exp with one block's output folded into ``rows`` (online
    softmax): new tensors when the block holds every row, else ``out`` and ``lse`` written in
    place (an in-place write is traced as a copy more).

    The block's share of the merged softmax mass is ``exp(block_lse - merged)``, which is
    ``sigmoid(block_lse - lse)``: one interpolation folds it in."""
    lse_rows = _part(lse, rows, -1)
    merged = torch.logaddexp(lse_rows, block_lse)
    share = torch.sigmoid(block_lse - lse_rows)
    if masked:  # a row may have met no visible key yet: -inf on both sides, and its output stays 0
        share = share.nan_to_num(0.0)
    folded = torch.lerp(_part(out, rows), block_out.to(out.dtype), share.unsqueeze(-1))
    if _every_row(rows, out.shape[-2]):
        return folded, merged
    out[..., rows, :] = folded
    lse[..., rows] = merged
    return out, lse


def _add_rows(total: torch.Tensor | None, rows: slice, part: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """``total`` (fp32, of ``shape``; zeros if None) with ``part`` added to ``rows`` of dim -2:
    out of place when ``part`` holds every row."""
    if _every_row(rows, shape[-2]):
        return part.float() if total is None else total + part
    if total is None:
        total = torch.zeros(shape, dtype=torch.float32, device=part.device)
    total[..., rows, :] += part
    return total


def _blocks_at(step: int, q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None,
               key_padding: torch.Tensor | None, *, ring: MeshDim, is_causal: bool, zigzag: bool,
               kv_len: int | None, window: int | None) -> tuple[_Block | None, torch.Tensor | None]:
    """What this rank computes at ring step ``step``: the block (None: skipped) and its additive
    mask. The same in forward and backward."""
    rank, size, block_len = ring.rank, ring.size, k.shape[-2]
    source = _source_at(step, rank, size)
    block = _plan_block(rank, source, q.shape[-2], block_len, is_causal=is_causal, zigzag=zigzag,
                        real_keys=_real_keys(source, size, block_len, kv_len, zigzag=zigzag), window=window,
                        size=size)
    if block is None:
        return None, None
    if mask is not None:
        return block, _block_mask(mask, block, source, size, block_len, zigzag=zigzag)
    box_mask = _positional_mask(block, key_padding, rank=rank, source=source, size=size, block_len=block_len,
                                zigzag=zigzag, window=window, dtype=q.dtype, device=q.device)
    return block, box_mask


def _ring_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                  key_padding: torch.Tensor | None, *, ring: MeshDim, comm: str, is_causal: bool,
                  scale: float | None, zigzag: bool, kv_len: int | None, window: int | None,
                  overlap: bool = True, keep_blocks: bool = False
                  ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """Output (q's dtype) and global log-sum-exp (float32) of this rank's query rows, and, with
    ``keep_blocks``, the stacked key/value block of each step (the backward's; without, each
    block is freed once computed). ``overlap=False`` waits for each rotation before computing
    (for benchmarks)."""
    size, net = ring.size, LOWERINGS[comm]
    groups = q.shape[1] // k.shape[1]
    masked = mask is not None or key_padding is not None or window is not None
    kv = torch.stack([k, v])
    blocks = [kv] if keep_blocks else []
    out = lse = None
    for step in range(size):
        incoming = net.start_rotation(kv, ring) if step + 1 < size else None
        if incoming is not None and not overlap:
            incoming = net.finish_rotation(incoming)
        block, block_mask = _blocks_at(step, q, k, mask, key_padding, ring=ring, is_causal=is_causal,
                                                      zigzag=zigzag, kv_len=kv_len, window=window)
        if block is not None:
            block_out, block_lse = _block_forward(
                _part(q, block.q_rows), _part(kv[0], block.kv_rows), _part(kv[1], block.kv_rows), block_mask,
                is_causal=block.is_causal, scale=scale, groups=groups)
            if out is None and _every_row(block.q_rows, q.shape[-2]):
                out, lse = block_out.float(), block_lse.float()
            else:
                if out is None:  # a window over padded keys can leave padded query rows no key
                    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
                    lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
                out, lse = _merge(out, lse, block.q_rows, block_out, block_lse, masked)
        if incoming is not None:
            kv = net.finish_rotation(incoming)
            if keep_blocks:
                blocks.append(kv)
    read_last = block is not None  # else the rotation that brought it must still be kept
    return (out if read_last else _consume(out, kv)).to(q.dtype), lse, blocks


def _ring_backward(grad_out: torch.Tensor, q: torch.Tensor, blocks: list[torch.Tensor],
                   mask: torch.Tensor | None, key_padding: torch.Tensor | None, out: torch.Tensor, lse: torch.Tensor,
                   *, ring: MeshDim, comm: str, is_causal: bool, scale: float | None, zigzag: bool,
                   kv_len: int | None, window: int | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq stays here, and so does this rank's share of its own key/value gradient (step 0).
    ``blocks``: the stacked key/value block of each step, as the forward received them.

    The other ranks' shares travel in one fp32 accumulator per block: block ``r - 1``'s
    starts on rank ``r`` at step 1, each later holder adds its share and sends it on, and the
    send at step ``ring - 1`` lands at the block's owner, which adds it to its own share.
    ``ring - 1`` dk/dv rotations, the fewest that bring every share home. Every rank issues
    the same rotations in the same order, whatever its mask skips.
    """
    net = LOWERINGS[comm]
    groups = q.shape[1] // blocks[0].shape[2]
    if mask is not None or key_padding is not None or window is not None:
        # A row the mask hides entirely has output 0 and no gradient; 0 keeps its kernel finite.
        lse = lse.masked_fill(lse.isneginf(), 0.0)
    dq = None
    dkv_incoming = None  # the accumulator on its way here, from step 2 on
    for step, kv in enumerate(blocks):
        block, block_mask = _blocks_at(step, q, kv[0], mask, key_padding, ring=ring, is_causal=is_causal,
                                                      zigzag=zigzag, kv_len=kv_len, window=window)
        if block is not None:
            rows, cols = block.q_rows, block.kv_rows
            dq_block, dk_block, dv_block = _block_backward(
                _part(grad_out, rows), _part(q, rows), _part(kv[0], cols), _part(kv[1], cols), block_mask,
                _part(out, rows), _part(lse, rows, -1), is_causal=block.is_causal, scale=scale, groups=groups)
            dq = _add_rows(dq, rows, dq_block, q.shape)
        # step 0: this rank's own share; step 1: block (rank - 1)'s accumulator starts here;
        # later: waited only now, so its transfer overlapped this step's compute
        dkv = None if dkv_incoming is None else net.finish_rotation(dkv_incoming)
        if block is not None:
            dkv = _add_rows(dkv, cols, torch.stack([dk_block, dv_block]), kv.shape)
        if dkv is None:
            dkv = torch.zeros_like(kv, dtype=torch.float32)
        if step == 0:
            dkv_own = dkv
        else:
            dkv_incoming = net.start_rotation(dkv, ring)
    dkv = dkv_own + net.finish_rotation(dkv_incoming)
    if dq is None:  # every block skipped (only padding here)
        dq = torch.zeros_like(q, dtype=torch.float32)
    return dq.to(q.dtype), dkv[0].to(blocks[0].dtype), dkv[1].to(blocks[0].dtype)


class _RingAttention(torch.autograd.Function):
    """Autograd wrapper: the backward is the ring backward, not autograd through the forward's
    collectives (which would rebuild every block's attention matrix)."""

    @staticmethod
    def forward(ctx, q, k, v, mask, key_padding, ring, comm, is_causal, scale, zigzag, kv_len, window, overlap,
                keep_blocks):
        options = dict(ring=ring, comm=comm, is_causal=is_causal, scale=scale, zigzag=zigzag, kv_len=kv_len,
                       window=window)
        out, lse, blocks = _ring_forward(q, k, v, mask, key_padding, **options, overlap=overlap,
                                         keep_blocks=keep_blocks)
        ctx.save_for_backward(q, mask, key_padding, out, lse, *blocks)
        ctx.options = options
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, mask, key_padding, out, lse, *blocks = ctx.saved_tensors
        dq, dk, dv = _ring_backward(grad_out, q, blocks, mask, key_padding, out, lse, **ctx.options)
        return (dq, dk, dv) + (None,) * 11


def _check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                  key_padding: torch.Tensor | None, *, rank: int, size: int, is_causal: bool, enable_gqa: bool,
                  zigzag: bool, kv_len: int | None, window: int | None) -> None:
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} is outside a ring of size {size}")
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4:
        raise ValueError(f"ring_attention expects q [B, H, S, D] and k, v of one shape [B, Hkv, S, D]; "
                         f"got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    q_heads, kv_heads = q.shape[1], k.shape[1]
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
        empty = [r for r in range(size) if _real_keys(r, size, block_len, kv_len, zigzag=zigzag) == 0]
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


def as_4d(mask: torch.Tensor) -> torch.Tensor:
    """A mask with its broadcast dims made explicit: [B|1, H|1, Sq|1, Skv|1], as SDPA aligns it."""
    return mask.view((1,) * (4 - mask.dim()) + tuple(mask.shape))


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask (True = attend) as the additive mask the kernels take."""
    if mask.dtype != torch.bool:
        return mask.to(dtype)
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, float("-inf"))


def _tiled_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, is_causal: bool, window: int | None,
                     key_padding: torch.Tensor | None, scale: float | None, tile: int = 512) -> torch.Tensor:
    """SDPA of whole sequences (a ring of one) under a causal window and/or a key padding,
    without a mask of the sequence: each tile of ``tile`` query rows attends, in one call, to
    the keys its (causal) window reaches, with the mask of that tile alone. A padded query
    row (past the real keys) takes the last real row's keys, so none is left without a key."""
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
        out.append(F.scaled_dot_product_attention(q[..., start:stop, :], k[..., lo:hi, :], v[..., lo:hi, :],
                                                  attn_mask=mask, scale=scale))
    return torch.cat(out, dim=-2)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, ring: MeshDim,
                   attn_mask: torch.Tensor | None = None, is_causal: bool = False, scale: float | None = None,
                   enable_gqa: bool = False, zigzag: bool = False, kv_len: int | None = None,
                   window: int | None = None, key_padding: torch.Tensor | None = None,
                   overlap: bool = True, comm: str = FUNCTIONAL) -> torch.Tensor:
    """This rank's rows of ``F.scaled_dot_product_attention`` over the full sequences, in
    forward and backward. ``overlap=False`` serializes communication and compute in the
    forward (only to measure what overlap saves).

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
    if isinstance(kv_len, torch.SymInt):  # only without a window or key padding: those pin the length
        attn_mask, kv_len = _hide_padded_keys(attn_mask, kv_len, k.shape[-2] * ring.size, is_causal, k.device), None
    _check_inputs(q, k, v, attn_mask, key_padding, rank=ring.rank, size=ring.size, is_causal=is_causal,
                  enable_gqa=enable_gqa, zigzag=zigzag, kv_len=kv_len, window=window)
    if ring.size == 1:
        if kv_len is not None:
            k, v = k[..., :kv_len, :], v[..., :kv_len, :]
        # kv heads repeated here, after the exchange, as each ring block does: with grouped kv,
        # CUDA's SDPA has only its flash kernel (half precision, no mask), else the math one.
        groups = q.shape[1] // k.shape[1]
        k, v = _repeat_kv_heads(k, groups), _repeat_kv_heads(v, groups)
        if window is not None or key_padding is not None:
            return _tiled_attention(q, k, v, is_causal=is_causal, window=window, key_padding=key_padding, scale=scale)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale)
    mask = None if attn_mask is None else _additive(attn_mask, q.dtype)
    backward = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    return _RingAttention.apply(q, k, v, mask, key_padding, ring, comm, is_causal, scale, zigzag, kv_len, window,
                                overlap, backward)
