"""Installing the package. The wheel: built from the checkout, installed into a fresh virtual
environment without CuPy, imported from another directory; needs pip to reach a package index
(numpy, ml_dtypes, setuptools) and skips where it cannot (the GPU machine has none). The editable
install: a copy of the checkout in a folder named ``cupyflash``, installed with ``pip install -e``
into a fresh environment, and the command line run from the folder above it, from the checkout and
from elsewhere; it builds with the running interpreter's setuptools where that can (no index
needed)."""

import os
import shutil
import subprocess
import sys
import zipfile
from importlib import metadata, util
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


# what a build of the package reads: the files and folders setup.cfg, setup.py and MANIFEST.in name
PROJECT_FILES = ("pyproject.toml", "setup.cfg", "setup.py", "MANIFEST.in", "README.md", "LICENSE", "cupyflash",
                 "kernels_cu", "benchmarks")


def _site_folder(module: str):
    """The folder the running interpreter imports ``module`` from (None where it has none); found
    without importing it."""
    spec = util.find_spec(module)
    return None if spec is None or spec.origin is None else str(Path(spec.origin).parent.parent)


def _builds_without_an_index() -> bool:
    """The running interpreter's setuptools can build an editable wheel: 64 or later (PEP 660), and
    ``wheel`` present below 70.1 (which brought bdist_wheel into setuptools)."""
    try:
        version = tuple(int(part) for part in metadata.version("setuptools").split(".")[:2])
    except (metadata.PackageNotFoundError, ValueError):
        return False
    return version >= (64, 0) and (version >= (70, 1) or util.find_spec("wheel") is not None)


@pytest.fixture(scope="module")
def editable_install(tmp_path_factory):
    """``(python, checkout)``: a fresh environment with an editable install of a copy of this
    checkout at ``<tmp>/cupyflash``. The environment sees the running interpreter's NumPy, ml_dtypes,
    pip (and setuptools, to build without an index) through a .pth file, and no CuPy, so the
    command line runs the NumPy path as on a machine without CuPy."""
    if _site_folder("pip") is None:
        pytest.skip("the running interpreter has no pip to install with")
    root = tmp_path_factory.mktemp("editable")
    checkout = root / "cupyflash"
    checkout.mkdir()
    for name in PROJECT_FILES:
        source = REPO / name
        if source.is_dir():
            shutil.copytree(source, checkout / name, ignore=shutil.ignore_patterns("__pycache__", "bench_results.*"))
        else:
            shutil.copy2(source, checkout / name)
    env = root / "env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True, timeout=300, env=CLEAN_ENV)
    python = env / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                          check=True, capture_output=True, text=True, timeout=300, env=CLEAN_ENV).stdout.strip()
    here = _builds_without_an_index()
    modules = ("numpy", "ml_dtypes", "pip") + (("setuptools", "wheel") if here else ())
    folders = dict.fromkeys(f for f in map(_site_folder, modules) if f is not None)
    # a .pth line that starts with "import" runs at start-up: CuPy then imports as absent
    (Path(site) / "running_interpreter.pth").write_text(
        "\n".join(folders) + '\nimport sys; sys.modules["cupy"] = sys.modules["cupy_backends"] = None\n')
    install = [str(python), "-m", "pip", "install", "-q", "--no-deps", "-e", str(checkout)]
    if here:
        install[4:4] = ["--no-build-isolation", "--no-index"]
    else:   # pip fetches setuptools into an isolated build environment
        probe = subprocess.run([str(python), "-m", "pip", "download", "--no-deps", "--retries", "0", "--timeout", "15",
                                "-q", "-d", str(root / "probe"), "setuptools"], capture_output=True, timeout=300,
                               env=CLEAN_ENV)
        if probe.returncode != 0:
            pytest.skip("the running interpreter has no setuptools >= 64 (with wheel below 70.1) and pip cannot "
                        "reach a package index for one")
    done = subprocess.run(install, capture_output=True, text=True, timeout=600, env=CLEAN_ENV)
    assert done.returncode == 0, done.stdout + done.stderr
    return python, checkout


@pytest.mark.parametrize("where", ["the checkout's parent", "the checkout", "elsewhere"])
def test_an_editable_install_runs_the_command_line_from_any_folder(editable_install, where, tmp_path):
    """From the checkout's parent the folder ``cupyflash`` (the checkout, with no ``__init__.py``)
    is a namespace package candidate on ``sys.path[0]``; the installed package must still win."""
    python, checkout = editable_install
    cwd = {"the checkout's parent": checkout.parent, "the checkout": checkout, "elsewhere": tmp_path}[where]

    def cli(*args):
        return subprocess.run([str(python), "-m", "cupyflash", *args], cwd=cwd, capture_output=True, text=True,
                              timeout=300, env=CLEAN_ENV)

    info = cli("info")
    assert info.returncode == 0, info.stdout + info.stderr
    lines = info.stdout.splitlines()
    assert lines[0] == f"cupyflash 0.1.0 at {(checkout / 'cupyflash').resolve()}", info.stdout
    assert f"kernel sources: {(checkout / 'kernels_cu').resolve()}" in lines and "CuPy: not installed" in info.stdout
    demo = cli("demo", "--seqlen", "33", "--head-dim", "24")
    assert demo.returncode == 0 and demo.stdout.splitlines()[-1] == "OK", demo.stdout + demo.stderr
    bench_help = cli("bench", "--help")
    assert bench_help.returncode == 0 and "--seqlens" in bench_help.stdout, bench_help.stdout + bench_help.stderr
