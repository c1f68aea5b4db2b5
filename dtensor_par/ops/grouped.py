"""A grouped matmul of rows sorted by expert: rows ``offs[e - 1]:offs[e]`` times expert ``e``'s
weight ``[K, N]``, one ``mm`` per expert.

canonicalize writes it where experts were read a row at a time (transformers' ``batched_mm``:
``W[expert_ids]`` then ``bmm``), so that they become the grouped chain the planner shards.
``torch._grouped_mm`` would be the kernel, but torch 2.13 takes only bfloat16 in it (its fake
implementation refuses float32 under compile), and the result must be the one-device model's in
any dtype: each row's dot products are the ones ``bmm`` computed. An opaque op
(``torch.library.custom_op``) because its runs' lengths are data; its backward is one too, for
the same reason. Rows past ``offs[-1]`` (expert parallelism's zero padding) come out zero.
"""

from __future__ import annotations

import torch


def _runs(offs: torch.Tensor) -> list[tuple[int, int, int]]:
    """(expert, first row, end) of each expert with rows."""
    ends = offs.tolist()
    return [(e, start, end) for e, (start, end) in enumerate(zip([0, *ends], ends)) if end > start]


@torch.library.custom_op("dtensor_par::grouped_mm", mutates_args=())
def grouped_mm(input: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``input [M, K]`` sorted by expert, ``weight [E, K, N]``, ``offs [E]`` where each expert's rows end."""
    out = input.new_zeros(input.shape[0], weight.shape[2])
    for e, start, end in _runs(offs):
        out[start:end] = input[start:end] @ weight[e]
    return out


@torch.library.custom_op("dtensor_par::grouped_mm_backward", mutates_args=())
def _grouped_mm_backward(input: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor,
                         grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    grad_input, grad_weight = torch.zeros_like(input), torch.zeros_like(weight)
    for e, start, end in _runs(offs):
        grad_input[start:end] = grad[start:end] @ weight[e].T
        grad_weight[e] = input[start:end].T @ grad[start:end]
    return grad_input, grad_weight


@grouped_mm.register_fake
def _(input, weight, offs):
    return input.new_empty(input.shape[0], weight.shape[2])


@_grouped_mm_backward.register_fake
def _(input, weight, offs, grad):
    return torch.empty_like(input), torch.empty_like(weight)


def _keep_operands(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward(ctx, grad):
    input, weight, offs = ctx.saved_tensors
    return *_grouped_mm_backward(input, weight, offs, grad), None


grouped_mm.register_autograd(_backward, setup_context=_keep_operands)
GROUPED_MM = torch.ops.dtensor_par.grouped_mm
"""The op as a graph calls it (its packet: the op registry knows it by its qualified name)."""
