"""Where ``pipeline`` cuts a model into stages, and what each stage costs.

The blocks are the children of the ``nn.ModuleList`` that holds the most parameters, and of the
lists beside it that run before or after it (Flux's joint blocks, then its single ones). Each is
costed on the whole graph planned over one stage's mesh (the mesh without pp), by the time
model (``passes.cost.node_seconds``: forward and backward of one microbatch) and by memory
(the parameters a rank holds, their gradients and AdamW's states, and the activations kept for
backward per microbatch). An op outside every block costs with the block traced before it, as
``pipelining`` places it: the embedding with the first block, the norm, head and loss with the
last. A parameter, and what localize computes of it alone at the graph's start (its FSDP gather,
its gradient reduction, each maybe merged with other blocks' parameters), costs with the block
whose ops read it: the stage that holds it at runtime (``block_shares``). Stages are contiguous
runs of blocks; the cut minimizes the slowest stage, after keeping every stage within the
machine's memory where it can, then the fullest stage's memory.
``explain(pp=...)`` and ``pipeline`` cut by the same function on the same costs, so what the
report shows is what the ranks run.
"""

from __future__ import annotations

import functools
import math
import operator
from dataclasses import dataclass
from typing import Callable

import torch
import torch.fx as fx
import torch.nn as nn

from .dump import parameter_rows
from .machines import H100_SXM, Machine
from .mesh import MeshInfo
from .ops import collectives as C
from .passes.context import ParallelContext
from .passes.cost import StepTime, Traffic, bytes_text, duration_text, link_classes, node_seconds
from .passes.meta import placements, planned_local_shape
from .placements import Shard, local_shape_on
from .passes.recompute import module_stack
from .passes.saved import kept_by_node

ADAM_STATES = 2
"""Optimizer state per gradient byte: Adam's two moments, in the parameters' dtype."""
REFERENCE = H100_SXM
"""The rates stages are balanced by where no machine is given (only their ratios move a cut),
with no memory limit."""


def blocks_of(model: nn.Module, gm: fx.GraphModule) -> list[str]:
    """The model's repeated blocks, where stages are cut, in the order ``gm`` (its captured graph)
    runs them: the children of the ``nn.ModuleList`` that holds the most parameters
    (``layers.0``, ``layers.1``, ...), and of each ``nn.ModuleList`` beside it (one parent) whose
    blocks run wholly before or after it: Flux's joint ``transformer_blocks``, then its
    ``single_transformer_blocks``. A list whose blocks run interleaved with the largest one's
    does not cut stages."""
    lists = {name: module for name, module in model.named_modules()
             if isinstance(module, nn.ModuleList) and len(module) > 0}
    if not lists:
        raise ValueError(f"pipeline: {type(model).__name__} holds no nn.ModuleList of blocks to cut into stages")
    largest = max(lists, key=lambda name: sum(p.numel() for p in lists[name].parameters()))
    parent = largest.rpartition(".")[0]
    children = {name: [f"{name}.{i}" if name else str(i) for i in range(len(module))] for name, module in lists.items()
                if name.rpartition(".")[0] == parent and bool(name) == bool(largest)}
    spans = _traced_spans(gm, children)
    runs = [name for name in children if name == largest or (name in spans and largest in spans and (
        spans[name][1] < spans[largest][0] or spans[name][0] > spans[largest][1]))]
    runs.sort(key=lambda name: spans.get(name, (0,))[0])
    return [block for name in runs for block in children[name]]


def _traced_spans(gm: fx.GraphModule, lists: dict[str, list[str]]) -> dict[str, tuple[int, int]]:
    """Of each list of blocks (name: its blocks' FQNs), the positions in ``gm`` of the first and
    last op traced in any of its blocks (not its parameters' placeholders, all at the graph's
    start); lists none of whose ops is traced are left out."""
    list_of = {block: name for name, blocks in lists.items() for block in blocks}
    index = {block: i for i, block in enumerate(list_of)}
    names = list(list_of)
    spans: dict[str, tuple[int, int]] = {}
    for position, node in enumerate(gm.graph.nodes):
        found = node_block(node, index) if node.op != "placeholder" else None  # parameters are inputs first
        if found is not None:
            name = list_of[names[found]]
            spans[name] = (spans.get(name, (position,))[0], position)
    return spans


