"""Normalizations, softmax and reductions: a shard survives when its dim is not reduced."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...placements import Partial, shard_dim
from ..patterns import arg, tensor_val
from .core import R, NodeSharding, moved, norm_dim, replicate_all, resolve_partial
from .registry import register


def norm_rule(node, ins, cur, env):
    cur = resolve_partial(ins, cur, env)
    x_p, ndim = cur[0], tensor_val(ins[0]).dim()
    normalized = len(arg(node, 1, "normalized_shape"))
    if shard_dim(x_p) is not None and x_p.dim < ndim - normalized:
        return NodeSharding(x_p, (x_p,) + tuple(R for _ in ins[1:]))
    return replicate_all(node, ins, cur, "normalization over the sharded dim")


def softmax_rule(node, ins, cur, env):
    cur = resolve_partial(ins, cur, env)
    p, ndim = cur[0], tensor_val(ins[0]).dim()
    if shard_dim(p) is not None and p.dim != norm_dim(arg(node, 1, "dim"), ndim):
        return NodeSharding(p, (p,))
    return replicate_all(node, ins, cur, "softmax over the sharded dim")


def reduce_rule(node, ins, cur, env):
    p, ndim = cur[0], tensor_val(ins[0]).dim()
    dims = arg(node, 1, "dim")
    reduced = set(range(ndim)) if dims is None else {norm_dim(d, ndim) for d in
                                                     (dims if isinstance(dims, (tuple, list)) else [dims])}
    keepdim = arg(node, 2, "keepdim", False)
    if isinstance(p, Partial) and node.target in ("sum", "mean", torch.sum, torch.mean):
        return NodeSharding(p, (p,))
    p = resolve_partial(ins, cur, env)[0]
    if shard_dim(p) is None or p.dim in reduced:
        return replicate_all(node, ins, [p], "reduction over the sharded dim")
    out_dim = p.dim if keepdim else p.dim - sum(1 for d in reduced if d < p.dim)
    return NodeSharding(moved(p, out_dim), (p,))


register("norm", "reductions", norm_rule, functions=[F.layer_norm, F.rms_norm, torch.layer_norm, torch.rms_norm])
register("softmax", "reductions", softmax_rule, functions=[F.softmax, torch.softmax, F.log_softmax,
                                                           torch.log_softmax],
         methods=["softmax", "log_softmax"])
register("reduce", "reductions", reduce_rule, functions=[torch.sum, torch.mean, torch.amax],
         methods=["sum", "mean", "amax"])
