"""Normalizations, softmax and reductions: a shard survives when its dim is not reduced, or
when the statistics of a norm are all-reduced instead."""

from __future__ import annotations

import math

import torch
import torch.fx as fx
import torch.nn.functional as F

from ...mesh import MeshInfo
from ...ops.norm import sharded_group_norm, sharded_norm
from ...ops.recurrence import kind_of, linear_recurrence, run_plan, sharded_linear_recurrence
from ...ops.scan import sharded_cumsum
from ...placements import InterleavedShard, Partial, Shard, parts_of, shard_dim
from ...symbolic import hint, is_symbolic
from ..meta import (Communication, NodeSharding, global_shape, planned_local_shape, set_communications, shardings,
                    site_role)
from ..nodes import arguments, target_name, tensor_val
from .core import R, moved, norm_dim, replaced_by, replicate_all, resolve_partial
from .pointwise import pointwise_rule
from .registry import register


def _normalized_ndim(node: fx.Node) -> int:
    shape = arguments(node)["normalized_shape"]
    return 1 if isinstance(shape, int) else len(shape)


def norm_rule(node, ins, cur, env):
    """A shard of a batch or sequence dim stays. A tp shard of the normalized features stays
    too (a cross-head qk-norm): ``localize_norm`` all-reduces the statistics instead."""
    cur = resolve_partial(ins, cur, env)
    x_p, ndim = cur[0], tensor_val(ins[0]).dim()
    first = ndim - _normalized_ndim(node)
    if shard_dim(x_p) is not None and x_p.dim < first:
        return NodeSharding(x_p, (x_p,) + tuple(R for _ in ins[1:]))
    if shard_dim(x_p) is not None and env.cuts_features:
        return NodeSharding(x_p, (x_p,) + tuple(moved(x_p, x_p.dim - first) for _ in ins[1:]))
    return replicate_all(node, ins, cur, "normalization over the sequence sharded on cp")


def localize_norm(gm: fx.GraphModule, node: fx.Node, mesh: MeshInfo) -> None:
    """A norm over features sharded on tp becomes ``sharded_norm``: statistics all-reduced."""
    ndim, normalized = len(global_shape(node)), _normalized_ndim(node)
    across = [name for name, s in shardings(node).items()
              if shard_dim(s.inputs[0]) is not None and s.inputs[0].dim >= ndim - normalized]
    if not across:
        return
    mesh_dim = mesh.dims[across[0]]
    rms = node.target in (F.rms_norm, torch.rms_norm)
    given = arguments(node)
    local = planned_local_shape(node, mesh)
    nbytes = hint(math.prod(local[:ndim - normalized])) * 4 * (1 if rms else 2)  # fp32 sums per token
    backward = "all_reduce" if node.meta["requires_grad"] else None
    sums = [Communication("all_reduce", backward, mesh_dim.name, mesh_dim.size, nbytes, nbytes, site_role(node))]
    new = replaced_by(gm, node, "call_function", sharded_norm,
                      (given["input"], normalized, given["weight"], given.get("bias"), given["eps"]),
                      {"rms": rms, "mesh_dim": mesh_dim})
    set_communications(new, sums)


def group_norm_rule(node, ins, cur, env):
    """A shard of the batch stays, and so does an equal one of a spatial dim (an image's rows
    cut over cp: ``localize_group_norm`` all-reduces each group's sums), and one of the channels
    in whole groups (a UNet's resnet block cut over tp: each rank normalizes its own groups,
    with its weight and bias). Padded rows would count: gathered, as channels that cut groups."""
    cur = resolve_partial(ins, cur, env)
    x_p, val = cur[0], tensor_val(ins[0])
    spatial = isinstance(x_p, Shard) and x_p.dim >= 2 and not env.padded(val.shape[x_p.dim])
    if spatial or x_p == Shard(0):
        return NodeSharding(x_p, (x_p,) + tuple(R for _ in ins[1:]))
    if x_p == Shard(1) and arguments(node)["num_groups"] % env.size == 0 and not env.padded(val.shape[1]):
        return NodeSharding(x_p, (x_p,) + tuple(Shard(0) for _ in ins[1:]))
    return replicate_all(node, ins, cur, "group_norm over channels that cut its groups, or over padded rows")


