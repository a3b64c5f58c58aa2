"""Session set-up: on a GPU machine, every kernel specialisation is compiled up front, side by side.

A test process would otherwise compile each specialisation at its first use, one after another on
one core (0.5-3 s each, about 140 of them on sm_90). ``cupyflash.precompile`` compiles them in one
worker process per core into CuPy's disk cache; the tests then load them. Only a session that
selects a GPU test pays it, and a warm cache makes it a few seconds.
"""

import pytest

from helpers import HAVE_GPU


def pytest_collection_modifyitems(session, config, items):
    session.selects_gpu_tests = any(item.get_closest_marker("gpu") for item in items)


@pytest.fixture(scope="session", autouse=True)
def kernels_compiled_in_parallel(request):
    if HAVE_GPU and getattr(request.session, "selects_gpu_tests", False):
        import cupyflash

        cupyflash.precompile()


@pytest.fixture()
def gpu_schedule(request, monkeypatch):
    """The API schedule of a "v1"/"v2"/"v2-mma" case (parametrized indirectly), with the Hopper kernels
    off for "v2-mma"."""
    from cupyflash import _launch

    monkeypatch.setattr(_launch, "USE_WGMMA", request.param != "v2-mma")
    return request.param.split("-")[0]
