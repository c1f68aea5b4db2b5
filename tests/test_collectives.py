"""The collectives of the per-rank graph at world size 8, counted exactly on a fake process group."""

from __future__ import annotations

from collections import Counter

import torch

import dtensor_par
from dtensor_par.ops import collectives as C
from dtensor_par.passes.localize import collectives_in
from dtensor_par.passes.meta import communications, placements
from dtensor_par.placements import InterleavedShard, Replicate, Shard
from dtensor_par._testing import models, patterns
from dtensor_par._testing.harness import aot_graphs, capturing_backend
from tests.conftest import GoldenTestCase, plan_graph


def forward_collectives(gm) -> Counter:
    return Counter(kind for _, kind in collectives_in(gm))


def traced_collectives(gm, ctx) -> dict[str, Counter]:
    """Collectives AOTAutograd traces into the forward and backward graphs of the local graph."""
    return {name: Counter(n.target.__name__.split(".")[0] for n in g.graph.nodes
                          if n.op == "call_function" and getattr(n.target, "namespace", "") == "_c10d_functional"
                          and "wait" not in str(n.target))
            for name, g in aot_graphs(gm, ctx).items()}


def test_plain_tp_two_all_reduces_per_block_forward_and_backward(fake_world):
    layers = 3
    model = models.GPT(layers=layers, hidden=64, heads=8, mlp=128)
    gm, ctx = plan_graph(model, [torch.randn(2, 16, 64)], tp=8)
    assert forward_collectives(gm) == Counter(all_reduce=2 * layers)
    assert sum(n.target is C.grad_all_reduce for n in gm.graph.nodes) == 2 * layers
    traced = traced_collectives(gm, ctx)
    assert traced["forward"] == Counter(all_reduce=2 * layers)
    assert traced["backward"] == Counter(all_reduce=2 * layers)
    assert ctx.warnings == []


def test_sequence_parallel_reduce_scatter_and_all_gather(fake_world):
    layers = 3
    model = models.GPT(layers=layers, hidden=64, heads=8, mlp=128)
    gm, ctx = plan_graph(model, [torch.randn(2, 16, 64)], tp=8, sequence_parallel=True)
    # Block 1 gets the replicated input, so only its MLP needs a gather; every later block
    # gathers before attention and MLP; the output is gathered once at the end.
    assert forward_collectives(gm) == Counter(reduce_scatter=2 * layers, all_gather=2 * layers)
    traced = traced_collectives(gm, ctx)
    assert traced["forward"] == Counter(reduce_scatter_tensor=2 * layers, all_gather_into_tensor=2 * layers)
    # Backward: each gather that feeds a colwise linear reduce-scatters (the output gather
    # only slices); each reduce-scatter all-gathers. Block 1's slice of its input would
    # gather the same gradient as its attention's reduce-scatter (the residual add's), and
    # the partitioner's CSE keeps one of the two, as aot_eager and inductor run it.
    # All-reduces: grads of the sequence-sharded norms' weight and bias (2 * (2 * layers - 1))
    # and of the rowwise biases (2 * layers), all in one flat bucket; and of block 1's
    # replicated attention input (1), which backward needs at once.
    norms_on_shards = 2 * layers - 1
    assert traced["backward"] == Counter(reduce_scatter_tensor=2 * layers - 1, all_gather_into_tensor=2 * layers,
                                         all_reduce=1 + 1)
    buckets = [n for n in gm.graph.nodes if n.target is C.grad_all_reduce_bucket]
    assert [len(n.args[0]) for n in buckets] == [2 * norms_on_shards + 2 * layers]
    # Buckets of at most 1 KiB (these gradients are 256 bytes each): four inputs per bucket.
    gm, ctx = plan_graph(model, [torch.randn(2, 16, 64)], tp=8, sequence_parallel=True, grad_bucket_mb=2**-10)
    buckets = [n for n in gm.graph.nodes if n.target is C.grad_all_reduce_bucket]
    assert [len(n.args[0]) for n in buckets] == [4, 4, 4, 4]
    assert aot_graphs(gm, ctx)["backward"] is not None
    assert traced_collectives(gm, ctx)["backward"]["all_reduce"] == 4 + 1


