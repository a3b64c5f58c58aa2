"""Where a call's host time goes: cProfile over back-to-back calls of the forward and the backward.

    python3 benchmarks/host_profile.py [--shape 1 1 64 64] [--calls 3000] [--top 25]

The calls are float16 and causal, as the host-cost check of benchmarks/bench.py (``--host``). Prints the
wall time per call without the profiler (back to back, the GPU idle most of the time at these shapes,
so the host's time is the call's), then the functions that take the most time of their own under it.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

import cupy
import numpy

REPO_ROOT = Path(__file__).resolve().parents[1]
if (REPO_ROOT / "cupyflash" / "__init__.py").is_file():   # run from a checkout
    sys.path.insert(0, str(REPO_ROOT))

import cupyflash  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", type=int, nargs=4, default=(1, 1, 64, 64), metavar=("B", "H", "N", "D"))
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    rng = numpy.random.default_rng(0)
    q, k, v, do = (cupy.asarray(rng.standard_normal(args.shape).astype(numpy.float16)) for _ in range(4))
    o, m, l = cupyflash.flash_attention_forward(q, k, v, causal=True)
    calls = {
        "forward": lambda: cupyflash.flash_attention_forward(q, k, v, causal=True),
        "backward": lambda: cupyflash.flash_attention_backward(do, q, k, v, o, m, l, causal=True),
    }
    for name, call in calls.items():
        for _ in range(100):
            call()
        cupy.cuda.Device().synchronize()
        start = time.perf_counter()
        for _ in range(args.calls):
            call()
        cupy.cuda.Device().synchronize()
        print(f"{name} {tuple(args.shape)}: {(time.perf_counter() - start) / args.calls * 1e6:.1f} us per call, "
              "back to back", flush=True)
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(args.calls):
            call()
        profile.disable()
        cupy.cuda.Device().synchronize()
        pstats.Stats(profile).sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
