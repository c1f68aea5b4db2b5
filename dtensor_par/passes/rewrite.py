"""rewrite: reshape the graph around sites so that every op can be sharded exactly.

- The bias of a rowwise projection is added once, after the partial sums are reduced:
  ``linear(x, w, b)`` becomes ``linear(x, w) + b``.
- ``enable_gqa`` attention whose kv heads cannot be split over tp gets its kv heads repeated
  to the query heads first (the kv projections then stay replicated), so each rank can take
  exactly the kv heads of its own query heads.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from .context import ParallelContext
from .detect import AttentionSite
from .patterns import arg, tensor_val


def _with_val(node: fx.Node, value) -> fx.Node:
    node.meta["val"] = value
    return node


def split_rowwise_bias(gm: fx.GraphModule, linear: fx.Node) -> None:
    bias = arg(linear, 2, "bias")
    if bias is None:
        return
    graph = gm.graph
    with graph.inserting_after(linear):
        add = graph.call_function(operator.add, (linear, bias))
    linear.replace_all_uses_with(add, delete_user_cb=lambda user: user is not add)
    linear.args = linear.args[:2]
    linear.kwargs = {}
    _with_val(add, linear.meta["val"])
    add.meta["dtensor_par_site"] = linear.meta.get("dtensor_par_site")


def expand_gqa_kv(gm: fx.GraphModule, site: AttentionSite) -> None:
    core, graph = site.core, gm.graph
    repeat = site.num_heads // site.num_kv_heads
    new_args = list(core.args)
    for i in (1, 2):
        kv = core.args[i]
        with graph.inserting_before(core):
            expanded = graph.call_method("repeat_interleave", (kv, repeat), {"dim": -3})
        _with_val(expanded, tensor_val(kv).repeat_interleave(repeat, dim=-3))
        new_args[i] = expanded
    core.args = tuple(new_args)
    core.kwargs = {**core.kwargs, "enable_gqa": False}


def rewrite_pass(gm: fx.GraphModule, ctx: ParallelContext) -> fx.GraphModule:
    tp = ctx.mesh.size("tp")
    for site in ctx.sites:
        for linear in site.rowwise:
            split_rowwise_bias(gm, linear)
        if (isinstance(site, AttentionSite) and site.core.kwargs.get("enable_gqa")
                and site.num_kv_heads != site.num_heads and site.num_kv_heads % tp):
            expand_gqa_kv(gm, site)
    gm.recompile()
    return gm