def test_megatron_weight_placements(fake_world):
    gm, ctx = plan_graph(models.GPTBlock(hidden=64, heads=8, mlp=128), [torch.randn(2, 16, 64)], tp=8)
    by_fqn = {ctx.params[name].fqn: p for name, p in ctx.param_placements.items()}
    assert by_fqn == {
        "qkv.weight": InterleavedShard(0, (64, 64, 64)), "qkv.bias": InterleavedShard(0, (64, 64, 64)),
        "proj.weight": Shard(1), "fc.weight": Shard(0), "fc.bias": Shard(0), "fc_out.weight": Shard(1),
    }


def test_llama_gqa_kv_sharded_when_divisible_else_replicated(fake_world):
    ids = [torch.randint(0, 50, (2, 8))]
    model = models.Llama(layers=1, hidden=64, heads=8, kv_heads=8)
    _, ctx = plan_graph(model, ids, tp=8)
    fqns = {ctx.params[name].fqn for name, p in ctx.param_placements.items() if p != Replicate()}
    assert {"blocks.0.k_proj.weight", "blocks.0.v_proj.weight", "blocks.0.q_proj.weight"} <= fqns
    model = models.Llama(layers=1, hidden=64, heads=8, kv_heads=2)
    gm, ctx = plan_graph(model, ids, tp=8)
    fqns = {ctx.params[name].fqn for name in ctx.param_placements}
    assert "blocks.0.k_proj.weight" not in fqns and "blocks.0.q_proj.weight" in fqns
    assert ctx.warnings == ["x: the embedding table embed.weight stays whole on every rank: its 50 rows do not divide "
                            "by tp=8",
                            "attention0 (a): 2 kv heads do not divide by tp=8; "
                            "kv projections ['blocks.0.k_proj', 'blocks.0.v_proj'] stay replicated"]
    assert forward_collectives(gm) == Counter(all_reduce=2)


