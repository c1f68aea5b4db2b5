"""The lower pass: replica groups, the Neuron checks, and the xla lowering run on CPU against
``tests.xm_gloo`` (torch_xla's xm collectives on gloo) in place of torch_xla."""

from __future__ import annotations

import itertools
from collections import Counter
import math
import sys

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import dtensor_par
from dtensor_par.planning import parallelize_graph
from dtensor_par.mesh import MESH_DIMS, SPANS, MeshDim, MeshInfo
from dtensor_par.ops.lowerings import ring_pairs
from dtensor_par.passes.capture import capture_graphs
from dtensor_par.config import ParallelConfig, resolve_collectives
from dtensor_par.passes.lower import check_circular, check_contiguous, check_partition
from dtensor_par.passes.meta import communications, placements
from dtensor_par.passes.steps import steps
from dtensor_par.params import local_value
from dtensor_par._testing import models
from dtensor_par._testing.harness import assert_matches, run_ranks
from tests import factories, tiers, xm_gloo
from tests.background import in_background
from tests.cases import run_cases
from tests.conftest import GoldenTestCase, _init_fake

NEURON_ORDER = ("ring", "tp", "ulysses")  # ulysses innermost: contiguous all-to-all groups


@pytest.fixture
def xm(monkeypatch):
    """``tests.xm_gloo`` as torch_xla.core.xla_model, for this test only."""
    xm_gloo.install(lambda name, module: monkeypatch.setitem(sys.modules, name, module))
    xm_gloo.calls.clear()
    return xm_gloo


def _expected_groups(sizes: dict, order: tuple, spans: tuple) -> set:
    """Groups of ``spans`` from each rank's coordinates (row-major over ``order``), each group
    in the order of its flattened coordinate (ring-major for cp, in ``spans``' order)."""
    groups: dict[tuple, dict[int, int]] = {}
    for rank, coords in enumerate(itertools.product(*(range(sizes[d]) for d in order))):
        at = dict(zip(order, coords))
        position = 0
        for d in spans:
            position = position * sizes[d] + at[d]
        groups.setdefault(tuple(at[d] for d in MESH_DIMS if d not in spans), {})[position] = rank
    return {tuple(g[i] for i in range(len(g))) for g in groups.values()}


@pytest.mark.parametrize("sizes", [dict(tp=2), dict(ring=4), dict(tp=2, ulysses=2), dict(tp=2, ring=2),
                                   dict(ring=2, ulysses=2), dict(tp=2, ring=2, ulysses=2),
                                   dict(tp=4, ring=2, ulysses=4), dict(tp=8, ring=2, ulysses=4)])
def test_xla_replica_groups_for_many_meshes_and_orders(sizes):
    """Every mesh dim's groups, in every order of the mesh dims: the ranks that share the other
    coordinates, by coordinate; a partition of the world; rotations as rings."""
    sizes = {**{d: 1 for d in MESH_DIMS}, **sizes}
    world = math.prod(sizes.values())
    for order in itertools.permutations(MESH_DIMS):
        info = MeshInfo.for_planning(sizes, "cpu", order)
        for name, spans in SPANS.items():
            dim = info.dims[name]
            if name == "fsdp":  # laid out as DTensor nests Shard placements: in the mesh's order
                spans = tuple(d for d in order if d in spans)
            assert set(dim.groups) == _expected_groups(sizes, order, spans), (order, name)
            assert len(dim.groups) == world // dim.size and 0 in dim.ranks and dim.rank == dim.ranks.index(0)
            check_partition(dim, world)
        pairs = ring_pairs(info.dims["ring"])
        assert len(pairs) == world and {tuple(p) for p in pairs} == {
            (g[i], g[(i + 1) % len(g)]) for g in info.dims["ring"].groups for i in range(len(g))}
        if sizes["ring"] > 1:
            check_circular(pairs, info.dims["ring"])


