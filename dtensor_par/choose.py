"""choose_mesh: plan a model over every mesh of a world size and rank the legal ones by
their predicted step time on a machine (``passes.cost``), saying why each other was refused.

One process, no process group: the model is captured once and each factorization of the
world over the mesh dims is planned once (dp_replicate and dp_shard apart: FSDP shards
parameters over dp_shard, not over dp_replicate). A mesh order changes no plan's collectives or
bytes, only the groups they run over, hence their links and, on Neuron, whether they are
legal: each order is judged on the same plan.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import operator
from dataclasses import dataclass
from typing import Callable

import torch.fx as fx
import torch.utils._pytree as pytree

from .config import ParallelConfig
from .dump import parameter_rows
from .errors import InvalidPlan
from .gcpause import paused_gc
from .machines import Machine, machine as machine_profile
from .mesh import MESH_DIMS, STAGE_DIMS, MeshInfo, mesh_order
from .ops.lowerings import FUNCTIONAL
from .params import SHARDED
from .passes.capture import capture_graphs
from .passes.cost import StepTime, Traffic, activation_bytes, bytes_text, cost_pass, link_classes, traffic_text
from .passes.localize import graph_communications
from .passes.lower import check_all_to_all_contiguous, check_replica_group_limit, replica_group_sets
from .passes.context import ParallelContext
from .passes.recompute import recompute_pass
from .passes.steps import STEPS, Step
from .pipeline_plan import (ADAM_STATES, MODELED_SCHEDULES, SCHEDULES, PipelinePlan, ScheduleRun, block_costs,
                            blocks_of, cut_blocks, pipeline_plan)
from .pipelining import cut_graph, microbatch_of
from .planning import fork, run_steps
from .symbolic import hint

PLANNING = tuple(s for s in STEPS if not s.each_order)
"""The steps a split is planned with: lower's checks depend on the mesh's order, judged per order."""


@dataclass(frozen=True)
class Memory:
    """Bytes one rank holds: parameters and gradients as ``parallelize`` holds them (what
    ``explain(parallelized=True)`` reports), the optimizer's states, activations
    (``cost.activation_bytes``)."""

    parameters: int
    gradients: int
    optimizer: int
    activations: int

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer + self.activations


@dataclass(frozen=True)
class MeshChoice:
    """A legal mesh: ``init_mesh(**choice.degrees, order=choice.order)`` builds it."""

    degrees: dict[str, int]  # every mesh dim of MESH_DIMS
    order: tuple[str, ...]  # the last dim fastest
    predicted: StepTime
    memory: Memory
    warnings: tuple[str, ...]  # the plan's (padded heads or sequences, gathers)
    activation_checkpointing: str | None = None  # the policy the mesh needs to fit in memory (training)
    pipeline: PipelinePlan | None = None  # with pp > 1: its stages and schedule (run by dtensor_par.pipeline)

    @property
    def collectives(self) -> dict[str, Traffic]:
        """By mesh dim, with the link class its groups cross."""
        return self.predicted.traffic

    def __str__(self) -> str:
        checkpointing = (f" with activation_checkpointing={self.activation_checkpointing!r}"
                         if self.activation_checkpointing else "")
        if self.pipeline is not None:
            s = self.pipeline.schedule
            checkpointing = (f" ({s.name}, {s.microbatches} microbatches, bubble {s.bubble:.1%}, "
                             f"{'/'.join(str(len(st.blocks)) for st in self.pipeline.stages)} blocks)")
        return (f"{mesh_text(self.degrees, self.order)}{checkpointing}: {self.predicted}; "
                f"{bytes_text(self.memory.total)} per rank; {traffic_text(self.collectives)}")


@dataclass(frozen=True)
class Rejection:
    degrees: dict[str, int]
    order: tuple[str, ...] | None  # None: refused whatever the order
    reason: str

    def __str__(self) -> str:
        mesh = mesh_text(self.degrees, self.order) if self.order else mesh_text(self.degrees, MESH_DIMS)
        return f"{mesh}{'' if self.order else ' (every order)'}: {self.reason}"


class Ranking(list):
    """The legal meshes, fastest first (the ``top`` of them), and ``rejected``: every refused mesh."""

    def __init__(self, choices: list[MeshChoice], rejected: list[Rejection], machine: Machine, world_size: int,
                 training: bool):
        super().__init__(choices)
        self.rejected, self.machine, self.world_size, self.training = rejected, machine, world_size, training

    def __str__(self) -> str:
        step = "training step" if self.training else "forward"
        out = [f"meshes of {self.world_size} ranks on {self.machine.name}, by predicted {step} time:"]
        out += [f"  {i}. {c}" for i, c in enumerate(self, 1)] or ["  none is legal"]
        out.append(f"rejected ({len(self.rejected)}):")
        out += [f"  {r}" for r in self.rejected]
        return "\n".join(out)


def mesh_text(degrees: dict[str, int], order) -> str:
    """The dims of degree above 1 in ``order`` (a stage dim outermost): ``pp=2 x ring=2 x tp=4``."""
    dims = (*(d for d in STAGE_DIMS if d in degrees and d not in order), *order)
    return " x ".join(f"{d}={degrees[d]}" for d in dims if degrees[d] > 1) or "one device"


def factorizations(world_size: int, dims: tuple[str, ...] = MESH_DIMS) -> list[dict[str, int]]:
    """Every assignment of degrees to ``dims`` whose product is ``world_size``."""
    if not dims:
        return [{}] if world_size == 1 else []
    first, rest = dims[0], dims[1:]
    return [{first: d, **others} for d in range(1, world_size + 1) if world_size % d == 0
            for others in factorizations(world_size // d, rest)]


def layouts(degrees: dict[str, int], device_type: str) -> list[tuple[str, ...]]:
    """Every order of the dims of degree above 1, the device's default first (dims of degree 1
    move no rank: they go outermost)."""
    default = mesh_order("choose_mesh", degrees, device_type, None)
    ones = tuple(d for d in default if degrees[d] == 1)
    return [ones + p for p in itertools.permutations([d for d in default if degrees[d] > 1])]


@dataclass(frozen=True)
class Stage:
    """A run of steps (``passes.steps``) that starts at one reading more of the mesh: two splits
    that agree on what it and the stages before read plan alike up to its end, so it runs once per
    value of that and its result is forked (``planning.fork``). ``refused_by``: what a refusal of
    it depends on alone, where that is less."""

    steps: tuple[Step, ...]
    before: tuple[Step, ...]  # the steps of the stages before

    def reads(self, degrees: dict[str, int]) -> tuple:
        return tuple(s.reads(degrees) for s in self.before + self.steps if s.reads)

    @property
    def refused_by(self) -> Callable[[dict[str, int]], object] | None:
        return self.steps[0].refused_by


def stages(planning: tuple[Step, ...]) -> tuple[Stage, ...]:
    """``planning`` cut where a step reads another thing of the mesh than the steps before it, or
    can refuse a split on less than it reads: a step that reads nothing joins the stage before."""
    runs: list[list[Step]] = []
    for step in planning:
        reads = [s.reads for s in runs[-1] if s.reads] if runs else []
        joins = runs and not runs[-1][0].refused_by and not step.refused_by and (
            step.reads is None or not reads or step.reads is reads[-1])
        if joins:
            runs[-1].append(step)
        else:
            runs.append([step])
    return tuple(Stage(tuple(run), tuple(s for earlier in runs[:i] for s in earlier)) for i, run in enumerate(runs))


STAGES = stages(PLANNING)


def _plan(captured: list, degrees: dict[str, int], machine: Machine, config: ParallelConfig, done: dict
          ) -> list | str:
    """Each captured graph planned over ``degrees`` as ``parallelize`` runs it: [(local graph,
    context)], or why the planner refuses the split. ``done``: each stage's result (or refusal)
    by graph and by what it reads of the degrees, kept across splits."""
    mesh = MeshInfo.for_planning(degrees, machine.device_type)
    try:
        config.check_mesh(mesh, "choose_mesh")
    except (InvalidPlan, NotImplementedError) as e:
        return str(e)
    planned = []
    for index, (gm, inputs) in enumerate(captured):
        shared = [done[key] for key in _refusals(index, degrees) if key in done]
        if shared:
            return shared[0]
        state = gm, ParallelContext(config, mesh, list(inputs), SHARDED)
        for depth, stage in enumerate(STAGES):
            key = index, depth, stage.reads(degrees)
            if key not in done:
                done[key] = _run_stage(stage, *state, mesh)
                if isinstance(done[key], str) and stage.refused_by:
                    done.update(dict.fromkeys(_refusals(index, degrees, depth), done[key]))
            state = done[key]
            if isinstance(state, str):
                return state
        planned.append(state)
    return planned


def _refusals(index: int, degrees: dict[str, int], depth: int | None = None) -> list[tuple]:
    """The keys under which ``done`` holds a refusal of graph ``index`` that every split agreeing
    with ``degrees`` on a stage's ``refused_by`` shares (of the stage at ``depth`` alone, if given)."""
    return [(index, at, "refused", stage.refused_by(degrees)) for at, stage in enumerate(STAGES)
            if stage.refused_by and depth in (None, at)]


