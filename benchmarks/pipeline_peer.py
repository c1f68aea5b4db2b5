"""torchtitan-style pipeline parallelism beside ``dtensor_par.pipeline``: the same toy Llama split
into stages by hand, as torchtitan splits its models, run by the same torch schedule.

torchtitan deep-copies the model once per stage the rank holds, deletes the layers outside the
stage, sets the embedding to None outside the first stage and the norm and head outside the last
(its model's forward skips what is None), compiles each stage and wraps it in torch's
``PipelineStage``; stage s runs on pp rank s % pp (its loop-style assignment, two stages a rank for
Interleaved1F1B). ``HandSplitStep`` does that with the layers split evenly (``pipeline`` cuts by
cost: its stages' block counts are in the results), each stage compiled whole
(``nn.Module.compile``) with the inner backend ``dtensor_par.pipeline`` compiles its stages with,
and returns the mean loss on every rank as ``PipelineStep`` does (a broadcast from the last
stage's rank), so the two steps do the same work.
"""

from __future__ import annotations

import copy
import statistics

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import dtensor_par
from benchmarks.timing import slowest, timed
from dtensor_par._testing.models import Llama

STAGES_PER_RANK = {"GPipe": 1, "1F1B": 1, "Interleaved1F1B": 2}
"""The schedules the hand split runs, and the stages each puts on a rank (loop-style: stage s on rank s % pp)."""
LOSS_TOLERANCE = 1e-5
"""How far the two variants' losses may differ: the same weights, microbatches and ops."""


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, 1), target.flatten())


class HandStage(nn.Module):
    """Blocks ``blocks`` of a deep copy of ``model`` (a ``_testing.models.Llama``), with its embedding
    only if ``first``, its norm and head only if ``last``: a torchtitan stage. The blocks keep their
    indices as names (torchtitan's ``ModuleDict`` of layers), so the FQNs are the model's."""

    def __init__(self, model: Llama, blocks: range, *, first: bool, last: bool):
        super().__init__()
        whole = copy.deepcopy(model)
        self.embed = whole.embed if first else None
        self.blocks = nn.ModuleDict({str(i): whole.blocks[i] for i in blocks})
        self.norm = whole.norm if last else None
        self.lm_head = whole.lm_head if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) if self.embed is not None else x
        for block in self.blocks.values():
            h = block(h)
        return self.lm_head(self.norm(h)) if self.norm is not None else h


class HandSplitStep:
    """This rank's hand-split stages of ``model`` under torch's ``Schedule<schedule>``: ``step(ids,
    target)`` returns the mean loss over the microbatches on every rank."""

    def __init__(self, model: Llama, group, schedule: str, microbatches: int, inner_backend: str):
        from torch.distributed import pipelining

        if schedule not in STAGES_PER_RANK:
            raise ValueError(f"hand split: schedule {schedule!r} is not one of {list(STAGES_PER_RANK)}")
        pp, rank = dist.get_world_size(group), dist.get_rank(group)
        stages = pp * STAGES_PER_RANK[schedule]
        layers = len(model.blocks)
        if layers % stages:
            raise ValueError(f"hand split: {layers} blocks do not split evenly into {stages} stages")
        per_stage = layers // stages
        self.modules = [HandStage(model, range(s * per_stage, (s + 1) * per_stage), first=s == 0,
                                  last=s == stages - 1) for s in range(rank, stages, pp)]
        runners = []
        for s, module in zip(range(rank, stages, pp), self.modules):
            if inner_backend != "eager":
                module.compile(backend=inner_backend)
            runners.append(pipelining.PipelineStage(module, s, stages, torch.device("cpu"), group=group))
        self.schedule = getattr(pipelining, f"Schedule{schedule}")(
            runners if len(runners) > 1 else runners[0], n_microbatches=microbatches, loss_fn=loss_fn,
            scale_grads=True)
        self.group, self.rank, self.last_rank = group, rank, (stages - 1) % pp

    def parameters(self):
        for module in self.modules:
            yield from module.parameters()

    def __call__(self, ids: torch.Tensor, *, target: torch.Tensor) -> torch.Tensor:
        losses: list[torch.Tensor] = []
        inputs = (ids,) if self.rank == 0 else ()
        self.schedule.step(*inputs, target=target, losses=losses, return_outputs=False)
        loss = torch.stack([x.detach() for x in losses]).mean() if losses else torch.zeros(())
        dist.broadcast(loss, group=self.group, group_src=self.last_rank)
        return loss


def _train_step(step, ids: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The step timed on both sides: the schedule's forward and backward, then the gradients set
    to None (what ``optimizer.zero_grad()`` does); no optimizer step."""
    loss = step(ids, target=target)
    for p in step.parameters():
        p.grad = None
    return loss


def side_by_side(rank: int, world: int, *, setup: dict, schedule: str, microbatches: int, reps: int) -> dict:
    """The median training step of the hand split and of ``dtensor_par.pipeline`` (same model,
    weights, microbatches, schedule and loss), after one warm-up each, over ``reps`` repetitions
    alternated between the two, each in turn first; their losses asserted equal."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    sizes, backend = setup["sizes"], setup["inner_backend"]
    model = Llama(**sizes)
    batch = (setup["rows"] * microbatches, setup["seq"])
    ids, target = torch.randint(0, sizes["vocab"], batch), torch.randint(0, sizes["vocab"], batch)
    mesh = dtensor_par.init_mesh(pp=world)
    steps = {"hand": HandSplitStep(model, mesh.get_group("pp"), schedule, microbatches, backend),
             "ours": dtensor_par.pipeline(model, mesh, (ids,), loss_fn=loss_fn, microbatches=microbatches,
                                          schedule=schedule, inner_backend=backend)}
    losses = {name: _train_step(step, ids, target).item() for name, step in steps.items()}
    if abs(losses["hand"] - losses["ours"]) > LOSS_TOLERANCE:
        raise AssertionError(f"{schedule}, {microbatches} microbatches: the hand split's loss {losses['hand']!r} "
                             f"and pipeline's {losses['ours']!r} differ by more than {LOSS_TOLERANCE}")
    seconds: dict[str, list[float]] = {name: [] for name in steps}
    for rep in range(reps):  # each in turn first: what runs second finds the caches as the first left them
        for name, step in list(steps.items())[::1 if rep % 2 == 0 else -1]:
            seconds[name].append(slowest(timed(lambda: _train_step(step, ids, target))))
    return {"hand_ms": 1e3 * statistics.median(seconds["hand"]), "ours_ms": 1e3 * statistics.median(seconds["ours"]),
            "loss": losses["ours"], "loss_difference": abs(losses["hand"] - losses["ours"]),
            "ours_stage_blocks": [len(blocks) for blocks in steps["ours"].cut.blocks]}
