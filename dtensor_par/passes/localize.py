"""localize: turn the planned global graph into this rank's graph.

One walk in graph order: where a consumer needs another placement than its producer has,
insert exactly that redistribution (once per producer and placement); rewrite every shape
argument from global to local sizes. Inputs and parameters arrive as local shards (the runtime
slices them), so placeholders are left as they are; but the gradient of a sliced input or of
a full (not parallelized) parameter is all-gathered by the runtime, and its placeholder
records that collective.

The partial gradients of graph inputs (parameters, mostly: replicated over cp, used by
rank-local computations) are reduced in flat buckets of ``grad_bucket_mb``, one all-reduce
each, rather than one per input (``bucket_input_grad_reductions``).
"""

from __future__ import annotations

import dataclasses
import math
import operator

import torch
import torch.fx as fx

from ..mesh import PLAN_DIMS_DECLARED, SPANS, MeshDim
from ..ops import collectives as C
from ..params import HeldLayout, expert_group, fed_placements, held_layouts, held_tensor
from ..placements import (Partial, Placement, Replicate, Shard, interleaved_parts, is_padded, local_shape,
                          local_shape_on, shard_dim)
from ..symbolic import hint, is_symbolic, materialize_sizes
from .context import ParallelContext, at_node
from .meta import (Communication, clear_communications, communications, global_shape, mark_fsdp_gather, placements,
                   planned_local_shape, set_communications, set_global_shape, shardings, site_role)
from .nodes import arguments, repeated_views, tensor_inputs, tensor_val, writes_in_place
from .rules.registry import lookup, op_kind
from .rules.views import view_groups

R = Replicate()


class _Inserter:
    """Inserts collective calls on one mesh dim, each annotated with its Communication."""

    def __init__(self, graph: fx.Graph, dim: MeshDim, shape: tuple[int, ...], element_size: int, site: str | None,
                 requires_grad: bool):
        self.graph, self.dim, self.shape, self.element_size, self.site = graph, dim, shape, element_size, site
        self.requires_grad = requires_grad  # without a gradient, no backward collective runs

    def nbytes(self, p: Placement) -> int:
        """At the planned sizes, when they are symbolic."""
        return hint(math.prod(local_shape(self.shape, p, self.dim.size, self.dim.chunks_per_rank)) * self.element_size)

    def padded_length(self, p: Placement) -> dict:
        """``{"length": n}`` when the dim ``p`` shards, of global length n, is laid out padded."""
        length = self.shape[p.dim]
        return {"length": length} if is_padded(length, self.dim.size, self.dim.chunks_per_rank) else {}

    def __call__(self, fn, args: tuple, src: Placement, dst: Placement, **kwargs) -> fx.Node:
        node = _valued_as(self.graph.call_function(fn, args, kwargs), args[0])  # a redistribution keeps it
        forward, backward = C.COMMUNICATION[fn]
        backward = backward if self.requires_grad else None
        set_communications(node, [Communication(
            forward, backward, self.dim.name, self.dim.size, self.nbytes(src), self.nbytes(dst), self.site)])
        return node


def redistribute(insert: _Inserter, x: fx.Node, src: Placement, dst: Placement) -> fx.Node:
    """Insert the op that turns ``x`` from ``src`` into ``dst`` placement (before the cursor)."""
    dim = insert.dim
    if isinstance(src, Partial):
        if dst == R:
            return insert(C.all_reduce, (x, dim), src, dst)
        if isinstance(dst, Shard):
            return insert(C.reduce_scatter, (x, dst.dim, dim), src, dst)
    elif src == R:
        return insert(C.shard_local, (x, dst.dim, interleaved_parts(dst), dim), src, dst)
    elif dst == R:
        return insert(C.all_gather, (x, src.dim, interleaved_parts(src), dim), src, dst, **insert.padded_length(src))
    elif isinstance(src, Shard) and isinstance(dst, Shard):
        return insert(C.all_to_all, (x, src.dim, dst.dim, dim), src, dst, **insert.padded_length(src))
    else:
        full = insert(C.all_gather, (x, src.dim, interleaved_parts(src), dim), src, R, **insert.padded_length(src))
        return insert(C.shard_local, (full, dst.dim, interleaved_parts(dst), dim), R, dst)
    raise ValueError(f"localize: no redistribution from {src} to {dst} for {x.name}")


def _outputs(p) -> tuple:
    return p if isinstance(p, tuple) else (p,)


