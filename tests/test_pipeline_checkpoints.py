"""Pipeline parallelism from a checkpoint (``dtensor_par.pipeline(..., checkpoint=folder)``): a
model whose parameters are on ``meta`` is cut into stages and each rank reads only its stages'
pieces, so a rank holds at most 0.6 of the model's parameters at pp2 (and 1/(tp x dp_shard) of
that beyond) and no other copy; it trains as one device's model loaded from the same checkpoint
accumulating the same microbatches (loss, every gradient, 3 AdamW steps with clipping:
``harness.pipeline_against_one_device``); ``step.save_pretrained`` writes what the model's own
loading reads back bit for bit. With ``test_pipeline`` these close issue 58's matrix: GPipe, 1F1B
and Interleaved1F1B each at pp2, pp2 x tp2, pp2 x ulysses2 and pp2 x dp_shard2 x tp2 (8 ranks, one
launch), transformers' Llama and the toy DiT (qk-normed, so every parameter has a gradient: a key
bias without it has none) each at every one of those meshes."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

import dtensor_par
from dtensor_par._testing import models
from dtensor_par._testing.harness import pipeline_against_one_device, pipeline_mismatches, run_ranks, run_ranks_together
from dtensor_par.checkpoints import empty_model, load_checkpoint, parameters_on_meta
from dtensor_par.pipeline_plan import SCHEDULES
from tests import tiers
from tests.background import in_background

pytest.importorskip("transformers", reason="the models extra (pip install -e '.[models]') is not installed")
# imported here, once, before this module's launches start: transformers' lazy imports are not thread-safe
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

LAYERS, BATCH, SEQ, VOCAB, MICROBATCHES, DIM = 4, 4, 8, 50, 2, 32
KW = {"use_cache": False}


def _token_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, 1), target.flatten())


def _toy_dit() -> torch.nn.Module:
    return models.DiT(layers=LAYERS, dim=DIM, heads=4, mlp=64, qk_norm=True)


def _toy_llama() -> torch.nn.Module:
    return models.Llama(vocab=VOCAB, layers=LAYERS)


def _loaded(build, folder: str) -> torch.nn.Module:
    """One device's model of the checkpoint: built, then read whole."""
    return load_checkpoint(build(), folder)


def _tokens(seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed))


CASES = {  # model: (built on meta, one device's model loaded, input, target, kwargs, loss_fn)
    "llama": (lambda folder: empty_model(LlamaForCausalLM, folder),
              lambda folder: LlamaForCausalLM.from_pretrained(folder),
              lambda: _tokens(1), lambda: _tokens(2), KW, _token_loss),
    "toy llama": (lambda folder: _built_with(parameters_on_meta(), _toy_llama),
                  lambda folder: _loaded(_toy_llama, folder), lambda: _tokens(1), lambda: _tokens(2), {}, _token_loss),
    "dit": (lambda folder: _built_with(torch.device("meta"), _toy_dit), lambda folder: _loaded(_toy_dit, folder),
            lambda: torch.randn(BATCH, SEQ, DIM, generator=torch.Generator().manual_seed(1)),
            lambda: torch.randn(BATCH, SEQ, DIM, generator=torch.Generator().manual_seed(2)), {}, F.mse_loss),
}


def _built_with(context, build) -> torch.nn.Module:
    with context:
        return build()


def pipeline_from_checkpoint(rank: int, world: int, *, folder: str, out: str, sizes: dict, model: str,
                             schedule: str) -> dict:
    """A pipeline of the meta model of ``folder`` reading its stages' pieces: whether it holds
    anything else, and the step saved to ``out`` at once, read back on one device; then
    ``harness.pipeline_against_one_device``'s numbers against one device's loaded model."""
    torch._dynamo.reset()
    build_meta, build_loaded, make_input, make_target, kwargs, loss_fn = CASES[model]
    mesh, x, target = dtensor_par.init_mesh(**sizes), make_input(), make_target()
    meta = build_meta(folder)
    backend = "eager" if SCHEDULES[schedule].splits_backward else "aot_eager"
    step = dtensor_par.pipeline(meta, mesh, (x,), loss_fn=loss_fn, microbatches=MICROBATCHES, schedule=schedule,
                                example_kwargs=kwargs, checkpoint=folder, inner_backend=backend)
    locals_ = [p.to_local() if isinstance(p, DTensor) else p for p in step.parameters()]
    result = {"model_on_meta": all(p.is_meta for p in meta.parameters()),
              "own_storage": all(t.untyped_storage().nbytes() == t.numel() * t.element_size() for t in locals_)}
    step.save_pretrained(out, max_shard_size="100KB")
    reference, saved = build_loaded(folder), build_loaded(out).state_dict()
    result["saved_differ"] = [k for k, v in reference.state_dict().items() if not torch.equal(v, saved[k])]
    result["files"] = sorted(os.listdir(out))
    result["by_vocab"] = {fqn: dict(zip(p.device_mesh.mesh_dim_names, map(str, p.placements)))["tp"]
                          for fqn, p in step.named_parameters() if fqn in VOCAB_CUT and isinstance(p, DTensor)}
    return {**result, **pipeline_against_one_device(step, reference, x, target, loss_fn=loss_fn,
                                                    microbatches=MICROBATCHES, kwargs=kwargs)}


VOCAB_CUT = ("model.embed_tokens.weight", "embed.weight", "lm_head.weight")
"""The Llamas' token tables (on the first stage) and LM heads (on the last), read cut by the vocabulary over tp."""


