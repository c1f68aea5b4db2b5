"""Pipeline parallelism: the bubble of torch's schedules under ``dtensor_par.pipeline`` against
``pipeline_plan``'s prediction, its training step beside torchtitan-style hand-split stages, and
the time ``explain`` takes to plan a 32-layer Llama at pp4 x tp8 x dp_shard4.

    python -m benchmarks.pipeline [--quick] [--steps 5] [--reps 7] [--no-explain] [--json out.json]

Bubble: ``dtensor_par.pipeline`` runs the toy Llama of ``_testing/models.py`` (8 blocks, hidden
256, microbatches of 2 x 128 tokens) on pp gloo ranks of this machine (``inner_backend=aot_eager``),
GPipe, 1F1B and Interleaved1F1B at pp2 and pp4, over 4 and 8 microbatches of a fixed size, each
step timed over ``--steps`` steps after one untimed step. The prediction is (pp-1)/(v m + pp-1).
- Replayed (``pipeline_replay``): each rank records every forward and backward it runs as its
  thread's CPU time; the ranks' action lists are replayed as if each rank had a core of its own,
  each action starting once its rank's previous action and the one it depends on have ended.
  The bubble is 1 - (the busiest rank's summed action time) / (the replayed step). The replay
  leaves communication out (a send takes no time), so it measures the schedule and the stages'
  balance, and it holds on a machine with fewer cores than ranks, where the ranks take turns.
- Wall (pp2 only): a step takes t (m + b) for a rank's per-microbatch time t and a fill and drain
  of b microbatches' time, so between m=4 and m=8 the slope is t, and the bubble at m is
  1 - t m / step(m), step the median wall time on rank 0. It means something only where every
  rank has a core of its own.

Side by side (pp2; ``pipeline_peer``): the same model, weights, microbatches, loss and torch
schedule (1F1B, GPipe, Interleaved1F1B), split into stages by hand as torchtitan does and each
stage compiled with the same inner backend, against ``dtensor_par.pipeline``: the training step
(the schedule's forward and backward, then zero_grad; no optimizer step on either side), the median
of ``--reps`` repetitions alternated between the two after one warm-up each, the slowest rank's.
The two losses are asserted equal (within 1e-5): the table compares the same computation.

Explain: ``explain`` of a Llama-70B-sized stack (hidden 8192, 64 heads, 8 kv heads, mlp 28672) of
32 layers on the meta device, a batch of 32 x 4096 tokens in 8 microbatches, at pp4 x tp8 x
dp_shard4 (128 ranks) on ``h100-sxm-8``: its wall and CPU seconds in this process (imports done).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import dtensor_par
from benchmarks.pipeline_peer import loss_fn, side_by_side
from benchmarks.pipeline_replay import Action, ActionRecorder, replay
from benchmarks.report import failure, print_table, save_json
from dtensor_par._testing.harness import run_ranks_together
from dtensor_par._testing.models import Llama, meta_llama_32_layers
from dtensor_par.pipeline_plan import bubble
from dtensor_par.pipeline_plan import MODELED_SCHEDULES, SCHEDULES

FULL = {"sizes": {"vocab": 512, "layers": 8, "hidden": 256, "heads": 8, "kv_heads": 4, "mlp": 768},
        "rows": 2, "seq": 128, "inner_backend": "aot_eager", "pp": (2, 4), "microbatches": (4, 8),
        "schedules": MODELED_SCHEDULES, "side_by_side": {"schedules": ("1F1B", "GPipe", "Interleaved1F1B"),
                                                         "microbatches": (4, 8)}}
QUICK = {"sizes": {"vocab": 64, "layers": 4, "hidden": 64, "heads": 4, "kv_heads": 2, "mlp": 128},
         "rows": 1, "seq": 16, "inner_backend": "aot_eager", "pp": (2,), "microbatches": (4, 8),
         "schedules": ("GPipe",), "side_by_side": {"schedules": ("GPipe",), "microbatches": (4,)}}


def explain_seconds() -> dict:
    model, inputs = meta_llama_32_layers()
    wall, cpu = time.perf_counter(), time.process_time()
    report = dtensor_par.explain(model, inputs, pp=4, tp=8, dp_shard=4, microbatches=8, machine="h100-sxm-8")
    return {"wall_s": time.perf_counter() - wall, "cpu_s": time.process_time() - cpu, "ranks": report.world_size,
            "stages": [len(s.blocks) for s in report.pipeline.stages],
            "predicted_step_s": report.pipeline.step_seconds}


def step_seconds(rank: int, world: int, *, setup: dict, schedule: str, microbatches: int, steps: int) -> dict:
    """The median wall step of ``schedule`` over ``microbatches`` microbatches of a fixed size on
    this rank, and the actions it ran in order (``pipeline_replay``), each its median over the steps."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    sizes = setup["sizes"]
    model = Llama(**sizes)
    batch = (setup["rows"] * microbatches, setup["seq"])
    ids, target = torch.randint(0, sizes["vocab"], batch), torch.randint(0, sizes["vocab"], batch)
    step = dtensor_par.pipeline(model, dtensor_par.init_mesh(pp=world), (ids,), loss_fn=loss_fn,
                                microbatches=microbatches, schedule=schedule, inner_backend=setup["inner_backend"])
    recorder = ActionRecorder(step.schedule)
    step(ids, target=target)
    times = []
    for _ in range(steps):
        recorder.step()
        start = time.perf_counter()
        step(ids, target=target)
        times.append(time.perf_counter() - start)
    return {"wall_s": statistics.median(times), "actions": recorder.actions()}


