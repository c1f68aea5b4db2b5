"""State that the passes hand one another for one captured graph."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.fx as fx

from ..config import resolve_collectives
from ..errors import USER_ERRORS, PlanningError
from ..logs import logger
from ..mesh import MeshInfo
from ..params import WHOLE, WholeParameters
from ..placements import Placement, describe
from ..symbolic import guards_at
from .meta import placements
from .nodes import target_name

if TYPE_CHECKING:
    from ..config import ParallelConfig
    from ..symbolic import Specialization


@dataclass
class ParamInfo:
    fqn: str
    index: int  # position among the graph's inputs
    tensor: torch.Tensor


@dataclass
class ParallelContext:
    config: ParallelConfig
    mesh: MeshInfo
    example_inputs: list
    feeding: WholeParameters = WHOLE  # how the runtime feeds parameters (params.py): whole, or DTensor shards
    params: dict[str, ParamInfo] = field(default_factory=dict)  # placeholder name -> parameter
    sites: list = field(default_factory=list)  # AttentionSite | MoESite | MLPSite, from detect
    param_placements: dict[str, Placement] = field(default_factory=dict)  # placeholder name -> tp placement
    vocab_cuts: list[str] = field(default_factory=list)  # of param_placements: token tables and LM heads, by vocab
    expert_placements: dict[str, dict[str, Placement]] = field(default_factory=dict)  # with ep: name -> plan dim -> cut
    input_cuts: dict[str, dict[str, Placement]] = field(default_factory=dict)  # plan dim -> placeholder name -> its
    # cut, by the step that seeds the dim (``mesh.PlanDim.seeded_by``: cp's sequence, dp's batch)
    batch_sized_whole: list[str] = field(default_factory=list)  # inputs with the batch's size whole on dp: batch
    cache_inputs: dict[str, dict[str, Placement]] = field(default_factory=dict)  # kv cache stand-in -> its cut
    cache_outputs: tuple = ()  # kv_cache.CacheOutput per output the runtime holds as a cache shard
    positions_of: dict[str, str] = field(default_factory=dict)  # input added for a held cache's positions -> it
    sent_outputs: dict[int, int] = field(default_factory=dict)  # output index -> the dim it is returned cut
    # along over cp: what a pipeline stage sends as its pieces (``sequence_pieces``)
    decided_vocab_cuts: dict[str, Placement] | None = None  # a pipeline stage's: by FQN, the vocab cuts decided
    # on the whole graph (``plan.vocab_cuts``); None: decided on this graph
    output_placements: list[dict[str, Placement] | None] = field(default_factory=list)  # per output, by dim
    recompute_regions: list = field(default_factory=list)  # meta.RecomputeRegion, in order: recompute_pass
    warnings: list[str] = field(default_factory=list)
    held_warnings: list[str] | None = None  # while a plan is tried (plan_pass): its warnings, kept back
    coverage: Coverage | None = None  # measured once planned (coverage.coverage_pass)
    comm: str = field(init=False)  # the lowering: known from the config and the inputs' devices alone
    replica_group_sets: dict[str, tuple] = field(default_factory=dict)  # from lower_pass
    specialization: Specialization | None = None  # a symbolic plan's guards (symbolic.py); None: static sizes
    fake_inputs: list | None = None  # the inputs a symbolic plan is made on: sizes are symbols

    def __post_init__(self) -> None:
        """The lowering is resolved here, not in ``lower_pass``, so that every pass (localize counting
        what expert parallelism's padded exchanges send, ``choose_mesh`` which stops before lower)
        reads the one the graph will run with."""
        devices = {a.device.type for a in self.example_inputs if isinstance(a, torch.Tensor)}
        self.comm = resolve_collectives(self.config.collectives, devices)

    def warn(self, message: str) -> None:
        if self.held_warnings is not None:
            self.held_warnings.append(message)
        elif message not in self.warnings:
            self.warnings.append(message)
            logger.warning(message)


@dataclass
class Coverage:
    """How much of a planned graph runs split; ``passes.coverage`` measures it."""

    linear_flops: int = 0
    sharded_linear_flops: int = 0  # sharded on every planned mesh dim
    rank_linear_flops: int = 0  # each op's FLOPs over the ranks it is split over: one rank's share of the whole
    block_linear_flops: int = 0
    sharded_block_linear_flops: int = 0
    whole_block_linears: dict[str, int] = field(default_factory=dict)  # weight -> FLOPs, outside sites and whole
    parameters: int = 0  # elements
    sharded_parameters: int = 0
    fallback_gathers: list[str] = field(default_factory=list)  # "node (op) on dim: why"
    output_gathers: list[str] = field(default_factory=list)  # "node on dim: why": the outputs' gather, done early
    parallel_sites: int = 0
    ring_attention_flops: dict[str, list[int]] = field(default_factory=dict)  # site -> FLOPs per ring rank
    cache_bytes: int = 0  # of the kv cache the graph returns, on one device
    cache_bytes_per_rank: int = 0  # of it this rank holds (kv_cache.py)

    @staticmethod
    def share(part: int, whole: int) -> float:
        return part / whole if whole else 1.0

    def summary(self) -> str:
        blocks = (f"in blocks {self.share(self.sharded_block_linear_flops, self.block_linear_flops):.1%}"
                  if self.block_linear_flops else "no block linears")
        return (f"linear FLOPs sharded {self.share(self.sharded_linear_flops, self.linear_flops):.1%} "
                f"({blocks}; per rank {self.share(self.rank_linear_flops, self.linear_flops):.1%} of one device's), "
                f"parameters sharded {self.share(self.sharded_parameters, self.parameters):.1%}, "
                f"{len(self.fallback_gathers)} fallback gathers"
                + (f", kv cache held {self.cache_bytes_per_rank:,} of {self.cache_bytes:,} bytes per rank "
                   f"({self.share(self.cache_bytes_per_rank, self.cache_bytes):.1%})" if self.cache_bytes else ""))

    def as_dict(self) -> dict:
        return {"linear_flops": self.linear_flops, "sharded_linear_flops": self.sharded_linear_flops,
                "rank_linear_flops": self.rank_linear_flops,
                "block_linear_flops": self.block_linear_flops,
                "sharded_block_linear_flops": self.sharded_block_linear_flops,
                "whole_block_linears": dict(self.whole_block_linears),
                "parameters": self.parameters, "sharded_parameters": self.sharded_parameters,
                "fallback_gathers": list(self.fallback_gathers), "output_gathers": list(self.output_gathers),
                "parallel_sites": self.parallel_sites,
                "ring_attention_flops": dict(self.ring_attention_flops), "cache_bytes": self.cache_bytes,
                "cache_bytes_per_rank": self.cache_bytes_per_rank}


def _described(node: fx.Node) -> str:
    """``name [shape] (tp: S(0), cp: R)``: a node's value and its planned placements."""
    value = node.meta.get("val", node.meta.get("example_value"))  # Dynamo's, before capture has propagated
    shape = str(list(value.shape)) if isinstance(value, torch.Tensor) else type(value).__name__
    planned = ", ".join(f"{d}: {describe(p)}" for d, p in placements(node).items())
    return f"{node.name} {shape}" + (f" ({planned})" if planned else "")


@contextlib.contextmanager
def at_node(pass_name: str, node: fx.Node):
    """Turn an internal exception raised while a pass handles ``node`` into a PlanningError."""
    try:
        with guards_at(f"{pass_name} at {node.name}"):
            yield
    except USER_ERRORS:
        raise
    except Exception as e:
        inputs = "; ".join(_described(i) for i in node.all_input_nodes)
        raise PlanningError(
            f"{pass_name}: cannot handle node {_described(node)} = {target_name(node)}"
            f"({inputs}): {type(e).__name__}: {e}. This is a dtensor_par bug: please report it with this message, "
            f"or set DTENSOR_PAR_DUMP=DIR to see the graph") from e
