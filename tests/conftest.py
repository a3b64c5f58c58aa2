"""Session set-up: on a GPU machine, every kernel specialisation is compiled up front, side by side.

A test process would otherwise compile each specialisation at its first use, one after another on
one core (0.5-3 s each, about 140 of them on sm_90). ``cupyflash.precompile`` compiles them in one
worker process per core into CuPy's disk cache; the tests then load them. Only a session that
selects a GPU test pays it, and a warm cache makes it a few seconds.
"""

import os
from pathlib import Path

import pytest

from helpers import HAVE_GPU

# seconds per GPU test in the last measured full tier, the long ones (tests/gpu/tier.py)
DURATIONS = Path(__file__).resolve().parent / "gpu" / "durations.txt"


def pytest_addoption(parser):
    parser.addoption("--longest-first", action="store_true",
                     help="run the tests tests/gpu/durations.txt names first, longest first (the GPU tiers)")


def measured_durations() -> dict:
    """{test id: seconds} from tests/gpu/durations.txt (lines "<seconds> <test id>", # comments)."""
    table = {}
    for line in DURATIONS.read_text().splitlines():
        if line and not line.startswith("#"):
            seconds, nodeid = line.split(" ", 1)
            table[nodeid] = float(seconds)
    return table


@pytest.hookimpl(trylast=True)   # after -k and -m have deselected
def pytest_collection_modifyitems(session, config, items):
    session.selects_gpu_tests = any(item.get_closest_marker("gpu") for item in items)
    if config.getoption("--longest-first"):
        items[:] = longest_first(items, measured_durations(), int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    elif "PYTEST_XDIST_WORKER" not in os.environ:
        compile_while_testing(items)


def compile_while_testing(items: list):
    """Where the session runs tests/test_compile.py's specialisations (its ``compiled`` fixture), start
    compiling them now, below the tests' priority, and run that module last: the compiles take the
    cores the CPU tests leave (CI: two cores, the CPU tests on one and a bit)."""
    compiling = [item for item in items if "compiled" in getattr(item, "fixturenames", ())]
    if not compiling:
        return
    module = compiling[0].module
    items[:] = ([item for item in items if getattr(item, "module", None) is not module]
                + [item for item in items if getattr(item, "module", None) is module])
    module.compile_in_the_background()
    _COMPILING.append(module)


_COMPILING = []   # the module whose compiles run in the background (compile_while_testing)


def pytest_sessionfinish(session):
    # a session that stops before the compile test (-x, a keyboard interrupt) does not wait for its compiles
    for module in _COMPILING:
        module.stop_compiling()


def longest_first(items: list, seconds: dict, workers: int) -> list:
    """``items`` in lanes, one per worker, each lane longest first: pytest-xdist's ``--dist worksteal``
    gives each worker a contiguous share of the tests (the later shares one longer where they do not
    divide) and lets an idle worker take the back half of a busy one's queue, so each worker starts with
    one of the longest tests and no long test starts last, where it would hold the tier up on its own.
    ``seconds``: the measured ones (a test it does not name counts as short)."""
    ranked = sorted(items, key=lambda item: -seconds.get(item.nodeid, 0.0))
    lanes = [ranked[w::workers] for w in range(workers)]
    return [item for lane in reversed(lanes) for item in lane]


@pytest.fixture(scope="session", autouse=True)
def kernels_compiled_in_parallel(request):
    # under pytest-xdist each worker compiles what its tests load: a pool per worker would start a
    # process per core in every worker
    if HAVE_GPU and getattr(request.session, "selects_gpu_tests", False) and "PYTEST_XDIST_WORKER" not in os.environ:
        import cupyflash

        cupyflash.precompile()


@pytest.fixture(autouse=True)
def pool_given_back_under_xdist():
    """Under pytest-xdist every worker's CuPy pool would keep the blocks of its largest test, and a few
    workers together run the GPU out of memory: each test hands its blocks back when it ends."""
    yield
    if HAVE_GPU and "PYTEST_XDIST_WORKER" in os.environ:
        import cupy

        cupy.get_default_memory_pool().free_all_blocks()


@pytest.fixture()
def gpu_schedule(request, monkeypatch):
    """The API schedule of a "v1"/"v2"/"v2-mma" case (parametrized indirectly), with the Hopper kernels
    off for "v2-mma"."""
    from cupyflash import _launch

    monkeypatch.setattr(_launch, "USE_WGMMA", request.param != "v2-mma")
    return request.param.split("-")[0]
