"""The sites detect finds, as the later passes read them: attention (``AttentionSite``, with the
``SinkLogits`` of its scores), MLPs (``MLPSite``) and mixtures of experts (``MoESite``, with the
``RowBias`` of each grouped matmul); and what is read off a site's weights: the ops whose weights
it cuts (``cut_projections``), their placeholder names (``site_weight_names``) and module paths
(``module_name``)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.fx as fx

from .context import ParallelContext
from .meta import weight_names
from .rules.registry import op_kind


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
    activations: list[fx.Node] = field(default_factory=list)  # and bilinear gates (detect.mlp._gates)
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


def site_weight_names(site) -> list[str]:
    """The placeholder names of a site's colwise, depthwise and rowwise weights, in order (each
    expert's, for experts stacked from an ``nn.ModuleList``)."""
    return [name for linear in cut_projections(site) for name in weight_names(linear)]


def cut_projections(site) -> list[fx.Node]:
    """The ops whose weights a site cuts: colwise, depthwise (an MLP site's), rowwise."""
    return site.colwise + (site.channelwise if isinstance(site, MLPSite) else []) + site.rowwise


def module_name(linear: fx.Node, ctx: ParallelContext, names: tuple[str, ...] | None = None) -> str:
    """The module path of a site linear, read off its weight (``blocks.0.k_proj``); of experts'
    weights stacked from an ``nn.ModuleList``, with ``*`` where their paths differ (``experts.*.w1``).
    ``names``: the weight's placeholders, for a linear that is no site's."""
    paths = [ctx.params[name].fqn.removesuffix(".weight").split(".") for name in names or weight_names(linear)]
    return ".".join(part if all(p[i] == part for p in paths) else "*" for i, part in enumerate(paths[0]))
