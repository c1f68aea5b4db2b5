"""A stand-in for ``torch_xla.core.xla_model`` on CPU: the semantics of the xm collectives the
xla lowering calls, with global ranks and full replica groups, over torch's functional
collectives (gloo in the rank processes, the fake group in process).

As torch_xla requires, ``groups`` must list every group (equal sizes, disjoint, covering the
world, the same on every rank), results come ordered by position in a group, and
``pin_layout`` must be False (what Neuron needs). Each call is appended to ``calls``.
``install`` puts the module in place of torch_xla's.
"""

from __future__ import annotations

import importlib.machinery
import sys
import types

import torch
import torch.distributed as dist

from dtensor_par.mesh import MeshDim
from dtensor_par.ops.lowerings import Functional

REDUCE_SUM = "sum"
MODULES = ("torch_xla", "torch_xla.core", "torch_xla.core.xla_model")
calls: list[str] = []
_process_groups: dict[tuple, list] = {}  # replica groups -> a process group per group


def install(put=sys.modules.__setitem__) -> None:
    """Make ``import torch_xla.core.xla_model`` give this module (``put(name, module)``)."""
    for name in MODULES[:-1]:
        package = types.ModuleType(name)
        package.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
        put(name, package)
    put(MODULES[-1], sys.modules[__name__])


def _record(name: str, x: torch.Tensor, **args) -> None:
    calls.append(f"{name} {list(x.shape)} " + " ".join(f"{k}={v}" for k, v in args.items()))


def _layout(groups: list[list[int]], pin_layout: bool) -> MeshDim:
    """This rank's group of ``groups`` as a mesh dim, its process groups made once per list."""
    if pin_layout:
        raise ValueError("xm stand-in: pin_layout=True (Neuron needs pin_layout=False)")
    key = tuple(map(tuple, groups))
    ranks = sorted(r for g in key for r in g)
    if len({len(g) for g in key}) != 1 or ranks != list(range(dist.get_world_size())):
        raise ValueError(f"xm stand-in: groups={groups} are not equal-size, disjoint groups covering the world")
    if key not in _process_groups:
        _process_groups[key] = [dist.new_group(list(g)) for g in key]  # every rank, the same order
    index = next(i for i, g in enumerate(key) if dist.get_rank() in g)
    return MeshDim("xm", len(key[index]), key[index].index(dist.get_rank()),
                   _process_groups[key][index].group_name, key, index)


def all_reduce(reduce_type: str, inputs: torch.Tensor, scale: float = 1.0, groups=None,
               pin_layout: bool = True) -> torch.Tensor:
    assert reduce_type == REDUCE_SUM
    _record("all_reduce", inputs, scale=scale, groups=groups, pin_layout=pin_layout)
    return Functional.all_reduce(inputs, _layout(groups, pin_layout)) * scale


def all_gather(value: torch.Tensor, dim: int = 0, groups=None, output=None, pin_layout: bool = True) -> torch.Tensor:
    _record("all_gather", value, dim=dim, groups=groups, pin_layout=pin_layout)
    return torch.cat(Functional.all_gather(value, _layout(groups, pin_layout)).unbind(0), dim=dim)


def reduce_scatter(reduce_type: str, input: torch.Tensor, scale: float, scatter_dim: int, shard_count: int,
                   groups=None, output=None, pin_layout: bool = True) -> torch.Tensor:
    assert reduce_type == REDUCE_SUM
    _record("reduce_scatter", input, scale=scale, scatter_dim=scatter_dim, shard_count=shard_count, groups=groups,
            pin_layout=pin_layout)
    stacked = torch.stack(input.chunk(shard_count, dim=scatter_dim))
    return Functional.reduce_scatter(stacked, _layout(groups, pin_layout)) * scale


def all_to_all(value: torch.Tensor, split_dimension: int, concat_dimension: int, split_count: int, groups=None,
               pin_layout: bool = True) -> torch.Tensor:
    _record("all_to_all", value, split_dimension=split_dimension, concat_dimension=concat_dimension,
            split_count=split_count, groups=groups, pin_layout=pin_layout)
    stacked = torch.stack(value.chunk(split_count, dim=split_dimension))
    return torch.cat(Functional.all_to_all(stacked, _layout(groups, pin_layout)).unbind(0), dim=concat_dimension)


def collective_permute(value: torch.Tensor, pairs: list[list[int]]) -> torch.Tensor:
    """Each rank sends ``value`` to its pairs' targets and receives from their sources; one
    ``all_to_all_single`` over the world with global ranks."""
    _record("collective_permute", value, pairs=pairs)
    me, world, rows = dist.get_rank(), dist.get_world_size(), value.shape[0]
    send = [sum(rows for s, t in pairs if s == me and t == r) for r in range(world)]
    receive = [sum(rows for s, t in pairs if t == me and s == r) for r in range(world)]
    c10d = torch.ops._c10d_functional
    out = c10d.all_to_all_single(value.contiguous(), receive, send, dist.group.WORLD.group_name)
    return c10d.wait_tensor(out)
