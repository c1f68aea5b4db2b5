"""recompute: activation checkpointing, the ops backward computes again instead of keeping their outputs.

A model's own ``torch.utils.checkpoint`` (transformers' and diffusers' gradient checkpointing
too) reaches the backend as a ``tag_activation_checkpoint`` call on a subgraph.
``inline_checkpoints`` puts each body back into the graph, every op marked with its region
(``meta.recompute_region``), so that detect, plan and localize see the model as if it were not
checkpointed. ``activation_checkpointing="full" | "selective" | policy`` instead makes every
block a region (``block_regions``): the ops of one numbered module (``layers.3``).

``recompute_pass`` runs last, on the rank's graph: each op that a pass inserted (a
collective, a reshape of local sizes) joins the region of the ops it serves, and every op of a
region gets the tags AOTAutograd copies onto the ops it traces from it and the min-cut
partitioner obeys: ``recompute`` (a ``CheckpointPolicy``) and ``ac_graph_id`` (its region).

What a region recomputes is its policy's choice, op by op:

- a model's own region, and ``"full"``: every op, collectives included: a recomputed block
  communicates again in backward, as eager ``torch.utils.checkpoint`` does, and as Megatron's and
  torchtitan's full recompute do. A rank keeps each block's input.
- ``"selective"``: ops costly to compute again per byte kept keep their outputs (attention, which
  keeps its log-sum-exp, recurrences, matmuls but an MLP's up and gate projections, the block's
  widest values) and so do those that communicate (collectives, hybrid attention over cp):
  backward recomputes norms, activations, pointwise ops and the MLP's up and gate projections,
  and never communicates twice.
- a callable: ``policy(node) -> CheckpointPolicy | bool`` on each op of the rank's graph (True:
  keep its output).
"""

from __future__ import annotations

import functools
import itertools
import operator
import re
from typing import Callable

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.utils.checkpoint import CheckpointPolicy

from ..errors import InvalidPlan
from ..logs import logger
from ..placements import Replicate
from .context import ParallelContext
from .coverage import CONTRACTIONS
from .meta import (RecomputeRegion, communications, is_fsdp_gather, module_paths, placements, recompute_region,
                   set_recompute_region, site_role)
from .nodes import arguments, target_name, writes_in_place
from .rules.registry import op_kind
from .saved import storage
from .sites import AttentionSite, site_weight_names

_OPS = ("call_function", "call_method", "call_module")
_KEPT_BY_SELECTIVE = {"linear", "matmul", "grouped_mm", "conv", "sdpa", "hybrid_attention", "recurrence"}
"""Op kinds whose outputs ``"selective"`` keeps: recomputing them costs their FLOPs again."""


@functools.cache
def allow_side_effects_in_regions() -> None:
    """Let Dynamo trace a checkpointed region that has Python side effects (transformers'
    decoder layers set and reset a context variable in each attention) instead of breaking
    the graph at every layer, each side effect then applied once, in forward, and not again
    when backward recomputes the region (``skip_fwd_side_effects_in_bwd_under_checkpoint``).
    Set for the process by the first ``hybrid_parallel`` backend or capture: Dynamo reads it
    while it traces, before any backend is called."""
    if not torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint:
        torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True
        logger.info("hybrid_parallel: set torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint: "
                    "a checkpointed region's Python side effects run in forward only")


def _module_path(source: str) -> str:
    """``L['self'].model.layers[0]`` (a Dynamo source) -> ``model.layers.0``; the model is
    ``L['args'][0]`` where its ``forward`` is wrapped in ``def wrapper(*args, **kwargs)`` (transformers').
    A forward wrapped by a decorator that reads ``self`` (diffusers' ``apply_lora_scale``) is traced
    through the module's ``__dict__['_modules']``: a container, not part of the path."""
    path = re.sub(r"^L\['args'\]\[0\]|^L\['[^']+'\]", "", source)
    path = re.sub(r"\.__dict__\['_(modules|parameters|buffers)'\]", "", path)
    parts = re.findall(r"\._modules\['([^']+)'\]|\[(\d+)\]|\['([^']+)'\]|\.(\w+)", path)
    return ".".join(next(p for p in groups if p) for groups in parts if any(groups) and groups[-1] != "_modules")


