"""The cost model's predictions beside published results, on the built-in machine profiles:
nothing runs, nothing is asserted.

    python -m benchmarks.published [--quick] [--json out.json]

Each comparison plans a model on the meta device at its published size (fewer layers where
every layer is alike: a speedup over identical layers does not depend on their number) with
``explain(..., machine=)``, the cost pass over each rank's graph, and divides the predicted
step of the baseline mesh by that of the parallel one. ``choose_mesh`` then says which mesh of
the parallel world it would pick itself. ``--quick``: sequences 16 times shorter (a smoke run).
"""

from __future__ import annotations

import argparse
import functools
import operator
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from benchmarks.report import print_table, save_json
from dtensor_par import choose_mesh, explain
from dtensor_par.choose import mesh_text
from dtensor_par.machines import machine as machine_profile
from dtensor_par._testing.models import DiT


@dataclass(frozen=True)
class Comparison:
    """A published speedup of ``parallel`` over ``baseline`` (mesh degrees), and how to build
    the model it was measured on: ``build(quick) -> (model, args, kwargs)``, on meta."""

    name: str
    source: str
    machine: str  # the built-in profile nearest the published hardware
    training: bool
    baseline: dict[str, int]
    parallel: dict[str, int]
    published: float  # the baseline's step over the parallel one's
    build: Callable[[bool], tuple]


def video_dit(quick: bool) -> tuple:
    """The seed PR's 56-head video DiT as assumed here (only its 56 heads are published): 2
    DiT blocks of 56 heads of 128 (width 7168), GELU MLP 4x (28672), 32768 tokens, batch 1, bfloat16."""
    with torch.device("meta"):
        model = DiT(layers=2, dim=56 * 128, heads=56, mlp=4 * 56 * 128).to(torch.bfloat16)
        x = torch.randn(1, 32768 // (16 if quick else 1), 56 * 128, dtype=torch.bfloat16)
    return model, (x,), {}


def flux_dev(quick: bool) -> tuple:
    """FLUX.1-dev (diffusers' config: 24 heads of 128, joint dim 4096) with 1 joint and 2
    single-stream blocks, the published model's 19 to 38 ratio; a 1024 px image: 4096 image
    tokens (64 x 64 latent patches) and 512 text tokens, batch 1, bfloat16."""
    from diffusers import FluxTransformer2DModel

    side, text = 64 // (4 if quick else 1), 512 // (16 if quick else 1)
    with torch.device("meta"):
        model = FluxTransformer2DModel(patch_size=1, in_channels=64, num_layers=1, num_single_layers=2,
                                       attention_head_dim=128, num_attention_heads=24, joint_attention_dim=4096,
                                       pooled_projection_dim=768, guidance_embeds=True,
                                       axes_dims_rope=(16, 56, 56)).to(torch.bfloat16)
        ids = torch.zeros(side * side, 3)
        ids[:, 1], ids[:, 2] = torch.arange(side * side) // side, torch.arange(side * side) % side
        kwargs = {"hidden_states": torch.randn(1, side * side, 64, dtype=torch.bfloat16),
                  "encoder_hidden_states": torch.randn(1, text, 4096, dtype=torch.bfloat16),
                  "pooled_projections": torch.randn(1, 768, dtype=torch.bfloat16),
                  "timestep": torch.tensor([0.5]), "guidance": torch.tensor([3.5]), "img_ids": ids,
                  "txt_ids": torch.zeros(text, 3), "return_dict": False}
    return model, (), kwargs


class ScaledAttention(nn.Module):
    """Llama-3.1-8B's attention alone (32 heads of 128, 8 kv heads, causal), as
    ring-flash-attention's benchmark runs it on q, k and v. A learned per-channel scale on
    each (3 x 128 parameters) gives the backward attention's own backward to run, as the
    benchmark's input gradients do, without gathering whole input gradients on every rank;
    the output's mean is returned, so no rank gathers the whole output either (the benchmark
    leaves each rank's shard where it is)."""

    def __init__(self):
        super().__init__()
        self.scales = nn.Parameter(torch.ones(3, 128))

    def forward(self, q, k, v):
        b, s = q.shape[:2]
        q, k, v = (t.view(b, s, -1, 128) * scale for t, scale in zip((q, k, v), self.scales))
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             is_causal=True, enable_gqa=True)
        return out.mean()


def ring_attention(quick: bool) -> tuple:
    """8192 tokens a rank over 8 ranks (65536 in all), batch 1, bfloat16, as the benchmark runs."""
    seq = 8 * 8192 // (16 if quick else 1)
    with torch.device("meta"):
        model = ScaledAttention().to(torch.bfloat16)
        qkv = [torch.randn(1, seq, heads * 128, dtype=torch.bfloat16) for heads in (32, 8, 8)]
    return model, tuple(qkv), {}


