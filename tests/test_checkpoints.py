"""Checkpoint folders (``checkpoints.py``): ``from_pretrained`` reads only each rank's pieces,
which equal, bit for bit, what ``parallelize`` of the model built whole holds (Shard, the
``_StridedShard`` of fused projections, FSDP, experts cut by ep); the model then computes what
one device's ``from_pretrained`` computes; ``save_pretrained`` writes what the library reads
back bit-exact; bad input is refused before anything is read, naming the key and shapes."""

from __future__ import annotations

import copy
import json
import logging
import os
import struct
import tempfile

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

import dtensor_par
from dtensor_par.checkpoints import load_checkpoint
from dtensor_par._testing import models
from dtensor_par._testing.harness import run_ranks_together
from tests.background import in_background

KW = {"use_cache": False}
"""Llama's keyword arguments: a kv cache is generate's, not what is planned here."""
SHARD = "100KB"
"""Each tiny Llama's files: 4 shards and an index."""


def _llama_config(**overrides):
    from transformers import LlamaConfig
    return LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=128, bos_token_id=0, eos_token_id=0, **overrides)


def _ids():
    return torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _placements(t: torch.Tensor) -> list[str]:
    return [str(p) for p in t.placements] if isinstance(t, DTensor) else ["plain"]


def _pieces_differ(loaded: nn.Module, whole: nn.Module, mesh, example_inputs: tuple, **options) -> list[str]:
    """The parameters and buffers of which ``loaded`` holds another piece, or another placement,
    than ``parallelize`` of ``whole`` (a model built with its values) holds."""
    theirs = copy.deepcopy(whole)
    dtensor_par.parallelize(theirs, mesh, example_inputs, **options)
    want = {**dict(theirs.named_parameters()), **dict(theirs.named_buffers())}
    return [name for name, t in [*loaded.named_parameters(), *loaded.named_buffers()]
            if _placements(t) != _placements(want[name]) or not torch.equal(_local(t), _local(want[name]))]


def _differ(state: dict, expected: dict) -> list[str]:
    return [k for k, v in expected.items() if k not in state or not torch.equal(state[k], v)] + sorted(
        set(state) - set(expected))


def llama_round_trip(rank: int, world: int, *, folder: str, out: str, sizes: dict, run: bool) -> dict:
    """A transformers Llama checkpoint (4 shards and an index) read piece by piece over the mesh
    of ``sizes``; with ``run``, its logits against one device's ``from_pretrained``; then written
    by ``save_pretrained`` and read back by transformers on one device."""
    from transformers import LlamaForCausalLM

    torch._dynamo.reset()
    mesh, ids = dtensor_par.init_mesh(**sizes), _ids()
    model = dtensor_par.from_pretrained(LlamaForCausalLM, folder, mesh, example_inputs=(ids,), example_kwargs=KW,
                                        inner_backend="aot_eager")
    reference = LlamaForCausalLM.from_pretrained(folder)
    result = {"pieces_differ": _pieces_differ(model, reference, mesh, (ids,), example_kwargs=KW),
              "q_proj": _placements(model.model.layers[0].self_attn.q_proj.weight),
              "tied": model.lm_head.weight is model.model.embed_tokens.weight,
              "inv_freq": torch.equal(model.model.rotary_emb.inv_freq, reference.model.rotary_emb.inv_freq)}
    if run:
        backend = dtensor_par.hybrid_parallel(mesh, inner_backend="aot_eager")
        logits = torch.compile(model, backend=backend)(ids, **KW).logits
        result["forward"] = (logits - reference(ids, **KW).logits).abs().max().item()
    dtensor_par.save_pretrained(model, out, max_shard_size=SHARD)
    result["saved_differ"] = _differ(LlamaForCausalLM.from_pretrained(out).state_dict(), reference.state_dict())
    result["files"] = sorted(os.listdir(out))
    return result