def _edge(insert: _Inserter, cached, x: fx.Node, src: Placement, dst: Placement, partial_grad: bool,
          summed_at_gather: bool = False) -> fx.Node:
    """The ops one input edge needs on one mesh dim; ``partial_grad``: the consumer computes
    rank-locally from a replicated input, so that input's gradient is a per-rank partial.
    ``summed_at_gather``: ``x`` is an FSDP-held parameter, whose gradient is summed over this
    dim where it is gathered (``gather_fsdp_param``): a partial gradient is left partial, and
    one that every rank computes whole is made partial, so that the sum counts it once."""
    dim = insert.dim
    if summed_at_gather:
        if not partial_grad and insert.requires_grad:
            x = cached((x, dim.name, "grad_as_partial"), lambda: _plain(insert.graph, C.grad_as_partial, (x, dim)))
        return x if src == dst else cached((x, dim.name, dst), lambda: redistribute(insert, x, src, dst))
    if partial_grad and shard_dim(src) is not None:
        return cached((x, dim.name, "gather_partial_grad"), lambda: insert(
            C.all_gather_partial_grad, (x, src.dim, interleaved_parts(src), dim), src, R,
            **insert.padded_length(src)))
    if src != dst:
        x = cached((x, dim.name, dst), lambda: redistribute(insert, x, src, dst))
    if partial_grad:
        x = cached((x, dim.name, "grad_all_reduce"), lambda: insert(C.grad_all_reduce, (x, dim), R, R))
    return x


def _plain(graph: fx.Graph, fn, args: tuple, kwargs: dict | None = None) -> fx.Node:
    """A call that communicates nothing (before the graph's cursor), with its input's value."""
    return _valued_as(graph.call_function(fn, args, kwargs or {}), args[0])


def _valued_as(node: fx.Node, source: fx.Node, dtype: torch.dtype | None = None) -> fx.Node:
    """``node`` given ``source``'s global value (in ``dtype``) and shape: a later localize reads
    them off what it inserted as off what it planned."""
    val = source.meta.get("val")
    node.meta["val"] = val if dtype is None else val.to(dtype)
    if global_shape(source) is not None:
        set_global_shape(node, global_shape(source))
    return node


INPUT_CUT_DIMS = tuple(d.name for d in PLAN_DIMS_DECLARED if d.seeded_by)
"""The plan dims that cut the inputs (cp's sequence, dp's batch): each rank's parameter gradient is
a part of the whole one, summed over them."""


def _summing_dims(plan_dim: str, fsdp: MeshDim, mesh) -> MeshDim | None:
    """The part of plan dim ``plan_dim`` (one of ``INPUT_CUT_DIMS``) that an FSDP gather's reduce-scatter over
    ``fsdp`` does not sum a gradient over, as a mesh dim; None if it sums over all of it."""
    spanned = mesh.spanned(plan_dim)
    rest = [n for n in spanned if n not in SPANS[fsdp.name]]
    if not rest:
        return None
    return mesh.dims[plan_dim] if len(rest) == len(spanned) else mesh.dims[rest[0]]


def gather_fsdp_param(gm: fx.GraphModule, ctx: ParallelContext, node: fx.Node, layout: HeldLayout,
                      compute: torch.dtype | None) -> fx.Node:
    """This rank's piece of an FSDP-held parameter placeholder gathered whole (its tp piece)
    over the layout's fsdp dim, inserted at the start of the graph; sent in ``compute``, the
    dtype the graph computes in, if it differs from the held one (``param_dtype``), and its
    gradient reduced in ``reduce_dtype``.

    Every consumer's gradient is a partial sum over cp and dp (``_edge``): the gather's
    reduce-scatter sums the parts of cp and dp that fsdp spans, and an all-reduce of this
    rank's piece, before it, the rest (HSDP's all-reduce over dp_replicate).
    Under ``batch="local"`` the reduce-scatter also divides by the dp size (DDP's average).
    """
    graph, mesh, val, grad = gm.graph, ctx.mesh, tensor_val(node), node.meta["requires_grad"]
    first = next(n for n in graph.nodes if n.op != "placeholder")
    numel = hint(math.prod(layout.held_shape(val.shape)))
    held = numel * val.element_size()
    x = node
    with graph.inserting_before(first), at_node("localize", node):
        for plan_dim in INPUT_CUT_DIMS:
            rest = _summing_dims(plan_dim, layout.fsdp, mesh)
            if rest is not None and mesh.size(plan_dim) > 1 and grad:
                x = _plain(graph, C.grad_all_reduce, (x, rest))
                set_communications(x, [Communication(None, "all_reduce", rest.name, rest.size, 0, held,
                                                     "parameter gradient")])
        divisor = mesh.size("dp") if ctx.config.batch == "local" else 1
        kwargs = {"divisor": divisor} if divisor != 1 else {}
        sent, reduced = val.dtype, val.dtype
        if compute is not None:
            sent, reduced = compute, ctx.config.reduce_dtype or compute
            kwargs.update(dtype=sent, grad_dtype=reduced)
        gather = graph.call_function(C.gather_params, ([x], [layout.fsdp_dim], layout.fsdp), kwargs)
        whole = numel * layout.fsdp.size * reduced.itemsize
        set_communications(gather, [Communication("all_gather", "reduce_scatter" if grad else None, layout.fsdp.name,
                                                  layout.fsdp.size, numel * sent.itemsize, whole if grad else 0,
                                                  "fsdp parameters")])
        piece = _valued_as(graph.call_function(operator.getitem, (gather, 0)), node, sent)
    return piece


