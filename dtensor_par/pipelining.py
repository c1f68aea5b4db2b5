"""Pipeline parallelism: ``pipeline(model, mesh, example_inputs, loss_fn=..., microbatches=...)``.

The model's one Dynamo graph (captured on one example microbatch) is cut at block boundaries
(the children of the ``nn.ModuleList`` that holds most of its parameters) into pp stages,
balanced by each block's time and memory (``pipeline_plan``): what runs before the first block
goes with the first stage, what runs after the last with the last. Each stage is a
``GraphModule`` whose inputs are the values the previous stage outputs (a value a later stage
needs is passed through the stages between) and whose parameters are the model's own, under
their FQNs (``get_attr``). Each rank
builds only its stage, holds its parameters as ``parallelize`` holds them over the mesh without
pp (the rank's slice), compiles it with ``hybrid_parallel`` over that slice, and runs it as a
``torch.distributed.pipelining.PipelineStage`` under one of torch's schedules, which sends what
crosses a cut point to point: under cp, each cp rank its own piece of a sequence the plan cuts
over cp (``pipeline_plan.sent_dims``), which the next stage takes already cut (``sequence_pieces``).

A model with its parameters on ``meta`` holds nothing: each rank materializes only its stages'
pieces and reads them from a checkpoint folder (``checkpoint=``, ``checkpoints.load_checkpoint``),
so a rank's memory is its stages', never the whole model's.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn
import torch.utils._pytree as pytree
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining.microbatch import TensorChunkSpec, _Replicate
from torch.distributed.tensor import DTensor

from .checkpoints import Part, held_tensors, load_checkpoint, tied_groups, write_parts
from .config import ParallelConfig
from .mesh import STAGE_DIMS, MeshInfo
from .machines import Machine, machine as machine_profile
from .params import SHARDED
from .passes.capture import capture_graphs
from .passes.context import ParallelContext
from .passes.meta import module_paths
from .passes.plan import decided_vocab_cuts
from .placements import Placement
from .pipeline_plan import (SCHEDULES, Schedule, ScheduleRun, StagePlan, blocks_of, node_block, node_blocks,
                            plan_stages, sent_dims, sent_shape)
from .planning import parallelize_graph
from .runtime import ParallelBackend
from .same_inputs import check_same_inputs
from .sequence_pieces import piece_standin
from .sharded import inputs_device, parallelize_with, planned_on
from .symbolic import hint


@dataclass
class Cut:
    """The captured graph cut into stages: each node's stage, and what each stage takes and gives."""

    gm: fx.GraphModule
    stage_of: dict[fx.Node, int]
    inputs: list[list[fx.Node]]  # per stage: the values it takes (stage 0: the user's tensors)
    outputs: list[list[fx.Node]]  # per stage: the values it gives (the last: the graph's outputs)
    params: dict[fx.Node, str]  # parameter and buffer placeholders: their FQNs
    user: list[int]  # stage 0's inputs: the index of each among the flattened call's tensors
    blocks: list[list[str]]  # each stage's blocks
    tensors: dict[str, torch.Tensor]  # the model's parameters and buffers by FQN
    owners: dict[str, int]  # the stage that reads each parameter and buffer, by FQN


def _place_nodes(gm: fx.GraphModule, blocks: list[str], stage_of_block: dict[str, int],
                 inputs: list[fx.Node]) -> dict[fx.Node, int]:
    """Each node's stage: that of its block as ``pipeline_plan.node_blocks`` places it (the block
    it runs in, else the block traced before it), the placement the stages were costed by; the
    call's tensors (``inputs``) with the first stage."""
    block_of = node_blocks(gm, blocks)
    stage_of: dict[fx.Node, int] = {n: 0 for n in inputs}
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if node.op == "call_module":
            raise NotImplementedError(f"pipeline: the captured graph calls module {node.target!r} (call_module)")
        current = stage_of_block[blocks[block_of[node]]]
        for arg in node.all_input_nodes:
            if arg in stage_of and stage_of[arg] > current:
                raise NotImplementedError(f"pipeline: {node.name} (stage {current}) reads {arg.name} of stage "
                                          f"{stage_of[arg]}: the blocks do not run in order")
        stage_of[node] = current
    index = {b: i for i, b in enumerate(blocks)}
    traced = {node_block(node, index) for node in block_of if node.op != "placeholder"}
    untraced = [b for i, b in enumerate(blocks) if i not in traced]
    if untraced:
        raise NotImplementedError(f"pipeline: no op of the captured graph was traced in blocks {untraced} (by "
                                  f"Dynamo's nn_module_stack) of {len(blocks)}: the stages cannot be cut there")
    return stage_of


