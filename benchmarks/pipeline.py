"""Pipeline parallelism: the measured bubble of torch's schedules against ``pipeline_plan``'s
prediction, and the time ``explain`` takes to plan a 32-layer Llama at pp4 x tp8 x dp_shard4.

    python -m benchmarks.pipeline [--quick] [--steps 5] [--no-explain] [--json out.json]

Bubble: ``dtensor_par.pipeline`` runs the toy Llama of ``_testing/models.py`` (8 blocks, hidden
256, microbatches of 2 x 128 tokens) on pp gloo ranks of this machine (``inner_backend=aot_eager``),
GPipe, 1F1B and Interleaved1F1B at pp2 and pp4, over 4 and 8 microbatches of a fixed size. A step
takes t (m + b) for a rank's per-microbatch time t and a fill and drain of b microbatches' time,
so between m=4 and m=8 the slope is t, and the measured bubble at m is 1 - t m / step(m): the share
of the step no microbatch's work fills. The prediction is (pp-1)/(v m + pp-1). Each step time is
the median of ``--steps`` steps (after one untimed step), on rank 0 (the step ends in a broadcast
of the loss over pp). It measures a pipeline only where every rank has a core of its own: on a
machine with fewer cores than ranks (or shared), ranks take turns and the fill and drain hide.

Explain: ``explain`` of a Llama-70B-sized stack (hidden 8192, 64 heads, 8 kv heads, mlp 28672) of
32 layers on the meta device, a batch of 32 x 4096 tokens in 8 microbatches, at pp4 x tp8 x
dp_shard4 (128 ranks) on ``h100-sxm-8``: its wall and CPU seconds in this process (imports done).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

import dtensor_par
from benchmarks.report import failure, print_table, save_json
from dtensor_par._testing.harness import run_ranks_together
from dtensor_par._testing.models import Llama, meta_llama_32_layers
from dtensor_par.pipeline_plan import bubble
from dtensor_par.pipeline_plan import MODELED_SCHEDULES, SCHEDULES

FULL = {"sizes": {"vocab": 512, "layers": 8, "hidden": 256, "heads": 8, "kv_heads": 4, "mlp": 768},
        "rows": 2, "seq": 128, "pp": (2, 4), "microbatches": (4, 8), "schedules": MODELED_SCHEDULES}
QUICK = {"sizes": {"vocab": 64, "layers": 4, "hidden": 64, "heads": 4, "kv_heads": 2, "mlp": 128},
         "rows": 1, "seq": 16, "pp": (2,), "microbatches": (4, 8), "schedules": ("GPipe",)}


def explain_seconds() -> dict:
    model, inputs = meta_llama_32_layers()
    wall, cpu = time.perf_counter(), time.process_time()
    report = dtensor_par.explain(model, inputs, pp=4, tp=8, dp_shard=4, microbatches=8, machine="h100-sxm-8")
    return {"wall_s": time.perf_counter() - wall, "cpu_s": time.process_time() - cpu, "ranks": report.world_size,
            "stages": [len(s.blocks) for s in report.pipeline.stages],
            "predicted_step_s": report.pipeline.step_seconds}


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, 1), target.flatten())


def step_seconds(rank: int, world: int, *, setup: dict, schedule: str, microbatches: int, steps: int) -> float:
    """The median step of ``schedule`` over ``microbatches`` microbatches of a fixed size, on this rank."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    sizes = setup["sizes"]
    model = Llama(**sizes)
    batch = (setup["rows"] * microbatches, setup["seq"])
    ids, target = torch.randint(0, sizes["vocab"], batch), torch.randint(0, sizes["vocab"], batch)
    step = dtensor_par.pipeline(model, dtensor_par.init_mesh(pp=world), (ids,), loss_fn=_loss,
                                microbatches=microbatches, schedule=schedule, inner_backend="aot_eager")
    step(ids, target=target)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step(ids, target=target)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(setup: dict, steps: int) -> list[dict]:
    rows = []
    for pp in setup["pp"]:
        calls = {(schedule, m): (step_seconds, {"setup": setup, "schedule": schedule, "microbatches": m,
                                                "steps": steps})
                 for schedule in setup["schedules"] for m in setup["microbatches"]}
        try:
            seconds = run_ranks_together(pp, {f"{s} m{m}": call for (s, m), call in calls.items()})[0]
        except Exception as e:  # noqa: BLE001  (a launch that fails is a row saying why)
            rows.append({"pp": pp, "error": failure(e)})
            continue
        for schedule in setup["schedules"]:
            few, many = setup["microbatches"]
            per_microbatch = (seconds[f"{schedule} m{many}"] - seconds[f"{schedule} m{few}"]) / (many - few)
            for m in (few, many):
                step = seconds[f"{schedule} m{m}"]
                rows.append({"schedule": schedule, "pp": pp, "microbatches": m, "step_ms": 1e3 * step,
                             "measured_bubble": 1 - per_microbatch * m / step,
                             "predicted_bubble": bubble(pp, SCHEDULES[schedule].stages_per_rank, m)})
    return rows


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="pp2, GPipe, a tiny model: a smoke run")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--no-explain", action="store_true", help="skip timing explain of the 32-layer Llama")
    parser.add_argument("--json", help="also write the measurements here")
    args = parser.parse_args()
    setup = QUICK if args.quick else FULL
    steps = 2 if args.quick else args.steps
    rows = measure(setup, steps)
    print_table(["schedule", "pp", "microbatches", "step ms", "measured bubble", "predicted bubble"],
                [[r.get("schedule", "-"), r["pp"], r.get("microbatches", "-"), f"{r['step_ms']:.1f}",
                  f"{r['measured_bubble']:.1%}", f"{r['predicted_bubble']:.1%}"] if "error" not in r else
                 ["-", r["pp"], "-", r["error"], "-", "-"] for r in rows])
    explained = None if args.no_explain or args.quick else explain_seconds()
    if explained:
        print(f"\nexplain, 32-layer Llama at pp4 x tp8 x dp_shard4 (128 ranks, meta): {explained['wall_s']:.1f} s "
              f"wall, {explained['cpu_s']:.1f} s CPU; stages of {explained['stages']} blocks")
    save_json(args.json, {"setup": {**setup, "steps": steps}, "rows": rows, "explain": explained})


if __name__ == "__main__":
    main()
