"""Biases built from positions: what attention adds to its scores as a function of the head and
the global positions of the query and the key, evaluated per ring block (and per query tile of
a ring of one) from the positions that block covers, so no ``S x S`` bias is ever kept.

- ALiBi: ``slope[h] * (k + offset)``, the key's position (``"alibi"``: Bloom's; MPT's counts
  from the last key, ``offset = 1 - S``), or ``slope[h] * (k - q)`` (``"alibi_relative"``);
- T5's relative position bias (``"buckets"``): ``table[bucket(k - q), h]``, a learned embedding
  indexed by the bucket of the distance, a step function of ``k - q`` given by its runs.

Each reads a table ``[rows, heads]`` (ALiBi's slopes as one row), so that tp and Ulysses cut
its heads as they cut the scores'. A learned table's gradient is each tile's score gradient
summed into the entries it read (``table_grad``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

KINDS = ("alibi", "alibi_relative", "buckets")


class PositionBias(NamedTuple):
    """Which bias (one of ``KINDS``); for ``"buckets"``, the distance ``k - q`` at which each
    run of one bucket starts (ascending; the first run reaches down, the last up, without end)
    and the bucket of each run; for ``"alibi"``, the offset added to the key's position. A
    named tuple, so a graph holds it as a call's argument."""

    kind: str
    starts: tuple[int, ...] = ()
    buckets: tuple[int, ...] = ()
    offset: int = 0

    def bucket_of(self, distance: torch.Tensor) -> torch.Tensor:
        """The table row of each distance ``k - q``."""
        starts = torch.tensor(self.starts, device=distance.device)
        run = (torch.searchsorted(starts, distance.contiguous(), right=True) - 1).clamp(min=0)
        return torch.tensor(self.buckets, device=distance.device)[run]

    def tile(self, table: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        """The bias of queries at global positions ``rows`` against keys at ``cols``:
        ``[1, heads, len(rows) | 1, len(cols)]``, in the table's dtype."""
        if self.kind == "alibi":
            return (table[0][:, None, None] * (cols + self.offset).to(table.dtype)[None, None, :])[None]
        distance = cols[None, :] - rows[:, None]
        if self.kind == "alibi_relative":
            return (table[0][:, None, None] * distance.to(table.dtype)[None])[None]
        return table[self.bucket_of(distance)].permute(2, 0, 1)[None]

    def table_grad(self, grad: torch.Tensor, table: torch.Tensor, rows: torch.Tensor,
                   cols: torch.Tensor) -> torch.Tensor:
        """The table's gradient (float32) from the gradient ``[B, heads, rows, cols]`` of one tile's
        bias: each score's gradient summed into the table entry it read."""
        per_head = grad.float().sum(0)
        if self.kind == "alibi":
            return (per_head * (cols + self.offset).float()).sum((1, 2))[None]
        distance = cols[None, :] - rows[:, None]
        if self.kind == "alibi_relative":
            return (per_head * distance.float()).sum((1, 2))[None]
        total = torch.zeros(table.shape, dtype=torch.float32, device=grad.device)
        return total.index_add_(0, self.bucket_of(distance).flatten(), per_head.flatten(1).T)


class TableBias(NamedTuple):
    """A position bias with the table it reads (this rank's heads): what a ring block evaluates."""

    form: PositionBias
    table: torch.Tensor

    def tile(self, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        return self.form.tile(self.table, rows, cols)

    def table_grad(self, grad: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        return self.form.table_grad(grad, self.table, rows, cols)
