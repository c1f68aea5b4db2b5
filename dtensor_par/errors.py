"""The errors planning raises: on purpose, each saying what to change (``InvalidPlan``,
``NotSupported``), or for a defect of dtensor_par (``PlanningError``). Every floor may raise
them: the rules refuse what cannot run on shards, the passes what the mesh rules out."""

from __future__ import annotations

from .symbolic import NotSymbolic


class PlanningError(RuntimeError):
    """A pass could not handle one node. Names the node, its op, input shapes and placements."""


class InvalidPlan(ValueError):
    """What is asked cannot be planned as given (heads not divisible by tp, a sequence shorter
    than cp, replica groups the hardware cannot run): raised on purpose, the message says what
    to change."""


class NotSupported(NotImplementedError):
    """What the planner does not do (yet): raised on purpose, naming the node and a way around."""


USER_ERRORS = (InvalidPlan, NotSupported, NotSymbolic, ImportError, PlanningError)
"""Errors the passes raise on purpose, each with a message for the user (an ImportError: a
lowering's missing package). Anything else, a ValueError from unpacking too, is a defect of
ours and becomes a PlanningError naming where it happened."""
