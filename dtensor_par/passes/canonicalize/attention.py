"""Rewrites of attention into the form detect reads: ``nn.MultiheadAttention`` written out, kv
heads repeated to the query heads read as grouped ones, a softmax's max shift dropped, sinks
applied after attention as a scale read as sink logits."""

from __future__ import annotations

import operator
from typing import NamedTuple

import torch
import torch.fx as fx
import torch.nn.functional as F

from ...symbolic import is_symbolic, same_size
from ..context import ParallelContext
from ..detect.attention import weighted_values
from ..edits import emitted, erase_unused, with_val
from ..nodes import arguments, tensor_inputs, tensor_val, value_from_inputs
from ..rules.registry import op_kind
from .registry import calls, functions, of_kind, rewrite


_FUSED_FAST_PATHS = {torch._transformer_encoder_layer_fwd: "nn.TransformerEncoderLayer",
                     torch._native_multi_head_attention: "nn.MultiheadAttention"}


def _unsupported_mha(node: fx.Node, given: dict) -> str | None:
    """Why a ``multi_head_attention_forward`` call is kept as one op, or None."""
    if any(given[name] is not None for name in ("bias_k", "bias_v", "static_k", "static_v")) or given["add_zero_attn"]:
        return "bias_k, bias_v, add_zero_attn or static keys"
    if any(u.target is operator.getitem and u.args[1] == 1 and u.users for u in node.users):
        return "its attention weights read (need_weights=True)"
    masks = [given[name] for name in ("attn_mask", "key_padding_mask") if given[name] is not None]
    if any(tensor_val(m).dim() != 2 for m in masks[1:]) or any(tensor_val(m).dim() not in (2, 3) for m in masks[:1]):
        return "a mask of another shape than [L, S] or [B * heads, L, S] and a key padding [B, S]"
    return None


def _additive(graph: fx.Graph, mask: fx.Node, dtype: torch.dtype) -> fx.Node:
    """A boolean mask (True: not attended) as the float one ``multi_head_attention_forward`` adds."""
    if tensor_val(mask).dtype != torch.bool:
        return mask
    zeros = emitted(graph, torch.zeros_like, mask, dtype=dtype)
    return emitted(graph, torch.masked_fill, zeros, mask, float("-inf"))


@rewrite(50, functions(F.multi_head_attention_forward))
def mha_as_attention(gm: fx.GraphModule, node: fx.Node, ctx: ParallelContext) -> None:
    """``F.multi_head_attention_forward`` (``nn.MultiheadAttention``, ``nn.TransformerEncoderLayer``
    in training) written out: q, k, v projections (one fused linear, chunked, for
    self-attention), heads viewed, SDPA with its masks made additive as it adds them, the out
    projection. Each is then found and sharded as any attention's; left as one op, nothing of it
    runs parallel, and a warning names it."""
    given = arguments(node)
    problem = _unsupported_mha(node, given)
    if problem is not None:
        ctx.warn(f"{node.name}: nn.MultiheadAttention with {problem} runs as one op, whole on every rank")
        return
    graph, (length, batch, embed), heads = gm.graph, tensor_val(given["query"]).shape, given["num_heads"]
    with graph.inserting_before(node):
        if not given["use_separate_proj_weight"] and given["query"] is given["key"] is given["value"]:
            qkv = emitted(graph, torch.chunk, emitted(graph, F.linear, given["query"], given["in_proj_weight"],
                                                  given["in_proj_bias"]), 3, -1)
            q, k, v = (emitted(graph, operator.getitem, qkv, i) for i in range(3))
        else:
            q, k, v = _mha_projections(graph, given)
        q, k, v = (emitted(graph, torch.permute, emitted(graph, torch.reshape, x, (tensor_val(x).shape[0], batch, heads, -1)),
                         (1, 2, 0, 3)) for x in (q, k, v))
        mask = _mha_mask(graph, given, batch, heads, tensor_val(q).dtype)
        causal = given["is_causal"] and given["key_padding_mask"] is None
        out = emitted(graph, F.scaled_dot_product_attention, q, k, v, attn_mask=None if causal else mask,
                    dropout_p=given["dropout_p"] if given["training"] else 0.0, is_causal=causal)
        out = emitted(graph, torch.reshape, emitted(graph, torch.permute, out, (2, 0, 1, 3)), (length, batch, embed))
        out = emitted(graph, F.linear, out, given["out_proj_weight"], given["out_proj_bias"])
    for user in list(node.users):
        if user.args[1] == 0:
            user.replace_all_uses_with(out)
        graph.erase_node(user)
    graph.erase_node(node)


