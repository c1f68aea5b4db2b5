"""Public entry points: the ``torch.compile`` backend, the class decorator and ``from_pretrained``."""

from __future__ import annotations

import dataclasses
import types

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from .checkpoints import empty_model, load_checkpoint
from .choose import Ranking, choose_mesh, mesh_text
from .config import ParallelConfig
from .errors import InvalidPlan
from .logs import logger
from .machines import MACHINES, Machine, machine as machine_profile
from .mesh import default_world_size, init_mesh, split_degrees
from .runtime import ParallelBackend
from .same_inputs import check_every_rank_agrees
from .sharded import parallelize, parallelize_with


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
_CHECKPOINT = "_dtensor_par_checkpoint"
"""The attribute of an instance the decorated class's ``from_pretrained`` built on meta: the
checkpoint folder its pieces are read from once its first call parallelizes it."""
RANKING = "mesh_ranking"
"""The attribute of an instance of a ``parallel(auto=True)`` class holding the ``choose.Ranking``
its mesh was chosen from (``[0]`` built), once chosen."""


def parallel(*, mesh: DeviceMesh | None = None, auto: bool = False, machine: str | Machine | None = None,
             training: bool | None = None, **options):
    """Class decorator: instances of the decorated ``nn.Module`` class run parallelized.

    ``options``: a degree for each mesh dim (``tp=2, ulysses=2``: ``mesh.MESH_DIMS``) and those of
    ``hybrid_parallel``. At an instance's first call (its inputs are known then) ``parallelize``
    shards its parameters over ``mesh`` (default: ``init_mesh`` of those degrees over the default
    process group), and that call and every later one run through ``torch.compile`` with
    ``hybrid_parallel(mesh, **options)``. Before its first call an instance is the plain
    module: load a full ``state_dict`` then, and build the optimizer after. Works on
    third-party classes too: ``parallel(tp=2)(LlamaForCausalLM)``.

    ``auto=True``: no degrees are given; at an instance's first call ``choose_mesh`` ranks every
    mesh of the default process group's ranks for that call on ``machine`` (a profile's name, a
    ``Machine`` or a JSON path) for a training step (``training``, default True) or a forward,
    every rank checks that all chose alike, and the fastest is built: the instance's
    ``mesh_ranking`` holds the ranking (``mesh_ranking[0]`` the mesh built).
    """
    given, options = split_degrees(options)
    config = ParallelConfig.of("parallel", options)
    profile = _auto_machine(auto, machine, training, given, mesh)
    meshes: dict[tuple, DeviceMesh] = {}  # by degrees and order, made at the first call that needs it, shared

    def mesh_for(self, args, kwargs) -> tuple[DeviceMesh, ParallelConfig]:
        """The mesh an instance runs on, and the config: with the activation checkpointing
        the chosen mesh needs to fit in memory (``auto=True``)."""
        if mesh is not None:
            return mesh, config
        degrees, order, chosen = given, None, config
        if profile is not None:
            ranking = _choose(self, args, kwargs, profile, training is None or training, config)
            self.__dict__[RANKING] = ranking
            degrees, order = ranking[0].degrees, ranking[0].order
            if ranking[0].activation_checkpointing is not None:
                chosen = dataclasses.replace(config, activation_checkpointing=ranking[0].activation_checkpointing)
        key = (tuple(degrees.values()), order)
        if key not in meshes:
            meshes[key] = init_mesh(**degrees, order=order)
        return meshes[key], chosen

    def call(self, *args, **kwargs):
        compiled = self.__dict__.get(_COMPILED)
        if compiled is None:
            built, chosen = mesh_for(self, args, kwargs)
            parallelize_with(self, built, args, kwargs, chosen, "parallel")
            if _CHECKPOINT in self.__dict__:
                load_checkpoint(self, self.__dict__.pop(_CHECKPOINT))
            compiled = torch.compile(types.MethodType(nn.Module.__call__, self),
                                     backend=ParallelBackend(built, chosen))
            self.__dict__[_COMPILED] = compiled
        return compiled(*args, **kwargs)

    def decorate(cls):
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise TypeError(f"dtensor_par.parallel decorates torch.nn.Module subclasses, got {cls!r}")
        return type(cls.__name__, (cls,), {"__call__": call, "from_pretrained": classmethod(_from_pretrained),
                                           "__module__": cls.__module__, "__qualname__": cls.__qualname__,
                                           "__doc__": cls.__doc__})

    return decorate