ONE = {}
AS_PUBLISHED = {"fsdp_dims": ()}
"""As the published runs hold them: each weight whole on every rank of the sequence dims (no FSDP)."""
XDIT = "xDiT docs/performance/flux.md, 4xH100, torch.compile: 1 GPU 4.30 s"
RING_FLASH = "ring-flash-attention README, 8xH800"
COMPARISONS = (
    Comparison("56-head video DiT (seed PR)", "seed PR's trn2 table: TP=8 9.285 s/step, TP=8 x ulysses=4 3.941",
               "trn2-48xl", False, {"tp": 8}, {"tp": 8, "ulysses": 4}, 9.285 / 3.941, video_dit),
    Comparison("FLUX.1-dev 1024 px (xDiT)", f"{XDIT}, Ulysses-4 1.63 s", "h100-sxm-8", False, ONE, {"ulysses": 4},
               2.63, flux_dev),
    Comparison("FLUX.1-dev 1024 px (xDiT)", f"{XDIT}, Ring-4 1.98 s", "h100-sxm-8", False, ONE, {"ring": 4},
               4.30 / 1.98, flux_dev),
    Comparison("FLUX.1-dev 1024 px (xDiT)", f"{XDIT}, Ulysses-2 x Ring-2 1.80 s", "h100-sxm-8", False, ONE,
               {"ring": 2, "ulysses": 2}, 4.30 / 1.80, flux_dev),
    Comparison("zigzag ring attention, forward", f"{RING_FLASH}: 85.2% of ideal", "h100-sxm-8", False, ONE,
               {"ring": 8}, 8 * 0.852, ring_attention),
    Comparison("zigzag ring attention, fwd + bwd", f"{RING_FLASH}: 90.2% of ideal", "h100-sxm-8", True, ONE,
               {"ring": 8}, 8 * 0.902, ring_attention),
)


def _ranks(degrees: dict[str, int]) -> int:
    return functools.reduce(operator.mul, degrees.values(), 1)


def predicted_step(comparison: Comparison, degrees: dict[str, int], quick: bool):
    """The predicted step of every captured graph together on ``degrees``' mesh (the device's default order)."""
    model, args, kwargs = comparison.build(quick)
    device_type = machine_profile(comparison.machine).device_type
    report = explain(model, args, **degrees, example_kwargs=kwargs, device_type=device_type, parallelized=True,
                     machine=comparison.machine, training=comparison.training, **AS_PUBLISHED)
    return functools.reduce(operator.add, (graph.predicted for graph in report.graphs))


@functools.cache
def chosen(build: Callable, quick: bool, world: int, machine: str, training: bool) -> str:
    """``choose_mesh``'s top mesh of ``world`` ranks for the model, with its predicted step."""
    model, args, kwargs = build(quick)
    ranking = choose_mesh(model, args, world, machine=machine, training=training, example_kwargs=kwargs, top=1,
                          **AS_PUBLISHED)
    return f"{mesh_text(ranking[0].degrees, ranking[0].order)}: {ranking[0].predicted}" if ranking else "none legal"


def compare(comparison: Comparison, quick: bool) -> dict:
    baseline, parallel = (predicted_step(comparison, degrees, quick)
                          for degrees in (comparison.baseline, comparison.parallel))
    world = _ranks(comparison.parallel)
    return {"name": comparison.name, "source": comparison.source, "machine": comparison.machine,
            "step": "training" if comparison.training else "forward",
            "baseline": mesh_text(comparison.baseline, tuple(comparison.baseline)),
            "parallel": mesh_text(comparison.parallel, tuple(comparison.parallel)),
            "ideal_speedup": world / _ranks(comparison.baseline), "published_speedup": comparison.published,
            "predicted_speedup": baseline.total / parallel.total,
            "baseline_step": str(baseline), "parallel_step": str(parallel),
            "choose_top": chosen(comparison.build, quick, world, comparison.machine, comparison.training)}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="sequences 16 times shorter (a smoke run)")
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args()
    rows = [compare(c, args.quick) for c in COMPARISONS]
    print_table(["comparison", "profile", "step", "baseline -> parallel", "ideal", "published", "predicted",
                 "predicted parallel step", "choose_mesh's top of the parallel world"],
                [[r["name"], r["machine"], r["step"], f"{r['baseline']} -> {r['parallel']}",
                  f"{r['ideal_speedup']:.0f}x", f"{r['published_speedup']:.2f}x", f"{r['predicted_speedup']:.2f}x",
                  r["parallel_step"], r["choose_top"]] for r in rows])
    save_json(args.json, {"quick": args.quick, "rows": rows})


if __name__ == "__main__":
    main()
