"""State that the passes hand one another for one captured graph."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..logs import logger
from ..mesh import MeshInfo
from ..ops.comm import FUNCTIONAL
from ..placements import Placement


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
    comm: str = FUNCTIONAL  # the lowering lower_pass picked
    replica_group_sets: dict[str, tuple] = field(default_factory=dict)  # from lower_pass

    @property
    def mesh(self) -> MeshInfo:
        return self.config.mesh

    def warn(self, message: str) -> None:
        if message not in self.warnings:
            self.warnings.append(message)
            logger.warning(message)