def _run_stage(stage: Stage, gm: fx.GraphModule, ctx: ParallelContext, mesh: MeshInfo) -> tuple | str:
    """The stage's steps on a fork of (gm, ctx) over ``mesh``, or why they refuse it."""
    try:
        forked, ctx = fork(gm, ctx, mesh)
        return run_steps(forked, ctx, stage.steps), ctx
    except (InvalidPlan, NotImplementedError) as e:
        return str(e)


def _memory(planned: list, training: bool) -> Memory:
    held = {}
    for _, ctx in planned:
        for row, info in zip(parameter_rows(ctx), ctx.params.values()):
            held[row["name"]] = (row["bytes_per_rank"], training and info.tensor.requires_grad)
    parameters = sum(nbytes for nbytes, _ in held.values())
    gradients = sum(nbytes for nbytes, trained in held.values() if trained)
    activations = sum(activation_bytes(gm, training) for gm, _ in planned)
    return Memory(parameters, gradients, ADAM_STATES * gradients, activations)


def _lowering_problem(planned: list, layout: MeshInfo, machine: Machine) -> str | None:
    """Why the machine cannot run the planned collectives over ``layout``'s groups, if it cannot."""
    try:
        for gm, _ in planned:
            comms = [c for _, c in graph_communications(gm)]
            if machine.contiguous_all_to_all:
                check_all_to_all_contiguous(comms, layout)
            if machine.replica_group_limit is not None:
                check_replica_group_limit(replica_group_sets(comms, layout, FUNCTIONAL), machine.replica_group_limit)
    except InvalidPlan as e:
        return str(e)
    return None


