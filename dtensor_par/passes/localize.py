"""localize: turn the planned global graph into this rank's graph.

One walk in graph order: where a consumer needs another placement than its producer has,
insert exactly that redistribution (once per producer and placement); rewrite every shape
argument from global to local sizes. Parameters arrive as local shards (the runtime slices
them), so placeholders are left as they are.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from ..mesh import MeshDim
from ..ops import collectives as C
from ..placements import InterleavedShard, Partial, Placement, Replicate, Shard, local_shape, shard_dim
from .context import ParallelContext
from .patterns import op_kind, tensor_val
from .rules import split_dim, tensor_inputs

R = Replicate()


def _parts(p: Placement) -> tuple[int, ...] | None:
    return p.parts if isinstance(p, InterleavedShard) else None


def redistribute(graph: fx.Graph, x: fx.Node, src: Placement, dst: Placement, dim: MeshDim) -> fx.Node:
    """Insert the op that turns ``x`` from ``src`` into ``dst`` placement (before the cursor)."""
    group, rank, size = dim.group_name, dim.rank, dim.size
    if isinstance(src, Partial):
        if dst == R:
            return graph.call_function(C.all_reduce, (x, group))
        if isinstance(dst, Shard):
            return graph.call_function(C.reduce_scatter, (x, dst.dim, group, size))
    elif src == R:
        return graph.call_function(C.shard_local, (x, dst.dim, _parts(dst), group, rank, size))
    elif dst == R:
        return graph.call_function(C.all_gather, (x, src.dim, _parts(src), group, rank, size))
    elif isinstance(src, Shard) and isinstance(dst, Shard):
        return graph.call_function(C.all_to_all, (x, src.dim, dst.dim, group, size))
    else:
        full = graph.call_function(C.all_gather, (x, src.dim, _parts(src), group, rank, size))
        return graph.call_function(C.shard_local, (full, dst.dim, _parts(dst), group, rank, size))
    raise ValueError(f"localize: no redistribution from {src} to {dst} for {x.name}")


def _outputs(p) -> tuple:
    return p if isinstance(p, tuple) else (p,)


def _local_sizes(node: fx.Node, size: int) -> tuple[int, ...]:
    return local_shape(tensor_val(node).shape, node.meta["dtensor_par"].out, size)


def _rewrite_sizes(gm: fx.GraphModule, node: fx.Node, size: int) -> None:
    """Give a view/expand/split the local sizes of its output."""
    kind = op_kind(node)
    sharding = node.meta["dtensor_par"]
    if kind in ("view", "expand"):
        if shard_dim(sharding.out) is None and shard_dim(sharding.inputs[0]) is None:
            return
        local = _local_sizes(node, size)
        method = "expand" if kind == "expand" else "reshape"
        with gm.graph.inserting_before(node):
            new = gm.graph.call_method(method, (node.args[0], *local))
        new.meta = node.meta
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
    elif kind == "split" and node.target in ("split", "split_with_sizes", torch.split):
        dim = split_dim(node)
        if shard_dim(sharding.inputs[0]) != dim:
            return
        sizes = node.args[1]
        local = sizes // size if isinstance(sizes, int) else [s // size for s in sizes]
        node.args = (node.args[0], local) + tuple(node.args[2:])


def localize_pass(gm: fx.GraphModule, ctx: ParallelContext) -> fx.GraphModule:
    tp = ctx.mesh.dims["tp"]
    graph = gm.graph
    cache: dict = {}  # one redistribution per producer and target placement, for all consumers

    def cached(key, make) -> fx.Node:
        if key not in cache:
            cache[key] = make()
        return cache[key]

    for node in list(graph.nodes):
        sharding = node.meta.get("dtensor_par")
        ins = tensor_inputs(node)
        if sharding is None or not ins:
            continue
        computes_locally = any(p != R for p in _outputs(sharding.out) if p is not None)
        position = iter(range(len(ins)))

        def localized(arg: fx.Node) -> fx.Node:
            if tensor_val(arg) is None:
                return arg
            i = next(position)
            src, dst = arg.meta["dtensor_par"].out, sharding.inputs[i]
            new = arg
            partial_grad = dst == R and computes_locally and tensor_val(arg).is_floating_point()
            with graph.inserting_before(node):
                if partial_grad and shard_dim(src) is not None:
                    return cached((arg, "gather_partial_grad"), lambda: graph.call_function(
                        C.all_gather_partial_grad, (arg, src.dim, _parts(src), tp.group_name, tp.size)))
                if src != dst:
                    new = cached((arg, dst), lambda: redistribute(graph, arg, src, dst, tp))
                if partial_grad:
                    new = cached((new, "grad_all_reduce"),
                                 lambda: graph.call_function(C.grad_all_reduce, (new, tp.group_name)))
            return new

        node.args = fx.node.map_arg(node.args, localized)
        node.kwargs = fx.node.map_arg(node.kwargs, localized)
        if node.op != "output" and tp.size > 1:
            _rewrite_sizes(gm, node, tp.size)
    for node in graph.nodes:
        for key in ("val", "example_value", "tensor_meta"):
            node.meta.pop(key, None)
    graph.lint()
    gm.recompile()
    return gm


def collectives_in(gm: fx.GraphModule) -> list[tuple[fx.Node, str]]:
    """Every forward collective of a localized graph, with its kind."""
    return [(n, C.COLLECTIVES[n.target]) for n in gm.graph.nodes
            if n.op == "call_function" and n.target in C.COLLECTIVES]
