"""Can a collective hide behind compute on this machine? A tp forward's all-reduce beside the matmul
that would run while it is in flight (async tensor parallelism's overlap), 2 gloo ranks.

    python -m benchmarks.comm_overlap [--tokens 1024] [--dim 256] [--hidden 1024] [--reps 50] [--json out.json]

The all-reduce is a rowwise projection's output (tokens x dim, float32); the matmul is the same
projection's local piece (tokens x hidden / 2 by hidden / 2 x dim). Three medians of ``--reps``
calls, alternated: each alone, then the all-reduce issued asynchronously before the matmul and
waited after it. Overlapped equal to the sum means overlap can win nothing here: gloo's all-reduce
is CPU work, and each rank's one core runs either it or the matmul.
"""

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from benchmarks.report import print_table, save_json
from dtensor_par._testing.harness import run_ranks


def _time(rank, world, *, tokens, dim, hidden, reps):
    torch.manual_seed(rank)
    out = torch.randn(tokens, dim)
    x, w = torch.randn(tokens, hidden // world), torch.randn(hidden // world, dim)

    def all_reduce():
        dist.all_reduce(out)

    def matmul():
        x @ w

    def overlapped():
        work = dist.all_reduce(out, async_op=True)
        x @ w
        work.wait()

    variants = {"all-reduce": all_reduce, "matmul": matmul, "overlapped": overlapped}
    times = {name: [] for name in variants}
    for _ in range(reps):  # alternated, so drift hits each alike
        for name, fn in variants.items():
            dist.barrier()
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--json")
    args = parser.parse_args()
    per_rank = run_ranks(2, _time, tokens=args.tokens, dim=args.dim, hidden=args.hidden, reps=args.reps)
    ms = {name: 1e3 * max(r[name] for r in per_rank) for name in per_rank[0]}
    row = {"tokens": args.tokens, "dim": args.dim, "hidden": args.hidden, **{f"{k}_ms": v for k, v in ms.items()},
           "hidden_fraction": (ms["all-reduce"] + ms["matmul"] - ms["overlapped"]) / ms["all-reduce"]}
    print_table(["tokens x dim", "all-reduce ms", "matmul ms", "both overlapped ms", "all-reduce hidden"],
                [[f"{args.tokens} x {args.dim}", f"{ms['all-reduce']:.2f}", f"{ms['matmul']:.2f}",
                  f"{ms['overlapped']:.2f}", f"{row['hidden_fraction']:.0%}"]])
    save_json(args.json, row)


if __name__ == "__main__":
    main()