def _mha_projections(graph: fx.Graph, given: dict) -> list[fx.Node]:
    """q, k and v projected apart: by weights of their own (``kdim``, ``vdim``), or by the thirds
    of one packed ``in_proj_weight`` (cross-attention: SigLIP's pooling probe over its patches)."""
    def thirds(packed: fx.Node | None) -> list:
        pieces = emitted(graph, torch.chunk, packed, 3) if packed is not None else None
        return [emitted(graph, operator.getitem, pieces, i) if pieces is not None else None for i in range(3)]
    weights = ([given[f"{p}_proj_weight"] for p in "qkv"] if given["use_separate_proj_weight"]
               else thirds(given["in_proj_weight"]))
    return [emitted(graph, F.linear, given[x], w, b)
            for x, w, b in zip(("query", "key", "value"), weights, thirds(given["in_proj_bias"]))]


def _mha_mask(graph: fx.Graph, given: dict, batch: int, heads: int, dtype: torch.dtype) -> fx.Node | None:
    """The float mask SDPA adds: the attention mask (``[L, S]``, or ``[B * heads, L, S]`` viewed
    per batch and head) plus the key padding (``[B, S]`` viewed ``[B, 1, 1, S]``)."""
    mask, padding = given["attn_mask"], given["key_padding_mask"]
    if mask is not None:
        mask = _additive(graph, mask, dtype)
        if tensor_val(mask).dim() == 3:
            mask = emitted(graph, torch.reshape, mask, (batch, heads) + tuple(tensor_val(mask).shape[1:]))
    if padding is not None:
        padding = emitted(graph, torch.reshape, _additive(graph, padding, dtype), (batch, 1, 1, -1))
        mask = padding if mask is None else emitted(graph, operator.add, mask, padding)
    return mask


@rewrite(60, functions(*_FUSED_FAST_PATHS))
def fused_fast_path_kept(gm: fx.GraphModule, node: fx.Node, ctx: ParallelContext) -> None:
    """``nn.TransformerEncoderLayer``'s and ``nn.MultiheadAttention``'s fused fast path (eval, no
    grad) is one op no rule knows, which runs whole on every rank: kept, and a warning says how
    to have it written out (``mha_as_attention``)."""
    ctx.warn(f"{node.name}: {_FUSED_FAST_PATHS[node.target]}'s fused fast path (eval, no grad) is one op and runs "
             f"whole on every rank; call torch.backends.mha.set_fastpath_enabled(False) before compiling, and "
             f"its attention and MLP are written out and parallelized")


def _with_new_dim_after_heads(node: fx.Node) -> fx.Node | None:
    """``x`` when ``node`` is a 4-d ``x`` with a size-1 dim inserted after its heads
    (``x[:, :, None]``, ``x.unsqueeze(2)``): a reshape (any view kind) or an index of only
    ``None``, ``:`` and ``...``, so every element stays where it was."""
    if not isinstance(node, fx.Node) or op_kind(node) not in ("getitem", "view"):
        return None
    given = arguments(node)
    if op_kind(node) == "getitem":
        index = given["index"] if isinstance(given["index"], tuple) else (given["index"],)
        if not all(i is None or i is Ellipsis or i == slice(None) for i in index):
            return None
    x, out = tensor_val(given["input"]), tensor_val(node)
    if x is None or out is None or x.dim() != 4 or not same_size(tuple(out.shape), (*x.shape[:2], 1, *x.shape[2:])):
        return None
    return given["input"]


