"""Does inductor's comm/compute reordering move our forward collectives?

    python -m benchmarks.overlap

One process, a fake process group (nothing is sent): a 2-block DiT forward at tp2 (the
all-reduces after the out and down projections) and at ulysses2 (the all-to-alls of q, of
k/v and of the output) is compiled twice: with plain inductor as the inner backend (a
callable is used as given: the collectives stay where the program calls them), and with
``inner_backend="inductor"``, which turns on inductor's ``raise_comms`` and ``sink_waits``
passes (``api.INDUCTOR_OVERLAP``). For each collective of the generated code it reports how
many compute kernels run between its issue and its wait: more with the passes means inductor
moved it. On CPU this is a report on the schedule, not a speed claim.
"""

from __future__ import annotations

import re

import torch
import torch.distributed as dist
from torch._inductor.compile_fx import compile_fx
from torch.testing._internal.distributed.fake_pg import FakeStore

import dtensor_par
from benchmarks.report import failure
from dtensor_par._testing.models import DiT

_ARG = r"\.default\((?:reinterpret_tensor\()?(\w+)"  # the first argument's buffer
_ISSUE = re.compile(r"_c10d_functional\.(all_reduce_?|all_to_all_single|all_gather_into_tensor|"
                    r"reduce_scatter_tensor)" + _ARG)
_WAIT = re.compile(r"_c10d_functional\.wait_tensor" + _ARG)
_COMPUTE = re.compile(r"\b(cpp_fused_\w+|extern_kernels\.\w+|aten\.\w+)\(")


def schedule(code: str) -> list[dict]:
    """Each collective of inductor's generated ``call``, in order: its op, and the compute
    kernels run between its issue and its wait."""
    issued, done = {}, []
    for line in code.splitlines():
        issue, wait = _ISSUE.search(line), _WAIT.search(line)
        target = re.match(r"\s*(\w+) = ", line)
        if issue:
            name = target.group(1) if target and issue.group(1) != "all_reduce_" else issue.group(2)
            issued[name] = {"op": issue.group(1).rstrip("_"), "compute_between": 0}
        elif wait and wait.group(1) in issued:
            done.append(issued.pop(wait.group(1)))
        elif _COMPUTE.search(line):
            for entry in issued.values():
                entry["compute_between"] += 1
    return done + list(issued.values())


def generated_code(mesh_sizes: dict, reorder: bool, seq: int) -> str:
    """Inductor's code for the forward; ``reorder``: our default inner backend, else plain inductor."""
    torch._dynamo.reset()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        mesh = dtensor_par.init_mesh(**mesh_sizes)
        torch.manual_seed(0)
        model, x = DiT(layers=2, dim=64, heads=4, mlp=128), torch.randn(1, seq, 64)
        inner = "inductor" if reorder else compile_fx
        compiled = torch.compile(model, backend=dtensor_par.hybrid_parallel(mesh, inner_backend=inner))
        with torch.no_grad():
            _, codes = torch._inductor.utils.run_and_get_code(compiled, x)
        return "\n".join(codes)
    finally:
        dist.destroy_process_group()
        torch._dynamo.reset()


def report(quick: bool = False) -> dict:
    if quick:
        return {"text": "skipped in --quick (each inductor compile takes tens of seconds on CPU)", "rows": []}
    rows, lines = [], ["| mesh | collective | compute kernels between issue and wait: as called "
                       "| with raise_comms + sink_waits |", "| --- | --- | --- | --- |"]
    for mesh_sizes in ({"tp": 2}, {"ulysses": 2}):
        try:
            as_called, overlapped = (schedule(generated_code(mesh_sizes, r, 64)) for r in (False, True))
        except Exception as e:  # noqa: BLE001  reported, not hidden
            lines.append(f"| {mesh_sizes} | failed: {failure(e, 200)} | | |")
            continue
        for i, (d, r) in enumerate(zip(as_called, overlapped)):
            row = {"mesh": mesh_sizes, "index": i, "op": d["op"], "as_called": d["compute_between"],
                   "overlapped": r["compute_between"], "overlapped_op": r["op"]}
            rows.append(row)
            lines.append(f"| {mesh_sizes} | {i}: {d['op']} | {d['compute_between']} | {r['compute_between']} |")
        if len(as_called) != len(overlapped):
            lines.append(f"| {mesh_sizes} | collective counts differ: {len(as_called)} vs {len(overlapped)} | | |")
    moved = sum(r["overlapped"] > r["as_called"] for r in rows)
    lines.append(f"\n{moved} of {len(rows)} forward collectives have more compute between issue and wait with "
                 "the passes on (moved); each of the others is read by the next op, with no compute that does "
                 "not need it in between.")
    return {"text": "\n".join(lines), "rows": rows}


if __name__ == "__main__":
    print(report()["text"])
