"""canonicalize: rewrite equivalent spellings of one computation into the one the rules know.

- A call given a tensor by keyword gets the arguments its op's schema takes by position
  too at their positions (``passes.nodes.keywords_as_positions``): the rules read a call's
  tensors in its schema's order, whatever order its keywords came in
  (``torch.matmul(other=b, input=a)``).
- A ``Conv1D`` linear (GPT-2: ``addmm(bias, x.view(-1, k), weight).view(*lead, n)`` with the
  weight stored ``[in, out]``) becomes ``linear(x, weight.t(), bias)``: the batch and
  sequence dims are never flattened together, so a sequence sharded over cp stays sharded,
  and the projection is found and sharded like any other (its weight transposed).
- A product with a parameter's ``.T`` (Falcon's ``FalconLinear``: ``x @ self.weight.T``)
  becomes ``linear(x, weight)``, and a parameter's product with a tensor whose features are its
  rows (Mamba's ``dt_proj.weight @ x``) ``linear(x.mT, weight).mT``: found and sharded as any
  projection.
- Any other ``addmm``/``baddbmm`` (function or method) becomes
  ``beta * input + alpha * (a @ b)``: a matmul and an add, which have rules.
- ``x.narrow(dim, start, length)`` becomes the slice ``x[..., start:start + length, ...]``, so
  a fused projection cut by ``narrow`` is cut part by part as by indexing.
- ``torch.outer(a, b)`` becomes ``a.unsqueeze(-1) * b`` (Flux.2's rotary frequencies: positions
  times inverse frequencies), which the pointwise rule places: cut positions stay cut.
- ``F.multi_head_attention_forward`` (``nn.MultiheadAttention``, ``nn.TransformerEncoderLayer`` in
  training) becomes its q, k, v projections, heads, SDPA and out projection, which detect reads
  as any attention (``mha_as_attention``); a form it does not write out stays one op, warned of.
- A 1-d convolution padded alike at both ends and cropped to its input's length (a causal one:
  transformers' ``causal_conv1d_fn``, ``conv1d(x, padding=k - 1)[..., :L]``, Mamba's, LFM2's short
  convolution, the gated delta rule's) becomes ``ops.halo.padded_conv1d(x, pad=(p, k - 1 - p))``:
  the same rows, each reading the rows it read; the convolution and its crop apart give more rows
  than the sequence has, which cp could not lay out, where this one gives back its input's length
  and reads ``p`` rows before each run, a halo (``rules.matmul.reach_of``).
- A chain of reshapes (``view``, ``squeeze``, ``unsqueeze``...) that gives back its source's shape
  is its source: the same elements in the same order (transformers' causal convolution reads its
  weight as ``w.squeeze(1)``, then ``.unsqueeze(1)``), so the parameter is read as the weight.
- Rows flattened for ops that work row by row and viewed back (Qwen3-Next's gated norm:
  ``a.reshape(-1, d)``, a norm over ``d`` gated by ``silu(z.reshape(-1, d))``, then
  ``.reshape(b, s, -1)``) run on the rows unflattened, ``[*lead, d]``: the same values per row, and
  the views back read the same elements in the same order. Flattened, the rows of a sequence cut
  over cp and heads cut over tp would be cut part by part over both at once, which no
  redistribution lays out (gathered).
- The ops of a linear recurrence over the sequence, traced from inside the module transformers
  wraps it in (``torch_chunk_gated_delta_rule``: Qwen3-Next's, Qwen3.5's, OLMo-hybrid's linear
  attention; a decode step's, by rows; ``ops.recurrence.RECURRENCES``), become one call of the
  model's own function (``ops.recurrence.linear_recurrence``): its rules run it on each rank's
  heads over tp and on each rank's rows over cp, where its ops one by one would have gathered
  the sequence.
- ``torch.tensor_split`` becomes ``torch.split`` into the sizes of its pieces (Qwen3-Next's
  gated delta rule cuts its padded sequence so), which the split rule places.
- A fused projection split after views of its features (Falcon-7B's multi-query
  ``qkv.view(b, s, heads + 2, d).split([heads, 1, 1], dim=2)``, GPTBigCode's
  ``qkv.unsqueeze(1).split([h, d, d], dim=3)``) becomes the split of its features, each part
  then viewed as its piece was: the same elements, since views keep their order, and the
  projection is read as fused parts (q, k, v) whose heads the views of each part tell.
- A tensor made empty and then filled slice by slice along one dim (DeepSeek's multi-head
  latent attention: ``k = kv.new_empty(...); k[..., :d].copy_(k_nope); k[..., d:].copy_(k_rot)``)
  becomes the ``torch.cat`` of its pieces: out of place, so each piece keeps its placement
  and the rules shard the concatenation (a write into a gathered copy would be lost).
- A slice along one dim written with a new value (CogView4's rotary embedding of the image
  part of a joint sequence: ``q[:, :, text:] = rope(q[:, :, text:])``) becomes the ``cat`` of the
  untouched slices and the value, read in place of the tensor by every later reader, where no
  other view of it is read after the write: out of place, each slice of a sequence cut part by
  part over cp stays local.
- A tensor a factory just made (zeros), written whole by ``copy_`` before anything reads it (a
  linear attention cache's conv and recurrent states) becomes the value written, read by every
  later reader: out of place, it keeps the value's placement (before: a cut value written into
  a replicated buffer was refused).
- A product's fresh output added to in place before anything reads it (transformers' grouped
  linear with biases, GPT-OSS's experts: ``out.add_(bias[expert_ids])``) becomes ``out + bias``,
  read by every later reader: the rules place it as any add, and detect reads the bias.
- With context parallelism, attention on key/value heads repeated to the query heads
  (transformers' ``repeat_kv``: ``k[:, :, None].expand(b, kv, rep, s, d).reshape(b, kv * rep,
  s, d)``, or ``k.repeat_interleave(rep, dim=1)``) becomes attention on the kv heads with
  ``enable_gqa=True``, which reads query head i against kv head i // rep: the same result,
  and Ulysses and the ring then send each kv head once, not ``rep`` times (hybrid attention
  repeats them after the exchange, for the kernels). Without cp nothing would be saved, and
  CUDA's SDPA takes grouped kv only in its flash kernel (half precision, no mask).
- Experts read a row at a time (transformers' ``batched_mm``: ``W[expert_ids]`` then ``bmm`` with
  each row, an up (and gate) product, per-row ops, a down product) become the grouped chain the
  planner knows (transformers' ``grouped_mm`` one): the ids sorted (stable), the tokens' rows
  gathered in that order, ``histc`` counts, their running sum as offsets, a grouped matmul for each
  product (``ops.grouped``) and the rows put back by ``argsort`` of the order. Each row's dot
  products are the same; detect, the tp plan and expert parallelism then apply unchanged, and no
  ``[S, out, in]`` copy of the weights is made.
- A softmax of its input less the input's max along the softmax's dim (GPT-OSS's
  ``logits - logits.max(-1, keepdim=True).values``) becomes the softmax of the input: a
  softmax subtracts its rows' max itself, and the result is the same. What it reads is then
  the scores themselves, which attention written out by hand is read from.
- Sink logits applied after attention as a scale (Granite-SWA's ``out * sigmoid(lse - sink)``,
  ``lse`` the scores' log-sum-exp) become GPT-OSS's ``softmax(cat([scores, sink], -1))[..., :-1]
  @ v``: the same probabilities, which detect reads as attention with sink logits.
"""

