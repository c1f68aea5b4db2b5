"""Machine profiles: what the cost model (``passes.cost``) needs to know of the hardware.

A profile gives one device's compute rates and memory, and for each link class (``intra_node``:
ranks of one node, ``inter_node``: ranks of different nodes) each collective kind's bandwidth
and latency. Bandwidths are bus bandwidths, as nccl-tests reports them: a collective of kind
``k`` over ``n`` ranks into which a rank puts ``b`` bytes takes
``latency + BUS_FACTOR[k](n) * b / bandwidth``. A measured profile may also give links of its
own to groups smaller than the node (``intra_node_by_group_size``: on one host, gloo's pairs
answer each other far sooner than its groups of every rank), time the other ops
(``elementwise``), give ring attention a rate of its own (``ring_attention_flops``) and say
how much of a collective's time its rank cannot compute
(``collective_compute_share``: gloo's collectives on ranks that oversubscribe the CPU cores
make no progress while the ranks compute).

Built-in profiles are published peak figures, each with its source; a measured profile saved
as JSON (``Machine.save``) replaces them. ``machine(spec)`` accepts a built-in name, a
``Machine`` or the path of a JSON profile.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass

LINK_CLASSES = ("intra_node", "inter_node")
BUS_FACTOR = {
    "all_reduce": lambda n: 2 * (n - 1) / n,  # reduce-scatter then all-gather of the input
    "all_gather": lambda n: n - 1,  # the input is this rank's piece; n - 1 pieces arrive
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "permute": lambda n: 1,  # point to point: the whole input goes to one peer
}
"""Bytes each kind moves over a rank's link per byte the rank puts in, over ``n`` ranks
(nccl-tests' bus-bandwidth factors, rewritten per input byte)."""
KINDS = tuple(BUS_FACTOR)


@dataclass(frozen=True)
class Link:
    bandwidth: float  # bus bandwidth, bytes per second per rank
    latency: float  # seconds


@dataclass(frozen=True)
class Machine:
    """One kind of node, repeated: its devices, their rates and the links between them."""

    name: str
    device_type: str  # as init_mesh takes it: "cuda", "neuron"
    devices_per_node: int  # ranks per node: a group spanning two nodes crosses ``inter_node`` links
    memory_per_device: int  # bytes
    matmul_flops: dict[str, float]  # dtype name ("bfloat16") -> FLOP/s of one device
    attention_flops: dict[str, float]  # likewise, for fused attention kernels
    links: dict[str, dict[str, Link]]  # link class -> collective kind -> Link
    # ops other than matmuls and attention: latency per op + output bytes / bandwidth; None: free
    elementwise: Link | None = None
    # the share of a collective's time that compute issued beside it cannot hide: 0 where collectives
    # run on engines of their own (NCCL's, NeuronLink's DMA), 1 where the two take turns
    collective_compute_share: float = 0.0
    # likewise, for ring attention's blocks with their merges and rotations beside them, where measured
    # (less what the rotations themselves cost: ``calibrate``); else ``attention_flops``
    ring_attention_flops: dict[str, float] = dataclasses.field(default_factory=dict)
    # group size -> collective kind -> Link inside a node, for groups smaller than ``links`` was
    # measured over; a size not given uses ``links``
    intra_node_by_group_size: dict[int, dict[str, Link]] = dataclasses.field(default_factory=dict)
    contiguous_all_to_all: bool = False  # Neuron: all-to-all groups must be runs of contiguous ranks
    replica_group_limit: int | None = None  # Neuron: most distinct replica-group sets a program may use

    def __post_init__(self):
        for link_class in LINK_CLASSES:
            missing = set(KINDS) - set(self.links.get(link_class, {}))
            if missing:
                raise ValueError(f"machine {self.name!r}: no {sorted(missing)} for link class {link_class!r}")

    def collective_seconds(self, kind: str, nbytes: int, group_size: int, link_class: str) -> float:
        by_kind = self.intra_node_by_group_size.get(group_size) if link_class == "intra_node" else None
        link = (by_kind or self.links[link_class])[kind]
        return link.latency + BUS_FACTOR[kind](group_size) * nbytes / link.bandwidth

    def elementwise_seconds(self, out_bytes: int) -> float:
        """An op that is neither a matmul nor attention, writing ``out_bytes``: free without ``elementwise``."""
        if self.elementwise is None or not out_bytes:
            return 0.0
        return self.elementwise.latency + out_bytes / self.elementwise.bandwidth

    def flops_per_second(self, engine: str, dtype: str) -> float:
        """``engine``: "matmul", "attention" or "ring_attention"; a dtype the profile lacks runs
        at its float32 rate."""
        rates = {"matmul": self.matmul_flops, "attention": self.attention_flops,
                 "ring_attention": self.ring_attention_flops or self.attention_flops}[engine]
        return rates.get(dtype, rates["float32"])

    def as_dict(self) -> dict:
        """Plain values only, as JSON holds them (``from_dict`` reads them back)."""
        return dataclasses.asdict(self)

    @staticmethod
    def from_dict(given: dict) -> Machine:
        links = {c: {k: Link(**v) for k, v in kinds.items()} for c, kinds in given["links"].items()}
        elementwise = given.get("elementwise") and Link(**given["elementwise"])
        by_size = {int(n): {k: Link(**v) for k, v in kinds.items()}
                   for n, kinds in given.get("intra_node_by_group_size", {}).items()}
        return Machine(**{**given, "links": links, "elementwise": elementwise, "intra_node_by_group_size": by_size})

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.as_dict(), f, indent=1)

    @staticmethod
    def load(path: str) -> Machine:
        with open(path) as f:
            return Machine.from_dict(json.load(f))


