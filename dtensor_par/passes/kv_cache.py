"""kv_cache: find the kv cache a graph keeps between calls (``dtensor_par.kv_cache``).

An output is a cache tensor when an attention reads it as its keys or values, directly or
through views (a repeat-kv expand, the filled part of a buffer), or when it is the last rows
of one (a sliding-window cache, whose trim the runtime then does): the model keeps it for
its next call. The plan holds it as it computed it, never gathered, and the runtime keeps
this rank's piece. An input that is a cache stand-in arrives cut as its shard was, and the
plan starts from those placements. Three rewrites follow from that:

- a static cache's fresh buffer is made cut as the rows written into it (``cache_buffer``);
- attention to ``cat([cache, new])`` of a cache cut over cp becomes ``cached_attention``,
  and the graph returns the new rows, which the runtime appends to the shards; attention
  written out by hand too, with its score function, sink logits and bias built from positions
  (``passes.scores``);
- a window's slice of the cache is left to the runtime (``CacheOutput.keep_last``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.fx as fx

from ..errors import InvalidPlan, NotSupported
from ..kv_cache import cache_shard
from ..ops.cache_attention import cache_buffer, cached_attention
from ..placements import Placement, shard_dim
from ..symbolic import same_size
from .context import ParallelContext, at_node
from .edits import erase_unused, with_val
from .nodes import arguments, tensor_inputs, tensor_val
from .rules.indexing import cat_dim, per_dim
from .rules.registry import kinds_in, op_kind
from .scores import WrittenAttention, as_sdpa_arguments, bias_kwargs, sinks_per_head, written_attention
from .sites import AttentionSite

_ALIASES = kinds_in("views") | {"cast", "getitem"}
"""Ops between a cache tensor and the attention that reads it."""


@dataclass(frozen=True)
class CacheOutput:
    index: int  # among the graph's outputs
    grows_along: int | None  # the dim a ``cat`` appends to (DynamicCache); None: a buffer (StaticCache)
    global_shape: tuple  # its shape (sizes may be symbols of the plan's specialization)
    appends_to: int | None = None  # new rows appended to the held cache input at this index (cut over cp)
    keep_last: int | None = None  # the runtime keeps only the last rows (a sliding-window cache)


def kv_cache_pass(gm: fx.GraphModule, ctx: ParallelContext) -> fx.GraphModule:
    """Fill ``ctx.cache_inputs`` and ``ctx.cache_outputs``; attention to a cache held cut over
    cp becomes ``cached_attention`` (``ops.cache_attention``)."""
    ctx.cache_inputs = cache_input_placements(gm, ctx)
    ctx.cache_outputs = find_cache_outputs(gm, ctx)
    output = next(n for n in gm.graph.nodes if n.op == "output")
    for c in ctx.cache_outputs:
        with at_node("kv_cache", output.args[0][c.index]):
            to_cache_buffer(gm, output.args[0][c.index])
    appended = {}
    for site in ctx.sites:
        if isinstance(site, AttentionSite):
            with at_node("kv_cache", site.core):
                appended.update(to_cached_attention(gm, site, ctx))
    if appended:
        ctx.cache_outputs = append_new_rows(gm, ctx, appended)
        gm.recompile()
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
            raise InvalidPlan(f"kv_cache: input {node.name!r} is a kv cache held over another mesh "
                             f"({shard.mesh.world_size} ranks, {dict((d, shard.mesh.size(d)) for d in shard.mesh.order)})"
                             f" than this plan's; a cache filled by one compiled model cannot feed another")
        found[node.name] = dict(shard.placements)
    return found


def _keys_and_values(site: AttentionSite) -> list[fx.Node]:
    """What an attention reads as its keys (transposed, written out) and values."""
    if site.written_out:
        return [tensor_inputs(site.scores)[1], tensor_inputs(site.core)[1]]
    return [arguments(site.core)[name] for name in ("key", "value")]


def _read_as_keys_or_values(ctx: ParallelContext) -> set[fx.Node]:
    """Every node an attention reads as its keys or values through aliasing ops, and those."""
    walked: set[fx.Node] = set()
    stack = [n for site in ctx.sites if isinstance(site, AttentionSite) for n in _keys_and_values(site)]
    while stack:
        node = stack.pop()
        if node in walked:
            continue
        walked.add(node)
        if op_kind(node) in _ALIASES:
            stack.extend(tensor_inputs(node)[:1])
    return walked


def _window(node: fx.Node, read: set[fx.Node]) -> tuple[fx.Node, int] | None:
    """``(cache, n)`` when ``node`` keeps the last ``n`` rows of a cache an attention reads
    (a sliding-window cache layer's ``full[..., -n:, :]``)."""
    if op_kind(node) != "getitem" or arguments(node)["input"] not in read or op_kind(arguments(node)["input"]) != "cat":
        return None
    cache = arguments(node)["input"]
    entries = per_dim(arguments(node)["index"], tensor_val(cache).dim())
    if entries is None or any(e != slice(None) for d, e in enumerate(entries) if d != cat_dim(cache)):
        return None
    kept = entries[cat_dim(cache)]
    if not isinstance(kept, slice) or kept.stop is not None or kept.step is not None or not isinstance(
            kept.start, int) or kept.start >= 0:
        return None
    return cache, -kept.start


def find_cache_outputs(gm: fx.GraphModule, ctx: ParallelContext) -> tuple[CacheOutput, ...]:
    """The outputs an attention reads as keys or values. A sliding-window cache's last rows
    are kept by the runtime (``keep_last``), from the cache the plan holds cut."""
    read = _read_as_keys_or_values(ctx)
    output = next(n for n in gm.graph.nodes if n.op == "output")
    outs, found = list(output.args[0]), []
    for i, node in enumerate(outs):
        if not isinstance(node, fx.Node) or tensor_val(node) is None:
            continue
        with at_node("kv_cache", node):
            window = _window(node, read)
        if window is not None:
            outs[i] = window[0]
        elif node not in read or node.op == "placeholder":
            continue
        grows = cat_dim(outs[i]) if op_kind(outs[i]) == "cat" else None
        found.append(CacheOutput(i, grows, tuple(tensor_val(outs[i]).shape), keep_last=window and window[1]))
    replaced = [n for n, kept in zip(output.args[0], outs) if n is not kept]
    output.args = (tuple(outs),)
    for node in replaced:  # a window's slice of the cache, now kept by the runtime
        erase_unused(gm, node)
    return tuple(found)


def to_cache_buffer(gm: fx.GraphModule, buffer: fx.Node) -> None:
    """A static kv cache's buffer (``torch.zeros``) whose rows are then written in place
    (``index_copy_``) becomes ``cache_buffer`` of the rows written: the plan cuts it as it
    cuts them (each rank's heads), where a fresh ``zeros`` would stay whole."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    writers = [u for u in buffer.users if op_kind(u) == "index_copy" and arguments(u)["input"] is buffer]
    if buffer.target is not torch.zeros or not writers:
        return
    writer = min(writers, key=order.__getitem__)
    if any(order[u] < order[writer] for u in buffer.users):
        return
    val = tensor_val(buffer)
    with gm.graph.inserting_before(writer):
        node = gm.graph.call_function(cache_buffer, (arguments(writer)["source"], list(val.shape), val.dtype))
    with_val(node, val)
    buffer.replace_all_uses_with(node)
    gm.graph.erase_node(buffer)


def _held_rows(key: fx.Node, ctx: ParallelContext) -> tuple[fx.Node, fx.Node, fx.Node] | None:
    """(the cat, the held cache input, the new rows) when attention reads as ``key`` (or
    values) ``cat([cache, new])`` along the sequence of a cache held cut over cp, directly or
    through a repeat-kv (each kv head repeated for its query heads: as SDPA's ``enable_gqa``)."""
    cat = key
    while op_kind(cat) in _ALIASES and tensor_inputs(cat):
        cat = tensor_inputs(cat)[0]
    parts = tensor_inputs(cat)
    if op_kind(cat) != "cat" or len(parts) != 2 or parts[0].name not in ctx.cache_inputs:
        return None
    if shard_dim(ctx.cache_inputs[parts[0].name].get("cp")) != cat_dim(cat):
        return None
    a, b = tensor_val(cat).shape, tensor_val(key).shape
    repeat_kv = len(a) == len(b) == 4 and all(same_size(a[d], b[d]) for d in (0, 2, 3)) and b[1] % a[1] == 0
    return (cat, parts[0], parts[1]) if cat is key or repeat_kv else None


def _positions_input(gm: fx.GraphModule, held: fx.Node, seq: int) -> fx.Node:
    """A graph input for the global positions of the rows of ``held`` this rank holds; the
    runtime feeds it from the shard (``LocalGraph.positions_of``)."""
    last = [n for n in gm.graph.nodes if n.op == "placeholder"][-1]
    val = tensor_val(held)
    with gm.graph.inserting_after(last):
        node = gm.graph.placeholder(f"{held.name}_positions")
    node.meta["val"] = val.new_empty((val.shape[seq],), dtype=torch.long)
    node.meta["requires_grad"] = False
    return node


def _keys_read(site: AttentionSite) -> tuple[fx.Node, fx.Node, WrittenAttention | None] | None:
    """The keys (not transposed) and values the site's attention reads, and, written out by hand,
    the rest of what it reads; None where cached attention cannot take it (keys read only
    transposed)."""
    if not site.written_out:
        return arguments(site.core)["key"], arguments(site.core)["value"], None
    found = written_attention(site)
    if isinstance(found, str) or found.key is None:
        return None
    return found.key, found.value, found


def to_cached_attention(gm: fx.GraphModule, site: AttentionSite, ctx: ParallelContext) -> dict:
    """Attention reading ``cat([cache, new])`` keys and values of a cache cut over cp becomes
    ``cached_attention`` on this rank's rows of the cache and the new rows (attention written out
    by hand with its score function and sinks). Returns each ``cat`` replaced -> (new rows, held
    input): the model's cache gets the new rows appended."""
    read = _keys_read(site) if ctx.cache_inputs else None  # no cache held cut: nothing to read
    keys, values = (None, None) if read is None else (_held_rows(read[0], ctx), _held_rows(read[1], ctx))
    if keys is None or values is None:
        return {}
    found = read[2]
    sdpa = arguments(site.core) if found is None else as_sdpa_arguments(gm, site, found)
    written_out = {} if found is None else {"score_mod": found.score_mod, **sinks_per_head(gm, site, found.sinks),
                                            **bias_kwargs(gm, site, found.bias, sdpa["query"])}
    if sdpa["dropout_p"]:
        raise NotSupported(f"kv_cache: attention {site.core.name!r} with dropout against a kv cache cut over "
                                  f"mesh dims 'ring' x 'ulysses'")
    seq = cat_dim(keys[0])
    kwargs = {"past": tensor_val(keys[1]).shape[seq], "attn_mask": sdpa["attn_mask"], "is_causal": sdpa["is_causal"],
              "scale": sdpa["scale"], **written_out, "cp": ctx.mesh.dims["cp"]._replace(zigzag=0)}
    positions = _positions_input(gm, keys[1], seq)
    with gm.graph.inserting_before(site.core):
        node = gm.graph.call_function(cached_attention, (sdpa["query"], keys[2], values[2], keys[1], values[1],
                                                         positions), kwargs)
    node.meta.update(site.core.meta)
    site.core.replace_all_uses_with(node)
    erase_unused(gm, site.core)  # and what only it read: written-out scores
    site.core = node
    ctx.positions_of[positions.name] = keys[1].name
    for read in (sdpa["key"], sdpa["value"]):  # a repeat-kv that fed only the attention goes
        erase_unused(gm, read)
    return {keys[0]: (keys[2], keys[1]), values[0]: (values[2], values[1])}


def append_new_rows(gm: fx.GraphModule, ctx: ParallelContext, appended: dict) -> tuple[CacheOutput, ...]:
    """The graph returns the new rows in place of each ``cat`` with a cache cut over cp; the
    runtime appends them to the cache's shards."""
    output = next(n for n in gm.graph.nodes if n.op == "output")
    outs = list(output.args[0])
    index = {n.name: i for i, n in enumerate(n for n in gm.graph.nodes if n.op == "placeholder")}
    found = []
    for c in ctx.cache_outputs:
        node = outs[c.index]
        if node in appended:
            new, held = appended[node]
            outs[c.index] = new
            c = dataclasses.replace(c, appends_to=index[held.name])
        found.append(c)
    output.args = (tuple(outs),)
    for node in appended:
        erase_unused(gm, node)
    return tuple(found)
