"""Contractions: linear (colwise, rowwise, or over a sharded batch or sequence), matmul, einsum,
and convolutions over a sharded batch or spatial dim."""

from __future__ import annotations

import math
import operator

import torch
import torch.fx as fx

from ...mesh import MeshInfo
from ...ops.collectives import every_rank_positions
from ...ops.halo import halo_conv, halo_plan, padded_conv1d
from ...placements import InterleavedShard, Partial, Shard, shard_dim
from ...symbolic import hint
from ..meta import Communication, NodeSharding, global_shape, planned_local_shape, set_communications, shardings, site_role
from ..nodes import arguments, tensor_val
from .core import R, moved, replicate_all, resolve_partial
from .registry import op_kind, register


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
    x_p = resolve_partial(ins[:1], [x_p], env)[0]
    if shard_dim(x_p) is not None and x_p.dim != tensor_val(ins[0]).dim() - 1:
        return NodeSharding(x_p, (x_p, R) + ((R,) if has_bias else ()))
    return replicate_all(node, ins, [x_p, w_p] + cur[2:], "linear over the sharded feature dim")


def _has_rule(p, contracted: int) -> bool:
    """Whether a matmul operand's shard has a rule: a shard of any dim, or an interleaved one of
    any but the contracted dim (Bloom's heads folded into the batch: each rank's heads of every
    batch entry; Llama 4's tokens tiled per expert as rows)."""
    return shard_dim(p) is not None and not (isinstance(p, InterleavedShard) and p.dim == contracted)


def matmul_rule(node, ins, cur, env):
    a, b = ins
    if tensor_val(a).dim() < 2 or tensor_val(b).dim() < 2:
        return replicate_all(node, ins, cur, "matmul of a vector")
    pa, pb = cur
    if isinstance(pa, Partial) != isinstance(pb, Partial) and R in (pa, pb):
        return NodeSharding(Partial(), (pa, pb))
    pa, pb = resolve_partial(ins, cur, env)
    nd_out, nd_a, nd_b = tensor_val(node).dim(), tensor_val(a).dim(), tensor_val(b).dim()
    contracted = tensor_val(a).shape[-1]
    if env.padded(contracted) and (shard_dim(pa) == nd_a - 1 or shard_dim(pb) == nd_b - 2):
        return replicate_all(node, ins, [pa, pb], "contraction over the padded sequence dim")
    if _has_rule(pa, nd_a - 1):
        if pa.dim == nd_a - 1:  # contraction dim
            return NodeSharding(Partial(), (pa, Shard(nd_b - 2)))
        if pa.dim == nd_a - 2:
            return NodeSharding(moved(pa, nd_out - 2), (pa, R))
        d_out = pa.dim + nd_out - nd_a  # a batch dim: the other operand must match it
        d_b = d_out - (nd_out - nd_b)
        pb_need = R if d_b < 0 or tensor_val(b).shape[d_b] == 1 else moved(pa, d_b)
        return NodeSharding(moved(pa, d_out), (pa, pb_need))
    if _has_rule(pb, nd_b - 2):
        if pb.dim == nd_b - 1:
            return NodeSharding(moved(pb, nd_out - 1), (R, pb))
        if pb.dim == nd_b - 2:
            return NodeSharding(Partial(), (Shard(nd_a - 1), pb))
        d_out = pb.dim + nd_out - nd_b
        d_a = d_out - (nd_out - nd_a)
        pa_need = R if d_a < 0 or tensor_val(a).shape[d_a] == 1 else moved(pb, d_a)
        return NodeSharding(moved(pb, d_out), (pa_need, pb))
    return replicate_all(node, ins, [pa, pb], "matmul contracting an interleaved dim")


def solve_triangular_rule(node, ins, cur, env):
    """``linalg.solve_triangular(A, B)`` solves each batch entry's system alone and each column
    of B alone (each row, ``left=False``), and is linear in B (Qwen3-Next's gated delta rule, per
    head). A cut batch dim stays cut, the other operand cut alike (whole where it broadcasts);
    B's columns cut stay cut with A whole; partial sums of B give partial sums. A cut of the
    system itself is gathered."""
    (a, b), nd = ins, tensor_val(node).dim()
    if isinstance(cur[1], Partial) and cur[0] == R:
        return NodeSharding(Partial(), (R, cur[1]))
    pa, pb = resolve_partial(ins, cur, env)
    columns = nd - 1 if arguments(node).get("left", True) else nd - 2

    def alike(operand, d_out, p):
        d = d_out - (nd - tensor_val(operand).dim())
        return R if d < 0 or tensor_val(operand).shape[d] == 1 else moved(p, d)
    for operand, p in ((b, pb), (a, pa)):
        if shard_dim(p) is None:
            continue
        d_out = p.dim + nd - tensor_val(operand).dim()
        if d_out < nd - 2:
            return NodeSharding(moved(p, d_out), (alike(a, d_out, p), alike(b, d_out, p)))
        if operand is b and d_out == columns:
            return NodeSharding(p, (R, p))
    return replicate_all(node, ins, [pa, pb], "a triangular solve over a cut dim of its system")


