"""Every rank must be given the same inputs: checked once per plan, before its first run.

The plan's contract is that all ranks hold the whole inputs and each cuts its own piece. A
rank given other inputs (its own data shard, its own noise) would compute a piece of a
different problem, and every rank would silently return a different wrong result. So the
first call of each plan exchanges a fingerprint of every input over the world and compares
it among the ranks that must agree: all of them, or under ``batch="local"`` the ranks at the
same data-parallel coordinate. What each rank decides on its own and all must share (the mesh
``parallel(auto=True)`` chooses) is compared among all ranks too (``check_every_rank_agrees``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

_CHUNK = 1 << 24  # bytes fingerprinted at a time: bounds the int64 copy of a large input
_WEIGHT_PERIOD = 65521  # a prime: a byte's weight is its position modulo it, plus one


def fingerprint(value) -> torch.Tensor:
    """``[numel, byte sum, position-weighted byte sum]`` of a tensor or Python number, in int64.

    Integer arithmetic on the raw bytes: exact and independent of the reduction order, so equal
    inputs give equal fingerprints on any rank and thread count; a moved or changed element
    changes the weighted sum.
    """
    if not isinstance(value, torch.Tensor):
        value = torch.tensor(value)
    data = value.detach().contiguous().reshape(-1)
    raw = (torch.view_as_real(data) if data.is_complex() else data).reshape(-1).view(torch.uint8)
    total = weighted = torch.zeros((), dtype=torch.int64, device=raw.device)
    for start in range(0, raw.numel(), _CHUNK):
        part = raw[start:start + _CHUNK].to(torch.int64)
        positions = torch.arange(start, start + part.numel(), dtype=torch.int64, device=raw.device)
        total = total + part.sum()
        weighted = weighted + (part * (positions % _WEIGHT_PERIOD + 1)).sum()
    return torch.stack([torch.tensor(data.numel(), device=raw.device), total, weighted])


def check_same_inputs(entry: str, inputs: dict[str, object], peers: list[list[int]], hint: str) -> None:
    """Raise, on every rank alike, if ranks that must agree hold different ``inputs`` (name ->
    tensor or number), or any two ranks inputs of different shapes (their plans would differ,
    and their collectives not match). ``peers`` partitions the world into the sets of ranks
    that must hold the same values."""
    if dist.get_world_size() == 1 or dist.get_backend() == "fake":
        return
    device = next((v.device for v in inputs.values() if isinstance(v, torch.Tensor)), torch.device("cpu"))
    shapes = [tuple(getattr(v, "shape", ())) for v in inputs.values()]
    signatures = _every_rank(torch.tensor([[len(inputs), hash(tuple(shapes))]], device=device))
    odd = [r for r, signature in enumerate(signatures) if not torch.equal(signature, signatures[0])]
    if odd:  # a different number of inputs, or shapes: nothing more can be exchanged safely
        counts = {int(signature[0, 0]) for signature in signatures}
        symbolic = ("; some ranks' graphs take more inputs: a symbolic size is one, and Dynamo makes a size "
                    "symbolic where this process saw another one before (automatic dynamic shapes), so ranks that "
                    "saw other sizes trace other graphs: compile with dynamic=True or dynamic=False on every rank"
                    ) if len(counts) > 1 else ""
        raise ValueError(f"{entry}: ranks {odd} were given inputs of other shapes than rank 0 (this rank "
                         f"{dist.get_rank()}: {dict(zip(inputs, map(list, shapes)))}){symbolic}. {hint}")
    if not inputs:
        return
    every = _every_rank(torch.stack([fingerprint(v).to(device) for v in inputs.values()]))
    differ = []
    for k, name in enumerate(inputs):
        for group in peers:
            odd = [r for r in group if not torch.equal(every[r, k], every[group[0], k])]
            if odd:
                differ.append(f"{name!r}: ranks {odd} hold other values than rank {group[0]}")
    if differ:
        raise ValueError(f"{entry}: ranks that must be given the same inputs were given different ones "
                         f"({'; '.join(differ)}). {hint}")


def check_every_rank_agrees(entry: str, what: str, mine, describe, hint: str) -> None:
    """Raise, on every rank alike, unless every rank holds a ``mine`` equal to rank 0's (a
    picklable value); the error shows each rank's, written by ``describe``."""
    if dist.get_world_size() == 1 or dist.get_backend() == "fake":
        return
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    if any(value != every[0] for value in every):
        held = "; ".join(f"rank {rank}: {describe(value)}" for rank, value in enumerate(every))
        raise RuntimeError(f"{entry}: the ranks do not agree on {what} ({held}). {hint}")


def _every_rank(mine: torch.Tensor) -> torch.Tensor:
    """``mine`` of every rank, stacked in rank order (not a functional collective: reports count
    the plan's collectives alone)."""
    every = torch.empty((dist.get_world_size() * len(mine), *mine.shape[1:]), dtype=mine.dtype, device=mine.device)
    dist.all_gather_single(every, mine)
    return every.view(dist.get_world_size(), *mine.shape)
