"""``python -m dtensor_par explain | choose`` on a diffusers checkpoint folder without weights: a
denoiser component's, or a pipeline's (its transformer, else its unet), built from the config on
the meta device and fed the inputs its config implies. In process, on the test's own thread."""

from __future__ import annotations

import json

import pytest

from dtensor_par._testing import real_models

pytest.importorskip("diffusers", reason="the models extra is not installed")

FLUX = {"_class_name": "FluxTransformer2DModel", "patch_size": 1, "in_channels": 16, "num_layers": 1,
        "num_single_layers": 1, "attention_head_dim": 16, "num_attention_heads": 4, "joint_attention_dim": 32,
        "pooled_projection_dim": 32, "axes_dims_rope": [4, 6, 6]}
"""``real_models.flux``'s config."""
FLUX_SIZE = ["--latent-height", "8", "--latent-width", "16", "--text-tokens", "16"]
"""``real_models.flux``'s inputs: 32 image tokens (8 x 16 latent pixels packed 2 x 2), 16 of text."""
UNET = {"_class_name": "UNet2DConditionModel", "sample_size": 16, "in_channels": 4, "out_channels": 4,
        "layers_per_block": 1, "block_out_channels": [32, 64],
        "down_block_types": ["CrossAttnDownBlock2D", "DownBlock2D"],
        "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D"], "cross_attention_dim": 32, "attention_head_dim": 8,
        "norm_num_groups": 8}
SD3 = {"_class_name": "SD3Transformer2DModel", "sample_size": 8, "patch_size": 2, "in_channels": 4, "num_layers": 2,
       "attention_head_dim": 8, "num_attention_heads": 4, "joint_attention_dim": 16, "caption_projection_dim": 32,
       "pooled_projection_dim": 16, "out_channels": 4, "pos_embed_max_size": 16}
WAN = {"_class_name": "WanTransformer3DModel", "patch_size": [1, 2, 2], "num_attention_heads": 4,
       "attention_head_dim": 8, "in_channels": 4, "out_channels": 4, "text_dim": 16, "freq_dim": 16, "ffn_dim": 64,
       "num_layers": 1, "rope_max_seq_len": 32}


def _write(path, content: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(content))


def _pipeline(root, denoiser: str, config: dict) -> None:
    """A pipeline's folder: its model_index.json and its denoiser's config (no weights)."""
    _write(root / "model_index.json", {"_class_name": "SomePipeline", "vae": ["diffusers", "AutoencoderKL"],
                                       "text_encoder": ["transformers", "CLIPTextModel"],
                                       denoiser: ["diffusers", config["_class_name"]]})
    _write(root / denoiser / "config.json", config)


def test_a_flux_component_folder_plans_as_the_model_built_on_the_cpu(tmp_path, capsys):
    """Built on meta, at ``real_models.flux``'s size, the plan is the model's own: every line of
    the report (sites, placements, collectives and their bytes) equal."""
    from dtensor_par.__main__ import main

    _write(tmp_path / "transformer" / "config.json", FLUX)
    expected = str(real_models.explained("flux", (("tp", 2), ("ulysses", 2))))
    assert "attention0: attention hybrid_attention, 4 heads" in expected and "single_transformer_blocks.0" in expected
    assert main(["explain", str(tmp_path / "transformer"), "--tp", "2", "--ulysses", "2", *FLUX_SIZE]) == 0
    described, report = capsys.readouterr().out.split("\n", 1)
    assert described == (f"{tmp_path / 'transformer' / 'config.json'}: FluxTransformer2DModel on the meta device, "
                         "hidden_states 1x32x16, encoder_hidden_states 1x16x32, pooled_projections 1x32, "
                         "img_ids 32x3, txt_ids 16x3")
    assert report == expected + "\n"


