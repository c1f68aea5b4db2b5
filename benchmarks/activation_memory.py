"""Activation checkpointing: the bytes a rank keeps for backward, measured against predicted, and
the training step's time, with none, selective and full checkpointing of the blocks.

    python -m benchmarks.activation_memory [--quick] [--json out.json]   (from the repo root)

A Llama (GQA, RoPE, SwiGLU) and a DiT, 4 blocks each, parallelized and compiled with
``hybrid_parallel(mesh, activation_checkpointing=...)`` (aot_eager) at tp2, ulysses2 (2 gloo
ranks) and tp2 x ring2 (4). Kept bytes are measured on one training step with saved-tensor
hooks (every storage AOTAutograd saves for backward, the inputs' and parameters' left out) and
predicted by ``explain`` (``passes.saved``). Step times are medians of alternated repetitions,
each policy's against none's on the same rank.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import dtensor_par
from benchmarks.report import print_table, save_json
from dtensor_par._testing.harness import loss_of, run_ranks
from dtensor_par._testing.models import DiT, Llama

POLICIES = (None, "selective", "full")
MESHES = {"tp2": {"tp": 2}, "ulysses2": {"ulysses": 2}, "tp2 x ring2": {"tp": 2, "ring": 2}}
GOALS = {"selective": (0.5, 1.15), "full": (1 / 3, 1.35)}
"""Policy -> (kept bytes over none's at most, step time over none's at most)."""


def _models(quick: bool) -> dict:
    """Name -> (model factory, input): 4 blocks, 512 tokens (quick: 2 blocks, 64 tokens)."""
    layers, seq = (2, 64) if quick else (4, 512)
    return {"llama": (lambda: Llama(vocab=256, layers=layers, hidden=256, heads=8, kv_heads=4, mlp=704),
                      torch.randint(0, 256, (2, seq))),
            "dit": (lambda: DiT(layers=layers, dim=256, heads=8, mlp=1024), torch.randn(2, seq, 256))}


def _kept_bytes(compiled, x, held: set[int]) -> int:
    """Bytes of the storages the compiled model keeps for backward in one training step (its
    call's, not the loss's), those in ``held`` left out."""
    saved = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in held:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = compiled(x)
    loss_of(out).backward()
    return sum(saved.values())


def measure(rank: int, world: int, *, mesh_sizes: dict, quick: bool, repeats: int) -> list[dict]:
    """Each model at each policy on this rank: kept bytes measured and predicted, step time."""
    torch.set_num_threads(1)
    mesh = dtensor_par.init_mesh(**mesh_sizes)
    rows = []
    for name, (make, x) in _models(quick).items():
        steps = {}
        for policy in POLICIES:
            torch.manual_seed(0)
            model = make()
            options = {"inner_backend": "aot_eager", "activation_checkpointing": policy}
            report = dtensor_par.explain(model, (x,), **mesh_sizes, device_type="cpu", parallelized=True,
                                         **{k: v for k, v in options.items() if k != "inner_backend"})
            dtensor_par.parallelize(model, mesh, (x,), **options)
            compiled = torch.compile(model, backend=dtensor_par.hybrid_parallel(mesh, **options))
            held = {p.to_local().untyped_storage().data_ptr() for p in model.parameters()} | \
                {x.untyped_storage().data_ptr()}
            step = (lambda c=compiled: loss_of(c(x)))
            step().backward()  # compiles
            kept = _kept_bytes(compiled, x, held)
            steps[policy] = step
            rows.append({"model": name, "policy": policy or "none", "kept_bytes": kept,
                         "predicted_bytes": sum(g.activations["kept_bytes"] for g in report.graphs),
                         "recomputed_flops": sum(g.activations["recomputed_flops"] for g in report.graphs)})
        times = {p: [] for p in POLICIES}
        for _ in range(repeats):  # alternated, so a slow moment of the machine is shared
            for policy, step in steps.items():
                start = time.perf_counter()
                step().backward()
                times[policy].append(time.perf_counter() - start)
        for row, policy in zip(rows[-len(POLICIES):], POLICIES):
            row["step_ms"] = 1e3 * statistics.median(times[policy])
    return rows


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="2 blocks, 64 tokens, tp2 only (a smoke test)")
    parser.add_argument("--json", help="also write the measurements here")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    meshes = {"tp2": MESHES["tp2"]} if args.quick else MESHES
    rows = []
    for label, sizes in meshes.items():
        world = 1
        for size in sizes.values():
            world *= size
        for row in run_ranks(world, measure, mesh_sizes=sizes, quick=args.quick, repeats=args.repeats)[0]:
            rows.append({"mesh": label, **row})
    none = {(r["mesh"], r["model"]): r for r in rows if r["policy"] == "none"}
    table = []
    for r in rows:
        base = none[r["mesh"], r["model"]]
        r["kept_over_none"], r["step_over_none"] = r["kept_bytes"] / base["kept_bytes"], r["step_ms"] / base["step_ms"]
        goal = GOALS.get(r["policy"])
        r["meets_goal"] = goal is None or (r["kept_over_none"] <= goal[0] and r["step_over_none"] <= goal[1])
        table.append([r["model"], r["mesh"], r["policy"], f"{r['kept_bytes'] / 2**20:.2f}",
                      f"{r['predicted_bytes'] / 2**20:.2f}", f"{r['kept_over_none']:.2f}", f"{r['step_ms']:.0f}",
                      f"{r['step_over_none']:.2f}", "" if goal is None else ("yes" if r["meets_goal"] else "no")])
    print_table(["model", "mesh", "checkpointing", "kept MiB/rank (measured)", "predicted", "kept / none",
                 "step ms (median)", "step / none", "meets goal"], table)
    save_json(args.json, {"rows": rows, "goals": GOALS, "repeats": args.repeats})


if __name__ == "__main__":
    main()