@pytest.mark.parametrize("check, message", [
    (lambda: check_partition(MeshDim("tp", 2, 0, None, ((0, 1), (2, 3, 4)), 0), 5),
     r"mesh dim 'tp' has groups of unequal sizes: \[\[0, 1\], \[2, 3, 4\]\] \(world size 5\)"),
    (lambda: check_partition(MeshDim("tp", 2, 0, None, ((0, 1), (1, 2)), 0), 4),
     r"mesh dim 'tp' has a rank in two groups: \[\[0, 1\], \[1, 2\]\]"),
    (lambda: check_partition(MeshDim("cp", 2, 0, None, ((0, 1), (2, 3)), 0), 8),
     r"mesh dim 'cp' has groups that do not cover the world: \[\[0, 1\], \[2, 3\]\] \(world size 8\)"),
    (lambda: check_circular([[0, 1], [1, 2]], MeshDim("ring", 3, 0, None, ((0, 1, 2),), 0)),
     r"collective_permute pairs \[\[0, 1\], \[1, 2\]\] over mesh dim 'ring' \(groups \[\[0, 1, 2\]\]\) do not form "
     r"rings"),
    (lambda: check_contiguous(MeshDim("cp", 4, 0, None, ((0, 1, 4, 5), (2, 3, 6, 7)), 0), NEURON_ORDER),
     r"all-to-all over mesh dim 'cp' needs groups of contiguous ranks on Neuron, but its groups are "
     r"\[\[0, 1, 4, 5\], \[2, 3, 6, 7\]\] .*order=\('tp', 'ring', 'ulysses'\)\) \(ring x ulysses innermost\)$"),
])
def test_xla_and_neuron_checks_name_the_mesh_dim_and_groups(check, message):
    with pytest.raises(ValueError, match=message):
        check()


def test_neuron_all_to_all_needs_contiguous_ulysses_groups():
    """On Neuron the plan refuses strided all-to-all groups and names an order that works; the
    Neuron default order and the all-gather form of Ulysses pass."""
    model, inputs = factories.gpt()
    mesh = dict(tp=2, ulysses=2, device_type="neuron")
    with pytest.raises(ValueError, match=r"mesh dim 'ulysses' .* groups are \[\[0, 2\], \[1, 3\]\] \(mesh order "
                                         r"\('ring', 'ulysses', 'tp'\)\); build the mesh with init_mesh\(\.\.\., "
                                         r"order=\('ring', 'tp', 'ulysses'\)\) \(ulysses innermost\) or "
                                         r"ulysses_impl='all_gather'"):
        dtensor_par.explain(model, inputs, **mesh, order=("ring", "ulysses", "tp"))
    assert dtensor_par.explain(model, inputs, **mesh).graphs[0].replica_group_sets == 2  # tp's, ulysses' (= cp's)
    dtensor_par.explain(model, inputs, **mesh, order=("ring", "ulysses", "tp"), ulysses_impl="all_gather")


def test_xla_replica_group_sets_count_and_limit(xm):
    """tp2 x ring2 x ulysses2: tp, cp and ulysses groups and the ring's permute pairs."""
    model, inputs = factories.gpt()
    mesh = dict(tp=2, ring=2, ulysses=2, order=NEURON_ORDER, collectives="xla")
    report = dtensor_par.explain(model, inputs, **mesh)
    assert report.graphs[0].replica_group_sets == 4 and "replica-group sets: 4 (xla)" in str(report)
    with pytest.raises(ValueError, match=r"uses 4 distinct replica-group sets, over the limit of 3 "
                                         r"\(replica_group_limit.*ring permute pairs: \[\[0, 4\], \[4, 0\]"):
        dtensor_par.explain(model, inputs, **mesh, replica_group_limit=3)


def test_xla_without_torch_xla_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_xla", None)
    model, inputs = factories.gpt()
    with pytest.raises(ImportError, match="collectives='xla' lowers every collective to torch_xla.core.xla_model "
                                          "calls, but torch_xla cannot be imported"):
        dtensor_par.explain(model, inputs, tp=2, collectives="xla")


