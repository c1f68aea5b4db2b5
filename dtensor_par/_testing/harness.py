"""Multi-process gloo runs on CPU, comparison against the single-device model, and what a run
leaves to inspect: the graphs AOTAutograd traces, the collectives a step runs, dtensor_par's
log records. The tests and the benchmarks use these (the tests never import the benchmarks).

A rank returns its numbers and asserts nothing it can leave to the test that reads them
(``compare`` measures, ``mismatches`` and ``assert_matches`` judge): a case out of tolerance
fails as that case, with its numbers, not as a launch that crashed."""

from __future__ import annotations

import contextlib
import copy
import faulthandler
import json
import logging
import math
import multiprocessing.forkserver
import os
import signal
import sys
import tempfile
import time
import traceback
from collections import Counter

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

FORWARD_ATOL = 1e-5
GRAD_RTOL = 1e-4

FUNCTIONAL_OPS = {"all_reduce": "all_reduce", "all_gather": "all_gather_into_tensor",
                  "reduce_scatter": "reduce_scatter_tensor", "all_to_all": "all_to_all_single",
                  "ring_rotate": "all_to_all_single"}
"""The functional collective each op of a report (explain, plan.json) runs as."""


def max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def whole(t: torch.Tensor) -> torch.Tensor:
    """The whole of a parallelized model's tensor: a DTensor's ``full_tensor()``; a plain one is
    held whole (``parallelize`` over a mesh that cuts no parameter)."""
    return t.full_tensor() if isinstance(t, torch.distributed.tensor.DTensor) else t