def compute_dtypes(gm: fx.GraphModule, ctx: ParallelContext) -> dict[str, torch.dtype]:
    """The parameters held in another dtype than the graph computes in (``param_dtype``: the
    stand-ins Dynamo traced are of it), each to the dtype it is cast to at use. Their
    placeholders are given the value the runtime feeds: the held piece's dtype."""
    compute = {}
    for node in gm.graph.find_nodes(op="placeholder"):
        val = tensor_val(node)
        held = held_tensor(ctx.params[node.name].tensor) if node.name in ctx.params else None
        if held is not None and val is not None and val.dtype != held.dtype:
            compute[node.name] = val.dtype
            node.meta["val"] = val.to(held.dtype)
    return compute


def _cast(graph: fx.Graph, cached, x: fx.Node, dtype: torch.dtype, *, before: fx.Node) -> fx.Node:
    """``x`` in ``dtype`` (itself if it is), cast once, before ``before``."""
    if tensor_val(x).dtype == dtype:
        return x

    def make():
        with graph.inserting_before(before):
            return _valued_as(graph.call_function(C.cast, (x, dtype)), x, dtype)
    return cached((x, "cast", dtype), make)


def record_runtime_gathers(gm: fx.GraphModule, ctx: ParallelContext) -> None:
    """The runtime hands the graph this rank's piece of each sharded input and gathers the
    gradient back whole: on each mesh dim it is sharded over for a (sequence-sharded) input;
    on tp for a full parameter (without ``parallelize`` every rank holds parameters whole; with
    it, one held whole that the plan cuts into unequal parts: ``HeldLayout.sliced``), and
    over its group for an expert weight cut by ep (``params.fed_placements``)."""
    layouts = held_layouts(ctx)
    for node in gm.graph.nodes:
        if node.op != "placeholder" or not node.meta["requires_grad"]:
            continue
        with at_node("localize", node):
            record_runtime_gather(node, ctx, layouts.get(node.name))


def record_runtime_gather(node: fx.Node, ctx: ParallelContext, layout: HeldLayout | None) -> None:
    """The runtime's gather of one input's gradient (``record_runtime_gathers``), if any;
    ``layout``: how a parameter is held."""
    if node.name in ctx.params:
        tp = {"tp": ctx.param_placements.get(node.name)}
        fed = {} if ctx.feeding.sharded and not layout.sliced else fed_placements(tp, layout)
        sharded = {d: p for d, p in fed.items() if shard_dim(p) is not None}
        site = "parameter gradient"
    else:
        sharded = {d: p for d, p in placements(node).items() if shard_dim(p) is not None}
        site = "input gradient"
    val = tensor_val(node)
    nbytes = hint(math.prod(local_shape_on(val.shape, sharded, ctx.mesh)) * val.element_size())
    comms = [Communication(None, "all_gather", d, ctx.mesh.size(d), 0, nbytes, site) for d in sharded]
    if comms:
        set_communications(node, comms)


def _bucket_sizes(reductions: list[fx.Node], limit: int) -> list[list[fx.Node]]:
    """``reductions`` cut in order into runs of at most ``limit`` bytes (an input larger
    than ``limit`` gets a bucket of its own)."""
    buckets, size = [], limit
    for node in reductions:
        nbytes = communications(node)[0].backward_bytes
        if size + nbytes > limit:
            buckets.append([])
            size = 0
        buckets[-1].append(node)
        size += nbytes
    return buckets