def _from_pretrained(cls, path: str, *, torch_dtype: torch.dtype | None = None) -> nn.Module:
    """A decorated class's ``from_pretrained``: an instance built on meta from the checkpoint folder
    ``path``'s config; its first call parallelizes it and reads each rank's pieces from ``path``."""
    model = empty_model(cls, path, torch_dtype)
    model.__dict__[_CHECKPOINT] = path
    return model


def from_pretrained(model_cls: type, path: str, mesh: DeviceMesh, *, example_inputs: tuple = (),
                    example_kwargs: dict | None = None, torch_dtype: torch.dtype | None = None,
                    **options) -> nn.Module:
    """``model_cls`` (transformers or diffusers) from the checkpoint folder ``path``, parallelized
    over ``mesh``, each rank reading only its pieces' bytes (``checkpoints``).

    With example inputs: built on ``meta``, ``parallelize``d for them (``options``) and read now;
    compile it with ``hybrid_parallel``. Without, nothing can be planned yet: the instance of
    ``parallel(mesh=mesh, **options)(model_cls)``, built on meta; call it directly, its first call
    plans, reads and compiles."""
    if not example_inputs and not example_kwargs:
        return parallel(mesh=mesh, **options)(model_cls).from_pretrained(path, torch_dtype=torch_dtype)
    model = empty_model(model_cls, path, torch_dtype)
    parallelize(model, mesh, example_inputs, example_kwargs=example_kwargs, **options)
    return load_checkpoint(model, path)


def _auto_machine(auto: bool, machine: str | Machine | None, training: bool | None, given: dict[str, int],
                  mesh: DeviceMesh | None) -> Machine | None:
    """``parallel``'s profile to choose the mesh on (None: the mesh is given), its arguments
    refused where they contradict each other."""
    if not auto:
        unread = [f"{name}={value!r}" for name, value in (("machine", machine), ("training", training))
                  if value is not None]
        if unread:
            raise ValueError(f"parallel: {', '.join(unread)} only serve auto=True (choosing the mesh)")
        return None
    explicit = [f"{name}={size}" for name, size in given.items() if size != 1] + (["mesh="] if mesh is not None else [])
    if explicit:
        raise ValueError(f"parallel: auto=True chooses the mesh; it cannot also be given ({', '.join(explicit)})")
    if machine is None:
        raise ValueError(f"parallel: auto=True needs machine=, the profile to predict on: one of {sorted(MACHINES)} "
                         f"or a JSON profile's path (python -m dtensor_par calibrate)")
    if training is not None and not isinstance(training, bool):
        raise TypeError(f"parallel: training must be a bool, got {training!r}")
    try:
        return machine_profile(machine)
    except ValueError as e:
        raise ValueError(f"parallel: {e}") from None


def _choose(model: nn.Module, args: tuple, kwargs: dict, profile: Machine, training: bool, config: ParallelConfig
            ) -> Ranking:
    """``choose_mesh``'s ranking for ``model``'s first call over the default process group's
    ranks, its top choice checked to be every rank's; with no legal mesh, every one's reason."""
    world = default_world_size()
    options = {f.name: getattr(config, f.name) for f in config.plan_options()}
    ranking = choose_mesh(model, args, world, machine=profile, training=training, example_kwargs=kwargs, **options)
    if not ranking:
        refused = "\n".join(f"  {r}" for r in ranking.rejected)
        raise InvalidPlan(f"parallel(auto=True): no mesh of {world} ranks is legal for {type(model).__name__} on "
                          f"{profile.name}; each was refused:\n{refused}")
    best = ranking[0]
    check_every_rank_agrees("parallel(auto=True)", "the mesh chosen", (best.degrees, best.order),
                            lambda layout: mesh_text(*layout), "choose_mesh is deterministic: were the ranks given "
                            "different models, inputs, options or machine profiles?")
    logger.info("parallel(auto=True): %s runs on %s of %d ranks%s, predicted on %s: %s (%d meshes rejected; the "
                "instance's %s holds the ranking)", type(model).__name__, mesh_text(best.degrees, best.order), world,
                f" with activation_checkpointing={best.activation_checkpointing!r}" if best.activation_checkpointing
                else "", profile.name, best.predicted, len(ranking.rejected), RANKING)
    return ranking
