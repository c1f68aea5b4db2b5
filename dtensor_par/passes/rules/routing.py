"""Ops that route tokens to experts: top-k and sorts along a dim, one-hot codes, scatters
that add rows into place, and histograms. A shard of a dim the op does not select, sort,
scatter or count along stays; along it the op needs the whole dim, so its inputs are
gathered (a clear fallback, never a guess), except counts, which add up as partial sums.
"""

from __future__ import annotations

import math

import torch
import torch.fx as fx
import torch.nn.functional as F

from ...errors import NotSupported
from ...mesh import MeshInfo
from ...ops.experts import combine_rows, dispatch_rows, exchange_counts, experts_from_rows, local_expert_ids, \
    local_offsets
from ...ops.lowerings import FUNCTIONAL
from ...placements import Partial, Placement, Shard, parts_of, shard_dim
from ...symbolic import hint
from ..meta import Communication, NodeSharding, experts_cut_over, planned_local_shape, set_communications, site_role
from ..nodes import arguments, target_name, tensor_val, writes_in_place
from .core import R, norm_dim, replicate_all, resolve_partial
from .registry import op_kind, register


def _along(node: fx.Node) -> int:
    """The dim an op selects, sorts or scatters along."""
    given = arguments(node)
    return norm_dim(given.get("dim", -1), tensor_val(given["input"]).dim())


def selection_rule(node, ins, cur, env):
    """``topk``, ``sort``, ``argsort``: each output (values, indices) is placed as the input,
    whose dim along which they select must be whole."""
    p = resolve_partial(ins, cur, env)[0]
    outputs = node.meta["val"]
    if shard_dim(p) == _along(node):
        return replicate_all(node, ins, [p], f"{target_name(node)} along the sharded dim {p.dim}")
    return NodeSharding(tuple(p for _ in outputs) if isinstance(outputs, (tuple, list)) else p, (p,))


def one_hot_rule(node, ins, cur, env):
    """Each index becomes its own code (a new last dim); ``num_classes=-1`` takes the class
    count from the whole tensor's largest index, which a shard does not know."""
    p = cur[0]
    if p != R and arguments(node)["num_classes"] == -1:
        return replicate_all(node, ins, cur, "one_hot with num_classes=-1 counts the classes of the whole tensor")
    return NodeSharding(p, (p,))


def _refuse_lost_write(node: fx.Node, ins: list[fx.Node], cur: list[Placement], env) -> None:
    """An in-place scatter into a shard it cannot keep would write into a gathered copy."""
    if writes_in_place(node) and cur[0] != R:
        raise NotSupported(
            f"plan: {node.name} ({target_name(node)}) writes in place along dim {_along(node)} into {ins[0].name} "
            f"{list(tensor_val(ins[0]).shape)}, which is {cur[0]} on mesh dim {env.dim!r}, with inputs "
            f"{', '.join(f'{i.name} {p}' for i, p in zip(ins, cur))}: the write cannot run on these shards; write it "
            f"out of place")