def module_stack(node: fx.Node) -> list[tuple[str, str]]:
    """(path, class name) of each module ``node`` was traced in, outermost first (Dynamo's
    ``nn_module_stack``): ``("model.layers.0", "LlamaDecoderLayer")``."""
    return [(_module_path(source), getattr(cls, "__name__", str(cls)))
            for source, cls in (node.meta.get("nn_module_stack") or {}).values()]


def _region_name(path: str, cls: str) -> str:
    return f"{path or 'the model'} ({cls})"


def _checkpointed_module(body: fx.GraphModule) -> str:
    """The region's name: the innermost module that every op of its body was traced in
    (``model.layers.0 (LlamaDecoderLayer)``)."""
    stacks = [module_stack(n) for n in body.graph.nodes if n.op in _OPS]
    common = [entry for entry, *others in zip(*stacks) if all(o == entry for o in others)] if stacks else []
    return _region_name(*common[-1]) if common else "the model's forward"


def inline_checkpoints(gm: fx.GraphModule) -> fx.GraphModule:
    """Replace each ``tag_activation_checkpoint`` call by its body's ops, each marked with a
    region of its own, numbered in graph order (a region inside another joins the outer one).
    A region's ``context_fn`` (a selective policy in the model) is not applied: it recomputes
    every op (``recompute_pass`` warns of it)."""
    numbers = itertools.count(1)
    while (hop := next((n for n in gm.graph.nodes if _is_checkpoint(n)), None)) is not None:
        body = getattr(gm, hop.args[0].target)
        selective = body.meta.get("_checkpoint_context_fn") is not None
        _inline(gm, hop, recompute_region(hop) or RecomputeRegion(next(numbers), _checkpointed_module(body), "model",
                                                                  selective))
    for node in [n for n in gm.graph.nodes if n.op == "get_attr" and not n.users]:
        if isinstance(getattr(gm, node.target), fx.GraphModule):  # a body inlined
            delattr(gm, node.target)
            gm.graph.erase_node(node)
    gm.recompile()
    return gm


