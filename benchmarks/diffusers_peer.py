"""Ours against diffusers' own parallelism on a diffusers transformer (Flux), side by side.

    python -m benchmarks.diffusers_peer [--inner aot_eager] [--reps 7] [--json diffusers_peer.json]

(``python -m benchmarks.side_by_side`` runs it too, as its last section.)

On 2 gloo ranks, one thread each, the same weights and inputs everywhere (``models.flux``: one
joint and one single-stream block, 8 heads x 32, 1024 image + 128 text tokens, fp32), forward
(no_grad) and training step (mean-square loss, backward, AdamW), medians of ``--reps``
repetitions alternated between the variants, each timed on its slowest rank:

- one device: ``torch.compile(backend=inner)``, eager too (diffusers' own runs eager);
- diffusers' ``enable_parallelism`` with ``ContextParallelConfig(ulysses_degree=2)`` and with
  ``TensorParallelConfig(tp_degree=2)`` (``parallelize_module`` over the model's ``_tp_plan``),
  each eager and compiled with ``inner``. Two changes let it run on CPU: diffusers picks a device
  with ``rank % torch.accelerator.device_count()``, 0 on CPU, so it is called with a count of 1;
  its tensor parallelism refuses a CPU mesh by a device-type check alone, which is let pass;
- ours: ``parallelize`` + ``hybrid_parallel(inner_backend=inner)`` at ulysses2 and at tp2, the
  parameters whole on every cp rank (``fsdp_dims=()``) as diffusers holds them.

Parallel efficiency: one device's best (compiled) time / (2 x the variant's). What fails is recorded.
"""

from __future__ import annotations

import argparse
import copy
import functools
import importlib.util
import json
import statistics
import traceback
from collections import defaultdict
from unittest import mock

import torch

import dtensor_par
from benchmarks.models import WithLoss, flux, ours
from benchmarks.report import failure
from benchmarks.timing import adamw, slowest, timed
from dtensor_par._testing.harness import run_ranks


def _diffusers(model, config, inner: str | None):
    """``model`` (a copy) under diffusers' ``enable_parallelism(config=config)``, with its loss;
    compiled with ``inner`` unless None. Its tensor parallelism (``parallelize_module`` over the
    model's ``_tp_plan``) refuses a CPU mesh by a device-type check alone: it is let run."""
    from diffusers.hooks import tensor_parallel

    parallel = copy.deepcopy(model)
    with mock.patch.object(torch.accelerator, "device_count", lambda: 1), \
            mock.patch.object(tensor_parallel, "_SUPPORTED_TP_DEVICES", (*tensor_parallel._SUPPORTED_TP_DEVICES, "cpu")):
        parallel.enable_parallelism(config=config)
    with_loss = WithLoss(parallel)
    return with_loss, (torch.compile(with_loss, backend=inner) if inner else with_loss)


def variants(model, kwargs, inner: str) -> dict:
    """label -> a maker of (module with its loss, its callable)."""
    from diffusers import ContextParallelConfig, TensorParallelConfig

    def one_device(backend):
        one = WithLoss(copy.deepcopy(model))
        return one, (torch.compile(one, backend=backend) if backend else one)

    return {"one_device": lambda: one_device(inner), "one_device eager": lambda: one_device(None),
            "ours ulysses2": lambda: ours(copy.deepcopy(model), dtensor_par.init_mesh(ulysses=2), example_kwargs=kwargs, inner=inner),
            "ours tp2": lambda: ours(copy.deepcopy(model), dtensor_par.init_mesh(tp=2), example_kwargs=kwargs, inner=inner),
            "diffusers ulysses2 eager": lambda: _diffusers(model, ContextParallelConfig(ulysses_degree=2), None),
            f"diffusers ulysses2 {inner}": lambda: _diffusers(model, ContextParallelConfig(ulysses_degree=2), inner),
            "diffusers tp2 eager": lambda: _diffusers(model, TensorParallelConfig(tp_degree=2), None),
            f"diffusers tp2 {inner}": lambda: _diffusers(model, TensorParallelConfig(tp_degree=2), inner)}