def _reduced_input(x: fx.Node) -> fx.Node:
    """What ``x`` is, through the ``grad_all_reduce``s (over other mesh dims) and the cast to
    ``reduce_dtype`` that it is."""
    while x.target is C.grad_all_reduce or x.target is C.cast:
        x = arguments(x)["x"] if x.target is C.grad_all_reduce else x.args[0]
    return x


def _reduce_before_view(graph: fx.Graph, reduction: fx.Node) -> None:
    """The gradient reduction of a view of a graph input (an expert weight read through
    ``transpose(-2, -1)``), read by nothing else, moved onto the input itself: the same sum,
    and the input's bucket can take it."""
    view = arguments(reduction)["x"]
    if lookup(view) is None or lookup(view).family != "views" or len(view.users) != 1:
        return
    (source,) = tensor_inputs(view) or (None,)
    if source is None or _reduced_input(source).op != "placeholder":
        return
    with graph.inserting_before(view):
        moved = graph.call_function(C.grad_all_reduce, (source,) + reduction.args[1:], dict(reduction.kwargs))
    moved.meta = {**source.meta, **{k: v for k, v in reduction.meta.items() if k != "val"}}
    view.replace_input_with(source, moved)
    reduction.replace_all_uses_with(view)
    graph.erase_node(reduction)


def bucket_input_grad_reductions(gm: fx.GraphModule, ctx: ParallelContext) -> None:
    """Replace the ``grad_all_reduce`` of each graph input by flat buckets.

    Backward produces gradients roughly in the reverse order of their use in forward, so
    inputs are bucketed by their last use, latest first: a bucket's all-reduce runs as soon
    as its last gradient exists, while backward still computes the earlier layers. Each
    bucket op sits just before the first use of its inputs, so that autograd, which runs the
    latest-created ready node first, runs its backward as soon as it is ready. Buckets are
    per mesh dim, dtype and divisor (1, or dp's size for its mean); an input partial on two mesh
    dims is reduced in a bucket of each.
    """
    graph = gm.graph
    for n in list(graph.nodes):
        if n.target is C.grad_all_reduce:
            _reduce_before_view(graph, n)
    groups: dict[tuple, list[fx.Node]] = {}
    for n in graph.nodes:
        given = arguments(n) if n.target is C.grad_all_reduce else None
        if given and communications(n) and _reduced_input(given["x"]).op == "placeholder":  # not a division alone
            groups.setdefault((given["mesh_dim"], tensor_val(given["x"]).dtype, given["divisor"]), []).append(n)
    limit = int(ctx.config.grad_bucket_mb * 2**20)
    for (dim, _, divisor), nodes in groups.items():
        order = {n: i for i, n in enumerate(graph.nodes)}  # with the buckets made so far
        nodes.sort(key=lambda n: -max(order[u] for u in n.users))
        for bucket in _bucket_sizes(nodes, limit):
            first_use = min((u for n in bucket for u in n.users), key=order.__getitem__)
            with graph.inserting_before(first_use):
                op = graph.call_function(C.grad_all_reduce_bucket, ([arguments(n)["x"] for n in bucket], dim),
                                         {"divisor": divisor} if divisor != 1 else {})
                nbytes = sum(communications(n)[0].backward_bytes for n in bucket)
                set_communications(op, [Communication(
                    None, "all_reduce", dim.name, dim.size, 0, nbytes, f"gradient bucket of {len(bucket)} inputs")])
                for i, n in enumerate(bucket):
                    piece = graph.call_function(operator.getitem, (op, i))
                    piece.meta = dict(n.meta)
                    clear_communications(piece)
                    n.replace_all_uses_with(piece)
                    graph.erase_node(n)


def _block_of(fqn: str) -> str:
    """The repeated block a parameter belongs to: its FQN up to the first index (``layers.3``);
    "" outside the blocks."""
    parts = fqn.split(".")
    index = next((i for i, part in enumerate(parts) if part.isdigit()), None)
    return "" if index is None else ".".join(parts[:index + 1])


