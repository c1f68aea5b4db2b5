"""Train a small Llama-style language model, tensor + context + data parallel, against one device.

    torchrun --nproc-per-node 4 examples/train.py [--inner-backend aot_eager] [--tp 2 --ulysses 2 --ring 1]
        [--dp-replicate 1 --dp-shard 1 --batch global] [--steps 5]

The model is written as a user writes it (no plan, no annotations). Every rank builds the same
model and keeps a deep copy as the single-device reference. ``dtensor_par.parallelize`` then
replaces the model's parameters by this rank's DTensor shards, and ``torch.compile`` with
``hybrid_parallel`` runs it. Both train with AdamW and gradient clipping on the same random
tokens; rank 0 prints both losses per step and the parameter bytes this rank holds.

With data-parallel dims the global batch holds 2 sequences per dp rank. ``--batch global``:
every rank is given all of it, and the plan cuts it over dp. ``--batch local``: each dp rank
is given its own slice (as a ``DistributedSampler`` would feed it) and the gradients are
averaged over dp; the loss printed is then the mean of the ranks' losses, one device's on the
whole batch.
"""

import argparse
import copy
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import dtensor_par

VOCAB, HIDDEN, HEADS, KV_HEADS, MLP, LAYERS = 128, 64, 8, 4, 128, 2
SEQ = 32


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(dim)), eps

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


def rope(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.head_dim = HIDDEN // HEADS
        self.attn_norm, self.mlp_norm = RMSNorm(HIDDEN), RMSNorm(HIDDEN)
        self.q_proj = nn.Linear(HIDDEN, HEADS * self.head_dim, bias=False)
        self.k_proj = nn.Linear(HIDDEN, KV_HEADS * self.head_dim, bias=False)
        self.v_proj = nn.Linear(HIDDEN, KV_HEADS * self.head_dim, bias=False)
        self.o_proj = nn.Linear(HEADS * self.head_dim, HIDDEN, bias=False)
        self.gate_proj = nn.Linear(HIDDEN, MLP, bias=False)
        self.up_proj = nn.Linear(HIDDEN, MLP, bias=False)
        self.down_proj = nn.Linear(MLP, HIDDEN, bias=False)

    def forward(self, x, cos, sin):
        b, s, _ = x.shape
        h = self.attn_norm(x)
        q = self.q_proj(h).view(b, s, HEADS, self.head_dim).transpose(1, 2)
        k = self.k_proj(h).view(b, s, KV_HEADS, self.head_dim).transpose(1, 2)
        v = self.v_proj(h).view(b, s, KV_HEADS, self.head_dim).transpose(1, 2)
        a = F.scaled_dot_product_attention(rope(q, cos, sin), rope(k, cos, sin), v, is_causal=True, enable_gqa=True)
        x = x + self.o_proj(a.transpose(1, 2).reshape(b, s, -1))
        h = self.mlp_norm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class Llama(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = RMSNorm(HIDDEN)
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, ids):
        head_dim = HIDDEN // HEADS
        inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        freqs = torch.outer(torch.arange(ids.shape[1], dtype=torch.float32), inv_freq)
        cos, sin = torch.cat((freqs, freqs), dim=-1).cos(), torch.cat((freqs, freqs), dim=-1).sin()
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.lm_head(self.norm(x))


def train_step(model, opt, inputs, targets):
    opt.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return loss.item()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--inner-backend", default="inductor")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--ulysses", type=int, help="default: world size // tp")
    parser.add_argument("--ring", type=int, default=1)
    parser.add_argument("--dp-replicate", type=int, default=1)
    parser.add_argument("--dp-shard", type=int, default=1)
    parser.add_argument("--batch", choices=("global", "local"), default="global")
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    dp = args.dp_replicate * args.dp_shard
    ulysses = args.ulysses or int(os.environ["WORLD_SIZE"]) // (args.tp * args.ring * dp)
    torch.set_num_threads(1)

    torch.manual_seed(0)  # every rank: the same model and the same tokens
    model = Llama()
    reference = copy.deepcopy(model)  # the single-device run
    tokens = torch.randint(0, VOCAB, (2 * dp, SEQ + 1))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]  # predict the next token

    mesh = dtensor_par.init_mesh(tp=args.tp, ring=args.ring, ulysses=ulysses, dp_replicate=args.dp_replicate,
                                 dp_shard=args.dp_shard)  # joins the torchrun group
    mine = slice(None)
    if args.batch == "local":  # this rank's dp coordinate (dp_replicate-major, as the mesh lays it out)
        coordinate = mesh.get_local_rank("dp_replicate") * args.dp_shard if args.dp_replicate > 1 else 0
        coordinate += mesh.get_local_rank("dp_shard") if args.dp_shard > 1 else 0
        mine = slice(2 * coordinate, 2 * coordinate + 2)
    dtensor_par.parallelize(model, mesh, (inputs[mine],), batch=args.batch)  # each parameter: this rank's shard
    compiled = torch.compile(model, backend=dtensor_par.hybrid_parallel(mesh, inner_backend=args.inner_backend,
                                                                        batch=args.batch))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)  # after parallelize
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3)

    rank0 = dist.get_rank() == 0
    if rank0:
        print(f"dp_replicate={args.dp_replicate} dp_shard={args.dp_shard} tp={args.tp} ulysses={ulysses} "
              f"ring={args.ring} batch={args.batch} inner_backend={args.inner_backend}")
        print("| step | loss parallel | loss single device | abs difference |\n| --- | --- | --- | --- |")
    for step in range(args.steps):
        loss = train_step(compiled, opt, inputs[mine], targets[mine])
        if args.batch == "local":  # every dp coordinate's loss, averaged: the loss of the whole batch
            total = torch.tensor(loss)
            dist.all_reduce(total)
            loss = total.item() / dist.get_world_size()
        ref_loss = train_step(reference, ref_opt, inputs, targets)
        if rank0:
            print(f"| {step} | {loss:.6f} | {ref_loss:.6f} | {abs(loss - ref_loss):.2e} |")

    held = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    full = sum(p.numel() * p.element_size() for p in model.parameters())
    if rank0:
        print(f"parameter bytes on this rank: {held:,} of {full:,} ({held / full:.1%})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
