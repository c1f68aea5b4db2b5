"""Graph edits the passes share: a node inserted with the metadata capture gives every node
(``with_val``, ``emitted``), and a node erased with every input it leaves unread
(``erase_unused``)."""

from __future__ import annotations

import torch.fx as fx

from .nodes import acts_beyond_value, value_from_inputs


def with_val(node: fx.Node, value) -> fx.Node:
    """Give a node a later pass inserts the metadata capture gives every node."""
    node.meta["val"] = value
    node.meta["requires_grad"] = any(i.meta["requires_grad"] for i in node.all_input_nodes)
    return node


def emitted(graph: fx.Graph, fn, *args, **kwargs) -> fx.Node:
    """``fn(*args, **kwargs)`` inserted at the graph's cursor, its value computed from its inputs'."""
    node = graph.call_function(fn, args, kwargs)
    return with_val(node, value_from_inputs(node))


def erase_unused(gm: fx.GraphModule, node: fx.Node) -> None:
    """Erase ``node`` if nothing reads it, then every input it leaves without readers (a dead
    mask subgraph, a repeat-kv no attention reads any more)."""
    stack, erased = [node], set()
    while stack:
        n = stack.pop()
        if n in erased or n.users or n.op not in ("call_function", "call_method") or n.is_impure() \
                or acts_beyond_value(n):
            continue
        inputs = n.all_input_nodes
        gm.graph.erase_node(n)
        erased.add(n)
        stack.extend(inputs)
