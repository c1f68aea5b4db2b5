"""Graph dumps: what each pass made of a graph, the collectives, the plan as JSON, the mesh.

A dump folder holds, for one compiled graph: ``0_dynamo.py`` (the graph as Dynamo captured
it), one file per step of ``passes.steps`` (``1_capture.py`` ... ``14_recompute.py``, the graph
the inner backend compiles), ``15_aten.py`` (with the functional lowering, its forward traced to
aten ops on fake tensors: the functional collectives gloo and NCCL run, as they are),
``sites.txt``, ``collectives.md``, ``plan.json`` and ``mesh.svg``.
"""

from __future__ import annotations

import itertools
import json
import math
import os
from collections import Counter
from xml.sax.saxutils import escape

import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx

from .ops.experts import combine_rows, dispatch_rows, experts_from_rows
from .ops.lowerings import FUNCTIONAL
from .passes.context import ParallelContext
from .passes.experts import group_text
from .passes.localize import graph_communications
from .passes.meta import communications, global_shape, param_fqn, placements, shardings, site_role
from .passes.nodes import target_name
from .passes.saved import kept_for_backward
from .passes.sites import AttentionSite, MoESite, module_name, site_weight_names
from .passes.steps import STEPS
from .params import expert_dim, expert_group, held_layouts, held_tensor
from .placements import Replicate, Shard, describe, local_shape_on

PLAN_VERSION = 6
"""2: parameter_state, coverage, bytes_per_rank is what the rank holds; 3: lowering, replica-group
sets; 4: batch (the dp dims); 5: fsdp, and each parameter's fsdp placement; 6: activations (kept
for backward, activation checkpointing)."""


def _format_arg(a) -> str:
    if isinstance(a, fx.Node):
        return a.name
    if isinstance(a, (list, tuple)):
        inner = ", ".join(_format_arg(x) for x in a)
        return f"[{inner}]" if isinstance(a, list) else f"({inner}{',' if len(a) == 1 else ''})"
    return repr(a)


def node_line(node: fx.Node) -> str:
    """One node as code, with its shape, placements and site as a comment."""
    args = node.args[1:] if node.op == "call_method" else node.args
    parts = [_format_arg(a) for a in args] + [f"{k}={_format_arg(v)}" for k, v in node.kwargs.items()]
    if node.op == "placeholder":
        code = f"{node.name} = input({node.target!r})"
    elif node.op == "output":
        code = f"return {_format_arg(node.args[0])}"
    elif node.op == "call_method":
        code = f"{node.name} = {_format_arg(node.args[0])}.{node.target}({', '.join(parts)})"
    else:
        code = f"{node.name} = {target_name(node)}({', '.join(parts)})"
    fqn, shape = param_fqn(node), global_shape(node)
    notes = [fqn] if fqn is not None else []
    if shape is not None:
        notes.append(str(list(shape)))
    for dim, sharding in shardings(node).items():
        ins = f" <- {describe(sharding.inputs)}" if sharding.inputs else ""
        notes.append(f"{dim}: {describe(sharding.out)}{ins}")
    for c in communications(node):
        notes.append(f"comm fwd={c.forward} bwd={c.backward} over {c.mesh_dim}[{c.group_size}]")
    if site_role(node):
        notes.append(site_role(node))
    return code + (f"  # {'  '.join(notes)}" if notes else "")


def graph_text(gm: fx.GraphModule) -> str:
    return "\n".join(node_line(n) for n in gm.graph.nodes) + "\n"


def sites_text(ctx: ParallelContext) -> str:
    lines = []
    for site in ctx.sites:
        def names(nodes):
            return [module_name(n, ctx) for n in nodes]
        if isinstance(site, AttentionSite):
            lines.append(f"{site.name}: attention {site.core.name}, {site.num_heads} heads, "
                         f"{site.num_kv_heads} kv heads; q={names(site.q)} k={names(site.k)} "
                         f"v={names(site.v)} out={names(site.out)}")
        elif isinstance(site, MoESite):
            lines.append(f"{site.name}: {site.num_experts} experts, top-{site.top_k}, router={names([site.router])} "
                         f"(replicated); up={names(site.up)} down={names(site.down)}; {experts_per_rank(site, ctx)}")
        else:
            lines.append(f"{site.name}: mlp up={names(site.up)} down={names(site.rowwise)} "
                         f"activations={[a.name for a in site.activations]}")
    return "".join(f"{line}\n" for line in lines)  # no sites: no line


