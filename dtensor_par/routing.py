"""The routing of a mixture of experts measured on example inputs, for ``explain(measure_routing=True)``.

With expert parallelism (``ep="cp"``) what a rank gets back from its experts depends on which
experts its tokens choose: ``explain`` reports the exact rows sent, the even and the worst case
back. Measured, the model runs once on one device; a hook on each mixture's experts module reads
the choice it is given (its ``[tokens, top_k]`` expert indices), and each rank's tokens are the
rows the plan gives it (its piece over cp, then over dp); a group of ranks that exchange rows
spans cp, and dp_shard (within one dp_replicate coordinate) where the experts are cut over it
too. With a local batch each dp_shard rank's rows are its own, which the example inputs are not:
such a mixture is not measured (``UNMEASURED``).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.nn as nn

from .mesh import MeshDim
from .ops.collectives import shard_local
from .passes.context import ParallelContext
from .passes.detect import MoESite, module_name
from .passes.meta import shardings
from .placements import Placement, interleaved_parts, shard_dim


@dataclass(frozen=True)
class RoutingProbe:
    """One mixture whose experts are cut over cp: where to read its choice, how its tokens are cut."""

    site: str
    experts_module: str  # the FQN of the module holding the experts, whose call is given the choice
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
            probes.append(RoutingProbe(site.name, module_name(site.up[0], ctx).rpartition(".")[0], site.num_experts,
                                       tuple((shardings(site.tokens)[d].out, ctx.mesh.dims[d]) for d in dims),
                                       tuple(spans[d] if d in site.ep_over else 1 for d in dims), site.ep_size))
    return probes


def _own_batches(site: MoESite, ctx: ParallelContext) -> bool:
    """Whether the experts' group spans dp_shard ranks that each run a batch of their own."""
    return ctx.mesh.size("dp_shard") > 1 and "dp" not in site.ep_over


def _choice(args: tuple, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(the tokens ``[T, hidden]``, their chosen experts ``[T, k]``) among a call's arguments."""
    tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor) and a.dim() == 2]
    tokens = next((t for t in tensors if t.is_floating_point()), None)
    chosen = next((t for t in tensors if not t.is_floating_point() and tokens is not None
                   and t.shape[0] == tokens.shape[0]), None)
    return None if chosen is None else (tokens, chosen)


def _rank_tokens(count: int, cuts: tuple[tuple[Placement, MeshDim], ...], coordinates: tuple[int, ...]) -> torch.Tensor:
    """The global indices of the tokens one rank holds (its coordinate on each cut dim)."""
    tokens = torch.arange(count)
    for (p, dim), c in zip(cuts, coordinates):
        tokens = shard_local(tokens, 0, interleaved_parts(p), dim._replace(rank=c))
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


def measure_routing(model: nn.Module, args: tuple, kwargs: dict, probes: list[RoutingProbe]) -> dict[str, int]:
    """Run ``model`` once on one device; per probe's site, the most bytes a rank gets back."""
    modules = dict(model.named_modules())
    seen: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    hooks = []
    for probe in probes:
        def read(module, call_args, call_kwargs, probe=probe):
            found = _choice(call_args, call_kwargs)
            if found is not None:
                seen.setdefault(probe.site, found)
        hooks.append(modules[probe.experts_module].register_forward_pre_hook(read, with_kwargs=True))
    try:
        with torch.no_grad():
            model(*args, **kwargs)
    finally:
        for hook in hooks:
            hook.remove()
    return {p.site: measured_back_bytes(p, *seen[p.site]) for p in probes if p.site in seen}
