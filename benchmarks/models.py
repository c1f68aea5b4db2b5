"""What the benchmarks add to the models they run (``dtensor_par._testing.models``' DiT and Llama, as a user
writes them): the hand-edited copies that torch's ``parallelize_module`` needs
(``TP_HAND_EDITS``) and the loss compiled with each model."""

from __future__ import annotations

import copy

import torch
import torch.nn as nn

import dtensor_par
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from dtensor_par._testing.models import DiTBlock

TP_HAND_EDITS = {
    "dit": ["attention uses the local head count (heads // tp), not the model's",
            "attention output is reshaped to (b, s, -1) (the local width), not (b, s, dim)"],
    "llama": ["attention uses the local query and kv head counts (heads // tp, kv_heads // tp)",
              "attention output is reshaped to (b, s, -1), as written (no edit)"],
}
"""What ``parallelize_module`` needs changed in each model, beyond its plan: it shards the
projections' weights but leaves view and reshape sizes as written, i.e. global."""


class WithLoss(nn.Module):
    """``model`` and the benchmark's loss (mean square of its output, the first of a tuple) in
    one module, as a training script compiles them: the loss is reduced where the output lies,
    and no rank needs the whole output."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, *args, **kwargs):
        out = self.model(*args, **kwargs)
        return (out[0] if isinstance(out, tuple) else out).square().mean()


def ours(model: nn.Module, mesh, example_inputs: tuple = (), example_kwargs: dict | None = None, *, inner: str):
    """``model`` with its loss (parallelized in place), and that compiled with our backend. Over
    cp alone the parameters stay whole on every rank, as the peers (``context_parallel``,
    diffusers' own) hold them: ``parallelize``'s default cuts them over cp as FSDP, which
    gathers them at each call."""
    cut = {name for name, size in zip(mesh.mesh_dim_names, mesh.mesh.shape) if size > 1}
    options = {"fsdp_dims": ()} if cut <= {"ring", "ulysses"} else {}
    parallel = WithLoss(model)
    dtensor_par.parallelize(parallel, mesh, example_inputs, example_kwargs=example_kwargs, **options)
    return parallel, torch.compile(parallel, backend=dtensor_par.hybrid_parallel(mesh, inner_backend=inner, **options))


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


def flux(heads: int = 8, head_dim: int = 32, image: int = 32, text: int = 128):
    """diffusers' Flux transformer, one joint and one single-stream block, ``heads x head_dim``
    wide (the rotary axes span ``head_dim``), on an ``image x image`` latent and ``text``
    tokens: ``(model, kwargs)``, seeded."""
    from diffusers import FluxTransformer2DModel
    torch.manual_seed(0)
    axes = (head_dim // 4, 3 * head_dim // 8, 3 * head_dim // 8)
    model = FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1,
                                   attention_head_dim=head_dim, num_attention_heads=heads, joint_attention_dim=64,
                                   pooled_projection_dim=64, axes_dims_rope=axes)
    ids = torch.zeros(image * image, 3)
    ids[:, 1], ids[:, 2] = torch.arange(image * image) // image, torch.arange(image * image) % image
    kwargs = {"hidden_states": torch.randn(1, image * image, 16), "encoder_hidden_states": torch.randn(1, text, 64),
              "pooled_projections": torch.randn(1, 64), "timestep": torch.tensor([0.5]), "img_ids": ids,
              "txt_ids": torch.zeros(text, 3), "return_dict": False}
    return model, kwargs


def fsdp_anchor(model: nn.Module, mesh) -> WithLoss:
    """FSDP2 + TP as torchtitan builds it: ``tp_anchor`` over mesh["tp"], then ``fully_shard``
    over mesh["dp_shard"] on each block and on the root, with its loss."""
    from torch.distributed.fsdp import fully_shard

    anchor = tp_anchor(model, mesh["tp"])
    for block in anchor.blocks:
        fully_shard(block, mesh=mesh["dp_shard"])
    return WithLoss(fully_shard(anchor, mesh=mesh["dp_shard"]))


def ddp_anchor(model: nn.Module) -> nn.Module:
    """``DistributedDataParallel`` over the whole world, its loss inside."""
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(WithLoss(copy.deepcopy(model)))
