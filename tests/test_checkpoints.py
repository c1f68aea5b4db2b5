"""Checkpoint folders (``checkpoints.py``): ``from_pretrained`` reads only each rank's pieces,
which, gathered, equal the checkpoint bit for bit (Shard, the ``_StridedShard`` of fused
projections, FSDP, experts cut by ep); the model then computes what one device's
``from_pretrained`` computes, within 1e-5; ``save_pretrained`` writes what the library reads
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
from dtensor_par._testing import loading, models, patterns, real_models
from dtensor_par._testing.harness import run_ranks, run_ranks_together
from tests import tiers
from tests.background import in_background

pytest.importorskip("transformers", reason="the models extra (pip install -e '.[models]') is not installed")
# imported here, once, before this module's launches start: transformers' lazy imports are not thread-safe
from diffusers import FluxTransformer2DModel  # noqa: E402
from transformers import (Dinov2Config, Dinov2Model, LlamaConfig, LlamaForCausalLM, LlamaModel,  # noqa: E402
                          MixtralConfig, MixtralForCausalLM, Phi3Config, Phi3ForCausalLM, Qwen2MoeForCausalLM)

KW = {"use_cache": False}
"""Llama's keyword arguments: a kv cache is generate's, not what is planned here."""
SHARD = "100KB"
"""Each tiny Llama's files: 4 shards and an index."""


def _llama_config(**overrides):
    return LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=128, bos_token_id=0, eos_token_id=0, **overrides)


def _ids():
    return torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _placements(t: torch.Tensor) -> list[str]:
    return [str(p) for p in t.placements] if isinstance(t, DTensor) else ["plain"]


def _pieces_differ(loaded: nn.Module, whole: nn.Module) -> list[str]:
    """The parameters and buffers of ``loaded`` whose pieces, gathered as DTensor places them,
    are not bit for bit ``whole``'s (a model built with its values)."""
    want = {**dict(whole.named_parameters()), **dict(whole.named_buffers())}
    return [name for name, t in [*loaded.named_parameters(), *loaded.named_buffers()]
            if not torch.equal(t.full_tensor() if isinstance(t, DTensor) else t, want[name])]


def _differ(state: dict, expected: dict) -> list[str]:
    return [k for k, v in expected.items() if k not in state or not torch.equal(state[k], v)] + sorted(
        set(state) - set(expected))


def _token_inputs() -> tuple[tuple, dict]:
    return (_ids(),), KW


def _flux_inputs() -> tuple[tuple, dict]:
    """``real_models.flux``'s inputs as a batch of 2 (dp_shard2 needs a sample per rank)."""
    torch.manual_seed(0)
    _, args, kwargs = real_models.flux()
    batched = {k: torch.cat([v, torch.randn_like(v)]) for k, v in kwargs.items()
               if k in ("hidden_states", "encoder_hidden_states", "pooled_projections")}
    return args, {**kwargs, **batched, "timestep": torch.tensor([0.5, 0.25])}


def _output(out) -> torch.Tensor:
    return out.logits if hasattr(out, "logits") else out[0]


def round_trip(rank: int, world: int, *, model_cls: type, folder: str, out: str, sizes: dict, probe: str,
               inputs=_token_inputs, options: dict | None = None) -> dict:
    """A checkpoint folder (transformers', or a diffusers component's) read piece by piece over
    the mesh of ``sizes`` (``options`` for planning and compiling), its output against one
    device's ``from_pretrained`` of it; then written by ``save_pretrained`` (each rank its own
    files) and read back by the library on one device. ``probe``: a parameter whose placements
    are reported. The read is measured alone (read again: ``from_pretrained`` also plans): the
    bytes read from disk beside the bytes this rank holds and the checkpoint's."""
    logging.getLogger("transformers").setLevel(logging.ERROR)
    torch._dynamo.reset()
    options = {"inner_backend": "eager", **(options or {})}
    mesh, (args, kwargs) = dtensor_par.init_mesh(**sizes), inputs()
    model = dtensor_par.from_pretrained(model_cls, folder, mesh, example_inputs=args, example_kwargs=kwargs, **options)
    read = loading.read_bytes()
    load_checkpoint(model, folder)
    read = {"read_bytes": loading.read_bytes() - read, "held_bytes": loading.held_bytes(model),
            "checkpoint_bytes": loading.checkpoint_bytes(folder)}
    reference = model_cls.from_pretrained(folder)
    computed = _output(torch.compile(model, backend=dtensor_par.hybrid_parallel(mesh, **options))(*args, **kwargs))
    embeddings = [getattr(model, f"get_{side}_embeddings", lambda: None)() for side in ("input", "output")]
    result = {"pieces_differ": _pieces_differ(model, reference), "probe": _placements(model.get_parameter(probe)),
              "tied": None not in embeddings and embeddings[0].weight is embeddings[1].weight,
              "vocab": [_placements(e.weight) for e in embeddings if e is not None],
              "forward": (computed - _output(reference(*args, **kwargs))).abs().max().item(), **read}
    written = dtensor_par.save_pretrained(model, out, max_shard_size=SHARD)
    result["saved_differ"] = _differ(_state(model_cls.from_pretrained(out)), _state(reference))
    result["written"], result["files"] = [os.path.basename(f) for f in written], sorted(os.listdir(out))
    return result


