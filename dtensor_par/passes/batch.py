"""batch: seed data parallelism, where the batch is cut over dp = dp_replicate x dp_shard.

With ``batch="global"`` every rank is given the whole batch, as it is given the whole
sequence: graph inputs whose dim 0 is the batch the sites run on arrive cut along it (the
runtime slices them, no communication; a batch that does not divide is padded, as a sequence
is), and the plan carries the cut through every node (``plan_pass``). Every rank gets the
whole result and the single-device gradients: a guided diffusion batch runs its conditional
and unconditional halves on different ranks (CFG parallelism).

With ``batch="local"`` each dp coordinate is given its own slice of the batch: the graph is
already this rank's on dp, nothing is cut, and the parameters' gradients are averaged over
dp (``localize``), as DDP does.
"""

from __future__ import annotations

import torch.fx as fx

from ..errors import InvalidPlan
from ..placements import Shard
from ..symbolic import hint, same_size
from .context import ParallelContext
from .detect import AttentionSite
from .meta import module_paths
from .nodes import tensor_inputs, tensor_val


def batch_pass(gm: fx.GraphModule, ctx: ParallelContext) -> fx.GraphModule:
    """Fill ``ctx.batch_placements`` (with dp and ``batch="global"`` only)."""
    dp = ctx.mesh.size("dp")
    if dp == 1 or ctx.config.batch == "local":
        return gm
    batch = site_batch_size(ctx)
    if batch is None:
        ctx.warn(f"no attention or MLP site to find the batch from: mesh dims 'dp_replicate' x 'dp_shard' = {dp} "
                 f"shard nothing")
        return gm
    state = module_paths(gm)  # parameters and buffers: the model's, never the batch's
    inputs = [n for n in gm.graph.nodes if n.op == "placeholder" and n.name not in state
              and n.name not in ctx.cache_inputs and tensor_val(n) is not None and tensor_val(n).dim() >= 1
              and same_size(tensor_val(n).shape[0], batch)]
    if inputs and hint(batch) < dp:
        raise InvalidPlan(f"batch: input {inputs[0].name!r} of shape {list(tensor_val(inputs[0]).shape)} holds a batch "
                          f"of {hint(batch)}, smaller than mesh dims 'dp_replicate' x 'dp_shard' = {dp}: some ranks "
                          f"would hold no sample; use a batch of at least {dp} or a smaller dp")
    ctx.batch_placements = {node.name: Shard(0) for node in inputs}
    if not inputs:
        ctx.warn(f"no graph input holds the batch of {hint(batch)} the sites run on along dim 0: mesh dims "
                 f"'dp_replicate' x 'dp_shard' = {dp} shard nothing")
    return gm


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
