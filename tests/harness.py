"""Multi-process gloo runs on CPU and comparison against the single-device model."""

from __future__ import annotations

import copy
import json
import os
import sys
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

FORWARD_ATOL = 1e-5
GRAD_RTOL = 1e-4


def _entry(rank: int, world: int, store: str, out_dir: str, fn, args) -> None:
    """One rank. It ends with ``os._exit`` once its result is written and the group torn down:
    C++ destructors of gloo threads at interpreter exit can abort a process whose work is done."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        result = fn(rank, world, *args)
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)
        dist.barrier()
        dist.destroy_process_group()
        code = 0
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_ranks(world: int, fn, *args) -> list:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo ranks; return each rank's result."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_entry, args=(world, os.path.join(tmp, "store"), tmp, fn, args), nprocs=world,
                           join=True, start_method="spawn")
        results = []
        for r in range(world):
            with open(os.path.join(tmp, f"rank{r}.json")) as f:
                results.append(json.load(f))
        return results


def max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def loss_of(out: torch.Tensor) -> torch.Tensor:
    """A loss that weighs every output element differently, so any misplaced value shows."""
    weights = torch.linspace(-1.0, 1.0, out.numel(), dtype=out.dtype).view(out.shape)
    return (out * weights).mean()


def compare(model: torch.nn.Module, inputs_seq: list, compiled_fn, steps: int = 1, lr: float = 1.0) -> dict:
    """Run the model and its compiled copy over each input tuple (``steps`` SGD steps each);
    return the largest forward abs diff and gradient relative diff seen.

    Each step must move the weights measurably, so a stale local weight shard would show.
    """
    reference = copy.deepcopy(model)
    opt_ref = torch.optim.SGD(reference.parameters(), lr=lr)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    compiled = compiled_fn(model)
    worst = {"forward_abs": 0.0, "grad_rel": 0.0}
    for inputs in inputs_seq:
        for _ in range(steps):
            ins_ref = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
            ins = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
            out_ref, out = reference(*ins_ref), compiled(*ins)
            loss_of(out_ref).backward()
            loss_of(out).backward()
            worst["forward_abs"] = max(worst["forward_abs"], (out - out_ref).abs().max().item())
            pairs = [(p.grad, q.grad, n) for (n, p), q in zip(model.named_parameters(), reference.parameters())]
            pairs += [(a.grad, b.grad, "input") for a, b in zip(ins, ins_ref) if b.grad is not None]
            for got, want, name in pairs:
                assert (got is None) == (want is None), f"gradient of {name}: {got is None=} {want is None=}"
                if want is not None:
                    worst["grad_rel"] = max(worst["grad_rel"], max_rel(got, want))
            before = [p.detach().clone() for p in model.parameters()]
            opt.step(); opt_ref.step(); opt.zero_grad(); opt_ref.zero_grad()
            moved = max((p.detach() - b).abs().max().item() for p, b in zip(model.parameters(), before))
            assert moved > 1e-4, f"an optimizer step moved the weights by only {moved}"
    assert worst["forward_abs"] <= FORWARD_ATOL, worst
    assert worst["grad_rel"] <= GRAD_RTOL, worst
    return worst


def capturing_backend(graphs: dict):
    """An AOTAutograd backend that keeps the forward and backward graphs it compiles in ``graphs``."""
    from torch._dynamo.backends.common import aot_autograd

    def keep(name):
        def compiler(graph, _):
            graphs[name] = graph
            return graph
        return compiler

    return aot_autograd(fw_compiler=keep("forward"), bw_compiler=keep("backward"))


def aot_graphs(local_gm, ctx, backward: bool = True) -> dict:
    """The forward (and backward) graphs AOTAutograd traces from a localized graph, run on
    this rank's pieces of the example inputs (on a fake process group nothing is sent)."""
    from dtensor_par.runtime import local_value

    graphs = {}

    placeholders = [n for n in local_gm.graph.nodes if n.op == "placeholder"]
    inputs = []
    for node, value in zip(placeholders, ctx.example_inputs):
        placements = {d: s.out for d, s in node.meta["dtensor_par"].items()}
        local = local_value(value.detach(), placements, ctx.mesh, ctx.comm).contiguous()
        inputs.append(local.requires_grad_(backward and value.is_floating_point()))
    out = capturing_backend(graphs)(local_gm, inputs)(*inputs)
    if backward:
        out[0].sum().backward()
    return graphs