def _einsum_subscripts(node, ins) -> tuple[list[str], str] | None:
    """``(["bhsd", "bhtd"], "bhst")`` for an explicit equation without repeated letters in one
    operand, its ``...`` spelled out in letters of their own (broadcast from the right, as
    einsum does); None otherwise."""
    given = arguments(node)  # torch.einsum(equation, *operands), or the operands as one list
    equation = (given["equation"] if "equation" in given else given["args"][0]).replace(" ", "")
    if "->" not in equation:
        return None
    inputs, output = equation.split("->")
    operands = inputs.split(",")
    if len(operands) != len(ins):
        return None
    spans = [tensor_val(i).dim() - len(s.replace("...", "")) if "..." in s else 0 for i, s in zip(ins, operands)]
    free = [c for c in "ABCDEFGHIJKLMNOPQRSTUVWXYZ" if c not in equation][:max(spans)]
    operands = [s.replace("...", "".join(free[len(free) - n:])) for s, n in zip(operands, spans)]
    output = output.replace("...", "".join(free))
    if any(len(set(s)) != len(s) for s in operands):
        return None
    return operands, output


def einsum_rule(node, ins, cur, env):
    """The letter of the first sharded operand's sharded dim stays sharded in every operand
    that has it (size-1 broadcast dims stay whole): in the output if it is kept there, else the
    contraction gives partial sums. Linear in each operand, so one Partial operand stays Partial."""
    subscripts = _einsum_subscripts(node, ins)
    if subscripts is None:
        return replicate_all(node, ins, cur, "einsum with a repeated index, an implicit output or a non-tensor operand")
    operands, output = subscripts
    if sum(isinstance(p, Partial) for p in cur) == 1 and all(p == R for p in cur if not isinstance(p, Partial)):
        return NodeSharding(Partial(), tuple(cur))
    cur = resolve_partial(ins, cur, env)
    sharded = next(((i, s, p) for i, s, p in zip(ins, operands, cur) if shard_dim(p) is not None), None)
    if sharded is None:
        return NodeSharding(R, tuple(cur))
    node_in, subscript, p = sharded
    letter = subscript[p.dim]
    length = tensor_val(node_in).shape[p.dim]
    if letter not in output and (isinstance(p, InterleavedShard) or env.padded(length)):
        return replicate_all(node, ins, cur, "einsum contracting an interleaved or padded dim")
    required = tuple(moved(p, s.index(letter)) if letter in s and tensor_val(i).shape[s.index(letter)] == length
                     else R for i, s in zip(ins, operands))
    out = moved(p, output.index(letter)) if letter in output else Partial()
    return NodeSharding(out, required)


def grouped_operands(node) -> tuple:
    """``(tokens [M, K], expert weights [E, K, N], offsets [E])`` of a grouped matmul, whatever
    its spelling names them (``input``/``mat2``, ``mat_a``/``mat_b``, ``input``/``weight``)."""
    given = arguments(node)
    tokens, weights = list(given.values())[:2]
    return tokens, weights, given.get("offs")


def grouped_mm_rule(node, ins, cur, env):
    """Tokens sorted by expert, expert ``e``'s rows ending at ``offs[e]``, each times its expert's
    weight: as a linear per expert. The experts' output features sharded (N) give sharded
    outputs (colwise), their input features (K) sharded partial sums (rowwise). Tokens cut
    along M are gathered here: their offsets would have to be their own (an expert dispatch
    run on each rank's tokens is planned as a whole: ``plan.token_local_sharding``)."""
    tokens, weights, _ = grouped_operands(node)
    if tensor_val(tokens).dim() != 2 or tensor_val(weights).dim() != 3:
        return replicate_all(node, ins, cur, "grouped matmul of other than tokens [M, K] and experts [E, K, N]")
    offsets = tuple(R for _ in ins[2:])  # tensor inputs in argument order: tokens, weights, offsets
    px, pw = cur[:2]
    if isinstance(px, Partial) and pw == R and offsets == tuple(cur[2:]):
        return NodeSharding(Partial(), (px, R) + offsets)
    px, pw = resolve_partial(ins[:2], cur[:2], env)
    if shard_dim(pw) == 2 and px == R:
        return NodeSharding(moved(pw, 1), (R, pw) + offsets)
    contracted = next((p for p in (pw, px) if shard_dim(p) == 1), None)
    if contracted is not None and all(p in (R, contracted) for p in (px, pw)) and arguments(node).get("bias") is None:
        return NodeSharding(Partial(), (contracted, contracted) + offsets)
    if px == pw == R:
        return NodeSharding(R, (R, R) + offsets)
    return replicate_all(node, ins, cur, "grouped matmul of tokens cut along their rows or experts cut")


