"""Dynamic shapes: one plan and one inner compile serve every sequence length and batch size."""

from __future__ import annotations

import contextlib
import logging
import math

import pytest
import torch

import dtensor_par
from dtensor_par.planning import parallelize_graph
from dtensor_par.explain import explain
from dtensor_par.mesh import MeshInfo
from dtensor_par.passes.capture import capture_graphs
from dtensor_par.passes.meta import symbolic_inputs
from dtensor_par.symbolic import hint
from dtensor_par._testing import models, patterns
from dtensor_par._testing.harness import assert_matches, compare, logged, run_ranks
from tests import tiers
from tests.background import in_background
from tests.conftest import GoldenTestCase, _init_fake

# Five lengths at two batch sizes: 13, 18 and 30 are padded over every mesh below (cp = 2, or
# 4 and 8 chunks in the zigzag layout), 16 and 24 are not.
SIZES = [(2, 16), (2, 13), (3, 18), (2, 24), (3, 30)]

# mesh sizes -> model; each mode runs every size in SIZES through one compiled model. Together
# they cover each mesh dim and both hybrids: tp x ulysses, tp x ring, ring x ulysses (Ulysses x
# ring attention); causal attention (zigzag) and bidirectional (the padded keys masked).
MODES = {
    "tp2_ulysses2": ({"tp": 2, "ulysses": 2}, lambda: models.Llama(layers=1)),
    "tp2_ring2": ({"tp": 2, "ring": 2}, lambda: patterns.MaskedAttention(None)),
    "ring2_ulysses2": ({"ring": 2, "ulysses": 2}, lambda: models.GPT(layers=1)),
}


def _inputs(name: str, batch: int, seq: int) -> tuple:
    if name == "tp2_ulysses2":
        return (torch.randint(0, 50, (batch, seq)),)
    return (torch.randn(batch, seq, 32),)


def _counting(compiles: list, traced: bool = True):
    """aot_eager (or with ``traced=False`` the graph as it is), counting its calls: each is one
    inner compile of a local graph."""
    def inner(gm, example_inputs):
        compiles.append([tuple(x.shape) if isinstance(x, torch.Tensor) else x for x in example_inputs])
        return torch._dynamo.backends.debugging.aot_eager(gm, example_inputs) if traced else gm.forward
    return inner


