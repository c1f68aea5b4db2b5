"""The options of ``hybrid_parallel``, ``parallelize``, ``parallel``, ``explain`` and the CLI, declared once.

Each option is a field of ``ParallelConfig``: its default, its help text (the CLI's ``--help``
reads it) and whether it changes the plan (what ``parallelize`` shards, what ``explain``
reports). ``__post_init__`` checks every value, so each entry point refuses a bad option the
same way, under its own name (``ParallelConfig.of``).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Callable

import torch

from .mesh import FSDP_DIMS, MeshInfo
from .ops.attention import ULYSSES_IMPLS
from .ops.lowerings import FUNCTIONAL, LOWERINGS

OUTPUTS = ("full", "local")
EXPERT_PARALLEL = (None, "cp")
BATCHES = ("global", "local")
COLLECTIVES = ("auto", *LOWERINGS)
CHECKPOINT_POLICIES = (None, "full", "selective")


def resolve_collectives(choice: str, device_types: set[str]) -> str:
    """The lowering ``choice`` means for inputs on ``device_types``."""
    if choice != "auto":
        return choice
    return "xla" if "xla" in device_types else FUNCTIONAL


def _option(default, help: str, *, plan: bool = True, choices: tuple | None = None, factory=None):
    metadata = {"help": help, "plan": plan, "choices": choices}
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass(frozen=True)
class ParallelConfig:
    """Every option a user can set; ``ParallelConfig.plan_options()`` are those that change the plan."""

    batch: str = _option(
        "global", "with data-parallel mesh dims: 'global': every rank is given the whole batch, which the plan cuts "
                  "over dp_replicate x dp_shard (CFG parallelism: every rank gets the whole result); 'local': each "
                  "dp coordinate is given its own slice and gradients are averaged over dp (DDP, FSDP)",
        choices=BATCHES)
    fsdp_dims: tuple | None = _option(
        None, "with parallelize: the mesh dims each parameter is also sharded over, as FSDP (its tp piece cut "
              "along a dim tp does not cut), gathered in the graph at use and its gradient reduce-scattered "
              "(default: dp_shard, ring and ulysses, every one the mesh has; () for none)")
    reshard_after_forward: bool = _option(
        True, "with FSDP: free each gathered parameter after its last forward use and gather it again in "
              "backward (False: keep it from forward to backward)")
    param_dtype: torch.dtype | None = _option(
        None, "with parallelize, as FSDP2's MixedPrecisionPolicy: compute in this dtype (torch.bfloat16), the "
              "parameters held in theirs: each is cast at use (an FSDP gather sends it cast) and so are the "
              "floating inputs")
    reduce_dtype: torch.dtype | None = _option(
        None, "with param_dtype: reduce the gradients in this dtype (torch.float32), or in param_dtype (default)")
    ep: str | None = _option(
        None, "expert parallelism: 'cp' cuts each mixture of experts' experts over the cp ranks (ring x ulysses), "
              "and the dp_shard ranks where the mesh has them, E / ep a rank, "
              "and sends each rank's tokens to their experts and back by uneven all-to-alls; None: "
              "every cp rank holds every expert (tp still cuts each expert's features)", choices=EXPERT_PARALLEL)
    activation_checkpointing: str | Callable | None = _option(
        None, "recompute activations in backward instead of keeping them, block by block (the numbered module "
              "that holds each attention or MLP site): 'full' keeps each block's input and recomputes every op, "
              "collectives included; 'selective' keeps the outputs of attention, collectives and matmuls but an "
              "MLP's up and gate projections, and recomputes the rest; or a callable policy(node) -> bool | "
              "CheckpointPolicy asked for each op of a block in the rank's graph (True: keep its output). None: as "
              "the model says (its own torch.utils.checkpoint regions recompute every op)")
    sequence_parallel: bool = _option(
        False, "Megatron sequence parallelism: norms, residuals and pointwise ops between sites run on sequence "
               "shards over tp; each all-reduce becomes reduce-scatter + all-gather")
    output: str = _option(
        "full", "'full': full tensors on every rank; 'local': this rank's shards as DTensors", choices=OUTPUTS)
    collectives: str = _option(
        "auto", "how collectives are lowered: 'functional' (NCCL, gloo, TorchNeuron), 'xla' (torch_xla xm calls "
                "with full replica groups) or 'auto' (xla for inputs on an xla device)", choices=COLLECTIVES)
    ulysses_impl: str = _option(
        "all_to_all", "Ulysses' exchange: 'all_to_all', or 'all_gather' for stacks whose all-to-all does not "
                      "compile", choices=ULYSSES_IMPLS)
    replica_group_limit: int = _option(
        12, "the most distinct replica-group sets a Neuron program may use (12 before runtime 2.32)")
    grad_bucket_mb: float = _option(
        25.0, "parameters' partial gradients are all-reduced in flat buckets of this many MB, each issued in "
              "backward as soon as its last gradient exists (0: one all-reduce per gradient)")
    dump_dir: str | None = _option(
        None, "write each pass's graph, the collectives, plan.json and mesh.svg here (default: $DTENSOR_PAR_DUMP)",
        plan=False, factory=lambda: os.environ.get("DTENSOR_PAR_DUMP") or None)
    inner_backend: str | Callable = _option(
        "inductor", "what compiles each rank's graph: 'inductor', 'aot_eager', 'eager' or a backend callable",
        plan=False)
    plan_cache: bool = _option(
        True, "keep each rank's plans on disk next to inductor's caches, so a job run again skips planning "
              "(default: $DTENSOR_PAR_PLAN_CACHE, 0 for off)",
        plan=False, factory=lambda: os.environ.get("DTENSOR_PAR_PLAN_CACHE", "1") != "0")
    cache_limit: int = _option(
        8, "plans kept per captured graph (sizes or dtypes a plan does not serve); least recently used dropped",
        plan=False)

    check_inputs: bool = _option(
        True, "at the first call of each plan, check that every rank was given the same inputs (a fingerprint "
              "exchanged over the world), so different inputs are an error, not a different wrong result per rank",
        plan=False)

    def __post_init__(self):
        for f in dataclasses.fields(self):
            choices, value = f.metadata["choices"], getattr(self, f.name)
            if choices is not None and value not in choices:
                raise ValueError(f"{f.name} must be one of {choices}, got {value!r}")
        if self.fsdp_dims is not None:
            if not isinstance(self.fsdp_dims, (tuple, list)) or any(n not in FSDP_DIMS for n in self.fsdp_dims):
                raise ValueError(f"fsdp_dims must be a tuple of names from {FSDP_DIMS}, got {self.fsdp_dims!r}")
            object.__setattr__(self, "fsdp_dims", tuple(self.fsdp_dims))
        for name in ("param_dtype", "reduce_dtype"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, torch.dtype) and value.is_floating_point):
                raise TypeError(f"{name} must be a floating torch.dtype, got {value!r}")
        if self.reduce_dtype is not None and self.param_dtype is None:
            raise ValueError(f"reduce_dtype={self.reduce_dtype} needs param_dtype: without it gradients are "
                             f"reduced in the parameters' own dtype")
        for name in ("sequence_parallel", "plan_cache", "check_inputs", "reshard_after_forward"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        for name in ("replica_group_limit", "cache_limit"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if not isinstance(self.grad_bucket_mb, (int, float)) or not self.grad_bucket_mb >= 0:
            raise ValueError(f"grad_bucket_mb must be a number >= 0 (0: one all-reduce per gradient), "
                             f"got {self.grad_bucket_mb!r}")
        if not (self.activation_checkpointing in CHECKPOINT_POLICIES or callable(self.activation_checkpointing)):
            raise ValueError(f"activation_checkpointing must be one of {CHECKPOINT_POLICIES} or a callable "
                             f"policy(node) -> bool | CheckpointPolicy, got {self.activation_checkpointing!r}")
        if not (isinstance(self.inner_backend, str) or callable(self.inner_backend)):
            raise TypeError(f"inner_backend must be a backend name or callable, got {self.inner_backend!r}")

    @classmethod
    def of(cls, entry: str, options: dict) -> ParallelConfig:
        """The config for ``options`` given to the entry point ``entry``; errors name that entry point."""
        unknown = sorted(set(options) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise TypeError(f"{entry}: unknown options {unknown}; the options are "
                            f"{[f.name for f in dataclasses.fields(cls)]}")
        try:
            return cls(**options)
        except (TypeError, ValueError) as e:
            raise type(e)(f"{entry}: {e}") from None

    @classmethod
    def plan_options(cls) -> list[dataclasses.Field]:
        return [f for f in dataclasses.fields(cls) if f.metadata["plan"]]

    def plan_key(self) -> tuple:
        """The values of the options that change the plan."""
        return tuple(getattr(self, f.name) for f in self.plan_options())

    def check_mesh(self, mesh: MeshInfo, entry: str) -> None:
        """Options that the mesh rules out."""
        try:
            mesh.fsdp(self.fsdp_dims)
        except (ValueError, NotImplementedError) as e:
            raise type(e)(f"{entry}: {e}") from None
        if self.sequence_parallel and mesh.size("cp") > 1:
            raise NotImplementedError(
                f"{entry}: sequence_parallel=True with context parallelism (ring={mesh.size('ring')}, "
                f"ulysses={mesh.size('ulysses')}) is not implemented: both would shard the sequence")