def node_block(node: fx.Node, blocks: dict[str, int]) -> int | None:
    """The index of the block a node runs in, from its module path (``nn_module_stack``)."""
    for path, _ in module_stack(node):
        parts = path.split(".")
        for k in range(len(parts), 0, -1):
            index = blocks.get(".".join(parts[:k]))
            if index is not None:
                return index
    return None


def balanced_cuts(blocks: int, stages: int, stage_cost: Callable[[int, int, int], tuple]) -> list[int]:
    """The first block of each stage: contiguous runs of ``blocks``, each stage at least one, whose
    costliest stage (``stage_cost(stage, first block, end)``, compared as tuples) is as cheap as
    can be (the first such split in order)."""
    best: dict[tuple[int, int], tuple[tuple, list[int]]] = {}

    def split(start: int, left: int) -> tuple[tuple, list[int]]:
        stage = stages - left
        if left == 1:
            return stage_cost(stage, start, blocks), [start]
        if (start, left) not in best:
            options = []
            for end in range(start + 1, blocks - left + 2):
                rest, starts = split(end, left - 1)
                options.append((max(stage_cost(stage, start, end), rest), [start, *starts]))
            best[start, left] = min(options, key=lambda o: o[0])
        return best[start, left]

    return split(0, stages)[1]


@dataclass(frozen=True)
class BlockCost:
    """One block on one rank, per microbatch, with the ops outside every block it is placed with."""

    seconds: float  # forward and backward, nothing overlapped but ring attention's rotations
    parameter_bytes: int  # the rank's piece over the stage's mesh
    trained_bytes: int  # of them, those with a gradient (and AdamW's states)
    activation_bytes: int  # kept for backward


_BUCKETS = (C.gather_params, C.grad_all_reduce_bucket)
"""The collectives localize merges over many parameters, each one's piece read by the getitem of
its position: FSDP's gathers (``bucket_fsdp_gathers``: one for all the parameters outside the
blocks, the embedding's and the head's) and the gradient buckets that may span blocks
(``bucket_input_grad_reductions``)."""


def node_blocks(gm: fx.GraphModule, blocks: list[str]) -> dict[fx.Node, int]:
    """Each op's block: the one it runs in, else the block traced before it (the first before
    any), as ``pipelining`` places ops in stages."""
    index = {b: i for i, b in enumerate(blocks)}
    current, of = 0, {}
    for node in gm.graph.nodes:
        if node.op not in ("placeholder", "output"):
            found = node_block(node, index)
            current = of[node] = current if found is None else found
    return of


def block_shares(gm: fx.GraphModule, ctx: ParallelContext, blocks: list[str], held: dict[str, int]
                 ) -> dict[fx.Node, dict[int, float]]:
    """Each node of the planned graph ``gm``: the blocks its cost goes to, with their shares. An op
    goes with its block (``node_blocks``). A placeholder, and what is computed from parameters
    alone (their casts, gradient reductions and FSDP gathers, which localize puts at the graph's
    start), goes with the first block that reads it: each stage's own plan gathers the
    parameters its ops read, so the stage that holds a parameter at runtime is that reader's.
    A bucket of several parameters (``_BUCKETS``) is split among its parameters' readers by their
    bytes (``held``: by FQN, on a rank), as the stages' own buckets move them."""
    of = node_blocks(gm, blocks)
    carried = set()  # the parameters' placeholders and what is computed from them alone
    for node in gm.graph.nodes:
        parameter = node.op == "placeholder" and node.name in ctx.params
        from_carried = node.op == "call_function" and node.all_input_nodes and all(
            a in carried for a in node.all_input_nodes)
        if parameter or from_carried:
            carried.add(node)
    reader: dict[fx.Node, int] = {}  # a carried node's or placeholder's first reading block

    def read_at(node: fx.Node, user: fx.Node) -> int | None:
        if user not in carried:
            return of.get(user)
        if user.target in _BUCKETS:  # this input's piece: the getitems of its position
            position = user.args[0].index(node)
            return min((reader[g] for g in user.users
                        if g.target is operator.getitem and g.args[1] == position), default=None)
        return reader[user]

    shares: dict[fx.Node, dict[int, float]] = {}
    for node in reversed(gm.graph.nodes):
        if node not in carried and node.op != "placeholder":
            if node in of:
                shares[node] = {of[node]: 1.0}
            continue
        reads = [b for b in (read_at(node, u) for u in node.users) if b is not None]
        reader[node] = min(reads, default=of.get(node, 0))
        if node.target in _BUCKETS and len(node.args[0]) > 1:
            nbytes = [held[ctx.params[_placeholder_of(x).name].fqn] for x in node.args[0]]
            split: dict[int, float] = {}
            for x, n in zip(node.args[0], nbytes):
                block = read_at(x, node)
                block = reader[node] if block is None else block
                split[block] = split.get(block, 0.0) + n / sum(nbytes)
            shares[node] = split
        else:
            shares[node] = {reader[node]: 1.0}
    return {node: shares[node] for node in gm.graph.nodes if node in shares}


