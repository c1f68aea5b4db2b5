"""Expert parallelism: each rank of a mesh dim ``ep`` (the cp ranks) holds ``E / ep`` of a
mixture's experts, expert ``e`` on coordinate ``e // (E / ep)``, and the rows its tokens send to
other ranks' experts travel there and back by uneven all-to-alls.

A rank's dispatch sorts its rows by expert, so the rows for one rank's experts are one run.
``dispatch_rows`` sends each run to its experts' holder and returns what every rank sent here,
regrouped expert by expert (as a grouped matmul reads them, ``local_offsets``), then zero rows
up to the worst case, ``ep`` times the rows sent (every rank's rows may all choose this rank's
experts): a static shape, whatever the routing. ``combine_rows`` sends each row back to where it
came from, in its sender's order. Each is the other's backward. No row is dropped: the result
is the one-device mixture's, forward and backward.

How many rows each expert gets from each rank is exchanged first (``exchange_counts``, a small
even all-to-all the compiler sees). The rows' split sizes are data, which a traced graph cannot
hold as sizes, so the row all-to-alls run inside opaque ops (``torch.library.custom_op``) that
read them.

A lowering without uneven all-to-alls (``xla``: XLA compiles static shapes only) sends the rows
padded instead: each rank's rows for each rank in a block of its own rows' length, one even
all-to-all, and the blocks regrouped by gathers whose indices come from the counts
(``_padded_dispatch``). Every rank then sends and gets ``ep`` times its rows, the worst case
the uneven exchange reaches only when every row chooses one rank's experts.
"""

from __future__ import annotations

import itertools

import torch
from ..mesh import MeshDim
from .collectives import all_to_all
from .lowerings import FUNCTIONAL, LOWERINGS

_c10d = torch.ops._c10d_functional


def exchange_counts(counts: torch.Tensor, ep: MeshDim, comm: str = FUNCTIONAL) -> torch.Tensor:
    """``[ep, E / ep]``: row ``s`` is how many rows rank ``s`` (by coordinate) sends to each of
    this rank's experts; ``counts`` is this rank's rows per expert (a histogram, any dtype)."""
    return LOWERINGS[comm].all_to_all(counts.to(torch.int64).view(ep.size, -1), ep)


def local_offsets(received: torch.Tensor) -> torch.Tensor:
    """Where each of this rank's experts' rows end in ``dispatch_rows``' result (a grouped
    matmul's ``offs``)."""
    return torch.cumsum(received.sum(0), 0, dtype=torch.int32)


