"""Training step time at tp=2, ours against torch's own tensor parallelism, 2 gloo ranks on CPU.

    python -m benchmarks.train_step [--reps 7] [--json out.json]   (from the repo root)

The same model (4 DiT-style pre-norm blocks, dim 256, 8 heads, x of shape (2, 256, 256)) with
the same weights, two ways: "ours" is ``dtensor_par.parallelize`` (the model as written), then
``torch.compile`` with ``hybrid_parallel``; "torch" is ``parallelize_module`` with a colwise /
rowwise plan, which needs hand edits of the model (``ANCHOR_EDITS``), then ``torch.compile``
with aot_eager. Both run AdamW. Steps alternate ours / torch, so drift hits both alike; the
table shows rank 0's medians. Goal: ours <= 1.0x torch's step time.
"""

import argparse
import datetime
import json
import os
import platform
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import dtensor_par
from tests.harness import run_ranks

TP, LAYERS, DIM, HEADS, MLP = 2, 4, 256, 8, 1024
BATCH, SEQ = 2, 256
LOSS_RTOL = 1e-4

# What parallelize_module needs changed in the model, beyond the plan itself.
ANCHOR_EDITS = [
    f"attention uses the local head count ({HEADS} // tp = {HEADS // TP}), not the model's {HEADS}",
    "attention output is reshaped to (b, s, -1) (the local width), not (b, s, dim)",
]


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.dim, self.heads, self.head_dim = dim, heads, dim // heads
        self.q, self.k, self.v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, s, self.heads, self.head_dim).transpose(1, 2) for p in (self.q, self.k, self.v))
        a = F.scaled_dot_product_attention(q, k, v)
        return self.out(a.transpose(1, 2).reshape(b, s, self.dim))


class AnchorAttention(Attention):
    """``Attention`` with the hand edits of ``ANCHOR_EDITS``: parallelize_module shards the
    projections' weights but leaves the view and reshape sizes as written, i.e. global."""

    def __init__(self, dim: int, heads: int, tp: int):
        super().__init__(dim, heads)
        self.heads = heads // tp  # edit 1

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, s, self.heads, self.head_dim).transpose(1, 2) for p in (self.q, self.k, self.v))
        a = F.scaled_dot_product_attention(q, k, v)
        return self.out(a.transpose(1, 2).reshape(b, s, -1))  # edit 2


class Block(nn.Module):
    """DiT-style pre-norm block: non-causal attention, GELU MLP."""

    def __init__(self, dim: int, heads: int, mlp: int):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.up, self.down = nn.Linear(dim, mlp), nn.Linear(mlp, dim)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.down(F.gelu(self.up(self.norm2(x)), approximate="tanh"))


class DiT(nn.Module):
    def __init__(self, layers: int = LAYERS, dim: int = DIM, heads: int = HEADS, mlp: int = MLP):
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim, heads, mlp) for _ in range(layers))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def torch_anchor(model: DiT, mesh) -> nn.Module:
    """A copy of ``model`` (same weights) with the hand edits, through torch's parallelize_module."""
    anchor = DiT()
    anchor.load_state_dict(model.state_dict())
    for block in anchor.blocks:
        edited = AnchorAttention(DIM, HEADS, TP)
        edited.load_state_dict(block.attn.state_dict())
        block.attn = edited
        parallelize_module(block, mesh, {**dict.fromkeys(("attn.q", "attn.k", "attn.v", "up"), ColwiseParallel()),
                                         "attn.out": RowwiseParallel(), "down": RowwiseParallel()})
    return anchor


def train_step(model, opt, x) -> float:
    opt.zero_grad(set_to_none=True)
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    return loss.item()


def forward(model, x) -> None:
    with torch.no_grad():
        model(x)


