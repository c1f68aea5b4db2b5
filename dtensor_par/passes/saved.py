"""saved: what a rank keeps from forward for backward, and what backward computes again.

Read off the rank's graph once ``recompute_pass`` has tagged it, as AOTAutograd's min-cut
partitioner reads those tags:

- an op's backward reads some of its values (``_read_by_backward``): a linear its input, a
  norm its input, softmax and ``exp`` their output, attention q, k, v, its output and
  log-sum-exp, a product each factor whose partner needs a gradient; a sum or a view nothing;
- such a value is kept, unless its op is tagged to be recomputed: backward then computes it
  again from its inputs, which are kept or recomputed in turn. The partitioner never keeps a
  value tagged ``PREFER_RECOMPUTE`` or ``MUST_RECOMPUTE``, but the last value of a region that a
  later region reads (its ``cleanup_recompute_tags``): that one is kept;
- a cheap pointwise op whose inputs are all kept anyway is recomputed rather than kept (the
  min-cut's own choice: it costs no memory), unless it is tagged ``MUST_SAVE``;
- a view shares its base's storage: a value is counted once, by the op that made its storage;
  parameters and the graph's inputs are held anyway and count nothing.

Without tags the min-cut may recompute more than the cheap ops whose inputs are kept: the bytes
kept are then at most what this says.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.utils.checkpoint import CheckpointPolicy

from ..ops import collectives as C
from .meta import communications, global_shape, is_fsdp_gather, work
from .nodes import arguments
from .rules.registry import kinds_in, op_kind

_RECOMPUTED = (CheckpointPolicy.PREFER_RECOMPUTE, CheckpointPolicy.MUST_RECOMPUTE)
_ALL_INPUTS = {"linear", "matmul", "einsum", "grouped_mm", "conv", "solve_triangular", "maximum",
               "elementwise_function", "extreme", "recurrence"} | kinds_in("routing")
"""Op kinds whose backward reads every tensor input (a parameter among them counts nothing)."""
_FIRST_INPUT = {"norm", "group_norm", "unary", "normalize", "reduce", "embedding", "where", "interpolate"}
"""... the first: a norm's input, an activation's, the mask of a where."""
_OUTPUT = {"softmax", "sdpa", "hybrid_attention"}
"""... its own output (attention: q, k, v as well, and its log-sum-exp)."""
_OUTPUT_READING_UNARY = {torch.exp, torch.tanh, torch.sigmoid, torch.rsqrt, torch.sqrt, torch.reciprocal, F.tanh,
                         F.sigmoid, "exp", "tanh", "sigmoid", "rsqrt", "sqrt", "reciprocal"}
"""Unary ops whose derivative is read off their output."""
_FACTORS = {"mul", "div"}
"""... each input whose partner needs a gradient."""
_NOTHING_READ = {"sum", "mean"}
"""Reductions whose backward reads no value."""
_ALIASING = kinds_in("views") | {"getitem", "split", "unbind"}
"""Op kinds whose output shares storage with their input."""
_CHEAP = kinds_in("pointwise") - {"dropout", "elementwise_function"}
"""Op kinds the partitioner recomputes at no memory cost when their inputs are kept anyway."""
_RANDOM = {"sdpa", "hybrid_attention", "dropout"}
"""Op kinds AOTAutograd traces as random (attention may drop out): recomputed, each keeps the
generator's state from forward (``functionalize_rng_ops``)."""
_RNG_STATE_BYTES = torch.get_rng_state().numel()
"""The CPU generator's state (a CUDA generator keeps a seed and an offset: 16 bytes)."""
_ATTENTION_ALWAYS_RANDOM = torch.torch_version.TorchVersion(torch.__version__) < "2.14"
"""torch 2.13's AOTAutograd keeps a generator state for every attention it recomputes, dropout or
not; 2.14's only for one that drops out (measured: a checkpointed GPT block at tp2 keeps 2 states
of 5,056 B on 2.13.0, none on 2.14.1)."""
_IDENTITIES = {C.grad_all_reduce, C.grad_all_reduce_bucket, C.grad_as_partial}
"""Inserted ops that give their input as it is in forward."""
_HELD = ("placeholder", "get_attr")
"""Nodes whose values are held anyway: parameters, inputs, attributes."""
_RECOMPUTING = "recomputing"
"""The reader of a value that a recomputed op reads."""
_GATHERS = {"embedding"}
"""Ops the partitioner recomputes from held values alone for ops it recomputes (an embedding
of the token ids), as cheap ones."""


@dataclass(frozen=True)
class KeptForBackward:
    """What one rank keeps for backward, and what backward recomputes."""

    bytes: int  # activations kept from forward for backward
    recomputed_flops: int  # FLOPs of forward ops backward runs again
    recomputed_collectives: int  # collectives backward issues again to recompute
    recomputed_bytes: int  # this rank's bytes into them


