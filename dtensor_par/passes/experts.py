"""Expert parallelism (``ep="cp"``), a step of ``rewrite``: each mixture of experts' experts are
cut over the cp ranks, ``E / cp`` a rank, and the rows each rank's tokens send to experts
travel to the rank holding them and back (``ops.experts``).

A mixture's dispatch already runs on each rank's own tokens over cp (``plan.token_local_sharding``).
Around its expert chain (the up and gate grouped matmuls, what runs between them per row, the
down grouped matmul) three steps are inserted: the rows per expert are exchanged, the rows sent
to their experts (``dispatch_rows``) and the chain's results sent back (``combine_rows``). The
chain then runs on the rows this rank's experts were sent, with offsets of its own experts
(``local_offsets``); the expert weights are cut along their expert dim over cp (``Shard(0)``), so
their gradients stay on the rank that holds them. What the chain holds between the two exchanges
(``MoESite.at_experts``) is laid out for the worst case, every rank's rows sent to this rank's
experts: ``cp`` times the rows the rank sent, a static shape.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from ..mesh import MeshInfo
from ..ops.experts import combine_rows, dispatch_rows, exchange_counts, local_offsets
from ..placements import Shard
from ..symbolic import is_symbolic
from .capture import erase_unused, with_val
from .context import ParallelContext
from .detect import MoESite
from .meta import set_site_role
from .nodes import arguments, tensor_inputs, tensor_val, weight_param
from .rules.matmul import grouped_operands
from .rules.registry import op_kind


def _chain(site: MoESite) -> list[fx.Node]:
    """The nodes from the up projections to the down projection, in graph order."""
    below, stack = set(), list(site.up)
    while stack:
        node = stack.pop()
        if node in site.region and node not in below:
            below.add(node)
            stack.extend(node.users)
    above, stack = set(), list(site.down)
    while stack:
        node = stack.pop()
        if node in below and node not in above:
            above.add(node)
            stack.extend(node.all_input_nodes)
    return [n for n in site.down[0].graph.nodes if n in above]


def _single(nodes: set[fx.Node], what: str) -> fx.Node | str:
    return next(iter(nodes)) if len(nodes) == 1 else f"its {what} are {sorted(n.name for n in nodes)}, not one node"


def expert_chain(site: MoESite, mesh: MeshInfo, sharded: bool
                 ) -> tuple[fx.Node, fx.Node, fx.Node, list[fx.Node]] | str:
    """(the rows the experts read, their offsets, the histogram those come from, the chain), or
    why the experts cannot be cut over cp (``sharded``: parameters held as DTensors)."""
    grouped, cp = site.up + site.down, mesh.dims["cp"]
    chunks = cp.size * cp.chunks_per_rank
    if site.num_experts % chunks:
        zigzag = " (the ring's zigzag layout cuts cp's dims in two chunks a rank)" if cp.zigzag else ""
        return f"{site.num_experts} experts do not divide into {chunks} equal chunks over cp={cp.size}{zigzag}"
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
    if sharded and 1 not in (mesh.size("ring"), mesh.size("ulysses")) and \
            mesh.order.index("ring") > mesh.order.index("ulysses"):
        return "parallelize holds the experts cut over ring then ulysses, but the mesh puts ulysses first"
    if any(is_symbolic(n) for n in tensor_val(rows).shape):
        return "its token count is symbolic (dynamic shapes)"
    chain = _chain(site)
    for node in chain:
        outside = [i for i in tensor_inputs(node) if i in site.region and i not in chain and i not in (rows, offsets)]
        if outside:
            return f"{node.name}, between its up and down projections, reads {[i.name for i in outside]} of the " \
                   f"dispatch"
    return rows, offsets, histogram, chain


def _rows_times(value, times: int):
    """A value like ``value`` with ``times`` as many rows (tuples: each tensor)."""
    if isinstance(value, (tuple, list)):
        return type(value)(_rows_times(v, times) for v in value)
    return value.new_empty(times * value.shape[0], *value.shape[1:])


def experts_to_ranks(gm: fx.GraphModule, site: MoESite, ctx: ParallelContext) -> None:
    """Cut ``site``'s experts over cp and send its rows to them and back; where it cannot, the
    experts stay whole on every cp rank, with a warning that says why."""
    cp = ctx.mesh.dims["cp"]
    ep = cp._replace(zigzag=0)  # experts in plain chunks: e on coordinate e // (E / cp)
    found = expert_chain(site, ctx.mesh, ctx.feeding.sharded)
    if isinstance(found, str):
        ctx.warn(f"{site.name}: ep='cp': the experts stay whole on every cp rank: {found}")
        return
    rows, offsets, histogram, chain = found
    graph, old_down = gm.graph, tensor_val(site.down[0])
    with graph.inserting_before(chain[0]):
        received = with_val(graph.call_function(exchange_counts, (histogram,), {"ep": ep}),
                            tensor_val(histogram).new_zeros((cp.size, site.num_experts // cp.size), dtype=torch.int64))
        offs = with_val(graph.call_function(local_offsets, (received,)),
                        tensor_val(offsets).new_zeros(site.num_experts // cp.size))
        sent = with_val(graph.call_function(dispatch_rows, (rows, histogram, received), {"ep": ep}),
                        _rows_times(tensor_val(rows), cp.size))
    for grouped in site.up + site.down:
        grouped.replace_input_with(offsets, offs)
    for grouped in site.up:
        grouped.replace_input_with(rows, sent)
    for node in chain:
        node.meta["val"] = _rows_times(node.meta["val"], cp.size)
    down = site.down[0]
    with graph.inserting_after(down):
        back = with_val(graph.call_function(combine_rows, (down, histogram, received), {"ep": ep}), old_down)
    down.replace_all_uses_with(back, delete_user_cb=lambda user: user is not back)
    erase_unused(gm, offsets)
    for node in (received, sent, back):
        set_site_role(node, f"{site.name}.experts")
    site.region = (site.region - {offsets}) | {received, offs, sent, back}
    site.counts = (site.counts - {offsets}) | {received, offs}
    site.at_experts, site.ep_size = frozenset([sent, *chain]), cp.size
    for grouped in site.up + site.down:
        ctx.expert_placements[weight_param(grouped)[0].name] = Shard(0)