def decorated_llama(rank: int, world: int, *, folder: str) -> dict:
    """``parallel(tp=2)(LlamaForCausalLM).from_pretrained(folder)``: built on meta, its pieces read
    at its first call, which parallelizes it."""
    from transformers import LlamaForCausalLM

    torch._dynamo.reset()
    ids = _ids()
    model = dtensor_par.parallel(tp=2, inner_backend="aot_eager")(LlamaForCausalLM).from_pretrained(folder)
    meta_before_call = all(p.is_meta for p in model.parameters())
    logits = model(ids, **KW).logits
    reference = LlamaForCausalLM.from_pretrained(folder)
    return {"meta_before_call": meta_before_call, "forward": (logits - reference(ids, **KW).logits).abs().max().item(),
            "pieces_differ": _pieces_differ(model, reference, dtensor_par.init_mesh(tp=2), (ids,), example_kwargs=KW),
            "q_rows": model.model.layers[0].self_attn.q_proj.weight.to_local().shape[0]}


def phi3_fused(rank: int, world: int, *, folder: str) -> dict:
    """Phi3's fused qkv and gate_up projections (``_StridedShard``) read at tp2, against one device."""
    from transformers import Phi3ForCausalLM

    torch._dynamo.reset()
    mesh, ids = dtensor_par.init_mesh(tp=2), _ids()
    model = dtensor_par.from_pretrained(Phi3ForCausalLM, folder, mesh, example_inputs=(ids,), example_kwargs=KW,
                                        inner_backend="aot_eager")
    reference = Phi3ForCausalLM.from_pretrained(folder)
    logits = torch.compile(model, backend=dtensor_par.hybrid_parallel(mesh, inner_backend="aot_eager"))(ids, **KW).logits
    layer = model.model.layers[0]
    return {"forward": (logits - reference(ids, **KW).logits).abs().max().item(),
            "pieces_differ": _pieces_differ(model, reference, mesh, (ids,), example_kwargs=KW),
            "qkv": _placements(layer.self_attn.qkv_proj.weight), "gate_up": _placements(layer.mlp.gate_up_proj.weight)}


def gpt_pieces(rank: int, world: int, *, folder: str, sizes: dict) -> dict:
    """A plain module (the test GPT: a fused qkv of equal parts) written by ``save_pretrained``
    and read into its parallelized meta twin by ``load_checkpoint``."""
    torch.manual_seed(0)
    whole, x = models.GPT(layers=1), torch.randn(2, 8, 32)
    mesh = dtensor_par.init_mesh(**sizes)
    dtensor_par.save_pretrained(whole, folder)
    with torch.device("meta"):
        model = models.GPT(layers=1)
    load_checkpoint(dtensor_par.parallelize(model, mesh, (x,)), folder)
    return {"pieces_differ": _pieces_differ(model, whole, mesh, (x,)),
            "qkv": _placements(model.blocks[0].qkv.weight), "fc": _placements(model.blocks[0].fc.weight)}


def mixtral_ep(rank: int, world: int, *, folder: str) -> dict:
    """Mixtral's stacked experts cut over dp_shard x ulysses (``ep="cp"``), written by
    ``save_pretrained`` under the model's own keys and read back piece by piece."""
    from transformers import MixtralConfig, MixtralForCausalLM

    logging.getLogger("transformers").setLevel(logging.ERROR)
    torch.manual_seed(0)
    whole = MixtralForCausalLM(MixtralConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                             num_hidden_layers=1, num_attention_heads=8, num_key_value_heads=4,
                                             num_local_experts=4, num_experts_per_tok=2)).eval()
    mesh, ids = dtensor_par.init_mesh(dp_shard=2, ulysses=2), _ids()
    dtensor_par.save_pretrained(whole, folder)
    model = dtensor_par.from_pretrained(MixtralForCausalLM, folder, mesh, example_inputs=(ids,), example_kwargs=KW,
                                        ep="cp")
    experts = model.model.layers[0].mlp.experts.gate_up_proj
    return {"pieces_differ": _pieces_differ(model, whole, mesh, (ids,), example_kwargs=KW, ep="cp"),
            "experts": _placements(experts), "local": list(experts.to_local().shape)}


