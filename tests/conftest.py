import json
import os

import expecttest
import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

import dtensor_par
from dtensor_par.passes.capture import capture_graphs
from dtensor_par.planning import parallelize_graph
from dtensor_par.mesh import MeshInfo
from dtensor_par.config import ParallelConfig
from dtensor_par._testing.harness import CPU_TIME_LOG, RANK_TIMEOUT, start_fork_server
from tests import background, tiers

# every test plans afresh (tests patch passes and count plans); the plan cache's own tests turn it on
os.environ.setdefault("DTENSOR_PAR_PLAN_CACHE", "0")
# the longest launch takes about 2 minutes on two loaded cores: one still running after 15 hangs
os.environ.setdefault(RANK_TIMEOUT, "900")
# The tests in this process run beside a launch's ranks on two cores: one thread, as each rank
# has. With two, every op's OpenMP workers spin for more work after it, taking the cores the
# ranks need (a 4-rank launch beside a loop of small matmuls: 40 CPU-s for the loop's work that
# takes 24 CPU-s on one thread).
torch.set_num_threads(1)

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU"))]
"""The devices a one-process test of a device-specific path runs on: CUDA where a GPU is present."""


def pytest_addoption(parser):
    parser.addoption("--sweep", action="store_true",
                     help="also run the repeats (tests/tiers.py): every family at every mesh, the full matrices")


def pytest_configure(config):
    """Before the test modules are imported: they choose what their launches run by the tier."""
    config.addinivalue_line("markers", "sweep: a repeat of a capability CI runs once; run with --sweep")
    tiers.SWEEP = config.getoption("--sweep")


def pytest_collection_modifyitems(config, items):
    if tiers.SWEEP:
        return
    skip = pytest.mark.skip(reason="a repeat of what CI runs once: run with --sweep")
    for item in items:
        if item.get_closest_marker("sweep"):
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def background_jobs(request):
    """Start the launches and subprocesses of the modules whose tests run (``tests.background``),
    and the ranks' fork server before any test changes the environment or the folder. Set up
    within pytest's output capture, as a test's own launch is, the ranks' output goes where
    the tests' output goes (shown when a test fails), not to the terminal."""
    running = [item for item in request.session.items if not item.get_closest_marker("skip")]
    if background.start({item.module.__name__ for item in running}):
        start_fork_server()
    yield
    background.stop()


def pytest_terminal_summary(terminalreporter):
    """With ``DTENSOR_PAR_TEST_CPU_LOG`` set: the CPU seconds each launch took, all ranks summed."""
    path = os.environ.get(CPU_TIME_LOG)
    if not path or not os.path.exists(path):
        return
    totals: dict[str, float] = {}
    with open(path) as f:
        for line in f:
            record = json.loads(line)
            totals[record["what"]] = totals.get(record["what"], 0.0) + record["cpu"]
    terminalreporter.section("CPU seconds of the ranks, all ranks summed")
    for what, cpu in totals.items():
        terminalreporter.write_line(f"{cpu:8.1f}  {what}")


def _init_fake(world: int) -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)


def _reset_world() -> None:
    """Drop the process group and Dynamo's caches a test leaves, so the next starts afresh."""
    if dist.is_initialized():
        dist.destroy_process_group()
    torch._dynamo.reset()


@pytest.fixture
def fake_world():
    """Initialize a fake process group of the given size (rank 0); no communication happens."""
    yield _init_fake
    _reset_world()


class GoldenTestCase(expecttest.TestCase):
    """Inline goldens (``assertExpectedInline``; refresh with ``EXPECTTEST_ACCEPT=1``), each
    test leaving no process group behind."""

    def tearDown(self):
        _reset_world()


def plan_graph(model, inputs, *, tp: int, steps=None, **options):
    """Capture the model's one graph and run the steps on it (default: every one) at ``tp`` on a fake group."""
    _init_fake(tp)
    mesh = dtensor_par.init_mesh(tp=tp)
    (gm, example_inputs), = capture_graphs(model, *inputs)
    kwargs = {"steps": steps} if steps is not None else {}
    return parallelize_graph(gm, example_inputs, MeshInfo.from_mesh(mesh), ParallelConfig(**options), **kwargs)


@pytest.fixture
def planned(fake_world):
    return plan_graph