def test_xla_chosen_by_auto_only_for_xla_tensors(fake_world, xm):
    assert resolve_collectives("auto", {"cpu"}) == "functional"
    assert resolve_collectives("auto", {"xla", "cpu"}) == "xla"
    assert resolve_collectives("functional", {"xla"}) == "functional"
    fake_world(2)
    (gm, inputs), = capture_graphs(models.GPTBlock(), torch.randn(2, 8, 32))
    mesh = MeshInfo.from_mesh(dtensor_par.init_mesh(tp=2))
    only = steps(last="lower")
    for device, lowered in (("cpu", None), ("xla", "xla")):
        with FakeTensorMode(allow_non_fake_inputs=True):
            on_device = [torch.empty(inputs[0].shape, device=device), *inputs[1:]]  # the input x
        local_gm, ctx = parallelize_graph(gm, on_device, mesh, steps=only)
        collectives = [n for n in local_gm.graph.nodes if n.op == "call_function" and communications(n)]
        assert ctx.comm == (lowered or "functional") and len(collectives) == 4
        assert {n.kwargs.get("comm") for n in collectives} == {lowered}


class TestXlaLoweredBlockGolden(GoldenTestCase):

    def test_xla_lowered_gpt_block_at_tp2_ring2_ulysses2(self):
        """The xm calls one block's forward and backward make, on rank 0 of a fake group of 8:
        every call with groups= every group of its mesh dim, pin_layout=False; the ring rotations
        as one collective_permute; the input and parameter gradients gathered too; the
        parameters' partial gradients reduced over cp in one flat bucket."""
        with pytest.MonkeyPatch.context() as monkeypatch:
            xm_gloo.install(lambda name, module: monkeypatch.setitem(sys.modules, name, module))
            _init_fake(8)
            info = MeshInfo.from_mesh(dtensor_par.init_mesh(tp=2, ring=2, ulysses=2, order=NEURON_ORDER))
            (g, inputs), = capture_graphs(models.GPTBlock(hidden=64, heads=8, mlp=128), torch.randn(2, 16, 64))
            gm, ctx = parallelize_graph(g, inputs, info, ParallelConfig(collectives="xla"))
            placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
            local = [local_value(value.detach().requires_grad_(), placements(n), ctx.mesh, ctx.comm)
                     for n, value in zip(placeholders, inputs)]
            xm_gloo.calls.clear()
            out, = gm(*local)
            forward = list(xm_gloo.calls)
            out.sum().backward()
        backward = xm_gloo.calls[len(forward):]
        self.assertExpectedInline("\n".join(["forward:", *forward, "backward:", *backward]), """\
forward:
all_to_all [2, 2, 2, 4, 8] split_dimension=0 concat_dimension=0 split_count=2 groups=[[0, 1], [2, 3], [4, 5], [6, 7]] pin_layout=False
all_to_all [2, 2, 2, 2, 4, 8] split_dimension=0 concat_dimension=0 split_count=2 groups=[[0, 1], [2, 3], [4, 5], [6, 7]] pin_layout=False
collective_permute [2, 2, 8, 16] pairs=[[0, 4], [4, 0], [1, 5], [5, 1], [2, 6], [6, 2], [3, 7], [7, 3]]
all_to_all [2, 2, 2, 4, 8] split_dimension=0 concat_dimension=0 split_count=2 groups=[[0, 1], [2, 3], [4, 5], [6, 7]] pin_layout=False
all_reduce [2, 4, 64] scale=1.0 groups=[[0, 2], [1, 3], [4, 6], [5, 7]] pin_layout=False
all_reduce [2, 4, 64] scale=1.0 groups=[[0, 2], [1, 3], [4, 6], [5, 7]] pin_layout=False
all_gather [1, 2, 4, 64] dim=0 groups=[[0, 1, 4, 5], [2, 3, 6, 7]] pin_layout=False
backward:
all_reduce [2, 4, 64] scale=1.0 groups=[[0, 2], [1, 3], [4, 6], [5, 7]] pin_layout=False
all_to_all [2, 2, 2, 4, 8] split_dimension=0 concat_dimension=0 split_count=2 groups=[[0, 1], [2, 3], [4, 5], [6, 7]] pin_layout=False
collective_permute [2, 2, 8, 16] pairs=[[0, 4], [4, 0], [1, 5], [5, 1], [2, 6], [6, 2], [3, 7], [7, 3]]
all_to_all [2, 2, 2, 2, 4, 8] split_dimension=0 concat_dimension=0 split_count=2 groups=[[0, 1], [2, 3], [4, 5], [6, 7]] pin_layout=False
all_to_all [2, 2, 2, 4, 8] split_dimension=0 concat_dimension=0 split_count=2 groups=[[0, 1], [2, 3], [4, 5], [6, 7]] pin_layout=False
all_reduce [2, 4, 64] scale=1.0 groups=[[0, 2], [1, 3], [4, 6], [5, 7]] pin_layout=False
all_reduce [16928] scale=1.0 groups=[[0, 1, 4, 5], [2, 3, 6, 7]] pin_layout=False
all_gather [1, 64, 64] dim=0 groups=[[0, 2], [1, 3], [4, 6], [5, 7]] pin_layout=False
all_gather [1, 64] dim=0 groups=[[0, 2], [1, 3], [4, 6], [5, 7]] pin_layout=False
all_gather [1, 64, 64] dim=0 groups=[[0, 2], [1, 3], [4, 6], [5, 7]] pin_layout=False
all_gather [1, 64, 32] dim=0 groups=[[0, 2], [1, 3], [4, 6], [5, 7]] pin_layout=False
all_gather [1, 96] dim=0 groups=[[0, 2], [1, 3], [4, 6], [5, 7]] pin_layout=False
all_gather [1, 96, 64] dim=0 groups=[[0, 2], [1, 3], [4, 6], [5, 7]] pin_layout=False
all_gather [1, 2, 4, 64] dim=0 groups=[[0, 1, 4, 5], [2, 3, 6, 7]] pin_layout=False""")