def dp_rows(mesh, size: int) -> slice:
    """This rank's rows of a batch of ``size`` under ``batch="local"``: its dp coordinate's share,
    as a DistributedSampler feeds DDP and FSDP2."""
    from dtensor_par.mesh import MeshInfo

    dp = MeshInfo.from_mesh(mesh).dims["dp"]
    return slice(dp.rank * size // dp.size, (dp.rank + 1) * size // dp.size)


def loss_of(out: torch.Tensor) -> torch.Tensor:
    """A loss that weighs every output element differently, so any misplaced value shows."""
    weights = torch.linspace(-1.0, 1.0, out.numel(), dtype=out.dtype).view(out.shape)
    return (out * weights).mean()


def compare(model: torch.nn.Module, inputs_seq: list, compiled_fn, steps: int = 1, lr: float = 1.0) -> dict:
    """Run the model and its compiled copy over each input tuple (``steps`` SGD steps each);
    return the largest forward abs diff and gradient relative diff seen, the least an optimizer
    step moved the weights (each must move them measurably, so a stale local weight shard would
    show) and the gradients one side has and the other lacks. Nothing is asserted here:
    ``mismatches`` says what of it is out of tolerance."""
    reference = copy.deepcopy(model)
    opt_ref = torch.optim.SGD(reference.parameters(), lr=lr)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    compiled = compiled_fn(model)
    worst = {"forward_abs": 0.0, "grad_rel": 0.0, "least_step": math.inf, "one_sided_grads": []}
    for inputs in inputs_seq:
        for _ in range(steps):
            ins_ref = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
            ins = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
            out_ref, out = reference(*ins_ref), compiled(*ins)
            loss_of(out_ref).backward()
            loss_of(out).backward()
            worst["forward_abs"] = max(worst["forward_abs"], (out - out_ref).abs().max().item())
            pairs = [(p.grad, q.grad, n) for (n, p), q in zip(model.named_parameters(), reference.parameters())]
            pairs += [(a.grad, b.grad, "input") for a, b in zip(ins, ins_ref) if b.grad is not None]
            for got, want, name in pairs:
                if (got is None) != (want is None):
                    worst["one_sided_grads"].append(f"{name}: {got is None=} {want is None=}")
                elif want is not None:
                    worst["grad_rel"] = max(worst["grad_rel"], max_rel(got, want))
            before = [p.detach().clone() for p in model.parameters()]
            opt.step(); opt_ref.step(); opt.zero_grad(); opt_ref.zero_grad()
            moved = max((p.detach() - b).abs().max().item() for p, b in zip(model.parameters(), before))
            worst["least_step"] = min(worst["least_step"], moved)
    return worst


LEAST_STEP = 1e-4
"""The least an optimizer step of ``compare`` must move the weights."""


def mismatches(metrics: dict, forward_atol: float = FORWARD_ATOL, grad_rtol: float = GRAD_RTOL) -> list[str]:
    """What of a case's metrics (``compare``'s: ``forward_abs``, ``grad_rel``, and where measured
    ``least_step`` and ``one_sided_grads``) is out of tolerance, in words; empty where nothing is."""
    found = []
    if not metrics["forward_abs"] <= forward_atol:
        found.append(f"forward max abs diff {metrics['forward_abs']:.3g} > {forward_atol:g}")
    if not metrics["grad_rel"] <= grad_rtol:
        found.append(f"gradient max rel diff {metrics['grad_rel']:.3g} > {grad_rtol:g}")
    if not metrics.get("least_step", math.inf) > LEAST_STEP:
        found.append(f"an optimizer step moved the weights by only {metrics['least_step']:.3g}")
    if metrics.get("one_sided_grads"):
        found.append(f"gradients on one side only: {metrics['one_sided_grads']}")
    return found


def assert_matches(case: str, per_rank: list[dict], forward_atol: float = FORWARD_ATOL,
                   grad_rtol: float = GRAD_RTOL) -> dict:
    """Case ``case``'s metrics on every rank (``per_rank``, ``compare``'s) within the tolerances;
    rank 0's. A failure names the case and prints every rank's numbers."""
    failed = {rank: found for rank, metrics in enumerate(per_rank)
              if (found := mismatches(metrics, forward_atol, grad_rtol))}
    numbers = "\n".join(f"  rank {rank}: {json.dumps(metrics)}" for rank, metrics in enumerate(per_rank))
    assert not failed, (f"{case}: " + "; ".join(f"rank {rank}: {', '.join(found)}" for rank, found in failed.items())
                        + f"\n{numbers}")
    return per_rank[0]


def _as_captured(out):
    """A model's output as a pipeline's ``loss_fn`` gets it: a ``ModelOutput``'s values without its
    ``None``s, one value as itself."""
    if hasattr(out, "to_tuple"):
        out = out.to_tuple()
        return out[0] if len(out) == 1 else out
    return out


def pipeline_against_one_device(step, reference: torch.nn.Module, x: torch.Tensor, target: torch.Tensor, *,
                                loss_fn, microbatches: int, kwargs: dict, steps: int = 3,
                                whole_inputs: tuple[str, ...] = ()) -> dict:
    """A pipeline's ``step`` (``dtensor_par.pipeline``) against one device's ``reference``
    accumulating the same microbatches (the mean loss over them, as the step returns), over
    ``steps`` AdamW steps with clipping (the norm over every stage): the worst loss (absolute),
    clipped norm and parameters (relative), the first step's worst gradient (relative), the
    least any parameter moved (so each trained), the share of the model's parameters this rank
    holds, and the FQNs it and the model hold. ``pipeline_mismatches`` judges them. The tensors
    of ``kwargs`` are cut into the microbatches too, but those ``whole_inputs`` names."""
    make_opt = lambda params: torch.optim.AdamW(params, lr=1e-2, eps=1e-3)  # noqa: E731
    opt, opt_ref = make_opt(step.parameters()), make_opt(reference.parameters())
    worst = Counter()
    initial = {fqn: whole(p).detach().clone() for fqn, p in step.named_parameters()}
    for i in range(steps):
        loss, losses = step(x, target=target, **kwargs), []
        for k, (xs, ts) in enumerate(zip(x.chunk(microbatches), target.chunk(microbatches))):
            part_kwargs = {name: value.chunk(microbatches)[k] if isinstance(value, torch.Tensor) and
                           name not in whole_inputs else value for name, value in kwargs.items()}
            part = loss_fn(_as_captured(reference(xs, **part_kwargs)), ts)
            (part / microbatches).backward()
            losses.append(part.detach())
        worst["loss"] = max(worst["loss"], abs(loss.item() - torch.stack(losses).mean().item()))
        if i == 0:
            worst["grad"] = max(max_rel(whole(p.grad), reference.get_parameter(fqn).grad)
                                for fqn, p in step.named_parameters())
        norm = step.clip_grad_norm_(0.05)
        norm_ref = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05)
        worst["norm"] = max(worst["norm"], abs(norm.item() - norm_ref.item()) / norm_ref.item())
        opt.step(); opt_ref.step(); opt.zero_grad(); opt_ref.zero_grad()
        worst["param"] = max(worst["param"], max(max_rel(whole(p), reference.get_parameter(fqn))
                                                 for fqn, p in step.named_parameters()))
    worst["least_moved"] = min((whole(p) - initial[fqn]).abs().max().item() for fqn, p in step.named_parameters())
    local = lambda p: p.to_local() if isinstance(p, torch.distributed.tensor.DTensor) else p  # noqa: E731
    return {**worst, "held": sum(local(p).numel() for p in step.parameters()) / sum(p.numel() for p in reference.parameters()),
            "fqns": sorted(fqn for fqn, _ in step.named_parameters()),
            "model_fqns": sorted(fqn for fqn, _ in reference.named_parameters())}


