"""NVRTC compile time of every specialisation (no GPU needed): the cost of a first call.

    PYTHONPATH=$PWD python3 benchmarks/compile_times.py [--arch sm_90] [--smem 232448]

Prints one line per specialisation (kernel, dtype, padded head dim, tiles, seconds) and the
totals per kernel. A first call compiles one specialisation (a backward: two, the preparation and
conversion kernels live in the V1 module); CuPy then keeps the binary in its disk cache, and a
later process loads it instead (warm start, measured on the GPU: see RESULTS.md).
"""

from __future__ import annotations

import argparse
import collections
import time

from cupyflash import _compile, _tiles


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="sm_90", help="architecture to compile for (default sm_90)")
    parser.add_argument("--smem", type=int, default=227 * 1024, help="opt-in shared memory per block, bytes")
    args = parser.parse_args(argv)
    per_kernel = collections.defaultdict(list)
    for cfg in _tiles.all_tile_configs(args.smem, args.arch):
        start = time.perf_counter()
        _compile.compile_for_arch(cfg, args.arch)
        seconds = time.perf_counter() - start
        per_kernel[cfg.kernel].append(seconds)
        print(f"{cfg.kernel:12s} {cfg.dtype:9s} D<={cfg.d_pad:<3d} {cfg.block_r}x{cfg.block_c} w{cfg.warps:<2d} "
              f"{seconds:6.2f} s", flush=True)
    print()
    print("| kernel | specialisations | seconds each (min–max) | total |")
    print("|---|---:|---|---:|")
    for kernel, times in per_kernel.items():
        print(f"| {kernel} | {len(times)} | {min(times):.1f}–{max(times):.1f} | {sum(times):.0f} s |")
    total = sum(sum(t) for t in per_kernel.values())
    print(f"| all | {sum(len(t) for t in per_kernel.values())} | | {total:.0f} s |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
