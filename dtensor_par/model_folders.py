"""A checkpoint folder -> its model, built from its config on the meta device, and example inputs:
what ``explain`` and ``choose`` plan needs no weights, so a model of any size costs no memory.

A transformers folder gets example input ids. A diffusers denoiser (a component folder, or a
pipeline's root whose ``transformer`` or ``unet`` it picks) gets the inputs its pipeline feeds it
at each step, derived from its config: latents, the text encoders' embeddings, a timestep and
whatever else its forward asks for. The input builders also make the test suite's diffusers
inputs, with real tensors outside the meta device: one way to feed each class.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Callable

import torch


@dataclasses.dataclass(frozen=True)
class Example:
    """The size of an example input: ``batch`` x ``seq`` input ids of a transformers model; a
    diffusers denoiser's latent and text, ``None``: its class's default (``DENOISERS``)."""
    batch: int = 1
    seq: int = 4096
    latent_height: int | None = None
    latent_width: int | None = None
    latent_frames: int | None = None
    text_tokens: int | None = None


@dataclasses.dataclass(frozen=True)
class Loaded:
    """A folder's model, its example inputs, and a line saying what was built at what size."""
    model: torch.nn.Module
    args: tuple
    kwargs: dict
    description: str


def flux_image_ids(rows: int, cols: int) -> torch.Tensor:
    """Flux's rotary positions of the image tokens: (0, row, column) of each packed latent patch."""
    ids = torch.zeros(rows * cols, 3)
    ids[:, 1], ids[:, 2] = torch.arange(rows * cols) // cols, torch.arange(rows * cols) % cols
    return ids


def _divisible(what: str, size: int, by: int) -> None:
    if size % by:
        raise ValueError(f"{what} {size} is not divisible by {by}")


def flux_inputs(config, batch: int, frames, height: int, width: int, text_tokens: int) -> dict:
    """Flux's pipeline packs each 2 x 2 patch of the latent into one token (``in_channels`` is 4
    latent channels' worth), positions them by ``img_ids``, and feeds T5's tokens and CLIP's
    pooled embedding; a guidance-distilled model (``guidance_embeds``) is given the guidance scale."""
    _divisible("Flux's latent height", height, 2)
    _divisible("Flux's latent width", width, 2)
    rows, cols = height // 2, width // 2
    inputs = {"hidden_states": torch.randn(batch, rows * cols, config.in_channels),
              "encoder_hidden_states": torch.randn(batch, text_tokens, config.joint_attention_dim),
              "pooled_projections": torch.randn(batch, config.pooled_projection_dim),
              "timestep": torch.full((batch,), 0.5), "img_ids": flux_image_ids(rows, cols),
              "txt_ids": torch.zeros(text_tokens, 3), "return_dict": False}
    if config.guidance_embeds:
        inputs["guidance"] = torch.full((batch,), 3.5)
    return inputs


def sd3_inputs(config, batch: int, frames, height: int, width: int, text_tokens: int) -> dict:
    """SD3's latent is patched inside the model, its positions cropped from a table of
    ``pos_embed_max_size`` patches a side; the text is CLIP's and T5's tokens side by side."""
    for side, size in (("height", height), ("width", width)):
        _divisible(f"SD3's latent {side}", size, config.patch_size)
        if config.pos_embed_max_size and size // config.patch_size > config.pos_embed_max_size:
            raise ValueError(f"SD3's latent {side} {size} is over its position table: {config.pos_embed_max_size} "
                             f"patches of {config.patch_size}")
    return {"hidden_states": torch.randn(batch, config.in_channels, height, width),
            "encoder_hidden_states": torch.randn(batch, text_tokens, config.joint_attention_dim),
            "pooled_projections": torch.randn(batch, config.pooled_projection_dim),
            "timestep": torch.full((batch,), 500.0), "return_dict": False}


def wan_inputs(config, batch: int, frames: int, height: int, width: int, text_tokens: int) -> dict:
    """Wan's video latent (frames, height, width) is patched inside the model; image-to-video
    models (``image_dim``) also attend to CLIP's 257 image tokens."""
    for what, size, patch in zip(("frames", "height", "width"), (frames, height, width), config.patch_size):
        _divisible(f"Wan's latent {what}", size, patch)
    inputs = {"hidden_states": torch.randn(batch, config.in_channels, frames, height, width),
              "timestep": torch.full((batch,), 500.0),
              "encoder_hidden_states": torch.randn(batch, text_tokens, config.text_dim), "return_dict": False}
    if config.image_dim is not None:
        inputs["encoder_hidden_states_image"] = torch.randn(batch, 257, config.image_dim)
    return inputs


def unet_inputs(config, batch: int, frames, height: int, width: int, text_tokens: int) -> dict:
    """Stable Diffusion's UNet cross-attends to CLIP's tokens; SDXL's (``addition_embed_type``
    ``text_time``) also takes the pooled text embedding and 6 size and crop numbers."""
    if config.class_embed_type is not None or config.encoder_hid_dim_type is not None \
            or config.addition_embed_type not in (None, "text_time"):
        raise ValueError("UNet2DConditionModel: only text conditioning is known (and SDXL's text_time): this one has "
                         f"class_embed_type={config.class_embed_type!r}, encoder_hid_dim_type="
                         f"{config.encoder_hid_dim_type!r}, addition_embed_type={config.addition_embed_type!r}")
    if not isinstance(config.cross_attention_dim, int):
        raise ValueError(f"UNet2DConditionModel: a cross_attention_dim per block ({config.cross_attention_dim}) "
                         "is not known")
    inputs = {"sample": torch.randn(batch, config.in_channels, height, width), "timestep": torch.full((batch,), 500.0),
              "encoder_hidden_states": torch.randn(batch, text_tokens, config.cross_attention_dim),
              "return_dict": False}
    if config.addition_embed_type == "text_time":
        pooled = config.projection_class_embeddings_input_dim - 6 * config.addition_time_embed_dim
        inputs["added_cond_kwargs"] = {"text_embeds": torch.randn(batch, pooled), "time_ids": torch.randn(batch, 6)}
    return inputs


