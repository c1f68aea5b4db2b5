"""Coverage of the real models: how much of each runs sharded at tp2, tp2 x ulysses2 and
tp2 x ring2, planned in one process without hardware.

    python -m benchmarks.coverage [--models llama,flux] [--out survey.txt] [--json out.json]

Each model of ``dtensor_par/_testing/real_models.py`` (transformers and diffusers from small configs) is
explained at each mesh: its sites, the share of linear FLOPs sharded (in blocks too), the
fallback gathers, the collectives and the warnings. ``--out`` writes every line of every
report, so that two trees can be compared line for line (a refactor must leave it unchanged).
"""

from __future__ import annotations

import argparse
import logging
import re

import torch

from benchmarks.report import failure, print_table, save_json
from dtensor_par._testing import real_models

MESHES = {"tp2": (("tp", 2),), "tp2 x ulysses2": (("tp", 2), ("ulysses", 2)), "tp2 x ring2": (("tp", 2), ("ring", 2))}


def survey(names: list[str]) -> list[dict]:
    """Each model at each mesh: its report's lines, or the error explain raised."""
    rows = []
    for name in names:
        for label, sizes in MESHES.items():
            try:
                report = real_models.explained(name, sizes)
            except Exception as e:  # noqa: BLE001  (a refusal is a row of the survey too)
                rows.append({"model": name, "mesh": label, "error": failure(e)})
                continue
            graphs = [{"sites": g.sites, "coverage": g.coverage.as_dict(), "summary": g.coverage.summary(),
                       "collectives": g.collectives, "warnings": g.warnings} for g in report.graphs]
            rows.append({"model": name, "mesh": label, "graphs": graphs})
    return rows


def lines(row: dict) -> list[str]:
    """A row as text, one line per fact, the planning time left out (it varies run to run)."""
    head = f"{row['model']} @ {row['mesh']}"
    if "error" in row:
        return [f"{head}: {row['error']}"]
    out = []
    for i, g in enumerate(row["graphs"]):
        out += [f"{head} graph {i}: {g['summary']}"] + [f"{head} graph {i} site: {s}" for s in g["sites"]]
        out += [f"{head} graph {i} collective: {sorted(c.items())}" for c in g["collectives"]]
        out += [f"{head} graph {i} warning: {re.sub(r' at 0x[0-9a-f]+', '', w)}" for w in g["warnings"]]
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", help="comma-separated names of dtensor_par/_testing/real_models.py (default: every one)")
    parser.add_argument("--out", help="write every report line here")
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args()
    logging.getLogger("dtensor_par").setLevel(logging.ERROR)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    names = args.models.split(",") if args.models else list(real_models.FACTORIES)
    rows = survey(names)
    table = []
    for row in rows:
        if "error" in row:
            table.append([row["model"], row["mesh"], "", "", "", row["error"]])
            continue
        cov = [g["coverage"] for g in row["graphs"]]
        block, sharded = sum(c["block_linear_flops"] for c in cov), sum(c["sharded_block_linear_flops"] for c in cov)
        table.append([row["model"], row["mesh"], sum(len(g["sites"]) for g in row["graphs"]),
                      f"{sharded / block:.1%}" if block else "-", sum(len(c["fallback_gathers"]) for c in cov),
                      sum(len(g["warnings"]) for g in row["graphs"])])
    print_table(["model", "mesh", "sites", "block linear FLOPs sharded", "fallback gathers", "warnings"], table)
    if args.out:
        with open(args.out, "w") as f:
            f.write("".join(f"{line}\n" for row in rows for line in lines(row)))
    save_json(args.json, rows)


if __name__ == "__main__":
    main()
