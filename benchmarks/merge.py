"""merge_attention's bandwidth: the bytes it reads and writes per second, against a device-to-device copy
of as many bytes (the copy ceiling), queued and per call; beside it a merge written with CuPy's array
operations.

    PYTHONPATH=$PWD python3 benchmarks/merge.py [--parts 2 4 8] [--dtypes fp16 fp32] [--rows 512 65536 2097152]

Each part is ``(o, m, l)`` of ``rows`` query rows of D = 128 (``rows`` = batch x heads x Nq: 512 is one
decoding step of B 16 x H 32, 2097152 a prefill of 16 x 32 x 4096). Bytes = (parts + 1) x (o + m + l).
"""

import argparse
import sys
from pathlib import Path

import cupy
import ml_dtypes
import numpy

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402  (the timing helpers)

import cupyflash  # noqa: E402

DTYPES = {"fp16": numpy.float16, "bf16": ml_dtypes.bfloat16, "fp32": numpy.float32, "fp64": numpy.float64}
D = 128


def cupy_merge(parts):
    """The merge in CuPy array operations (one kernel per operation), for comparison."""
    o = cupy.stack([p[0] for p in parts])
    m = cupy.stack([p[1] for p in parts])
    l = cupy.stack([p[2] for p in parts])
    m_all = m.max(axis=0)
    w = l * cupy.exp(m - m_all)
    l_all = w.sum(axis=0)
    return (((w / l_all)[..., None] * o.astype(cupy.float32)).sum(axis=0)).astype(o.dtype), m_all, l_all


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--dtypes", nargs="+", default=["fp16", "fp32"], choices=DTYPES)
    parser.add_argument("--rows", type=int, nargs="+", default=[512, 65536, 2097152])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args(argv)
    clock = bench.cupy_clock()
    print(f"# merge_attention, D = {D}, {cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()}")
    print("| dtype | parts | rows | MB moved | copy GB/s | merge GB/s queued | / copy | single call µs | "
          "CuPy ops GB/s | merge / CuPy ops |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name in args.dtypes:
        dtype = numpy.dtype(DTYPES[name])
        for rows in args.rows:
            for n in args.parts:
                rng = cupy.random.default_rng(n)
                parts = [(rng.standard_normal((rows, D), dtype=cupy.float32).astype(dtype),
                          rng.standard_normal(rows, dtype=cupy.float32).astype(cupyflash._tiles.accumulator_dtype(dtype)),
                          rng.uniform(1, 100, rows).astype(cupyflash._tiles.accumulator_dtype(dtype)))
                         for _ in range(n)]
                part_bytes = sum(x.nbytes for x in parts[0])
                moved = (n + 1) * part_bytes
                src = cupy.empty(moved // 2, numpy.uint8)
                dst = cupy.empty_like(src)
                copy_ms = bench.median_ms(lambda: dst.__setitem__(Ellipsis, src), clock, 3, args.repeats)
                merge = lambda: cupyflash.merge_attention(parts)  # noqa: E731
                queued = bench.median_ms(merge, clock, 3, args.repeats)
                single = bench.single_ms(merge, clock, args.repeats)
                naive = bench.median_ms(lambda: cupy_merge(parts), clock, 3, args.repeats)
                gbs = lambda ms: moved / ms / 1e6  # noqa: E731
                print(f"| {name} | {n} | {rows} | {moved / 1e6:.1f} | {gbs(copy_ms):.0f} | {gbs(queued):.0f} | "
                      f"{copy_ms / queued:.2f} | {single * 1e3:.1f} | {gbs(naive):.0f} | {naive / queued:.2f} |")
                del parts, src, dst
                bench.free_memory()
    return 0


if __name__ == "__main__":
    sys.exit(main())