def _checkpointed(planned: list, policy: str) -> list:
    """``planned`` with its blocks checkpointed by ``policy`` (``passes.recompute``)."""
    checkpointed = []
    for gm, ctx in planned:
        gm, ctx = fork(gm, ctx, ctx.mesh)
        ctx.config = dataclasses.replace(ctx.config, activation_checkpointing=policy)
        checkpointed.append((recompute_pass(gm, ctx), ctx))
    return checkpointed


def _fitting(planned: list, machine: Machine, training: bool) -> tuple[list, Memory, str | None] | str:
    """(the plan, its memory, the activation checkpointing it needs) that fits a device of
    ``machine``: as planned, or else, training a model the options leave unchecked, with
    "selective" then "full" checkpointing of its blocks; or why none fits."""
    unchecked = training and planned[0][1].config.activation_checkpointing is None
    for policy in (None, "selective", "full") if unchecked else (None,):
        tried = _checkpointed(planned, policy) if policy else planned
        memory = _memory(tried, training)
        if memory.total <= machine.memory_per_device:
            return tried, memory, policy
    held = ", ".join(f"{f.name} {bytes_text(getattr(memory, f.name))}" for f in dataclasses.fields(memory))
    tried_text = f", with activation_checkpointing={policy!r}" if policy else ""
    return (f"{bytes_text(memory.total)} per rank ({held}{tried_text}), over the "
            f"{bytes_text(machine.memory_per_device)} of a {machine.name} device")


