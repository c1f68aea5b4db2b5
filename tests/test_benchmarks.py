"""``python -m benchmarks --quick`` and ``python -m benchmarks.decode --quick`` start and write
valid JSON (smoke tests: no timing is asserted)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


def _quick(module: str, out) -> subprocess.CompletedProcess:
    """``python -m module --quick --json out`` from the repo root; it must succeed."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-m", module, "--quick", "--json", str(out)], cwd=root, env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return run


def test_quick_benchmark_writes_json(tmp_path):
    out = tmp_path / "bench.json"
    run = _quick("benchmarks", out)
    report = json.loads(out.read_text())
    result, = report["results"]
    assert "error" not in result, result
    assert {"step/ours", "forward/ours", "step/one_device", "forward/torch"} <= set(result["ms"]), result["ms"]
    assert result["collectives"]["ours"]["train_forward"]["all_reduce"]["calls"] > 0
    assert set(result["memory"]["ours"]) == {"params", "grads", "optimizer", "saved_activations"}
    assert report["gpu"]["skipped"] == (not __import__("torch").cuda.is_available())
    assert "| model | mesh |" in run.stdout


def test_quick_decode_benchmark_decodes_one_devices_tokens_on_half_the_cache(tmp_path):
    pytest.importorskip("transformers", reason="the models extra (pip install -e '.[models]') is not installed")
    out = tmp_path / "decode.json"
    run = _quick("benchmarks.decode", out)
    report = json.loads(out.read_text())
    one, tp = report["rows"]
    decoded = report["setup"]["warmup"] + report["setup"]["steps"]
    assert (one["mesh"], tp["mesh"]) == ("one device", "tp=2"), (one, tp)
    assert "error" not in one and "error" not in tp, (one, tp)
    assert tp["tokens_equal_one_device"] and tp["ranks_agree"], (one["tokens"], tp["tokens"])
    assert tp["cache_bytes_per_rank"] * 2 == one["cache_bytes_per_rank"] > 0, (one, tp)
    assert tp["final_cache_length"] == one["final_cache_length"] == one["cache_length"] + decoded, (one, tp)
    assert "| tp=2 | 2 |" in run.stdout