def cut_graph(model: nn.Module, gm: fx.GraphModule, graph_inputs: list, flat_inputs: list,
              stage_blocks: list[list[str]]) -> Cut:
    """Cut ``gm`` (Dynamo's graph of ``model`` called on ``flat_inputs``) into stages of the
    blocks ``stage_blocks`` (``pipeline_plan.plan_stages``'s)."""
    blocks = [b for run in stage_blocks for b in run]
    stages = len(stage_blocks)
    stage_of_block = {b: stage for stage, run in enumerate(stage_blocks) for b in run}
    paths = module_paths(gm)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    params = {n: paths[n.name] for n in placeholders if n.name in paths}
    user = []
    for node, value in zip(placeholders, graph_inputs):
        if node in params:
            continue
        found = [i for i, leaf in enumerate(flat_inputs) if leaf is value]
        if not found:
            raise NotImplementedError(f"pipeline: graph input {node.name!r} is neither a parameter, a buffer nor an "
                                      f"input tensor of the call")
        user.append(found[0])
    stage_of = _place_nodes(gm, blocks, stage_of_block, [n for n in placeholders if n not in params])
    used_at: dict[fx.Node, int] = {}
    for node in gm.graph.nodes:
        at = stages - 1 if node.op == "output" else stage_of.get(node)
        for arg in node.all_input_nodes:
            if arg in params:
                if node.op == "output":
                    raise NotImplementedError(f"pipeline: the model returns its parameter {params[arg]!r}")
                if used_at.get(arg, at) != at:
                    raise NotImplementedError(f"pipeline: {params[arg]!r} is read by stages {used_at[arg]} and {at} "
                                              f"(tied weights across stages are not supported yet): untie them, e.g. "
                                              f"transformers' tie_word_embeddings=False in the model's config")
            used_at[arg] = max(used_at.get(arg, at), at)
    values = [n for n in gm.graph.nodes if n in stage_of]
    crossing = [[v for v in values if stage_of[v] <= k < used_at.get(v, -1)] for k in range(stages - 1)]
    output = next(n for n in gm.graph.nodes if n.op == "output")
    outs = list(pytree.tree_leaves(output.args[0]))
    tensors = {**dict(model.named_parameters(remove_duplicate=False)), **dict(model.named_buffers(remove_duplicate=False))}
    return Cut(gm, stage_of, [[n for n in placeholders if n not in params], *crossing], [*crossing, outs], params,
               user, [list(run) for run in stage_blocks], tensors,
               {params[n]: at for n, at in used_at.items() if n in params})


def stage_module(cut: Cut, stage: int) -> fx.GraphModule:
    """Stage ``stage`` of ``cut`` as a GraphModule: its inputs as placeholders, its parameters and
    buffers as ``get_attr`` of the model's own tensors under their FQNs, its outputs a tuple (the
    last stage's: the graph's output, one tensor as one tensor)."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    root = nn.Module()
    for node in cut.inputs[stage]:
        env[node] = graph.placeholder(node.name)
        env[node].meta = dict(node.meta)

    def read(node: fx.Node) -> fx.Node:
        if node not in env:
            fqn = cut.params[node]
            _put(root, fqn, cut.tensors[fqn])
            env[node] = graph.get_attr(fqn)
        return env[node]

    for node in cut.gm.graph.nodes:
        if cut.stage_of.get(node) != stage or node.op == "placeholder":
            continue
        for arg in node.all_input_nodes:
            if arg in cut.params:
                read(arg)
        if node.op == "get_attr":
            _put(root, node.target, getattr(cut.gm, node.target))
        env[node] = graph.node_copy(node, lambda n: env[n])
    outs = [env[n] for n in cut.outputs[stage]]
    last = stage == len(cut.outputs) - 1
    if not last:  # what crosses a cut is sent point to point, which takes a contiguous tensor (a slice, a transpose)
        outs = [graph.call_method("contiguous", (out,)) if _strided(node) else out
                for node, out in zip(cut.outputs[stage], outs)]
    graph.output(outs[0] if last and len(outs) == 1 else tuple(outs))
    return fx.GraphModule(root, graph, class_name=f"Stage{stage}")


def _strided(node: fx.Node) -> bool:
    """Whether Dynamo saw ``node``'s value as a tensor laid out other than contiguously."""
    value = node.meta.get("example_value")
    return isinstance(value, torch.Tensor) and not value.is_contiguous()


def _put(root: nn.Module, fqn: str, tensor: torch.Tensor) -> None:
    """Register ``tensor`` (the model's parameter or buffer ``fqn``, or a constant of the graph) on
    ``root`` under the path ``fqn``."""
    *path, name = fqn.split(".")
    owner = root
    for part in path:
        if part not in owner._modules:
            owner.add_module(part, nn.Module())
        owner = owner._modules[part]
    if isinstance(tensor, nn.Parameter):
        owner.register_parameter(name, tensor)
    else:
        owner.register_buffer(name, tensor)


