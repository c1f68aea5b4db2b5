"""Tensor-parallel transformer blocks from an unmodified model.

    torchrun --nproc-per-node 2 examples/tp_block.py [--inner-backend aot_eager] [--sequence-parallel]

Every rank builds the same model, runs it on its own as the reference, then runs it through
``hybrid_parallel`` and prints the largest difference in the output and in the gradients.
"""

import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from dtensor_par import hybrid_parallel, init_mesh


class Block(nn.Module):
    def __init__(self, hidden=64, heads=8):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.out = nn.Linear(hidden, hidden)
        self.up = nn.Linear(hidden, 4 * hidden)
        self.down = nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
        q, k, v = (t.view(b, s, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(a.transpose(1, 2).reshape(b, s, h))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--inner-backend", default="inductor")
    parser.add_argument("--sequence-parallel", action="store_true")
    args = parser.parse_args()

    torch.manual_seed(0)
    model = nn.Sequential(Block(), Block())
    x = torch.randn(2, 16, 64)

    reference = model(x)
    reference.square().mean().backward()
    expected_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()

    mesh = init_mesh(tp=int(os.environ["WORLD_SIZE"]))  # joins the torchrun process group
    compiled = torch.compile(model, backend=hybrid_parallel(mesh, inner_backend=args.inner_backend,
                                                            sequence_parallel=args.sequence_parallel))
    out = compiled(x)
    out.square().mean().backward()

    forward_diff = (out - reference).abs().max().item()
    grad_diff = max((p.grad - g).abs().max().item() for p, g in zip(model.parameters(), expected_grads))
    if dist.get_rank() == 0:
        print(f"tp={mesh.size()} inner_backend={args.inner_backend} sequence_parallel={args.sequence_parallel}")
        print(f"max |output - single device|   = {forward_diff:.3e}")
        print(f"max |gradient - single device| = {grad_diff:.3e}")
    dist.destroy_process_group()
    # The work is done; leave without the interpreter's teardown, in which gloo's worker threads
    # can abort the process now and then (pytorch/pytorch#179291).
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