def pipeline_mismatches(label: str, per_rank: list[dict], most_held: float, least_moved: float = 1e-3) -> list[str]:
    """What of ``pipeline_against_one_device``'s numbers on every rank is out of tolerance (loss
    within 1e-6, gradients, clipped norms and parameters within 1e-5 relative, each parameter
    moved by more than ``least_moved``, a rank holding at most ``most_held`` of the model's parameters, each parameter held
    by some rank), each naming the case, the rank and its numbers; empty where nothing is."""
    found = []
    for rank, r in enumerate(per_rank):
        numbers = {k: v for k, v in r.items() if "fqns" not in k}
        if not (r["loss"] <= 1e-6 and r["grad"] <= 1e-5 and r["norm"] <= 1e-5 and r["param"] <= 1e-5):
            found.append(f"{label}: rank {rank} differs from one device: {numbers}")
        if not r["least_moved"] > least_moved:
            found.append(f"{label}: rank {rank}: a parameter moved by only {r['least_moved']:.3g}: {numbers}")
        if not 0 < r["held"] <= most_held:
            found.append(f"{label}: rank {rank} holds {r['held']:.3f} of the parameters, more than {most_held:.3f}")
    unheld = set(per_rank[0]["model_fqns"]).difference(*(r["fqns"] for r in per_rank))
    if unheld:
        found.append(f"{label}: no rank holds {sorted(unheld)}")
    return found


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


RANK_TIMEOUT = "DTENSOR_PAR_TEST_RANK_TIMEOUT"
"""An environment variable (``conftest`` sets it; benchmarks' long launches do not): seconds
after which a rank still running prints every thread's stack and exits, so a launch that hangs
(a collective one rank never joins) fails with where each rank waits, not at CI's limit."""


def _entry(rank: int, world: int, store: str, out_dir: str, fn, kwargs: dict) -> None:
    """One rank. It ends with ``os._exit`` once its result is written and the group torn down:
    C++ destructors of gloo threads at interpreter exit can abort a process whose work is done."""
    if os.environ.get(RANK_TIMEOUT):
        faulthandler.dump_traceback_later(float(os.environ[RANK_TIMEOUT]), exit=True)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # kill -USR1 <rank>: its stacks now
    faulthandler.enable(all_threads=True)  # a crash (SIGSEGV, SIGABRT from a heap check) prints where each thread was
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        result = fn(rank, world, **kwargs)
        log_cpu_time(f"launch of {', '.join(kwargs['calls']) if fn is _each else fn.__name__} at world {world}", rank)
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


_RANK_PRELOAD = ["torch", "torch._dynamo.backends.debugging", "torch._inductor.compile_fx", "dtensor_par",
                 "dtensor_par._testing.harness", "dtensor_par._testing.models", "transformers.modeling_utils",
                 "transformers.generation", "diffusers.models.transformers"]
