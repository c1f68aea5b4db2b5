"""Transformer blocks, tensor x context parallel on a Trainium host, against a CPU run.

    torchrun --nproc-per-node 8 examples/neuron/compare.py               # TorchNeuron (native), tp=2 x ulysses=4
    torchrun --nproc-per-node 8 examples/neuron/compare.py --torch-xla   # the torch_xla stack
    torchrun --nproc-per-node 4 examples/neuron/compare.py --device cpu --tp 2 --ulysses 2   # the same on gloo

Every rank builds the same two blocks (``examples/tp_block.py``) and input, runs them on the
CPU in float32 as the reference, then in bfloat16 on its device through ``hybrid_parallel``,
and compares the output and every gradient at bf16 tolerances (largest difference over the
largest reference value). Exits with status 1 when a difference is over its tolerance.

- native: device ``neuron``, process group ``neuron``, the ``neuron`` compile backend for
  the per-rank graph, functional collectives.
- ``--torch-xla``: device ``xla``, process group ``xla``, every collective an xm call with
  full replica groups (``collectives="xla"``); the per-rank graph runs as eager ops on lazy
  XLA tensors (``--inner-backend eager``), which torch_xla traces into one program.

Both use the Neuron mesh order (ulysses innermost: contiguous all-to-all groups).
"""

import argparse
import copy
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tp_block import Block  # noqa: E402

from dtensor_par import hybrid_parallel, init_mesh  # noqa: E402
from dtensor_par.mesh import default_order  # noqa: E402

FORWARD_RTOL, GRAD_RTOL = 3e-2, 5e-2  # bf16 has 8 bits of mantissa; two blocks of error


def device_setup(args) -> tuple[torch.device, str]:
    """The device this rank computes on and the mesh's device type; starts the process group."""
    if args.torch_xla:
        import torch_xla.core.xla_model as xm
        import torch_xla.distributed.xla_backend  # noqa: F401  registers the "xla" process group backend

        dist.init_process_group("xla", init_method="xla://")
        return xm.xla_device(), "xla"
    if args.device == "neuron":
        import torch_neuronx  # noqa: F401  registers the neuron device, process group and compile backend

        return torch.device("neuron", int(os.environ.get("LOCAL_RANK", 0))), "neuron"
    return torch.device("cpu"), "cpu"


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float().cpu() - want).abs().max() / want.abs().max().clamp_min(1e-12)).item()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--ulysses", type=int, default=4)
    parser.add_argument("--ring", type=int, default=1)
    parser.add_argument("--device", default="neuron", choices=("neuron", "cpu"))
    parser.add_argument("--torch-xla", action="store_true", help="the torch_xla stack (torch-neuronx 2.9 and before)")
    parser.add_argument("--inner-backend", help="default: neuron (native), eager (--torch-xla), aot_eager (cpu)")
    parser.add_argument("--seq", type=int, default=64)
    args = parser.parse_args()

    torch.manual_seed(0)
    model = nn.Sequential(Block(), Block())
    x = torch.randn(2, args.seq, 64)
    reference = copy.deepcopy(model)
    ref_out = reference(x)
    ref_out.square().mean().backward()

    device, device_type = device_setup(args)
    inner = args.inner_backend or {"xla": "eager", "neuron": "neuron"}.get(device_type, "aot_eager")
    mesh = init_mesh(tp=args.tp, ring=args.ring, ulysses=args.ulysses, device_type=device_type,
                     order=default_order("neuron"))
    model = model.to(device, torch.bfloat16)
    compiled = torch.compile(model, backend=hybrid_parallel(
        mesh, inner_backend=inner, collectives="xla" if args.torch_xla else "functional"), dynamic=False)
    out = compiled(x.to(device, torch.bfloat16))
    out.float().square().mean().backward()
    if args.torch_xla:
        import torch_xla.core.xla_model as xm

        xm.mark_step()

    forward = relative(out, ref_out)
    grads = max(relative(p.grad, q.grad) for p, q in zip(model.parameters(), reference.parameters()))
    ok = forward <= FORWARD_RTOL and grads <= GRAD_RTOL
    if dist.get_rank() == 0:
        stack = "torch_xla" if args.torch_xla else device_type
        print(f"{stack}: tp={args.tp} x ring={args.ring} x ulysses={args.ulysses}, inner backend {inner}, bfloat16")
        print(f"output    max |diff| / max |reference| = {forward:.2e} (tolerance {FORWARD_RTOL:.0e})")
        print(f"gradients max |diff| / max |reference| = {grads:.2e} (tolerance {GRAD_RTOL:.0e})")
        print("OK" if ok else "FAILED")
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