def bucket_fsdp_gathers(gm: fx.GraphModule, ctx: ParallelContext) -> None:
    """Merge the FSDP gathers of each block's parameters into one flat gather (FSDP2 wraps each
    block), placed before the first use of any of them; its backward reduce-scatters the
    block's gradients in one flat bucket. With ``reshard_after_forward`` the partitioner
    gathers them again in backward rather than keep them whole from forward to backward, but
    for a block's experts cut over cp (ep): a grouped matmul's backward reads the gathered
    experts it saved (transformers' opaque one keeps a view of them), so they are kept."""
    graph, groups = gm.graph, {}
    for n in graph.nodes:
        if n.target is C.gather_params:
            (x,), _, mesh_dim = n.args
            fqn = ctx.params[_reduced_input(x).name].fqn
            groups.setdefault((_block_of(fqn), tensor_val(x).dtype, mesh_dim, tuple(n.kwargs.items())), []).append(n)
    for (block, _, mesh_dim, kwargs), gathers in groups.items():
        order = {n: i for i, n in enumerate(graph.nodes)}
        pieces = [next(iter(g.users)) for g in gathers]
        first_use = min((u for p in pieces for u in p.users), key=order.__getitem__)
        comms = [communications(g)[0] for g in gathers]
        with graph.inserting_before(first_use):
            merged = graph.call_function(C.gather_params, ([g.args[0][0] for g in gathers],
                                                           [g.args[1][0] for g in gathers], mesh_dim),
                                         dict(kwargs))
            experts = all(_reduced_input(g.args[0][0]).name in ctx.expert_placements for g in gathers)
            reshard = ctx.config.reshard_after_forward and not experts
            mark_fsdp_gather(merged, reshard)
            site = f"fsdp parameters of {block or 'the model outside its blocks'} ({len(gathers)})"
            held = sum(c.forward_bytes for c in comms)
            gather = dataclasses.replace(comms[0], forward_bytes=held,
                                         backward_bytes=sum(c.backward_bytes for c in comms), site=site)
            again = Communication(None, "all_gather", mesh_dim.name, mesh_dim.size, 0, held, f"{site}, again")
            set_communications(merged, [gather, again] if reshard and gather.backward else [gather])
            for i, (gather, piece) in enumerate(zip(gathers, pieces)):
                bucketed = graph.call_function(operator.getitem, (merged, i))
                piece.replace_all_uses_with(bucketed)
                graph.erase_node(piece)
                graph.erase_node(gather)


def average_gradients_over_dp(gm: fx.GraphModule, ctx: ParallelContext, fsdp: dict[str, HeldLayout]) -> None:
    """Under ``batch="local"`` each dp coordinate computes on its own slice of the batch, so each
    parameter's gradient is averaged over dp (DDP's and FSDP2's reduction); ``grad_bucket_mb``
    buckets these as it does any input's gradient reduction. An FSDP-held parameter's gather
    averages its own (``gather_fsdp_param``), an expert weight cut over dp_shard is reduced
    apart (``reduce_expert_gradients_over_dp``)."""
    dp = ctx.mesh.dims["dp"]
    if ctx.config.batch != "local" or dp.size == 1:
        return
    for node in [n for n in gm.graph.nodes if n.op == "placeholder" and n.name in ctx.params]:
        if not node.meta["requires_grad"] or node.name in fsdp or _experts_cut_over_dp_shard(node, ctx):
            continue
        val = tensor_val(node)
        shape = local_shape_on(val.shape, {d: s.out for d, s in shardings(node).items()}, ctx.mesh)
        insert = _Inserter(gm.graph, dp, shape, val.element_size(), "parameter gradient", True)
        users = list(node.users)
        with gm.graph.inserting_after(node):
            averaged = insert(C.grad_all_reduce, (node, dp), R, R, divisor=dp.size)
        for user in users:
            user.replace_input_with(node, averaged)


def _experts_cut_over_dp_shard(node: fx.Node, ctx: ParallelContext) -> bool:
    """Whether graph input ``node`` is an expert weight whose experts ep cuts over dp_shard."""
    return node.name in ctx.expert_placements and "dp_shard" in ctx.mesh.spanned(expert_group(ctx.mesh).name)