class TestLocalGraphGolden(GoldenTestCase):

    def test_gpt_block_local_graph_at_tp8(self):
        gm, _ = plan_graph(models.GPTBlock(hidden=64, heads=8, mlp=128), [torch.randn(2, 16, 64)], tp=8)
        self.assertExpectedInline(gm.code.strip(), """\
def forward(self, L_x_ : torch.Tensor, L_self_modules_ln1_parameters_weight_ : torch.nn.parameter.Parameter, L_self_modules_ln1_parameters_bias_ : torch.nn.parameter.Parameter, L_self_modules_qkv_parameters_weight_ : torch.nn.parameter.Parameter, L_self_modules_qkv_parameters_bias_ : torch.nn.parameter.Parameter, L_self_modules_proj_parameters_weight_ : torch.nn.parameter.Parameter, L_self_modules_proj_parameters_bias_ : torch.nn.parameter.Parameter, L_self_modules_ln2_parameters_weight_ : torch.nn.parameter.Parameter, L_self_modules_ln2_parameters_bias_ : torch.nn.parameter.Parameter, L_self_modules_fc_parameters_weight_ : torch.nn.parameter.Parameter, L_self_modules_fc_parameters_bias_ : torch.nn.parameter.Parameter, L_self_modules_fc_out_parameters_weight_ : torch.nn.parameter.Parameter, L_self_modules_fc_out_parameters_bias_ : torch.nn.parameter.Parameter):
    l_x_ = L_x_
    l_self_modules_ln1_parameters_weight_ = L_self_modules_ln1_parameters_weight_
    l_self_modules_ln1_parameters_bias_ = L_self_modules_ln1_parameters_bias_
    l_self_modules_qkv_parameters_weight_ = L_self_modules_qkv_parameters_weight_
    l_self_modules_qkv_parameters_bias_ = L_self_modules_qkv_parameters_bias_
    l_self_modules_proj_parameters_weight_ = L_self_modules_proj_parameters_weight_
    l_self_modules_proj_parameters_bias_ = L_self_modules_proj_parameters_bias_
    l_self_modules_ln2_parameters_weight_ = L_self_modules_ln2_parameters_weight_
    l_self_modules_ln2_parameters_bias_ = L_self_modules_ln2_parameters_bias_
    l_self_modules_fc_parameters_weight_ = L_self_modules_fc_parameters_weight_
    l_self_modules_fc_parameters_bias_ = L_self_modules_fc_parameters_bias_
    l_self_modules_fc_out_parameters_weight_ = L_self_modules_fc_out_parameters_weight_
    l_self_modules_fc_out_parameters_bias_ = L_self_modules_fc_out_parameters_bias_
    layer_norm = torch.nn.functional.layer_norm(l_x_, (64,), l_self_modules_ln1_parameters_weight_, l_self_modules_ln1_parameters_bias_, 1e-05);  l_self_modules_ln1_parameters_weight_ = l_self_modules_ln1_parameters_bias_ = None
    grad_all_reduce = dtensor_par_ops_collectives_grad_all_reduce(layer_norm, dtensor_par_mesh_MeshDim('tp', 8, 0, '0', ((0, 1, 2, 3, 4, 5, 6, 7),), 0, 0));  layer_norm = None
    linear = torch._C._nn.linear(grad_all_reduce, l_self_modules_qkv_parameters_weight_, l_self_modules_qkv_parameters_bias_);  grad_all_reduce = l_self_modules_qkv_parameters_weight_ = l_self_modules_qkv_parameters_bias_ = None
    chunk = linear.chunk(3, dim = -1);  linear = None
    q = chunk[0]
    k = chunk[1]
    v = chunk[2];  chunk = None
    reshape_1 = q.reshape(2, 16, 1, 8);  q = None
    q_1 = reshape_1.transpose(1, 2);  reshape_1 = None
    reshape_2 = k.reshape(2, 16, 1, 8);  k = None
    k_1 = reshape_2.transpose(1, 2);  reshape_2 = None
    reshape_3 = v.reshape(2, 16, 1, 8);  v = None
    v_1 = reshape_3.transpose(1, 2);  reshape_3 = None
    a = torch._C._nn.scaled_dot_product_attention(q_1, k_1, v_1, is_causal = True);  q_1 = k_1 = v_1 = None
    transpose_3 = a.transpose(1, 2);  a = None
    reshape_4 = transpose_3.reshape(2, 16, 8);  transpose_3 = None
    linear_1 = torch._C._nn.linear(reshape_4, l_self_modules_proj_parameters_weight_);  reshape_4 = l_self_modules_proj_parameters_weight_ = None
    all_reduce = dtensor_par_ops_collectives_all_reduce(linear_1, dtensor_par_mesh_MeshDim('tp', 8, 0, '0', ((0, 1, 2, 3, 4, 5, 6, 7),), 0, 0));  linear_1 = None
    add = all_reduce + l_self_modules_proj_parameters_bias_;  all_reduce = l_self_modules_proj_parameters_bias_ = None
    x = l_x_ + add;  l_x_ = add = None
    layer_norm_1 = torch.nn.functional.layer_norm(x, (64,), l_self_modules_ln2_parameters_weight_, l_self_modules_ln2_parameters_bias_, 1e-05);  l_self_modules_ln2_parameters_weight_ = l_self_modules_ln2_parameters_bias_ = None
    grad_all_reduce_1 = dtensor_par_ops_collectives_grad_all_reduce(layer_norm_1, dtensor_par_mesh_MeshDim('tp', 8, 0, '0', ((0, 1, 2, 3, 4, 5, 6, 7),), 0, 0));  layer_norm_1 = None
    linear_2 = torch._C._nn.linear(grad_all_reduce_1, l_self_modules_fc_parameters_weight_, l_self_modules_fc_parameters_bias_);  grad_all_reduce_1 = l_self_modules_fc_parameters_weight_ = l_self_modules_fc_parameters_bias_ = None
    gelu = torch._C._nn.gelu(linear_2, approximate = 'tanh');  linear_2 = None
    linear_3 = torch._C._nn.linear(gelu, l_self_modules_fc_out_parameters_weight_);  gelu = l_self_modules_fc_out_parameters_weight_ = None
    all_reduce_1 = dtensor_par_ops_collectives_all_reduce(linear_3, dtensor_par_mesh_MeshDim('tp', 8, 0, '0', ((0, 1, 2, 3, 4, 5, 6, 7),), 0, 0));  linear_3 = None
    add_2 = all_reduce_1 + l_self_modules_fc_out_parameters_bias_;  all_reduce_1 = l_self_modules_fc_out_parameters_bias_ = None
    add_1 = x + add_2;  x = add_2 = None
    return (add_1,)""")


