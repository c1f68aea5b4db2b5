"""Ours against what a user would write by hand, side by side, in one run.

    python -m benchmarks [--quick] [--reps 5] [--compile-reps 4] [--inner inductor] [--json benchmarks.json]

from the repo root; ``python -m benchmarks.side_by_side`` is the same run (``__main__.py`` calls
``main`` here: spawned ranks import what they run from a module).

Per configuration (a model and a mesh), on gloo ranks on CPU, one thread each, the same
weights and input everywhere:

- step time, forward (no_grad) and training step (forward + backward + AdamW), medians of
  ``--reps`` repetitions alternated between the variants (so drift hits all alike):
  "ours" (``dtensor_par.parallelize`` + ``hybrid_parallel(inner_backend="aot_eager")``),
  the PyTorch anchor (``parallelize_module`` with a Colwise/Rowwise plan and the hand edits
  of ``models.TP_HAND_EDITS``, compiled with aot_eager; or ``context_parallel``, eager, for
  ring and for ulysses: torch's one form of context parallelism), and the one-device model
  (``torch.compile(backend="aot_eager")``) run on every rank at once; speedup = one device /
  ours. Over cp alone ours holds the parameters whole, as ``context_parallel`` does
  (``fsdp_dims=()``). What fails is recorded, not hidden.
- collectives a step runs (profiler): calls and bytes per rank put into them, forward and
  backward, against the analytic minimum of the strategy (``analytic_bytes``), with what
  lies above it by op.
- gradient reductions: buckets against one reduction per parameter (``explain``, fake group).
- compile overhead: first call (forward and backward, compiles included; the optimizer's
  first step apart) with our backend against plain ``torch.compile`` with the same inner
  backend: each compiled afresh, slowest rank, median of ``--compile-reps`` alternated (each
  variant in turn first); and the share of our passes in it (``dtensor_par`` debug log).
- memory per rank: parameters, gradients and AdamW state (bytes of the local pieces), and
  activations saved for backward (measured with saved-tensor hooks: distinct storages).
- parallel efficiency, one device / (world x ours), and the same for the anchor;
- the models: the DiT (``dit``; ``dit_qk``: q and k RMS-normed per head, as Flux's), the Llama;
  ``--inner``: the backend of ours, the one device model and the compiled anchors (aot_eager;
  inductor); ``context_parallel`` runs eager;
- diffusers' Flux transformer against diffusers' own ``enable_parallelism`` (ulysses2; tp2,
  which diffusers refuses on CPU, recorded), ``diffusers_peer.py``;
- forward overlap under inductor (``overlap.py``), greedy decoding with a kv cache at tp=2
  and ring=2 against one device (``decode.py``; skipped in ``--quick``), and a GPU section
  (``gpu.py``), skipped on CPU with a line saying so.

Numbers measured on a shared or oversubscribed machine (world 4 on 2 cores) are noise-bound.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import gc
import json
import logging
import os
import platform
import statistics
import time
import traceback
from collections import defaultdict

import torch

import dtensor_par
from benchmarks import decode, gpu, overlap
from benchmarks.models import TP_HAND_EDITS, WithLoss, ddp_anchor, fsdp_anchor, ours, tp_anchor
from benchmarks.report import failure
from benchmarks.timing import adamw, slowest, timed
from dtensor_par._testing.harness import dp_rows, executed_collectives, logged, run_ranks
from dtensor_par._testing.models import DiT, Llama

FULL = {"dit": {"layers": 2, "dim": 256, "heads": 8, "mlp": 1024},
        "dit_qk": {"layers": 2, "dim": 256, "heads": 8, "mlp": 1024, "qk_norm": True},
        "llama": {"layers": 2, "hidden": 256, "heads": 8, "kv_heads": 4, "mlp": 768, "vocab": 512}}
QUICK = {"dit": {"layers": 1, "dim": 64, "heads": 4, "mlp": 128},
         "dit_qk": {"layers": 1, "dim": 64, "heads": 4, "mlp": 128, "qk_norm": True},
         "llama": {"layers": 1, "hidden": 64, "heads": 4, "kv_heads": 2, "mlp": 96, "vocab": 64}}
CONFIGS = {2: [("dit", {"tp": 2}), ("dit_qk", {"tp": 2}), ("llama", {"tp": 2}), ("dit", {"ring": 2}),
               ("dit_qk", {"ring": 2}), ("dit_qk", {"ulysses": 2}), ("llama", {"ulysses": 2}),
               ("llama", {"dp_replicate": 2})],
           4: [("dit", {"tp": 4}), ("dit", {"ring": 4}), ("llama", {"tp": 2, "ulysses": 2}),
               ("llama", {"dp_shard": 2, "tp": 2})]}
QUICK_CONFIGS = {2: [("dit", {"tp": 2})]}


def build(name: str, sizes: dict, seq: int, mesh: dict):
    """The model (seeded: the same weights on every rank) and its input: one sequence per dp rank."""
    return model_and_input(name, sizes, seq, mesh.get("dp_replicate", 1) * mesh.get("dp_shard", 1))


def model_and_input(name: str, sizes: dict, seq: int, batch: int):
    """The model (seeded: the same weights on every rank) and an input of ``batch`` sequences."""
    torch.manual_seed(0)
    if name.startswith("dit"):
        return DiT(**sizes), torch.randn(batch, seq, sizes["dim"])
    return Llama(**sizes), torch.randint(0, sizes["vocab"], (batch, seq))


def on_own_rows(fn, mesh, x):
    """``fn`` given this rank's rows of the batch, as a DistributedSampler feeds DDP and FSDP2
    (ours is given the whole batch and cuts it over dp itself)."""
    rows = dp_rows(mesh, len(x))
    return lambda _: fn(x[rows])


def train_step(fn, opt, x) -> None:
    opt.zero_grad(set_to_none=True)
    fn(x).backward()
    opt.step()


def forward(fn, x) -> None:
    with torch.no_grad():
        fn(x)


def pass_ms(records: list[logging.LogRecord]) -> dict[str, float]:
    """Milliseconds per pass, summed, from the times ``pipeline.py`` logs at debug level."""
    ms = defaultdict(float)
    for record in records:
        if record.msg == "%s: %.1f ms":
            ms[record.args[0]] += record.args[1]
    return ms


def local_bytes(tensors) -> int:
    total = 0
    for t in tensors:
        if isinstance(t, torch.Tensor):
            t = t.to_local() if hasattr(t, "to_local") else t
            total += t.numel() * t.element_size()
    return total


def memory(model, fn, opt, x) -> dict:
    """Bytes this rank holds to train ``model`` (run as ``fn``): parameters, gradients, AdamW
    state (after a step), and the activations one training step saves for backward."""
    saved = {}

    def pack(t):
        local = t.to_local() if hasattr(t, "to_local") else t
        if local.device.type != "meta":
            storage = local.untyped_storage()
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    opt.zero_grad(set_to_none=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = fn(x)
    loss.backward()
    opt.step()
    params = list(model.parameters())
    return {"params": local_bytes(params), "grads": local_bytes(p.grad for p in params),
            "optimizer": local_bytes(v for s in opt.state.values() for v in s.values() if v.dim() > 0),
            "saved_activations": sum(saved.values())}


def context_parallel_variant(model: WithLoss, mesh, x):
    """torch's ``context_parallel`` (eager) over a 1-D mesh: a fresh copy of ``x`` is sharded
    along the sequence in place at each call; attention runs as torch's ring attention; the
    loss is the mean over ranks of each rank's loss (equal shards)."""
    from torch.distributed.nn.functional import all_reduce
    from torch.distributed.tensor.experimental import context_parallel

    def call(_):
        shard = x.clone()
        with context_parallel(mesh, buffers=[shard], buffer_seq_dims=[1]):
            local = model(shard)
        return all_reduce(local, group=mesh.get_group()) / mesh.size()

    return call


