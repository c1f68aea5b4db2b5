"""The plan cache: a job run again reads each rank's plans from disk instead of planning them,
and computes what one device does; a change to anything a plan depends on misses it."""

from __future__ import annotations

import glob
import logging
import os
import tempfile

import pytest
import torch

import dtensor_par
from dtensor_par import plancache
from dtensor_par._testing import models, patterns
from dtensor_par._testing.harness import assert_matches, compare, logged, run_ranks
from tests.background import in_background

LENGTHS = (8, 12, 16)  # the first compiles static, the second symbolic: two plans per rank


def _gpt(layers: int = 1) -> torch.nn.Module:
    return models.GPT(layers=layers)


def _job(mesh, make_model=_gpt, inner_backend="eager", **options) -> dict:
    """A fresh compile of the model on ``mesh`` (as a new process makes it) trained over LENGTHS
    against one device; how many plans it made, how many it read from the cache, what it warned.
    The inner backend is no part of a plan's key: the warm runs trace the plans they read
    through AOTAutograd, the others run their local graphs as they are (CI time)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    backend = dtensor_par.hybrid_parallel(mesh, inner_backend=inner_backend, plan_cache=True, **options)
    inputs = [(torch.randn(2, seq, 32),) for seq in LENGTHS]
    with logged(logging.INFO) as records:
        worst = compare(make_model(), inputs, lambda m: torch.compile(m, backend=backend))
    messages = [r.getMessage() for r in records]
    return {**worst, "plans": sum("planned graph" in m for m in messages),
            "read": sum("plan read from the plan cache" in m for m in messages),
            "unreadable": sum("unreadable plan cache entry" in m for m in messages)}


def _with_source_digest(mesh, digest: str) -> dict:
    """The job as if dtensor_par's source had changed."""
    real = plancache.source_digest
    plancache.source_digest = lambda: digest
    try:
        return _job(mesh)
    finally:
        plancache.source_digest = real


def _corrupt_entries(mesh, cache: str) -> dict:
    """The job after every stored plan was overwritten with garbage."""
    for path in glob.glob(os.path.join(cache, plancache.PLANS_DIR, "*.pkl")):
        with open(path, "wb") as f:
            f.write(b"not a plan")
    return _job(mesh)


def _buffer_job(mesh, ones_at: int | None = None) -> dict:
    """Attention under a causal mask kept in a buffer (read as causal attention), compiled afresh
    and run twice against one device (forward, backward, an SGD step); before run ``ones_at``, if
    given, its buffer is set to all ones in place (no mask). How many plans it made, how many it
    read from the cache, how many it made because the buffer changed; the worst of both runs
    against one device."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = patterns.BufferMaskedAttention()
    compiled = torch.compile(model, backend=dtensor_par.hybrid_parallel(mesh, inner_backend="eager", plan_cache=True))
    with logged(logging.INFO) as records:
        runs = []
        for run in range(2):
            if run == ones_at:
                model.bias.fill_(1)
            runs.append(compare(model, [(torch.randn(2, 16, 32),)], lambda m: compiled))
    messages = [r.getMessage() for r in records]
    worst = {"forward_abs": max(r["forward_abs"] for r in runs), "grad_rel": max(r["grad_rel"] for r in runs),
             "least_step": min(r["least_step"] for r in runs),
             "one_sided_grads": [g for r in runs for g in r["one_sided_grads"]]}
    return {**worst, "plans": sum("planned graph" in m for m in messages),
            "read": sum("plan read from the plan cache" in m for m in messages),
            "changed": sum("bias, which the plan read" in m for m in messages)}


def _runs(rank: int, world: int, *, cache: str) -> dict:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache  # the plan cache's folder, as inductor's
    mesh = dtensor_par.init_mesh(tp=2)  # one mesh: a new one's process groups have other names, so other keys
    return {"cold": _job(mesh), "warm": _job(mesh, inner_backend="aot_eager"),
            "other config": _job(mesh, grad_bucket_mb=1.0), "other graph": _job(mesh, lambda: _gpt(layers=2)),
            "other source": _with_source_digest(mesh, "changed"), "sp cold": _job(mesh, sequence_parallel=True),
            "sp warm": _job(mesh, inner_backend="aot_eager", sequence_parallel=True),
            "corrupt": _corrupt_entries(mesh, cache), **_buffer_runs(dtensor_par.init_mesh(ring=2))}


def _buffer_runs(mesh) -> dict:
    """The buffer's jobs in order, each reading the cache the ones before wrote."""
    return {"buffer cold": _buffer_job(mesh), "buffer warm": _buffer_job(mesh),
            "buffer ones": _buffer_job(mesh, ones_at=0), "buffer changed": _buffer_job(mesh, ones_at=1)}


def _launch() -> list[dict]:
    """Each rank's runs, with a plan cache in a temporary folder."""
    with tempfile.TemporaryDirectory() as cache:
        return run_ranks(2, _runs, cache=cache)


LAUNCH = in_background(_launch)


def _counted(run: str, expected: dict) -> None:
    """Job ``run`` within the tolerances against one device on every rank, and its counts of
    plans made, read and so on ``expected`` on every rank."""
    per_rank = [rank[run] for rank in LAUNCH.result()]
    assert_matches(run, per_rank)
    for rank, got in enumerate(per_rank):
        assert {key: got[key] for key in expected} == expected, (run, rank, got)


WARM_START = {"cold": {"plans": 2, "read": 0}, "warm": {"plans": 2, "read": 2},
              **dict.fromkeys(("other config", "other graph", "other source", "sp cold"), {"plans": 2, "read": 0}),
              "sp warm": {"plans": 2, "read": 1},  # the static plan only
              "corrupt": {"read": 0, "unreadable": 2}}
"""Each job of ``_runs`` -> its counts on every rank."""


@pytest.mark.parametrize("run", WARM_START)
def test_a_warm_start_reads_every_plan_and_a_changed_key_reads_none(run):
    """Each rank: the second run of a job reads both its plans and computes what one device
    does; another plan option, another graph or another dtensor_par source plans afresh. A
    symbolic plan that decided on its sizes (Megatron-SP's divisibility by tp) is not stored,
    and an unreadable entry is planned again, with a warning."""
    _counted(run, WARM_START[run])


BUFFER = {"buffer cold": {"plans": 1, "read": 0, "changed": 0}, "buffer warm": {"plans": 1, "read": 1, "changed": 0},
          "buffer ones": {"plans": 1, "read": 0, "changed": 0}, "buffer changed": {"plans": 2, "read": 0, "changed": 1}}
"""Each job of ``_buffer_runs`` -> its counts on every rank."""


@pytest.mark.parametrize("run", BUFFER)
def test_a_plan_that_read_a_buffer_holds_only_while_the_buffer_keeps_its_values(run):
    """A causal mask kept in a buffer is planned as causal attention, its values not in the plan
    key: a plan read from the cache for a buffer holding other values (all ones: no mask) is
    planned again, and so is a plan whose buffer changes in place between two runs (the
    reason logged); each run is exact against one device."""
    _counted(run, BUFFER[run])
