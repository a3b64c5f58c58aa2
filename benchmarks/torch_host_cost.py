"""The host time of cupyflash.torch's own work, with cupyflash's calls replaced by nothing (no GPU needed).

    python benchmarks/torch_host_cost.py [--shape 2 4 64 64] [--calls 2000]

The wrapper is run on CPU tensors but through its CUDA path: CuPy views made over the tensors' memory
(no GPU is touched to make them), a stand-in for torch's stream, and ``flash_attention_forward`` /
``_backward`` replaced by functions that return their ``out=`` at once. What remains is the wrapper's
Python (views, outputs from torch's allocator, the plan look-up, the stream context) and torch's
autograd machinery. Printed: the forward alone (under ``torch.no_grad``, no autograd node), and the
forward and backward through autograd as the marginal cost of one more call in a chain of calls (one
``autograd.grad`` over the chain), beside the same figure for torch's own ops on tiny CPU tensors
(SDPA, whose work is then small, and a multiply) as a yardstick of torch's per-op cost on this host.
On a GPU host, cupyflash's own host time per call comes on top (``benchmarks/host_profile.py``).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if (REPO_ROOT / "cupyflash" / "__init__.py").is_file():   # run from a checkout
    sys.path.insert(0, str(REPO_ROOT))


def best_of(call, calls: int, repeats: int = 5) -> float:
    """Microseconds per ``call()``: the best of ``repeats`` runs of ``calls`` calls, after a warm-up."""
    for _ in range(min(calls, 200)):
        call()
    best = float("inf")
    for _ in range(repeats):
        begin = time.perf_counter()
        for _ in range(calls):
            call()
        best = min(best, (time.perf_counter() - begin) / calls * 1e6)
    return best


def marginal(op, x, calls: int) -> float:
    """Microseconds that one more ``op`` in a chain of them adds to a forward and backward (the gradient
    taken with respect to the chain's input alone: no gradients summed on the CPU)."""
    import torch

    def chain(n):
        def run():
            y = x
            for _ in range(n):
                y = op(y)
            torch.autograd.grad(y, (x,), seed)
        return run

    seed = torch.ones_like(op(x))

    return (best_of(chain(9), calls // 4) - best_of(chain(1), calls // 4)) / 8


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", type=int, nargs=4, default=(2, 4, 64, 64), metavar=("B", "H", "N", "D"))
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()

    import torch
    import torch.nn.functional as F

    import cupyflash.torch as cft
    from cupyflash import api

    api.flash_attention_forward = lambda q, k, v, *, out, **kw: out
    api.flash_attention_backward = lambda do, q, k, v, o, m, l, *, out, **kw: out
    made = cft._Plan.__init__

    def on_the_cuda_path(plan, *args):
        made(plan, *args)
        plan.device, plan.array, plan.held = 0, cft._device_array, cft._held_array

    class NoStream:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    cft._Plan.__init__ = on_the_cuda_path
    cft._cupy()
    # getDevice: device 0 is current; ctxGetCurrent: a context is current (setDevice is never reached)
    cft._CUPY.getDevice, cft._CUPY.ctxGetCurrent = (lambda: 0), (lambda: 1)
    cft._current_stream = lambda device, stream=NoStream(): stream

    q, k, v = (torch.randn(args.shape, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))

    def forward_alone():
        with torch.no_grad():
            cft.flash_attention(q, k, v, causal=True)

    tiny = [torch.randn(1, 1, 4, 8) for _ in range(2)]
    rows = [("cupyflash.torch, forward alone (no autograd)", best_of(forward_alone, args.calls)),
            ("cupyflash.torch, forward + backward through autograd",
             marginal(lambda x: cft.flash_attention(x, k, v, causal=True), q, args.calls)),
            ("torch SDPA on (1, 1, 4, 8) CPU tensors, forward + backward",
             marginal(lambda x: F.scaled_dot_product_attention(x, *tiny, is_causal=True),
                      torch.randn(1, 1, 4, 8, requires_grad=True), args.calls)),
            ("torch multiply, forward + backward", marginal(lambda x: x * 1.0, torch.randn(8, requires_grad=True),
                                                            args.calls))]
    print(f"torch {torch.__version__}; cupyflash's calls replaced by nothing; q, k, v {tuple(args.shape)} bfloat16\n")
    print("| host work | us per call |")
    print("|---|---:|")
    for name, us in rows:
        print(f"| {name} | {us:.1f} |")


if __name__ == "__main__":
    main()