def along_index_rule(node, ins, cur, env):
    """``gather(input, dim, index)``, ``scatter(input, dim, index, src or value)`` (DeepSeek's
    router masks its expert groups so, and picks its top-k weights), ``scatter_add(input, dim,
    index, src)`` and ``index_add(input, dim, index, source)``: ops that read or write ``input``
    at the positions ``index`` holds along ``dim``. Partial sums stay partial through the adds
    (linear in input and the added rows), not through ``scatter``, which overwrites. Off ``dim`` a
    shard stays where every tensor that spans that dim does so at the same length (``index_add``'s
    1-D index stays whole); along ``dim`` the positions the index names are global, so the
    inputs are gathered (an in-place write that cannot keep its target is refused), except a
    ``gather`` from a whole input with its index cut along ``dim``: each rank reads the
    positions its piece of the index names (RoBERTa's token types, a buffer gathered at
    positions cut over cp)."""
    given, along = arguments(node), _along(node)
    index = given["index"]
    values = [i for i in ins if i is not index]
    if op_kind(node) == "scatter_add" and all(isinstance(cur[ins.index(i)], Partial) for i in values) \
            and cur[ins.index(index)] == R:
        return NodeSharding(Partial(), tuple(cur))
    cur = resolve_partial(ins, cur, env)
    at_index = cur[ins.index(index)]
    if op_kind(node) == "gather" and cur[ins.index(given["input"])] == R and shard_dim(at_index) == along:
        return NodeSharding(at_index, tuple(cur))
    spanning = [i for i in ins if tensor_val(i).dim() == tensor_val(ins[0]).dim()]
    sharded = [p for p in cur if shard_dim(p) is not None]
    if not sharded:
        return NodeSharding(R, tuple(R for _ in ins))
    p = sharded[0]
    fits = (p.dim != along and all(cur[ins.index(i)] in (p, R) for i in spanning)
            and len({tensor_val(i).shape[p.dim] for i in spanning}) == 1
            and all(cur[ins.index(i)] == R for i in ins if i not in spanning))
    if fits:
        return NodeSharding(p, tuple(p if i in spanning else R for i in ins))
    _refuse_lost_write(node, ins, cur, env)
    return replicate_all(node, ins, cur,
                         f"{target_name(node)} of inputs placed {[str(q) for q in cur]}, along dim {along}")


def histc_rule(node, ins, cur, env):
    """Counts over a fixed range add up: a histogram of shards is partial sums of the whole's
    (unless the dim is padded: the padding would count). ``min == max`` takes the range from
    the whole tensor's values, which a shard does not know."""
    p, given = resolve_partial(ins, cur, env)[0], arguments(node)
    if p == R:
        return NodeSharding(R, (R,))
    if given["min"] == given["max"] or any(env.padded(part) for part in parts_of(p, tensor_val(ins[0]).shape[p.dim])):
        return replicate_all(node, ins, [p], "histc over a range the shards do not share (min == max) or of padding")
    return NodeSharding(Partial(), (p,))


def bincount_rule(node, ins, cur, env):
    """The count's length is the whole tensor's largest value + 1: a shard's may differ."""
    if all(p == R for p in cur):
        return NodeSharding(R, tuple(cur))
    return replicate_all(node, ins, cur, "bincount's length follows the largest value of the whole tensor")


def expert_exchange_rule(node, ins, cur, env):
    """Expert parallelism's exchanges (``ops.experts``: the counts, the rows sent to their
    experts and back) move whole rows between the cp ranks, so a cut of the rows' features (tp),
    their partial sums, and the rows of one dp rank stay as they are; the counts are whole. Over
    cp they run only on each rank's own tokens, which the mixture's dispatch places
    (``plan.token_local_sharding``): here its tokens are not cut over cp."""
    rows, counts = cur[0], cur[1:]  # exchange_counts' and local_offsets' only input: counts
    if env.cuts_sequence or shard_dim(rows) == 0 or any(c != R for c in counts):
        raise NotSupported(f"plan: {node.name} ({target_name(node)}): expert parallelism (ep='cp') runs on each "
                           f"cp rank's own tokens, but the mixture's inputs reach it {[str(c) for c in cur]} on "
                           f"mesh dim {env.dim!r} (gathered before it: see the warnings); run it with ep=None")
    return NodeSharding(rows, tuple(cur))


def local_expert_ids_rule(node, ins, cur, env):
    """``local_expert_ids``: whole, from the whole offsets, reading of its rows only how many they
    are (their features may be cut); what the exchanges refuse, it refuses."""
    expert_exchange_rule(node, ins[::-1], cur[::-1], env)
    return NodeSharding(R, tuple(cur))


