"""Redistributions between placements, with the autograd of a replicated loss.

Every rank computes the same loss, so gradients follow DTensor's (Megatron's f/g) rules, not
the sum-of-per-rank-losses rules of torch's functional-collective autograd:

======================  =====================  ==========================
forward                 placement change       backward
======================  =====================  ==========================
all_reduce              Partial -> Replicate   identity
reduce_scatter          Partial -> Shard       all_gather
all_gather              Shard -> Replicate     local slice
all_gather_partial_grad Shard -> Replicate,    reduce_scatter
                        used by a rank-local
                        computation
shard_local             Replicate -> Shard     all_gather
all_to_all              Shard(a) -> Shard(b)   all_to_all back
grad_all_reduce         Replicate used by a    all_reduce (the gradient
(identity)              rank-local computation is a per-rank partial)
======================  =====================  ==========================

The forwards are ``torch.ops._c10d_functional`` ops, so a traced graph shows each collective
and inductor may schedule it. Each public function is what a localized graph calls.
"""

from __future__ import annotations

import torch

from ..placements import InterleavedShard, Placement, Shard, local_chunk

_c10d = torch.ops._c10d_functional


def _placement(dim: int, parts: tuple[int, ...] | None) -> Placement:
    return Shard(dim) if parts is None else InterleavedShard(dim, parts)


def _gather(x: torch.Tensor, dim: int, parts: tuple[int, ...] | None, group: str, size: int) -> torch.Tensor:
    out = _c10d.wait_tensor(_c10d.all_gather_into_tensor(x.contiguous(), size, group))
    by_rank = out.chunk(size, dim=0)
    if parts is None:
        return torch.cat(by_rank, dim=dim)
    local_parts = [p // size for p in parts]
    per_rank = [r.split(local_parts, dim=dim) for r in by_rank]
    return torch.cat([per_rank[r][i] for i in range(len(parts)) for r in range(size)], dim=dim)


def _reduce_scatter(x: torch.Tensor, p: Placement, group: str, size: int) -> torch.Tensor:
    """Sum over ranks, keeping this rank's piece under placement ``p``."""
    stacked = torch.cat([local_chunk(x, p, r, size) for r in range(size)], dim=0).contiguous()
    return _c10d.wait_tensor(_c10d.reduce_scatter_tensor(stacked, "sum", size, group))


def _all_to_all(x: torch.Tensor, src_dim: int, dst_dim: int, group: str, size: int) -> torch.Tensor:
    """Local shard of ``src_dim`` -> local shard of ``dst_dim`` (even sizes)."""
    send = torch.stack(x.chunk(size, dim=dst_dim), dim=0).contiguous()
    flat = send.flatten(0, 1)
    split = [flat.shape[0] // size] * size
    recv = _c10d.wait_tensor(_c10d.all_to_all_single(flat, split, split, group)).view(send.shape)
    return torch.cat(recv.unbind(0), dim=src_dim)


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _c10d.wait_tensor(_c10d.all_reduce(x.contiguous(), "sum", group))

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GradAllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _c10d.wait_tensor(_c10d.all_reduce(grad.contiguous(), "sum", ctx.group)), None


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, parts, group, rank, size):
        ctx.args = (dim, parts, rank, size)
        return _gather(x, dim, parts, group, size)

    @staticmethod
    def backward(ctx, grad):
        dim, parts, rank, size = ctx.args
        return local_chunk(grad, _placement(dim, parts), rank, size), None, None, None, None, None


class _ShardLocal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, parts, group, rank, size):
        ctx.args = (dim, parts, group, size)
        return local_chunk(x, _placement(dim, parts), rank, size).contiguous()

    @staticmethod
    def backward(ctx, grad):
        dim, parts, group, size = ctx.args
        return _gather(grad, dim, parts, group, size), None, None, None, None, None


class _AllGatherPartialGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, parts, group, size):
        ctx.args = (dim, parts, group, size)
        return _gather(x, dim, parts, group, size)

    @staticmethod
    def backward(ctx, grad):
        dim, parts, group, size = ctx.args
        return _reduce_scatter(grad, _placement(dim, parts), group, size), None, None, None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group, size):
        ctx.args = (dim, group, size)
        return _reduce_scatter(x, Shard(dim), group, size)

    @staticmethod
    def backward(ctx, grad):
        dim, group, size = ctx.args
        return _gather(grad, dim, None, group, size), None, None, None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, src_dim, dst_dim, group, size):
        ctx.args = (src_dim, dst_dim, group, size)
        return _all_to_all(x, src_dim, dst_dim, group, size)

    @staticmethod
    def backward(ctx, grad):
        src_dim, dst_dim, group, size = ctx.args
        return _all_to_all(grad, dst_dim, src_dim, group, size), None, None, None, None


def all_reduce(x: torch.Tensor, group: str) -> torch.Tensor:
    return _AllReduce.apply(x, group)


def grad_all_reduce(x: torch.Tensor, group: str) -> torch.Tensor:
    return _GradAllReduce.apply(x, group)


def all_gather(x: torch.Tensor, dim: int, parts: tuple[int, ...] | None, group: str, rank: int,
               size: int) -> torch.Tensor:
    return _AllGather.apply(x, dim, parts, group, rank, size)


def all_gather_partial_grad(x: torch.Tensor, dim: int, parts: tuple[int, ...] | None, group: str,
                            size: int) -> torch.Tensor:
    return _AllGatherPartialGrad.apply(x, dim, parts, group, size)


def shard_local(x: torch.Tensor, dim: int, parts: tuple[int, ...] | None, group: str, rank: int,
                size: int) -> torch.Tensor:
    return _ShardLocal.apply(x, dim, parts, group, rank, size)


def reduce_scatter(x: torch.Tensor, dim: int, group: str, size: int) -> torch.Tensor:
    return _ReduceScatter.apply(x, dim, group, size)


def all_to_all(x: torch.Tensor, src_dim: int, dst_dim: int, group: str, size: int) -> torch.Tensor:
    return _AllToAll.apply(x, src_dim, dst_dim, group, size)


def gather_param_grad(grad: torch.Tensor, p: Placement, group: str, size: int) -> torch.Tensor:
    """Full gradient of a parameter from every rank's gradient of its local shard."""
    return _gather(grad, p.dim, p.parts if isinstance(p, InterleavedShard) else None, group, size)


COMMUNICATION = {
    all_reduce: ("all_reduce", None),
    reduce_scatter: ("reduce_scatter", "all_gather"),
    all_gather: ("all_gather", None),
    all_gather_partial_grad: ("all_gather", "reduce_scatter"),
    shard_local: (None, "all_gather"),
    all_to_all: ("all_to_all", "all_to_all"),
    grad_all_reduce: (None, "all_reduce"),
}
"""The collective each function a localized graph calls issues in (forward, backward)."""