@contextlib.contextmanager
def _torch_errors():
    """The errors torch's fake tensors log while the block runs: a meta kernel failing on
    symbolic sizes logs its traceback, even where a fallback then serves (its logger does not
    propagate, so it is listened to itself)."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = records.append
    fake_tensors = logging.getLogger("torch._subclasses.fake_tensor")
    fake_tensors.addHandler(handler)
    try:
        yield records
    finally:
        fake_tensors.removeHandler(handler)


def _run_modes(rank: int, world: int, *, names: list[str]) -> dict:
    results = {}
    for name in names:
        sizes, make_model = MODES[name]
        mesh = dtensor_par.init_mesh(**sizes)
        torch._dynamo.reset()
        torch.manual_seed(0)
        compiles = []
        backend = dtensor_par.hybrid_parallel(mesh, inner_backend=_counting(compiles))
        inputs = [_inputs(name, b, s) for b, s in SIZES]
        with logged(logging.INFO) as records, _torch_errors() as errors:
            metrics = compare(make_model(), inputs, lambda m: torch.compile(m, backend=backend, dynamic=True),
                              steps=1)
        symbolic = [c for c in compiles if any(isinstance(x, torch.SymInt) for x in c)]
        messages = [r.getMessage() for r in records]
        results[name] = {**metrics, "compiles": len(compiles), "symbolic_compiles": len(symbolic),
                         "plans": [m for m in messages if "hybrid_parallel: planned graph" in m],
                         "torch_errors": [r.getMessage()[:200] for r in errors]}

    # dynamic=False keeps today's behaviour: Dynamo specializes, and each size is planned for itself
    # (static local graphs, which the other suites trace: run as they are).
    mesh = dtensor_par.init_mesh(tp=world)
    torch._dynamo.reset()
    torch.manual_seed(0)
    compiles = []
    backend = dtensor_par.hybrid_parallel(mesh, inner_backend=_counting(compiles, traced=False))
    metrics = compare(models.GPT(layers=1), [_inputs("ring2_ulysses2", b, s) for b, s in SIZES[:2]],
                      lambda m: torch.compile(m, backend=backend, dynamic=False), steps=1)
    results["static"] = {**metrics, "compiles": len(compiles),
                         "symbolic_compiles": sum(any(isinstance(x, torch.SymInt) for x in c) for c in compiles)}
    return results


SWEPT = {"tp2_ulysses2", "tp2_ring2"}
"""Modes ``tests.tiers`` leaves to ``--sweep``: CI runs Ulysses x ring, whose padded zigzag
sequence holds the symbolic sizes the other modes hold."""
LAUNCH = in_background(run_ranks, 4, _run_modes, names=tiers.running(list(MODES), SWEPT))


@pytest.mark.parametrize("name", [tiers.case(name, sweep=name in SWEPT) for name in [*MODES, "static"]])
def test_one_compile_serves_every_length_and_batch_size(name):
    """Five lengths (three padded over cp) and two batch sizes through one plan and one inner
    compile per mesh, exact against one device in forward and backward; ``dynamic=False``
    compiles each size (``static``)."""
    result = assert_matches(name, [rank_results[name] for rank_results in LAUNCH.result()])
    if name == "static":
        assert result["compiles"] == 2 and result["symbolic_compiles"] == 0, result
    else:
        assert result["compiles"] == 1 and result["symbolic_compiles"] == 1, result
        assert len(result["plans"]) == 1 and "symbolic in L['" in result["plans"][0], result
        assert result["torch_errors"] == [], result  # the ring's merge traced on symbolic sizes


def _plan_symbolic(model, inputs, **sizes):
    """Capture ``model`` with symbolic sizes and plan it on them, on a fake process group."""
    _init_fake(math.prod(sizes.values()))
    mesh = dtensor_par.init_mesh(**sizes)
    (gm, example_inputs), = capture_graphs(model, *inputs, dynamic=True)
    example_inputs = [hint(a) for a in example_inputs]
    spec = symbolic_inputs(gm).specialization(example_inputs)
    return parallelize_graph(gm, example_inputs, MeshInfo.from_mesh(mesh), specialization=spec)


def test_replans_only_where_a_guard_fails_and_keeps_at_most_cache_limit_plans(fake_world, caplog):
    """Megatron-SP shards the sequence over tp only when it divides: the plan pins that, so an
    odd length is planned again (the log names the size, the condition and the op), and
    with ``cache_limit=1`` the even plan is dropped (with a warning) and made again."""
    fake_world(2)
    compiles = []
    backend = dtensor_par.hybrid_parallel(dtensor_par.init_mesh(tp=2), inner_backend=lambda gm, ex: (
        compiles.append(1), gm.forward)[1], sequence_parallel=True, cache_limit=1)
    compiled = torch.compile(models.GPTBlock(), backend=backend, dynamic=True)
    caplog.set_level(logging.INFO, logger="dtensor_par")
    for seq in (16, 12, 9, 20):
        assert compiled(torch.randn(2, seq, 32)).shape == (2, seq, 32)
    plans = [r.getMessage() for r in caplog.records if "planned graph" in r.getMessage()]
    assert len(compiles) == len(plans) == 3, plans
    assert "triggered by: guard failed: Eq(Mod(L['x'].size(1), 2), 0) (from plan at add) is false for " \
           "L['x'].size(0)=2, L['x'].size(1)=9" in plans[1], plans
    assert "guard failed: Ne(Mod(L['x'].size(1), 2), 0)" in plans[2], plans
    dropped = [r.getMessage() for r in caplog.records if "cache_limit=1" in r.getMessage()]
    assert len(dropped) == 2, dropped


def test_explain_reports_symbolic_sizes_and_the_op_that_specializes(fake_world):
    report = explain(models.GPTBlock(), (torch.randn(2, 16, 32),), tp=2, dynamic=True, sequence_parallel=True,
                     device_type="cpu")
    (graph,) = report.graphs
    assert graph.symbolic == ["L['x'].size(0)", "L['x'].size(1)"]
    assert graph.specialized == ["Eq(Mod(L['x'].size(1), 2), 0) (from plan at add)"]
    assert "sizes: symbolic in L['x'].size(0), L['x'].size(1)" in str(report)
    static = explain(models.GPTBlock(), (torch.randn(2, 16, 32),), tp=2, device_type="cpu")
    assert static.graphs[0].symbolic == [] and "sizes: static" in str(static)


class TestSymbolicLocalGraphGolden(GoldenTestCase):

    def test_gpt_block_local_graph_at_tp2_ulysses2(self):
        """Local sizes are expressions in the SymInt inputs: the sequence padded to 2 chunks
        over ulysses, heads cut by tp, the real length handed to the ops that gather."""
        gm, _ = _plan_symbolic(models.GPTBlock(hidden=16, heads=4, mlp=32), [torch.randn(2, 8, 16)],
                               tp=2, ulysses=2)
        self.assertExpectedInline(gm.code.strip(), """\
