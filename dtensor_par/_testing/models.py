"""Small transformer models, written as users write them (no plans, no annotations)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint



class GPTBlock(nn.Module):
    """Pre-norm block with a fused QKV projection (chunked), biases, GELU MLP."""

    def __init__(self, hidden: int = 32, heads: int = 4, mlp: int = 64):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.fc = nn.Linear(hidden, mlp)
        self.fc_out = nn.Linear(mlp, hidden)

    def attend(self, x):
        """``x`` plus its causal attention."""
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        q, k, v = (t.view(b, s, self.heads, h // self.heads).transpose(1, 2) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.proj(a.transpose(1, 2).reshape(b, s, h))

    def forward(self, x):
        x = self.attend(x)
        return x + self.fc_out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class PartsFirstBlock(GPTBlock):
    """The fused qkv viewed part first, ``(b, s, 3, heads, head_dim)``, then permuted and
    unbound, as timm's ViT attention and ModernBERT write it. 12 heads: read as 3 groups of
    heads, the parts would leave tp=2 and 4 no fused projection to shard."""

    def __init__(self):
        super().__init__(hidden=48, heads=12, mlp=64)

    def forward(self, x):
        b, s, h = x.shape
        qkv = self.qkv(self.ln1(x)).reshape(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        a = F.scaled_dot_product_attention(q, k, v)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, h))
        return x + self.fc_out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, layers: int = 2, **block):
        super().__init__()
        self.blocks = nn.ModuleList(GPTBlock(**block) for _ in range(layers))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


class CheckpointedGPT(GPT):
    """GPT whose blocks run under ``torch.utils.checkpoint``, as nanoGPT-style training code
    checkpoints them."""

    def __init__(self, layers: int = 2, use_reentrant: bool = False, **block):
        super().__init__(layers, **block)
        self.use_reentrant = use_reentrant

    def forward(self, x):
        for block in self.blocks:
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=self.use_reentrant)
        return x


class Attention(nn.Module):
    """Non-causal attention with separate q, k, v projections; ``width``: the output's width,
    as written (a hand-edited copy for ``parallelize_module`` makes it -1, the local width).
    ``qk_norm``: q and k RMS-normed per head (over head_dim), as Flux and SD3 do."""

    def __init__(self, dim: int, heads: int, qk_norm: bool = False):
        super().__init__()
        self.dim, self.heads, self.head_dim = dim, heads, dim // heads
        self.q, self.k, self.v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.out = nn.Linear(dim, dim)
        self.width = dim
        self.norm_q, self.norm_k = ((nn.RMSNorm(self.head_dim, eps=1e-6), nn.RMSNorm(self.head_dim, eps=1e-6))
                                    if qk_norm else (nn.Identity(), nn.Identity()))

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, s, self.heads, self.head_dim) for p in (self.q, self.k, self.v))
        q, k, v = self.norm_q(q).transpose(1, 2), self.norm_k(k).transpose(1, 2), v.transpose(1, 2)
        a = F.scaled_dot_product_attention(q, k, v)
        return self.out(a.transpose(1, 2).reshape(b, s, self.width))


class CrossAttention(nn.Module):
    """Queries from the tokens, keys and values from a context of another length and width
    (a text encoder's output, as in PixArt's and Sana's cross-attention)."""

    def __init__(self, dim: int, context_dim: int, heads: int):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.q, self.out = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.k, self.v = nn.Linear(context_dim, dim), nn.Linear(context_dim, dim)

    def forward(self, x, context):
        def split(t):
            return t.view(t.shape[0], t.shape[1], self.heads, self.head_dim).transpose(1, 2)

        a = F.scaled_dot_product_attention(split(self.q(x)), split(self.k(context)), split(self.v(context)))
        return self.out(a.transpose(1, 2).flatten(2))


class DiTBlock(nn.Module):
    """DiT-style pre-norm block: non-causal attention, GELU MLP."""

    def __init__(self, dim: int, heads: int, mlp: int, qk_norm: bool = False):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = Attention(dim, heads, qk_norm)
        self.up, self.down = nn.Linear(dim, mlp), nn.Linear(mlp, dim)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.down(F.gelu(self.up(self.norm2(x)), approximate="tanh"))


class DiT(nn.Module):
    """A stack of DiT blocks on a (batch, seq, dim) input."""

    def __init__(self, layers: int = 2, dim: int = 256, heads: int = 8, mlp: int = 1024, qk_norm: bool = False):
        super().__init__()
        self.blocks = nn.ModuleList(DiTBlock(dim, heads, mlp, qk_norm) for _ in range(layers))

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
        variance = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(variance + self.eps))


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class LlamaBlock(nn.Module):
    """RMSNorm, RoPE, GQA, causal attention, SwiGLU. ``gqa``: how kv heads meet the query
    heads: ``"repeat_kv"`` (transformers' expand + reshape), ``"repeat_interleave"`` or
    ``"enable_gqa"`` (SDPA's own grouping, nothing repeated)."""

    def __init__(self, hidden: int = 64, heads: int = 8, kv_heads: int = 2, mlp: int = 96, gqa: str = "repeat_kv"):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, hidden // heads
        self.gqa = gqa
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

    def _repeat_kv(self, t):
        b, n, s, d = t.shape
        rep = self.heads // self.kv_heads
        if self.gqa == "repeat_interleave":
            return t.repeat_interleave(rep, dim=1)
        return t[:, :, None, :, :].expand(b, n, rep, s, d).reshape(b, n * rep, s, d)

    def forward(self, x):
        b, s, _ = x.shape
        freqs = torch.outer(torch.arange(s, dtype=torch.float32, device=x.device), self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        h = self.input_norm(x)
        q = self.q_proj(h).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(h).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(h).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        if self.gqa == "enable_gqa":
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            a = F.scaled_dot_product_attention(q, self._repeat_kv(k), self._repeat_kv(v), is_causal=True)
        x = x + self.o_proj(a.transpose(1, 2).reshape(b, s, -1))
        h = self.post_norm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class Llama(nn.Module):
    """Token embedding, Llama blocks, final norm and LM head (outside any site: both cut by the
    vocabulary over tp where it divides)."""

    def __init__(self, vocab: int = 50, layers: int = 2, **block):
        super().__init__()
        hidden = block.setdefault("hidden", 64)
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(LlamaBlock(**block) for _ in range(layers))
        self.norm = RMSNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.norm(x))


def meta_llama_32_layers() -> tuple[Llama, tuple[torch.Tensor]]:
    """A Llama-70B-sized stack (hidden 8192, 64 heads, 8 kv heads, mlp 28672) of 32 layers on the
    meta device and a batch of 32 x 4096 tokens: what ``explain`` plans at pp4 x tp8 x dp_shard4
    (8 microbatches of 4 rows, one a dp_shard rank)."""
    with torch.device("meta"):
        model = Llama(vocab=32000, layers=32, hidden=8192, heads=64, kv_heads=8, mlp=28672)
        ids = torch.randint(0, 32000, (32, 4096))
    return model, (ids,)
