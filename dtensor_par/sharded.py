"""Sharded state: each rank holds only its piece of every parameter the plan shards.

``parallelize`` plans a model once (as ``explain`` does) and replaces, in place and under
the same names, each parameter by an ``nn.Parameter`` holding a DTensor with the plan's
placements (``Shard`` or, for fused projections, ``_StridedShard`` on tp; with FSDP,
``Shard`` on each of ``fsdp_dims`` along a dim tp does not cut, ``params.HeldLayout``;
``Replicate`` elsewhere). The optimizer, ``clip_grad_norm_``
and ``torch.distributed.checkpoint`` then work as they do for FSDP2/TP models (the state dict
hands DCP a fused projection's piece as the blocks it holds, ``pieces.Blocks``). Where no mesh
dim cuts a parameter (``params.holds_whole``: dp_replicate alone), each stays a plain
``nn.Parameter`` held whole, as DDP holds it; everything below applies to it alike.

Dynamo must not trace the model on DTensors: DTensor would propagate its own placements
through every op (slow, and some ops have no rule). So while a parallelized model is
called, a forward pre-hook puts a *stand-in* in each DTensor parameter's place: a plain
``nn.Parameter`` of the global shape and dtype that owns no memory (a NaN expanded to that
shape), and a forward hook puts the DTensor back. Dynamo hands the stand-ins to the backend;
the runtime feeds the graph ``param.to_local()`` in their place, so ``param.grad`` comes back
as a DTensor with the parameter's placements and nothing is gathered. Outside
``torch.compile`` the pre-hook refuses to run, so stand-ins never compute a result.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.utils._pytree as pytree
from torch._C._dynamo.eval_frame import get_eval_frame_callback
from torch._dynamo.eval_frame import skip_code
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_pre_hook

from .config import ParallelConfig
from .mesh import MeshInfo
from .params import SHARDED, STANDIN_OF, HeldLayout, expert_dim, held_mesh, holds_whole, layout_maker
from .passes.capture import capture_graphs
from .passes.steps import steps
from .pieces import blocks_for_dcp, optimizer_blocks_for_dcp
from .planning import parallelize_graph
from .placements import Placement, Replicate, describe

_STATE = "_dtensor_par_sharded"  # the root module's attribute holding its ShardedState


@dataclass
class Slot:
    """One place a held parameter is registered: ``module._parameters[name]``."""

    fqn: str
    module: nn.Module
    name: str
    param: nn.Parameter  # the held parameter: a DTensor, or plain where nothing is cut
    standin: nn.Parameter  # what Dynamo sees in its place


@dataclass
class ShardedState:
    """What ``parallelize`` did to a model, kept on it."""

    mesh: DeviceMesh
    config: ParallelConfig
    slots: list[Slot]
    replaced: dict[int, tuple[weakref.ref, str]] = field(default_factory=dict)
    """The parameters ``parallelize`` replaced: id -> (the old parameter, its FQN). An optimizer
    still holding one was built before ``parallelize`` and would step tensors the model no longer uses."""

    def remember_replaced(self, old: nn.Parameter, fqn: str) -> None:
        key, replaced = id(old), self.replaced  # the callback holds the dict alone, not the model's state
        replaced[key] = (weakref.ref(old, lambda _: replaced.pop(key, None)), fqn)


def _check_optimizer(replaced: dict[int, tuple[weakref.ref, str]], optimizer: torch.optim.Optimizer, args,
                     kwargs) -> None:
    """An optimizer step pre-hook of one parallelized model (it holds only that model's
    ``ShardedState.replaced``): refuses to step parameters the model no longer holds."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            ref, fqn = replaced.get(id(p), (None, None))
            if ref is not None and ref() is p:
                raise RuntimeError(
                    f"{type(optimizer).__name__} holds parameter {fqn!r} as it was before "
                    f"dtensor_par.parallelize replaced it by the parameter each rank holds; build the optimizer after "
                    f"parallelize (or after the first call of a dtensor_par.parallel model)")


def _standin(param: nn.Parameter, compute_dtype: torch.dtype | None, device: torch.device | None = None
             ) -> nn.Parameter:
    """A plain parameter of ``param``'s global shape that owns one element: NaN, so any
    backend but ours that computes with it shows it at once. Of ``compute_dtype`` if given
    (``param_dtype``): Dynamo then traces the model computing in it, as it will run. On
    ``param``'s device, or ``device``."""
    dtype = compute_dtype if compute_dtype is not None and param.is_floating_point() else param.dtype
    device = device or (param.to_local() if isinstance(param, DTensor) else param).device
    nan = torch.full((), float("nan"), dtype=dtype, device=device)
    standin = nn.Parameter(nan.expand(param.shape), requires_grad=param.requires_grad)
    setattr(standin, STANDIN_OF, param)
    return standin


