"""Score functions: what attention written out by hand does to its scores between ``q @ kT``
and the softmax (a scale, Gemma2's soft-capping ``tanh(s / c) * c``), as a chain of steps
each ring block and the Ulysses kernel apply to their own tile of scores.

It is FlexAttention's ``score_mod`` restricted to functions of the score alone: masks and
biases built from positions travel beside it, as for SDPA (causal, a window, a key padding),
so no tile ever needs the whole sequence. Each step's derivative is known in closed form
(``d/ds c * tanh(s / c)`` is ``1 - tanh^2(s / c)``), so a block's backward applies the chain
rule itself, with no autograd inside the ring's backward.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

# step: (its value at x with constant c, its derivative from its value y and c)
_STEPS = {
    "mul": (lambda x, c: x * c, lambda y, c: c),
    "div": (lambda x, c: x / c, lambda y, c: 1.0 / c),
    "add": (lambda x, c: x + c, lambda y, c: 1.0),
    "sub": (lambda x, c: x - c, lambda y, c: 1.0),
    "rsub": (lambda x, c: c - x, lambda y, c: -1.0),
    "neg": (lambda x, c: -x, lambda y, c: -1.0),
    "tanh": (lambda x, c: torch.tanh(x), lambda y, c: 1.0 - y * y),
}
STEPS = tuple(_STEPS)


class ScoreMod(NamedTuple):
    """The steps ``(name, constant)`` applied to the scores in order, ``name`` one of ``STEPS``
    (the constant of ``neg`` and ``tanh`` is unused). A named tuple, so a graph holds it as
    a call's argument and prints it as code."""

    steps: tuple[tuple[str, float], ...]

    def __call__(self, scores: torch.Tensor) -> torch.Tensor:
        for name, constant in self.steps:
            scores = _STEPS[name][0](scores, constant)
        return scores

    def codes(self) -> tuple[list[int], list[float]]:
        """The steps as ``STEPS`` indices and constants: arguments a custom op takes."""
        return [STEPS.index(name) for name, _ in self.steps], [constant for _, constant in self.steps]

    @classmethod
    def from_codes(cls, codes: list[int], constants: list[float]) -> "ScoreMod":
        return cls(tuple((STEPS[code], constant) for code, constant in zip(codes, constants)))

    def with_derivative(self, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | float]:
        """The modified scores and their derivative by the raw scores (the chain rule, step by step)."""
        slope = 1.0
        for name, constant in self.steps:
            value, derivative = _STEPS[name]
            scores = value(scores, constant)
            slope = slope * derivative(scores, constant)
        return scores, slope