def launch(pp: int, setup: dict, steps: int, reps: int) -> list[dict]:
    """One launch of pp ranks: every schedule's steps (``step_seconds``), and at pp2 the side by side."""
    calls = {f"{s} m{m}": (step_seconds, {"setup": setup, "schedule": s, "microbatches": m, "steps": steps})
             for s in setup["schedules"] for m in setup["microbatches"]}
    if pp == 2:
        side = setup["side_by_side"]
        calls.update({f"side {s} m{m}": (side_by_side, {"setup": setup, "schedule": s, "microbatches": m,
                                                         "reps": reps})
                      for s in side["schedules"] for m in side["microbatches"]})
    return run_ranks_together(pp, calls)


def bubble_rows(pp: int, setup: dict, ranks: list[dict]) -> list[dict]:
    """Each schedule's bubble at each microbatch count: predicted, replayed from every rank's
    actions, and (pp2) inferred from rank 0's wall steps."""
    rows = []
    for schedule in setup["schedules"]:
        few, many = setup["microbatches"]
        wall = {m: ranks[0][f"{schedule} m{m}"]["wall_s"] for m in (few, many)}
        per_microbatch = (wall[many] - wall[few]) / (many - few)
        for m in (few, many):
            replayed = replay([[Action(*a) for a in results[f"{schedule} m{m}"]["actions"]] for results in ranks])
            rows.append({"schedule": schedule, "pp": pp, "microbatches": m,
                         "predicted_bubble": bubble(pp, SCHEDULES[schedule].stages_per_rank, m),
                         "replayed_bubble": replayed.bubble, "replayed_step_ms": 1e3 * replayed.step_seconds,
                         "step_ms": 1e3 * wall[m],
                         "wall_bubble": 1 - per_microbatch * m / wall[m] if pp == 2 else None})
    return rows


def side_rows(setup: dict, ranks: list[dict]) -> list[dict]:
    side = setup["side_by_side"]
    return [{"schedule": s, "microbatches": m, **ranks[0][f"side {s} m{m}"]}
            for s in side["schedules"] for m in side["microbatches"]]


def _percent(share: float | None) -> str:
    return "-" if share is None else f"{share:.1%}"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="pp2, GPipe, a tiny model: a smoke run")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per bubble measurement")
    parser.add_argument("--reps", type=int, default=7, help="timed steps per variant side by side")
    parser.add_argument("--no-explain", action="store_true", help="skip timing explain of the 32-layer Llama")
    parser.add_argument("--json", help="also write the measurements here")
    args = parser.parse_args()
    setup = QUICK if args.quick else FULL
    steps, reps = (2, 2) if args.quick else (args.steps, args.reps)
    bubbles, sides = [], []
    for pp in setup["pp"]:
        try:
            ranks = launch(pp, setup, steps, reps)
        except Exception as e:  # noqa: BLE001  (a launch that fails is a row saying why)
            bubbles.append({"pp": pp, "error": failure(e)})
            continue
        bubbles += bubble_rows(pp, setup, ranks)
        sides += side_rows(setup, ranks) if pp == 2 else []
    print_table(["schedule", "pp", "microbatches", "predicted bubble", "replayed bubble", "replayed step ms",
                 "wall bubble", "wall step ms"],
                [[r["schedule"], r["pp"], r["microbatches"], _percent(r["predicted_bubble"]),
                  _percent(r["replayed_bubble"]), f"{r['replayed_step_ms']:.1f}", _percent(r["wall_bubble"]),
                  f"{r['step_ms']:.1f}"] if "error" not in r else ["-", r["pp"], r["error"], *["-"] * 5]
                 for r in bubbles])
    print()
    print_table(["schedule", "microbatches", "hand-split ms", "ours ms", "ours/hand"],
                [[r["schedule"], r["microbatches"], f"{r['hand_ms']:.1f}", f"{r['ours_ms']:.1f}",
                  f"{r['ours_ms'] / r['hand_ms']:.2f}x"] for r in sides])
    explained = None if args.no_explain or args.quick else explain_seconds()
    if explained:
        print(f"\nexplain, 32-layer Llama at pp4 x tp8 x dp_shard4 (128 ranks, meta): {explained['wall_s']:.1f} s "
              f"wall, {explained['cpu_s']:.1f} s CPU; stages of {explained['stages']} blocks")
    save_json(args.json, {"setup": {**setup, "steps": steps, "reps": reps}, "rows": bubbles,
                          "side_by_side": sides, "explain": explained})


if __name__ == "__main__":
    main()