def reduce_expert_gradients_over_dp(gm: fx.GraphModule, ctx: ParallelContext) -> None:
    """An expert weight cut over dp_shard (and cp) has, on the rank holding each expert, the sum
    over every row its replica's ranks sent it: each replica (of dp_replicate) holds every expert
    once. That sum is all-reduced over dp_replicate, as HSDP reduces any parameter's, and under
    ``batch="local"`` divided by dp's size, as DDP averages the others'
    (``average_gradients_over_dp``). Over one replica with a global batch, nothing is left to do."""
    replicas, dp = ctx.mesh.dims["dp_replicate"], ctx.mesh.dims["dp"]
    divisor = dp.size if ctx.config.batch == "local" else 1
    if replicas.size == 1 and divisor == 1:
        return
    layouts = held_layouts(ctx)
    for node in [n for n in gm.graph.nodes if n.op == "placeholder" and _experts_cut_over_dp_shard(n, ctx)]:
        if not node.meta["requires_grad"]:
            continue
        val = tensor_val(node)
        users = list(node.users)
        with gm.graph.inserting_after(node):
            if replicas.size == 1:
                summed = _plain(gm.graph, C.grad_all_reduce, (node, replicas), {"divisor": divisor})
            else:
                insert = _Inserter(gm.graph, replicas, layouts[node.name].computed_shape(val.shape),
                                   val.element_size(), "parameter gradient", True)
                summed = insert(C.grad_all_reduce, (node, replicas), R, R, divisor=divisor)
        for user in users:
            user.replace_input_with(node, summed)


def localize_pass(gm: fx.GraphModule, ctx: ParallelContext) -> fx.GraphModule:
    record_runtime_gathers(gm, ctx)
    dims = ctx.mesh.plan_dims
    graph = gm.graph
    cache: dict = {}  # one redistribution per value, mesh dim and target placement
    fsdp = {name: layout for name, layout in held_layouts(ctx).items() if layout.fsdp_dim is not None}
    local_batch = ctx.config.batch == "local"
    compute = compute_dtypes(gm, ctx)
    same_value = {node: view for node, view in repeated_views(gm).items() if shardings(node) == shardings(view)}

    def cached(key, make) -> fx.Node:
        """The node ``make`` inserts, made once per key; a view taken again alike is its first
        take's value, so it shares that one's redistributions (the inner backend's CSE would
        merge their collectives, and reports count what runs)."""
        key = (same_value.get(key[0], key[0]), *key[1:])
        if key not in cache:
            cache[key] = make()
        return cache[key]

    for node in list(graph.nodes):
        plans = shardings(node)
        ins = tensor_inputs(node)
        if not plans or not (ins or node.op == "call_function"):  # a factory (arange) may take local sizes
            continue
        position = iter(range(len(ins)))

        def localized(arg: fx.Node) -> fx.Node:
            if tensor_val(arg) is None:
                return arg
            i = next(position)
            site = site_role(node) or _summed_site(arg)
            current = {d.name: shardings(arg)[d.name].out for d in dims}
            val = tensor_val(arg)
            layout, dtype = (fsdp.get(arg.name), compute.get(arg.name)) if arg.op == "placeholder" else (None, None)
            held_fsdp = layout is not None
            new = _parameter_at_use(gm, ctx, cached, arg, layout, dtype)
            element_size = tensor_val(new).element_size()
            for dim in dims:
                src, dst = current[dim.name], plans[dim.name].inputs[i]
                computes_locally = any(p != R for p in _outputs(plans[dim.name].out) if p is not None)
                partial_grad = dst == R and computes_locally and arg.meta["requires_grad"]
                summed_at_gather = held_fsdp and dim.name != "tp"
                partial_grad = partial_grad or (summed_at_gather and local_batch and dim.name == "dp")
                others = {d: p for d, p in current.items() if d != dim.name}
                insert = _Inserter(graph, dim, local_shape_on(val.shape, others, ctx.mesh), element_size, site,
                                   arg.meta["requires_grad"])
                with graph.inserting_before(node):
                    new = _edge(insert, cached, new, src, dst, partial_grad, summed_at_gather)
                current[dim.name] = dst
            return new if dtype is None else _cast(graph, cached, new, dtype, before=node)

        with at_node("localize", node):
            node.args = fx.node.map_arg(node.args, localized)
            node.kwargs = fx.node.map_arg(node.kwargs, localized)
            kind = lookup(node)
            if kind is not None and kind.localize is not None:
                kind.localize(gm, node, ctx.mesh)
    _finish(gm, ctx, fsdp)
    return gm


def _summed_site(value: fx.Node) -> str | None:
    """The site a value comes from: its own, or where it is partial sums viewed since (a rowwise
    MLP's output viewed as an image grid), the site that made them, whose all-reduce it is; a
    token embedding's partial sums (its table cut by vocab rows) are named as such."""
    while (site_role(value) is None and lookup(value) is not None and lookup(value).family == "views"
           and any(isinstance(p, Partial) for p in placements(value).values())):
        value = tensor_inputs(value)[0]
    summed_lookup = op_kind(value) == "embedding" and any(isinstance(p, Partial) for p in placements(value).values())
    return site_role(value) or ("token embedding" if summed_lookup else None)