def _batch_rows(entry: str, flat: list, microbatches: int, what: str = "input", batched: list | None = None) -> None:
    """Every tensor of ``flat`` (those ``batched`` marks, where given) cut along dim 0 into
    ``microbatches`` equal microbatches, all of one batch: refuse sizes that do not divide, and a
    tensor whose dim 0 is not the first's. That one has no batch dim: cut as if it had, its pieces
    may broadcast against each microbatch's rows, a different answer from one device's, silently."""
    hint = ("; a keyword input without a batch dim goes whole to every microbatch: name it in whole_inputs="
            if what == "input" else "")
    cut = [(i, leaf) for i, leaf in enumerate(flat)
           if isinstance(leaf, torch.Tensor) and (batched is None or batched[i])]
    for i, leaf in cut:
        if leaf.dim() == 0 or leaf.shape[0] % microbatches:
            raise ValueError(f"{entry}: {what} {i} of shape {list(leaf.shape)} has a batch (dim 0) of "
                             f"{leaf.shape[0] if leaf.dim() else 'no size'}, not divisible by microbatches="
                             f"{microbatches}{hint}")
    for i, leaf in cut[1:]:
        first, batch = cut[0]
        if leaf.shape[0] != batch.shape[0]:
            raise ValueError(f"{entry}: {what} {i} of shape {list(leaf.shape)} would be cut along dim 0 into "
                             f"microbatches=" f"{microbatches}, but its dim 0 is not the batch: {what} {first} has "
                             f"{batch.shape[0]} rows (shape {list(batch.shape)}){hint}")


