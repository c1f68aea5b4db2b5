"""Mixture-of-experts sites: the grouped matmuls of the experts' up and down projections, the
router's choice of experts per token that routes their tokens (``is_topk``, ``is_choice``,
``choice_logits_and_k``, ``routing_choice``) and the dispatch between the tokens and their
weighted sum per token (``dispatch_region``, ``moe_site``, ``find_moe_sites``)."""

from __future__ import annotations

import torch
import torch.fx as fx

from ..context import ParallelContext, at_node
from ..nodes import arguments, stacked_params, tensor_inputs, tensor_val, weight_param
from ..rules.indexing import cat_dim
from ..rules.matmul import grouped_operands
from ..rules.registry import kinds_in, op_kind
from ..sites import MoESite, RowBias, module_name
from .mlp import INSIDE_MLP
from .walk import find_producers, has_param_weight, walk_through, written_from


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
            stack.extend(written_from(node))
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


def routing_choice(region: frozenset[fx.Node]) -> fx.Node | None:
    """The one choice that routes a dispatch region's tokens: inside it (the router reads the
    tokens it dispatches), else the one it reads its choice from (DeepSeek's router reads the
    hidden states before they are flattened to tokens); None when there is not exactly one."""
    inside = [n for n in region if is_choice(n)]
    if inside:
        return inside[0] if len(inside) == 1 else None
    _, walked = walk_through([i for n in region for i in n.all_input_nodes if i not in region],
                      lambda n: n.all_input_nodes, _TO_CHOICE, set())
    fed = {i for n in walked for i in n.all_input_nodes if is_choice(i)}
    return fed.pop() if len(fed) == 1 else None


def moe_site(site_name: str, ups: list[fx.Node], down: fx.Node, ctx: ParallelContext) -> MoESite | None:
    """The mixture of experts around one down projection's grouped matmul, or None when it does
    not read as one (no token gather before it, no per-token sum after, no top-k router)."""
    tokens = _gathered_tokens(ups[0])
    output = _per_token_output(down, tokens) if tokens is not None else None
    if output is None or any(not has_param_weight(g, ctx) for g in ups + [down]):
        return None
    region = dispatch_region([tokens], output)
    choice = routing_choice(region)
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
        ups, _ = walk_through([grouped_operands(down)[0]], written_from, INSIDE_MLP, {"grouped_mm"})
        with at_node("detect", down):
            site = moe_site(f"moe{len(sites)}", ups, down, ctx) if ups else None
        if site is not None:
            sites.append(site)
    read = {g for site in sites for g in site.up + site.down}
    for grouped in (n for n in gm.graph.nodes if op_kind(n) == "grouped_mm" and n not in read):
        if has_param_weight(grouped, ctx):
            stacked = tuple(w.name for w in stacked_params(weight_param(grouped)[0]))
            ctx.warn(f"{grouped.name}: the grouped matmul of {module_name(grouped, ctx, stacked)} is not "
                     f"read as a mixture of experts (up and down grouped matmuls with per-row ops between them, on "
                     f"tokens gathered by a top-k router's choice and summed back per token): planned op by op, its "
                     f"experts whole on every rank")
    return sites
