"""A token embedding whose table is cut by rows (the vocabulary) over a mesh dim: Megatron's
vocab-parallel embedding. Each rank holds only its rows, so no rank holds the whole table."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def vocab_rows_embedding(input: torch.Tensor, weight: torch.Tensor, rank: int,
                         padding_idx: int | None = None) -> torch.Tensor:
    """``F.embedding(input, table)`` where ``weight`` is rank ``rank``'s rows of ``table``, cut
    in equal pieces: each id this rank holds looks up its row, every other gives zeros, so the
    ranks' outputs are partial sums whose all-reduce is the whole lookup, bit for bit. The
    zeros are masked after the lookup, so the weight's gradient is exactly this rank's rows'
    (an id outside adds a zero); ``padding_idx`` (the table's row, ``>= 0``) keeps its zero
    gradient on the rank that holds it."""
    rows = weight.shape[0]
    first = rank * rows
    local = input - first
    outside = (local < 0) | (local >= rows)
    held_padding = padding_idx - first if padding_idx is not None and 0 <= padding_idx - first < rows else None
    return F.embedding(local.masked_fill(outside, 0), weight, held_padding).masked_fill(outside.unsqueeze(-1), 0)