def _parameter_at_use(gm: fx.GraphModule, ctx: ParallelContext, cached, arg: fx.Node, layout: HeldLayout | None,
                      dtype: torch.dtype | None) -> fx.Node:
    """What a graph input's edges start from: an FSDP-held parameter's gather (sent in the
    dtype the graph computes in), or a parameter held in another dtype than that cast to
    ``reduce_dtype`` first (the edges' backward reduces its gradient; at the start of the
    graph, as the placeholder is, before any bucket of them); else the input itself."""
    if layout is not None:
        return cached((arg, "fsdp"), lambda: gather_fsdp_param(gm, ctx, arg, layout, dtype))
    if dtype is None:
        return arg
    first = next(n for n in gm.graph.nodes if n.op != "placeholder")
    return _cast(gm.graph, cached, arg, ctx.config.reduce_dtype or dtype, before=first)


def _finish(gm: fx.GraphModule, ctx: ParallelContext, fsdp: dict[str, HeldLayout]) -> None:
    """Once every edge is localized: sizes as graph values, the inputs' gradient averages over
    dp and the buckets, no global values left."""
    graph = gm.graph
    if ctx.specialization is not None:
        materialize_sizes(gm)
    average_gradients_over_dp(gm, ctx, fsdp)
    reduce_expert_gradients_over_dp(gm, ctx)
    for cut in [n for n in graph.nodes if n.target is C.shard_local]:
        expand_to_local_copies(graph, cut, ctx)
    for reduction in [n for n in graph.nodes if n.target is C.grad_all_reduce]:
        hoist_grad_reduction(graph, reduction, ctx)
    bucket_fsdp_gathers(gm, ctx)
    bucket_input_grad_reductions(gm, ctx)
    for node in graph.nodes:  # the global values: the local graph's differ
        for key in ("val", "example_value", "tensor_meta"):
            node.meta.pop(key, None)
    graph.lint()
    gm.recompile()


def expand_to_local_copies(graph: fx.Graph, cut: fx.Node, ctx: ParallelContext) -> None:
    """A cut of a dim that only repeats copies of a tensor (``expand``, then a view merging it
    with dims of 1: transformers' ``repeat_kv`` of one kv head to every query head, GPTBigCode's
    multi-query attention under tp) becomes the expand to this rank's count of copies, its input's
    gradient summed over the ranks: in the backward each rank sums its own copies' gradients and
    the ranks all-reduce the input's (one kv head's bytes), where the cut's backward gathered every
    copy's (each head's)."""
    x, dim, parts, mesh_dim = cut.args
    view = x if op_kind(x) == "view" and len(x.users) == 1 else None
    expand = arguments(view)["input"] if view is not None else x
    if parts is not None or op_kind(expand) != "expand" or len(expand.users) != 1:
        return
    source = arguments(expand)["input"]
    before, copies = tensor_val(source).shape, tensor_val(expand).shape
    if any(is_symbolic(n) for n in (*copies, *tensor_val(x).shape)):
        return  # comparing symbolic sizes would put conditions on the plan
    group = [dim] if view is None else next((src for src, dst in view_groups(copies, tensor_val(x).shape)
                                             if dst == [dim]), [])
    repeated = [d for d in group if copies[d] != 1]
    new_dim = len(copies) - len(before)  # expand's new leading dims repeat too
    if len(repeated) != 1 or (repeated[0] >= new_dim and before[repeated[0] - new_dim] != 1):
        return
    sizes = [_divided(a, i == repeated[0], mesh_dim.size) for i, a in enumerate(_size_args(expand))]
    shape = [_divided(a, i == dim, mesh_dim.size) for i, a in enumerate(_size_args(view))] if view else None
    if None in sizes or (shape is not None and None in shape):
        return
    with graph.inserting_before(cut):
        summed = graph.call_function(C.grad_all_reduce, (source, mesh_dim))
        local = graph.call_method("expand", (summed, *sizes))
        local = graph.call_method("reshape", (local, *shape)) if view is not None else local
    summed.meta.update(val=source.meta.get("val"), requires_grad=True)
    size = _local_bytes(source, ctx)
    set_communications(summed, [dataclasses.replace(communications(cut)[0], backward="all_reduce",
                                                    forward_bytes=size, backward_bytes=size)])
    cut.replace_all_uses_with(local)
    for node in (cut, view, expand):
        if node is not None:
            graph.erase_node(node)


