"""``python -m dtensor_par explain module.py:factory --tp 8``: the plan, without hardware."""

from __future__ import annotations

import argparse
import gc
import importlib
import importlib.util
import os
import sys

from .explain import explain


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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dtensor_par")
    commands = parser.add_subparsers(dest="command", required=True)
    ex = commands.add_parser("explain", help="plan a model at any mesh size and print the plan")
    ex.add_argument("factory", help="MODULE:FACTORY; FACTORY() returns (model, example_inputs)")
    for dim in ("tp", "ring", "ulysses"):
        ex.add_argument(f"--{dim}", type=int, default=1)
    ex.add_argument("--device-type", default="cuda")
    ex.add_argument("--sequence-parallel", action="store_true")
    ex.add_argument("--svg", help="write the mesh picture to this file")
    ex.add_argument("--dump", help="write the per-pass dump folders here")
    args = parser.parse_args(argv)

    gc.freeze()  # what the imports made lives until exit: no collection need walk it again (~0.2 s)
    model, example_inputs = load_factory(args.factory)()
    try:
        report = explain(model, example_inputs, tp=args.tp, ring=args.ring, ulysses=args.ulysses,
                         device_type=args.device_type, sequence_parallel=args.sequence_parallel,
                         dump_dir=args.dump)
    except (ValueError, NotImplementedError) as e:
        print(f"explain: {e}", file=sys.stderr)
        return 2
    print(report)
    if args.svg:
        with open(args.svg, "w") as f:
            f.write(report.svg())
    return 0


if __name__ == "__main__":
    sys.exit(main())
