"""The command line: the demo (the README's main command), info, precompile and the benchmark verb."""

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

import cupyflash
from cupyflash import _tiles
from cupyflash._tiles import MAX_HEAD_DIM
from helpers import HAVE_GPU, gpu_test

REPO = Path(__file__).resolve().parent.parent


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "cupyflash", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=300)


# `python -m cupyflash` where CuPy is not installed: a None in sys.modules makes `import cupy` raise ImportError
WITHOUT_CUPY = ("import runpy, sys; sys.modules['cupy'] = sys.modules['cupy_backends'] = None; "
                "runpy.run_module('cupyflash', run_name='__main__', alter_sys=True)")


def run_cli_without_cupy(*args):
    return subprocess.run([sys.executable, "-c", WITHOUT_CUPY, *args], cwd=REPO, capture_output=True, text=True,
                          timeout=300)


def test_demo_checks_itself_against_the_reference():
    done = run_cli("demo", "--seqlen", "70", "--head-dim", "40", "--causal")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "relative error against the float64 reference" in done.stdout and "OK" in done.stdout
    if not HAVE_GPU:
        assert "no usable CUDA GPU, running the NumPy path" in done.stdout


def test_demo_without_cupy_says_why_it_runs_numpy_in_one_line():
    done = run_cli_without_cupy("demo", "--seqlen", "33", "--head-dim", "24")
    assert done.returncode == 0 and "OK" in done.stdout, done.stdout + done.stderr
    first = done.stdout.splitlines()[0]
    assert first.startswith("no usable CUDA GPU, running the NumPy path"), first
    assert "CuPy is not installed" in first and "[cuda13]" in first, first


@pytest.mark.skipif(HAVE_GPU or importlib.util.find_spec("cupy") is None,
                    reason="needs CuPy without a usable GPU")
def test_demo_with_cupy_and_no_gpu_gives_cupys_error():
    done = run_cli("demo", "--seqlen", "33", "--head-dim", "24")
    assert done.returncode == 0, done.stdout + done.stderr
    first = done.stdout.splitlines()[0]
    assert first.startswith("no usable CUDA GPU, running the NumPy path"), first
    assert "CuPy" in first and "is installed but" in first, first


@pytest.mark.parametrize("option, value, says", [
    ("--seqlen", "0", "--seqlen: must be at least 1, got 0"),
    ("--head-dim", str(MAX_HEAD_DIM + 1), f"--head-dim: must be from 1 to {MAX_HEAD_DIM}, got {MAX_HEAD_DIM + 1}"),
    ("--head-dim", "0", f"--head-dim: must be from 1 to {MAX_HEAD_DIM}, got 0"),
    ("--batch", "0", "--batch: must be at least 1, got 0"),
    ("--heads", "-2", "--heads: must be at least 1, got -2"),
    ("--seqlen", "many", "--seqlen: not an integer: 'many'"),
])
def test_demo_refuses_impossible_sizes_in_one_line(option, value, says):
    done = run_cli("demo", option, value)
    assert done.returncode == 2 and done.stdout == "", done.stdout + done.stderr
    assert done.stderr.splitlines()[-1] == f"python -m cupyflash: error: argument {says}"
    assert "Traceback" not in done.stderr


@pytest.mark.skipif(HAVE_GPU, reason="a GPU is present: the benchmark would run")
def test_bench_without_a_gpu_says_so_in_one_line():
    done = run_cli("bench", "--quick", "--systems", "cupyflash-v2", "--no-long", "--out-dir", "/nonexistent/dir")
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and done.stdout == "", done.stdout + done.stderr
    assert lines[0].startswith(("the benchmark needs a CUDA GPU", "the benchmark needs CuPy and a GPU")), lines


def test_bench_help_prints_the_benchmarks_options():
    done = run_cli("bench", "--help")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "--seqlens" in done.stdout and "--quick" in done.stdout


def test_bench_help_needs_no_cupy_and_a_run_names_the_extra_it_needs():
    done = run_cli_without_cupy("bench", "--help")
    assert done.returncode == 0 and done.stderr == "", done.stdout + done.stderr
    assert "--seqlens" in done.stdout and "--quick" in done.stdout
    done = run_cli_without_cupy("bench", "--quick")
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and done.stdout == "" and len(lines) == 1, done.stdout + done.stderr
    assert lines[0].startswith("the benchmark needs CuPy and a GPU") and "[cuda12,bench]" in lines[0], lines


def test_info_names_versions_and_the_gpu_or_its_absence():
    done = run_cli("info")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "cupyflash 0.1.0" in done.stdout and "kernel sources:" in done.stdout
    if HAVE_GPU:
        assert "GPU 0:" in done.stdout
    else:
        assert "no CUDA GPU found" in done.stdout or "CuPy: not installed" in done.stdout
        # what a call may compile on the H200 the library is tuned for (every GPU's own, with one)
        count = _tiles.specialisation_count(_tiles.SM90_SMEM_BLOCK, "sm_90")
        assert f"{count} specialisations can exist on sm_90 with 227 KB" in done.stdout, done.stdout


def test_info_without_cupy_still_counts_the_specialisations_of_sm_90():
    done = run_cli_without_cupy("info")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "CuPy: not installed" in done.stdout
    assert f"{_tiles.specialisation_count()} specialisations can exist on sm_90" in done.stdout, done.stdout


def test_precompile_compiles_chosen_specialisations_or_says_what_it_needs():
    done = run_cli("precompile", "--kernels", "fwd_v1", "--dtypes", "float32", "--head-dims", "24", "64")
    if HAVE_GPU:   # two buckets, 32 and 64, each under both float32 precisions
        assert done.returncode == 0, done.stdout + done.stderr
        for bucket in (32, 64):
            for precision in _tiles.PRECISIONS:
                assert re.search(f"fwd_v1 float32 D<={bucket} .* precision={precision}", done.stdout), done.stdout
        assert "4 specialisations" in done.stdout
    else:
        assert done.returncode == 2
        assert "needs a CUDA GPU" in done.stderr or "needs CuPy" in done.stderr


@gpu_test
def test_precompile_of_bfloat16_under_an_old_cupy_names_the_version_needed(monkeypatch):
    import cupy

    monkeypatch.setattr(cupy, "__version__", "13.6.0")
    with pytest.raises(RuntimeError, match="CuPy >= 14"):
        cupyflash.precompile(kernels=["fwd_v1"], dtypes=["bfloat16"], head_dims=[64])
    chosen = cupyflash.precompile(kernels=["fwd_v1"], head_dims=[64])   # every dtype but bfloat16
    assert {cfg.dtype for cfg in chosen} == {"float16", "float32", "float64"}