def _judge(degrees: dict[str, int], planned: list | str, machine: Machine, training: bool
           ) -> tuple[list[MeshChoice], list[Rejection]]:
    """The legal orders of one split, predicted, and the refused ones; of orders that put
    every mesh dim on the same links and are alike legal, the first only."""
    if isinstance(planned, str):
        return [], [Rejection(degrees, None, planned)]
    fitting = _fitting(planned, machine, training)
    if isinstance(fitting, str):
        return [], [Rejection(degrees, None, fitting)]
    planned, memory, policy = fitting
    choices, rejected, seen = [], [], set()
    warnings = tuple(w for _, ctx in planned for w in ctx.warnings)
    for order in layouts(degrees, machine.device_type):
        layout = MeshInfo.for_planning(degrees, machine.device_type, order)
        problem = _lowering_problem(planned, layout, machine)
        alike = (tuple(sorted(link_classes(layout, machine.devices_per_node).items())), problem is None)
        if alike in seen:
            continue
        seen.add(alike)
        if problem:
            rejected.append(Rejection(degrees, order, problem))
            continue
        predicted = functools.reduce(operator.add, (cost_pass(gm, ctx, machine, layout=layout, training=training)
                                                    for gm, ctx in planned))
        choices.append(MeshChoice(degrees, order, predicted, memory, warnings, policy))
    return choices, rejected


def choose_mesh(model, example_inputs, world_size: int, *, machine: str | Machine, training: bool = True,
                example_kwargs: dict | None = None, batch: str = "global", top: int = 5, pp: tuple[int, ...] = (1,),
                microbatches: int | None = None, schedules: tuple[str, ...] = MODELED_SCHEDULES, **options) -> Ranking:
    """The ``top`` meshes of ``world_size`` ranks for ``model(*example_inputs,
    **example_kwargs)`` on ``machine`` (a built-in name, a ``machines.Machine`` or a JSON
    profile's path), fastest first by predicted step time (the forward alone without
    ``training``); ``.rejected`` says why every other mesh was refused. The model may live on
    the ``meta`` device; it is not run. ``options``: those of ``hybrid_parallel`` that change
    the plan (``config.ParallelConfig``). ``pp``: the pipeline degrees allowed (above 1: meshes
    ``dtensor_par.pipeline`` runs, each of ``schedules`` over ``microbatches`` of the example
    batch, scored with its bubble and point-to-point sends: ``_pipelined``)."""
    profile = machine_profile(machine)
    config = ParallelConfig.of("choose_mesh", {"batch": batch, **options})
    staged = _pipeline_degrees(pp, world_size, microbatches, schedules, training)
    choices, rejected, done = [], [], {}
    with paused_gc():
        if 1 in pp:
            captured = [(gm, [hint(a) for a in inputs])
                        for gm, inputs in capture_graphs(model, *example_inputs, **(example_kwargs or {}))]
            for degrees in factorizations(world_size):
                legal, refused = _judge(degrees, _plan(captured, degrees, profile, config, done), profile, training)
                choices += legal
                rejected += refused
        if staged:
            legal, refused = _pipelined(model, (tuple(example_inputs), example_kwargs or {}), world_size, staged,
                                        microbatches, schedules, profile, config)
            choices += legal
            rejected += refused
    choices.sort(key=lambda c: c.predicted.total)
    return Ranking(choices[:top], rejected, profile, world_size, training)


def _pipeline_degrees(pp: tuple[int, ...], world_size: int, microbatches, schedules: tuple[str, ...],
                      training: bool) -> list[int]:
    """The pp degrees above 1 to try, refusing ones that do not divide the world, an unknown
    schedule, and pp without microbatches or training (``pipeline`` runs training steps)."""
    wrong = [d for d in pp if not isinstance(d, int) or d < 1 or world_size % d]
    if wrong or not pp:
        raise ValueError(f"choose_mesh: pp={pp} must name degrees that divide the world size {world_size}; "
                         f"{wrong} do not")
    unknown = [name for name in schedules if name not in MODELED_SCHEDULES]
    if unknown or not schedules:
        raise ValueError(f"choose_mesh: schedules {unknown} cannot be ranked; the schedules whose bubble is modeled "
                         f"are {list(MODELED_SCHEDULES)}")
    staged = sorted(d for d in set(pp) if d > 1)
    if staged and (not isinstance(microbatches, int) or microbatches < 1 or not training):
        raise ValueError(f"choose_mesh: pp={pp} plans pipeline's training steps: it needs training=True and "
                         f"microbatches= (a positive int), got training={training}, microbatches={microbatches!r}")
    return staged


