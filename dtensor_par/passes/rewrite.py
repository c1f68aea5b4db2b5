"""rewrite: reshape the graph around sites so that every op can be sharded exactly.

- The bias of a rowwise projection is added once, after the partial sums are reduced:
  ``linear(x, w, b)`` becomes ``linear(x, w) + b``.
- ``enable_gqa`` attention whose kv heads cannot be split over tp (x ulysses) gets each kv
  head repeated, the fewest times that make them split evenly, so each rank takes exactly
  the kv heads of its own query heads; otherwise kv travels with its own heads.
- With context parallelism, each attention call becomes ``hybrid_attention`` (Ulysses
  all-to-all, ring attention, all-to-all back) over sequence shards, with its mask, and with
  the padded keys of an uneven sequence masked. A mask built from positions (causal, a causal
  sliding window, either ANDed with a ``[B, S]`` key padding) runs as ``is_causal`` with its
  ``window`` and ``key_padding``, without the ``S x S`` mask. A mask that is, or holds added, a
  bias built from positions (ALiBi, T5's relative buckets: ``passes.biases``) gives it to hybrid
  attention as its ``position_bias`` and ``bias_table``, which each ring block evaluates for
  its own positions. Attention with dropout or another mask that needs a gradient stays as it
  is and runs on the gathered sequence, with a warning.
- With context parallelism, attention written out by hand becomes ``hybrid_attention`` too: what it
  does to its scores is read as a score function and a mask (``passes.scores``), the mask then as
  an SDPA mask, and sink logits concatenated to the scores (GPT-OSS) as its ``sinks``. What does not read so runs op by op on the whole sequence, with a warning naming
  the node.
"""

from __future__ import annotations

import functools
import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from ..errors import InvalidPlan
from ..logs import logger
from ..ops.attention import hybrid_attention
from ..ops.score_mod import ScoreMod
from ..placements import InterleavedShard, is_padded, shard_length
from ..symbolic import guards_at, hint, is_symbolic
from .context import ParallelContext, at_node
from .detect.heads import find_head_projections
from .edits import erase_unused, with_val
from .meta import Communication, set_communications, set_site_role, site_role
from .nodes import arguments, tensor_inputs, tensor_val
from .plan import colwise_placement, fused_parts
from .rules.attention import kv_whole_on_tp
from .rules.registry import op_kind
from .biases import FoundBias, constant_ancestors, evaluate_constant, position_bias
from .scores import as_sdpa_arguments, bias_kwargs, hiding_value, sinks_per_head, written_attention
from .sites import AttentionSite


def split_rowwise_bias(gm: fx.GraphModule, linear: fx.Node) -> None:
    """A rowwise linear's (or pointwise convolution's) bias, added once after its partial sums
    are reduced. (A grouped matmul's bias keeps its experts replicated: ``grouped_mm_rule``.)"""
    given = arguments(linear)
    bias, kind = given.get("bias"), op_kind(linear)
    if bias is None or kind not in ("linear", "conv"):
        return
    graph = gm.graph
    if kind == "conv":  # one value a channel, at every position
        spatial = (1,) * (tensor_val(linear).dim() - 2)
        with graph.inserting_before(linear):
            bias = with_val(graph.call_method("view", (bias, -1, *spatial)), tensor_val(bias).view(-1, *spatial))
    with graph.inserting_after(linear):
        add = graph.call_function(operator.add, (linear, bias))
    linear.replace_all_uses_with(add, delete_user_cb=lambda user: user is not add)
    linear.args, linear.kwargs = ((given["input"], given["weight"]), {}) if kind == "linear" else \
        ((), {**given, "bias": None})
    with_val(add, linear.meta["val"])
    set_site_role(add, site_role(linear))


