"""plan: give every node a placement on each planned mesh dim (tp, cp).

Sites decide the tp weights (Megatron: q/k/v, up and gate colwise; out and down rowwise), and
``sequence_pass`` the cp inputs; the rule table then carries placements through every node in
graph order, so the plan covers the whole graph, not just the sites. ``traced_cuts`` runs the
same rules from one seed alone, apart from the plan (``batch_pass``: which inputs hold the batch).
"""

from __future__ import annotations

import dataclasses

from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.fx as fx

from ..mesh import PLAN, SPANS
from ..params import unequal_parts
from ..errors import InvalidPlan, NotSupported
from ..placements import InterleavedShard, Partial, Placement, Replicate, Shard, parts_of, shard_dim
from .context import ParallelContext, at_node
from .detect.attention import concatenated_features
from .detect.heads import parts_major_split
from .detect.mlp import is_batched_linear
from .meta import NodeSharding, set_global_shape, set_sharding, shardings
from .nodes import arguments, stacked_params, target_name, tensor_inputs, tensor_val, weight_param, writes_in_place
from .rules.core import RuleEnv, check_divisible, moved, replicate_all
from .rules.indexing import cat_dim, per_dim, split_dim
from .rules.matmul import grouped_operands, is_channelwise_conv
from .rules.pointwise import is_activation
from .rules.registry import lookup, op_kind
from .rules.views import dim_order
from .sites import AttentionSite, MLPSite, MoESite, module_name

R = Replicate()


class FusedParts(NamedTuple):
    """A fused projection's parts: their sizes along its features, and the nodes that take them
    off (a split's pieces, or the slices; none for a view that splits it part first)."""

    sizes: tuple[int, ...]
    nodes: tuple[fx.Node, ...]


def features_dim(projection: fx.Node) -> int:
    """The dim of a site projection's output that holds its features: a convolution's channels
    (dim 1), a linear's last."""
    return 1 if op_kind(projection) == "conv" else tensor_val(projection).dim() - 1


def features_carried(node: fx.Node, dim: int) -> tuple[fx.Node, int]:
    """Where the features along ``node``'s dim ``dim`` end up, and along which dim, past the ops
    it goes through alone (``_carrier``) that keep each feature apart: activations, casts,
    depthwise convolutions, transposes, slices and concatenations along other dims (a decode
    step's rows after a cache's), where cp starts cutting the sequence (Sana's GLUMBConv: a
    pointwise convolution, SiLU, a depthwise one; Qwen3.5's q, k and v: transposed, convolved
    causally, SiLU, transposed back; Mamba-2's x, B and C, split off the projection, so too), and
    arithmetic with tensors as large or broadcast over them (``_feature_by_feature``). Every
    graph of a model must read a projection's parts alike: its weight is held one way."""
    while (user := _carrier(node, dim)) is not None and tensor_val(user) is not None:
        carried = _carried_dim(user, node, dim)
        if carried is None:
            break
        node, dim = user, carried
    return node, dim


def _carried_dim(op: fx.Node, source: fx.Node, dim: int) -> int | None:
    """The dim of ``op``'s output holding ``source``'s features along ``dim`` one by one (each
    output feature from its own input feature), or None where ``op`` mixes them: transposes
    move them, and activations, casts, ``sequence_start``, depthwise convolutions (channels,
    dim 1), slices and concatenations along other dims and arithmetic with tensors as large or
    broadcast over them (``_feature_by_feature``) keep them in place. ``features_carried`` walks
    forward by it, ``_feeding_projections`` back."""
    if op_kind(op) == "transpose":
        return dim_order(op, tensor_val(op).dim()).index(dim)
    keeps = (is_activation(op) or op_kind(op) in ("cast", "sequence_start") or (is_channelwise_conv(op) and dim == 1)
             or _feature_by_feature(op, source) or _sliced_along_other_dims(op, source, dim)
             or (op_kind(op) == "cat" and cat_dim(op) != dim))
    return dim if keeps else None


def _carrier(node: fx.Node, dim: int) -> fx.Node | None:
    """``node``'s one reader that may carry its features on; beside it, others may only slice
    along other dims (a cache keeping the last rows of Mamba-2's x, B and C)."""
    readers = list(node.users)
    if len(readers) > 1:
        readers = [u for u in readers if not _sliced_along_other_dims(u, node, dim)]
    return readers[0] if len(readers) == 1 else None


def _sliced_along_other_dims(user: fx.Node, node: fx.Node, dim: int) -> bool:
    """``user`` slices ``node`` along dims other than ``dim``, keeping every dim (Mamba-2's
    convolution output cropped to the rows past a cache's)."""
    if op_kind(user) != "getitem" or arguments(user)["input"] is not node:
        return False
    entries = per_dim(arguments(user)["index"], tensor_val(node).dim())
    return entries is not None and all(isinstance(e, slice) for e in entries) and entries[dim] == slice(None)


