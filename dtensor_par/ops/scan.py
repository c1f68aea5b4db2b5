"""A running sum (``cumsum``) along a dim sharded across ranks: RoBERTa's position ids, counted
over the sequence that cp cuts.

Each rank sums within each run of the dim it holds (one, or the zigzag layout's two), then adds
the totals of every run that comes before it in the whole dim: only those totals, one number
per run and row, are gathered, never the tensor. Padding sits at the end of the dim, so it
reaches no run that holds a real position. A floating input gets its gradient through the
gather's reduce-scatter.
"""

from __future__ import annotations

import torch

from ..mesh import MeshDim
from .collectives import every_rank_positions, gather_stacked
from .lowerings import FUNCTIONAL


def sharded_cumsum(x: torch.Tensor, dim: int, length: int, mesh_dim: MeshDim, dtype: torch.dtype | None = None,
                   comm: str = FUNCTIONAL) -> torch.Tensor:
    """``torch.cumsum(x, dim, dtype=dtype)`` of the whole dim (``length`` long), of which this
    rank holds its piece ``x``, sharded over ``mesh_dim``."""
    runs = mesh_dim.chunks_per_rank
    rows = x.movedim(dim, -1)
    summed = rows.unflatten(-1, (runs, -1)).cumsum(-1, dtype=dtype)  # [..., runs, rows a run]
    totals = gather_stacked(summed[..., -1], mesh_dim, comm).movedim(0, -2).flatten(-2)  # [..., ranks * runs]
    starts = every_rank_positions(length, mesh_dim)[:, ::summed.shape[-1]]  # [ranks, runs]: each run's first row
    before = (starts.flatten() < starts[mesh_dim.rank].unsqueeze(-1)).to(x.device, summed.dtype)  # [runs, all runs]
    offsets = (totals.unsqueeze(-2) * before).sum(-1)  # [..., runs]
    return (summed + offsets.unsqueeze(-1)).flatten(-2).movedim(-1, dim)