def _pipelined(model, example: tuple, world_size: int, degrees_pp: list[int], microbatches: int,
               schedules: tuple[str, ...], machine: Machine, config: ParallelConfig
               ) -> tuple[list[MeshChoice], list[Rejection]]:
    """Meshes with pp: the model captured on one microbatch, as ``pipeline`` captures it, each split
    of a stage's ranks planned (a stage's mesh, its default order), its blocks cut into stages for
    each schedule (``pipeline_plan``) and predicted: the slowest rank's microbatches over 1 - bubble,
    and the sends of the fill and drain."""
    args, kwargs = microbatch_of(example, microbatches, "choose_mesh")
    graphs = capture_graphs(model, *args, dynamic=False, **kwargs)
    if len(graphs) != 1:
        why = f"Dynamo captured {len(graphs)} graphs of {type(model).__name__}; pipeline stages are cut from one"
        return [], [Rejection({"pp": d, **dict.fromkeys(MESH_DIMS, 1)}, None, why) for d in degrees_pp]
    (gm, inputs), = graphs
    captured, flat, blocks = [(gm, [hint(a) for a in inputs])], pytree.tree_leaves((args, kwargs)), blocks_of(model, gm)
    done: dict = {}
    choices, rejected = [], []
    for pp in degrees_pp:
        for degrees in factorizations(world_size // pp):
            staged = {"pp": pp, **degrees}
            planned = _plan(captured, degrees, machine, config, done)
            order = layouts(degrees, machine.device_type)[0]
            layout = MeshInfo.for_planning(degrees, machine.device_type, order)
            problem = planned if isinstance(planned, str) else _lowering_problem(planned, layout, machine)
            if problem:
                rejected.append(Rejection(staged, None, problem))
                continue
            (local_gm, ctx), = planned
            costs = block_costs(local_gm, ctx, blocks, machine)
            for name in schedules:
                schedule = ScheduleRun(name, pp, SCHEDULES[name].stages_per_rank, microbatches)
                try:
                    stages = cut_blocks(type(model).__name__, costs, blocks, schedule,
                                        machine.memory_per_device / schedule.virtual)
                except ValueError as e:
                    rejected.append(Rejection(staged, ("pp", *order), f"{name}: {e}"))
                    continue
                cut = cut_graph(model, gm, inputs, flat, [st.blocks for st in stages])
                plan = pipeline_plan(stages, cut.outputs[:-1], local_gm, layout, schedule, machine)
                verdict = _pipeline_choice(staged, ("pp", *order), plan, ctx, machine)
                (choices if isinstance(verdict, MeshChoice) else rejected).append(verdict)
    return choices, rejected


def _pipeline_choice(degrees: dict[str, int], order: tuple[str, ...], plan: PipelinePlan, ctx: ParallelContext,
                     machine: Machine) -> MeshChoice | Rejection:
    """The choice, or its refusal where its fullest rank's memory is over a device's."""
    held = [plan.rank_stages(rank) for rank in range(plan.schedule.pp)]
    memory = max((Memory(sum(s.parameter_bytes for s in stages), sum(s.trained_bytes for s in stages),
                         ADAM_STATES * sum(s.trained_bytes for s in stages),
                         sum(s.in_flight * s.activation_bytes for s in stages)) for stages in held),
                 key=lambda m: m.total)
    if memory.total > machine.memory_per_device:
        return Rejection(degrees, order, f"{plan.schedule.name}: {bytes_text(memory.total)} on its fullest rank, "
                                         f"over the {bytes_text(machine.memory_per_device)} of a {machine.name} device")
    return MeshChoice(degrees, order, plan.predicted, memory, tuple(ctx.warnings), None, plan)