def _spatial(node: fx.Node, dim: int) -> tuple[int, int, int, int] | None:
    """(kernel, stride, padding, dilation) of a convolution along spatial ``dim`` of its input;
    None for a padding given by name."""
    given, spatial = arguments(node), dim - 2
    kernel = tensor_val(given["weight"]).shape[dim]
    values = [given.get(name, default) for name, default in (("stride", 1), ("padding", 0), ("dilation", 1))]
    if any(isinstance(v, str) for v in values):
        return None
    return (kernel, *(v if isinstance(v, int) else v[spatial] for v in values))


def reach_of(node: fx.Node, dim: int) -> tuple[int, int, int] | None:
    """(rows read before a run, rows read after it, stride) of a convolution along spatial
    ``dim`` that turns any run of rows starting and ending on its stride into exactly its share
    of the output (``rows / stride``): dilation 1 and, with the padding ``p`` at both ends,
    ``kernel - stride <= 2p < kernel``; rows ``[a, a + L)`` give outputs ``[a / s, (a + L) / s)``,
    reading ``p`` rows before ``a`` and ``kernel - stride - p`` after. A 3 x 3 kernel padded by 1
    reads one row each side; a downsampling one of stride 2, one before; a patch embedding
    (kernel = stride, no padding), none; a causal one (``padded_conv1d``), ``kernel - 1`` before.
    None for any other."""
    if node.target is padded_conv1d:
        before, after = arguments(node)["pad"]
        kernel = tensor_val(arguments(node)["weight"]).shape[-1]
        return (before, kernel - 1 - before, 1) if before + after == kernel - 1 else None
    found = _spatial(node, dim)
    if found is None:
        return None
    kernel, stride, padding, dilation = found
    after = kernel - stride - padding
    return (padding, after, stride) if dilation == 1 and after >= 0 and kernel - stride <= 2 * padding < kernel \
        else None


def is_channelwise_conv(node: fx.Node) -> bool:
    """A depthwise convolution, each channel slid over by a kernel of its own (groups = channels
    in = channels out): it runs on any cut of the channels."""
    if op_kind(node) != "conv":
        return False
    weight = tensor_val(arguments(node)["weight"])
    return arguments(node).get("groups", 1) == weight.shape[0] and weight.shape[1] == 1


def _channels_rule(node, ins, cur) -> NodeSharding | None:
    """A convolution of an MLP site cut over tp along its channels (its weight placed by the
    plan): a pointwise one colwise (every input channel, this rank's output channels) or
    rowwise (this rank's input channels, partial sums out), a depthwise one on this rank's
    channels with their kernels, also where only its input's channels are cut (the kernels of
    a whole weight sliced: Qwen3-Next's convolution over its concatenated q, k and v); None
    for a weight not cut."""
    x_p, w_p = cur[0], cur[1]
    if shard_dim(w_p) is None and shard_dim(x_p) == 1 and is_channelwise_conv(node):
        w_p = moved(x_p, 0)
    bias = (moved(w_p, 0),) if len(ins) == 3 else ()
    if shard_dim(w_p) == 0 and is_channelwise_conv(node):
        return NodeSharding(moved(w_p, 1), (moved(w_p, 1), w_p) + bias)
    if shard_dim(w_p) == 0:
        return NodeSharding(moved(w_p, 1), (R, w_p) + bias)
    if shard_dim(w_p) == 1 and not bias:  # a rowwise bias is added after the sums: rewrite.split_rowwise_bias
        return NodeSharding(Partial(), (moved(w_p, 1), w_p))
    return None


