"""Public entry points."""

from __future__ import annotations

import functools
import os
from typing import Callable

import torch
import torch.nn as nn
from torch._dynamo.backends.registry import lookup_backend
from torch.distributed.device_mesh import DeviceMesh

from .mesh import MeshInfo, init_mesh
from .ops.attention import ULYSSES_IMPLS
from .passes.capture import record_module_names
from .passes.context import ParallelConfig
from .passes.lower import COLLECTIVES
from .passes.overlap import overlapped_aot_eager
from .runtime import ParallelRuntime
from .sharded import parallelize

OUTPUT_MODES = ("full", "local")


INDUCTOR_OVERLAP = {"reorder_for_compute_comm_overlap": True,
                    "reorder_for_compute_comm_overlap_passes": ["raise_comms", "sink_waits"]}
"""Inductor's own form of ``passes.overlap``: each collective issued as early as its inputs
allow, each wait at its first reader."""


def _overlapped_inductor(gm: torch.fx.GraphModule, example_inputs):
    """Inductor with ``INDUCTOR_OVERLAP``, unless its comm/compute reordering is configured."""
    from torch._inductor.compile_fx import compile_fx

    configured = torch._inductor.config.reorder_for_compute_comm_overlap
    return compile_fx(gm, example_inputs, config_patches=None if configured else INDUCTOR_OVERLAP)


def resolve_backend(inner_backend: str | Callable) -> Callable:
    """The inner backend by name; ``"aot_eager"`` and ``"inductor"`` issue each collective as
    early as its inputs allow and wait for it at its first reader (``passes.overlap``)."""
    if inner_backend == "aot_eager":
        return overlapped_aot_eager
    if inner_backend == "inductor":
        return _overlapped_inductor
    return inner_backend if callable(inner_backend) else lookup_backend(inner_backend)


def check_options(info: MeshInfo, sequence_parallel: bool, collectives: str = "auto",
                  ulysses_impl: str = "all_to_all") -> None:
    for name, value, allowed in (("collectives", collectives, COLLECTIVES),
                                 ("ulysses_impl", ulysses_impl, ULYSSES_IMPLS)):
        if value not in allowed:
            raise ValueError(f"hybrid_parallel: {name} must be one of {allowed}, got {value!r}")
    if sequence_parallel and info.size("cp") > 1:
        raise NotImplementedError(
            f"hybrid_parallel: sequence_parallel=True with context parallelism (ring={info.size('ring')}, "
            f"ulysses={info.size('ulysses')}) is not implemented: both would shard the sequence")


