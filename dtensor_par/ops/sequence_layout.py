"""Where a sequence sharded over a ring of ``n`` ranks lies: the global positions each rank's
block holds (``S`` = full sequence length).

- contiguous: rank ``r`` holds positions ``[r*S/n, (r+1)*S/n)``. Under a causal mask rank
  ``r`` attends to ``r + 1`` blocks, so late ranks do most of the work.
- zigzag: the sequence is cut into ``2n`` chunks and rank ``r`` holds chunks ``r`` and
  ``2n-1-r``. Under a causal mask every rank does the same work at every ring step.

In both, local positions increase with global ones. ``ops.collectives`` lays a sequence out
in these positions (and back); the ring's schedule and its masks read them.
"""

from __future__ import annotations

import torch


def zigzag_indices(seq_len: int, size: int, rank: int) -> torch.Tensor:
    """Global positions rank ``rank`` holds in the zigzag layout, in local order."""
    if seq_len % (2 * size):
        raise ValueError(f"zigzag needs the sequence length ({seq_len}) to divide into 2 * {size} chunks")
    chunk = seq_len // (2 * size)
    first, second = rank, 2 * size - 1 - rank
    return torch.cat([torch.arange(first * chunk, (first + 1) * chunk),
                      torch.arange(second * chunk, (second + 1) * chunk)])


def block_positions(rank: int, size: int, block_len: int, *, zigzag: bool) -> torch.Tensor:
    """Global positions of ``rank``'s block, in local order."""
    return (zigzag_indices(block_len * size, size, rank) if zigzag
            else torch.arange(rank * block_len, (rank + 1) * block_len))


def position_runs(rank: int, size: int, block_len: int, *, zigzag: bool,
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


def count_real_keys(source: int, size: int, block_len: int, kv_len: int | None, *, zigzag: bool) -> int:
    """How many of ``source``'s key rows are real positions (< ``kv_len``), not the padding that
    ends an uneven sequence. They are a prefix of the block: local positions increase with
    global ones in both layouts."""
    if kv_len is None:
        return block_len
    if not zigzag:
        return min(block_len, max(0, kv_len - source * block_len))
    chunk = block_len // 2
    return sum(min(chunk, max(0, kv_len - c * chunk)) for c in (source, 2 * size - 1 - source))