def _is_checkpoint(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is torch.ops.higher_order.tag_activation_checkpoint


def _inline(gm: fx.GraphModule, hop: fx.Node, region: RecomputeRegion) -> None:
    """``hop``'s body in its place, its ops marked with ``region``; its outputs read where
    ``hop``'s were (by position)."""
    body: fx.GraphModule = getattr(gm, hop.args[0].target)
    env = dict(zip([n for n in body.graph.nodes if n.op == "placeholder"], hop.args[1:]))
    with gm.graph.inserting_before(hop):
        for node in body.graph.nodes:
            if node.op == "output":
                outputs = fx.node.map_arg(node.args[0], env.__getitem__)
            elif node.op == "get_attr":  # a nested region's body
                name = f"{hop.args[0].target}_{node.target}"
                setattr(gm, name, getattr(body, node.target))
                env[node] = gm.graph.get_attr(name)
                env[node].meta = dict(node.meta)
            elif node.op != "placeholder":
                env[node] = gm.graph.node_copy(node, env.__getitem__)
                set_recompute_region(env[node], region)
    for user in list(hop.users):
        if user.target is not operator.getitem:
            raise NotImplementedError(f"inline_checkpoints: {user.name} reads the checkpointed call {hop.name} "
                                      f"other than by position")
        user.replace_all_uses_with(outputs[user.args[1]])
        gm.graph.erase_node(user)
    gm.graph.erase_node(hop)


_NUMBERED = re.compile(r"(?:^|\.)\d+$")


def _block_of(site, ctx: ParallelContext) -> str:
    """The block a site belongs to: the deepest numbered module (``model.layers.3``) that holds
    every weight it cuts; failing that, the deepest module that does (``""``: the model itself)."""
    paths = [ctx.params[name].fqn.split(".")[:-1] for name in site_weight_names(site) if name in ctx.params]
    common = []
    for parts in zip(*paths):
        if len(set(parts)) > 1:
            break
        common.append(parts[0])
    prefixes = [".".join(common[:i]) for i in range(1, len(common) + 1)]
    numbered = [p for p in prefixes if _NUMBERED.search(p)]
    return (numbered or prefixes or [""])[-1]


def block_regions(gm: fx.GraphModule, ctx: ParallelContext) -> None:
    """``activation_checkpointing``'s regions: one per block that holds a site, each the ops
    traced in its module (the innermost, where blocks nest), numbered in graph order; the model's
    own regions give way to them."""
    blocks = {_block_of(s, ctx) for s in ctx.sites}
    regions: dict[str, RecomputeRegion] = {}
    for node in gm.graph.nodes:
        inside = [(path, cls) for path, cls in module_stack(node) if path in blocks]
        if not inside or node.op not in _OPS:
            set_recompute_region(node, None)
            continue
        path, cls = inside[-1]
        if path not in regions:
            regions[path] = RecomputeRegion(len(regions) + 1, _region_name(path, cls), "backend")
        set_recompute_region(node, regions[path])
    if not regions:  # asked for, and nothing checkpointed: said, not silent
        ctx.warn(f"activation checkpointing={ctx.config.activation_checkpointing!r}: no block to checkpoint "
                 f"({len(ctx.sites)} sites; no op was traced in a module that holds one): every activation is kept "
                 f"for backward")


def _full(node: fx.Node) -> CheckpointPolicy:
    return CheckpointPolicy.PREFER_RECOMPUTE


def _selective(node: fx.Node, copied: set[fx.Node]) -> CheckpointPolicy:
    """Keep what costs most to compute again per byte kept: what communicates in forward (a
    collective, hybrid attention over cp: backward never communicates twice), attention's output
    (its FLOPs grow with the sequence), a recurrence's, and the matmuls' outputs, but the MLP's up
    and gate projections' (the block's widest values, one matmul each to recompute from the
    normalized input) and the ``copied`` ones: q, k and v projections of an attention over cp,
    which hybrid attention keeps copies of itself, in the layout it computes in."""
    if any(c.forward for c in communications(node)):
        return CheckpointPolicy.MUST_SAVE
    role = site_role(node) or ""
    if role.startswith("mlp") and role.endswith(".colwise") or node in copied or op_kind(node) not in _KEPT_BY_SELECTIVE:
        return CheckpointPolicy.PREFER_RECOMPUTE
    return CheckpointPolicy.PREFER_SAVE


def region_policy(option, ctx: ParallelContext) -> Callable[[fx.Node], CheckpointPolicy]:
    """The policy each op of a region is asked: ``activation_checkpointing``'s, or, for the
    model's own regions (``None``), ``"full"``'s. An op kept is ``PREFER_SAVE``, not ``MUST_SAVE``:
    AOTAutograd gives the tag to every op it traces from it, a linear's ``t(weight)`` too, and a
    view of an FSDP-gathered weight kept must-save would keep the whole gathered weight."""
    if option is None or option == "full":
        return _full
    if option == "selective":
        copied = {n for site in ctx.sites if isinstance(site, AttentionSite) and op_kind(site.core) == "hybrid_attention"
                  for n in site.q + site.k + site.v}
        return functools.partial(_selective, copied=copied)
    return lambda node: _asked(option, node)


def _asked(policy: Callable, node: fx.Node) -> CheckpointPolicy:
    """The user's ``policy`` for ``node``; what it raises or an answer of another type, an InvalidPlan naming the op."""
    asked = f"activation_checkpointing: the policy {getattr(policy, '__name__', policy)!r}"
    try:
        answer = policy(node)
    except Exception as e:
        raise InvalidPlan(f"{asked} raised {type(e).__name__} for {node.name} ({target_name(node)}): {e}") from e
    if isinstance(answer, CheckpointPolicy):
        return answer
    if isinstance(answer, bool):
        return CheckpointPolicy.PREFER_SAVE if answer else CheckpointPolicy.PREFER_RECOMPUTE
    raise InvalidPlan(f"{asked} answered {answer!r} for {node.name} ({target_name(node)}); it must answer a bool "
                      f"(True: keep the output) or a torch.utils.checkpoint.CheckpointPolicy")


def _join_served_regions(gm: fx.GraphModule) -> None:
    """Give each op outside every region whose readers are all in one region (a collective or a
    reshape that a pass inserted for them) that region, last op first: a chain of such ops
    joins the region it feeds."""
    for node in reversed(gm.graph.nodes):
        if node.op not in _OPS or recompute_region(node) is not None or not node.users:
            continue
        served = {recompute_region(u) for u in node.users}
        if len(served) == 1 and None not in served:
            set_recompute_region(node, served.pop())


def recompute_pass(gm: fx.GraphModule, ctx: ParallelContext) -> fx.GraphModule:
    """Tag each op of a region for the partitioner, as its policy says (``recompute``,
    ``ac_graph_id``); with ``activation_checkpointing``, the regions are the blocks
    (``block_regions``). An FSDP gather keeps its own choice: one that reshards after forward
    (``meta.mark_fsdp_gather``) takes its readers' region, so that the partitioner gathers it
    again rather than keep it as the region's input; one that does not is kept from forward."""
    option = ctx.config.activation_checkpointing
    if option is None:
        _warn_of_unapplied_policies(ctx, gm)
    else:
        block_regions(gm, ctx)
    _warn_of_writes_in_regions(gm, ctx)
    _warn_of_whole_regions(gm, ctx)
    _join_served_regions(gm)
    policy = region_policy(option, ctx)
    for node in gm.graph.nodes:
        region = recompute_region(node)
        if region is not None and is_fsdp_gather(node) and "recompute" not in node.meta:
            set_recompute_region(node, None)
        elif region is not None:
            node.meta.update(recompute=node.meta["recompute"] if is_fsdp_gather(node) else policy(node),
                             ac_graph_id=region.index)
    ctx.recompute_regions = list(dict.fromkeys(r for n in gm.graph.nodes if (r := recompute_region(n))))
    return gm


def _written_inputs(node: fx.Node) -> list[fx.Node]:
    """The graph inputs (a module buffer, a kv cache) ``node`` writes in place, through views."""
    if writes_in_place(node) or node.target is operator.setitem:
        written = [node.args[0]]
    elif node.target in (F.batch_norm, torch.batch_norm) and arguments(node).get("training"):
        written = [arguments(node)[name] for name in ("running_mean", "running_var")]
    else:
        return []
    return [root for value in written if isinstance(value, fx.Node) and (root := storage(value)).op == "placeholder"]


def _warn_of_unapplied_policies(ctx: ParallelContext, gm: fx.GraphModule) -> None:
    for region in dict.fromkeys(r for n in gm.graph.nodes if (r := recompute_region(n)) and r.selective):
        ctx.warn(f"activation checkpointing: the checkpointed region {region.name} has a context_fn (a selective "
                 f"policy) that hybrid_parallel does not apply: backward recomputes every op of the region; "
                 f"activation_checkpointing='selective' or a policy callable chooses what is kept")


def _warn_of_writes_in_regions(gm: fx.GraphModule, ctx: ParallelContext) -> None:
    for node in gm.graph.nodes:
        region = recompute_region(node)
        for written in _written_inputs(node) if region is not None else ():
            name = module_paths(gm).get(written.name, written.name)
            ctx.warn(f"activation checkpointing: {node.name} ({target_name(node)}) writes the input {name} "
                     f"in place inside the checkpointed region {region.name}: it is written once per step, in "
                     f"forward, as without checkpointing (eager torch.utils.checkpoint writes it again when "
                     f"backward recomputes the region)")


def _warn_of_whole_regions(gm: fx.GraphModule, ctx: ParallelContext) -> None:
    """Name each region whose linears all run whole on every rank: the planner found nothing
    to cut in it (the warnings before say why)."""
    linears: dict[RecomputeRegion, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        if recompute_region(node) is not None and op_kind(node) in CONTRACTIONS:
            linears.setdefault(recompute_region(node), []).append(node)
    for region, ops in linears.items():
        if ctx.mesh.plan_dims and all(all(p == Replicate() for p in placements(n).values()) for n in ops):
            ctx.warn(f"activation checkpointing: the checkpointed region {region.name} runs whole on every rank: "
                     f"none of its {len(ops)} linears is cut on any mesh dim (see the warnings above for why)")
