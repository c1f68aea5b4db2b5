"""What a call of a compiled model runs on each rank beyond one device's graph: the per-rank ops
(profiled, counted where the program calls them) and the runtime's Python after the first call."""

from __future__ import annotations

import contextlib
import copy
from collections import Counter
from unittest import mock

import torch

import dtensor_par
from dtensor_par import params, runtime
from dtensor_par._testing.harness import called_ops, run_ranks_together
from dtensor_par._testing.models import DiT
from tests.background import in_background

TP2_OVER_ONE_DEVICE = Counter({"all_reduce_": 4, "wait_tensor": 4, "mm": 4, "add": 4, "_unsafe_view": 4,
                               "addmm": -4, "view": 4})
"""A 2-block qk-norm DiT's no_grad forward at tp2 (aot_eager), op counts against one device's:

- the plan's collectives: an all-reduce after each rowwise projection (out, down), reduced in
  place (``passes.overlap``), and its wait;
- a rowwise projection's ``addmm`` is ``mm``, all-reduce, then its bias ``add``ed once (the
  2-D ``mm`` is viewed back as ``_unsafe_view``, where ``addmm``'s result was ``view``ed);
- 8 views the identity forwards of the gradient all-reduces trace as (``grad_all_reduce`` on
  each colwise input, ``grad_all_reduce_bucket`` on the 4 qk-norm weights), 4 of them in the
  place of the ``view``s above.

Nothing else: no copy, cast, slice or ``view_as`` per parameter."""

RUNTIME_CHECKS = [(runtime.ParallelRuntime, "_check_devices"), (runtime.ParallelRuntime, "_check_same_inputs"),
                  (runtime, "_check_param_dtype"), (params.ShardedParameters, "check"),
                  (params, "sharding_placements"), (params, "_whole_on_tp")]
"""What the runtime checks or derives once per plan, at the first call of a signature."""


def _ops_of_one_call(fn, x) -> Counter:
    """The ops one (warm) call runs, each counted where the program calls it."""
    fn(x)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn(x)
    return Counter(e.name.split("::")[-1] for e in called_ops(prof.events()))


def per_call(rank: int, world: int) -> dict:
    """Ours (parallelized, aot_eager) and one device's ops of a no_grad forward, the calls of
    ``RUNTIME_CHECKS`` at the first and the next three calls, and the largest difference of the
    outputs."""
    torch.manual_seed(0)
    model, x = DiT(layers=2, dim=64, heads=8, mlp=128, qk_norm=True), torch.randn(1, 16, 64)
    one = torch.compile(copy.deepcopy(model), backend="aot_eager")
    mesh = dtensor_par.init_mesh(tp=world)
    ours = torch.compile(dtensor_par.parallelize(model, mesh, (x,)),
                         backend=dtensor_par.hybrid_parallel(mesh, inner_backend="aot_eager"))
    calls = Counter()
    with torch.no_grad(), _counting(calls):
        first = ours(x)
        at_first = sum(calls.values())
        for _ in range(3):
            later = ours(x)
        after_first = sum(calls.values()) - at_first
        ops = {"ours": _ops_of_one_call(ours, x), "one_device": _ops_of_one_call(one, x)}
        expected = one(x)
    return {"ops": {k: dict(v) for k, v in ops.items()}, "checks_at_first_call": at_first,
            "checks_after_first_call": after_first,
            "diff": max((first - expected).abs().max().item(), (later - expected).abs().max().item())}


def _counting(calls: Counter) -> contextlib.ExitStack:
    """Every ``RUNTIME_CHECKS`` function wrapped to count its calls in ``calls``, until exit."""
    patches = contextlib.ExitStack()
    for owner, name in RUNTIME_CHECKS:
        def counted(*args, _original=getattr(owner, name), _name=name, **kwargs):
            calls[_name] += 1
            return _original(*args, **kwargs)

        patches.enter_context(mock.patch.object(owner, name, counted))
    return patches


LAUNCH = in_background(run_ranks_together, 2, {"per call": (per_call, {})})


def test_tp2_forward_runs_one_devices_ops_and_the_plans_collectives_only():
    for rank in LAUNCH.result():
        r = rank["per call"]
        assert r["diff"] <= 1e-5, r["diff"]
        ours, one = Counter(r["ops"]["ours"]), Counter(r["ops"]["one_device"])
        beyond = Counter(ours)
        beyond.subtract(one)
        assert {op: n for op, n in beyond.items() if n} == dict(TP2_OVER_ONE_DEVICE), (ours, one)


def test_runtime_checks_once_per_plan_not_at_every_call():
    for rank in LAUNCH.result():
        r = rank["per call"]
        assert r["checks_at_first_call"] > 0 and r["checks_after_first_call"] == 0, r
