"""The models the benchmarks run, as a user writes them, and the hand-edited copies that
torch's ``parallelize_module`` needs (``TP_HAND_EDITS``)."""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

TP_HAND_EDITS = {
    "dit": ["attention uses the local head count (heads // tp), not the model's",
            "attention output is reshaped to (b, s, -1) (the local width), not (b, s, dim)"],
    "llama": ["attention uses the local query and kv head counts (heads // tp, kv_heads // tp)",
              "attention output is reshaped to (b, s, -1), as written (no edit)"],
}
"""What ``parallelize_module`` needs changed in each model, beyond its plan: it shards the
projections' weights but leaves view and reshape sizes as written, i.e. global."""


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.dim, self.heads, self.head_dim = dim, heads, dim // heads
        self.q, self.k, self.v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.out = nn.Linear(dim, dim)
        self.width = dim  # the attention output's width, as written

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, s, self.heads, self.head_dim).transpose(1, 2) for p in (self.q, self.k, self.v))
        a = F.scaled_dot_product_attention(q, k, v)
        return self.out(a.transpose(1, 2).reshape(b, s, self.width))


class DiTBlock(nn.Module):
    """DiT-style pre-norm block: non-causal attention, GELU MLP."""

    def __init__(self, dim: int, heads: int, mlp: int):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.up, self.down = nn.Linear(dim, mlp), nn.Linear(mlp, dim)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.down(F.gelu(self.up(self.norm2(x)), approximate="tanh"))


class DiT(nn.Module):
    """A stack of DiT blocks on a (batch, seq, dim) input."""

    def __init__(self, layers: int = 2, dim: int = 256, heads: int = 8, mlp: int = 1024):
        super().__init__()
        self.blocks = nn.ModuleList(DiTBlock(dim, heads, mlp) for _ in range(layers))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class LlamaBlock(nn.Module):
    """RMSNorm, RoPE, GQA (repeated kv heads), causal attention, SwiGLU."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, mlp: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, hidden // heads
        self.input_norm, self.post_norm = RMSNorm(hidden), RMSNorm(hidden)
        self.q_proj = nn.Linear(hidden, heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(heads * self.head_dim, hidden, bias=False)
        self.gate_proj = nn.Linear(hidden, mlp, bias=False)
        self.up_proj = nn.Linear(hidden, mlp, bias=False)
        self.down_proj = nn.Linear(mlp, hidden, bias=False)
        inv_freq = 1.0 / (10000 ** (torch.arange(0, self.head_dim, 2).float() / self.head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x):
        b, s, _ = x.shape
        freqs = torch.outer(torch.arange(s, dtype=torch.float32, device=x.device), self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        h = self.input_norm(x)
        q = self.q_proj(h).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(h).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(h).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        rep = self.heads // self.kv_heads
        k, v = (t[:, :, None].expand(b, self.kv_heads, rep, s, self.head_dim).reshape(b, self.heads, s, -1)
                for t in (k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o_proj(a.transpose(1, 2).reshape(b, s, -1))
        h = self.post_norm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class Llama(nn.Module):
    """Token embedding, Llama blocks, final norm and LM head (outside any site: replicated)."""

    def __init__(self, vocab: int = 512, layers: int = 2, hidden: int = 256, heads: int = 8, kv_heads: int = 4,
                 mlp: int = 768):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(LlamaBlock(hidden, heads, kv_heads, mlp) for _ in range(layers))
        self.norm = RMSNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.norm(x))


class WithLoss(nn.Module):
    """``model`` and the benchmark's loss (mean square of its output) in one module, as a
    training script compiles them: the loss is reduced where the output lies, and no rank
    needs the whole output."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x):
        return self.model(x).square().mean()


def tp_anchor(model: nn.Module, mesh) -> nn.Module:
    """``model`` (same weights) with ``TP_HAND_EDITS`` applied, through ``parallelize_module``
    with Megatron's colwise (q/k/v, up/gate) and rowwise (out/down) plan over ``mesh``."""
    anchor = copy.deepcopy(model)
    tp = mesh.size()
    for block in anchor.blocks:
        if isinstance(block, DiTBlock):
            block.attn.heads //= tp
            block.attn.width = -1
            plan = {**dict.fromkeys(("attn.q", "attn.k", "attn.v", "up"), ColwiseParallel()),
                    "attn.out": RowwiseParallel(), "down": RowwiseParallel()}
        else:
            block.heads //= tp
            block.kv_heads //= tp
            plan = {**dict.fromkeys(("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"), ColwiseParallel()),
                    "o_proj": RowwiseParallel(), "down_proj": RowwiseParallel()}
        parallelize_module(block, mesh, plan)
    return anchor
