"""Public entry points."""

from __future__ import annotations

import os
from typing import Callable

import torch

from torch._dynamo.backends.registry import lookup_backend
from torch.distributed.device_mesh import DeviceMesh

from .mesh import MeshInfo
from .passes.capture import record_module_names
from .passes.context import ParallelConfig
from .runtime import ParallelRuntime

OUTPUT_MODES = ("full", "local")


def resolve_backend(inner_backend: str | Callable) -> Callable:
    return inner_backend if callable(inner_backend) else lookup_backend(inner_backend)


def check_options(info: MeshInfo, sequence_parallel: bool) -> None:
    if sequence_parallel and info.size("cp") > 1:
        raise NotImplementedError(
            f"hybrid_parallel: sequence_parallel=True with context parallelism (ring={info.size('ring')}, "
            f"ulysses={info.size('ulysses')}) is not implemented: both would shard the sequence")


def hybrid_parallel(mesh: DeviceMesh, *, inner_backend: str | Callable = "inductor", dump_dir: str | None = None,
                    output: str = "full", sequence_parallel: bool = False) -> Callable:
    """A ``torch.compile`` backend that runs the model tensor- and context-parallel over ``mesh``.

    Heads are sharded over tp; with ``ring`` or ``ulysses`` > 1, activations are sharded along
    the sequence over ring x ulysses and attention runs as Ulysses x ring hybrid attention.
    ``output="full"`` returns full tensors on every rank; ``"local"`` returns local shards as
    DTensors. ``sequence_parallel`` shards norms, residuals and pointwise ops between sites
    along the sequence over tp (Megatron-SP): reduce-scatter + all-gather instead of all-reduce.
    """
    dump_dir = dump_dir or os.environ.get("DTENSOR_PAR_DUMP")
    if output not in OUTPUT_MODES:
        raise ValueError(f"hybrid_parallel: output must be one of {OUTPUT_MODES}, got {output!r}")
    info = MeshInfo.from_mesh(mesh)
    check_options(info, sequence_parallel)
    config = ParallelConfig(info, sequence_parallel=sequence_parallel, output=output, dump_dir=dump_dir)
    inner = resolve_backend(inner_backend)

    def backend(gm, example_inputs):
        return ParallelRuntime(record_module_names(gm), config, mesh, inner)

    return backend


def capture_graphs(model, *example_inputs, dynamic: bool | None = None, **example_kwargs) -> list[tuple]:
    """The (graph, example inputs) pairs Dynamo hands a backend for ``model(*example_inputs, **example_kwargs)``.

    Resets Dynamo's caches before and after (so repeated captures never hit its recompile
    limit, and a later compile of the model starts fresh): compiled functions of the calling
    process recompile on their next call.
    """
    captured = []

    def record(gm, inputs):
        captured.append((record_module_names(gm), list(inputs)))
        return gm.forward

    torch._dynamo.reset()
    try:
        torch.compile(model, backend=record, dynamic=dynamic)(*example_inputs, **example_kwargs)
    finally:
        torch._dynamo.reset()
    if not captured:
        raise RuntimeError(f"capture_graphs: Dynamo captured no graph of {type(model).__name__}")
    return captured