from __future__ import annotations

import math
import operator
import re
from functools import partial
from typing import NamedTuple

import torch
import torch.fx as fx
import torch.nn.functional as F

from ..ops.grouped import GROUPED_MM
from ..ops.halo import padded_conv1d
from ..ops.recurrence import (RECURRENCES, GatedDeltaRule, SelectiveScan, StateSpaceScan, kind_of, linear_recurrence,
                              recurrence)
from ..symbolic import is_symbolic, same_size
from .capture import emitted, erase_unused, with_val
from .context import ParallelContext, at_node
from .detect import is_topk, weighted_values
from .nodes import (arguments, is_vmap_level, keywords_as_positions, tensor_inputs, tensor_val, value_from_inputs,
                    writes_in_place)
from .rules.indexing import split_dim
from .rules.registry import kinds_in, op_kind


def _flattened_source(view: fx.Node) -> fx.Node | None:
    """``x`` when ``view`` is ``x.view(-1, k)`` merging every leading dim of ``x``."""
    if op_kind(view) != "view":
        return None
    source = arguments(view)["input"]
    x, out = tensor_val(source), tensor_val(view)
    if x is None or out is None or out.dim() != 2 or x.dim() < 3 or out.shape[1] != x.shape[-1]:
        return None
    return source


def conv1d_linear(gm: fx.GraphModule, addmm: fx.Node) -> bool:
    """Rewrite one ``addmm`` of the Conv1D form; False when it is not one."""
    given = arguments(addmm)
    if given["beta"] != 1 or given["alpha"] != 1:
        return False  # scaled: not a plain linear
    bias, flat, weight = given["input"], given["mat1"], given["mat2"]
    x = _flattened_source(flat)
    users = list(addmm.users)
    if x is None or len(users) != 1 or op_kind(users[0]) != "view":
        return False
    unflatten = users[0]
    if tuple(tensor_val(unflatten).shape) != tuple(tensor_val(x).shape[:-1]) + (tensor_val(addmm).shape[-1],):
        return False
    graph = gm.graph
    with graph.inserting_before(addmm):
        transposed = with_val(graph.call_method("t", (weight,)), tensor_val(weight).t())
        linear = graph.call_function(F.linear, (x, transposed, bias))
    with_val(linear, tensor_val(unflatten))
    unflatten.replace_all_uses_with(linear)
    for node in (unflatten, addmm):
        graph.erase_node(node)
    if not flat.users:
        graph.erase_node(flat)
    return True


def _transposed_parameter(node, ctx: ParallelContext) -> fx.Node | None:
    """``W`` when ``node`` is ``W.T`` of a 2-d parameter (as Dynamo records it: ``getattr(W, "T")``;
    from torch 2.14, ``torch.ops.aten.numpy_T(W)``)."""
    if not (isinstance(node, fx.Node) and node.op == "call_function"
            and (node.target is getattr and node.args[1] == "T" or node.target is torch.ops.aten.numpy_T)):
        return None
    weight = node.args[0]
    return weight if isinstance(weight, fx.Node) and weight.name in ctx.params and tensor_val(weight).dim() == 2 \
        else None


def parameter_product_as_linear(gm: fx.GraphModule, matmul: fx.Node, ctx: ParallelContext) -> None:
    """Rewrite ``x @ W.T`` of a 2-d parameter ``W`` into ``linear(x, W)``, and ``W @ x`` (Mamba's
    ``dt_proj.weight @ x``, x's features at dim -2) into ``linear(x.mT, W).mT``; anything else
    (``x @ W.t()`` too) stays the matmul it is."""
    given = arguments(matmul)
    left, right = given["input"], given["other"]
    transposed = _transposed_parameter(right, ctx)
    on_the_left = transposed is None and isinstance(left, fx.Node) and left.name in ctx.params \
        and tensor_val(left).dim() == 2
    x = right if on_the_left else left
    if not (transposed is not None or on_the_left) or tensor_val(x).dim() < 2:
        return
    with gm.graph.inserting_before(matmul):
        if on_the_left:
            rows = emitted(gm.graph, torch.transpose, x, -1, -2)
            linear = emitted(gm.graph, torch.transpose, emitted(gm.graph, F.linear, rows, left), -1, -2)
        else:
            linear = with_val(gm.graph.call_function(F.linear, (x, transposed)), tensor_val(matmul))
    matmul.replace_all_uses_with(linear)
    gm.graph.erase_node(matmul)
    if transposed is not None:
        erase_unused(gm, right)


_ADD_PRODUCT = {torch.addmm, torch.baddbmm, "addmm", "baddbmm"}
_FACTORS = {"addmm": ("mat1", "mat2"), "baddbmm": ("batch1", "batch2")}  # by the op's name


def add_product_as_matmul(gm: fx.GraphModule, node: fx.Node) -> None:
    """Rewrite ``addmm(input, a, b, beta=, alpha=)`` (or ``baddbmm``) into a matmul and an add."""
    given = arguments(node)
    a, b = (given[name] for name in _FACTORS[getattr(node.target, "__name__", node.target)])
    x, beta, alpha = given["input"], given["beta"], given["alpha"]
    graph = gm.graph
    with graph.inserting_before(node):
        product = emitted(graph, torch.matmul, a, b)
        if alpha != 1:
            product = emitted(graph, operator.mul, product, alpha)
        if beta != 0:
            scaled = x if beta == 1 else emitted(graph, operator.mul, x, beta)
            product = emitted(graph, operator.add, scaled, product)
    node.replace_all_uses_with(product)
    graph.erase_node(node)


def narrow_as_slice(gm: fx.GraphModule, node: fx.Node) -> None:
    given = arguments(node)
    x, dim, start, length = (given[name] for name in ("input", "dim", "start", "length"))
    if not all(isinstance(v, int) for v in (dim, start, length)):
        return  # bounds computed in the graph: left to the fallback
    dim = dim % tensor_val(x).dim()
    index = (slice(None),) * dim + (slice(start, start + length),)
    with gm.graph.inserting_before(node):
        sliced = with_val(gm.graph.call_function(operator.getitem, (x, index)), tensor_val(node))
    node.replace_all_uses_with(sliced)
    gm.graph.erase_node(node)


def outer_as_product(gm: fx.GraphModule, node: fx.Node) -> None:
    """``torch.outer(a, b)`` (``ger``): ``a.unsqueeze(-1) * b``, the same products, which the
    pointwise rule places."""
    given = arguments(node)
    with gm.graph.inserting_before(node):
        product = emitted(gm.graph, operator.mul, emitted(gm.graph, torch.unsqueeze, given["input"], -1), given["vec2"])
    node.replace_all_uses_with(product)
    gm.graph.erase_node(node)


