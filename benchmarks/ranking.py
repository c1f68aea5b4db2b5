"""Does ``choose_mesh`` rank the meshes as they run? Every legal mesh of world 4, measured.

    python -m benchmarks.ranking [--profile profile.json] [--models dit,llama] [--seqs 1024,2048]
                                 [--batch 4] [--reps 5] [--json ranking.json]
    python -m benchmarks.ranking --quick        (a smoke run: tiny models, short sequences, 2 reps)

For the benchmark DiT and Llama (``side_by_side.FULL``, with its loss: ``models.WithLoss``) at
each sequence length, with the same global batch on every mesh (``batch="global"``):

1. a profile of this machine from ``calibrate --world 4`` (``--profile``, or measured first);
2. ``choose_mesh(..., 4, machine=profile)``: every legal mesh of 4 ranks, its predicted
   training step (orders that put every dim on the same links are one mesh: on one host, all);
3. each legal mesh's training step measured on 4 gloo ranks (``dtensor_par.parallelize`` +
   ``hybrid_parallel(inner_backend=...)``, forward + backward + AdamW, median of ``--reps`` on
   the slowest rank, every mesh timed once per round: ``measure_meshes``);
4. the Spearman rank correlation of predicted against measured step times, and whether the
   top choice's measured step is within 10% of the best measured (goals: >= 0.8, yes).

Four ranks on a machine of fewer cores, or one others load, measure the load as much as the
meshes: the numbers are noise-bound there.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import os
import statistics
import tempfile
import time

import torch

import dtensor_par
from benchmarks.models import WithLoss, ours
from benchmarks.report import save_json
from benchmarks.side_by_side import FULL, QUICK, model_and_input, train_step
from benchmarks.timing import adamw, slowest, timed
from dtensor_par.calibrate import calibrate
from dtensor_par.choose import choose_mesh
from dtensor_par.machines import machine as machine_profile
from dtensor_par._testing.harness import run_ranks

WORLD = 4
TOP_WITHIN = 0.10
GOAL_SPEARMAN = 0.8


def ranks(values: list[float]) -> list[float]:
    """1 for the smallest; tied values share the mean of their places."""
    order = sorted(range(len(values)), key=values.__getitem__)
    out = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in order[i:j + 1]:
            out[k] = (i + j) / 2 + 1
        i = j + 1
    return out


def spearman(a: list[float], b: list[float]) -> float | None:
    """Spearman's rank correlation (Pearson's of the ranks); None below 3 points or for a constant."""
    if len(a) < 3:
        return None
    ra, rb = ranks(a), ranks(b)
    ma, mb = statistics.fmean(ra), statistics.fmean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    spread = (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5
    return cov / spread if spread else None


def predicted(name: str, sizes: dict, seq: int, batch: int, profile) -> tuple[list[dict], list[str]]:
    """Every legal mesh of the world, fastest predicted first, and the refused ones."""
    model, x = model_and_input(name, sizes, seq, batch)
    ranking = choose_mesh(WithLoss(model), (x,), WORLD, machine=profile, top=10**6)
    return ([{"degrees": c.degrees, "order": list(c.order), "predicted_ms": 1e3 * c.predicted.total,
              "mesh": mesh_text(c.degrees)} for c in ranking], [str(r) for r in ranking.rejected])


def mesh_text(degrees: dict) -> str:
    return " x ".join(f"{d}{n}" for d, n in degrees.items() if n > 1) or "one device"


def _compiled(name, sizes, seq, batch, m, inner):
    """A training step of ``name`` parallelized over the mesh ``m``, compiled (its first step
    run), or why it failed."""
    try:
        mesh = dtensor_par.init_mesh(**m["degrees"], order=tuple(m["order"]), device_type="cpu")
        model, x = model_and_input(name, sizes, seq, batch)
        parallel, fn = ours(model, mesh, (x,), inner=inner)
        step = functools.partial(train_step, fn, adamw(parallel), x)
        step()
        return step
    except Exception as e:  # noqa: BLE001  recorded in the table, never hidden
        return f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"


def measure_meshes(rank, world, *, name, sizes, seq, batch, meshes, reps, inner) -> list[dict]:
    """Each mesh's training step (ms, median of ``reps``, slowest rank; and every round's), or
    why it failed.

    Every mesh is compiled first, then timed in ``reps`` rounds of one step each: a load that
    drifts during the run reaches every mesh alike, where timing one mesh after another would
    charge it to whichever mesh ran then. A round before them is not timed: a mesh's first
    steps after the other meshes compiled ran up to 20 times slower (253, 44, then 12 ms)."""
    # one compiled forward per mesh, alive together; past the limit Dynamo would run a mesh eagerly, unparallelized
    torch._dynamo.config.recompile_limit = len(meshes)
    torch._dynamo.config.fail_on_recompile_limit_hit = True
    steps = [_compiled(name, sizes, seq, batch, m, inner) for m in meshes]
    times = [[] for _ in meshes]
    for _ in range(1 + reps):
        for step, seconds in zip(steps, times):
            if callable(step):
                seconds.append(slowest(timed(step)))
    times = [seconds[1:] for seconds in times]
    return [{"measured_ms": 1e3 * statistics.median(seconds), "rounds_ms": [1e3 * s for s in seconds]}
            if callable(step) else {"error": step} for step, seconds in zip(steps, times)]


def compare(rows: list[dict]) -> dict:
    """Spearman over the meshes measured, and the top choice's step against the best measured."""
    ok = [r for r in rows if "measured_ms" in r]
    if not ok:
        return {"spearman": None, "top_over_best": None, "top_within_10pct": None}
    best = min(r["measured_ms"] for r in ok)
    top_over_best = ok[0]["measured_ms"] / best if ok[0] is rows[0] else None  # the top choice itself measured
    return {"spearman": spearman([r["predicted_ms"] for r in ok], [r["measured_ms"] for r in ok]),
            "top_over_best": top_over_best,
            "top_within_10pct": None if top_over_best is None else top_over_best <= 1 + TOP_WITHIN}


