"""The command line: the demo (the README's main command) and the benchmark verb."""

import subprocess
import sys
from pathlib import Path

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
