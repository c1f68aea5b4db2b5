"""A pipeline's bubble from each action's own CPU time, replayed: what the step would take with a
core per rank, measured on a machine that has fewer (or shares them).

On each rank, ``ActionRecorder`` times every forward and backward of a stage's microbatch that
torch's schedule runs, as the thread's CPU time (``time.thread_time``: a rank that waits for a
core, or for a send, is not charged for it). ``replay`` then runs every rank's actions in the order
the rank ran them, each as soon as the rank's previous action and the action it depends on have
ended: forward i of stage s after forward i of stage s-1; backward i of stage s after backward i of
stage s+1, and the last stage's after its own forward i. Communication is not replayed (a send
takes no time), nor what the schedule runs beside the stages' compute (the receive waits, the
gradients' final scaling, the loss's broadcast): the replayed bubble is the schedule's own.
Backwards split into input and weight gradients (the zero-bubble schedules) are not recorded.
"""

from __future__ import annotations

import functools
import statistics
import time
from dataclasses import dataclass
from typing import NamedTuple


class Action(NamedTuple):
    """One action a rank ran: ``kind`` "F" (forward) or "B" (backward) of ``stage`` on ``microbatch``."""

    kind: str
    stage: int
    microbatch: int
    seconds: float


class ActionRecorder:
    """Times the actions torch's ``schedule`` runs on this rank, by wrapping (on the instances, the
    library untouched) each stage's ``forward_one_chunk`` and ``backward_one_chunk`` and the
    schedule's ``_maybe_compute_loss``, whose time counts with the last stage's forward it follows.
    ``step()`` starts a step's list; ``actions()`` is each action's median over the steps."""

    def __init__(self, schedule):
        stages = getattr(schedule, "_stages", None) or [schedule._stage]
        self._steps: list[list[Action]] = []
        for stage in stages:
            stage.forward_one_chunk = self._timed(stage.forward_one_chunk, "F", stage.stage_index)
            stage.backward_one_chunk = self._timed(stage.backward_one_chunk, "B", stage.stage_index)
        loss = schedule._maybe_compute_loss

        @functools.wraps(loss)
        def timed_loss(stage, output, target_mbs, mb_index, *rest):
            start = time.thread_time()
            result = loss(stage, output, target_mbs, mb_index, *rest)
            if self._steps:
                last = self._steps[-1][-1]
                assert (last.kind, last.stage, last.microbatch) == ("F", stage.stage_index, mb_index), last
                self._steps[-1][-1] = last._replace(seconds=last.seconds + time.thread_time() - start)
            return result

        schedule._maybe_compute_loss = timed_loss

    def _timed(self, run, kind: str, stage: int):
        @functools.wraps(run)
        def timed(microbatch, *args, **kwargs):
            start = time.thread_time()
            result = run(microbatch, *args, **kwargs)
            if self._steps:
                self._steps[-1].append(Action(kind, stage, microbatch, time.thread_time() - start))
            return result

        return timed

    def step(self) -> None:
        """Record the actions of the step that follows (until then, none are: the warm-up's compile)."""
        self._steps.append([])

    def actions(self) -> list[Action]:
        """This rank's actions in the order it ran them, each the median of its time over the recorded steps."""
        orders = {tuple(a[:3] for a in step) for step in self._steps}
        assert len(orders) == 1, f"the schedule ran its actions in {len(orders)} different orders"
        return [Action(*key, statistics.median(step[i].seconds for step in self._steps))
                for i, key in enumerate(next(iter(orders)))]


@dataclass(frozen=True)
class Replay:
    step_seconds: float  # when the last action ends
    busy_seconds: list[float]  # each rank's actions' summed time

    @property
    def bubble(self) -> float:
        """The share of the step the busiest rank idles: 1 - its summed action time / the step."""
        return 1 - max(self.busy_seconds) / self.step_seconds


def _dependency(action: Action, last_stage: int) -> tuple[str, int, int] | None:
    """The action ``action`` waits for, as (kind, stage, microbatch); None for the first stage's forwards."""
    if action.kind == "F":
        return ("F", action.stage - 1, action.microbatch) if action.stage > 0 else None
    if action.stage == last_stage:
        return "F", action.stage, action.microbatch
    return "B", action.stage + 1, action.microbatch


def replay(ranks: list[list[Action]]) -> Replay:
    """The step ``ranks`` (each rank's actions, in the order it ran them) take when each action
    starts once its rank's previous action and its dependency have ended."""
    last_stage = max(a.stage for actions in ranks for a in actions)
    ended: dict[tuple[str, int, int], float] = {}
    free, position = [0.0] * len(ranks), [0] * len(ranks)
    while any(position[r] < len(actions) for r, actions in enumerate(ranks)):
        moved = False
        for r, actions in enumerate(ranks):
            while position[r] < len(actions):
                action = actions[position[r]]
                waits_for = _dependency(action, last_stage)
                if waits_for is not None and waits_for not in ended:
                    break
                free[r] = max(free[r], ended.get(waits_for, 0.0)) + action.seconds
                ended[action[:3]] = free[r]
                position[r] += 1
                moved = True
        if not moved:
            waiting = {r: actions[position[r]][:3] for r, actions in enumerate(ranks) if position[r] < len(actions)}
            raise ValueError(f"replay: every rank waits for an action no rank can run next (each rank's next, "
                             f"as kind, stage, microbatch: {waiting})")
    return Replay(max(free), [sum(a.seconds for a in actions) for actions in ranks])
