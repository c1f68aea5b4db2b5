"""The experts step: with expert parallelism (``ep="cp"``) each mixture of experts' experts are
cut over the cp ranks, and the dp_shard ranks where the mesh has them (``params.expert_group``),
``E / ep`` a rank, and the rows each rank's tokens send to experts travel to the rank holding
them and back (``ops.experts``).

A mixture's dispatch already runs on each rank's own tokens over cp and dp
(``plan.token_local_sharding``). Around its expert chain (the up and gate grouped matmuls, what
runs between them per row, the down grouped matmul) three steps are inserted: the rows per expert
are exchanged, the rows sent to their experts (``dispatch_rows``) and the chain's results sent
back (``combine_rows``). The chain then runs on the rows this rank's experts were sent, with
offsets of its own experts (``local_offsets``); the expert weights are cut along their expert dim
over the group (``Shard(0)`` on each plan dim it spans), so their gradients stay on the rank that
holds them: every row of the group that chose an expert reached it. What the chain holds between
the two exchanges (``MoESite.at_experts``) is laid out for the worst case, every rank's rows sent
to this rank's experts: ``ep`` times the rows the rank sent, a static shape.

An ``nn.ModuleList``'s experts are parameters of their own, stacked in the graph
(``passes.expert_loop``): no placement cuts a list of parameters over the experts, and DTensors
on submeshes of their own are not stepped right by stock optimizers (foreach AdamW skips the
second submesh's, silently). So each expert's weight is held cut over the group along a dim tp
does not cut (``held_by_rows``): every rank holds ``1 / ep`` of every expert, as many bytes as
``E / ep`` experts whole, on the one mesh. Before each use one even all-to-all sends each rank its
own experts whole (``experts_from_rows``), and in backward their gradients back in pieces.
"""

from __future__ import annotations

import dataclasses
import math
import operator

import torch
import torch.fx as fx

from ..mesh import SPANS, MeshDim, MeshInfo
from ..ops.experts import combine_rows, dispatch_rows, exchange_counts, experts_from_rows, local_expert_ids, \
    local_offsets
from ..params import expert_group
from ..placements import Shard
from ..symbolic import is_symbolic
from .context import ParallelContext, at_node
from .edits import erase_unused, with_val
from .meta import set_experts_cut_over, set_site_role
from .nodes import arguments, tensor_inputs, tensor_val, weight_param
from .rules.matmul import grouped_operands
from .rules.registry import op_kind
from .sites import MoESite


def _chain(site: MoESite) -> list[fx.Node]:
    """The nodes from the up projections to the down projection's output (with its rows' bias,
    if any), in graph order."""
    below, stack = set(), list(site.up)
    while stack:
        node = stack.pop()
        if node in site.region and node not in below:
            below.add(node)
            stack.extend(node.users)
    above, stack = set(), [site.out_of(down) for down in site.down]
    while stack:
        node = stack.pop()
        if node in below and node not in above:
            above.add(node)
            stack.extend(node.all_input_nodes)
    return [n for n in site.down[0].graph.nodes if n in above]


def _single(nodes: set[fx.Node], what: str) -> fx.Node | str:
    return next(iter(nodes)) if len(nodes) == 1 else f"its {what} are {sorted(n.name for n in nodes)}, not one node"


def held_by_rows(site: MoESite, ep: MeshDim) -> dict[fx.Node, int] | str:
    """Each expert weight stacked in the graph (``torch.stack`` of an ``nn.ModuleList``'s experts'
    parameters, ``passes.expert_loop``) -> the dim of the stack each expert is held cut along over
    ``ep``: one tp does not cut (the up projections' input features, the down projection's
    output features; ``experts_from_rows`` then sends each rank its experts whole), which must
    divide; or why they cannot be held so."""
    found = {}
    for grouped in site.up + site.down:
        stacked, swapped = weight_param(grouped)  # the grouped matmul's [E, in, out]; swapped: a stack of [out, in]
        if stacked.op == "placeholder":
            continue
        experts = arguments(stacked).get("tensors") if stacked.target is torch.stack else None
        if not experts or arguments(stacked).get("dim", 0) != 0 or any(e.op != "placeholder" for e in experts):
            return f"its expert weight {stacked.name} is neither a parameter nor a stack of parameters along dim 0"
        dim = 1 + (swapped == (grouped in site.up))
        if tensor_val(stacked).shape[dim] % ep.size:
            return (f"its experts' weights are held cut along a dim of their own (an nn.ModuleList's), but dim "
                    f"{dim} of {stacked.name} {list(tensor_val(stacked).shape)} does not divide over {ep.size} ranks")
        found[stacked] = dim
    return found


