"""Where a cupyflash.torch call's time goes on a GPU: per-call rows beside the direct call, and the kernels.

    python3 benchmarks/torch_profile.py [--shape 16 4 512 64] [--calls 200] [--no-kernels]

One causal bfloat16 attention on contiguous (B, H, N, D) tensors, back to back, µs per call (host: the
Python loop's time; GPU: CUDA events around the loop; the larger bounds a model's step):

* cupyflash.torch forward + backward through ``torch.autograd.grad``, with torch's backward on its
  autograd thread (the default) and on the calling thread (``set_multithreading_enabled(False)``);
* cupyflash.torch's forward alone under ``torch.no_grad``;
* cupyflash called directly on CuPy views of the same tensors (zero copy, torch's stream), forward and
  backward, with and without ``out=``;
* torch SDPA forward + backward through autograd, on either thread;
* torch's floor for any Python ``torch.autograd.Function``: one that returns an empty tensor of o's shape
  and three empty gradients (no kernel), forward + backward through ``torch.autograd.grad``, on either
  thread: what a Python-level extension pays before any of its own work.

``--cprofile`` adds cProfile's top functions (by own time) over the calling-thread iterations.

Then (unless ``--no-kernels``) torch.profiler's table of the kernels of ten iterations of the
cupyflash.torch and the direct forward + backward: the same kernels and GPU time mean the difference
is host work. benchmarks/torch_host_cost.py measures the wrapper's own Python on the CPU; this script
needs a GPU, torch with CUDA and CuPy.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if (REPO_ROOT / "cupyflash" / "__init__.py").is_file():   # run from a checkout
    sys.path.insert(0, str(REPO_ROOT))


def per_call(call, calls: int) -> tuple[float, float]:
    """(host µs, GPU µs) per ``call()`` over ``calls`` back-to-back calls, after 20 untimed ones."""
    import torch

    for _ in range(20):
        call()
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin = time.perf_counter()
    start.record()
    for _ in range(calls):
        call()
    stop.record()
    host = (time.perf_counter() - begin) / calls * 1e6
    stop.synchronize()
    return host, start.elapsed_time(stop) / calls * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", type=int, nargs=4, default=(16, 4, 512, 64), metavar=("B", "H", "N", "D"))
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--no-kernels", action="store_true", help="skip torch.profiler's kernel tables")
    parser.add_argument("--cprofile", action="store_true", help="cProfile the calling-thread iterations")
    args = parser.parse_args()

    import cupy
    import torch
    import torch.nn.functional as F

    import cupyflash
    from cupyflash.torch import flash_attention

    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(args.shape, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(4))
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    stream = cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)
    cq, ck, cv, cdo = (cupy.from_dlpack(x) for x in (q, k, v, do))
    with stream:
        o, m, l = cupyflash.flash_attention_forward(cq, ck, cv, causal=True)
        outs = tuple(cupy.empty_like(x) for x in (o, m, l))
        grad_outs = tuple(cupy.empty_like(x) for x in (cq, ck, cv))

    def through_torch():
        torch.autograd.grad(flash_attention(*leaves, causal=True), leaves, do)

    def on_calling_thread(call):
        """``call`` with torch's backward on the calling thread."""
        def run():
            with torch.autograd.set_multithreading_enabled(False):
                call()
        return run

    on_one_thread = on_calling_thread(through_torch)

    def torch_forward():
        with torch.no_grad():
            flash_attention(q, k, v, causal=True)

    def direct(forward_out=None, backward_out=None, backward=True):
        def call():
            with stream:
                result = cupyflash.flash_attention_forward(cq, ck, cv, causal=True, out=forward_out)
                if backward:
                    cupyflash.flash_attention_backward(cdo, cq, ck, cv, *result, causal=True, out=backward_out)
        return call

    def sdpa():
        torch.autograd.grad(F.scaled_dot_product_attention(*leaves, is_causal=True), leaves, do)

    class Empty(torch.autograd.Function):   # no work at all: torch's cost of a Python Function
        @staticmethod
        def forward(ctx, q, k, v):
            return torch.empty_like(q)

        @staticmethod
        def backward(ctx, grad):
            return torch.empty_like(grad), torch.empty_like(grad), torch.empty_like(grad)

    def floor():
        torch.autograd.grad(Empty.apply(*leaves), leaves, do)

    rows = [
        ("cupyflash.torch forward + backward (autograd thread)", through_torch),
        ("cupyflash.torch forward + backward (calling thread)", on_one_thread),
        ("cupyflash.torch forward alone (no_grad)", torch_forward),
        ("cupyflash direct forward + backward", direct()),
        ("cupyflash direct forward + backward, out=", direct(outs, grad_outs)),
        ("cupyflash direct forward", direct(backward=False)),
        ("cupyflash direct forward, out=", direct(outs, backward=False)),
        ("torch SDPA forward + backward (autograd thread)", sdpa),
        ("torch SDPA forward + backward (calling thread)", on_calling_thread(sdpa)),
        ("an empty Python autograd.Function forward + backward (autograd thread)", floor),
        ("an empty Python autograd.Function forward + backward (calling thread)", on_calling_thread(floor)),
    ]
    print(f"{tuple(args.shape)} bfloat16 causal, {args.calls} back-to-back calls, torch {torch.__version__}\n")
    print("| call | host µs | GPU µs |")
    print("|---|---:|---:|")
    for name, call in rows:
        host, gpu = per_call(call, args.calls)
        print(f"| {name} | {host:.1f} | {gpu:.1f} |", flush=True)
    if args.cprofile:
        import cProfile
        import pstats

        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(args.calls):
            on_one_thread()
        profiler.disable()
        torch.cuda.synchronize()
        print(f"\ncProfile, cupyflash.torch forward + backward on the calling thread, {args.calls} iterations:")
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
    if args.no_kernels:
        return
    from torch.profiler import ProfilerActivity, profile

    for name, call in (("cupyflash.torch", through_torch), ("cupyflash direct", direct())):
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                call()
            torch.cuda.synchronize()
        print(f"\n{name}, 10 iterations:")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=50))


if __name__ == "__main__":
    main()