def test_hybrid_attention_collectives_per_attention(fake_world):
    """tp=2 x ring=2 x ulysses=2: per attention, forward one all-to-all for q, one for k/v
    (packed), one for the output and ring-1 kv rotations; the backward mirrors the all-to-alls,
    reuses the kv blocks and rotates the dk/dv accumulators ring-1 times."""
    import dtensor_par
    from dtensor_par.passes.capture import capture_graphs
    from dtensor_par.planning import parallelize_graph
    from dtensor_par.mesh import MeshInfo

    fake_world(8)
    layers, ring = 2, 2
    mesh = dtensor_par.init_mesh(tp=2, ring=ring, ulysses=2)
    info = MeshInfo.from_mesh(mesh)
    (g, inputs), = capture_graphs(models.GPT(layers=layers, hidden=64, heads=8, mlp=128), torch.randn(2, 16, 64))
    gm, ctx = parallelize_graph(g, inputs, info)
    graphs = aot_graphs(gm, ctx)

    def all_to_alls(graph, dim):
        group = info.dims[dim].group_name
        return sum(1 for n in graph.graph.nodes if n.target == torch.ops._c10d_functional.all_to_all_single.default
                   and n.args[3] == group)

    assert all_to_alls(graphs["forward"], "ulysses") == 3 * layers
    assert all_to_alls(graphs["forward"], "ring") == (ring - 1) * layers
    assert all_to_alls(graphs["backward"], "ulysses") == 3 * layers
    assert all_to_alls(graphs["backward"], "ring") == (ring - 1) * layers  # dk/dv


def test_ring_backward_runs_no_forward_attention_kernel(fake_world):
    """The runtime compiles its graph at the first call, outside Dynamo, under the tracing
    context Dynamo gives a backend. Without it, dead-code elimination kept random-tagged ops,
    and AOTAutograd's default partitioner (an ``aot_autograd`` backend's unless it names
    another) copied every forward block's attention kernel, whose results only the forward
    merge reads, into the backward, where it ran for nothing."""
    fake_world(2)
    model = models.DiTBlock(dim=32, heads=4, mlp=64)  # not causal: two blocks merged per rank
    x = torch.randn(2, 16, 32)
    graphs = {}
    backend = dtensor_par.hybrid_parallel(dtensor_par.init_mesh(ring=2), inner_backend=capturing_backend(graphs))
    torch.compile(model, backend=backend)(x).sum().backward()
    sdpa = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    sdpa_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
    kernels = {name: Counter(n.target for n in gm.graph.nodes if n.target in (sdpa, sdpa_backward))
               for name, gm in graphs.items()}
    assert kernels == {"forward": {sdpa: 2}, "backward": {sdpa_backward: 2}}, kernels