def experts_per_rank(site: MoESite, ctx: ParallelContext) -> str:
    """How many of a mixture's experts each rank holds, and how much of each; with expert
    parallelism, the rows one rank sends to them and gets back per layer (once localized and
    lowered)."""
    split = all(name in ctx.param_placements for name in site_weight_names(site))
    tp, ep, group = ctx.mesh.size("tp"), site.ep_size, group_text(ctx.mesh, expert_group(ctx.mesh))
    held = f"{site.num_experts // ep} of {site.num_experts} (ep over {group})" if ep > 1 else f"{site.num_experts}"
    line = f"experts per rank: {held}, " + (f"each 1/{tp} of its features (tp)" if split else "each whole")
    weights = [communications(n)[0] for n in site.down[0].graph.nodes
               if n.target is experts_from_rows and site_role(n) == f"{site.name}.experts" and communications(n)]
    if weights:
        line += (f"; the experts' weights (an nn.ModuleList's, held cut) sent whole to their ranks per layer: "
                 f"{sum(c.forward_bytes for c in weights)} B, their gradients back "
                 f"{sum(c.backward_bytes for c in weights)} B")
    exchanged = {n.target: communications(n)[0] for n in site.region
                 if n.target in (dispatch_rows, combine_rows) and communications(n)}
    if len(exchanged) != 2:
        return line
    sent, back = exchanged[dispatch_rows].forward_bytes, exchanged[combine_rows].forward_bytes
    if ctx.comm != FUNCTIONAL:
        line += (f"; rows to the experts per layer: {sent} B sent and {back} B back, padded to the worst case (even "
                 f"all-to-alls over {group}: the {ctx.comm} lowering)")
    else:
        line += (f"; rows to the experts per layer: {sent} B sent, {back // ep} B back with even routing, {back} B "
                 f"at most (all-to-alls over {group})")
    return line


def batch_line(ctx: ParallelContext) -> str | None:
    """How the batch meets the dp dims: which inputs are cut along which dim (and which of the
    batch's size stay whole), or that each dp rank is given its own slice; None without dp."""
    if ctx.mesh.size("dp") == 1:
        return None
    dp = f"dp_replicate x dp_shard = {ctx.mesh.size('dp')}"
    if ctx.config.batch == "local":
        return f"batch: local, each of {dp} ranks given its own slice; parameter gradients averaged over dp"
    cut = ", ".join(f"{name} dim {p.dim}" for name, p in ctx.input_cuts.get("dp", {}).items())
    sized = (f" (of the batch's size, but no dim of theirs reaches the sites' batch: {', '.join(ctx.batch_sized_whole)})"
             if ctx.batch_sized_whole else "")
    return f"batch: global, cut over {dp} along {cut or 'no input (warned)'}; other inputs whole{sized}"


def fsdp_line(ctx: ParallelContext) -> str | None:
    """Which parameters FSDP cuts, over which mesh dims, and which it holds as tp cuts them
    (no dim of theirs divides; not the expert weights ep cuts); None where nothing is cut (not
    parallelized, or no fsdp dim)."""
    layouts = held_layouts(ctx)
    cut = [name for name, layout in layouts.items() if layout.fsdp_dim is not None]
    if not cut:
        return None
    fsdp = layouts[cut[0]].fsdp
    spans = " x ".join(ctx.mesh.spanned(fsdp.name))
    whole = [ctx.params[name].fqn for name, layout in layouts.items() if name not in cut and layout.ep is None]
    return (f"fsdp: {len(cut)} of {len(layouts)} parameters cut over {spans} = {fsdp.size}, gathered at use one "
            f"block at a time" + (f"; held as tp cuts them (no dim divides): {', '.join(whole)}" if whole else ""))


