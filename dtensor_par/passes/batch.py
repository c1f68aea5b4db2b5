"""batch: seed data parallelism, where the batch is cut over dp = dp_replicate x dp_shard.

With ``batch="global"`` every rank is given the whole batch, as it is given the whole
sequence: graph inputs that hold the batch the sites run on arrive cut along it (the runtime
slices them, no communication; a batch that does not divide is padded, as a sequence is), and
the plan carries the cut through every node (``plan_pass``). Every rank gets the whole result
and the single-device gradients: a guided diffusion batch runs its conditional and
unconditional halves on different ranks (CFG parallelism).

Which dim of which input holds the batch is traced, not guessed from sizes: a dim of an input
holds it when its cut, carried by the plan's own rules (``plan.traced_cuts``), reaches the batch
dim of a site's operands (dim 0 of attention's ``[batch, heads, seq, dim]`` queries and what
attention cuts with them; the leading dim of an MLP's input where no attention is found).
So ``[seq, batch, hidden]`` inputs are cut along dim 1, a ``[batch]`` timestep that reaches
the sites through a broadcast is cut, and a table whose rows merely number as many as the
batch stays whole.

With ``batch="local"`` each dp coordinate is given its own slice of the batch: the graph is
already this rank's on dp, nothing is cut, and the parameters' gradients are averaged over
dp (``localize``), as DDP does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.fx as fx

from ..errors import InvalidPlan
from ..placements import Replicate, Shard, shard_dim
from ..symbolic import hint, same_size
from .context import ParallelContext
from .meta import module_paths
from .nodes import tensor_inputs, tensor_val
from .plan import traced_cuts
from .rules.core import RuleEnv
from .rules.registry import lookup
from .sites import AttentionSite


@dataclass(frozen=True)
class Carrier:
    """An operand of a site whose dim ``dim`` is the batch the site runs on."""

    site: str
    node: fx.Node
    dim: int


def batch_pass(gm: fx.GraphModule, ctx: ParallelContext) -> fx.GraphModule:
    """Fill ``ctx.input_cuts["dp"]`` and ``ctx.batch_sized_whole`` (with dp and ``batch="global"`` only)."""
    dp = ctx.mesh.size("dp")
    if dp == 1 or ctx.config.batch == "local":
        return gm
    batch = site_batch_size(ctx)
    if batch is None:
        ctx.warn(f"no attention or MLP site to find the batch from: mesh dims 'dp_replicate' x 'dp_shard' = {dp} "
                 f"shard nothing")
        return gm
    sized = batch_sized_inputs(gm, ctx, batch)
    if sized and hint(batch) < dp:  # refused untraced: a batch of 1 traces nowhere (a view takes a dim of 1 for none)
        node = next(iter(sized))
        raise InvalidPlan(f"batch: input {node.name!r} of shape {list(tensor_val(node).shape)} holds a batch "
                          f"of {hint(batch)}, smaller than mesh dims 'dp_replicate' x 'dp_shard' = {dp}: some ranks "
                          f"would hold no sample; use a batch of at least {dp} or a smaller dp")
    carriers = batch_carriers(ctx)
    found = {node: batch_dim(gm, ctx, node, dims, carriers) for node, dims in sized.items()}
    ctx.input_cuts["dp"] = {node.name: Shard(dim) for node, dim in found.items() if dim is not None}
    ctx.batch_sized_whole = [node.name for node, dim in found.items() if dim is None]
    if not ctx.input_cuts["dp"]:
        ctx.warn(f"no graph input's dim reaches the batch of {hint(batch)} the sites run on: mesh dims "
                 f"'dp_replicate' x 'dp_shard' = {dp} shard nothing")
    return gm


def batch_sized_inputs(gm: fx.GraphModule, ctx: ParallelContext, batch) -> dict[fx.Node, list[int]]:
    """Each graph input with dims of the batch's size, and those dims: the ones that may hold it
    (parameters, buffers and kv caches never do)."""
    state = module_paths(gm)
    sized = {}
    for node in gm.graph.nodes:
        val = tensor_val(node)
        if node.op == "placeholder" and node.name not in state and node.name not in ctx.cache_inputs and val is not None:
            sized[node] = [d for d in range(val.dim()) if same_size(val.shape[d], batch)]
    return {node: dims for node, dims in sized.items() if dims}


def batch_dim(gm: fx.GraphModule, ctx: ParallelContext, node: fx.Node, dims: list[int],
              carriers: list[Carrier]) -> int | None:
    """The one of ``dims`` (of the batch's size) of input ``node`` whose cut reaches a site's batch,
    or None; two that do are an error: which one is the batch cannot be told."""
    reached = {}
    for d in dims:
        cuts = traced_cuts(gm, ctx, "dp", {node.name: Shard(d)})
        sites = list(dict.fromkeys(c.site for c in carriers if shard_dim(cuts.get(c.node)) == c.dim))
        if sites:
            reached[d] = sites
    if len(reached) > 1:
        shape = list(tensor_val(node).shape)
        raise InvalidPlan(f"batch: input {node.name!r} of shape {shape}: the sites' batch traces back to more than "
                          f"one of its dims (" + "; ".join(f"dim {d} of size {shape[d]} to {', '.join(s)}"
                                                           for d, s in reached.items())
                          + "), so which one to cut over mesh dims 'dp_replicate' x 'dp_shard' cannot be told; give "
                          "each dp rank its own slice with batch='local'")
    return next(iter(reached), None)


def site_batch_size(ctx: ParallelContext):
    """The batch the sites run on: dim 0 of attention's queries (``[batch, heads, seq, dim]``), or
    of an MLP's input where no attention is found. None without sites."""
    attention = [s for s in ctx.sites if isinstance(s, AttentionSite)]
    batches = {s.name: tensor_val(tensor_inputs(s.core)[0]).shape[0] for s in attention}
    if any(not same_size(b, batches[attention[0].name]) for b in batches.values()):
        raise InvalidPlan(f"batch: the attention sites run on batches of different sizes ({batches}): which graph "
                          f"input holds the batch to cut over dp cannot be told; use batch='local'")
    if attention:
        return batches[attention[0].name]
    if ctx.sites:
        return tensor_val(tensor_inputs(ctx.sites[0].colwise[0])[0]).shape[0]
    return None


def batch_carriers(ctx: ParallelContext) -> list[Carrier]:
    """The operands that hold the batch at the sites: attention's queries along dim 0 and what
    attention's own rule cuts with them (keys, values, a mask with a batch dim), or where no
    attention is found, each MLP's input along its leading dim."""
    attention = [s for s in ctx.sites if isinstance(s, AttentionSite)]
    if not attention:
        return [Carrier(s.name, tensor_inputs(s.colwise[0])[0], 0) for s in ctx.sites]
    env = RuleEnv("dp", ctx.mesh.size("dp"), {}, False)
    carriers = []
    for site in attention:
        ins = tensor_inputs(site.core)
        cut_with_queries = lookup(site.core).rule(site.core, ins, [Shard(0)] + [Replicate()] * (len(ins) - 1), env)
        carriers += [Carrier(site.name, i, p.dim) for i, p in zip(ins, cut_with_queries.inputs)
                     if shard_dim(p) is not None]
    return carriers
