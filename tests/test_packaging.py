"""The wheel: built from the checkout, installed into a fresh virtual environment without CuPy,
imported from another directory. Needs pip to reach a package index (numpy, ml_dtypes, setuptools);
skips where it cannot (the GPU machine has none)."""

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# the fresh environment's own imports only: a PYTHONPATH into the checkout (the README's way of
# testing without installing) would import the checkout instead of the wheel
CLEAN_ENV = {name: value for name, value in os.environ.items() if name != "PYTHONPATH"}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    out = tmp_path_factory.mktemp("wheel")
    probe = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--retries", "0", "--timeout", "15",
                            "-q", "-d", str(out / "probe"), "setuptools"], capture_output=True, timeout=300, env=CLEAN_ENV)
    if probe.returncode != 0:
        pytest.skip("pip cannot reach a package index")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(REPO)],
                   check=True, timeout=600, env=CLEAN_ENV)
    (built,) = out.glob("cupyflash-*.whl")
    return built


def test_the_wheel_carries_the_kernel_sources_the_benchmark_the_type_marker_and_the_licence(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    sources = {p.name for p in (REPO / "kernels_cu").iterdir() if p.suffix in (".cu", ".cuh")}
    assert {f"cupyflash/kernels_cu/{name}" for name in sources} <= names
    assert {"cupyflash/py.typed", "cupyflash/benchmarks/bench.py"} <= names
    licences = [n for n in names if n.split("/")[0].endswith(".dist-info") and n.endswith("/LICENSE")]
    assert licences, sorted(names)
    assert "BSD 3-Clause" in zipfile.ZipFile(wheel).read(licences[0]).decode()


def test_a_fresh_environment_without_cupy_imports_it_anywhere(wheel, tmp_path):
    env = tmp_path / "env"
    subprocess.run([sys.executable, "-m", "venv", str(env)], check=True, timeout=300, env=CLEAN_ENV)
    python = env / "bin" / "python"
    subprocess.run([str(python), "-m", "pip", "install", "-q", str(wheel)], check=True, timeout=600, env=CLEAN_ENV)
    script = """
import numpy, cupyflash
from cupyflash import _compile
assert 'site-packages' in str(_compile.kernel_dir()), _compile.kernel_dir()
assert _compile.kernel_source('fwd_sm90').startswith('//')
q = numpy.random.default_rng(0).standard_normal((2, 5, 8)).astype(numpy.float32)
o, m, l = cupyflash.flash_attention_forward(q, q, q, causal=True)
assert o.shape == (2, 5, 8)
try:
    cupyflash.precompile()
except RuntimeError as error:
    assert "[cuda12]" in str(error), error   # the install hint names the extra
else:
    raise AssertionError("precompile without CuPy did not raise")
print(cupyflash.__version__)
"""
    done = subprocess.run([str(python), "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env=CLEAN_ENV)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip() == "0.1.0"
    info = subprocess.run([str(python), "-m", "cupyflash", "info"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300, env=CLEAN_ENV)
    assert info.returncode == 0 and "CuPy: not installed" in info.stdout, info.stdout + info.stderr
    demo = subprocess.run([str(python), "-m", "cupyflash", "demo", "--seqlen", "33"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300, env=CLEAN_ENV)
    assert demo.returncode == 0 and "CuPy is not installed" in demo.stdout.splitlines()[0], demo.stdout + demo.stderr
    bench_help = subprocess.run([str(python), "-m", "cupyflash", "bench", "--help"], cwd=tmp_path,
                                capture_output=True, text=True, timeout=300, env=CLEAN_ENV)
    assert bench_help.returncode == 0 and "--seqlens" in bench_help.stdout, bench_help.stdout + bench_help.stderr
    bench = subprocess.run([str(python), "-m", "cupyflash", "bench", "--quick"], cwd=tmp_path, capture_output=True,
                           text=True, timeout=300, env=CLEAN_ENV)
    assert bench.returncode == 2 and "[cuda12,bench]" in bench.stderr, bench.stdout + bench.stderr
