"""detect: find attention, mixture-of-experts and MLP sites and the projections that feed them."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch
import torch.fx as fx

from .context import ParallelContext, at_node
from .meta import set_site_role, set_weight_names, weight_names
from .nodes import arguments, stacked_params, tensor_inputs, tensor_val, weight_param, writes_in_place
from .rules.indexing import cat_dim, per_dim, split_dim
from .rules.matmul import grouped_operands, is_channelwise_conv
from .rules.pointwise import is_activation
from .rules.registry import kinds_in, op_kind
from .rules.views import dim_order

# Ops allowed between a projection and the attention call: head reshapes, RoPE, QK-norm.
TO_ATTENTION = kinds_in("pointwise", "views", "indexing") | {"norm"}
# Ops allowed between attention output and its out projection: head merges, output gates, norms
# of heads (DiffLlama's per head pair).
_FROM_ATTENTION = kinds_in("pointwise", "views", "indexing") | {"norm"}
# Ops through which a projection beside attention reaches its out projection, not through the
# residual stream (no add): an output gate (Qwen3-Next's gated norm: ``norm(a) * silu(gate(x))``).
_TO_OUT_PROJECTION = _FROM_ATTENTION - {"add"}
# Ops allowed inside an MLP between up/gate and down projections.
_INSIDE_MLP = kinds_in("pointwise") | {"split", "getitem"}
# ... and inside a site read as one (``find_mlp_sites``): views and products of activations too,
# so that linear attention is one (Sana's: relu of q and k viewed as heads, multiplied with v head
# by head, then merged), its features cut from the q, k, v projections to the out projection;
# group norms between convolutions (a UNet's resnet block: conv, norm, activation, conv); a
# recurrence run head by head, as one op (Qwen3.5's gated delta rule: its q, k, v, gate and beta
# projections to its out projection; its depthwise convolution is walked through as any site's) or
# as traced (MiniMax's, Kimi's: the chunks' cumulative gates, triangular solves, sums over each
# head's features, the chunks concatenated back).
_INSIDE_MLP_SITE = _INSIDE_MLP | kinds_in("views") | {"matmul", "group_norm", "recurrence", "cumsum", "reduce", "cat",
                                                      "solve_triangular"}
# Ops allowed between attention written out by hand's q @ kT and its softmax: scale, soft-capping
# (tanh), an additive bias or mask, masked_fill, where, upcasts; and between softmax and @ v.
# Views fold the heads into the batch and back (Bloom's [batch * heads, seq, keys] scores).
_SCORE_MODIFIERS = kinds_in("pointwise") | {"cast", "view"}
_AFTER_SOFTMAX = {"cast", "dropout", "view"}
# Ops through which a softmax that is not read as attention may still be made from a matmul's
# output: enough to name it in a warning.
_NEAR_SCORES = _SCORE_MODIFIERS | kinds_in("views", "indexing", "reductions")


@dataclass(frozen=True)
class SinkLogits:
    """GPT-OSS's attention sinks: a learned logit per head concatenated after the scores' last
    column (a key every query sees, whose value is zero), its probability dropped before ``@ v``."""

    scores: fx.Node  # the scores the sink column is concatenated to
    per_head: fx.Node  # [1, heads, 1, 1]: the logits, before they are expanded to the column
    dropped: fx.Node  # the probabilities without the sink column


@dataclass
class AttentionSite:
    name: str
    core: fx.Node  # the scaled_dot_product_attention call, or the probabilities @ v of attention written out
    q: list[fx.Node]  # projection linears; a fused QKV linear appears in q, k and v
    k: list[fx.Node]
    v: list[fx.Node]
    out: list[fx.Node]
    num_heads: int
    num_kv_heads: int
    branch: list[fx.Node] = field(default_factory=list)  # beside attention, reaching its out projection: an MLP, a gate
    layout_problem: str | None = None  # why the heads cannot be read off the projections' views: tp refuses it
    scores: fx.Node | None = None  # attention written out by hand: its q @ kT
    softmax: fx.Node | None = None  # ... and the softmax over its scores
    sinks: SinkLogits | None = None  # ... and the sink logits concatenated to them
    kv_whole_on_tp: list[fx.Node] = field(default_factory=list)  # fused kv parts rewrite gathers (gather_fused_kv)

    @property
    def colwise(self) -> list[fx.Node]:
        return list(dict.fromkeys(self.q + self.k + self.v + self.branch))

    @property
    def written_out(self) -> bool:
        """Attention written out by hand (``softmax(q @ kT ...) @ v``), still as written: its ops
        are planned one by one, as any op is, unless rewrite turns it into hybrid attention (cp)."""
        return op_kind(self.core) == "matmul"

    @property
    def rowwise(self) -> list[fx.Node]:
        return self.out


@dataclass
class MLPSite:
    name: str
    up: list[fx.Node]  # up and gate projections
    down: fx.Node
    activations: list[fx.Node] = field(default_factory=list)  # and bilinear gates (detect._gates)
    # depthwise convolutions and group norms between, their weights cut with the channels
    channelwise: list[fx.Node] = field(default_factory=list)
    # projections between that read the cut features and give whole ones, which up projections
    # read (Mamba-1's x_proj: its time steps' low-rank input, then dt_proj; B and C for every channel)
    inner: list[fx.Node] = field(default_factory=list)

    @property
    def colwise(self) -> list[fx.Node]:
        return self.up

    @property
    def rowwise(self) -> list[fx.Node]:
        return [*self.inner, self.down]


@dataclass(frozen=True)
class RowBias:
    """A bias added to each row of a grouped matmul's output: its expert's row of ``table``
    ``[E, N]``, gathered by the rows' sorted expert ids that the offsets count (GPT-OSS:
    ``out.add_(gate_up_proj_bias[expert_ids_g])``, made out of place by canonicalize)."""

    add: fx.Node  # the grouped matmul's output plus ``rows``
    rows: fx.Node  # table[ids]
    table: fx.Node  # the parameter


@dataclass
class MoESite:
    """A mixture of experts: a router's top-k choice per token, the tokens sorted by expert
    through grouped matmuls (each expert's up and gate, then down projection) and their
    outputs weighted and summed back per token. ``region``: the dispatch, every node computed
    from the tokens (and from the router's choice, where the router reads no tokens) on the way
    to ``output``, which maps each token's row to its own row."""

    name: str
    router: fx.Node  # the router's linear: its logits
    up: list[fx.Node]  # grouped matmuls of the experts' up (and gate) projections
    down: list[fx.Node]
    tokens: fx.Node  # [tokens, hidden] the experts read
    token_order: fx.Node  # the first of the tokens and the router's scores: the dispatch's rows are placed as it
    output: fx.Node  # [tokens, hidden] the experts' weighted sum per token
    region: frozenset[fx.Node]
    counts: frozenset[fx.Node]  # dispatch nodes made from a histogram of experts: shaped by experts, not tokens
    expert_order: frozenset[fx.Node]  # dispatch nodes made from a sort by expert: their rows are no token's
    num_experts: int
    top_k: int
    at_experts: frozenset[fx.Node] = frozenset()  # with ep: what holds rows at their experts' rank (passes.experts)
    ep_size: int = 1  # the ranks its experts are cut over
    ep_over: tuple[str, ...] = ()  # the plan dims they are cut over (passes.experts.plan_dims_cut)
    sent_whole: frozenset[str] = frozenset()  # with ep: one expert's weights each (an nn.ModuleList's), held cut
    # along a dim of their own and sent whole to their expert's rank at each use (passes.experts.held_by_rows)
    biases: dict[fx.Node, RowBias] = field(default_factory=dict)  # grouped matmul -> the bias its rows get

    @property
    def colwise(self) -> list[fx.Node]:
        return self.up

    def out_of(self, grouped: fx.Node) -> fx.Node:
        """A grouped matmul's output as its readers take it: with its rows' bias, if any."""
        return self.biases[grouped].add if grouped in self.biases else grouped

    @property
    def rowwise(self) -> list[fx.Node]:
        return self.down


def _has_param_weight(linear: fx.Node, ctx: ParallelContext) -> bool:
    weight, _ = weight_param(linear)
    return isinstance(weight, fx.Node) and all(w.name in ctx.params for w in stacked_params(weight))


def site_weight_names(site) -> list[str]:
    """The placeholder names of a site's colwise, depthwise and rowwise weights, in order (each
    expert's, for experts stacked from an ``nn.ModuleList``)."""
    return [name for linear in _cut_projections(site) for name in weight_names(linear)]


def _cut_projections(site) -> list[fx.Node]:
    """The ops whose weights a site cuts: colwise, depthwise (an MLP site's), rowwise."""
    return site.colwise + (site.channelwise if isinstance(site, MLPSite) else []) + site.rowwise


def module_name(linear: fx.Node, ctx: ParallelContext, names: tuple[str, ...] | None = None) -> str:
    """The module path of a site linear, read off its weight (``blocks.0.k_proj``); of experts'
    weights stacked from an ``nn.ModuleList``, with ``*`` where their paths differ (``experts.*.w1``).
    ``names``: the weight's placeholders, for a linear that is no site's."""
    paths = [ctx.params[name].fqn.removesuffix(".weight").split(".") for name in names or weight_names(linear)]
    return ".".join(part if all(p[i] == part for p in paths) else "*" for i, part in enumerate(paths[0]))


def _walk(stack: list[fx.Node], step, through: set[str], ends: set[str]) -> tuple[list[fx.Node], list[fx.Node]]:
    """Walk from the nodes in ``stack`` through ops of the given kinds (and what is written into
    them), ``step(node)`` giving the next ones; return (the ops of the kinds ``ends`` reached,
    the nodes walked through)."""
    reached, walked, seen = [], [], set()
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if op_kind(node) in ends:
            reached.append(node)
        elif op_kind(node) in through or _written_into(node):
            walked.append(node)
            stack.extend(step(node))
    return reached, walked


def _walk_to_linears(stack: list[fx.Node], step, through: set[str], ctx: ParallelContext):
    """``_walk`` to linears; return (the parameter linears reached, the nodes walked through)."""
    linears, walked = _walk(stack, step, through, {"linear"})
    return [n for n in linears if _has_param_weight(n, ctx)], walked


def _written_into(node: fx.Node) -> list[fx.Node]:
    """What is written into ``node`` in place (a static kv cache's buffer gets its keys by
    ``index_copy_``): the writes' other inputs."""
    return [i for u in node.users if writes_in_place(u) and arguments(u)["input"] is node for i in u.all_input_nodes
            if i is not node]


def _written_from(node: fx.Node) -> list[fx.Node]:
    """What ``node`` is computed from: its inputs, and what is written into it in place."""
    return node.all_input_nodes + _written_into(node)


def find_producers(start: fx.Node, through: set[str], ctx: ParallelContext) -> tuple[list[fx.Node], list[fx.Node]]:
    """Walk back from ``start`` through ops of the given kinds; return (linears, nodes walked)."""
    return _walk_to_linears([start], _written_from, through, ctx)


def _broadcast_over_heads(node: fx.Node) -> bool:
    """A 4-d ``expand`` of one head to many (DeepSeek's rotary key part, shared by every head)."""
    if op_kind(node) != "expand":
        return False
    src, dst = tensor_val(tensor_inputs(node)[0]), tensor_val(node)
    return src is not None and src.dim() == dst.dim() == 4 and src.shape[1] == 1 != dst.shape[1]


def _per_head_inputs(node: fx.Node) -> list[fx.Node]:
    """What ``node`` is computed from head by head: ``_written_from``, but nothing past a
    broadcast over the heads, whose source no head owns: the projection making it serves every
    head and stays whole."""
    return [] if _broadcast_over_heads(node) else _written_from(node)


def find_head_projections(attention_input: fx.Node, ctx: ParallelContext) -> tuple[list[fx.Node], list[fx.Node]]:
    """Walk back from an attention input to the projections making its heads; return (linears,
    nodes walked)."""
    return _walk_to_linears([attention_input], _per_head_inputs, TO_ATTENTION, ctx)


def find_consumers(start: fx.Node, through: set[str], ctx: ParallelContext) -> list[fx.Node]:
    """Walk forward from ``start`` through ops of the given kinds to the linears it feeds."""
    return _walk_to_linears(list(start.users), lambda n: n.users, through, ctx)[0]


def _feature_split(node: fx.Node) -> tuple[int, ...] | None:
    """The sizes a view splits the feature (last) dim of activations into: ``(heads, head_dim)``,
    or a grouped layout's ``(groups, members, head_dim)`` (Falcon's fused qkv; Bloom's
    ``(heads, 3, head_dim)``), through the views before it that split the same features (Falcon
    in transformers 5.25: ``(heads, head_dim)``, then ``(groups, members, head_dim)``). Integer
    positions viewed on the way to RoPE are no heads."""
    if op_kind(node) != "view" or not tensor_val(node).is_floating_point():
        return None
    source = arguments(node)["input"]
    while _regroups(source, node):
        source = arguments(source)["input"]
    src, dst = tensor_val(source).shape, tensor_val(node).shape
    lead = len(src) - 1
    if len(dst) > len(src) and src[:-1] == dst[:lead] and math.prod(dst[lead:]) == src[-1]:
        return tuple(dst[lead:])
    return None


def _regroups(view: fx.Node, user: fx.Node) -> bool:
    """Whether ``user`` views the features ``view`` split, their last dim kept: it can only
    split their outer parts finer, ``(heads, head_dim)`` into ``(groups, members, head_dim)``,
    not ``head_dim`` into the pairs of a rotary embedding."""
    return (_feature_split(view) is not None and op_kind(user) == "view"
            and tensor_val(user).shape[-1] == tensor_val(view).shape[-1])


def _selects_along(node: fx.Node, dim: int) -> bool:
    """Whether the first op past views and copies that picks pieces of ``node``'s value picks
    them along ``dim`` (``unbind``, an integer index, ``split``/``chunk``)."""
    ndim = tensor_val(node).dim()
    for user in node.users:
        kind = op_kind(user)
        if kind in ("permute", "transpose"):
            if not _selects_along(user, dim_order(user, ndim).index(dim)):
                return False
        elif kind == "cast":
            if not _selects_along(user, dim):
                return False
        elif kind in ("unbind", "split"):
            if split_dim(user) != dim:
                return False
        elif kind == "getitem":
            entries = per_dim(arguments(user)["index"], ndim)
            if entries is None or not isinstance(entries[dim], int):
                return False
        else:
            return False
    return bool(node.users)


def parts_major_split(view: fx.Node) -> tuple[int, int, int] | None:
    """``(parts, heads, head_dim)`` when ``view`` splits a fused projection's features part
    first, every part (q, k, v) holding all the heads, and what reads it takes one part each:
    ``qkv.view(b, s, 3, heads, head_dim)``, then ``permute`` and ``unbind`` (timm's attention,
    ModernBERT). Its units of heads are the heads; the projection is cut part by part."""
    sizes = _feature_split(view)
    if sizes is None or len(sizes) != 3 or not _selects_along(view, tensor_val(view).dim() - 3):
        return None
    return sizes


def _head_units(view: fx.Node) -> int:
    """What tp cuts a view of a projection's features into: heads, or groups of heads."""
    parts_major = parts_major_split(view)
    return parts_major[1] if parts_major else _feature_split(view)[0]


def _head_splits(linear: fx.Node, path: set[fx.Node]) -> list[fx.Node]:
    """The view splitting features on each way from a projection through ``path``: the last of
    a chain of views that split them finer."""
    splits, stack, seen = [], list(linear.users), set()
    while stack:
        node = stack.pop()
        if node in seen or node not in path:
            continue
        seen.add(node)
        finer = [u for u in node.users if u in path and _regroups(node, u) and _feature_split(u) is not None]
        if _feature_split(node) is not None and not finer:
            splits.append(node)
        else:
            stack.extend(node.users)
    return splits


def projected_heads(attention_input: fx.Node, heads: int, ctx: ParallelContext) -> tuple[int | None, str | None]:
    """``(units, problem)``: the heads (or groups of heads) one attention input's projections
    make, read off the views that split their features (None without such a view). tp shards
    them unit by unit, so each unit must group whole heads of the ``heads`` the attention reads;
    where they do not, the layout cannot be read, and ``problem`` names the views and sizes.
    Beside a view that groups heads, a split into a multiple of the heads cuts inside each head
    (rotary pairs: LTX-Video's ``unflatten(2, (-1, 2))`` before the heads are split) and says
    nothing of how heads group."""
    linears, walked = find_head_projections(attention_input, ctx)
    views = list(dict.fromkeys(v for linear in linears for v in _head_splits(linear, set(walked))))
    if any(heads % _head_units(v) == 0 for v in views):
        views = [v for v in views if _head_units(v) <= heads or _head_units(v) % heads]
    units = {_head_units(v) for v in views}
    if not views:
        return None, None
    if len(units) == 1 and heads % next(iter(units)) == 0:
        return units.pop(), None
    seen = ", ".join(f"{v.name!r} {list(tensor_val(arguments(v)['input']).shape)} -> {list(tensor_val(v).shape)}"
                     for v in views)
    return None, (f"the head layout of {attention_input.name!r} cannot be read: its projection's features are split "
                  f"by the view {seen}, whose outer sizes {sorted(units)} do not group the {heads} heads the attention "
                  f"reads")


def folds_heads(unfolded: torch.Size, folded: torch.Size) -> bool:
    """Whether ``folded`` is ``[batch * heads, seq, dim]`` of an ``unfolded`` ``[batch, heads, seq, dim]``."""
    return len(unfolded) == 4 and len(folded) == 3 and unfolded[0] * unfolded[1] == folded[0] \
        and tuple(unfolded[2:]) == tuple(folded[1:])


def unfolded_heads(node: fx.Node) -> fx.Node | None:
    """The ``[batch, heads, seq, dim]`` tensor a ``[batch * heads, seq, dim]`` one is viewed from."""
    if op_kind(node) != "view":
        return None
    source = tensor_inputs(node)[0]
    return source if folds_heads(tensor_val(source).shape, tensor_val(node).shape) else None


def _heads_of(x: fx.Node) -> int:
    """The heads of ``[batch, heads, seq, dim]`` attention operands; 1 without a heads dim."""
    return tensor_val(x).shape[-3] if tensor_val(x).dim() >= 4 else 1


def _written_heads(scores: fx.Node, softmax: fx.Node) -> int | None:
    """The heads attention written out by hand runs: its probabilities' ``[batch, heads, seq,
    keys]``, or, folded into the batch (``[batch * heads, seq, keys]``: XGLM), the heads its
    query was viewed from; None for neither."""
    if tensor_val(softmax).dim() >= 4:
        return tensor_val(softmax).shape[-3]
    source = unfolded_heads(tensor_inputs(scores)[0]) if tensor_val(softmax).dim() == 3 else None
    return None if source is None else tensor_val(source).shape[1]


def _score_products(scores: fx.Node) -> list[fx.Node]:
    """The matmuls a softmax's input is made from through score modifiers."""
    return _walk([scores], _written_from, _SCORE_MODIFIERS, {"matmul"})[0]


def _drops_last_column(node: fx.Node) -> bool:
    """Whether ``node`` is ``x[..., :-1]``: every column of ``x``'s last dim but the last."""
    entries = per_dim(arguments(node)["index"], tensor_val(node).dim()) if op_kind(node) == "getitem" else None
    if not entries or any(e != slice(None) for e in entries[:-1]) or not isinstance(entries[-1], slice):
        return False
    columns = tensor_val(arguments(node)["input"]).shape[-1]
    return range(columns)[entries[-1]] == range(columns - 1)


def find_sink_logits(softmax: fx.Node) -> SinkLogits | None:
    """The sink logits of a softmax over ``cat([scores, column], -1)`` whose column is a
    ``[1, heads, 1, 1]`` tensor expanded, and whose probabilities are read without it."""
    logits, ndim = tensor_inputs(softmax)[0], tensor_val(softmax).dim()
    if op_kind(logits) != "cat" or cat_dim(logits) != ndim - 1 or len(logits.users) != 1 or ndim != 4 \
            or len(arguments(logits)["tensors"]) != 2 or len(softmax.users) != 1:
        return None
    scores, column = arguments(logits)["tensors"]
    per_head = tensor_inputs(column)[0] if op_kind(column) == "expand" else None
    if per_head is None or tuple(tensor_val(per_head).shape) != (1, tensor_val(scores).shape[1], 1, 1):
        return None
    dropped = next(iter(softmax.users))
    return SinkLogits(scores, per_head, dropped) if _drops_last_column(dropped) else None


def weighted_values(softmax: fx.Node, sinks: SinkLogits | None) -> fx.Node | None:
    """The matmul that weighs values by a softmax's probabilities (through casts, dropout and
    views, and without the sinks' column)."""
    probabilities = softmax if sinks is None else sinks.dropped
    while len(probabilities.users) == 1 and op_kind(next(iter(probabilities.users))) in _AFTER_SOFTMAX:
        probabilities = next(iter(probabilities.users))
    users = [u for u in probabilities.users if op_kind(u) == "matmul" and tensor_inputs(u)[0] is probabilities]
    return users[0] if len(users) == 1 and len(probabilities.users) == 1 else None


def _over_last_dim(softmax: fx.Node) -> bool:
    return arguments(softmax).get("dim") in (-1, tensor_val(softmax).dim() - 1)


def find_written_attention(gm: fx.GraphModule, ctx: ParallelContext
                           ) -> list[tuple[fx.Node, fx.Node, fx.Node, SinkLogits | None]]:
    """``(q @ kT, softmax, probabilities @ v, sink logits)`` of each attention written out by hand:
    a softmax over the last dim of ``[batch, heads, seq, keys]`` scores made from one matmul's
    output (through score modifiers and views folding the heads into the batch, as Bloom's
    ``baddbmm`` does; with sink logits concatenated last) whose probabilities are multiplied with
    the values. A softmax over a matmul's output that does not read so is warned of by name: a
    report must not look complete when it is not."""
    found = []
    for softmax in (n for n in gm.graph.nodes if op_kind(n) == "softmax"):
        sinks = find_sink_logits(softmax)
        products = _score_products(tensor_inputs(softmax)[0] if sinks is None else sinks.scores)
        weighted = weighted_values(softmax, sinks)
        if len(products) == 1 and weighted is not None and _over_last_dim(softmax) \
                and _written_heads(products[0], softmax) is not None:
            found.append((products[0], softmax, weighted, sinks))
            continue
        products = products or _walk([tensor_inputs(softmax)[0]], _written_from, _NEAR_SCORES, {"matmul"})[0]
        if products:
            ctx.warn(f"{softmax.name}: a softmax over the product {products[0].name} is not read as attention "
                     f"(softmax(q @ kT) @ v, the scores [batch, heads, seq, keys]); it is planned op by op, its heads "
                     f"not sharded as a site's")
    return found


def find_attention_sites(gm: fx.GraphModule, ctx: ParallelContext) -> list[AttentionSite]:
    """SDPA calls and attention written out by hand, in graph order, each with the heads its
    query and key are read with."""
    cores = []
    for sdpa in (n for n in gm.graph.nodes if op_kind(n) == "sdpa"):
        inputs = arguments(sdpa)
        cores.append((sdpa, inputs, (_heads_of(inputs["query"]), _heads_of(inputs["key"])), (None, None, None)))
    for scores, softmax, weighted, sinks in find_written_attention(gm, ctx):
        (query, key), value = tensor_inputs(scores), tensor_inputs(weighted)[1]
        inputs = {"query": query, "key": key, "value": value}
        cores.append((weighted, inputs, (_written_heads(scores, softmax),) * 2, (scores, softmax, sinks)))
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    sites = []
    for node, inputs, heads, (scores, softmax, sinks) in sorted(cores, key=lambda c: order[c[0]]):
        with at_node("detect", node):
            site = attention_site(f"attention{len(sites)}", node, inputs, heads, ctx)
        site.scores, site.softmax, site.sinks = scores, softmax, sinks
        sites.append(site)
    return sites


def attention_site(site_name: str, node: fx.Node, sdpa: dict, heads: tuple[int, int],
                   ctx: ParallelContext) -> AttentionSite:
    """The site of one attention call (its ``query``, ``key`` and ``value`` inputs in ``sdpa``,
    read with ``heads`` query and key heads): the projections it reads, the heads they make and
    the projections its output feeds."""
    q, k, v = (find_head_projections(sdpa[name], ctx)[0] for name in ("query", "key", "value"))
    layouts = {name: projected_heads(sdpa[name], heads[0], ctx) for name in ("query", "key", "value")}
    problem = next((problem for _, problem in layouts.values() if problem), None)
    kv_heads = layouts["key"][0] or heads[1]
    out = find_consumers(node, _FROM_ATTENTION, ctx)
    branch = [linear for o in out for part in (concatenated_features(o) or ())
              for linear in find_producers(part, _INSIDE_MLP, ctx)[0]]
    gates = [linear for o in out for linear in find_producers(arguments(o)["input"], _TO_OUT_PROJECTION, ctx)[0]]
    branch = list(dict.fromkeys(branch + [g for g in gates if g not in q + k + v]))
    return AttentionSite(site_name, node, q, k, v, out, heads[0], kv_heads, branch, problem)


def concatenated_features(linear: fx.Node) -> list[fx.Node] | None:
    """The inputs of a ``cat`` along the feature dim that a linear reads (Flux's single-stream
    blocks: ``proj_out(cat([attention, mlp], -1))``), else None."""
    x = arguments(linear)["input"]
    if op_kind(x) != "cat" or cat_dim(x) != tensor_val(x).dim() - 1:
        return None
    return tensor_inputs(x)


def is_batched_linear(node: fx.Node, ctx: ParallelContext) -> bool:
    """Whether ``node`` is a product of ``[E, tokens, in]`` by a parameter ``[E, in, out]``: one
    linear per expert, each run on every token (Llama 4's experts: the tokens tiled once per
    expert, weighted by the router's scores, zero where an expert is not chosen)."""
    if op_kind(node) != "matmul" or not _has_param_weight(node, ctx):
        return False
    weight, x = tensor_val(weight_param(node)[0]), tensor_val(arguments(node)["input"])
    return weight.dim() == 3 and x is not None and x.dim() == 3


def _projection_kind(node: fx.Node, ctx: ParallelContext) -> str | None:
    """The op kind of the projections of an MLP site ``node`` may be the down projection of: a
    parameter linear, a convolution of every channel in to every channel out (a 1 x 1 kernel is
    a linear over the channels; a wider one, a UNet's resnet block's), or a batched linear
    (``is_batched_linear``), whose up projections are of the same kind."""
    if op_kind(node) == "linear" and _has_param_weight(node, ctx):
        return "linear"
    if op_kind(node) == "conv" and arguments(node).get("groups", 1) == 1 and _has_param_weight(node, ctx):
        return "conv"
    return "matmul" if is_batched_linear(node, ctx) else None


def _walk_to_projections(down: fx.Node, kind: str, ctx: ParallelContext) -> tuple[list, list, list]:
    """(the ops of ``kind`` a down projection reads through ``_INSIDE_MLP_SITE``, the nodes
    walked, the depthwise convolutions walked through): those keep each channel apart (Sana's
    GLUMBConv: a pointwise, a depthwise, the gate chunked off, a pointwise; a gated delta rule's
    causal convolution over its q, k and v)."""
    ups, walked, channelwise, stack = [], [], [], [arguments(down)["input"]]
    while stack:
        found, through = _walk(stack, _written_from, _INSIDE_MLP_SITE, {kind, "conv"})
        walked += through
        stack = []
        for n in found:
            if is_channelwise_conv(n) and _has_param_weight(n, ctx):
                channelwise.append(n)
                stack.append(arguments(n)["input"])
            else:
                ups.append(n)
    return list(dict.fromkeys(ups)), list(dict.fromkeys(walked)), list(dict.fromkeys(channelwise))


def find_mlp_sites(gm: fx.GraphModule, ctx: ParallelContext, taken: set[fx.Node]) -> list[MLPSite]:
    sites = []
    for node in gm.graph.nodes:
        kind = _projection_kind(node, ctx)
        if kind is None or node in taken:
            continue
        with at_node("detect", node):
            ups, walked, channelwise = _walk_to_projections(node, kind, ctx)
            ups = [up for up in ups if _projection_kind(up, ctx) == kind]
        between = _made_from(ups, walked + channelwise)
        path = _between_not_through_sums(ups, node, walked + channelwise)
        activations = [n for n in path if is_activation(n) or _gates(n, {*ups, *path})]
        if kind == "conv" and _leaves_site(ups + between, {*between, node}):
            continue
        norms = [n for n in between if op_kind(n) == "group_norm" and _has_param_weight(n, ctx)]
        inner = _inner_site(sites, ups, taken)
        if ups and activations and not taken.intersection(ups):
            sites.append(MLPSite(f"mlp{len(sites)}", ups, node, activations, channelwise + norms))
        elif inner is not None:
            site = sites[inner]
            sites[inner] = replace(site, up=site.up + [up for up in ups if up not in taken], down=node,
                                   activations=list(dict.fromkeys(site.activations + activations)),
                                   channelwise=list(dict.fromkeys(site.channelwise + channelwise + norms)),
                                   inner=site.inner + [site.down])
        else:
            continue
        taken.update(ups)
        taken.add(node)
    return sites


def _inner_site(sites: list[MLPSite], ups: list[fx.Node], taken: set[fx.Node]) -> int | None:
    """The earlier site whose projections are all among ``ups``, a down projection's walk back,
    and the only ones of them taken: a site inside a larger one (Mamba-1's in_proj to x_proj, in
    its mixer from in_proj and dt_proj to out_proj), which the larger one takes in
    (``MLPSite.inner``)."""
    for i, site in enumerate(sites):
        if site.down in ups and taken.intersection(ups) == {*site.up, *site.inner, site.down}:
            return i
    return None


def _gates(node: fx.Node, made_from_ups: set[fx.Node]) -> bool:
    """A product of two values made from the up projections: a bilinear gate, nonlinear as an
    activation is (LFM2's short convolution: ``B * x``, convolved, then ``C *``, all three chunked
    off one projection)."""
    factors = tensor_inputs(node)
    return op_kind(node) == "mul" and len(factors) == 2 and all(f in made_from_ups for f in factors)


def _leaves_site(nodes: list[fx.Node], inside: set[fx.Node]) -> bool:
    """Whether any of ``nodes`` is read outside ``inside``: a convolution's output that also
    feeds a residual (a UNet's input convolution, or a resnet block's output, before the next
    block's norm and convolution) is the stream the block adds to, not an MLP's hidden layer."""
    return any(user not in inside for node in nodes for user in node.users)


def _between_not_through_sums(ups: list[fx.Node], down: fx.Node, walked: list[fx.Node]) -> list[fx.Node]:
    """The ``walked`` nodes on a path from ``ups`` to ``down`` that passes no sum: where an MLP's
    activation lies. A recurrence's sums over each head's features are walked through (Kimi's
    forget gate reaches its output only so), but the ``pow`` and ``rsqrt`` of a norm of the
    residual stream lie on no such path: o_proj and the next gate_proj are no MLP."""
    kept = [n for n in walked if op_kind(n) != "reduce"]
    walkable, reaching, stack = set(kept), set(), [arguments(down)["input"]]
    while stack:
        node = stack.pop()
        if node in walkable and node not in reaching:
            reaching.add(node)
            stack.extend(node.all_input_nodes)
    return [n for n in _made_from(ups, kept) if n in reaching]


def _made_from(sources: list[fx.Node], walked: list[fx.Node]) -> list[fx.Node]:
    """The ``walked`` nodes that ``sources`` reach through walked nodes: an MLP's activation lies
    between its projections, not on a branch beside them."""
    inside, reached, stack = set(walked), set(), list(sources)
    while stack:
        for user in stack.pop().users:
            if user in inside and user not in reached:
                reached.add(user)
                stack.append(user)
    return [n for n in walked if n in reached]


_FROM_EXPERTS = kinds_in("pointwise", "views", "indexing") | {"reduce"}
"""Ops between the down projection's grouped matmul and the per-token sum: routing weights,
the inverse permutation, the sum over the top k."""


def _gathered_tokens(grouped: fx.Node) -> fx.Node | None:
    """The ``[tokens, hidden]`` tensor whose rows a grouped matmul reads in expert order
    (``x[perm // top_k]``, through casts)."""
    rows = grouped_operands(grouped)[0]
    while op_kind(rows) == "cast":
        rows = arguments(rows)["input"]
    given = arguments(rows) if op_kind(rows) == "getitem" else {}
    source = given.get("input")
    if not isinstance(given.get("index"), fx.Node) or tensor_val(source) is None or tensor_val(source).dim() != 2:
        return None
    return source


def _row_bias(grouped: fx.Node, ids: fx.Node | None, ctx: ParallelContext) -> RowBias | None:
    """The bias ``grouped``'s rows get, if its output is read only by an add of a parameter
    ``[E, N]`` gathered by ``ids`` (the expert ids its offsets count)."""
    users = list(grouped.users)
    add = users[0] if len(users) == 1 and op_kind(users[0]) == "add" else None
    rows = [i for i in tensor_inputs(add) if i is not grouped] if add is not None else []
    if len(rows) != 1 or op_kind(rows[0]) != "getitem":
        return None
    table, index = arguments(rows[0])["input"], arguments(rows[0])["index"]
    experts, out = tensor_val(grouped_operands(grouped)[1]).shape[0], tensor_val(grouped).shape[-1]
    if index is not ids or ids is None or table.name not in ctx.params or tuple(tensor_val(table).shape) != (experts, out):
        return None
    return RowBias(add, rows[0], table)


def _counted_ids(histograms: list[fx.Node]) -> fx.Node | None:
    """The ids the one histogram of a dispatch counts (through casts)."""
    if len(histograms) != 1:
        return None
    ids = tensor_inputs(histograms[0])[0]
    while op_kind(ids) == "cast":
        ids = arguments(ids)["input"]
    return ids


def _per_token_output(down: fx.Node, tokens: fx.Node) -> fx.Node | None:
    """The first node after the down projection shaped as the tokens: their weighted sum."""
    node = down
    while tensor_val(node) is None or tensor_val(node).shape != tensor_val(tokens).shape:
        users = list(node.users)
        if len(users) != 1 or op_kind(users[0]) not in _FROM_EXPERTS:
            return None
        node = users[0]
    return node


def dispatch_region(sources: list[fx.Node], output: fx.Node) -> frozenset[fx.Node]:
    """The nodes computed from ``sources`` (the tokens, and the router's choice where the
    router reads no tokens) that ``output`` is computed from, the writes into them
    (``inv_perm[perm] = arange(n)``) and the fresh tensors written (that ``arange``)."""
    below, stack = set(), [user for source in sources for user in source.users]
    while stack:
        node = stack.pop()
        if node not in below:
            below.add(node)
            stack.extend(node.users)
    region, stack = set(), [output]
    while stack:
        node = stack.pop()
        if node in below and node not in region:
            region.add(node)
            stack.extend(_written_from(node))
    for write in [u for n in region for u in n.users if op_kind(u) == "setitem" and arguments(u)["input"] in region]:
        region.add(write)
        region.update(i for i in write.all_input_nodes if not tensor_inputs(i) and i.op == "call_function")
    return frozenset(region)


_TO_CHOICE = kinds_in("pointwise", "views") | {"getitem", "gather"}
"""Ops between a router's top-k and the dispatch reading its choice: the indices picked out,
the weights gathered at them, scaled and cast."""


def is_topk(node: fx.Node) -> bool:
    return node.target in (torch.topk, "topk")


def _top1_pick(node: fx.Node) -> fx.Node | None:
    """The ``max`` whose indices ``node`` is, ``x.max(dim=-1, keepdim=True)[1]``: one expert a token."""
    if op_kind(node) != "getitem" or arguments(node)["index"] != 1:
        return None
    found = arguments(node)["input"]
    if op_kind(found) != "extreme" or found.target not in (torch.max, "max"):
        return None
    given = arguments(found)
    last = tensor_val(given["input"]).dim() - 1
    return found if given.get("dim") in (-1, last) and given.get("keepdim") else None


def _picks_one_by_one(node: fx.Node) -> bool:
    """Whether ``node`` concatenates top-1 picks along the last dim: PhiMoE's sparsemixer picks
    its experts one by one so, each pick's expert masked out of the scores of the next."""
    return op_kind(node) == "cat" and cat_dim(node) == tensor_val(node).dim() - 1 \
        and all(_top1_pick(pick) is not None for pick in tensor_inputs(node))


def is_choice(node: fx.Node) -> bool:
    """A router's choice of experts per token: a top-k, or top-1 picks concatenated."""
    return is_topk(node) or _picks_one_by_one(node)


def choice_logits_and_k(choice: fx.Node) -> tuple[fx.Node, int]:
    """The router's scores a choice picks from (the first pick's), and how many it picks a token."""
    if is_topk(choice):
        return arguments(choice)["input"], arguments(choice)["k"]
    first = _top1_pick(tensor_inputs(choice)[0])
    return arguments(first)["input"], tensor_val(choice).shape[-1]


def _routing_choice(region: frozenset[fx.Node]) -> fx.Node | None:
    """The one choice that routes a dispatch region's tokens: inside it (the router reads the
    tokens it dispatches), else the one it reads its choice from (DeepSeek's router reads the
    hidden states before they are flattened to tokens); None when there is not exactly one."""
    inside = [n for n in region if is_choice(n)]
    if inside:
        return inside[0] if len(inside) == 1 else None
    _, walked = _walk([i for n in region for i in n.all_input_nodes if i not in region],
                      lambda n: n.all_input_nodes, _TO_CHOICE, set())
    fed = {i for n in walked for i in n.all_input_nodes if is_choice(i)}
    return fed.pop() if len(fed) == 1 else None


def moe_site(site_name: str, ups: list[fx.Node], down: fx.Node, ctx: ParallelContext) -> MoESite | None:
    """The mixture of experts around one down projection's grouped matmul, or None when it does
    not read as one (no token gather before it, no per-token sum after, no top-k router)."""
    tokens = _gathered_tokens(ups[0])
    output = _per_token_output(down, tokens) if tokens is not None else None
    if output is None or any(not _has_param_weight(g, ctx) for g in ups + [down]):
        return None
    region = dispatch_region([tokens], output)
    choice = _routing_choice(region)
    if choice is None:
        return None
    token_order = tokens
    logits, k = choice_logits_and_k(choice)
    if choice not in region:
        region = dispatch_region([tokens, choice], output)
        order = {n: i for i, n in enumerate(tokens.graph.nodes)}
        token_order = min(tokens, logits, key=order.get)
    routers = find_producers(logits, kinds_in("pointwise") | {"softmax"}, ctx)[0]
    if len(routers) != 1:
        return None
    histograms = [n for n in region if op_kind(n) in ("histc", "bincount")]
    counts = _computed_from(region, set(histograms), only=True)
    expert_order = _computed_from(region, {n for n in region if op_kind(n) == "selection" and n is not choice})
    biases = {g: bias for g in ups + [down] if (bias := _row_bias(g, _counted_ids(histograms), ctx)) is not None}
    return MoESite(site_name, routers[0], ups, [down], tokens, token_order, output, region, counts, expert_order,
                   tensor_val(logits).shape[-1], k, biases=biases)


def _computed_from(region: frozenset[fx.Node], sources: set[fx.Node], only: bool = False) -> frozenset[fx.Node]:
    """The nodes of a region computed from ``sources`` (these included): from any of them, or
    with ``only``, from nothing else (the cumulative sum of a histogram, not a matmul it offsets)."""
    found, stack = set(), list(sources)
    while stack:
        node = stack.pop()
        inputs = tensor_inputs(node)
        if node in region and node not in found and (node in sources or not only or all(i in found for i in inputs)):
            found.add(node)
            stack.extend(node.users)
    return frozenset(found)


def find_moe_sites(gm: fx.GraphModule, ctx: ParallelContext) -> list[MoESite]:
    """Each grouped matmul whose tokens another one's outputs make (through the activation
    and gate): the experts' down and up projections, and the mixture around them. An expert
    weight's grouped matmul read otherwise is warned of by name: a report must not look
    complete when it is not."""
    sites = []
    for down in (n for n in gm.graph.nodes if op_kind(n) == "grouped_mm"):
        ups, _ = _walk([grouped_operands(down)[0]], _written_from, _INSIDE_MLP, {"grouped_mm"})
        with at_node("detect", down):
            site = moe_site(f"moe{len(sites)}", ups, down, ctx) if ups else None
        if site is not None:
            sites.append(site)
    read = {g for site in sites for g in site.up + site.down}
    for grouped in (n for n in gm.graph.nodes if op_kind(n) == "grouped_mm" and n not in read):
        if _has_param_weight(grouped, ctx):
            stacked = tuple(w.name for w in stacked_params(weight_param(grouped)[0]))
            ctx.warn(f"{grouped.name}: the grouped matmul of {module_name(grouped, ctx, stacked)} is not "
                     f"read as a mixture of experts (up and down grouped matmuls with per-row ops between them, on "
                     f"tokens gathered by a top-k router's choice and summed back per token): planned op by op, its "
                     f"experts whole on every rank")
    return sites


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
    routed = {_routing_choice(site.region) for site in experts}
    output = gm.graph.output_node()
    for topk in (n for n in gm.graph.nodes if is_topk(n) and n not in routed):
        indices = [u for u in topk.users if op_kind(u) == "getitem" and arguments(u)["index"] == 1]
        _, walked = _walk(indices, lambda n: list(n.users), _CARRY_CHOICE, set())
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
        for linear in _cut_projections(site) + ([site.router] if isinstance(site, MoESite) else []):
            set_weight_names(linear, tuple(w.name for w in stacked_params(weight_param(linear)[0])))
    return gm
