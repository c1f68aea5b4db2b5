"""Each op family's rule alone, on every placement its inputs can arrive with.

No process group: ranks are simulated. Each rank's inputs are cut from the global ones as
the rule requires them (a Partial input as random per-rank summands), the op runs on them,
and the rank outputs, put together as the rule's output placement says, must equal the op
on the global inputs. A rule that keeps a shard it cannot keep fails here.
"""

from __future__ import annotations

import itertools
import operator
from types import SimpleNamespace

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F

from dtensor_par.mesh import MeshDim
from dtensor_par.ops.attention import hybrid_attention
from dtensor_par.ops.experts import combine_rows, dispatch_rows, exchange_counts
from dtensor_par.ops.halo import HaloPlan, halo_plan, padded_conv1d
from dtensor_par.ops.recurrence import linear_recurrence
from dtensor_par.ops.vocab import vocab_rows_embedding
from dtensor_par.passes.meta import NodeSharding, set_global_shape, set_sharding
from dtensor_par.passes.nodes import tensor_inputs
from dtensor_par.passes.rules.core import RuleEnv
from dtensor_par.passes.rules.indexing import localize_embedding, localize_split
from dtensor_par.passes.rules.reductions import localize_group_norm, localize_mean
from dtensor_par.passes.rules.registry import lookup
from dtensor_par.passes.rules.views import localize_interpolate
from dtensor_par.placements import InterleavedShard, Partial, Replicate, Shard, local_chunk, parts_of, shard_dim

SIZE = 2
R = Replicate()


def _traced(fn, inputs) -> tuple[fx.GraphModule, fx.Node]:
    """The graph of ``fn`` (traced, or a graph module built by hand) with every node's value in
    ``meta["val"]``, and its one op node."""
    gm = fn if isinstance(fn, fx.GraphModule) else fx.symbolic_trace(fn)
    values = iter(inputs)
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            node.meta["val"] = next(values)
        elif node.op != "output":
            args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta["val"])
            node.meta["val"] = (node.target(*args, **kwargs) if node.op == "call_function"
                                else getattr(args[0], node.target)(*args[1:], **kwargs))
    (op,) = [n for n in gm.graph.nodes if n.op in ("call_function", "call_method")]
    return gm, op


def _pieces(x: torch.Tensor, p, generator: torch.Generator) -> list[torch.Tensor]:
    """Each rank's value of ``x`` under placement ``p``."""
    if isinstance(p, Partial):
        summands = [torch.randn(x.shape, generator=generator, dtype=x.dtype) for _ in range(SIZE - 1)]
        return summands + [x - sum(summands)]
    return [local_chunk(x, p, r, SIZE) for r in range(SIZE)]


