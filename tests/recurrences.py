"""A recurrence over the sequence wrapped in a module as transformers wraps its own, in a module of
its own: a model of another module calling it is traced as transformers models are."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


def _gated_delta_rule_by_rows(query, key, value, g, beta, initial_state=None, output_final_state=False,
                              use_qk_l2norm_in_kernel=False):
    """The gated delta rule one row at a time (transformers' recurrent form), in its inputs'
    dtype (transformers' runs in float32 whatever they are): float64 checks the chunked state
    passing (``ops.recurrence``) exactly. It reads its tensors in the order transformers'
    chunked form does."""
    query, key, value, beta, g = (x.transpose(1, 2) for x in (query, key, value, beta, g))
    if use_qk_l2norm_in_kernel:  # as transformers' l2norm
        query, key = (x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6) for x in (query, key))
    query = query * query.shape[-1] ** -0.5
    batch, heads, rows, k_dim = key.shape
    state = value.new_zeros(batch, heads, k_dim, value.shape[-1]) if initial_state is None else initial_state
    out = []
    for t in range(rows):
        state = state * g[:, :, t, None, None].exp()
        delta = (value[:, :, t] - (state * key[:, :, t, :, None]).sum(-2)) * beta[:, :, t, None]
        state = state + key[:, :, t, :, None] * delta[:, :, None, :]
        out.append((state * query[:, :, t, :, None]).sum(-2))
    return torch.stack(out, 2).transpose(1, 2), state if output_final_state else None


class _Wrapped(nn.Module):
    """A function wrapped in a module, as transformers' kernel hub wraps its recurrences."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *args, **kwargs):
        return self.fn(*args, **kwargs)


torch_chunk_gated_delta_rule = _Wrapped(_gated_delta_rule_by_rows)


class GatedDeltaRuleMixer(nn.Module):
    """Qwen3.5's linear attention, written small: q, k and v heads, a decay gate and beta from
    projections, the gated delta rule over the sequence (``torch_chunk_gated_delta_rule``, by
    rows), an out projection. Its final state is read too (its mean per batch row added), as a
    cache keeps it."""

    def __init__(self, hidden: int = 32, heads: int = 4, head_dim: int = 8, normalized: bool = True):
        super().__init__()
        self.heads, self.normalized = heads, normalized
        self.q, self.k, self.v = (nn.Linear(hidden, heads * head_dim, bias=False) for _ in range(3))
        self.a, self.b = nn.Linear(hidden, heads), nn.Linear(hidden, heads)
        self.out = nn.Linear(heads * head_dim, hidden, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, s, self.heads, -1) for p in (self.q, self.k, self.v))
        g, beta = -F.softplus(self.a(x)), torch.sigmoid(self.b(x))
        out, state = torch_chunk_gated_delta_rule(q, k, F.silu(v), g=g, beta=beta, output_final_state=True,
                                                  use_qk_l2norm_in_kernel=self.normalized)
        return x + self.out(out.reshape(b, s, -1)) + state.mean((1, 2, 3))[:, None, None]