def _runs(rank: int, world: int, *, runs: dict) -> dict:
    """Each run: (the mesh as run_cases takes it, hybrid_parallel options, cases); which xm
    functions it called comes back with its metrics."""
    xm_gloo.install()
    results = {}
    for label, (mesh, options, cases) in runs.items():
        xm_gloo.calls.clear()
        metrics = run_cases(rank, world, names=cases, options=options, steps=1, **mesh)
        results[label] = {"metrics": metrics, "xm": sorted({c.split()[0] for c in xm_gloo.calls})}
    return results


XLA = {"collectives": "xla"}
ALL_GATHER = {"ulysses_impl": "all_gather"}
EAGER = {"inner_backend": "eager"}
PERMUTED = [[3, 1], [0, 2]]  # coordinates and process-group ranks (by global rank) differ along both dims
RUNS = {
    4: {"xla tp2 x ulysses2": (dict(mesh_sizes={"tp": 2, "ulysses": 2}, order=NEURON_ORDER), XLA,
                               ["gpt_fused_qkv"]),
        "xla tp2 x ring2": (dict(mesh_sizes={"tp": 2, "ring": 2}), XLA, ["gpt_fused_qkv", "uneven_seq_30_masked"]),
        # Strided ulysses groups (tp innermost): refused for all-to-all, fine for all-gathers; 7 heads per
        # tp rank padded to 8 for ulysses.
        "xla all_gather tp2 x ulysses2": (dict(mesh_sizes={"tp": 2, "ulysses": 2}), {**XLA, **ALL_GATHER},
                                          ["uneven_heads_14"]),
        "all_gather ring2 x ulysses2": (dict(mesh_sizes={"ring": 2, "ulysses": 2}), ALL_GATHER,
                                        ["uneven_seq_30_masked"]),
        # The permuted meshes differ in the groups the collectives name: their local graphs run as they are.
        "permuted ring, tp": (dict(mesh_ranks=(PERMUTED, ("ring", "tp"))), EAGER, ["gpt_fused_qkv", "unshardable_op"]),
        "xla permuted ring, tp": (dict(mesh_ranks=(PERMUTED, ("ring", "tp"))), {**XLA, **EAGER}, ["gpt_fused_qkv"]),
        "permuted ulysses, tp": (dict(mesh_ranks=(PERMUTED, ("ulysses", "tp"))), EAGER, ["llama_gqa_rope"])},
    # Groups of 4: the lowering's groups and rotations at another size (AOT's trace of the xla ops: at world 4).
    8: {"xla tp2 x ulysses4": (dict(mesh_sizes={"tp": 2, "ulysses": 4}, order=NEURON_ORDER), {**XLA, **EAGER},
                               ["gpt_fused_qkv"]),
        "xla tp2 x ring4": (dict(mesh_sizes={"tp": 2, "ring": 4}), {**XLA, **EAGER}, ["gpt_fused_qkv"])},
}