def deferred_llama(rank: int, world: int, *, folder: str) -> dict:
    """Planning and reading deferred to the first call: ``parallel(tp=2)(LlamaForCausalLM)
    .from_pretrained(folder)``, and ``from_pretrained`` without example inputs (``parallel``'s
    instance over the given mesh). Each is built on meta; its first call parallelizes it, reads
    its pieces and computes one device's logits."""

    reference, ids = LlamaForCausalLM.from_pretrained(folder), _ids()
    mesh = dtensor_par.init_mesh(tp=2)
    built = {"decorator": lambda: dtensor_par.parallel(tp=2, inner_backend="eager")(LlamaForCausalLM)
             .from_pretrained(folder),
             "from_pretrained": lambda: dtensor_par.from_pretrained(LlamaForCausalLM, folder, mesh,
                                                                    inner_backend="eager")}
    result = {}
    for label, build in built.items():
        torch._dynamo.reset()
        model = build()
        meta_before_call = isinstance(model, LlamaForCausalLM) and all(p.is_meta for p in model.parameters())
        logits = model(ids, **KW).logits
        result[label] = {"meta_before_call": meta_before_call,
                         "forward": (logits - reference(ids, **KW).logits).abs().max().item(),
                         "pieces_differ": _pieces_differ(model, reference),
                         "q_rows": model.model.layers[0].self_attn.q_proj.weight.to_local().shape[0]}
    return result


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
    return {"pieces_differ": _pieces_differ(model, whole),
            "qkv": _placements(model.blocks[0].qkv.weight), "fc": _placements(model.blocks[0].fc.weight)}


def _mixtral():
    return MixtralForCausalLM(MixtralConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                            num_attention_heads=8, num_key_value_heads=4, num_local_experts=4,
                                            num_experts_per_tok=2)).eval()


def looped_experts(rank: int, world: int, *, folder: str) -> dict:
    """A mixture whose experts are an ``nn.ModuleList`` looped over (``patterns.LoopedMoEBlock``),
    with ``ep="cp"`` at tp2 x ring2: each expert's weights held cut over ring along the dim tp does
    not cut. Written whole by ``save_pretrained``, read into its parallelized meta twin: the pieces,
    one device's output, and the parallelized model written back."""
    from safetensors.torch import load_file

    torch._dynamo.reset()
    torch.manual_seed(0)
    whole, x = patterns.LoopedMoEBlock(), torch.randn(2, 16, 32)
    mesh = dtensor_par.init_mesh(tp=2, ring=2)
    dtensor_par.save_pretrained(whole, os.path.join(folder, "whole"))
    with torch.device("meta"):
        model = patterns.LoopedMoEBlock()
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        load_checkpoint(dtensor_par.parallelize(model, mesh, (x,), ep="cp"), os.path.join(folder, "whole"))
        backend = dtensor_par.hybrid_parallel(mesh, ep="cp", inner_backend="eager")
        forward = (torch.compile(model, backend=backend)(x) - whole(x)).abs().max().item()
    written = dtensor_par.save_pretrained(model, os.path.join(folder, "ours"), max_shard_size=20_000)
    files = [os.path.join(folder, "ours", f) for f in os.listdir(os.path.join(folder, "ours"))]
    read = {k: v for f in files if f.endswith(".safetensors") for k, v in load_file(f).items()}
    return {"pieces_differ": _pieces_differ(model, whole), "w1": _placements(model.moe.experts[0].w1.weight),
            "forward": forward, "saved_differ": _differ(read, _state(whole)),
            "written": [os.path.basename(f) for f in written]}


