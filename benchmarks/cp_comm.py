"""Bytes each rank sends per attention (forward) for Ulysses, ring and hybrid, against the
analytic minimum, read off the compiled forward graph (AOTAutograd) on a fake process group.

    python -m benchmarks.cp_comm [--batch 1] [--seq 4096] [--heads 16] [--head-dim 64] [--json out.json]

Analytic minimum per rank (P = ulysses, R = ring, h = heads * head_dim, fp32):
Ulysses sends (P-1)/P of 4 tensors of b*s*h/(R*P) elements (q, k, v in, output back);
ring sends R-1 kv blocks of 2*b*(s/R)*h/P elements. A sequence that does not divide into
2*R*P chunks is padded; its ratio is the padding's overhead.
"""

import argparse
import json

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

import dtensor_par
from dtensor_par.passes.capture import capture_graphs
from dtensor_par.backend import parallelize_graph
from dtensor_par.mesh import MeshInfo
from dtensor_par.passes.context import ParallelConfig
from tests.harness import aot_graphs
from tests.models import GPTBlock


def sent_bytes(batch, seq, heads, head_dim, ring, ulysses) -> dict[str, int]:
    """Bytes rank 0 sends to other ranks in the forward graph, by mesh dim."""
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=ring * ulysses)
    try:
        info = MeshInfo.from_mesh(dtensor_par.init_mesh(ring=ring, ulysses=ulysses))
        model = GPTBlock(hidden=heads * head_dim, heads=heads, mlp=4 * heads * head_dim)
        (gm, inputs), = capture_graphs(model, torch.randn(batch, seq, heads * head_dim))
        local_gm, ctx = parallelize_graph(gm, inputs, ParallelConfig(info))
        graphs = aot_graphs(local_gm, ctx, backward=False)
        groups = {info.dims[d].group_name: d for d in ("ring", "ulysses") if info.size(d) > 1}
        sent = {d: 0 for d in groups.values()}
        for node in graphs["forward"].graph.nodes:
            if node.target != torch.ops._c10d_functional.all_to_all_single.default or node.args[3] not in groups:
                continue
            val = node.args[0].meta["val"]
            row_bytes = val[0].numel() * val.element_size()
            sent[groups[node.args[3]]] += sum(n for r, n in enumerate(node.args[2]) if r != 0) * row_bytes
        return sent
    finally:
        dist.destroy_process_group()
        torch._dynamo.reset()


def analytic(batch, seq, heads, head_dim, ring, ulysses) -> dict[str, float]:
    """For the real sequence: an uneven one's padding counts as overhead."""
    h, b, fp32 = heads * head_dim, batch, 4
    out = {}
    if ulysses > 1:
        out["ulysses"] = (ulysses - 1) * 4 * b * seq * h / (ring * ulysses * ulysses) * fp32
    if ring > 1:
        out["ring"] = (ring - 1) * 2 * b * (seq / ring) * h / ulysses * fp32
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--json")
    args = parser.parse_args()
    rows = []
    print("| scheme | ring | ulysses | seq | mesh dim | sent MiB/rank | analytic MiB/rank | ratio |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    # The last scheme's sequence does not divide into 2 * ring * ulysses chunks: it is padded.
    schemes = (("ulysses", 1, 4, 0), ("ring", 4, 1, 0), ("hybrid", 2, 2, 0), ("hybrid, uneven", 2, 2, -2))
    for scheme, ring, ulysses, extra in schemes:
        shape = (args.batch, args.seq + extra, args.heads, args.head_dim)
        measured, minimum = sent_bytes(*shape, ring, ulysses), analytic(*shape, ring, ulysses)
        for dim in minimum:
            row = {"scheme": scheme, "ring": ring, "ulysses": ulysses, "seq": shape[1], "mesh_dim": dim,
                   "sent_bytes": measured[dim], "analytic_bytes": minimum[dim], "ratio": measured[dim] / minimum[dim]}
            rows.append(row)
            print(f"| {scheme} | {ring} | {ulysses} | {shape[1]} | {dim} | {measured[dim] / 2**20:.3f} | "
                  f"{minimum[dim] / 2**20:.3f} | {row['ratio']:.4f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