def _registered_parameters(model: nn.Module):
    """Every place a parameter is registered, tied ones at each: (FQN, owning module, name, parameter)."""
    for fqn, param in model.named_parameters(remove_duplicate=False):
        owner_name, _, name = fqn.rpartition(".")
        yield fqn, model.get_submodule(owner_name), name, param


@contextlib.contextmanager
def traced_in(model: nn.Module, param_dtype: torch.dtype | None):
    """While ``explain`` captures a model that is not parallelized: each floating parameter in
    the place of a stand-in of ``param_dtype``, as ``parallelize``'s hook puts at each call,
    so that the plan computes in the dtype the runtime will."""
    if param_dtype is None or sharded_state(model) is not None:
        yield
        return
    slots, standins = [], {}
    for _, owner, name, param in _registered_parameters(model):
        standin = standins.setdefault(id(param), _standin(param, param_dtype))
        slots.append((owner, name, param, standin))
    try:
        for owner, name, _, standin in slots:
            owner._parameters[name] = standin
        yield
    finally:
        for owner, name, param, _ in slots:
            owner._parameters[name] = param


def cast_floating(tree, dtype: torch.dtype | None):
    """Every floating tensor of ``tree`` in ``dtype`` (None: as it is): FSDP2's ``cast_forward_inputs``."""
    if dtype is None:
        return tree
    return pytree.tree_map_only(torch.Tensor, functools.partial(_cast_floating_tensor, dtype=dtype), tree)


