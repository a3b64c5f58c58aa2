"""The examples run and check themselves: the decoding one everywhere (NumPy on the CPU, CuPy on a GPU), the
interop ones where their peer framework (with CUDA) and a GPU are present; else skip."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import HAVE_GPU, gpu_test

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def peer_with_cuda(name: str) -> bool:
    if importlib.util.find_spec(name) is None:
        return False
    check = {"torch": "import torch; assert torch.cuda.is_available()",
             "jax": "import jax; assert any(d.platform == 'gpu' for d in jax.devices())"}[name]
    return subprocess.run([sys.executable, "-c", check], capture_output=True, timeout=300).returncode == 0


def run_example(script: str) -> str:
    done = subprocess.run([sys.executable, str(EXAMPLES / script)], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(EXAMPLES.parent)})
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip().endswith("OK")
    return done.stdout


# on a GPU machine it runs CuPy, so it belongs to the GPU tiers there; elsewhere it is a CPU test
@(pytest.mark.gpu if HAVE_GPU else (lambda test: test))
def test_the_decoding_example_runs_and_checks_itself():
    """examples/decoding.py: a paged-cache decoding loop, split-KV and a merge against the reference,
    on the GPU where there is one, else on the CPU."""
    out = run_example("decoding.py")
    assert "decoding loop" in out and "split-KV" in out and "merge" in out


@gpu_test
@pytest.mark.parametrize("script, peer", [("torch_autograd.py", "torch"), ("jax_interop.py", "jax")])
def test_example_runs_and_checks_itself(script, peer):
    if not peer_with_cuda(peer):
        pytest.skip(f"needs {peer} with CUDA and a GPU")
    run_example(script)
