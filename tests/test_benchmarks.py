"""``python -m benchmarks --quick``, ``python -m benchmarks.decode --quick`` and ``python -m
benchmarks.pipeline --quick`` start and write valid JSON (smoke tests: no timing is asserted)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import pytest

from tests import tiers
from tests.background import in_background

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
"""The environment the session started in: tests running meanwhile change this process's."""


def _quick(module: str) -> tuple[subprocess.CompletedProcess, str]:
    """``python -m module --quick --json out`` from the repo root: the run and the JSON it wrote."""
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "out.json")
        run = subprocess.run([sys.executable, "-m", module, "--quick", "--json", out], cwd=ROOT, env=ENV,
                             capture_output=True, text=True, timeout=600)
        return run, open(out).read() if run.returncode == 0 else ""


QUICK, QUICK_DECODE, QUICK_PIPELINE = (in_background(_quick, module) if tiers.SWEEP else None
                                       for module in ("benchmarks", "benchmarks.decode", "benchmarks.pipeline"))
"""The benchmarks' smoke runs, left to ``--sweep`` (``tests.tiers``): they launch the peers and
ours for the report alone; what they compare is checked by the tests of each capability."""


@tiers.MARK
def test_quick_benchmark_writes_json():
    run, written = QUICK.result()
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(written)
    result, = report["results"]
    assert "error" not in result, result
    assert {"step/ours", "forward/ours", "step/one_device", "forward/torch"} <= set(result["ms"]), result["ms"]
    assert result["collectives"]["ours"]["train_forward"]["all_reduce"]["calls"] > 0
    assert set(result["memory"]["ours"]) == {"params", "grads", "optimizer", "saved_activations"}
    assert report["gpu"]["skipped"] == (not __import__("torch").cuda.is_available())
    assert "| model | mesh |" in run.stdout
    flux = report["diffusers"]  # diffusers' transformer: ours and diffusers' own ulysses2 and tp2 ran
    if flux.get("skipped"):
        return
    assert {"forward/ours ulysses2", "forward/ours tp2", "step/diffusers ulysses2 eager",
            "step/diffusers tp2 eager"} <= set(flux["ms"]), flux
    assert set(flux["failed"]) <= {"diffusers tp2 aot_eager"}, flux["failed"]  # Dynamo's RecursionError, recorded


@tiers.MARK
def test_quick_decode_benchmark_decodes_one_devices_tokens_on_half_the_cache():
    pytest.importorskip("transformers", reason="the models extra (pip install -e '.[models]') is not installed")
    run, written = QUICK_DECODE.result()
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(written)
    one, tp = report["rows"]
    decoded = report["setup"]["warmup"] + report["setup"]["steps"]
    assert (one["mesh"], tp["mesh"]) == ("one device", "tp=2"), (one, tp)
    assert "error" not in one and "error" not in tp, (one, tp)
    assert tp["tokens_equal_one_device"] and tp["ranks_agree"], (one["tokens"], tp["tokens"])
    assert tp["cache_bytes_per_rank"] * 2 == one["cache_bytes_per_rank"] > 0, (one, tp)
    assert tp["final_cache_length"] == one["final_cache_length"] == one["cache_length"] + decoded, (one, tp)
    assert "| tp=2 | 2 |" in run.stdout


@tiers.MARK
def test_quick_pipeline_benchmark_replays_the_bubble_and_steps_beside_the_hand_split():
    run, written = QUICK_PIPELINE.result()
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(written)
    rows = report["rows"]
    assert [(r["schedule"], r["pp"], r["microbatches"]) for r in rows] == [("GPipe", 2, 4), ("GPipe", 2, 8)], rows
    assert [r["predicted_bubble"] for r in rows] == pytest.approx([1 / 5, 1 / 9])
    assert all(r["step_ms"] > 0 and isinstance(r["wall_bubble"], float) for r in rows), rows
    assert all(r["replayed_step_ms"] > 0 and 0 < r["replayed_bubble"] < 1 for r in rows), rows
    side, = report["side_by_side"]
    assert (side["schedule"], side["microbatches"]) == ("GPipe", 4) and side["loss_difference"] <= 1e-5, side
    assert side["hand_ms"] > 0 and side["ours_ms"] > 0, side
    assert "| schedule | pp | microbatches | predicted bubble | replayed bubble |" in run.stdout
    assert "| schedule | microbatches | hand-split ms | ours ms | ours/hand |" in run.stdout
