"""Dynamic shapes: one plan and one inner compile serve every sequence length and batch size."""

from __future__ import annotations

import logging

import torch

import dtensor_par
from tests import models
from tests.harness import FORWARD_ATOL, GRAD_RTOL, compare, run_ranks

# Five lengths at two batch sizes: 13, 18 and 30 are padded over every mesh below (cp = 2, or
# 4 and 8 chunks in the zigzag layout), 16 and 24 are not.
SIZES = [(2, 16), (2, 13), (3, 18), (2, 24), (3, 30)]

# mesh sizes -> model; each mode runs every size in SIZES through one compiled model. Together
# they cover each mesh dim and both hybrids: tp x ulysses, tp x ring, ring x ulysses (Ulysses x
# ring attention); causal attention (zigzag) and bidirectional (the padded keys masked).
MODES = {
    "tp2_ulysses2": ({"tp": 2, "ulysses": 2}, lambda: models.Llama(layers=1)),
    "tp2_ring2": ({"tp": 2, "ring": 2}, lambda: models.MaskedAttention(None)),
    "ring2_ulysses2": ({"ring": 2, "ulysses": 2}, lambda: models.GPT(layers=1)),
}


def _inputs(name: str, batch: int, seq: int) -> tuple:
    if name == "tp2_ulysses2":
        return (torch.randint(0, 50, (batch, seq)),)
    return (torch.randn(batch, seq, 32),)


def _counting(compiles: list):
    """aot_eager, counting its calls: each is one inner compile of a local graph."""
    def inner(gm, example_inputs):
        compiles.append([tuple(x.shape) if isinstance(x, torch.Tensor) else x for x in example_inputs])
        return torch._dynamo.backends.debugging.aot_eager(gm, example_inputs)
    return inner


class _Log(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _run_modes(rank: int, world: int, names: list[str]) -> dict:
    results = {}
    for name in names:
        sizes, make_model = MODES[name]
        mesh = dtensor_par.init_mesh(**sizes)
        torch._dynamo.reset()
        torch.manual_seed(0)
        compiles = []
        backend = dtensor_par.hybrid_parallel(mesh, inner_backend=_counting(compiles))
        inputs = [_inputs(name, b, s) for b, s in SIZES]
        log = _Log()
        logging.getLogger("dtensor_par").addHandler(log)
        logging.getLogger("dtensor_par").setLevel(logging.INFO)
        try:
            metrics = compare(make_model(), inputs, lambda m: torch.compile(m, backend=backend, dynamic=True),
                              steps=1)
        finally:
            logging.getLogger("dtensor_par").removeHandler(log)
            logging.getLogger("dtensor_par").setLevel(logging.WARNING)
        symbolic = [c for c in compiles if any(isinstance(x, torch.SymInt) for x in c)]
        results[name] = {**metrics, "compiles": len(compiles), "symbolic_compiles": len(symbolic),
                         "plans": [m for m in log.messages if "hybrid_parallel: planned graph" in m]}

    # dynamic=False keeps today's behaviour: Dynamo specializes, and each size is planned for itself.
    mesh = dtensor_par.init_mesh(tp=world)
    torch._dynamo.reset()
    torch.manual_seed(0)
    compiles = []
    backend = dtensor_par.hybrid_parallel(mesh, inner_backend=_counting(compiles))
    metrics = compare(models.GPT(layers=1), [_inputs("ring2_ulysses2", b, s) for b, s in SIZES[:2]],
                      lambda m: torch.compile(m, backend=backend, dynamic=False), steps=1)
    results["static"] = {**metrics, "compiles": len(compiles),
                         "symbolic_compiles": sum(any(isinstance(x, torch.SymInt) for x in c) for c in compiles)}
    return results


def test_one_compile_serves_every_length_and_batch_size():
    """Five lengths (three padded over cp) and two batch sizes through one plan and one inner
    compile per mesh, exact against one device in forward and backward; ``dynamic=False``
    compiles each size."""
    results = run_ranks(4, _run_modes, list(MODES))
    for rank_result in results:
        for name, r in rank_result.items():
            assert r["forward_abs"] <= FORWARD_ATOL and r["grad_rel"] <= GRAD_RTOL, (name, r)
    result = results[0]
    for name in MODES:
        assert result[name]["compiles"] == 1 and result[name]["symbolic_compiles"] == 1, (name, result[name])
        assert len(result[name]["plans"]) == 1 and "symbolic in L['" in result[name]["plans"][0], result[name]
    assert result["static"]["compiles"] == 2 and result["static"]["symbolic_compiles"] == 0, result["static"]
