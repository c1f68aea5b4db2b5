"""Hybrid (Ulysses x ring) attention over sequence shards.

Input q/k/v are this rank's sequence shard, ``[batch, heads, seq / cp, head_dim]`` with cp
rank = ring rank * ulysses + ulysses rank, in the zigzag layout when ring > 1 (ring rank r's
block is chunks r and 2 * ring - 1 - r of 2 * ring, ``ops.sequence_layout``), so causal
attention is load-balanced. One all-to-all over ``ulysses`` trades the sequence shard for a
head shard: each rank then holds its ring block (the ``ulysses`` shards of one ring rank,
in order) for ``heads / ulysses`` heads. Ring attention over ``ring`` computes exact
attention of that block against the whole sequence, and a second all-to-all trades the
heads back. Both all-to-alls' backwards are all-to-alls the other way.

``ulysses_impl="all_gather"`` makes the same trades without all-to-all, for stacks whose
all-to-all does not compile (torch_xla's on Neuron): q/k/v are all-gathered along the
sequence and each rank keeps its heads; the output is all-gathered along the heads and each
rank keeps its sequence shard. A gather used by a rank-local slice has a reduce-scatter as
its backward (``collectives.all_gather_partial_grad``), so the gradients are exact; each
gather moves ``ulysses`` times the bytes of an all-to-all.

Heads that do not divide by ``ulysses`` are padded with zero heads (grouped kv heads are
repeated to the query heads first): a zero head's output is zero and is cut off again, so
the result is exact at the cost of the padded heads' compute.

A sequence that does not divide evenly arrives padded at its end (``ops.collectives``); the
ring masks the padded keys, and padded queries compute rows nobody reads.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..mesh import MeshDim
from .collectives import all_gather_partial_grad, all_to_all
from .lowerings import FUNCTIONAL
from .ring import ring_attention
from .ring_kernels import as_4d
from .position_bias import PositionBias
from .score_mod import ScoreMod
from .sequence_layout import zigzag_indices

HEADS, SEQ = -3, -2
ULYSSES_IMPLS = ("all_to_all", "all_gather")


def _trade(x: torch.Tensor, gathered: int, kept: int, ulysses: MeshDim, impl: str, comm: str) -> torch.Tensor:
    """The shard of dim ``gathered`` (whole over ulysses after this) for one of dim ``kept``."""
    if impl == "all_to_all":
        return all_to_all(x, gathered % x.dim(), kept % x.dim(), ulysses, comm=comm)
    full = all_gather_partial_grad(x, gathered % x.dim(), None, ulysses, comm=comm)
    n = x.shape[kept] // ulysses.size
    return full.narrow(kept, ulysses.rank * n, n)


def _seq_to_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ulysses: MeshDim, impl: str,
                  comm: str) -> list[torch.Tensor]:
    """q's exchange alone, issued first, then k and v packed in one (one each when grouped kv
    heads make their shapes differ). q's exchange depends on q only, so a scheduler that issues
    collectives as early as their inputs allow (``passes.overlap``, inductor's ``raise_comms``)
    can send it while k and v are still being projected."""
    q = _trade(q, SEQ, HEADS, ulysses, impl, comm)
    if k.shape == v.shape:
        return [q, *_trade(torch.stack([k, v]), SEQ, HEADS, ulysses, impl, comm).unbind(0)]
    return [q, _trade(k, SEQ, HEADS, ulysses, impl, comm), _trade(v, SEQ, HEADS, ulysses, impl, comm)]


def _mask_for_rank(mask: torch.Tensor, heads: int, padded_heads: int, ulysses_rank: int, ulysses_size: int,
                   rows: torch.Tensor) -> torch.Tensor:
    """The part of a whole mask this rank's attention needs: its heads after the all-to-all and
    the query rows of its ring block (``rows``: global positions, padding clamped to the last
    real row so that a padded query is never left without a key)."""
    mask = as_4d(mask)
    if mask.shape[HEADS] > 1:
        if padded_heads != heads:  # the zero heads attend to everything
            attend = torch.ones_like if mask.dtype == torch.bool else torch.zeros_like
            mask = torch.cat([mask, attend(mask[:, :1]).expand(-1, padded_heads - heads, -1, -1)], dim=HEADS)
        per_rank = padded_heads // ulysses_size
        mask = mask.narrow(HEADS, ulysses_rank * per_rank, per_rank)
    if mask.shape[SEQ] > 1:
        mask = mask.index_select(SEQ, rows.clamp(max=mask.shape[SEQ] - 1).to(mask.device))
    return mask


def _heads_of_rank(table: torch.Tensor, padded_heads: int, ulysses: MeshDim) -> torch.Tensor:
    """This ulysses rank's heads of a table ``[rows, heads]`` (a bias's, the sinks'): zero heads
    read it nowhere."""
    table = F.pad(table, (0, padded_heads - table.shape[1]))
    per_rank = padded_heads // ulysses.size
    return table.narrow(1, ulysses.rank * per_rank, per_rank)


def hybrid_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, attn_mask: torch.Tensor | None = None,
                     is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False,
                     ulysses: MeshDim, ring: MeshDim, kv_len: int | None = None, window: int | None = None,
                     key_padding: torch.Tensor | None = None, score_mod: ScoreMod | None = None,
                     position_bias: PositionBias | None = None, bias_table: torch.Tensor | None = None,
                     sinks: torch.Tensor | None = None, ulysses_impl: str = "all_to_all",
                     comm: str = FUNCTIONAL) -> torch.Tensor:
    """This rank's sequence shard of ``scaled_dot_product_attention(q, k, v, attn_mask)`` over
    the full sequence, forward and backward.

    ``attn_mask`` is whole (every query and key position, any broadcastable shape, heads
    sharded only by tp). ``window`` (with ``is_causal``) and ``key_padding`` (boolean
    ``[B, keys]``, whole) stand for a causal sliding-window / key-padding mask without one of
    the sequence (``ring_attention``). ``kv_len``: the real key length when an uneven sequence
    was padded at its end to split evenly; the padded keys are masked. ``score_mod``: the score
    function of attention written out by hand (``ops.score_mod``), applied by every ring block
    and at a ring of one to its own tile of scores. ``position_bias``: a bias built from
    positions (``ops.position_bias``) reading ``bias_table`` ``[rows, heads]`` (heads sharded
    only by tp), evaluated by each ring block for the heads and positions it holds, and the
    table's gradient this rank's share (the graph sums it over cp). ``sinks``: a logit per query
    head (GPT-OSS's attention sinks, heads sharded only by tp), folded in after the ring, its
    gradient this rank's share likewise. ``ulysses``, ``ring``: the layouts
    of the two mesh dims; ``ulysses_impl``: one of ULYSSES_IMPLS; ``comm``: the lowering of
    the collectives (``ops.lowerings``).
    """
    ulysses_size, ring_size = ulysses.size, ring.size
    heads = q.shape[HEADS]
    padded = heads
    if ulysses_size > 1:
        if heads % ulysses_size or k.shape[HEADS] % ulysses_size:
            if enable_gqa and k.shape[HEADS] != heads:
                k, v = (t.repeat_interleave(heads // t.shape[HEADS], dim=HEADS) for t in (k, v))
                enable_gqa = False
            padded = -(-heads // ulysses_size) * ulysses_size
            q, k, v = (F.pad(t, (0, 0, 0, 0, 0, padded - heads)) for t in (q, k, v))
        q, k, v = _seq_to_heads(q, k, v, ulysses, ulysses_impl, comm)
        if bias_table is not None:
            bias_table = _heads_of_rank(bias_table, padded, ulysses)
        if sinks is not None:
            sinks = _heads_of_rank(sinks.unsqueeze(0), padded, ulysses).squeeze(0)
    if attn_mask is not None:
        block = q.shape[SEQ]  # this ring rank's block of (padded) query positions
        rows = (zigzag_indices(block * ring_size, ring_size, ring.rank) if ring_size > 1
                else torch.arange(block))
        attn_mask = _mask_for_rank(attn_mask, heads, padded, ulysses.rank, ulysses_size, rows)
    out = ring_attention(q, k, v, ring=ring, comm=comm, attn_mask=attn_mask,
                         is_causal=is_causal, scale=scale, enable_gqa=enable_gqa, zigzag=ring_size > 1,
                         kv_len=kv_len, window=window, key_padding=key_padding, score_mod=score_mod,
                         position_bias=position_bias, table=bias_table, sinks=sinks)
    if ulysses_size > 1:
        out = _trade(out, HEADS, SEQ, ulysses, ulysses_impl, comm)
    return out[:, :heads] if padded != heads else out