def tensor_split_as_split(gm: fx.GraphModule, node: fx.Node) -> None:
    """``torch.tensor_split`` (at indices, or into a number of sections) becomes ``torch.split``
    into the sizes its pieces have (symbolic ones too: Mamba's scan cut at the rows before a
    cache's), which the split rule places."""
    given = arguments(node)
    dim = given.get("dim", 0) % tensor_val(given["input"]).dim()
    sizes = [piece.shape[dim] for piece in node.meta["val"]]
    with gm.graph.inserting_before(node):
        split = with_val(gm.graph.call_function(torch.split, (given["input"], sizes, dim)), node.meta["val"])
    node.replace_all_uses_with(split)
    gm.graph.erase_node(node)


def reshaped_back(gm: fx.GraphModule, node: fx.Node) -> None:
    """A chain of reshapes ending at ``node`` that gives back its source's shape: ``node``'s
    readers read the source (the module docstring says why); not where one writes in place,
    for a reshape may have copied."""
    source = node
    while op_kind(source) == "view":
        source = tensor_inputs(source)[0]
    if source is node or any(writes_in_place(u) for u in node.users) \
            or not same_size(tensor_val(source).shape, tensor_val(node).shape):
        return
    node.replace_all_uses_with(source)
    erase_unused(gm, node)


