"""localize: turn the planned global graph into this rank's graph.

One walk in graph order: where a consumer needs another placement than its producer has,
insert exactly that redistribution (once per producer and placement); rewrite every shape
argument from global to local sizes. Parameters arrive as local shards (the runtime slices
them), so placeholders are left as they are.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

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


@dataclass(frozen=True)
class Communication:
    """What one inserted op communicates, for dumps and reports."""

    forward: str | None  # collective issued in the forward, if any
    backward: str | None  # collective its backward issues, if any
    mesh_dim: str
    group_size: int
    forward_bytes: int  # bytes this rank puts into the forward collective
    backward_bytes: int  # bytes of the gradient this rank puts into the backward collective
    site: str | None  # the site whose plan needs it


def local_bytes(val: torch.Tensor, p: Placement, size: int) -> int:
    return math.prod(local_shape(val.shape, p, size)) * val.element_size()


class _Inserter:
    """Inserts collective calls before a node, each annotated with its Communication."""

    def __init__(self, graph: fx.Graph, dim: MeshDim, val: torch.Tensor, site: str | None):
        self.graph, self.dim, self.val, self.site = graph, dim, val, site

    def __call__(self, fn, args: tuple, src: Placement, dst: Placement) -> fx.Node:
        node = self.graph.call_function(fn, args)
        forward, backward = C.COMMUNICATION[fn]
        size = self.dim.size
        node.meta["dtensor_par_comm"] = Communication(
            forward, backward, self.dim.name, size, local_bytes(self.val, src, size),
            local_bytes(self.val, dst, size), self.site)
        return node


def redistribute(insert: _Inserter, x: fx.Node, src: Placement, dst: Placement) -> fx.Node:
    """Insert the op that turns ``x`` from ``src`` into ``dst`` placement (before the cursor)."""
    dim = insert.dim
    group, rank, size = dim.group_name, dim.rank, dim.size
    if isinstance(src, Partial):
        if dst == R:
            return insert(C.all_reduce, (x, group), src, dst)
        if isinstance(dst, Shard):
            return insert(C.reduce_scatter, (x, dst.dim, group, size), src, dst)
    elif src == R:
        return insert(C.shard_local, (x, dst.dim, _parts(dst), group, rank, size), src, dst)
    elif dst == R:
        return insert(C.all_gather, (x, src.dim, _parts(src), group, rank, size), src, dst)
    elif isinstance(src, Shard) and isinstance(dst, Shard):
        return insert(C.all_to_all, (x, src.dim, dst.dim, group, size), src, dst)
    else:
        full = insert(C.all_gather, (x, src.dim, _parts(src), group, rank, size), src, R)
        return insert(C.shard_local, (full, dst.dim, _parts(dst), group, rank, size), R, dst)
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
            partial_grad = dst == R and computes_locally and arg.meta["requires_grad"]
            site = node.meta.get("dtensor_par_site") or arg.meta.get("dtensor_par_site")
            insert = _Inserter(graph, tp, tensor_val(arg), site)
            with graph.inserting_before(node):
                if partial_grad and shard_dim(src) is not None:
                    return cached((arg, "gather_partial_grad"), lambda: insert(
                        C.all_gather_partial_grad, (arg, src.dim, _parts(src), tp.group_name, tp.size), src, R))
                if src != dst:
                    new = cached((arg, dst), lambda: redistribute(insert, arg, src, dst))
                if partial_grad:
                    new = cached((new, "grad_all_reduce"),
                                 lambda: insert(C.grad_all_reduce, (new, tp.group_name), R, R))
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


def communications(gm: fx.GraphModule) -> list[tuple[fx.Node, Communication]]:
    """Every op of a localized graph that communicates, forward or backward."""
    return [(n, n.meta["dtensor_par_comm"]) for n in gm.graph.nodes if "dtensor_par_comm" in n.meta]


def collectives_in(gm: fx.GraphModule) -> list[tuple[fx.Node, str]]:
    """Every forward collective of a localized graph, with its kind."""
    return [(n, c.forward) for n, c in communications(gm) if c.forward]
