"""``benchmarks.pipeline_replay.replay`` on hand-made action lists whose step is known: GPipe and
1F1B with every stage equally fast take (pp - 1 + m) (forward + backward), a bubble of
(pp - 1)/(m + pp - 1). Pure Python, no launch."""

from __future__ import annotations

import pytest

from benchmarks.pipeline_replay import Action, replay

FORWARD, BACKWARD = 1.0, 2.0


def _gpipe(pp: int, m: int) -> list[list[Action]]:
    """Rank r runs stage r: every forward, then every backward."""
    return [[Action("F", r, i, FORWARD) for i in range(m)] + [Action("B", r, i, BACKWARD) for i in range(m)]
            for r in range(pp)]


def _one_f_one_b(pp: int, m: int) -> list[list[Action]]:
    """Rank r runs stage r: pp - 1 - r warm-up forwards, then a forward and a backward in turn, then
    the backwards left."""
    ranks = []
    for r in range(pp):
        warmup = min(pp - 1 - r, m)
        actions = [Action("F", r, i, FORWARD) for i in range(warmup)]
        for i in range(m - warmup):
            actions += [Action("F", r, warmup + i, FORWARD), Action("B", r, i, BACKWARD)]
        actions += [Action("B", r, i, BACKWARD) for i in range(m - warmup, m)]
        ranks.append(actions)
    return ranks


@pytest.mark.parametrize("order", [_gpipe, _one_f_one_b])
@pytest.mark.parametrize("pp,m", [(2, 4), (2, 8), (4, 4), (4, 8)])
def test_replay_of_equal_stages_has_the_predicted_bubble(order, pp, m):
    replayed = replay(order(pp, m))
    assert replayed.step_seconds == (m + pp - 1) * (FORWARD + BACKWARD)
    assert replayed.busy_seconds == [m * (FORWARD + BACKWARD)] * pp
    assert replayed.bubble == pytest.approx((pp - 1) / (m + pp - 1), abs=1e-12)


def test_replay_waits_for_the_slowest_stage():
    """A last stage twice as slow: the first stage's backwards wait for it, and it is never idle
    after its first forward (its step: one forward of stage 0, then all of its own work)."""
    ranks = _gpipe(2, 4)
    ranks[1] = [a._replace(seconds=2 * a.seconds) for a in ranks[1]]
    replayed = replay(ranks)
    assert replayed.step_seconds == FORWARD + 4 * 2 * (FORWARD + BACKWARD) + BACKWARD
    assert replayed.bubble == pytest.approx(1 - 24 / 27)


def test_replay_refuses_orders_that_wait_on_each_other():
    ranks = [[Action("B", 0, 0, 1.0), Action("F", 0, 0, 1.0)], [Action("F", 1, 0, 1.0), Action("B", 1, 0, 1.0)]]
    with pytest.raises(ValueError, match=r"every rank waits .*0: \('B', 0, 0\), 1: \('F', 1, 0\)"):
        replay(ranks)