def expert_chain(site: MoESite, mesh: MeshInfo, ep: MeshDim) \
        -> tuple[fx.Node, fx.Node, fx.Node, list[fx.Node], dict[fx.Node, int]] | str:
    """(the rows the experts read, their offsets, the histogram those come from, the chain, the
    weights stacked in the graph by the dim ``held_by_rows`` cuts them along), or why the experts
    cannot be cut over ``ep``."""
    grouped, cp = site.up + site.down, mesh.dims["cp"]
    chunks = math.lcm(ep.size, cp.size * cp.chunks_per_rank)
    if site.num_experts % chunks:
        zigzag = " (the ring's zigzag layout cuts cp's dims in two chunks a rank)" if cp.zigzag else ""
        return (f"{site.num_experts} experts do not divide into {chunks} equal chunks over "
                f"{group_text(mesh, ep)}{zigzag}")
    by_rows = held_by_rows(site, ep)
    if isinstance(by_rows, str):
        return by_rows
    rows = _single({grouped_operands(g)[0] for g in site.up}, "up projections' rows")
    offsets = _single({grouped_operands(g)[2] for g in grouped}, "grouped matmuls' offsets")
    histogram = _single({n for n in site.region if op_kind(n) in ("histc", "bincount")}, "histograms")
    for found in (rows, offsets, histogram):
        if isinstance(found, str):
            return found
    if offsets.target not in (torch.cumsum, "cumsum") or arguments(offsets)["input"] is not histogram:
        return f"its offsets {offsets.name} are not the running sum of its histogram {histogram.name}"
    if any(arguments(g).get("bias") is not None for g in grouped):
        return "its grouped matmuls add a bias"
    if any(is_symbolic(n) for n in tensor_val(rows).shape):
        return "its token count is symbolic (dynamic shapes)"
    chain, biases = _chain(site), {bias.rows for bias in site.biases.values()}
    for node in chain:
        outside = [i for i in tensor_inputs(node) if i in site.region and i not in chain and i not in (rows, offsets)
                   and i not in biases]
        if outside:
            return f"{node.name}, between its up and down projections, reads {[i.name for i in outside]} of the " \
                   f"dispatch"
    return rows, offsets, histogram, chain, by_rows


def _rows_times(value, times: int):
    """A value like ``value`` with ``times`` as many rows (tuples: each tensor)."""
    if isinstance(value, (tuple, list)):
        return type(value)(_rows_times(v, times) for v in value)
    return value.new_empty(times * value.shape[0], *value.shape[1:])


def group_text(mesh: MeshInfo, ep: MeshDim) -> str:
    """``dp_shard=2 x cp=2``: what an expert group (``params.expert_group``) spans, as reports name it."""
    spanned = mesh.spanned(ep.name)
    return " x ".join(f"{name}={mesh.size(name)}" for name in ("dp_shard", "cp")
                      if any(part in spanned for part in SPANS[name]))


def plan_dims_cut(mesh: MeshInfo, ep: MeshDim, batch: str) -> tuple[str, ...]:
    """The plan dims the experts are cut over, as the plan sees them: cp, and dp where the group
    spans dp_shard and the plan cuts the batch over dp (a global batch; beside dp_replicate the
    plan's dp spans the replicas too, each holding every expert, so the experts' gradients are
    summed over dp_replicate apart: ``localize.reduce_expert_gradients_over_dp``). A local batch
    is each rank's own, not cut by the plan: its rows still go to the group's ranks over dp_shard."""
    return ("dp", "cp") if "dp_shard" in mesh.spanned(ep.name) and batch == "global" else ("cp",)


