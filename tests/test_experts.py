"""Expert parallelism's row exchange (``ops.experts``) on gloo ranks, against every expert on one
device: forward, the rows' gradients and the experts'."""

from __future__ import annotations

import torch
import torch.distributed as dist

from dtensor_par.mesh import MeshDim
from dtensor_par.ops.experts import combine_rows, dispatch_rows, exchange_counts, local_offsets
from tests.background import in_background
from tests.harness import run_ranks

EXPERTS, WIDTH, OUT = 6, 5, 3


def _routing(rank: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s rows sorted by expert and its rows per expert (some experts get none)."""
    g = torch.Generator().manual_seed(rank)
    experts = torch.randint(0, EXPERTS - 1 + rank % 2, (rows,), generator=g).sort().values
    return torch.randn(rows, WIDTH, generator=g, dtype=torch.float64), experts


def exchange_rows(rank: int, world: int, *, coordinates: tuple[int, ...]) -> dict:
    """Each rank's rows through the experts it does not hold, by ``dispatch_rows`` and
    ``combine_rows`` over a mesh dim whose coordinates are not the ranks' order."""
    ep = MeshDim("cp", world, coordinates.index(rank), dist.group.WORLD.group_name, (coordinates,), 0)
    weights = torch.randn(EXPERTS, WIDTH, OUT, generator=torch.Generator().manual_seed(99), dtype=torch.float64)
    per_rank = EXPERTS // world
    mine = weights[ep.rank * per_rank:(ep.rank + 1) * per_rank].clone().requires_grad_()
    rows, experts = _routing(rank, 4 + 3 * rank)
    rows.requires_grad_()
    counts = torch.histc(experts.float(), bins=EXPERTS, min=0, max=EXPERTS - 1)
    received = exchange_counts(counts, ep)
    arrived = dispatch_rows(rows, counts, received, ep)
    ends = local_offsets(received).tolist()
    out = torch.cat([arrived[start:end] @ mine[j] for j, (start, end) in enumerate(zip([0] + ends, ends))]
                    + [arrived.new_zeros(arrived.shape[0] - ends[-1], OUT)])
    back = combine_rows(out, counts, received, ep)
    (back * torch.arange(back.numel(), dtype=back.dtype).view_as(back)).sum().backward()
    # One device: every rank's rows through every expert, the same loss summed over ranks.
    full = weights.clone().requires_grad_()
    total, own = 0.0, None
    for r in range(world):
        r_rows, r_experts = _routing(r, 4 + 3 * r)
        r_rows.requires_grad_(r == rank)
        expected = torch.einsum("nd,ndo->no", r_rows, full[r_experts])
        total = total + (expected * torch.arange(expected.numel(), dtype=expected.dtype).view_as(expected)).sum()
        own = (expected, r_rows) if r == rank else own
    total.backward()
    return {"shape": list(arrived.shape), "forward": (back - own[0]).abs().max().item(),
            "rows_grad": (rows.grad - own[1].grad).abs().max().item(),
            "experts_grad": (mine.grad - full.grad[ep.rank * per_rank:(ep.rank + 1) * per_rank]).abs().max().item()}


LAUNCH = in_background(run_ranks, 3, exchange_rows, coordinates=(2, 0, 1))


def test_rows_reach_their_experts_and_come_back_exactly():
    for rank, result in enumerate(LAUNCH.result()):
        assert result["shape"] == [3 * (4 + 3 * rank), WIDTH], result
        assert result["forward"] < 1e-12 and result["rows_grad"] < 1e-12 and result["experts_grad"] < 1e-12, result
