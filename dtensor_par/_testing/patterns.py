"""Small models each written to show one pattern that model families spell (a graph break, an
unruled op, convolutions, recurrences, joint attention, looped experts...); no plans, no
annotations."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import recurrences
from .models import Attention, GPTBlock, rotate_half


class GraphBreakModel(nn.Module):
    """Two blocks with a graph break between them: Dynamo hands the backend two graphs."""

    def __init__(self):
        super().__init__()
        self.first, self.second = GPTBlock(), GPTBlock()

    def forward(self, x):
        x = self.first(x)
        torch._dynamo.graph_break()
        return self.second(x)


class OddMLPBlock(GPTBlock):
    """A GPT block whose MLP width (18) is not divisible by 4: that MLP stays replicated at tp=4."""

    def __init__(self):
        super().__init__(hidden=32, heads=4, mlp=18)


class UnruledOpMLP(nn.Module):
    """An MLP holding an op with no sharding rule (logcumsumexp): its input is gathered, exactly."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x):
        h = torch.relu(self.up(x))
        return self.down(h + torch.logcumsumexp(h, dim=1))


class MeanLoss(nn.Module):
    """A block and its loss in one graph: a mean over the sequence and a mean over
    everything, each partial sums of the sequence shards, reduced once."""

    def __init__(self, hidden: int = 32):
        super().__init__()
        self.block = GPTBlock(hidden=hidden)

    def forward(self, x):
        h = self.block(x)
        return (h * h.mean(dim=1, keepdim=True)).mean()


class SequencePooling(nn.Module):
    """Ops that mix along the sequence after attention: a depthwise convolution over it, a
    cumulative sum, a mean over it and the last token."""

    def __init__(self, hidden: int = 32):
        super().__init__()
        self.block = GPTBlock(hidden=hidden)
        self.conv = nn.Conv1d(hidden, hidden, kernel_size=3, padding=1, groups=hidden)

    def forward(self, x):
        x = self.block(x)
        x = x + self.conv(x.transpose(1, 2)).transpose(1, 2)
        x = x + x.cumsum(dim=1) / x.shape[1]
        x = x + x.mean(dim=1, keepdim=True)
        return x[:, -1]


