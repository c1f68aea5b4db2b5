"""Loading a transformers checkpoint piece by piece: each rank's peak RSS rise, bytes read and
held, and time, beside one device's ``LlamaForCausalLM.from_pretrained`` of the same folder.

    python -m benchmarks.loading [--cache DIR] [--json out.json]   (from the repo root)

Two random float32 Llama checkpoints (written once under ``--cache``, 4 to 6 shards): ~300 MB
(hidden 1024, 4 layers) and ~1.2 GB (hidden 2048, 8 layers). Each is read at tp2 (world 2),
tp2 x ulysses2 and dp_shard2 x tp2 (world 4) on gloo ranks, in ``from_pretrained``'s two steps:
planning (built on meta, ``parallelize``: Dynamo traces the model once) and reading
(``load_checkpoint``). Goals: a rank's RSS rise while reading at most the bytes it holds + 64 MB,
and at most "checkpoint / ranks + 64 MB" (both are shown), and the time at most 1.2 x one device's (run in a fresh process; transformers 5 maps a float32
file into float32 parameters, so its time and RSS are also shown with every parameter read once).
Then each rank's ``save_pretrained`` of what it read (each rank writes its share of the files;
its RSS rise is at most the largest tensor it gathers + the 16 MB block buffer), beside one
device's transformers ``save_pretrained`` of the whole model.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

from benchmarks.report import print_table, save_json
from dtensor_par._testing.harness import run_ranks
from dtensor_par._testing.loading import MIB, checkpoint_bytes, llama_checkpoint, load_measured

CHECKPOINTS = {"300MB": dict(hidden=1024, intermediate=4096, layers=4, vocab=8000, max_shard_size="100MB"),
               "1.2GB": dict(hidden=2048, intermediate=3584, layers=8, vocab=8000, max_shard_size="300MB")}
MESHES = {"tp2": {"tp": 2}, "tp2 x ulysses2": {"tp": 2, "ulysses": 2}, "dp_shard2 x tp2": {"dp_shard": 2, "tp": 2}}
SLACK = 64 * MIB


def one_device(folder: str, save_to: str) -> dict:
    """transformers' ``from_pretrained`` of ``folder``, then its ``save_pretrained``, in a fresh process."""
    out = subprocess.run([sys.executable, "-m", "dtensor_par._testing.loading", folder, save_to], check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def rows_for(name: str, folder: str) -> list[dict]:
    whole = checkpoint_bytes(folder)
    with tempfile.TemporaryDirectory(dir=os.path.dirname(folder)) as saved:
        reference = one_device(folder, os.path.join(saved, "one device"))
        rows = [{"checkpoint": name, "mesh": "one device", "bytes": whole, **reference}]
        for mesh, sizes in MESHES.items():
            world = 1
            for size in sizes.values():
                world *= size
            results = run_ranks(world, load_measured, folder=folder, sizes=sizes, save_to=os.path.join(saved, mesh))
            for rank, r in enumerate(results):
                rows.append({"checkpoint": name, "mesh": mesh, "rank": rank, "world": world, "bytes": whole, **r,
                             "seconds": r["plan_s"] + r["read_s"], "one_device_s": reference["touched_s"],
                             "one_device_save_s": reference["save_s"]})
    return rows


def _cells(r: dict) -> list:
    mib = lambda b: f"{b / MIB:.0f}"  # noqa: E731
    if r["mesh"] == "one device":
        return [r["checkpoint"], "one device", "", mib(r["held_bytes"]),
                f"{mib(r['rise'])} (mapped); {mib(r['touched_rise'])} used", "", "", mib(r["read_bytes"]), "", "",
                f"{r['seconds']:.2f} (mapped); {r['touched_s']:.2f} used", ""]
    goal = r["held_bytes"] + SLACK
    return [r["checkpoint"], r["mesh"], r["rank"], mib(r["held_bytes"]), mib(r["read_rise"]),
            f"{mib(goal)} {'yes' if r['read_rise'] <= goal else 'NO'}", mib(r["bytes"] / r["world"] + SLACK),
            mib(r["read_bytes"]), mib(r["plan_rise"]), f"{r['plan_s']:.1f}", f"{r['read_s']:.2f}",
            f"{r['seconds'] / r['one_device_s']:.1f}x / {r['read_s'] / r['one_device_s']:.2f}x"]


COLUMNS = ["checkpoint", "mesh", "rank", "held MiB", "read: RSS rise MiB", "goal held + 64 (met)",
           "checkpoint / ranks + 64", "read MiB", "plan: RSS rise MiB", "plan s", "read s",
           "vs one device: plan + read / read"]


def _save_cells(r: dict) -> list:
    mib = lambda b: f"{b / MIB:.0f}"  # noqa: E731
    if r["mesh"] == "one device":
        return [r["checkpoint"], "one device", "", "", mib(r["save_rise"]), "", f"{r['save_s']:.2f}", ""]
    return [r["checkpoint"], r["mesh"], r["rank"], mib(r["written_bytes"]), mib(r["save_rise"]),
            mib(r["largest_bytes"]), f"{r['save_s']:.2f}", f"{r['save_s'] / r['one_device_save_s']:.2f}x"]


SAVE_COLUMNS = ["checkpoint", "mesh", "rank", "wrote MiB", "save: RSS rise MiB", "largest tensor MiB", "save s",
                "vs one device"]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--cache", default=os.path.join(tempfile.gettempdir(), "dtensor_par_loading"),
                        help="where the checkpoints are written once")
    parser.add_argument("--only", choices=list(CHECKPOINTS), help="one checkpoint")
    parser.add_argument("--json", help="also write the measurements here")
    args = parser.parse_args()
    rows = []
    for name, config in CHECKPOINTS.items():
        if args.only in (None, name):
            rows += rows_for(name, llama_checkpoint(os.path.join(args.cache, f"llama-{name}"), **config))
    print_table(COLUMNS, [_cells(r) for r in rows])
    print()
    print_table(SAVE_COLUMNS, [_save_cells(r) for r in rows])
    print("\nRSS rises are peaks (VmHWM reset by clear_refs); read MiB: /proc/self/io rchar (mapped pages are not "
          "counted); one device: transformers maps the file, its pages come in at first use ('used': every parameter "
          "summed once), and runs alone; ranks share the machine's cores")
    save_json(args.json, {"checkpoints": CHECKPOINTS, "meshes": MESHES, "rows": rows})


if __name__ == "__main__":
    main()
