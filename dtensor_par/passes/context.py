"""State that the passes hand one another for one captured graph."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.fx as fx

from ..logs import logger
from ..mesh import MeshInfo
from ..ops.lowerings import FUNCTIONAL
from ..placements import Placement, describe
from ..symbolic import guards_at

if TYPE_CHECKING:
    from ..symbolic import Specialization
    from .coverage import Coverage


@dataclass
class ParallelConfig:
    """What the user asked for in ``hybrid_parallel``."""

    mesh: MeshInfo
    sequence_parallel: bool = False
    output: str = "full"  # "full": gathered tensors; "local": local shards as DTensors
    dump_dir: str | None = None  # where each pass writes its graph, if set
    parallelized: bool = False  # parameters are DTensor shards (dtensor_par.parallelize), not full tensors
    collectives: str = "auto"  # the lowering: "auto", "functional" or "xla" (passes.lower)
    ulysses_impl: str = "all_to_all"  # Ulysses' exchange: "all_to_all" or "all_gather" (ops.attention)
    replica_group_limit: int = 12  # distinct replica-group sets a Neuron program may use
    grad_bucket_mb: float = 25.0  # size of the flat buckets that inputs' partial gradients are reduced in
    cache_limit: int = 8  # plans (specializations) one captured graph keeps (runtime.ParallelRuntime)


@dataclass
class ParamInfo:
    fqn: str
    index: int  # position among the graph's inputs
    tensor: torch.Tensor


@dataclass
class ParallelContext:
    config: ParallelConfig
    example_inputs: list
    params: dict[str, ParamInfo] = field(default_factory=dict)  # placeholder name -> parameter
    sites: list = field(default_factory=list)  # AttentionSite | MLPSite, from detect
    param_placements: dict[str, Placement] = field(default_factory=dict)  # placeholder name -> tp placement
    output_placements: list[dict[str, Placement] | None] = field(default_factory=list)  # per output, by dim
    warnings: list[str] = field(default_factory=list)
    coverage: Coverage | None = None  # from plan_pass
    comm: str = FUNCTIONAL  # the lowering lower_pass picked
    replica_group_sets: dict[str, tuple] = field(default_factory=dict)  # from lower_pass
    specialization: Specialization | None = None  # a symbolic plan's guards (symbolic.py); None: static sizes
    fake_inputs: list | None = None  # the inputs a symbolic plan is made on: sizes are symbols

    @property
    def mesh(self) -> MeshInfo:
        return self.config.mesh

    def warn(self, message: str) -> None:
        if message not in self.warnings:
            self.warnings.append(message)
            logger.warning(message)


@dataclass(frozen=True)
class Communication:
    """What one inserted op communicates, for dumps and reports."""

    forward: str | None  # collective issued in the forward, if any
    backward: str | None  # collective its backward issues, if any
    mesh_dim: str
    group_size: int
    forward_bytes: int  # bytes this rank puts into the forward collective
    backward_bytes: int  # bytes of the gradient this rank puts into the backward collective
    site: str | None  # the site whose plan needs it


class PlanningError(RuntimeError):
    """A pass could not handle one node. Names the node, its op, input shapes and placements."""


USER_ERRORS = (ValueError, NotImplementedError, TypeError, ImportError, PlanningError)
"""Errors the passes raise on purpose, each with a message for the user; anything else is a
defect of ours and becomes a PlanningError naming where it happened."""


def _described(node: fx.Node) -> str:
    """``name [shape] (tp: S(0), cp: R)``: a node's value and its planned placements."""
    value = node.meta.get("val")
    shape = str(list(value.shape)) if isinstance(value, torch.Tensor) else type(value).__name__
    placements = ", ".join(f"{d}: {describe(s.out)}" for d, s in node.meta.get("dtensor_par", {}).items())
    return f"{node.name} {shape}" + (f" ({placements})" if placements else "")


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
            f"{pass_name}: cannot handle node {_described(node)} = {getattr(node.target, '__name__', node.target)}"
            f"({inputs}): {type(e).__name__}: {e}. This is a dtensor_par bug: please report it with this message, "
            f"or set DTENSOR_PAR_DUMP=DIR to see the graph") from e