"""What the process the ranks fork from imports once (the compilers' modules too, the small
models, and the real models' libraries where the models extra is installed; one that is not is
skipped): a rank spawned afresh takes seconds of CPU to import them (transformers and diffusers
3 s), and a suite starts dozens of ranks. Each rank still starts with nothing compiled."""


def start_fork_server() -> None:
    """Start the process the ranks fork from, if it is not running: every rank gets the
    environment and folder this process has now."""
    mp.get_context("forkserver").set_forkserver_preload(_RANK_PRELOAD)
    multiprocessing.forkserver.ensure_running()


def run_ranks(world: int, fn, /, **kwargs) -> list:
    """Run ``fn(rank, world, **kwargs)`` on ``world`` gloo ranks; return each rank's result."""
    start_fork_server()
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_entry, args=(world, os.path.join(tmp, "store"), tmp, fn, kwargs), nprocs=world,
                           join=True, start_method="forkserver")
        results = []
        for r in range(world):
            with open(os.path.join(tmp, f"rank{r}.json")) as f:
                results.append(json.load(f))
        return results


CPU_TIME_LOG = "DTENSOR_PAR_TEST_CPU_LOG"
"""An environment variable: a file each rank appends the CPU seconds of its work to (``conftest``
sums them per launch). A suite on two cores is CPU-bound; wall time under load says little."""


def log_cpu_time(what: str, rank: int, since: float = 0.0) -> None:
    if os.environ.get(CPU_TIME_LOG):
        with open(os.environ[CPU_TIME_LOG], "a") as f:
            f.write(json.dumps({"what": what, "rank": rank, "cpu": time.process_time() - since}) + "\n")


def _each(rank: int, world: int, *, calls: dict[str, tuple]) -> dict:
    results = {}
    for label, (fn, kwargs) in calls.items():
        start = time.process_time()
        results[label] = fn(rank, world, **kwargs)
        log_cpu_time(f"  {label} at world {world}", rank, start)
    return results


def run_ranks_together(world: int, calls: dict[str, tuple]) -> list[dict]:
    """Each ``label: (fn, kwargs)`` of ``calls`` in turn, in one launch of ``world`` gloo ranks:
    a launch (process group, each rank's first compile) costs seconds. Each rank's results by label."""
    return run_ranks(world, _each, calls=calls)


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


OP_NAMESPACES = ("aten::", "_c10d_functional::", "c10d::")


def _is_op(name: str) -> bool:
    """An op's profiler event: aten's, a collective's, or a kernel inductor generated (recorded
    under ``cpp.enable_kernel_profile``)."""
    return name.startswith(OP_NAMESPACES) or "cpp_fused" in name


def called_ops(events) -> list:
    """The profiled ops the program called itself: an op run inside another (``contiguous``'s
    ``clone``) is the caller's, so a copy counts where it was asked for."""
    called = []
    for event in events:
        parent = event.cpu_parent
        while parent is not None and not _is_op(parent.name):
            parent = parent.cpu_parent
        if parent is None and _is_op(event.name):
            called.append(event)
    return called


def reported_collectives(graph) -> dict[str, Counter]:
    """An explained graph's collectives by direction: ``(functional op, bytes per rank) -> count``,
    as ``step_collectives`` counts what runs."""
    reported = {"forward": Counter(), "backward": Counter()}
    for row in graph.collectives:
        reported[row["direction"]][FUNCTIONAL_OPS[row["op"]], row["bytes_per_rank"]] += row["count"]
    return reported


def step_collectives(compiled, *inputs) -> dict[str, Counter]:
    """The collectives a training step of ``compiled`` on ``inputs`` runs (after a first step,
    which compiles), by direction."""
    compiled(*inputs).sum().backward()
    loss = {}
    ran = {"forward": Counter(executed_collectives(lambda: loss.setdefault("step", compiled(*inputs).sum())))}
    ran["backward"] = Counter(executed_collectives(loss["step"].backward))
    return ran


_PROFILER_DTYPES = {"float": torch.float32, "double": torch.float64, "c10::Half": torch.float16,
                    "c10::BFloat16": torch.bfloat16, "long int": torch.int64, "int": torch.int32}
