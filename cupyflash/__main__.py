"""``python -m cupyflash [demo | bench ...]``.

``demo`` (the default): attention on random data, checked against the float64
reference. On a machine with a CUDA GPU the fused kernels run; without one the
same blocked algorithm runs in NumPy, and the demo says so.

``bench``: the side-by-side benchmark, ``benchmarks/bench.py`` of the source
checkout, with its own options (``python -m cupyflash bench --help``).
"""

from __future__ import annotations

import argparse
import runpy
import sys
import time
from pathlib import Path

import numpy

import cupyflash
from cupyflash import reference


def _gpu():
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() > 0:
            return cupy
    except Exception:  # no cupy or no usable driver/device
        pass
    return None


def _rel(got, ref) -> float:
    got, ref = numpy.asarray(got, numpy.float64), numpy.asarray(ref, numpy.float64)
    return float(numpy.linalg.norm(got - ref) / numpy.linalg.norm(ref))


def demo(batch: int, heads: int, seqlen: int, head_dim: int, causal: bool) -> int:
    cupy = _gpu()
    rng = numpy.random.default_rng(0)
    dtype = numpy.float16 if cupy is not None else numpy.float32
    shape = (batch, heads, seqlen, head_dim)
    q, k, v, do = (rng.standard_normal(shape).astype(dtype) for _ in range(4))
    if cupy is None:
        print("no CUDA GPU found: running the NumPy path (the blocked Algorithm 1 on the CPU), float32")
        inputs = (q, k, v, do)
    else:
        name = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"]
        name = name.decode() if isinstance(name, bytes) else name
        print(f"GPU: {name} — running the fused CUDA kernels, float16")
        inputs = tuple(cupy.asarray(x) for x in (q, k, v, do))
    print(f"q, k, v: {shape}, causal={causal}")

    start = time.perf_counter()
    o, m, l = cupyflash.flash_attention_forward(*inputs[:3], causal=causal)
    dq, dk, dv = cupyflash.flash_attention_backward(inputs[3], *inputs[:3], o, m, l, causal=causal)
    if cupy is not None:
        cupy.cuda.Device().synchronize()
        o, m, l, dq, dk, dv = (x.get() for x in (o, m, l, dq, dk, dv))
    elapsed = time.perf_counter() - start

    o_ref, m_ref, l_ref = reference.attention_forward(q, k, v, causal=causal)
    grads_ref = reference.attention_backward(do, q, k, v, o_ref, m_ref, l_ref, causal=causal)
    errors = {"o": _rel(o, o_ref), "m": _rel(m, m_ref), "l": _rel(l, l_ref)}
    errors.update({name: _rel(g, r) for name, g, r in zip(("dq", "dk", "dv"), (dq, dk, dv), grads_ref)})
    limit = 5e-3 if dtype == numpy.float16 else 1e-4
    note = " (the first call compiles the kernels)" if cupy is not None else ""
    print(f"forward + backward: {elapsed * 1e3:.1f} ms{note}")
    print("relative error against the float64 reference: "
          + ", ".join(f"{name} {err:.1e}" for name, err in errors.items()))
    ok = all(err <= limit for err in errors.values())
    print("OK" if ok else f"FAILED: an error exceeds {limit:.0e}")
    return 0 if ok else 1


BENCH_SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "bench.py"


def bench(argv) -> int:
    if not BENCH_SCRIPT.is_file():
        print(f"the benchmark ships with the source checkout ({BENCH_SCRIPT} not found)", file=sys.stderr)
        return 2
    sys.argv = [str(BENCH_SCRIPT), *argv]
    try:
        runpy.run_path(str(BENCH_SCRIPT), run_name="__main__")
    except SystemExit as stop:
        return stop.code if isinstance(stop.code, int) else 0
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:
        return bench(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m cupyflash", description=__doc__.splitlines()[0])
    parser.add_argument("command", nargs="?", default="demo", choices=["demo", "bench"])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seqlen", type=int, default=None, help="default 1024 on a GPU, 256 on the CPU")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--causal", action="store_true")
    args = parser.parse_args(argv)
    seqlen = args.seqlen or (1024 if _gpu() is not None else 256)
    return demo(args.batch, args.heads, seqlen, args.head_dim, args.causal)


if __name__ == "__main__":
    sys.exit(main())
