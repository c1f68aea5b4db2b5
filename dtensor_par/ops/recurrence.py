"""A chunked linear recurrence over the sequence (transformers' ``torch_chunk_gated_delta_rule``:
Qwen3-Next's, Qwen3.5's, OLMo-hybrid's linear attention; ``chunk_kimi_delta_attention``, its decay
per key channel: Kimi-Linear's) run on each cp rank's rows.

The recurrence carries a state ``S`` ``[batch, heads, k_dim, v_dim]`` along the sequence, and
everything it computes is linear in the values and the state it starts from, column by column
of ``v_dim``: a run of rows started from ``S0`` gives ``out(v, 0) + out(0, S0)`` and ends at
``A @ S0 + E``, ``E`` its end state from zero, ``A`` ``[k_dim, k_dim]`` how it carries a state
through. So each rank runs the model's own function on its runs twice:

1. from ``[0 | I]`` with values ``[v | 0]``: its output from a zero state, ``E`` and ``A``;
2. the ``E`` and ``A`` of every run are gathered (``heads x k_dim x (v_dim + k_dim)`` numbers a
   run and batch row, never the sequence), and each rank folds those of the runs before each of
   its own, in sequence order, into the state that run starts from;
3. from that state with zero values: what the runs before add to its output.

The final state (a cache's) folds every run, alike on every rank, and so is its gradient: each
rank sends back only its own runs' share of it (the gather's backward sums what every rank sends,
which would count it once per rank). Rows that pad the sequence to divide over the ranks
sit at its end: their gate and beta are zeroed, so they leave the state as it is. Gradients flow
back through both calls and the gather (a reduce-scatter).
"""

from __future__ import annotations

import importlib
from functools import cache
from typing import NamedTuple

import torch

from ..mesh import MeshDim
from .collectives import every_rank_positions, gather_stacked
from .lowerings import FUNCTIONAL

_READ = ("query", "key", "value", "beta", "g", "initial_state")
RECURRENCES = {"torch_chunk_gated_delta_rule": _READ, "chunk_kimi_delta_attention": _READ,
               "torch_recurrent_gated_delta_rule": _READ,  # a decode step's, from the cache's state
               "recurrent_kimi_delta_attention": ("query", "key", "value", "g", "beta", "initial_state")}
"""The recurrences read as one op (``canonicalize.recurrence_as_one_op``), by the name of the
module transformers wraps each in: their tensor arguments in the order the function first reads
them (the state it starts from, if given, last). Every transformers model calls them with
``use_qk_l2norm_in_kernel=True``: the traced ops must show it (the square roots of q's and k's
l2 norms)."""


@cache
def recurrence(rule: str):
    """The function ``rule`` (``module:name``) names: the model's own, resolved as it calls it."""
    module, name = rule.split(":")
    return getattr(importlib.import_module(module), name)


def _call(rule: str, query, key, value, g, beta, initial_state=None, output_final_state=True):
    """``rule`` called as transformers calls it, from ``initial_state`` (zeros if None)."""
    return recurrence(rule)(query, key, value, g=g, beta=beta, initial_state=initial_state,
                            output_final_state=output_final_state, use_qk_l2norm_in_kernel=True)


