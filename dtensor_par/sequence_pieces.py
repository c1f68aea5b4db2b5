"""A graph input given as this rank's piece of its sequence over cp, not whole.

What crosses a pipeline cut under cp (``pipelining``) is sent as each cp rank's piece of the
sequence, as the stage that makes it holds it: the next stage takes it already cut. Dynamo
traces that stage on global shapes as ever, so the stage is called with a stand-in: a zero
expanded to the global shape (it owns no memory) that carries the piece. The runtime feeds the
graph the piece itself (``params.WholeParameters.local_input``), so the gradient flows to the
piece, and the plan seeds the input with the piece's cut (``passes.sequence``). The piece is in
the layout a plan cuts a sequence in over cp (``ops.sequence_layout``: zigzag over ring, padded
where the length does not divide), the one both stages share: the mesh and the length fix it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

PIECE_OF = "_dtensor_par_sequence_piece"
"""The attribute of a stand-in holding its SequencePiece."""


@dataclass(frozen=True)
class SequencePiece:
    """This rank's piece of a value cut along ``dim`` over cp, whole on every other mesh dim."""

    local: torch.Tensor
    dim: int


def piece_standin(local: torch.Tensor, shape: tuple[int, ...], dim: int) -> torch.Tensor:
    """The stand-in a stage is called with for ``local``, the piece along ``dim`` of a value of
    global ``shape``; it requires a gradient where the piece does, so the stage is compiled to
    return the piece's."""
    zero = torch.zeros((), dtype=local.dtype, device=local.device, requires_grad=local.requires_grad)
    standin = zero.expand(shape)
    setattr(standin, PIECE_OF, SequencePiece(local, dim))
    return standin


def sequence_piece(value) -> SequencePiece | None:
    """The piece a graph input stands for, or None for any other input."""
    return getattr(value, PIECE_OF, None) if isinstance(value, torch.Tensor) else None