def _assembled(outs: list[torch.Tensor], p) -> torch.Tensor:
    """The global value of per-rank outputs under placement ``p``."""
    if isinstance(p, Partial):
        return sum(outs)
    if shard_dim(p) is None:
        for out in outs[1:]:
            torch.testing.assert_close(out, outs[0], rtol=0, atol=0)
        return outs[0]
    local_parts = [o.split([part // SIZE for part in parts_of(p, o.shape[p.dim] * SIZE)], dim=p.dim) for o in outs]
    return torch.cat([torch.cat([parts[i] for parts in local_parts], dim=p.dim)
                      for i in range(len(local_parts[0]))], dim=p.dim)


def check_rule(fn, inputs: list, placements: list) -> NodeSharding:
    """Plan ``fn``'s op for inputs arriving with ``placements``; assert the plan is exact."""
    gm, op = _traced(fn, inputs)
    given = dict(zip([n for n in gm.graph.nodes if n.op == "placeholder"], placements))
    for node, p in given.items():
        set_sharding(node, "tp", NodeSharding(p, ()))
    ins = tensor_inputs(op)
    kind = lookup(op)
    sharding = kind.rule(op, ins, [given[i] for i in ins], RuleEnv("tp", SIZE, {}, False))
    # the hooks that change what a rank computes, sending nothing
    if kind.localize in (localize_mean, localize_split, localize_interpolate, localize_group_norm):
        set_sharding(op, "tp", sharding)
        if isinstance(op.meta["val"], torch.Tensor):  # what plan_pass keeps
            set_global_shape(op, tuple(op.meta["val"].shape))
        kind.localize(gm, op, SimpleNamespace(dims={"tp": SimpleNamespace(size=SIZE, chunks_per_rank=1)},
                                              size=lambda name: SIZE))
    generator = torch.Generator().manual_seed(0)
    pieces = {}
    for i, need in zip(ins, sharding.inputs):
        if isinstance(need, Partial):
            assert isinstance(given[i], Partial), f"{op.name}: the rule asks {i.name} for partial sums it lacks"
        pieces[i] = _pieces(i.meta["val"], need, generator)
    outs, planned = [], (op.target, op.args, op.kwargs)
    for r in range(SIZE):
        if kind.localize is localize_embedding:  # rank r's rows of the table: localized for that rank
            set_sharding(op, "tp", sharding)
            kind.localize(gm, op, SimpleNamespace(dims={"tp": SimpleNamespace(rank=r)}))
        args, kwargs = fx.node.map_arg((op.args, op.kwargs), lambda n: pieces[n][r])
        outs.append(op.target(*args, **kwargs) if op.op == "call_function"
                    else getattr(args[0], op.target)(*args[1:], **kwargs))
        op.target, op.args, op.kwargs = planned
    several = isinstance(sharding.out, tuple)  # topk's, sort's values and indices
    for rank_outs, p, expected in zip(zip(*outs) if several else [outs], sharding.out if several else [sharding.out],
                                      op.meta["val"] if several else [op.meta["val"]]):
        torch.testing.assert_close(_assembled(list(rank_outs), p), expected, rtol=1e-12, atol=1e-12)
    return sharding


def every_placement(x: torch.Tensor, partial: bool = True) -> list:
    partial = partial and x.is_floating_point()
    return [R] + ([Partial()] if partial else []) + [Shard(d) for d in range(x.dim()) if x.shape[d] % SIZE == 0]


def _t(*shape):
    return torch.randn(*shape, dtype=torch.float64)


def _check_all(fn, inputs, partial: bool = True) -> list[NodeSharding]:
    return [check_rule(fn, inputs, list(ps))
            for ps in itertools.product(*(every_placement(x, partial) for x in inputs))]


OPS = {
    "add_broadcast": (lambda x, y: x + y, [_t(2, 4, 6), _t(6)]),
    "mul": (lambda x, y: torch.mul(x, y), [_t(2, 4, 6), _t(2, 4, 6)]),
    "where": (lambda c, x, y: torch.where(c, x, y), [_t(2, 4) > 0, _t(2, 4), _t(4)]),
    "matmul": (lambda a, b: torch.matmul(a, b), [_t(2, 4, 6), _t(6, 8)]),
    "bmm": (lambda a, b: torch.bmm(a, b), [_t(2, 4, 6), _t(2, 6, 8)]),
    "linear": (lambda x, w: F.linear(x, w), [_t(2, 4, 6), _t(8, 6)]),
    "einsum_scores": (lambda q, k: torch.einsum("bhsd,bhtd->bhst", q, k), [_t(2, 2, 4, 6), _t(2, 2, 4, 6)]),
    "einsum_project": (lambda x, w: torch.einsum("bsd,fd->bsf", x, w), [_t(2, 4, 6), _t(8, 6)]),
    "einsum_vector": (lambda x, v: torch.einsum("bsh,h->bs", x, v), [_t(2, 4, 6), _t(6)]),
    "einsum_broadcast": (lambda x, y: torch.einsum("bsd,bsd->bs", x, y), [_t(2, 4, 6), _t(1, 4, 6)]),
    # HiDream's rotary angles, positions times frequencies; and '...' broadcast from the right.
    "einsum_ellipsis": (lambda x, w: torch.einsum("...n,d->...nd", x, w), [_t(2, 4, 6), _t(4)]),
    "einsum_ellipsis_broadcast": (lambda x, y: torch.einsum("...d,...d->...", x, y), [_t(2, 4, 6), _t(4, 6)]),
    # Features of odd width: a tp shard of the normalized features runs as ops.norm.sharded_norm,
    # which all-reduces (tests/test_cp_gloo.py, case qk_norm_across_heads).
    "layer_norm": (lambda x, w: F.layer_norm(x, (5,), w), [_t(2, 4, 5), _t(5)]),
    "rms_norm": (lambda x: torch.rms_norm(x, [5]), [_t(2, 4, 5)]),
    "softmax": (lambda x: torch.softmax(x, -1), [_t(2, 4, 6)]),
    "sum": (lambda x: x.sum(1), [_t(2, 4, 6)]),
    "mean_keepdim": (lambda x: x.mean(-1, keepdim=True), [_t(2, 4, 6)]),
    "mean_all": (lambda x: x.mean(), [_t(2, 4, 6)]),
    "mean_dims_dtype": (lambda x: torch.mean(x, (0, 2), dtype=torch.float64), [_t(2, 4, 6)]),
    "cat": (lambda x, y: torch.cat([x, y], 1), [_t(2, 4, 6), _t(2, 2, 6)]),
    "cat_empty": (lambda e, x: torch.cat([e, x], 1), [_t(0), _t(2, 4, 6)]),
    "stack": (lambda x, y: torch.stack([x, y], 1), [_t(2, 4), _t(2, 4)]),
    "transpose": (lambda x: x.transpose(1, 2), [_t(2, 4, 6)]),
    "index_by_list": (lambda x: x[:, :, [-2]], [_t(2, 4, 6, 2)]),  # Falcon's key of each kv group
    "index_by_tensor": (lambda x, i: x[i], [_t(4, 6), torch.tensor([3, 0, 3, 1])]),  # tokens in expert order
    "t": (lambda x: x.t(), [_t(4, 6)]),
    "numpy_T": (lambda x: torch.ops.aten.numpy_T(x), [_t(2, 4, 6)]),  # w.T, as torch 2.14's Dynamo records it
    # Jamba's selective scan moves the state's dims
    "movedim": (lambda x: torch.movedim(x, (0, 1), (2, 0)), [_t(2, 4, 6)]),
    "moveaxis_method": (lambda x: x.moveaxis(-1, 0), [_t(2, 4, 6)]),
    # GPT-J's rotary tables (torch.repeat_interleave(sin, 2, dim=3)), and kv heads repeated by the method
    "repeat_interleave": (lambda x: torch.repeat_interleave(x, 2, dim=2), [_t(2, 4, 6)]),
    "repeat_interleave_method": (lambda x: x.repeat_interleave(3, dim=-1), [_t(2, 4, 6)]),
    # LTX-Video's rotary grid of positions tiled over the batch (a new leading dim, one tiled dim).
    "repeat": (lambda x: x.repeat(2, 1, 2, 1), [_t(2, 4, 6)]),
    "complex": (lambda x: torch.view_as_complex(x), [_t(2, 4, 2)]),
    "pad": (lambda x: F.pad(x, (0, 2)), [_t(2, 4, 6)]),
    "embedding": (lambda ids, w: F.embedding(ids, w), [torch.randint(0, 10, (2, 4)), _t(10, 6)]),
    # a table cut by vocab rows: each rank's ids looked up, zeros elsewhere; the padding row kept on its rank
    "embedding_padding_idx": (lambda ids, w: F.embedding(ids, w, padding_idx=7), [torch.randint(0, 10, (2, 4)),
                                                                                 _t(10, 6)]),
    "conv2d": (lambda x, w, b: F.conv2d(x, w, b, stride=2), [_t(2, 3, 4, 4), _t(6, 3, 2, 2), _t(6)]),
    # Sana's 1 x 1 convolutions over an image grid made of the sequence: a row for each row, its shard kept
    "conv2d_pointwise": (lambda x, w, b: F.conv2d(x, w, b), [_t(2, 3, 4, 6), _t(5, 3, 1, 1), _t(5)]),
    # A mixture-of-experts router and its dispatch: top-k experts, tokens sorted by expert, counts.
    "topk": (lambda x: torch.topk(x, 2, dim=-1), [_t(2, 4, 6)]),
    "sort": (lambda x: torch.sort(x, dim=1), [_t(2, 4, 6)]),
    "argsort": (lambda x: x.argsort(descending=True), [_t(2, 4, 6)]),
    "one_hot": (lambda i: F.one_hot(i, 5), [torch.randint(0, 5, (2, 4))]),
    "scatter_add": (lambda x, i, s: torch.scatter_add(x, 0, i, s),
                    [_t(4, 6), torch.randint(0, 4, (2, 6)), _t(2, 6)]),
    "index_add": (lambda x, i, s: torch.index_add(x, 0, i, s), [_t(4, 6), torch.tensor([3, 0, 3]), _t(3, 6)]),
    "histc": (lambda x: torch.histc(x, bins=4, min=-2, max=2), [_t(2, 4, 6)]),
    # PhiMoE's router: the top score's margin over the others, by max along the experts (values, indices).
    "max_dim": (lambda x: x.max(dim=-1), [_t(2, 4, 6)]),
    "min_dim_keepdim": (lambda x: torch.min(x, 1, keepdim=True), [_t(2, 4, 6)]),
    "max_elementwise": (lambda x, y: torch.max(x, y), [_t(2, 4, 6), _t(6)]),
    # DeepSeek's router: expert groups masked by a scatter, the top-k weights gathered, casts by .type and .bool.
    "scatter_value": (lambda x, i: x.scatter(1, i, 1.0), [_t(4, 6), torch.randint(0, 6, (4, 2))]),
    "scatter_src": (lambda x, i, s: x.scatter(1, i, s), [_t(4, 6), torch.randint(0, 6, (4, 2)), _t(4, 2)]),
    "gather": (lambda x, i: x.gather(1, i), [_t(4, 6), torch.randint(0, 6, (4, 2))]),
    # Apertus' xIELU activation (expm1, softplus), and other ops that act element by element.
    "expm1": (lambda x: torch.expm1(x), [_t(2, 4, 6)]),
    "softplus": (lambda x: F.softplus(x), [_t(2, 4, 6)]),
    "clamp_min_method": (lambda x: x.clamp_min(0.5), [_t(2, 4, 6)]),
    "clip": (lambda x: torch.clip(x, min=0.5), [_t(2, 4, 6)]),  # RecurrentGemma's bounded sqrt's backward
    # xLSTM's norms: the variance over the features, unbiased or not
    "var": (lambda x: x.var(-1, keepdim=True, unbiased=False), [_t(2, 4, 6)]),
    "std_correction": (lambda x: torch.std(x, dim=1, correction=1), [_t(2, 4, 6)]),
    # Inkling2's L2 clip of the hidden states (as Dynamo records it), a norm method, and F.normalize
    "vector_norm": (lambda x: torch._C._linalg.linalg_vector_norm(x, dim=-1, keepdim=True), [_t(2, 4, 6)]),
    "norm_method": (lambda x: x.norm(dim=1), [_t(2, 4, 6)]),
    "normalize": (lambda x: F.normalize(x, dim=1), [_t(2, 4, 6)]),
    "type_cast": (lambda x: x.type(torch.float64), [_t(2, 4)]),
    "bool_cast": (lambda x: x.bool(), [_t(2, 4)]),
}


@pytest.mark.parametrize("name", OPS)
def test_every_placement_is_exact(name):
    fn, inputs = OPS[name]
    shardings = _check_all(fn, inputs, partial=not name.startswith("embedding"))
    firsts = [s.out[0] if isinstance(s.out, tuple) else s.out for s in shardings]
    assert any(shard_dim(p) is not None or isinstance(p, Partial) for p in firsts), name


def test_a_table_cut_by_vocab_rows_sums_to_the_lookup_and_gives_each_rank_its_rows_gradient():
    """Each rank's lookup of its rows (zeros elsewhere) sums to the whole lookup bit for bit, and
    each rank's gradient is exactly its rows of the whole table's, the padding row's zero kept."""
    ids = torch.randint(0, 10, (3, 5), generator=torch.Generator().manual_seed(0))
    ids[0, :2] = 7
    table, grad = _t(10, 6).requires_grad_(), _t(3, 5, 6)
    expected = F.embedding(ids, table, padding_idx=7)
    expected.backward(grad)
    pieces = [table.detach()[5 * r:5 * (r + 1)].clone().requires_grad_() for r in range(SIZE)]
    outs = [vocab_rows_embedding(ids, piece, r, 7) for r, piece in enumerate(pieces)]
    for out in outs:
        out.backward(grad)
    assert torch.equal(sum(outs), expected)
    assert torch.equal(torch.cat([piece.grad for piece in pieces]), table.grad) and not table.grad[7].any()


def test_a_new_tensor_is_whole_and_leaves_its_source_as_it_is():
    x = _t(2, 4, 6)
    for p in every_placement(x):
        assert check_rule(lambda x: x.new_zeros(4, 6), [x], [p]) == NodeSharding(R, (p,))


def test_a_convolution_keeps_rows_cut_over_cp_only_where_each_run_of_them_gives_its_share_of_the_output():
    """A 3 x 3 kernel padded by 1 keeps rows cut over cp (their halo fetched: ``ops.halo``), and
    so do a downsampling one of stride 2 and a patch embedding (kernel = stride) where every run
    of rows starts and ends on the stride; over tp a kernel wider than 1 has no halo exchange.
    Rows that do not divide into such runs, fewer than its halo, or a kernel padded otherwise
    are gathered, saying why; partial sums are summed, not gathered."""
    w = _t(3, 1, 3, 3)
    for dim, rows, kwargs, kept in (("cp", 8, {"padding": 1}, True), ("tp", 8, {"padding": 1}, False),
                                    ("cp", 8, {"padding": 1, "stride": 2}, True),
                                    ("cp", 12, {"padding": 1, "stride": 2}, False),  # 4 runs of 3 rows
                                    ("cp", 8, {"padding": 0}, False), ("cp", 2, {"padding": 1}, False),
                                    ("cp", 8, {"padding": 1, "dilation": 2}, False)):
        gm, conv = _traced(lambda x, w: F.conv2d(x, w, groups=3, **kwargs), [_t(2, 3, rows, 6), w])
        ins = tensor_inputs(conv)
        env = RuleEnv(dim, SIZE, {}, False, chunks_per_rank=2 if dim == "cp" else 1)
        sharding = lookup(conv).rule(conv, ins, [Shard(2), R], env)
        assert (sharding.out == Shard(2) and sharding.note is None) == kept, (dim, rows, kwargs, sharding)
        if not kept:
            assert sharding.note.startswith("a convolution over rows cut along dim 2"), sharding.note
    graph = fx.Graph()  # a causal one, as canonicalize writes it (a trace would step into it)
    graph.output(graph.call_function(padded_conv1d, (graph.placeholder("x"), graph.placeholder("w"), None, (2, 0), 3)))
    gm, conv = _traced(fx.GraphModule(torch.nn.Module(), graph), [_t(2, 3, 8), _t(3, 1, 3)])
    sharding = lookup(conv).rule(conv, tensor_inputs(conv), [Shard(2), R], RuleEnv("cp", SIZE, {}, False, 2))
    assert sharding.out == Shard(2) and sharding.note is None, sharding
    patches = [(_t(2, 3, 8, 8), _t(4, 3, 2, 2)), (_t(2, 3, 6, 8), _t(4, 3, 2, 2))]  # 4 chunks of 2 rows; of 1.5
    for (x, w), kept in zip(patches, (True, False)):
        gm, conv = _traced(lambda x, w: F.conv2d(x, w, stride=2), [x, w])
        sharding = lookup(conv).rule(conv, tensor_inputs(conv), [Shard(2), R], RuleEnv("cp", SIZE, {}, False, 2))
        assert (sharding.out == Shard(2)) == kept, sharding
    # a rowwise MLP's partial sums are summed first, as before a linear: its all-reduce, not a fallback
    sharding = lookup(conv).rule(conv, ins, [Partial(), R], RuleEnv("tp", SIZE, {}, False))
    assert sharding == NodeSharding(R, (R, R)), sharding


def test_group_norm_keeps_the_batch_rows_and_whole_groups_cut():
    """Rows cut over cp stay (``ops.norm.sharded_group_norm`` all-reduces each group's sums);
    channels cut in whole groups stay, each rank normalizing its own groups with its weight and
    bias; channels that cut a group, and padded rows, which would count, are gathered."""
    x, weight = _t(2, 8, 6, 4), _t(8)
    norm = lambda x, w: F.group_norm(x, 4, w, w)  # noqa: E731
    assert check_rule(norm, [x, weight], [Shard(0), R]) == NodeSharding(Shard(0), (Shard(0), R, R))
    assert check_rule(norm, [x, weight], [Shard(1), R]) == NodeSharding(Shard(1), (Shard(1), Shard(0), Shard(0)))
    odd_groups = check_rule(lambda x, w: F.group_norm(x, 1, w, w), [x, weight], [Shard(1), R])
    assert odd_groups.out == R and odd_groups.note.startswith("group_norm over channels that cut"), odd_groups
    for p, rows, kept in ((Shard(2), 6, True), (Shard(3), 6, True), (Shard(2), 5, False)):
        gm, op = _traced(norm, [_t(2, 8, rows, 4), weight])
        sharding = lookup(op).rule(op, tensor_inputs(op), [p, R], RuleEnv("cp", SIZE, {}, False))
        assert (sharding.out == p and sharding.note is None) == kept, (p, rows, sharding)


def test_nearest_upsampling_by_a_whole_factor_keeps_rows_cut():
    """Each row repeated in place: a shard of the rows stays, as one of the batch or channels
    does under any mode; bilinear resampling mixes rows across a cut: gathered."""
    x = _t(2, 4, 6, 4)
    for fn in (lambda x: F.interpolate(x, scale_factor=2.0, mode="nearest"),
               lambda x: F.interpolate(x, size=(12, 8), mode="nearest-exact")):
        for p in (Shard(0), Shard(1), Shard(2), Shard(3)):
            assert check_rule(fn, [x], [p]) == NodeSharding(p, (p,)), p
    bilinear = lambda x: F.interpolate(x, scale_factor=2.0, mode="bilinear")  # noqa: E731
    assert check_rule(bilinear, [x], [Shard(1)]).out == Shard(1)
    gathered = check_rule(bilinear, [x], [Shard(2)])
    assert gathered.out == R and gathered.note.startswith("interpolate (bilinear) along the cut dim 2"), gathered


def test_einsum_keeps_shards_and_contracts_to_partial_sums():
    q, k = _t(2, 2, 4, 6), _t(2, 2, 4, 6)
    scores = lambda q, k: torch.einsum("bhsd,bhtd->bhst", q, k)  # noqa: E731
    assert check_rule(scores, [q, k], [Shard(1), R]) == NodeSharding(Shard(1), (Shard(1), Shard(1)))  # heads
    assert check_rule(scores, [q, k], [Shard(3), Shard(3)]) == NodeSharding(Partial(), (Shard(3), Shard(3)))
    assert check_rule(scores, [q, k], [Partial(), R]).out == Partial()


def test_norm_keeps_shards_of_the_dims_it_does_not_normalize():
    x = _t(2, 4, 6)
    assert check_rule(lambda x: F.layer_norm(x, (6,)), [x], [Shard(1)]).out == Shard(1)
    over_features = check_rule(lambda x: F.layer_norm(x, (4, 6)), [x], [Shard(0)])
    assert over_features.out == Shard(0) and over_features.note is None


def test_a_fused_projection_stays_interleaved_through_an_einsum():
    x, w = _t(2, 4, 6), _t(12, 6)
    fused = InterleavedShard(0, (4, 8))
    sharding = check_rule(lambda x, w: torch.einsum("bsd,fd->bsf", x, w), [x, w], [R, fused])
    assert sharding.out == InterleavedShard(2, (4, 8))


def test_heads_folded_into_the_batch_stay_sharded_through_a_matmul():
    """Bloom's attention on ``[batch * heads, seq, dim]``: each rank holds its heads of every
    batch entry (an interleaved batch dim), and so does the product."""
    folded = InterleavedShard(0, (4, 4))
    bmm = lambda a, b: torch.bmm(a, b)  # noqa: E731
    assert check_rule(bmm, [_t(8, 4, 6), _t(8, 6, 4)], [folded, folded]) == NodeSharding(folded, (folded, folded))
    assert check_rule(bmm, [_t(8, 4, 6), _t(8, 6, 4)], [R, folded]) == NodeSharding(folded, (folded, folded))
    rows = InterleavedShard(1, (2, 2))  # each product's rows, parts of two runs: they stay so
    assert check_rule(bmm, [_t(8, 4, 6), _t(8, 6, 4)], [rows, R]) == NodeSharding(rows, (rows, R))
    assert check_rule(bmm, [_t(8, 4, 6), _t(8, 6, 4)], [R, InterleavedShard(2, (2, 2))]).out == InterleavedShard(2, (2, 2))
    assert check_rule(bmm, [_t(8, 4, 6), _t(8, 6, 4)], [InterleavedShard(2, (2, 4)), R]).note  # contracted: gathered


def test_tokens_tiled_per_expert_stay_cut_through_the_views_and_products_of_dense_experts():
    """Llama 4's experts run on every token: tokens ``[B * S, H]`` (the sequence cut, so the rows
    are interleaved parts, one per batch entry) tiled once per expert, viewed ``[E, B * S, H]``,
    multiplied by each expert's weight and summed back over the experts. Each rank keeps its own
    rows throughout."""
    tokens, parts = InterleavedShard(0, (4, 4)), (4, 4)
    tiled = check_rule(lambda x: x.repeat(3, 1), [_t(8, 6)], [tokens])
    assert tiled == NodeSharding(InterleavedShard(0, parts * 3), (tokens,))
    assert check_rule(lambda x: x.repeat(3, 1), [_t(8, 6)], [Shard(0)]).out == InterleavedShard(0, (8, 8, 8))
    per_expert = check_rule(lambda x: x.view(3, -1, 6), [_t(24, 6)], [InterleavedShard(0, parts * 3)])
    assert per_expert.out == InterleavedShard(1, parts)
    assert check_rule(lambda x: x.view(3, -1, 6), [_t(24, 6)], [InterleavedShard(0, (8, 8, 8))]).out == Shard(1)
    weights = check_rule(lambda s: s.reshape(-1, 1), [_t(3, 8)], [InterleavedShard(1, parts)])  # scores [E, tokens]
    assert weights.out == InterleavedShard(0, parts * 3)
    product = check_rule(lambda x, w: torch.bmm(x, w), [_t(3, 8, 6), _t(3, 6, 4)], [InterleavedShard(1, parts), R])
    assert product.out == InterleavedShard(1, parts)
    assert check_rule(lambda x: x.sum(0), [_t(3, 8, 6)], [InterleavedShard(1, parts)]).out == tokens
    assert check_rule(lambda x: x.view(3, -1, 6), [_t(12, 6)], [InterleavedShard(0, (4, 4, 4))]).out == Shard(1)
    assert check_rule(lambda x: x.view(2, -1, 6), [_t(24, 6)], [InterleavedShard(0, parts * 3)]).out == \
        InterleavedShard(1, parts + (4,))


def test_a_joint_sequence_of_several_parts_stays_cut_part_by_part():
    """HiDream's joint sequence: image tokens beside text from two encoders (three parts, one a
    concatenation already), its rotary angles made from positions concatenated once (two parts),
    split back into image and text, and flattened with the batch for its experts and viewed back.
    Each rank keeps its piece of every part; where two cuts meet, the smaller tensor follows."""
    text = InterleavedShard(1, (4, 4))
    joint = check_rule(lambda x, t: torch.cat([x, t], 1), [_t(2, 8, 6), _t(2, 8, 6)], [Shard(1), text])
    assert joint == NodeSharding(InterleavedShard(1, (8, 4, 4)), (Shard(1), text))
    assert check_rule(lambda t, y: torch.cat([t, y], 1), [_t(2, 8, 6), _t(2, 4, 6)], [text, R]) == \
        NodeSharding(InterleavedShard(1, (4, 4, 4)), (text, Shard(1)))
    parts = InterleavedShard(1, (8, 4, 4))
    split = check_rule(lambda x: torch.split(x, [8, 8], 1), [_t(2, 16, 6)], [parts])
    assert split == NodeSharding((Shard(1), text), (parts,))
    assert check_rule(lambda x: torch.split(x, [4, 12], 1), [_t(2, 16, 6)], [parts]).note  # cuts a part: gathered
    # all of it in one piece, none in the other (Qwen3.5's rows kept for its recurrent states: none): kept cut
    assert check_rule(lambda x: torch.split(x, [16, 0], 1), [_t(2, 16, 6)], [Shard(1)]) == \
        NodeSharding((Shard(1), R), (Shard(1),))
    angles = InterleavedShard(1, (8, 8))  # [B, S, 1, D]: the heads broadcast
    turned = check_rule(lambda q, f: q * f, [_t(2, 16, 3, 4), _t(2, 16, 1, 4)], [parts, angles])
    assert turned == NodeSharding(parts, (parts, parts))
    rows = InterleavedShard(0, (8, 4, 4) * 2)
    assert check_rule(lambda y: y.view(2, -1, 6), [_t(32, 6)], [rows]).out == parts


def test_heads_flattened_with_the_batch_and_sequence_are_viewed_back_cut_by_heads():
    """Qwen3-Next's gated norm reads ``[B * S * H, d]``: the heads cut over tp are parts of
    the rows, one per token, repeated (a view that splits the features into heads and merges
    them into the rows at once); viewed back ``[B, S, H, d]`` they are cut along the heads."""
    heads = InterleavedShard(0, (4,) * 6)  # B, S, H = 2, 3, 4
    assert check_rule(lambda x: x.reshape(-1, 5), [_t(2, 3, 20)], [Shard(2)]) == NodeSharding(heads, (Shard(2),))
    assert check_rule(lambda x: x.reshape(2, 3, -1, 5), [_t(24, 5)], [heads]) == NodeSharding(Shard(2), (heads,))
    assert check_rule(lambda x: x.reshape(6, -1, 5), [_t(24, 5)], [heads]).out == Shard(1)
    assert check_rule(lambda x: x.reshape(2, -1, 5), [_t(24, 5)], [heads]).out == InterleavedShard(1, (4, 4, 4))
    assert check_rule(lambda x: x.reshape(4, -1, 5), [_t(24, 5)], [heads]).note  # 1.5 tokens a row: gathered


def test_heads_cut_group_by_group_stay_cut_through_their_views_and_attention():
    """DiffLlama's heads cut half by half over tp (``plan.head_groups``): a projection's features
    in two halves viewed as heads, kv heads merged with their repeats, attention on query heads
    and kv heads cut in as many groups, and the output chunked into its halves."""
    halves = InterleavedShard(2, (4, 4))  # 8 heads of 5
    assert check_rule(lambda x: x.view(2, 3, -1, 5), [_t(2, 3, 40)], [InterleavedShard(2, (20, 20))]) == \
        NodeSharding(halves, (InterleavedShard(2, (20, 20)),))
    repeated = check_rule(lambda k: k.reshape(2, -1, 3, 5), [_t(2, 4, 2, 3, 5)], [InterleavedShard(1, (2, 2))])
    assert repeated.out == InterleavedShard(1, (4, 4))
    q, kv = _t(2, 8, 3, 5), _t(2, 4, 3, 5)
    attention = check_rule(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, enable_gqa=True), [q, kv, kv],
                           [InterleavedShard(1, (4, 4)), R, R])
    assert attention == NodeSharding(InterleavedShard(1, (4, 4)), (InterleavedShard(1, (4, 4)),
                                                                    InterleavedShard(1, (2, 2)), InterleavedShard(1, (2, 2))))
    assert check_rule(lambda x: x.chunk(2, 2), [_t(2, 3, 8, 10)], [halves]).out == (Shard(2), Shard(2))


def test_a_triangular_solve_keeps_its_batch_and_right_hand_columns_cut():
    """Qwen3-Next's gated delta rule solves a unit lower-triangular system per head and chunk:
    a cut batch dim (heads) stays cut, B's columns stay cut with A whole, and partial sums of B
    stay partial; a cut of the system's rows is gathered."""
    a, b = torch.eye(6, dtype=torch.float64) + _t(2, 4, 6, 6).tril(-1), _t(2, 4, 6, 8)
    solve = lambda a, b: torch.linalg.solve_triangular(a, b, upper=False, unitriangular=True)  # noqa: E731
    assert check_rule(solve, [a, b], [Shard(1), R]) == NodeSharding(Shard(1), (Shard(1), Shard(1)))
    assert check_rule(solve, [a, b], [R, Shard(3)]) == NodeSharding(Shard(3), (R, Shard(3)))
    assert check_rule(solve, [a, b], [R, Partial()]) == NodeSharding(Partial(), (R, Partial()))
    assert check_rule(solve, [a[0], b], [R, Shard(1)]).out == Shard(1)  # A broadcast over the batch
    assert check_rule(solve, [a, b], [R, Shard(2)]).note  # the rows it eliminates: gathered


def test_a_depthwise_convolution_of_cut_channels_slices_a_whole_weight():
    """Qwen3-Next's convolution over its q, k and v concatenated, each cut by heads: each rank's
    channels with their kernels, the weight whole and sliced alike."""
    gm, conv = _traced(lambda x, w: F.conv1d(x, w, padding=1, groups=8), [_t(2, 8, 6), _t(8, 1, 3)])
    qkv = InterleavedShard(1, (4, 4))
    depthwise = lookup(conv).rule(conv, tensor_inputs(conv), [qkv, R], RuleEnv("tp", SIZE, {}, False))
    assert depthwise == NodeSharding(qkv, (qkv, InterleavedShard(0, (4, 4))))  # localize_conv: 4 groups a rank


def test_a_running_sum_keeps_every_cut_but_part_by_part_along_its_dim():
    """``cumsum`` along another dim runs on each rank's piece (exact here); along the cut dim it
    stays cut, each rank adding the totals before its runs (``ops.scan.sharded_cumsum``, which
    gathers: exact in ``test_cp_gloo``, case running_positions), unless the dim is cut part by
    part, which is gathered, saying why."""
    x = _t(2, 8, 6)
    assert check_rule(lambda x: x.cumsum(2), [x], [Shard(1)]) == NodeSharding(Shard(1), (Shard(1),))
    gm, op = _traced(lambda x: torch.cumsum(x, 1), [x])
    along = lookup(op).rule(op, tensor_inputs(op), [Shard(1)], RuleEnv("cp", SIZE, {}, False, chunks_per_rank=2))
    assert along == NodeSharding(Shard(1), (Shard(1),))
    parts = lookup(op).rule(op, tensor_inputs(op), [InterleavedShard(1, (4, 4))], RuleEnv("cp", SIZE, {}, False))
    assert parts.out == R and parts.note.startswith("a running sum along the dim 1, cut part by part"), parts


def _recurrence_graph(*names: str, rule: str = "torch_chunk_gated_delta_rule", options: tuple = ()) -> fx.GraphModule:
    """``linear_recurrence`` of ``rule`` by rows (``dtensor_par._testing.recurrences``) on inputs ``names``, built
    by hand (symbolic tracing would trace into the function)."""
    graph = fx.Graph()
    tensors = [graph.placeholder(name) for name in names]
    graph.output(graph.call_function(linear_recurrence, (f"dtensor_par._testing.recurrences:{rule}", *tensors),
                                     {"options": options} if options else {}))
    return fx.GraphModule(torch.nn.Module(), graph)


def test_a_recurrence_runs_on_each_ranks_heads_or_batch_rows_and_on_each_ranks_rows_over_cp():
    """A chunked recurrence (``ops.recurrence``; here the gated delta rule by rows) runs on each
    rank's heads (tp) or batch rows, its final state cut alike (exact here), a replicated gate or
    beta sliced as the heads are; along the sequence, over cp only, each rank runs its rows from
    the state the rows before leave (``sharded_linear_recurrence``: exact in test_cp_gloo, cases
    gated_delta_rule); any other cut is gathered, saying why."""
    inputs = [_t(2, 6, 4, 8), _t(2, 6, 4, 8), _t(2, 6, 4, 8), -_t(2, 6, 4).abs(), _t(2, 6, 4).sigmoid()]
    gm = _recurrence_graph("q", "k", "v", "g", "beta")
    for p, state in ((Shard(0), Shard(0)), (Shard(2), Shard(1))):
        assert check_rule(gm, inputs, [p] * 5) == NodeSharding((p, state), (p,) * 5)
    assert check_rule(gm, inputs, [Shard(2)] * 3 + [R, R]) == NodeSharding((Shard(2), Shard(1)), (Shard(2),) * 5)
    gathered = check_rule(gm, inputs, [Shard(1)] * 5)  # tp
    assert gathered.out == (R, R) and gathered.note.startswith("a recurrence's inputs cut differently"), gathered
    op = next(n for n in gm.graph.nodes if n.op == "call_function")
    along = lookup(op).rule(op, tensor_inputs(op), [Shard(1)] * 5, RuleEnv("cp", SIZE, {}, False, chunks_per_rank=2))
    assert along == NodeSharding((Shard(1), R), (Shard(1),) * 5)
    gm = _recurrence_graph("q", "k", "v", "g", "beta", "state")  # from a given state (a decode step's): by heads too
    assert check_rule(gm, inputs + [_t(2, 4, 8, 8)], [Shard(2)] * 5 + [Shard(1)]) == \
        NodeSharding((Shard(2), Shard(1)), (Shard(2),) * 5 + (Shard(1),))
    op = next(n for n in gm.graph.nodes if n.op == "call_function")
    from_state = lookup(op).rule(op, tensor_inputs(op), [Shard(1)] * 5 + [R], RuleEnv("cp", SIZE, {}, False))
    assert from_state.out == (R, R) and from_state.note, from_state  # along the sequence, from a state: gathered


def test_mamba2s_scan_runs_on_each_ranks_heads_its_single_group_whole_and_on_each_ranks_rows_over_cp():
    """Mamba-2's selective scan (by rows) runs on each rank's heads, its A, D and dt_bias sliced as
    they are, B and C of 1 group whole on every rank (a cut of their state gathered), of 2 groups
    cut by group (exact here: each rank's 2 heads read its own group); on each rank's batch rows;
    along the sequence, over cp only, from the state the rows before leave (exact in test_cp_gloo,
    cases state_space_scan)."""
    rows, per_head = [_t(2, 6, 4, 8), _t(2, 6, 4)], [-_t(4).abs(), _t(4), _t(4)]
    gm = _recurrence_graph("x", "dt", "B", "C", "A", "D", "dt_bias", rule="mamba2_chunk_scan",
                           options=(("chunk_size", 4), ("dt_limit", (0.0, float("inf")))))
    for groups, given, whole in ((1, Shard(3), R), (2, Shard(2), Shard(2))):
        inputs = rows + [_t(2, 6, groups, 4), _t(2, 6, groups, 4)] + per_head
        heads = check_rule(gm, inputs, [Shard(2)] * 2 + [given] * 2 + [R] * 3)
        assert heads == NodeSharding((Shard(2), Shard(1)), (Shard(2),) * 2 + (whole,) * 2 + (Shard(0),) * 3), heads
    assert check_rule(gm, inputs, [Shard(0)] * 4 + [R] * 3) == NodeSharding((Shard(0),) * 2, (Shard(0),) * 4 + (R,) * 3)
    op = next(n for n in gm.graph.nodes if n.op == "call_function")
    along = lookup(op).rule(op, tensor_inputs(op), [Shard(1)] * 4 + [R] * 3, RuleEnv("cp", SIZE, {}, False))
    assert along == NodeSharding((Shard(1), R), (Shard(1),) * 4 + (R,) * 3)
    mixed = check_rule(gm, inputs, [Shard(2), Shard(0)] + [R] * 5)
    assert mixed.out == (R, R) and mixed.note.startswith("a recurrence's inputs cut differently"), mixed


def test_mamba1s_scan_runs_on_each_ranks_channels_b_and_c_whole_and_on_each_ranks_rows_over_cp():
    """Mamba-1's selective scan (rows first, as ``linear_recurrence`` takes it) runs on each
    rank's channels, its A, D and delta_bias sliced as they are, B and C (one set for every
    channel) whole on every rank, exact here; on each rank's batch rows; along the sequence,
    over cp only, from the state the rows before leave (exact in test_cp_gloo, cases
    selective_scan)."""
    rows = [_t(2, 6, 8), _t(2, 6, 8), _t(2, 6, 1, 4), _t(2, 6, 1, 4), _t(2, 6, 8)]
    inputs = rows + [-_t(8, 4).abs(), _t(8), _t(8)]
    gm = _recurrence_graph("x", "dt", "B", "C", "z", "A", "D", "delta_bias", rule="mamba_selective_scan")
    channels = check_rule(gm, inputs, [Shard(2)] * 2 + [R] * 2 + [Shard(2)] + [R] * 3)
    assert channels == NodeSharding((Shard(2), Shard(1)), (Shard(2),) * 2 + (R,) * 2 + (Shard(2),) + (Shard(0),) * 3)
    assert check_rule(gm, inputs, [Shard(0)] * 5 + [R] * 3) == NodeSharding((Shard(0),) * 2, (Shard(0),) * 5 + (R,) * 3)
    op = next(n for n in gm.graph.nodes if n.op == "call_function")
    along = lookup(op).rule(op, tensor_inputs(op), [Shard(1)] * 5 + [R] * 3, RuleEnv("cp", SIZE, {}, False))
    assert along == NodeSharding((Shard(1), R), (Shard(1),) * 5 + (R,) * 3)


def test_setitem_writes_each_shard_in_place_or_is_refused():
    """Wan's RoPE writes ``out[..., 0::2] = ...``: the sharded dim is kept whole, so each rank
    writes its own piece. A write that cuts the sharded dim is refused, never gathered."""
    def write(out, value):
        out[..., 0::2] = value
        return out

    out, value = _t(2, 4, 6), _t(2, 4, 3)
    graph = fx.Graph()  # (symbolic tracing cannot record an item assignment)
    target, source = graph.placeholder("out"), graph.placeholder("value")
    target.meta["val"], source.meta["val"] = out, value
    op = graph.call_function(operator.setitem, (target, (Ellipsis, slice(0, None, 2)), source))
    env = RuleEnv("tp", SIZE, {}, False)
    for p in (Shard(0), Shard(1)):
        set_sharding(target, "tp", NodeSharding(p, ()))
        set_sharding(source, "tp", NodeSharding(R, ()))
        sharding = lookup(op).rule(op, [target, source], [p, R], env)
        assert sharding == NodeSharding(None, (p, p))
        pieces = [write(local_chunk(out, p, r, SIZE).clone(), local_chunk(value, p, r, SIZE)) for r in range(SIZE)]
        torch.testing.assert_close(_assembled(pieces, p), write(out.clone(), value), rtol=0, atol=0)
    set_sharding(target, "tp", NodeSharding(Shard(2), ()))
    with pytest.raises(NotImplementedError, match=r"writes in place into out .* S\(2\) on mesh dim 'tp'"):
        lookup(op).rule(op, [target, source], [Shard(2), R], env)


def test_a_key_padding_is_cut_with_the_batch_it_pads():
    """Hybrid attention's key padding ``[B, keys]`` holds the batch on dim 0, not where a mask
    broadcast from the right would: cut with the queries' batch, whole beside their heads."""
    graph = fx.Graph()
    inputs = [graph.placeholder(name) for name in ("q", "k", "v", "keep")]
    alone = {name: MeshDim(name, 1, 0, None, ((0,),), 0) for name in ("ulysses", "ring")}  # SDPA on each rank
    graph.output(graph.call_function(hybrid_attention, tuple(inputs[:3]), {"key_padding": inputs[3], **alone}))
    attention = fx.GraphModule({}, graph)
    keep = torch.ones(2, 4, dtype=torch.bool)
    keep[1, -1] = False
    q, k, v = _t(2, 2, 4, 6), _t(2, 2, 4, 6), _t(2, 2, 4, 6)
    batch = check_rule(attention, [q, k, v, keep], [Shard(0), Shard(0), Shard(0), Shard(0)])
    assert batch == NodeSharding(Shard(0), (Shard(0),) * 4)
    heads = check_rule(attention, [q, k, v, keep], [Shard(1), Shard(1), Shard(1), R])
    assert heads == NodeSharding(Shard(1), (Shard(1),) * 3 + (R,))


def test_a_grouped_matmul_is_colwise_or_rowwise_over_its_experts_features():
    """Each expert's weight [E, K, N]: N sharded gives sharded outputs, K (with the tokens'
    features) partial sums; tokens cut along their rows (their offsets are global) are gathered.
    Integer values in float32 (the kernel's dtype): every sum is exact."""
    tokens, experts = torch.randint(-3, 4, (8, 8)).float(), torch.randint(-3, 4, (4, 8, 8)).float()
    offsets = torch.tensor([2, 3, 6, 8], dtype=torch.int32)
    grouped = lambda x, w, o: torch._grouped_mm(x, w, offs=o)  # noqa: E731
    shardings = _check_all(grouped, [tokens, experts, offsets], partial=False)
    assert check_rule(grouped, [tokens, experts, offsets], [R, Shard(2), R]).out == Shard(1)
    assert check_rule(grouped, [tokens, experts, offsets], [Shard(1), Shard(1), R]).out == Partial()
    assert check_rule(grouped, [tokens, experts, offsets], [Shard(0), R, R]).note
    assert sum(s.note is None and s.out != R for s in shardings) >= 2


def test_a_strided_slice_keeps_the_shards_whose_pieces_hold_whole_steps():
    """GPT-OSS's interleaved gate and up (``gate_up[..., ::2]``, ``gate_up[..., 1::2]``): a rank's
    piece of a length the step divides starts at a multiple of it, so the piece's own ``::2`` are
    its share of the whole's: cut alike (part by part of an interleaved dim too). A piece of odd
    length would keep the other parity: gathered, and the note says why."""
    x, fused = _t(4, 8), InterleavedShard(1, (4, 8))
    for fn in (lambda x: x[..., ::2], lambda x: x[..., 1::2], lambda x: x[:, 3::4]):
        assert check_rule(fn, [x], [Shard(1)]) == NodeSharding(Shard(1), (Shard(1),))
    assert check_rule(lambda x: x[0, 1::2], [x], [Shard(1)]).out == Shard(0)
    assert check_rule(lambda x: x[..., 1::2], [_t(4, 12)], [fused]).out == InterleavedShard(1, (2, 4))
    odd = check_rule(lambda x: x[..., ::2], [_t(4, 6)], [Shard(1)])
    assert odd.out == R and "a piece's length is not a multiple of the step" in odd.note, odd
    assert check_rule(lambda x: x[..., 2::2], [x], [Shard(1)]).note == "indexing into the sharded dim 1"


def test_rows_of_a_table_cut_along_its_features_are_picked_cut_alike():
    """An experts' bias table ``[E, N]`` cut along N, a row picked for each expert row by its
    (whole) expert id: each rank picks its features of every row."""
    table, ids = _t(4, 8), torch.tensor([0, 0, 1, 3, 3, 3])
    assert check_rule(lambda t, i: t[i], [table, ids], [Shard(1), R]) == NodeSharding(Shard(1), (Shard(1), R))
    fused = InterleavedShard(1, (2, 6))
    assert check_rule(lambda t, i: t[i], [table, ids], [fused, R]).out == fused


def test_a_gather_from_a_whole_input_keeps_its_index_cut():
    """``table.gather(1, positions)`` of a whole table (RoBERTa's token-type buffer) at positions cut
    along the dim it gathers along (the sequence, over cp): each rank reads what its positions
    name. Cut along another dim, the table must be cut alike (row i reads row i); a cut table is
    gathered along that dim, its positions being global."""
    table, positions = _t(2, 8), torch.randint(0, 8, (2, 6))
    for placement in (Shard(1), InterleavedShard(1, (2, 4))):
        assert check_rule(lambda t, i: t.gather(1, i), [table, positions], [R, placement]).out == placement
    assert check_rule(lambda t, i: t.gather(1, i), [table, positions], [R, Shard(0)]).inputs == (Shard(0), Shard(0))
    assert check_rule(lambda t, i: t.gather(1, i), [table, positions], [Shard(1), Shard(1)]).note


def test_routing_ops_gather_along_the_dim_they_select_sort_or_count_over():
    """A shard of the dim topk, sort, max or a scatter works along, or of any dim of a count whose
    length or range the whole tensor decides, is gathered with a note: never a guess."""
    x, ids = _t(2, 4, 6), torch.randint(0, 5, (8,))
    for fn, placement in [(lambda x: torch.topk(x, 2, dim=-1), Shard(2)), (lambda x: x.sort(dim=0), Shard(0)),
                          (lambda x: torch.histc(x, bins=4), Shard(1)), (lambda x: x.max(dim=1), Shard(1)),
                          (lambda x: x.min(), Shard(0))]:
        assert check_rule(fn, [x], [placement]).note
    assert check_rule(lambda i: F.one_hot(i), [ids], [Shard(0)]).note
    assert check_rule(lambda i: torch.bincount(i, minlength=5), [ids], [Shard(0)]).note
    assert check_rule(lambda i: torch.bincount(i, minlength=5), [ids], [R]) == NodeSharding(R, (R,))
    counts = check_rule(lambda x: torch.histc(x, bins=4, min=-2, max=2), [x], [Shard(0)])
    assert counts == NodeSharding(Partial(), (Shard(0),))


def test_an_in_place_scatter_that_cannot_keep_its_target_is_refused():
    """``x.index_add_(0, index, rows)`` into an x sharded along dim 0: the positions are global,
    and a write into a gathered copy would be lost."""
    graph = fx.Graph()
    x, index, rows = (graph.placeholder(n) for n in ("x", "index", "rows"))
    x.meta["val"], index.meta["val"], rows.meta["val"] = _t(4, 6), torch.tensor([3, 0]), _t(2, 6)
    op = graph.call_method("index_add_", (x, 0, index, rows))
    op.meta["val"] = x.meta["val"]
    with pytest.raises(NotImplementedError, match=r"writes in place along dim 0 into x \[4, 6\], which is S\(0\)"):
        lookup(op).rule(op, [x, index, rows], [Shard(0), R, R], RuleEnv("tp", SIZE, {}, False))


def test_expert_exchanges_keep_feature_cuts_and_partial_sums_and_refuse_tokens_whole_over_cp():
    """Expert parallelism's exchanges (``ops.experts``) move whole rows between the cp ranks: the
    rows' features cut over tp, their partial sums and a dp rank's own rows stay as they are, and
    the counts stay whole; rows cut along themselves, or met over cp (where only each rank's own
    tokens may be sent, ``plan.token_local_sharding``), are refused, never guessed."""
    ep = MeshDim("cp", SIZE, 0, None, ((0, 1),), 0)
    graph = fx.Graph()
    rows, counts, received = (graph.placeholder(n) for n in ("rows", "counts", "received"))
    rows.meta["val"], counts.meta["val"], received.meta["val"] = _t(6, 4), _t(4), torch.zeros(SIZE, 2)
    ops = [graph.call_function(f, (rows, counts, received), {"ep": ep}) for f in (dispatch_rows, combine_rows)]
    ops.append(graph.call_function(exchange_counts, (counts,), {"ep": ep}))
    for op in ops:
        ins = list(op.args)
        for given in [[R]] if op.target is exchange_counts else [[p, R, R] for p in (R, Partial(), Shard(1))]:
            for dim in ("tp", "dp"):
                sharding = lookup(op).rule(op, ins, given, RuleEnv(dim, SIZE, {}, False))
                assert sharding == NodeSharding(given[0], tuple(given))
        for given, dim in [([Shard(0), R, R][:len(ins)], "tp"), ([R] * len(ins), "cp")]:
            with pytest.raises(NotImplementedError, match=r"expert parallelism \(ep='cp'\) runs on each cp rank's own"):
                lookup(op).rule(op, ins, given, RuleEnv(dim, SIZE, {}, False))


def test_halo_plans_cut_runs_of_rows_to_one_length_and_find_their_neighbours():
    """Rows 0..7 in the zigzag layout over 2 ranks (0, 1 | 6, 7 on rank 0; 2..5 on rank 1): runs
    of 2 rows each, rank 1's 4 rows two runs; each run's halo is the last rows of the run before
    and the first of the run after (runs numbered ``rank * runs + run``), none at the image's
    edges."""
    positions = [[0, 1, 6, 7], [2, 3, 4, 5]]
    assert halo_plan(positions, 0) == HaloPlan(runs=2, run_length=2, above=(-1, 3), below=(2, -1))
    assert halo_plan(positions, 1) == HaloPlan(runs=2, run_length=2, above=(0, 2), below=(3, 1))
