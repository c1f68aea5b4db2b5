"""A rank's share of a gated delta rule over cp: transformers' ``torch_chunk_gated_delta_rule``
(Qwen3.5's), forward and backward, on one CPU thread.

    python -m benchmarks.recurrence [--lengths 2048 4096] [--cps 2 4] [--json out.json]

``whole``: the rule on the whole sequence, what every cp rank ran when the recurrence gathered
its inputs. ``rank``: the two calls ``ops.recurrence.sharded_chunked_recurrence`` makes on a
rank's ``length / cp`` rows (values widened by k from ``[0 | I]``, then zero values from the
state the runs before leave). Not counted: the gather of the runs' states (``heads x k x
(v + k)`` float32 numbers a run) and the fold of them, both independent of the length.
"""

from __future__ import annotations

import argparse
import time

import torch

from benchmarks.report import print_table, save_json

BATCH, HEADS, HEAD_DIM = 1, 4, 128


def _seconds(rule, rows: int, width: int, start: bool) -> float:
    """One forward and backward of ``rule`` on ``rows`` rows, values ``width`` wide, from a given
    state or zeros."""
    q, k = torch.randn(BATCH, rows, HEADS, HEAD_DIM), torch.randn(BATCH, rows, HEADS, HEAD_DIM)
    v, g, beta = torch.randn(BATCH, rows, HEADS, width), -torch.rand(BATCH, rows, HEADS), torch.rand(BATCH, rows, HEADS)
    inputs = [t.requires_grad_() for t in (q, k, v, g, beta)]
    state = torch.zeros(BATCH, HEADS, HEAD_DIM, width) if start else None
    begin = time.perf_counter()
    out, final = rule(*inputs[:3], g=inputs[3], beta=inputs[4], initial_state=state, output_final_state=True,
                      use_qk_l2norm_in_kernel=True)
    (out.sum() + final.sum()).backward()
    return time.perf_counter() - begin


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096])
    parser.add_argument("--cps", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json")
    args = parser.parse_args()
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule as rule
    torch.manual_seed(0)
    torch.set_num_threads(1)
    rows = []
    for length in args.lengths:
        whole = min(_seconds(rule, length, HEAD_DIM, False) for _ in range(args.repeats))
        for cp in args.cps:
            rank = min(_seconds(rule, length // cp, 2 * HEAD_DIM, True) + _seconds(rule, length // cp, HEAD_DIM, True)
                       for _ in range(args.repeats))
            rows.append({"length": length, "cp": cp, "whole_ms": whole * 1e3, "rank_ms": rank * 1e3,
                         "rank / whole": rank / whole})
    print_table(list(rows[0]), [[f"{v:.2f}" if isinstance(v, float) else v for v in row.values()] for row in rows])
    save_json(args.json, rows)


if __name__ == "__main__":
    main()