def experts_to_ranks(gm: fx.GraphModule, site: MoESite, ctx: ParallelContext, ep: MeshDim) -> None:
    """Cut ``site``'s experts over ``ep`` (``params.expert_group``) and send its rows to them and
    back; where it cannot, the experts stay whole on every rank of it, with a warning that says why."""
    found = expert_chain(site, ctx.mesh, ep)
    if isinstance(found, str):
        ctx.warn(f"{site.name}: ep='cp': the experts stay whole on every rank of {group_text(ctx.mesh, ep)}: {found}")
        return
    rows, offsets, histogram, chain, by_rows = found
    graph, per_rank, out = gm.graph, site.num_experts // ep.size, site.out_of(site.down[0])
    old_out, old_biases = tensor_val(out), {bias.rows for bias in site.biases.values()}
    with graph.inserting_before(chain[0]):
        lowered = {"ep": ep, "comm": ctx.comm}  # the padded exchanges of a lowering without uneven all-to-alls
        received = with_val(graph.call_function(exchange_counts, (histogram,), lowered),
                            tensor_val(histogram).new_zeros((ep.size, per_rank), dtype=torch.int64))
        offs = with_val(graph.call_function(local_offsets, (received,)), tensor_val(offsets).new_zeros(per_rank))
        sent = with_val(graph.call_function(dispatch_rows, (rows, histogram, received), lowered),
                        _rows_times(tensor_val(rows), ep.size))
        biases = _biases_by_local_ids(graph, site, offs, sent)
    for grouped in site.up + site.down:
        grouped.replace_input_with(offsets, offs)
    for grouped in site.up:
        grouped.replace_input_with(rows, sent)
    for node in chain:
        node.meta["val"] = _rows_times(node.meta["val"], ep.size)
    with graph.inserting_after(out):
        back = with_val(graph.call_function(combine_rows, (out, histogram, received), lowered), old_out)
    out.replace_all_uses_with(back, delete_user_cb=lambda user: user is not back)
    for old in (offsets, *old_biases):
        erase_unused(gm, old)
    for node in (received, sent, back):
        set_site_role(node, f"{site.name}.experts")
    site.region = (site.region - {offsets, *old_biases}) | {received, offs, sent, back, *biases}
    site.counts = (site.counts - {offsets}) | {received, offs}
    site.expert_order = site.expert_order - {offsets, *old_biases}
    site.at_experts, site.ep_size, site.ep_over = frozenset([sent, *biases, *chain]), ep.size, \
        plan_dims_cut(ctx.mesh, ep, ctx.config.batch)
    held = [weight_param(grouped)[0] for grouped in site.up + site.down] + [b.table for b in site.biases.values()]
    for tensor in held:
        if tensor not in by_rows:
            ctx.expert_placements[tensor.name] = {d: Shard(0) for d in site.ep_over}
    for stacked, dim in by_rows.items():
        _send_experts_whole(graph, site, stacked, dim, lowered, ctx)


def _send_experts_whole(graph: fx.Graph, site: MoESite, stacked: fx.Node, dim: int, lowered: dict,
                        ctx: ParallelContext) -> None:
    """Hold each expert weight ``stacked`` stacks cut along its dim ``dim - 1`` over the group, and
    read the stack through ``experts_from_rows``: this rank's experts whole."""
    with graph.inserting_after(stacked):
        whole = with_val(graph.call_function(experts_from_rows, (stacked, dim), lowered), tensor_val(stacked))
    stacked.replace_all_uses_with(whole, delete_user_cb=lambda user: user is not whole)
    set_site_role(whole, f"{site.name}.experts")
    set_experts_cut_over(whole, site.ep_over)
    for expert in arguments(stacked)["tensors"]:
        ctx.expert_placements[expert.name] = {d: Shard(dim - 1) for d in site.ep_over}
        site.sent_whole |= {expert.name}


