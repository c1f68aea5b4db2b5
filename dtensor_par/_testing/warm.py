"""Imported once by the process the test ranks fork from (``harness._RANK_PRELOAD``): one small
block compiled forward and backward with ``aot_eager``, so that Dynamo's and AOTAutograd's
first-use work (lazy imports, caches filled once a process) is done before the fork, not again
in each of the dozens of ranks a suite starts (about 1 CPU-s each). Dynamo's caches are reset
after it: each rank still compiles its own models afresh."""

import torch

from .models import GPTBlock

torch.set_num_threads(1)  # no OpenMP pool before the fork
_x = torch.randn(2, 8, 32, requires_grad=True)
torch.compile(GPTBlock(), backend="aot_eager")(_x).sum().backward()
torch._dynamo.reset()
del _x