def _calls(world: int, folder: str) -> dict:
    """Each launch's rank functions, by label, with the checkpoints they read written first."""
    from transformers import LlamaForCausalLM, Phi3Config, Phi3ForCausalLM

    torch.manual_seed(0)
    tied, untied = os.path.join(folder, "tied"), os.path.join(folder, "untied")
    LlamaForCausalLM(_llama_config(tie_word_embeddings=True)).save_pretrained(tied, max_shard_size=SHARD)
    LlamaForCausalLM(_llama_config()).save_pretrained(untied, max_shard_size=SHARD)
    out = lambda name: dict(out=os.path.join(folder, name))  # noqa: E731
    if world == 2:
        phi3 = os.path.join(folder, "phi3")
        Phi3ForCausalLM(Phi3Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=4, pad_token_id=0)).save_pretrained(phi3)
        return {"tp2": (llama_round_trip, dict(folder=tied, sizes={"tp": 2}, run=True, **out("tp2"))),
                "decorated": (decorated_llama, dict(folder=tied)),
                "phi3": (phi3_fused, dict(folder=phi3)),
                "gpt tp2": (gpt_pieces, dict(folder=os.path.join(folder, "gpt"), sizes={"tp": 2}))}
    return {"tp2-ulysses2": (llama_round_trip, dict(folder=untied, sizes={"tp": 2, "ulysses": 2}, run=True,
                                                    **out("tp2-ulysses2"))),
            "dp_shard2-tp2": (llama_round_trip, dict(folder=tied, sizes={"dp_shard": 2, "tp": 2}, run=False,
                                                     **out("dp_shard2-tp2"))),
            "gpt dp_shard2-tp2": (gpt_pieces, dict(folder=os.path.join(folder, "gpt"), sizes={"dp_shard": 2, "tp": 2})),
            "ep": (mixtral_ep, dict(folder=os.path.join(folder, "mixtral")))}


def _launch(world: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as folder:
        return run_ranks_together(world, _calls(world, folder))


LAUNCHES = {world: in_background(_launch, world) for world in (2, 4)}

LLAMA_FILES = ["config.json", "model-00001-of-00004.safetensors", "model-00002-of-00004.safetensors",
               "model-00003-of-00004.safetensors", "model-00004-of-00004.safetensors", "model.safetensors.index.json"]


@pytest.mark.parametrize("world, label, q_proj", [(2, "tp2", ["S(0)"]), (4, "tp2-ulysses2", ["S(1)", "S(0)"]),
                                                   (4, "dp_shard2-tp2", ["S(1)", "S(0)"])])
def test_llama_pieces_equal_parallelize_and_compute_as_one_device(world, label, q_proj):
    for rank, result in enumerate(r[label] for r in LAUNCHES[world].result()):
        assert result["pieces_differ"] == [] and result["inv_freq"], (rank, result)
        assert result["q_proj"] == q_proj, (rank, result)
        assert result["tied"] == (label != "tp2-ulysses2"), (rank, result)
        assert result.get("forward", 0.0) <= 1e-5, (rank, result)
        assert result["saved_differ"] == [] and result["files"] == LLAMA_FILES, (rank, result)


def test_decorated_class_reads_its_pieces_at_the_first_call():
    for rank, result in enumerate(r["decorated"] for r in LAUNCHES[2].result()):
        assert result["meta_before_call"] and result["pieces_differ"] == [], (rank, result)
        assert result["forward"] <= 1e-5 and result["q_rows"] == 32, (rank, result)


def test_fused_projections_read_their_strided_pieces():
    for rank, result in enumerate(r["phi3"] for r in LAUNCHES[2].result()):
        assert result["pieces_differ"] == [] and result["forward"] <= 1e-5, (rank, result)
        assert result["qkv"] == ["_S(0, 3)"] and result["gate_up"] == ["_S(0, 2)"], (rank, result)


@pytest.mark.parametrize("world, label, qkv, fc", [(2, "gpt tp2", ["_S(0, 3)"], ["S(0)"]),
                                                   (4, "gpt dp_shard2-tp2", ["S(1)", "_S(0, 3)"], ["S(1)", "S(0)"])])
def test_plain_module_pieces_equal_parallelize(world, label, qkv, fc):
    for rank, result in enumerate(r[label] for r in LAUNCHES[world].result()):
        assert result == {"pieces_differ": [], "qkv": qkv, "fc": fc}, (rank, result)


def test_experts_cut_by_ep_read_their_pieces():
    for rank, result in enumerate(r["ep"] for r in LAUNCHES[4].result()):
        assert result["pieces_differ"] == [] and result["experts"] == ["S(0)", "S(0)"], (rank, result)
        assert result["local"] == [1, 256, 64], (rank, result)
