"""Bad input gets a clear error naming the node, the mesh dim and the sizes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

import dtensor_par
from dtensor_par.ops import collectives as C
from dtensor_par.errors import NotSupported, PlanningError
from dtensor_par._testing import models, patterns


def test_unknown_mesh_dim_name(fake_world):
    fake_world(8)
    mesh = init_device_mesh("cpu", (4, 2), mesh_dim_names=("tp", "dp"))
    with pytest.raises(ValueError, match=r"unknown mesh dim names \['dp'\].*sizes \(4, 2\)"):
        dtensor_par.hybrid_parallel(mesh)


def test_mesh_size_must_equal_world_size(fake_world):
    fake_world(8)
    with pytest.raises(ValueError, match=r"tp=4 x ring=1 x ulysses=1 = 4 ranks, but the world size is 8"):
        dtensor_par.init_mesh(tp=4)
    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
    with pytest.raises(ValueError, match=r"holds 4 ranks but the world size is 8"):
        dtensor_par.hybrid_parallel(mesh)


def test_init_mesh_rejects_bad_order_and_sizes(fake_world):
    fake_world(8)
    with pytest.raises(ValueError, match="order must name each of"):
        dtensor_par.init_mesh(tp=8, order=("tp", "ring", "dp"))
    with pytest.raises(ValueError, match=r"explain: order must name each of .* got \('tp', 'ring', 'dp'\)"):
        dtensor_par.explain(models.GPTBlock(), (torch.randn(2, 8, 32),), tp=2, order=("tp", "ring", "dp"))
    with pytest.raises(ValueError, match="'ring' must be a positive int"):
        dtensor_par.init_mesh(tp=8, ring=0)


def test_init_mesh_order_puts_last_dim_on_contiguous_ranks(fake_world):
    fake_world(8)
    mesh = dtensor_par.init_mesh(tp=2, ring=2, ulysses=2)
    assert mesh.mesh_dim_names == ("ring", "ulysses", "tp")
    assert mesh.mesh.flatten().tolist() == list(range(8))
    mesh = dtensor_par.init_mesh(tp=2, ring=2, ulysses=2, order=("tp", "ring", "ulysses"))
    assert mesh.mesh_dim_names == ("tp", "ring", "ulysses")
    assert dtensor_par.mesh.default_order("neuron")[-1] == "ulysses"


def test_heads_not_divisible_by_tp(fake_world):
    fake_world(8)
    compiled = torch.compile(models.GPTBlock(hidden=48, heads=6, mlp=64),
                             backend=dtensor_par.hybrid_parallel(dtensor_par.init_mesh(tp=8), inner_backend="eager"))
    with pytest.raises(ValueError, match=r"attention 'a' has 6 heads, not divisible by mesh dim 'tp' of size 8"):
        compiled(torch.randn(2, 8, 48))


def test_inputs_on_another_device_type_than_the_mesh(fake_world):
    fake_world(2)
    model = models.GPTBlock().to("meta")
    compiled = torch.compile(model, backend=dtensor_par.hybrid_parallel(dtensor_par.init_mesh(tp=2),
                                                                         inner_backend="eager"))
    with pytest.raises(ValueError, match=r"input 'l_x_' is on meta but the mesh is on cpu"):
        compiled(torch.randn(2, 8, 32, device="meta"))


def test_sequence_parallel_and_context_parallel_together_are_refused(fake_world):
    fake_world(4)
    with pytest.raises(NotImplementedError, match=r"sequence_parallel=True with context parallelism \(ring=2"):
        dtensor_par.hybrid_parallel(dtensor_par.init_mesh(tp=2, ring=2), sequence_parallel=True)


def test_sequence_shorter_than_cp(fake_world):
    fake_world(4)
    compiled = torch.compile(models.GPTBlock(), backend=dtensor_par.hybrid_parallel(
        dtensor_par.init_mesh(ring=2, ulysses=2), inner_backend="eager"))
    with pytest.raises(ValueError, match=r"attention 'a' has sequence length 3 \(keys 3\), shorter than mesh dims "
                                         r"'ring' x 'ulysses' = 2 x 2 = 4"):
        compiled(torch.randn(2, 3, 32))


class _PooledText(torch.nn.Module):
    """Text tokens pooled by one query, their mean (Mochi's attention pool), before a block."""

    def __init__(self):
        super().__init__()
        self.block = models.GPTBlock()

    def forward(self, x, text):
        heads = lambda t: t.unflatten(-1, (4, 8)).transpose(1, 2)  # noqa: E731
        pooled = F.scaled_dot_product_attention(heads(text.mean(1, keepdim=True)), heads(text), heads(text))
        return self.block(x + pooled.transpose(1, 2).flatten(2))


def test_attention_fewer_than_cp_on_one_side_runs_whole_beside_the_sequence(fake_world):
    """One query against the text (a pool) is no sequence the ranks share: it runs whole, named
    in a warning, and the block beside it runs over cp (a self-attention of 3 tokens is refused)."""
    report = dtensor_par.explain(_PooledText(), (torch.randn(2, 8, 32), torch.randn(2, 6, 32)), ulysses=4)
    graph, = report.graphs
    assert any("attention over 1 query rows and 6 keys, fewer than the 4 cp ranks on one side, runs on the gathered "
               "sequence" in w for w in graph.warnings), graph.warnings
    assert any("hybrid_attention" in site for site in graph.sites), graph.sites


def test_local_output_of_a_padded_sequence_is_refused(fake_world):
    fake_world(2)
    compiled = torch.compile(models.GPTBlock(), backend=dtensor_par.hybrid_parallel(
        dtensor_par.init_mesh(ulysses=2), inner_backend="eager", output="local"))
    with pytest.raises(NotImplementedError, match=r"output='local' with a sequence of length 5 padded to split "
                                                  r"over mesh dims 'ring' x 'ulysses' = 2"):
        compiled(torch.randn(2, 5, 32))


def test_unknown_output_mode(fake_world):
    fake_world(2)
    with pytest.raises(ValueError, match="output must be one of"):
        dtensor_par.hybrid_parallel(dtensor_par.init_mesh(tp=2), output="gathered")


def test_unshardable_op_gathers_with_a_warning_naming_the_node(planned):
    gm, ctx = planned(patterns.UnruledOpMLP(), [torch.randn(2, 4, 16)], tp=4)
    assert ctx.warnings == ["logcumsumexp (torch.logcumsumexp): inputs gathered on mesh dim 'tp': no sharding rule "
                            "for torch.logcumsumexp"]
    gathered = [n for n in gm.graph.nodes if n.target is C.all_gather]
    assert [n.args[0].name for n in gathered] == ["h"]


def test_local_output_of_zigzag_sequence_shards_is_refused(fake_world):
    fake_world(2)
    compiled = torch.compile(models.GPTBlock(), backend=dtensor_par.hybrid_parallel(
        dtensor_par.init_mesh(ring=2), inner_backend="eager", output="local"))
    with pytest.raises(NotImplementedError, match="zigzag layout, which a DTensor placement cannot describe"):
        compiled(torch.randn(2, 8, 32))


def test_user_mesh_with_a_subset_of_dim_names(fake_world):
    fake_world(8)
    from dtensor_par.mesh import MeshInfo

    info = MeshInfo.from_mesh(init_device_mesh("cpu", (4, 2), mesh_dim_names=("ulysses", "tp")))
    assert {n: info.size(n) for n in ("tp", "ring", "ulysses", "cp")} == {"tp": 2, "ring": 1, "ulysses": 4, "cp": 4}
    assert info.order == ("ring", "ulysses", "tp") and info.world_size == 8
    compiled = torch.compile(models.GPTBlock(hidden=64, heads=8, mlp=128), backend=dtensor_par.hybrid_parallel(
        init_device_mesh("cpu", (8,), mesh_dim_names=("tp",)), inner_backend="eager"))
    assert compiled(torch.randn(2, 8, 64)).shape == (2, 8, 64)


class _InPlaceMLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(16, 32), torch.nn.Linear(32, 16)

    def forward(self, x):
        h = torch.relu(self.up(x))
        h.cumsum_(-1)  # no rule: its input would be gathered, and the write lost
        return self.down(h)


def test_in_place_op_without_a_rule_on_a_shard_is_refused(planned):
    with pytest.raises(NotImplementedError, match=r"cumsum_ \(Tensor.cumsum_\) writes in place into .* mesh dim 'tp'"):
        planned(_InPlaceMLP(), [torch.randn(2, 4, 16)], tp=4)


class _ScaledBySum(torch.nn.Module):
    def forward(self, x):
        return x * x.sum().item()


class _KeptRows(torch.nn.Module):
    def forward(self, x):
        rows = x.flatten(0, 1)
        return rows[torch.nonzero(rows.sum(-1) > 0).squeeze(1)]


class _UnevenExperts(patterns.LoopedExperts):
    """Expert 1 twice as wide as the others: no stack holds their weights."""

    def __init__(self):
        super().__init__(32, 64, 4, 2)
        self.experts[1] = patterns.GatedExpert(32, 128)


class _SkippedExpert(patterns.MaskedLoopExperts):
    """The last expert left out of the loop: its rows would keep ``empty_like``'s values."""

    def __init__(self):
        super().__init__(32, 64, 4, 2)
        self.experts = self.experts[:3]


def test_a_size_that_depends_on_values_is_refused_naming_the_op_and_the_way_around():
    """Under Dynamo's ``capture_dynamic_output_shape_ops`` a ``nonzero`` is captured with a size
    no plan can lay out (under ``capture_scalar_outputs``, a computed tensor's ``.item()`` a
    number): refused on purpose, naming the op and the model's line, not a dtensor_par bug. A
    loop over experts that capture cannot read as experts a row at a time is refused saying why."""
    nonzero = r"^capture: nonzero \(torch.nonzero\) of inputs \[\[32\]\] \(.*test_errors.py.*torch.nonzero"
    uneven = (r"^capture: the loop over experts whose first pass is where .* expert 1's linear_\d+ has a weight of "
              r"another shape. Compile without Dynamo's capture_dynamic_output_shape_ops")
    skipped = (r"^capture: the loop over experts whose first pass is getitem_?\d* \(rows\[ids == e\]\) .* it passes "
               r"experts \[0, 1, 2\] of 4, not each once")
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        with pytest.raises(NotSupported, match=nonzero):
            dtensor_par.explain(_KeptRows(), (torch.randn(2, 16, 32),), tp=2)
        with pytest.raises(NotSupported, match=uneven):
            dtensor_par.explain(_UnevenExperts(), (torch.randn(2, 8, 32),), tp=2)
        with pytest.raises(NotSupported, match=skipped):
            dtensor_par.explain(_SkippedExpert(), (torch.randn(2, 8, 32),), tp=2)
    item = r"^capture: item \(Tensor.item\) of inputs \[\[\]\] .*x.sum\(\).item\(\)"
    with torch._dynamo.config.patch(capture_scalar_outputs=True), pytest.raises(NotSupported, match=item):
        dtensor_par.explain(_ScaledBySum(), (torch.randn(2, 8, 32),), tp=2)


# A function each pass calls per node inside its ``at_node``, and the defect it is made to raise.
INTERNAL_ERRORS = {
    "capture": ("torch.fx.passes.fake_tensor_prop.FakeTensorProp.run_node", IndexError("list index out of range")),
    "canonicalize": ("dtensor_par.passes.canonicalize.canonicalize_node",
                     ValueError("not enough values to unpack (expected 3, got 1)")),
    "detect": ("dtensor_par.passes.detect.attention.attention_site", KeyError("query")),
    "kv_cache": ("dtensor_par.passes.kv_cache.to_cached_attention", AttributeError("no meta")),
    "rewrite": ("dtensor_par.passes.rewrite.split_rowwise_bias", TypeError("not subscriptable")),
    "sequence": ("dtensor_par.passes.sequence.sequence_lengths", IndexError("tuple index out of range")),
    "tracing cuts on 'cp'": ("dtensor_par.passes.plan.plan_node", ValueError("too many values to unpack")),
    "plan": ("dtensor_par.passes.plan.plan_node", ValueError("too many values to unpack")),
    "coverage": ("dtensor_par.passes.coverage._linear_flops", ZeroDivisionError("division by zero")),
    "localize": ("dtensor_par.passes.localize.lookup", KeyError("cp")),
}


@pytest.mark.parametrize("pass_name", INTERNAL_ERRORS)
def test_an_internal_error_in_any_pass_is_a_planning_error_naming_the_node(pass_name, monkeypatch):
    """A defect of ours (an unpacking ValueError too, as Bloom's keyword ``baddbmm`` met) reaches
    the user as a PlanningError naming the pass, the node, its op and its inputs' shapes."""
    target, error = INTERNAL_ERRORS[pass_name]

    def fail(*args, **kwargs):
        raise error

    monkeypatch.setattr(target, fail)
    if pass_name == "capture":  # values propagated node by node, not read off Dynamo's
        monkeypatch.setattr("dtensor_par.passes.capture._values_from_dynamo", lambda gm: False)
    inputs = r"(\w+ \[[\d, ]*\].*)?"  # "name [shape] (placements)" of each input; a placeholder has none
    with pytest.raises(PlanningError, match=rf"^{pass_name}: cannot handle node \w+ \[[\d, ]*\].* = [\w.]+\({inputs}\): "
                                            rf"{type(error).__name__}: .*This is a dtensor_par bug") as caught:
        # the sequence pass traces its inputs' cuts with the plan's rules before the plan runs them
        dtensor_par.explain(models.GPTBlock(), (torch.randn(2, 8, 32),), **({"tp": 2} if pass_name == "plan" else
                                                                          {"tp": 2, "ring": 2}))
    assert caught.value.__cause__ is error
