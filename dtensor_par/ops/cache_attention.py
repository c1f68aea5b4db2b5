"""Attention of new tokens against a kv cache cut along the sequence over cp (decode).

After a prefill under context parallelism each cp rank keeps the cache rows of its own
sequence positions (``kv_cache.CacheShard.positions``, in any layout: contiguous, zigzag,
appended to the rank holding the fewest). A decode step's few queries are not cut: every rank holds them whole,
attends them to the cache rows it holds and to the step's new rows (the same on every rank),
and the partial results merge by their log-sum-exp after one all-gather across cp. Masks
(causal, sliding window, key padding: any ``attn_mask`` over the global key positions) hold
for the cached rows: each rank takes the mask columns of the positions it holds. Attention
written out by hand brings its score function, applied to every row's scores, its sink
logits, one more log-sum-exp in the merge whose output is zero, and its bias built from
positions (``ops.position_bias``: ALiBi), evaluated at the queries' and the keys'
positions.
"""

from __future__ import annotations

import torch

from ..mesh import MeshDim
from .collectives import all_gather
from .lowerings import FUNCTIONAL
from .ring_kernels import as_4d, as_additive, block_forward
from .position_bias import PositionBias, TableBias
from .score_mod import ScoreMod


def cache_buffer(source: torch.Tensor, size: list[int], dtype: torch.dtype) -> torch.Tensor:
    """``torch.zeros(size, dtype)`` on ``source``'s device: a static kv cache's buffer, which
    ``source``'s rows are then written into (``passes.kv_cache``): planned cut as ``source`` is."""
    return torch.zeros(size, dtype=dtype, device=source.device)


def _columns(mask: torch.Tensor | None, keys: torch.Tensor, q_len: int, is_causal: bool,
             dtype: torch.dtype) -> torch.Tensor | None:
    """The additive mask of ``q_len`` query rows against the keys at global positions ``keys``:
    the given mask's columns there, and SDPA's own causal mask (query ``i`` sees keys ``<= i``)."""
    cols = None
    if mask is not None:
        mask = as_4d(mask)
        cols = as_additive(mask if mask.shape[-1] == 1 else mask.index_select(-1, keys), dtype)
    if is_causal:
        causal = as_additive(keys[None, :] <= torch.arange(q_len, device=keys.device)[:, None], dtype)
        cols = causal if cols is None else cols + causal
    return cols


def _plus(cols: torch.Tensor | None, bias: torch.Tensor | None) -> torch.Tensor | None:
    """Additive columns with ``bias`` added (either may be None)."""
    return cols if bias is None else bias if cols is None else cols + bias


@torch.library.custom_op("dtensor_par::held_attention", mutates_args=())
def held_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                   mask: torch.Tensor | None, is_causal: bool, scale: float | None, groups: int,
                   score_codes: list[int], score_constants: list[float], bias: torch.Tensor | None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q`` to the cache rows this rank holds: the output and per-row log-sum-exp
    (``-inf`` for a row that sees none of them), the score function given by its codes
    (``ScoreMod.codes``; none without), ``bias`` added to the scores (a position bias at the
    held rows). An op of its own: the number of rows a rank holds differs between ranks and
    steps, and no compiled graph depends on it."""
    if k.shape[-2] == 0:
        return torch.zeros_like(q), q.new_full(q.shape[:-1], float("-inf"), dtype=torch.float32)
    score_mod = ScoreMod.from_codes(score_codes, score_constants) if score_codes else None
    cols = _plus(_columns(mask, positions, q.shape[-2], is_causal, q.dtype), bias)
    out, lse = block_forward(q, k, v, cols, is_causal=False, scale=scale, groups=groups, score_mod=score_mod)
    return out, lse.float()


@held_attention.register_fake
def _(q, k, v, positions, mask, is_causal, scale, groups, score_codes, score_constants, bias):
    return torch.empty_like(q), q.new_empty(q.shape[:-1], dtype=torch.float32)


def cached_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_held: torch.Tensor, v_held: torch.Tensor,
                     positions: torch.Tensor, *, past: int, attn_mask: torch.Tensor | None = None,
                     is_causal: bool = False, scale: float | None = None, score_mod: ScoreMod | None = None,
                     sinks: torch.Tensor | None = None, position_bias: PositionBias | None = None,
                     bias_table: torch.Tensor | None = None, cp: MeshDim, comm: str = FUNCTIONAL) -> torch.Tensor:
    """``scaled_dot_product_attention(q, cat([cache, k]), cat([cache, v]), attn_mask)`` when
    the cache (``past`` rows) is cut over ``cp``: ``k_held``/``v_held`` are this rank's rows
    of it, at global ``positions``; ``k``/``v`` the new rows, at positions ``past, past + 1, ...``.
    Fewer kv heads than query heads serve a group of query heads each (SDPA's ``enable_gqa``).
    ``score_mod``, ``sinks`` (a logit per query head) and ``position_bias`` with the table it
    reads (this rank's heads): attention written out by hand's (``ops.score_mod``,
    ``ring_kernels.add_sinks``, ``ops.position_bias``)."""
    groups = q.shape[1] // k.shape[1]
    codes = score_mod.codes() if score_mod is not None else ([], [])
    q_len = q.shape[-2]
    queries = torch.arange(q_len, device=q.device) + past
    bias = None if position_bias is None else TableBias(position_bias, bias_table)
    held_bias = None if bias is None else bias.tile(queries, positions).to(q.dtype)
    out, lse = held_attention(q, k_held, v_held, positions, attn_mask, is_causal, scale, groups, *codes, held_bias)
    outs = all_gather(out.unsqueeze(0), 0, None, cp, comm=comm)
    lses = all_gather(lse.unsqueeze(0), 0, None, cp, comm=comm)
    new_bias = None if bias is None else bias.tile(queries, queries).to(q.dtype)  # new rows at the queries' positions
    new_cols = _plus(_columns(attn_mask, queries, q_len, is_causal, q.dtype), new_bias)
    new_out, new_lse = block_forward(q, k, v, new_cols, is_causal=False, scale=scale, groups=groups,
                                     score_mod=score_mod)
    lses = torch.cat([lses, new_lse.float().unsqueeze(0)])
    outs = torch.cat([outs, new_out.unsqueeze(0)]).float()
    if sinks is not None:  # a key every query sees, whose value is zero
        lses = torch.cat([lses, sinks.float().view(1, 1, -1, 1).expand_as(lses[:1])])
        outs = torch.cat([outs, torch.zeros_like(outs[:1])])
    top = lses.amax(0)
    weights = torch.exp(lses - top.masked_fill(top.isneginf(), 0.0))
    return ((weights.unsqueeze(-1) * outs).sum(0) / weights.sum(0).unsqueeze(-1)).to(q.dtype)
