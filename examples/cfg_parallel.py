"""Classifier-free guidance, parallel: the conditional and unconditional halves of each guided
batch run on two groups of ranks, each group Ulysses-parallel over the image tokens.

    torchrun --nproc-per-node 4 examples/cfg_parallel.py [--inner-backend aot_eager] [--steps 4]

The DiT and the sampling loop are written as for one device: each step runs the model once on
the guided batch ``cat([latents, latents])`` with the class labels and the null label, then
mixes the two halves. On the mesh ``dp_replicate=2 x ulysses=2`` the backend cuts that batch
over dp_replicate (``batch="global"``, the default): one group computes the conditional half,
the other the unconditional, and every rank gets the whole guided output. Rank 0 prints the
largest difference to the same loop on one device after every step.
"""

import argparse
import math

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import dtensor_par

HIDDEN, HEADS, LAYERS, TOKENS, CLASSES = 64, 4, 2, 16, 10
IMAGES, GUIDANCE = 2, 4.0


def timestep_embedding(t, dim):
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32) / half)
    angles = t[:, None].float() * freqs[None]
    return torch.cat([angles.cos(), angles.sin()], dim=-1)


class Block(nn.Module):
    """adaLN-modulated attention and MLP, as in DiT."""

    def __init__(self):
        super().__init__()
        self.norm1 = nn.LayerNorm(HIDDEN, elementwise_affine=False)
        self.norm2 = nn.LayerNorm(HIDDEN, elementwise_affine=False)
        self.modulation = nn.Linear(HIDDEN, 4 * HIDDEN)
        self.qkv = nn.Linear(HIDDEN, 3 * HIDDEN)
        self.out = nn.Linear(HIDDEN, HIDDEN)
        self.up = nn.Linear(HIDDEN, 4 * HIDDEN)
        self.down = nn.Linear(4 * HIDDEN, HIDDEN)

    def forward(self, x, c):
        b, s, h = x.shape
        shift1, scale1, shift2, scale2 = self.modulation(F.silu(c))[:, None].chunk(4, dim=-1)
        q, k, v = self.qkv(self.norm1(x) * (1 + scale1) + shift1).chunk(3, dim=-1)
        q, k, v = (t.view(b, s, HEADS, -1).transpose(1, 2) for t in (q, k, v))
        x = x + self.out(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, s, h))
        return x + self.down(F.gelu(self.up(self.norm2(x) * (1 + scale2) + shift2)))


class DiT(nn.Module):
    """Predicts the noise in ``latents`` at time ``t`` for class ``labels`` (``CLASSES``: none)."""

    def __init__(self):
        super().__init__()
        self.labels = nn.Embedding(CLASSES + 1, HIDDEN)
        self.time = nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.SiLU(), nn.Linear(HIDDEN, HIDDEN))
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.final = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, latents, t, labels):
        c = self.time(timestep_embedding(t, HIDDEN)) + self.labels(labels)
        x = latents
        for block in self.blocks:
            x = block(x, c)
        return self.final(x)


def sample(model, noise, labels, steps):
    """Euler steps of guided denoising from ``noise``; yields the latents after each step."""
    latents = noise
    null = torch.full_like(labels, CLASSES)
    for i in range(steps):
        t = torch.full((2 * len(latents),), 1.0 - i / steps)
        both = model(torch.cat([latents, latents]), t, torch.cat([labels, null]))
        conditional, unconditional = both.chunk(2)
        latents = latents - (unconditional + GUIDANCE * (conditional - unconditional)) / steps
        yield latents


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--inner-backend", default="inductor")
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(1)

    torch.manual_seed(0)  # every rank: the same model, noise and labels
    model = DiT().eval()
    noise = torch.randn(IMAGES, TOKENS, HIDDEN)
    labels = torch.randint(0, CLASSES, (IMAGES,))

    mesh = dtensor_par.init_mesh(dp_replicate=2, ulysses=2)  # joins the torchrun group
    compiled = torch.compile(model, backend=dtensor_par.hybrid_parallel(mesh, inner_backend=args.inner_backend))
    rank0 = dist.get_rank() == 0
    if rank0:
        print(f"dp_replicate=2 x ulysses=2, inner_backend={args.inner_backend}: guided batch of {2 * IMAGES}, "
              f"conditional half on dp_replicate rank 0, unconditional on rank 1")
        print("| step | max abs difference of the latents to one device |\n| --- | --- |")
    with torch.no_grad():
        for step, (ours, reference) in enumerate(zip(sample(compiled, noise, labels, args.steps),
                                                     sample(model, noise, labels, args.steps))):
            if rank0:
                print(f"| {step} | {(ours - reference).abs().max().item():.2e} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
