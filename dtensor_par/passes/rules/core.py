"""What every rule shares: the rule's view of the mesh dim and the fallback that gathers. A
rule returns a ``meta.NodeSharding``, the node's planned placements on that mesh dim."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from ...mesh import PLAN
from ...placements import InterleavedShard, Partial, Placement, Replicate, Shard, is_padded, parts_of, shard_dim
from ..meta import NodeSharding, shardings
from ..nodes import tensor_val

R = Replicate()


@dataclass
class RuleEnv:
    """The plan dim a rule places a node on (``mesh.PLAN``): rules ask it what it cuts, not its name."""

    dim: str  # the plan dim planned: "tp", "cp" or "dp"
    size: int
    input_placements: dict[str, Placement]  # placeholder name -> placement (others Replicate)
    sequence_parallel: bool
    chunks_per_rank: int = 1  # 2 for cp's zigzag layout

    @property
    def cuts_features(self) -> bool:
        """Heads and hidden features (tp)."""
        return PLAN[self.dim].cuts == "features"

    @property
    def cuts_sequence(self) -> bool:
        return PLAN[self.dim].cuts == "sequence"

    @property
    def cuts_batch(self) -> bool:
        return PLAN[self.dim].cuts == "batch"

    @property
    def pads(self) -> bool:
        """Whether a shard here that does not divide is padded: an uneven sequence or batch;
        ``check_divisible`` refuses uneven feature shards."""
        return PLAN[self.dim].pads

    def padded(self, length: int) -> bool:
        """Whether a dim of this length is laid out padded when sharded here."""
        return self.pads and is_padded(length, self.size, self.chunks_per_rank)

    def out_of(self, node: fx.Node):
        return shardings(node)[self.dim].out

    def reduce_target(self, node: fx.Node) -> Placement:
        """Where a Partial goes when an op cannot take it: Replicate, or the sequence shard
        (the dim before the hidden dim) under Megatron sequence parallelism."""
        val = tensor_val(node)
        if self.sequence_parallel and val.dim() >= 2 and val.shape[-2] % self.size == 0:
            return Shard(val.dim() - 2)
        return R


def moved(p: Placement, dim: int) -> Placement:
    """The same kind of shard (parts included) along another dim."""
    return InterleavedShard(dim, p.parts) if isinstance(p, InterleavedShard) else Shard(dim)


def norm_dim(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


def replicate_all(node: fx.Node, ins: list[fx.Node], cur: list[Placement], why: str | None = None) -> NodeSharding:
    out = tuple(R for _ in node.meta["val"]) if isinstance(node.meta.get("val"), (tuple, list)) else R
    gathered = any(p != R for p in cur)
    return NodeSharding(out, tuple(R for _ in ins), (why or "no sharding rule") if gathered else None)


def resolve_partial(ins, cur, env: RuleEnv) -> list[Placement]:
    return [env.reduce_target(i) if isinstance(p, Partial) else p for i, p in zip(ins, cur)]


def _fits(p: Placement, val: torch.Tensor, env: RuleEnv) -> bool:
    d = shard_dim(p)
    if d is None or (env.pads and isinstance(p, Shard)):
        return True  # cp pads a sequence that does not divide, dp a batch
    if env.pads:  # the parts of a joint sequence: each laid out unpadded
        return not any(env.padded(part) for part in p.parts)
    return all(part % env.size == 0 for part in parts_of(p, val.shape[d]))


def check_divisible(node: fx.Node, ins: list[fx.Node], sharding: NodeSharding, env: RuleEnv) -> str | None:
    """Why a planned placement cannot be laid out evenly, if it cannot."""
    outs = sharding.out if isinstance(sharding.out, tuple) else (sharding.out,)
    vals = node.meta["val"] if isinstance(node.meta.get("val"), (tuple, list)) else (node.meta.get("val"),)
    for p, val in list(zip(outs, vals)) + list(zip(sharding.inputs, (tensor_val(i) for i in ins))):
        if isinstance(val, torch.Tensor) and shard_dim(p) is not None and shard_dim(p) >= val.dim():
            return f"{p} of a tensor of shape {list(val.shape)} names no dim of it"
        if isinstance(val, torch.Tensor) and not _fits(p, val, env):
            return f"{p} of a tensor of shape {list(val.shape)} does not divide by {env.size}"
    return None


def replaced_by(gm: fx.GraphModule, node: fx.Node, op: str, target, args: tuple, kwargs: dict | None = None) -> fx.Node:
    """``node`` replaced, for every reader, by a call of ``target`` inserted where it was, which
    keeps its meta: what localize writes in place of an op that runs otherwise on a rank's shard."""
    with gm.graph.inserting_before(node):
        new = gm.graph.create_node(op, target, args, kwargs or {})
    new.meta = node.meta
    node.replace_all_uses_with(new)
    gm.graph.erase_node(node)
    return new
