"""A convolution over a spatial dim cut over the sequence ranks (a depthwise 3 x 3 convolution over
image rows cut over cp, a downsampling of stride 2): each run of rows a rank holds is
convolved with the rows it reaches across its edges, its halo, fetched from the ranks that hold
them.

The rows of an image grid cut over cp are the sequence's rows: contiguous chunks, or the zigzag
layout's two a ring rank (split further among its ulysses ranks). Each rank sends the rows of
each run it holds that its neighbours read: the first ``after`` and the last ``before`` (one
all-gather of ``runs x (before + after)`` rows); a run is convolved with the last rows of the
run before it and the first of the run after it (zeros at the image's edges, as the conv's
padding), and gives exactly its own rows of the output. The backward sums each rank's gradient
of the rows it sent (a reduce-scatter).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

from ..mesh import MeshDim
from .collectives import gather_stacked
from .lowerings import FUNCTIONAL


class HaloPlan(NamedTuple):
    """This rank's runs along the cut dim: ``runs`` of ``run_length`` rows each (every rank holds
    as many, as long), and for each run the runs its halos come from, the one before (``above``:
    its last rows) and the one after (``below``: its first rows), numbered ``rank * runs + run``
    among every rank's (-1: the image's edge, zeros). Plain values: FX prints it as code."""

    runs: int
    run_length: int
    above: tuple[int, ...]
    below: tuple[int, ...]


def halo_plan(positions: list[list[int]], rank: int) -> HaloPlan:
    """The plan for ``rank`` given every rank's global row positions in local order (as many
    rows each): runs of consecutive rows, cut to the greatest length that divides every one, so
    that every rank's are as long and as many."""
    runs_of = [_runs(rows) for rows in positions]
    length = math.gcd(*(stop - start for runs in runs_of for start, stop in runs))
    runs_of = [[(s, s + length) for start, stop in runs for s in range(start, stop, length)] for runs in runs_of]
    count = len(runs_of[0])
    starting, ending = {}, {}  # the first and the last global row of each run -> its number
    for r, runs in enumerate(runs_of):
        for j, (start, stop) in enumerate(runs):
            starting[start], ending[stop - 1] = r * count + j, r * count + j
    mine = runs_of[rank]
    return HaloPlan(count, length, tuple(ending.get(start - 1, -1) for start, _ in mine),
                    tuple(starting.get(stop, -1) for _, stop in mine))


def _runs(rows: list[int]) -> list[tuple[int, int]]:
    """Maximal runs of consecutive positions: ``[(start, stop), ...]`` in local order."""
    runs = []
    for row in rows:
        if runs and runs[-1][1] == row:
            runs[-1] = (runs[-1][0], row + 1)
        else:
            runs.append((row, row + 1))
    return runs


def padded_conv1d(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, pad: tuple[int, int],
                  groups: int = 1) -> torch.Tensor:
    """``conv1d`` of ``input`` padded with ``pad = (before, after)`` zero rows along its length,
    which it gives back whole when ``before + after`` is the kernel's length less one: a causal
    convolution reads the rows up to its own (``(k - 1, 0)``). Canonicalize makes it of a
    convolution padded alike at both ends and cropped to its input's length (transformers'
    ``causal_conv1d_fn``: Mamba's, LFM2's, the gated delta rule's)."""
    return F.conv1d(F.pad(input, pad), weight, bias, groups=groups)


def halo_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, stride: tuple[int, ...],
              padding: tuple[int, ...], groups: int, *, dim: int, reach: tuple[int, int], plan: HaloPlan,
              mesh_dim: MeshDim, comm: str = FUNCTIONAL) -> torch.Tensor:
    """``conv{1,2,3}d(x, weight, bias, stride, padding, dilation=1, groups)`` on this rank's rows of
    spatial ``dim`` (cut over ``mesh_dim``, laid out as ``plan`` says, each run starting and
    ending on the stride), which reads ``reach = (before, after)`` rows past each end of a run
    (``rules.matmul.reach_of``): each run convolved with those rows of its neighbours, fetched
    from the ranks that hold them, gives exactly its share of the output rows."""
    before, after = reach
    conv = (F.conv1d, F.conv2d, F.conv3d)[x.dim() - 3]
    runs = x.split(plan.run_length, dim)
    # each run sends what its neighbours read: its first `after` rows, then its last `before`
    edges = torch.stack([torch.cat([run.narrow(dim, 0, after), run.narrow(dim, plan.run_length - before, before)], dim)
                         for run in runs])
    sent = gather_stacked(edges, mesh_dim, comm).flatten(0, 1)  # [ranks * runs, *edges]
    inner = tuple(0 if d == dim - 2 else p for d, p in enumerate(padding))
    out = []
    for run, above, below in zip(runs, plan.above, plan.below):
        rows = [torch.zeros_like(run.narrow(dim, 0, before)) if above < 0 else sent[above].narrow(dim, after, before),
                run,
                torch.zeros_like(run.narrow(dim, 0, after)) if below < 0 else sent[below].narrow(dim, 0, after)]
        out.append(conv(torch.cat(rows, dim), weight, bias, stride=stride, padding=inner, groups=groups))
    return torch.cat(out, dim)
