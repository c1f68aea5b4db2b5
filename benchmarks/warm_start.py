"""A job run a second time on the same machine: the compile caches warm.

    python -m benchmarks.warm_start [--n 6] [--backend inductor] [--json out.json]

The job of ``dynamic_shapes.py`` on the DiT of ``models.py`` (2 blocks, dim 256): N distinct
lengths then the first two again, inference, every time including compiling. Each variant,
``hybrid_parallel`` (tp=2 on 2 gloo ranks) and plain ``torch.compile`` (one device), runs it
twice in fresh processes against one fresh ``TORCHINDUCTOR_CACHE_DIR`` of its own: cold (the
cache empty), then warm (what the cold run left there). Reported with each run: inductor's
FX graph cache and AOTAutograd's cache hits, misses and bypasses (rank 0's), and, apart,
inductor's check of the CPU's vector ISA, which every process makes once whatever it runs.
Goal: warm, ours / plain <= 1.25.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import torch
import torch._inductor.cpu_vec_isa

import dtensor_par
from benchmarks.dynamic_shapes import _in_cache, _lengths, _timed_calls
from dtensor_par._testing.harness import run_ranks
from dtensor_par._testing.models import DiT

CACHE_COUNTERS = {"inductor": ("fxgraph_cache_hit", "fxgraph_cache_miss", "fxgraph_cache_bypass"),
                  "aot_autograd": ("autograd_cache_hit", "autograd_cache_miss", "autograd_cache_bypass")}
"""The counters (``torch._dynamo.utils.counters``) that say what the caches served."""


def _cache_counts() -> dict[str, int]:
    counters = torch._dynamo.utils.counters
    return {name: counters[group][name] for group, names in CACHE_COUNTERS.items() for name in names}


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return DiT(layers=2, dim=256, heads=8, mlp=1024).eval()


def _check_isa() -> None:
    """Inductor's check of the CPU's vector ISA, made once per process before it loads a CPU
    kernel (a dlopen probe in a fresh interpreter per candidate ISA, each under a file lock in
    the cache dir, so ranks sharing the cache take turns); run ahead here, so the calls'
    time is the compile's. Per process, and the same for any job: it is not compile work."""
    torch._inductor.cpu_vec_isa.valid_vec_isa_list()  # functools.cache: the compile reads this answer


def _job(rank: int, world: int, *, n: int, backend: str) -> dict:
    """The call sequence on a fresh compile: ours on more than one rank, plain on one. The
    ranks start the calls together: they take turns at the ISA check's lock, and a rank that
    started first would count the other's turn as waiting at its first collective, in the
    calls' time as well as in the ISA check's (``isa_check``: until every rank has made it)."""
    start = time.perf_counter()
    if backend == "inductor":
        _check_isa()
    if world > 1:
        torch.distributed.barrier()
    isa = time.perf_counter() - start
    if world > 1:
        backend = dtensor_par.hybrid_parallel(dtensor_par.init_mesh(tp=world), inner_backend=backend)
    return {**_timed_calls(torch.compile(_model(), backend=backend), _lengths(n)), "isa_check": isa,
            **_cache_counts()}


def _cold_then_warm(n: int, backend: str) -> dict:
    """The job twice per variant, each time in fresh processes, against one fresh cache
    directory per variant; the variants alternate (ours cold, plain cold, ours warm, plain
    warm), so a change in the machine's load hits both alike."""
    worlds = {"ours": 2, "plain": 1}
    results = {variant: {} for variant in worlds}
    with tempfile.TemporaryDirectory() as ours, tempfile.TemporaryDirectory() as plain:
        caches = {"ours": ours, "plain": plain}
        for run in ("cold", "warm"):
            for variant, world in worlds.items():
                ranks = run_ranks(world, _in_cache, cache=caches[variant], fn=_job, n=n, backend=backend)
                results[variant][run] = {**ranks[0], "total": max(r["total"] for r in ranks),  # the slowest rank's
                                         "isa_check": max(r["isa_check"] for r in ranks)}
    return results


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=6, help="distinct lengths (the job makes n + 2 calls)")
    parser.add_argument("--backend", default="inductor", help="inner backend, and plain torch.compile's")
    parser.add_argument("--json", help="also write the measurements here")
    args = parser.parse_args()

    results = _cold_then_warm(args.n, args.backend)
    print(f"DiT (2 blocks, dim 256), {args.n + 2} calls over {args.n} lengths, inference, {args.backend}: tp=2 on 2 "
          "gloo ranks (ours) vs one device (plain), each run in fresh processes, the cache dir cold then warm")
    print("| run | ours s | plain s | ours / plain | ISA check ours s | ISA check plain s | ours / plain with the "
          "ISA check | ours fx graph cache "
          "hit/miss/bypass | ours aot cache hit/miss/bypass | plain fx graph cache | plain aot cache |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for run in ("cold", "warm"):
        mine, theirs = results["ours"][run], results["plain"][run]
        counts = ["/".join(str(r[name]) for name in names) for r in (mine, theirs) for names in CACHE_COUNTERS.values()]
        print(f"| {run} | {mine['total']:.1f} | {theirs['total']:.1f} | {mine['total'] / theirs['total']:.2f} | "
              f"{mine['isa_check']:.1f} | {theirs['isa_check']:.1f} | "
              f"{(mine['total'] + mine['isa_check']) / (theirs['total'] + theirs['isa_check']):.2f} | "
              + " | ".join(counts) + " |")
    print("goal: warm, ours / plain <= 1.25")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"backend": args.backend, "distinct_lengths": args.n, "goal_warm_ratio": 1.25, **results}, f,
                      indent=1)


if __name__ == "__main__":
    main()
