"""calibrate: a machine profile (``machines.Machine``) measured on the machine it runs on.

    python -m dtensor_par calibrate --world 4 --out profile.json    (spawns 4 ranks on this host)
    torchrun --nproc-per-node 4 -m dtensor_par calibrate --world 4 --out profile.json

Every rank runs at once, as in a parallel step: matmul and SDPA throughput are a device's while
its peers compute too (CPU ranks share the cores). Each collective kind is timed over the whole
world at several sizes on the default backend (NCCL on CUDA, gloo on CPU), and ``latency + bus
bytes / bandwidth`` (``machines.BUS_FACTOR``) is fitted to the slowest rank's medians by least
squares; then alike over groups of each smaller size that divides the world, every group at
once (``intra_node_by_group_size``). Other ops are timed as a product of two tensors at the
same sizes, fitted alike to ``latency + output bytes / bandwidth``. A matmul, an all-reduce of
the largest size and the two side by side are timed in turn: what the pair takes beyond the
longer alone, over the shorter, is the share of a collective's time that compute beside it
does not hide (``collective_compute_share``). Attention is timed forward and backward, as a
training step runs it: SDPA on each rank alone, and ring attention over a ring of the whole
world (``ring_attention_flops``: its blocks are smaller than one SDPA call's, it merges their
results, and its rotations run beside them; what the cost model charges for the rotations is
taken out of its time, so that model and measurement agree on the ring calibrated). The ranks
are taken as one node (``devices_per_node`` = the world): ``inter_node`` is given the figures
measured, and a choice over at most this world never crosses it.
"""

from __future__ import annotations

import functools
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .machines import BUS_FACTOR, KINDS, LINK_CLASSES, Link, Machine
from .mesh import MeshDim
from .ops.ring import ring_attention
from .ops.ring_schedule import ring_step_flops
from .passes.cost import BACKWARD_TIMES

