"""expert_loop: a loop over an ``nn.ModuleList`` of experts, captured in one graph, becomes the experts read a row at a time (transformers' ``batched_mm`` layout), which
``canonicalize`` makes the grouped chain that tp and expert parallelism shard.

Under Dynamo's ``capture_dynamic_output_shape_ops`` such a loop (Mixtral's before transformers
4.57, ``dtensor_par._testing.patterns.LoopedExperts``) unrolls to one iteration per expert ``e``::

    slot, token = torch.where(one_hot(chosen, E).permute(2, 1, 0)[e])  # a size the values make
    y = expert_e(tokens[token]) * weights[token, slot, None]
    out.index_add_(0, token, y)

Every (token, slot) pair reaches exactly one expert, the one ``chosen[token, slot]`` names. So
the iterations together compute, for row ``token * k + slot`` of
``tokens.repeat_interleave(k, dim=0)``, the chain of its expert, with the experts' weights
stacked ``[E, out, in]`` and read by ``chosen.reshape(-1)``; and ``out`` gains each token's
rows summed over its k slots. Each row's products are the same; only the order in which a
token's k rows are added differs (none for top-2). No size then depends on values.

A loop over rows already repeated k times (DeepSeek's reference MoE in training, which HiDream
copies) picks each expert's rows by a mask and writes them back in place::

    rows = tokens.repeat_interleave(k, dim=0); out = torch.empty_like(rows); ids = chosen.view(-1)
    out[ids == e] = expert_e(rows[ids == e])

Every row is written by exactly one expert, the one ``ids`` names, when ``ids`` are a ``topk``'s
indices over E experts and the loop passes each of the E once: ``out`` is then the chain of each
row's expert, with nothing added and no size made by values.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from ..errors import NotSupported
from .context import ParallelContext
from .detect.experts import is_topk
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
    why = _chain_problem(chain, nodes)
    if why is not None:
        return why
    return _Iteration(expert, where, chosen, gathered[0].args[0], gathered[0], gates[0], add, chain, nodes)


def _chain_problem(chain: list[fx.Node], nodes: set[fx.Node]) -> str | None:
    """Why an expert's ``chain`` (in its pass's ``nodes``) is not computed row by row from its
    rows and its own weights alone, or None."""
    for node in chain:
        if op_kind(node) not in _CHAIN_KINDS:
            return f"{node.name} ({node.target}) between its tokens and the rows it gives back is not computed row by row"
        outside = [i for i in node.all_input_nodes if i not in nodes and not _is_weight(node, i)]
        if outside:
            return f"{node.name} reads {[i.name for i in outside]}, from outside the expert's pass"
        if op_kind(node) == "linear" and arguments(node).get("bias") is not None:
            return f"{node.name}: an expert's linear with a bias"
        if op_kind(node) == "linear" and _value(arguments(node)["input"]).ndim != 2:
            return f"{node.name}: an expert's linear of rows {list(_value(arguments(node)['input']).shape)}, not 2-d"
    if any(u not in nodes for n in nodes for u in n.users):
        return "a node of it is read after the loop"
    return None


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
    if (first.chosen, first.tokens, first.add.args[0], first.gate.args[0]) \
            != (other.chosen, other.tokens, other.add.args[0], other.gate.args[0]):
        return f"expert {other.expert}'s pass reads other tokens, routing or output"
    return _same_chain(first.expert, first.chain, other.expert, other.chain,
                       {other.gathered: first.gathered, other.gate: first.gate})


def _same_chain(expert: int, chain: list[fx.Node], other: int, other_chain: list[fx.Node],
                same: dict[fx.Node, fx.Node]) -> str | None:
    """Why expert ``other``'s chain does not compute what ``expert``'s does with its own weights
    (``same``: its inputs, each mapped to ``expert``'s), or None."""
    if len(chain) != len(other_chain):
        return f"expert {other}'s pass computes other ops"
    same = {**same, **dict(zip(other_chain, chain))}
    for mine, theirs in zip(other_chain, chain):
        mapped = fx.node.map_arg((mine.args, mine.kwargs), lambda n: same.get(n, "weight" if _is_weight(mine, n) else n))
        expected = fx.node.map_arg((theirs.args, theirs.kwargs), lambda n: "weight" if _is_weight(theirs, n) else n)
        if mine.target != theirs.target or mapped != expected:
            return f"expert {other}'s {mine.name} is not expert {expert}'s {theirs.name}"
        if op_kind(mine) == "linear" and \
                _value(arguments(mine)["weight"]).shape != _value(arguments(theirs)["weight"]).shape:
            return f"expert {other}'s {mine.name} has a weight of another shape"
    return None


def _loops(gm: fx.GraphModule) -> dict[fx.Node, list[fx.Node]]:
    """The ``torch.where`` of each expert's pass, by the experts' choice (``chosen``) they read."""
    loops = {}
    for node in gm.graph.nodes:
        if node.target is torch.where and _expert_of(node) is not None:
            loops.setdefault(_expert_of(node)[0], []).append(node)
    return loops


def _refuse(first: fx.Node, why: str):
    spelled = "rows[ids == e]" if first.target is operator.getitem else "torch.where of a one-hot of the chosen experts"
    return NotSupported(
        f"capture: the loop over experts whose first pass is {first.name} ({spelled}) cannot be read as experts a "
        f"row at a time: {why}. Compile without Dynamo's capture_dynamic_output_shape_ops: the loop then runs "
        f"whole on every rank, between the planned graphs")


def expert_loop_pass(gm: fx.GraphModule, ctx: ParallelContext) -> fx.GraphModule:
    """Rewrite each loop over experts (see the module's docstring) into the experts read a row at
    a time; a loop that cannot be read so is refused, saying why."""
    for wheres in _loops(gm).values():
        experts, order = _expert_of(wheres[0])[2], {n: i for i, n in enumerate(gm.graph.nodes)}
        passes = [_read_iteration(w, order) for w in wheres]
        why = next((p for p in passes if isinstance(p, str)), None)
        why = why or _not_each_once([p.expert for p in passes], experts)
        why = why or next(filter(None, (_same_pass(passes[0], p) for p in passes[1:])), None)
        if why is not None:
            raise _refuse(wheres[0], why)
        _as_rows(gm, passes, order)
    for picks in _masked_loops(gm).values():
        order = {n: i for i, n in enumerate(gm.graph.nodes)}
        passes = [_read_masked_pass(p, order) for p in picks]
        why = next((p for p in passes if isinstance(p, str)), None)
        why = why or _not_each_once([p.expert for p in passes], _topk_width(passes[0].ids))
        why = why or next(filter(None, (_same_masked_pass(passes[0], p) for p in passes[1:])), None)
        if why is not None:
            raise _refuse(min(picks, key=order.get), why)
        _masked_as_rows(gm, passes, order)
    gm.graph.lint()
    gm.recompile()
    return gm


def _not_each_once(experts: list[int], of: int | str) -> str | None:
    """Why a loop that passes ``experts`` does not pass each of ``of`` experts once (``of``: their
    number, or why it is not known), or None."""
    if isinstance(of, str):
        return of
    return None if sorted(experts) == list(range(of)) else f"it passes experts {sorted(experts)} of {of}, not each once"


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
    with graph.inserting_before(start):
        stacked = _stacked_weights(graph, {p.expert: p.chain for p in passes})
        rows = graph.call_method("repeat_interleave", (first.tokens, k), {"dim": 0})
        gathered = rows
        if isinstance(first.gathered.args[1], tuple) and first.gathered.args[1][0] is None:
            gathered = graph.call_method("unsqueeze", (rows, 0))  # tokens[None, token]
        ids = graph.call_method("reshape", (first.chosen, -1))
        gate = graph.call_method("reshape", (first.gate.args[0], -1))
        for _ in first.gate.args[1][2:]:
            gate = graph.call_method("unsqueeze", (gate, -1))
        made = {first.gathered: gathered, first.gate: gate}
        for node in first.chain:
            if gathered is not rows and arguments(node).get("input") is first.gathered \
                    and op_kind(node) == "view" and _value(node).ndim == 2:
                made[node] = rows  # tokens[None, token].reshape(-1, hidden): the rows themselves
        _chain_on_rows(graph, first.chain, made, ids, stacked)
        added = made[first.add.args[3]]
        per_token = graph.call_method("sum", (graph.call_method("view", (added, -1, k, hidden)),), {"dim": 1})
        total = graph.call_function(operator.add, (out, per_token))
    for user in [u for u in out.users if order.get(u, -1) > order[last]]:  # what reads the sums made
        user.replace_input_with(out, total)
    for node in sorted(set().union(*(p.nodes for p in passes)), key=order.get, reverse=True):
        graph.erase_node(node)
    if not gathered.users:
        graph.erase_node(gathered)


def _stacked_weights(graph: fx.Graph, chains: dict[int, list[fx.Node]]) -> list[fx.Node]:
    """Each of an expert's linears' weights stacked over the experts, in expert order (made
    first: canonicalize reads them from before the loop)."""
    weights = {e: [arguments(n)["weight"] for n in chain if op_kind(n) == "linear"] for e, chain in chains.items()}
    return [graph.call_function(torch.stack, ([weights[e][i] for e in range(len(chains))],))
            for i in range(len(weights[0]))]


def _chain_on_rows(graph: fx.Graph, chain: list[fx.Node], made: dict[fx.Node, fx.Node], ids: fx.Node,
                   stacked: list[fx.Node]) -> None:
    """Copy an expert's ``chain`` to run on every row, each linear's weight the row of its stack
    that ``ids`` picks (transformers' ``batched_mm``); ``made`` maps each node to its copy, and
    nodes already in it are not copied."""
    linears = iter(stacked)
    for node in chain:
        if node in made:
            continue
        if op_kind(node) == "linear":
            picked = graph.call_function(operator.getitem, (next(linears), ids))
            column = graph.call_method("unsqueeze", (made[arguments(node)["input"]], -1))
            made[node] = graph.call_method("squeeze", (graph.call_function(torch.bmm, (picked, column)), -1))
        else:
            made[node] = graph.node_copy(node, lambda n: made.get(n, n))
            made[node].meta.pop("example_value", None)  # its sizes were the values' own


@dataclass
class _MaskedPass:
    """One expert's pass of a loop that picks its rows by a mask (the module's docstring)."""

    expert: int
    ids: fx.Node
    rows: fx.Node
    gathered: fx.Node  # rows[ids == e]
    put: fx.Node  # out[ids == e] = chain[-1]
    chain: list[fx.Node]  # from ``gathered`` to the rows put back, in graph order
    nodes: set[fx.Node]  # every node of the pass, its two masks and Dynamo's size checks too


def _mask_of(node) -> tuple[fx.Node, int] | None:
    """``(ids, e)`` when ``node`` is ``ids == e``."""
    if not isinstance(node, fx.Node) or len(node.args) != 2 or node.kwargs or not (
            node.target in (operator.eq, torch.eq) or (node.op == "call_method" and node.target == "eq")):
        return None
    ids, expert = node.args
    return (ids, expert) if isinstance(ids, fx.Node) and type(expert) is int else None


def _masked_loops(gm: fx.GraphModule) -> dict[tuple[fx.Node, fx.Node], list[fx.Node]]:
    """Each expert's ``rows[ids == e]`` (rows a linear reads), by the rows and ids they read."""
    loops = {}
    for node in gm.graph.nodes:
        if node.target is operator.getitem and len(node.args) == 2 and _mask_of(node.args[1]) is not None \
                and any(op_kind(n) == "linear" for n in _descendants(node)):
            loops.setdefault((node.args[0], _mask_of(node.args[1])[0]), []).append(node)
    return loops


def _read_masked_pass(gathered: fx.Node, order: dict[fx.Node, int]) -> _MaskedPass | str:
    """The pass ``gathered`` (``rows[ids == e]``) starts, or why it is not one expert's pass
    (``order``: each node's position in the graph)."""
    (ids, expert), nodes = _mask_of(gathered.args[1]), _descendants(gathered)
    puts = [n for n in nodes if n.target is operator.setitem]
    if len(puts) != 1 or _mask_of(puts[0].args[1]) != (ids, expert):
        return f"{gathered.name}'s rows are put back {len(puts)} times, not once by the same mask"
    put = puts[0]
    chain = [n for n in nodes - {gathered, put} if isinstance(_value(n), torch.Tensor)]
    checks = nodes - set(chain) - {gathered, put}
    if any(isinstance(_value(u), torch.Tensor) for n in checks for u in n.users):
        return f"{gathered.name} gives a size the values make to a tensor"
    chain.sort(key=order.get)
    if not chain or put.args[2] is not chain[-1]:
        return f"{put.name} puts back {put.args[2]}, not the last node computed from {gathered.name}"
    nodes |= {gathered.args[1], put.args[1]}
    return _chain_problem(chain, nodes) or _MaskedPass(expert, ids, gathered.args[0], gathered, put, chain, nodes)


def _same_masked_pass(first: _MaskedPass, other: _MaskedPass) -> str | None:
    if other.put.args[0] is not first.put.args[0]:
        return f"expert {other.expert}'s pass puts its rows in {other.put.args[0].name}, not {first.put.args[0].name}"
    return _same_chain(first.expert, first.chain, other.expert, other.chain, {other.gathered: first.gathered})


def _topk_width(ids: fx.Node) -> int | str:
    """How many experts ``ids`` (``topk``'s indices, viewed) chooses among, or why that is not known."""
    node = ids
    while op_kind(node) == "view":
        node = arguments(node)["input"]
    if node.target is not operator.getitem or node.args[1] != 1 or not is_topk(node.args[0]):
        return f"its expert ids {ids.name} are not a topk's indices, so a row may be put back by no expert"
    given = arguments(node.args[0])
    return _value(given["input"]).shape[given.get("dim", -1)]


def _masked_as_rows(gm: fx.GraphModule, passes: list[_MaskedPass], order: dict[fx.Node, int]) -> None:
    """Each expert's pass made one pass over every row (the module's docstring)."""
    first, graph = min(passes, key=lambda p: p.expert), gm.graph
    start = min((n for p in passes for n in p.nodes), key=order.get)
    out, last = first.put.args[0], max((p.put for p in passes), key=order.get)
    if any(order[n] > order[start] for n in (out, first.rows, first.ids)):
        raise _refuse(start, "its rows, ids or output are made inside the loop")
    between = [u.name for u in out.users if order[start] < order[u] < order[last] and u.target is not operator.setitem]
    if between:
        raise _refuse(start, f"{between} read its output between the experts' passes")
    shapes = [tuple(_value(n).shape) for n in (first.rows, first.ids, out)]
    if len(shapes[0]) != 2 or shapes[1] != shapes[0][:1] or shapes[2][:1] != shapes[0][:1]:
        raise _refuse(start, f"its rows, ids and output are {shapes}, not [rows, features], [rows], [rows, ...]")
    with graph.inserting_before(start):
        made = {first.gathered: first.rows}
        _chain_on_rows(graph, first.chain, made, first.ids, _stacked_weights(graph, {p.expert: p.chain for p in passes}))
        result = made[first.chain[-1]]
        if _value(first.chain[-1]).dtype != _value(out).dtype:
            result = graph.call_method("to", (result, _value(out).dtype))  # as the put casts
    for user in [u for u in out.users if order.get(u, -1) > order[last]]:
        user.replace_input_with(out, result)
    for node in sorted(set().union(*(p.nodes for p in passes)), key=order.get, reverse=True):
        graph.erase_node(node)
    if not out.users:
        graph.erase_node(out)
