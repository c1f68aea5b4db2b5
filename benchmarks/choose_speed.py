"""How long ``choose_mesh`` takes over every mesh of 64 ranks for a 24-layer, 56-head model at
32k tokens, in one process, without hardware.

    python -m benchmarks.choose_speed [--layers 24] [--world 64] [--machine trn2-48xl] [--json out.json]

The model (56 heads of 128, 8 kv heads, as MiniMax-H3: tp alone stops at 8) lives on the
meta device. Wall time and CPU time (``time.process_time``) are both reported: on a shared
machine the wall time measures the load as much as the search. Target: 60 s or less.
"""

import argparse
import time

import torch

from benchmarks.report import print_table, save_json
from dtensor_par import choose_mesh
from dtensor_par._testing.models import Llama

TARGET_SECONDS = 60.0


def minimax_like(layers: int = 24, seq: int = 32768):
    """56 heads of 128 (hidden 7168), 8 kv heads, SwiGLU 18432, ``seq`` tokens, float32 (its RoPE is), on meta."""
    with torch.device("meta"):
        model = Llama(vocab=32000, layers=layers, hidden=56 * 128, heads=56, kv_heads=8, mlp=18432)
        ids = torch.randint(0, 32000, (1, seq))
    return model, (ids,)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--seq", type=int, default=32768)
    parser.add_argument("--world", type=int, default=64)
    parser.add_argument("--machine", default="trn2-48xl")
    parser.add_argument("--json", help="also write the measurements here")
    args = parser.parse_args()

    model, inputs = minimax_like(args.layers, args.seq)
    wall, cpu = time.perf_counter(), time.process_time()
    ranking = choose_mesh(model, inputs, args.world, machine=args.machine, top=10)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    row = {"layers": args.layers, "seq": args.seq, "world": args.world, "machine": args.machine,
           "legal": len(ranking), "rejected": len(ranking.rejected), "wall_seconds": wall, "cpu_seconds": cpu,
           "best": str(ranking[0]) if ranking else None, "target_seconds": TARGET_SECONDS}
    print_table(["layers", "seq", "world", "machine", "rejected", "choose wall s", "choose CPU s", "target"],
                [[args.layers, args.seq, args.world, args.machine, row["rejected"], f"{wall:.1f}", f"{cpu:.1f}",
                  f"<= {TARGET_SECONDS:.0f}"]])
    print(f"\nbest: {row['best']}")
    save_json(args.json, row)


if __name__ == "__main__":
    main()
