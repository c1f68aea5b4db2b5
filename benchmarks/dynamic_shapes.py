"""Serving many sequence lengths: total time over a sequence of calls with N distinct lengths,
``hybrid_parallel`` (tp=2 on 2 gloo ranks) against plain ``torch.compile`` on one device.

    python -m benchmarks.dynamic_shapes [--ns 2 5 8] [--backend inductor] [--json out.json]

Each run calls a fresh compile of a 2-block transformer with N distinct lengths (32, 40, ...)
and then the first two again, in inference (as a server does), Dynamo's default dynamic
setting on both sides: the first length compiles static, the second recompiles with the
length symbolic, and that graph serves every later length. Every time includes compiling.
Goal: ours / plain <= 1.25 at N = 5, and our total flat in N (no compile per length).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch

import dtensor_par
from benchmarks.report import print_table, save_json
from dtensor_par._testing.harness import run_ranks
from dtensor_par._testing.models import GPT

BATCH, HIDDEN, HEADS = 2, 256, 8


def _lengths(n: int) -> list[int]:
    distinct = [32 + 8 * i for i in range(n)]
    return distinct + distinct[:2]


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return GPT(layers=2, hidden=HIDDEN, heads=HEADS, mlp=4 * HIDDEN).eval()


def _timed_calls(compiled, lengths: list[int]) -> dict:
    """Seconds for the whole call sequence, and each call's."""
    calls = []
    with torch.no_grad():
        start = time.perf_counter()
        for seq in lengths:
            t = time.perf_counter()
            compiled(torch.randn(BATCH, seq, HIDDEN))
            calls.append(time.perf_counter() - t)
    return {"total": time.perf_counter() - start, "calls": calls}


def _ours(rank: int, world: int, *, n: int, backend: str) -> dict:
    compiles = []

    def inner(gm, example_inputs):
        compiles.append(1)
        return dtensor_par.api.resolve_backend(backend)(gm, example_inputs)

    backend_fn = dtensor_par.hybrid_parallel(dtensor_par.init_mesh(tp=world), inner_backend=inner)
    return {**_timed_calls(torch.compile(_model(), backend=backend_fn), _lengths(n)), "inner_compiles": len(compiles)}


def _plain(rank: int, world: int, *, n: int, backend: str) -> dict:
    return _timed_calls(torch.compile(_model(), backend=backend), _lengths(n))


def _in_cache(rank: int, world: int, *, cache: str, fn, **kwargs) -> dict:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache  # read when the first compile looks for its cache
    return fn(rank, world, **kwargs)


def _cold(world: int, fn, **kwargs) -> dict:
    """``fn`` on ``world`` fresh processes (one thread each, as gloo ranks run) with empty
    compile caches, as a new user's first run: nothing compiled before is reused."""
    with tempfile.TemporaryDirectory() as cache:
        return run_ranks(world, _in_cache, cache=cache, fn=fn, **kwargs)[0]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--ns", type=int, nargs="+", default=[2, 5, 8], help="numbers of distinct lengths")
    parser.add_argument("--backend", default="inductor", help="inner backend, and plain torch.compile's")
    parser.add_argument("--json", help="also write the measurements here")
    args = parser.parse_args()

    rows = []
    for n in args.ns:
        mine, theirs = _cold(2, _ours, n=n, backend=args.backend), _cold(1, _plain, n=n, backend=args.backend)
        rows.append({"distinct_lengths": n, "calls": len(_lengths(n)), "ours_s": mine["total"],
                     "plain_s": theirs["total"], "ratio": mine["total"] / theirs["total"],
                     "ours_inner_compiles": mine["inner_compiles"], "ours_calls_s": mine["calls"],
                     "plain_calls_s": theirs["calls"]})
    first = rows[0]["ours_s"]
    print(f"2-block transformer (hidden {HIDDEN}, {HEADS} heads), batch {BATCH}, tp=2 on 2 gloo ranks vs one "
          f"device, {args.backend}, inference; lengths 32, 40, ... then the first two again")
    calls = lambda c: f"{c[0]:.1f}, {c[1]:.1f}, {max(c[2:]):.2f}"  # noqa: E731
    print_table(["distinct lengths", "calls", "ours s", "plain s", "ours / plain",
                 f"ours / ours at N={rows[0]['distinct_lengths']}", "inner compiles (ours)",
                 "ours: 1st, 2nd, slowest later call s", "plain: same"],
                [[r["distinct_lengths"], r["calls"], f"{r['ours_s']:.1f}", f"{r['plain_s']:.1f}", f"{r['ratio']:.2f}",
                  f"{r['ours_s'] / first:.2f}", r["ours_inner_compiles"], calls(r["ours_calls_s"]),
                  calls(r["plain_calls_s"])] for r in rows])
    print("goal: ours / plain <= 1.25 at N = 5; ours flat in N")
    save_json(args.json, {"backend": args.backend, "rows": rows, "goal_ratio_at_5": 1.25})


if __name__ == "__main__":
    main()