def localize_group_norm(gm: fx.GraphModule, node: fx.Node, mesh: MeshInfo) -> None:
    """A group_norm over cut channels normalizes this rank's groups; over rows cut it becomes
    ``sharded_group_norm``: each group's sums all-reduced."""
    given = arguments(node)
    given["num_groups"] = given["num_groups"] * planned_local_shape(node, mesh)[1] // global_shape(node)[1]
    node.args, node.kwargs = (), given
    across = [name for name, s in shardings(node).items() if shard_dim(s.inputs[0]) not in (None, 0, 1)]
    if not across:
        return
    mesh_dim = mesh.dims[across[0]]
    nbytes = hint(planned_local_shape(node, mesh)[0]) * given["num_groups"] * 4  # an fp32 sum per image and group
    backward = "all_reduce" if node.meta["requires_grad"] else None
    sums = [Communication("all_reduce", backward, mesh_dim.name, mesh_dim.size, nbytes, nbytes, site_role(node))] * 2
    new = replaced_by(gm, node, "call_function", sharded_group_norm,
                      (given["input"], given["num_groups"], given.get("weight"), given.get("bias"),
                       given.get("eps", 1e-5)), {"mesh_dim": mesh_dim})
    set_communications(new, sums)


def along_dim_rule(node, ins, cur, env):
    """``softmax`` and ``F.normalize``: each slice along ``dim`` normalized alone, so a shard of
    another dim stays and a shard of ``dim`` is gathered."""
    cur = resolve_partial(ins, cur, env)
    p, ndim = cur[0], tensor_val(ins[0]).dim()
    if shard_dim(p) is not None and p.dim != norm_dim(arguments(node)["dim"], ndim):
        return NodeSharding(p, (p,))
    return replicate_all(node, ins, cur, f"{target_name(node)} over the sharded dim")


_LINEAR = ("sum", "mean", torch.sum, torch.mean)
"""Reductions that are sums: of partial sums, or of shards (a mean is a sum scaled)."""


def _reduced_dims(node: fx.Node, ndim: int) -> set[int]:
    dims = arguments(node).get("dim")  # x.sum(): an overload without dims
    return set(range(ndim)) if dims is None else {norm_dim(d, ndim) for d in
                                                  (dims if isinstance(dims, (tuple, list)) else [dims])}


def reduce_rule(node, ins, cur, env):
    """A shard of a dim kept stays. A sum or mean over a sharded dim gives partial sums,
    unless the dim is padded (an uneven sequence: the padding would count); any other
    reduction over it (``amax``, ``var``, ``std``: xLSTM's norms; a vector norm: Inkling2's L2
    clip, ``F.normalize``) is gathered."""
    p, val = cur[0], tensor_val(ins[0])
    reduced = _reduced_dims(node, val.dim())
    if isinstance(p, Partial) and node.target in _LINEAR:
        return NodeSharding(p, (p,))
    p = resolve_partial(ins, cur, env)[0]
    if shard_dim(p) is not None and p.dim in reduced and node.target in _LINEAR and not any(
            env.padded(part) for part in parts_of(p, val.shape[p.dim])):
        return NodeSharding(Partial(), (p,))
    if shard_dim(p) is None or p.dim in reduced:
        return replicate_all(node, ins, [p], "reduction over the sharded dim")
    keepdim = arguments(node).get("keepdim", False)
    out_dim = p.dim if keepdim else p.dim - sum(1 for d in reduced if d < p.dim)
    return NodeSharding(moved(p, out_dim), (p,))


def extreme_rule(node, ins, cur, env):
    """``max`` and ``min``: along a dim, the values and their indices, each placed as the input
    with the dim dropped unless kept; a shard of that dim is gathered (an index into a shard is
    none into the whole). Of two tensors: elementwise. Of the whole tensor: one value, gathered."""
    given = arguments(node)
    if "other" in given:
        return pointwise_rule(node, ins, cur, env)
    p = resolve_partial(ins, cur, env)[0]
    if given.get("dim") is None:
        return NodeSharding(R, (R,)) if p == R else replicate_all(node, ins, [p], f"{target_name(node)} of all")
    dim = norm_dim(given["dim"], tensor_val(ins[0]).dim())
    if shard_dim(p) == dim:
        return replicate_all(node, ins, [p], f"{target_name(node)} along the sharded dim {dim}")
    out = p if shard_dim(p) is None or given.get("keepdim", False) or p.dim < dim else moved(p, p.dim - 1)
    return NodeSharding((out, out), (p,))