def hybrid_parallel(mesh: DeviceMesh, *, inner_backend: str | Callable = "inductor", dump_dir: str | None = None,
                    output: str = "full", sequence_parallel: bool = False, collectives: str = "auto",
                    ulysses_impl: str = "all_to_all", replica_group_limit: int = 12,
                    grad_bucket_mb: float = 25.0, cache_limit: int = 8) -> Callable:
    """A ``torch.compile`` backend that runs the model tensor- and context-parallel over ``mesh``.

    Heads are sharded over tp; with ``ring`` or ``ulysses`` > 1, activations are sharded along
    the sequence over ring x ulysses and attention runs as Ulysses x ring hybrid attention.
    ``output="full"`` returns full tensors on every rank; ``"local"`` returns local shards as
    DTensors. ``sequence_parallel`` shards norms, residuals and pointwise ops between sites
    along the sequence over tp (Megatron-SP): reduce-scatter + all-gather instead of all-reduce.
    ``collectives``: how collectives are lowered (``passes.lower``): ``"functional"`` (NCCL, gloo,
    TorchNeuron), ``"xla"`` (torch_xla's xm calls with full replica groups) or ``"auto"``.
    ``ulysses_impl="all_gather"``: Ulysses without all-to-all, for stacks whose all-to-all does
    not compile. ``replica_group_limit``: distinct replica-group sets a Neuron program may use.
    ``grad_bucket_mb``: the partial gradients of parameters (replicated over a mesh dim, used
    rank-locally) are all-reduced in flat buckets of this size, each issued in backward as soon
    as its last gradient exists. ``inner_backend``: what compiles each rank's graph; with
    ``"inductor"`` and ``"aot_eager"`` each collective is issued as early as its inputs allow
    and waited for at its first reader, so it overlaps the compute that does not need it
    (``passes.overlap``; with inductor, its ``raise_comms`` and ``sink_waits`` passes unless
    ``torch._inductor.config.reorder_for_compute_comm_overlap`` is set).

    Sizes Dynamo made symbolic (``dynamic=True``, ``mark_dynamic``, or its automatic dynamic
    shapes at the second size) are planned and compiled once, for every size; ``dynamic=False``
    or ``mark_static`` keep a plan per size. ``cache_limit``: plans kept per captured graph
    (sizes or dtypes a plan does not serve), least recently used dropped beyond it; each new
    plan is logged at INFO with what triggered it (``dtensor_par.set_verbosity("info")``).
    """
    dump_dir = dump_dir or os.environ.get("DTENSOR_PAR_DUMP")
    if output not in OUTPUT_MODES:
        raise ValueError(f"hybrid_parallel: output must be one of {OUTPUT_MODES}, got {output!r}")
    if not isinstance(cache_limit, int) or cache_limit < 1:
        raise ValueError(f"hybrid_parallel: cache_limit must be a positive int, got {cache_limit!r}")
    info = MeshInfo.from_mesh(mesh)
    check_options(info, sequence_parallel, collectives, ulysses_impl)
    config = ParallelConfig(info, sequence_parallel=sequence_parallel, output=output, dump_dir=dump_dir,
                            collectives=collectives, ulysses_impl=ulysses_impl,
                            replica_group_limit=replica_group_limit, grad_bucket_mb=grad_bucket_mb,
                            cache_limit=cache_limit)
    inner = resolve_backend(inner_backend)

    def backend(gm, example_inputs):
        return ParallelRuntime(record_module_names(gm), config, mesh, inner)

    return backend


PLAN_OPTIONS = ("sequence_parallel",)
"""The ``hybrid_parallel`` options that change the plan, hence what ``parallelize`` shards."""


def parallel(tp: int = 1, ring: int = 1, ulysses: int = 1, *, mesh: DeviceMesh | None = None, **options):
    """Class decorator: instances of the decorated ``nn.Module`` class run parallelized.

    At an instance's first call (its inputs are known then) ``parallelize`` shards its
    parameters over ``mesh`` (default: ``init_mesh(tp, ring, ulysses)`` over the default
    process group), and that call and every later one run through ``torch.compile`` with
    ``hybrid_parallel(mesh, **options)``. Before its first call an instance is the plain
    module: load a full ``state_dict`` then, and build the optimizer after. Works on
    third-party classes too: ``parallel(tp=2)(LlamaForCausalLM)``.
    """
    plan_options = {k: v for k, v in options.items() if k in PLAN_OPTIONS}
    meshes: list[DeviceMesh] = [mesh] if mesh is not None else []  # made at the first call, shared by instances

    def call(self, *args, **kwargs):
        compiled = self.__dict__.get("_dtensor_par_compiled")
        if compiled is None:
            if not meshes:
                meshes.append(init_mesh(tp, ring, ulysses))
            self.__dict__["_dtensor_par_compiled"] = functools.partial(nn.Module.__call__, self)  # while planning
            try:
                parallelize(self, meshes[0], args, example_kwargs=kwargs, **plan_options)
            finally:
                del self.__dict__["_dtensor_par_compiled"]
            compiled = torch.compile(functools.partial(nn.Module.__call__, self),
                                     backend=hybrid_parallel(meshes[0], **options))
            self.__dict__["_dtensor_par_compiled"] = compiled
        return compiled(*args, **kwargs)

    def decorate(cls):
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise TypeError(f"dtensor_par.parallel decorates torch.nn.Module subclasses, got {cls!r}")
        return type(cls.__name__, (cls,), {"__call__": call, "__module__": cls.__module__,
                                           "__qualname__": cls.__qualname__, "__doc__": cls.__doc__})

    return decorate

