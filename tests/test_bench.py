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


@pytest.fixture(scope="module")
def ab():
    folder = Path(__file__).resolve().parent.parent / "benchmarks"
    sys.path.insert(0, str(folder))
    spec = importlib.util.spec_from_file_location("ab_under_test", folder / "ab.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]
    sys.path.remove(str(folder))


def test_ab_imports_each_checkout_as_a_package_of_its_own(ab):
    """benchmarks/ab.py times checkouts side by side in one process: each is its own package, with its
    own kernel sources, and runs (here the NumPy path) as the public package does."""
    import numpy

    root = Path(__file__).resolve().parent.parent
    first, second = ab.load_tree("first_under_test", root), ab.load_tree("second_under_test", root)
    try:
        assert first is not second and first.__name__ == "cupyflash_first_under_test"
        assert Path(first._compile.kernel_dir()) == root / "kernels_cu"
        q = numpy.random.default_rng(0).standard_normal((1, 2, 8, 16))
        for o_a, o_b in zip(first.flash_attention_forward(q, q, q, causal=True),
                            second.flash_attention_forward(q, q, q, causal=True)):
            numpy.testing.assert_array_equal(o_a, o_b)
    finally:
        for name in [n for n in sys.modules if n.startswith(("cupyflash_first_under_test", "cupyflash_second"))]:
            del sys.modules[name]


def test_ab_covers_the_protocol_and_every_variant_causal_and_not(ab):
    points = list(ab.cases(["protocol", "variants"], ["fp16", "bf16"], [64, 128], [512, 16384], [1024]))
    protocol = [p for p in points if p[0] == "protocol"]
    assert len(protocol) == 2 * 2 * 2 * 2 and {p[1] for p in protocol} == {"plain"}
    variants = {(p[1], p[5]) for p in points if p[0] == "variants"}
    assert variants == {(v, c) for v in ab.VARIANTS[1:] for c in (False, True)}
    with pytest.raises(SystemExit, match="NAME=PATH"):
        ab.main(["--base", ".", "--tree", "no-equals-sign"])


def test_the_host_path_of_kept_calls_runs_on_a_faked_gpu():
    """benchmarks/host_path.py times a kept call's Python with the GPU faked, on any machine; its counts
    are the plans': a causal Hopper forward launches its kernel alone (it repairs its own tiles), a
    backward its preparation, main kernel, repair and conversion, each from one allocation; a float8
    forward its V^T pass and main kernel from one allocation; a decoding step over 16384 keys its split
    forward and their merge (and the append first), a merge one kernel."""
    import os
    import subprocess

    repo = Path(__file__).resolve().parent.parent
    done = subprocess.run([sys.executable, "benchmarks/host_path.py", "--calls", "50"], capture_output=True,
                          text=True, timeout=300, cwd=repo, env={**os.environ, "PYTHONPATH": str(repo)})
    assert done.returncode == 0, done.stderr
    rows = {line.split("|")[1].strip(): [cell.strip() for cell in line.split("|")[2:5]]
            for line in done.stdout.splitlines() if line.startswith("| ") and not line.startswith("| call")}
    counts = {"forward": ["1", "1"], "backward": ["4", "2"], "forward, float8": ["2", "1"],
              "decode, contiguous cache": ["2", "1"],
              "decode, paged cache": ["2", "1"], "decode, contiguous cache, a key appended": ["3", "1"],
              "decode, paged cache, a key appended": ["3", "1"], "merge of 2 parts": ["1", "1"],
              "merge of 8 parts": ["1", "1"]}
    assert set(rows) == set(counts), done.stdout
    for name, (seconds, *launches_allocations) in rows.items():
        assert float(seconds) > 0 and launches_allocations == counts[name], (name, done.stdout)