def write_checkpoints(rank: int, world: int, *, folder: str) -> dict:
    """The checkpoints the launches read, written in a process of their own (transformers models
    are not built on the pytest process's background thread)."""
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
                                 num_attention_heads=8, num_key_value_heads=4, initializer_range=0.1,
                                 tie_word_embeddings=False)).save_pretrained(os.path.join(folder, "llama"),
                                                                             max_shard_size="100KB")
    dtensor_par.save_pretrained(_toy_dit(), os.path.join(folder, "dit"))
    dtensor_par.save_pretrained(_toy_llama(), os.path.join(folder, "toy llama"))
    return {}


RUNS = {  # label: world, mesh, model, schedule; the most a rank holds of the model's parameters
    "transformers Llama pp2 1F1B": (2, {"pp": 2}, "llama", "1F1B", 0.6),
    "DiT pp2 Interleaved1F1B": (2, {"pp": 2}, "dit", "Interleaved1F1B", 0.6),
    "DiT pp2 ZBVZeroBubble": (2, {"pp": 2}, "dit", "ZBVZeroBubble", 0.6),  # V-shaped: rank 0 holds stages 0 and 3
    "transformers Llama pp2 x tp2 1F1B": (4, {"pp": 2, "tp": 2}, "llama", "1F1B", 0.6 / 2),
    "DiT pp2 x tp2 GPipe": (4, {"pp": 2, "tp": 2}, "dit", "GPipe", 0.6 / 2),
    "DiT pp2 x ulysses2 Interleaved1F1B": (4, {"pp": 2, "ulysses": 2}, "dit", "Interleaved1F1B", 0.6),
    "toy Llama pp2 x dp_shard2 x tp2 1F1B": (8, {"pp": 2, "dp_shard": 2, "tp": 2}, "toy llama", "1F1B", 0.6 / 4),
    "transformers Llama pp2 x dp_shard2 x tp2 GPipe": (8, {"pp": 2, "dp_shard": 2, "tp": 2}, "llama", "GPipe", 0.6 / 4),
    "DiT pp2 x dp_shard2 x tp2 Interleaved1F1B": (8, {"pp": 2, "dp_shard": 2, "tp": 2}, "dit", "Interleaved1F1B",
                                                  0.6 / 4),
}


SWEPT = {"DiT pp2 x tp2 GPipe", "toy Llama pp2 x dp_shard2 x tp2 1F1B", "transformers Llama pp2 x dp_shard2 x tp2 GPipe"}
"""Runs ``tests.tiers`` leaves to ``--sweep``: CI reads transformers' Llama at pp2 and beside tp,
and the DiT over pp x dp_shard x tp."""


def _launch(world: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as folder:
        run_ranks(1, write_checkpoints, folder=folder)
        return run_ranks_together(world, {
            label: (pipeline_from_checkpoint, dict(folder=os.path.join(folder, model), sizes=sizes, model=model,
                                                   schedule=schedule, out=os.path.join(folder, f"saved {label}")))
            for label, (w, sizes, model, schedule, _) in RUNS.items() if w == world and tiers.kept(label, SWEPT)})


LAUNCHES = {world: in_background(_launch, world) for world in (2, 4, 8)}
"""One launch per world size; the 8 ranks' three cases run one schedule each, and both models."""


@pytest.mark.parametrize("label", [tiers.case(label, sweep=label in SWEPT) for label in RUNS])
def test_a_meta_model_reads_its_stages_and_trains_as_one_device_loaded_alike(label):
    world, sizes, model, _, most = RUNS[label]
    per_rank = [r[label] for r in LAUNCHES[world].result()]
    found = pipeline_mismatches(label, per_rank, most)
    assert not found, "\n".join(found)
    for rank, result in enumerate(per_rank):
        assert result["model_on_meta"] and result["own_storage"], (label, rank, result)
        assert result["saved_differ"] == [], (label, rank, result["saved_differ"])
        assert "model.safetensors.index.json" in result["files"], (label, rank, result["files"])
    if model != "dit" and "tp" in sizes:  # each rank read its vocabulary's rows of the table and of the head
        held = [(fqn, placement) for r in per_rank for fqn, placement in r["by_vocab"].items()]
        assert len({fqn for fqn, _ in held}) == 2 and all(p == "S(0)" for _, p in held), (label, held)


def test_a_meta_model_without_what_fills_it_is_refused_by_name(fake_world, tmp_path):
    """Parameters on meta and no checkpoint; buffers on meta that no checkpoint holds (the toy
    Llama's rotary frequencies, built under ``torch.device("meta")``); a step given to
    ``dtensor_par.save_pretrained``."""
    fake_world(2)
    mesh, ids = dtensor_par.init_mesh(pp=2), _tokens(1)
    dit = _built_with(torch.device("meta"), _toy_dit)
    with pytest.raises(ValueError, match=r"pipeline: 72 parameters of DiT are on meta \(first 'blocks.0.norm1.weight'\) "
                                         r"and no checkpoint= was given"):
        dtensor_par.pipeline(dit, mesh, (torch.randn(BATCH, SEQ, DIM),), loss_fn=F.mse_loss, microbatches=2)
    llama = _built_with(torch.device("meta"), _toy_llama)
    with pytest.raises(ValueError, match=r"pipeline: buffers \['blocks.0.inv_freq', 'blocks.1.inv_freq', "
                                         r"'blocks.2.inv_freq', 'blocks.3.inv_freq'\] of Llama \(4 in all\) are on meta "
                                         r"and no checkpoint holds them; .*parameters_on_meta\(\)"):
        dtensor_par.pipeline(llama, mesh, (ids,), loss_fn=_token_loss, microbatches=2, checkpoint=str(tmp_path))
    with pytest.raises(TypeError, match=r"save_pretrained writes an nn.Module, not a PipelineStep; a pipeline's step "
                                        r"writes its stages itself: step.save_pretrained\(path\)"):
        dtensor_par.save_pretrained(object.__new__(dtensor_par.pipelining.PipelineStep), str(tmp_path))
