"""expert_loop, a step of ``capture``: a loop over an ``nn.ModuleList`` of experts, captured in
one graph, becomes the experts read a row at a time (transformers' ``batched_mm`` layout), which
``canonicalize`` makes the grouped chain that tp and expert parallelism shard.

Under Dynamo's ``capture_dynamic_output_shape_ops`` such a loop (Mixtral's before transformers
4.57, ``tests.models.LoopedExperts``) unrolls to one iteration per expert ``e``::

    slot, token = torch.where(one_hot(chosen, E).permute(2, 1, 0)[e])  # a size the values make
    y = expert_e(tokens[token]) * weights[token, slot, None]
    out.index_add_(0, token, y)

Every (token, slot) pair reaches exactly one expert, the one ``chosen[token, slot]`` names. So
the iterations together compute, for row ``token * k + slot`` of
``tokens.repeat_interleave(k, dim=0)``, the chain of its expert, with the experts' weights
stacked ``[E, out, in]`` and read by ``chosen.reshape(-1)``; and ``out`` gains each token's
rows summed over its k slots. Each row's products are the same; only the order in which a
token's k rows are added differs (none for top-2). No size then depends on values.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from ..errors import NotSupported
from .nodes import arguments
from .rules.registry import kinds_in, op_kind

_CHAIN_KINDS = kinds_in("pointwise") | {"view", "linear"}
"""What an expert may compute between its tokens' rows and the rows it adds back: each row on
its own (a linear's product along features, elementwise ops, views)."""


@dataclass
class _Iteration:
    """One expert's pass of the loop: the nodes that read its ``torch.where``."""

    expert: int
    where: fx.Node
    chosen: fx.Node
    tokens: fx.Node
    gathered: fx.Node  # tokens[token] (or tokens[None, token])
    gate: fx.Node  # weights[token, slot, None]
    add: fx.Node  # out.index_add_(0, token, rows)
    chain: list[fx.Node]  # from ``gathered`` and ``gate`` to the rows added, in graph order
    nodes: set[fx.Node]  # every node that reads the where, with the size checks Dynamo adds


def _value(node):
    return node.meta.get("example_value", node.meta.get("val")) if isinstance(node, fx.Node) else node


def _expert_of(where: fx.Node) -> tuple[fx.Node, int, int] | None:
    """``(chosen, e, E)`` when ``where`` is ``torch.where(one_hot(chosen, E).permute(2, 1, 0)[e])``."""
    picked = where.args[0] if len(where.args) == 1 and not where.kwargs else None
    if not isinstance(picked, fx.Node) or picked.target is not operator.getitem or not isinstance(picked.args[1], int):
        return None
    mask = picked.args[0]
    if op_kind(mask) != "permute" or list(arguments(mask)["dims"]) != [2, 1, 0]:
        return None
    one_hot = arguments(mask)["input"]
    if one_hot.target not in (torch.nn.functional.one_hot, torch._C._nn.one_hot):
        return None
    given = arguments(one_hot)
    return given["input"], picked.args[1], given["num_classes"]


def _descendants(node: fx.Node) -> set[fx.Node]:
    found, stack = set(), [node]
    while stack:
        n = stack.pop()
        if n not in found:
            found.add(n)
            stack.extend(n.users)
    return found


def _read_iteration(where: fx.Node, order: dict[fx.Node, int]) -> _Iteration | str:
    """The iteration ``where`` starts, or why it is not one expert's pass of a loop over experts
    (``order``: each node's position in the graph)."""
    chosen, expert, _ = _expert_of(where)
    nodes = _descendants(where)
    parts = {u.args[1]: u for u in where.users if u.target is operator.getitem}
    gathered, gates, adds, chain = [], [], [], []
    for node in sorted(nodes - {where}, key=order.get):
        index = node.args[1] if node.target is operator.getitem and len(node.args) == 2 else None
        if index is not None and node.args[0] is where:
            continue
        if not isinstance(_value(node), torch.Tensor):
            if any(isinstance(_value(u), torch.Tensor) for u in node.users):
                return f"{node.name} ({node.target}) gives a size the values make to {sorted(u.name for u in node.users)}"
            continue  # Dynamo's checks of the size
        if index is not None and node.args[0] not in nodes and _reads_token(index, where) is not None:
            (gates if _reads_slot(index, where) else gathered).append(node)
        elif node.op == "call_method" and node.target == "index_add_":
            adds.append(node)
        else:
            chain.append(node)
    if len(gathered) != 1 or len(gates) != 1 or len(adds) != 1 or not {0, 1} <= set(parts):
        return (f"it reads its tokens {len(gathered)} times, their routing weights {len(gates)} times and adds rows "
                f"back {len(adds)} times, where one expert's pass does each once")
    add = adds[0]
    if add.args[1:3] != (0, _token_part(where, add.args[2])) or add.kwargs or len(add.args) != 4:
        return f"{add.name} does not add rows back by token along dim 0 ({add.args[1:]}, {add.kwargs})"
    for node in chain:
        if op_kind(node) not in _CHAIN_KINDS:
            return f"{node.name} ({node.target}) between its tokens and the rows it adds back is not computed row by row"
        outside = [i for i in node.all_input_nodes if i not in nodes and not _is_weight(node, i)]
        if outside:
            return f"{node.name} reads {[i.name for i in outside]}, from outside the expert's pass"
        if op_kind(node) == "linear" and arguments(node).get("bias") is not None:
            return f"{node.name}: an expert's linear with a bias"
        if op_kind(node) == "linear" and _value(arguments(node)["input"]).ndim != 2:
            return f"{node.name}: an expert's linear of rows {list(_value(arguments(node)['input']).shape)}, not 2-d"
    if any(u not in nodes for n in nodes for u in n.users):
        return "a node of it is read after the loop"
    return _Iteration(expert, where, chosen, gathered[0].args[0], gathered[0], gates[0], add, chain, nodes)


def _token_part(where: fx.Node, index) -> fx.Node | None:
    return index if isinstance(index, fx.Node) and index.target is operator.getitem and index.args == (where, 1) \
        else None


def _reads_token(index, where: fx.Node) -> fx.Node | None:
    """The token part of ``where`` when ``index`` reads the rows of tokens (``[token]``,
    ``[None, token]``) or their routing weights (``[token, slot, None...]``)."""
    parts = index if isinstance(index, tuple) else (index,)
    if parts[:1] == (None,) and len(parts) == 2:
        parts = parts[1:]
    return _token_part(where, parts[0]) if parts and (len(parts) == 1 or _reads_slot(index, where)) else None


def _reads_slot(index, where: fx.Node) -> bool:
    """Whether ``index`` is ``[token, slot, None...]``: each row's routing weight."""
    return isinstance(index, tuple) and len(index) >= 2 and isinstance(index[1], fx.Node) \
        and index[1].target is operator.getitem and index[1].args == (where, 0) and all(i is None for i in index[2:])


def _is_weight(node: fx.Node, value: fx.Node) -> bool:
    return op_kind(node) == "linear" and value is arguments(node)["weight"] and value.op == "placeholder"


def _same_pass(first: _Iteration, other: _Iteration) -> str | None:
    """Why ``other`` does not compute what ``first`` does with another expert's weights, or None."""
    if len(first.chain) != len(other.chain) or (first.chosen, first.tokens, first.add.args[0], first.gate.args[0]) \
            != (other.chosen, other.tokens, other.add.args[0], other.gate.args[0]):
        return f"expert {other.expert}'s pass computes other ops, or reads other tokens, routing or output"
    same = {other.gathered: first.gathered, other.gate: first.gate, **dict(zip(other.chain, first.chain))}
    for mine, theirs in zip(other.chain, first.chain):
        mapped = fx.node.map_arg((mine.args, mine.kwargs), lambda n: same.get(n, "weight" if _is_weight(mine, n) else n))
        expected = fx.node.map_arg((theirs.args, theirs.kwargs), lambda n: "weight" if _is_weight(theirs, n) else n)
        if mine.target != theirs.target or mapped != expected:
            return f"expert {other.expert}'s {mine.name} is not expert {first.expert}'s {theirs.name}"
        if op_kind(mine) == "linear" and \
                _value(arguments(mine)["weight"]).shape != _value(arguments(theirs)["weight"]).shape:
            return f"expert {other.expert}'s {mine.name} has a weight of another shape"
    return None


def _loops(gm: fx.GraphModule) -> dict[fx.Node, list[fx.Node]]:
    """The ``torch.where`` of each expert's pass, by the experts' choice (``chosen``) they read."""
    loops = {}
    for node in gm.graph.nodes:
        if node.target is torch.where and _expert_of(node) is not None:
            loops.setdefault(_expert_of(node)[0], []).append(node)
    return loops


def _refuse(where: fx.Node, why: str):
    return NotSupported(
        f"capture: the loop over experts whose first pass is {where.name} (torch.where of a one-hot of the chosen "
        f"experts) cannot be read as experts a row at a time: {why}. Compile without Dynamo's "
        f"capture_dynamic_output_shape_ops: the loop then runs whole on every rank, between the planned graphs")


def loop_of_experts_as_rows(gm: fx.GraphModule) -> fx.GraphModule:
    """Rewrite each loop over experts (see the module's docstring) into the experts read a row at
    a time; a loop that cannot be read so is refused, saying why."""
    for wheres in _loops(gm).values():
        experts, order = _expert_of(wheres[0])[2], {n: i for i, n in enumerate(gm.graph.nodes)}
        passes = [_read_iteration(w, order) for w in wheres]
        why = next((p for p in passes if isinstance(p, str)), None)
        if why is None and sorted(p.expert for p in passes) != list(range(experts)):
            why = f"it passes experts {sorted(p.expert for p in passes)} of {experts}, not each once"
        why = why or next(filter(None, (_same_pass(passes[0], p) for p in passes[1:])), None)
        if why is not None:
            raise _refuse(wheres[0], why)
        _as_rows(gm, passes, order)
    gm.graph.lint()
    gm.recompile()
    return gm


def _as_rows(gm: fx.GraphModule, passes: list[_Iteration], order: dict[fx.Node, int]) -> None:
    """Each expert's pass made one pass over every token's top-k rows (the module's docstring)."""
    first, graph = min(passes, key=lambda p: p.expert), gm.graph
    start = min((p.where for p in passes), key=order.get)
    out, chosen, tokens = first.add.args[0], _value(first.chosen), _value(first.tokens)
    if any(order[n] > order[start] for n in (out, first.tokens, first.gate.args[0], first.chosen)):
        raise _refuse(start, "its tokens, routing weights or output are made inside the loop")
    adds = {p.add for p in passes}
    last = max(adds, key=order.get)
    between = [u.name for u in out.users if order[start] < order[u] < order[last] and u not in adds]
    if between:
        raise _refuse(start, f"{between} read its output between the experts' passes")
    shapes = [tuple(t.shape) for t in (chosen, _value(first.gate.args[0]), tokens, _value(out))]
    if chosen.ndim != 2 or tokens.ndim != 2 or shapes[1] != shapes[0] or shapes[3] != shapes[2] \
            or shapes[2][0] != shapes[0][0]:
        raise _refuse(start, f"its choice, routing weights, tokens and output are {shapes}, not [tokens, top-k] "
                             f"twice and [tokens, features] twice")
    k, hidden = chosen.shape[1], tokens.shape[1]
    if not isinstance(k, int) or not isinstance(hidden, int):
        raise _refuse(start, f"its top-k {k} or its tokens' width {hidden} is symbolic")
    weights = {p.expert: [arguments(n)["weight"] for n in p.chain if op_kind(n) == "linear"] for p in passes}
    with graph.inserting_before(start):
        stacked = [graph.call_function(torch.stack, ([weights[e][i] for e in range(len(passes))],))
                   for i in range(len(weights[0]))]  # first: canonicalize reads them from before the loop
        rows = graph.call_method("repeat_interleave", (first.tokens, k), {"dim": 0})
        gathered = rows
        if isinstance(first.gathered.args[1], tuple) and first.gathered.args[1][0] is None:
            gathered = graph.call_method("unsqueeze", (rows, 0))  # tokens[None, token]
        ids = graph.call_method("reshape", (first.chosen, -1))
        gate = graph.call_method("reshape", (first.gate.args[0], -1))
        for _ in first.gate.args[1][2:]:
            gate = graph.call_method("unsqueeze", (gate, -1))
        made = {first.gathered: gathered, first.gate: gate}
        linears = iter(stacked)
        for node in first.chain:
            if gathered is not rows and made.get(arguments(node).get("input")) is gathered \
                    and op_kind(node) == "view" and _value(node).ndim == 2:
                made[node] = rows  # tokens[None, token].reshape(-1, hidden): the rows themselves
            elif op_kind(node) == "linear":
                picked = graph.call_function(operator.getitem, (next(linears), ids))
                column = graph.call_method("unsqueeze", (made[arguments(node)["input"]], -1))
                made[node] = graph.call_method("squeeze", (graph.call_function(torch.bmm, (picked, column)), -1))
            else:
                made[node] = graph.node_copy(node, lambda n: made.get(n, n))
                made[node].meta.pop("example_value", None)  # its sizes were the values' own
        added = made[first.add.args[3]]
        per_token = graph.call_method("sum", (graph.call_method("view", (added, -1, k, hidden)),), {"dim": 1})
        total = graph.call_function(operator.add, (out, per_token))
    for user in [u for u in out.users if order.get(u, -1) > order[last]]:  # what reads the sums made
        user.replace_input_with(out, total)
    for node in sorted(set().union(*(p.nodes for p in passes)), key=order.get, reverse=True):
        graph.erase_node(node)
    if not gathered.users:
        graph.erase_node(gathered)