def conv_rule(node, ins, cur, env):
    """A convolution (a DiT's patch embedding) runs on this rank's images of a batch cut over
    dp, and on this rank's rows of a spatial dim where each run of them gives its share of the
    output rows (``reach_of``: an image grid made of a sequence, Sana's feed-forward, a UNet's
    downsampling): a kernel of 1 there as it is, a wider one over cp with the rows it reads past
    each run (its halo) fetched from their ranks (``localize_conv``). An MLP
    site's are cut along their channels (``_channels_rule``). Any other cut mixes what it slides
    over or sums over channels: gathered. A partial sum in (a rowwise MLP's output) is summed
    first, as before a linear: the MLP's own all-reduce, not a fallback."""
    cut_channels = _channels_rule(node, ins, cur)
    if cut_channels is not None:
        return cut_channels
    x_p, params = R if isinstance(cur[0], Partial) else cur[0], cur[1:]
    if not isinstance(x_p, Shard) or x_p.dim == 1 or any(p != R for p in params):
        return replicate_all(node, ins, [x_p, *params], "a convolution runs split along its batch or rows, or an "
                                                        "MLP site's along its channels, only")
    if x_p.dim == 0:
        return NodeSharding(x_p, tuple(cur))
    rows, reach = tensor_val(ins[0]).shape[x_p.dim], reach_of(node, x_p.dim)
    if reach == (0, 0, 1) or (reach and (env.cuts_sequence or reach[:2] == (0, 0)) and _runs_fit(rows, reach, env)):
        return NodeSharding(x_p, tuple(cur))
    return replicate_all(node, ins, cur, f"a convolution over rows cut along dim {x_p.dim} (kernel, stride, padding, "
                                         f"dilation {_spatial(node, x_p.dim)}) that reads past a run of them "
                                         f"other than by its padding, or rows that do not divide into runs of its "
                                         f"stride each at least its reach long")


def _runs_fit(rows: int, reach: tuple[int, int, int], env) -> bool:
    """Whether every run of rows a rank holds starts and ends on the stride (so its outputs are
    the output's rows laid out alike, none padded) and is at least as long as the rows read past it.
    A causal one (stride 1, reading no row after) runs on a sequence padded to divide too: the
    padding sits at its end, where no real row reads it."""
    before, after, stride = reach
    chunks = env.size * env.chunks_per_rank
    if env.padded(rows) and (stride, after) == (1, 0):
        rows = -(-rows // chunks) * chunks
    return rows % (stride * chunks) == 0 and rows // chunks >= max(before, after)


def localize_conv(gm: fx.GraphModule, node: fx.Node, mesh: MeshInfo) -> None:
    """A depthwise convolution on this rank's channels has as many groups; a convolution whose
    kernel reads across the rows of a spatial dim cut over cp becomes ``halo_conv``: each run
    of rows with the halo rows of its neighbours."""
    given = arguments(node)
    groups = given.get("groups", 1)
    if groups > 1:  # a depthwise one's groups are its output channels
        given["groups"] = groups * planned_local_shape(node, mesh)[1] // global_shape(node)[1]
        node.args, node.kwargs = (), given
    cut = [(name, s.inputs[0].dim, reach) for name, s in shardings(node).items()
           if isinstance(s.inputs[0], Shard) and s.inputs[0].dim >= 2 and (reach := reach_of(node, s.inputs[0].dim))
           and reach[:2] != (0, 0)]
    if not cut:
        return
    (name, dim, (before, after, _)), = cut  # the rule keeps rows a kernel reads past cut over cp only
    mesh_dim = mesh.dims[name]
    rows = global_shape(given["input"])[dim]
    plan = halo_plan(every_rank_positions(rows, mesh_dim).tolist(), mesh_dim.rank)
    spatial = len(global_shape(node)) - 2
    stride, padding = (given.get(key, default) for key, default in (("stride", 1), ("padding", 0)))
    stride, padding = ((v,) * spatial if isinstance(v, int) else tuple(v) for v in (stride, padding))
    node.target = halo_conv
    node.args = (given["input"], given["weight"], given.get("bias"), stride, padding, given.get("groups", 1))
    node.kwargs = {"dim": dim, "reach": (before, after), "plan": plan, "mesh_dim": mesh_dim}
    edges = list(planned_local_shape(given["input"], mesh))
    edges[dim] = plan.runs * (before + after)
    nbytes = hint(math.prod(edges)) * tensor_val(given["input"]).element_size()
    # the backward reduce-scatters the gradient of every rank's edges: all of them go in
    set_communications(node, [Communication("all_gather", "reduce_scatter" if node.meta["requires_grad"] else None,
                                            name, mesh_dim.size, nbytes, nbytes * mesh_dim.size, site_role(node))])


register("conv", "matmul", conv_rule, functions=[torch.conv1d, torch.conv2d, torch.conv3d, padded_conv1d,
                                                  torch.nn.functional.conv1d, torch.nn.functional.conv2d,
                                                  torch.nn.functional.conv3d], localize=localize_conv)
register("linear", "matmul", linear_rule, functions=[torch._C._nn.linear, torch.nn.functional.linear])
register("matmul", "matmul", matmul_rule, functions=[operator.matmul, torch.matmul, torch.bmm],
         methods=["matmul", "bmm"])
register("einsum", "matmul", einsum_rule, functions=[torch.einsum])
register("solve_triangular", "matmul", solve_triangular_rule, functions=[torch.linalg.solve_triangular])
register("grouped_mm", "matmul", grouped_mm_rule, functions=[torch._grouped_mm, torch.nn.functional.grouped_mm],
         custom_ops=["transformers::grouped_mm_fallback", "dtensor_par::grouped_mm"])