def _variants(name, sizes, seq, mesh_sizes, mesh, inner):
    """(model, loss callable, note) per variant, all from the same weights; ``inner``: the
    backend that compiles ours, the one-device model and the tp anchor. Each compiles the
    model with its loss (``WithLoss``), as a training script does."""
    model, x = build(name, sizes, seq, mesh_sizes)
    out = {"one_device": (*one_device(model, inner), f"torch.compile(backend={inner!r})")}
    if set(mesh_sizes) == {"tp"}:
        anchor = WithLoss(tp_anchor(model, mesh["tp"]))
        out["torch"] = (anchor, torch.compile(anchor, backend=inner),
                        f"parallelize_module (colwise q/k/v/up/gate, rowwise out/down), torch.compile(backend={inner!r})")
    elif set(mesh_sizes) in ({"ring"}, {"ulysses"}):  # torch's context parallelism has one form, its ring
        anchor = WithLoss(copy.deepcopy(model))
        out["torch"] = (anchor, context_parallel_variant(anchor, mesh[next(iter(mesh_sizes))], x),
                        "context_parallel (eager; compiled: not tried, its tracing took over 12 minutes in "
                        "issue 11's measurement)")
    elif set(mesh_sizes) == {"dp_shard", "tp"}:
        anchor = fsdp_anchor(model, mesh)
        out["torch"] = (anchor, on_own_rows(torch.compile(anchor, backend=inner), mesh, x),
                        f"fully_shard per block and root over dp_shard + parallelize_module over tp, "
                        f"torch.compile(backend={inner!r}); each rank given its own sequence")
    elif set(mesh_sizes) == {"dp_replicate"}:
        anchor = ddp_anchor(model)
        out["torch"] = (anchor, on_own_rows(torch.compile(anchor, backend=inner), mesh, x),
                        f"DistributedDataParallel, torch.compile(backend={inner!r}); each rank given its own sequence")
    note = f"dtensor_par.parallelize + hybrid_parallel(inner_backend={inner!r})"
    if set(mesh_sizes) <= {"ring", "ulysses"}:
        note += "; parameters whole on every rank (fsdp_dims=()), as context_parallel holds them"
    out["ours"] = (*ours(model, mesh, (x,), inner=inner), note)
    return out, x


