"""Plan a model at any mesh size in one process, with no process group, and report the plan."""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field

import torch.utils._pytree as pytree

from .config import ParallelConfig
from .dump import (GraphDump, activations, activations_line, batch_line, collective_rows, fsdp_line, mesh_svg,
                   parameter_rows, site_placement_lines, sites_text)
from .gcpause import paused_gc
from .machines import Machine, machine as machine_profile
from .planning import parallelize_graph
from .routing import UNMEASURED, measure_routing, routing_probes
from .mesh import MeshInfo, split_degrees
from .params import SHARDED, WHOLE
from .passes import meta
from .passes.capture import capture_graphs
from .passes.cost import StepTime, cost_pass, traffic_text
from .passes.coverage import Coverage
from .passes.sites import MoESite
from .pipeline_plan import SCHEDULES, PipelinePlan, ScheduleRun, pipeline_plan
from .pipelining import cut_by_cost, microbatch_of
from .sharded import cast_floating, sharded_state, traced_in
from .symbolic import hint


@dataclass
class GraphReport:
    sites: list[str]
    placements: list[str]
    parameters: list[dict]
    collectives: list[dict]
    warnings: list[str]
    plan_seconds: float  # the passes alone, without Dynamo's capture
    coverage: Coverage  # what runs split: linear FLOPs, parameters, fallback gathers
    lowering: str  # how the collectives are lowered: "functional" or "xla"
    replica_group_sets: int  # distinct replica-group sets the program uses (a Neuron limit)
    symbolic: list[str] = field(default_factory=list)  # the sizes the plan is symbolic in; empty: static
    specialized: list[str] = field(default_factory=list)  # conditions the plan put on them, and the op that did
    batch: str | None = None  # how the batch is cut over the dp dims (dump.batch_line); None without dp
    fsdp: str | None = None  # which parameters FSDP cuts (dump.fsdp_line); None where it cuts none
    predicted: StepTime | None = None  # on the machine explain was given (passes.cost); None without one
    activations: dict | None = None  # kept for backward, with and without checkpointing (dump.activations)


@dataclass
class Report:
    """What ``explain`` found; ``str(report)`` is a readable text report."""

    sizes: dict[str, int]
    order: tuple[str, ...]
    device_type: str
    parameter_state: str  # which mode the parameter bytes describe: sharded or full
    graphs: list[GraphReport] = field(default_factory=list)
    machine: str | None = None  # the profile the predicted times are for
    training: bool = True  # whether they are of a training step or of a forward
    pp: int = 1  # pipeline stages over ranks: the graphs are then the whole model over one stage's mesh
    pipeline: PipelinePlan | None = None  # its stages, with pp > 1

    @property
    def world_size(self) -> int:
        return math.prod(self.sizes.values()) * self.pp

    @property
    def parameter_bytes(self) -> tuple[int, int]:
        """(bytes per rank, bytes of the full model) over all graphs' parameters."""
        rows = {r["name"]: r for g in self.graphs for r in g.parameters}.values()
        return sum(r["bytes_per_rank"] for r in rows), sum(r["bytes"] for r in rows)

    def svg(self) -> str:
        lines = [line for g in self.graphs for line in g.placements]
        return mesh_svg(self.sizes, self.order, lines)

    def __str__(self) -> str:
        mesh = " x ".join([f"pp={self.pp}"] * (self.pp > 1) + [f"{d}={self.sizes[d]}" for d in self.order])
        local, full = self.parameter_bytes
        out = [f"dtensor_par plan: mesh {mesh} ({self.world_size} ranks, {self.device_type}, last dim contiguous)",
               f"parameters: {local:,} bytes held per rank of {full:,} ({local / max(full, 1):.1%}); their "
               f"gradients as much, AdamW's exp_avg and exp_avg_sq {2 * local:,}; state {self.parameter_state}"]
        if self.pipeline is not None:
            out[1] += " (of the whole model over one stage's mesh: a rank holds its stages', below)"
            out += self.pipeline.lines()
        for i, g in enumerate(self.graphs):
            out.append(f"\ngraph {i}: {len(g.sites)} sites; {g.coverage.summary()}")
            out += [f"  {s}" for s in g.sites]
            out += [f"  {line}" for line in (g.batch, g.fsdp) if line]
            out.append("  weight placements:")
            out += [f"    {p}" for p in g.placements]
            out.append("  collectives (direction op mesh-dim[group] bytes-per-rank x count, site):")
            out += [f"    {c['direction']:8} {c['op']:14} {c['mesh_dims']}[{c['group_size']}] "
                    f"{c['bytes_per_rank']:>12,} B x {c['count']}  {c['site']}" for c in g.collectives]
            out.append(f"  replica-group sets: {g.replica_group_sets} ({g.lowering})")
            if g.activations is not None:
                out.append(f"  {activations_line(g.activations)}")
            if g.predicted is not None:
                step = "training step" if self.training else "forward"
                out.append(f"  predicted {step} on {self.machine}: {g.predicted}; {traffic_text(g.predicted.traffic)}")
            out.append(f"  sizes: symbolic in {', '.join(g.symbolic)} (one plan for every size; bytes at these sizes)"
                       if g.symbolic else "  sizes: static (planned for these sizes only)")
            if g.specialized:
                out.append("  specialized on (a size outside these conditions is planned again):")
                out += [f"    {s}" for s in g.specialized]
            for site, flops in g.coverage.ring_attention_flops.items():
                out.append(f"  {site}: attention FLOPs per ring rank {[f'{f:,}' for f in flops]}")
            if g.coverage.output_gathers:
                out.append("  outputs gathered before their last reshapes (as many bytes as at the output):")
                out += [f"    {f}" for f in g.coverage.output_gathers]
            if g.coverage.fallback_gathers:
                out.append("  fallback gathers (correct, but not parallel):")
                out += [f"    {f}" for f in g.coverage.fallback_gathers]
            if g.warnings:
                out.append("  warnings:")
                out += [f"    {w}" for w in g.warnings]
        return "\n".join(out)


