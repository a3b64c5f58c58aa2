"""CPU tests of benchmarks/bench.py's case lists (no GPU: only the configurations are built)."""

import importlib.util
import sys
from pathlib import Path

import pytest

pytest.importorskip("cupy")
pytest.importorskip("ml_dtypes")


@pytest.fixture(scope="module")
def bench():
    path = Path(__file__).resolve().parent.parent / "benchmarks" / "bench.py"
    spec = importlib.util.spec_from_file_location("bench_under_test", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module     # its dataclasses look their module up there
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def test_breadth_holds_issue_16s_cases(bench):
    configs = bench.sweep_configs(bench.parse_args(["--breadth"]))
    wide = {(c.dtype, c.D, c.B, c.H, c.N) for c in configs if c.dtype in ("fp32", "fp64")}
    for dtype in ("fp32", "fp64"):
        for D in (64, 128):
            assert (dtype, D, 2, 8, 4096) in wide                          # the issue's (B 2, H 8) shape
            assert (dtype, D, 16384 // 4096, 2048 // D, 4096) in wide      # and the FA protocol's
    narrow = {(c.dtype, c.D, c.N, c.causal) for c in configs if c.dtype in ("fp16", "bf16")}
    assert narrow == {(d, D, N, causal) for d in ("fp16", "bf16") for D in (160, 192, 256)
                      for N in (1024, 2048, 4096, 8192, 16384) for causal in (False, True)}


def test_breadth_narrows_by_dtype_length_and_mask(bench):
    configs = bench.sweep_configs(bench.parse_args(["--breadth", "--dtypes", "fp16", "--seqlens", "2048",
                                                    "--causal", "1"]))
    assert {(c.dtype, c.N, c.causal) for c in configs} == {("fp16", 2048, True)}
    assert sorted(c.D for c in configs) == [160, 192, 256]