def activations(gm: fx.GraphModule, ctx: ParallelContext) -> dict:
    """What a rank keeps for backward (``passes.saved``), with its checkpointed regions and
    without, and what backward recomputes: plan.json's ``activations``."""
    kept, without = kept_for_backward(gm), kept_for_backward(gm, checkpointing=False)
    option = ctx.config.activation_checkpointing
    policy = (None if not ctx.recompute_regions else "full (the model's torch.utils.checkpoint)" if option is None
              else option if isinstance(option, str) else f"policy {getattr(option, '__name__', option)}")
    return {"kept_bytes": kept.bytes, "kept_bytes_without_checkpointing": without.bytes, "policy": policy,
            "regions": [r.name for r in ctx.recompute_regions], "recomputed_flops": kept.recomputed_flops,
            "recomputed_collectives": kept.recomputed_collectives, "recomputed_bytes": kept.recomputed_bytes}


def activations_line(kept: dict) -> str:
    """``activations``' line in explain's report."""
    line = f"activations kept for backward: {kept['kept_bytes']:,} bytes per rank"
    if kept["policy"] is None:
        return line + " (no activation checkpointing)"
    return (f"{line} with activation checkpointing ({kept['policy']}, {len(kept['regions'])} regions), "
            f"{kept['kept_bytes_without_checkpointing']:,} without; backward recomputes "
            f"{kept['recomputed_flops']:,} FLOPs and {kept['recomputed_collectives']} collectives "
            f"({kept['recomputed_bytes']:,} bytes)")


def collective_rows(gm: fx.GraphModule) -> list[dict]:
    """Collectives of a localized graph grouped by (direction, op, dim, size, bytes, site)."""
    counts = Counter()
    for _, c in graph_communications(gm):
        for direction, op, nbytes in (("forward", c.forward, c.forward_bytes),
                                      ("backward", c.backward, c.backward_bytes)):
            if op:
                counts[(direction, op, c.mesh_dim, c.group_size, nbytes, c.site or "-")] += 1
    keys = ("direction", "op", "mesh_dims", "group_size", "bytes_per_rank", "site")
    return [{**dict(zip(keys, k)), "count": n} for k, n in counts.items()]


def collectives_markdown(rows: list[dict]) -> str:
    lines = ["| direction | op | mesh dims | group size | bytes per rank | count | site |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {r['direction']} | {r['op']} | {r['mesh_dims']} | {r['group_size']} | {r['bytes_per_rank']} "
              f"| {r['count']} | {r['site']} |" for r in rows]
    return "".join(f"{line}\n" for line in lines)  # no sites: no line


def parameter_rows(ctx: ParallelContext) -> list[dict]:
    """Each parameter: its placement, the local shape the graph computes with and the bytes
    this rank holds (its piece once parallelized, FSDP's cut included; the whole parameter before)."""
    rows = []
    for name, layout in held_layouts(ctx).items():
        info = ctx.params[name]
        shape, element = tuple(info.tensor.shape), held_tensor(info.tensor).element_size()  # param_dtype's stand-in
        held = layout.held_shape(shape) if ctx.feeding.sharded else shape
        rows.append({"name": info.fqn, "shape": list(shape), "placement": layout.describe(),
                     "local_shape": list(layout.computed_shape(shape)), "bytes_per_rank": math.prod(held) * element,
                     "bytes": math.prod(shape) * element})
    return rows


def planned_nodes(gm: fx.GraphModule) -> list[dict]:
    """Every node of a planned graph with its shape, placements and site."""
    nodes = []
    for n in gm.graph.nodes:
        nodes.append({"name": n.name, "op": n.op, "target": target_name(n),
                      "shape": list(global_shape(n)) if global_shape(n) is not None else None,
                      "placement": {dim: {"out": describe(s.out), "inputs": describe(s.inputs)}
                                    for dim, s in shardings(n).items()},
                      "site": site_role(n)})
    return nodes