def linear_recurrence(rule: str, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor,
                      beta: torch.Tensor, initial_state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``rule``'s output ``[batch, seq, heads, v_dim]`` and final state, from ``initial_state``
    (zeros if None): the one op canonicalize makes of the function's traced ops."""
    return _call(rule, query, key, value, g, beta, initial_state)


class RunPlan(NamedTuple):
    """This rank's runs of the sequence (``runs`` of ``run_length`` rows each, every rank alike):
    every rank's runs, numbered ``rank * runs + run``, in sequence order, this rank's numbers, and
    how many of each of its runs are real rows, not padding (``padded``: some rank's are not).
    Every rank computes alike, with its own numbers: its collectives, forward and backward, come
    in the same order as every other's. Plain values: FX prints it as code."""

    runs: int
    run_length: int
    order: tuple[int, ...]
    mine: tuple[int, ...]
    real: tuple[int, ...]
    padded: bool


def run_plan(length: int, mesh_dim: MeshDim) -> RunPlan:
    """The plan for this rank of a sequence of ``length`` rows cut over ``mesh_dim``: its runs
    as ``every_rank_positions`` lays them out (one, or the zigzag layout's two)."""
    positions = every_rank_positions(length, mesh_dim)
    runs = mesh_dim.chunks_per_rank
    run_length = positions.shape[1] // runs
    starts = positions[:, ::run_length].flatten().tolist()  # each run's first row, numbered rank * runs + run
    mine = tuple(range(mesh_dim.rank * runs, (mesh_dim.rank + 1) * runs))
    return RunPlan(runs, run_length, tuple(sorted(range(len(starts)), key=starts.__getitem__)), mine,
                   tuple(min(max(length - starts[run], 0), run_length) for run in mine), positions.numel() > length)


def _by_run(x: torch.Tensor, plan: RunPlan) -> torch.Tensor:
    """``[batch, rows, ...]`` -> ``[runs * batch, run_length, ...]``."""
    return x.unflatten(1, (plan.runs, plan.run_length)).transpose(0, 1).flatten(0, 1)


def _padding_zeroed(x: torch.Tensor, plan: RunPlan) -> torch.Tensor:
    """``x`` ``[runs * batch, run_length, heads, ...]`` with the rows past each run's real ones zeroed."""
    if not plan.padded:
        return x
    rows = torch.arange(plan.run_length, device=x.device)
    kept = torch.stack([rows < real for real in plan.real])  # [runs, run_length]
    kept = kept.view(plan.runs, 1, plan.run_length, *[1] * (x.dim() - 2)).to(x.dtype)
    return (x.unflatten(0, (plan.runs, -1)) * kept).flatten(0, 1)


def sharded_linear_recurrence(rule: str, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                               g: torch.Tensor, beta: torch.Tensor, *, plan: RunPlan, mesh_dim: MeshDim,
                               comm: str = FUNCTIONAL) -> tuple[torch.Tensor, torch.Tensor]:
    """``linear_recurrence`` of the whole sequence (from zeros), of which this rank holds the rows ``plan``
    lays out along dim 1 (cut over ``mesh_dim``): this rank's rows of the output, and the final
    state (the module docstring says how)."""
    batch = query.shape[0]
    query, key, value, g, beta = (_by_run(x, plan) for x in (query, key, value, g, beta))
    g, beta = _padding_zeroed(g, plan), _padding_zeroed(beta, plan)
    heads, k_dim, v_dim = value.shape[2], key.shape[-1], value.shape[-1]
    dtype = torch.promote_types(value.dtype, torch.float32)  # the function's state: float32, or finer
    state = value.new_zeros(batch, heads, k_dim, v_dim, dtype=dtype)
    identity = torch.eye(k_dim, dtype=dtype, device=value.device).expand(query.shape[0], heads, k_dim, k_dim)
    widened = torch.cat([value, value.new_zeros(*value.shape[:-1], k_dim)], -1)
    start = torch.cat([state.repeat(plan.runs, 1, 1, 1), identity], -1)
    out, ends = _call(rule, query, key, widened, g, beta, start)
    every = gather_stacked(ends.unflatten(0, (plan.runs, batch)), mesh_dim, comm).flatten(0, 1)  # [all runs, ...]
    owned = torch.zeros(len(plan.order), dtype=torch.bool, device=every.device)
    owned[list(plan.mine)] = True
    owned_only = torch.where(owned.view(-1, *[1] * (every.dim() - 1)), every, every.detach())
    starts, final = [None] * len(plan.order), state
    for run in plan.order:  # the state each run starts from, then the final one
        starts[run] = state
        state = every[run, ..., v_dim:] @ state + every[run, ..., :v_dim]
        final = owned_only[run, ..., v_dim:] @ final + owned_only[run, ..., :v_dim]
    carried, _ = _call(rule, query, key, torch.zeros_like(value), g, beta,
                       torch.stack(starts)[list(plan.mine)].flatten(0, 1), output_final_state=False)
    out = out[..., :v_dim] + carried
    return out.unflatten(0, (plan.runs, batch)).transpose(0, 1).flatten(1, 2), final