def one_device(model, inner):
    """A copy of ``model`` with its loss, and its ``torch.compile`` form."""
    one = WithLoss(copy.deepcopy(model))
    return one, torch.compile(one, backend=inner)


def first_call_seconds(name, sizes, seq, mesh_sizes, mesh, inner, reps) -> tuple[dict, dict]:
    """Compile overhead: the first forward and backward of a model compiled afresh (Dynamo's
    caches reset, garbage collected), on the slowest rank, median of ``reps`` alternated
    between one device and ours, each in turn first (one device, ours, ours, one device...:
    a compile's time depends on what the process compiled before it); and our passes' mean
    time per compile (ms)."""
    model, x = build(name, sizes, seq, mesh_sizes)
    makers = {"one_device": lambda: one_device(model, inner),
              "ours": lambda: ours(copy.deepcopy(model), mesh, (x,), inner=inner)}
    times, records = defaultdict(list), []
    for rep in range(reps):
        for v, make in list(makers.items())[::1 if rep % 2 == 0 else -1]:
            torch._dynamo.reset()
            _, fn = make()
            gc.collect()
            with logged(logging.DEBUG) as logs:  # the passes the first call runs, not parallelize's planning
                times[v].append(slowest(timed(lambda: fn(x).backward())))
            records += logs
    return ({v: statistics.median(t) for v, t in times.items()},
            {k: ms / reps for k, ms in pass_ms(records).items()})