def _placeholder_of(node: fx.Node) -> fx.Node:
    """The parameter's placeholder a carried value (a cast or gradient reduction of it) comes from."""
    while node.op != "placeholder":
        node = node.all_input_nodes[0]
    return node


def block_costs(gm: fx.GraphModule, ctx: ParallelContext, blocks: list[str], machine: Machine) -> list[BlockCost]:
    """Each block's cost on one rank of the planned graph ``gm`` (a training step's), each node's
    split among blocks by ``block_shares``."""
    links = link_classes(ctx.mesh, machine.devices_per_node)
    kept, recomputed = kept_by_node(gm)
    held = {row["name"]: row["bytes_per_rank"] for row in parameter_rows(ctx)}
    seconds, params, trained, acts = ([0] * len(blocks) for _ in range(4))
    for node, split in block_shares(gm, ctx, blocks, held).items():
        for block, share in split.items():
            seconds[block] += share * node_seconds(node, machine, links, True, node in recomputed)
            acts[block] += round(share * kept.get(node, 0))
        info = ctx.params.get(node.name) if node.op == "placeholder" else None
        if info is not None:
            (block,) = split
            params[block] += held[info.fqn]
            trained[block] += held[info.fqn] if info.tensor.requires_grad else 0
    return [BlockCost(*c) for c in zip(seconds, params, trained, acts)]


def bubble(pp: int, virtual: int, microbatches: int) -> float:
    """The share of a step each rank idles filling and draining the pipeline: (pp - 1) stage
    times of 1/v of a microbatch's, against the m microbatches' work, (pp-1)/(v m + pp - 1);
    GPipe's and 1F1B's at v = 1."""
    return (pp - 1) / (virtual * microbatches + pp - 1)


def _every_microbatch(pp: int, virtual: int, microbatches: int, rank: int) -> int:
    """GPipe runs every forward before any backward; the schedules that split the backward are
    bounded as GPipe is."""
    return microbatches


def _one_forward_one_backward(pp: int, virtual: int, microbatches: int, rank: int) -> int:
    """1F1B's rank r runs pp - r forwards before its first backward."""
    return min(microbatches, pp - rank)


def _interleaved_warmup(pp: int, virtual: int, microbatches: int, rank: int) -> int:
    """Interleaved1F1B's rank runs its warmup forwards (torch's ``_get_warmup_ops``), spread over
    its v stages."""
    per_round = microbatches // max(1, microbatches // pp)
    warmup = min((virtual - 1) * per_round + 2 * (pp - 1 - rank) + 1, microbatches * virtual)
    return math.ceil(warmup / virtual)


@dataclass(frozen=True)
class Schedule:
    """How ``pipeline`` runs one of torch's schedules: the stages each rank holds, and where; how
    many microbatches' activations a rank keeps at once."""

    stages_per_rank: int
    in_flight_rule: Callable[[int, int, int, int], int] = _every_microbatch  # (pp, virtual, microbatches, rank)
    v_shaped: bool = False  # rank r holds stages r and 2*pp-1-r (the first and last both on rank 0), not r, r+pp, ...
    splits_backward: bool = False  # computes each stage's input gradients and weight gradients apart

    def stages_of(self, rank: int, pp: int) -> list[int]:
        """The stages pp rank ``rank`` holds, in order (torch's ``generate_stage_to_rank_mapping``)."""
        if self.v_shaped:
            return [rank, 2 * pp - 1 - rank]
        return list(range(rank, pp * self.stages_per_rank, pp))

    def in_flight(self, pp: int, virtual: int, microbatches: int, stage: int) -> int:
        """Microbatches whose activations ``stage`` holds at once, by the rank that holds it."""
        return self.in_flight_rule(pp, virtual, microbatches, self.rank_of(stage, pp))

    def check_backend(self, name: str, inner_backend) -> None:
        """Refuse to split the backward of stages compiled whole: an AOT-compiled stage's backward is
        one autograd node, which torch's split runs whole for the input gradients and again for the
        weights (exact, but twice the backward and no bubble saved); torch 2.13 refuses it too."""
        if self.splits_backward and inner_backend != "eager":
            raise NotImplementedError(
                f"pipeline: schedule {name!r} computes a stage's input gradients and weight gradients apart, by "
                f"walking the stage's autograd graph, which takes inner_backend='eager' (one autograd node per op); "
                f"under inner_backend={inner_backend!r} a stage's backward is one compiled node, which the split runs "
                f"whole twice (exact, but twice the backward and no bubble saved), and torch 2.13 refuses these "
                f"schedules over compiled stages")

    def rank_of(self, stage: int, pp: int) -> int:
        """The pp rank that holds ``stage``."""
        return next(r for r in range(pp) if stage in self.stages_of(r, pp))


