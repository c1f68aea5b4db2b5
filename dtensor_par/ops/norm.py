"""layer_norm and rms_norm over features sharded across ranks (a cross-head qk-norm on tp), and
group_norm over an image's rows cut over cp.

Each rank sums over its own features or rows; only those sums, one or two fp32 numbers per
token or per image and group, are all-reduced, never the activation. The sums are used
rank-locally, so their gradient is summed over ranks as well.
"""

from __future__ import annotations

import math

import torch

from ..mesh import MeshDim
from .collectives import all_reduce, grad_all_reduce
from .lowerings import FUNCTIONAL


def _total(local_sum: torch.Tensor, mesh_dim: MeshDim, comm: str) -> torch.Tensor:
    return grad_all_reduce(all_reduce(local_sum, mesh_dim, comm), mesh_dim, comm)


def _standardized(xf: torch.Tensor, dims, count: int, eps: float, mesh_dim: MeshDim, comm: str) -> torch.Tensor:
    """``xf`` less its mean over ``dims``, over its standard deviation there: the ``count``
    elements of each are spread over the ranks, so each sum is totalled over them, the
    variance's about the mean already totalled (two passes, as one device's norms compute it)."""
    centered = xf - _total(xf.sum(dims, keepdim=True), mesh_dim, comm) / count
    variance = _total(centered.square().sum(dims, keepdim=True), mesh_dim, comm) / count
    return centered * torch.rsqrt(variance + eps)


def sharded_norm(x: torch.Tensor, normalized_ndim: int, weight: torch.Tensor | None, bias: torch.Tensor | None,
                 eps: float | None, *, rms: bool, mesh_dim: MeshDim, comm: str = FUNCTIONAL) -> torch.Tensor:
    """The norm of ``x`` over its last ``normalized_ndim`` dims, of which this rank holds a
    shard (``weight`` and ``bias`` sharded alike). rms_norm's default ``eps`` is the dtype's."""
    dims = tuple(range(-normalized_ndim, 0))
    count = math.prod(x.shape[-normalized_ndim:]) * mesh_dim.size
    xf = x.float()
    if rms:
        eps = torch.finfo(x.dtype).eps if eps is None else eps
        mean_square = _total(xf.square().sum(dims, keepdim=True), mesh_dim, comm) / count
        y = xf * torch.rsqrt(mean_square + eps)
    else:
        y = _standardized(xf, dims, count, eps, mesh_dim, comm)
    y = y.to(x.dtype)
    if weight is not None:
        y = y * weight
    return y if bias is None else y + bias


def sharded_group_norm(x: torch.Tensor, num_groups: int, weight: torch.Tensor | None, bias: torch.Tensor | None,
                       eps: float, *, mesh_dim: MeshDim, comm: str = FUNCTIONAL) -> torch.Tensor:
    """``group_norm`` of ``x`` ``[N, C, *spatial]``, of whose spatial dims this rank holds an
    equal share (no padding): each group's mean, then its variance about that mean, summed over
    the ranks."""
    n, c = x.shape[:2]
    xf = x.float().reshape(n, num_groups, -1)
    y = _standardized(xf, -1, xf.shape[-1] * mesh_dim.size, eps, mesh_dim, comm).reshape(x.shape).to(x.dtype)
    per_channel = (c,) + (1,) * (x.dim() - 2)
    if weight is not None:
        y = y * weight.reshape(per_channel)
    return y if bias is None else y + bias.reshape(per_channel)