def forward(self, s77 : torch.SymInt, s27 : torch.SymInt, L_x_ : torch.Tensor, L_self_modules_ln1_parameters_weight_ : torch.nn.parameter.Parameter, L_self_modules_ln1_parameters_bias_ : torch.nn.parameter.Parameter, L_self_modules_ln1_eps : torch.Tensor, L_self_modules_qkv_parameters_weight_ : torch.nn.parameter.Parameter, L_self_modules_qkv_parameters_bias_ : torch.nn.parameter.Parameter, L_self_modules_proj_parameters_weight_ : torch.nn.parameter.Parameter, L_self_modules_proj_parameters_bias_ : torch.nn.parameter.Parameter, L_self_modules_ln2_parameters_weight_ : torch.nn.parameter.Parameter, L_self_modules_ln2_parameters_bias_ : torch.nn.parameter.Parameter, L_self_modules_ln2_eps : torch.Tensor, L_self_modules_fc_parameters_weight_ : torch.nn.parameter.Parameter, L_self_modules_fc_parameters_bias_ : torch.nn.parameter.Parameter, L_self_modules_fc_out_parameters_weight_ : torch.nn.parameter.Parameter, L_self_modules_fc_out_parameters_bias_ : torch.nn.parameter.Parameter):
    l_x_ = L_x_
    l_self_modules_ln1_parameters_weight_ = L_self_modules_ln1_parameters_weight_
    l_self_modules_ln1_parameters_bias_ = L_self_modules_ln1_parameters_bias_
    l_self_modules_ln1_eps = L_self_modules_ln1_eps
    l_self_modules_qkv_parameters_weight_ = L_self_modules_qkv_parameters_weight_
    l_self_modules_qkv_parameters_bias_ = L_self_modules_qkv_parameters_bias_
    l_self_modules_proj_parameters_weight_ = L_self_modules_proj_parameters_weight_
    l_self_modules_proj_parameters_bias_ = L_self_modules_proj_parameters_bias_
    l_self_modules_ln2_parameters_weight_ = L_self_modules_ln2_parameters_weight_
    l_self_modules_ln2_parameters_bias_ = L_self_modules_ln2_parameters_bias_
    l_self_modules_ln2_eps = L_self_modules_ln2_eps
    l_self_modules_fc_parameters_weight_ = L_self_modules_fc_parameters_weight_
    l_self_modules_fc_parameters_bias_ = L_self_modules_fc_parameters_bias_
    l_self_modules_fc_out_parameters_weight_ = L_self_modules_fc_out_parameters_weight_
    l_self_modules_fc_out_parameters_bias_ = L_self_modules_fc_out_parameters_bias_
    mul = -1 * s27
    floordiv_3 = mul // 2;  mul = None
    mul_1 = -1 * floordiv_3;  floordiv_3 = None
    grad_all_reduce_bucket = dtensor_par_ops_collectives_grad_all_reduce_bucket([l_self_modules_fc_out_parameters_bias_, l_self_modules_fc_out_parameters_weight_, l_self_modules_fc_parameters_weight_, l_self_modules_fc_parameters_bias_, l_self_modules_ln2_parameters_weight_, l_self_modules_ln2_parameters_bias_, l_self_modules_proj_parameters_bias_, l_self_modules_proj_parameters_weight_, l_self_modules_qkv_parameters_weight_, l_self_modules_qkv_parameters_bias_, l_self_modules_ln1_parameters_weight_, l_self_modules_ln1_parameters_bias_], dtensor_par_mesh_MeshDim('cp', 2, 0, '9', ((0, 2), (1, 3)), 0, 0));  l_self_modules_fc_out_parameters_bias_ = l_self_modules_fc_out_parameters_weight_ = l_self_modules_fc_parameters_weight_ = l_self_modules_fc_parameters_bias_ = l_self_modules_ln2_parameters_weight_ = l_self_modules_ln2_parameters_bias_ = l_self_modules_proj_parameters_bias_ = l_self_modules_proj_parameters_weight_ = l_self_modules_qkv_parameters_weight_ = l_self_modules_qkv_parameters_bias_ = l_self_modules_ln1_parameters_weight_ = l_self_modules_ln1_parameters_bias_ = None
    getitem = grad_all_reduce_bucket[0]
    getitem_3 = grad_all_reduce_bucket[1]
    getitem_4 = grad_all_reduce_bucket[2]
    getitem_5 = grad_all_reduce_bucket[3]
    getitem_6 = grad_all_reduce_bucket[4]
    getitem_7 = grad_all_reduce_bucket[5]
    getitem_8 = grad_all_reduce_bucket[6]
    getitem_9 = grad_all_reduce_bucket[7]
    getitem_10 = grad_all_reduce_bucket[8]
    getitem_11 = grad_all_reduce_bucket[9]
    getitem_12 = grad_all_reduce_bucket[10]
    getitem_13 = grad_all_reduce_bucket[11];  grad_all_reduce_bucket = None
    layer_norm = torch.nn.functional.layer_norm(l_x_, (16,), getitem_12, getitem_13, 1e-05);  getitem_12 = getitem_13 = None
    grad_all_reduce_2 = dtensor_par_ops_collectives_grad_all_reduce(layer_norm, dtensor_par_mesh_MeshDim('tp', 2, 0, '7', ((0, 1), (2, 3)), 0, 0));  layer_norm = None
    linear = torch._C._nn.linear(grad_all_reduce_2, getitem_10, getitem_11);  grad_all_reduce_2 = getitem_10 = getitem_11 = None
    chunk = linear.chunk(3, dim = -1);  linear = None
    q = chunk[0]
    k = chunk[1]
    v = chunk[2];  chunk = None
    reshape_1 = q.reshape(s77, mul_1, 2, 4);  q = None
    q_1 = reshape_1.transpose(1, 2);  reshape_1 = None
    reshape_2 = k.reshape(s77, mul_1, 2, 4);  k = None
    k_1 = reshape_2.transpose(1, 2);  reshape_2 = None
    reshape_3 = v.reshape(s77, mul_1, 2, 4);  v = None
    v_1 = reshape_3.transpose(1, 2);  reshape_3 = None
    hybrid_attention = dtensor_par_ops_attention_hybrid_attention(q_1, k_1, v_1, attn_mask = None, is_causal = True, scale = None, enable_gqa = False, ulysses = dtensor_par_mesh_MeshDim('ulysses', 2, 0, '5', ((0, 2), (1, 3)), 0, 0), ring = dtensor_par_mesh_MeshDim('ring', 1, 0, None, ((0,), (1,), (2,), (3,)), 0, 0), ulysses_impl = 'all_to_all', kv_len = s27);  q_1 = k_1 = v_1 = None
    transpose_3 = hybrid_attention.transpose(1, 2);  hybrid_attention = None
    reshape_4 = transpose_3.reshape(s77, mul_1, 8);  transpose_3 = s77 = mul_1 = None
    linear_1 = torch._C._nn.linear(reshape_4, getitem_9);  reshape_4 = getitem_9 = None
    all_reduce = dtensor_par_ops_collectives_all_reduce(linear_1, dtensor_par_mesh_MeshDim('tp', 2, 0, '7', ((0, 1), (2, 3)), 0, 0));  linear_1 = None
    add = all_reduce + getitem_8;  all_reduce = getitem_8 = None
    x = l_x_ + add;  l_x_ = add = None
    layer_norm_1 = torch.nn.functional.layer_norm(x, (16,), getitem_6, getitem_7, 1e-05);  getitem_6 = getitem_7 = None
    grad_all_reduce_9 = dtensor_par_ops_collectives_grad_all_reduce(layer_norm_1, dtensor_par_mesh_MeshDim('tp', 2, 0, '7', ((0, 1), (2, 3)), 0, 0));  layer_norm_1 = None
    linear_2 = torch._C._nn.linear(grad_all_reduce_9, getitem_4, getitem_5);  grad_all_reduce_9 = getitem_4 = getitem_5 = None
    gelu = torch._C._nn.gelu(linear_2, approximate = 'tanh');  linear_2 = None
    linear_3 = torch._C._nn.linear(gelu, getitem_3);  gelu = getitem_3 = None
    all_reduce_1 = dtensor_par_ops_collectives_all_reduce(linear_3, dtensor_par_mesh_MeshDim('tp', 2, 0, '7', ((0, 1), (2, 3)), 0, 0));  linear_3 = None
    add_2 = all_reduce_1 + getitem;  all_reduce_1 = getitem = None
    add_1 = x + add_2;  x = add_2 = None
    all_gather = dtensor_par_ops_collectives_all_gather(add_1, 1, None, dtensor_par_mesh_MeshDim('cp', 2, 0, '9', ((0, 2), (1, 3)), 0, 0), length = s27);  add_1 = s27 = None
    return (all_gather,)""")


class SplitAtLength(torch.nn.Module):
    """An MLP's hidden rows cut at an index computed from the length (Mamba's scan: ``tensor_split``
    at the rows before the cache's), its features cut over tp."""

    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(32, 64), torch.nn.Linear(64, 32)

    def forward(self, x):
        head, tail = torch.tensor_split(torch.nn.functional.gelu(self.up(x)), [x.shape[1] - 2], dim=1)
        return self.down(torch.cat([head * 2, tail], 1))


def test_a_tensor_split_at_symbolic_indices_is_a_split(fake_world, tmp_path):
    """``tensor_split`` at an index computed from a symbolic length becomes ``split`` into its
    pieces' symbolic sizes, which the split rule places and the MLP site is read through: both
    projections cut (before: no site, every rank computing the whole MLP). The dump writes the
    symbolic sizes among its arguments as they print (before: plan.json failed on them)."""
    report = explain(SplitAtLength(), (torch.randn(2, 16, 32),), tp=2, dynamic=True, device_type="cpu",
                     dump_dir=str(tmp_path))
    (graph,) = report.graphs
    assert graph.symbolic and graph.coverage.fallback_gathers == [] and graph.warnings == [], graph.warnings
    assert graph.coverage.sharded_linear_flops == graph.coverage.linear_flops, graph.coverage.summary()
    assert any(path.name == "plan.json" for path in tmp_path.rglob("*")), list(tmp_path.rglob("*"))