def dcp_between_meshes(rank: int, world: int, *, folder: str) -> dict:
    """The test GPT (a fused qkv: ``_StridedShard`` on tp) parallelized at tp2 x ring2 and saved
    by DCP, loaded by DCP into fresh meta models at tp4 (``model.state_dict``) and dp_shard2 x tp2
    (``get_model_state_dict``): parameters bit-equal to the saved ones; tp4 computes one device's
    output."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    torch._dynamo.reset()
    torch.manual_seed(0)
    whole, x = models.GPT(layers=1), torch.randn(2, 8, 32)
    saved = dtensor_par.parallelize(copy.deepcopy(whole), dtensor_par.init_mesh(tp=2, ring=2), (x,))
    dcp.save(get_model_state_dict(saved), checkpoint_id=folder)
    result = {"saved qkv": _placements(saved.blocks[0].qkv.weight)}
    for label, sizes in (("tp4", {"tp": 4}), ("dp_shard2-tp2", {"dp_shard": 2, "tp": 2})):
        mesh = dtensor_par.init_mesh(**sizes)
        with torch.device("meta"):
            model = models.GPT(layers=1)
        dtensor_par.parallelize(model, mesh, (x,))
        if label == "tp4":
            state = model.state_dict()
            dcp.load(state, checkpoint_id=folder)
            model.load_state_dict(state)
            backend = dtensor_par.hybrid_parallel(mesh, inner_backend="eager")
            result["forward"] = (torch.compile(model, backend=backend)(x) - whole(x)).abs().max().item()
        else:
            state = get_model_state_dict(model)
            dcp.load(state, checkpoint_id=folder)
            set_model_state_dict(model, state)
        gathered = {k: v.full_tensor() for k, v in model.state_dict().items()}
        result[label] = {"differ": _differ(gathered, _state(whole)), "qkv": _placements(model.blocks[0].qkv.weight)}
    return result


def write_checkpoints(rank: int, world: int, *, folder: str, launch: int) -> dict:
    """The checkpoints the launches' ranks read, written in a process of their own: building
    transformers models on the pytest process's background thread would race its tests' Dynamo
    traces (transformers registers each model class in a global that Dynamo guards on). Mixtral's
    by ``save_pretrained`` (the model's own keys) and by transformers' (per expert, the layout
    its loading converts), Qwen2-MoE's by transformers' too; a diffusers transformer into a
    pipeline's component folder, sharded with an index."""
    torch.manual_seed(0)
    LlamaForCausalLM(_llama_config(tie_word_embeddings=True)).save_pretrained(os.path.join(folder, "tied"),
                                                                              max_shard_size=SHARD)
    LlamaForCausalLM(_llama_config()).save_pretrained(os.path.join(folder, "untied"), max_shard_size=SHARD)
    Phi3ForCausalLM(Phi3Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                               num_attention_heads=4, num_key_value_heads=4, pad_token_id=0)
                    ).save_pretrained(os.path.join(folder, "phi3"))
    mixtral = _mixtral()
    dtensor_par.save_pretrained(mixtral, os.path.join(folder, "mixtral"))
    read = _differ(_state(MixtralForCausalLM.from_pretrained(os.path.join(folder, "mixtral"))), _state(mixtral))
    assert read == [], f"transformers reads other values from save_pretrained's Mixtral: {read}"
    mixtral.save_pretrained(os.path.join(folder, "legacy mixtral"))
    real_models.qwen2_moe()[0].save_pretrained(os.path.join(folder, "legacy qwen2_moe"))
    per_expert = [_checkpoint_keys(os.path.join(folder, name), "experts.0.") for name in LEGACY]
    assert all(per_expert), f"transformers no longer writes experts one by one: {dict(zip(LEGACY, per_expert))}"
    torch.manual_seed(0)
    real_models.flux()[0].save_pretrained(os.path.join(folder, "flux", "transformer"), max_shard_size="50KB")
    if launch == 2:
        loading.llama_checkpoint(os.path.join(folder, "big"), **BIG)
    return {}


def _checkpoint_keys(folder: str, part: str) -> list[str]:
    """The keys of the checkpoint ``folder`` that hold ``part``."""
    from dtensor_par.checkpoints import checkpoint_entries
    return sorted(key for key in checkpoint_entries(folder) if part in key)


LEGACY = ("legacy mixtral", "legacy qwen2_moe")
"""The folders transformers writes experts to one by one (its ``save_pretrained`` reverses its
conversion mapping), which its loading stacks."""
MESHES = {"tp2": {"tp": 2}, "tp2-ulysses2": {"tp": 2, "ulysses": 2}, "tp2-ring2": {"tp": 2, "ring": 2},
          "dp_shard2-tp2": {"dp_shard": 2, "tp": 2}, "dp_shard2-ulysses2": {"dp_shard": 2, "ulysses": 2}}
"""tp2 runs in the world-2 launch, the others in the world-4 one."""
ISSUE_MESHES = ("tp2", "tp2-ulysses2", "tp2-ring2", "dp_shard2-tp2")
"""Issue 57's acceptance meshes."""
ROUND_TRIPS = {
    "llama": dict(model_cls=LlamaForCausalLM, folder="tied", probe="model.layers.0.self_attn.q_proj.weight",
                  meshes=("tp2", "dp_shard2-tp2")),
    "llama untied": dict(model_cls=LlamaForCausalLM, folder="untied", probe="model.layers.0.self_attn.q_proj.weight",
                         meshes=("tp2-ulysses2", "tp2-ring2")),
    "phi3": dict(model_cls=Phi3ForCausalLM, folder="phi3", probe="model.layers.0.self_attn.qkv_proj.weight"),
    "mixtral": dict(model_cls=MixtralForCausalLM, folder="mixtral", probe="model.layers.0.mlp.experts.gate_up_proj",
                    options={"ep": "cp"}, meshes=(*ISSUE_MESHES, "dp_shard2-ulysses2")),
    "legacy-mixtral": dict(model_cls=MixtralForCausalLM, folder="legacy mixtral",
                           probe="model.layers.0.mlp.experts.gate_up_proj", options={"ep": "cp"},
                           meshes=("tp2", "tp2-ring2")),
    "legacy-qwen2_moe": dict(model_cls=Qwen2MoeForCausalLM, folder="legacy qwen2_moe",
                             probe="model.layers.0.mlp.experts.gate_up_proj", options={"ep": "cp"}, meshes=("tp2",)),
    "flux": dict(model_cls=FluxTransformer2DModel, folder="flux/transformer", probe="transformer_blocks.0.attn.to_q.weight",
                 inputs=_flux_inputs)}
"""Each model ``round_trip`` reads, by name, at its ``meshes`` (the issue's by default): Llama with
tied embeddings at tp2 and dp_shard2 x tp2, untied at the two cp meshes; Mixtral's experts also cut
4 ways, over dp_shard x ulysses; the per-expert folders transformers writes (``LEGACY``) at tp2 and,
experts cut by ring, tp2 x ring2."""


SWEPT = {"llama tp2-ulysses2", "llama tp2-ring2", "phi3 tp2-ulysses2", "phi3 dp_shard2-tp2", "mixtral tp2-ulysses2",
         "mixtral dp_shard2-tp2", "mixtral dp_shard2-ulysses2", "flux tp2-ring2", "flux dp_shard2-tp2"}
