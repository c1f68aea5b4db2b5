"""``python -m dtensor_par explain module.py:factory --tp 8`` (or a transformers or diffusers
checkpoint folder: ``explain ./llama-70b --tp 8 --seq 4096``, ``explain ./flux --tp 8``): the plan,
without hardware;
``python -m dtensor_par choose module.py:factory --world 64 --machine trn2-48xl``: every mesh
of 64 ranks ranked by predicted step time there, and why the others are refused;
``python -m dtensor_par calibrate --world 4 --out profile.json``: a profile of this machine."""

from __future__ import annotations

import argparse
import dataclasses
import gc
import importlib
import importlib.util
import os
import sys

import torch

from .calibrate import calibrate, describe
from .choose import choose_mesh
from .config import ParallelConfig
from .explain import explain
from .machines import MACHINES
from .mesh import MESH_DIMS, PLAN_DIMS_DECLARED
from .model_folders import Example, Loaded, load_folder


def load_factory(spec: str):
    """``path/to/module.py:factory`` or ``package.module:factory`` -> the factory callable."""
    if ":" not in spec:
        raise SystemExit(f"explain: expected MODULE:FACTORY, got {spec!r}")
    module_name, factory_name = spec.rsplit(":", 1)
    if module_name.endswith(".py"):
        if not os.path.isfile(module_name):
            raise SystemExit(f"explain: no file {module_name!r}")
        module_spec = importlib.util.spec_from_file_location(os.path.basename(module_name)[:-3], module_name)
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(module_name)
        except ImportError as e:
            raise SystemExit(f"explain: cannot import {module_name!r}: {e}") from None
    factory = getattr(module, factory_name, None)
    if not callable(factory):
        raise SystemExit(f"explain: {module_name!r} has no factory {factory_name!r}")
    return factory


def load_model(spec: str, example: Example) -> Loaded:
    """``MODULE:FACTORY``'s model and example inputs, or a checkpoint folder's (``model_folders``)."""
    if os.path.isdir(spec) or spec.endswith(".json"):
        try:
            return load_folder(spec, example)
        except ValueError as e:
            raise SystemExit(f"explain: {e}") from None
    model, example_inputs = load_factory(spec)()
    return Loaded(model, tuple(example_inputs), {}, "")


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) == 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return int(text)


def _dtype(name: str):
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise argparse.ArgumentTypeError(f"{name!r} is not a torch dtype (bfloat16, float16, float32)")
    return dtype


def add_option_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per option that changes the plan, and ``--dump-dir``: read from ``ParallelConfig``'s fields."""
    fields = {f.name: f for f in dataclasses.fields(ParallelConfig)}
    for f in [*ParallelConfig.plan_options(), fields["dump_dir"]]:
        flag, default = "--" + f.name.replace("_", "-"), getattr(ParallelConfig(), f.name)
        if isinstance(default, bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=f.metadata["help"])
        elif f.name == "fsdp_dims":
            parser.add_argument(flag, type=lambda names: tuple(n for n in names.split(",") if n), default=default,
                                help=f.metadata["help"] + " (comma-separated)")
        elif "torch.dtype" in str(f.type):
            parser.add_argument(flag, type=_dtype, default=default, help=f.metadata["help"] + " (a torch dtype's name)")
        else:
            shown = f" (default: {default})" if default is not None else ""
            choices = f.metadata["choices"] and [c for c in f.metadata["choices"] if c is not None]  # None: left out
            parser.add_argument(flag, type=type(default) if default is not None else str, default=default,
                                choices=choices, help=f.metadata["help"] + shown)


