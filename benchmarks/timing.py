"""Timing shared by the side-by-side benchmarks: a call timed on every rank at once, the
slowest rank's time, and AdamW as torch picks it on GPU."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def timed(fn) -> float:
    """Seconds ``fn`` takes on this rank, started together on every rank."""
    dist.barrier()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def slowest(seconds: float) -> float:
    """The largest of every rank's ``seconds``: a parallel call is done when its last rank is."""
    t = torch.tensor(seconds, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def adamw(model) -> torch.optim.AdamW:
    """AdamW as torch picks it on GPU: foreach (each op over every parameter at once) where the
    parameters are of one tensor type. The tp anchor's mix DTensors and plain tensors, which
    foreach refuses, so its AdamW loops over them (CPU's default for every variant)."""
    params = list(model.parameters())
    return torch.optim.AdamW(params, foreach=len({isinstance(p, DTensor) for p in params}) == 1)
