"""Planning time of a 24-layer transformer at 64 ranks, in one process, without hardware.

    python -m benchmarks.plan_speed [--model llama|dit] [--layers 24] [--json out.json]   (from the repo root)
    python -m benchmarks.plan_speed --model dit --cli-runs 5

The model lives on the meta device (no memory for weights); ``explain`` captures it with
Dynamo and runs every pass as rank 0 of the mesh would. ``llama``: tp=64 (hidden 8192).
``dit``: tp=8 x ulysses=4 x ring=2 (hidden 4096, 32 heads: tp * ulysses divides them;
4096 tokens). ``--cli-runs N`` also times the command a user runs, process start included,
N times in fresh processes: ``python -m dtensor_par explain benchmarks.plan_speed:dit
--tp 8 --ulysses 4 --ring 2``. Target: under 10 s, either way.
"""

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time

import torch

from benchmarks.report import print_table, save_json
from dtensor_par import explain
from dtensor_par._testing.models import DiT, Llama

MESHES = {"llama": {"tp": 64}, "dit": {"tp": 8, "ulysses": 4, "ring": 2}}


def llama(layers: int = 24):
    """A Llama-70B-sized stack (hidden 8192, 64 heads, 8 kv heads), 4096 tokens, on meta."""
    with torch.device("meta"):
        model = Llama(vocab=32000, layers=layers, hidden=8192, heads=64, kv_heads=8, mlp=28672)
        ids = torch.randint(0, 32000, (1, 4096))
    return model, (ids,)


def dit(layers: int = 24):
    """A video-DiT-sized stack (hidden 4096, 32 heads of 128, MLP 16384), bf16, 4096 tokens, on meta."""
    with torch.device("meta"):
        model = DiT(layers=layers, dim=4096, heads=32, mlp=16384).to(torch.bfloat16)
        x = torch.randn(1, 4096, 4096, dtype=torch.bfloat16)
    return model, (x,)


def cli_seconds(model: str, runs: int) -> dict:
    """Wall and CPU (user + system) seconds of the ``explain`` command, each run a fresh process."""
    mesh = [f"--{dim}={size}" for dim, size in MESHES[model].items()]
    command = [sys.executable, "-m", "dtensor_par", "explain", f"benchmarks.plan_speed:{model}", *mesh]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    walls, cpus = [], []
    for _ in range(runs):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        subprocess.run(command, cwd=root, check=True, stdout=subprocess.DEVNULL)
        walls.append(time.perf_counter() - start)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpus.append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
    return {"command": " ".join(command[1:]), "wall_min": min(walls), "wall_median": statistics.median(walls),
            "cpu_min": min(cpus), "cpu_median": statistics.median(cpus)}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=sorted(MESHES), default="llama")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--cli-runs", type=int, default=0, help="also time the CLI this many times")
    parser.add_argument("--json", help="also write the measurements here")
    args = parser.parse_args()

    model, inputs = {"llama": llama, "dit": dit}[args.model](args.layers)
    start = time.perf_counter()
    report = explain(model, inputs, **MESHES[args.model])
    seconds = time.perf_counter() - start

    graph = report.graphs[0]
    local, full = report.parameter_bytes
    row = {"model": args.model, "layers": args.layers, "ranks": report.world_size, "sites": len(graph.sites),
           "collective_kinds": len(graph.collectives), "param_gib_per_rank": local / 2**30,
           "param_gib_total": full / 2**30, "explain_seconds": seconds, "passes_seconds": graph.plan_seconds,
           "target_seconds": 10.0}
    print_table(["model", "layers", "ranks", "sites", "param GiB/rank", "param GiB total",
                 "explain s (capture + passes)", "passes s", "target"],
                [[args.model, row["layers"], row["ranks"], row["sites"], f"{row['param_gib_per_rank']:.2f}",
                  f"{row['param_gib_total']:.1f}", f"{seconds:.2f}", f"{graph.plan_seconds:.2f}", "< 10"]])
    if args.cli_runs:
        if args.layers != 24:
            parser.error("--cli-runs times the 24-layer factory")
        row["cli"] = cli_seconds(args.model, args.cli_runs)
        cli = row["cli"]
        print(f"\n`{cli['command']}` ({args.cli_runs} runs, process start included): wall min "
              f"{cli['wall_min']:.2f} s, median {cli['wall_median']:.2f} s; CPU (user + sys) min "
              f"{cli['cpu_min']:.2f} s, median {cli['cpu_median']:.2f} s; target < 10 s")
    save_json(args.json, row)


if __name__ == "__main__":
    main()