def explain(model, example_inputs, *, device_type: str = "cuda",
            order: tuple[str, ...] | None = None, parallelized: bool | None = None,
            example_kwargs: dict | None = None, dynamic: bool | None = None, machine: str | Machine | None = None,
            training: bool = True, measure_routing: bool = False, pp: int = 1, microbatches: int | None = None,
            schedule: str = "1F1B", whole_inputs: tuple[str, ...] = (), **options) -> Report:
    """Plan ``model(*example_inputs, **example_kwargs)`` for the given mesh as rank 0 would, without hardware.

    The model may live on the ``meta`` device, so a model too large for this machine can be
    planned at its real size; it is not run (``capture_graphs``). Capturing resets Dynamo's caches.
    ``options``: a degree for each mesh dim (``tp=8, ulysses=4``: ``mesh.MESH_DIMS``), and those of
    ``hybrid_parallel`` (``config.ParallelConfig``).
    ``parallelized``: report parameters held as by ``parallelize`` (DTensor pieces, no
    gradient gathers) or as by ``hybrid_parallel`` alone (full); default: as the model is.
    With ``device_type="neuron"`` or ``collectives="xla"`` the plan is checked as Neuron needs it.
    ``dynamic=True``: capture with symbolic sizes (as ``torch.compile(dynamic=True)``) and
    plan on them, reporting the sizes the plan is symbolic in and any op that specialized it.
    ``machine`` (a ``machines`` profile, its name or a JSON profile's path): also predict each
    graph's time there (``passes.cost``), of a training step or, without ``training``, of a forward.
    ``measure_routing``: with experts cut over cp (``ep="cp"``), run the captured graph once on one
    device to report what each mixture's routing of the example inputs sends back (``routing``).
    ``pp`` > 1: plan ``pipeline(..., microbatches=, schedule=)`` as it runs, the example inputs a
    whole batch: its stages and their blocks, each one's time (on ``machine``) and memory, the
    schedule's bubble and the bytes sent across each cut (``pipeline_plan``); the graph is the whole
    model planned over one stage's mesh, on one microbatch (``whole_inputs``: as ``pipeline`` takes it).
    """
    sizes, options = split_degrees(options)
    config = ParallelConfig.of("explain", options)
    info = MeshInfo.for_planning(sizes, device_type, order)
    sizes = {d: info.size(d) for d in info.order}
    config.check_mesh(info, "explain")
    if pp > 1:
        parallelized, dynamic = _pipelined(pp, microbatches, schedule, parallelized, dynamic, training)
    if parallelized is None:
        parallelized = sharded_state(model) is not None or config.param_dtype is not None
    if config.param_dtype is not None and not parallelized:
        raise ValueError(f"explain: param_dtype={config.param_dtype} is how parallelize holds a model: "
                         f"parallelized=False contradicts it")
    feeding = SHARDED if parallelized else WHOLE
    profile = machine_profile(machine) if machine is not None else None
    report = Report(sizes, info.order, device_type, feeding.state_on(info, config),
                    machine=profile and profile.name, training=training, pp=pp)
    with paused_gc():  # capture and passes: ~0.5 s of full collections finding little garbage
        args, kwargs = cast_floating((tuple(example_inputs), example_kwargs or {}), config.param_dtype)
        if pp > 1:
            args, kwargs = microbatch_of((args, kwargs), microbatches, "explain", tuple(whole_inputs))
        with traced_in(model, config.param_dtype):
            captured = capture_graphs(model, *args, dynamic=dynamic, **kwargs)
        for i, (gm, inputs) in enumerate(captured):
            dump = GraphDump(os.path.join(config.dump_dir, f"graph{i}"), info.order) if config.dump_dir else None
            graph, *planned = _graph_report(gm, [hint(a) for a in inputs], info, config, feeding, dump, profile,
                                            training, measure_routing)
            report.graphs.append(graph)
        if pp > 1:
            report.pipeline = _stages(model, captured, (args, kwargs), planned, info,
                                      ScheduleRun(schedule, pp, SCHEDULES[schedule].stages_per_rank, microbatches), profile)
    return report