SCHEDULES = {
    "GPipe": Schedule(1),
    "1F1B": Schedule(1, _one_forward_one_backward),
    "Interleaved1F1B": Schedule(2, _interleaved_warmup),
    "InterleavedZeroBubble": Schedule(2, splits_backward=True),
    "ZBVZeroBubble": Schedule(2, v_shaped=True, splits_backward=True),
    "DualPipeV": Schedule(2, v_shaped=True, splits_backward=True),
}
"""torch's schedules ``pipeline`` runs, by name (``torch.distributed.pipelining.Schedule<name>``)."""
MODELED_SCHEDULES = tuple(name for name, kind in SCHEDULES.items() if not kind.splits_backward)
"""Those whose bubble ``bubble`` models: the ones ``choose_mesh`` ranks."""


@dataclass(frozen=True)
class ScheduleRun:
    """A schedule of ``SCHEDULES`` run over pp ranks of ``virtual`` stages each."""

    name: str
    pp: int
    virtual: int
    microbatches: int

    @property
    def stages(self) -> int:
        return self.pp * self.virtual

    def stages_of(self, rank: int) -> list[int]:
        return SCHEDULES[self.name].stages_of(rank, self.pp)

    @property
    def bubble(self) -> float | None:
        """``bubble``'s share; None for the schedules that split the backward, which no formula here models."""
        return None if SCHEDULES[self.name].splits_backward else bubble(self.pp, self.virtual, self.microbatches)


@dataclass(frozen=True)
class StagePlan:
    blocks: list[str]
    seconds: float  # per microbatch, forward and backward
    parameter_bytes: int
    trained_bytes: int  # of the parameters, those with a gradient (and AdamW's states)
    activation_bytes: int  # per microbatch
    in_flight: int  # microbatches whose activations it holds at once
    memory: int  # bytes at most: parameters, gradients, AdamW's states, activations in flight


def stage_plan(costs: list[BlockCost], blocks: list[str], schedule: ScheduleRun, stage: int) -> StagePlan:
    """Stage ``stage`` made of ``blocks`` (their ``costs``)."""
    held = SCHEDULES[schedule.name].in_flight(schedule.pp, schedule.virtual, schedule.microbatches, stage)
    params, trained = sum(c.parameter_bytes for c in costs), sum(c.trained_bytes for c in costs)
    activations = sum(c.activation_bytes for c in costs)
    return StagePlan(blocks, sum(c.seconds for c in costs), params, trained, activations, held,
                     params + (1 + ADAM_STATES) * trained + held * activations)


def cut_blocks(model_name: str, costs: list[BlockCost], blocks: list[str], schedule: ScheduleRun,
               memory_limit: float = math.inf) -> list[StagePlan]:
    """The pp x v stages, cut by ``balanced_cuts``: first every stage within ``memory_limit``
    where it can be, then the slowest stage as fast as can be, then the fullest as small."""
    if len(blocks) < schedule.stages:
        raise ValueError(f"pipeline: {model_name} has {len(blocks)} blocks ({blocks[0].rpartition('.')[0]}) "
                         f"but {schedule.stages} stages were asked for: each stage needs at least one block")

    @functools.cache
    def measures(stage: int, start: int, end: int) -> tuple[float, float, int]:
        plan = stage_plan(costs[start:end], blocks[start:end], schedule, stage)
        return max(0.0, plan.memory - memory_limit), float(f"{plan.seconds:.9g}"), plan.memory

    bounds: list[float] = []  # the best costliest stage of each measure before, kept while minimizing the next

    def within(stage: int, start: int, end: int) -> tuple:
        measured = measures(stage, start, end)
        kept = all(m <= b for m, b in zip(measured, bounds))
        return (measured[len(bounds)] if kept else math.inf,)

    for measure in range(3):
        starts = balanced_cuts(len(blocks), schedule.stages, within)
        bounds.append(max(measures(stage, start, end)[measure]
                          for stage, (start, end) in enumerate(zip(starts, [*starts[1:], len(blocks)]))))
    return [stage_plan(costs[start:end], blocks[start:end], schedule, stage)
            for stage, (start, end) in enumerate(zip(starts, [*starts[1:], len(blocks)]))]


