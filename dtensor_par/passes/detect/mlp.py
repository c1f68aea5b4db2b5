"""MLP sites: a down projection and the up (and gate) projections it reads through an activation
(``find_mlp_sites``). Their projections are linears, convolutions of every channel in to every
channel out, or batched linears of one weight per expert (``is_batched_linear``); between them may
lie depthwise convolutions, group norms, bilinear gates and recurrences, and a smaller site that
the larger one takes in."""

from __future__ import annotations

from dataclasses import replace

import torch.fx as fx

from ..context import ParallelContext, at_node
from ..nodes import arguments, tensor_inputs, tensor_val, weight_param
from ..rules.matmul import is_channelwise_conv
from ..rules.pointwise import is_activation
from ..rules.registry import kinds_in, op_kind
from ..sites import MLPSite
from .walk import has_param_weight, walk_through, written_from


# Ops allowed inside an MLP between up/gate and down projections.
INSIDE_MLP = kinds_in("pointwise") | {"split", "getitem"}


# ... and inside a site read as one (``find_mlp_sites``): views and products of activations too,
# so that linear attention is one (Sana's: relu of q and k viewed as heads, multiplied with v head
# by head, then merged), its features cut from the q, k, v projections to the out projection;
# group norms between convolutions (a UNet's resnet block: conv, norm, activation, conv); a
# recurrence run head by head, as one op (Qwen3.5's gated delta rule: its q, k, v, gate and beta
# projections to its out projection; its depthwise convolution is walked through as any site's) or
# as traced (MiniMax's, Kimi's: the chunks' cumulative gates, triangular solves, sums over each
# head's features, the chunks concatenated back).
_INSIDE_MLP_SITE = INSIDE_MLP | kinds_in("views") | {"matmul", "group_norm", "recurrence", "cumsum", "reduce", "cat",
                                                      "solve_triangular"}


def is_batched_linear(node: fx.Node, ctx: ParallelContext) -> bool:
    """Whether ``node`` is a product of ``[E, tokens, in]`` by a parameter ``[E, in, out]``: one
    linear per expert, each run on every token (Llama 4's experts: the tokens tiled once per
    expert, weighted by the router's scores, zero where an expert is not chosen)."""
    if op_kind(node) != "matmul" or not has_param_weight(node, ctx):
        return False
    weight, x = tensor_val(weight_param(node)[0]), tensor_val(arguments(node)["input"])
    return weight.dim() == 3 and x is not None and x.dim() == 3


def _projection_kind(node: fx.Node, ctx: ParallelContext) -> str | None:
    """The op kind of the projections of an MLP site ``node`` may be the down projection of: a
    parameter linear, a convolution of every channel in to every channel out (a 1 x 1 kernel is
    a linear over the channels; a wider one, a UNet's resnet block's), or a batched linear
    (``is_batched_linear``), whose up projections are of the same kind."""
    if op_kind(node) == "linear" and has_param_weight(node, ctx):
        return "linear"
    if op_kind(node) == "conv" and arguments(node).get("groups", 1) == 1 and has_param_weight(node, ctx):
        return "conv"
    return "matmul" if is_batched_linear(node, ctx) else None


def _walk_to_projections(down: fx.Node, kind: str, ctx: ParallelContext) -> tuple[list, list, list]:
    """(the ops of ``kind`` a down projection reads through ``_INSIDE_MLP_SITE``, the nodes
    walked, the depthwise convolutions walked through): those keep each channel apart (Sana's
    GLUMBConv: a pointwise, a depthwise, the gate chunked off, a pointwise; a gated delta rule's
    causal convolution over its q, k and v)."""
    ups, walked, channelwise, stack = [], [], [], [arguments(down)["input"]]
    while stack:
        found, through = walk_through(stack, written_from, _INSIDE_MLP_SITE, {kind, "conv"})
        walked += through
        stack = []
        for n in found:
            if is_channelwise_conv(n) and has_param_weight(n, ctx):
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
        norms = [n for n in between if op_kind(n) == "group_norm" and has_param_weight(n, ctx)]
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