def cumsum_rule(node, ins, cur, env):
    """A running sum keeps its input's cut: along another dim each rank sums its own piece;
    along the cut dim, cut evenly, each rank adds the totals of the pieces before its own
    (``localize_cumsum``). Cut part by part (a joint sequence), the parts are gathered."""
    p = resolve_partial(ins, cur, env)[0]
    dim = norm_dim(arguments(node)["dim"], tensor_val(ins[0]).dim())
    if shard_dim(p) == dim and (isinstance(p, InterleavedShard) or is_symbolic(tensor_val(ins[0]).shape[dim])):
        return replicate_all(node, ins, [p], f"a running sum along the dim {dim}, cut part by part or of a "
                                             f"symbolic length")
    return NodeSharding(p, (p,))


def localize_cumsum(gm: fx.GraphModule, node: fx.Node, mesh: MeshInfo) -> None:
    """A running sum along a dim sharded evenly becomes ``sharded_cumsum``: each run's total
    gathered, never the tensor."""
    given = arguments(node)
    dim = norm_dim(given["dim"], len(global_shape(node)))
    along = [name for name, s in shardings(node).items() if shard_dim(s.inputs[0]) == dim]
    if not along:
        return
    mesh_dim = mesh.dims[along[0]]
    local = planned_local_shape(node, mesh)
    totals = hint(math.prod(local) // local[dim]) * mesh_dim.chunks_per_rank * tensor_val(node).element_size()
    backward = "reduce_scatter" if node.meta["requires_grad"] else None
    gathered = [Communication("all_gather", backward, mesh_dim.name, mesh_dim.size, totals, totals * mesh_dim.size,
                              site_role(node))]
    new = replaced_by(gm, node, "call_function", sharded_cumsum,
                      (given["input"], dim, global_shape(node)[dim], mesh_dim, given.get("dtype")))
    set_communications(new, gathered)


def recurrence_rule(node, ins, cur, env):
    """A linear recurrence (``ops.recurrence``) runs each batch row and each head alone, along
    the sequence. Its rows (q, k, v, g and beta; Mamba-2's x, dt, B and C) cut alike along the
    batch (dp) or the heads (tp: q and k, B and C by their key heads or groups, the rest by their
    value heads; a single key head or group whole on every rank) run on each rank's, its states
    (the one it starts from, if given, and the final one) and per-head tensors (Mamba-2's A, D
    and dt_bias: sliced as the heads are) cut so too; along a sequence of static length (cp),
    from zeros, each rank runs its rows from the state the rows before leave
    (``localize_recurrence``), the final state whole on every rank. Any other cut is gathered."""
    kind = kind_of(node.args[0])
    cur = resolve_partial(ins, cur, env)
    count = len(kind.rows)
    rows, start = cur[:count], cur[count + len(kind.per_head):]
    whole = [name in kind.key_heads and tensor_val(i).shape[2] == 1 for name, i in zip(kind.rows, ins)]
    cut = {p for p, single in zip(rows, whole) if not single} - {R}
    p = cut.pop() if len(cut) == 1 else R if not cut else None
    state = {0: Shard(0), 2: Shard(1)}.get(shard_dim(p))  # the states' cut for rows cut by batch or heads
    alike = isinstance(p, Shard) and not isinstance(p, InterleavedShard)
    if p == R and set(start) <= {R}:
        return NodeSharding((R, R), (R,) * len(ins))
    # replicated inputs sliced alike (Qwen3-Next's g and beta over tp), a single key head or group whole
    needed = tuple(R if single and p.dim == 2 else p for single in whole) if alike else ()
    if alike and state is not None and set(start) <= {R, state}:
        per_head = Shard(0) if p.dim == 2 else R
        return NodeSharding((p, state), needed + (per_head,) * len(kind.per_head) + (state,) * len(start))
    if alike and p.dim == 1 and not start and env.cuts_sequence and not is_symbolic(tensor_val(ins[0]).shape[1]):
        return NodeSharding((p, R), needed + (R,) * len(kind.per_head))
    return replicate_all(node, ins, cur, "a recurrence's inputs cut differently, or along a sequence of symbolic "
                                         "length or from a given state")


def localize_recurrence(gm: fx.GraphModule, node: fx.Node, mesh: MeshInfo) -> None:
    """A recurrence along a sequence cut over cp becomes ``sharded_linear_recurrence``: each run's
    end state (widened to carry a state through) gathered, never the sequence."""
    along = [name for name, s in shardings(node).items() if shard_dim(s.inputs[0]) == 1]
    if not along:
        return
    mesh_dim, kind = mesh.dims[along[0]], kind_of(node.args[0])
    plan = run_plan(global_shape(node.args[1])[1], mesh_dim)
    rows = {name: torch.empty([hint(n) for n in planned_local_shape(i, mesh)], dtype=tensor_val(i).dtype, device="meta")
            for name, i in zip(kind.rows, node.args[1:])}  # this rank's, for the state's size
    end = kind.run_end(rows)  # what is gathered
    nbytes = plan.runs * end.numel() * end.element_size()
    new = replaced_by(gm, node, "call_function", sharded_linear_recurrence, node.args,
                      {**node.kwargs, "plan": plan, "mesh_dim": mesh_dim})
    set_communications(new, [Communication("all_gather", "reduce_scatter" if node.meta["requires_grad"] else None,
                                           mesh_dim.name, mesh_dim.size, nbytes, nbytes * mesh_dim.size,
                                           site_role(node))])


def mean_of_shards(x: torch.Tensor, dim, keepdim: bool, dtype: torch.dtype | None, ranks: int) -> torch.Tensor:
    """This rank's share of a mean over a dim whose equal shards ``ranks`` ranks hold: its own
    mean over ``ranks``, so the shares sum to the mean."""
    mean = x.mean(dtype=dtype) if dim is None else x.mean(dim, keepdim=keepdim, dtype=dtype)
    return mean / ranks


def localize_mean(gm: fx.GraphModule, node: fx.Node, mesh: MeshInfo) -> None:
    """A mean planned as partial sums of shards becomes ``mean_of_shards``."""
    if node.target not in ("mean", torch.mean):
        return
    ranks = math.prod(mesh.dims[d].size for d, s in shardings(node).items()
                      if isinstance(s.out, Partial) and not isinstance(s.inputs[0], Partial))
    if ranks > 1:
        given = arguments(node)
        node.op, node.target = "call_function", mean_of_shards
        node.args = (given["input"], given.get("dim"), given.get("keepdim", False), given.get("dtype"))
        node.kwargs = {"ranks": ranks}


def loss_rule(node, ins, cur, env):
    """A loss reads its logits whole. Logits cut by class over tp (an LM head cut by the
    vocabulary: ``plan.vocab_cuts``) are gathered by plan, as an output's are; any other cut (a
    sequence over cp, partial sums) is gathered as for an op without a rule, with a warning."""
    classes = 1 if tensor_val(ins[0]).dim() > 1 else 0
    if env.cuts_features and shard_dim(cur[0]) == classes and all(p == R for p in cur[1:]):
        return NodeSharding(R, tuple(R for _ in ins))
    return replicate_all(node, ins, cur, f"no sharding rule for {target_name(node)}")


register("norm", "reductions", norm_rule, functions=[F.layer_norm, F.rms_norm, torch.layer_norm, torch.rms_norm],
         localize=localize_norm)
register("group_norm", "reductions", group_norm_rule, functions=[F.group_norm, torch.group_norm],
         localize=localize_group_norm)
register("softmax", "reductions", along_dim_rule, functions=[F.softmax, torch.softmax, F.log_softmax,
                                                              torch.log_softmax],
         methods=["softmax", "log_softmax"])
register("normalize", "reductions", along_dim_rule, functions=[F.normalize])
register("reduce", "reductions", reduce_rule, functions=[torch.sum, torch.mean, torch.amax, torch.var, torch.std,
                                                         torch.linalg.vector_norm, torch._C._linalg.linalg_vector_norm,
                                                         torch.norm],
         methods=["sum", "mean", "amax", "var", "std", "norm"], localize=localize_mean)
register("extreme", "reductions", extreme_rule, functions=[torch.max, torch.min], methods=["max", "min"])
register("recurrence", "reductions", recurrence_rule, functions=[linear_recurrence], localize=localize_recurrence)
register("cumsum", "reductions", cumsum_rule, functions=[torch.cumsum], methods=["cumsum"], localize=localize_cumsum)
register("loss", "reductions", loss_rule, functions=[F.cross_entropy])
