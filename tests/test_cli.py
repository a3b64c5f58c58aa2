"""The command line: the demo (the README's main command), info, precompile and the benchmark verb."""

import subprocess
import sys
from pathlib import Path

import pytest

import cupyflash
from helpers import HAVE_GPU

REPO = Path(__file__).resolve().parent.parent


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "cupyflash", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=300)


def test_demo_checks_itself_against_the_reference():
    done = run_cli("demo", "--seqlen", "70", "--head-dim", "40", "--causal")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "relative error against the float64 reference" in done.stdout and "OK" in done.stdout
    if not HAVE_GPU:
        assert "no CUDA GPU found: running the NumPy path" in done.stdout


def test_bench_verb_reaches_the_benchmark():
    done = run_cli("bench", "--help")
    assert done.returncode == 0, done.stderr
    assert "--seqlens" in done.stdout


def test_info_names_versions_and_the_gpu_or_its_absence():
    done = run_cli("info")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "cupyflash 0.1.0" in done.stdout and "kernel sources:" in done.stdout
    if HAVE_GPU:
        assert "GPU 0:" in done.stdout
    else:
        assert "no CUDA GPU found" in done.stdout or "CuPy: not installed" in done.stdout


def test_precompile_compiles_chosen_specialisations_or_says_what_it_needs():
    done = run_cli("precompile", "--kernels", "fwd_v1", "--dtypes", "float32", "--head-dims", "24", "64")
    if HAVE_GPU:   # two buckets, 32 and 64
        assert done.returncode == 0, done.stdout + done.stderr
        assert "fwd_v1 float32 D<=32" in done.stdout and "fwd_v1 float32 D<=64" in done.stdout
        assert "2 specialisations" in done.stdout
    else:
        assert done.returncode == 2
        assert "needs a CUDA GPU" in done.stderr or "needs CuPy" in done.stderr


@pytest.mark.skipif(not HAVE_GPU, reason="needs a CUDA GPU")
def test_precompile_of_bfloat16_under_an_old_cupy_names_the_version_needed(monkeypatch):
    import cupy

    monkeypatch.setattr(cupy, "__version__", "13.6.0")
    with pytest.raises(RuntimeError, match="CuPy >= 14"):
        cupyflash.precompile(kernels=["fwd_v1"], dtypes=["bfloat16"], head_dims=[64])
    chosen = cupyflash.precompile(kernels=["fwd_v1"], head_dims=[64])   # every dtype but bfloat16
    assert {cfg.dtype for cfg in chosen} == {"float16", "float32", "float64"}