def plan_dict(nodes: list[dict], local_gm: fx.GraphModule, ctx: ParallelContext) -> dict:
    """The plan with stable keys: mesh, sites, parameters, nodes, collectives, warnings, coverage."""
    return {
        "version": PLAN_VERSION,
        "mesh": {name: ctx.mesh.size(name) for name in ctx.mesh.order},
        "world_size": ctx.mesh.world_size,
        "parameter_state": ctx.feeding.state_on(ctx.mesh, ctx.config),
        "sites": sites_text(ctx).splitlines(),
        "batch": batch_line(ctx),
        "fsdp": fsdp_line(ctx),
        "parameters": parameter_rows(ctx),
        "nodes": nodes,
        "collectives": collective_rows(local_gm),
        "collectives_lowering": ctx.comm,
        "replica_group_sets": {what: [list(g) for g in groups] for what, groups in ctx.replica_group_sets.items()},
        "warnings": list(ctx.warnings),
        "coverage": ctx.coverage.as_dict(),
        "activations": activations(local_gm, ctx),
    }


def mesh_svg(sizes: dict[str, int], order: tuple[str, ...], sites: list[str] | None = None) -> str:
    """Ranks as a grid: one panel per coordinate of the outer dims (all but the last two),
    rows along the middle dim, columns along the innermost (contiguous) dim. Innermost groups
    are the filled rows, middle-dim groups the dashed columns, outer-dim groups share a cell
    position."""
    *outer_dims, middle_dim, inner_dim = order
    outer, middle, inner = math.prod(sizes[d] for d in outer_dims), sizes[middle_dim], sizes[inner_dim]
    panels = list(itertools.product(*(range(sizes[d]) for d in outer_dims)))
    cell, gap, pad = 44, 24, 20
    panel_w, panel_h = inner * cell, middle * cell
    site_lines = sites or []
    title = (f'mesh {" x ".join(f"{d}={sizes[d]}" for d in order)} ({outer * middle * inner} ranks; '
             f'last dim contiguous)')
    legend = (f"filled rows: {inner_dim} groups; dashed columns: {middle_dim} groups; "
              f"same cell across panels: {' x '.join(outer_dims)} groups")
    char_width = 7.3  # 12px monospace
    longest = max(len(line) for line in [title, legend] + site_lines)
    width = int(max(pad * 2 + outer * panel_w + (outer - 1) * gap, pad * 2 + longest * char_width))
    height = pad + 30 + panel_h + 40 + 16 * len(site_lines)
    colors = ["#cfe3ff", "#ffe0b3", "#d6f5d6", "#f5d6f0", "#fff5b3", "#d6f0f5", "#e8d6f5", "#f5dcd6"]
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'font-family="monospace" font-size="12">',
           f'<rect width="{width}" height="{height}" fill="white"/>',
           f'<text x="{pad}" y="{pad + 4}">{escape(title)}</text>']
    top = pad + 30
    for o in range(outer):
        x0 = pad + o * (panel_w + gap)
        label = ",".join(f"{d}={c}" for d, c in zip(outer_dims, panels[o]))
        out.append(f'<text x="{x0}" y="{top - 6}">{escape(label)}</text>')
        for m in range(middle):
            y = top + m * cell
            out.append(f'<rect x="{x0 + 2}" y="{y + 2}" width="{panel_w - 4}" height="{cell - 4}" rx="8" '
                       f'fill="{colors[(o * middle + m) % len(colors)]}" stroke="#555"/>')
            for i in range(inner):
                rank = (o * middle + m) * inner + i
                out.append(f'<text x="{x0 + i * cell + cell / 2}" y="{y + cell / 2 + 4}" '
                           f'text-anchor="middle">{rank}</text>')
        for i in range(inner):
            out.append(f'<rect x="{x0 + i * cell + 6}" y="{top - 2}" width="{cell - 12}" height="{panel_h + 4}" '
                       f'fill="none" stroke="#c33" stroke-dasharray="4 3"/>')
    legend_y = top + panel_h + 24
    out.append(f'<text x="{pad}" y="{legend_y}">{escape(legend)}</text>')
    for k, line in enumerate(site_lines):
        out.append(f'<text x="{pad}" y="{legend_y + 20 + 16 * k}">{escape(line)}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def site_placement_lines(ctx: ParallelContext) -> list[str]:
    """Per site, the tp placement of each of its weights and experts' bias tables (and, with ep,
    the mesh dims an expert weight's experts are cut over; or those one expert's weight, an
    ``nn.ModuleList``'s, is cut over along a dim of its own, and sent whole to its expert's rank);
    then the token embeddings' tables and LM heads cut by the vocabulary."""
    lines, group = [], group_text(ctx.mesh, expert_group(ctx.mesh))
    for site in ctx.sites:
        weights, names = [], site_weight_names(site)
        names += [bias.table.name for bias in site.biases.values()] if isinstance(site, MoESite) else []
        for name in names:
            dim = expert_dim(ctx, name)
            experts = "" if dim is None else f" (experts cut over {group})" if name not in site.sent_whole else \
                f" ({describe(Shard(dim))} over {group}, sent whole to its expert's rank at each use)"
            weights.append(f"{ctx.params[name].fqn}={describe(ctx.param_placements.get(name, Replicate()))}{experts}")
        lines.append(f"{site.name}: " + ", ".join(weights))
    by_vocab = [f"{ctx.params[name].fqn}={describe(ctx.param_placements[name])}" for name in ctx.vocab_cuts
                if name in ctx.param_placements]
    return lines + ([f"cut by vocabulary (token embeddings, LM heads): {', '.join(by_vocab)}"] if by_vocab else [])


def aten_code(gm: fx.GraphModule, ctx: ParallelContext) -> str:
    """The local graph's forward at aten level, traced on fake tensors (nothing is sent)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    held = held_layouts(ctx) if ctx.feeding.sharded else {}
    inputs = []
    for node, value in zip(placeholders, ctx.example_inputs):
        if isinstance(value, torch.Tensor):
            shape = held[node.name].held_shape(value.shape) if node.name in held else \
                local_shape_on(value.shape, placements(node), ctx.mesh)
            value = torch.empty(shape, dtype=value.dtype)
        inputs.append(value)
    with torch.no_grad():
        return make_fx(gm, tracing_mode="fake")(*inputs).code


class GraphDump:
    """Writes one folder per compiled graph; ``after`` is called after every pass."""

    def __init__(self, folder: str, order: tuple[str, ...]):
        self.folder, self.order = folder, order
        os.makedirs(folder, exist_ok=True)
        self.step = 0
        self.nodes: list[dict] = []

    def _write(self, name: str, text: str) -> None:
        with open(os.path.join(self.folder, name), "w") as f:
            f.write(text)

    def captured(self, gm: fx.GraphModule) -> None:
        self._write("0_dynamo.py", gm.code)

    def after(self, name: str, gm: fx.GraphModule, ctx: ParallelContext) -> None:
        """The graph step ``name`` (``passes.steps``) left; after detect the sites, after plan the
        placements, after the last step the plan, its collectives and its mesh."""
        self.step += 1
        self._write(f"{self.step}_{name}.py", graph_text(gm))
        if name == "detect":
            self._write("sites.txt", sites_text(ctx))
        if name == "plan":
            self.nodes = planned_nodes(gm)
        if name == STEPS[-1].name:
            if ctx.comm == FUNCTIONAL:
                self._write(f"{self.step + 1}_aten.py", aten_code(gm, ctx))
            plan = plan_dict(self.nodes, gm, ctx)
            # default=str: a symbolic size among a node's arguments (s48 - 2) is written as it prints
            self._write("plan.json", json.dumps(plan, indent=1, sort_keys=True, default=str) + "\n")
            self._write("collectives.md", collectives_markdown(plan["collectives"]))
            sizes = {d: ctx.mesh.size(d) for d in ctx.mesh.order}
            self._write("mesh.svg", mesh_svg(sizes, self.order, site_placement_lines(ctx)))