def _rows_flattened(view: fx.Node) -> tuple[fx.Node, tuple[int, ...]] | None:
    """``(x, lead)`` when ``view`` makes ``[prod(lead), d]`` rows of ``x``, whose last dims hold
    ``lead``'s last ones and ``d`` (``[*lead, d]``, or ``[b, s, h * d]``), all sizes static, at
    least two of ``lead`` merged."""
    x = tensor_inputs(view)[0] if op_kind(view) == "view" else None
    out, given = tensor_val(view), tensor_val(x) if x is not None else None
    if given is None or out is None or out.dim() != 2 or given.dim() < 2 or is_symbolic(given.shape):
        return None
    rows, d = out.shape
    *outer, last = given.shape
    lead = (*outer, last // d) if last != d else tuple(outer)
    merged = sum(n > 1 for n in lead) >= 2  # not a squeeze
    return (x, lead) if last % d == 0 and math.prod(lead) == rows and merged else None


def _row_wise(node: fx.Node) -> bool:
    """Whether ``node`` computes each row alone from its last dim: pointwise, a reduction over
    the last dim spelled ``-1`` and kept, a norm over it."""
    if op_kind(node) in kinds_in("pointwise"):
        return True
    if op_kind(node) == "norm":
        return len(arguments(node)["normalized_shape"]) == 1
    if op_kind(node) != "reduce":
        return False
    given = arguments(node)
    dims = given.get("dim")
    return given.get("keepdim", False) and list(dims if isinstance(dims, (list, tuple)) else [dims]) == [-1]


def _rows_region(first: fx.Node, lead: tuple[int, ...]) -> tuple[list, list, list] | None:
    """(the views flattening rows of ``lead``, the row-wise ops on them, the views that read
    them back) from ``first`` on, or None where anything else reads them or they read a tensor
    that is neither flattened alike nor broadcast over every row (``[d]`` weights)."""
    roots, region, ends, stack = [first], [], [], [first]
    while stack:
        for user in stack.pop().users:
            if user in roots or user in region or user in ends:
                continue
            if user.target in _RESHAPES:
                ends.append(user)
                continue
            if not _row_wise(user):
                return None
            region.append(user)
            stack.append(user)
            for other in tensor_inputs(user):  # rows flattened alike, maybe through row-wise ops (a gate's silu)
                root = _flattened_above(other, lead)
                if root is not None and root not in roots:
                    roots.append(root)
                    stack.append(root)
    inside = {*roots, *region}
    if any(i not in inside and tensor_val(i).dim() > 1 for n in region for i in tensor_inputs(n)):
        return None
    return roots, region, ends


_RESHAPES = {"view", "reshape", torch.reshape}
"""Views to sizes given: the same elements in the same order from the rows flattened or not (a
squeeze or unsqueeze of the rows would give another shape)."""


def _flattened_above(node: fx.Node, lead: tuple[int, ...]) -> fx.Node | None:
    """The view flattening rows of ``lead`` that ``node`` is made from through row-wise ops of
    one input each, if any."""
    while _rows_flattened(node) is None and _row_wise(node) and len(tensor_inputs(node)) == 1:
        node = tensor_inputs(node)[0]
    found = _rows_flattened(node)
    return node if found is not None and found[1] == lead else None


def rows_unflattened(gm: fx.GraphModule, view: fx.Node) -> None:
    """The rows ``view`` flattens, and those flattened alike beside them, read unflattened by the
    row-wise ops between them and the views back (the module docstring says why)."""
    found = _rows_flattened(view)
    region = _rows_region(view, found[1]) if found is not None else None
    if region is None or not region[2]:
        return
    roots, ops, ends = region
    for root in roots:
        x, lead = _rows_flattened(root)
        d = tensor_val(root).shape[1]
        with gm.graph.inserting_before(root):
            rows = x if tensor_val(x).shape == (*lead, d) else emitted(gm.graph, torch.reshape, x, (*lead, d))
        root.replace_all_uses_with(rows)
        gm.graph.erase_node(root)
    region = set(ops)
    for node in [n for n in gm.graph.nodes if n in region]:  # each value again, from its inputs' new ones
        node.meta["val"] = value_from_inputs(node)
    for end in ends:  # a view of rows an op may have left strided: a reshape reads them alike
        if end.op == "call_method" and end.target == "view":
            end.target = "reshape"


_WRAPPED_FUNCTION = re.compile(r"G\['__import_(\w+)'\]\.(\w+)")
"""How Dynamo names a module transformers wraps a module-level function in (its kernel hub)."""


def _recurrence_module(node: fx.Node) -> str | None:
    """``module:name`` of the chunked recurrence whose wrapping module ``node`` was traced in."""
    stack = node.meta.get("nn_module_stack")
    found = _WRAPPED_FUNCTION.fullmatch(list(stack.values())[-1][0]) if stack else None
    if found is None or found[2] not in RECURRENCES:
        return None
    return f"{found[1].replace('_dot_', '.')}:{found[2]}"


def _delta_rule_read(given: dict, region: list[fx.Node]) -> tuple[dict, torch.Tensor, tuple] | None:
    """The gated delta rule's shapes (q, k, v ``[B, S, H, d]``, g ``[B, S, H]`` or
    ``[B, S, H, d]``, beta ``[B, S, H]``), its output and no options; None where its ops do not
    normalize q and k (as every transformers model asks)."""
    if not any(n.target in (torch.rsqrt, "rsqrt", torch.sqrt, "sqrt") for n in region):
        return None
    (b, s, k_heads, k_dim), (heads, v_dim) = tensor_val(given["key"]).shape, tensor_val(given["value"]).shape[2:]
    shapes = {"query": (b, s, k_heads, k_dim), "key": (b, s, k_heads, k_dim), "value": (b, s, heads, v_dim),
              "beta": (b, s, heads),
              "g": (b, s, heads, k_dim)[:tensor_val(given["g"]).dim()]}  # a decay per head, or per key channel (Kimi's)
    return shapes, tensor_val(given["query"]).new_empty(b, s, heads, v_dim), ()


def _scan_read(given: dict, region: list[fx.Node]) -> tuple[dict, torch.Tensor, tuple] | None:
    """Mamba-2's scan's shapes (x ``[B, S, H, P]``, dt ``[B, S, H]``, B and C ``[B, S, G, N]``, A,
    D and dt_bias ``[H]``), its output and its options: the chunk size its rows are viewed in, and
    ``dt_limit`` (its clamp's bounds); None unless it applies a softplus to the time steps
    (``dt_softplus``, as every transformers model asks)."""
    (b, s, heads, head_dim), (groups, size) = tensor_val(given["hidden_states"]).shape, tensor_val(given["B"]).shape[2:]
    clamps = [n for n in region if n.target in (torch.clamp, "clamp")]
    chunks = [tensor_val(n).shape[2] for n in region if op_kind(n) == "view" and tensor_val(n).dim() == 5
              and same_size(tuple(tensor_val(n).shape[3:]), (heads, head_dim))]
    if not any(n.target is F.softplus for n in region) or len(clamps) != 1 or not chunks:
        return None
    bounds = arguments(clamps[0])
    shapes = {"hidden_states": (b, s, heads, head_dim), "dt": (b, s, heads), "B": (b, s, groups, size),
              "C": (b, s, groups, size), "A": (heads,), "D": (heads,), "dt_bias": (heads,)}
    x = tensor_val(given["hidden_states"])
    return shapes, x.new_empty(b, s, heads, head_dim, dtype=torch.promote_types(x.dtype, torch.float32)), \
        (("chunk_size", chunks[0]), ("dt_limit", (bounds.get("min"), bounds.get("max"))))


def _selective_scan_read(given: dict, region: list[fx.Node]) -> tuple[dict, torch.Tensor, tuple] | None:
    """Mamba-1's scan's shapes in the function's layout (x, dt and z ``[B, D, S]``, B and C
    ``[B, N, S]``, A ``[D, N]``, D and delta_bias ``[D]``), its output and no options; None unless
    it applies a softplus to the time steps (``delta_softplus``, as every transformers model asks)."""
    x, A = tensor_val(given["hidden_states"]), tensor_val(given["A"])
    if not any(n.target is F.softplus for n in region) or x.dim() != 3 or A.dim() != 2:
        return None
    (b, d, s), n = x.shape, A.shape[1]
    shapes = {"hidden_states": (b, d, s), "dt": (b, d, s), "z": (b, d, s), "B": (b, n, s), "C": (b, n, s),
              "A": (d, n), "D": (d,), "delta_bias": (d,)}
    return shapes, x.new_empty(b, d, s, dtype=torch.promote_types(x.dtype, torch.float32)), ()


_READS = {GatedDeltaRule: _delta_rule_read, StateSpaceScan: _scan_read, SelectiveScan: _selective_scan_read}
"""How the ops traced from each kind of recurrence are checked and read (``recurrence_as_one_op``):
the shapes of its arguments but the state, in the function's layout, its output, its options. The
state, the one it starts from and the final one, is the kind's own (``state``)."""


def _rows_first(kind, name: str) -> list[tuple]:
    """The ops, with their arguments after the tensor, that lay the function's argument ``name``
    out as ``linear_recurrence`` takes it: rows at dim 1 (``kind.channels_first``: from dim 2),
    key heads or groups at dim 2 (``kind.ungrouped``: one)."""
    return [(torch.movedim, (2, 1))] * (name in kind.channels_first) \
        + [(torch.unsqueeze, (2,))] * (name in kind.ungrouped)


def _laid_out(x, ops: list[tuple], emit=None):
    """``x`` (a tensor, or a node ``emit``ted into its graph) through ``ops``."""
    for fn, args in ops:
        x = emit(fn, x, *args) if emit else fn(x, *args)
    return x


def recurrence_as_one_op(gm: fx.GraphModule, first: fx.Node, rule: str) -> None:
    """The ops traced from one call of ``rule``, from ``first`` on, become one
    ``linear_recurrence``: where they read exactly its tensor arguments, shaped as its kind's
    are (``_READS``), give only its output and final state and show it called as transformers
    calls it. Otherwise, or where the function cannot be imported, they stay as traced."""
    region, node = [], first
    while node.op in ("call_function", "call_method") and (_recurrence_module(node) == rule or is_vmap_level(node)):
        region.append(node)  # a level of vmap closed is traced without the module (Mamba-1's associative scan)
        node = node.next
    inside = set(region)
    kind, reads = RECURRENCES[rule.split(":")[1]]
    read = list(dict.fromkeys(i for n in region for i in n.all_input_nodes if i not in inside))
    given = dict(zip(reads, read))
    if len(read) not in (len(reads) - (reads[-1] == "state"), len(reads)) or any(tensor_val(n) is None for n in read):
        return
    found = _READS[kind](given, region)
    if found is None:
        return
    shapes, output, options = found
    if not all(same_size(tuple(tensor_val(given[name]).shape), shapes[name]) for name in given if name != "state"):
        return
    final = kind.state({name: _laid_out(tensor_val(n), _rows_first(kind, name)) for name, n in given.items()})
    if "state" in given and not same_size(tuple(tensor_val(given["state"]).shape), tuple(final.shape)):
        return
    values = [output, final]
    kept = _values_read(region, given[kind.read_out], values)
    if kept is None:
        return
    for n, i in kept.items():
        values[i] = tensor_val(n)
    try:
        recurrence(rule)
    except (ImportError, AttributeError):
        return
    _recurrence_call(gm, first, rule, given, kept, values, options)
    for n in reversed(region):
        gm.graph.erase_node(n)


def _values_read(region: list[fx.Node], read_out: fx.Node, values: list) -> dict[fx.Node, int] | None:
    """The nodes of ``region`` read after it, each the recurrence's output (0) or its final state
    (1), as their shapes tell, or where both are alike (Mamba-1's when the rows are as many as its
    state's size), as what they are made from does: the output from the read-out tensor
    (``kind.read_out``), which the state never reads. None where one is neither, or two are the
    same value."""
    inside = set(region)
    from_read_out, stack = set(), [read_out]
    while stack:
        for user in stack.pop().users:
            written = user.args[0] if writes_in_place(user) or user.target is operator.setitem else None
            for reached in (user, written):  # a write reaches the tensor written into
                if reached in inside and reached not in from_read_out:
                    from_read_out.add(reached)
                    stack.append(reached)
    kept = {}
    for n in (n for n in region if any(u not in inside for u in n.users)):
        fits = [i for i, value in enumerate(values)
                if tensor_val(n) is not None and same_size(tuple(tensor_val(n).shape), tuple(value.shape))]
        kept[n] = fits[0] if len(fits) == 1 else int(n not in from_read_out) if fits else None
    return kept if None not in kept.values() and len(set(kept.values())) == len(kept) else None


def _recurrence_call(gm: fx.GraphModule, first: fx.Node, rule: str, given: dict, kept: dict, values: list,
                     options: tuple) -> None:
    """One ``linear_recurrence`` of ``rule`` before ``first``, its tensors ``given`` laid out as it
    takes them, read by the nodes ``kept`` maps to its output (0, laid out back as the function's)
    or final state (1); ``values`` are theirs, in the function's layout."""
    kind = kind_of(rule)
    emit, back = partial(emitted, gm.graph), [(torch.movedim, (1, 2))] if kind.channels_first else []
    with gm.graph.inserting_before(first):
        tensors = [_laid_out(given[name], _rows_first(kind, name), emit)
                   for name in kind.rows + kind.per_head + ("state",) if name in given]
        call = gm.graph.call_function(linear_recurrence, (rule, *tensors), {"options": options} if options else {})
        with_val(call, (values[0].movedim(2, 1).contiguous() if back else values[0], values[1]))
        for n, i in kept.items():
            got = with_val(gm.graph.call_function(operator.getitem, (call, i)), call.meta["val"][i])
            n.replace_all_uses_with(_laid_out(got, back, emit) if i == 0 else got)


def cropped_conv_as_padded(gm: fx.GraphModule, crop: fx.Node) -> None:
    """``conv1d(x, padding=p)[:, :, :L]``, ``L`` the length of ``x``, with stride 1 and dilation 1:
    ``padded_conv1d(x, pad=(p, k - 1 - p))`` (the module docstring says why)."""
    conv, index = crop.args
    if not (isinstance(conv, fx.Node) and conv.target in (torch.conv1d, F.conv1d) and len(conv.users) == 1):
        return
    if isinstance(index, tuple) and len(index) == 2 and index[0] is Ellipsis:  # x[..., :L]
        index = (slice(None), slice(None), index[1])
    given = arguments(conv)
    length, kernel = tensor_val(given["input"]).shape[-1], tensor_val(given["weight"]).shape[-1]
    stride, padding, dilation = ((v,) if isinstance(v, int) else tuple(v)
                                 for v in (given["stride"], given["padding"], given["dilation"]))
    if not (isinstance(index, tuple) and len(index) == 3 and index[:2] == (slice(None),) * 2
            and index[2] in (slice(None, length), slice(0, length)) and not is_symbolic(length)
            and stride == dilation == (1,) and isinstance(padding[0], int) and 0 < padding[0] < kernel):
        return
    with gm.graph.inserting_before(crop):
        padded = emitted(gm.graph, padded_conv1d, given["input"], given["weight"], given["bias"],
                         (padding[0], kernel - 1 - padding[0]), given["groups"])
    crop.replace_all_uses_with(padded)
    gm.graph.erase_node(crop)
    gm.graph.erase_node(conv)


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


def _viewed_features(split: fx.Node) -> tuple[fx.Node, int] | None:
    """``(linear, inner)`` when ``split`` cuts views of a linear's output (each read once) along
    a dim that, with the ``inner`` elements after it, is the linear's feature dim regrouped."""
    x, views = arguments(split)["input"], 0
    while op_kind(x) == "view" and len(x.users) == 1:  # views keep the elements' order
        x, views = arguments(x)["input"], views + 1
    if not views or op_kind(x) != "linear" or len(x.users) != 1:
        return None
    viewed, dim = tensor_val(arguments(split)["input"]).shape, split_dim(split)
    inner = math.prod(viewed[dim + 1:])
    features = tensor_val(x).shape
    if math.prod(viewed[:dim]) != math.prod(features[:-1]) or viewed[dim] * inner != features[-1]:
        return None
    return x, inner


def split_features_before_views(gm: fx.GraphModule, split: fx.Node) -> None:
    """Rewrite a split of a fused projection's viewed features into the split of its features,
    each part then reshaped to its piece's shape."""
    found = _viewed_features(split)
    if found is None or any(u.target is not operator.getitem for u in split.users):
        return
    linear, inner = found
    pieces = split.meta["val"]
    features = [t.shape[split_dim(split)] * inner for t in pieces]
    with gm.graph.inserting_before(split):
        parts = gm.graph.call_method("split", (linear, features, -1))
        parts.meta = {**linear.meta, "val": tuple(tensor_val(linear).split(features, -1))}
    for user in list(split.users):
        with gm.graph.inserting_before(user):
            part = with_val(gm.graph.call_function(operator.getitem, (parts, user.args[1])),
                            parts.meta["val"][user.args[1]])
            piece = with_val(gm.graph.call_method("reshape", (part, tuple(pieces[user.args[1]].shape))),
                             pieces[user.args[1]])
        user.replace_all_uses_with(piece)
        gm.graph.erase_node(user)
    erase_unused(gm, split)


_EMPTY = {"new_empty", torch.empty_like, "empty_like"}


def _one_dim_slice(index, ndim: int) -> tuple[int, slice] | None:
    """``(dim, slice)`` when ``index`` cuts one dim by a static unit-step slice and leaves
    every other whole (``x[..., 2:5]``, ``x[:, :4]``); None otherwise."""
    index = index if isinstance(index, tuple) else (index,)
    if index.count(Ellipsis) > 1 or not all(isinstance(i, slice) or i is Ellipsis for i in index):
        return None
    if Ellipsis in index:
        at = index.index(Ellipsis)
        index = index[:at] + (slice(None),) * (ndim - len(index) + 1) + index[at + 1:]
    cut = [(dim, i) for dim, i in enumerate(index) if i != slice(None)]
    if len(index) > ndim or len(cut) != 1 or cut[0][1].step not in (None, 1) \
            or not all(isinstance(b, int) or b is None for b in (cut[0][1].start, cut[0][1].stop)):
        return None
    return cut[0]


def _slice_fills(empty: fx.Node) -> tuple[int, list[fx.Node], fx.Node] | None:
    """The dim, the ``copy_`` nodes in slice order and the last of them in graph order, that
    fill ``empty`` (a tensor made uninitialized) along one dim: each slice copied into once, by
    a piece of its shape, the slices covering the dim exactly, and every other reader of
    ``empty`` after the last copy. None when it is not filled so."""
    val = tensor_val(empty)
    if val is None or is_symbolic(val.shape):
        return None
    pieces, readers = {}, []
    for user in empty.users:
        cut = _one_dim_slice(user.args[1], val.dim()) if user.target is operator.getitem else None
        if cut is None:
            readers.append(user)
            continue
        copies = list(user.users)
        if len(copies) != 1 or copies[0].target != "copy_" or copies[0].args[0] is not user or copies[0].users \
                or getattr(tensor_val(copies[0].args[1]), "shape", None) != tensor_val(user).shape:
            return None
        dim, (start, stop, _) = cut[0], cut[1].indices(val.shape[cut[0]])
        pieces[(dim, start)] = (stop, copies[0])
    dims = {dim for dim, _ in pieces}
    if len(dims) != 1:
        return None
    dim, at, fills = dims.pop(), 0, []
    while (dim, at) in pieces:
        at, copy = pieces.pop((dim, at))
        fills.append(copy)
    order = {n: i for i, n in enumerate(empty.graph.nodes)}
    last = max(fills, key=order.get) if fills else None
    if last is None or pieces or at != val.shape[dim] or any(order[r] < order[last] for r in readers):
        return None
    return dim, fills, last


def slice_fills_as_cat(gm: fx.GraphModule, empty: fx.Node) -> None:
    """Rewrite an empty tensor filled slice by slice along one dim into the ``cat`` of its
    pieces, placed after the last copy (so after every piece, before every reader)."""
    found = _slice_fills(empty)
    if found is None:
        return
    dim, fills, last = found
    pieces = [copy.args[1] for copy in fills]
    with gm.graph.inserting_after(last):
        joined = with_val(gm.graph.call_function(torch.cat, (pieces, dim)),
                          torch.cat([tensor_val(p) for p in pieces], dim))
    empty.replace_all_uses_with(joined, delete_user_cb=lambda user: user.target is not operator.getitem)
    for copy in fills:
        view = copy.args[0]
        gm.graph.erase_node(copy)
        gm.graph.erase_node(view)
    gm.graph.erase_node(empty)


_ALIASING = {"view", "transpose", "permute", "expand", "cast"}
"""Op kinds whose output may share its input's storage (a cast to the dtype it has)."""


def _written_alone(target: fx.Node, write: fx.Node, order: dict[fx.Node, int]) -> bool:
    """Whether a write into ``target`` reaches no tensor read after it but ``target``: the tensors
    it views are read by nothing else, and what reads ``target`` before the write is read before
    it too (a slice of it read to make the written value). ``order``: each node's place in the graph."""
    for reader in target.users:
        if order[reader] < order[write] and any(order[u] > order[write] for u in reader.users):
            return False
    node = target
    while op_kind(node) in _ALIASING:
        node = tensor_inputs(node)[0]
        if len(node.users) != 1:
            return False
    return True


def slice_write_as_cat(gm: fx.GraphModule, write: fx.Node) -> None:
    """Rewrite ``x[..., a:b, ...] = value`` into the ``cat`` of ``x``'s slices before and after
    and ``value``, read in place of ``x`` by the nodes after the write."""
    target, index, value = write.args
    val = tensor_val(target)
    cut = _one_dim_slice(index, val.dim()) if val is not None and not is_symbolic(val.shape) else None
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    if cut is None or getattr(tensor_val(value), "shape", None) != val[index].shape \
            or tensor_val(value).dtype != val.dtype or not _written_alone(target, write, order):
        return
    dim, (start, stop, _) = cut[0], cut[1].indices(val.shape[cut[0]])
    graph, before = gm.graph, (slice(None),) * dim
    later = [u for u in target.users if order[u] > order[write]]
    with graph.inserting_before(write):
        pieces = [with_val(graph.call_function(operator.getitem, (target, before + (slice(a, b),))),
                           val[before + (slice(a, b),)]) if (a, b) != (start, stop) else value
                  for a, b in ((0, start), (start, stop), (stop, val.shape[dim])) if b > a]
        whole = with_val(graph.call_function(torch.cat, (pieces, dim)), val.clone())
    for user in later:
        user.replace_input_with(target, whole)
    graph.erase_node(write)


def in_place_add_out_of_place(gm: fx.GraphModule, node: fx.Node) -> None:
    """Rewrite ``y.add_(b)`` into ``y + b`` read in place of ``y`` (and of the write's result),
    where ``y`` is a product's output (fresh: no other tensor shares its storage) that nothing
    reads before the write and ``y + b`` keeps its dtype: the same values everywhere."""
    given = arguments(node)
    y, other = given["input"], given["other"]
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    if op_kind(y) not in kinds_in("matmul") or given.get("alpha", 1) != 1 or not isinstance(other, fx.Node) \
            or any(order[u] < order[node] for u in y.users) or tensor_val(other) is None \
            or torch.result_type(tensor_val(y), tensor_val(other)) != tensor_val(y).dtype:
        return
    with gm.graph.inserting_before(node):
        added = with_val(gm.graph.call_function(operator.add, (y, other)), tensor_val(y))
    _read_in_place(gm, y, node, added)


def _read_in_place(gm: fx.GraphModule, written: fx.Node, write: fx.Node, value: fx.Node) -> None:
    """``value`` read in place of ``written`` and of the in-place ``write``'s result, by every
    reader after the write (those before read ``written`` as it was); the write erased."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for reader in (written, write):
        reader.replace_all_uses_with(value, delete_user_cb=lambda user: user not in (value, write)
                                     and order[user] > order[write])
    gm.graph.erase_node(write)


_FRESH = {torch.zeros, torch.empty, torch.ones, torch.zeros_like, torch.empty_like, torch.ones_like, torch.clone,
          "new_zeros", "new_empty", "new_ones", "clone"}
"""Factories and copies: a tensor they make shares its storage with no other."""


def _read_before(reader: fx.Node, write: fx.Node, order: dict[fx.Node, int]) -> bool:
    """Whether ``reader`` makes a new tensor before ``write``, or casts (an alias where the dtype
    is the same: Mamba's ``state.float()``) that only such readers read before it."""
    if order[reader] > order[write]:
        return False
    if op_kind(reader) == "cast":
        return all(_read_before(user, write, order) for user in reader.users)
    return op_kind(reader) in kinds_in("pointwise")


def copy_into_fresh_out_of_place(gm: fx.GraphModule, node: fx.Node) -> None:
    """Rewrite ``fresh.copy_(src)``, ``fresh`` a tensor a factory or a copy just made and ``src``
    as large (a linear attention cache's state, made zeros, then written whole; Mamba-2's decode
    step's, cloned, read, then written whole), into ``src`` (cast to ``fresh``'s dtype) read in
    place of ``fresh`` and of the write's result after it, where only ops making new tensors
    read ``fresh`` before (``_read_before``: no view of it sees the write) and nothing writes
    into ``src`` after it: the same values everywhere."""
    given = arguments(node)
    fresh, src = given["input"], given["src"]
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    if fresh.target not in _FRESH or not isinstance(src, fx.Node) or tensor_val(src) is None \
            or any(order[u] < order[node] and not _read_before(u, node, order) for u in fresh.users) \
            or any(writes_in_place(u) and order[u] > order[node] for u in src.users) \
            or not same_size(tuple(tensor_val(src).shape), tuple(tensor_val(fresh).shape)):
        return
    value = src
    if tensor_val(src).dtype != tensor_val(fresh).dtype:
        with gm.graph.inserting_before(node):
            value = with_val(gm.graph.call_method("to", (src, tensor_val(fresh).dtype)), tensor_val(fresh))
    _read_in_place(gm, fresh, node, value)
    erase_unused(gm, fresh)


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


def grouped_kv_attention(gm: fx.GraphModule, sdpa_node: fx.Node) -> None:
    """Give an attention call that reads kv heads repeated to its query heads the kv heads
    themselves and ``enable_gqa=True``; the repeats go when nothing else reads them.
    Left as it is when ``enable_gqa`` is set already, or key and value are not both repeats
    by the same factor of the query heads."""
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


class _RowProduct(NamedTuple):
    """An expert product read a row at a time: ``out [S, N]`` is each row of ``rows [S, K]`` times
    its own expert's weight, ``weight[ids]`` (``weight`` stored ``[E, K, N]`` when ``stored_in_out``,
    else ``[E, N, K]``), through ``column``, the rows viewed as the product reads them."""

    product: fx.Node
    out: fx.Node
    weight: fx.Node
    ids: fx.Node
    rows: fx.Node
    column: fx.Node
    stored_in_out: bool


def _top_k_indices(ids: fx.Node) -> bool:
    """Whether ``ids`` are a top-k's indices (through views): each names an expert, in range, as
    the histogram that groups them counts it."""
    while op_kind(ids) == "view":
        ids = arguments(ids)["input"]
    return op_kind(ids) == "getitem" and is_topk(arguments(ids)["input"]) and arguments(ids)["index"] == 1


def _gathered_experts(node) -> tuple[fx.Node, fx.Node] | None:
    """``(W, ids)`` when ``node`` is ``W[ids]``: a 3-d tensor's experts, one a row, picked by a
    top-k's indices ``[S]``."""
    if op_kind(node) != "getitem":
        return None
    given = arguments(node)
    weight, ids = given["input"], given["index"]
    if not isinstance(ids, fx.Node) or getattr(tensor_val(weight), "ndim", 0) != 3 \
            or getattr(tensor_val(ids), "ndim", 0) != 1 or not _top_k_indices(ids):
        return None
    return weight, ids


def row_product(node: fx.Node) -> _RowProduct | None:
    """The expert product ``node`` computes a row at a time, if it is one (transformers'
    ``_batched_linear``): a ``bmm`` or ``matmul`` of ``W[ids]`` and the rows as columns
    (``W[ids] @ x.unsqueeze(-1)``, W ``[E, N, K]``) or as rows (``x.unsqueeze(1) @ W[ids]``, W
    ``[E, K, N]``), both views, read only through a view back to ``[S, N]``."""
    if op_kind(node) != "matmul" or getattr(tensor_val(node), "ndim", 0) != 3 or len(node.users) != 1:
        return None
    given, (out,) = arguments(node), node.users
    a, b = given["input"], given.get("mat2", given.get("other"))
    for gathered, column, stored_in_out in ((a, b, False), (b, a, True)):
        found = _gathered_experts(gathered)
        if found is None or op_kind(column) != "view" or op_kind(out) != "view":
            continue
        rows, weight = arguments(column)["input"], tensor_val(found[0])
        if getattr(tensor_val(rows), "ndim", 0) != 2:
            continue
        (s, k), n = tensor_val(rows).shape, weight.shape[2 if stored_in_out else 1]
        shapes = (((s, 1, k), (s, 1, n)) if stored_in_out else ((s, k, 1), (s, n, 1))) + ((s, n),)
        if same_size(weight.shape[1 if stored_in_out else 2], k) and all(
                same_size(tuple(tensor_val(v).shape), shape) for v, shape in zip((column, node, out), shapes)):
            return _RowProduct(node, out, found[0], found[1], rows, column, stored_in_out)
    return None


_PER_ROW = kinds_in("pointwise") | {"split", "getitem"}
"""Ops that may run between the experts' up and down products on rows in any order: the
activation and gate, elementwise, and the pieces of a fused gate and up split along features."""


def _keeps_rows(node: fx.Node) -> bool:
    """Whether a per-row op keeps each row to itself: a split along features, a piece of one."""
    if op_kind(node) == "split":
        return split_dim(node) != 0
    if op_kind(node) == "getitem":
        return isinstance(arguments(node)["input"].meta.get("val"), (tuple, list))
    return True


def _row_aligned(node: fx.Node, rows) -> bool:
    """Whether ``node`` holds one row per expert row (a split of them, pieces and all)."""
    val = node.meta.get("val")
    return isinstance(val, (tuple, list)) or (isinstance(val, torch.Tensor) and val.dim() >= 2
                                              and same_size(val.shape[0], rows))


def _up_products(down: _RowProduct) -> tuple[list[_RowProduct], fx.Node, int] | str | None:
    """The up (and gate) products (in graph order) whose outputs ``down``'s rows are made from,
    row by row, the tokens whose rows they read and each token's count of rows (top-k); None when
    ``down``'s rows come from no such product (it is no down projection), else why the rows
    between cannot run in expert order."""
    ups, between, leaves, stack = {}, set(), [], [down.rows]
    rows = tensor_val(down.rows).shape[0]
    while stack:
        node = stack.pop()
        if node in between or node in ups:
            continue
        up = row_product(arguments(node)["input"]) if op_kind(node) == "view" else None
        if up is not None and up.out is node:
            ups[node] = up
        elif op_kind(node) in _PER_ROW and _keeps_rows(node):
            between.add(node)
            stack.extend(i for i in node.all_input_nodes if _row_aligned(i, rows))
        else:
            leaves.append(node)
    if not ups:
        return None
    ups = sorted(ups.values(), key=lambda up: _position(up.product))
    outside = [(n, u) for n in between | {up.out for up in ups} for u in n.users
               if u not in between and u is not down.column]
    if leaves:
        return f"{leaves[0].name} is read row by row between them, and is no expert product's output"
    if outside:
        return f"{outside[0][1].name} reads {outside[0][0].name} between them"
    if any(up.ids is not down.ids or up.rows is not ups[0].rows for up in ups):
        return "they pick their experts by other indices, or read other rows"
    repeated = _repeated_tokens(ups[0].rows)
    if repeated is None:
        return f"their rows {ups[0].rows.name} are not each token repeated top-k times in a row " \
               f"(repeat_interleave along dim 0)"
    return ups, *repeated


def _position(node: fx.Node) -> int:
    return next(i for i, n in enumerate(node.graph.nodes) if n is node)


def _repeated_tokens(rows: fx.Node) -> tuple[fx.Node, int] | None:
    """``(tokens, k)`` when ``rows`` are each token repeated ``k`` times in a row
    (``tokens.repeat_interleave(k, dim=0)``), as transformers lays out a token's top-k rows."""
    if rows.target not in (torch.repeat_interleave, "repeat_interleave"):
        return None
    given = arguments(rows)
    tokens, k = given["input"], given["repeats"]
    if given["dim"] != 0 or not isinstance(k, int) or getattr(tensor_val(tokens), "ndim", 0) != 2:
        return None
    return tokens, k


def experts_as_grouped(gm: fx.GraphModule, down: _RowProduct, ctx: ParallelContext) -> None:
    """Rewrite the experts' products read a row at a time, up (and gate) and ``down`` with only
    per-row ops between them, into the grouped chain (see the module's docstring). A pair that
    cannot be reordered stays as it is, with a warning that says why."""
    found = _up_products(down)
    if isinstance(found, str):
        ctx.warn(f"{down.product.name}: experts read a row at a time through {down.ids.name} stay so (whole on every "
                 f"rank): {found}")
    if not isinstance(found, tuple):
        return
    (ups, tokens, top_k), graph, ids = found, gm.graph, tensor_val(down.ids)

    def call(fn, args, value, kwargs=None, method=False):
        return with_val((graph.call_method if method else graph.call_function)(fn, args, kwargs or {}), value)

    experts = tensor_val(down.weight).shape[0]
    with graph.inserting_before(ups[0].product):
        order = call(torch.sort, (down.ids,), (ids.new_empty(ids.shape), ids.new_empty(ids.shape)), {"stable": True})
        by_expert, perm = (call(operator.getitem, (order, i), ids.new_empty(ids.shape)) for i in (0, 1))
        source = call(operator.floordiv, (perm, top_k), tensor_val(perm))
        rows = call(operator.getitem, (tokens, source), tensor_val(ups[0].rows))
        float_ids = call("float", (by_expert,), ids.new_empty(ids.shape, dtype=torch.float32), method=True)
        counts = call(torch.histc, (float_ids,), float_ids.meta["val"].new_empty(experts),
                      {"bins": experts, "min": 0, "max": experts - 1})
        offs = call(torch.cumsum, (counts, 0), ids.new_empty(experts, dtype=torch.int32), {"dtype": torch.int32})
        for up in ups:
            up.out.replace_all_uses_with(_grouped(graph, up, rows, offs))
    with graph.inserting_before(down.product):
        product = _grouped(graph, down, down.rows, offs)
        back = call(operator.getitem, (product, call(torch.argsort, (perm,), tensor_val(perm))), tensor_val(down.out))
    down.out.replace_all_uses_with(back)
    for old in ups + [down]:
        erase_unused(gm, old.out)


def _grouped(graph: fx.Graph, old: _RowProduct, rows: fx.Node, offs: fx.Node) -> fx.Node:
    """The grouped matmul of ``rows`` in expert order with ``old``'s experts read ``[E, K, N]``."""
    weight = old.weight
    if not old.stored_in_out:
        weight = with_val(graph.call_method("transpose", (weight, -2, -1)), tensor_val(weight).transpose(-2, -1))
    return with_val(graph.call_function(GROUPED_MM, (rows, weight, offs)), tensor_val(old.out))


class _SinkScale(NamedTuple):
    """Granite-SWA's sinks, a logit per head applied after attention: ``out * sigmoid(lse - sink)``."""

    softmax: fx.Node  # over the scores the log-sum-exp reads
    sink: fx.Node  # a number per head
    scaled: fx.Node  # the output times the scale
    output: fx.Node  # the probabilities times the values


def _sink_scale(lse: fx.Node) -> _SinkScale | None:
    """The sink scale made of ``lse``, a log-sum-exp over the last dim of ``[batch, heads, seq,
    keys]`` scores that a softmax reads too: ``lse - sink`` through casts and views, a sigmoid,
    then multiplying the softmax's ``@ v`` (``detect.weighted_values``)."""
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


def sink_scale_as_sink_logits(gm: fx.GraphModule, lse: fx.Node) -> None:
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


def softmax_of_unshifted(gm: fx.GraphModule, softmax: fx.Node) -> None:
    shifted = arguments(softmax)["input"]
    if op_kind(shifted) != "sub" or len(shifted.users) != 1 or arguments(shifted).get("alpha", 1) != 1:
        return
    x, row_max, dim = arguments(shifted)["input"], arguments(shifted)["other"], arguments(softmax)["dim"]
    if isinstance(x, fx.Node) and isinstance(row_max, fx.Node) and isinstance(dim, int) \
            and _is_row_max(row_max, x, dim % tensor_val(softmax).dim()):
        softmax.replace_input_with(shifted, x)
        erase_unused(gm, shifted)


def elementwise_extreme(node: fx.Node) -> None:
    """``torch.max(a, b)`` and ``a.min(b)`` of two tensors are ``torch.maximum`` and ``torch.minimum``:
    elementwise ops (XGLM clamps its scores with ``torch.max(scores, full((), finfo.min))``), not
    reductions."""
    given = arguments(node)
    if isinstance(given.get("other"), fx.Node):
        node.target = torch.maximum if node.target in (torch.max, "max") else torch.minimum
        node.op, node.args, node.kwargs = "call_function", (given["input"], given["other"]), {}


def _tensor_by_keyword(node: fx.Node) -> bool:
    """Whether a call is given a tensor by keyword (``x.baddbmm(batch1=a, batch2=b)``)."""
    given = []
    fx.node.map_arg(node.kwargs, given.append)
    return any(tensor_val(n) is not None for n in given)


def canonicalize_node(gm: fx.GraphModule, node: fx.Node, ctx: ParallelContext) -> None:
    """Rewrite ``node`` into the spelling the rules know, if it has another."""
    if node.op in ("call_function", "call_method") and _tensor_by_keyword(node):
        node.args, node.kwargs = keywords_as_positions(node) or (node.args, node.kwargs)
    if node.op in ("call_function", "call_method") and node.target in (torch.narrow, "narrow"):
        narrow_as_slice(gm, node)
    elif node.op in ("call_function", "call_method") and node.target in (torch.outer, torch.ger, "outer", "ger"):
        outer_as_product(gm, node)
    elif node.op == "call_function" and node.target is operator.getitem:
        cropped_conv_as_padded(gm, node)
    elif node.op in ("call_function", "call_method") and node.target in (torch.tensor_split, "tensor_split"):
        tensor_split_as_split(gm, node)
    elif node.op == "call_function" and node.target is F.multi_head_attention_forward:
        mha_as_attention(gm, node, ctx)
    elif node.op == "call_function" and node.target in _FUSED_FAST_PATHS:
        ctx.warn(f"{node.name}: {_FUSED_FAST_PATHS[node.target]}'s fused fast path (eval, no grad) is one op and runs "
                 f"whole on every rank; call torch.backends.mha.set_fastpath_enabled(False) before compiling, and "
                 f"its attention and MLP are written out and parallelized")
    elif node.op in ("call_function", "call_method") and node.target in _ADD_PRODUCT:
        if not (node.target in (torch.addmm, "addmm") and conv1d_linear(gm, node)):
            add_product_as_matmul(gm, node)
    elif (down := row_product(node)) is not None:
        experts_as_grouped(gm, down, ctx)
    elif node.op in ("call_function", "call_method") and node.target in (operator.matmul, torch.matmul, "matmul"):
        parameter_product_as_linear(gm, node, ctx)
    elif node.op in ("call_function", "call_method") and node.target in _EMPTY:
        slice_fills_as_cat(gm, node)
    elif node.op == "call_method" and node.target == "add_":
        in_place_add_out_of_place(gm, node)
    elif node.op == "call_method" and node.target == "copy_":
        copy_into_fresh_out_of_place(gm, node)
    elif node.op == "call_function" and node.target is operator.setitem:
        slice_write_as_cat(gm, node)
    elif op_kind(node) == "sdpa" and ctx.mesh.size("cp") > 1:
        grouped_kv_attention(gm, node)
    elif op_kind(node) == "softmax":
        softmax_of_unshifted(gm, node)
    elif node.op in ("call_function", "call_method") and node.target in (torch.logsumexp, "logsumexp"):
        sink_scale_as_sink_logits(gm, node)
    elif node.op in ("call_function", "call_method") and node.target in (torch.max, torch.min, "max", "min"):
        elementwise_extreme(node)
    elif op_kind(node) == "split":
        split_features_before_views(gm, node)
    elif op_kind(node) == "view":
        reshaped_back(gm, node)
        if not node._erased:
            rows_unflattened(gm, node)
    if not node._erased and (rule := _recurrence_module(node)) is not None and _recurrence_module(node.prev) != rule:
        recurrence_as_one_op(gm, node, rule)


def canonicalize_pass(gm: fx.GraphModule, ctx: ParallelContext) -> fx.GraphModule:
    for node in list(gm.graph.nodes):
        if node._erased:  # by a rule at an earlier node (its crop, its view)
            continue
        with at_node("canonicalize", node):
            canonicalize_node(gm, node, ctx)
    gm.recompile()
    return gm