def measure_config(world, name, sizes, seq, mesh_sizes, reps, compile_reps, inner) -> dict:
    mesh = dtensor_par.init_mesh(**mesh_sizes)
    result = {"model": name, "mesh": mesh_sizes, "world": world, "seq": seq, "notes": {}, "failed": {},
              "first_call_s": {}, "pass_ms": {}, "ms": {}, "memory": {}, "collectives": {}}
    if compile_reps:
        result["first_call_s"], result["pass_ms"] = first_call_seconds(name, sizes, seq, mesh_sizes, mesh, inner,
                                                                       compile_reps)

    torch._dynamo.reset()
    variants, x = _variants(name, sizes, seq, mesh_sizes, mesh, inner)
    opts = {v: adamw(m) for v, (m, _, _) in variants.items()}
    fns = {v: fn for v, (_, fn, _) in variants.items()}
    result["notes"] = {v: note for v, (_, _, note) in variants.items()}
    losses = {}
    for v in ("one_device", "ours", "torch"):  # first call: compiles
        if v not in fns:
            continue
        try:
            fns[v](x).backward()
            opts[v].zero_grad(set_to_none=True)
            with torch.no_grad():
                losses[v] = fns[v](x).item()
        except Exception as e:  # noqa: BLE001  recorded in the table, never hidden
            result["failed"][f"{v} training step"] = failure(e)
            if v != "torch":
                raise
    result["losses_after_one_step"] = losses

    steps = [v for v in fns if f"{v} training step" not in result["failed"]]
    fwds = list(fns)
    for v in fwds:  # warm-up: no_grad compiles anew
        try:
            forward(fns[v], x)
        except Exception as e:  # noqa: BLE001
            result["failed"][f"{v} forward"] = failure(e)
    fwds = [v for v in fwds if f"{v} forward" not in result["failed"]]
    for v in steps:
        train_step(fns[v], opts[v], x)
    times = defaultdict(list)
    for _ in range(reps):
        for v in steps:  # alternated, so drift hits every variant alike
            times[f"step/{v}"].append(timed(lambda: train_step(fns[v], opts[v], x)))
        for v in fwds:
            times[f"forward/{v}"].append(timed(lambda: forward(fns[v], x)))
    result["ms"] = {k: 1e3 * statistics.median(t) for k, t in times.items()}

    for v in steps:
        result["memory"][v] = memory(variants[v][0], fns[v], opts[v], x)
    for v in ("ours", "torch"):
        if v not in fns:
            continue
        phases = {}
        if v in fwds:
            phases["forward"] = executed_collectives(lambda: forward(fns[v], x))
        if v in steps:
            holder = {}
            train = executed_collectives(lambda: holder.setdefault("loss", fns[v](x)))
            phases["train_forward"] = train
            phases["backward"] = executed_collectives(lambda: holder["loss"].backward())
        result["collectives"][v] = {p: _by_op(c) for p, c in phases.items()}
    return result


def _by_op(calls: list[tuple[str, int]]) -> dict:
    out = defaultdict(lambda: {"calls": 0, "bytes": 0})
    for name, nbytes in calls:
        out[name]["calls"] += 1
        out[name]["bytes"] += nbytes
    return dict(out)


def run_world(rank, world, *, configs, shapes, seq, reps, compile_reps, inner) -> list:
    results = []
    for name, mesh_sizes in configs:
        try:
            results.append(measure_config(world, name, shapes[name], seq, mesh_sizes, reps, compile_reps, inner))
        except Exception as e:  # noqa: BLE001  one broken configuration does not hide the others
            traceback.print_exc()
            results.append({"model": name, "mesh": mesh_sizes, "world": world, "seq": seq,
                            "error": failure(e)})
    return results


