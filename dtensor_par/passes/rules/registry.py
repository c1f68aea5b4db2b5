"""The op registry: every op the planner knows, one entry per op kind.

Dynamo keeps the user's spelling (``x.view``, ``torch.reshape``, ``operator.add``,
``torch._C._nn.linear``). Each family module of this package (``pointwise``, ``views``,
``indexing``, ``matmul``, ``reductions``, ``routing``, ``attention``) registers, for each kind
of op, its spellings, its placement rule and, when the op needs it, how localize rewrites it
for one rank (size arguments into local sizes; an op over a sharded dim into its distributed form):
adding an op is one ``register`` call in its family's module.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch.fx as fx

if TYPE_CHECKING:
    from ...mesh import MeshInfo
    from ..meta import NodeSharding
    from .core import RuleEnv

Rule = Callable[[fx.Node, list, list, "RuleEnv"], "NodeSharding"]
Localize = Callable[[fx.GraphModule, fx.Node, "MeshInfo"], None]

FAMILIES = ("pointwise", "views", "indexing", "matmul", "reductions", "routing", "attention")


@dataclass(frozen=True)
class OpKind:
    """One kind of op: the spellings that mean it, and what the planner does with it."""

    name: str
    family: str
    rule: Rule  # (node, tensor inputs, their placements, env) -> NodeSharding on one mesh dim
    localize: Localize | None  # rewrites the node for this rank: local sizes, or a distributed form


_KINDS: dict[str, OpKind] = {}
_BY_FUNCTION: dict[object, OpKind] = {}
_BY_METHOD: dict[str, OpKind] = {}
_BY_OP_NAME: dict[str, OpKind] = {}


def register(name: str, family: str, rule: Rule, *, functions=(), methods=(), custom_ops=(),
             localize: Localize | None = None) -> None:
    """Declare an op kind: ``functions`` are ``call_function`` targets, ``methods`` Tensor
    method names (aliases, such as ``F.linear`` and ``torch._C._nn.linear``, may repeat),
    ``custom_ops`` the qualified names of custom ops another library registers
    (``transformers::grouped_mm_fallback``: known without importing it). A spelling claimed by
    two kinds is a bug of the registry, refused here."""
    if family not in FAMILIES or name in _KINDS:
        raise ValueError(f"op registry: {name!r} of family {family!r} is registered twice or names no family")
    kind = _KINDS[name] = OpKind(name, family, rule, localize)
    for table, spellings in ((_BY_FUNCTION, functions), (_BY_METHOD, methods), (_BY_OP_NAME, custom_ops)):
        for spelling in spellings:
            if spelling in table and table[spelling].name != name:
                raise ValueError(f"op registry: {spelling!r} is both {table[spelling].name!r} and {name!r}")
            table[spelling] = kind


def lookup(node: fx.Node) -> OpKind | None:
    if node.op == "call_function":
        packet = getattr(node.target, "overloadpacket", node.target)  # an OpOverload's packet
        return _BY_FUNCTION.get(node.target) or _BY_OP_NAME.get(getattr(packet, "_qualified_op_name", None))
    if node.op == "call_method":
        return _BY_METHOD.get(node.target)
    return None


def op_kind(node: fx.Node) -> str | None:
    """The kind of op a node is (``"view"`` for ``x.view``, ``torch.reshape``...), or None."""
    kind = lookup(node)
    return kind.name if kind else None


def kinds_in(*families: str) -> frozenset[str]:
    return frozenset(k.name for k in _KINDS.values() if k.family in families)