def _chunk(flat: list, microbatches: int, batched: list[bool]) -> list:
    """The first microbatch of each tensor of ``flat`` (what each stage is planned on); those
    ``batched`` does not mark, whole."""
    return [leaf[: leaf.shape[0] // microbatches] if isinstance(leaf, torch.Tensor) and cut else leaf
            for leaf, cut in zip(flat, batched)]


def batched_leaves(args: tuple, kwargs: dict, whole_inputs: tuple[str, ...], entry: str) -> list[bool]:
    """Per leaf of the flattened call ``(args, kwargs)``: whether it is cut into microbatches
    (every tensor but the keyword inputs ``whole_inputs`` names, which have no batch dim: Flux's
    ``img_ids`` and ``txt_ids``, positions every sample shares). Refuses a name no keyword
    input has."""
    unknown = [name for name in whole_inputs if name not in kwargs]
    if unknown:
        raise ValueError(f"{entry}: whole_inputs names {unknown}, which are not keyword inputs of the call "
                         f"(those are {list(kwargs)})")
    marks = (pytree.tree_map(lambda _: True, args),
             {name: pytree.tree_map(lambda _, cut=name not in whole_inputs: cut, value) for name, value in kwargs.items()})
    return pytree.tree_leaves(marks)


def microbatch_of(tree, microbatches: int, entry: str, whole_inputs: tuple[str, ...] = ()):
    """``tree`` (``(args, kwargs)``) with each tensor its first of ``microbatches`` (cut along dim
    0; a batch they do not divide refused; those ``whole_inputs`` names whole): what ``pipeline``
    captures and plans the stages on."""
    flat, spec = pytree.tree_flatten(tree)
    batched = batched_leaves(*tree, whole_inputs, entry)
    _batch_rows(entry, flat, microbatches, batched=batched)
    return pytree.tree_unflatten(_chunk(flat, microbatches, batched), spec)


def _example(node: fx.Node, device: torch.device, shape: tuple[int, ...] | None = None) -> torch.Tensor:
    """A tensor of the dtype Dynamo saw at ``node`` (a stage's input or output: its values unread
    by planning and by torch's stage, which takes them as metadata), of its shape or ``shape``
    (a piece of it)."""
    value = node.meta["example_value"]
    return torch.zeros(value.shape if shape is None else shape, dtype=value.dtype,
                       device=device).requires_grad_(value.is_floating_point())


def _stage_example(cut: Cut, index: int, first: list, device: torch.device, sent: list[list[int | None]],
                   info: MeshInfo) -> list:
    """What torch's stage ``index`` is given: the call's tensors (the first stage), else what the
    previous stage sends (``sent``: per stage, each output's piece dim over cp; a piece where cut)."""
    if index == 0:
        return [first[i] for i in cut.user]
    return [_example(n, device, sent_shape(n, dim, info)) for n, dim in zip(cut.inputs[index], sent[index - 1])]


def _standins(cut: Cut, index: int, sent: list[list[int | None]], inputs: list) -> list:
    """Stage ``index``'s ``inputs`` as its compiled graph takes them: each received as its piece
    over cp (``sent``) as the piece's stand-in of the whole shape (``sequence_pieces``)."""
    if index == 0:
        return list(inputs)
    return [x if dim is None else piece_standin(x, tuple(n.meta["example_value"].shape), dim)
            for x, n, dim in zip(inputs, cut.inputs[index], sent[index - 1])]


def _stage_options(config: ParallelConfig) -> ParallelConfig:
    """A stage's config: its inputs checked by ``pipeline`` over the world at the first step (each
    stage's differ, and the runtime's check is a collective of every rank, which the stages reach
    at different times)."""
    return dataclasses.replace(config, check_inputs=False)


def _refuse_unfilled_meta(model: nn.Module, checkpoint: str | None) -> None:
    """A model on ``meta`` is filled from ``checkpoint``: refuse one without it, and ``meta``
    buffers no checkpoint holds (values the model's constructor computes, such as rotary
    frequencies), which would otherwise be used uninitialized."""
    name = type(model).__name__
    on_meta = [fqn for fqn, p in model.named_parameters() if p.is_meta]
    if on_meta and checkpoint is None:
        raise ValueError(f"pipeline: {len(on_meta)} parameters of {name} are on meta (first {on_meta[0]!r}) and no "
                         f"checkpoint= was given to read each rank's stages from")
    persistent = model.state_dict().keys() if checkpoint is not None else ()
    unfilled = [fqn for fqn, b in model.named_buffers() if b.is_meta and fqn not in persistent]
    if unfilled:
        raise ValueError(f"pipeline: buffers {unfilled[:4]} of {name} ({len(unfilled)} in all) are on meta and no "
                         f"checkpoint holds them; build the model with its buffers computed and its parameters on "
                         f"meta: dtensor_par.checkpoints.empty_model, or a constructor called under "
                         f"dtensor_par.checkpoints.parameters_on_meta()")


def _materialize(stage_gm: fx.GraphModule, device: torch.device) -> None:
    """A stage over a slice of one rank (pp alone), held whole: each ``meta`` parameter and
    buffer materialized on ``device`` uninitialized (the checkpoint fills it next; tied ones stay
    one), and each other buffer moved to ``device`` (``empty_model`` computes them on the CPU)."""
    made: dict[int, torch.Tensor] = {}
    for module in stage_gm.modules():
        for store in (module._parameters, module._buffers):
            for name, tensor in store.items():
                if tensor is not None and tensor.is_meta:
                    if id(tensor) not in made:
                        empty = torch.empty_like(tensor, device=device)
                        made[id(tensor)] = (nn.Parameter(empty, requires_grad=tensor.requires_grad)
                                            if isinstance(tensor, nn.Parameter) else empty)
                    store[name] = made[id(tensor)]
                elif store is module._buffers and tensor is not None and tensor.device.type != device.type:
                    store[name] = tensor.to(device)


def _compile_stage(stage_gm: fx.GraphModule, submesh: DeviceMesh, example: list, config: ParallelConfig,
                   options: dict, device: torch.device, sent: list[int | None],
                   vocab_cuts: dict[str, Placement]) -> None:
    """Hold and compile the stage over ``submesh`` (the mesh without pp): ``parallelize`` and
    ``hybrid_parallel``, each output returned as its piece over cp along its dim in ``sent``
    (None: whole), the token tables and LM heads cut as the whole graph's plan decided
    (``vocab_cuts``, by FQN: the last stage holds no table to show its head is one); over a
    slice of one rank (pp alone), held whole and compiled by the inner backend alone. Compiled
    in place (``nn.Module.compile``): the module the schedule runs holds the parameters, which
    torch's input/weight backward split walks."""
    if submesh.size() == 1:
        ignored = sorted(set(options) - {"inner_backend", "check_inputs"})
        if ignored:
            raise NotImplementedError(f"pipeline: options {ignored} with pp alone (the stage's mesh is one rank) are "
                                      f"not applied yet; the stage is compiled by the inner backend alone")
        _materialize(stage_gm, device)
        if config.inner_backend != "eager":
            stage_gm.compile(backend=config.inner_backend)
        return
    stage_config = _stage_options(config)
    parallelize_with(stage_gm, submesh, tuple(example), {}, stage_config, "pipeline", vocab_cuts)
    pieces = {i: dim for i, dim in enumerate(sent) if dim is not None}
    stage_gm.compile(backend=ParallelBackend(submesh, stage_config, pieces, vocab_cuts))


class PipelineStep:
    """This rank's stage of a pipelined model and the schedule that runs it: ``step(*inputs,
    target=target, **kwargs)`` runs forward and backward over the microbatches and returns the mean
    loss on every rank (built with ``loss_fn=None``: ``step(*inputs, **kwargs)`` runs forward only
    and returns the model's output on every rank); ``parameters()``/``named_parameters()`` are this
    rank's (model FQNs); ``save_pretrained(path)`` writes the whole model."""

    def __init__(self, model: nn.Module, mesh: DeviceMesh, submesh: DeviceMesh, cut: Cut,
                 stage_gms: list[fx.GraphModule], schedule, kind: Schedule, spec, example_flat: list,
                 batched: list[bool], microbatches: int, config: ParallelConfig, forward_only: bool):
        self.model, self.mesh, self.submesh, self.cut, self.modules = model, mesh, submesh, cut, stage_gms
        self.schedule, self.kind = schedule, kind  # torch's schedule object, and how it places stages
        self._spec, self._example_flat, self._batched = spec, example_flat, batched
        self.microbatches, self.config, self.forward_only = microbatches, config, forward_only
        self.pp_group = mesh.get_group("pp")
        self.pp, self.stage = mesh["pp"].size(), mesh.get_local_rank("pp")
        self.stages = kind.stages_of(self.stage, self.pp)  # the stages this rank runs (by index)
        self.loss_rank = kind.rank_of(len(cut.blocks) - 1, self.pp)  # the pp rank of the last stage
        self._checked, self._loss_dtype = False, None

    def named_parameters(self):
        """This rank's parameters (every stage it holds) under the model's FQNs."""
        for module in self.modules:
            yield from module.named_parameters()

    def parameters(self):
        for _, param in self.named_parameters():
            yield param

    def _stage_inputs(self, args: tuple, kwargs: dict, target) -> list:
        flat, spec = pytree.tree_flatten((args, kwargs))
        if spec != self._spec:
            raise ValueError(f"pipeline: the step was called with inputs structured as {spec}, but the model was "
                             f"captured on {self._spec}")
        for i, (leaf, example) in enumerate(zip(flat, self._example_flat)):
            if not isinstance(leaf, torch.Tensor) and leaf != example:
                raise ValueError(f"pipeline: input {i} is {leaf!r}, but the model was captured with {example!r} "
                                 f"(a non-tensor input is part of the captured graph)")
        _batch_rows("pipeline", flat, self.microbatches, batched=self._batched)
        named = {f"input {i}": leaf for i, leaf in enumerate(flat) if isinstance(leaf, torch.Tensor)}
        if self.forward_only:
            if target is not None:
                raise ValueError("pipeline: built with loss_fn=None, the step runs forward only and takes no target=; "
                                 "give pipeline a loss_fn= to train")
        elif target is None:
            raise ValueError("pipeline: the step needs target=, what loss_fn compares the last stage's output with")
        else:
            _batch_rows("pipeline", [target], self.microbatches, "target")
            named["target"] = target
        if self.config.check_inputs and not self._checked:
            check_same_inputs("pipeline", named, [list(range(dist.get_world_size()))],
                              "Give every rank the same inputs and target; check_inputs=False turns this check off")
            self._checked = True
        return [flat[i] for i in self.cut.user]

    def __call__(self, *args, target=None, **kwargs):
        inputs = self._stage_inputs(args, kwargs, target)
        device = inputs[0].device if inputs else torch.device(self.mesh.device_type)
        if self.forward_only:
            return self._forward(inputs, device)
        losses: list[torch.Tensor] = []
        # the outputs are not merged over the microbatches: only the losses are used (and a 0-dim output,
        # a model's own loss, does not concatenate)
        if self.stage == 0:
            self.schedule.step(*inputs, target=target, losses=losses, return_outputs=False)
        else:
            self.schedule.step(target=target, losses=losses, return_outputs=False)
        last = self.loss_rank
        if self._loss_dtype is None:
            dtype = [losses[0].dtype if losses else None]
            dist.broadcast_object_list(dtype, group=self.pp_group, group_src=last)
            self._loss_dtype = dtype[0]
        loss = (torch.stack([x.detach() for x in losses]).mean() if losses else
                torch.zeros((), dtype=self._loss_dtype, device=device))
        dist.broadcast(loss, group=self.pp_group, group_src=last)
        return loss

    def _forward(self, inputs: list, device: torch.device):
        """Every microbatch forward through the stages under ``no_grad`` (nothing kept for a
        backward; torch's schedule built without a loss skips its backward), the last stage's
        outputs concatenated along dim 0, then broadcast over pp from the last stage's rank: every
        rank returns the whole output, so a loop of steps (a diffusion sampler's) feeds it to the
        next step on every rank, as every rank gives the step the same inputs. One tensor as
        itself, several as a tuple, as ``loss_fn`` would get them."""
        with torch.no_grad():
            out = self.schedule.step(*inputs) if self.stage == 0 else self.schedule.step()
        if self.stage == self.loss_rank:
            outputs = pytree.tree_leaves(out)
        else:  # the shapes Dynamo saw on one microbatch, dim 0 times the microbatches
            values = [node.meta["example_value"] for node in self.cut.outputs[-1]]
            outputs = [torch.empty((v.shape[0] * self.microbatches, *v.shape[1:]), dtype=v.dtype, device=device)
                       for v in values]
        for output in outputs:
            dist.broadcast(output, group=self.pp_group, group_src=self.loss_rank)
        return outputs[0] if len(outputs) == 1 else tuple(outputs)

    def clip_grad_norm_(self, max_norm: float, foreach: bool | None = None) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over the whole model: the 2-norm of every stage's
        gradients (each stage's squared norm summed over pp), every gradient scaled alike."""
        params = [p for p in self.parameters() if p.grad is not None]
        grads = [p.grad for p in params]
        local = torch.nn.utils.get_total_norm(grads, 2.0, False, foreach) if grads else torch.zeros(())
        if isinstance(local, DTensor):
            local = local.full_tensor()
        squared = local.float().square() if local.dtype != torch.float64 else local.square()
        dist.all_reduce(squared, group=self.pp_group)
        total = squared.sqrt().to(local.dtype)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0).item()
        for g in grads:
            g.mul_(coef)
        return total

    def save_pretrained(self, path: str, *, max_shard_size: int | str = "5GB") -> None:
        """Write the whole model as ``dtensor_par.save_pretrained`` writes one (its config, its own
        keys, an index): each stage's tensors in files of their own, written in parallel by the
        ranks of the stage's slice of the mesh (``checkpoints.write_parts``). Every rank calls it."""
        state = self.model.state_dict(keep_vars=True)
        held = held_tensors(self.modules)
        keys: list[list[str]] = [[] for _ in self.cut.blocks]
        mine: dict[str, torch.Tensor] = {}
        for group in tied_groups(state):
            owner = next((self.cut.owners[key] for key in group if key in self.cut.owners), None)
            if owner is None:
                raise ValueError(f"pipeline: no stage of {type(self.model).__name__} reads {group[0]!r}, so no rank "
                                 f"holds it to save")
            keys[owner].append(group[0])
            mine.update({group[0]: held[key] for key in group if key in held})
        pp_dim = self.mesh.mesh_dim_names.index("pp")
        ranks_of = [self.mesh.mesh.select(pp_dim, r).flatten().tolist() for r in range(self.pp)]
        parts = [Part(stage_keys, ranks_of[self.kind.rank_of(index, self.pp)],
                      {key: mine[key] for key in stage_keys} if index in self.stages else None)
                 for index, stage_keys in enumerate(keys)]
        write_parts(self.model, path, max_shard_size, parts)


def _one_graph(model: nn.Module, call: tuple[tuple, dict], device: torch.device, microbatches: int
               ) -> tuple[fx.GraphModule, list]:
    """Dynamo's one graph of ``model(*args, **kwargs)`` (``call``: the first of ``microbatches``)
    and its inputs; a model on ``meta`` is traced with stand-ins on ``device``
    (``sharded.planned_on``). A model that fails on the microbatch is refused naming the likely
    cause: an input without a batch dim, cut as if it had one."""
    args, kwargs = call
    try:
        with planned_on(model, device):
            graphs = capture_graphs(model, *args, dynamic=False, **kwargs)
    except NotImplementedError as e:
        raise NotImplementedError(f"pipeline: the model must be one graph to cut into stages: {e}") from None
    except torch._dynamo.exc.TorchRuntimeError as e:
        raise ValueError(f"pipeline: {type(model).__name__} fails on its first microbatch (each tensor input cut "
                         f"along dim 0 into microbatches={microbatches}): {_fake_error(e)}. An input without a "
                         f"batch dim (positions, a table every sample shares) goes whole to every microbatch: name "
                         f"it in whole_inputs=") from e
    if len(graphs) != 1:
        raise NotImplementedError(f"pipeline: Dynamo captured {len(graphs)} graphs of {type(model).__name__}; "
                                  f"stages are cut from one graph")
    return graphs[0]


def _fake_error(error: Exception) -> str:
    """The error an op raised on Dynamo's fake tensors, as its message quotes it (``got
    RuntimeError('Attempting to broadcast ...')``), else the message's first line."""
    found = re.search(r"got (\w+\(.*\))$", str(error), re.MULTILINE)
    return found.group(1) if found else str(error).splitlines()[0]


def _planned_whole(gm: fx.GraphModule, graph_inputs: list, submesh: DeviceMesh, config: ParallelConfig
                   ) -> tuple[fx.GraphModule, ParallelContext]:
    """The whole graph planned over one stage's mesh, as rank 0 of the first stage sees it (so
    every rank costs the blocks alike, cuts the same stages and cuts the same tables and heads by
    the vocabulary), as ``explain`` plans it."""
    names = tuple(submesh.mesh_dim_names)
    info = MeshInfo.for_planning(dict(zip(names, submesh.shape)), submesh.device_type, names)
    return parallelize_graph(gm, [hint(a) for a in graph_inputs], info, _stage_options(config), feeding=SHARDED)


class _TakesPieces(nn.Module):
    """A stage called with pieces over cp of its inputs, each handed to the compiled stage as its
    stand-in (``standins``: ``_standins`` of the stage): what torch's stage receives and returns
    gradients for is the piece."""

    def __init__(self, stage: fx.GraphModule, standins):
        super().__init__()
        self.stage, self.standins = stage, standins

    def forward(self, *inputs):
        return self.stage(*self.standins(inputs))


def _pipeline_stage(stage_gm: fx.GraphModule, index: int, device: torch.device, example: list, cut: Cut,
                    mesh: DeviceMesh, sent: list[list[int | None]], info: MeshInfo):
    """Stage ``index`` as torch's ``PipelineStage``, given the metadata of what it receives and
    sends (``sent``: per stage, each output's piece dim over cp): torch's own inference runs a later
    stage on uninitialized tensors (garbage integers: labels, ids)."""
    from torch.distributed import pipelining

    outputs = [_example(n, device, sent_shape(n, dim, info)) for n, dim in zip(cut.outputs[index], sent[index])]
    module = stage_gm
    if index > 0 and any(dim is not None for dim in sent[index - 1]):
        module = _TakesPieces(stage_gm, functools.partial(_standins, cut, index, sent))
    return pipelining.PipelineStage(module, index, len(cut.blocks), device, input_args=tuple(example),
                                    output_args=tuple(outputs), group=mesh.get_group("pp"))


def _cut_stages(model: nn.Module, gm: fx.GraphModule, graph_inputs: list, first: list, submesh: DeviceMesh,
                config: ParallelConfig, schedule: ScheduleRun, machine: Machine | None
                ) -> tuple[Cut, list[list[int | None]], dict[str, Placement]]:
    """``gm`` cut into stages as ``explain(pp=...)`` reports them (``cut_by_cost`` on the whole
    graph planned over one stage's mesh); per stage the dim each output is sent cut along over
    cp, by that plan (``pipeline_plan.sent_dims``; None: whole; the last stage's: not sent); and
    the tables and heads that plan cuts by the vocabulary (by FQN), which every stage holds so."""
    planned = _planned_whole(gm, graph_inputs, submesh, config)
    _, cut = cut_by_cost(model, gm, graph_inputs, first, planned, schedule, machine)
    sent = [*(sent_dims(values, planned[0]) for values in cut.outputs[:-1]), [None] * len(cut.outputs[-1])]
    return cut, sent, decided_vocab_cuts(planned[1])


def cut_by_cost(model: nn.Module, gm: fx.GraphModule, graph_inputs: list, flat_inputs: list,
                planned: tuple[fx.GraphModule, ParallelContext], schedule: ScheduleRun, machine: Machine | None
                ) -> tuple[list[StagePlan], Cut]:
    """``gm`` cut into stages of blocks balanced by the time model (and memory) of ``planned``
    (the graph planned over one stage's mesh; ``pipeline_plan.plan_stages``): what ``pipeline``
    runs and ``explain(pp=...)`` reports."""
    stages = plan_stages(type(model).__name__, *planned, blocks_of(model, gm), schedule, machine)
    return stages, cut_graph(model, gm, graph_inputs, flat_inputs, [s.blocks for s in stages])


def _refuse_bad_call(mesh: DeviceMesh, schedule: str, microbatches, loss_fn, inner_backend) -> None:
    """An unknown schedule, a mesh without pp, microbatches not a positive int, a backward split
    over compiled stages (``Schedule.check_backend``), a V-shaped schedule forward only."""
    if schedule not in SCHEDULES:
        raise ValueError(f"pipeline: unknown schedule {schedule!r}; the schedules are {list(SCHEDULES)}")
    names = tuple(mesh.mesh_dim_names or ())
    if "pp" not in names:
        raise ValueError(f"pipeline: the mesh {dict(zip(names, mesh.shape))} has no pp dim: build it with "
                         f"init_mesh(pp=..., ...)")
    if not isinstance(microbatches, int) or microbatches < 1:
        raise ValueError(f"pipeline: microbatches must be a positive int, got {microbatches!r}")
    if loss_fn is not None:
        SCHEDULES[schedule].check_backend(schedule, inner_backend)
    elif SCHEDULES[schedule].v_shaped:
        raise NotImplementedError(
            f"pipeline: loss_fn=None (forward only) under the V-shaped schedule {schedule!r} is not built: torch "
            f"2.13's runtime hands a backward between a rank's two adjacent stages even when it runs none; forward "
            f"only, a schedule decides no more than where the stages sit and the order of their forwards: take one "
            f"of {[name for name, kind in SCHEDULES.items() if not kind.v_shaped]}")


def _refuse_unbatched_outputs(cut: Cut) -> None:
    """A forward-only step concatenates the last stage's outputs over the microbatches along dim 0:
    refuse a 0-dim one (a model's own loss), which has no batch dim to concatenate along."""
    for i, node in enumerate(cut.outputs[-1]):
        if node.meta["example_value"].dim() == 0:
            raise ValueError(f"pipeline: loss_fn=None returns the model's outputs concatenated over the microbatches "
                             f"along dim 0, but its output {i} ({node.name}) is 0-dim")


def pipeline(model: nn.Module, mesh: DeviceMesh, example_inputs: tuple = (), *, loss_fn, microbatches: int,
             schedule: str = "1F1B", example_kwargs: dict | None = None, whole_inputs: tuple[str, ...] = (),
             checkpoint: str | None = None, machine: str | Machine | None = None, **options) -> PipelineStep:
    """Run ``model`` pipeline-parallel over ``mesh``'s pp dim, each stage over the other dims as
    ``hybrid_parallel`` runs a model (``options``: its options).

    ``example_inputs``/``example_kwargs``: a whole batch, as the step will be called; every tensor
    is cut along dim 0 into ``microbatches``, but the keyword inputs ``whole_inputs`` names, which
    have no batch dim (Flux's ``img_ids`` and ``txt_ids``): each microbatch is given them whole.
    ``loss_fn(output, target)``: a mean over its microbatch, given the last stage's output: the
    tensors the model returns, as the captured graph returns them (a ``ModelOutput``'s without its
    ``None``s), one tensor as itself. ``schedule``: one of ``SCHEDULES``. ``machine``: the profile
    whose time model (and memory) balances the stages, as ``explain(pp=..., machine=...)`` reports.
    Returns a ``PipelineStep``: ``loss = step(*inputs, target=target, **kwargs)`` is the mean of
    ``loss_fn`` over the microbatches on every rank, the gradients those of that mean (optimizer
    over ``step.parameters()``, clip with ``step.clip_grad_norm_``). ``loss_fn=None``: forward only
    (no V-shaped schedule), ``out = step(*inputs, **kwargs)`` the whole batch's output, every rank.

    ``checkpoint``: a checkpoint folder (safetensors, transformers or diffusers layout) each rank
    reads its stages' pieces from. With it, ``model`` may hold its parameters on ``meta``
    (``checkpoints.empty_model``): then no rank ever holds more than its stages.
    """
    from torch.distributed import pipelining

    config = ParallelConfig.of("pipeline", options)
    _refuse_bad_call(mesh, schedule, microbatches, loss_fn, config.inner_backend)
    runs = SCHEDULES[schedule]
    _refuse_unfilled_meta(model, checkpoint)
    pp, stage = mesh["pp"].size(), mesh.get_local_rank("pp")
    submesh = mesh[tuple(n for n in mesh.mesh_dim_names if n not in STAGE_DIMS)]
    info = MeshInfo.from_mesh(submesh, "pipeline")  # every rank now, in one order: every stage's groups
    flat, spec = pytree.tree_flatten((tuple(example_inputs), example_kwargs or {}))
    batched = batched_leaves(tuple(example_inputs), example_kwargs or {}, tuple(whole_inputs), "pipeline")
    _batch_rows("pipeline", flat, microbatches, batched=batched)
    first = _chunk(flat, microbatches, batched)
    device = torch.device(mesh.device_type, torch.cuda.current_device()) if mesh.device_type == "cuda" else \
        torch.device(mesh.device_type)
    gm, graph_inputs = _one_graph(model, pytree.tree_unflatten(first, spec), inputs_device(first) or device,
                                  microbatches)
    cut, sent, vocab_cuts = _cut_stages(model, gm, graph_inputs, first, submesh, config,
                                        ScheduleRun(schedule, pp, runs.stages_per_rank, microbatches),
                                        machine and machine_profile(machine))
    if loss_fn is None:
        _refuse_unbatched_outputs(cut)
    held, runners = [], []
    for index in runs.stages_of(stage, pp):
        stage_gm = stage_module(cut, index)
        example = _stage_example(cut, index, first, device, sent, info)
        _compile_stage(stage_gm, submesh, _standins(cut, index, sent, example), config, options, device, sent[index],
                       vocab_cuts)
        held.append(stage_gm)
        runners.append(_pipeline_stage(stage_gm, index, device, example, cut, mesh, sent, info))
    if checkpoint is not None:
        load_checkpoint(model, checkpoint, stages=held)
    chunking = tuple(TensorChunkSpec(0) if batched[i] else _Replicate for i in cut.user)
    order = getattr(pipelining, f"Schedule{schedule}")(runners if runs.stages_per_rank > 1 else runners[0],
                                                       n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=True,
                                                       args_chunk_spec=chunking)
    return PipelineStep(model, mesh, submesh, cut, held, order, runs, spec, flat, batched, microbatches, config,
                        forward_only=loss_fn is None)