class KeywordAttention(GPTBlock):
    """SDPA called with keyword arguments only, with its own scale."""

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(h, dim=-1)
        q, k, v = (t.view(b, s, self.heads, h // self.heads).transpose(1, 2) for t in (q, k, v))
        a = F.scaled_dot_product_attention(query=q, key=k, value=v, is_causal=True, scale=0.3)
        return x + self.proj(a.transpose(1, 2).reshape(b, s, h))


class MaskedAttention(GPTBlock):
    """Bidirectional attention under a user mask: key padding from the ``keep`` input
    ([B, S], False = padding) with a boolean sliding window (``mask="bool"``), or with an
    additive per-head distance bias (``"additive"``, ALiBi-like, so the mask has a head dim);
    ``None``: no mask, no ``keep``."""

    def __init__(self, mask: str | None):
        super().__init__()
        self.mask = mask

    def forward(self, x, keep=None):
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        q, k, v = (t.view(b, s, self.heads, h // self.heads).transpose(1, 2) for t in (q, k, v))
        mask = None
        if self.mask is not None:
            pos = torch.arange(s, device=x.device)
            distance = (pos[:, None] - pos[None, :]).abs()
            padding = keep[:, None, None, :]
            if self.mask == "additive":
                slopes = torch.arange(1, self.heads + 1, device=x.device, dtype=x.dtype) / self.heads
                mask = torch.where(padding, -distance.to(x.dtype) * slopes[:, None, None], float("-inf"))
            else:
                mask = (distance <= 5) & padding
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, h))
        return x + self.fc_out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class RowsHiddenByAnInput(nn.Module):
    """Written-out attention whose scores are filled with the lowest finite value where an input
    hides them (``where(keep, scores, finfo.min)``, as DistilBERT and GPT-Neo fill): a query row
    hidden entirely attends to every key evenly, and its scores get no gradient."""

    def __init__(self):
        super().__init__()
        self.qkv, self.o = nn.Linear(32, 96), nn.Linear(32, 32)

    def forward(self, x, keep):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, 4, 8).permute(2, 0, 3, 1, 4)
        scores = torch.where(keep, q @ k.transpose(-2, -1) / 8 ** 0.5, torch.finfo(x.dtype).min)
        return self.o((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, s, 32))


class BufferMaskedAttention(GPTBlock):
    """Causal attention written out by hand under a mask kept in a buffer (``max_len`` square):
    nanoGPT's float ``tril`` read as ``masked_fill(bias[:, :, :s, :s] == 0, -inf)``
    (``spelling="nanogpt"``), or GPT-Neo's boolean one, within a sliding ``window`` if given
    (``tril ^ tril(-window)``), read as ``where(bias[:, :, :s, :s], scores, finfo.min)``."""

    def __init__(self, spelling: str = "nanogpt", window: int | None = None, max_len: int = 64):
        super().__init__()
        self.spelling = spelling
        causal = torch.ones(max_len, max_len, dtype=torch.bool).tril()
        if window is not None:
            causal = causal ^ causal.tril(-window)
        self.register_buffer("bias", causal.float() if spelling == "nanogpt" else causal, persistent=False)

    def attend(self, x):
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        q, k, v = (t.view(b, s, self.heads, h // self.heads).transpose(1, 2) for t in (q, k, v))
        scores = q @ k.transpose(-2, -1) / (h // self.heads) ** 0.5
        if self.spelling == "nanogpt":
            scores = scores.masked_fill(self.bias[None, None, :s, :s] == 0, float("-inf"))
        else:
            scores = torch.where(self.bias[None, None, :s, :s], scores, torch.finfo(x.dtype).min)
        return x + self.proj((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, s, h))


class LinearAttentionConvBlock(nn.Module):
    """Sana's block, written small: linear attention (ReLU kernels, ``v @ kT`` summed over the
    sequence, normalized by a row of ones padded to v) and a gated feed-forward of convolutions
    over the ``side x side`` grid the sequence makes (1 x 1 up, depthwise 3 x 3, the gate chunked
    off, 1 x 1 down, here with a bias)."""

    def __init__(self, hidden: int = 32, heads: int = 4, mlp: int = 48, side: int = 4):
        super().__init__()
        self.heads, self.side = heads, side
        self.q, self.k, self.v, self.out = (nn.Linear(hidden, hidden) for _ in range(4))
        self.up = nn.Conv2d(hidden, 2 * mlp, 1)
        self.depthwise = nn.Conv2d(2 * mlp, 2 * mlp, 3, padding=1, groups=2 * mlp)
        self.down = nn.Conv2d(mlp, hidden, 1)

    def attend(self, x):
        q, k, v = (p(x).transpose(1, 2).unflatten(1, (self.heads, -1)) for p in (self.q, self.k, self.v))
        q, k = F.relu(q), F.relu(k).transpose(2, 3)
        v = F.pad(v, (0, 0, 0, 1), value=1.0)
        a = (v @ k) @ q
        a = a[:, :, :-1] / (a[:, :, -1:] + 1e-15)
        return x + self.out(a.flatten(1, 2).transpose(1, 2))

    def forward(self, x):
        x = self.attend(x)
        grid = x.unflatten(1, (self.side, self.side)).permute(0, 3, 1, 2)
        h, gate = self.depthwise(F.silu(self.up(grid))).chunk(2, dim=1)
        return x + self.down(h * F.silu(gate)).flatten(2).transpose(1, 2)


class TemporalConvBlock(nn.Module):
    """Sana-Video's feed-forward after attention, written small: an MLP's output (a partial sum
    over tp) goes through a convolution over frames (kernel 3 x 1, every channel in and out) of
    the ``frames x positions`` grid the sequence makes (frames cut over cp: a halo each side)."""

    def __init__(self, hidden: int = 32, mlp: int = 64, frames: int = 4):
        super().__init__()
        self.frames, self.block = frames, GPTBlock(hidden)
        self.up, self.down = nn.Linear(hidden, mlp), nn.Linear(mlp, hidden, bias=False)
        self.temporal = nn.Conv2d(hidden, hidden, (3, 1), padding=(1, 0))

    def forward(self, x):
        x = self.block(x)
        h = self.down(F.gelu(self.up(x)))
        grid = h.unflatten(1, (self.frames, -1)).permute(0, 3, 1, 2)
        return x + self.temporal(grid).flatten(2).transpose(1, 2)


class SmallUNet(nn.Module):
    """A UNet's path in miniature (Stable Diffusion's ``UNet2DConditionModel``): attention over an
    image's positions, a resnet block (group norms, 3 x 3 convolutions), a downsampling
    convolution of stride 2, attention at half the rows, nearest upsampling, a last group norm
    and convolution. Over cp the image's rows stay cut from the first attention on; over tp the
    resnet block is an MLP site (its first convolution colwise, its group norm on each rank's
    groups, its second rowwise)."""

    def __init__(self, channels: int = 16, heads: int = 2, groups: int = 4):
        super().__init__()
        self.attend_full, self.attend_half = Attention(channels, heads), Attention(channels, heads)
        for attention in (self.attend_full, self.attend_half):  # a key bias's true gradient is 0
            attention.k = nn.Linear(channels, channels, bias=False)
        self.norm1, self.norm2, self.norm_out = (nn.GroupNorm(groups, channels) for _ in range(3))
        self.conv1, self.conv2, self.conv_out = (nn.Conv2d(channels, channels, 3, padding=1) for _ in range(3))
        self.down = nn.Conv2d(channels, channels, 3, stride=2, padding=1)

    @staticmethod
    def _attend(attention: nn.Module, image: torch.Tensor) -> torch.Tensor:
        return image + attention(image.flatten(2).transpose(1, 2)).transpose(1, 2).reshape(image.shape)

    def forward(self, image):
        h = self._attend(self.attend_full, image)
        h = h + self.conv2(F.silu(self.norm2(self.conv1(F.silu(self.norm1(h))))))
        h = self._attend(self.attend_half, self.down(h))
        h = F.interpolate(h, scale_factor=2.0, mode="nearest")
        return self.conv_out(F.silu(self.norm_out(h)))


class GatedHeadNorm(nn.Module):
    """Qwen3-Next's gated norm, written small after attention: the heads flattened with the
    batch and sequence (``[B * S * H, d]``), normalized per head and gated by a projection's
    heads flattened alike, then viewed back ``[B, S, H * d]``."""

    def __init__(self, hidden: int = 32, heads: int = 4):
        super().__init__()
        self.heads = heads  # no biases: a key bias's true gradient is 0 (a shift of a softmax row)
        self.q, self.k, self.v, self.gate, self.out = (nn.Linear(hidden, hidden, bias=False) for _ in range(5))
        self.norm = nn.RMSNorm(hidden // heads)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, s, self.heads, -1).transpose(1, 2) for p in (self.q, self.k, self.v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
        d = a.shape[-1]
        a = self.norm(a.reshape(-1, d)) * F.silu(self.gate(x).reshape(-1, d))
        return x + self.out(a.reshape(b, s, -1))


class GatedDeltaRuleBlock(nn.Module):
    """A gated delta rule mixer (``_testing.recurrences``) traced from another module's frame, as a
    transformers model's recurrence is: Dynamo names the module its function comes from."""

    def __init__(self, normalized: bool = True):
        super().__init__()
        self.mixer = recurrences.GatedDeltaRuleMixer(normalized=normalized)

    def forward(self, x):
        return self.mixer(x)


class AdaptedGateUp(nn.Module):
    """Zamba2's shared MLP: gate and up from one projection plus a low-rank adapter's, added,
    then chunked apart."""

    def __init__(self, hidden: int = 32, mlp: int = 64, rank: int = 4):
        super().__init__()
        self.gate_up = nn.Linear(hidden, 2 * mlp, bias=False)
        self.adapter = nn.Sequential(nn.Linear(hidden, rank, bias=False), nn.Linear(rank, 2 * mlp, bias=False))
        self.down = nn.Linear(mlp, hidden, bias=False)

    def forward(self, x):
        gate, up = (self.gate_up(x) + self.adapter(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class StateSpaceBlock(nn.Module):
    """Mamba-2's mixer (``_testing.recurrences``) traced from another module's frame, as a
    transformers model's is."""

    def __init__(self, groups: int = 1, dt_softplus: bool = True):
        super().__init__()
        self.mixer = recurrences.StateSpaceMixer(groups=groups, dt_softplus=dt_softplus)

    def forward(self, x):
        return self.mixer(x)


class SelectiveScanBlock(nn.Module):
    """Mamba-1's mixer (``_testing.recurrences``) traced from another module's frame, as a
    transformers model's is."""

    def __init__(self, dt_softplus: bool = True):
        super().__init__()
        self.mixer = recurrences.SelectiveScanMixer(dt_softplus=dt_softplus)

    def forward(self, x):
        return self.mixer(x)


class NormBetweenLinears(nn.Module):
    """A projection whose output reaches an MLP only through the residual stream and an RMSNorm
    written out (Llama's; an attention's out projection not read as one): the norm's ``rsqrt``
    lies beside the path, not on it, so the projection and the MLP's gate are no MLP; the MLP
    after it is one."""

    def __init__(self, hidden: int = 32, mlp: int = 64):
        super().__init__()
        self.proj, self.norm = nn.Linear(hidden, hidden), nn.Parameter(torch.ones(hidden))
        self.gate, self.up, self.down = nn.Linear(hidden, mlp), nn.Linear(hidden, mlp), nn.Linear(mlp, hidden)

    def forward(self, x):
        h = x + self.proj(x)
        n = self.norm * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6))
        return h + self.down(F.silu(self.gate(n)) * self.up(n))


class ClassTokenBlock(nn.Module):
    """ViT's embeddings, written small: an image's 4 x 4 patches embedded by a convolution, a
    learned class token concatenated before them (a sequence of 1 + patches made in the graph),
    positions added, then a block."""

    def __init__(self, hidden: int = 32, patches: int = 15):
        super().__init__()
        self.embed, self.block = nn.Conv2d(3, hidden, 4, stride=4), GPTBlock(hidden)
        self.cls, self.pos = nn.Parameter(torch.randn(1, 1, hidden)), nn.Parameter(torch.randn(1, patches + 1, hidden))

    def forward(self, image):
        x = self.embed(image).flatten(2).transpose(1, 2)
        return self.block(torch.cat([self.cls.expand(x.shape[0], -1, -1), x], 1) + self.pos)


class TorchEncoder(nn.Module):
    """PyTorch's own layers: ``nn.TransformerEncoderLayer`` (batch first, pre-norm) with a key
    padding mask and a causal mask, then an ``nn.MultiheadAttention`` whose keys and values have
    their own width (``kdim``, ``vdim``: separate projection weights) over a context."""

    def __init__(self, hidden: int = 32, heads: int = 4, context: int = 16):
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(hidden, heads, 64, dropout=0.0, batch_first=True, norm_first=True)
        self.cross = nn.MultiheadAttention(hidden, heads, batch_first=True, kdim=context, vdim=context)

    def forward(self, x, padding, context):
        causal = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool, device=x.device).triu(1)  # True: not attended
        x = self.layer(x, src_mask=causal, src_key_padding_mask=padding, is_causal=True)
        return x + self.cross(x, context, context, need_weights=False)[0]


class SequenceGram(nn.Module):
    """A contraction over the sequence after attention (the sum of x^T x over positions)."""

    def __init__(self):
        super().__init__()
        self.block = GPTBlock()

    def forward(self, x):
        x = self.block(x)
        return x.transpose(1, 2) @ x


class Conv1DBlock(nn.Module):
    """GPT-2's Conv1D: ``addmm(bias, x.view(-1, k), weight).view(...)`` with weights ``[in, out]``."""

    def __init__(self, hidden: int = 32, heads: int = 4):
        super().__init__()
        self.heads = heads
        self.c_attn_w, self.c_attn_b = nn.Parameter(torch.randn(hidden, 3 * hidden) / 8), nn.Parameter(torch.zeros(3 * hidden))
        self.c_proj_w, self.c_proj_b = nn.Parameter(torch.randn(hidden, hidden) / 8), nn.Parameter(torch.zeros(hidden))

    @staticmethod
    def conv1d(x, weight, bias):
        return torch.addmm(bias, x.view(-1, x.size(-1)), weight).view(x.size()[:-1] + (weight.shape[1],))

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = self.conv1d(x, self.c_attn_w, self.c_attn_b).split(h, dim=2)
        q, k, v = (t.view(b, s, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, h)
        return x + self.conv1d(a, self.c_proj_w, self.c_proj_b)


class JointBlock(nn.Module):
    """MMDiT joint attention: text and image tokens projected apart, attended together (with
    the text's padding hidden, if given), split back; then a single-stream block whose MLP runs beside attention and shares its
    out projection (Flux), and a fused qkv sliced by index with unequal parts (Phi-3, GQA)."""

    def __init__(self, hidden: int = 32, heads: int = 4, kv_heads: int = 2):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, hidden // heads
        self.img_qkv, self.txt_qkv = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, 3 * hidden)
        self.img_out, self.txt_out = nn.Linear(hidden, hidden), nn.Linear(hidden, hidden)
        self.qkv = nn.Linear(hidden, (heads + 2 * kv_heads) * self.head_dim)
        self.proj_mlp = nn.Linear(hidden, 2 * hidden)
        self.proj_out = nn.Linear(3 * hidden, hidden)

    def heads_of(self, t, n):
        return t.unflatten(-1, (n, self.head_dim)).transpose(1, 2)

    def forward(self, img, txt, txt_keep=None):
        text = txt.shape[1]
        iq, ik, iv = self.img_qkv(img).chunk(3, dim=-1)
        tq, tk, tv = self.txt_qkv(txt).chunk(3, dim=-1)
        q, k, v = (self.heads_of(torch.cat([t, i], dim=1), self.heads) for t, i in ((tq, iq), (tk, ik), (tv, iv)))
        mask = None  # text padding hidden from every query (QwenImage, HunyuanVideo)
        if txt_keep is not None:
            mask = torch.cat([txt_keep, txt_keep.new_ones(img.shape[:2])], dim=1)[:, None, None, :]
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).flatten(2)
        t_out, i_out = a.split([text, a.shape[1] - text], dim=1)
        x = torch.cat([txt + self.txt_out(t_out), img + self.img_out(i_out)], dim=1)
        qkv = self.qkv(x)
        q_size, kv_size = self.heads * self.head_dim, self.kv_heads * self.head_dim
        q = self.heads_of(qkv[..., :q_size], self.heads)
        k = self.heads_of(qkv[..., q_size:q_size + kv_size], self.kv_heads)
        v = self.heads_of(qkv[..., q_size + kv_size:], self.kv_heads)
        a = F.scaled_dot_product_attention(q, k, v, enable_gqa=True).transpose(1, 2).flatten(2)
        x = x + self.proj_out(torch.cat([a, F.gelu(self.proj_mlp(x))], dim=-1))
        return x[:, text:]


class ComplexRoPEAttention(nn.Module):
    """RoPE through ``view_as_complex``/``view_as_real`` (Llama's original spelling), an
    ``F.pad`` of the head dim and a ``zeros_like`` buffer."""

    def __init__(self, hidden: int = 32, heads: int = 4):
        super().__init__()
        self.heads, self.head_dim = heads, hidden // heads
        self.qkv, self.out = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (t.view(b, s, self.heads, self.head_dim) for t in self.qkv(x).chunk(3, dim=-1))
        angles = torch.outer(torch.arange(s, dtype=torch.float32), torch.arange(self.head_dim // 2) / self.head_dim)
        freqs = torch.polar(torch.ones_like(angles), angles)[None, :, None]
        q, k = (torch.view_as_real(torch.view_as_complex(t.reshape(b, s, self.heads, -1, 2)) * freqs).flatten(3)
                for t in (q, k))
        q, k, v = (F.pad(t, (0, 8)).transpose(1, 2) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)[..., :self.head_dim]
        a = a + torch.zeros_like(a)
        return x + self.out(a.transpose(1, 2).reshape(b, s, -1))


class CrossHeadQKNorm(nn.Module):
    """Wan's attention: q and k normalized over every head's features at once (an rms_norm
    and a layer_norm over the whole hidden dim) before the heads are split; the output
    projection written as an einsum."""

    def __init__(self, hidden: int = 32, heads: int = 4):
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v = (nn.Linear(hidden, hidden) for _ in range(3))
        # The layer_norm (with a bias) on q: a bias added to every key would shift no score, its gradient zero.
        self.norm_q, self.norm_k = nn.LayerNorm(hidden), nn.RMSNorm(hidden, eps=1e-6)
        self.out = nn.Parameter(torch.randn(hidden, hidden) / hidden ** 0.5)

    def forward(self, x):
        q, k, v = (t.unflatten(2, (self.heads, -1)).transpose(1, 2)
                   for t in (self.norm_q(self.q(x)), self.norm_k(self.k(x)), self.v(x)))
        a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2)
        return x + torch.einsum("bsd,od->bso", a, self.out)


class TokenMLP(nn.Module):
    """Attention, then an MLP over tokens flattened with the batch (``x.view(-1, hidden)``, as
    MoE layers and Conv1D do), then a ``baddbmm`` mixing."""

    def __init__(self, hidden: int = 32, mlp: int = 64):
        super().__init__()
        self.attention = CrossHeadQKNorm(hidden)
        self.up, self.down = nn.Linear(hidden, mlp), nn.Linear(mlp, hidden)
        self.mix, self.shift = nn.Parameter(torch.randn(hidden, hidden) / hidden), nn.Parameter(torch.randn(hidden))

    def forward(self, x):
        x = self.attention(x)
        b, s, d = x.shape
        y = self.down(F.gelu(self.up(x.reshape(-1, d)))).view(b, s, d)
        return x + torch.baddbmm(self.shift, y, self.mix.expand(b, d, d), alpha=0.5)


class SequenceFirst(nn.Module):
    """Megatron's ``[seq, batch, hidden]`` layout, given a table of two rows (a scale and a
    shift, whole: its rows are no samples) beside a batch of two."""

    def __init__(self, hidden: int = 32, heads: int = 4, mlp: int = 64):
        super().__init__()
        self.heads = heads
        self.norm = nn.LayerNorm(hidden)
        self.qkv, self.proj = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)
        self.fc, self.fc_out = nn.Linear(hidden, mlp), nn.Linear(mlp, hidden)

    def forward(self, x, table):
        s, b, h = x.shape
        x = x * table[0] + table[1]
        q, k, v = (t.view(s, b, self.heads, h // self.heads).permute(1, 2, 0, 3)
                   for t in self.qkv(self.norm(x)).chunk(3, dim=-1))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.permute(2, 0, 1, 3).reshape(s, b, h))
        return x + self.fc_out(F.gelu(self.fc(x)))


class GatedExpert(nn.Module):
    """One expert of ``LoopedExperts``: transformers' ``MixtralBlockSparseTop2MLP`` before 4.57."""

    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.w1 = nn.Linear(hidden, inter, bias=False)
        self.w3 = nn.Linear(hidden, inter, bias=False)
        self.w2 = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class LoopedExperts(nn.Module):
    """A mixture as transformers wrote Mixtral's before 4.57, and many models still do: an
    ``nn.ModuleList`` of gated MLPs looped over by ``range``, each taking its tokens by
    ``torch.where`` of a one-hot mask and adding its weighted rows back by ``index_add_``."""

    def __init__(self, hidden: int, inter: int, experts: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.gate = nn.Linear(hidden, experts, bias=False)
        self.experts = nn.ModuleList(GatedExpert(hidden, inter) for _ in range(experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        weights, chosen = torch.topk(torch.softmax(self.gate(tokens), dim=-1, dtype=torch.float), self.top_k, dim=-1)
        weights = (weights / weights.sum(dim=-1, keepdim=True)).to(x.dtype)
        out = torch.zeros_like(tokens)
        mask = F.one_hot(chosen, num_classes=len(self.experts)).permute(2, 1, 0)
        for e, expert in enumerate(self.experts):
            slot, token = torch.where(mask[e])
            out.index_add_(0, token, expert(tokens[token]) * weights[token, slot, None])
        return out.reshape(x.shape)


class MaskedLoopExperts(LoopedExperts):
    """The loop as DeepSeek's reference MoE writes it in training (HiDream's copy of it): each
    token's rows repeated k times, each expert's picked by a mask and written back in place,
    weighted and summed after the loop."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.view(-1, x.shape[-1])
        weights, chosen = torch.topk(torch.softmax(self.gate(tokens), dim=-1), self.top_k, dim=-1)
        ids, rows = chosen.view(-1), tokens.repeat_interleave(self.top_k, dim=0)
        out = torch.empty_like(rows)
        for e, expert in enumerate(self.experts):
            out[ids == e] = expert(rows[ids == e])
        return (out.view(*weights.shape, -1) * weights.unsqueeze(-1)).sum(dim=1).view(x.shape)


class RunningPositions(nn.Module):
    """Running sums along the sequence: positions counted over the tokens a padding mask keeps
    (RoBERTa's position ids, integers) and a running mean of the hidden states (floating, with
    a gradient), before a GPT block."""

    def __init__(self, hidden: int = 32, positions: int = 40):
        super().__init__()
        self.table = nn.Embedding(positions, hidden)
        self.block = GPTBlock(hidden)

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        h = x + self.table(torch.cumsum(keep.int(), dim=1) * keep)
        counts = torch.arange(1, h.shape[1] + 1, device=h.device, dtype=h.dtype)
        return self.block(h + h.cumsum(1) / counts[:, None])


class JointRotary(nn.Module):
    """HiDream's joint attention, small: image tokens beside two texts (a joint sequence of parts
    [16, 8, 8]), turned by rotary angles made of positions concatenated once (parts [16, 16]),
    each half of the angles taken for q and again for k, as diffusers' rotary embedding does."""

    def __init__(self, hidden: int = 32, heads: int = 4):
        super().__init__()
        self.heads = heads
        self.qkv, self.out = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)
        self.register_buffer("freqs", torch.linspace(0.1, 1.0, hidden // heads))

    def forward(self, image, text_a, text_b, image_pos, text_pos):
        x = torch.cat([image, torch.cat([text_a, text_b], 1)], 1)
        angles = torch.cat([image_pos, text_pos], 1)[:, :, None, None] * self.freqs  # [B, S, 1, head_dim]
        turns = torch.stack([angles.cos(), angles.sin()], -1)
        q, k, v = (t.unflatten(-1, (self.heads, -1)) for t in self.qkv(x).chunk(3, -1))
        q = q * turns[..., 0] + rotate_half(q) * turns[..., 1]
        k = k * turns[..., 0] + rotate_half(k) * turns[..., 1]
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return self.out(out.transpose(1, 2).flatten(2))


class FusedAttentionMLP(nn.Module):
    """Flux.2's single-stream block: one projection for q, k, v and a gated MLP's gate and up,
    split into qkv and the pair, qkv chunked into q, k and v, the pair sliced apart; attention
    and the MLP concatenated into one out projection."""

    def __init__(self, hidden: int = 32, heads: int = 4, mlp: int = 64):
        super().__init__()
        self.heads, self.hidden, self.mlp = heads, hidden, mlp
        self.fused = nn.Linear(hidden, 3 * hidden + 2 * mlp)
        self.out = nn.Linear(hidden + mlp, hidden)

    def forward(self, x):
        qkv, pair = torch.split(self.fused(x), [3 * self.hidden, 2 * self.mlp], dim=-1)
        q, k, v = (t.unflatten(-1, (self.heads, -1)).transpose(1, 2) for t in qkv.chunk(3, dim=-1))
        a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2)
        gated = F.silu(pair[..., :self.mlp]) * pair[..., self.mlp:]
        return x + self.out(torch.cat([a, gated], dim=-1))


class LoopedMoEBlock(GPTBlock):
    """A GPT block whose MLP is ``LoopedExperts``: 4 experts, top-2."""

    def __init__(self, hidden: int = 32, heads: int = 4, inter: int = 64):
        super().__init__(hidden, heads, inter)
        del self.fc, self.fc_out
        self.moe = LoopedExperts(hidden, inter, 4, 2)

    def forward(self, x):
        x = self.attend(x)
        return x + self.moe(self.ln2(x))


class JointBeforeProjection(nn.Module):
    """Text and image tokens concatenated before the projections (CogVideoX's joint attention),
    split back after the out projection. The key projection has no bias: its gradient would be 0
    in exact arithmetic (the softmax ignores a shift every key shares), which no relative error
    can be measured against."""

    def __init__(self, hidden: int = 32, heads: int = 4):
        super().__init__()
        self.text_proj, self.norm = nn.Linear(hidden, hidden), nn.LayerNorm(hidden)
        self.attention = Attention(hidden, heads)
        self.attention.k = nn.Linear(hidden, hidden, bias=False)

    def forward(self, image, text):
        joint = torch.cat([self.text_proj(text), image], dim=1)
        text_out, image_out = self.attention(self.norm(joint)).split([text.shape[1], image.shape[1]], dim=1)
        return image_out * text_out.mean(dim=1, keepdim=True)


class FoldedHeadsAttention(nn.Module):
    """Attention written out by hand with its heads folded into the batch around a 3-d softmax, a
    mask (causal, or the one given; ``masks`` times) added to the unfolded scores and the scores
    clamped with ``torch.max``, as XGLM writes it in transformers 5.25."""

    def __init__(self, hidden: int = 32, heads: int = 4, masks: int = 1):
        super().__init__()
        self.heads, self.head_dim, self.masks = heads, hidden // heads, masks
        self.q, self.k, self.v, self.out = (nn.Linear(hidden, hidden) for _ in range(4))
        self.k.bias = None  # its gradient would be 0 in exact arithmetic: no relative error can be measured

    def forward(self, x, mask=None):
        b, s, h = x.shape
        q, k, v = (p(x).view(b, s, self.heads, self.head_dim).transpose(1, 2).reshape(b * self.heads, s, -1)
                   for p in (self.q, self.k, self.v))
        mask = torch.full((s, s), torch.finfo(x.dtype).min).triu(1) if mask is None else mask
        scores = torch.bmm(q, k.transpose(1, 2)).view(b, self.heads, s, s)
        for _ in range(self.masks):
            scores = scores + mask
        scores = torch.max(scores, torch.full((), torch.finfo(x.dtype).min)).view(b * self.heads, s, s)
        a = torch.bmm(F.softmax(scores, dim=-1), v).view(b, self.heads, s, -1).transpose(1, 2)
        return self.out(a.reshape(b, s, h))
