"""Factories for ``python -m dtensor_par explain``: each returns (model, example_inputs)."""

import torch

from dtensor_par._testing import models


def gpt():
    torch.manual_seed(0)
    return models.GPT(layers=2, hidden=64, heads=8, mlp=128), (torch.randn(2, 16, 64),)


def minimax_like():
    """56 heads, as MiniMax-H3: TP alone stops at 8. Weights on the meta device."""
    with torch.device("meta"):
        model = models.Llama(vocab=1000, layers=2, hidden=56 * 64, heads=56, kv_heads=8, mlp=4096)
        ids = torch.randint(0, 1000, (1, 256))
    return model, (ids,)