def experts_from_rows_rule(node, ins, cur, env):
    """``experts_from_rows``: over the plan dims the experts are cut over (``experts_cut_over``) every
    expert's piece along ``rows_dim`` becomes this rank's experts whole (``Shard(rows_dim)`` in,
    ``Shard(0)`` out); elsewhere it sends nothing and a cut of another dim (tp's) stays."""
    rows_dim, p, over = node.args[1], cur[0], experts_cut_over(node)
    moved = env.dim in over
    fits = p == Shard(rows_dim) if moved else not isinstance(p, Partial) and shard_dim(p) not in (0, rows_dim)
    if not fits:
        raise NotSupported(f"plan: {node.name} ({target_name(node)}) sends each rank its experts whole from their "
                           f"pieces along dim {rows_dim} over {list(over)}, but {ins[0].name} "
                           f"{list(tensor_val(ins[0]).shape)} reaches it {p} on mesh dim {env.dim!r}")
    return NodeSharding(Shard(0) if moved else p, (p,))


def localize_experts_from_rows(gm: fx.GraphModule, node: fx.Node, mesh: MeshInfo) -> None:
    """What ``experts_from_rows`` sends: this rank's pieces of every expert, each way."""
    ep, val = node.kwargs["ep"], tensor_val(node)
    nbytes = hint(math.prod(planned_local_shape(node, mesh))) * val.element_size()
    backward = "all_to_all" if node.meta["requires_grad"] else None
    set_communications(node, [Communication("all_to_all", backward, ep.name, ep.size, nbytes,
                                            nbytes if backward else 0, site_role(node))])


def localize_expert_exchange(gm: fx.GraphModule, node: fx.Node, mesh: MeshInfo) -> None:
    """What each exchange sends: the counts, a rank's rows (all of them go in, wherever they go),
    and, the other way, at most what every rank's rows could send to its experts (the worst
    case, ``cp`` times its own: the routing decides). A lowering without uneven all-to-alls
    (``ops.experts``' padded form) sends the worst case both ways, whatever the routing."""
    ep, val = node.kwargs["ep"], tensor_val(node)
    nbytes = hint(math.prod(planned_local_shape(node, mesh))) * val.element_size()
    grad, padded = node.meta["requires_grad"], node.kwargs["comm"] != FUNCTIONAL
    own, worst = (nbytes // ep.size, nbytes) if node.target is dispatch_rows else (nbytes, nbytes * ep.size)
    sent = {exchange_counts: (nbytes, 0), dispatch_rows: (worst if padded else own, worst if grad else 0),
            combine_rows: (worst, (worst if padded else own) if grad else 0)}[node.target]
    backward = "all_to_all" if sent[1] else None
    set_communications(node, [Communication("all_to_all", backward, ep.name, ep.size, *sent, site_role(node))])


register("selection", "routing", selection_rule, functions=[torch.topk, torch.sort, torch.argsort],
         methods=["topk", "sort", "argsort"])
register("one_hot", "routing", one_hot_rule, functions=[F.one_hot])
register("scatter_add", "routing", along_index_rule, functions=[torch.scatter_add, torch.index_add],
         methods=["scatter_add", "scatter_add_", "index_add", "index_add_"])
register("scatter", "routing", along_index_rule, functions=[torch.scatter], methods=["scatter", "scatter_"])
register("gather", "routing", along_index_rule, functions=[torch.gather], methods=["gather"])
register("histc", "routing", histc_rule, functions=[torch.histc], methods=["histc"])
register("bincount", "routing", bincount_rule, functions=[torch.bincount], methods=["bincount"])
register("expert_exchange", "routing", expert_exchange_rule, functions=[exchange_counts, dispatch_rows, combine_rows],
         localize=localize_expert_exchange)
register("experts_from_rows", "routing", experts_from_rows_rule, functions=[experts_from_rows],
         localize=localize_experts_from_rows)
register("expert_offsets", "routing", expert_exchange_rule, functions=[local_offsets])
register("expert_ids", "routing", local_expert_ids_rule, functions=[local_expert_ids])