def _biases_by_local_ids(graph: fx.Graph, site: MoESite, offs: fx.Node, sent: fx.Node) -> list[fx.Node]:
    """Each per-row bias gathered again at the experts, by the rows' ids among this rank's
    experts (``local_expert_ids``) from its cut of the table: the ids, and the new gathers
    (before the cursor), read in place of the old ones."""
    if not site.biases:
        return []
    ids = with_val(graph.call_function(local_expert_ids, (offs, sent)),
                   tensor_val(sent).new_zeros(tensor_val(sent).shape[0], dtype=torch.int64))
    for grouped, bias in site.biases.items():
        table = tensor_val(bias.table)
        rows = with_val(graph.call_function(operator.getitem, (bias.table, ids)),
                        table.new_empty(tensor_val(ids).shape[0], *table.shape[1:]))
        bias.add.replace_input_with(bias.rows, rows)
        site.biases[grouped] = dataclasses.replace(bias, rows=rows)
    return [ids, *(bias.rows for bias in site.biases.values())]


def _linear_in(node: fx.Node, rows: fx.Node) -> bool:
    """Whether ``node`` is linear in ``rows``, its one input computed from them: weighted by
    another tensor, reordered, viewed, or summed or averaged."""
    kind, others = op_kind(node), [i for i in tensor_inputs(node) if i is not rows]
    if kind == "mul":
        return len(others) == 1
    if kind == "reduce":
        return node.target in (torch.sum, "sum", torch.mean, "mean")
    return kind in ("getitem", "view") and arguments(node)["input"] is rows


def sink_expert_bias(gm: fx.GraphModule, site: MoESite) -> None:
    """Add the experts' down projection bias (GPT-OSS: each row its expert's) after the rows are
    weighted and summed per token, not before: the ops between are linear in the rows, so
    ``f(out + bias) = f(out) + f(bias)``, and over tp the partial sums are reduced on the tokens'
    rows, top-k times fewer, as for experts without a bias."""
    bias = site.biases.get(site.down[0])
    chain, node = [], bias.add if bias is not None else None
    while node is not None and node is not site.output and len(node.users) == 1 \
            and _linear_in(next(iter(node.users)), node):
        node = next(iter(node.users))
        chain.append(node)
    if not chain or chain[-1] is not site.output:
        return
    graph, made = gm.graph, {bias.add: bias.rows}
    with graph.inserting_before(next(iter(site.output.users))):
        for n in chain:
            made[n] = with_val(graph.node_copy(n, lambda a: made.get(a, a)), tensor_val(n))
        total = with_val(graph.call_function(operator.add, (site.output, made[site.output])), tensor_val(site.output))
    site.output.replace_all_uses_with(total, delete_user_cb=lambda user: user is not total)
    set_site_role(total, f"{site.name}.rowwise")  # where its partial sums are reduced
    chain[0].replace_input_with(bias.add, site.down[0])
    graph.erase_node(bias.add)
    del site.biases[site.down[0]]
    copies = {made[n] for n in chain if n in site.expert_order} | ({total} if site.output in site.expert_order else set())
    site.region = (site.region - {bias.add}) | {made[n] for n in chain} | {total}
    site.expert_order = (site.expert_order - {bias.add}) | copies
    site.output = total


def experts_pass(gm: fx.GraphModule, ctx: ParallelContext) -> fx.GraphModule:
    """Each mixture's experts sent their rows over the expert group (``ep="cp"``), and over tp
    its down projection's bias added after the rows are summed per token."""
    tp, ep = ctx.mesh.size("tp"), expert_group(ctx.mesh)
    for site in ctx.sites:
        if not isinstance(site, MoESite):
            continue
        with at_node("experts", site.down[0]):
            if ctx.config.ep == "cp" and ep.size > 1:
                experts_to_ranks(gm, site, ctx, ep)
            if tp > 1:
                sink_expert_bias(gm, site)
    gm.recompile()
    return gm
