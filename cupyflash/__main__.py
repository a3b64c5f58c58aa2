"""``python -m cupyflash [demo | info | precompile | bench ...]``.

``demo`` (the default): attention on random data, checked against the float64
reference. On a machine with a CUDA GPU the fused kernels run; without one the
same blocked algorithm runs in NumPy, and the demo says so.

``info``: versions (cupyflash, NumPy, ml_dtypes, CuPy, CUDA runtime, driver,
NVRTC), each GPU and which kernels run on it, where the kernel sources and
CuPy's kernel cache are, how many specialisations this GPU can use without
modifiers and how many can exist on it with them (``_tiles.specialisation_count``;
for sm_90 where no GPU is found). Without CuPy or a GPU it says so and exits 0.

``precompile``: compile specialisations for this GPU into CuPy's kernel cache
now (``cupyflash.precompile``), e.g. when a container image is built on a GPU
machine; ``--kernels``, ``--dtypes``, ``--head-dims`` choose which.

``bench``: the side-by-side benchmark, ``benchmarks/bench.py`` (the wheel
carries it), with its own options (``python -m cupyflash bench --help``, which needs neither CuPy nor a
GPU). Without CuPy or a usable GPU a run says so in one line and exits 2, as ``precompile`` does.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import runpy
import sys
import time
from pathlib import Path

import ml_dtypes
import numpy

import cupyflash
from cupyflash import _compile, _tiles, reference


def _gpu_or_why():
    """(cupy, None) where a CUDA GPU can be used, else (None, why not) in one line: CuPy missing, or
    CuPy present with no usable device or driver, and the error it gave."""
    try:
        import cupy
    except ImportError:
        return None, f"CuPy is not installed; for the GPU kernels, {_compile.install_hint()}"
    try:
        if cupy.cuda.runtime.getDeviceCount() > 0:
            return cupy, None
        return None, f"CuPy {cupy.__version__} is installed but finds no CUDA device"
    except Exception as error:  # no usable driver or device
        why = " ".join(str(error).split()) or type(error).__name__
        return None, f"CuPy {cupy.__version__} is installed but cannot use a GPU: {why}"


def _rel(got, ref) -> float:
    got, ref = numpy.asarray(got, numpy.float64), numpy.asarray(ref, numpy.float64)
    return float(numpy.linalg.norm(got - ref) / numpy.linalg.norm(ref))


def demo(batch: int, heads: int, seqlen: int, head_dim: int, causal: bool, gpu=None) -> int:
    cupy, why = gpu if gpu is not None else _gpu_or_why()
    rng = numpy.random.default_rng(0)
    dtype = numpy.float16 if cupy is not None else numpy.float32
    shape = (batch, heads, seqlen, head_dim)
    q, k, v, do = (rng.standard_normal(shape).astype(dtype) for _ in range(4))
    if cupy is None:
        print(f"no usable CUDA GPU, running the NumPy path (the blocked Algorithm 1 on the CPU, float32): {why}")
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


def _cuda_version(number: int) -> str:
    return f"{number // 1000}.{number % 1000 // 10}"


def _can_exist(smem: int, arch: str) -> str:
    """How many specialisations can exist on a device of ``arch`` with ``smem`` bytes of shared memory per block."""
    return (f"{_tiles.specialisation_count(smem, arch)} specialisations can exist on {arch} with {smem // 1024} KB "
            f"of shared memory per block (families x dtypes x head-dim buckets x precisions x compile-time flag "
            f"sets; user expressions aside)")


def info() -> int:
    print(f"cupyflash {cupyflash.__version__} at {Path(cupyflash.__file__).resolve().parent}")
    print(f"numpy {numpy.__version__}, ml_dtypes {ml_dtypes.__version__}")
    print(f"kernel sources: {_compile.kernel_dir()}")
    try:
        import cupy
    except ImportError:
        print(f"CuPy: not installed, so only the NumPy path runs; for the GPU kernels: {_compile.install_hint()}")
        print(f"on an H100/H200: {_can_exist(_tiles.SM90_SMEM_BLOCK, 'sm_90')}")
        return 0
    from cupy_backends.cuda.libs import nvrtc

    print(f"CuPy {cupy.__version__}; NVRTC {'.'.join(map(str, nvrtc.getVersion()))}")
    if not _compile.holds_bfloat16(cupy):
        print(f"  this CuPy holds no bfloat16 arrays: bfloat16 on the GPU needs CuPy >= {_compile.BFLOAT16_CUPY} "
              "(the cuda12/cuda13 extras)")
    cache = os.environ.get("CUPY_CACHE_DIR", str(Path.home() / ".cupy" / "kernel_cache"))
    files = len(list(Path(cache).glob("*"))) if Path(cache).is_dir() else 0
    print(f"CuPy kernel cache: {cache} ({files} files, all programs' kernels; CUPY_CACHE_DIR moves it)")
    try:
        count, why = cupy.cuda.runtime.getDeviceCount(), ""
        runtime = _cuda_version(cupy.cuda.runtime.runtimeGetVersion())
        driver = _cuda_version(cupy.cuda.runtime.driverGetVersion())
    except cupy.cuda.runtime.CUDARuntimeError as error:
        count, why = 0, f" ({error})"
    if count == 0:
        print(f"no CUDA GPU found{why}: the NumPy path runs")
        print(f"on an H100/H200: {_can_exist(_tiles.SM90_SMEM_BLOCK, 'sm_90')}")
        return 0
    print(f"CUDA runtime {runtime}, driver {driver}")
    for device_id in range(count):
        with cupy.cuda.Device(device_id) as device:
            props = cupy.cuda.runtime.getDeviceProperties(device_id)
            name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
            capability = device.compute_capability
            smem = device.attributes["MaxSharedMemoryPerBlockOptin"]
            hopper = "Hopper warpgroup-MMA kernels for float16/bfloat16" if capability == "90" else "portable kernels"
            configs = _tiles.all_tile_configs(smem, f"sm_{capability}")
            print(f"GPU {device_id}: {name}, compute capability {capability[:-1]}.{capability[-1]}, "
                  f"{device.attributes['MultiProcessorCount']} SMs, {smem // 1024} KB shared memory per block; "
                  f"{hopper}; {len(configs)} specialisations without modifiers, compiled on first use "
                  f"(or by `python -m cupyflash precompile`); {_can_exist(smem, f'sm_{capability}')}")
    return 0


def precompile(argv) -> int:
    parser = argparse.ArgumentParser(prog="python -m cupyflash precompile",
                                     description="compile specialisations for this GPU into CuPy's kernel cache")
    parser.add_argument("--kernels", nargs="+", help="e.g. fwd_sm90 bwd_sm90 (default: all that run here)")
    parser.add_argument("--dtypes", nargs="+", help="float16 bfloat16 float32 float64 (default: all)")
    parser.add_argument("--head-dims", nargs="+", type=int, help="head dims to serve (default: every bucket)")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    try:
        done = cupyflash.precompile(args.kernels, args.dtypes, args.head_dims)
    except RuntimeError as error:
        print(error, file=sys.stderr)
        return 2
    for cfg in done:
        variant = f" precision={_tiles.PRECISION_OF[cfg.fp32_mma]}" if cfg.fp32_mma else ""
        print(f"{cfg.kernel} {cfg.dtype} D<={cfg.d_pad} tiles {cfg.block_r}x{cfg.block_c}{variant}")
    print(f"{len(done)} specialisations compiled or found in the cache in {time.perf_counter() - start:.1f} s")
    return 0


# the benchmark as installed (setup.py copies benchmarks/bench.py into a built package), or in a checkout
BENCH_SCRIPTS = (Path(__file__).resolve().parent / "benchmarks" / "bench.py",
                 Path(__file__).resolve().parent.parent / "benchmarks" / "bench.py")


def bench(argv) -> int:
    script = next((p for p in BENCH_SCRIPTS if p.is_file()), None)
    if script is None:
        print(f"the benchmark is not installed ({' or '.join(map(str, BENCH_SCRIPTS))} not found)", file=sys.stderr)
        return 2
    if not {"-h", "--help"} & set(argv):   # the options print without CuPy; a run needs CuPy and a GPU
        if importlib.util.find_spec("cupy") is None:
            print(f"the benchmark needs CuPy and a GPU: {_compile.install_hint(',bench')}", file=sys.stderr)
            return 2
        cupy, why = _gpu_or_why()
        if cupy is None:
            print(f"the benchmark needs a CUDA GPU, and none can be used here: {why}", file=sys.stderr)
            return 2
    sys.argv = [str(script), *argv]
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as stop:   # argparse's exits, or sys.exit("why") from the script
        if stop.code is None or isinstance(stop.code, int):
            return stop.code or 0
        print(stop.code, file=sys.stderr)
        return 2
    return 0


def _in_range(low, high=None):
    """An argparse type: an int in [low, high] (no upper bound when ``high`` is None)."""
    def parse(text):
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if value < low or (high is not None and value > high):
            bounds = f"at least {low}" if high is None else f"from {low} to {high}"
            raise argparse.ArgumentTypeError(f"must be {bounds}, got {value}")
        return value

    return parse


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:
        return bench(argv[1:])
    if argv[:1] == ["precompile"]:
        return precompile(argv[1:])
    if argv[:1] == ["info"]:
        return info()
    parser = argparse.ArgumentParser(prog="python -m cupyflash", description=__doc__.splitlines()[0])
    parser.add_argument("command", nargs="?", default="demo", choices=["demo", "info", "precompile", "bench"])
    parser.add_argument("--batch", type=_in_range(1), default=2, help="at least 1 (default %(default)s)")
    parser.add_argument("--heads", type=_in_range(1), default=4, help="at least 1 (default %(default)s)")
    parser.add_argument("--seqlen", type=_in_range(1), default=None,
                        help="at least 1 (default 1024 on a GPU, 256 on the CPU)")
    parser.add_argument("--head-dim", type=_in_range(1, _tiles.MAX_HEAD_DIM), default=64,
                        help=f"1 to {_tiles.MAX_HEAD_DIM} (default %(default)s)")
    parser.add_argument("--causal", action="store_true")
    args = parser.parse_args(argv)
    gpu = _gpu_or_why()
    seqlen = args.seqlen if args.seqlen is not None else (1024 if gpu[0] is not None else 256)
    return demo(args.batch, args.heads, seqlen, args.head_dim, args.causal, gpu)


if __name__ == "__main__":
    sys.exit(main())