@dataclasses.dataclass(frozen=True)
class Denoiser:
    """How to feed a diffusers class: ``inputs(config, batch, frames, height, width, text_tokens)``
    and its pipeline's default sizes, in latent pixels (the image's / the VAE's 8)."""
    inputs: Callable[..., dict]
    text_tokens: int
    latent: tuple[int, int]  # (height, width) where the config has no sample_size
    frames: int | None = None  # a video's latent frames


DENOISERS = {
    "FluxTransformer2DModel": Denoiser(flux_inputs, text_tokens=512, latent=(128, 128)),
    "SD3Transformer2DModel": Denoiser(sd3_inputs, text_tokens=333, latent=(128, 128)),  # CLIP's 77 + T5's 256
    "WanTransformer3DModel": Denoiser(wan_inputs, text_tokens=512, latent=(60, 104), frames=21),  # 480 x 832, 81
    "UNet2DConditionModel": Denoiser(unet_inputs, text_tokens=77, latent=(64, 64)),
}


def _denoiser(name: str) -> Denoiser:
    if name not in DENOISERS:
        raise ValueError(f"no example inputs are known for the diffusers class {name}: supported are "
                         f"{', '.join(DENOISERS)}; write MODULE:FACTORY returning (model, example_inputs)")
    return DENOISERS[name]


def denoiser_inputs(model, example: Example = Example()) -> dict:
    """The keyword inputs of a diffusers denoiser at ``example``'s size (the class's defaults, or
    its config's ``sample_size``, where it says none), on the current default device."""
    name, config = type(model).__name__, model.config
    denoiser = _denoiser(name)
    sample = getattr(config, "sample_size", None)
    height, width = (sample, sample) if isinstance(sample, int) else denoiser.latent
    if denoiser.frames is None and example.latent_frames is not None:
        raise ValueError(f"{name} makes images: --latent-frames is for a video model")
    return denoiser.inputs(config, example.batch, example.latent_frames or denoiser.frames,
                           example.latent_height or height, example.latent_width or width,
                           example.text_tokens or denoiser.text_tokens)


def _json(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def _transformers_model(config_file: str, source: str, example: Example) -> Loaded:
    """In the config's dtype, with ``batch`` x ``seq`` input ids."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(os.path.dirname(config_file) or ".")
    config.use_cache = False  # a cache is generate's; its empty tensors are not the model's
    architecture = (config.architectures or [None])[0]
    model_cls = getattr(transformers, architecture, None) if architecture else None
    with torch.device("meta"):
        model = model_cls(config) if model_cls else transformers.AutoModelForCausalLM.from_config(config)
        ids = torch.randint(0, config.vocab_size, (example.batch, example.seq))
    dtype = getattr(config, "dtype", None)
    model = model.to(dtype) if isinstance(dtype, torch.dtype) else model
    return Loaded(model, (ids,), {}, f"{source}: {type(model).__name__} on the meta device, "
                                     f"input ids {example.batch} x {example.seq}")


def _diffusers_model(raw: dict, source: str, example: Example) -> Loaded:
    """In float32 (a diffusers config names no dtype), fed ``denoiser_inputs``."""
    name = raw["_class_name"]
    _denoiser(name)  # before building it
    import diffusers

    with torch.device("meta"):
        model = getattr(diffusers, name).from_config(raw)
        kwargs = denoiser_inputs(model, example)
    sizes = {k: tuple(v.shape) for k, v in kwargs.items() if isinstance(v, torch.Tensor) and v.dim() > 1}
    shown = ", ".join(f"{k} {'x'.join(map(str, s))}" for k, s in sizes.items())
    return Loaded(model, (), kwargs, f"{source}: {name} on the meta device, {shown}")


def _denoiser_of_pipeline(index_file: str) -> str:
    """A pipeline's ``transformer`` component, else its ``unet``: the model each step runs."""
    components = [k for k, v in _json(index_file).items()
                  if not k.startswith("_") and isinstance(v, list) and any(v)]  # [null, null]: left out
    picked = next((c for c in ("transformer", "unet") if c in components), None)
    if picked is None:
        raise ValueError(f"{index_file} has no 'transformer' or 'unet' component to plan (its components: "
                         f"{', '.join(components) or 'none'})")
    return picked


def load_folder(path: str, example: Example) -> Loaded:
    """A transformers or diffusers checkpoint folder, its ``config.json``, or a diffusers pipeline's
    folder (``model_index.json``: its denoiser, named in the description)."""
    picked = ""
    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "config.json")) \
            and os.path.isfile(os.path.join(path, "model_index.json")):
        component = _denoiser_of_pipeline(os.path.join(path, "model_index.json"))
        path, picked = os.path.join(path, component), f" (the pipeline's denoiser, '{component}')"
    config_file = path if os.path.isfile(path) else os.path.join(path, "config.json")
    if not os.path.isfile(config_file):
        raise ValueError(f"{path!r} is neither MODULE:FACTORY nor a checkpoint folder with a config.json "
                         f"(or a diffusers pipeline's with a model_index.json)")
    raw = _json(config_file)
    if "_class_name" in raw:
        return _diffusers_model(raw, config_file + picked, example)
    if "model_type" in raw:
        return _transformers_model(config_file, config_file + picked, example)
    raise ValueError(f"{config_file} is neither a transformers config ('model_type') nor a diffusers one "
                     f"('_class_name')")
