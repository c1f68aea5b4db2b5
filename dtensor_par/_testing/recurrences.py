"""Recurrences over the sequence wrapped in a module as transformers wraps its own, in a module of
its own: a model of another module calling one is traced as transformers models are. Each runs
one row at a time, in its inputs' dtype: float64 checks the chunked state passing
(``ops.recurrence``) exactly."""

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


def _scan_by_rows(hidden_states, dt, A, B, C, chunk_size, D=None, dt_bias=None, initial_states=None,
                  dt_softplus=False, dt_limit=(0.0, float("inf")), return_final_states=False):
    """Mamba-2's selective scan one row at a time (transformers' ``mamba2_selective_state_update``,
    repeated). It reads its tensors in the order transformers' ``mamba2_chunk_scan`` does, and
    views its rows in chunks as that does (where canonicalize reads the chunk size)."""
    dt = dt + dt_bias.to(dt.dtype)
    if dt_softplus:
        dt = F.softplus(dt)
    dt = torch.clamp(dt, min=dt_limit[0], max=dt_limit[1])
    batch, rows, heads, head_dim = hidden_states.shape
    pad = -rows % chunk_size
    chunked = F.pad(hidden_states, (0, 0, 0, 0, 0, pad)).reshape(batch, -1, chunk_size, heads, head_dim)
    x = chunked.flatten(1, 2)[:, :rows]
    B, C = (t.repeat_interleave(heads // t.shape[2], dim=2) for t in (B, C))
    skip = D[:, None] * x
    decay = torch.exp(dt * A)  # [batch, rows, heads]
    state = x.new_zeros(batch, heads, head_dim, B.shape[-1]) if initial_states is None else initial_states
    out = []
    for t in range(rows):
        state = state * decay[:, t, :, None, None] + (dt[:, t, :, None] * x[:, t])[..., None] * B[:, t, :, None, :]
        out.append((state * C[:, t, :, None, :]).sum(-1))
    out = torch.stack(out, 1) + skip
    return (out, state) if return_final_states else out


def _selective_scan_by_rows(hidden_states, dt, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                            return_last_state=False, **kwargs):
    """Mamba-1's selective scan one row at a time (transformers' recurrent form of
    ``mamba_selective_scan``), channels first as that is, in its inputs' dtype. It reads its
    tensors in the order that one does."""
    dt = dt + delta_bias.to(dt.dtype)[..., None]
    if delta_softplus:
        dt = F.softplus(dt)
    B, C = B.transpose(1, 2), C.transpose(1, 2)  # [batch, rows, state]
    decay = torch.exp(A[None, :, None, :] * dt[..., None])  # [batch, channels, rows, state]
    inputs = dt[..., None] * B[:, None] * hidden_states[..., None]
    state = hidden_states.new_zeros(*hidden_states.shape[:2], A.shape[-1])
    out = []
    for t in range(hidden_states.shape[-1]):
        state = decay[:, :, t] * state + inputs[:, :, t]
        out.append((state @ C[:, t, :, None])[..., 0])
    out = (torch.stack(out, -1) + hidden_states * D[None, :, None]) * F.silu(z)
    return (out, state) if return_last_state else out


class _Wrapped(nn.Module):
    """A function wrapped in a module, as transformers' kernel hub wraps its recurrences."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *args, **kwargs):
        return self.fn(*args, **kwargs)


torch_chunk_gated_delta_rule = _Wrapped(_gated_delta_rule_by_rows)
mamba2_chunk_scan = _Wrapped(_scan_by_rows)
mamba_selective_scan = _Wrapped(_selective_scan_by_rows)


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


class StateSpaceMixer(nn.Module):
    """Mamba-2's mixer as transformers writes it, small: one projection fused ``[z, x, B, C, dt]``
    (B and C ``groups`` groups of ``state`` numbers), a causal depthwise convolution over x, B
    and C, the selective scan (``mamba2_chunk_scan``, by rows) in chunks of 4, a norm by groups
    gated by z, an out projection. Its final state is read too (its mean per batch row added), as
    a cache keeps it. Its time steps pass a softplus (``dt_softplus``) as every transformers model's do."""

    def __init__(self, hidden: int = 32, heads: int = 4, head_dim: int = 8, groups: int = 1, state: int = 4,
                 dt_softplus: bool = True):
        super().__init__()
        self.heads, self.groups, self.state, self.inner = heads, groups, state, heads * head_dim
        self.dt_softplus = dt_softplus
        conv = self.inner + 2 * groups * state
        self.in_proj = nn.Linear(hidden, self.inner + conv + heads, bias=False)
        self.conv1d = nn.Conv1d(conv, conv, 3, groups=conv, padding=2)
        self.A_log, self.D = nn.Parameter(torch.rand(heads).log()), nn.Parameter(torch.randn(heads))
        self.dt_bias, self.norm = nn.Parameter(torch.randn(heads)), nn.Parameter(1 + torch.randn(self.inner) / 4)
        self.out_proj = nn.Linear(self.inner, hidden, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        z, xbc, dt = self.in_proj(x).split([self.inner, self.inner + 2 * self.groups * self.state, self.heads], -1)
        xbc = F.silu(self.conv1d(xbc.transpose(1, 2))[..., :s].transpose(1, 2))
        h, B, C = xbc.split([self.inner, self.groups * self.state, self.groups * self.state], -1)
        out, state = mamba2_chunk_scan(h.view(b, s, self.heads, -1), dt, -torch.exp(self.A_log),
                                       B.view(b, s, self.groups, -1), C.view(b, s, self.groups, -1), 4, D=self.D,
                                       dt_bias=self.dt_bias, dt_softplus=self.dt_softplus, return_final_states=True)
        gated = (out.reshape(b, s, -1) * F.silu(z)).view(b, s, self.groups, -1)
        normed = gated * torch.rsqrt(gated.pow(2).mean(-1, keepdim=True) + 1e-6)
        return x + self.out_proj(self.norm * normed.view(b, s, -1)) + state.mean((1, 2, 3))[:, None, None]


class SelectiveScanMixer(nn.Module):
    """Mamba-1's mixer as transformers writes it, small: one projection fused ``[x, z]``, channels
    first; a causal depthwise convolution over x, SiLU; ``x_proj`` to the time steps' low-rank
    input, B and C (one set for every channel); the time steps by ``dt_proj``'s weight; the
    selective scan (``mamba_selective_scan``, by rows); an out projection. Its final state is
    read too (its mean per batch row added), as a cache keeps it. Its time steps pass a softplus
    (``dt_softplus``) as every transformers model's do."""

    def __init__(self, hidden: int = 32, inner: int = 64, state: int = 4, rank: int = 4, dt_softplus: bool = True):
        super().__init__()
        self.state, self.rank, self.dt_softplus = state, rank, dt_softplus
        self.in_proj = nn.Linear(hidden, 2 * inner, bias=False)
        self.conv1d = nn.Conv1d(inner, inner, 3, groups=inner, padding=2)
        self.x_proj = nn.Linear(inner, rank + 2 * state, bias=False)
        self.dt_proj = nn.Linear(rank, inner)
        self.A_log, self.D = nn.Parameter(torch.rand(inner, state).log()), nn.Parameter(torch.randn(inner))
        self.out_proj = nn.Linear(inner, hidden, bias=False)

    def forward(self, x):
        s = x.shape[1]
        h, z = self.in_proj(x).transpose(1, 2).chunk(2, dim=1)
        h = F.silu(self.conv1d(h)[..., :s])
        dt, B, C = self.x_proj(h.transpose(1, 2)).split([self.rank, self.state, self.state], -1)
        out, state = mamba_selective_scan(h, self.dt_proj.weight @ dt.transpose(1, 2), -torch.exp(self.A_log),
                                          B.transpose(1, 2), C.transpose(1, 2), D=self.D, z=z,
                                          delta_bias=self.dt_proj.bias, delta_softplus=self.dt_softplus,
                                          return_last_state=True)
        return x + self.out_proj(out.transpose(1, 2)) + state.mean((1, 2))[:, None, None]
