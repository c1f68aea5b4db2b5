"""The routing of a mixture of experts measured on example inputs, for ``explain(measure_routing=True)``.

With expert parallelism (``ep="cp"``) what a rank gets back from its experts depends on which
experts its tokens choose: ``explain`` reports the exact rows sent, the even and the worst case
back. Measured, the captured graph runs once on one device and each mixture's choice is read
off it (its ``[tokens, top_k]`` expert ids, whatever spells the experts: stacked weights, an
``nn.ModuleList`` looped over), and each rank's tokens are the rows the plan gives it (its
piece over cp, then over dp); a group of ranks that exchange rows spans cp, and dp_shard (within
one dp_replicate coordinate) where the experts are cut over it too. With a local batch each
dp_shard rank's rows are its own, which the example inputs are not: such a mixture is not
measured (``UNMEASURED``).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.fx as fx

from .config import ParallelConfig
from .logs import quiet
from .mesh import MeshDim, MeshInfo
from .ops.collectives import shard_local
from .passes.context import ParallelContext
from .passes.meta import shardings
from .passes.nodes import arguments
from .passes.sites import MoESite
from .passes.steps import steps
from .planning import parallelize_graph
from .placements import Placement, interleaved_parts, shard_dim
from .symbolic import Specialization, hint, materialize_sizes


@dataclass(frozen=True)
class RoutingProbe:
    """One mixture whose experts are cut over cp: how its tokens are cut, and over which ranks."""

    site: str
    num_experts: int
    cuts: tuple[tuple[Placement, MeshDim], ...]  # the tokens' cut over cp, then over dp (a batch entry's run)
    spans: tuple[int, ...]  # per cut: how many consecutive coordinates of it one group spans (1: none)
    ep_size: int  # the ranks the experts are cut over


UNMEASURED = "not measured: with a local batch the experts' rows come from each dp_shard rank's own batch"


def routing_probes(ctx: ParallelContext) -> list[RoutingProbe]:
    """A probe per mixture of a planned graph whose experts are cut over cp (and dp_shard, with a
    global batch: the plan's dp is replicate-major, so a group spans dp_shard's consecutive
    coordinates of it)."""
    probes = []
    for site in ctx.sites:
        if isinstance(site, MoESite) and site.ep_size > 1 and not _own_batches(site, ctx):
            dims = [d for d in ("cp", "dp") if d in shardings(site.tokens)
                    and shard_dim(shardings(site.tokens)[d].out) == 0]
            spans = {"cp": ctx.mesh.size("cp"), "dp": ctx.mesh.size("dp_shard")}
            probes.append(RoutingProbe(site.name, site.num_experts,
                                       tuple((shardings(site.tokens)[d].out, ctx.mesh.dims[d]) for d in dims),
                                       tuple(spans[d] if d in site.ep_over else 1 for d in dims), site.ep_size))
    return probes


def _own_batches(site: MoESite, ctx: ParallelContext) -> bool:
    """Whether the experts' group spans dp_shard ranks that each run a batch of their own."""
    return ctx.mesh.size("dp_shard") > 1 and "dp" not in site.ep_over


def _rank_tokens(count: int, cuts: tuple[tuple[Placement, MeshDim], ...], coordinates: tuple[int, ...]) -> torch.Tensor:
    """The global indices of the tokens one rank holds (its coordinate on each cut dim; a
    symbolic part's length at its hint, as the example inputs have it)."""
    tokens = torch.arange(count)
    for (p, dim), c in zip(cuts, coordinates):
        parts = interleaved_parts(p)
        tokens = shard_local(tokens, 0, parts and tuple(map(hint, parts)), dim._replace(rank=c))
    return tokens


def measured_back_bytes(probe: RoutingProbe, tokens: torch.Tensor, chosen: torch.Tensor) -> int:
    """The most bytes a rank gets back from its experts (the rows every rank of its group sent
    them), over the ranks, for this routing."""
    per_group: dict[tuple[int, ...], torch.Tensor] = {}
    for rank in itertools.product(*[range(dim.size) for _, dim in probe.cuts]):  # its coordinate on each cut
        group = tuple(c // span for c, span in zip(rank, probe.spans))
        counts = torch.bincount(chosen[_rank_tokens(len(tokens), probe.cuts, rank)].flatten(),
                                minlength=probe.num_experts)
        per_group[group] = per_group.get(group, 0) + counts
    worst = max(c.view(probe.ep_size, -1).sum(1).max().item() for c in per_group.values())  # by holder
    return worst * tokens.shape[1] * tokens.element_size()


def measure_routing(gm: fx.GraphModule, inputs: list, mesh: MeshInfo, config: ParallelConfig,
                    probes: list[RoutingProbe], specialization: Specialization | None = None) -> dict[str, int]:
    """Per probe's site, the most bytes a rank gets back, for the choice the captured graph
    ``gm`` makes on ``inputs`` on one device: planned again up to ``detect`` (quietly: its
    warnings are the plan's), which finds each mixture's tokens and the expert ids its dispatch
    sorts (token by token, ``k`` each), and run by an interpreter (its symbolic sizes computed in
    it, as localize makes them), whatever spells the experts."""
    with quiet():
        found, ctx = parallelize_graph(gm, inputs, mesh, config, steps=steps(last="detect"),
                                       specialization=specialization)
    if specialization is not None:
        materialize_sizes(found)
    read = {}
    for site in (s for s in ctx.sites if isinstance(s, MoESite)):
        sorts = [n for n in site.region if n.target in (torch.sort, "sort")]  # by expert: its input is in token order
        if len(sorts) == 1:
            read[site.tokens], read[arguments(sorts[0])["input"]] = (site.name, "tokens"), (site.name, "ids")
    values: dict[str, dict[str, torch.Tensor]] = {}

    class Reader(fx.Interpreter):
        def run_node(self, node):
            value = super().run_node(node)
            if node in read:
                values.setdefault(read[node][0], {})[read[node][1]] = value
            return value

    with torch.no_grad():
        Reader(found).run(*inputs)
    return {p.site: measured_back_bytes(p, got["tokens"], got["ids"].long().view(got["tokens"].shape[0], -1))
            for p in probes if len(got := values.get(p.site, {})) == 2}
