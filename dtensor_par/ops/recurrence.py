"""A chunked linear recurrence over the sequence run on each cp rank's rows: transformers' gated
delta rule (``torch_chunk_gated_delta_rule``: Qwen3-Next's, Qwen3.5's, OLMo-hybrid's linear
attention; ``chunk_kimi_delta_attention``, its decay per key channel: Kimi-Linear's), Mamba-2's
selective scan (``mamba2_chunk_scan``: Mamba-2, Bamba, Granite 4, Nemotron-H, Falcon-H1, Zamba2) and
Mamba-1's (``mamba_selective_scan``: Mamba, FalconMamba, Jamba).

The recurrence carries a state ``S`` along the sequence, and everything it computes is linear in
its values and the state it starts from, column by column of the values: a run of rows started
from ``S0`` gives ``out(v, 0) + out(0, S0)`` and ends at ``carry(S0) + E``, ``E`` its end state
from zero, ``carry`` linear (a matrix for the delta rule, one number a head for the scan: each
kind's ``fold``). So each rank runs the model's own function (Mamba-1's: its formula,
``selective_scan``) on its runs twice:

1. from a start that reads the carry off the end state, values widened to match (each kind's
   ``widened``; Mamba-1's scan gives the carry itself): its output from a zero state, ``E`` and
   the carry (each kind's ``ends``);
2. every run's end is gathered (the state's size a run and batch row, widened, never the
   sequence), and each rank folds those of the runs before each of its own, in sequence order,
   into the state that run starts from;
3. from that state with zero values: what the runs before add to its output (each kind's
   ``carried``; Mamba-1's: read off the start, decayed, without a scan).

The final state (a cache's) folds every run, alike on every rank, and so is its gradient: each
rank sends back only its own runs' share of it (the gather's backward sums what every rank sends,
which would count it once per rank). Rows that pad the sequence to divide over the ranks sit at
its end and are made to leave the state as it is (each kind's ``neutral``). Gradients flow back
through both calls and the gather (a reduce-scatter).
"""

from __future__ import annotations

import importlib
from functools import cache
from typing import NamedTuple

import torch
import torch.nn.functional as F

from ..errors import NotSupported
from ..mesh import MeshDim
from .collectives import every_rank_positions, gather_stacked
from .lowerings import FUNCTIONAL