def _cast_floating_tensor(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x.to(dtype) if x.is_floating_point() else x


def _in_compiled_call(module: nn.Module) -> bool:
    """Whether the swap hooks run for a compiled call: traced into a caller's graph, run eagerly
    as their own frames by a compiled module (the check torch's ``set_stance`` makes), or before
    a ``forward`` compiled on its own (``model.forward = torch.compile(model.forward, ...)``,
    transformers' advice for ``generate``): Dynamo's wrapper names the function it compiles
    (``torch.compiler.disable``'s wrapper too, marked disabled)."""
    if torch.compiler.is_compiling():
        return True
    callback = get_eval_frame_callback()
    if callback is not None and callback is not False:
        return True
    forward = module.__dict__.get("forward")
    return hasattr(forward, "_torchdynamo_orig_callable") and not getattr(forward, "_torchdynamo_disable", False)


def _swap_in(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """Put the stand-ins in; with ``param_dtype``, return the floating inputs cast to it (FSDP2's
    ``cast_forward_inputs``)."""
    state = getattr(module, _STATE)
    slots = state.slots
    for slot in slots:
        if slot.module._parameters[slot.name] is not slot.param:
            raise RuntimeError(
                f"parameter {slot.fqn!r} of parallelized {type(module).__name__} was replaced; change it in place "
                f"(copy_, torch.distributed.checkpoint.state_dict.set_model_state_dict)")
    if not _in_compiled_call(module):
        raise RuntimeError(
            f"{type(module).__name__} was parallelized (dtensor_par.parallelize holds its parameters): call it through "
            f"torch.compile(model, backend=dtensor_par.hybrid_parallel(mesh)), or build it with the "
            f"dtensor_par.parallel class decorator")
    for slot in slots:
        slot.module._parameters[slot.name] = slot.standin
    return cast_floating((args, kwargs), state.config.param_dtype) if state.config.param_dtype else None


def _swap_out(module: nn.Module, args, output) -> None:
    for slot in getattr(module, _STATE).slots:
        slot.module._parameters[slot.name] = slot.param


# ``torch.compile(model)`` calls the hooks as frames of their own, each of which Dynamo would
# compile (a trace of the loop over every parameter, twice per first call): they run eagerly
# instead. A caller that is traced (the ``parallel`` decorator, an outer compiled function)
# still inlines them into its graph, with no graph break; ``torch.compiler.disable`` would break.
for _hook in (_swap_in, _swap_out, _in_compiled_call, cast_floating, _cast_floating_tensor):
    skip_code(_hook.__code__)


def sharded_state(model: nn.Module) -> ShardedState | None:
    return getattr(model, _STATE, None)


def plan_placements(model: nn.Module, mesh: DeviceMesh, example_args: tuple, example_kwargs: dict,
                    config: ParallelConfig, vocab_cuts: dict[str, Placement] | None = None
                    ) -> dict[str, tuple[Placement, int | None]]:
    """The tp placement of every parameter (by FQN, a tied one under each of its FQNs), and the
    dim ``ep`` cuts it along over its expert group (None: not cut); the plan's warnings are
    logged. ``vocab_cuts``: a pipeline stage's, decided on the whole graph (``plan.vocab_cuts``).

    Plans as ``explain`` does: one process, no communication, any device (meta included).
    """
    mesh_info = MeshInfo.for_planning(dict(zip(mesh.mesh_dim_names, mesh.shape)), mesh.device_type,
                                      MeshInfo.full_order(mesh.mesh_dim_names))
    placements: dict[str, tuple[Placement, int | None]] = {}

    def agreed(fqn: str, p: tuple) -> None:
        if placements.setdefault(fqn, p) != p:
            raise ValueError(f"parallelize: graphs of {type(model).__name__} shard parameter {fqn!r} "
                             f"differently ({describe(placements[fqn][0])}, cut by ep along dim "
                             f"{placements[fqn][1]}; and {describe(p[0])}, along dim {p[1]})")

    for gm, inputs in capture_graphs(model, *example_args, **example_kwargs):
        _, ctx = parallelize_graph(gm, inputs, mesh_info, config, feeding=SHARDED, steps=steps(last="coverage"),
                                  vocab_cuts=vocab_cuts)
        for name, param in ctx.params.items():
            agreed(param.fqn, (ctx.param_placements.get(name, Replicate()), expert_dim(ctx, name)))
    # a graph reads a tied weight by one of its FQNs, not necessarily the first it is registered
    # under (a token table shared by an encoder and a decoder): its placement holds under each
    tied: dict[int, list[str]] = {}
    for fqn, param in model.named_parameters(remove_duplicate=False):
        tied.setdefault(id(param), []).append(fqn)
    for fqns in tied.values():
        read = next((placements[fqn] for fqn in fqns if fqn in placements), None)
        if read is not None:
            for fqn in fqns:
                agreed(fqn, read)
    return placements


@contextlib.contextmanager
def planned_on(model: nn.Module, device: torch.device):
    """While a model with parameters on ``meta`` is planned on inputs of ``device``: each such
    parameter in the place of a stand-in of ``device`` (``_standin``: one element) and each
    ``meta`` buffer of an empty one there. Dynamo reads no value, but ops refuse tensors of two
    devices (a ``layer_norm`` of real inputs by a meta weight; a kv cache the model builds on its
    inputs' device)."""
    slots = [(module, store, name, tensor) for module in model.modules()
             for store in (module._parameters, module._buffers) for name, tensor in store.items()
             if tensor is not None and tensor.is_meta]
    standins: dict[int, torch.Tensor] = {}  # tied parameters share one
    for module, store, name, tensor in slots:
        if id(tensor) not in standins:
            standins[id(tensor)] = (_standin(tensor, None, device) if store is module._parameters
                                    else torch.empty_like(tensor, device=device))
        store[name] = standins[id(tensor)]
    try:
        yield
    finally:
        for module, store, name, tensor in slots:
            store[name] = tensor


def inputs_device(inputs) -> torch.device | None:
    """The device of the first tensor of ``inputs`` that is not on ``meta`` (None: none is)."""
    return next((t.device for t in pytree.tree_leaves(inputs) if isinstance(t, torch.Tensor) and not t.is_meta),
                None)


def _held_piece(param: nn.Parameter, layout: HeldLayout, mesh: DeviceMesh, info: MeshInfo) -> torch.Tensor:
    """This rank's piece of ``param`` in storage of its own; of a meta ``param``, only that piece
    materialized, uninitialized (as ``Module.to_empty``)."""
    if param.is_meta:
        return torch.empty(layout.held_shape(param.shape), dtype=param.dtype, device=mesh.device_type)
    return layout.held_piece(param.detach(), info.dims["tp"].rank).clone(memory_format=torch.contiguous_format)


def _held_param(param: nn.Parameter, layout: HeldLayout, mesh: DeviceMesh, info: MeshInfo,
                whole: bool) -> nn.Parameter:
    """What a rank holds of ``param``: the whole of it as a plain parameter where ``whole``
    (``holds_whole``), else its DTensor piece."""
    if whole:
        return nn.Parameter(_held_piece(param, layout, mesh, info), requires_grad=param.requires_grad)
    return _as_dtensor(param, layout, mesh, info)


def _as_dtensor(param: nn.Parameter, layout: HeldLayout, mesh: DeviceMesh, info: MeshInfo) -> nn.Parameter:
    """This rank's piece of ``param`` as a DTensor parameter over ``mesh`` (``held_mesh``); its
    storage holds only that piece."""
    local = _held_piece(param, layout, mesh, info)
    dtensor = DTensor.from_local(local, mesh, layout.dtensor_placements(mesh, info), run_check=False,
                                 shape=param.shape, stride=torch.empty(param.shape, device="meta").stride())
    return nn.Parameter(dtensor, requires_grad=param.requires_grad)


def parallelize(model: nn.Module, mesh: DeviceMesh, example_inputs: tuple = (), *,
                example_kwargs: dict | None = None, **options) -> nn.Module:
    """Hold on each rank only its piece of the model's parameters, as DTensors; return ``model``.

    Plans ``model(*example_inputs, **example_kwargs)`` once, without communication and without
    running the model (it may be on the ``meta`` device: then only the local pieces are
    materialized, with uninitialized values to load or initialize), and replaces every
    parameter, in place and under the same FQN, by an ``nn.Parameter(DTensor)``: the plan's
    placement on tp, and cut again over ``fsdp_dims`` (FSDP: dp_shard, ring and ulysses by
    default), Replicate on the other mesh dims; by a plain ``nn.Parameter`` held whole where
    no mesh dim cuts one (dp_replicate alone, as DDP holds them). Run the model with
    ``torch.compile(model, backend=hybrid_parallel(mesh, **options))``; build the optimizer
    afterwards. ``options``: those of ``hybrid_parallel`` (``config.ParallelConfig``).
    """
    config = ParallelConfig.of("parallelize", options)
    return parallelize_with(model, mesh, tuple(example_inputs), example_kwargs or {}, config, "parallelize")


def parallelize_with(model: nn.Module, mesh: DeviceMesh, example_args: tuple, example_kwargs: dict,
                     config: ParallelConfig, entry: str, vocab_cuts: dict[str, Placement] | None = None) -> nn.Module:
    """``parallelize`` with its options checked; errors name the entry point ``entry``.
    ``vocab_cuts``: a pipeline stage's (``plan_placements``)."""
    state = sharded_state(model)
    if state is not None:
        if state.mesh != mesh or state.config.plan_key() != config.plan_key():
            raise ValueError(f"{entry}: {type(model).__name__} was already parallelized over {state.mesh} "
                             f"with {state.config}; it cannot be parallelized again over {mesh} with {config}")
        return model
    info = MeshInfo.from_mesh(mesh, entry)
    config.check_mesh(info, entry)
    device = inputs_device((example_args, example_kwargs))
    with planned_on(model, device) if device is not None else contextlib.nullcontext():
        placements = plan_placements(model, mesh, example_args, example_kwargs, config, vocab_cuts)
    layout_of, held, whole = layout_maker(info, config, True), held_mesh(mesh), holds_whole(info, config)
    state = ShardedState(mesh, config, [])
    # id(old) -> (held param, stand-in): tied weights share them
    replaced: dict[int, tuple[nn.Parameter, nn.Parameter]] = {}
    for fqn, owner, name, old in _registered_parameters(model):
        if id(old) not in replaced:
            param = _held_param(old, layout_of(old.shape, *placements.get(fqn, (None, None))), held, info, whole)
            replaced[id(old)] = (param, _standin(param, config.param_dtype))
            state.remember_replaced(old, fqn)
        param, standin = replaced[id(old)]
        owner._parameters[name] = param
        state.slots.append(Slot(fqn, owner, name, param, standin))
    for module in model.modules():  # buffers of a meta model: materialized whole, uninitialized
        for name, buffer in module._buffers.items():
            if buffer is not None and buffer.is_meta:
                module._buffers[name] = torch.empty_like(buffer, device=mesh.device_type)
    setattr(model, _STATE, state)
    model.register_forward_pre_hook(_swap_in, with_kwargs=True)
    model.register_forward_hook(_swap_out, always_call=True)
    model.register_state_dict_post_hook(blocks_for_dcp)
    for hook in (register_optimizer_step_pre_hook(functools.partial(_check_optimizer, state.replaced)),
                 register_optimizer_step_pre_hook(optimizer_blocks_for_dcp)):
        weakref.finalize(model, hook.remove)  # the hooks hang off the model: they go with it
    return model