def kept_for_backward(gm: fx.GraphModule, checkpointing: bool = True) -> KeptForBackward:
    """What ``gm`` keeps for backward as the partitioner cuts it; ``checkpointing=False``: as it
    would without its regions' tags."""
    kept, recomputed = _cut(gm, checkpointing)
    comms = [c for n in recomputed if not is_fsdp_gather(n) for c in communications(n) if c.forward]
    return KeptForBackward(
        sum(_held_bytes(gm, kept, recomputed).values()),
        sum(w.flops for n in recomputed if (w := work(n))), len(comms), sum(c.forward_bytes for c in comms))


def kept_by_node(gm: fx.GraphModule) -> tuple[dict[fx.Node, int], set[fx.Node]]:
    """(``kept_for_backward``'s bytes by the node that holds them, ``recomputed_ops``): a part of
    the graph (a pipeline stage) sums its own."""
    kept, recomputed = _cut(gm, checkpointing=True)
    return _held_bytes(gm, kept, recomputed), {n for n in recomputed if not is_fsdp_gather(n)}


def _held_bytes(gm: fx.GraphModule, kept: set[fx.Node], recomputed: set[fx.Node]) -> dict[fx.Node, int]:
    """Bytes each node holds for backward: a kept value's storage, an attention's own saved
    state, a recomputed random op's RNG state."""
    held = dict.fromkeys(gm.graph.nodes, 0)
    for node in kept:
        held[node] += _bytes(node)
    for node in gm.graph.nodes:
        if op_kind(node) in ("sdpa", "hybrid_attention") and node not in recomputed:
            held[node] += _attention_own_bytes(node)
    for node in recomputed:
        held[node] += _RNG_STATE_BYTES * _random_ops(node)
    return {node: nbytes for node, nbytes in held.items() if nbytes}


def recomputed_ops(gm: fx.GraphModule) -> set[fx.Node]:
    """The forward ops backward runs again (``passes.cost`` times them), but FSDP's gathers: the
    gather again in backward is already their own backward Communication (``localize``)."""
    return {n for n in _cut(gm, checkpointing=True)[1] if not is_fsdp_gather(n)}


def _cut(gm: fx.GraphModule, checkpointing: bool) -> tuple[set[fx.Node], set[fx.Node]]:
    """(the values kept for backward, the ops backward recomputes), each value named by the op
    that made its storage."""
    tagged = _tagged_recomputed(gm) if checkpointing else set()
    grad = _needing_grad(gm)
    readers: dict[fx.Node, set[str | None]] = {}  # kept value -> the kinds of op whose backward reads it
    recomputed: set[fx.Node] = set()

    def keep(value: fx.Node, reader: str | None, chain: set[fx.Node]) -> None:
        value = storage(value)
        if value in tagged:
            if value not in chain:
                chain.add(value)
                for i in value.all_input_nodes:
                    keep(i, _RECOMPUTING, chain)
        elif value.op not in _HELD:
            readers.setdefault(value, set()).add(reader)

    for node in gm.graph.nodes:
        if grad[node]:
            for value in _read_by_backward(node, grad):
                keep(value, op_kind(node), recomputed)
    _recompute_cheap_ops(readers, recomputed, checkpointing)
    return set(readers), recomputed


def _tagged_recomputed(gm: fx.GraphModule) -> set[fx.Node]:
    """Ops tagged to be recomputed, less the last op of a region that a later region's
    recomputed op reads (the partitioner keeps it)."""
    def recomputed(n: fx.Node) -> bool:
        return n.meta.get("recompute") in _RECOMPUTED

    return {n for n in gm.graph.nodes if recomputed(n) and not any(
        recomputed(u) and u.meta.get("ac_graph_id", 0) > n.meta.get("ac_graph_id", 0) for u in n.users)}


def _recompute_cheap_ops(readers: dict[fx.Node, set[str | None]], recomputed: set[fx.Node], checkpointing: bool
                         ) -> None:
    """Drop from the kept values each cheap op's whose inputs are kept, held or recomputed anyway and whose
    readers in backward are cheap ops or recomputed ones (a matmul's backward would need it
    materialized: it is kept); an embedding's too where only recomputed ops read it. One at a
    time, in graph order, until none is left."""
    dropped = True
    while dropped:
        dropped = False
        for value in sorted(readers, key=_position):
            cheap = op_kind(value) in _CHEAP and readers[value] <= _CHEAP | {_RECOMPUTING} or \
                op_kind(value) in _GATHERS and readers[value] == {_RECOMPUTING}
            if cheap and not (checkpointing and value.meta.get("recompute") == CheckpointPolicy.MUST_SAVE) \
                    and all(storage(i) in readers or storage(i) in recomputed or storage(i).op in _HELD
                            for i in value.all_input_nodes):
                del readers[value]
                dropped = True


