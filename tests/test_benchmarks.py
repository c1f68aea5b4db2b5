"""``python -m benchmarks --quick`` starts and writes valid JSON (a smoke test: no timing is asserted)."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def test_quick_benchmark_writes_json(tmp_path):
    out = tmp_path / "bench.json"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-m", "benchmarks", "--quick", "--json", str(out)], cwd=root, env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(out.read_text())
    result, = report["results"]
    assert "error" not in result, result
    assert {"step/ours", "forward/ours", "step/one_device", "forward/torch"} <= set(result["ms"]), result["ms"]
    assert result["collectives"]["ours"]["train_forward"]["all_reduce"]["calls"] > 0
    assert set(result["memory"]["ours"]) == {"params", "grads", "optimizer", "saved_activations"}
    assert report["gpu"]["skipped"] == (not __import__("torch").cuda.is_available())
    assert "| model | mesh |" in run.stdout