def test_mask_stays_whole_and_an_uneven_sequence_is_padded(fake_world):
    """ring=2 x ulysses=2, sequence 30 in 8 chunks (padded to 32): the key-padding input that
    only builds the [B, H, S, S] mask stays whole (nothing gathers the mask); the forward has
    the collectives of an even sequence, local shards of 32 / 4 positions, and the one gather
    of the output cuts the padding off."""
    import dtensor_par
    from dtensor_par.passes.capture import capture_graphs
    from dtensor_par.planning import parallelize_graph
    from dtensor_par.mesh import MeshInfo
    from dtensor_par.ops.attention import hybrid_attention

    fake_world(4)
    info = MeshInfo.from_mesh(dtensor_par.init_mesh(ring=2, ulysses=2))
    keep = torch.ones(2, 30, dtype=torch.bool)
    (g, inputs), = capture_graphs(patterns.MaskedAttention("additive"), torch.randn(2, 30, 32), keep)
    gm, ctx = parallelize_graph(g, inputs, info)
    inputs = {n.name: placements(n)["cp"] for n in gm.graph.nodes if n.op == "placeholder"}
    assert inputs["l_x_"] == Shard(1) and inputs["l_keep_"] == Replicate()
    assert forward_collectives(gm) == Counter(all_to_all=3, ring_rotate=1, all_gather=1)
    gather, = [n for n in gm.graph.nodes if n.target is C.all_gather]
    assert gather.kwargs == {"length": 30}
    hybrid, = [n for n in gm.graph.nodes if n.target is hybrid_attention]
    assert hybrid.kwargs["kv_len"] == 30 and hybrid.kwargs["attn_mask"].name == "mask"
    traced = aot_graphs(gm, ctx, backward=False)["forward"]
    x_local = next(n for n in traced.graph.nodes if n.op == "placeholder" and n.meta["val"].dim() == 3)
    assert tuple(x_local.meta["val"].shape) == (2, 8, 32)


def test_contraction_over_the_sequence_sums_shards_unless_padded(fake_world):
    """An even sequence's shards contract to partial sums (one all-reduce on cp); a padded
    one would sum the padding, so its shards are gathered (cut to the real length) first."""
    import dtensor_par
    from dtensor_par.passes.capture import capture_graphs
    from dtensor_par.planning import parallelize_graph
    from dtensor_par.mesh import MeshInfo

    fake_world(4)
    info = MeshInfo.from_mesh(dtensor_par.init_mesh(ring=2, ulysses=2))
    for seq, gathers, reduces in ((32, 0, 1), (30, 1, 0)):
        (g, inputs), = capture_graphs(patterns.SequenceGram(), torch.randn(2, seq, 32))
        gm, ctx = parallelize_graph(g, inputs, info)
        matmul, = [n for n in gm.graph.nodes if n.op == "call_function" and n.target.__name__ == "matmul"]
        around = set(matmul.all_input_nodes) | set(matmul.users)
        counts = Counter(kind for node, kind in collectives_in(gm) if node in around)
        assert counts == Counter({k: v for k, v in (("all_gather", 2 * gathers), ("all_reduce", reduces)) if v}), seq
        assert any("contraction over the padded sequence dim" in w for w in ctx.warnings) == bool(gathers)