class _FromState:
    """A kind whose function starts from a given state: a run's end (``E`` and the carry) is read
    by running it from a widened start (``widened``). Its tensors are laid out as the function's."""

    channels_first = ungrouped = ()

    @classmethod
    def run_end(cls, t: dict) -> torch.Tensor:
        """A run's end as ``ends`` gives it (its shape and dtype: what is gathered)."""
        return cls.widened(t, cls.state(t))[1]

    @classmethod
    def ends(cls, fn, t: dict, options: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """Each run's output from a zero state, and its end."""
        widened, start = cls.widened(t, cls.state(t))
        out, ends = cls.call(fn, widened, start, True, options)
        return out[..., :t[cls.values].shape[-1]], ends

    @classmethod
    def carried(cls, fn, t: dict, start: torch.Tensor, options: dict) -> torch.Tensor:
        """What the state each run starts from adds to its output: the run from it, values zero."""
        return cls.call(fn, {**t, cls.values: torch.zeros_like(t[cls.values])}, start, False, options)[0]


class GatedDeltaRule(_FromState):
    """transformers' gated delta rule (``torch_chunk_gated_delta_rule`` and its decode step;
    Kimi's with a decay per key channel): a state ``[batch, heads, k_dim, v_dim]`` that a run
    carries through as ``A @ S0 + E``, ``A`` ``[k_dim, k_dim]``: started from ``[0 | I]`` with
    values ``[v | 0]`` it ends at ``[E | A]``."""

    rows = ("query", "key", "value", "g", "beta")
    per_head = ()
    key_heads = ("query", "key")
    values = "value"
    read_out = "query"  # read by the output only, never by the state

    @staticmethod
    def call(fn, t: dict, state, final: bool, options: dict):
        return fn(t["query"], t["key"], t["value"], g=t["g"], beta=t["beta"], initial_state=state,
                  output_final_state=final, use_qk_l2norm_in_kernel=True)

    @staticmethod
    def state(t: dict) -> torch.Tensor:
        value, k_dim = t["value"], t["key"].shape[-1]
        dtype = torch.promote_types(value.dtype, torch.float32)  # the function's state: float32, or finer
        return value.new_zeros(value.shape[0], value.shape[2], k_dim, value.shape[-1], dtype=dtype)

    @staticmethod
    def widened(t: dict, state: torch.Tensor) -> tuple[dict, torch.Tensor]:
        value, k_dim = t["value"], state.shape[-2]
        identity = torch.eye(k_dim, dtype=state.dtype, device=state.device).expand(*state.shape[:2], k_dim, k_dim)
        return {**t, "value": torch.cat([value, value.new_zeros(*value.shape[:-1], k_dim)], -1)}, \
            torch.cat([state, identity], -1)

    @staticmethod
    def fold(end: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        return end[..., state.shape[-1]:] @ state + end[..., :state.shape[-1]]

    @staticmethod
    def flops(t: dict, options: dict, cp: bool = False) -> int:
        """The chunked form's products, forward, on ``t``'s rows (chunks of 64, transformers'):
        a row's scores and values within its chunk, its read of the state, the state's update;
        ``cp``: the two calls a rank makes, the first with values widened by ``k_dim``."""
        (b, s, heads, v_dim), k_dim = t["value"].shape, t["key"].shape[-1]
        per_row = [64 * (2 * k_dim + v) + 3 * k_dim * v for v in ((v_dim, v_dim + k_dim) if cp else (v_dim,))]
        return 2 * b * s * heads * sum(per_row)

    @staticmethod
    def neutral(t: dict, kept: torch.Tensor, options: dict) -> dict:
        """Padding rows with a zero gate and beta: they leave the state as it is."""
        return {**t, "g": t["g"] * _rows_mask(kept, t["g"]), "beta": t["beta"] * _rows_mask(kept, t["beta"])}


def _scan_state(t: dict) -> torch.Tensor:
    """A selective scan's zero state: ``x``'s dims but its rows (batch, heads and head dim; batch
    and channels), then B's state size, in float32 or finer."""
    x, size = t["hidden_states"], t["B"].shape[-1]
    return x.new_zeros(*x.shape[:1], *x.shape[2:], size, dtype=torch.promote_types(x.dtype, torch.float32))


def _time_steps(t: dict) -> torch.Tensor:
    """Mamba-1's time steps: ``softplus(dt + delta_bias)``."""
    return F.softplus(t["dt"] + t["delta_bias"].to(t["dt"].dtype))


def _padding_steps_off(t: dict, kept: torch.Tensor) -> dict:
    """A selective scan's tensors with a time step of ``-inf`` on padding rows, 0 past the softplus:
    they neither decay the state nor add to it."""
    return {**t, "dt": t["dt"].masked_fill(~_rows_mask(kept, t["dt"]), -torch.inf)}


class StateSpaceScan(_FromState):
    """transformers' Mamba-2 selective scan (``mamba2_chunk_scan``: Mamba-2, Bamba, Granite 4,
    Nemotron-H, Falcon-H1, Zamba2): a state ``[batch, heads, head_dim, state_size]`` that a run
    decays by one number per head and batch row, ``a``: started from ``[0 ; 1]`` (a row of ones
    below) with ``x`` ``[x | 0]`` it ends at ``[E ; a]``. Its ``A``, ``D`` and ``dt_bias`` are
    per head."""

    rows = ("hidden_states", "dt", "B", "C")
    per_head = ("A", "D", "dt_bias")
    key_heads = ("B", "C")
    values = "hidden_states"
    read_out = "C"  # read by the output only, never by the state

    @staticmethod
    def call(fn, t: dict, state, final: bool, options: dict):
        out = fn(t["hidden_states"], t["dt"], t["A"], t["B"], t["C"], options["chunk_size"], D=t["D"],
                 dt_bias=t["dt_bias"], initial_states=state, dt_softplus=True, dt_limit=options["dt_limit"],
                 return_final_states=final)
        return out if final else (out, None)

    state = staticmethod(_scan_state)

    @staticmethod
    def widened(t: dict, state: torch.Tensor) -> tuple[dict, torch.Tensor]:
        x = t["hidden_states"]
        return {**t, "hidden_states": torch.cat([x, x.new_zeros(*x.shape[:-1], 1)], -1)}, \
            torch.cat([state, torch.ones_like(state[..., :1, :])], -2)

    @staticmethod
    def fold(end: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        return end[..., state.shape[-2]:, :] * state + end[..., :state.shape[-2], :]

    @staticmethod
    def flops(t: dict, options: dict, cp: bool = False) -> int:
        """The chunked form's products, forward, on ``t``'s rows: a row's scores and values within
        its chunk, its state's read and update; ``cp``: the two calls a rank makes, the first
        with x widened by a column."""
        (b, s, heads, head_dim), size = t["hidden_states"].shape, t["B"].shape[-1]
        chunk = options["chunk_size"]
        per_row = [chunk * (size + p) + 3 * size * p for p in ((head_dim, head_dim + 1) if cp else (head_dim,))]
        return 2 * b * s * heads * sum(per_row)

    @staticmethod
    def neutral(t: dict, kept: torch.Tensor, options: dict) -> dict:
        """Padding rows with a time step of ``-inf``, 0 past the softplus and the clamp to
        ``dt_limit`` from 0 (every transformers model's): they leave the state as it is. From a
        higher bound they would decay it: refused."""
        if options["dt_limit"][0] > 0:
            raise NotSupported(f"a Mamba-2 scan with dt_limit {options['dt_limit']} over a sequence padded to divide "
                               f"over cp: its padding rows would decay the final state; use a length that divides")
        return _padding_steps_off(t, kept)


class SelectiveScan:
    """transformers' Mamba-1 selective scan (``mamba_selective_scan``: Mamba, FalconMamba, Jamba):
    a state ``[batch, channels, state_size]`` that each row decays element by element. Its
    tensors are channels first in the function (``channels_first``: x, dt and z ``[B, D, S]``,
    B and C ``[B, N, S]``) and rows first here, B and C one group (``ungrouped``:
    ``[B, S, 1, N]``), shared by every channel; its ``A`` ``[D, N]``, ``D`` and ``delta_bias``
    are per channel. It is run by ``selective_scan``, the function's own formula: the function
    takes no state to start from, and its parallel scan runs only under Dynamo (traced again,
    its loop is unrolled row by row). It starts from zeros, as the function does; what a given
    start adds, ``carried`` computes alone."""

    rows = ("hidden_states", "dt", "B", "C", "z")
    per_head = ("A", "D", "delta_bias")
    key_heads = ("B", "C")
    values = "hidden_states"
    read_out = "C"  # read by the output only, never by the state
    channels_first = rows
    ungrouped = ("B", "C")

    @staticmethod
    def call(fn, t: dict, state, final: bool, options: dict):
        if state is not None:
            raise NotSupported("Mamba-1's selective scan from a given state: transformers' function takes none")
        out, last, _ = selective_scan(t)
        return out, last if final else None

    state = staticmethod(_scan_state)

    @classmethod
    def run_end(cls, t: dict) -> torch.Tensor:
        """A run's end: ``[E | a]``, its end state from zero beside its decay."""
        return torch.cat([cls.state(t)] * 2, -1)

    @staticmethod
    def ends(fn, t: dict, options: dict) -> tuple[torch.Tensor, torch.Tensor]:
        out, last, decay = selective_scan(t)
        return out, torch.cat([last, decay], -1)

    @staticmethod
    def carried(fn, t: dict, start: torch.Tensor, options: dict) -> torch.Tensor:
        """``C`` read from ``start`` decayed by each row so far (``exp(A * sum dt)``, no scan),
        gated by z."""
        states = torch.exp(t["A"] * _time_steps(t).cumsum(1)[..., None]) * start[:, None]  # [B, S, D, N]
        return (states.to(t["hidden_states"].dtype) @ t["C"].transpose(-1, -2)).squeeze(-1) * F.silu(t["z"])

    @staticmethod
    def fold(end: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        return end[..., state.shape[-1]:] * state + end[..., :state.shape[-1]]

    @staticmethod
    def flops(t: dict, options: dict, cp: bool = False) -> int:
        """``selective_scan``'s ops, forward, on ``t``'s rows: 12 a channel, state number and row
        (the decay and input, the prefix scan's combines, C's read); ``cp``: ``carried``'s 6 too."""
        (b, s, channels), size = t["hidden_states"].shape, t["B"].shape[-1]
        return (12 + 6 * cp) * b * s * channels * size

    @staticmethod
    def neutral(t: dict, kept: torch.Tensor, options: dict) -> dict:
        return _padding_steps_off(t, kept)


def selective_scan(t: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Mamba-1's scan (``SelectiveScan``'s tensors ``t``, rows first) from zeros, in transformers'
    dtypes (the state in float32, or finer): its output, final state and decay (every row's,
    multiplied), the state carried by ``prefix_scan``."""
    x = t["hidden_states"]
    dtype, dt = torch.promote_types(x.dtype, torch.float32), _time_steps(t)
    decay, states = prefix_scan(torch.exp(t["A"] * dt[..., None]),
                                dt[..., None] * t["B"].to(dtype) * x[..., None].to(dtype))  # [B, S, D, N]
    out = (states.to(x.dtype) @ t["C"].transpose(-1, -2)).squeeze(-1) + x * t["D"]
    return out * F.silu(t["z"]), states[:, -1], decay[:, -1]


def prefix_scan(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``h_t = a_t * h_(t-1) + b_t`` from ``h = 0`` along dim 1: each row's product of ``a`` so
    far and ``h_t``. Rows are combined in pairs, the pairs scanned alike, then each even row
    from the pair before it: log2(rows) steps of whole-tensor ops, where a loop over the rows
    would be unrolled row by row when traced."""
    rows = a.shape[1]
    if rows == 1:
        return a, b
    pairs_a, pairs_b = prefix_scan(a[:, 1::2] * a[:, :-1:2], a[:, 1::2] * b[:, :-1:2] + b[:, 1::2])  # rows 1, 3, ...
    before = (rows - 1) // 2  # the even rows after row 0, each after the odd row before it
    even_a = torch.cat([a[:, :1], a[:, 2::2] * pairs_a[:, :before]], 1)
    even_b = torch.cat([b[:, :1], a[:, 2::2] * pairs_b[:, :before] + b[:, 2::2]], 1)
    return _interleaved(even_a, pairs_a, rows), _interleaved(even_b, pairs_b, rows)


def _interleaved(even: torch.Tensor, odd: torch.Tensor, rows: int) -> torch.Tensor:
    """Rows ``even[0], odd[0], even[1], ...``, ``rows`` of them."""
    odd = torch.cat([odd, even[:, -1:]], 1) if odd.shape[1] < even.shape[1] else odd
    return torch.stack([even, odd], 2).flatten(1, 2)[:, :rows]


RECURRENCES = {"torch_chunk_gated_delta_rule": (GatedDeltaRule, ("query", "key", "value", "beta", "g", "state")),
               "chunk_kimi_delta_attention": (GatedDeltaRule, ("query", "key", "value", "beta", "g", "state")),
               "torch_recurrent_gated_delta_rule": (GatedDeltaRule, ("query", "key", "value", "beta", "g", "state")),
               "recurrent_kimi_delta_attention": (GatedDeltaRule, ("query", "key", "value", "g", "beta", "state")),
               "mamba2_chunk_scan": (StateSpaceScan, ("dt_bias", "dt", "hidden_states", "B", "C", "D", "A", "state")),
               "mamba_selective_scan": (SelectiveScan, ("delta_bias", "dt", "B", "C", "A", "hidden_states", "D", "z"))}
"""The recurrences read as one op (``canonicalize.recurrence.recurrence_as_one_op``), by the name of the
module transformers wraps each in: its kind, and its tensor arguments in the order the function
first reads them (the state it starts from, if it takes one, last)."""


def kind_of(rule: str):
    """The kind (``GatedDeltaRule``, ``StateSpaceScan``, ``SelectiveScan``) of the recurrence
    ``rule`` names."""
    return RECURRENCES[rule.split(":")[1]][0]


def named_arguments(rule: str, tensors: tuple) -> dict:
    """``linear_recurrence``'s tensor arguments by name: the rows, the per-head ones, the state
    it starts from if given."""
    kind = kind_of(rule)
    return dict(zip(kind.rows + kind.per_head + ("state",), tensors))


@cache
def recurrence(rule: str):
    """The function ``rule`` (``module:name``) names: the model's own, resolved as it calls it."""
    module, name = rule.split(":")
    return getattr(importlib.import_module(module), name)


def linear_recurrence(rule: str, *tensors: torch.Tensor, options: tuple = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """``rule``'s output ``[batch, seq, heads, v_dim]`` and final state, from the state it starts
    from (zeros if not given): the one op canonicalize makes of the function's traced ops. The
    tensors are its rows, its per-head tensors, then the state (``named_arguments``); ``options``
    are its other arguments, as pairs."""
    t = named_arguments(rule, tensors)
    return kind_of(rule).call(recurrence(rule), t, t.pop("state", None), True, dict(options))


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


def _kept(x: torch.Tensor, plan: RunPlan) -> torch.Tensor:
    """``[runs * batch, run_length]``: which rows of ``x`` ``[runs * batch, run_length, ...]`` are
    real, not padding."""
    rows = torch.arange(plan.run_length, device=x.device)
    kept = torch.stack([rows < real for real in plan.real])  # [runs, run_length]
    return kept.unsqueeze(1).expand(plan.runs, x.shape[0] // plan.runs, plan.run_length).flatten(0, 1)


def _rows_mask(kept: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``kept`` ``[runs * batch, run_length]`` viewed to broadcast against ``x``'s rows."""
    return kept.view(*kept.shape, *[1] * (x.dim() - 2))


def sharded_linear_recurrence(rule: str, *tensors: torch.Tensor, options: tuple = (), plan: RunPlan,
                               mesh_dim: MeshDim, comm: str = FUNCTIONAL) -> tuple[torch.Tensor, torch.Tensor]:
    """``linear_recurrence`` of the whole sequence (from zeros), of which this rank holds the rows ``plan``
    lays out along dim 1 (cut over ``mesh_dim``): this rank's rows of the output, and the final
    state (the module docstring says how)."""
    kind, fn, options = kind_of(rule), recurrence(rule), dict(options)
    t = named_arguments(rule, tensors)
    batch = t[kind.values].shape[0]
    t = {name: _by_run(x, plan) if name in kind.rows else x for name, x in t.items()}
    if plan.padded:
        t = kind.neutral(t, _kept(t[kind.values], plan), options)
    zeros = kind.state(t)
    out, ends = kind.ends(fn, t, options)
    every = gather_stacked(ends.unflatten(0, (plan.runs, batch)), mesh_dim, comm).flatten(0, 1)  # [all runs, ...]
    owned = torch.zeros(len(plan.order), dtype=torch.bool, device=every.device)
    owned[list(plan.mine)] = True
    owned_only = torch.where(owned.view(-1, *[1] * (every.dim() - 1)), every, every.detach())
    starts, state, final = [None] * len(plan.order), zeros[:batch], zeros[:batch]
    for run in plan.order:  # the state each run starts from, then the final one
        starts[run] = state
        state, final = kind.fold(every[run], state), kind.fold(owned_only[run], final)
    out = out + kind.carried(fn, t, torch.stack(starts)[list(plan.mine)].flatten(0, 1), options)
    return out.unflatten(0, (plan.runs, batch)).transpose(0, 1).flatten(1, 2), final