def _size_args(node: fx.Node) -> list:
    """The sizes a view or expand node is given, one a dim."""
    sizes = node.args[1:]
    return list(sizes[0]) if len(sizes) == 1 and isinstance(sizes[0], (tuple, list)) else list(sizes)


def _divided(size, cut: bool, ranks: int):
    """A size argument, divided by ``ranks`` where ``cut`` (-1, inferred, as it is); None where it
    cannot be."""
    if not cut or size == -1:
        return size
    return size // ranks if isinstance(size, int) and size % ranks == 0 else None


def hoist_grad_reduction(graph: fx.Graph, reduction: fx.Node, ctx: ParallelContext) -> None:
    """Move a gradient all-reduce onto the smaller replicated tensors its input is made from for it
    alone (by views, tilings, pointwise ops and rows picked by index), where they take fewer bytes:
    any op's input gradients are linear in its output's, so their sums over the ranks are the same.
    Llama 4 tiles its tokens once per expert and scales them by the router's weights before its
    experts' colwise product: the tokens' and weights' gradients are summed, not the E times
    larger tiles'. Grouped experts read each token's row top-k times (``x[perm // k]``): the
    tokens' gradient is summed, not their rows'."""
    dim, source = arguments(reduction)["mesh_dim"], arguments(reduction)["x"]
    _, edges = _cheapest_reduction(source, dim.name, ctx)
    if edges is None:
        return
    (old,) = communications(reduction)
    for consumer, producer in edges:
        with graph.inserting_before(consumer):
            moved = graph.call_function(C.grad_all_reduce, (producer,) + reduction.args[1:], dict(reduction.kwargs))
        moved.meta.update(val=producer.meta.get("val"), requires_grad=True)
        size = _local_bytes(producer, ctx)
        set_communications(moved, [dataclasses.replace(old, forward_bytes=size, backward_bytes=size)])
        consumer.replace_input_with(producer, moved)
    reduction.replace_all_uses_with(source)
    graph.erase_node(reduction)


def _local_bytes(node: fx.Node, ctx: ParallelContext) -> int:
    return hint(math.prod(planned_local_shape(node, ctx.mesh))) * tensor_val(node).element_size()


def _cheapest_reduction(node: fx.Node, dim: str, ctx: ParallelContext) -> tuple[int, list | None]:
    """(bytes, edges ``(consumer, producer)`` to reduce the gradient on) of the cheapest place to
    sum ``node``'s gradient, a per-rank partial over plan dim ``dim`` that flows to it from one
    reader alone; edges None: at ``node`` itself."""
    if not shardings(node) or tensor_val(node) is None:  # an op localize inserted: left where it is
        return 0, None  # (only ever the reduction's own input: inputs without a plan stop the walk below)
    here, kind, ins = _local_bytes(node, ctx), lookup(node), tensor_inputs(node)
    picks = kind is not None and kind.name == "getitem" and tensor_val(arguments(node)["input"]) is not None
    moves = picks or kind is not None and kind.family in ("views", "pointwise")  # a split's piece stays
    if len(node.users) != 1 or not moves or writes_in_place(node) or any("requires_grad" not in i.meta for i in ins):
        return here, None
    grads = [i for i in ins if i.meta["requires_grad"]]
    if not grads or any(dim not in shardings(i) or shardings(i)[dim].out != R for i in ins):
        return here, None  # each rank's backward of it is then the same linear map
    total, edges = 0, []
    for i in grads:
        nbytes, above = _cheapest_reduction(i, dim, ctx) if i.op != "placeholder" else (_local_bytes(i, ctx), None)
        total, edges = total + nbytes, edges + (above or [(node, i)])
    return (total, edges) if total < here else (here, None)


def graph_communications(gm: fx.GraphModule) -> list[tuple[fx.Node, Communication]]:
    """Every collective of a localized graph, forward or backward, with the op issuing it."""
    return [(n, c) for n in gm.graph.nodes for c in communications(n)]


def collectives_in(gm: fx.GraphModule) -> list[tuple[fx.Node, str]]:
    """Every forward collective of a localized graph, with its kind."""
    return [(n, c.forward) for n, c in graph_communications(gm) if c.forward]
