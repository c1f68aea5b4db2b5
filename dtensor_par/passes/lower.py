"""lower: the last pass. Names on the local graph's collectives how they reach the network (the
lowering, resolved from the config and the inputs' devices when the context is made, so that
localize already counts what it sends) and checks the replica groups that takes.

- ``"functional"``: torch's functional collectives over process groups, as localize inserted
  them (NCCL, gloo, TorchNeuron's ``neuron`` backend).
- ``"xla"``: every collective call, and through it its backward, the ring rotations and the
  Ulysses exchange, issues ``torch_xla.core.xla_model`` calls with full replica groups
  (``ops.lowerings.Xla``); no group name is relied on. Whatever the device. Expert
  parallelism's rows go padded to the worst case, by even all-to-alls (``ops.experts``).
- ``"auto"``: ``"xla"`` when an input is on an xla device, else ``"functional"``.

Each collective node already carries its mesh dim's layout (``mesh.MeshDim``), so lowering
only names the lowering on it. The runtime's own collectives (input slicing, parameter
gradient gathers) follow ``ctx.comm``.

Checks, each an error naming the mesh dim and its groups: every mesh dim's groups are of
equal size, disjoint and cover every rank; on Neuron (``device_type="neuron"``) or with the
xla lowering, all-to-all groups are runs of contiguous ranks and the program uses at most
``replica_group_limit`` distinct replica-group sets; xla's permute pairs form rings.
"""

from __future__ import annotations

import torch.fx as fx

from ..errors import InvalidPlan
from ..mesh import SPANS, MeshDim, MeshInfo
from ..ops.lowerings import FUNCTIONAL, ring_pairs, xla_model
from .context import ParallelContext
from .localize import graph_communications
from .meta import Communication, communications


def _groups_text(groups) -> str:
    return str([list(g) for g in groups])


def check_partition(dim: MeshDim, world: int) -> None:
    """xm takes a mesh dim's groups as one list: equal-size, disjoint and covering every rank."""
    ranks = [r for g in dim.groups for r in g]
    problem = ("groups of unequal sizes" if len({len(g) for g in dim.groups}) > 1 else
               "a rank in two groups" if len(set(ranks)) != len(ranks) else
               "groups that do not cover the world" if sorted(ranks) != list(range(world)) else None)
    if problem:
        raise InvalidPlan(f"lower: mesh dim {dim.name!r} has {problem}: {_groups_text(dim.groups)} "
                         f"(world size {world}); its groups must be equal-size, disjoint and cover every rank")


def check_contiguous(dim: MeshDim, order: tuple[str, ...]) -> None:
    """Neuron's all-to-all takes only groups of contiguous ranks."""
    if all(sorted(g) == list(range(min(g), min(g) + len(g))) for g in dim.groups):
        return
    spans = SPANS[dim.name]
    works = tuple(d for d in order if d not in spans) + spans
    fallback = " or ulysses_impl='all_gather'" if dim.name == "ulysses" else ""
    raise InvalidPlan(
        f"lower: an all-to-all over mesh dim {dim.name!r} needs groups of contiguous ranks on Neuron, "
        f"but its groups are {_groups_text(dim.groups)} (mesh order {order}); build the mesh with "
        f"init_mesh(..., order={works}) ({' x '.join(spans)} innermost){fallback}")


def check_circular(pairs: list[list[int]], dim: MeshDim) -> None:
    """Neuron permutes only in rings: every rank in the pairs sends once and receives once,
    never to itself."""
    sources, targets = [s for s, _ in pairs], [t for _, t in pairs]
    if len(set(sources)) != len(pairs) or set(sources) != set(targets) or any(s == t for s, t in pairs):
        raise InvalidPlan(f"lower: collective_permute pairs {pairs} over mesh dim {dim.name!r} (groups "
                         f"{_groups_text(dim.groups)}) do not form rings")


def replica_group_sets(comms: list[Communication], mesh: MeshInfo, comm: str) -> dict[str, tuple]:
    """Each distinct replica-group set the program uses (forward and backward), by what uses it
    first: a mesh dim's groups, or an xla rotation's permute pairs."""
    sets: dict[str, tuple] = {}
    for c in comms:
        for op in (c.forward, c.backward):
            if op is None:
                continue
            dim = mesh.dims[c.mesh_dim]
            rotates = op == "ring_rotate" and comm == "xla"
            key = tuple(map(tuple, ring_pairs(dim))) if rotates else dim.groups
            if key not in sets.values():
                sets[f"{c.mesh_dim} {'permute pairs' if rotates else 'groups'}"] = key
    return sets


def check_lowering(comms: list[Communication], mesh: MeshInfo, comm: str, limit: int) -> dict[str, tuple]:
    """Every check above; returns the replica-group sets."""
    used = {c.mesh_dim for c in comms}
    for name in used:
        check_partition(mesh.dims[name], mesh.world_size)
    if comm == "xla" and "ring" in used:
        check_circular(ring_pairs(mesh.dims["ring"]), mesh.dims["ring"])
    sets = replica_group_sets(comms, mesh, comm)
    if comm == "xla" or mesh.device_type == "neuron":
        check_all_to_all_contiguous(comms, mesh)
        check_replica_group_limit(sets, limit)
    return sets


def check_all_to_all_contiguous(comms: list[Communication], mesh: MeshInfo) -> None:
    """Every mesh dim an all-to-all runs over has groups of contiguous ranks (Neuron)."""
    for name in sorted({c.mesh_dim for c in comms if "all_to_all" in (c.forward, c.backward)}):
        check_contiguous(mesh.dims[name], mesh.order)


def check_replica_group_limit(sets: dict[str, tuple], limit: int) -> None:
    """A Neuron program uses at most ``limit`` distinct replica-group sets."""
    if len(sets) > limit:
        listed = "; ".join(f"{what}: {list(map(list, key))}" for what, key in sets.items())
        raise InvalidPlan(f"lower: the program uses {len(sets)} distinct replica-group sets, over the "
                         f"limit of {limit} (replica_group_limit; Neuron runtimes before 2.32 take 12): {listed}")


def lower_pass(gm: fx.GraphModule, ctx: ParallelContext) -> fx.GraphModule:
    """Names ``ctx.comm`` (resolved with the context) on every collective node."""
    if ctx.comm == "xla":
        xla_model()  # fail at plan time, not at the first collective
    ctx.replica_group_sets = check_lowering([c for _, c in graph_communications(gm)], ctx.mesh, ctx.comm,
                                            ctx.config.replica_group_limit)
    if ctx.comm != FUNCTIONAL:
        for node in gm.graph.nodes:
            if node.op == "call_function" and communications(node):
                node.update_kwarg("comm", ctx.comm)
    gm.recompile()
    return gm