def local_expert_ids(offsets: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Each of ``rows``' rows' expert among this rank's, as ``dispatch_rows`` lays them out expert
    by expert, ``offsets`` (``local_offsets``) where each expert's end: the index its per-row
    bias is gathered by. The zero rows past the last take the last expert's (never sent back)."""
    at = torch.arange(rows.shape[0], device=offsets.device, dtype=offsets.dtype)
    return torch.searchsorted(offsets, at, right=True).clamp(max=offsets.shape[0] - 1)


def experts_from_rows(stacked: torch.Tensor, rows_dim: int, ep: MeshDim, comm: str = FUNCTIONAL) -> torch.Tensor:
    """This rank's experts whole (``[E / ep, ...]``) from ``stacked``, this rank's piece along
    ``rows_dim`` of every expert: one even all-to-all over ``ep``, and in backward each expert's
    gradient sent back in pieces to the ranks holding them. The experts of an ``nn.ModuleList``
    are parameters of their own, which no placement cuts over the experts, so each is held cut
    along a dim of its own, which DTensor places (``passes.experts``)."""
    return all_to_all(stacked, rows_dim, 0, ep, None, comm)


def _runs(sizes: list[int]) -> list[tuple[int, int]]:
    """(start, length) of consecutive runs of the given lengths."""
    return list(zip(itertools.accumulate(sizes, initial=0), sizes))


def _reorder(x: torch.Tensor, sizes: list[list[int]], outer_first: bool) -> torch.Tensor:
    """``x``'s rows, runs of ``sizes[a][b]`` laid out a-major, laid out b-major (or back, with
    ``outer_first=False``)."""
    na, nb = len(sizes), len(sizes[0])
    order = [(a, b) for a in range(na) for b in range(nb)]
    laid = order if outer_first else sorted(order, key=lambda ab: (ab[1], ab[0]))
    runs = dict(zip(laid, _runs([sizes[a][b] for a, b in laid])))
    wanted = sorted(order, key=lambda ab: (ab[1], ab[0])) if outer_first else order
    pieces = [x.narrow(0, *runs[ab]) for ab in wanted if runs[ab][1]]
    return torch.cat(pieces) if pieces else x[:0]


def _exchange(x: torch.Tensor, send: list[int], receive: list[int], group_name: str, ranks: list[int]) -> torch.Tensor:
    """Send run ``c`` of ``x`` (``send[c]`` rows, runs by coordinate) to coordinate ``c``; return
    the rows each coordinate sent here (``receive[c]``), by coordinate. The group's own order is
    its ranks sorted."""
    by_group = sorted(range(len(ranks)), key=lambda c: ranks[c])
    runs = _runs(send)
    out = torch.cat([x.narrow(0, *runs[c]) for c in by_group])
    got = _c10d.wait_tensor(_c10d.all_to_all_single(out.contiguous(), [receive[c] for c in by_group],
                                                    [send[c] for c in by_group], group_name))
    received = dict(zip(by_group, _runs([receive[c] for c in by_group])))
    return torch.cat([got.narrow(0, *received[c]) for c in range(len(ranks))])


def _padded(x: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.cat([x, x.new_zeros(rows - x.shape[0], *x.shape[1:])])


def _sizes(counts: torch.Tensor, received: torch.Tensor) -> tuple[list[list[int]], list[list[int]]]:
    """This rank's rows per (destination, expert there), and per (source, expert here)."""
    return counts.to(torch.int64).view(received.shape[0], -1).tolist(), received.tolist()


@torch.library.custom_op("dtensor_par::dispatch_rows", mutates_args=())
def _dispatch_rows(rows: torch.Tensor, counts: torch.Tensor, received: torch.Tensor, group_name: str,
                   ranks: list[int]) -> torch.Tensor:
    sent, got = _sizes(counts, received)
    arrived = _exchange(rows, [sum(s) for s in sent], [sum(g) for g in got], group_name, ranks)
    return _padded(_reorder(arrived, got, outer_first=True), len(ranks) * rows.shape[0])


@torch.library.custom_op("dtensor_par::combine_rows", mutates_args=())
def _combine_rows(rows: torch.Tensor, counts: torch.Tensor, received: torch.Tensor, group_name: str,
                  ranks: list[int]) -> torch.Tensor:
    sent, got = _sizes(counts, received)
    by_source = _reorder(rows[:sum(map(sum, got))], got, outer_first=False)
    returned = _exchange(by_source, [sum(g) for g in got], [sum(s) for s in sent], group_name, ranks)
    return _padded(returned, rows.shape[0] // len(ranks))


@_dispatch_rows.register_fake
def _(rows, counts, received, group_name, ranks):
    return rows.new_empty(len(ranks) * rows.shape[0], *rows.shape[1:])


@_combine_rows.register_fake
def _(rows, counts, received, group_name, ranks):
    return rows.new_empty(rows.shape[0] // len(ranks), *rows.shape[1:])


def _keep_routing(ctx, inputs, output):
    _, ctx.counts, ctx.received, ctx.group_name, ctx.ranks = inputs


def _dispatch_backward(ctx, grad):
    return _combine_rows(grad, ctx.counts, ctx.received, ctx.group_name, ctx.ranks), None, None, None, None


def _combine_backward(ctx, grad):
    return _dispatch_rows(grad, ctx.counts, ctx.received, ctx.group_name, ctx.ranks), None, None, None, None


_dispatch_rows.register_autograd(_dispatch_backward, setup_context=_keep_routing)
_combine_rows.register_autograd(_combine_backward, setup_context=_keep_routing)


def _run_starts(lengths: torch.Tensor, block: int | None = None) -> torch.Tensor:
    """Where each run of ``lengths[a, b]`` rows starts: one after another, a-major (``block``
    None), or row ``a``'s runs one after another from ``a * block``."""
    if block is None:
        flat = lengths.flatten()
        return (flat.cumsum(0) - flat).view_as(lengths)
    return torch.arange(lengths.shape[0], device=lengths.device)[:, None] * block + lengths.cumsum(1) - lengths


def _moved(x: torch.Tensor, lengths: torch.Tensor, src: torch.Tensor, dst: torch.Tensor, rows: int) -> torch.Tensor:
    """``rows`` rows holding each run of ``lengths[i]`` rows of ``x`` from ``src[i]`` at ``dst[i]``,
    zeros elsewhere: one gather, whatever the lengths. The runs are listed in ``dst``'s order
    (nondecreasing), so the run holding a row is the last one starting at or before it."""
    at = torch.arange(rows, device=x.device)
    run = (torch.searchsorted(dst, at, right=True) - 1).clamp(min=0)
    within = at - dst[run]
    found = (within >= 0) & (within < lengths[run])
    picked = x.index_select(0, torch.where(found, src[run] + within, 0))
    return torch.where(found.view(-1, *[1] * (x.dim() - 1)), picked, torch.zeros((), dtype=x.dtype, device=x.device))


def _exchanged_blocks(x: torch.Tensor, ep: MeshDim, comm: str) -> torch.Tensor:
    """Block ``c`` of ``x`` (``ep`` blocks of equal rows) sent to coordinate ``c``; the blocks
    every coordinate sent here, by coordinate. Its backward is the same exchange."""
    blocks = x.view(ep.size, x.shape[0] // ep.size, *x.shape[1:])
    return all_to_all(blocks, 1, 0, ep, comm=comm).view_as(x)


def _padded_dispatch(rows: torch.Tensor, counts: torch.Tensor, received: torch.Tensor, ep: MeshDim,
                     comm: str) -> torch.Tensor:
    """``dispatch_rows`` by one even all-to-all of blocks of ``len(rows)`` rows."""
    n, sent = rows.shape[0], counts.to(torch.int64).view(ep.size, -1)
    blocks = _moved(rows, sent.flatten(), _run_starts(sent).flatten(), _run_starts(sent, n).flatten(), ep.size * n)
    arrived = _exchanged_blocks(blocks, ep, comm)
    by_expert = received.T  # the result's runs: expert-major, by sender within one
    return _moved(arrived, by_expert.flatten(), _run_starts(received, n).T.flatten(),
                  _run_starts(by_expert).flatten(), ep.size * n)


def _padded_combine(rows: torch.Tensor, counts: torch.Tensor, received: torch.Tensor, ep: MeshDim,
                    comm: str) -> torch.Tensor:
    """``combine_rows`` by one even all-to-all: ``_padded_dispatch`` backwards."""
    n, sent = rows.shape[0] // ep.size, counts.to(torch.int64).view(ep.size, -1)
    blocks = _moved(rows, received.flatten(), _run_starts(received.T).T.flatten(),
                    _run_starts(received, n).flatten(), ep.size * n)
    returned = _exchanged_blocks(blocks, ep, comm)
    return _moved(returned, sent.flatten(), _run_starts(sent, n).flatten(), _run_starts(sent).flatten(), n)


def dispatch_rows(rows: torch.Tensor, counts: torch.Tensor, received: torch.Tensor, ep: MeshDim,
                  comm: str = FUNCTIONAL) -> torch.Tensor:
    """``rows`` sorted by expert, ``counts[e]`` of them for expert ``e``: the rows every rank sends
    to this rank's experts, expert by expert (by sender within one), then zero rows up to
    ``ep x len(rows)``. ``received``: ``exchange_counts``' result."""
    if comm != FUNCTIONAL:
        return _padded_dispatch(rows, counts, received, ep, comm)
    return _dispatch_rows(rows, counts, received, ep.group_name, list(ep.ranks))


def combine_rows(rows: torch.Tensor, counts: torch.Tensor, received: torch.Tensor, ep: MeshDim,
                 comm: str = FUNCTIONAL) -> torch.Tensor:
    """``dispatch_rows``' inverse: each row of ``rows`` (as ``dispatch_rows`` laid them out) back
    at the rank and place it came from."""
    if comm != FUNCTIONAL:
        return _padded_combine(rows, counts, received, ep, comm)
    return _combine_rows(rows, counts, received, ep.group_name, list(ep.ranks))
