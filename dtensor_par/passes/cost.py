"""cost: a rank's predicted step time and activation memory, read off its localized graph.

The graph says what one rank does: each op's FLOPs and output bytes (``meta.work``, recorded
by coverage) and each collective with its bytes and mesh dim (``meta.communications``). A
machine profile (``machines.Machine``) turns them into seconds, and the mesh order decides
which link each collective crosses: a mesh dim whose groups hold ranks of two nodes crosses
``inter_node`` links, any other ``intra_node``.

The schedule is the one ``passes.overlap`` lays out: ops compute one at a time in graph
order; a collective that localize inserted is issued as soon as its input exists and runs
on the network while later ops compute, until its first reader waits for it. Collectives
run one at a time, in the order they are issued. A collective inside an op holds the op up
(Ulysses' exchanges, a sharded norm's sums), except ring attention's rotations, which run
behind the op's own block computations.

A recurrence over the sequence (``ops.recurrence``) counts its kind's FLOPs at attention's rate.
Ops other than matmuls, attention and recurrences (norms, pointwise ops, copies) cost what the profile's
``elementwise`` says of the bytes they write, and nothing where it has none (the built-in
profiles). A collective's ``collective_compute_share`` of its time also occupies the compute
stream: what compute beside a collective does not hide, as calibrate measures it (all of it
for gloo on ranks that oversubscribe the CPU cores; none in the built-in profiles).

Training adds the backward, after the forward, in reverse graph order: each op computes
``BACKWARD_TIMES`` times its forward (a matmul's or attention's FLOPs: the gradients of its
inputs and of its weights; another op's bytes, where its output is floating: the gradients of
its inputs, two for most); each backward collective a Communication records is issued once the
gradients of its node's users exist. An op that activation checkpointing recomputes
(``saved.recomputed_ops``) runs its forward again in backward, its collectives included.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable, Iterable

import torch
import torch.fx as fx

from ..machines import Machine
from ..mesh import MeshInfo
from ..ops import collectives as C
from .context import ParallelContext
from .localize import graph_communications
from .meta import Communication, communications, work
from .saved import kept_for_backward, recomputed_ops

BACKWARD_TIMES = 2
"""An op's backward time over its forward time."""
KIND = {"ring_rotate": "permute"}
"""A Communication's op -> the collective kind a machine profile times, where they differ."""


@dataclass(frozen=True)
class Traffic:
    """What one mesh dim's collectives move in a step."""

    link: str  # the link class its groups cross
    collectives: int
    bytes: int  # this rank's bytes into them
    seconds: float  # their time on the link, hidden behind compute or not


@dataclass(frozen=True)
class StepTime:
    """A step's predicted time on one rank."""

    compute: float  # seconds of matmuls and attention, and of other ops where the profile times them
    exposed_communication: float  # seconds the step waits for collectives
    traffic: dict[str, Traffic]  # by mesh dim

    @property
    def total(self) -> float:
        return self.compute + self.exposed_communication

    def __str__(self) -> str:
        return (f"{duration_text(self.total)} (compute {duration_text(self.compute)}, exposed communication "
                f"{duration_text(self.exposed_communication)})")

    def __add__(self, other: StepTime) -> StepTime:
        """Two graphs run one after the other (a step of a model that Dynamo captured in parts)."""
        traffic = dict(self.traffic)
        for dim, t in other.traffic.items():
            mine = traffic.get(dim, Traffic(t.link, 0, 0, 0.0))
            traffic[dim] = Traffic(t.link, mine.collectives + t.collectives, mine.bytes + t.bytes,
                                   mine.seconds + t.seconds)
        return StepTime(self.compute + other.compute, self.exposed_communication + other.exposed_communication,
                        traffic)


def duration_text(seconds: float) -> str:
    """``1.23 ms``: three significant digits in the unit that keeps them above 1."""
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if seconds >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds / 1e-9:.3g} ns"