def test_parameter_gradients_reduced_in_buckets_over_cp(fake_world):
    """At tp2 x ulysses2 every parameter is replicated over cp and used rank-locally: its
    gradient is a per-rank partial. They are reduced in flat buckets, issued where autograd
    produces their last gradient; sink_waits then waits for each just before its first reader."""
    from dtensor_par.planning import parallelize_graph
    from dtensor_par.mesh import MeshInfo
    from dtensor_par.passes.capture import capture_graphs
    from dtensor_par.config import ParallelConfig
    from dtensor_par.passes.overlap import WAIT, sink_waits

    fake_world(4)
    layers = 2
    mesh = MeshInfo.from_mesh(dtensor_par.init_mesh(tp=2, ulysses=2))
    model = models.GPT(layers=layers, hidden=64, heads=8, mlp=128)
    (gm, inputs), = capture_graphs(model, torch.randn(2, 16, 64))
    params = len(list(model.parameters()))
    local_gm, ctx = parallelize_graph(gm, inputs, mesh)
    buckets = [n for n in local_gm.graph.nodes if n.target is C.grad_all_reduce_bucket]
    assert [len(n.args[0]) for n in buckets] == [params]
    assert not any(n.target is C.grad_all_reduce and n.args[0].op == "placeholder" for n in local_gm.graph.nodes)
    # Backward: the tp all-reduces of the colwise inputs' gradients (2 per block), and 1 bucket.
    assert traced_collectives(local_gm, ctx)["backward"]["all_reduce"] == 2 * layers + 1

    local_gm, ctx = parallelize_graph(gm, inputs, mesh, ParallelConfig(grad_bucket_mb=0.05))
    buckets = [n for n in local_gm.graph.nodes if n.target is C.grad_all_reduce_bucket]
    assert len(buckets) == 3 and sum(len(n.args[0]) for n in buckets) == params
    backward = sink_waits(aot_graphs(local_gm, ctx)["backward"])
    order = {n: i for i, n in enumerate(backward.graph.nodes)}
    reduces = [n for n in backward.graph.nodes if n.target is torch.ops._c10d_functional.all_reduce.default]
    bucket_reduces = [n for n in reduces if n.args[0].target is torch.ops.dtensor_par.flatten_cat.default]
    assert len(bucket_reduces) == 3
    for issue in bucket_reduces[:-1]:  # the last bucket holds the first layer's parameters: little is left
        wait, = (u for u in issue.users if u.target is WAIT)
        between = [n for n in backward.graph.nodes if order[issue] < order[n] < order[wait]]
        assert any(n.target is torch.ops.aten.mm.default for n in between), (issue.name, [str(n.target) for n in between])


def test_bucket_flatten_and_unflatten_ops_round_trip():
    """The bucket's two custom ops: every shape (a scalar too) comes back in its own storage,
    and their schemas and fake kernels pass torch.library's checks. Only CPU and CUDA graphs
    get them; elsewhere the bucket is flattened and split with aten ops."""
    from torch.fx.experimental.proxy_tensor import make_fx

    grads = [torch.randn(3, 4), torch.randn(()), torch.randn(5)]
    flat = C.flatten_cat(grads)
    pieces = C.unflatten_copy(flat, [3, 4, 5], [2, 0, 1])
    assert all(torch.equal(p, g) for p, g in zip(pieces, grads))
    assert len({p.untyped_storage().data_ptr() for p in pieces} | {flat.untyped_storage().data_ptr()}) == 4
    torch.library.opcheck(C.flatten_cat, (grads,))
    torch.library.opcheck(C.unflatten_copy, (flat, [3, 4, 5], [2, 0, 1]))

    def traced_ops(device: str) -> set[str]:
        xs = [g.to(device) for g in grads]
        gm = make_fx(lambda *xs: C._unflatten(C._flatten(list(xs)), [x.shape for x in xs]))(*xs)
        return {n.target.namespace for n in gm.graph.nodes if n.op == "call_function" and hasattr(n.target, "namespace")}

    assert traced_ops("cpu") == {"dtensor_par"}
    assert traced_ops("meta") == {"aten"}  # as on a device whose compiler knows aten ops only (Neuron, XLA)


def test_forward_issues_q_exchange_before_the_kv_projections(fake_world):
    """Ulysses exchanges q alone; overlap_pass issues it as soon as q exists, so the k and v
    projections run while it is in flight (as traced, it waits at once, after them)."""
    from dtensor_par.planning import parallelize_graph
    from dtensor_par.mesh import MeshInfo
    from dtensor_par.passes.capture import capture_graphs
    from dtensor_par.passes.overlap import WAIT, overlap_pass

    fake_world(2)
    mesh = MeshInfo.from_mesh(dtensor_par.init_mesh(ulysses=2))
    model = models.LlamaBlock(hidden=64, heads=8, kv_heads=2, gqa="enable_gqa")
    (gm, inputs), = capture_graphs(model, torch.randn(2, 16, 64))
    local_gm, ctx = parallelize_graph(gm, inputs, mesh)
    assert communications(ctx.sites[0].core)[0].forward_bytes == 2 * 8 * 8 * 8 * 4  # q: 8 heads of 8 rows

    def compute_during_each_exchange(forward):
        order = {n: i for i, n in enumerate(forward.graph.nodes)}
        exchanges = [n for n in forward.graph.nodes if n.target is torch.ops._c10d_functional.all_to_all_single.default]
        result = []
        for issue in exchanges:
            wait, = (u for u in issue.users if u.target is WAIT)
            result.append([n.target for n in forward.graph.nodes if order[issue] < order[n] < order[wait]
                           and n.target is torch.ops.aten.mm.default])
        return result

    traced = aot_graphs(local_gm, ctx)["forward"]
    assert compute_during_each_exchange(traced) == [[], [], []]  # q; k and v packed; the output
    during = compute_during_each_exchange(overlap_pass(traced))
    assert len(during[0]) == 2 and during[1:] == [[], []]  # the k and v projections run during q's


