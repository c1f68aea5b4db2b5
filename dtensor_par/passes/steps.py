"""The pipeline as one table: every step that touches a graph, in order, with what it reads of
the mesh and which node annotations it writes.

``planning.parallelize_graph`` runs ``STEPS`` on a copy of the graph Dynamo captured;
``choose_mesh`` runs a step once for all the meshes that agree on what it and the steps
before it read (``reads``), so that a model is planned over every mesh of a world size in one
process; the dumps name each graph after the step that made it. ``OVERLAP`` is the last step,
run by the inner backend on the graphs AOTAutograd traces from the rank's graph.

A step is ``run(gm, ctx) -> gm``, public and tested on its own. ``reads`` maps a mesh's degrees
(``{"tp": 2, "ring": 1, ...}``) to what the step reads of them (None: nothing); ``writes`` names
the annotations it writes, on the nodes it makes too (``meta.ANNOTATIONS``' keys:
``tests/test_steps.py`` holds each step to them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch.fx as fx

from ..mesh import PLAN
from .batch import batch_pass
from .canonicalize import canonicalize_pass
from .capture import capture_pass, specialize_pass
from .context import ParallelContext
from .coverage import coverage_pass
from .detect import detect_pass
from .expert_loop import expert_loop_pass
from .experts import experts_pass
from .kv_cache import kv_cache_pass
from .localize import localize_pass
from .lower import lower_pass
from .overlap import overlap_pass
from .plan import plan_pass
from .recompute import recompute_pass
from .rewrite import rewrite_pass
from .sequence import sequence_pass

Degrees = dict[str, int]


def _size(degrees: Degrees, plan_dim: str) -> int:
    return math.prod(degrees[n] for n in PLAN[plan_dim].mesh_dims)


def _cp_at_all(degrees: Degrees) -> bool:
    return _size(degrees, "cp") > 1


def _dp_as_one(degrees: Degrees) -> tuple:
    """dp_replicate and dp_shard read only as their product, dp."""
    return _size(degrees, "dp"), *(size for name, size in degrees.items() if name not in PLAN["dp"].mesh_dims)


def _dp(degrees: Degrees) -> int:
    return _size(degrees, "dp")


def _every_degree(degrees: Degrees) -> tuple:
    return tuple(degrees.values())


@dataclass(frozen=True)
class Step:
    """One step of the pipeline."""

    name: str
    run: Callable[[fx.GraphModule, ParallelContext], fx.GraphModule]
    reads: Callable[[Degrees], object] | None  # what it reads of the mesh's degrees; None: nothing
    writes: tuple[str, ...]  # the node annotations it writes (meta.ANNOTATIONS' keys)
    refused_by: Callable[[Degrees], object] | None = None  # what a refusal of it depends on alone, where less
    each_order: bool = False  # it reads the mesh's order too: choose_mesh judges it for each order


STEPS = (
    Step("capture", capture_pass, None, ("param_fqn", "buffer_value")),
    Step("expert_loop", expert_loop_pass, None, ()),
    Step("specialize", specialize_pass, None, ("val", "requires_grad")),
    Step("canonicalize", canonicalize_pass, _cp_at_all, ("val", "requires_grad")),  # grouped kv heads over cp
    Step("detect", detect_pass, None, ("site_role", "weight_names")),
    Step("kv_cache", kv_cache_pass, _dp_as_one, ("val", "requires_grad")),
    Step("rewrite", rewrite_pass, _dp_as_one,  # attention read by passes.scores and passes.biases
         ("val", "requires_grad", "site_role", "communications", "recompute_region")),
    Step("experts", experts_pass, _every_degree,  # its group is cp's or fsdp's by dp_shard apart from dp
         ("val", "requires_grad", "site_role", "communications", "experts_cut_over", "recompute_region")),
    Step("sequence", sequence_pass, _dp_as_one, ("val", "requires_grad")),
    Step("batch", batch_pass, _dp_as_one, ("val", "requires_grad"), refused_by=_dp),  # a batch shorter than dp
    Step("plan", plan_pass, _every_degree, ("shardings", "global_shape")),
    Step("coverage", coverage_pass, None, ("work",)),
    Step("localize", localize_pass, None, ("val", "requires_grad", "global_shape", "shardings", "work",
                                           "communications", "fsdp_gather", "recompute", "recompute_region")),
    Step("lower", lower_pass, None, ("communications",), each_order=True),
    Step("recompute", recompute_pass, None, ("recompute_region", "recompute")),
)
"""Every step, in the order it runs."""

OVERLAP = overlap_pass
"""The step after ``STEPS``, on AOTAutograd's forward and backward graphs (``"aot_eager"``; inductor
runs its own ``raise_comms`` and ``sink_waits``): each collective issued as early as its inputs
allow, its wait at its first reader."""


def steps(first: str | None = None, last: str | None = None) -> tuple[Step, ...]:
    """The steps from ``first`` to ``last``, both included (default: from the first, to the last)."""
    names = [s.name for s in STEPS]
    start = names.index(first) if first else 0
    stop = names.index(last) + 1 if last else len(STEPS)
    return STEPS[start:stop]


def named(*names: str) -> tuple[Step, ...]:
    """The steps of these names, in the pipeline's order (a test runs some alone)."""
    unknown = set(names) - {s.name for s in STEPS}
    if unknown:
        raise ValueError(f"no step is named {sorted(unknown)}; the steps are {[s.name for s in STEPS]}")
    return tuple(s for s in STEPS if s.name in names)
