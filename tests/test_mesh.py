"""MeshInfo: the layout facts each collective carries, built once per mesh."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

import dtensor_par
from dtensor_par.planning import parallelize_graph
from dtensor_par.mesh import MeshDim, MeshInfo
from dtensor_par.ops import collectives as C
from dtensor_par.passes.capture import capture_graphs
from dtensor_par.passes.meta import communications
from dtensor_par._testing import models, patterns


def test_cp_process_groups_are_created_once_per_mesh(fake_world, monkeypatch):
    """Two hybrid_parallel calls over one mesh and a recompile for a new sequence length
    create the cp groups (one per tp index) once; another mesh object gets its own."""
    fake_world(8)
    mesh = dtensor_par.init_mesh(tp=2, ring=2, ulysses=2)
    created = []
    new_group = dist.new_group
    monkeypatch.setattr(dist, "new_group", lambda ranks, **kw: created.append(ranks) or new_group(ranks, **kw))
    model = models.GPTBlock(hidden=64, heads=8, mlp=128)
    for _ in range(2):
        compiled = torch.compile(model, backend=dtensor_par.hybrid_parallel(mesh, inner_backend="eager"))
        for seq in (8, 16):
            compiled(torch.randn(2, seq, 64))
    assert created == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert MeshInfo.from_mesh(mesh) is MeshInfo.from_mesh(mesh)
    other = MeshInfo.from_mesh(dtensor_par.init_mesh(tp=2, ring=2, ulysses=2))
    assert len(created) == 4 and other.dims["cp"].group_name != MeshInfo.from_mesh(mesh).dims["cp"].group_name


def test_coordinates_come_from_the_mesh_not_the_global_rank(fake_world):
    """Rank 0 sits at coordinate (1, 0) of this mesh: ring coordinate 1, tp coordinate 0; each
    group lists its ranks by coordinate, and cp (ring x ulysses, ring-major) equals ring here."""
    fake_world(4)
    info = MeshInfo.from_mesh(DeviceMesh("cpu", [[3, 1], [0, 2]], mesh_dim_names=("ring", "tp")))
    tp, ring, cp = info.dims["tp"], info.dims["ring"], info.dims["cp"]
    assert (tp.rank, tp.groups, tp.ranks) == (0, ((3, 1), (0, 2)), (0, 2))
    assert (ring.rank, ring.groups, ring.ranks) == (1, ((3, 0), (1, 2)), (3, 0))
    assert (cp.rank, cp.groups, cp.zigzag) == (1, ring.groups, 2)


def test_every_collective_node_states_its_layout(fake_world):
    """tp2 x ring2 x ulysses2, a masked sequence of 30 laid out as 32: each collective node
    takes the MeshDim of each mesh dim it communicates over (groups, this rank's coordinate,
    zigzag), and a gather of the padded sequence its real length: the graph alone says what
    every collective does."""
    fake_world(8)
    info = MeshInfo.from_mesh(dtensor_par.init_mesh(tp=2, ring=2, ulysses=2))
    keep = torch.ones(2, 30, dtype=torch.bool)
    (g, inputs), = capture_graphs(patterns.MaskedAttention("additive"), torch.randn(2, 30, 32), keep)
    gm, _ = parallelize_graph(g, inputs, info)
    seen = set()
    for node in gm.graph.nodes:
        if node.op == "call_function" and communications(node):
            dims = [a for a in (*node.args, *node.kwargs.values()) if isinstance(a, MeshDim)]
            assert {d.name for d in dims} == {c.mesh_dim for c in communications(node)}, node.name
            assert all(d == info.dims[d.name] for d in dims), node.name
            seen |= {d.name for d in dims}
    assert seen == {"tp", "cp", "ring", "ulysses"} and info.dims["cp"].zigzag == 2
    gather, = [n for n in gm.graph.nodes if n.target is C.all_gather]
    assert gather.args[3].name == "cp" and gather.kwargs == {"length": 30}


def test_every_declared_mesh_dim_reaches_the_mesh_the_entry_points_and_the_cli(fake_world):
    """Each mesh dim of ``mesh.PLAN_DIMS_DECLARED`` is read off the declaration everywhere: a
    degree of init_mesh and of the entry points' keywords, a CLI flag with its plan dim's help,
    a span of MeshInfo, and a dim choose_mesh factors the world over."""
    from dtensor_par.__main__ import _parser
    from dtensor_par.choose import factorizations
    from dtensor_par.mesh import MESH_DIMS, PLAN_DIMS_DECLARED, SPANS, split_degrees

    explain_flags = {a.dest: a.help for a in _parser()._subparsers._group_actions[0].choices["explain"]._actions}
    fake_world(2)
    for plan_dim in PLAN_DIMS_DECLARED:
        for dim in plan_dim.mesh_dims:
            assert dim in MESH_DIMS and SPANS[dim] == (dim,), dim
            assert split_degrees({dim: 2, "ep": "cp"}) == ({n: 2 if n == dim else 1 for n in MESH_DIMS}, {"ep": "cp"})
            assert plan_dim.help in explain_flags[dim], (dim, explain_flags.get(dim))
            assert {n: 2 if n == dim else 1 for n in MESH_DIMS} in factorizations(2), dim
            mesh = dtensor_par.init_mesh(**{dim: 2})
            assert dict(zip(mesh.mesh_dim_names, mesh.shape))[dim] == 2, (dim, mesh)
        if len(plan_dim.mesh_dims) > 1:
            assert SPANS[plan_dim.name] == plan_dim.mesh_dims