"""Round trips ``tests.tiers`` leaves to ``--sweep``: CI reads and writes each model at tp2 and
at one mesh of 4 (Llama tied over dp_shard x tp, Phi3's fused projections and Mixtral's experts
beside the ring, Flux beside Ulysses)."""


def _round_trips(world: int, folder: str) -> dict:
    calls = {}
    for model, spec in ROUND_TRIPS.items():
        spec = {"meshes": ISSUE_MESHES, **spec}
        for mesh in spec.pop("meshes"):
            if (world == 2) == (mesh == "tp2"):
                kwargs = {**spec, "sizes": MESHES[mesh], "folder": os.path.join(folder, spec["folder"]),
                          "out": os.path.join(folder, f"{model} {mesh}")}
                calls[f"{model.split()[0]} {mesh}"] = (round_trip, kwargs)
    return tiers.running(calls, SWEPT)


def _calls(world: int, folder: str) -> dict:
    """Each launch's rank functions, by label, with their arguments."""
    if world == 2:
        # first: a rank's peak RSS then rises from a process that has allocated nothing yet
        return {"memory": (loading.load_measured, dict(folder=os.path.join(folder, "big"), sizes={"tp": 2},
                                                       save_to=os.path.join(folder, "big saved"))),
                **_round_trips(world, folder),
                "deferred": (deferred_llama, dict(folder=os.path.join(folder, "tied"))),
                "gpt tp2": (gpt_pieces, dict(folder=os.path.join(folder, "gpt"), sizes={"tp": 2}))}
    return {**_round_trips(world, folder),
            "gpt dp_shard2-tp2": (gpt_pieces, dict(folder=os.path.join(folder, "gpt"), sizes={"dp_shard": 2, "tp": 2})),
            "looped experts": (looped_experts, dict(folder=os.path.join(folder, "looped"))),
            "dcp": (dcp_between_meshes, dict(folder=os.path.join(folder, "dcp")))}


