"""Public entry points: the ``torch.compile`` backend and the class decorator."""

from __future__ import annotations

import types

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from .config import ParallelConfig
from .mesh import init_mesh
from .runtime import ParallelBackend
from .sharded import parallelize_with


def hybrid_parallel(mesh: DeviceMesh, **options) -> ParallelBackend:
    """A ``torch.compile`` backend that runs the model tensor- and context-parallel over ``mesh``.

    Heads are sharded over tp; with ``ring`` or ``ulysses`` > 1, activations are sharded along
    the sequence over ring x ulysses and attention runs as Ulysses x ring hybrid attention;
    with ``dp_replicate`` or ``dp_shard`` > 1, the batch is cut over them (``batch``).
    ``options`` are ``config.ParallelConfig``'s fields (``batch``, ``check_inputs``,
    ``inner_backend``, ``output``, ``sequence_parallel``, ``collectives``, ``ulysses_impl``,
    ``replica_group_limit``, ``grad_bucket_mb``, ``dump_dir``, ``plan_cache``, ``cache_limit``),
    each documented there.

    Sizes Dynamo made symbolic (``dynamic=True``, ``mark_dynamic``, or its automatic dynamic
    shapes at the second size) are planned and compiled once, for every size; ``dynamic=False``
    or ``mark_static`` keep a plan per size. Each new plan is logged at INFO with what
    triggered it (``dtensor_par.set_verbosity("info")``).
    """
    return ParallelBackend(mesh, ParallelConfig.of("hybrid_parallel", options))


_COMPILED = "_dtensor_par_compiled"
"""The attribute of a decorated instance holding its compiled call, once made."""


def parallel(tp: int = 1, ring: int = 1, ulysses: int = 1, *, dp_replicate: int = 1, dp_shard: int = 1,
             mesh: DeviceMesh | None = None, **options):
    """Class decorator: instances of the decorated ``nn.Module`` class run parallelized.

    At an instance's first call (its inputs are known then) ``parallelize`` shards its
    parameters over ``mesh`` (default: ``init_mesh(tp, ring, ulysses)`` over the default
    process group), and that call and every later one run through ``torch.compile`` with
    ``hybrid_parallel(mesh, **options)``. Before its first call an instance is the plain
    module: load a full ``state_dict`` then, and build the optimizer after. Works on
    third-party classes too: ``parallel(tp=2)(LlamaForCausalLM)``.
    """
    config = ParallelConfig.of("parallel", options)
    meshes: list[DeviceMesh] = [mesh] if mesh is not None else []  # made at the first call, shared by instances

    def call(self, *args, **kwargs):
        compiled = self.__dict__.get(_COMPILED)
        if compiled is None:
            if not meshes:
                meshes.append(init_mesh(tp, ring, ulysses, dp_replicate=dp_replicate, dp_shard=dp_shard))
            parallelize_with(self, meshes[0], args, kwargs, config, "parallel")
            compiled = torch.compile(types.MethodType(nn.Module.__call__, self),
                                     backend=ParallelBackend(meshes[0], config))
            self.__dict__[_COMPILED] = compiled
        return compiled(*args, **kwargs)

    def decorate(cls):
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise TypeError(f"dtensor_par.parallel decorates torch.nn.Module subclasses, got {cls!r}")
        return type(cls.__name__, (cls,), {"__call__": call, "__module__": cls.__module__,
                                           "__qualname__": cls.__qualname__, "__doc__": cls.__doc__})

    return decorate