def timed(fn) -> float:
    """Seconds ``fn`` takes on this rank, started together on every rank."""
    dist.barrier()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _run(rank, world, reps):
    """One rank. Every rank seeds alike, so every rank (and both variants) starts from one model."""
    torch.manual_seed(0)
    mesh = dtensor_par.init_mesh(tp=TP)
    model, x = DiT(), torch.randn(BATCH, SEQ, DIM)
    anchor = torch_anchor(model, mesh["tp"])  # copied before parallelize replaces the model's parameters
    dtensor_par.parallelize(model, mesh, (x,))
    models = {"ours": torch.compile(model, backend=dtensor_par.hybrid_parallel(mesh, inner_backend="aot_eager")),
              "torch": torch.compile(anchor, backend="aot_eager")}
    opts = {"ours": torch.optim.AdamW(model.parameters()), "torch": torch.optim.AdamW(anchor.parameters())}

    # Warm-up step 1 compiles, and its losses (same weights, same input) must agree.
    first = {"ours": train_step(models["ours"], opts["ours"], x)}
    anchor_mode = "torch.compile(backend='aot_eager')"
    try:
        first["torch"] = train_step(models["torch"], opts["torch"], x)
    except Exception as error:  # noqa: BLE001  a failed compile never reaches opt.step: retry eager
        anchor_mode = f"eager: compiling failed with {type(error).__name__}: {str(error).splitlines()[0]}"
        models["torch"] = anchor
        first["torch"] = train_step(anchor, opts["torch"], x)
    rel = abs(first["ours"] - first["torch"]) / abs(first["torch"])
    assert rel <= LOSS_RTOL, f"first-step losses differ: {first} (relative {rel:.2e} > {LOSS_RTOL})"
    for name in models:
        train_step(models[name], opts[name], x)
        for _ in range(2):  # no_grad compiles anew
            forward(models[name], x)

    times = {(what, name): [] for what in ("step", "forward") for name in models}
    for _ in range(reps):
        for name in models:  # alternated, so drift hits both alike
            times["step", name].append(timed(lambda: train_step(models[name], opts[name], x)))
    for _ in range(reps):
        for name in models:
            times["forward", name].append(timed(lambda: forward(models[name], x)))
    return {"first_loss": first, "loss_rel_diff": rel, "anchor": anchor_mode,
            "ms": {f"{what}/{name}": 1e3 * statistics.median(t) for (what, name), t in times.items()}}


ROWS = (("step", "train step (fwd + bwd + AdamW)"), ("forward", "forward (no_grad)"))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=7, help="timed steps per variant (at least 7)")
    parser.add_argument("--json", help="also write the measurements here")
    args = parser.parse_args()
    result = run_ranks(TP, _run, max(args.reps, 7))[0]  # rank 0's numbers

    ms = result["ms"]
    rows = [{"what": label, "ours_ms": ms[f"{key}/ours"], "torch_ms": ms[f"{key}/torch"],
             "ratio": ms[f"{key}/ours"] / ms[f"{key}/torch"]} for key, label in ROWS]
    info = {"model": f"{LAYERS} DiT blocks, dim {DIM}, {HEADS} heads, mlp {MLP}, x {(BATCH, SEQ, DIM)}",
            "ranks": f"tp={TP}, gloo, 1 thread each", "reps": max(args.reps, 7),
            "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cpus",
            "torch": torch.__version__, "date": datetime.date.today().isoformat(),
            "ours": "dtensor_par.parallelize + hybrid_parallel(inner_backend='aot_eager')",
            "torch_anchor": f"parallelize_module (colwise q/k/v/up, rowwise out/down), {result['anchor']}",
            "torch_anchor_hand_edits": ANCHOR_EDITS, "first_loss": result["first_loss"],
            "first_loss_rel_diff": result["loss_rel_diff"], "goal": "ours <= 1.0x torch"}
    print("| what | ours ms | torch ms | ratio |")
    print("| --- | --- | --- | --- |")
    for row in rows:
        print(f"| {row['what']} | {row['ours_ms']:.1f} | {row['torch_ms']:.1f} | {row['ratio']:.2f} |")
    print()
    for key, value in info.items():
        if key == "torch_anchor_hand_edits":
            print(f"{key}:" + "".join(f"\n  - {edit}" for edit in value))
        else:
            print(f"{key}: {value}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, **info}, f, indent=1)


if __name__ == "__main__":
    main()