def analytic_bytes(name: str, sizes: dict, seq: int, mesh: dict, param_bytes: int) -> dict:
    """The least each rank must put into collectives per training step, by phase (fp32,
    batch 1): tp: 2 all-reduces of the activation per block, forward and backward (Megatron);
    ulysses: q/k/v (kv with the model's kv heads) in and the output back, forward and
    backward; ring: ring - 1 kv-block rotations forward, and backward ring - 1 transfers of
    the blocks' partial dk, dv (the kv blocks kept from forward); cp: every parameter's local
    gradient reduced once, and the loss's partial sums (one float) combined; dp_shard (FSDP,
    ``param_bytes`` the pieces held): the pieces all-gathered forward and again backward, the
    gradients (dp_shard times the pieces) reduce-scattered; dp_replicate: the gradients
    all-reduced."""
    tp, ring, ulysses, fsdp = (mesh.get(d, 1) for d in ("tp", "ring", "ulysses", "dp_shard"))
    cp = ring * ulysses
    layers, dim = sizes["layers"], sizes.get("dim", sizes.get("hidden"))
    heads, kv_heads = sizes["heads"], sizes.get("kv_heads", sizes["heads"])
    head_dim, rows = dim // heads, seq // cp  # rows: this rank's sequence positions
    act = rows * dim * 4
    forward = backward = 0
    if tp > 1:
        forward += 2 * layers * act
        backward += 2 * layers * act
    if ulysses > 1:
        exchange = layers * rows * (2 * heads + 2 * kv_heads) * head_dim // tp * 4
        forward += exchange
        backward += exchange
    if ring > 1:
        kv_block = 2 * rows * kv_heads * head_dim // tp * 4
        forward += layers * (ring - 1) * kv_block
        backward += layers * (ring - 1) * kv_block
    gradients = param_bytes if cp > 1 or mesh.get("dp_replicate", 1) > 1 else 0
    if fsdp > 1:
        forward += param_bytes
        backward += param_bytes
        gradients = param_bytes * fsdp
    forward += 4 if cp > 1 else 0
    return {"forward": forward, "backward": backward + gradients, "gradient_reductions": gradients}


def gradient_buckets(name: str, sizes: dict, seq: int, mesh: dict) -> dict:
    """Gradient reductions a step issues for the parameters, from ``explain`` (fake group):
    flat buckets now, against one reduction per parameter (``grad_bucket_mb=0``)."""
    model, x = build(name, sizes, seq, mesh)
    out = {}
    for label, mb in (("buckets", 25.0), ("per_parameter", 0.0)):
        report = dtensor_par.explain(model, (x,), device_type="cpu", parallelized=True, grad_bucket_mb=mb, **mesh)
        rows = [c for g in report.graphs for c in g.collectives if c["site"].startswith("gradient bucket")]
        out[label] = sum(c["count"] for c in rows)
        out[f"{label}_bytes"] = sum(c["count"] * c["bytes_per_rank"] for c in rows)
    return out


def _mesh_text(mesh: dict) -> str:
    return " x ".join(f"{d}{n}" for d, n in mesh.items())


def _sum(phase: dict | None) -> tuple[int, int]:
    phase = phase or {}
    return sum(c["calls"] for c in phase.values()), sum(c["bytes"] for c in phase.values())


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f}"


def _ratio(a, b) -> str:
    return f"{a / b:.2f}" if a is not None and b else "-"


def _efficiency(r: dict, phase: str) -> str:
    """Parallel efficiency, one device's time / (world x the variant's): ours (the peer's)."""
    ms, world = r["ms"], r["world"]
    one = ms.get(f"{phase}/one_device")
    cell = lambda v: f"{one / (world * ms[f'{phase}/{v}']):.0%}" if one and f"{phase}/{v}" in ms else "-"  # noqa: E731
    return f"{cell('ours')} ({cell('torch')})"


def _above(r: dict) -> str:
    """Bytes above the analytic minimum, forward and backward."""
    c, a = r["collectives"].get("ours", {}), r["analytic_bytes"]
    excess = {"forward": _sum(c.get("train_forward"))[1] - a["forward"],
              "backward": _sum(c.get("backward"))[1] - a["backward"]}
    return ", ".join(f"{phase} {_mib(n)} MiB" for phase, n in excess.items() if n)