def _repeated_heads(node) -> tuple[fx.Node, int] | None:
    """``(x, rep)`` when ``node`` is the 4-d ``x`` with each head (dim -3) repeated ``rep``
    times in a row, as ``enable_gqa`` reads them: ``x.repeat_interleave(rep, dim=1)``, or
    ``x[:, :, None].expand(b, kv, rep, s, d)`` reshaped to ``(b, kv * rep, s, d)``.

    Any reshape of ``(b, kv, rep, s, d)`` to ``(b, kv * rep, s, d)`` merges exactly
    ``(kv, rep)``, so the shapes decide. Heads or a factor in symbols are left alone.
    """
    if not isinstance(node, fx.Node) or tensor_val(node) is None:
        return None
    if node.op in ("call_function", "call_method") and node.target in (torch.repeat_interleave, "repeat_interleave"):
        given = arguments(node)
        x, rep, dim = (given[name] for name in ("input", "repeats", "dim"))
        if not isinstance(x, fx.Node) or not isinstance(rep, int) or dim not in (1, -3):
            return None
    elif op_kind(node) == "view" and op_kind(expand := arguments(node)["input"]) == "expand":
        expanded = tensor_val(expand)
        x = _with_new_dim_after_heads(arguments(expand)["input"])
        if x is None or expanded is None:
            return None
        rep, source = expanded.shape[2], tensor_val(x).shape
        if not same_size(tuple(expanded.shape), (*source[:2], rep, *source[2:])):
            return None
    else:
        return None
    source = tensor_val(x)
    if source is None or source.dim() != 4 or is_symbolic(source.shape[1]) or is_symbolic(rep) or rep < 1:
        return None
    b, heads, s, d = source.shape
    return (x, int(rep)) if same_size(tuple(tensor_val(node).shape), (b, heads * rep, s, d)) else None


@rewrite(140, of_kind("sdpa"), when=lambda _, ctx: ctx.mesh.size("cp") > 1)
def grouped_kv_attention(gm: fx.GraphModule, sdpa_node: fx.Node, ctx: ParallelContext) -> None:
    """With context parallelism, give an attention call that reads kv heads repeated to its query
    heads (transformers' ``repeat_kv``: ``k[:, :, None].expand(b, kv, rep, s, d).reshape(b, kv *
    rep, s, d)``, or ``k.repeat_interleave(rep, dim=1)``) the kv heads themselves and
    ``enable_gqa=True``, which reads query head i against kv head i // rep: the same result, and
    Ulysses and the ring then send each kv head once, not ``rep`` times (hybrid attention repeats
    them after the exchange, for the kernels). The repeats go when nothing else reads them. Left
    as it is when ``enable_gqa`` is set already, or key and value are not both repeats by the
    same factor of the query heads. Without cp nothing would be saved, and CUDA's SDPA takes
    grouped kv only in its flash kernel (half precision, no mask)."""
    sdpa = arguments(sdpa_node)
    query = tensor_val(sdpa["query"])
    if sdpa["enable_gqa"] or query is None or query.dim() != 4:
        return
    key, value = _repeated_heads(sdpa["key"]), _repeated_heads(sdpa["value"])
    if key is None or value is None or key[1] != value[1] or key[1] == 1 \
            or not same_size(query.shape[-3], tensor_val(key[0]).shape[-3] * key[1]):
        return
    repeats = (sdpa["key"], sdpa["value"])
    sdpa["key"], sdpa["value"], sdpa["enable_gqa"] = key[0], value[0], True
    sdpa_node.args, sdpa_node.kwargs = (sdpa.pop("query"), sdpa.pop("key"), sdpa.pop("value")), sdpa
    for repeat in dict.fromkeys(repeats):
        erase_unused(gm, repeat)


def _is_row_max(node: fx.Node, x: fx.Node, dim: int) -> bool:
    """Whether ``node`` is the max of ``x`` along ``dim``, the dim kept: ``x.amax(dim, keepdim=True)``
    or ``x.max(dim, keepdim=True)[0]``."""
    if op_kind(node) == "getitem" and arguments(node)["index"] == 0:
        node = arguments(node)["input"]
        if node.target not in (torch.max, "max"):
            return False
    elif node.target not in (torch.amax, "amax"):
        return False
    given = arguments(node)
    dims = given.get("dim")
    dims = dims if isinstance(dims, (tuple, list)) else [dims]
    ndim = tensor_val(x).dim()
    return given["input"] is x and given.get("keepdim") is True and [d % ndim for d in dims] == [dim]