def plan_stages(model_name: str, gm: fx.GraphModule, ctx: ParallelContext, blocks: list[str], schedule: ScheduleRun,
                machine: Machine | None) -> list[StagePlan]:
    """The stages of the graph ``gm`` planned over one stage's mesh (``ctx``), costed on
    ``machine`` (``REFERENCE``'s rates, no memory limit, where None); a rank's v stages share its
    device's memory."""
    costs = block_costs(gm, ctx, blocks, machine or REFERENCE)
    limit = machine.memory_per_device / schedule.virtual if machine else math.inf
    return cut_blocks(model_name, costs, blocks, schedule, limit)


def _value(node: fx.Node):
    """The captured graph's example of a node's value (Dynamo's)."""
    return node.meta.get("example_value", node.meta.get("val"))


def sent_dims(values: list[fx.Node], planned: fx.GraphModule) -> list[int | None]:
    """Of each value crossing a cut, the dim along which each cp rank sends its own piece of it
    (``sequence_pieces``), where the plan of the whole graph over one stage's mesh (``planned``)
    cuts it over cp (a ``Shard``: its sequence); None where it is sent whole: cp is 1, or the plan
    holds it whole on cp (gathered, or rewritten away: transformers' mask under cp, which the
    planned attention reads none of). Both stages of a cut are compiled to it: the one that
    makes a value returns it so, the next takes it so."""
    nodes = {n.name: n for n in planned.graph.nodes}
    cuts = [placements(nodes[v.name]).get("cp") if v.name in nodes else None for v in values]
    return [p.dim if type(p) is Shard and isinstance(_value(v), torch.Tensor) else None
            for v, p in zip(values, cuts)]


def sent_shape(value: fx.Node, dim: int | None, mesh: MeshInfo) -> tuple[int, ...]:
    """The shape of what one rank sends of a crossing value: its piece along ``dim`` over cp (in
    the sequence layout, padded where the length does not divide), or whole (``dim`` None)."""
    shape = tuple(_value(value).shape)
    return shape if dim is None else local_shape_on(shape, {"cp": Shard(dim)}, mesh)


def _piece_bytes(captured: fx.Node, planned: dict[str, fx.Node], mesh: MeshInfo) -> int:
    """This rank's bytes of a value as the plan cuts it (``planned``: the planned graph's nodes by
    name); whole where the plan rewrote it away (transformers' mask under cp: the planned
    attention reads none), as the stage that makes it returns it."""
    value = _value(captured)
    if captured.name not in planned:
        return value.numel() * value.element_size()
    return math.prod(planned_local_shape(planned[captured.name], mesh)) * value.element_size()