SWEPT = {8}
"""World sizes ``tests.tiers`` leaves to ``--sweep``: groups of 4 lower as groups of 2 do, and
``test_xla_replica_groups_for_many_meshes_and_orders`` checks them at every size in process."""
LAUNCHES = {world: in_background(run_ranks, world, _runs, runs=runs) for world, runs in RUNS.items()
            if tiers.kept(world, SWEPT)}
"""One launch per world size for all of its runs."""


def _results(world: int) -> dict:
    """Rank 0's results of the launch of ``world`` ranks (``test_xla_lowering_matches_single_device``
    checks every rank's)."""
    return LAUNCHES[world].result()[0]


@pytest.mark.parametrize("world, label, name", [tiers.case(world, label, name, sweep=world in SWEPT)
                                                for world, runs in RUNS.items()
                                                for label, (_, _, cases) in runs.items() for name in cases])
def test_xla_lowering_matches_single_device(world, label, name):
    """tp x ulysses and tp x ring through the xm calls only: forward and every gradient exact."""
    results = LAUNCHES[world].result()
    assert all(name in rank_results[label]["metrics"] for rank_results in results), (label, name)
    assert_matches(f"{label}: {name} at world {world}",
                   [rank_results[label]["metrics"][name] for rank_results in results])
    xm = results[0][label]["xm"]
    if label.startswith("xla"):
        expected = {"all_gather", "all_reduce"} | (
            {"collective_permute"} if "ring" in label else
            {"reduce_scatter"} if "all_gather" in label else {"all_to_all"})
        assert set(xm) == expected, (label, xm)
    else:
        assert xm == [], label


def test_ulysses_all_gather_form_matches_single_device():
    """Without all-to-all: heads padded for ulysses (over xm calls) and a padded zigzag
    sequence under a mask (over gloo)."""
    results = _results(4)
    assert any("padded to 8 heads" in w for w in
               results["xla all_gather tp2 x ulysses2"]["metrics"]["uneven_heads_14"]["warnings"])
    assert "all_to_all" not in results["xla all_gather tp2 x ulysses2"]["xm"]


def test_permuted_mesh_takes_shards_by_coordinate():
    """A user mesh whose rank order is not the default: shards, gathers (tp gathers before an
    op without a rule), ring rotations and the zigzag layout follow each rank's coordinate,
    with functional collectives and with xm calls."""
    results = _results(4)
    assert any("logcumsumexp" in w for w in results["permuted ring, tp"]["metrics"]["unshardable_op"]["warnings"])
    assert "collective_permute" in results["xla permuted ring, tp"]["xm"]


def test_ulysses_all_gather_form_collectives():
    """Per attention: three all-gathers over ulysses forward (q, k/v, the output), three
    reduce-scatters backward, no all-to-all."""
    model, inputs = factories.gpt()
    graph, = dtensor_par.explain(model, inputs, tp=2, ulysses=2, ulysses_impl="all_gather").graphs
    ulysses = Counter()
    for c in graph.collectives:
        if c["mesh_dims"] == "ulysses" and c["site"] == "attention0":
            ulysses[c["direction"], c["op"]] += c["count"]
    assert ulysses == {("forward", "all_gather"): 3, ("backward", "reduce_scatter"): 3}
