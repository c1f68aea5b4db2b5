"""What the benchmarks and the tests share: gloo ranks in processes, the graphs AOTAutograd
traces from a localized graph, dtensor_par's log records."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import sys
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


@contextlib.contextmanager
def logged(level: int):
    """The records dtensor_par logs at ``level`` or above while the block runs."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(level)
    handler.emit = records.append
    logger = logging.getLogger("dtensor_par")
    before = logger.level
    logger.addHandler(handler)
    logger.setLevel(level)
    try:
        yield records
    finally:
        logger.removeHandler(handler)
        logger.setLevel(before)


def _entry(rank: int, world: int, store: str, out_dir: str, fn, args) -> None:
    """One rank. It ends with ``os._exit`` once its result is written and the group torn down:
    C++ destructors of gloo threads at interpreter exit can abort a process whose work is done."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        result = fn(rank, world, *args)
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)
        dist.barrier()
        dist.destroy_process_group()
        code = 0
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_ranks(world: int, fn, *args) -> list:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo ranks; return each rank's result."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_entry, args=(world, os.path.join(tmp, "store"), tmp, fn, args), nprocs=world,
                           join=True, start_method="spawn")
        results = []
        for r in range(world):
            with open(os.path.join(tmp, f"rank{r}.json")) as f:
                results.append(json.load(f))
        return results


def capturing_backend(graphs: dict):
    """An AOTAutograd backend that keeps the forward and backward graphs it compiles in
    ``graphs``: those ``aot_eager`` and inductor get (their partitioner; torch's default one
    leaves dead recomputation in backward, see README)."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    def keep(name):
        def compiler(graph, _):
            graphs[name] = graph
            return graph
        return compiler

    return aot_autograd(fw_compiler=keep("forward"), bw_compiler=keep("backward"),
                        partition_fn=min_cut_rematerialization_partition)


def aot_graphs(local_gm, ctx, backward: bool = True) -> dict:
    """The forward (and backward) graphs AOTAutograd traces from a localized graph, compiled as
    the runtime compiles it and run on this rank's pieces of the example inputs (on a fake
    process group nothing is sent)."""
    from dtensor_par.params import local_value
    from dtensor_par.passes.meta import placements
    from dtensor_par.runtime import compile_local

    graphs = {}

    placeholders = [n for n in local_gm.graph.nodes if n.op == "placeholder"]
    inputs = []
    for node, value in zip(placeholders, ctx.example_inputs):
        local = local_value(value.detach(), placements(node), ctx.mesh, ctx.comm).contiguous()
        inputs.append(local.requires_grad_(backward and value.is_floating_point()))
    out = compile_local(capturing_backend(graphs), local_gm, inputs)(*inputs)
    if backward:
        out[0].sum().backward()
    return graphs


def executed_collectives(step) -> list[tuple[str, int]]:
    """The functional collectives ``step()`` runs, in order, as the profiler records them
    (a dispatch mode would make Dynamo run the model eagerly): each op's name and the bytes
    of the tensor this rank puts into it. Waits are left out; an in-place ``all_reduce_``
    (``passes.overlap.reinplace_all_reduces``) is the same collective, named ``all_reduce``."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as profile:
        step()
    ran = []
    for e in profile.events():
        name = e.name.removeprefix("_c10d_functional::")
        if name == e.name or name == "wait_tensor":
            continue
        name = name.removesuffix("_")
        shape, dtype = e.input_shapes[0], e.input_dtypes[0]
        itemsize = torch.empty((), dtype=_PROFILER_DTYPES.get(dtype, torch.float32)).element_size()
        ran.append((name, math.prod(shape) * itemsize))
    return ran


_PROFILER_DTYPES = {"float": torch.float32, "double": torch.float64, "c10::Half": torch.float16,
                    "c10::BFloat16": torch.bfloat16, "long int": torch.int64, "int": torch.int32}
