"""The ring's schedule: what this rank computes of the key/value block it holds at each
ring step, a box of (its query rows) x (the block's key rows) or nothing, decided from
positions alone (no tensor), the same in forward and backward; and what that costs
(``ring_step_flops``, which the coverage report reads).

Under a causal mask this rank's own block runs with the kernel's causal mask; in the
contiguous layout an earlier rank's block is computed whole and a later one's not at all, in
the zigzag layout every other rank's block in half. A causal sliding window (``window``:
query ``p`` sees keys ``p - window < k <= p``) keeps the box of rows and
columns where the window leaves something visible (a block outside the window is skipped,
forward and backward), marked ``positional`` when the box itself holds hidden pairs. An
uneven sequence padded at its end (``kv_len`` real keys) leaves the padded keys out of every
block.
"""

from __future__ import annotations

from dataclasses import dataclass

from .sequence_layout import position_runs


@dataclass(frozen=True)
class Block:
    """The part of (this rank's queries) x (one source rank's keys) that is computed.

    Rows are local sequence positions; ``is_causal`` means the two ranges hold the same
    global positions, so the kernel's own causal mask is the global one.
    """

    q_rows: slice
    kv_rows: slice
    is_causal: bool
    positional: bool = False  # the box holds hidden pairs: its mask is built from the global positions


def plan_block(rank: int, source: int, q_block: int, kv_block: int, *, is_causal: bool, zigzag: bool,
               real_keys: int | None = None, window: int | None = None, size: int = 1) -> Block | None:
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
    return Block(block.q_rows, slice(0, real_keys), block.is_causal) if real_keys else None


def _causal_block(rank: int, source: int, q_block: int, kv_block: int, *, is_causal: bool,
                  zigzag: bool) -> Block | None:
    """The part causality leaves of this rank's queries against ``source``'s keys."""
    everything = Block(slice(0, q_block), slice(0, kv_block), False)
    if not is_causal:
        return everything
    if source == rank:
        # Local positions increase with global ones in both layouts, so the local causal
        # mask is the global one.
        return Block(slice(0, q_block), slice(0, kv_block), True)
    if not zigzag:
        return everything if source < rank else None
    half = q_block // 2
    if source < rank:
        # Our chunks are r and 2n-1-r. The source's first chunk precedes both; its second
        # chunk follows both.
        return Block(slice(0, q_block), slice(0, half), False)
    # Both source chunks follow our first chunk and precede our second one.
    return Block(slice(half, q_block), slice(0, kv_block), False)


def _window_block(rank: int, source: int, size: int, q_block: int, kv_real: int, *, window: int,
                  zigzag: bool) -> Block | None:
    """The box of this rank's queries x ``source``'s first ``kv_real`` keys in which the causal
    window (``p - window < k <= p``) leaves a pair visible; None when it leaves none. This
    rank's own block runs with the kernel's causal mask (and the window's where it cuts);
    another block runs plain when the window hides nothing in its box, else with its mask."""
    q_spans = position_runs(rank, size, q_block, zigzag=zigzag)
    kv_spans = position_runs(source, size, q_block, zigzag=zigzag, count=kv_real)
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
        return Block(q_rows, kv_rows, True, positional=q_ranges[-1][1] - 1 - kv_ranges[0][0] >= window)
    if all(kb - 1 <= qa and qb - 1 - ka < window for qa, qb in q_ranges for ka, kb in kv_ranges):
        return Block(q_rows, kv_rows, False)
    return Block(q_rows, kv_rows, False, positional=True)


def source_at(step: int, rank: int, size: int) -> int:
    """Whose key/value block this rank holds at ring step ``step``."""
    return (rank - step) % size


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
        block = plan_block(rank, source_at(step, rank, size), local, local, is_causal=is_causal,
                           zigzag=zigzag, window=window, size=size)
        pairs = 0
        if block is not None:
            rows = block.q_rows.stop - block.q_rows.start
            cols = block.kv_rows.stop - block.kv_rows.start
            pairs = rows * (rows + 1) // 2 if block.is_causal else rows * cols
        per_step.append(4 * batch * heads * head_dim * pairs)
    return per_step