def bytes_text(nbytes: int) -> str:
    """``1.5 GiB``: three significant digits in the binary unit that keeps them above 1."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.3g} {unit}"
    return f"{nbytes} B"


@dataclass(frozen=True)
class _NodeTime:
    compute: float = 0.0
    held: float = 0.0  # collectives inside the op, before it computes
    hidden: float = 0.0  # collectives inside the op, behind its compute
    issued: float = 0.0  # the node's own collectives, on the network stream


def traffic_text(traffic: dict[str, Traffic]) -> str:
    """``tp: 16 collectives, 8 MiB, intra_node``: each mesh dim's collectives in a step, and the links they cross."""
    return ", ".join(f"{d}: {t.collectives} collectives, {bytes_text(t.bytes)}, {t.link}"
                     for d, t in traffic.items()) or "no collectives"


def link_classes(mesh: MeshInfo, devices_per_node: int) -> dict[str, str]:
    """Mesh dim -> the link class its collectives cross."""
    return {name: "inter_node" if any(len({r // devices_per_node for r in g}) > 1 for g in dim.groups)
            else "intra_node" for name, dim in mesh.dims.items()}


def _issued(c: Communication, direction: str) -> tuple[str, int] | None:
    """(kind, bytes) of the collective ``c`` issues in ``direction``, if it issues one."""
    op, nbytes = (c.forward, c.forward_bytes) if direction == "forward" else (c.backward, c.backward_bytes)
    return None if op is None else (KIND.get(op, op), nbytes)


def _collectives(node: fx.Node, direction: str) -> list[tuple[str, int, Communication]]:
    """(kind, bytes, Communication) of each collective the node issues in ``direction``."""
    return [(*issued, c) for c in communications(node) if (issued := _issued(c, direction))]


def _compute_seconds(node: fx.Node, machine: Machine, direction: str) -> float:
    """The node's own compute in ``direction``: its FLOPs at its engine's rate, or its output
    at the elementwise rate (backward: only a floating output has a gradient)."""
    done = work(node)
    if done is None:
        return 0.0
    if done.engine:
        seconds = done.flops / machine.flops_per_second(done.engine, done.dtype) if done.flops else 0.0
    elif direction == "forward" or getattr(torch, done.dtype).is_floating_point:
        seconds = machine.elementwise_seconds(done.out_bytes)
    else:
        return 0.0
    return seconds if direction == "forward" else BACKWARD_TIMES * seconds


def _node_time(node: fx.Node, machine: Machine, links: dict[str, str], direction: str) -> _NodeTime:
    compute = _compute_seconds(node, machine, direction)
    own = node.op == "placeholder" or node.target in C.COMMUNICATION  # issued ahead (runtime's, localize's)
    held = hidden = issued = 0.0
    for kind, nbytes, c in _collectives(node, direction):
        seconds = machine.collective_seconds(kind, nbytes, c.group_size, links[c.mesh_dim])
        if own:
            issued += seconds
        elif kind == "permute":
            hidden += seconds
        else:
            held += seconds
    return _NodeTime(compute, held, hidden, issued)


def _backward_time(node: fx.Node, recomputed: bool, machine: Machine, links: dict[str, str]) -> _NodeTime:
    """The node's backward, after its forward again where backward recomputes it (activation
    checkpointing): its compute and, for a collective, its forward collective too."""
    back = _node_time(node, machine, links, "backward")
    if not recomputed:
        return back
    again = _node_time(node, machine, links, "forward")
    return _NodeTime(*(a + b for a, b in zip(dataclasses.astuple(back), dataclasses.astuple(again))))


def node_seconds(node: fx.Node, machine: Machine, links: dict[str, str], training: bool, recomputed: bool) -> float:
    """The node's time with nothing overlapped but ring attention's rotations: its compute and its
    collectives, forward and with ``training`` backward (``recomputed``: its forward again there).
    What a part of a graph costs alone (a pipeline stage's blocks), where ``cost_pass`` times a
    whole graph."""
    times = [_node_time(node, machine, links, "forward")]
    if training:
        times.append(_backward_time(node, recomputed, machine, links))
    return sum(t.held + max(t.compute, t.hidden) + t.issued for t in times)


def _run(nodes: Iterable[fx.Node], needs: Callable[[fx.Node], list[fx.Node]],
         time_of: Callable[[fx.Node], _NodeTime], share: float) -> tuple[float, float]:
    """(end, compute seconds) of the nodes run in order on one compute and one network stream,
    each node starting once the nodes it ``needs`` are done; ``share`` of each collective's
    time occupies the compute stream too."""
    done: dict[fx.Node, float] = {}
    computing = networking = compute = 0.0
    for node in nodes:
        t = time_of(node)
        ready = max((done[n] for n in needs(node) if n in done), default=0.0)
        if t.compute or t.held or t.hidden:
            computing = ready = max(computing, ready) + t.held + max(t.compute + share * t.hidden, t.hidden)
        if t.issued:
            networking = ready = max(networking, ready) + t.issued
            computing += share * t.issued
        done[node] = ready
        compute += t.compute
    return max(computing, networking), compute


def _traffic(gm: fx.GraphModule, machine: Machine, links: dict[str, str], directions: tuple[str, ...]
             ) -> dict[str, Traffic]:
    traffic: dict[str, Traffic] = {}
    for _, c in graph_communications(gm):
        for kind, nbytes in filter(None, (_issued(c, direction) for direction in directions)):
            t = traffic.get(c.mesh_dim, Traffic(links[c.mesh_dim], 0, 0, 0.0))
            seconds = machine.collective_seconds(kind, nbytes, c.group_size, t.link)
            traffic[c.mesh_dim] = Traffic(t.link, t.collectives + 1, t.bytes + nbytes, t.seconds + seconds)
    return traffic


def cost_pass(gm: fx.GraphModule, ctx: ParallelContext, machine: Machine, *, layout: MeshInfo | None = None,
              training: bool = True) -> StepTime:
    """The predicted step of this rank's graph ``gm`` on ``machine``: the forward, and with
    ``training`` the backward. ``layout``: the mesh whose groups the collectives run over
    (default: the planned one; another order of its degrees moves them onto other links)."""
    links = link_classes(layout or ctx.mesh, machine.devices_per_node)
    nodes = list(gm.graph.nodes)
    share = machine.collective_compute_share
    runs = [_run(nodes, lambda n: n.all_input_nodes, lambda n: _node_time(n, machine, links, "forward"), share)]
    if training:
        recomputed = recomputed_ops(gm)
        runs.append(_run(reversed(nodes), lambda n: list(n.users),
                         lambda n: _backward_time(n, n in recomputed, machine, links), share))
    end, compute = (sum(r[i] for r in runs) for i in range(2))
    directions = ("forward", "backward") if training else ("forward",)
    return StepTime(compute, end - compute, _traffic(gm, machine, links, directions))


def activation_bytes(gm: fx.GraphModule, training: bool) -> int:
    """Bytes of op outputs one rank holds at most: with ``training``, those kept for the
    backward (``saved.kept_for_backward``: activation checkpointing keeps fewer); without, the
    peak of outputs still to be read, in graph order."""
    if training:
        return kept_for_backward(gm).bytes
    nodes = list(gm.graph.nodes)
    outputs = [(i, done.out_bytes) for i, n in enumerate(nodes) if (done := work(n))]
    position = {n: i for i, n in enumerate(nodes)}
    freed_after = defaultdict(int)
    for i, nbytes in outputs:
        freed_after[max((position[u] for u in nodes[i].users), default=i)] += nbytes
    held = peak = 0
    made = dict(outputs)
    for i in range(len(nodes)):
        held += made.get(i, 0)
        peak = max(peak, held)
        held -= freed_after[i]
    return peak
