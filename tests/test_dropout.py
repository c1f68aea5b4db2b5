"""Dropout of sharded tensors: one mask per distinct shard, the same mask on ranks holding the
same elements. Ranks are simulated in one process (each rank's view of a tp2 x ulysses2 mesh,
every rank's generator seeded alike, as a real run seeds them): no process group needed."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from dtensor_par.planning import parallelize_graph
from dtensor_par.mesh import MeshInfo
from dtensor_par.ops.dropout import sharded_dropout
from dtensor_par.passes.capture import capture_graphs
from tests.conftest import DEVICES

P = 0.3
SHAPE = (64, 64)


def _rank_views(sizes: dict) -> list[MeshInfo]:
    """Each rank's view of the mesh (order ring, ulysses, tp: tp fastest)."""
    planning = MeshInfo.for_planning(sizes, "cpu")
    ranks = torch.arange(planning.world_size).reshape([planning.size(n) for n in planning.order])
    return [MeshInfo.build("cpu", ranks, planning.order, me, lambda *_: None) for me in range(planning.world_size)]


def _masks(dims: tuple[str, ...], device: str, seed: int = 0) -> tuple[list[torch.Tensor], list[float]]:
    """Each rank's keep-mask of a shard sharded along ``dims``, and the next number each
    rank's generator (the device's) gives afterwards."""
    masks, after = [], []
    for view in _rank_views({"tp": 2, "ulysses": 2}):
        torch.manual_seed(seed)
        x = torch.ones(SHAPE, device=device)
        masks.append(sharded_dropout(x, P, True, dims=tuple(view.dims[d] for d in dims)) != 0)
        after.append(torch.rand((), device=device).item())
    return masks, after


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool((a == b).all())


@pytest.mark.parametrize("device", DEVICES)
def test_ranks_holding_the_same_elements_draw_the_same_mask_and_others_differ(device):
    masks, after = _masks(("tp",), device)  # ranks 0, 2 hold tp shard 0; ranks 1, 3 shard 1 (cp replicated)
    assert _same(masks[0], masks[2]) and _same(masks[1], masks[3])
    assert not _same(masks[0], masks[1])
    masks, _ = _masks(("tp", "cp"), device)  # four shards: four masks
    assert all(not _same(masks[i], masks[j]) for i in range(4) for j in range(i + 1, 4))
    # Every rank's generator advanced alike, so later random ops stay in step.
    assert len(set(after)) == 1


@pytest.mark.parametrize("device", DEVICES)
def test_keep_rate_independence_and_determinism(device):
    masks, _ = _masks(("tp", "cp"), device)
    n = math.prod(SHAPE)
    sigma = math.sqrt(P * (1 - P) / n)
    for mask in masks:
        assert abs(mask.float().mean().item() - (1 - P)) < 5 * sigma
    # Independent shards agree on about (1-p)^2 + p^2 of the elements, not on all of them.
    agreement = (masks[0] == masks[1]).float().mean().item()
    assert abs(agreement - ((1 - P) ** 2 + P ** 2)) < 5 * math.sqrt(0.25 / n)
    again, _ = _masks(("tp", "cp"), device)
    assert all(_same(a, b) for a, b in zip(masks, again))
    other_seed, _ = _masks(("tp", "cp"), device, seed=1)
    assert not _same(masks[0], other_seed[0])


@pytest.mark.parametrize("device", DEVICES)
def test_forward_and_backward_use_one_mask_under_aot_eager(device):
    """The mask op is drawn once: the gradient is the forward's keep-mask / (1 - p)."""
    dims = (_rank_views({"tp": 2})[1].dims["tp"],)
    fn = torch.compile(lambda x: sharded_dropout(x, P, True, dims=dims), backend="aot_eager", fullgraph=True)
    x = torch.randn(SHAPE, device=device, requires_grad=True)
    out = fn(x)
    out.sum().backward()
    kept = out != 0
    assert torch.allclose(x.grad, kept / (1 - P)) and torch.allclose(out, x.detach() * x.grad)
    assert sharded_dropout(x, P, False, dims=dims) is x


class _DropoutBlock(nn.Module):
    """Dropout on tp-sharded MLP features, on the sequence-sharded residual after attention,
    and on a replicated (pooled) tensor."""

    def __init__(self, dim: int = 32, heads: int = 4):
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))
        self.up, self.down = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = (f(x).view(b, s, self.heads, -1).transpose(1, 2) for f in (self.q, self.k, self.v))
        attention = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, s, d)
        y = x + F.dropout(self.o(attention), 0.2, True)
        y = y + self.down(F.dropout(F.gelu(self.up(y)), 0.1, True))
        return y, F.dropout(y.sum(1), 0.3, True)


def test_localize_gives_each_sharded_dropout_its_mesh_dims():
    (gm, inputs), = capture_graphs(_DropoutBlock(), torch.randn(2, 16, 32))
    local, _ = parallelize_graph(gm, inputs, MeshInfo.for_planning({"tp": 2, "ulysses": 2}, "cpu"))
    dropouts = {n.args[1]: n for n in local.graph.nodes if n.target in (F.dropout, sharded_dropout)}
    assert sorted(dropouts) == [0.1, 0.2, 0.3], dropouts
    assert [d.name for d in dropouts[0.1].kwargs["dims"]] == ["tp", "cp"]  # features on tp, sequence on cp
    assert [d.name for d in dropouts[0.2].kwargs["dims"]] == ["cp"]
    assert dropouts[0.3].target is F.dropout  # replicated: the single-device mask on every rank


@pytest.mark.parametrize("p", [-0.1, 1.5])
def test_bad_probability(p):
    with pytest.raises(ValueError, match="between 0 and 1"):
        sharded_dropout(torch.ones(2), p, dims=())
