"""The annotations the passes leave on nodes and graphs: one accessor per key.

FX gives every node (and the graph module) a ``meta`` dict that survives graph copies and
rewrites; the passes keep what they learn there. Each key is spelled in this module only:
every pass, report and test reads and writes it through the functions below, whose
docstrings say which pass writes it and what it holds. A node without an annotation reads
as empty (no placements, no communication, no site).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from ..placements import Placement, local_shape_on

if TYPE_CHECKING:
    from ..mesh import MeshInfo
    from ..symbolic import SymbolicInputs

_SHARDINGS = "dtensor_par"
_GLOBAL_SHAPE = "dtensor_par_shape"
_COMMUNICATIONS = "dtensor_par_comm"
_SITE_ROLE = "dtensor_par_site"
_PARAM_FQN = "dtensor_par_fqn"
_WEIGHT_NAME = "dtensor_par_weight"
_BUFFER = "dtensor_par_buffer"
_WORK = "dtensor_par_work"
_EXPERTS_OVER = "dtensor_par_experts_over"
_RECOMPUTE = "dtensor_par_recompute"
_MODULE_PATHS = "dtensor_par_fqns"  # on the graph module
SYMBOLIC = "dtensor_par_symbolic"  # on the graph module
_FSDP_GATHER = "dtensor_par_fsdp_gather"  # in node.meta["custom"], which AOTAutograd copies to the ops it traces

ANNOTATIONS = {
    "shardings": (_SHARDINGS,), "global_shape": (_GLOBAL_SHAPE,), "communications": (_COMMUNICATIONS,),
    "site_role": (_SITE_ROLE,), "param_fqn": (_PARAM_FQN,), "weight_names": (_WEIGHT_NAME,), "buffer_value": (_BUFFER,),
    "work": (_WORK,), "experts_cut_over": (_EXPERTS_OVER,), "recompute_region": (_RECOMPUTE,),
    "fsdp_gather": ("custom",),
    # torch's own keys: FX's value of a node, autograd's, AOTAutograd's partitioner's (activation checkpointing)
    "val": ("val",), "requires_grad": ("requires_grad",), "recompute": ("recompute", "ac_graph_id"),
}
"""Each annotation a step may write (``passes.steps``) and the node meta keys it is kept under."""


@dataclass(frozen=True)
class NodeSharding:
    """Planned placements of one node on one mesh dim."""

    out: Placement | tuple[Placement, ...] | None  # a tuple for ops returning several tensors
    inputs: tuple[Placement, ...]  # required placement of each tensor input (``tensor_inputs`` order)
    note: str | None = None  # why the node was gathered, if it was
    for_output: str | None = None  # why it was gathered where only reshapes lead on to the output, whole there anyway


@dataclass(frozen=True)
class Communication:
    """What one inserted op communicates, for dumps and reports."""

    forward: str | None  # collective issued in the forward, if any
    backward: str | None  # collective its backward issues, if any
    mesh_dim: str
    group_size: int
    forward_bytes: int  # bytes this rank puts into the forward collective
    backward_bytes: int  # bytes of the gradient this rank puts into the backward collective
    site: str | None  # the site whose plan needs it


@dataclass(frozen=True)
class Work:
    """What one rank computes and makes at a node in forward, for the cost model (``passes.cost``)."""

    flops: int
    engine: str | None  # the rate it runs at: "matmul", "attention", "ring_attention", or None (no FLOPs counted)
    dtype: str  # of its output: "bfloat16"
    out_bytes: int  # this rank's piece of its output; 0 for a view of its input


def shardings(node: fx.Node) -> dict[str, NodeSharding]:
    """Mesh dim name -> the node's NodeSharding there; written by ``plan_pass`` for every node
    of the global graph (empty before planning, and for the nodes localize inserts)."""
    return node.meta.get(_SHARDINGS, {})


def set_sharding(node: fx.Node, dim: str, sharding: NodeSharding) -> None:
    """Plan ``node`` on mesh dim ``dim`` (a fresh dict: a copied graph's nodes share meta values)."""
    node.meta[_SHARDINGS] = {**shardings(node), dim: sharding}


def placements(node: fx.Node) -> dict[str, Placement]:
    """Mesh dim name -> the placement the plan gives the node's value (``shardings``' ``out``)."""
    return {dim: s.out for dim, s in shardings(node).items()}


def global_shape(node: fx.Node) -> tuple | None:
    """The global shape of a tensor node, kept by ``plan_pass``: localize drops the values."""
    return node.meta.get(_GLOBAL_SHAPE)


def set_global_shape(node: fx.Node, shape: tuple) -> None:
    node.meta[_GLOBAL_SHAPE] = shape


def planned_local_shape(node: fx.Node, mesh: MeshInfo) -> tuple:
    """This rank's shape of a planned tensor node."""
    return local_shape_on(global_shape(node), placements(node), mesh)


def communications(node: fx.Node) -> list[Communication]:
    """What the node communicates, forward and backward: set on the ops that issue collectives
    (``localize_pass``, the rules' localize rewrites, ``rewrite_pass`` for hybrid attention) and
    on the placeholders whose gradient the runtime gathers; empty on every other node."""
    return node.meta.get(_COMMUNICATIONS, [])


def set_communications(node: fx.Node, comms: list[Communication]) -> None:
    node.meta[_COMMUNICATIONS] = comms


def clear_communications(node: fx.Node) -> None:
    """Drop the node's communications (a node made from one that communicates, but does not)."""
    node.meta.pop(_COMMUNICATIONS, None)


def work(node: fx.Node) -> Work | None:
    """The node's Work, set by ``coverage.coverage_pass`` on each planned op with a tensor
    output (localize keeps it: it rewrites those nodes' arguments, not the nodes)."""
    return node.meta.get(_WORK)


def set_work(node: fx.Node, done: Work) -> None:
    node.meta[_WORK] = done


def site_role(node: fx.Node) -> str | None:
    """``attention0.colwise``: the site and role of a node that belongs to one, set by
    ``detect_pass`` (and by ``rewrite_pass`` on the bias add it splits off a rowwise linear)."""
    return node.meta.get(_SITE_ROLE)


def set_site_role(node: fx.Node, role: str | None) -> None:
    node.meta[_SITE_ROLE] = role


def experts_cut_over(node: fx.Node) -> tuple[str, ...]:
    """The plan dims (cp, dp) over which an ``experts_from_rows`` node sends each rank its
    experts whole, set by ``passes.experts``."""
    return node.meta[_EXPERTS_OVER]


def set_experts_cut_over(node: fx.Node, dims: tuple[str, ...]) -> None:
    node.meta[_EXPERTS_OVER] = dims


@dataclass(frozen=True)
class RecomputeRegion:
    """Ops whose outputs backward recomputes instead of keeping (``passes.checkpoint``)."""

    index: int  # from 1, in graph order: the ``ac_graph_id`` the partitioner reads
    name: str  # the module it checkpoints: ``model.layers.0 (LlamaDecoderLayer)``
    source: str  # "model": the model's own torch.utils.checkpoint; "backend": activation_checkpointing=
    selective: bool = False  # the model gave it a selective policy (a context_fn), which is not applied


def recompute_region(node: fx.Node) -> RecomputeRegion | None:
    """The RecomputeRegion ``node`` belongs to, set by ``recompute.inline_checkpoints`` (the
    model's own regions) or ``recompute.block_regions`` (the backend's); ``recompute_pass``
    gives it to the ops other passes inserted. None outside every region."""
    return node.meta.get(_RECOMPUTE)


def set_recompute_region(node: fx.Node, region: RecomputeRegion | None) -> None:
    if region is None:
        node.meta.pop(_RECOMPUTE, None)
    else:
        node.meta[_RECOMPUTE] = region


def param_fqn(node: fx.Node) -> str | None:
    """The module path of the parameter a placeholder holds (``blocks.0.q_proj.weight``), set by
    ``capture_pass``; None on other nodes."""
    return node.meta.get(_PARAM_FQN)


def set_param_fqn(node: fx.Node, fqn: str) -> None:
    node.meta[_PARAM_FQN] = fqn


@dataclass
class BufferValue:
    """A module buffer the graph reads and never writes, with the value it had when planned.
    Passes may read that value as a constant (a causal mask kept in a buffer, nanoGPT's and
    GPT-Neo's ``bias``); the first to do so sets ``read``, and the plan then holds only while the
    buffer keeps that value (``plancache.ConstantInput``, checked before every run)."""

    fqn: str
    index: int  # position among the graph's inputs
    value: torch.Tensor
    read: bool = False


def buffer_value(node: fx.Node) -> BufferValue | None:
    """The BufferValue of a placeholder holding a module buffer, set by ``capture_pass``; None
    on other nodes."""
    return node.meta.get(_BUFFER)


def set_buffer_value(node: fx.Node, value: BufferValue) -> None:
    node.meta[_BUFFER] = value


def weight_names(linear: fx.Node) -> tuple[str, ...]:
    """The placeholder names of a site linear's weight (each expert's, for an ``nn.ModuleList``'s
    experts stacked in the graph: ``nodes.stacked_params``), set by ``detect_pass`` (kept here:
    localize rewires the linear's arguments)."""
    return linear.meta[_WEIGHT_NAME]


def set_weight_names(linear: fx.Node, names: tuple[str, ...]) -> None:
    linear.meta[_WEIGHT_NAME] = names


def module_paths(gm: fx.GraphModule) -> dict[str, str]:
    """Placeholder name -> module path (``attn.weight``), read off Dynamo's sources when the
    graph is captured (``capture.record_module_names``); Dynamo drops the sources later."""
    return gm.meta.get(_MODULE_PATHS, {})


def symbolic_inputs(gm: fx.GraphModule) -> SymbolicInputs:
    """Which inputs Dynamo made symbolic, recorded when the graph is captured
    (``capture.record_module_names``)."""
    return gm.meta[SYMBOLIC]


def record_capture(gm: fx.GraphModule, paths: dict[str, str], symbolic: SymbolicInputs) -> None:
    """Keep what capture read off Dynamo's graph; a graph recorded once keeps its first record."""
    gm.meta.setdefault(_MODULE_PATHS, paths)
    gm.meta.setdefault(SYMBOLIC, symbolic)


def mark_fsdp_gather(node: fx.Node, reshard_after_forward: bool) -> None:
    """Localize marks an FSDP gather (``bucket_fsdp_gathers``), so that the ops AOTAutograd traces
    from it carry the mark (``custom`` is one of the fields it copies) and the overlap pass
    prefetches it one block ahead, not earlier. ``reshard_after_forward``: also tagged for the
    partitioner to recompute in backward, as activation checkpointing tags ops."""
    node.meta["custom"] = {**node.meta.get("custom", {}), _FSDP_GATHER: True}
    if reshard_after_forward:
        node.meta.update(recompute=CheckpointPolicy.MUST_RECOMPUTE, ac_graph_id=0)


def is_fsdp_gather(node: fx.Node) -> bool:
    """Whether ``node`` is, or was traced from, an FSDP gather (``mark_fsdp_gather``)."""
    return bool(node.meta.get("custom", {}).get(_FSDP_GATHER))