def test_a_pipeline_folder_plans_its_transformer_at_its_pipelines_default_size(tmp_path, capsys):
    """FLUX.1-dev's pipeline: its transformer picked and said so, fed a 1024 x 1024 image's 4096
    tokens, 512 of text and the guidance scale (``guidance_embeds``), whose embedder is a site."""
    from dtensor_par.__main__ import main

    _pipeline(tmp_path, "transformer", {**FLUX, "guidance_embeds": True})
    assert main(["explain", str(tmp_path), "--tp", "2", "--ulysses", "2"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == (f"{tmp_path / 'transformer' / 'config.json'} (the pipeline's denoiser, "
                                   "'transformer'): FluxTransformer2DModel on the meta device, "
                                   "hidden_states 1x4096x16, encoder_hidden_states 1x512x32, pooled_projections 1x32, "
                                   "img_ids 4096x3, txt_ids 512x3"), out
    assert "graph 0: 7 sites;" in out and "0 fallback gathers" in out, out
    assert "mlp1: mlp up=['time_text_embed.guidance_embedder.linear_1']" in out, out


@pytest.mark.parametrize("layout, config, flags, described, sites", [
    ("pipeline", UNET, [], "(the pipeline's denoiser, 'unet'): UNet2DConditionModel on the meta device, "
                           "sample 1x4x16x16, encoder_hidden_states 1x77x32", 21),
    ("component", SD3, ["--text-tokens", "8"], ": SD3Transformer2DModel on the meta device, hidden_states 1x4x8x8, "
                                               "encoder_hidden_states 1x8x16, pooled_projections 1x16", 7),
    ("component", WAN, ["--latent-frames", "2", "--latent-height", "8", "--latent-width", "12", "--text-tokens", "8"],
     ": WanTransformer3DModel on the meta device, hidden_states 1x4x2x8x12, encoder_hidden_states 1x8x16", 5),
], ids=["unet-pipeline", "sd3", "wan"])
def test_other_denoisers_plan_from_their_folders(tmp_path, capsys, layout, config, flags, described, sites):
    """A UNet pipeline (no transformer: its unet picked), SD3's and Wan's components, each at
    the size asked or its config's ``sample_size``: every block sharded, nothing gathered."""
    from dtensor_par.__main__ import main

    if layout == "pipeline":
        _pipeline(tmp_path, "unet", config)
        folder = tmp_path / "unet"
    else:
        _write(tmp_path / "config.json", config)
        folder = tmp_path
    assert main(["explain", str(tmp_path if layout == "pipeline" else folder), "--tp", "2", "--ulysses", "2",
                 *flags]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == f"{folder / 'config.json'}" + (" " if layout == "pipeline" else "") + described
    assert f"graph 0: {sites} sites;" in out and "0 fallback gathers" in out, out


def test_choose_ranks_meshes_for_a_flux_components_config(tmp_path, capsys):
    from dtensor_par.__main__ import main

    _write(tmp_path / "config.json", FLUX)
    assert main(["choose", str(tmp_path / "config.json"), "--world", "2", "--machine", "h100-sxm-8", *FLUX_SIZE]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].endswith("FluxTransformer2DModel on the meta device, hidden_states 1x32x16, "
                                        "encoder_hidden_states 1x16x32, pooled_projections 1x32, img_ids 32x3, "
                                        "txt_ids 16x3"), out
    assert "meshes of 2 ranks on h100-sxm-8, by predicted training step time:" in out, out


@pytest.mark.parametrize("files, flags, message", [  # a pipeline saves a component it lacks as [null, null]
    ({}, [], "is neither MODULE:FACTORY nor a checkpoint folder with a config.json .or a diffusers pipeline's"),
    ({"model_index.json": {"_class_name": "SomePipeline", "vae": ["diffusers", "AutoencoderKL"],
                           "text_encoder": ["transformers", "CLIPTextModel"], "transformer": [None, None]}}, [],
     "model_index.json has no 'transformer' or 'unet' component to plan .its components: vae, text_encoder."),
    ({"config.json": {"_class_name": "AutoencoderKL"}}, [],
     "no example inputs are known for the diffusers class AutoencoderKL: supported are FluxTransformer2DModel, "
     "SD3Transformer2DModel, WanTransformer3DModel, UNet2DConditionModel; write MODULE:FACTORY"),
    ({"config.json": {"hidden_size": 64}}, [], "config.json is neither a transformers config .'model_type'. nor a "
                                               "diffusers one .'_class_name'."),
    ({"config.json": FLUX}, ["--latent-height", "7"], "Flux's latent height 7 is not divisible by 2"),
    ({"config.json": FLUX}, ["--latent-frames", "3"],
     "FluxTransformer2DModel makes images: --latent-frames is for a video model"),
    ({"config.json": SD3}, ["--latent-height", "64"],
     "SD3's latent height 64 is over its position table: 16 patches of 2"),
    ({"config.json": {**UNET, "class_embed_type": "timestep"}}, [],
     "UNet2DConditionModel: only text conditioning is known .and SDXL's text_time.: this one has "
     "class_embed_type='timestep'"),
], ids=["no-config", "no-denoiser", "unknown-class", "no-class", "odd-latent", "frames-of-an-image",
        "over-positions", "class-conditioned-unet"])
def test_a_folder_it_cannot_plan_is_refused_saying_why(tmp_path, files, flags, message):
    from dtensor_par.__main__ import main

    for name, content in files.items():
        _write(tmp_path / name, content)
    with pytest.raises(SystemExit, match="explain: .*" + message):
        main(["explain", str(tmp_path), "--tp", "2", *flags])