def _feature_by_feature(user: fx.Node, node: fx.Node) -> bool:
    """``user`` adds, subtracts, multiplies or divides ``node`` element by element, as large as
    it: by a mask broadcast over its features (Granite 4's padding mask), a constant a feature
    (Falcon-H1's muP vector over its fused parts) or another projection's output (Zamba2's LoRA
    adapter beside its fused gate and up)."""
    return op_kind(user) in ("add", "sub", "mul", "div") and tensor_val(user).shape == tensor_val(node).shape


def fused_parts(linear: fx.Node) -> FusedParts | None:
    """The parts when the projection's features (``features_carried``) are only cut into parts:
    by one chunk/split or by slices that tile them (``qkv[..., :q]``, ``qkv[..., q:q + kv]``,
    ...), each part cut so again giving its own parts (``_parts_taken_off``), or by a view that
    splits them part first (``detect.heads.parts_major_split``)."""
    node, dim = features_carried(linear, features_dim(linear))
    users = list(node.users)
    parts_major = parts_major_split(users[0]) if len(users) == 1 and dim == tensor_val(node).dim() - 1 else None
    if parts_major is not None:
        parts, heads, head_dim = parts_major
        return FusedParts((heads * head_dim,) * parts, ())
    return _parts_taken_off(node, dim)


def _parts_taken_off(node: fx.Node, dim: int) -> FusedParts | None:
    """The parts ``node``'s readers cut it into along its dim ``dim``: one split or chunk, or
    slices that tile it; a part itself cut so gives its own parts in its place (Flux.2's fused
    projection: qkv split off, then chunked into q, k and v; the MLP's gate and up split off,
    then sliced apart)."""
    users = list(node.users)
    if len(users) == 1 and op_kind(users[0]) == "split":
        split = users[0]
        if arguments(split)["input"] is not node or split_dim(split) != dim:
            return None
        sizes, taken = tuple(t.shape[dim] for t in split.meta["val"]), all(op_kind(u) == "getitem" for u in split.users)
        if not taken or len(split.users) != len(sizes):  # a piece unread, or read twice: not refined
            return FusedParts(sizes, tuple(split.users) if taken else ())
        pieces = sorted(split.users, key=lambda u: u.args[1])
    else:
        ranges = {}
        for user in users:
            entries = per_dim(arguments(user)["index"], dim + 1) if op_kind(user) == "getitem" else None
            if entries is None or any(e != slice(None) for e in entries[:-1]) or not isinstance(entries[-1], slice):
                return None
            start, stop, step = entries[-1].indices(tensor_val(node).shape[dim])
            if step != 1:
                return None
            ranges.setdefault((start, stop), []).append(user)
        bounds = sorted(ranges)
        tiles = all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
        if len(bounds) < 2 or not tiles or bounds[0][0] != 0 or bounds[-1][1] != tensor_val(node).shape[dim]:
            return None
        if any(len(readers) > 1 for readers in ranges.values()):
            return FusedParts(tuple(stop - start for start, stop in bounds), tuple(users))
        sizes, pieces = tuple(stop - start for start, stop in bounds), [ranges[b][0] for b in bounds]
    inner = [_parts_taken_off(*features_carried(piece, dim)) for piece in pieces]
    return FusedParts(sum((p.sizes if p and p.nodes else (n,) for p, n in zip(inner, sizes)), ()),
                      sum((p.nodes if p and p.nodes else (piece,) for p, piece in zip(inner, pieces)), ()))