def _position(node: fx.Node) -> int:
    return list(node.graph.nodes).index(node)


def _needing_grad(gm: fx.GraphModule) -> dict[fx.Node, bool]:
    """Whether autograd wants each node's gradient: as capture marked it (``meta["requires_grad"]``),
    or, for an op a later pass inserted, where an input's is wanted."""
    grad: dict[fx.Node, bool] = {}
    for node in gm.graph.nodes:
        marked = node.meta.get("requires_grad")
        grad[node] = marked if marked is not None else any(grad.get(i, False) for i in node.all_input_nodes)
    return grad


def _read_by_backward(node: fx.Node, grad: dict[fx.Node, bool]) -> list[fx.Node]:
    """The values ``node``'s backward reads."""
    kind = op_kind(node)
    ins = node.all_input_nodes  # the rank's graph keeps no values to tell tensors from sizes by: a size counts nothing
    if node.op not in ("call_function", "call_method") or kind in _ALIASING or not ins:
        return []
    if kind in _ALL_INPUTS:
        return ins
    if kind in _FACTORS:
        return [i for i in ins if any(grad.get(other, False) for other in ins if other is not i)]
    if kind == "unary" and node.target in _OUTPUT_READING_UNARY:
        return [node]
    if kind in _FIRST_INPUT:
        name = getattr(node.target, "__name__", node.target)
        return [] if kind == "reduce" and name in _NOTHING_READ else ins[:1]
    if kind == "hybrid_attention":  # over Ulysses it keeps copies of its own; tagged to be kept, q, k and v too
        kept = node.meta.get("recompute") in (CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_SAVE)
        return ([] if _mesh_dims(node)[0] > 1 else [node, ins[0]]) + (ins[:3] if kept else [])
    if kind in _OUTPUT:
        return [node] + (ins[:3] if kind != "softmax" else [])
    if kind == "dropout":
        return [node]  # its mask, counted at its output's size
    if kind is not None or node.target in C.COMMUNICATION or node.target in _IDENTITIES:
        return []  # add, sub, cast, cat...: their backward reads no value; a collective's neither
    return ins  # an op the planner has no rule for: every input, to be safe


def storage(value: fx.Node) -> fx.Node:
    """The op that made ``value``'s storage: through views, and identities inserted in forward."""
    while (op_kind(value) in _ALIASING or value.target in _IDENTITIES or value.target is operator.getitem) \
            and value.all_input_nodes:
        value = value.all_input_nodes[0]
    return value


def _bytes(node: fx.Node) -> int:
    """This rank's bytes of ``node``'s output: planned (``meta.work``), or for an inserted op
    that communicates what it gives (its gradient's size)."""
    done = work(node)
    if done is not None:
        return done.out_bytes
    comms = communications(node)
    return comms[-1].backward_bytes if comms else 0


def _mesh_dims(attention: fx.Node) -> tuple[int, int]:
    """(ulysses, ring) sizes of a hybrid attention."""
    return attention.kwargs["ulysses"].size, attention.kwargs["ring"].size


def _attention_own_bytes(attention: fx.Node) -> int:
    """What attention keeps beyond the graph's values its backward reads: its float32
    log-sum-exp, and a hybrid attention what it makes inside (``ops.attention``): over Ulysses q
    and its output in the heads layout; over a ring of R ranks the R key/value blocks it saw,
    else k and v repeated to the query heads, as SDPA keeps them."""
    done, shape = work(attention), global_shape(attention)
    if done is None or not shape:
        return 0
    itemsize = getattr(torch, done.dtype).itemsize
    lse = done.out_bytes // itemsize // shape[-1] * 4
    if op_kind(attention) != "hybrid_attention":
        return lse
    q, k, v = attention.args[:3]
    share = done.out_bytes / (math.prod(shape) * itemsize)  # q, k and v are cut as the output is

    def local(x: fx.Node) -> int:
        return round(math.prod(global_shape(x)) * itemsize * share)

    ulysses, ring = _mesh_dims(attention)
    own = local(q) + done.out_bytes if ulysses > 1 else 0
    groups = global_shape(q)[1] // global_shape(k)[1]
    return lse + own + (ring * (local(k) + local(v)) if ring > 1 else groups * (local(k) + local(v)) if ulysses > 1 else 0)


def _random_ops(node: fx.Node) -> int:
    """How many random ops AOTAutograd traces from ``node``: a hybrid attention (which never
    drops out) one per ring step, where attention is traced as random without dropout."""
    kind = op_kind(node)
    if kind == "hybrid_attention":
        return _mesh_dims(node)[1] if _ATTENTION_ALWAYS_RANDOM else 0
    if kind == "sdpa" and not _ATTENTION_ALWAYS_RANDOM:
        return int(bool(arguments(node)["dropout_p"]))
    return int(kind in _RANDOM)