@dataclass(frozen=True)
class PipelinePlan:
    """A pipelined model's stages and what its schedule predicts (``explain(pp=...)``)."""

    schedule: ScheduleRun
    stages: list[StagePlan]
    sent_bytes: list[int]  # per microbatch, one rank to its peer across each cut (the gradients back: as many at most)
    sent_whole: list[list[str]]  # per cut, the values sent whole under cp (the others: each cp rank's piece)
    piece_bytes: list[int]  # the rank's own piece as the plan cuts the values (every dim: dp's rows too)
    send_seconds: float  # one send across the largest cut, on the pp link
    link: str  # the link class pp's sends cross
    machine: str | None  # the profile the seconds are of; None: REFERENCE's rates, shown only as shares

    def rank_stages(self, rank: int) -> list[StagePlan]:
        """The stages pp rank ``rank`` holds (``Schedule.stages_of``)."""
        return [self.stages[i] for i in self.schedule.stages_of(rank)]

    @property
    def predicted(self) -> StepTime:
        """A training step: the slowest rank's microbatches (compute, its collectives unhidden),
        then what it waits: the fill and drain (the bubble) and their sends (every cut once
        forward and once backward; the others overlap compute). Traffic: a middle rank's sends,
        a microbatch's activation forward and its gradient back."""
        if self.schedule.bubble is None:
            raise ValueError(f"pipeline: no step is predicted for schedule {self.schedule.name!r}: its bubble (a "
                             f"backward split into input and weight gradients) is not modeled")
        m = self.schedule.microbatches
        slowest = max(sum(s.seconds for s in self.rank_stages(r)) for r in range(self.schedule.pp))
        step = slowest * m / (1 - self.schedule.bubble) + 2 * (self.schedule.stages - 1) * self.send_seconds
        sends = 2 * m * self.schedule.virtual
        traffic = {"pp": Traffic(self.link, sends, sends * max(self.sent_bytes, default=0), sends * self.send_seconds)}
        return StepTime(slowest * m, step - slowest * m, traffic)

    @property
    def step_seconds(self) -> float:
        return self.predicted.total

    def lines(self) -> list[str]:
        s = self.schedule
        bubble = (f"bubble {s.bubble:.1%} ((pp-1)/(v*m+pp-1))" if s.bubble is not None else
                  "bubble not modeled (a backward split into input and weight gradients)")
        out = [f"pipeline: {s.name}, pp={s.pp} x {s.virtual} stage{'s' if s.virtual > 1 else ''} a rank, "
               f"{s.microbatches} microbatches; {bubble}"]
        total = sum(st.seconds for st in self.stages) or 1.0
        for i, st in enumerate(self.stages):
            time = duration_text(st.seconds) if self.machine else f"{st.seconds / total:.1%} of the model's time"
            out.append(f"  stage {i} (pp rank {SCHEDULES[s.name].rank_of(i, s.pp)}): {_block_span(st.blocks)}; {time} a microbatch; "
                       f"{bytes_text(st.memory)} (parameters {bytes_text(st.parameter_bytes)}, activations "
                       f"{bytes_text(st.activation_bytes)} a microbatch x {st.in_flight} in flight)")
        for i, (sent, whole, piece) in enumerate(zip(self.sent_bytes, self.sent_whole, self.piece_bytes)):
            how = f"; whole on cp in the plan, so sent whole: {', '.join(whole)}" if whole else ""
            out.append(f"  cut {i}->{i + 1}: {sent:,} bytes a microbatch a rank ({self.link}{how}), and back the "
                       f"gradients of those that need one; the rank's own piece {piece:,}")
        if self.machine and s.bubble is not None:
            out.append(f"  predicted training step on {self.machine}: {duration_text(self.step_seconds)}")
        return out


def _block_span(blocks: list[str]) -> str:
    """``layers.0..3 (4 blocks)``; a run across two lists names both ends whole."""
    if len(blocks) == 1:
        return blocks[0]
    first, last = blocks[0].rpartition("."), blocks[-1].rpartition(".")
    end = last[2] if first[0] == last[0] else blocks[-1]
    return f"{blocks[0]}..{end} ({len(blocks)} blocks)"


def pipeline_plan(stages: list[StagePlan], crossing: list[list[fx.Node]], gm: fx.GraphModule, mesh: MeshInfo,
                  schedule: ScheduleRun, machine: Machine | None) -> PipelinePlan:
    """The report of ``stages`` whose cuts send ``crossing`` (values of the captured graph): each
    as ``pipeline`` sends it (``sent_dims``: each cp rank its sequence piece, where the plan of
    ``gm``, its planned graph, cuts it so; else whole), and the piece the plan cuts of it on every
    dim. The pp group of rank 0 spans one stage's ranks (its mesh's size) apart."""
    planned = {n.name: n for n in gm.graph.nodes}
    dims = [sent_dims(values, gm) for values in crossing]
    sent = [sum(math.prod(sent_shape(v, d, mesh)) * _value(v).element_size() for v, d in zip(values, ds))
            for values, ds in zip(crossing, dims)]
    whole = [[v.name for v, d in zip(values, ds) if d is None and mesh.size("cp") > 1]
             for values, ds in zip(crossing, dims)]
    pieces = [sum(_piece_bytes(v, planned, mesh) for v in values) for values in crossing]
    rates = machine or REFERENCE
    apart = mesh.world_size // mesh.stages
    link = "inter_node" if (schedule.pp - 1) * apart >= rates.devices_per_node else "intra_node"
    seconds = rates.collective_seconds("permute", max(sent, default=0), 2, link)
    return PipelinePlan(schedule, stages, sent, whole, pieces, seconds, link, machine and machine.name)