MODEL_HELP = ("MODULE:FACTORY (FACTORY() returns (model, example_inputs)); or a transformers or diffusers "
              "checkpoint folder or its config.json, or a diffusers pipeline's folder (its transformer, else its "
              "unet): built from the config on the meta device, with example inputs (--batch-size, --seq; "
              "--latent-height, --latent-width, --latent-frames, --text-tokens)")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m dtensor_par")
    commands = parser.add_subparsers(dest="command", required=True)
    ex = commands.add_parser("explain", help="plan a model at any mesh size and print the plan")
    ex.add_argument("factory", help=MODEL_HELP)
    for plan_dim in PLAN_DIMS_DECLARED:
        for dim in plan_dim.mesh_dims:
            ex.add_argument(f"--{dim.replace('_', '-')}", type=int, default=1,
                            help=f"size of mesh dim {dim!r}, a part of {plan_dim.name}: {plan_dim.help}")
    ex.add_argument("--order", help="the mesh dims, comma-separated, the last fastest (default: by device type)")
    ex.add_argument("--device-type", default="cuda")
    ex.add_argument("--svg", help="write the mesh picture to this file")
    ex.add_argument("--parallelized", action="store_true",
                    help="report parameters as dtensor_par.parallelize holds them (tp and FSDP pieces), not whole")
    ex.add_argument("--machine", help="also predict the step time on this machine profile (a name or a JSON path)")
    ch = commands.add_parser("choose", help="rank every mesh of a world size by predicted step time on a machine")
    ch.add_argument("factory", help=MODEL_HELP)
    ch.add_argument("--world", type=int, required=True, help="the number of ranks")
    ch.add_argument("--machine", required=True, help=f"a profile's name ({', '.join(MACHINES)}) or a JSON path")
    ch.add_argument("--top", type=int, default=5, help="how many legal meshes to list (default: 5)")
    cal = commands.add_parser("calibrate", help="measure this machine into a profile --machine accepts")
    cal.add_argument("--world", type=int, required=True, help="ranks to measure with (torchrun's, or spawned here)")
    cal.add_argument("--out", required=True, help="where to write the profile (JSON)")
    cal.add_argument("--reps", type=int, default=10, help="timed repetitions per measurement (median)")
    for sub in (ex, ch):
        sub.add_argument("--inference", action="store_true", help="predict a forward, not a training step")
        sub.add_argument("--seq", type=_positive, default=4096,
                         help="a transformers checkpoint's example input tokens (default: 4096)")
        sub.add_argument("--batch-size", type=_positive, default=1, help="a checkpoint's example samples (default: 1)")
        sub.add_argument("--latent-height", type=_positive, help="a diffusers denoiser's latent height: the image's "
                         "over the VAE's scale, 8 (default: the config's sample_size, else 1024 pixels' 128; Wan: 60)")
        sub.add_argument("--latent-width", type=_positive, help="a diffusers denoiser's latent width (default: as the "
                         "height; Wan: 104)")
        sub.add_argument("--latent-frames", type=_positive, help="a video denoiser's latent frames (default: Wan: 21, "
                         "81 frames')")
        sub.add_argument("--text-tokens", type=_positive, help="a diffusers denoiser's prompt tokens (default: its "
                         "pipeline's: Flux 512, SD3 333, Wan 512, UNet 77)")
        add_option_flags(sub)
    return parser


def main(argv=None) -> int:
    args = vars(_parser().parse_args(argv))
    if args["command"] == "calibrate":
        profile = calibrate(args["world"], args["out"], reps=args["reps"])
        if int(os.environ.get("RANK", 0)) == 0:  # under torchrun, the rank that wrote it
            print(describe(profile) + f"\nwritten to {args['out']}")
        return 0
    gc.freeze()  # what the imports made lives until exit: no collection need walk it again (~0.2 s)
    example = Example(batch=args["batch_size"], seq=args["seq"], latent_height=args["latent_height"],
                      latent_width=args["latent_width"], latent_frames=args["latent_frames"],
                      text_tokens=args["text_tokens"])
    loaded = load_model(args["factory"], example)
    if loaded.description:
        print(loaded.description)
    options = {f.name: args[f.name] for f in dataclasses.fields(ParallelConfig) if f.name in args}
    training = not args["inference"]
    try:
        if args["command"] == "choose":
            print(choose_mesh(loaded.model, loaded.args, args["world"], machine=args["machine"], training=training,
                              example_kwargs=loaded.kwargs, top=args["top"], **options))
            return 0
        order = tuple(args["order"].split(",")) if args["order"] else None
        report = explain(loaded.model, loaded.args, example_kwargs=loaded.kwargs, **{d: args[d] for d in MESH_DIMS},
                         order=order, device_type=args["device_type"], parallelized=args["parallelized"] or None,
                         machine=args["machine"], training=training, **options)
    except (ValueError, NotImplementedError, TypeError) as e:
        print(e, file=sys.stderr)
        return 2
    print(report)
    if args["svg"]:
        with open(args["svg"], "w") as f:
            f.write(report.svg())
    return 0


if __name__ == "__main__":
    sys.exit(main())