def colwise_placement(linear: fx.Node, tp: int, groups: int = 1) -> Placement | None:
    """A colwise weight's cut: its fused parts each cut, else its ``groups`` of heads each cut
    (``head_groups``), else its features cut."""
    out_features = tensor_val(linear).shape[features_dim(linear)]
    parts = fused_parts(linear)
    if (parts is None or len(parts.sizes) == 1) and groups > 1 and out_features % groups == 0:
        parts = FusedParts((out_features // groups,) * groups, ())
    if parts is not None and len(parts.sizes) > 1:
        return InterleavedShard(0, parts.sizes) if all(p % tp == 0 for p in parts.sizes) else None
    return Shard(0) if out_features % tp == 0 else None


def _expert_weights(site: MoESite, ctx: ParallelContext) -> dict[fx.Node, Placement] | None:
    """Each expert's up (and gate) projection colwise, its down projection rowwise: placements of
    the grouped matmuls' ``[E, K, N]`` weights (N, parts of a fused gate and up each, then K cut),
    or None (with a warning) to leave the experts replicated. The router stays replicated."""
    tp = ctx.mesh.size("tp")
    placements, features = {}, {}
    for up in site.up:
        parts = fused_parts(site.out_of(up))
        features[up] = parts.sizes if parts else (tensor_val(up).shape[-1],)
        placements[up] = InterleavedShard(2, features[up]) if len(features[up]) > 1 else Shard(2)
    for down in site.down:
        features[down], placements[down] = (tensor_val(grouped_operands(down)[0]).shape[-1],), Shard(1)
    uneven = {module_name(g, ctx): list(f) for g, f in features.items() if any(n % tp for n in f)}
    if uneven:
        ctx.warn(f"{site.name}: the experts' features {uneven} do not divide by tp={tp}; the experts stay replicated")
        return None
    return placements


def _site_weights(site, ctx: ParallelContext, groups: int = 1) -> dict[fx.Node, Placement] | None:
    """Weight placements for one site, or None (with a warning) to leave it replicated; an
    attention site's heads taken in ``groups`` (``head_groups``)."""
    tp = ctx.mesh.size("tp")
    if isinstance(site, MoESite):
        return _expert_weights(site, ctx)
    colwise = list(site.colwise)
    if isinstance(site, AttentionSite):
        if site.layout_problem:
            raise InvalidPlan(f"plan: attention {site.core.name!r}: {site.layout_problem}, so tp={tp} cannot shard "
                              f"them")
        if site.num_heads % tp:
            raise InvalidPlan(
                f"plan: attention {site.core.name!r} has {site.num_heads} heads, not divisible "
                f"by mesh dim 'tp' of size {tp} (uneven heads come with context parallelism)"
            )
        if site.num_kv_heads % tp and site.num_kv_heads != site.num_heads and not site.kv_whole_on_tp:
            kv_only = [n for n in dict.fromkeys(site.k + site.v) if n not in site.q]
            ctx.warn(f"{site.name} ({site.core.name}): {site.num_kv_heads} kv heads do not divide by "
                     f"tp={tp}; kv projections {[module_name(n, ctx) for n in kv_only]} stay replicated")
            colwise = [n for n in colwise if n not in kv_only]
            if any(n in site.q for n in site.k + site.v):
                ctx.warn(f"{site.name}: fused projection with {site.num_kv_heads} kv heads at tp={tp} "
                         f"stays replicated")
                return None
    placements = {}
    for linear in colwise:
        p = colwise_placement(linear, tp, groups)
        if p is None:
            parts = fused_parts(linear)
            features = tensor_val(linear).shape[features_dim(linear)]
            ctx.warn(f"{site.name}: {module_name(linear, ctx)} has {features} output features (parts "
                     f"{parts.sizes if parts else None}), not divisible by tp={tp}; the site stays replicated")
            return None
        placements[linear] = moved(p, 2) if is_batched_linear(linear, ctx) else p  # [E, in, out]: out
    for linear in site.rowwise:
        parts = tuple(tensor_val(x).shape[-1] for x in concatenated_features(linear) or ())
        in_features = parts or (tensor_val(arguments(linear)["input"]).shape[features_dim(linear)],)
        if any(f % tp for f in in_features):
            ctx.warn(f"{site.name}: {module_name(linear, ctx)} has {list(in_features)} input features, not divisible "
                     f"by tp={tp}; the site stays replicated")
            return None
        placements[linear] = InterleavedShard(1, parts) if parts else Shard(1)
    for node in site.channelwise if isinstance(site, MLPSite) else ():  # cut as the channels reaching them
        cuts = {placements[up] for up in _feeding_projections(node, set(site.up))}
        if len(cuts) > 1:
            ctx.warn(f"{site.name}: projections cut differently reach {node.name} ({target_name(node)}); the site "
                     f"stays replicated")
            return None
        if cuts:
            placements[node] = cuts.pop()
    for linear, p in placements.items():
        if ctx.feeding.sharded and unequal_parts(p):
            ctx.warn(f"{site.name}: {module_name(linear, ctx)} is sharded part by part with unequal parts "
                     f"{list(p.parts)}, which no DTensor placement describes; under parallelize it is held whole on "
                     f"every rank and sliced at each call, its gradient all-gathered over tp")
    return placements


def _feeding_projections(node: fx.Node, projections: set[fx.Node]) -> set[fx.Node]:
    """The ``projections`` whose features reach ``node``'s input (its channels, dim 1) feature by
    feature (``_carried_dim``, walked back: a UNet's convolution, the time embedding added, to
    the group norm; Qwen3.5's q, k and v, transposed, to its causal convolution, after a decode
    step's convolution state). None where they are mixed first (Qwen3-Next's q, k and v
    concatenated: its convolution's weight stays whole, sliced as its input's channels are)."""
    found, seen, stack = set(), set(), [(arguments(node)["input"], 1)]
    while stack:
        n, dim = stack.pop()
        if (n, dim) in seen:
            continue
        seen.add((n, dim))
        if n in projections:
            found.add(n)
            continue
        source_dim = dim_order(n, tensor_val(n).dim())[dim] if op_kind(n) == "transpose" else dim
        stack.extend((i, source_dim) for i in tensor_inputs(n) if _carried_dim(n, i, source_dim) == dim)
    return found


def _bias_placement(site, linear: fx.Node, p: Placement) -> tuple[fx.Node, Placement] | None:
    """A site linear's bias and its placement: a linear's cut as its output features (a rowwise
    one has none left: ``rewrite.split_rowwise_bias``); the experts' bias table ``[E, N]`` of a
    grouped matmul cut along N (colwise) as its weight ``[E, K, N]``, whole where K is cut
    (rowwise), for it is added once, to the reduced sums."""
    if isinstance(site, MoESite):
        bias = site.biases.get(linear)
        return (bias.table, moved(p, 1)) if bias is not None and p.dim == 2 else None
    bias = arguments(linear).get("bias")
    return None if bias is None else (bias, p)


def vocab_cuts(gm: fx.GraphModule, ctx: ParallelContext) -> dict[str, Placement]:
    """The tables of token embeddings, cut by rows over tp (Megatron's vocab-parallel embedding:
    ``rules.indexing.localize_embedding``), so no rank holds a whole one: tables (parameters)
    that ``F.embedding`` reads with ids that are a graph input as given (through views and
    casts; not positions or buckets the graph computes). One whose rows do not divide by tp, or
    read with options a cut cannot keep exact (``max_norm`` writes the table,
    ``scale_grad_by_freq`` counts ids over all rows, ``sparse``), stays whole (a warning).
    An LM head, tied to a cut table or not, is cut colwise by the vocabulary (``_lm_heads``).
    A pipeline stage takes the cuts decided on the whole graph (``ctx.decided_vocab_cuts``): the
    last stage holds no table to show its head is one."""
    if ctx.decided_vocab_cuts is not None:
        return {name: ctx.decided_vocab_cuts[param.fqn] for name, param in ctx.params.items()
                if param.fqn in ctx.decided_vocab_cuts}
    tp, tables, shapes = ctx.mesh.size("tp"), {}, set()
    for node in (n for n in gm.graph.nodes if op_kind(n) == "embedding"):
        given = arguments(node)
        table, ids = given["weight"], given["input"]
        while op_kind(ids) in _RESHAPES:
            ids = tensor_inputs(ids)[0]
        if table.name not in ctx.params or ids.op != "placeholder" or ids.name in ctx.params:
            continue
        rows, fqn = tensor_val(table).shape[0], ctx.params[table.name].fqn
        options = {k: given[k] for k in ("max_norm", "scale_grad_by_freq", "sparse") if given[k] not in (None, False)}
        if rows % tp or options:
            why = f"its {rows} rows do not divide by tp={tp}" if rows % tp else f"it is read with {options}"
            ctx.warn(f"{node.name}: the embedding table {fqn} stays whole on every rank: {why}")
            continue
        tables[table.name] = Shard(0)
        shapes.add(tensor_val(table).shape)
    return {**tables, **_lm_heads(gm, ctx, shapes)}


def decided_vocab_cuts(ctx: ParallelContext) -> dict[str, Placement]:
    """The vocab cuts ``ctx``'s plan holds (those a conflict left whole dropped), by FQN: what a
    pipeline's whole graph hands each stage's plan."""
    return {ctx.params[name].fqn: ctx.param_placements[name] for name in ctx.vocab_cuts if name in ctx.param_placements}


def _lm_heads(gm: fx.GraphModule, ctx: ParallelContext, table_shapes: set[torch.Size]) -> dict[str, Placement]:
    """The weights (and biases) of LM heads, cut colwise (``Shard(0)``: each rank its vocabulary's
    logits, which the plan gathers where they are read whole): linears outside every site whose
    weight is a parameter shaped as a cut token table, ``[vocab, hidden]``. A head tied to the
    table reads it cut so anyway."""
    in_sites = {n for site in ctx.sites for n in site.colwise + site.rowwise}
    heads = {}
    for linear in (n for n in gm.graph.nodes if op_kind(n) == "linear" and n not in in_sites):
        weight, transposed = weight_param(linear)
        if transposed or getattr(weight, "name", None) not in ctx.params or tensor_val(weight).shape not in table_shapes:
            continue
        bias = arguments(linear).get("bias")
        heads.update({t.name: Shard(0) for t in (weight, bias) if isinstance(t, fx.Node) and t.name in ctx.params})
    return heads


def assign_weight_placements(gm: fx.GraphModule, ctx: ParallelContext, groups: dict[str, int] | None = None) -> None:
    """Fill ``ctx.param_placements`` from the sites, the heads of those in ``groups`` (site name
    -> groups) cut group by group, and the token embeddings' tables and LM heads cut by the
    vocabulary (``vocab_cuts``); a weight shared by two roles stays replicated."""
    chosen: dict[str, Placement] = vocab_cuts(gm, ctx)
    ctx.vocab_cuts = list(chosen)
    conflicts: set[str] = set()
    for site in ctx.sites:
        placements = _site_weights(site, ctx, (groups or {}).get(site.name, 1)) or {}
        for linear, p in placements.items():
            weight, transposed = weight_param(linear)
            ndim = tensor_val(weight).dim()  # transposed: its last two dims swapped
            held = moved(p, 2 * ndim - 3 - p.dim) if transposed else p
            stacked = stacked_params(weight)  # an nn.ModuleList's experts: each cut as the stack is, less its dim 0
            tensors = [(weight, held)] if stacked == [weight] else [(w, moved(held, held.dim - 1)) for w in stacked]
            bias = _bias_placement(site, linear, p)
            tensors += [bias] if bias is not None else []
            for tensor, placement in tensors:
                if tensor.name in chosen and chosen[tensor.name] != placement:
                    conflicts.add(tensor.name)
                chosen[tensor.name] = placement
    for name in conflicts:
        ctx.warn(f"parameter {ctx.params[name].fqn} is used by sites that shard it differently; "
                 f"it stays replicated")
        chosen.pop(name)
    ctx.param_placements = chosen


def _check_local_outputs(outputs: list[fx.Node], placements: list[Placement], env: RuleEnv) -> None:
    """A DTensor shard is one contiguous, unpadded range: refuse sequence shards that are not."""
    for node, p in zip(outputs, placements):
        if not isinstance(p, Shard):
            continue
        if env.chunks_per_rank > 1:
            raise NotSupported(
                f"output='local' with ring > 1 (output {node.name!r}): sequence shards are in the zigzag layout, "
                f"which a DTensor placement cannot describe; use output='full'")
        if env.padded(tensor_val(node).shape[p.dim]):
            raise NotSupported(
                f"output='local' with a {'batch' if env.cuts_batch else 'sequence'} of length "
                f"{tensor_val(node).shape[p.dim]} padded to split over mesh dims "
                f"{' x '.join(map(repr, SPANS[env.dim]))} = {env.size} (output {node.name!r}): a DTensor cannot "
                f"hold the padding; use output='full'")


def _plan_outputs(output: fx.Node, cur: list[Placement], env: RuleEnv, ctx: ParallelContext) -> NodeSharding:
    """Outputs are gathered whole, unless ``output="local"`` or they are a kv cache, which the
    runtime holds as computed (``passes.kv_cache``) on tp and cp: whole on dp. What a pipeline
    stage sends as its pieces over cp (``ctx.sent_outputs``) is returned cut so on cp."""
    tensors = tensor_inputs(output)
    caches = {output.args[0][c.index] for c in ctx.cache_outputs}
    if ctx.config.output == "local":
        _check_local_outputs(tensors, cur, env)
    kept = [p if (ctx.config.output == "local" or (o in caches and not env.cuts_batch))
            and isinstance(p, (Shard, Replicate)) else R
            for o, p in zip(tensors, cur)]
    if env.dim == "cp":
        sent = {output.args[0][i]: Shard(dim) for i, dim in ctx.sent_outputs.items()}
        kept = [sent.get(o, p) for o, p in zip(tensors, kept)]
    return NodeSharding(None, tuple(kept))


def token_local_sharding(node: fx.Node, site: MoESite, ins, cur, env: RuleEnv) -> NodeSharding:
    """A mixture's dispatch on a dim that cuts its tokens (cp, dp) runs on each rank's tokens
    as on one device: every token's output row depends on its own row only (no capacity, no
    token dropped), so the sort, the counts and the grouped matmuls of this rank's tokens give
    its rows of the output. Each node is placed for its local size only (a shard of its
    ``m x tokens`` rows, or whole for the experts' counts); nothing is sent inside it. It reads
    from outside only replicated tensors and rows placed as its tokens (the router's scores).
    What leaves it (the output, the router's logits) is in token order.

    With expert parallelism what holds rows at their experts (``site.at_experts``) is cut over the
    plan dims its experts are (``site.ep_over``: cp, and dp where they span dp_shard of a global
    batch) as one rank's rows of all its group's (``Shard(0)``), reading the experts cut so too;
    over dp otherwise it is placed as its rows, ``ep`` times a token's share each (``passes.experts``)."""
    p = env.out_of(site.token_order)
    tokens = tensor_val(site.tokens).shape[0]
    at_experts = node in site.at_experts
    if site.at_experts and any(env.padded(n) for n in parts_of(p, tokens)):
        raise NotSupported(f"plan: {site.name} with ep='cp': its {tokens} tokens do not divide over mesh dim "
                           f"{env.dim!r} of size {env.size}; the experts' rows are laid out for equal shares")
    for i, q in zip(ins, cur):
        as_tokens = q == p and tensor_val(i).dim() and tensor_val(i).shape[0] == tokens
        held_experts = at_experts and env.dim in site.ep_over and q == Shard(0)
        if i not in site.region and q != R and not as_tokens and not held_experts:
            raise NotSupported(f"plan: {site.name}'s dispatch node {node.name} reads {i.name}, which is {q} on mesh dim "
                               f"{env.dim!r}: a mixture of experts runs on each rank's tokens only from them and "
                               f"replicated tensors")
    leaves = node is not site.output and any(u not in site.region for u in node.users)
    if leaves and node in site.expert_order:
        raise NotSupported(f"plan: {node.name} of {site.name}'s dispatch, in expert order, is read outside it "
                           f"({[u.name for u in node.users if u not in site.region]}): only token order leaves it")

    def placed(val):
        rows = val.shape[0] if isinstance(val, torch.Tensor) and val.dim() else 0
        if at_experts and env.dim in site.ep_over:
            return Shard(0)
        if node in site.counts or rows % tokens or not 0 < rows // tokens <= site.top_k * site.ep_size:
            return R
        return p if rows == tokens else InterleavedShard(0, parts_of(p, tokens) * (rows // tokens))
    val = node.meta.get("val")
    out = tuple(map(placed, val)) if isinstance(val, (tuple, list)) else placed(val) if val is not None else None
    return NodeSharding(out, tuple(cur))


def _as_read(node: fx.Node, env: RuleEnv):
    """The placement a reader takes ``node`` in: as planned, but a vocab-cut embedding's partial
    sums reduced (or reduce-scattered under sequence parallelism) once for all its readers. The
    stream it starts is read by norms, which need it whole, and by residual adds, which would
    carry partial sums on: each block's norm would then reduce it again."""
    p = env.out_of(node)
    return env.reduce_target(node) if isinstance(p, Partial) and op_kind(node) == "embedding" else p


def plan_node(node: fx.Node, env: RuleEnv, ctx: ParallelContext, dispatch: dict[fx.Node, MoESite]) -> NodeSharding:
    """``dispatch``: the mixture of experts whose dispatch each node is part of, if any."""
    ins = tensor_inputs(node)
    cur = [_as_read(i, env) for i in ins]
    site = dispatch.get(node)
    if site is not None and not env.cuts_features and shard_dim(env.out_of(site.token_order)) == 0:
        return token_local_sharding(node, site, ins, cur, env)
    if node.op == "placeholder":
        return NodeSharding(env.input_placements.get(node.name, R), ())
    if node.op == "get_attr":
        return NodeSharding(R, ())
    if node.op == "output":
        return _plan_outputs(node, cur, env, ctx)
    kind = lookup(node)
    if kind is None and writes_in_place(node) and cur[0] == R and ins[0].op == "placeholder":
        return replicate_all(node, ins, cur, f"{target_name(node)} writes in place into the input {ins[0].name}, "
                                             f"whole on every rank (a linear attention cache's state)")
    if kind is None and writes_in_place(node) and any(p != R for p in cur):
        raise NotSupported(
            f"plan: {node.name} ({target_name(node)}) writes in place into {ins[0].name}; its inputs are "
            f"{', '.join(f'{i.name} {p}' for i, p in zip(ins, cur))} on mesh dim {env.dim!r}; it has no sharding rule, "
            f"and a write into a gathered copy would be lost: write it out of place")
    if kind is None:
        return replicate_all(node, ins, cur, f"no sharding rule for {target_name(node)}")
    sharding = kind.rule(node, ins, cur, env)
    problem = check_divisible(node, ins, sharding, env) or _cut_part_by_part_twice(node, sharding, env.dim)
    if problem:
        return replicate_all(node, ins, cur, problem)
    return sharding


def _cut_part_by_part_twice(node: fx.Node, sharding: NodeSharding, dim: str) -> str | None:
    """Why ``sharding`` cannot stand where it cuts a dim part by part that a mesh dim planned
    before already cuts part by part, on the node's output or an input (Qwen3-Next's heads
    flattened with the batch and sequence, ``[B * S * H, d]``: tp's parts, one a head of each
    token, inside cp's, one a batch entry's sequence): no redistribution lays out both, so this
    dim is gathered before such a merge."""
    def pairs(placements: NodeSharding, planned: NodeSharding):
        outs = zip(placements.out, planned.out) if isinstance(placements.out, tuple) else [(placements.out, planned.out)]
        return [*outs, *zip(placements.inputs, planned.inputs)]
    for other, planned in shardings(node).items():
        for p, q in (pairs(sharding, planned) if other != dim else ()):
            if isinstance(p, InterleavedShard) and isinstance(q, InterleavedShard) and p.dim == q.dim:
                return (f"dim {p.dim} would be cut part by part over mesh dim {dim!r} ({p}) and over mesh dim "
                        f"{other!r} (in {len(q.parts)} parts) at once")
    return None


def dispatch_regions(ctx: ParallelContext) -> dict[fx.Node, MoESite]:
    """Each node of a mixture of experts' dispatch, and its mixture (``plan_node``'s ``dispatch``)."""
    return {n: site for site in ctx.sites if isinstance(site, MoESite) for n in site.region}


@dataclass
class _TracedEnv(RuleEnv):
    """A RuleEnv whose placements are held apart from the graph's plan (``traced_cuts``): a node
    it holds none for is whole."""

    traced: dict[fx.Node, Placement | tuple] = field(default_factory=dict)

    def out_of(self, node: fx.Node):
        if node in self.traced:
            return self.traced[node]
        val = node.meta.get("val")
        return tuple(R for _ in val) if isinstance(val, (tuple, list)) else R


def _cut(p) -> bool:
    """Whether a traced placement is anything but whole."""
    return any(map(_cut, p)) if isinstance(p, tuple) else p is not None and p != R


def traced_cuts(gm: fx.GraphModule, ctx: ParallelContext, dim: str, seeds: dict[str, Placement],
                gathered: set[fx.Node] | None = None) -> dict[fx.Node, Placement | tuple]:
    """Where ``seeds`` alone take their cuts on mesh dim ``dim``, by the rules the plan runs but
    without planning the graph: each node they reach that is not whole, and its placement
    (``batch_pass`` asks which inputs' cuts reach the sites' batch, ``sequence_pass`` which reach
    the attention's sequence). A seed may be any node, an input or one the graph computes. A node
    whose rule refuses the cut is taken as gathered (and added to ``gathered``, where given)."""
    mesh_dim = next(d for d in ctx.mesh.plan_dims if d.name == dim)
    env = _TracedEnv(dim, mesh_dim.size, seeds, False, mesh_dim.chunks_per_rank)
    dispatch = dispatch_regions(ctx)
    for node in gm.graph.nodes:
        if node.name in seeds:
            env.traced[node] = seeds[node.name]
            continue
        if not any(i in env.traced for i in node.all_input_nodes):
            continue
        with at_node(f"tracing cuts on {dim!r}", node):
            try:
                sharding = plan_node(node, env, ctx, dispatch)
            except NotSupported:
                sharding = NodeSharding(R, (), "refused")
        if _cut(sharding.out):
            env.traced[node] = sharding.out
        elif sharding.note is not None and gathered is not None:
            gathered.add(node)
    return env.traced


def _seeds(ctx: ParallelContext, dim: str) -> dict[str, Placement]:
    """The inputs' placements on plan dim ``dim`` that its plan starts from: the weights' (tp's,
    chosen by the plan from the sites) or the inputs its seeding step cut."""
    seeds = dict(ctx.input_cuts.get(dim, {}) if PLAN[dim].seeded_by else ctx.param_placements)
    for name, cut in (*ctx.cache_inputs.items(), *ctx.expert_placements.items()):
        seeds.update({name: p for d, p in cut.items() if d == dim})
    return seeds


def _plan_dim(gm: fx.GraphModule, ctx: ParallelContext, dim, dispatch: dict[fx.Node, MoESite]) -> int:
    """Plan every node on mesh dim ``dim``; return how many gather a cut input (a note each)."""
    env = RuleEnv(dim.name, dim.size, _seeds(ctx, dim.name), ctx.config.sequence_parallel and PLAN[dim.name].cuts == "features",
                  dim.chunks_per_rank)
    for node in gm.graph.nodes:
        with at_node("plan", node):
            sharding = plan_node(node, env, ctx, dispatch)
            if sharding.note is not None and op_kind(node) in _RESHAPES and _reshaped_into_whole_outputs(node, ctx):
                sharding = dataclasses.replace(sharding, note=None, for_output=sharding.note)
            set_sharding(node, dim.name, sharding)
    return sum(shardings(node)[dim.name].note is not None for node in gm.graph.nodes)


_RESHAPES = {"view", "transpose", "permute", "movedim", "cast"}
"""Op kinds that give their input's elements in another shape (or a copy), no more, no fewer."""


def _reshaped_into_whole_outputs(node: fx.Node, ctx: ParallelContext) -> bool:
    """Whether ``node``'s value reaches only outputs that are gathered whole, through reshapes:
    where ``node`` is a reshape too, gathering its input is the outputs' gather, done earlier and
    of as many bytes (Wan's unpatchify, a view of the zigzag sequence that splits it)."""
    output = next(iter(node.graph.find_nodes(op="output")))
    caches = {output.args[0][c.index] for c in ctx.cache_outputs}
    if ctx.config.output == "local" or node in caches or not node.users:
        return False
    return all(user is output or op_kind(user) in _RESHAPES and _reshaped_into_whole_outputs(user, ctx)
               for user in node.users)


def head_groups(gm: fx.GraphModule, ctx: ParallelContext) -> dict[str, int]:
    """The attention sites whose heads the tp plan gathers to split into equal groups (DiffLlama:
    the values chunked into two halves of the kv heads, and the output into two halves of the
    heads, each head paired with the one ``heads / 2`` on), and the groups: site name -> count.
    Cut group by group, each rank holds its heads of every group, and the splits stay local."""
    colwise: dict[fx.Node, set[str]] = {}
    for site in (s for s in ctx.sites if isinstance(s, AttentionSite)):
        for linear in site.colwise:
            colwise.setdefault(linear, set()).add(site.name)
    groups: dict[str, set[int]] = {}
    for split in (n for n in gm.graph.nodes if op_kind(n) == "split"):
        p = shardings(arguments(split)["input"])["tp"].out
        pieces = {piece.shape[split_dim(split)] for piece in split.meta["val"]}
        if shardings(split)["tp"].note is None or type(p) is not Shard or p.dim != split_dim(split) or len(pieces) != 1:
            continue
        for site in _sites_cutting(split, colwise):
            groups.setdefault(site, set()).add(len(split.meta["val"]))
    return {site: counts.pop() for site, counts in groups.items() if len(counts) == 1}


def _sites_cutting(node: fx.Node, colwise: dict[fx.Node, set[str]]) -> set[str]:
    """The sites whose colwise projections the tp cut of ``node``'s input comes from: walked back
    through cut nodes only, so not past a projection to the stream it reads."""
    sites, stack, seen = set(), [arguments(node)["input"]], set()
    while stack:
        n = stack.pop()
        if n in seen or (n not in colwise and shard_dim(shardings(n)["tp"].out) is None):
            continue
        seen.add(n)
        if n in colwise:
            sites |= colwise[n]
        else:
            stack.extend(n.all_input_nodes)
    return sites


def _cut_starts_as_read(gm: fx.GraphModule, dim: str) -> None:
    """A sequence cut where it is made from a value whole on every rank (a rotary table built from
    the positions) may take any cut of that dim for free: a local slice. Where every reader needs
    one other cut of it (a joint sequence's, each rank its part of each stream), it is cut so
    where it starts, not cut evenly and then gathered and cut again at each reader."""
    for start in [n for n in gm.graph.nodes if op_kind(n) == "sequence_start"]:
        planned = shardings(start)[dim]
        if shardings(tensor_inputs(start)[0])[dim].out != R:
            continue
        casts: list[fx.Node] = []
        needed = _needed_by_readers(start, dim, planned.out, casts)
        if len(needed) != 1:
            continue
        wanted = needed.pop()
        if wanted != planned.out and shard_dim(wanted) == shard_dim(planned.out):
            for node in (start, *casts):
                set_sharding(node, dim, dataclasses.replace(shardings(node)[dim], out=wanted, inputs=(wanted,)))


def _needed_by_readers(node: fx.Node, dim: str, p: Placement, casts: list[fx.Node]) -> set[Placement]:
    """The placements ``node``'s readers need it in on ``dim``, past casts that keep ``p`` (which
    join ``casts``: a ``.to(device)``)."""
    needed = set()
    for user in node.users:
        planned = shardings(user)[dim]
        if op_kind(user) == "cast" and len(tensor_inputs(user)) == 1 and planned.out == p and planned.inputs == (p,):
            casts.append(user)
            needed |= _needed_by_readers(user, dim, p, casts)
        else:
            needed |= {q for i, q in zip(tensor_inputs(user), planned.inputs) if i is node}
    return needed


def plan_pass(gm: fx.GraphModule, ctx: ParallelContext) -> fx.GraphModule:
    """Annotate every node with its NodeSharding on each planned mesh dim (``meta.shardings``).
    Where the tp plan gathers an attention's heads to split them into groups, the heads are cut
    group by group instead (``head_groups``), if that gathers less."""
    if ctx.mesh.size("tp") > 1:
        assign_weight_placements(gm, ctx)
    for node in gm.graph.nodes:
        if tensor_val(node) is not None:
            set_global_shape(node, tuple(tensor_val(node).shape))
    dispatch = dispatch_regions(ctx)
    for dim in ctx.mesh.plan_dims:
        gathers = _plan_dim(gm, ctx, dim, dispatch)
        groups = head_groups(gm, ctx) if dim.name == "tp" and gathers else {}
        if groups:
            whole, ctx.held_warnings = ctx.param_placements, []
            assign_weight_placements(gm, ctx, groups)
            held, ctx.held_warnings = ctx.held_warnings, None
            if _plan_dim(gm, ctx, dim, dispatch) >= gathers:
                ctx.param_placements = whole
                _plan_dim(gm, ctx, dim, dispatch)
            else:
                for message in held:
                    ctx.warn(message)
        if PLAN[dim.name].cuts == "sequence":
            _cut_starts_as_read(gm, dim.name)
        for node in gm.graph.nodes:
            if (note := shardings(node)[dim.name].note) is not None:
                ctx.warn(f"{node.name} ({target_name(node)}): inputs gathered on mesh dim {dim.name!r}: {note}")
    output = next(n for n in gm.graph.nodes if n.op == "output")
    tensors = [i for i, o in enumerate(output.args[0]) if tensor_val(o) is not None]
    ctx.output_placements = [None] * len(output.args[0])
    for k, i in enumerate(tensors):
        ctx.output_placements[i] = {d: s.inputs[k] for d, s in shardings(output).items()}
    return gm