def _links(intra: tuple[float, float], inter: tuple[float, float], *, permute_intra: float | None = None
           ) -> dict[str, dict[str, Link]]:
    """Every kind at one (bandwidth, latency) per link class; ``permute_intra``: a point-to-point
    latency of its own inside a node."""
    links = {c: {k: Link(*given) for k in KINDS} for c, given in (("intra_node", intra), ("inter_node", inter))}
    if permute_intra is not None:
        links["intra_node"]["permute"] = Link(intra[0], permute_intra)
    return links


GB = 1e9
US = 1e-6
# NCCL's tuning constants (src/graph/tuning.cc, as torch/_inductor/comm_analysis.py tabulates them):
# ring, LL protocol: 6.6 us base + 0.6 us per NVLink step, 2.7 us per network step. Over a ring of
# 8, 7 steps: 6.6 + 7 * 0.6 = 10.8 us inside a node, 6.6 + 7 * 2.7 = 25.5 us across; a permute is
# one step: 6.6 + 0.6 = 7.2 us.
_NCCL_INTRA_LATENCY, _NCCL_INTER_LATENCY, _NCCL_PERMUTE_LATENCY = 10.8 * US, 25.5 * US, 7.2 * US

H100_SXM = Machine(
    name="h100-sxm-8",
    device_type="cuda",
    devices_per_node=8,  # HGX H100 8-GPU
    memory_per_device=80 * GB,  # H100 SXM datasheet: 80 GB HBM3
    # H100 SXM datasheet: BF16/FP16 Tensor Core 1,979 TFLOPS with sparsity (989.5 dense), FP32 67 TFLOPS
    matmul_flops={"bfloat16": 989.5e12, "float16": 989.5e12, "float32": 67e12},
    # FlashAttention-3 (Shah et al. 2024): up to 740 TFLOPS FP16 on H100 (75% of peak); FP32: the FP32 peak
    attention_flops={"bfloat16": 740e12, "float16": 740e12, "float32": 67e12},
    # NVLink 4: 900 GB/s per GPU, both directions (H100 datasheet): 450 GB/s each way; NDR InfiniBand
    # 400 Gb/s per GPU (DGX H100: 8 ConnectX-7): 50 GB/s
    links=_links((450 * GB, _NCCL_INTRA_LATENCY), (50 * GB, _NCCL_INTER_LATENCY), permute_intra=_NCCL_PERMUTE_LATENCY),
)

H200 = dataclasses.replace(
    H100_SXM,
    name="h200-8",
    memory_per_device=141 * GB,  # H200 datasheet: 141 GB HBM3e; compute and NVLink 900 GB/s as H100 SXM
)

TRN2_48XL = Machine(
    name="trn2-48xl",
    device_type="neuron",
    # Neuron docs, training best practices: 16 Trainium2 chips, LNC=2 (default): 4 logical cores a chip,
    # 64 ranks an instance, 96 GiB HBM a chip: 24 GiB a rank
    devices_per_node=64,
    memory_per_device=24 * 2**30,
    # Trainium2 architecture page: 667 BF16/FP16 TFLOPS, 181 FP32 TFLOPS a chip, 4 ranks a chip.
    # No attention figure is published: the same rates.
    matmul_flops={"bfloat16": 667e12 / 4, "float16": 667e12 / 4, "float32": 181e12 / 4},
    attention_flops={"bfloat16": 667e12 / 4, "float16": 667e12 / 4, "float32": 181e12 / 4},
    # Trn2 architecture page: intra-instance NeuronLink-v3 1,024 GB/s a chip (256 GB/s a rank); EFAv3
    # 3,200 Gbps an instance (400 GB/s over 64 ranks: 6.25 GB/s a rank). No latency is published:
    # NCCL's figures above.
    links=_links((256 * GB, _NCCL_INTRA_LATENCY), (6.25 * GB, _NCCL_INTER_LATENCY),
                 permute_intra=_NCCL_PERMUTE_LATENCY),
    contiguous_all_to_all=True,  # see DESIGN.md, Neuron: all-to-all groups are contiguous rank runs
    replica_group_limit=12,  # Neuron runtimes before 2.32 (16 from 2.32)
)

MACHINES = {m.name: m for m in (H100_SXM, H200, TRN2_48XL)}


def machine(spec: str | Machine) -> Machine:
    """A built-in profile by name, a ``Machine`` as it is, or a JSON profile by path."""
    if isinstance(spec, Machine):
        return spec
    if spec in MACHINES:
        return MACHINES[spec]
    if os.path.isfile(spec):
        return Machine.load(spec)
    raise ValueError(f"unknown machine {spec!r}: give a JSON profile's path or one of {sorted(MACHINES)}")