def test_overlap_pass_alone_raises_issues_and_sinks_waits_keeping_random_order():
    """The issue moves ahead of the compute it does not need, its wait to its first reader;
    the two random draws stay in their order (the first draw is not needed by anything
    before the reduction, the second reads the matmul)."""
    from dtensor_par.passes.overlap import overlap_pass

    aten, c10d = torch.ops.aten, torch.ops._c10d_functional
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    first_draw = graph.call_function(aten.rand_like.default, (x,))
    product = graph.call_function(aten.mm.default, (x, x))
    second_draw = graph.call_function(aten.rand_like.default, (product,))
    issue = graph.call_function(c10d.all_reduce.default, (x, "sum", "0"))
    wait = graph.call_function(c10d.wait_tensor.default, (issue,))
    with_second = graph.call_function(aten.add.Tensor, (product, second_draw))
    total = graph.call_function(aten.add.Tensor, (with_second, first_draw))
    result = graph.call_function(aten.add.Tensor, (total, wait))
    graph.output(result)
    gm = overlap_pass(torch.fx.GraphModule(torch.nn.Module(), graph))
    expected = [x, issue, first_draw, product, second_draw, with_second, total, wait, result]
    assert [n.name for n in gm.graph.nodes][:-1] == [n.name for n in expected]


def test_reinplace_all_reduces_alone_only_where_nothing_else_reads_the_input():
    """A matmul read only through a view is reduced in place; a graph input, a matmul read
    twice, one an ``_unsafe_view`` shares with another reader, and an exchange's result
    (a wait returns its input's storage) read twice keep the copying all_reduce. Neither
    ``_unsafe_view`` nor ``wait_tensor`` declares the alias in its schema."""
    from dtensor_par.passes.overlap import reinplace_all_reduces

    aten, c10d = torch.ops.aten, torch.ops._c10d_functional
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    x.meta["val"] = torch.empty(4, 4)

    def all_reduce(t):
        issue = graph.call_function(c10d.all_reduce.default, (t, "sum", "0"))
        return issue, graph.call_function(c10d.wait_tensor.default, (issue,))

    def node(op, *args):
        n = graph.call_function(op, args)
        n.meta["val"] = op(*[a.meta["val"] if isinstance(a, torch.fx.Node) else a for a in args])
        return n

    only_reader, _ = all_reduce(node(aten.view.default, node(aten.mm.default, x, x), [16]))
    of_input, _ = all_reduce(x)
    read_twice = node(aten.mm.default, x, x)
    of_read_twice, _ = all_reduce(read_twice)
    shared = node(aten.mm.default, x, x)
    of_unsafe_view, _ = all_reduce(node(aten._unsafe_view.default, shared, [16]))
    exchanged = graph.call_function(c10d.all_to_all_single.default, (node(aten.mm.default, x, x), [1], [1], "0"))
    exchanged.meta["val"] = torch.empty(4, 4)
    of_exchanged, _ = all_reduce(node(c10d.wait_tensor.default, exchanged))
    graph.output((read_twice, shared, exchanged))
    reinplace_all_reduces(torch.fx.GraphModule(torch.nn.Module(), graph))
    assert only_reader.target is c10d.all_reduce_.default
    kept = (of_input, of_read_twice, of_unsafe_view, of_exchanged)
    assert [n.target for n in kept] == [c10d.all_reduce.default] * 4
