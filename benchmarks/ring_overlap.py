"""Ring attention forward time with communication overlapped versus serialized, 4 gloo ranks.

    python -m benchmarks.ring_overlap [--seq 4096] [--heads 8] [--head-dim 64] [--json out.json]

Each rank holds a zigzag sequence block; causal attention. Prints a table; median of 10 runs.
"""

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from benchmarks.report import print_table, save_json
from dtensor_par.mesh import MeshInfo
from dtensor_par.ops.ring import ring_attention
from dtensor_par._testing.harness import run_ranks


def _time(rank, world, *, seq, heads, head_dim):
    torch.manual_seed(rank)
    q, k, v = (torch.randn(1, heads, seq // world, head_dim) for _ in range(3))
    ring = MeshInfo.from_mesh(init_device_mesh("cpu", (world,), mesh_dim_names=("ring",))).dims["ring"]
    results = {}
    for overlap in (True, False, True, False):  # interleaved, so drift hits both alike
        times = []
        for _ in range(10):
            dist.barrier()
            start = time.perf_counter()
            ring_attention(q, k, v, ring=ring, is_causal=True, zigzag=True, overlap=overlap)
            times.append(time.perf_counter() - start)
        results.setdefault(str(overlap), []).extend(times)
    return {k: statistics.median(v) for k, v in results.items()}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--json")
    args = parser.parse_args()
    per_rank = run_ranks(4, _time, seq=args.seq, heads=args.heads, head_dim=args.head_dim)
    overlapped = max(r["True"] for r in per_rank)
    serial = max(r["False"] for r in per_rank)
    row = {"ranks": 4, "seq": args.seq, "heads": args.heads, "head_dim": args.head_dim,
           "overlap_ms": 1e3 * overlapped, "serial_ms": 1e3 * serial, "speedup": serial / overlapped}
    print_table(["ranks", "seq", "heads x dim", "overlapped ms", "serialized ms", "speedup"],
                [[4, args.seq, f"{args.heads} x {args.head_dim}", f"{row['overlap_ms']:.1f}", f"{row['serial_ms']:.1f}",
                  f"{row['speedup']:.2f}"]])
    save_json(args.json, row)


if __name__ == "__main__":
    main()