def _forward(fn, kwargs) -> None:
    with torch.no_grad():
        fn(**kwargs)


def _step(fn, opt, kwargs) -> None:
    opt.zero_grad(set_to_none=True)
    fn(**kwargs).backward()
    opt.step()


def run_world(rank: int, world: int, *, reps: int, inner: str, image: int, text: int) -> dict:
    torch._dynamo.config.recompile_limit = 64  # one code object (WithLoss.forward), a compile per variant and mode
    model, kwargs = flux(image=image, text=text)
    model.eval()
    fns, opts, failed, losses = {}, {}, {}, {}
    for label, make in variants(model, kwargs, inner).items():
        try:
            module, fn = make()
            opts[label] = adamw(module)
            fn(**kwargs).backward()  # compiles the step, then the no_grad forward
            opts[label].zero_grad(set_to_none=True)
            with torch.no_grad():
                losses[label] = fn(**kwargs).item()
            fns[label] = fn
        except Exception as e:  # noqa: BLE001  recorded in the table, never hidden
            traceback.print_exc()
            failed[label] = failure(e)
    steps = {label: functools.partial(_step, fn, opts[label], kwargs) for label, fn in fns.items()}
    forwards = {label: functools.partial(_forward, fn, kwargs) for label, fn in fns.items()}
    for label in fns:  # once all are built: a variant built later can change what an earlier one's guards read
        forwards[label]()
        steps[label]()
    times = defaultdict(list)
    for _ in range(reps):
        for label in fns:  # alternated, so drift hits every variant alike
            times[f"forward/{label}"].append(slowest(timed(forwards[label])))
            times[f"step/{label}"].append(slowest(timed(steps[label])))
    return {"ms": {k: 1e3 * statistics.median(t) for k, t in times.items()}, "failed": failed,
            "losses_after_warm_up": losses, "reps": reps, "inner": inner, "tokens": [image * image, text]}


def table(result: dict) -> str:
    """Forward and step per variant: ms, ratio to diffusers' best on the same mesh (ulysses2 or
    tp2, eager or compiled) and parallel efficiency."""
    ms = result["ms"]
    labels = list(dict.fromkeys(k.split("/", 1)[1] for k in ms))
    out = ["| variant | fwd ms | fwd / diffusers' best, same mesh | fwd efficiency | step ms "
           "| step / diffusers' best, same mesh | step efficiency |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for label in labels:
        row = [label]
        mesh = label.split()[1] if label.startswith(("ours", "diffusers")) else None
        for phase in ("forward", "step"):
            peers = [v for k, v in ms.items() if mesh and k.startswith(f"{phase}/diffusers {mesh}")]
            one, own = ms.get(f"{phase}/one_device"), ms[f"{phase}/{label}"]
            row += [f"{own:.1f}", f"{own / min(peers):.2f}" if peers else "-",
                    f"{one / (2 * own):.0%}" if one and "one_device" not in label else "-"]
        out.append("| " + " | ".join(row) + " |")
    out += [f"- {label}: failed: {why}" for label, why in result["failed"].items()]
    return "\n".join(out)


def measure(reps: int, inner: str, quick: bool = False) -> dict:
    """Rank 0's result of one launch at world 2, with its table as ``text`` (a line saying why
    where diffusers is not installed)."""
    if importlib.util.find_spec("diffusers") is None:
        return {"skipped": True, "inner": inner, "text": "skipped: diffusers is not installed (the models extra)"}
    result = run_ranks(2, run_world, reps=reps, inner=inner, image=8 if quick else 32, text=16 if quick else 128)[0]
    result["text"] = table(result)
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inner", default="aot_eager", choices=["aot_eager", "inductor"])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="an 8 x 8 latent and 16 text tokens, 2 reps")
    parser.add_argument("--json", default="diffusers_peer.json")
    args = parser.parse_args()
    result = measure(2 if args.quick else max(args.reps, 7), args.inner, args.quick)
    print(result["text"])
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