SIZES = tuple(4**i for i in range(6, 13))
"""Bytes a rank puts into each timed collective and each other op writes: 4 KiB to 16 MiB, the
range of a step's activations (a slope fitted below it missed caches that large tensors outgrow)."""


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _slowest(run) -> float:
    """The seconds ``run`` takes on the slowest rank, every rank started together."""
    dist.barrier()
    start = time.perf_counter()
    run()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    elapsed = torch.tensor(time.perf_counter() - start, dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item()


def _slowest_median(run, reps: int) -> float:
    """Median over ``reps`` of ``_slowest(run)`` (one call first, untimed: it warms caches and
    connections)."""
    run()
    return statistics.median(_slowest(run) for _ in range(reps))


def _collective(kind: str, nbytes: int, group, size: int, index: int):
    """A call of ``kind`` over ``group`` (``size`` ranks, this one its ``index``-th) into which
    this rank puts ``nbytes`` (float32)."""
    x = torch.ones(max(size, nbytes // 4 // size * size), device=_device())
    if kind == "all_reduce":
        return lambda: dist.all_reduce(x, group=group)
    if kind == "all_gather":
        gathered = x.new_empty(size * x.numel())
        return lambda: dist.all_gather_single(gathered, x, group=group)
    out = x.new_empty(x.numel() // size if kind == "reduce_scatter" else x.numel())
    if kind == "reduce_scatter":
        return lambda: dist.reduce_scatter_single(out, x, group=group)
    if kind == "all_to_all":
        return lambda: dist.all_to_all_single(out, x, group=group)
    # permute: the whole input to the next rank, as a ring rotation runs (ops/lowerings.py)
    send = [x.numel() if r == (index + 1) % size else 0 for r in range(size)]
    receive = [x.numel() if r == (index - 1) % size else 0 for r in range(size)]
    return lambda: dist.all_to_all_single(out, x, receive, send, group=group)


def _links(rank: int, world: int, size: int, sizes: tuple[int, ...], reps: int) -> dict[str, Link]:
    """Each kind fitted over the world's groups of ``size`` consecutive ranks, all at once."""
    group = None
    if size < world:  # every rank makes every group, in the same order
        group = [dist.new_group(list(range(first, first + size))) for first in range(0, world, size)][rank // size]
    return {kind: fit_link([(BUS_FACTOR[kind](size) * nbytes,
                             _slowest_median(_collective(kind, nbytes, group, size, rank % size), reps))
                            for nbytes in sizes]) for kind in KINDS}


def fit_link(points: list[tuple[float, float]]) -> Link:
    """``latency + bytes / bandwidth`` fitted by least squares to (bytes, seconds);
    a slope noise made negative gives the bandwidth of the largest point alone."""
    xs, ys = zip(*points)
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / sum((x - mean_x) ** 2 for x in xs)
    if slope <= 0:
        return Link(max(xs) / ys[xs.index(max(xs))], 0.0)
    return Link(1 / slope, max(0.0, mean_y - slope * mean_x))


def _dtypes() -> dict[str, torch.dtype]:
    """The dtypes rates are measured in, by name ("bfloat16")."""
    dtypes = (torch.float32, torch.bfloat16) if _device().type == "cuda" else (torch.float32,)
    return {str(dtype).removeprefix("torch."): dtype for dtype in dtypes}


def _matmul_rates(reps: int, matmul_size: int) -> dict[str, float]:
    """FLOP/s of a square matmul per dtype, every rank at once."""
    rates = {}
    for name, dtype in _dtypes().items():
        a = torch.randn(matmul_size, matmul_size, device=_device(), dtype=dtype)
        rates[name] = 2 * matmul_size**3 / _slowest_median(lambda: a @ a, reps)
    return rates


def _training_seconds(attention, q: torch.Tensor, reps: int) -> float:
    """Seconds of ``attention(q, q, q)``'s forward and backward on the slowest rank."""
    return _slowest_median(lambda: attention(q, q, q).sum().backward(), reps)


def _attention_heads(length: int, dtype: torch.dtype) -> torch.Tensor:
    """A causal attention's q (= k = v): 8 heads of 64, as coverage counts them."""
    return torch.randn(1, 8, length, 64, device=_device(), dtype=dtype, requires_grad=True)


def _attention_rates(reps: int, length: int) -> dict[str, float]:
    """FLOP/s of causal SDPA on each rank, forward and backward, per dtype, every rank at once."""
    flops = (1 + BACKWARD_TIMES) * 4 * 8 * 64 * length * (length + 1) // 2  # as coverage counts causal pairs
    sdpa = functools.partial(F.scaled_dot_product_attention, is_causal=True)
    return {name: flops / _training_seconds(sdpa, _attention_heads(length, dtype), reps)
            for name, dtype in _dtypes().items()}


def _ring_attention_rates(rank: int, world: int, reps: int, length: int, permute: Link, share: float
                          ) -> dict[str, float]:
    """FLOP/s of causal ring attention (zigzag) over a ring of the world's ``length`` tokens,
    forward and backward, per dtype: its slowest rank's FLOPs over its time less what the cost
    model charges for its rotations (``share`` of each, every one hidden behind the blocks)."""
    ring = MeshDim("ring", world, rank, dist.group.WORLD.group_name, (tuple(range(world)),), 0, zigzag=world)
    attention = functools.partial(ring_attention, ring=ring, is_causal=True, zigzag=True)
    flops = (1 + BACKWARD_TIMES) * max(sum(ring_step_flops(length, world, r, zigzag=True, is_causal=True, heads=8,
                                                           head_dim=64)) for r in range(world))
    rates = {}
    for name, dtype in _dtypes().items():
        q = _attention_heads(length // world, dtype)
        # k and v forward, their float32 gradients backward, ring - 1 times each (passes/rewrite.py)
        rotations = (world - 1) * sum(permute.latency + BUS_FACTOR["permute"](world) * 2 * q.numel() * size
                                      / permute.bandwidth for size in (q.element_size(), 4))
        seconds = _training_seconds(attention, q, reps) - share * rotations
        if seconds > 0:  # else the rotations the model charges explain the whole time: the blocks' own rate stays
            rates[name] = flops / seconds
    return rates


def _elementwise(reps: int, sizes: tuple[int, ...]) -> Link:
    """A product of two float32 tensors writing each of ``sizes`` bytes, every rank at once."""
    points = []
    for nbytes in sizes:
        x = torch.ones(nbytes // 4, device=_device())
        points.append((nbytes, _slowest_median(lambda: x * x, reps)))
    return fit_link(points)


def _collective_compute_share(reps: int, matmul_size: int, nbytes: int) -> float:
    """The share of an all-reduce's time that a matmul issued beside it does not hide, within
    [0, 1]: 0 when the pair takes as long as the longer alone, 1 when it takes both one after
    the other. The median over ``reps`` of each rep's matmul, all-reduce and pair, timed in turn
    (a load that drifts hits all three alike)."""
    a = torch.randn(matmul_size, matmul_size, device=_device())
    x = torch.ones(nbytes // 4, device=_device())

    def both():
        pending = dist.all_reduce(x, async_op=True)
        a @ a
        pending.wait()

    def share() -> float:
        alone = _slowest(lambda: a @ a), _slowest(lambda: dist.all_reduce(x))
        return min(1.0, max(0.0, (_slowest(both) - max(alone)) / min(alone)))

    both()
    return statistics.median(share() for _ in range(reps))


def _memory_per_device(world: int) -> int:
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // world


def measure(rank: int, world: int, *, sizes: tuple[int, ...] = SIZES, reps: int = 10, matmul_size: int = 1024,
            attention_length: int = 2048) -> dict:
    """The profile of this machine as ``Machine.as_dict`` gives it, measured on every rank of
    the default process group at once (each rank returns the same). ``attention_length``: the
    sequence of SDPA and of the ring alike (so that their rates compare; from 2048 on, SDPA's
    rate on a CPU no longer grows with it)."""
    by_size = {size: _links(rank, world, size, sizes, reps) for size in range(2, world + 1) if world % size == 0}
    links = by_size.pop(world)
    device = _device()
    share = _collective_compute_share(reps, matmul_size, max(sizes))
    machine = Machine(name=f"calibrated-{os.uname().nodename}-{device.type}-world{world}", device_type=device.type,
                      devices_per_node=world, memory_per_device=_memory_per_device(world),
                      matmul_flops=_matmul_rates(reps, matmul_size),
                      attention_flops=_attention_rates(reps, attention_length),
                      ring_attention_flops=_ring_attention_rates(rank, world, reps, attention_length, links["permute"],
                                                                 share),
                      links={c: dict(links) for c in LINK_CLASSES}, intra_node_by_group_size=by_size,
                      elementwise=_elementwise(reps, sizes), collective_compute_share=share)
    return machine.as_dict()


def describe(machine: Machine) -> str:
    """What a measured profile says, a line per figure."""
    engines = (("matmul", machine.matmul_flops), ("attention", machine.attention_flops),
               ("ring attention", machine.ring_attention_flops))
    rates = [f"{engine} {dtype}: {rate / 1e9:.3g} GFLOP/s" for engine, by_dtype in engines
             for dtype, rate in by_dtype.items()]
    groups = {machine.devices_per_node: machine.links["intra_node"], **machine.intra_node_by_group_size}
    links = [f"{kind} over {size}: {link.bandwidth / 1e9:.3g} GB/s bus bandwidth, {link.latency * 1e6:.3g} us latency"
             for size, kinds in groups.items() for kind, link in kinds.items()]
    other = machine.elementwise
    timed = [f"other ops: {other.bandwidth / 1e9:.3g} GB/s written, {other.latency * 1e6:.3g} us latency",
             f"share of a collective's time that compute beside it does not hide: "
             f"{machine.collective_compute_share:.0%}"] if other else []
    return "\n".join([f"{machine.name}: {machine.devices_per_node} ranks", *rates, *links, *timed])


def _spawned_rank(rank: int, world: int, store: str, out: str, options: dict) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    profile = Machine.from_dict(measure(rank, world, **options))
    if rank == 0:
        profile.save(out)
    dist.barrier()
    dist.destroy_process_group()


def calibrate(world: int, out: str, **options) -> Machine:
    """Measure this machine over ``world`` ranks and save the profile at ``out``: under torchrun,
    on the ranks it started (``world`` must be its world size); otherwise on ``world`` ranks this
    spawns on this host (gloo, on CPU)."""
    if "RANK" in os.environ:
        if int(os.environ["WORLD_SIZE"]) != world:
            raise ValueError(f"calibrate: --world {world}, but torchrun started {os.environ['WORLD_SIZE']} ranks")
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group()
        profile = Machine.from_dict(measure(dist.get_rank(), world, **options))
        if dist.get_rank() == 0:
            profile.save(out)
        dist.destroy_process_group()
        return profile
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as folder:
        mp.start_processes(_spawned_rank, args=(world, os.path.join(folder, "store"), out, options), nprocs=world,
                           join=True, start_method="spawn")
    return Machine.load(out)