def _launch(world: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as folder:
        run_ranks(1, write_checkpoints, folder=folder, launch=world)
        return run_ranks_together(world, _calls(world, folder))


LAUNCHES = {world: in_background(_launch, world) for world in (2, 4)}

def _each_rank_wrote_its_own_files(results: list[dict]) -> None:
    """Every rank wrote files, and each shard file the folder holds was written by one rank."""
    written = [r["written"] for r in results]
    shards = [f for f in results[0]["files"] if f.endswith(".safetensors")]
    assert all(written) and sorted(f for w in written for f in w) == shards, written


@pytest.mark.parametrize("world, label, probe, tied", [tiers.case(*run, sweep=run[1] in SWEPT) for run in [
    (2, "llama tp2", ["S(0)"], True), (4, "llama tp2-ulysses2", ["S(1)", "S(0)"], False),
    (4, "llama tp2-ring2", ["S(1)", "S(0)"], False), (4, "llama dp_shard2-tp2", ["S(1)", "S(0)"], True),
    (2, "phi3 tp2", ["_S(0, 3)"], False), (4, "phi3 tp2-ulysses2", ["S(1)", "_S(0, 3)"], False),
    (4, "phi3 tp2-ring2", ["S(1)", "_S(0, 3)"], False), (4, "phi3 dp_shard2-tp2", ["S(1)", "_S(0, 3)"], False),
    (2, "mixtral tp2", ["_S(1, 2)"], False), (4, "mixtral tp2-ulysses2", ["S(0)", "_S(1, 2)"], False),
    (4, "mixtral tp2-ring2", ["S(0)", "_S(1, 2)"], False), (4, "mixtral dp_shard2-tp2", ["S(0)", "_S(1, 2)"], False),
    (4, "mixtral dp_shard2-ulysses2", ["S(0)", "S(0)"], False),
    (2, "legacy-mixtral tp2", ["_S(1, 2)"], False), (4, "legacy-mixtral tp2-ring2", ["S(0)", "_S(1, 2)"], False),
    (2, "legacy-qwen2_moe tp2", ["_S(1, 2)"], False),
    (2, "flux tp2", ["S(0)"], False), (4, "flux tp2-ulysses2", ["S(1)", "S(0)"], False),
    (4, "flux tp2-ring2", ["S(1)", "S(0)"], False), (4, "flux dp_shard2-tp2", ["S(1)", "S(0)"], False)]])
def test_checkpoints_read_at_each_mesh_compute_as_one_device_and_write_back(world, label, probe, tied):
    """Llama (4 shards and an index), Phi3's fused qkv and gate_up (``_StridedShard``), Mixtral's
    stacked experts with ``ep="cp"`` (which cuts none at tp2, where cp is 1), the per-expert
    folders transformers writes of Mixtral and Qwen2-MoE (stacked and concatenated as read) and a
    diffusers Flux transformer from its component folder:
    pieces bit-equal to the library's one-device read, output within 1e-5 of it, and the files
    ``save_pretrained`` writes (each rank its own) read back by the library bit-exact."""
    results = [r[label] for r in LAUNCHES[world].result()]
    for rank, result in enumerate(results):
        assert result["pieces_differ"] == [] and result["saved_differ"] == [], (rank, result)
        assert result["probe"] == probe and result["tied"] == tied, (rank, result)
        assert result["forward"] <= 1e-5, (rank, result)
        # the token embedding and LM head cut by the vocabulary on tp (last), read piece by piece
        assert all(p[-1] == "S(0)" for p in result["vocab"]) and len(result["vocab"]) == (0 if "flux" in label else 2)
    _each_rank_wrote_its_own_files(results)


@pytest.mark.parametrize("world, mesh", [(2, "tp2"), (4, "tp2-ring2")])
def test_a_per_expert_checkpoint_reads_the_rank_pieces_of_each_expert(world, mesh):
    """A rank reads its pieces of the per-expert tensors, not whole stacked ones: at most what it
    reads of the stacked folder ``save_pretrained`` writes (where a piece of ``gate_up_proj`` cut
    along its rows reads whole experts, each expert's ``w1``, ``w3`` here only its rows), and at
    most its pieces and one rank's share of the rest (a column cut reads whole rows)."""
    for rank, result in enumerate(LAUNCHES[world].result()):
        legacy, stacked = result[f"legacy-mixtral {mesh}"], result[f"mixtral {mesh}"]
        assert legacy["held_bytes"] == stacked["held_bytes"], (rank, legacy, stacked)
        assert legacy["read_bytes"] <= stacked["read_bytes"], (rank, legacy, stacked)
        assert legacy["read_bytes"] < legacy["held_bytes"] + legacy["checkpoint_bytes"] / world, (rank, legacy)


BIG = dict(hidden=1024, intermediate=8192, layers=2, vocab=1000, max_shard_size="100MB")
"""A checkpoint where a whole copy would show (235 MB), 96% of it in what tp cuts, planned in 2 layers."""
SLACK = 64 * 2**20
"""What reading may add to a rank's memory beyond its pieces: the 16 MB read blocks, allocator slack."""


def test_reading_a_rank_pieces_raises_its_peak_rss_by_those_pieces_only():
    for rank, result in enumerate(r["memory"] for r in LAUNCHES[2].result()):
        whole = result["checkpoint_bytes"]
        assert whole > 200e6 and result["held_bytes"] < 0.6 * whole, (rank, result)
        assert result["read_rise"] <= result["held_bytes"] + SLACK and result["read_rise"] < whole, (rank, result)
        assert result["read_bytes"] < result["held_bytes"] + SLACK, (rank, result)


def test_writing_splits_the_bytes_between_ranks_and_gathers_one_tensor_at_a_time():
    """Each rank writes about half the checkpoint; its peak RSS rises by at most the largest
    tensor it gathers (32 MB) + the 16 MB block buffer and slack, far below the whole."""
    for rank, result in enumerate(r["memory"] for r in LAUNCHES[2].result()):
        whole = result["checkpoint_bytes"]
        assert 0.4 * whole < result["written_bytes"] < 0.6 * whole, (rank, result)
        assert result["save_rise"] <= result["largest_bytes"] + SLACK, (rank, result)


@pytest.mark.parametrize("label", ["decorator", "from_pretrained"])
def test_without_example_inputs_the_first_call_plans_and_reads(label):
    for rank, result in enumerate(r["deferred"][label] for r in LAUNCHES[2].result()):
        assert result["meta_before_call"] and result["pieces_differ"] == [], (rank, result)
        assert result["forward"] <= 1e-5 and result["q_rows"] == 32, (rank, result)


@pytest.mark.parametrize("world, label, qkv, fc", [(2, "gpt tp2", ["_S(0, 3)"], ["S(0)"]),
                                                   (4, "gpt dp_shard2-tp2", ["S(1)", "_S(0, 3)"], ["S(1)", "S(0)"])])
def test_plain_module_pieces_equal_parallelize(world, label, qkv, fc):
    for rank, result in enumerate(r[label] for r in LAUNCHES[world].result()):
        assert result == {"pieces_differ": [], "qkv": qkv, "fc": fc}, (rank, result)


def test_an_nn_modulelist_of_experts_cut_by_ep_reads_its_pieces_and_writes_back():
    results = [r["looped experts"] for r in LAUNCHES[4].result()]
    for rank, result in enumerate(results):
        assert result["pieces_differ"] == [] and result["saved_differ"] == [], (rank, result)
        assert result["w1"] == ["S(1)", "S(0)"] and result["forward"] <= 1e-5, (rank, result)
    assert all(r["written"] for r in results), results


def test_dcp_reshards_fused_projections_between_meshes():
    """DCP (torch 2.13) records a DTensor as one block from its first offset: a ``_StridedShard``
    piece failed its overlap check at save and read other rows at load; ``parallelize``'s state
    dict hands it the blocks each piece holds (``pieces.Blocks``)."""
    for rank, result in enumerate(r["dcp"] for r in LAUNCHES[4].result()):
        assert result["saved qkv"] == ["S(1)", "_S(0, 3)"], (rank, result)
        assert result["tp4"] == {"differ": [], "qkv": ["_S(0, 3)"]}, (rank, result)
        assert result["dp_shard2-tp2"] == {"differ": [], "qkv": ["S(1)", "_S(0, 3)"]}, (rank, result)
        assert result["forward"] <= 1e-5, (rank, result)


# --- one process: the files against the safetensors library, and bad input ----------------------

class Small(nn.Module):
    """Tensors of several dtypes and ranks: a 0-dim parameter, an integer and a bool buffer."""

    def __init__(self, dtype=torch.bfloat16):
        super().__init__()
        self.linear = nn.Linear(4, 3).to(dtype)
        self.scale = nn.Parameter(torch.tensor(0.5, dtype=torch.float16))
        self.register_buffer("steps", torch.arange(3))
        self.register_buffer("mask", torch.tensor([True, False]))
        self.register_buffer("cache", torch.zeros(2), persistent=False)


def _save(tensors: dict, folder: str) -> str:
    from safetensors.torch import save_file
    os.makedirs(folder, exist_ok=True)
    save_file(tensors, os.path.join(folder, "model.safetensors"))
    return folder


def _state(model: nn.Module) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_reads_and_writes_what_the_safetensors_library_does(tmp_path):
    from safetensors.torch import load_file

    torch.manual_seed(0)
    source = Small()
    source.steps.copy_(torch.tensor([7, -1, 3]))
    model = load_checkpoint(Small(), _save(_state(source), str(tmp_path / "library")))
    assert _differ(_state(model), _state(source)) == []
    dtensor_par.save_pretrained(model, str(tmp_path / "ours"), max_shard_size=20)
    with open(tmp_path / "ours" / "model.safetensors.index.json") as f:
        files = sorted(set(json.load(f)["weight_map"].values()))
    assert files == [f"model-0000{i}-of-00005.safetensors" for i in range(1, 6)]  # 2+24+2 | 24 | 6 bytes: 5 files
    read = {k: v for name in files for k, v in load_file(str(tmp_path / "ours" / name)).items()}
    assert _differ(read, _state(source)) == []


def test_a_base_model_checkpoint_loads_into_a_model_with_a_head_and_back(tmp_path):
    """Checkpoint keys without the model's ``base_model_prefix`` ("model."), or with it where the
    model has none, as transformers loads them; a tied LM head needs no key of its own."""

    torch.manual_seed(0)
    base = LlamaModel(_llama_config(tie_word_embeddings=True))
    base.save_pretrained(str(tmp_path / "base"))
    head = load_checkpoint(LlamaForCausalLM(_llama_config(tie_word_embeddings=True)), str(tmp_path / "base"))
    assert _differ(_state(head.model), _state(base)) == [] and head.lm_head.weight is head.model.embed_tokens.weight
    head.save_pretrained(str(tmp_path / "head"))
    again = load_checkpoint(LlamaModel(_llama_config(tie_word_embeddings=True)), str(tmp_path / "head"))
    assert _differ(_state(again), _state(base)) == []


def test_not_a_checkpoint_folder_is_named_with_what_was_looked_for(tmp_path, fake_world):

    fake_world(2)
    mesh = dtensor_par.init_mesh(tp=2)
    looked = r"has none of \['model.safetensors', 'model.safetensors.index.json', 'diffusion_pytorch_model.safetensors'"
    with pytest.raises(FileNotFoundError, match=f"{tmp_path}' is not a checkpoint folder: it {looked}"):
        dtensor_par.from_pretrained(LlamaForCausalLM, str(tmp_path), mesh)
    with pytest.raises(FileNotFoundError, match=looked):
        dtensor_par.parallel(tp=2)(LlamaForCausalLM).from_pretrained(str(tmp_path))
    _save({"x": torch.zeros(1)}, str(tmp_path))
    with pytest.raises(FileNotFoundError, match="is not a checkpoint folder: it has no config.json"):
        dtensor_par.from_pretrained(LlamaForCausalLM, str(tmp_path), mesh)
    with pytest.raises(TypeError, match="builds transformers and diffusers models from their config, not Small"):
        dtensor_par.from_pretrained(Small, str(tmp_path), mesh)
    with pytest.raises(ValueError, match="max_shard_size '5 parsecs' is not a size"):
        dtensor_par.save_pretrained(Small(), str(tmp_path / "out"), max_shard_size="5 parsecs")


def test_a_tensor_no_gather_makes_whole_is_refused_before_anything_is_sent(tmp_path, fake_world):
    """A ``Partial`` DTensor (a sum still to take), and one on a mesh that leaves out ranks (a
    pipeline stage's), named with their key and mesh, before any file or message."""
    from torch.distributed.tensor import Partial, Replicate

    fake_world(4)
    mesh = dtensor_par.init_mesh(tp=2, ulysses=2)
    model = nn.Module()
    model.register_buffer("partial", DTensor.from_local(torch.zeros(2), mesh["tp"], [Partial()]))
    with pytest.raises(ValueError, match=r"'partial' \(\[2\]\) is \[Partial\(sum\)\] on mesh dims tp: a Partial sum "
                                         r"is not a value to write"):
        dtensor_par.save_pretrained(model, str(tmp_path / "partial"))
    model.partial = DTensor.from_local(torch.zeros(2), mesh["tp"], [Replicate()])
    with pytest.raises(ValueError, match=r"'partial' lives on a mesh of 2 ranks \(tp\), the world has 4"):
        dtensor_par.save_pretrained(model, str(tmp_path / "stage"))
    assert not os.path.exists(tmp_path / "partial") and not os.path.exists(tmp_path / "stage")


def test_a_shard_file_the_index_names_must_be_there(tmp_path):

    LlamaForCausalLM(_llama_config()).save_pretrained(str(tmp_path), max_shard_size=SHARD)
    os.remove(tmp_path / "model-00003-of-00004.safetensors")
    with pytest.raises(FileNotFoundError, match=r"model.safetensors.index.json names shard files that are not in "
                                                r".*: \['model-00003-of-00004.safetensors'\]"):
        load_checkpoint(LlamaForCausalLM(_llama_config()), str(tmp_path))


def test_every_mismatch_is_named_before_anything_is_read(tmp_path):
    torch.manual_seed(0)
    good = _state(Small())
    bad = {**{k: v for k, v in good.items() if k != "linear.bias"}, "linear.weight": torch.zeros(3, 5),
           "steps": torch.zeros(3), "other": torch.zeros(1)}
    model = Small()
    before = _state(model)
    with pytest.raises(ValueError) as error:
        load_checkpoint(model, _save(bad, str(tmp_path)))
    assert str(error.value) == (
        f"checkpoint {str(tmp_path)!r} does not fit Small:\n"
        "  unexpected key 'other' (not in the model)\n"
        "  'steps' is torch.float32 in the checkpoint, which does not convert to the model's torch.int64\n"
        "  'linear.weight' has shape [3, 5] in the checkpoint, [3, 4] in the model\n"
        "  missing key 'linear.bias'")
    assert _differ(_state(model), before) == []


def _dinov2(**overrides):
    return Dinov2Model(Dinov2Config(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                                    image_size=32, patch_size=8, **overrides)).eval()


def test_a_layout_transformers_renames_is_read_under_the_model_keys(tmp_path):
    """transformers 5 writes Dinov2's attention under its old names (``attention.attention.query``)
    and renames them when loading (``attention.q_proj``): read as the library reads them."""
    logging.getLogger("transformers").setLevel(logging.ERROR)
    torch.manual_seed(0)
    _dinov2().save_pretrained(str(tmp_path))
    assert _checkpoint_keys(str(tmp_path), "attention.attention.query") != []
    model = load_checkpoint(_dinov2(), str(tmp_path))
    assert _differ(_state(model), _state(Dinov2Model.from_pretrained(str(tmp_path)))) == []


def test_a_tensor_transformers_chunks_is_read_stretch_by_stretch(tmp_path, fake_world):
    """Dinov2's SwiGLU checkpoints hold gate and up in one tensor (``mlp.weights_in``), which
    transformers chunks when loading (``Chunk``): each model tensor is read as its stretch of the
    file's, whole and as tp2's pieces (gate and up cut by their rows), bit for bit what
    transformers loads. Before, refused."""
    logging.getLogger("transformers").setLevel(logging.ERROR)
    torch.manual_seed(0)
    _dinov2(use_swiglu_ffn=True).save_pretrained(str(tmp_path))
    assert _checkpoint_keys(str(tmp_path), "mlp.weights_in") != []
    reference = Dinov2Model.from_pretrained(str(tmp_path))
    assert _differ(_state(load_checkpoint(_dinov2(use_swiglu_ffn=True), str(tmp_path))), _state(reference)) == []
    fake_world(2)
    mesh, pixels = dtensor_par.init_mesh(tp=2), torch.randn(1, 3, 32, 32)
    model = dtensor_par.from_pretrained(Dinov2Model, str(tmp_path), mesh, example_inputs=(pixels,))
    theirs = dict(dtensor_par.parallelize(reference, mesh, (pixels,)).named_parameters())
    gate = "encoder.layer.0.mlp.gate_proj.weight"
    assert _placements(theirs[gate]) == ["S(0)"] and _local(theirs[gate]).shape[0] < theirs[gate].shape[0]
    assert [name for name, p in model.named_parameters() if not torch.equal(_local(p), _local(theirs[name]))] == []


def test_a_conversion_that_is_not_read_piece_by_piece_is_refused_naming_its_operation(tmp_path, monkeypatch):
    """A conversion other than a stack, a concatenation or a last chunk (here a transpose in
    place of Dinov2's chunk) is refused naming the operation, the model tensor and the checkpoint
    key, before anything is read."""
    from transformers import conversion_mapping
    from transformers.core_model_loading import Chunk, Transpose

    logging.getLogger("transformers").setLevel(logging.ERROR)
    torch.manual_seed(0)
    _dinov2(use_swiglu_ffn=True).save_pretrained(str(tmp_path))
    mapping = copy.deepcopy(conversion_mapping.get_model_conversion_mapping(_dinov2(use_swiglu_ffn=True)))
    for transform in mapping:
        if getattr(transform, "operations", None) and type(transform.operations[0]) is Chunk:
            transform.operations = [Transpose(dim0=0, dim1=1)]
    monkeypatch.setattr(conversion_mapping, "get_model_conversion_mapping", lambda *_, **__: mapping)
    model = _dinov2(use_swiglu_ffn=True)
    before = _state(model)
    with pytest.raises(ValueError) as error:
        load_checkpoint(model, str(tmp_path))
    layer = "'encoder.layer.0.mlp"
    assert str(error.value) == (
        f"checkpoint {str(tmp_path)!r} is in a layout transformers converts while loading Dinov2Model (its "
        "conversion mapping) by operations that are not read piece by piece: 2 of the model's tensors, first\n"
        f"  {layer}.gate_proj.bias' (from {layer}.weights_in.bias') is made by transformers' Transpose, which is "
        "not read piece by piece\n"
        f"  {layer}.gate_proj.weight' (from {layer}.weights_in.weight') is made by transformers' Transpose, which is "
        "not read piece by piece\n"
        "Read it once on one device with transformers' from_pretrained and write it with dtensor_par.save_pretrained, "
        "which writes the model's own keys")
    assert _differ(_state(model), before) == []


def test_a_per_expert_checkpoint_missing_an_expert_is_named_with_the_stacked_shape(tmp_path):
    from safetensors.torch import load_file

    logging.getLogger("transformers").setLevel(logging.ERROR)
    torch.manual_seed(0)
    _mixtral().save_pretrained(str(tmp_path))
    tensors = load_file(str(tmp_path / "model.safetensors"))
    _save({k: v for k, v in tensors.items() if ".experts.3." not in k}, str(tmp_path))
    with pytest.raises(ValueError) as error:
        load_checkpoint(_mixtral(), str(tmp_path))
    assert str(error.value) == (
        f"checkpoint {str(tmp_path)!r} does not fit MixtralForCausalLM:\n"
        "  'model.layers.0.mlp.experts.gate_up_proj' has shape [3, 256, 64] in the checkpoint, [4, 256, 64] in the "
        "model\n"
        "  'model.layers.0.mlp.experts.down_proj' has shape [3, 64, 128] in the checkpoint, [4, 64, 128] in the model")


def _rewrite_header(file: str, edit) -> None:
    with open(file, "rb") as f:
        data = f.read()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + length])
    edit(header)
    text = json.dumps(header).encode()
    with open(file, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + data[8 + length:])