def _stages(model, captured: list, example: tuple, planned: list, info: MeshInfo, schedule: ScheduleRun,
            machine: Machine | None) -> PipelinePlan:
    """The stages ``pipeline`` cuts of the one captured graph (``planned``: its plan over one
    stage's mesh ``info``), and what crosses each cut."""
    if len(captured) != 1:
        raise NotImplementedError(f"explain: Dynamo captured {len(captured)} graphs of {type(model).__name__}; "
                                  f"pipeline stages are cut from one graph")
    (gm, inputs), = captured
    stages, cut = cut_by_cost(model, gm, inputs, pytree.tree_leaves(example), planned, schedule, machine)
    return pipeline_plan(stages, cut.outputs[:-1], planned[0], info, schedule, machine)


def _pipelined(pp: int, microbatches, schedule: str, parallelized: bool | None, dynamic: bool | None,
               training: bool) -> tuple[bool, bool]:
    """(parallelized, dynamic) as ``pipeline`` plans a stage: parameters held as ``parallelize``
    holds them, static sizes; a training step. Refuses a contradiction or an unknown schedule."""
    if schedule not in SCHEDULES:
        raise ValueError(f"explain: unknown schedule {schedule!r}; the schedules are {list(SCHEDULES)}")
    if not isinstance(microbatches, int) or microbatches < 1:
        raise ValueError(f"explain: pp={pp} needs microbatches= (a positive int, as pipeline takes), got "
                         f"{microbatches!r}")
    if parallelized is False or dynamic or not training:
        raise ValueError(f"explain: pp={pp} plans pipeline's training step, whose stages hold their parameters as "
                         f"parallelize does on static sizes: parallelized=False, dynamic=True and training=False "
                         f"do not apply")
    return True, False


def _with_measured_routing(sites: list[str], ctx, gm, inputs: list, info: MeshInfo, config: ParallelConfig,
                           spec) -> list[str]:
    """The site lines, each mixture's whose experts are cut over cp with what a rank got back
    from them on the example inputs (the most over the ranks)."""
    probes = routing_probes(ctx)
    back = measure_routing(gm, inputs, info, config, probes, spec)
    unmeasured = {s.name for s in ctx.sites if isinstance(s, MoESite) and s.ep_size > 1} - {p.site for p in probes}
    return [f"{line}; measured on the example inputs: {back[name]} B back at most" if name in back else
            f"{line}; {UNMEASURED}" if name in unmeasured else line
            for line, name in zip(sites, (line.split(":")[0] for line in sites))]


def _graph_report(gm, inputs: list, info: MeshInfo, config: ParallelConfig, feeding, dump, machine: Machine | None,
                  training: bool, measure_routing: bool) -> tuple[GraphReport, object, object]:
    """Plan one captured graph at the example sizes (Dynamo's SymInt inputs at their hints):
    its report, its planned graph and context; ``measure_routing``: with the routing of experts
    cut over cp that the graph computes on them."""
    start = time.perf_counter()
    symbolic = meta.symbolic_inputs(gm)
    spec = symbolic.specialization(inputs) if symbolic.symbolic else None
    local_gm, ctx = parallelize_graph(gm, inputs, info, config, feeding=feeding, dump=dump, specialization=spec)
    sites = sites_text(ctx).splitlines()
    plan_seconds = time.perf_counter() - start
    if measure_routing:
        sites = _with_measured_routing(sites, ctx, gm, inputs, info, config, spec)
    return GraphReport(sites, site_placement_lines(ctx), parameter_rows(ctx),
                       collective_rows(local_gm), list(ctx.warnings), plan_seconds, ctx.coverage,
                       ctx.comm, len(ctx.replica_group_sets), spec.symbolic_names() if spec else [],
                       spec.specialized() if spec else [], batch_line(ctx), fsdp_line(ctx),
                       cost_pass(local_gm, ctx, machine, training=training) if machine else None,
                       activations(local_gm, ctx) if training else None), local_gm, ctx
