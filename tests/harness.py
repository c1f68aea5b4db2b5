"""Multi-process gloo runs on CPU and comparison against the single-device model."""

from __future__ import annotations

import copy

import torch

from benchmarks.common import aot_graphs, capturing_backend, logged, run_ranks  # noqa: F401  (shared with the benchmarks)

FORWARD_ATOL = 1e-5
GRAD_RTOL = 1e-4

FUNCTIONAL_OPS = {"all_reduce": "all_reduce", "all_gather": "all_gather_into_tensor",
                  "reduce_scatter": "reduce_scatter_tensor", "all_to_all": "all_to_all_single",
                  "ring_rotate": "all_to_all_single"}
"""The functional collective each op of a report (explain, plan.json) runs as."""


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
