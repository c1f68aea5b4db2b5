"""The lowerings of the collectives: how each primitive reaches the network. Every
redistribution, ring rotation and Ulysses exchange is built from these few primitives, in
chunk order (by the coordinate along the mesh dim that holds each chunk, never by global
rank). ``LOWERINGS`` maps each lowering's name (a ``comm`` argument, ``ctx.comm``) to its
class; the module is named for them. None has autograd: ``ops.collectives`` wraps them in
the collectives a localized graph calls, with the replicated-loss gradients.

``Functional`` issues torch's functional collectives over this rank's process group (NCCL,
gloo, TorchNeuron's ``neuron`` backend). A process group orders its ranks by global rank, so
pieces are put into and taken out of that order; a mesh whose ranks do not increase along a
dim makes the two differ.

``Xla`` issues ``torch_xla.core.xla_model`` calls. torch_xla's kernels for the functional
collectives ignore the group name (a sub-group all-reduce becomes a world all-reduce), so
each call names the groups itself: ``groups=`` every group of the mesh dim, the same list on
every rank, each group in coordinate order (xm orders results by position in the group), and
``pin_layout=False`` (pinned, all_to_all emits a tuple StableHLO conversion rejects and
all_gather becomes an all_reduce). A ring rotation is one ``collective_permute`` over the
pairs of every ring group. torch_xla is imported at the first call.

Tensors that go to or come from every rank of a group are stacked on a new leading dim, one
entry per chunk.
"""

from __future__ import annotations

import importlib

import torch

from ..mesh import MeshDim

_c10d = torch.ops._c10d_functional


def _group_order(dim: MeshDim) -> list[int]:
    """The chunk each group rank holds: process groups rank their members by global rank."""
    return [dim.ranks.index(r) for r in sorted(dim.ranks)]


def _to_group_order(stacked: torch.Tensor, dim: MeshDim) -> torch.Tensor:
    order = _group_order(dim)
    return stacked if order == sorted(order) else torch.stack([stacked[c] for c in order])


def _to_chunk_order(stacked: torch.Tensor, dim: MeshDim) -> torch.Tensor:
    order = _group_order(dim)
    if order == sorted(order):
        return stacked
    by_chunk = [None] * dim.size
    for piece, chunk in zip(stacked.unbind(0), order):
        by_chunk[chunk] = piece
    return torch.stack(by_chunk)


class Functional:
    """torch's functional collectives over ``dim.group_name``."""

    @staticmethod
    def all_reduce(x: torch.Tensor, dim: MeshDim) -> torch.Tensor:
        return _c10d.wait_tensor(_c10d.all_reduce(x.contiguous(), "sum", dim.group_name))

    @staticmethod
    def all_gather(x: torch.Tensor, dim: MeshDim) -> torch.Tensor:
        """``[size, *x.shape]``: every rank's ``x``, by chunk."""
        out = _c10d.wait_tensor(_c10d.all_gather_into_tensor(x.contiguous().unsqueeze(0), dim.size, dim.group_name))
        return _to_chunk_order(out, dim)

    @staticmethod
    def reduce_scatter(stacked: torch.Tensor, dim: MeshDim) -> torch.Tensor:
        """The sum over ranks of ``stacked[c]``, ``c`` this rank's chunk."""
        send = _to_group_order(stacked, dim).contiguous()
        return _c10d.wait_tensor(_c10d.reduce_scatter_tensor(send, "sum", dim.size, dim.group_name))[0]

    @staticmethod
    def all_to_all(stacked: torch.Tensor, dim: MeshDim) -> torch.Tensor:
        """Sends ``stacked[c]`` to the holder of chunk ``c``; returns what each chunk's holder sent here."""
        send = _to_group_order(stacked, dim).contiguous()
        split = [1] * dim.size  # one entry of the stacked dim each
        received = _c10d.all_to_all_single(send, split, split, dim.group_name)
        return _to_chunk_order(_c10d.wait_tensor(received), dim)

    @staticmethod
    def start_rotation(x: torch.Tensor, dim: MeshDim) -> torch.Tensor:
        """Start sending ``x`` to the next rank of the ring (by coordinate) and receiving the
        previous one's; ``finish_rotation`` waits for it. One ``all_to_all_single`` whose only
        non-empty split goes to the next rank."""
        group_rank = sorted(dim.ranks).index
        rows = x.shape[0]
        send, receive = [0] * dim.size, [0] * dim.size
        send[group_rank(dim.ranks[(dim.rank + 1) % dim.size])] = rows
        receive[group_rank(dim.ranks[(dim.rank - 1) % dim.size])] = rows
        return _c10d.all_to_all_single(x.contiguous(), receive, send, dim.group_name)

    @staticmethod
    def finish_rotation(x: torch.Tensor) -> torch.Tensor:
        return _c10d.wait_tensor(x)


def replica_groups(dim: MeshDim) -> list[list[int]]:
    """``groups=`` for an xm collective over ``dim``: every group, by coordinate."""
    return [list(g) for g in dim.groups]


def ring_pairs(dim: MeshDim) -> list[list[int]]:
    """``collective_permute`` pairs of a rotation over ``dim``: each rank sends to the next of
    its group, in every group."""
    return [[g[i], g[(i + 1) % len(g)]] for g in dim.groups for i in range(len(g))]


def xla_model():
    """``torch_xla.core.xla_model``; only the xla lowering needs torch_xla."""
    try:
        return importlib.import_module("torch_xla.core.xla_model")
    except ImportError as e:
        raise ImportError(
            "lower: collectives='xla' lowers every collective to torch_xla.core.xla_model calls, but "
            f"torch_xla cannot be imported ({e}); install the torch_xla stack (torch-neuronx 2.9 and before, from "
            "AWS's Neuron package repository), or use collectives='functional'") from e


class Xla:
    """torch_xla's xm collectives over every group of ``dim`` at once."""

    @staticmethod
    def all_reduce(x: torch.Tensor, dim: MeshDim) -> torch.Tensor:
        xm = xla_model()
        return xm.all_reduce(xm.REDUCE_SUM, x, groups=replica_groups(dim), pin_layout=False)

    @staticmethod
    def all_gather(x: torch.Tensor, dim: MeshDim) -> torch.Tensor:
        return xla_model().all_gather(x.unsqueeze(0), 0, groups=replica_groups(dim), pin_layout=False)

    @staticmethod
    def reduce_scatter(stacked: torch.Tensor, dim: MeshDim) -> torch.Tensor:
        xm = xla_model()
        return xm.reduce_scatter(xm.REDUCE_SUM, stacked, 1.0, 0, dim.size, groups=replica_groups(dim),
                                 pin_layout=False)[0]

    @staticmethod
    def all_to_all(stacked: torch.Tensor, dim: MeshDim) -> torch.Tensor:
        return xla_model().all_to_all(stacked, 0, 0, dim.size, groups=replica_groups(dim), pin_layout=False)

    @staticmethod
    def start_rotation(x: torch.Tensor, dim: MeshDim) -> torch.Tensor:
        return xla_model().collective_permute(x, ring_pairs(dim))

    @staticmethod
    def finish_rotation(x: torch.Tensor) -> torch.Tensor:
        return x


FUNCTIONAL = "functional"
LOWERINGS = {FUNCTIONAL: Functional, "xla": Xla}