def test_an_unknown_dtype_and_a_truncated_file_are_named(tmp_path):
    folder = _save(_state(Small()), str(tmp_path))
    file = os.path.join(folder, "model.safetensors")
    _rewrite_header(file, lambda header: header["linear.weight"].update(dtype="F4"))
    with pytest.raises(ValueError, match=r"tensor 'linear.weight' has safetensors dtype 'F4', which torch does not "
                                         r"read \(known: F64, F32"):
        load_checkpoint(Small(), folder)
    _save(_state(Small()), folder)
    with open(file, "r+b") as f:
        f.truncate(os.path.getsize(file) - 1)
    with pytest.raises(ValueError, match=r"tensor '\w+' \(\w+, shape \(.*\): \d+ bytes\) has bytes \[\d+, \d+\) after "
                                         r"the header, in a file of \d+ data bytes"):
        load_checkpoint(Small(), folder)


def test_torch_dtype_casts_the_parameters_not_the_rotary_frequencies(tmp_path, fake_world):
    """``torch_dtype``: parameters built in it (transformers' ``dtype``) and read converted from the
    float32 files; the rotary frequencies stay the float32 the constructor computes."""
    torch.manual_seed(0)
    LlamaForCausalLM(_llama_config()).save_pretrained(str(tmp_path), max_shard_size=SHARD)
    reference = LlamaForCausalLM.from_pretrained(str(tmp_path), dtype=torch.bfloat16)
    fake_world(2)
    mesh, ids = dtensor_par.init_mesh(tp=2), _ids()
    model = dtensor_par.from_pretrained(LlamaForCausalLM, str(tmp_path), mesh, example_inputs=(ids,),
                                        example_kwargs=KW, torch_dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32
    theirs = dict(dtensor_par.parallelize(reference, mesh, (ids,), example_kwargs=KW).named_parameters())
    assert [name for name, p in model.named_parameters() if not torch.equal(_local(p), _local(theirs[name]))] == []


def test_torch_dtype_keeps_the_modules_the_library_keeps_in_float32(tmp_path, fake_world):
    """The libraries' ``_keep_in_fp32_modules`` stay float32 as their own ``from_pretrained`` keeps
    them (before: every parameter cast): T5's ``wo`` under float16, as transformers loads it; Wan's
    time embedder, norm2 and scale-shift tables under bfloat16, as diffusers' loading does (its
    ``from_pretrained`` needs accelerate for Wan), Wan's rotary tables the constructor's float32."""
    from diffusers import WanTransformer3DModel
    from transformers import T5Model

    from dtensor_par._testing import real_models

    torch.manual_seed(0)
    real_models.t5()[0].save_pretrained(str(tmp_path / "t5"))
    real_models.wan()[0].save_pretrained(str(tmp_path / "wan"))
    fake_world(2)
    mesh = dtensor_par.init_mesh(tp=2)
    t5 = dtensor_par.from_pretrained(T5Model, str(tmp_path / "t5"), mesh, torch_dtype=torch.float16)
    theirs = {k: t.dtype for k, t in T5Model.from_pretrained(str(tmp_path / "t5"), dtype=torch.float16).state_dict().items()}
    assert {k: t.dtype for k, t in t5.state_dict().items()} == theirs
    assert t5.encoder.block[0].layer[1].DenseReluDense.wo.weight.dtype == torch.float32
    wan = dtensor_par.from_pretrained(WanTransformer3DModel, str(tmp_path / "wan"), mesh, torch_dtype=torch.bfloat16)
    assert sorted(k for k, t in wan.state_dict().items() if t.dtype != torch.bfloat16) == [
        "blocks.0.norm2.bias", "blocks.0.norm2.weight", "blocks.0.scale_shift_table",
        "condition_embedder.time_embedder.linear_1.bias", "condition_embedder.time_embedder.linear_1.weight",
        "condition_embedder.time_embedder.linear_2.bias", "condition_embedder.time_embedder.linear_2.weight",
        "scale_shift_table"]
    assert {b.dtype for b in wan.rope.buffers()} == {torch.float32}
