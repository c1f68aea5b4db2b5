"""detect: find attention, mixture-of-experts and MLP sites and the projections that feed them.

``detect_pass`` records the sites in ``ctx.sites`` (``passes.sites``: attention, then experts, then
MLPs among the projections neither took) and tags their nodes; it names what reads almost as a
site but is planned op by op, so that a report never counts it parallel in silence. Each module
holds one part:

- ``walk``: the walks every detector makes, back to the linears a value is made from and forward
  to those it feeds;
- ``heads``: the projections that make an attention input's heads, and how many heads they make;
- ``attention``: SDPA calls and attention written out by hand, with their projections;
- ``mlp``: MLPs, from a down projection back through an activation to its up projections;
- ``experts``: mixtures of experts, from grouped matmuls back to the router's choice.
"""

from __future__ import annotations

import torch.fx as fx

from ..context import ParallelContext
from ..meta import set_site_role, set_weight_names
from ..nodes import arguments, stacked_params, tensor_val, weight_param
from ..rules.registry import kinds_in, op_kind
from ..sites import AttentionSite, MoESite, cut_projections
from .attention import find_attention_sites
from .experts import find_moe_sites, is_topk, routing_choice
from .mlp import find_mlp_sites, is_batched_linear
from .walk import find_producers, walk_through


def warn_experts_read_per_row(gm: fx.GraphModule, ctx: ParallelContext) -> None:
    """Expert weights ``[E, ...]`` still indexed by a tensor after canonicalize, each row reading
    its own expert's copy (``W[expert_ids]`` then ``bmm``), are no mixture the planner reads:
    canonicalize makes grouped matmuls of an up (and gate) and a down product with only per-row
    ops between them (transformers' ``batched_mm`` experts), and these were not such a pair. They
    stay whole on every rank; warned of by name, so that a report never counts them parallel in
    silence."""
    for node in (n for n in gm.graph.nodes if op_kind(n) == "getitem"):
        given = arguments(node)
        weight, index = given.get("input"), given.get("index")
        if isinstance(weight, fx.Node) and weight.name in ctx.params and isinstance(index, fx.Node) \
                and tensor_val(weight).dim() == 3:
            ctx.warn(f"{ctx.params[weight.name].fqn} is read a row at a time through {index.name} ({node.name}) "
                     f"outside a pair of expert products with only per-row ops between them: whole on every rank")


_CARRY_CHOICE = kinds_in("pointwise", "views") | {"one_hot", "reduce", "getitem"}
"""Ops that carry a router's choice toward experts without running them: its indices picked out,
one-hot coded, permuted, counted (transformers' ``eager`` experts, up to ``nonzero``)."""


def warn_routing_leaving_graph(gm: fx.GraphModule, ctx: ParallelContext, experts: list[MoESite]) -> None:
    """A router's top-k whose choice leaves the graph, routing no mixture in it: the experts that
    read it run where Dynamo broke the graph (a loop over the experts ``nonzero`` finds:
    transformers' ``eager`` experts), between the planned graphs, whole on every rank. Named, so
    that a report never counts a graph parallel while its experts run outside it."""
    routed = {routing_choice(site.region) for site in experts}
    output = gm.graph.output_node()
    for topk in (n for n in gm.graph.nodes if is_topk(n) and n not in routed):
        indices = [u for u in topk.users if op_kind(u) == "getitem" and arguments(u)["index"] == 1]
        _, walked = walk_through(indices, lambda n: list(n.users), _CARRY_CHOICE, set())
        routers = find_producers(arguments(topk)["input"], kinds_in("pointwise") | {"softmax"}, ctx)[0]
        if len(routers) == 1 and any(output in n.users for n in walked):
            ctx.warn(f"{topk.name}: the choice of router {ctx.params[weight_param(routers[0])[0].name].fqn} leaves "
                     f"the graph: the experts it routes to run outside it, where Dynamo breaks the graph (a loop "
                     f"over experts: transformers' experts_implementation='eager'), whole on every rank; "
                     f"transformers' 'grouped_mm' or 'batched_mm' experts run sharded, and so does a loop over "
                     f"every expert of an nn.ModuleList captured under Dynamo's capture_dynamic_output_shape_ops")


def warn_batched_linears_outside_sites(gm: fx.GraphModule, ctx: ParallelContext) -> None:
    """A product by an ``[E, in, out]`` parameter that no MLP site holds (no activation between
    it and a second one): its weight stays whole on every rank; named, so that a report never
    counts it parallel in silence."""
    held = {n for site in ctx.sites for n in site.colwise + site.rowwise}
    for node in (n for n in gm.graph.nodes if n not in held and is_batched_linear(n, ctx)):
        ctx.warn(f"{node.name}: the batched product by {ctx.params[weight_param(node)[0].name].fqn} is not read as "
                 f"part of an MLP (a product, an activation, a product): planned op by op, its weight whole on "
                 f"every rank")


def detect_pass(gm: fx.GraphModule, ctx: ParallelContext) -> fx.GraphModule:
    """Record sites in ``ctx.sites``; tag their nodes with their site role and each site
    linear with its weight's name (``meta.site_role``, ``meta.weight_name``)."""
    attention, experts = find_attention_sites(gm, ctx), find_moe_sites(gm, ctx)
    taken = {n for site in attention + experts for n in site.colwise + site.rowwise}
    taken.update(site.router for site in experts)
    ctx.sites = attention + experts + find_mlp_sites(gm, ctx, taken)
    warn_experts_read_per_row(gm, ctx)
    warn_routing_leaving_graph(gm, ctx, experts)
    warn_batched_linears_outside_sites(gm, ctx)
    for site in ctx.sites:
        roles = {"core": [site.core]} if isinstance(site, AttentionSite) else {}
        roles.update({"colwise": site.colwise, "rowwise": site.rowwise})
        for role, nodes in roles.items():
            for n in nodes:
                set_site_role(n, f"{site.name}.{role}")
        for linear in cut_projections(site) + ([site.router] if isinstance(site, MoESite) else []):
            set_weight_names(linear, tuple(w.name for w in stacked_params(weight_param(linear)[0])))
    return gm
