"""The suite's two tiers.

``python -m pytest tests`` (CI, the README's command) runs every capability once: each mesh
dim and pair of dims, each kind of site, each entry point, on the project's own models and one
model of each family. ``--sweep`` adds the repeats: the same numerics at more meshes and
models, the full pipeline and checkpoint matrices. Whoever stops runs the sweep and reports it.

The split exists because 82% of a launched case is Dynamo tracing the model on every rank:
two cores cannot trace every family at every mesh within CI's time. A repeat is marked
``sweep`` (``case``) and left out of its launch (``running``, ``kept``); without ``--sweep`` it is
reported skipped, never silently absent.
"""

from __future__ import annotations

import pytest

SWEEP = False
"""``--sweep`` given: set by ``tests/conftest.py`` before any test module is imported."""

MARK = pytest.mark.sweep


def case(*values, sweep: bool, id: str | None = None):
    """One parametrized case, marked ``sweep`` when it is a repeat."""
    return pytest.param(*values, marks=[MARK] if sweep else [], id=id)


def kept(key, sweep) -> bool:
    """Whether a launch runs the case ``key`` this session: every case under ``--sweep``, else
    those not in ``sweep``."""
    return SWEEP or key not in sweep


def running(cases, sweep, key=lambda case: case):
    """The cases a launch runs this session (``kept``): of a dict by label, or of a list, each
    looked up in ``sweep`` as ``key`` of its label or item."""
    if isinstance(cases, dict):
        return {label: case for label, case in cases.items() if kept(key(label), sweep)}
    return [case for case in cases if kept(key(case), sweep)]
