"""The placement rule of every op a transformer graph holds, for one mesh dim.

A rule sees the placements its tensor inputs arrive with and returns a ``NodeSharding``:
the placement each input must have (localize inserts the collective where it differs) and
the placement of the output. Ops without a rule, or whose sharded dim the rule cannot keep,
get their inputs gathered (Replicate), with a warning naming the node: never a guess.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.fx as fx

from ..placements import InterleavedShard, Partial, Placement, Replicate, Shard, is_padded, parts_of, shard_dim
from ..symbolic import is_symbolic
from .patterns import arg, op_kind, tensor_val

R = Replicate()


@dataclass(frozen=True)
class NodeSharding:
    """Planned placements of one node on one mesh dim (``node.meta["dtensor_par"][dim]``)."""

    out: Placement | tuple[Placement, ...] | None  # a tuple for ops returning several tensors
    inputs: tuple[Placement, ...]  # required placement of each tensor input (``tensor_inputs`` order)
    note: str | None = None  # why the node was gathered, if it was


@dataclass
class RuleEnv:
    dim: str  # the mesh dim planned: "tp" or "cp"
    size: int
    input_placements: dict[str, Placement]  # placeholder name -> placement (others Replicate)
    sequence_parallel: bool
    chunks_per_rank: int = 1  # 2 for cp's zigzag layout

    def padded(self, length: int) -> bool:
        """Whether a dim of this length is laid out padded when sharded here. Only cp pads (an
        uneven sequence); ``check_divisible`` refuses uneven tp shards."""
        return is_padded(length, self.size, self.chunks_per_rank)

    def out_of(self, node: fx.Node):
        return node.meta["dtensor_par"][self.dim].out

    def reduce_target(self, node: fx.Node) -> Placement:
        """Where a Partial goes when an op cannot take it: Replicate, or the sequence shard
        (the dim before the hidden dim) under Megatron sequence parallelism."""
        val = tensor_val(node)
        if self.sequence_parallel and val.dim() >= 2 and val.shape[-2] % self.size == 0:
            return Shard(val.dim() - 2)
        return R


def tensor_inputs(node: fx.Node) -> list[fx.Node]:
    found = []
    fx.node.map_arg((node.args, node.kwargs), lambda n: found.append(n) if tensor_val(n) is not None else None)
    return found


def moved(p: Placement, dim: int) -> Placement:
    """The same kind of shard (parts included) along another dim."""
    return InterleavedShard(dim, p.parts) if isinstance(p, InterleavedShard) else Shard(dim)


def _norm_dim(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


def replicate_all(node: fx.Node, ins: list[fx.Node], cur: list[Placement], why: str | None = None) -> NodeSharding:
    out = tuple(R for _ in node.meta["val"]) if isinstance(node.meta.get("val"), (tuple, list)) else R
    gathered = any(p != R for p in cur)
    return NodeSharding(out, tuple(R for _ in ins), (why or "no sharding rule") if gathered else None)


def _resolve_partial(ins, cur, env: RuleEnv) -> list[Placement]:
    return [env.reduce_target(i) if isinstance(p, Partial) else p for i, p in zip(ins, cur)]


# --- pointwise ------------------------------------------------------------------------

def _partial_passes(node: fx.Node, ins: list[fx.Node], cur: list[Placement]) -> bool:
    """Whether the op is linear in its Partial inputs, so partial sums stay partial sums."""
    kind = op_kind(node)
    partial = [i for i, p in zip(ins, cur) if isinstance(p, Partial)]
    others_replicated = all(p == R for p in cur if not isinstance(p, Partial))
    if kind in ("neg", "cast"):
        return partial == [node.args[0]] and others_replicated
    if kind in ("add", "sub"):
        operands = node.args[:2]
        return all(isinstance(a, fx.Node) and a in partial for a in operands)
    if kind == "mul":
        return len(partial) == 1 and others_replicated
    if kind == "div":
        return partial == [node.args[0]] and others_replicated
    return False


def pointwise_rule(node, ins, cur, env):
    if any(isinstance(p, Partial) for p in cur):
        if _partial_passes(node, ins, cur):
            return NodeSharding(Partial(), tuple(cur))
        cur = _resolve_partial(ins, cur, env)
    out_val = tensor_val(node)
    target = None
    for i, p in zip(ins, cur):
        if shard_dim(p) is not None:
            target = moved(p, p.dim + out_val.dim() - tensor_val(i).dim())
            break
    if target is None:
        return NodeSharding(R, tuple(R for _ in ins))
    expected = []
    for i in ins:
        val = tensor_val(i)
        d = target.dim - (out_val.dim() - val.dim())
        broadcast = d < 0 or (val.shape[d] == 1 and out_val.shape[target.dim] != 1)
        expected.append(R if broadcast else moved(target, d))
    return NodeSharding(target, tuple(expected))


# --- shapes ---------------------------------------------------------------------------

def _view_groups(src: tuple[int, ...], dst: tuple[int, ...]) -> list[tuple[list[int], list[int]]]:
    """Pair runs of source and destination dims whose sizes have equal products."""
    groups, i, j = [], 0, 0
    while i < len(src) and j < len(dst):
        gi, gj, pi, pj = [i], [j], src[i], dst[j]
        i, j = i + 1, j + 1
        while pi != pj:
            if pi < pj:
                gi.append(i); pi *= src[i]; i += 1
            else:
                gj.append(j); pj *= dst[j]; j += 1
        groups.append((gi, gj))
    if groups:  # trailing size-1 dims join the last group
        groups[-1][0].extend(range(i, len(src)))
        groups[-1][1].extend(range(j, len(dst)))
    return groups


def view_target(src: tuple[int, ...], dst: tuple[int, ...], p: Placement, size: int) -> Placement | None:
    """Placement of a view's output given its input's, or None when no shard survives."""
    for gi, gj in _view_groups(src, dst):
        if p.dim not in gi:
            continue
        if any(src[d] != 1 for d in gi[:gi.index(p.dim)]):
            return None  # the shard is not the outermost dim of its run
        outer = [d for d in gj if dst[d] != 1]
        if not outer:
            return None
        if isinstance(p, InterleavedShard):
            if dst[outer[0]] == src[p.dim]:
                return InterleavedShard(outer[0], p.parts)
            if dst[outer[0]] == len(p.parts) and len(set(p.parts)) == 1 and len(outer) > 1:
                return Shard(outer[1]) if dst[outer[1]] % size == 0 else None
            return None
        keeps_length = dst[outer[0]] == src[p.dim]  # the shard's layout is the input's: even or padded
        return Shard(outer[0]) if keeps_length or dst[outer[0]] % size == 0 else None
    return None


def view_rule(node, ins, cur, env):
    p = cur[0]
    if shard_dim(p) is None:
        return NodeSharding(p, tuple(cur))
    src, dst = tuple(tensor_val(ins[0]).shape), tuple(tensor_val(node).shape)
    out = view_target(src, dst, p, env.size)
    if out is not None and env.padded(src[p.dim]) and dst[out.dim] != src[p.dim]:
        out = None  # the padding sits at the end of the sharded dim, not of a merged one
    if out is None:
        return replicate_all(node, ins, cur, f"view {list(src)} -> {list(dst)} splits the sharded dim {p.dim}")
    return NodeSharding(out, tuple(cur))


def expand_rule(node, ins, cur, env):
    p = cur[0]
    if shard_dim(p) is None:
        return NodeSharding(p, tuple(cur))
    offset = tensor_val(node).dim() - tensor_val(ins[0]).dim()
    return NodeSharding(moved(p, p.dim + offset), tuple(cur))


def repeat_interleave_rule(node, ins, cur, env):
    """Each element repeated in place: the shard of the repeated tensor is the repeated shard."""
    p, dim = cur[0], arg(node, 2, "dim")
    if len(ins) != 1 or dim is None:
        return replicate_all(node, ins, cur, "repeat_interleave of a flattened tensor or with tensor repeats")
    repeated = shard_dim(p) == _norm_dim(dim, tensor_val(ins[0]).dim())
    if repeated and isinstance(p, InterleavedShard):
        return replicate_all(node, ins, cur, "repeat_interleave along an interleaved dim")
    if repeated and env.padded(tensor_val(ins[0]).shape[p.dim]):
        return replicate_all(node, ins, cur, "repeat_interleave along the padded sequence dim")
    return NodeSharding(p, (p,))


def _dim_order(node: fx.Node, ndim: int) -> list[int]:
    """Output dim i comes from input dim order[i]."""
    if op_kind(node) == "transpose":
        if node.target in ("t", torch.t):
            return list(reversed(range(ndim)))
        a, b = (_norm_dim(d, ndim) for d in (arg(node, 1, "dim0"), arg(node, 2, "dim1")))
        order = list(range(ndim))
        order[a], order[b] = order[b], order[a]
        return order
    dims = node.args[1:] if len(node.args) > 2 or isinstance(node.args[1], int) else node.args[1]
    if not dims:
        dims = node.kwargs["dims"]
    return [_norm_dim(d, ndim) for d in dims]


def permute_rule(node, ins, cur, env):
    p = cur[0]
    if shard_dim(p) is None:
        return NodeSharding(p, tuple(cur))
    order = _dim_order(node, tensor_val(ins[0]).dim())
    return NodeSharding(moved(p, order.index(p.dim)), tuple(cur))


def _static_slice(e) -> bool:
    """A slice whose bounds are Python ints or None (not sizes computed in the graph)."""
    return isinstance(e, slice) and all(isinstance(v, (int, type(None))) for v in (e.start, e.stop, e.step))


def _whole(e: slice, size: int) -> bool:
    """Whether a slice keeps every position of a dim of ``size`` (``x[:, 0:]`` as ``x[:, :]``);
    of a symbolic size, only when it does for every value (asking would pin the plan to one)."""
    if is_symbolic(size):
        return e.start in (None, 0) and e.stop is None and e.step in (None, 1)
    return e.indices(size) == (0, size, 1)


def complex_rule(node, ins, cur, env):
    """``view_as_complex`` folds the last dim (the real/imaginary pair), ``view_as_real``
    unfolds it: a shard of any other dim stays where it is."""
    p = _resolve_partial(ins, cur, env)[0]
    if shard_dim(p) is not None and p.dim == tensor_val(ins[0]).dim() - 1:
        return replicate_all(node, ins, [p], "view_as_complex of the sharded last dim")
    return NodeSharding(p, (p,))


def pad_rule(node, ins, cur, env):
    """``F.pad`` pads trailing dims: a shard of an unpadded dim stays where it is."""
    p = _resolve_partial(ins, cur, env)[0]
    widths = arg(node, 1, "pad")
    ndim = tensor_val(ins[0]).dim()
    padded = {ndim - 1 - i // 2 for i, w in enumerate(widths) if w}
    if shard_dim(p) is not None and p.dim in padded:
        return replicate_all(node, ins, [p], f"padding of the sharded dim {p.dim}")
    return NodeSharding(p, (p,))


def _index_map(index, shape: tuple[int, ...]) -> dict[int, int] | None:
    """Input dim -> output dim for the dims a basic index keeps whole; None if not basic."""
    ndim = len(shape)
    entries = index if isinstance(index, tuple) else (index,)
    consumed = sum(1 for e in entries if e is not None and e is not Ellipsis)
    kept, src, dst = {}, 0, 0
    for e in entries:
        if e is None:
            dst += 1
        elif e is Ellipsis:
            for _ in range(ndim - consumed):
                kept[src] = dst; src += 1; dst += 1
        elif isinstance(e, int):
            src += 1
        elif isinstance(e, slice):
            if _static_slice(e) and _whole(e, shape[src]):
                kept[src] = dst
            src += 1; dst += 1
        else:
            return None
    for s in range(src, ndim):
        kept[s] = dst; dst += 1
    return kept


def getitem_rule(node, ins, cur, env):
    source = node.args[0]
    if isinstance(source.meta.get("val"), (tuple, list)):
        return NodeSharding(env.out_of(source)[node.args[1]], ())
    kept = _index_map(node.args[1], tuple(tensor_val(source).shape))
    if kept is None or len(ins) != 1:
        return replicate_all(node, ins, cur, "advanced indexing")
    p = cur[0]
    if isinstance(p, Partial) or p == R:
        return NodeSharding(p, (p,))
    if p.dim not in kept:
        kept_parts = sliced_part_range(node, p)
        if kept_parts is None:
            return replicate_all(node, ins, cur, f"indexing into the sharded dim {p.dim}")
        parts = p.parts[kept_parts[0]:kept_parts[1]]
        out_dim = p.dim - sum(1 for e in per_dim(node.args[1], tensor_val(source).dim())[:p.dim] if isinstance(e, int))
        return NodeSharding(Shard(out_dim) if len(parts) == 1 else InterleavedShard(out_dim, parts), (p,))
    return NodeSharding(moved(p, kept[p.dim]), (p,))


def per_dim(index, ndim: int) -> list | None:
    """One entry per input dim (Ellipsis spelled out), or None when the index adds dims."""
    entries = list(index if isinstance(index, tuple) else (index,))
    if any(e is None for e in entries):
        return None
    if Ellipsis in entries:
        at = entries.index(Ellipsis)
        entries[at:at + 1] = [slice(None)] * (ndim - len(entries) + 1)
    return entries + [slice(None)] * (ndim - len(entries))


def sliced_part_range(node: fx.Node, p: Placement) -> tuple[int, int] | None:
    """``(first, stop)``: the parts an index keeps, ``p.parts[first:stop]``, when it slices
    whole parts off an InterleavedShard dim (``qkv[..., :q_size]`` of a fused projection;
    ``x[:, text_len:]`` of a joint sequence)."""
    entries = per_dim(node.args[1], tensor_val(node.args[0]).dim())
    if not isinstance(p, InterleavedShard) or entries is None or not _static_slice(entries[p.dim]):
        return None
    start, stop, step = entries[p.dim].indices(sum(p.parts))
    bounds = [sum(p.parts[:i]) for i in range(len(p.parts) + 1)]
    if step != 1 or start not in bounds or stop not in bounds or start >= stop:
        return None
    return bounds.index(start), bounds.index(stop)


def split_dim(node: fx.Node) -> int:
    return _norm_dim(arg(node, 2, "dim", 0), tensor_val(node.args[0]).dim())


def split_rule(node, ins, cur, env):
    p, pieces = cur[0], node.meta["val"]
    if shard_dim(p) is None:
        return NodeSharding(tuple(p for _ in pieces), (p,))
    dim = split_dim(node)
    if p.dim != dim:
        return NodeSharding(tuple(p for _ in pieces), (p,))
    sizes = tuple(t.shape[dim] for t in pieces)
    if isinstance(p, InterleavedShard) and p.parts == sizes:
        return NodeSharding(tuple(Shard(dim) for _ in pieces), (p,))
    return replicate_all(node, ins, cur, f"split {list(sizes)} of the sharded dim {dim}")


def unbind_rule(node, ins, cur, env):
    p, pieces = cur[0], node.meta["val"]
    dim = _norm_dim(arg(node, 1, "dim", 0), tensor_val(ins[0]).dim())
    if shard_dim(p) is None:
        return NodeSharding(tuple(p for _ in pieces), (p,))
    if p.dim == dim:
        return replicate_all(node, ins, cur, f"unbind of the sharded dim {dim}")
    out = moved(p, p.dim - 1) if p.dim > dim else p
    return NodeSharding(tuple(out for _ in pieces), (p,))


def cat_dim(node: fx.Node) -> int:
    return _norm_dim(arg(node, 1, "dim", 0), tensor_val(node).dim())


def cat_rule(node, ins, cur, env):
    """Empty inputs (an empty kv cache: ``cat([torch.tensor([]), k])``) add nothing and stay
    as they are; the others must share one placement, sharded off the concatenated dim."""
    stack = op_kind(node) == "stack"
    dim = cat_dim(node)
    empty = [not stack and tensor_val(i).numel() == 0 for i in ins]
    real = [(i, p) for i, p, e in zip(ins, cur, empty) if not e]
    as_given = lambda required: tuple(p if e else required for p, e in zip(cur, empty))  # noqa: E731
    if all(isinstance(p, Partial) for _, p in real):
        return NodeSharding(Partial(), tuple(cur))
    resolved = _resolve_partial([i for i, _ in real], [p for _, p in real], env)
    sharded = [p for p in resolved if shard_dim(p) is not None]
    if not sharded:
        return NodeSharding(R, as_given(R))
    p = sharded[0]
    if len(real) == 1:  # nothing but empties beside it: the concatenation is the tensor itself
        return NodeSharding(p, as_given(p))
    out_dim = p.dim + 1 if stack and p.dim >= dim else p.dim
    if not stack and p.dim == dim:
        if any(q != Shard(dim) for q in resolved):
            return replicate_all(node, ins, cur, f"concatenation along the sharded dim {dim}")
        # Each rank concatenates its piece of every input: its piece of every part (a joint
        # text + image sequence, an attention output beside an MLP branch).
        return NodeSharding(InterleavedShard(dim, tuple(tensor_val(i).shape[dim] for i, _ in real)),
                            as_given(Shard(dim)))
    return NodeSharding(moved(p, out_dim), as_given(p))


# --- contractions ---------------------------------------------------------------------

def linear_rule(node, ins, cur, env):
    x_p, w_p = cur[0], cur[1]
    has_bias = len(ins) == 3
    ndim = tensor_val(node).dim()
    if shard_dim(w_p) == 0:  # colwise: full input, this rank's output features
        return NodeSharding(moved(w_p, ndim - 1), (R, w_p) + ((moved(w_p, 0),) if has_bias else ()))
    if shard_dim(w_p) == 1:  # rowwise: this rank's input features, partial sums out
        if has_bias:
            raise AssertionError(f"{node.name}: rowwise linear must have its bias split off by rewrite_pass")
        return NodeSharding(Partial(), (moved(w_p, ndim - 1), w_p))
    if isinstance(x_p, Partial) and not has_bias:
        return NodeSharding(Partial(), (x_p, R))
    x_p = _resolve_partial(ins[:1], [x_p], env)[0]
    if shard_dim(x_p) is not None and x_p.dim != tensor_val(ins[0]).dim() - 1:
        return NodeSharding(x_p, (x_p, R) + ((R,) if has_bias else ()))
    return replicate_all(node, ins, [x_p, w_p] + cur[2:], "linear over the sharded feature dim")


def matmul_rule(node, ins, cur, env):
    a, b = ins
    if tensor_val(a).dim() < 2 or tensor_val(b).dim() < 2:
        return replicate_all(node, ins, cur, "matmul of a vector")
    pa, pb = cur
    if isinstance(pa, Partial) != isinstance(pb, Partial) and R in (pa, pb):
        return NodeSharding(Partial(), (pa, pb))
    pa, pb = _resolve_partial(ins, cur, env)
    nd_out, nd_a, nd_b = tensor_val(node).dim(), tensor_val(a).dim(), tensor_val(b).dim()
    contracted = tensor_val(a).shape[-1]
    if env.padded(contracted) and (shard_dim(pa) == nd_a - 1 or shard_dim(pb) == nd_b - 2):
        return replicate_all(node, ins, [pa, pb], "contraction over the padded sequence dim")
    if shard_dim(pa) is not None and not isinstance(pa, InterleavedShard):
        if pa.dim == nd_a - 1:  # contraction dim
            return NodeSharding(Partial(), (pa, Shard(nd_b - 2)))
        if pa.dim == nd_a - 2:
            return NodeSharding(Shard(nd_out - 2), (pa, R))
        d_out = pa.dim + nd_out - nd_a  # a batch dim: the other operand must match it
        d_b = d_out - (nd_out - nd_b)
        pb_need = R if d_b < 0 or tensor_val(b).shape[d_b] == 1 else Shard(d_b)
        return NodeSharding(Shard(d_out), (pa, pb_need))
    if shard_dim(pb) is not None and not isinstance(pb, InterleavedShard):
        if pb.dim == nd_b - 1:
            return NodeSharding(Shard(nd_out - 1), (R, pb))
        if pb.dim == nd_b - 2:
            return NodeSharding(Partial(), (Shard(nd_a - 1), pb))
        d_out = pb.dim + nd_out - nd_b
        d_a = d_out - (nd_out - nd_a)
        pa_need = R if d_a < 0 or tensor_val(a).shape[d_a] == 1 else Shard(d_a)
        return NodeSharding(Shard(d_out), (pa_need, pb))
    return replicate_all(node, ins, [pa, pb], "matmul of an interleaved operand")


def sdpa_rule(node, ins, cur, env):
    """Attention is independent per batch entry and per head: shard either, gather the rest."""
    cur = _resolve_partial(ins, cur, env)
    q_val = tensor_val(ins[0])
    nd = q_val.dim()
    batch_like = set(range(nd - 2))
    chosen = next((p for p in cur[:3] if isinstance(p, Shard) and p.dim in batch_like), None)
    if chosen is None:
        return replicate_all(node, ins, cur, "attention sharded along the sequence or head dim")
    expected = []
    for i in ins:
        val = tensor_val(i)
        d = chosen.dim - (nd - val.dim())
        broadcast = d < 0 or val.shape[d] == 1
        expected.append(R if broadcast else Shard(d))
    return NodeSharding(chosen, tuple(expected))


def hybrid_attention_rule(node, ins, cur, env):
    """Heads split on tp as for SDPA; on cp q, k, v and the output are sequence shards and a
    mask is whole (each ring block takes its rows and columns).

    A joint sequence (text and image tokens, each sharded on its own and concatenated per
    rank) stays as it is when nothing depends on token order (no mask, not causal): every
    rank then holds its slice of each part, and attention over a permuted sequence is the
    same attention, permuted alike.
    """
    if env.dim != "cp":
        return sdpa_rule(node, ins, cur, env)
    seq_dim = tensor_val(ins[0]).dim() - 2
    joint = cur[0]
    if (isinstance(joint, InterleavedShard) and joint.dim == seq_dim and cur[1] == joint and cur[2] == joint
            and len(ins) == 3 and not node.kwargs.get("is_causal")):
        return NodeSharding(joint, (joint, joint, joint))
    seq = Shard(seq_dim)
    return NodeSharding(seq, (seq, seq, seq) + (R,) * (len(ins) - 3))


# --- normalizations and reductions ------------------------------------------------------

def norm_rule(node, ins, cur, env):
    cur = _resolve_partial(ins, cur, env)
    x_p, ndim = cur[0], tensor_val(ins[0]).dim()
    normalized = len(arg(node, 1, "normalized_shape"))
    if shard_dim(x_p) is not None and x_p.dim < ndim - normalized:
        return NodeSharding(x_p, (x_p,) + tuple(R for _ in ins[1:]))
    return replicate_all(node, ins, cur, "normalization over the sharded dim")


def softmax_rule(node, ins, cur, env):
    cur = _resolve_partial(ins, cur, env)
    p, ndim = cur[0], tensor_val(ins[0]).dim()
    if shard_dim(p) is not None and p.dim != _norm_dim(arg(node, 1, "dim"), ndim):
        return NodeSharding(p, (p,))
    return replicate_all(node, ins, cur, "softmax over the sharded dim")


def reduce_rule(node, ins, cur, env):
    p, ndim = cur[0], tensor_val(ins[0]).dim()
    dims = arg(node, 1, "dim")
    reduced = set(range(ndim)) if dims is None else {_norm_dim(d, ndim) for d in
                                                     (dims if isinstance(dims, (tuple, list)) else [dims])}
    keepdim = arg(node, 2, "keepdim", False)
    if isinstance(p, Partial) and node.target in ("sum", "mean", torch.sum, torch.mean):
        return NodeSharding(p, (p,))
    p = _resolve_partial(ins, cur, env)[0]
    if shard_dim(p) is None or p.dim in reduced:
        return replicate_all(node, ins, [p], "reduction over the sharded dim")
    out_dim = p.dim if keepdim else p.dim - sum(1 for d in reduced if d < p.dim)
    return NodeSharding(moved(p, out_dim), (p,))


def embedding_rule(node, ins, cur, env):
    ids_p, w_p = cur
    if w_p != R or isinstance(ids_p, Partial):
        return replicate_all(node, ins, cur, "sharded embedding table")
    return NodeSharding(ids_p, (ids_p, R))


RULES: dict[str, Callable[..., NodeSharding]] = {
    **{k: pointwise_rule for k in ("add", "sub", "mul", "div", "neg", "unary", "cast", "where", "logical")},
    "view": view_rule, "expand": expand_rule, "repeat_interleave": repeat_interleave_rule, "transpose": permute_rule, "permute": permute_rule,
    "getitem": getitem_rule, "split": split_rule, "unbind": unbind_rule, "cat": cat_rule, "stack": cat_rule,
    "linear": linear_rule, "matmul": matmul_rule, "sdpa": sdpa_rule, "hybrid_attention": hybrid_attention_rule,
    "norm": norm_rule, "softmax": softmax_rule, "reduce": reduce_rule, "embedding": embedding_rule,
    "complex": complex_rule, "pad": pad_rule,
}


def _fits(p: Placement, val: torch.Tensor, env: RuleEnv) -> bool:
    d = shard_dim(p)
    if d is None or (env.dim == "cp" and isinstance(p, Shard)):
        return True  # cp pads a sequence that does not divide
    if env.dim == "cp":  # the parts of a joint sequence: each laid out unpadded
        return not any(env.padded(part) for part in p.parts)
    return all(part % env.size == 0 for part in parts_of(p, val.shape[d]))


def check_divisible(node: fx.Node, ins: list[fx.Node], sharding: NodeSharding, env: RuleEnv) -> str | None:
    """Why a planned placement cannot be laid out evenly, if it cannot."""
    outs = sharding.out if isinstance(sharding.out, tuple) else (sharding.out,)
    vals = node.meta["val"] if isinstance(node.meta.get("val"), (tuple, list)) else (node.meta.get("val"),)
    for p, val in list(zip(outs, vals)) + list(zip(sharding.inputs, (tensor_val(i) for i in ins))):
        if isinstance(val, torch.Tensor) and shard_dim(p) is not None and shard_dim(p) >= val.dim():
            return f"{p} of a tensor of shape {list(val.shape)} names no dim of it"
        if isinstance(val, torch.Tensor) and not _fits(p, val, env):
            return f"{p} of a tensor of shape {list(val.shape)} does not divide by {env.size}"
    return None
