"""A rank's share of a recurrence over cp, forward and backward, on one CPU thread: transformers'
gated delta rule (``torch_chunk_gated_delta_rule``, Qwen3.5's), Mamba-2's selective scan
(``mamba2_chunk_scan``, Granite 4's) and Mamba-1's (``mamba_selective_scan``, Jamba's, run by
``ops.recurrence.selective_scan``).

    python -m benchmarks.recurrence [--lengths 2048 4096] [--cps 2 4] [--json out.json]

``whole``: the function on the whole sequence, what every cp rank ran when the recurrence gathered
its inputs. ``rank``: the two calls ``ops.recurrence.sharded_linear_recurrence`` makes on a rank's
``length / cp`` rows, through each kind's own ``ends`` and ``carried`` (each run's output and
end, then what a given state adds). Not counted: the gather of the runs' end states and their
fold, both independent of the length.
"""

from __future__ import annotations

import argparse
import time

import torch

from benchmarks.report import print_table, save_json
from dtensor_par.ops.recurrence import GatedDeltaRule, SelectiveScan, StateSpaceScan, recurrence

BATCH = 1


def _delta_rule(rows: int) -> tuple[dict, dict]:
    """Qwen3.5's shapes: 4 heads of 128."""
    q, k, v = (torch.randn(BATCH, rows, 4, 128) for _ in range(3))
    return {"query": q, "key": k, "value": v, "g": -torch.rand(BATCH, rows, 4), "beta": torch.rand(BATCH, rows, 4)}, {}


def _scan(rows: int) -> tuple[dict, dict]:
    """Granite 4's shapes, fewer heads: 8 heads of 64, one group of B and C of 128, chunks of 256."""
    return {"hidden_states": torch.randn(BATCH, rows, 8, 64), "dt": torch.randn(BATCH, rows, 8),
            "B": torch.randn(BATCH, rows, 1, 128), "C": torch.randn(BATCH, rows, 1, 128), "A": -torch.rand(8),
            "D": torch.randn(8), "dt_bias": torch.randn(8)}, {"chunk_size": 256, "dt_limit": (0.0, float("inf"))}


def _selective_scan(rows: int) -> tuple[dict, dict]:
    """Mamba-1's shapes, fewer channels: 256 channels, states of 16."""
    return {"hidden_states": torch.randn(BATCH, rows, 256), "dt": torch.randn(BATCH, rows, 256),
            "B": torch.randn(BATCH, rows, 1, 16), "C": torch.randn(BATCH, rows, 1, 16),
            "z": torch.randn(BATCH, rows, 256),
            "A": -torch.rand(256, 16), "D": torch.randn(256), "delta_bias": torch.randn(256)}, {}


KINDS = {"gated delta rule": (GatedDeltaRule, "transformers.models.qwen3_5.modeling_qwen3_5:torch_chunk_gated_delta_rule",
                              _delta_rule),
         "mamba-2 scan": (StateSpaceScan, "transformers.models.granitemoehybrid.modeling_granitemoehybrid:"
                                          "mamba2_chunk_scan", _scan),
         "mamba-1 scan": (SelectiveScan, "transformers.models.jamba.modeling_jamba:mamba_selective_scan",
                          _selective_scan)}


def _seconds(kind, fn, make, rows: int, as_a_rank: bool) -> float:
    """One forward and backward on ``rows`` rows: the whole sequence's one call from zeros, or a
    rank's two."""
    t, options = make(rows)
    t = {name: x.requires_grad_() for name, x in t.items()}
    begin = time.perf_counter()
    if as_a_rank:
        out, ends = kind.ends(fn, t, options)
        total = out.sum() + ends.sum() + kind.carried(fn, t, kind.state(t), options).sum()
    else:
        out, final = kind.call(fn, t, None, True, options)
        total = out.sum() + final.sum()
    total.backward()
    return time.perf_counter() - begin


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096])
    parser.add_argument("--cps", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json")
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    rows = []
    for label, (kind, rule, make) in KINDS.items():
        fn = recurrence(rule)
        for length in args.lengths:
            whole = min(_seconds(kind, fn, make, length, False) for _ in range(args.repeats))
            for cp in args.cps:
                rank = min(_seconds(kind, fn, make, length // cp, True) for _ in range(args.repeats))
                rows.append({"recurrence": label, "length": length, "cp": cp, "whole_ms": whole * 1e3,
                             "rank_ms": rank * 1e3, "rank / whole": rank / whole})
    print_table(list(rows[0]), [[f"{v:.2f}" if isinstance(v, float) else v for v in row.values()] for row in rows])
    save_json(args.json, rows)


if __name__ == "__main__":
    main()
