"""kv_cache: find the kv cache a graph keeps between calls (``dtensor_par.kv_cache``).

An output is a cache tensor when an attention reads it as its keys or values, directly or
through views (a repeat-kv expand, the filled part of a buffer): the model keeps it for its
next call. The plan holds it as it computed it, never gathered, and the runtime keeps this
rank's piece. An input that is a cache stand-in arrives cut as its shard was, and the plan
starts from those placements.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.fx as fx

from ..kv_cache import cache_shard
from ..placements import Placement
from .context import ParallelContext
from .detect import AttentionSite
from .nodes import tensor_inputs, tensor_val
from .rules.attention import sdpa_arguments
from .rules.indexing import cat_dim
from .rules.registry import kinds_in, op_kind

_ALIASES = kinds_in("views") | {"cast", "getitem"}
"""Ops between a cache tensor and the attention that reads it."""


@dataclass(frozen=True)
class CacheOutput:
    index: int  # among the graph's outputs
    grows_along: int | None  # the dim a ``cat`` appends to (DynamicCache); None: a buffer (StaticCache)


def kv_cache_pass(gm: fx.GraphModule, ctx: ParallelContext) -> fx.GraphModule:
    """Fill ``ctx.cache_inputs`` and ``ctx.cache_outputs``."""
    ctx.cache_inputs = cache_input_placements(gm, ctx)
    ctx.cache_outputs = find_cache_outputs(gm, ctx)
    return gm


def cache_input_placements(gm: fx.GraphModule, ctx: ParallelContext) -> dict[str, dict[str, Placement]]:
    """Placeholder name -> the placements its cache shard is cut in, for the stand-in inputs."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    found = {}
    for node, value in zip(placeholders, ctx.example_inputs):
        shard = cache_shard(value)
        if shard is None:
            continue
        if shard.mesh != ctx.mesh:
            raise ValueError(f"kv_cache: input {node.name!r} is a kv cache held over another mesh "
                             f"({shard.mesh.world_size} ranks, {dict((d, shard.mesh.size(d)) for d in shard.mesh.order)})"
                             f" than this plan's; a cache filled by one compiled model cannot feed another")
        found[node.name] = dict(shard.placements)
    return found


def _read_as_keys_or_values(ctx: ParallelContext) -> set[fx.Node]:
    """Every node an attention reads as its keys or values through aliasing ops, and those."""
    walked: set[fx.Node] = set()
    stack = [sdpa_arguments(site.core)[name] for site in ctx.sites if isinstance(site, AttentionSite)
             for name in ("key", "value")]
    while stack:
        node = stack.pop()
        if node in walked:
            continue
        walked.add(node)
        if op_kind(node) in _ALIASES:
            stack.extend(tensor_inputs(node)[:1])
    return walked


def find_cache_outputs(gm: fx.GraphModule, ctx: ParallelContext) -> tuple[CacheOutput, ...]:
    read = _read_as_keys_or_values(ctx)
    output = next(n for n in gm.graph.nodes if n.op == "output")
    found = []
    for i, node in enumerate(output.args[0]):
        if isinstance(node, fx.Node) and node in read and node.op != "placeholder" and tensor_val(node) is not None:
            grows = cat_dim(node) if op_kind(node) == "cat" else None
            found.append(CacheOutput(i, grows))
    return tuple(found)