def tables(results: list[dict]) -> str:
    """The printed report: step time, collectives, gradient buckets, compile, memory, failures."""
    out = ["| model | mesh | fwd ours ms | fwd torch ms | fwd 1-dev ms | step ours ms | step torch ms "
           "| step 1-dev ms | fwd ours/torch | step ours/torch | speedup 1-dev/ours (step) "
           "| fwd efficiency ours (torch) | step efficiency ours (torch) |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    ok = [r for r in results if "error" not in r]
    for r in ok:
        ms = r["ms"]
        cell = lambda k: f"{ms[k]:.1f}" if k in ms else "-"  # noqa: E731
        out.append(f"| {r['model']} | {_mesh_text(r['mesh'])} | {cell('forward/ours')} | {cell('forward/torch')} "
                   f"| {cell('forward/one_device')} | {cell('step/ours')} | {cell('step/torch')} "
                   f"| {cell('step/one_device')} | {_ratio(ms.get('forward/ours'), ms.get('forward/torch'))} "
                   f"| {_ratio(ms.get('step/ours'), ms.get('step/torch'))} "
                   f"| {_ratio(ms.get('step/one_device'), ms.get('step/ours'))} "
                   f"| {_efficiency(r, 'forward')} | {_efficiency(r, 'step')} |")
    out += ["", "Collectives per training step, ours (calls; MiB this rank puts into them; the analytic minimum):",
            "| model | mesh | fwd calls | fwd MiB | fwd min MiB | fwd ratio | bwd calls | bwd MiB | bwd min MiB "
            "| bwd ratio | grad buckets (per-parameter before) | forward ops (calls, MiB) | backward ops (calls, MiB) |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in ok:
        c = r["collectives"].get("ours", {})
        (fc, fb), (bc, bb) = _sum(c.get("train_forward")), _sum(c.get("backward"))
        a, g = r["analytic_bytes"], r["grad_buckets"]
        ops = lambda p: ", ".join(f"{k} {v['calls']} {_mib(v['bytes'])}" for k, v in (p or {}).items())  # noqa: E731
        out.append(f"| {r['model']} | {_mesh_text(r['mesh'])} | {fc} | {_mib(fb)} | {_mib(a['forward'])} "
                   f"| {_ratio(fb, a['forward'])} | {bc} | {_mib(bb)} | {_mib(a['backward'])} "
                   f"| {_ratio(bb, a['backward'])} | {g['buckets']} ({g['per_parameter']}) "
                   f"| {ops(c.get('train_forward'))} | {ops(c.get('backward'))} |")
    out.append("\nAbove the minimum: " + ("; ".join(
        f"{r['model']} {_mesh_text(r['mesh'])}: {_above(r)}" for r in ok if _above(r)) or "nothing"))
    out += ["", "Compile overhead (first forward and backward, compiles included) and memory per rank (MiB):",
            "| model | mesh | first call ours s | first call plain torch.compile s | ratio | our passes s (share) "
            "| ours: params / grads / AdamW / saved activations | torch | one device |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in ok:
        first, passes = r["first_call_s"], sum(r["pass_ms"].values()) / 1e3
        mem = lambda v: " / ".join(_mib(r["memory"][v][k]) for k in ("params", "grads", "optimizer",  # noqa: E731
                                                                     "saved_activations")) if v in r["memory"] else "-"
        out.append(f"| {r['model']} | {_mesh_text(r['mesh'])} | {first.get('ours', 0):.2f} "
                   f"| {first.get('one_device', 0):.2f} | {_ratio(first.get('ours'), first.get('one_device'))} "
                   f"| {passes:.2f} ({passes / first.get('ours', 1):.0%}) | {mem('ours')} | {mem('torch')} "
                   f"| {mem('one_device')} |")
    failed = [(r, k, v) for r in ok for k, v in r["failed"].items()] + [(r, "configuration", r["error"])
                                                                       for r in results if "error" in r]
    out += ["", "Recorded failures:" if failed else "Recorded failures: none"]
    out += [f"- {r['model']} {_mesh_text(r['mesh'])}: {what}: {why}" for r, what, why in failed]
    return "\n".join(out)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run: one tiny configuration at world 2, 2 reps, inner backend eager")
    parser.add_argument("--reps", type=int, default=5, help="timed repetitions per variant (at least 5)")
    parser.add_argument("--compile-reps", type=int, default=4,
                        help="fresh compiles per variant for the compile overhead (median)")
    parser.add_argument("--seq", type=int, default=None, help="sequence length (default 1024, quick 64)")
    parser.add_argument("--inner", choices=["aot_eager", "inductor"], default=None,
                        help="the inner backend of ours, the one-device model and the compiled peers "
                             "(default aot_eager, quick eager)")
    parser.add_argument("--json", default="benchmarks.json", help="where to write the measurements")
    parser.add_argument("--world", type=int, action="append", choices=sorted(CONFIGS),
                        help="only the configurations of this world size (repeatable; default all)")
    parser.add_argument("--mesh", action="append",
                        help="only the configurations at this mesh, as the table writes it (e.g. ring2, 'tp2 x ulysses2'; "
                             "repeatable)")
    parser.add_argument("--timed-only", action="store_true",
                        help="the step and forward times and the diffusers section only: no compile overhead "
                             "(first calls), forward overlap, decode or GPU section")
    args = parser.parse_args()
    shapes, configs = (QUICK, QUICK_CONFIGS) if args.quick else (FULL, CONFIGS)
    reps = 2 if args.quick else max(args.reps, 5)
    compile_reps = 0 if args.timed_only else 1 if args.quick else max(args.compile_reps, 1)
    seq = args.seq or (64 if args.quick else 1024)
    inner = args.inner or ("eager" if args.quick else "aot_eager")
    start = time.perf_counter()
    results = []
    for world, world_configs in configs.items():
        if args.world and world not in args.world:
            continue
        if args.mesh:
            world_configs = [(name, sizes) for name, sizes in world_configs if _mesh_text(sizes) in args.mesh]
            if not world_configs:
                continue
        results += run_ranks(world, run_world, configs=world_configs, shapes=shapes, seq=seq, reps=reps,
                             compile_reps=compile_reps, inner=inner)[0]  # rank 0's numbers
    for r in results:
        if "error" in r:
            continue
        r["analytic_bytes"] = analytic_bytes(r["model"], shapes[r["model"]], seq, r["mesh"],
                                             r["memory"].get("ours", {}).get("params", 0))
        r["grad_buckets"] = gradient_buckets(r["model"], shapes[r["model"]], seq, r["mesh"])
    skipped = {"text": "skipped (--timed-only)"}
    overlap_report = skipped if args.timed_only else overlap.report(quick=args.quick)
    decode_report = skipped if args.timed_only else decode.section(quick=args.quick)
    gpu_report = skipped if args.timed_only else gpu.report(quick=args.quick)
    from benchmarks import diffusers_peer  # it imports this module's timing helpers

    diffusers_report = diffusers_peer.measure(reps, "aot_eager" if inner == "eager" else inner, args.quick)
    info = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
            "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cpus, {platform.system()}",
            "torch": torch.__version__, "ranks": "gloo on CPU, 1 thread each", "reps": reps,
            "compile_reps": compile_reps, "seq": seq,
            "inner_backend": inner,
            "models": {k: v for k, v in shapes.items()}, "tp_hand_edits": TP_HAND_EDITS,
            "goals": ["TP step <= 0.9x parallelize_module", "CP forward <= 0.9x context_parallel",
                      "speedup over one device >= 1.6x at world 2 for seq >= 1024", "bytes = analytic minimum",
                      "gradient reduction calls <= 1 per bucket", "compile overhead <= 1.25x"],
            "seconds": None}
    text = tables(results)
    print(f"# python -m benchmarks{' --quick' if args.quick else ''}: {info['date']}, {info['machine']}, "
          f"torch {info['torch']}, {info['ranks']}, medians of {reps} (compile overhead: of {compile_reps}), seq {seq}, "
          f"inner backend {inner}\n")
    print(text)
    print("\nHand edits parallelize_module needs (kept in benchmarks/models.py):")
    for model, edits in TP_HAND_EDITS.items():
        print("".join(f"\n- {model}: {e}" for e in edits).lstrip("\n"))
    print("\nForward overlap under inductor:\n" + overlap_report["text"])
    print("\nDecode with a kv cache:\n" + decode_report["text"])
    print("\nGPU:\n" + gpu_report["text"])
    print(f"\ndiffusers' Flux transformer, ours against diffusers' enable_parallelism "
          f"(inner backend {diffusers_report['inner']}):\n" + diffusers_report["text"])
    info["seconds"] = time.perf_counter() - start
    print(f"\n{info['seconds']:.0f} s")
    with open(args.json, "w") as f:
        json.dump({**info, "results": results, "overlap": overlap_report, "decode": decode_report,
                   "gpu": gpu_report, "diffusers": diffusers_report}, f, indent=1)


if __name__ == "__main__":
    main()
