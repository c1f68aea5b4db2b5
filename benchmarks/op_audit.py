"""What one forward runs on each rank, op by op: ours at tp2 against one device and ``parallelize_module``.

    python -m benchmarks.op_audit [--inner aot_eager inductor] [--models dit_qk llama flux] [--calls 3] [--json F]

On 2 gloo ranks (one thread each), per model and inner backend, three variants of one no_grad
forward (compiled, warmed up, then profiled over ``--calls`` calls): the one-device model
(``torch.compile``), ours (``parallelize`` + ``hybrid_parallel``) and, for the test models,
``parallelize_module`` (Colwise q/k/v/up/gate, Rowwise out/down, ``benchmarks.models.tp_anchor``).
Ops are counted where the program calls them (an aten op inside another, ``contiguous``'s
``clone``, is the caller's), per call, by kind; the CPU time of a call is split into its ops' and
the Python around them (the runtime, guards, hooks). Shares, not times, are what to compare on a
loaded machine. Under inductor the generated kernels are profiled too
(``cpp.enable_kernel_profile``) and counted as ``kernel``.
"""

from __future__ import annotations

import argparse
import copy
import json
from collections import Counter

import torch

import dtensor_par
from benchmarks.models import flux, tp_anchor
from dtensor_par._testing.harness import called_ops, run_ranks
from dtensor_par._testing.models import DiT, Llama

KINDS = {
    "matmul": ("mm", "addmm", "bmm", "baddbmm", "linear", "matmul"),
    "attention": ("scaled_dot_product_attention", "_scaled_dot_product_flash_attention_for_cpu",
                  "_scaled_dot_product_efficient_attention", "_scaled_dot_product_attention_math"),
    "norm": ("native_layer_norm", "layer_norm", "rms_norm", "_fused_rms_norm"),
    "copy": ("clone", "contiguous", "copy_", "_to_copy", "to", "cat", "empty_like", "expand_copy"),
    "view": ("view", "_unsafe_view", "reshape", "transpose", "t", "permute", "expand", "slice", "select",
             "split", "split_with_sizes", "unsqueeze", "squeeze", "as_strided", "alias", "detach", "unflatten",
             "flatten", "chunk", "narrow", "unbind", "lift_fresh"),
    "collective": ("all_reduce", "all_reduce_", "wait_tensor", "all_gather_into_tensor", "reduce_scatter_tensor",
                   "all_to_all_single"),
}
CALL = "op_audit.call"


def kind(op: str) -> str:
    if "cpp_fused" in op:
        return "kernel"
    return next((k for k, names in KINDS.items() if op.split("::")[-1] in names), "elementwise/other")


def profile_forward(fn, args: tuple, kwargs: dict, calls: int) -> dict:
    """Ops per call (outermost, by name), and each kind's and the Python's share of the calls'
    CPU time (an op's own time includes the ops it calls)."""
    with torch.no_grad():
        for _ in range(2):
            fn(*args, **kwargs)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
            for _ in range(calls):
                with torch.profiler.record_function(CALL):
                    fn(*args, **kwargs)
    events = prof.events()
    total = sum(e.cpu_time_total for e in events if e.name == CALL)
    ops, time_by_kind, shapes = Counter(), Counter(), Counter()
    for e in called_ops(events):
        name = "cpp_fused kernel" if "cpp_fused" in e.name else e.name.split("::")[-1]
        ops[name] += 1
        time_by_kind[kind(e.name)] += e.cpu_time_total
        if kind(e.name) in ("matmul", "attention"):  # a matmul by its operands (addmm's bias aside)
            operands = [s for s in e.input_shapes if s][-2:] if kind(e.name) == "matmul" else e.input_shapes[:3]
            shapes[f"{kind(e.name)} {operands}"] += 1
    op_time = sum(time_by_kind.values())
    shares = {k: t / total for k, t in time_by_kind.items()}
    shares["python (outside ops)"] = (total - op_time) / total
    return {"ops": {k: v / calls for k, v in sorted(ops.items())}, "shares": shares, "call_us": total / calls,
            "compute_shapes": {k: v / calls for k, v in sorted(shapes.items())}}


