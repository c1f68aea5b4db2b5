"""Planning time of a 24-layer transformer at 64 ranks (tp=64), in one process, without hardware.

    python -m benchmarks.plan_speed [--layers 24] [--tp 64] [--json out.json]   (from the repo root)

The model lives on the meta device (no memory for weights); ``explain`` captures it with
Dynamo and runs every pass as rank 0 of the mesh would. Target: under 10 s.
"""

import argparse
import time

import torch

from benchmarks.report import print_table, save_json
from dtensor_par import explain
from tests.models import Llama


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--tp", type=int, default=64)
    parser.add_argument("--json", help="also write the measurements here")
    args = parser.parse_args()

    with torch.device("meta"):
        model = Llama(vocab=32000, layers=args.layers, hidden=8192, heads=64, kv_heads=8, mlp=28672)
        ids = torch.randint(0, 32000, (1, 4096))
    start = time.perf_counter()
    report = explain(model, (ids,), tp=args.tp)
    seconds = time.perf_counter() - start

    graph = report.graphs[0]
    local, full = report.parameter_bytes
    row = {"layers": args.layers, "ranks": report.world_size, "sites": len(graph.sites),
           "collective_kinds": len(graph.collectives), "param_gib_per_rank": local / 2**30,
           "param_gib_total": full / 2**30, "explain_seconds": seconds, "passes_seconds": graph.plan_seconds,
           "target_seconds": 10.0}
    print_table(["layers", "ranks", "sites", "param GiB/rank", "param GiB total", "explain s (capture + passes)",
                 "passes s", "target"],
                [[row["layers"], row["ranks"], row["sites"], f"{row['param_gib_per_rank']:.2f}",
                  f"{row['param_gib_total']:.1f}", f"{seconds:.2f}", f"{graph.plan_seconds:.2f}", "< 10"]])
    save_json(args.json, row)


if __name__ == "__main__":
    main()
