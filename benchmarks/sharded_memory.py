"""Training memory per rank of a parallelized 24-layer Llama, planned in one process, without hardware.

    python -m benchmarks.sharded_memory [--json out.json]   (from the repo root)

The model (vocab 32000, hidden 4096, 32 heads, 8 kv heads, mlp 11008, fp32) lives on the meta
device; ``explain(..., parallelized=True)`` plans it at tp = 2, 4 and 8 and reports the
parameter bytes each rank holds once ``dtensor_par.parallelize`` has sharded it. Training
memory per rank counts parameters + gradients + AdamW's exp_avg and exp_avg_sq, all shaped
like the parameters: 4 x the parameter bytes held (activations not counted). "one device"
is 4 x the full parameter bytes. The ideal ratio is 1/tp; what stays replicated (embedding,
LM head, norms) keeps the real one above it. The last row is the model run by
``hybrid_parallel`` alone (``parallelized=False``): every rank holds every parameter whole.
"""

import argparse

import torch

from benchmarks.report import print_table, save_json
from dtensor_par import explain
from dtensor_par._testing.models import Llama

TPS = (2, 4, 8)
STATE_COPIES = 4  # parameters, gradients, AdamW exp_avg, AdamW exp_avg_sq
GIB = 2**30


def kind(name: str) -> str:
    """Which part of the model a parameter belongs to."""
    if name.startswith("embed."):
        return "embedding"
    if name.startswith("lm_head."):
        return "lm_head"
    if name.endswith("norm.weight"):
        return "norms"
    return "blocks"


def measure(model, ids, tp: int, parallelized: bool) -> dict:
    report = explain(model, (ids,), tp=tp, parallelized=parallelized)
    held, full = report.parameter_bytes
    rows = {r["name"]: r for g in report.graphs for r in g.parameters}.values()
    replicated = {}  # kind -> bytes each rank holds of the parameters left whole on tp
    block_held = block_full = 0
    for r in rows:
        if r["local_shape"] == r["shape"]:
            replicated[kind(r["name"])] = replicated.get(kind(r["name"]), 0) + r["bytes"]
        if kind(r["name"]) == "blocks":
            block_held, block_full = block_held + r["bytes_per_rank"], block_full + r["bytes"]
    repl = sum(replicated.values())
    return {"tp": tp, "parallelized": parallelized, "param_bytes_per_rank": held, "param_bytes_full": full,
            "train_bytes_per_rank": STATE_COPIES * held, "train_bytes_one_device": STATE_COPIES * full,
            "ratio": held / full, "ideal_ratio": 1 / tp,
            "expected_ratio": (repl + (full - repl) / tp) / full if parallelized else 1.0,
            "block_weights_ratio": block_held / block_full, "replicated_bytes": replicated}


def _table_row(r: dict) -> list:
    repl = ", ".join(f"{k} {v / GIB:.3f}" for k, v in r["replicated_bytes"].items())
    repl = repl if r["parallelized"] else f"all {r['param_bytes_full'] / GIB:.2f} (plan replicates {repl})"
    return [r["tp"], "yes" if r["parallelized"] else "no", f"{r['param_bytes_per_rank'] / GIB:.2f}",
            f"{r['train_bytes_per_rank'] / GIB:.2f}", f"{r['train_bytes_one_device'] / GIB:.2f}", f"{r['ratio']:.3f}",
            f"{r['ideal_ratio']:.3f}", f"{r['expected_ratio']:.3f}", f"{r['block_weights_ratio']:.3f}", repl]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", help="also write the measurements here")
    args = parser.parse_args()

    with torch.device("meta"):
        model = Llama(vocab=32000, layers=24, hidden=4096, heads=32, kv_heads=8, mlp=11008)
        ids = torch.randint(0, 32000, (1, 512))
    rows = [measure(model, ids, tp, parallelized=True) for tp in TPS]
    rows.append(measure(model, ids, TPS[-1], parallelized=False))

    print_table(["tp", "parallelize", "params GiB/rank", "params + grads + AdamW GiB/rank", "one device GiB", "ratio",
                 "ideal 1/tp", "expected (replicated whole, rest / tp)", "block weights ratio", "replicated GiB/rank"],
                [_table_row(r) for r in rows])
    print("\nmodel: Llama, 24 layers, vocab 32000, hidden 4096, 32 heads, 8 kv heads, mlp 11008, fp32; "
          "ids (1, 512); training state = 4 x parameter bytes (activations not counted)")
    save_json(args.json, {"model": "Llama(vocab=32000, layers=24, hidden=4096, heads=32, kv_heads=8, mlp=11008), "
                                   "fp32, meta device, ids (1, 512)",
                          "state_copies": STATE_COPIES, "rows": rows})


if __name__ == "__main__":
    main()