def run_config(name, sizes, seq, args, profile) -> dict:
    rows, rejected = predicted(name, sizes, seq, args.batch, profile)
    measured = run_ranks(WORLD, measure_meshes, name=name, sizes=sizes, seq=seq, batch=args.batch, meshes=rows,
                         reps=args.reps, inner=args.inner)[0]
    rows = [{**r, **m} for r, m in zip(rows, measured)]
    return {"model": name, "seq": seq, "batch": args.batch, "meshes": rows, "rejected": rejected, **compare(rows)}


def _cell(value, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def tables(results: list[dict]) -> str:
    out = ["| model | seq | mesh (predicted order) | predicted ms | measured ms | slowest / fastest round "
           "| predicted rank | measured rank |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        ok = [m for m in r["meshes"] if "measured_ms" in m]
        measured_rank = dict(zip(map(id, ok), ranks([m["measured_ms"] for m in ok])))
        for i, m in enumerate(r["meshes"], 1):
            cell = f"{m['measured_ms']:.1f}" if "measured_ms" in m else m["error"]
            spread = max(m["rounds_ms"]) / min(m["rounds_ms"]) if "rounds_ms" in m else None
            out.append(f"| {r['model']} | {r['seq']} | {m['mesh']} | {m['predicted_ms']:.2f} | {cell} "
                       f"| {_cell(spread, '.2f')} | {i} | {_cell(measured_rank.get(id(m)), '.1f')} |")
    out += ["", "| model | seq | meshes measured | Spearman (goal >= 0.8) | top choice / best measured "
            "| top within 10% |", "| --- | --- | --- | --- | --- | --- |"]
    for r in results:
        measured = sum("measured_ms" in m for m in r["meshes"])
        out.append(f"| {r['model']} | {r['seq']} | {measured} of {len(r['meshes'])} | {_cell(r['spearman'], '.2f')} "
                   f"| {_cell(r['top_over_best'], '.2f')} | {_cell(r['top_within_10pct'], '')} |")
    return "\n".join(out)


def _profile(path: str | None, folder: str):
    """The profile at ``path``, or one measured now (``calibrate --world 4``)."""
    if path:
        return machine_profile(path)
    return calibrate(WORLD, os.path.join(folder, "profile.json"))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny models, seq 64 and 128, 2 reps, inner eager")
    parser.add_argument("--profile", help="a calibrate --world 4 profile (default: measured first)")
    parser.add_argument("--models", default="dit,llama")
    parser.add_argument("--seqs", help="sequence lengths, comma-separated (default 1024,2048; quick 64,128)")
    parser.add_argument("--batch", type=int, default=4, help="the global batch, the same on every mesh")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--json", default="ranking.json", help="where to write the measurements")
    args = parser.parse_args()
    shapes = QUICK if args.quick else FULL
    args.reps, args.inner = (2, "eager") if args.quick else (args.reps, "aot_eager")
    seqs = [int(s) for s in (args.seqs or ("64,128" if args.quick else "1024,2048")).split(",")]
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as folder:
        profile = _profile(args.profile, folder)
        results = [run_config(name, shapes[name], seq, args, profile)
                   for name in args.models.split(",") for seq in seqs]
    info = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
            "cpus": os.cpu_count(), "torch": torch.__version__, "world": WORLD, "reps": args.reps,
            "inner_backend": args.inner, "models": {n: shapes[n] for n in args.models.split(",")},
            "profile": profile.as_dict(), "goals": {"spearman": GOAL_SPEARMAN, "top_within": TOP_WITHIN}}
    print(f"# python -m benchmarks.ranking: {info['date']}, {info['cpus']} cpus, world {WORLD} on gloo, "
          f"medians of {args.reps}, inner backend {args.inner}, profile {profile.name}\n")
    print(tables(results))
    info["seconds"] = time.perf_counter() - start
    print(f"\n{info['seconds']:.0f} s")
    save_json(args.json, {**info, "results": results})


if __name__ == "__main__":
    main()