def gqa_repeat(heads: int, kv_heads: int, divisor: int) -> int:
    """Fewest repeats of each kv head after which they split evenly over ``divisor`` ranks
    and still group the query heads (``enable_gqa`` maps query head i to kv head i // group)."""
    return next(r for r in range(1, heads // kv_heads + 1)
                if (kv_heads * r) % divisor == 0 and heads % (kv_heads * r) == 0 or kv_heads * r == heads)


def expand_gqa_kv(gm: fx.GraphModule, site: AttentionSite, repeat: int) -> None:
    core, graph = site.core, gm.graph
    sdpa = arguments(core)
    for name in ("key", "value"):
        kv = sdpa[name]
        with graph.inserting_before(core):
            expanded = graph.call_method("repeat_interleave", (kv, repeat), {"dim": -3})
        with_val(expanded, tensor_val(kv).repeat_interleave(repeat, dim=-3))
        sdpa[name] = expanded
    sdpa["enable_gqa"] = site.num_kv_heads * repeat != site.num_heads
    core.args, core.kwargs = (sdpa.pop("query"), sdpa.pop("key"), sdpa.pop("value")), sdpa


def hybrid_attention_communication(site: AttentionSite, q, k, v, mesh, ulysses_impl: str) -> list[Communication]:
    """The collectives one hybrid attention issues, per rank, forward and backward.

    Ulysses: one all-to-all for q, one for k and v (packed; one each when their shapes differ)
    and one for the output, each mirrored in the backward; or, with
    ``ulysses_impl="all_gather"``, an all-gather of each whose backward reduce-scatters
    ``ulysses`` times the bytes. Ring: ring-1 kv rotations forward, whose blocks the backward
    reuses; backward ring-1 fp32 dk/dv rotations (each rank keeps its share of its own block's
    gradient). Sizes include the zero heads padding adds.
    """
    tp, ulysses, ring, cp = (mesh.size(n) for n in ("tp", "ulysses", "ring", "cp"))
    q_heads = q.shape[-3] // tp
    kv_heads = k.shape[-3] // tp if k.shape[-3] % tp == 0 else k.shape[-3]
    if q_heads % ulysses or kv_heads % ulysses:
        q_heads = kv_heads = -(-q_heads // ulysses) * ulysses

    def per_head(t: torch.Tensor, seq: int) -> int:
        """Bytes of one head of a (padded) sequence shard; cross-attention's keys have their own length."""
        local_seq = shard_length(seq, cp, mesh.dims["cp"].chunks_per_rank)
        return hint(t.shape[0] * local_seq * t.shape[-1] * t.element_size())

    q_bytes, k_bytes, v_bytes = per_head(q, q.shape[-2]), per_head(k, k.shape[-2]), per_head(v, k.shape[-2])
    out_bytes = q_bytes * v.shape[-1] // q.shape[-1]
    comms = []
    if ulysses > 1:
        gathers = ulysses_impl == "all_gather"
        forward, backward = ("all_gather", "reduce_scatter") if gathers else ("all_to_all", "all_to_all")
        kv = [kv_heads * (k_bytes + v_bytes)] if k.shape == v.shape else [kv_heads * k_bytes, kv_heads * v_bytes]
        for nbytes in [q_heads * q_bytes, *kv, q_heads * out_bytes]:
            comms.append(Communication(forward, backward, "ulysses", ulysses, nbytes,
                                       nbytes * ulysses if gathers else nbytes, site.name))
    if ring > 1:
        kv_block = kv_heads * (k_bytes + v_bytes)  # k and v of one ring block
        comms += [Communication("ring_rotate", None, "ring", ring, kv_block, 0, site.name) for _ in range(ring - 1)]
        fp32_block = kv_block * 4 // q.element_size()
        comms += [Communication(None, "ring_rotate", "ring", ring, 0, fp32_block, site.name)
                  for _ in range(ring - 1)]
    return comms


def _sequence_lengths(site: AttentionSite, q, k, mesh, ctx: ParallelContext) -> dict:
    """``{"kv_len": n}`` when the keys' length does not divide over cp and hybrid attention
    must mask the padding; raises when a rank would hold nothing but padding."""
    cp, per_rank = mesh.size("cp"), mesh.dims["cp"].chunks_per_rank
    q_len, kv_len = q.shape[-2], k.shape[-2]
    if min(q_len, kv_len) < cp:
        decode = ("; a decode step (queries against a longer kv cache) runs over cp against the cache rows a "
                  "prefill under cp left on each rank (ops.cache_attention), for SDPA and for attention written "
                  "out by hand") if q_len < kv_len else ""
        raise InvalidPlan(
            f"rewrite: attention {site.core.name!r} has sequence length {q_len} (keys {kv_len}), "
            f"shorter than mesh dims 'ring' x 'ulysses' = {mesh.size('ring')} x {mesh.size('ulysses')} = {cp}: "
            f"some ranks would hold only padding; use smaller 'ring' or 'ulysses' dims{decode}")
    if is_symbolic(q_len) or is_symbolic(kv_len):
        ctx.warn(f"{site.name} ({site.core.name}): sequence length {ctx.specialization.named(q_len)} is symbolic: it is "
                 f"padded at the end to a multiple of {cp * per_rank} chunks (ring={mesh.size('ring')}, "
                 f"ulysses={mesh.size('ulysses')}), by nothing where it divides, so one plan serves every length")
    elif is_padded(q_len, cp, per_rank) or is_padded(kv_len, cp, per_rank):
        keys = f" (keys {kv_len})" if kv_len != q_len else ""
        ctx.warn(f"{site.name} ({site.core.name}): sequence length {q_len}{keys} does not divide into "
                 f"{cp * per_rank} equal chunks (ring={mesh.size('ring')}, ulysses={mesh.size('ulysses')}); padded at "
                 f"the end to a multiple of {cp * per_rank}")
    return {"kv_len": kv_len} if is_padded(kv_len, cp, per_rank) else {}


@dataclass(frozen=True)
class PositionalMask:
    """An attention mask found to be exactly causal, within a sliding ``window`` (query ``p``
    sees keys ``p - window < k <= p``) if one, and with a boolean ``[B, keys]`` key padding if
    one (the node holding it)."""

    window: int | None = None
    key_padding: fx.Node | None = None


def _causal_window(value: torch.Tensor, q_len: int, kv_len: int) -> PositionalMask | None:
    """The causal (sliding-window) pattern a constant mask is exactly, if it is one: the same
    [q_len, kv_len] pattern for every batch entry and head."""
    q_len, kv_len = int(q_len), int(kv_len)  # symbolic ones are pinned already: the mask was evaluated at one length
    if value.dtype != torch.bool:
        hidden = torch.isneginf(value) | (value == torch.finfo(value.dtype).min)
        if not bool((hidden | (value == 0)).all()):
            return None  # an additive bias, not only a mask
        value = ~hidden
    if q_len != kv_len or value.dim() < 2 or value.shape[-2:] != (q_len, kv_len):
        return None
    pattern = value.reshape(-1, q_len, kv_len)
    if not bool((pattern == pattern[:1]).all()):
        return None
    pattern = pattern[0]
    position = torch.arange(q_len, device=pattern.device)
    distance = position[:, None] - position[None, :]
    window = int(pattern[:, 0].sum())  # under a window of w, key 0 is seen by queries 0..w-1
    if window < 1:
        return None
    if bool((pattern == (distance >= 0)).all()):
        return PositionalMask()
    if bool((pattern == ((distance >= 0) & (distance < window))).all()):
        return PositionalMask(window=window)
    return None


_AND = {operator.and_, torch.logical_and, torch.bitwise_and, "__and__", "logical_and", "bitwise_and"}


def _skip_device_moves(node):
    """The node a ``.to(device)`` (no dtype change) or ``expand`` (SDPA broadcasts masks anyway) reads."""
    while isinstance(node, fx.Node) and node.op == "call_method" and node.target in ("to", "expand") \
            and tensor_val(node) is not None and tensor_val(source := arguments(node)["input"]) is not None \
            and tensor_val(node).dtype == tensor_val(source).dtype:
        node = source
    return node


def _and_leaves(node: fx.Node) -> list[fx.Node]:
    """The operands of a tree of boolean ``&``, device moves and broadcasts skipped."""
    node = _skip_device_moves(node)
    if node.op not in ("call_function", "call_method") or node.target not in _AND:
        return [node]
    operands = (arguments(node)["input"], arguments(node)["other"])
    if all(tensor_val(a) is not None and tensor_val(a).dtype == torch.bool for a in (node, *operands)):
        return [leaf for a in operands for leaf in _and_leaves(a)]
    return [node]


def _key_padding_of(leaf: fx.Node, kv_len: int) -> fx.Node | None:
    """``K`` when ``leaf`` is exactly ``K[:, None, None, :]`` for a boolean ``[B, kv_len]`` K:
    indexed by constant ``(arange(B)[:, None, None, None], arange(kv_len)[None, None, None, :])``
    (how transformers spells it) or by ``(:, None, None, :)``."""
    if leaf.op != "call_function" or leaf.target is not operator.getitem:
        return None
    keys, index = arguments(leaf)["input"], arguments(leaf)["index"]
    val = tensor_val(keys)
    if val is None or val.dtype != torch.bool or val.dim() != 2 or val.shape[1] != kv_len:
        return None
    if index == (slice(None), None, None, slice(None)):
        return keys
    if not (isinstance(index, tuple) and len(index) == 2 and all(isinstance(i, fx.Node) for i in index)):
        return None
    ancestors = [constant_ancestors(i) for i in index]
    if None in ancestors:
        return None
    try:
        rows, cols = torch.broadcast_tensors(*(evaluate_constant(nodes) for nodes in ancestors))
    except RuntimeError:
        return None
    batch = val.shape[0]
    if rows.shape != (batch, 1, 1, kv_len) or rows.dtype not in (torch.int64, torch.int32):
        return None
    expected_rows = torch.arange(batch, device=rows.device).view(batch, 1, 1, 1).expand_as(rows)
    expected_cols = torch.arange(kv_len, device=cols.device).view(1, 1, 1, kv_len).expand_as(cols)
    return keys if bool((rows == expected_rows).all() and (cols == expected_cols).all()) else None


def positional_mask(mask: fx.Node, q_len: int, kv_len: int) -> PositionalMask | None:
    """What an attention mask built from positions (and a key padding) is, if it is exactly
    causal or a causal sliding window, alone or ANDed with ``K[:, None, None, :]`` of a
    boolean ``[B, keys]`` K.

    transformers builds a ``[B, 1, S, S]`` mask from aranges while Dynamo traces instead of
    passing ``is_causal``. The part that depends on no input is evaluated here, once, and
    compared with the causal and window patterns; the part that depends on an input must be
    the key-padding indexing above. Recognition is exact, never a guess.
    """
    nodes = constant_ancestors(mask)
    if nodes is not None:
        return _causal_window(evaluate_constant(nodes), q_len, kv_len)
    leaves = _and_leaves(mask)
    constant = [leaf for leaf in leaves if constant_ancestors(leaf) is not None]
    padding = [_key_padding_of(leaf, kv_len) for leaf in leaves if leaf not in constant]
    if len(padding) != 1 or padding[0] is None or not constant:
        return None
    value = functools.reduce(operator.and_, torch.broadcast_tensors(*(evaluate_constant(constant_ancestors(leaf))
                                                                      for leaf in constant)))
    found = _causal_window(value, q_len, kv_len)
    return None if found is None else PositionalMask(found.window, padding[0])


def _fills_finite_lowest(mask: fx.Node) -> bool:
    """Whether an additive mask is, or holds (added to it, or filling it: masks applied one after
    another, ``scores.as_sdpa_arguments``), the lowest finite value where a condition computed
    from an input hides keys (``where(keep, 0, finfo.min)``, ``masked_fill(hide, finfo.min)``). A
    query row the condition hides entirely (a left-padded batch's first rows) then scores the same
    at every key, and on one device attends to all of them evenly; ring blocks, each normalized
    on its own, cannot reproduce that (its log-sum-exp is lost below the lowest value)."""
    kind = op_kind(mask)
    if kind not in ("add", "where") or not tensor_val(mask).is_floating_point():
        return False
    given = arguments(mask)
    condition = given.get("condition", given.get("mask"))
    values = [given.get(name) for name in ("input", "other", "value")]
    if kind == "where" and isinstance(condition, fx.Node) and constant_ancestors(condition) is None \
            and any(v != float("-inf") and hiding_value(v, mask) is not None for v in values):
        return True
    return any(isinstance(v, fx.Node) and _fills_finite_lowest(v) for v in values)


def _gathered_reason(attention: dict, ring: int) -> str | None:
    """Why hybrid attention over a ring of ``ring`` cannot take these attention arguments (the
    attention then runs on the gathered sequence), if it cannot."""
    mask = attention["attn_mask"]
    if attention["dropout_p"] or tensor_val(attention["query"]).dim() != 4 \
            or (mask is not None and mask.meta["requires_grad"]):
        return "attention with dropout, a mask that needs a gradient or no batch dim"
    if ring > 1 and mask is not None and _fills_finite_lowest(mask):
        return (f"the mask {mask.name} fills with the lowest finite value where an input hides keys, so a query row "
                f"it hides entirely (a left-padded batch's first rows) attends to every key evenly, which ring blocks "
                f"cannot reproduce (ulysses can)")
    return None


def _short_side(attention: dict, ctx: ParallelContext) -> str | None:
    """Why an attention whose queries or keys are fewer than cp has ranks, and not the other,
    runs whole: a pooling query (Mochi's text pooled by one query) or a short context is no
    sequence the ranks share. A self-attention over too short a sequence, or a decode step
    against a kv cache, is refused by ``_sequence_lengths``."""
    cp = ctx.mesh.size("cp")
    q_len, kv_len = (tensor_val(attention[name]).shape[-2] for name in ("query", "key"))
    if is_symbolic(q_len) or is_symbolic(kv_len) or min(q_len, kv_len) >= cp or q_len == kv_len \
            or ctx.cache_outputs or ctx.cache_inputs:
        return None
    return f"attention over {q_len} query rows and {kv_len} keys, fewer than the {cp} cp ranks on one side,"


def _positional(site: AttentionSite, attention: dict) -> dict:
    """Hybrid attention's ``window`` and ``key_padding`` when the mask is built from positions
    (``positional_mask``); the mask then goes from ``attention``, which becomes causal."""
    mask = attention["attn_mask"]
    if mask is None or attention["is_causal"]:
        return {}
    q_len, kv_len = tensor_val(attention["query"]).shape[-2], tensor_val(attention["key"]).shape[-2]
    with guards_at(f"rewrite at {mask.name} (a mask built from positions, evaluated at one length)"):
        structure = positional_mask(mask, q_len, kv_len)
    if structure is None:
        return {}
    positional = {name: value for name, value in (("window", structure.window),
                                                  ("key_padding", structure.key_padding)) if value is not None}
    window = f" within a window of {structure.window} keys" if structure.window else ""
    padding = f", with the key padding {structure.key_padding.name}" if structure.key_padding else ""
    logger.info("%s (%s): its attention mask is causal%s%s: runs as is_causal%s, without the mask",
                site.name, site.core.name, window, padding, "".join(f" and {name}" for name in positional))
    attention["attn_mask"], attention["is_causal"] = None, True
    return positional


def _split_position_bias(attention: dict) -> FoundBias | None:
    """A position bias an SDPA mask is, or holds added to the rest of it, or kept where a boolean
    mask attends (T5 passes its relative bias as the mask, its decoder's as
    ``where(causal, bias, lowest)``): taken out of ``attention``'s mask, which keeps the rest.

    ``where(condition, bias, lowest)`` gives a query row the condition hides entirely the same
    score at every key, so on one device it attends to all of them evenly; the condition as a
    boolean mask would attend to none. It is split only where no row can be hidden entirely:
    a causal mask or window without a key padding (a left-padded batch hides its first rows)."""
    mask = attention["attn_mask"]
    if mask is None:
        return None
    q, k = tensor_val(attention["query"]), tensor_val(attention["key"])
    sizes = q.shape[-3], q.shape[-2], k.shape[-2]
    while mask.op == "call_method" and mask.target == "contiguous":
        mask = mask.args[0]
    parts, given = [(mask, None)], arguments(mask) if mask.op in ("call_function", "call_method") else {}
    if op_kind(mask) == "add" and given.get("alpha", 1) == 1:
        operands = given["input"], given["other"]
        if all(isinstance(a, fx.Node) for a in operands):
            parts += [operands, operands[::-1]]
    with guards_at(f"rewrite at {mask.name} (a bias built from positions, evaluated at one length)"):
        if op_kind(mask) == "where" and "condition" in given and isinstance(given["input"], fx.Node) \
                and hiding_value(given["other"], mask) is not None:
            kept = positional_mask(given["condition"], *sizes[1:])
            if kept is not None and kept.key_padding is None:
                parts.append((given["input"], given["condition"]))
        for part, rest in parts:
            found = position_bias(part, *sizes)
            if found is not None:
                attention["attn_mask"] = rest
                return found
    return None


def _refold(gm: fx.GraphModule, hybrid: fx.Node, core: fx.Node, query: fx.Node) -> fx.Node:
    """The attention's output as its users read it: ``[batch * heads, seq, dim]`` where the heads
    were folded into the batch (Bloom)."""
    folded = tensor_val(core)
    if folded.dim() != 3:
        return hybrid
    with_val(hybrid, folded.view(*tensor_val(query).shape[:2], *folded.shape[1:]))
    with gm.graph.inserting_after(hybrid):
        return with_val(gm.graph.call_method("reshape", (hybrid, *folded.shape)), folded)


def to_hybrid_attention(gm: fx.GraphModule, site: AttentionSite, attention: dict, ctx: ParallelContext,
                        score_mod: ScoreMod | None = None, bias: FoundBias | None = None,
                        sinks: fx.Node | None = None) -> None:
    """Replace the site's attention (its arguments as SDPA names them in ``attention``, its
    score function, bias built from positions and sink logits if written out by hand) by
    ``hybrid_attention`` over the cp mesh dims."""
    mesh, core = ctx.mesh, site.core
    bias = bias or _split_position_bias(attention)
    reason = _gathered_reason(attention, mesh.size("ring")) or _short_side(attention, ctx)
    if reason is not None:
        ctx.warn(f"{site.name} ({core.name}): {reason} runs on the gathered sequence (mesh dims 'ring' x 'ulysses' "
                 f"= {mesh.size('cp')})")
        return
    positional = _positional(site, attention)
    tp, ulysses = mesh.size("tp"), mesh.size("ulysses")
    kv_heads = tensor_val(attention["key"]).shape[-3]
    kv_heads = kv_heads // tp if kv_heads % tp == 0 else kv_heads
    heads = site.num_heads // tp
    if heads % ulysses or kv_heads % ulysses:
        padded = -(-heads // ulysses) * ulysses
        ctx.warn(f"{site.name} ({core.name}): {heads} query / {kv_heads} kv heads per tp rank (tp={tp}) do not "
                 f"divide by mesh dim 'ulysses' of size {ulysses}; padded to {padded} heads "
                 f"({padded - heads} zero heads computed per {heads})")
    q, k, v = (attention[name] for name in ("query", "key", "value"))
    kwargs = {"attn_mask": attention["attn_mask"], "is_causal": attention["is_causal"], "scale": attention["scale"],
              "enable_gqa": attention["enable_gqa"], "ulysses": mesh.dims["ulysses"], "ring": mesh.dims["ring"],
              "ulysses_impl": ctx.config.ulysses_impl, **positional,
              **({"score_mod": score_mod} if score_mod is not None else {}), **bias_kwargs(gm, site, bias, q),
              **sinks_per_head(gm, site, sinks),
              **_sequence_lengths(site, tensor_val(q), tensor_val(k), mesh, ctx)}
    with gm.graph.inserting_before(core):
        hybrid = gm.graph.call_function(hybrid_attention, (q, k, v), kwargs)
    hybrid.meta.update(core.meta)
    set_communications(hybrid, hybrid_attention_communication(
        site, *(tensor_val(n) for n in (q, k, v)), mesh, ctx.config.ulysses_impl))
    core.replace_all_uses_with(_refold(gm, hybrid, core, q))
    erase_unused(gm, core)  # and what only it read: a mask built from positions, written-out scores
    site.core = hybrid


def written_out_to_hybrid_attention(gm: fx.GraphModule, site: AttentionSite, ctx: ParallelContext) -> None:
    """Attention written out by hand as hybrid attention with its score function
    (``passes.scores``); where it does not read as one, it runs op by op, with a warning."""
    found = written_attention(site)
    if isinstance(found, str):
        ctx.warn(f"{site.name} ({site.core.name}): attention written out by hand runs op by op on the whole "
                 f"sequence over cp: {found}")
        return
    to_hybrid_attention(gm, site, as_sdpa_arguments(gm, site, found), ctx, found.score_mod, found.bias, found.sinks)


def _kv_parts_to_gather(site: AttentionSite, ctx: ParallelContext) -> list[fx.Node]:
    """The key and value parts of a fused projection whose kv heads (its parts' features over
    the query part's head dim: the model may repeat them to the query heads before attention)
    do not divide by tp, when every part's features do (multi-query: GPTBigCode, Falcon-7B).
    Empty where the kv heads divide, or the parts do not, or cannot be told apart."""
    tp = ctx.mesh.size("tp")
    fused = [n for n in dict.fromkeys(site.q) if n in site.k + site.v]
    found = fused_parts(fused[0]) if tp > 1 and len(fused) == 1 else None
    if not found or not found.nodes or not isinstance(colwise_placement(fused[0], tp), InterleavedShard):
        return []
    query = tensor_inputs(site.scores if site.scores is not None else site.core)[0]
    walked = set(find_head_projections(query, ctx)[1])
    queries, kv = [p for p in found.nodes if p in walked], [p for p in found.nodes if p not in walked]
    if len(queries) != 1 or not kv:
        return []
    head_dim = tensor_val(queries[0]).shape[-1] // site.num_heads
    return kv if any(tensor_val(p).shape[-1] // head_dim % tp for p in kv) else []


def gather_fused_kv(gm: fx.GraphModule, site: AttentionSite, ctx: ParallelContext) -> None:
    """Gather whole over tp the key and value parts of a fused projection cut part by part with
    its query's heads, as they are taken off it (``kv_whole_on_tp``), where its kv heads do not
    divide by tp: every rank holds the kv heads whole and its own query heads, as Megatron
    replicates fewer kv heads than tp ranks (``site.kv_whole_on_tp``, which the plan reads)."""
    site.kv_whole_on_tp = _kv_parts_to_gather(site, ctx)
    for part in site.kv_whole_on_tp:
        with gm.graph.inserting_after(part):
            whole = with_val(gm.graph.call_function(kv_whole_on_tp, (part,)), tensor_val(part))
        part.replace_all_uses_with(whole, delete_user_cb=lambda user: user is not whole)
        set_site_role(whole, f"{site.name}.kv")


def rewrite_pass(gm: fx.GraphModule, ctx: ParallelContext) -> fx.GraphModule:
    tp = ctx.mesh.size("tp")
    for site in ctx.sites:
        for linear in site.rowwise:
            with at_node("rewrite", linear):
                split_rowwise_bias(gm, linear)
        if not isinstance(site, AttentionSite):
            continue
        with at_node("rewrite", site.core):
            gather_fused_kv(gm, site, ctx)
        if op_kind(site.core) == "cached_attention":
            continue  # attention to a kv cache held cut over cp is rewritten already (passes.kv_cache)
        if site.written_out:
            if ctx.mesh.size("cp") > 1:
                with at_node("rewrite", site.core):
                    written_out_to_hybrid_attention(gm, site, ctx)
            continue
        with at_node("rewrite", site.core):
            if arguments(site.core)["enable_gqa"] and site.num_kv_heads != site.num_heads:
                divisor = tp * (ctx.mesh.size("ulysses") if ctx.mesh.size("cp") > 1 else 1)
                repeat = gqa_repeat(site.num_heads, site.num_kv_heads, divisor)
                if repeat > 1:
                    expand_gqa_kv(gm, site, repeat)
            if ctx.mesh.size("cp") > 1:
                to_hybrid_attention(gm, site, arguments(site.core), ctx)
    gm.recompile()
    return gm