@rewrite(150, of_kind("softmax"))
def softmax_of_unshifted(gm: fx.GraphModule, softmax: fx.Node, ctx: ParallelContext) -> None:
    """A softmax of its input less the input's max along the softmax's dim (GPT-OSS's
    ``logits - logits.max(-1, keepdim=True).values``) becomes the softmax of the input: a softmax
    subtracts its rows' max itself, and the result is the same. What it reads is then the scores
    themselves, which attention written out by hand is read from."""
    shifted = arguments(softmax)["input"]
    if op_kind(shifted) != "sub" or len(shifted.users) != 1 or arguments(shifted).get("alpha", 1) != 1:
        return
    x, row_max, dim = arguments(shifted)["input"], arguments(shifted)["other"], arguments(softmax)["dim"]
    if isinstance(x, fx.Node) and isinstance(row_max, fx.Node) and isinstance(dim, int) \
            and _is_row_max(row_max, x, dim % tensor_val(softmax).dim()):
        softmax.replace_input_with(shifted, x)
        erase_unused(gm, shifted)


class _SinkScale(NamedTuple):
    """Granite-SWA's sinks, a logit per head applied after attention: ``out * sigmoid(lse - sink)``."""

    softmax: fx.Node  # over the scores the log-sum-exp reads
    sink: fx.Node  # a number per head
    scaled: fx.Node  # the output times the scale
    output: fx.Node  # the probabilities times the values


def _sink_scale(lse: fx.Node) -> _SinkScale | None:
    """The sink scale made of ``lse``, a log-sum-exp over the last dim of ``[batch, heads, seq,
    keys]`` scores that a softmax reads too: ``lse - sink`` through casts and views, a sigmoid,
    then multiplying the softmax's ``@ v`` (``detect.attention.weighted_values``)."""
    given = arguments(lse)
    scores = given["input"]
    dims = given["dim"] if isinstance(given["dim"], (list, tuple)) else [given["dim"]]
    if tensor_val(scores).dim() != 4 or [d % 4 for d in dims] != [3] or given.get("keepdim", False):
        return None
    softmaxes = [u for u in scores.users if op_kind(u) == "softmax" and arguments(u).get("dim") in (-1, 3)]
    output = weighted_values(softmaxes[0], None) if len(softmaxes) == 1 else None
    node, sink, sigmoid = lse, None, False
    while output is not None and len(node.users) == 1:
        user = next(iter(node.users))
        if op_kind(user) == "sub" and arguments(user)["input"] is node and sink is None:
            sink = arguments(user)["other"]
        elif user.target in (torch.sigmoid, F.sigmoid, "sigmoid") and not sigmoid:
            sigmoid = True
        elif op_kind(user) == "mul" and sigmoid and set(tensor_inputs(user)) == {node, output}:
            heads = tensor_val(scores).shape[1]
            if isinstance(sink, fx.Node) and tensor_val(sink).numel() == heads and tensor_val(sink).dim() <= 3:
                return _SinkScale(softmaxes[0], sink, user, output)
            return None
        elif op_kind(user) not in ("cast", "unsqueeze", "view"):
            return None
        node = user
    return None


@rewrite(160, calls(torch.logsumexp, "logsumexp"))
def sink_scale_as_sink_logits(gm: fx.GraphModule, lse: fx.Node, ctx: ParallelContext) -> None:
    """``(softmax(s) @ v) * sigmoid(logsumexp(s) - sink)`` (Granite-SWA's sinks) becomes GPT-OSS's
    ``softmax(cat([s, sink], -1))[..., :-1] @ v``: the same probabilities, the sink one more
    logit in the softmax's denominator, which detect reads as attention with sink logits."""
    found = _sink_scale(lse)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    if found is None or order[found.sink] > order[found.softmax]:
        return
    scores = arguments(lse)["input"]
    batch, heads, rows, _ = tensor_val(scores).shape
    graph = gm.graph
    with graph.inserting_before(found.softmax):
        per_head = emitted(graph, torch.reshape, found.sink, (1, heads, 1, 1))
        column = emitted(graph, torch.broadcast_to, per_head, (batch, heads, rows, 1))
        logits = emitted(graph, torch.cat, [scores, column], -1)
        softmax = graph.node_copy(found.softmax, lambda n: logits if n is scores else n)
        with_val(softmax, value_from_inputs(softmax))
        dropped = emitted(graph, operator.getitem, softmax, (Ellipsis, slice(None, -1)))
    found.softmax.replace_all_uses_with(dropped)
    found.scaled.replace_all_uses_with(found.output)
    graph.erase_node(found.softmax)
    erase_unused(gm, found.scaled)