def build(name: str, seq: int):
    """(model, args, kwargs), seeded: the same weights and inputs on every rank."""
    torch.manual_seed(0)
    if name == "dit_qk":
        return DiT(layers=2, dim=256, heads=8, mlp=1024, qk_norm=True), (torch.randn(1, seq, 256),), {}
    if name == "llama":
        model = Llama(layers=2, hidden=256, heads=8, kv_heads=4, mlp=768, vocab=512)
        return model, (torch.randint(0, 512, (1, seq)),), {}
    model, kwargs = flux()
    return model, (), kwargs


def audit(rank: int, world: int, *, models: list[str], inners: list[str], seq: int, calls: int) -> dict:
    mesh = dtensor_par.init_mesh(tp=world)
    out = {}
    for inner in inners:
        with torch._inductor.config.patch({"cpp.enable_kernel_profile": True}):
            for name in models:
                torch._dynamo.reset()
                model, args, kwargs = build(name, seq)
                variants = {"one_device": torch.compile(copy.deepcopy(model), backend=inner)}
                if name != "flux":
                    variants["parallelize_module"] = torch.compile(tp_anchor(model, mesh["tp"]), backend=inner)
                ours = dtensor_par.parallelize(copy.deepcopy(model), mesh, args, example_kwargs=kwargs)
                variants["ours"] = torch.compile(ours, backend=dtensor_par.hybrid_parallel(mesh, inner_backend=inner))
                out[f"{name}/{inner}"] = {v: profile_forward(fn, args, kwargs, calls) for v, fn in variants.items()}
    return out


def by_kind(ops: dict[str, float]) -> Counter:
    counts = Counter()
    for op, n in ops.items():
        counts[kind(op)] += n
    return counts


def table(results: dict) -> str:
    """Per case: op counts per call by kind (ours, one device, parallelize_module), the ops whose
    counts differ between ours and one device, and each variant's share of CPU time by kind."""
    lines = []
    for case, variants in results.items():
        names = list(variants)
        lines += [f"\n### {case}", "", "| kind | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
        kinds = sorted(set().union(*(by_kind(v["ops"]) for v in variants.values())))
        for k in kinds:
            lines.append(f"| {k} | " + " | ".join(f"{by_kind(variants[v]['ops'])[k]:g}" for v in names) + " |")
        shares = sorted(set().union(*(v["shares"] for v in variants.values())))
        lines += [f"| {k} share of CPU | " + " | ".join(f"{variants[v]['shares'].get(k, 0):.1%}" for v in names) + " |"
                  for k in shares]
        lines.append("| CPU per call ms (loaded machine) | " + " | ".join(
            f"{variants[v]['call_us'] / 1e3:.1f}" for v in names) + " |")
        ops = sorted(set().union(*(v["ops"] for v in variants.values())))
        differ = [op for op in ops if len({variants[v]["ops"].get(op, 0) for v in names}) > 1]
        lines += ["", "ops whose counts differ: " + "; ".join(
            f"{op} " + "/".join(f"{variants[v]['ops'].get(op, 0):g}" for v in names) for op in differ)]
        if "parallelize_module" in variants:  # the same local matmuls and attention (mm + add for addmm aside)
            same = variants["ours"]["compute_shapes"] == variants["parallelize_module"]["compute_shapes"]
            lines.append(f"matmul and attention input shapes, ours and parallelize_module: "
                         f"{'the same' if same else 'differ'}")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inner", nargs="+", default=["aot_eager", "inductor"])
    parser.add_argument("--models", nargs="+", default=["dit_qk", "llama", "flux"])
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--json", default="op_audit.json")
    args = parser.parse_args()
    results = run_ranks(2, audit, models=args.models, inners=args.inner, seq=args.seq, calls=args.calls)[0]
    print(table(results))
    with open(args.json, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
