"""scores: read attention written out by hand as hybrid attention's arguments.

Between ``q @ kT`` and the softmax, the ops of one score each (a scale, Gemma2's
soft-capping ``tanh(s / c) * c``, negation, float casts) become a score function
(``ops.score_mod.ScoreMod``), which each ring block applies to its own scores; a mask applied
last (tensors added, ``masked_fill`` or ``where`` of the scores with -inf or the dtype's
lowest value, one or several in a row) becomes the attention's mask, which rewrite then reads as
it reads an SDPA mask (built from positions: no ``S x S`` tensor kept); a tensor added there that is a bias built
from positions (ALiBi, T5's relative buckets: ``passes.biases``) travels as hybrid attention's
position bias beside it. Sink logits concatenated after the scores (GPT-OSS: ``sites.SinkLogits``)
travel as hybrid attention's sinks. Heads folded into the batch around the scores (Bloom's
``[batch * heads, seq, keys]``) are read unfolded. Between the softmax and ``@ v``:
float casts and a dropout that drops nothing. Anything else is a reason, naming its node,
why the attention stays as written.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.nn.functional as F

from ..logs import logger
from ..ops.score_mod import ScoreMod
from ..symbolic import guards_at
from .biases import FoundBias, constant_ancestors, evaluate_constant, position_bias
from .detect.heads import folds_heads, unfolded_heads
from .edits import with_val
from .nodes import arguments, tensor_inputs, tensor_val
from .rules.registry import op_kind
from .sites import AttentionSite

_TANH = {torch.tanh, F.tanh, "tanh"}
_SOFTMAX = {F.softmax, torch.softmax, "softmax"}


@dataclass(frozen=True)
class MaskStep:
    """One mask applied to the scores: ``tensor`` added to them (``fill`` None), or the scores
    filled with ``fill`` (-inf or the dtype's lowest value) where the boolean ``tensor`` is True
    (``hides``) or where it is False."""

    tensor: fx.Node
    hides: bool = False
    fill: float | None = None


@dataclass
class WrittenAttention:
    """Hybrid attention's arguments read off attention written out by hand: ``key`` is None
    where ``q @ kT`` reads no ``key.transpose(-2, -1)`` (rewrite then transposes ``key_t``);
    ``masks``: the masks applied last, in the order they are (``as_sdpa_arguments`` makes them
    one SDPA mask); ``bias``: a bias built from positions
    (``passes.biases``); ``sinks``: the ``[1, heads, 1, 1]`` sink logits (GPT-OSS). Where the heads
    are folded into the batch (Bloom's ``[batch * heads, seq, dim]``), q, k and v are the 4-d
    tensors they were folded from."""

    query: fx.Node
    key: fx.Node | None
    key_t: fx.Node
    value: fx.Node
    score_mod: ScoreMod
    masks: tuple[MaskStep, ...]
    bias: FoundBias | None = None
    sinks: fx.Node | None = None


def _number(a) -> bool:
    return isinstance(a, (int, float)) and not isinstance(a, bool)


def _score_step(node: fx.Node) -> tuple[fx.Node, tuple[str, float] | None] | None:
    """``(the scores it reads, its step)`` when ``node`` applies one step of a score function
    to one tensor of scores (a float cast: no step); else None."""
    kind, given = op_kind(node), arguments(node)
    if kind == "cast" and node.target != "detach" and len(tensor_inputs(node)) == 1 \
            and tensor_val(node).is_floating_point():
        return tensor_inputs(node)[0], None
    if kind == "neg" or (kind == "unary" and node.target in _TANH):
        return given["input"], (kind if kind == "neg" else "tanh", 0.0)
    if kind not in ("mul", "div", "add", "sub") or given.get("alpha", 1) != 1:
        return None
    x, c = given["input"], given["other"]
    if isinstance(x, fx.Node) and tensor_val(x) is not None and (number := _scalar(c)) is not None:
        return x, (kind, number)
    if isinstance(c, fx.Node) and tensor_val(c) is not None and (number := _scalar(x)) is not None and kind != "div":
        return c, ("rsub" if kind == "sub" else kind, number)
    return None


def _scalar(a) -> float | None:
    """A number, or one made of sizes (``k.size(-1) ** 0.5`` under ``dynamic=True``) at its value:
    the plan then holds at those sizes only (a guard, which ``explain`` reports)."""
    if _number(a):
        return float(a)
    value = a.meta.get("val") if isinstance(a, fx.Node) else None
    return float(value) if _number(value) or isinstance(value, (torch.SymFloat, torch.SymInt)) else None


def hiding_value(fill, scores: fx.Node) -> float | None:
    """The value filling the (floating) scores with ``fill`` gives them, when it hides them from
    the softmax (-inf, or the lowest value of their dtype, as transformers fills); ``fill`` a
    number or a one-element tensor computed from constants (GPT-Neo's
    ``torch.tensor(finfo.min, dtype=...)``). None for any other fill."""
    if isinstance(fill, fx.Node):
        one = tensor_val(fill) is not None and tensor_val(fill).numel() == 1
        made_of = constant_ancestors(fill) if one else None
        fill = evaluate_constant(made_of).item() if made_of else None
    return float(fill) if _number(fill) and fill <= torch.finfo(tensor_val(scores).dtype).min else None


def _mask_step(node: fx.Node, scores: fx.Node) -> tuple[fx.Node, MaskStep] | None:
    """``(the scores it reads, the mask it applies)`` when ``node`` masks the scores (read from
    ``scores``): adds a tensor to them, or fills them by a boolean condition with a value that
    hides."""
    kind, given = op_kind(node), arguments(node)
    if kind == "add" and given.get("alpha", 1) == 1:
        operands = [a for a in (given["input"], given["other"]) if isinstance(a, fx.Node)]
        reading = [a for a in operands if _reads(a, scores)]
        if len(operands) == 2 and len(reading) == 1:
            return reading[0], MaskStep(next(a for a in operands if a is not reading[0]))
    if kind == "where" and "mask" in given and (fill := hiding_value(given["value"], node)) is not None:
        return given["input"], MaskStep(given["mask"], True, fill)
    if kind == "where" and "condition" in given:
        kept, filled = given["input"], given["other"]
        if isinstance(kept, fx.Node) and (fill := hiding_value(filled, node)) is not None:
            return kept, MaskStep(given["condition"], False, fill)
        if isinstance(filled, fx.Node) and (fill := hiding_value(kept, node)) is not None:
            return filled, MaskStep(given["condition"], True, fill)
    return None


def _reads(node: fx.Node, target: fx.Node) -> bool:
    """Whether ``node`` is computed from ``target``."""
    seen, stack = set(), [node]
    while stack:
        n = stack.pop()
        if n is target:
            return True
        if n not in seen:
            seen.add(n)
            stack.extend(n.all_input_nodes)
    return False


def _unfolds_heads(node: fx.Node) -> bool:
    """Whether ``node`` views ``[batch * heads, q, k]`` scores as ``[batch, heads, q, k]``."""
    return op_kind(node) == "view" and folds_heads(tensor_val(node).shape, tensor_val(tensor_inputs(node)[0]).shape)


@dataclass
class _Scores:
    """What happens to the scores between ``q @ kT`` and the softmax: the score function, the
    masks applied last (in the order they are), and whether the heads are folded into the batch
    before (Bloom)."""

    score_mod: ScoreMod
    masks: list[MaskStep]
    folded: bool


def _clamped_at_lowest(node: fx.Node) -> tuple[fx.Node, float] | None:
    """``(the scores, the value)`` when ``node`` clamps scores from below at -inf or their dtype's
    lowest value (XGLM: ``torch.max(s, full((), finfo.min))``, made ``torch.maximum``)."""
    given = arguments(node) if node.target is torch.maximum else {}
    low = hiding_value(given["other"], node) if isinstance(given.get("input"), fx.Node) else None
    return None if low is None else (given["input"], low)


def _unclamped(masks: list[MaskStep], low: float | None) -> str | None:
    """Why clamping the masked scores at ``low`` is not the identity: it is after one mask that is
    a constant finite tensor added (a score plus the lowest value rounds to it; -inf, or the
    lowest value added twice, would not)."""
    if low is None or low == float("-inf"):
        return None
    if len(masks) > 1:
        return f"the scores are clamped at the lowest value after {len(masks)} masks, whose sum may be -inf"
    for step in masks:
        made_of = None if step.fill is not None else constant_ancestors(step.tensor)
        if made_of is None or not evaluate_constant(made_of).isfinite().all():
            return f"the scores are clamped at the lowest value after a mask ({step.tensor.name}) that may hold -inf"
    return None


def _score_function(site: AttentionSite) -> _Scores | str:
    """The steps between the site's ``q @ kT`` and its softmax: a score function, then (after
    it, in order of application) tensors added or a mask filled in, a clamp at the lowest value
    that changes nothing, and a view unfolding the heads from the batch, anywhere; the softmax
    may read the scores folded back into the batch (XGLM)."""
    steps, masks, folded, low = [], [], False, None
    node = tensor_inputs(site.softmax)[0] if site.sinks is None else site.sinks.scores
    refolded = site.sinks is None and len(node.users) == 1 and unfolded_heads(node) is not None
    node = unfolded_heads(node) if refolded else node
    while True:
        if len(node.users) != 1:
            return f"{node.name} is read by more than the softmax"
        if node is site.scores:
            problem = _unclamped(masks, low) or (refolded and not folded and f"{site.softmax.name} reads the scores "
                                                 f"folded into the batch, which are not made so")
            return problem or _Scores(ScoreMod(tuple(reversed(steps))), masks[::-1], folded)
        if node.op not in ("call_function", "call_method"):
            return f"{node.name} is no step of a score function"
        if not folded and _unfolds_heads(node):
            node, folded = tensor_inputs(node)[0], True
            continue
        if not steps and not masks and low is None and (clamp := _clamped_at_lowest(node)) is not None:
            node, low = clamp
            continue
        masking = _mask_step(node, site.scores) if not steps else None
        if masking is not None:
            node, mask = masking
            masks.append(mask)
            continue
        found = _score_step(node)
        if found is None:
            return f"{node.name} ({op_kind(node) or node.target}) is no step of a score function"
        node, step = found
        if step is not None:
            steps.append(step)


def _weights_problem(site: AttentionSite) -> str | None:
    """Why the probabilities do not reach ``@ v`` as they are (a dropout that drops something, a
    view other than folding the heads into the batch)."""
    if site.softmax.target not in _SOFTMAX:
        return f"{site.softmax.name} is no softmax"
    node = next(iter(site.softmax.users))
    while node is not site.core:
        given = arguments(node)
        if (op_kind(node) == "view" and unfolded_heads(node) is None and not _unfolds_heads(node)) \
                or (op_kind(node) == "dropout" and given["p"] and given["training"]):
            return f"{node.name} ({op_kind(node)}) between the softmax and @ v"
        node = next(iter(node.users))
    return None


def _swaps_last_two(node: fx.Node) -> bool:
    """Whether ``node`` is ``x.transpose(-2, -1)`` of a 3-d or 4-d ``x``."""
    if op_kind(node) != "transpose" or tensor_val(node).dim() not in (3, 4):
        return False
    n = tensor_val(node).dim()
    dims = [d for name, d in arguments(node).items() if name in ("dim0", "dim1", "axis0", "axis1")]
    return sorted(d % n for d in dims) == [n - 2, n - 1]


def _operands(site: AttentionSite, folded: bool) -> tuple[fx.Node, fx.Node | None, fx.Node, fx.Node] | str:
    """``(query, key, kT, value)``, 4-d: where the heads are folded into the batch, the tensors
    they were folded from (``key`` then from below the transpose); ``key`` None where ``kT`` is
    no transpose of it."""
    query, key_t = tensor_inputs(site.scores)
    value = tensor_inputs(site.core)[1]
    key = tensor_inputs(key_t)[0] if _swaps_last_two(key_t) else None
    if not folded:
        return query, key, key_t, value
    unfolded = [None if n is None else unfolded_heads(n) for n in (query, key, value)]
    if None in unfolded:
        return f"{site.scores.name}: q, k and v with their heads folded into the batch are views of [batch, heads, ...]"
    return unfolded[0], unfolded[1], key_t, unfolded[2]


def _bias_and_masks(applied: list[MaskStep], q: torch.Tensor, k: torch.Tensor,
                    folded: bool) -> tuple[FoundBias | None, tuple[MaskStep, ...]] | str:
    """Of the masks applied to the scores, a position bias (one tensor added at most) and the
    rest, in order."""
    batch, heads, q_len, _ = q.shape
    biases, masks = [], []
    for step in applied:
        found = None if step.fill is not None else position_bias(step.tensor, heads, q_len, k.shape[-2],
                                                                 batch if folded else None)
        (masks if found is None else biases).append(step if found is None else found)
    if len(biases) > 1:
        return f"{applied[0].tensor.name}: more than one position bias is added to the scores"
    for step in masks:
        if _hides_rows_finitely(step):
            return (f"{step.tensor.name}: the scores are filled with the lowest finite value where it hides them, and "
                    f"it may hide a query row entirely (it is computed from an input or from a buffer with no values, "
                    f"as on the meta device, or it does): such a row attends to "
                    f"every key evenly and its scores get no gradient, which hybrid attention cannot reproduce")
        if step.tensor.meta["requires_grad"]:
            return f"{step.tensor.name}: a mask that needs a gradient (a learned bias)"
        if folded and tensor_val(step.tensor).dim() == 3 and tensor_val(step.tensor).shape[0] > 1:
            return f"{step.tensor.name}: a mask of the heads folded into the batch"
    return (biases or [None])[0], tuple(masks)


def _hides_rows_finitely(step: MaskStep) -> bool:
    """Whether ``step`` fills the scores with the lowest finite value (not -inf) by a condition
    that may hide a query row entirely: one computed from an input, or a constant one that does.
    On one device such a row scores the same at every key and attends to them evenly, and its
    scores get no gradient through the fill; the kernels lose its log-sum-exp below the lowest
    value, and an additive mask would pass the gradient on."""
    if step.fill is None or step.fill == float("-inf"):
        return False
    made_of = constant_ancestors(step.tensor)
    if made_of is None:
        return True
    condition = evaluate_constant(made_of)
    hidden = condition if step.hides else ~condition
    return bool(hidden.all(-1).any())


def read_written_attention(site: AttentionSite) -> WrittenAttention | str:
    """The site as hybrid attention's arguments, or why it cannot run as one (naming the node)."""
    found = _weights_problem(site) or _score_function(site)
    if isinstance(found, str):
        return found
    operands = _operands(site, found.folded)
    if isinstance(operands, str):
        return operands
    query, key, key_t, value = operands
    q, v, out = (tensor_val(n) for n in (query, value, site.core))
    k_t = tensor_val(key_t) if key is None else tensor_val(key).transpose(-2, -1)
    if any(t.dim() != 4 for t in (q, k_t, v)) or len({t.dtype for t in (q, k_t, v, out)}) != 1 \
            or (*k_t.shape[:2], k_t.shape[3]) != tuple(v.shape[:3]):
        return (f"{site.scores.name}: [batch, heads, seq, head_dim] q, k and v of one dtype are needed, k and v of "
                f"one batch, heads and seq; got q {list(q.shape)} {q.dtype}, kT {list(k_t.shape)}, v {list(v.shape)} "
                f"{v.dtype}")
    read = _bias_and_masks(found.masks, q, k_t.transpose(-2, -1), found.folded)
    if isinstance(read, str):
        return read
    bias, masks = read
    if site.sinks is not None and found.folded:
        return f"{site.sinks.per_head.name}: sink logits beside heads folded into the batch"
    sinks = None if site.sinks is None else site.sinks.per_head
    return WrittenAttention(query, key, key_t, value, found.score_mod, masks, bias, sinks)


def written_attention(site: AttentionSite) -> WrittenAttention | str:
    """``read_written_attention``, its bias's sizes evaluated at one length."""
    with guards_at(f"at {site.scores.name} (a bias built from positions, evaluated at one length)"):
        return read_written_attention(site)


def as_sdpa_arguments(gm: fx.GraphModule, site: AttentionSite, found: WrittenAttention) -> dict:
    """The attention as SDPA's arguments, its score function aside (``scale`` 1: the score
    function scales): ``kT`` transposed back where no key is read, the masks as one
    (``_sdpa_mask``), by nodes inserted before the site's core."""
    key = found.key
    with gm.graph.inserting_before(site.core):
        if key is None:
            key = with_val(gm.graph.call_method("transpose", (found.key_t, -2, -1)),
                           tensor_val(found.key_t).transpose(-2, -1))
        mask = _sdpa_mask(gm.graph, found.masks, tensor_val(found.query).dtype)
    return {"query": found.query, "key": key, "value": found.value, "attn_mask": mask, "dropout_p": 0.0,
            "is_causal": False, "scale": 1.0, "enable_gqa": False}


def _sdpa_mask(graph: fx.Graph, masks: tuple[MaskStep, ...], dtype: torch.dtype) -> fx.Node | None:
    """One SDPA mask that masks the scores as ``masks`` applied in order do. A lone tensor added
    is that tensor; a lone fill with -inf, its condition as a boolean mask (True = attend). Any
    other masks are applied to zero scores, an additive mask: a fill with the lowest finite value
    stays that value, so a query row it hides entirely scores the same at every key and attends to
    them evenly, as on one device (a boolean mask would attend to none); ``s + fill`` is ``fill``
    for any score far below the dtype's largest."""
    def call(fn, args, value, kwargs=None):
        return with_val(graph.call_function(fn, args, kwargs or {}), value)

    if len(masks) == 1 and (masks[0].fill is None or masks[0].fill == float("-inf")):
        step = masks[0]
        return call(torch.logical_not, (step.tensor,), ~tensor_val(step.tensor)) if step.hides else step.tensor
    mask = None
    for step in masks:
        given = tensor_val(step.tensor)
        if step.fill is None:
            mask = step.tensor if mask is None else call(operator.add, (mask, step.tensor), tensor_val(mask) + given)
            continue
        if mask is None:
            mask = call(torch.zeros_like, (step.tensor,), torch.zeros_like(given, dtype=dtype), {"dtype": dtype})
        kept, filled = (step.fill, mask) if step.hides else (mask, step.fill)
        shape = torch.broadcast_shapes(given.shape, tensor_val(mask).shape)
        mask = call(torch.where, (step.tensor, kept, filled), given.new_empty(shape, dtype=dtype))
    return mask


def bias_kwargs(gm: fx.GraphModule, site: AttentionSite, bias: FoundBias | None, query: fx.Node) -> dict:
    """``{"position_bias": ..., "bias_table": ...}`` for hybrid or cached attention, which
    evaluate the bias from positions; a constant table (ALiBi's slopes) made in the graph,
    before the site's core. ``{}`` without a bias."""
    if bias is None:
        return {}
    table = bias.table
    if not isinstance(table, fx.Node):
        with gm.graph.inserting_before(site.core):
            node = gm.graph.call_function(torch.tensor, (table.tolist(),),
                                          {"dtype": table.dtype, "device": tensor_val(query).device})
        table = with_val(node, tensor_val(query).new_empty(table.shape, dtype=table.dtype))
    logger.info("%s (%s): its scores' bias is %s, evaluated from positions", site.name, site.core.name, bias.form.kind)
    return {"position_bias": bias.form, "bias_table": table}


def sinks_per_head(gm: fx.GraphModule, site: AttentionSite, sinks: fx.Node | None) -> dict:
    """``{"sinks": ...}``, the ``[1, heads, 1, 1]`` sink logits as one a head (a node inserted
    before the site's core), for hybrid or cached attention; ``{}`` without."""
    if sinks is None:
        return {}
    with gm.graph.inserting_before(site.core):
        return {"sinks": with_val(gm.graph.call_method("reshape", (sinks, -1)), tensor_val(sinks).reshape(-1))}
