"""Side-by-side benchmark: cupyflash against naive CuPy attention and PyTorch SDPA.

Protocol of the FlashAttention papers: B·N = 16384 tokens, H·D = 2048 hidden,
layout (B, H, N, D), N from 512 to 16384, D in (64, 128), causal and not,
fp16 and bf16; modes forward, backward and fwd+bwd (one forward then one
backward, timed together).

FLOPs: forward 4·B·H·Nq·Nk·D (two matmuls), halved when causal; backward
2.5 x forward; fwd+bwd 3.5 x forward. Times: CUDA events, the median of the
timed calls after untimed warm-up calls (the first call compiles kernels).

Systems, timed in one process on the same inputs:
  cupyflash-v1  cupyflash.flash_attention_forward / _backward, schedule="v1"
  cupyflash-v2  the same with schedule="v2" (ratio columns compare this one); on sm_90 its
                16-bit forward and backward are the warpgroup-MMA kernels
  cupyflash-v2-mma  schedule="v2" on the portable mma.sync kernels (an A/B on sm_90)
  cupyflash-fp8  flash_attention_forward_fp8 on float8 e4m3 copies of q, k, v (forward only;
                the float8 Hopper kernel on sm_90 at D <= 128)
  cupyflash-v2-det  schedule="v2", backward with deterministic=True (the cost of ordered sums)
  naive         cuBLAS S = q kᵀ in the input dtype, softmax in float32,
                P cast back, P v (cupy.matmul; bf16 through
                cublasGemmStridedBatchedEx, as cupy.matmul lacks it);
                forward only, skipped when the N×N scores do not fit
  torch-flash   torch SDPA, flash backend   } only where torch and
  torch-cudnn   torch SDPA, cuDNN backend   } torch.cuda are available;
                inputs shared zero-copy through DLPack

Decoding (``--decode``, issue #18): one query row per sequence, 32 query heads against 32, 8 or 1
K/V heads (GQA by broadcasting), Nk from 1k to 128k, B 16 and 1, D 128: the bytes of K and V over the
time, queued and per call, beside a device copy's bandwidth and torch SDPA's flash and cuDNN backends.

Host cost (``--host``, also part of the default run): at small shapes (HOST_SHAPES, float16,
causal) cupyflash's and torch flash's forward and backward, timed three ways: wall time per call
of HOST_CALLS back-to-back calls (the host cost once it exceeds the GPU's), one call between two
CUDA events after a synchronisation (a call as a user meets it, launch latency included), and the
queued median of the sweep (events around each of back-to-back calls).

The default run is the sweep, then the floor check (cupyflash / naive forward
at N=4096, D=128, B=4, H=16, fp16 must be >= 3.5x) and the long-sequence memory
check (cupyflash forward at N=65536). It writes bench_results.json, bench_results.md and
results.png (when matplotlib imports) into --out-dir; RESULTS.md next to this script is the
hand-kept record of runs, never written by it.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Callable

import ml_dtypes
import numpy

try:
    import cupy
    from cupy_backends.cuda.api.runtime import CUDA_R_16BF
    from cupy_backends.cuda.libs import cublas
except ImportError:     # --help needs no CuPy; main() says what a run needs
    cupy = None

REPO_ROOT = Path(__file__).resolve().parent.parent
CHECKOUT = (REPO_ROOT / "cupyflash" / "__init__.py").is_file()   # else installed: cupyflash/benchmarks/bench.py
if CHECKOUT:
    sys.path.insert(0, str(REPO_ROOT))
import cupyflash  # noqa: E402
from cupyflash import _launch  # noqa: E402

# Protocol of the FlashAttention papers
TOKENS = 16384                              # B · N
HIDDEN = 2048                               # H · D
SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
HEAD_DIMS = (64, 128)
DTYPES = {"fp16": numpy.float16, "bf16": ml_dtypes.bfloat16, "fp32": numpy.float32, "fp64": numpy.float64}
SWEEP_DTYPES = ("fp16", "bf16")   # the FlashAttention papers' sweep; --dtypes fp32 fp64 adds issue #16's cases
BFLOAT16 = numpy.dtype(ml_dtypes.bfloat16)
MODES = ("fwd", "bwd", "fwd+bwd")
QUICK_SEQLENS = (1024, 4096)
QUICK_HEAD_DIMS = (128,)
QUICK_DTYPES = ("fp16",)
CAUSAL_FLAGS = {"0": (False,), "1": (True,), "both": (False, True)}   # --causal
# issue #16's cases (--breadth): 16-bit head dims past 128 on the FA protocol, float32/float64 at D 64
# and 128 on the (B 2, H 8, N 4096) and the FA protocol at two lengths
BREADTH_16BIT_HEAD_DIMS = (160, 192, 256)
BREADTH_16BIT_SEQLENS = (1024, 2048, 4096, 8192, 16384)
BREADTH_WIDE_HEAD_DIMS = (64, 128)
BREADTH_WIDE_SEQLENS = (1024, 4096)
BREADTH_WIDE_SHAPE = (2, 8, 4096)           # (B, H, N)

# FLOPs of a mode as a multiple of the forward's 4·B·H·Nq·Nk·D
FLOPS_PER_FORWARD = {"fwd": 1.0, "bwd": 2.5, "fwd+bwd": 3.5}
CAUSAL_FLOP_FRACTION = 0.5                  # the causal mask keeps half of the scores

WARMUP = 3
REPEATS = 20

NAIVE_BYTES_PER_SCORE = 4 + 2 + 2           # float32 S, 16-bit S, 16-bit P
NAIVE_MEMORY_FRACTION = 0.6                 # of the free GPU memory
FLOAT32_BYTES = 4

# host cost: (B, H, N, D) shapes, back-to-back calls per wall-time figure, single calls per median
HOST_SHAPES = ((1, 1, 64, 64), (4, 8, 256, 64))
HOST_CALLS = 2000
HOST_SINGLE = 200
US_PER_S = 1e6

FLOOR_RATIO = 3.5                           # cupyflash / naive forward speed the issue asks for
LONG_WARMUP = 1
LONG_REPEATS = 5

# decoding (--decode, issue #18): B, K/V heads and keys of each point; 32 query heads, D 128; the paged
# cache's page size
DECODE_BATCHES = (16, 1)
DECODE_KV_HEADS = (32, 8, 1)
DECODE_KEYS = (1024, 4096, 32768, 131072)
DECODE_HQ = 32
DECODE_D = 128
DECODE_PAGE = 64

SEED = 0
GB = 1e9
TERA = 1e12
MS_PER_S = 1e3
NOTE_CHARS = 200                            # longest error message kept in a record
# What a run writes into --out-dir: raw records, their tables, the plot (the README shows the
# committed results.png; the other two are not kept in git)
OUTPUT_NAMES = ("bench_results.json", "bench_results.md", "results.png")

FLASH = "cupyflash-v2"          # the fast path: ratio columns compare it with every other system
FLOOR_SYSTEM = "cupyflash-v1"   # issue #2's floor is a V1 promise
SCHEDULES = {"cupyflash-v1": "v1", "cupyflash-v2": "v2", "cupyflash-v2-mma": "v2", "cupyflash-v2-det": "v2",
             "cupyflash-v1-tf32": "v1", "cupyflash-v2-tf32": "v2"}
LONG_SYSTEM = "cupyflash-v1"    # the long run shows V1's O(N) workspace


@dataclass(frozen=True)
class Config:
    """One benchmarked problem: q, k, v, do of shape (B, H, N, D)."""

    dtype: str          # key of DTYPES
    D: int
    N: int
    causal: bool
    B: int
    H: int


def protocol_config(dtype, D, N, causal) -> Config:
    return Config(dtype, D, N, causal, B=max(1, TOKENS // N), H=max(1, HIDDEN // D))


FLOOR_CONFIG = protocol_config("fp16", D=128, N=4096, causal=False)        # B=4, H=16
LONG_CONFIG = Config("fp16", D=128, N=65536, causal=False, B=1, H=16)


def forward_flops(cfg: Config) -> float:
    """4·B·H·N²·D: S = q kᵀ and O = P v, 2 FLOPs per multiply-add; halved when causal."""
    flops = 4.0 * cfg.B * cfg.H * cfg.N * cfg.N * cfg.D
    return flops * CAUSAL_FLOP_FRACTION if cfg.causal else flops


@dataclass
class Inputs:
    """Random normal q, k, v and output gradient do, each (B, H, N, D), on the GPU."""

    q: cupy.ndarray
    k: cupy.ndarray
    v: cupy.ndarray
    do: cupy.ndarray
    causal: bool


def make_inputs(cfg: Config, seed: int) -> Inputs:
    rng = cupy.random.default_rng(seed)
    shape = (cfg.B, cfg.H, cfg.N, cfg.D)
    q, k, v, do = (rng.standard_normal(shape, dtype=cupy.float32).astype(DTYPES[cfg.dtype]) for _ in range(4))
    return Inputs(q, k, v, do, cfg.causal)


class Unavailable(Exception):
    """A system cannot run a configuration; the message says why and is recorded."""


# ---------------------------------------------------------------------------
# Systems: each maps Inputs to {mode: a zero-argument call that runs it once}.
# Preparation (a first forward, a DLPack view, a mask) happens here, untimed.


@contextlib.contextmanager
def hopper_kernels(enabled: bool):
    """Run the block with the Hopper kernels switched on or off (``_launch.USE_WGMMA``), then restore it."""
    saved = _launch.USE_WGMMA
    _launch.USE_WGMMA = enabled
    try:
        yield
    finally:
        _launch.USE_WGMMA = saved


def cupyflash_runs(schedule: str, x: Inputs, *, wgmma: bool = True, deterministic: bool = False,
                   precision: str = "highest") -> dict:
    def forward():
        return cupyflash.flash_attention_forward(x.q, x.k, x.v, causal=x.causal, schedule=schedule,
                                                 precision=precision)

    def backward_from(o, m, l):
        return cupyflash.flash_attention_backward(x.do, x.q, x.k, x.v, o, m, l, causal=x.causal,
                                                  schedule=schedule, precision=precision,
                                                  deterministic=deterministic)

    if not wgmma:   # the portable kernels where the Hopper ones would run: switched for each call alone
        forward, backward_from = (_portable(f) for f in (forward, backward_from))
    saved = forward()       # o, m, l for the timed backward
    return {"fwd": forward, "bwd": lambda: backward_from(*saved), "fwd+bwd": lambda: backward_from(*forward())}


def fp8_runs(x: Inputs) -> dict:
    """cupyflash.flash_attention_forward_fp8 on float8 e4m3 copies of q, k, v (made here, untimed, through
    ml_dtypes on the host), o in the inputs' 16-bit dtype."""
    import ml_dtypes

    if x.q.dtype.itemsize != 2:
        raise Unavailable("the float8 forward is timed beside the 16-bit inputs it stands in for")
    q, k, v = (cupy.asarray(a.get().astype(ml_dtypes.float8_e4m3fn).view(numpy.uint8)) for a in (x.q, x.k, x.v))
    out_dtype = x.q.dtype

    def forward():
        return cupyflash.flash_attention_forward_fp8(q, k, v, causal=x.causal, out_dtype=out_dtype)

    return {"fwd": forward}


def _portable(call):
    def run(*args):
        with hopper_kernels(False):
            return call(*args)
    return run


def cublas_matmul(a, b, *, transpose_b=False):
    """``a @ b`` (``a @ bᵀ`` with ``transpose_b``) through cuBLAS, in the input dtype, float32 accumulation.

    a (batch, M, K) and b (batch, K, N), or b (batch, N, K) with
    ``transpose_b``; both C-contiguous. ``cupy.matmul`` for float16; CuPy 14's
    matmul does not take bfloat16, so bfloat16 calls cublasGemmStridedBatchedEx.
    """
    if a.dtype != BFLOAT16:
        return cupy.matmul(a, b.swapaxes(-1, -2) if transpose_b else b)
    assert a.flags.c_contiguous and b.flags.c_contiguous, "cublas_matmul takes C-contiguous arrays"
    *batch, M, K = a.shape
    N = b.shape[-2] if transpose_b else b.shape[-1]
    c = cupy.empty((*batch, M, N), a.dtype)
    one, zero = numpy.ones(1, numpy.float32), numpy.zeros(1, numpy.float32)   # host alpha, beta
    handle = cupy.cuda.device.get_cublas_handle()
    cublas.setStream(handle, cupy.cuda.get_current_stream().ptr)
    # cuBLAS is column-major: row-major C = A op(B) is column-major Cᵀ = op(B)ᵀ Aᵀ
    op_b, ld_b = (cublas.CUBLAS_OP_T, K) if transpose_b else (cublas.CUBLAS_OP_N, N)
    cublas.gemmStridedBatchedEx(
        handle, op_b, cublas.CUBLAS_OP_N, N, M, K,
        one.ctypes.data, b.data.ptr, CUDA_R_16BF, ld_b, N * K,
        a.data.ptr, CUDA_R_16BF, K, M * K,
        zero.ctypes.data, c.data.ptr, CUDA_R_16BF, N, M * N,
        math.prod(batch), cublas.CUBLAS_COMPUTE_32F, cublas.CUBLAS_GEMM_DEFAULT)
    return c


def naive_attention(q, k, v, scale, bias):
    """softmax(scale · q kᵀ + bias) v with the (B, H, N, N) scores in HBM.

    cuBLAS matmuls in the input dtype, softmax in float32 (float64 for float64),
    P cast back to the input dtype. ``bias`` is (N, N), -inf above the diagonal, or None.
    """
    s = cublas_matmul(q, k, transpose_b=True)   # (B, H, N, N), input dtype
    p32 = s.astype(cupy.float64 if q.dtype == cupy.float64 else cupy.float32)   # (B, H, N, N)
    del s
    p32 *= scale
    if bias is not None:
        p32 += bias
    p32 -= p32.max(axis=-1, keepdims=True)
    cupy.exp(p32, out=p32)
    p32 /= p32.sum(axis=-1, keepdims=True)
    p = p32.astype(q.dtype)                     # (B, H, N, N), input dtype
    del p32
    return cublas_matmul(p, v)                  # (B, H, N, D)


def naive_runs(x: Inputs) -> dict:
    B, H, N, D = x.q.shape
    need = B * H * N * N * NAIVE_BYTES_PER_SCORE + (N * N * FLOAT32_BYTES if x.causal else 0)
    free, _ = cupy.cuda.Device().mem_info
    if need > NAIVE_MEMORY_FRACTION * free:
        raise Unavailable(f"N×N scores need {need / GB:.1f} GB > {NAIVE_MEMORY_FRACTION:.0%} "
                          f"of the free {free / GB:.1f} GB")
    scale = 1.0 / math.sqrt(D)
    # (N, N): key j is hidden from query i when j > i
    bias = cupy.triu(cupy.full((N, N), -numpy.inf, cupy.float32), k=1) if x.causal else None
    return {"fwd": lambda: naive_attention(x.q, x.k, x.v, scale, bias)}


def torch_runs(backend_name: str, x: Inputs) -> dict:
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, backend_name)
    try:
        q, k, v, do = (torch.from_dlpack(a) for a in (x.q, x.k, x.v, x.do))
    except Exception as error:  # noqa: BLE001 - e.g. a dtype DLPack cannot carry
        raise Unavailable(f"DLPack of {x.q.dtype} failed: {short(error)}") from error
    leaves = tuple(t.detach().requires_grad_() for t in (q, k, v))

    def sdpa(q, k, v):
        with sdpa_kernel(backend):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=x.causal)

    try:
        out = sdpa(*leaves)     # its graph is reused by the timed backward
    except RuntimeError as error:
        raise Unavailable(f"{backend_name} cannot run this: {short(error)}") from error

    def backward():
        return torch.autograd.grad(out, leaves, do, retain_graph=True)

    def forward_backward():
        return torch.autograd.grad(sdpa(*leaves), leaves, do)

    return {"fwd": lambda: sdpa(q, k, v), "bwd": backward, "fwd+bwd": forward_backward}


@dataclass(frozen=True)
class Clock:
    """CUDA events of one library, recorded on its current stream."""

    new_event: Callable
    elapsed_ms: Callable


def cupy_clock() -> Clock:
    return Clock(cupy.cuda.Event, cupy.cuda.get_elapsed_time)


def torch_clock() -> Clock:
    import torch

    return Clock(lambda: torch.cuda.Event(enable_timing=True), lambda start, stop: start.elapsed_time(stop))


@dataclass(frozen=True)
class System:
    name: str
    modes: tuple
    runs: Callable          # Inputs -> {mode: call}; raises Unavailable
    clock: Callable         # () -> Clock
    needs_torch: bool


SYSTEMS = (
    *(System(name, MODES, partial(cupyflash_runs, schedule, wgmma=not name.endswith("-mma"),
                                  deterministic=name.endswith("-det"),
                                  precision="tf32" if name.endswith("-tf32") else "highest"),
             cupy_clock, needs_torch=False)
      for name, schedule in SCHEDULES.items()),
    System("cupyflash-fp8", ("fwd",), fp8_runs, cupy_clock, needs_torch=False),
    System("naive", ("fwd",), naive_runs, cupy_clock, needs_torch=False),
    System("torch-flash", MODES, partial(torch_runs, "FLASH_ATTENTION"), torch_clock, needs_torch=True),
    System("torch-cudnn", MODES, partial(torch_runs, "CUDNN_ATTENTION"), torch_clock, needs_torch=True),
    # torch's fp32 peer: the memory-efficient kernel (error-compensated TF32 products for float32)
    System("torch-efficient", MODES, partial(torch_runs, "EFFICIENT_ATTENTION"), torch_clock, needs_torch=True),
)
SYSTEM_NAMES = tuple(s.name for s in SYSTEMS)


def torch_missing() -> str | None:
    """Why torch SDPA cannot run here, or None when it can."""
    try:
        import torch
    except ImportError as error:
        return f"torch is not importable ({error})"
    if not torch.cuda.is_available():
        return "torch.cuda is not available"
    return None


# ---------------------------------------------------------------------------
# Timing


def device_synchronize():
    """Wait for all work on the device, on every stream of every library (cudaDeviceSynchronize)."""
    cupy.cuda.Device().synchronize()


def free_memory():
    gc.collect()
    cupy.get_default_memory_pool().free_all_blocks()
    if "torch" in sys.modules and sys.modules["torch"].cuda.is_available():
        sys.modules["torch"].cuda.empty_cache()


def median_ms(run, clock: Clock, warmup: int, repeats: int) -> float:
    """Median time of ``run()`` over ``repeats`` calls, each between two events, after ``warmup`` calls."""
    device_synchronize()
    for _ in range(warmup):
        run()
    events = [(clock.new_event(), clock.new_event()) for _ in range(repeats)]
    for start, stop in events:
        start.record()
        run()
        stop.record()
    events[-1][1].synchronize()
    return statistics.median(clock.elapsed_ms(start, stop) for start, stop in events)


def single_ms(run, clock: Clock, calls: int) -> float:
    """Median time of ``calls`` calls of ``run()`` as a user meets one: the device idle first, then the
    call between two events, its host cost included."""
    times = []
    for _ in range(calls):
        start, stop = clock.new_event(), clock.new_event()
        device_synchronize()
        start.record()
        run()
        stop.record()
        stop.synchronize()
        times.append(clock.elapsed_ms(start, stop))
    return statistics.median(times)


def short(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:NOTE_CHARS]


def make_record(system: str, mode: str, cfg: Config, flops: float, ms, note) -> dict:
    tflops = None if ms is None else flops / (ms / MS_PER_S) / TERA
    return dict(system=system, mode=mode, dtype=cfg.dtype, D=cfg.D, N=cfg.N, B=cfg.B, H=cfg.H,
                causal=cfg.causal, ms=ms, tflops=tflops, flops=flops, note=note)


def progress_line(tag: str, r: dict) -> str:
    head = (f"{tag} {r['dtype']} D={r['D']:<3} N={r['N']:<5} causal={int(r['causal'])} "
            f"{r['mode']:<7} {r['system']:<12}")
    if r["ms"] is None:
        return f"{head} unavailable: {r['note']}"
    return f"{head} {r['ms']:9.2f} ms {r['tflops']:6.1f} TFLOP/s"


def bench_system(system: System, x: Inputs, cfg: Config, modes, warmup: int, repeats: int, tag: str) -> list:
    """One record per mode of ``system`` on inputs ``x``; a failure is recorded, not raised."""
    free_memory()
    try:
        runs, unavailable = system.runs(x), None
    except Unavailable as error:
        runs, unavailable = {}, str(error)
    except Exception as error:  # noqa: BLE001 - record it and go on with the other systems
        runs, unavailable = {}, short(error)
    records = []
    for mode in (m for m in modes if m in system.modes):
        flops = forward_flops(cfg) * FLOPS_PER_FORWARD[mode]
        ms, note = None, unavailable
        if note is None:
            try:
                ms = median_ms(runs[mode], system.clock(), warmup, repeats)
            except Exception as error:  # noqa: BLE001
                note = short(error)
        records.append(make_record(system.name, mode, cfg, flops, ms, note))
        print(progress_line(tag, records[-1]), flush=True)
    return records


def run_sweep(configs, systems, modes, warmup: int, repeats: int) -> list:
    records = []
    width = len(str(len(configs)))
    for index, cfg in enumerate(configs, 1):
        x = make_inputs(cfg, SEED + index)
        tag = f"[{index:>{width}}/{len(configs)}]"
        for system in systems:
            records += bench_system(system, x, cfg, modes, warmup, repeats, tag)
        del x
        free_memory()
    return records


# ---------------------------------------------------------------------------
# The floor and the long-sequence check


def floor_summary(records) -> dict | None:
    """cupyflash / naive forward speed at FLOOR_CONFIG, or None when either was not timed."""
    def tflops(system):
        for r in records:
            if (r["system"], r["mode"]) == (system, "fwd") and r["tflops"] is not None and \
                    all(r[key] == value for key, value in asdict(FLOOR_CONFIG).items()):
                return r["tflops"]
        return None

    flash, naive = tflops(FLOOR_SYSTEM), tflops("naive")
    if flash is None or naive is None:
        return None
    ratio = flash / naive
    return dict(config=asdict(FLOOR_CONFIG), cupyflash_tflops=flash, naive_tflops=naive,
                ratio=ratio, target=FLOOR_RATIO, met=ratio >= FLOOR_RATIO)


def floor_text(floor: dict) -> str:
    c = floor["config"]
    return (f"Floor: {c['dtype']} D={c['D']} N={c['N']} B={c['B']} H={c['H']} non-causal forward: "
            f"cupyflash / naive = {floor['cupyflash_tflops']:.1f} / {floor['naive_tflops']:.1f} TFLOP/s "
            f"= {floor['ratio']:.2f}x, target >= {floor['target']}x: {'met' if floor['met'] else 'NOT met'}")


def long_sequence_check() -> dict:
    """cupyflash forward at N=65536: time, and the pool memory one forward adds beyond its inputs."""
    cfg = LONG_CONFIG
    free_memory()
    x = make_inputs(cfg, SEED)
    pool = cupy.get_default_memory_pool()

    def forward():
        return cupyflash.flash_attention_forward(x.q, x.k, x.v, causal=cfg.causal, schedule=SCHEDULES[LONG_SYSTEM])

    forward()                   # compiles; its outputs are dropped at once
    device_synchronize()
    pool.free_all_blocks()
    held_before = pool.total_bytes()
    o, m, l = forward()
    device_synchronize()
    # the pool keeps every block freed during the call, so its growth is the call's peak
    extra = pool.total_bytes() - held_before
    outputs = o.nbytes + m.nbytes + l.nbytes
    del o, m, l
    ms = median_ms(forward, cupy_clock(), LONG_WARMUP, LONG_REPEATS)
    flops = forward_flops(cfg)
    result = dict(config=asdict(cfg), system=LONG_SYSTEM, ms=ms, tflops=flops / (ms / MS_PER_S) / TERA,
                  inputs_bytes=x.q.nbytes + x.k.nbytes + x.v.nbytes, outputs_bytes=outputs, extra_bytes=extra,
                  naive_scores_bytes=cfg.B * cfg.H * cfg.N * cfg.N * FLOAT32_BYTES,
                  gpu_bytes=cupy.cuda.Device().mem_info[1])
    del x
    free_memory()
    return result


def long_text(r: dict) -> str:
    if "error" in r:
        return f"Long sequence check failed: {r['error']}"
    c = r["config"]
    return (f"Long sequence: {c['dtype']} D={c['D']} N={c['N']} B={c['B']} H={c['H']} non-causal forward, "
            f"{r['system']} {r['ms']:.2f} ms {r['tflops']:.1f} TFLOP/s; memory: inputs q,k,v "
            f"{r['inputs_bytes'] / GB:.2f} GB, outputs o,m,l {r['outputs_bytes'] / GB:.2f} GB, "
            f"pool growth during one forward {r['extra_bytes'] / GB:.2f} GB; naive would need "
            f"{r['naive_scores_bytes'] / GB:.1f} GB for the N×N float32 scores alone "
            f"(GPU memory {r['gpu_bytes'] / GB:.1f} GB)")


def host_cost_check(systems) -> list:
    """Per-call cost at HOST_SHAPES (float16, causal) of the forward and backward of ``systems``
    (cupyflash-v2 and torch-flash where present): wall, single and queued microseconds."""
    records = []
    for B, H, N, D in HOST_SHAPES:
        cfg = Config("fp16", D, N, True, B, H)
        x = make_inputs(cfg, SEED)
        for system in systems:
            try:
                runs = system.runs(x)
            except Unavailable as error:
                records.append(dict(system=system.name, shape=(B, H, N, D), note=str(error)))
                continue
            clock = system.clock()
            for mode in ("fwd", "bwd"):
                run = runs[mode]
                for _ in range(WARMUP * 10):
                    run()
                device_synchronize()
                started = time.perf_counter()
                for _ in range(HOST_CALLS):
                    run()
                device_synchronize()
                wall = (time.perf_counter() - started) / HOST_CALLS * US_PER_S
                single = single_ms(run, clock, HOST_SINGLE) * 1e3
                queued = median_ms(run, clock, WARMUP, REPEATS) * 1e3
                records.append(dict(system=system.name, shape=(B, H, N, D), mode=mode, wall_us=wall,
                                    single_us=single, queued_us=queued))
                print(f"host cost {system.name:<12} {mode} (B, H, N, D) = {(B, H, N, D)}: {wall:6.1f} us per "
                      f"back-to-back call, {records[-1]['single_us']:6.1f} us single, {queued:6.1f} us queued",
                      flush=True)
        del x
        free_memory()
    return records


def host_text(records) -> list:
    lines = ["| system | mode | (B, H, N, D) | wall per call, back-to-back (us) | single call (us) | queued (us) |",
             "|---|---|---|---:|---:|---:|"]
    for r in records:
        if "note" in r:
            lines.append(f"| {r['system']} | — | {r['shape']} | {r['note']} | | |")
        else:
            lines.append(f"| {r['system']} | {r['mode']} | {tuple(r['shape'])} | {r['wall_us']:.1f} | "
                         f"{r['single_us']:.1f} | {r['queued_us']:.1f} |")
    return lines


# ---------------------------------------------------------------------------
# Decoding (--decode): one query row per sequence against a long K/V, GQA by broadcasting


def decode_configs(dtype: str) -> list:
    """(dtype, B, Hkv, Nk) of issue #18's decode points: Hq = DECODE_HQ query heads, D = DECODE_D."""
    return [(dtype, B, Hkv, Nk) for B in DECODE_BATCHES for Hkv in DECODE_KV_HEADS for Nk in DECODE_KEYS]


def copy_ceiling_gbs(nbytes: int = 2 << 30) -> float:
    """GB/s of a device-to-device copy of ``nbytes`` (read and written): the bandwidth a read can reach."""
    src = cupy.empty(nbytes // 2, numpy.uint8)
    dst = cupy.empty_like(src)
    ms = median_ms(lambda: dst.__setitem__(Ellipsis, src), cupy_clock(), WARMUP, REPEATS)
    del src, dst
    free_memory()
    return nbytes / (ms / MS_PER_S) / GB


def decode_runs(dtype: str, B: int, Hkv: int, Nk: int, use_torch: bool) -> dict:
    """{system: (call, clock)}: cupyflash with q (B, Hkv, G, 1, D) against k, v (B, Hkv, 1, Nk, D); torch
    SDPA's flash and cuDNN backends on the same memory as q (B, Hq, 1, D), k, v (B, Hkv, Nk, D)
    (``enable_gqa``); one row that sees every key (causal bottom-right, as cupyflash and a decoding step
    align it; torch's is_causal is top-left, so its calls are not causal)."""
    G, D = DECODE_HQ // Hkv, DECODE_D
    rng = cupy.random.default_rng(SEED)
    q = rng.standard_normal((B, Hkv, G, 1, D), dtype=cupy.float32).astype(DTYPES[dtype])
    # K, V of up to 17 GB each: one random (Nk, D) block repeated over the heads (no float32 copy of it all)
    k, v = (cupy.empty((B, Hkv, 1, Nk, D), DTYPES[dtype]) for _ in range(2))
    for x in (k, v):
        x[...] = rng.standard_normal((Nk, D), dtype=cupy.float32).astype(DTYPES[dtype])
    runs = {"cupyflash": (lambda: cupyflash.flash_attention_forward(q, k, v, causal=True), cupy_clock())}
    # the same step through flash_attention_with_kvcache: the contiguous cache (every entry Nk long), and a
    # paged copy of it in pages of DECODE_PAGE rows, shuffled and in order (what scattering the pages costs
    # beside what reading them through the table costs)
    from cupyflash.kvcache import flash_attention_with_kvcache

    q4, k4, v4 = q.reshape(B, DECODE_HQ, 1, D), k.reshape(B, Hkv, Nk, D), v.reshape(B, Hkv, Nk, D)
    lens = cupy.full(B, Nk, numpy.int32)
    runs["cupyflash-cache"] = (lambda: flash_attention_with_kvcache(q4, k4, v4, lens), cupy_clock())
    per = -(-Nk // DECODE_PAGE)
    table = cupy.asarray(numpy.random.default_rng(SEED).permutation(B * per).reshape(B, per).astype(numpy.int32))
    kp, vp = (cupy.empty((B * per, Hkv, DECODE_PAGE, D), DTYPES[dtype]) for _ in range(2))
    for paged, whole in ((kp, k4), (vp, v4)):
        paged[...] = whole[0, 0, :DECODE_PAGE]
    runs["cupyflash-paged"] = (lambda: flash_attention_with_kvcache(q4, kp, vp, lens, block_table=table), cupy_clock())
    in_order = cupy.arange(B * per, dtype=numpy.int32).reshape(B, per)
    runs["cupyflash-paged-in-order"] = (lambda: flash_attention_with_kvcache(q4, kp, vp, lens, block_table=in_order),
                                        cupy_clock())
    if use_torch:
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel

        tq, tk, tv = (torch.from_dlpack(x) for x in (q.reshape(B, DECODE_HQ, 1, D), k.reshape(B, Hkv, Nk, D),
                                                       v.reshape(B, Hkv, Nk, D)))
        for name, backend in (("torch-flash", SDPBackend.FLASH_ATTENTION), ("torch-cudnn", SDPBackend.CUDNN_ATTENTION)):
            def call(backend=backend):
                with sdpa_kernel(backend):
                    # not is_causal: torch aligns its causal mask top-left, where one row would see key 0 only
                    return torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, enable_gqa=True)
            try:
                call()
            except RuntimeError as error:
                runs[name] = Unavailable(short(error))
                continue
            runs[name] = (call, torch_clock())
    return runs


def decode_check(dtypes, use_torch: bool, warmup: int, repeats: int) -> dict:
    """Effective K/V read bandwidth of one decoding step (bytes of K and V once / time), queued and per
    call, of cupyflash and torch SDPA's flash and cuDNN backends, beside the copy ceiling."""
    ceiling = copy_ceiling_gbs()
    records = []
    for dtype in dtypes:
        for _, B, Hkv, Nk in decode_configs(dtype):
            kv_bytes = 2 * B * Hkv * Nk * DECODE_D * numpy.dtype(DTYPES[dtype]).itemsize
            for system, run in decode_runs(dtype, B, Hkv, Nk, use_torch).items():
                record = dict(system=system, dtype=dtype, B=B, Hkv=Hkv, Nk=Nk, kv_bytes=kv_bytes)
                if isinstance(run, Unavailable):
                    record["note"] = str(run)
                else:
                    call, clock = run
                    queued = median_ms(call, clock, warmup, repeats)
                    single = single_ms(call, clock, repeats)
                    record.update(queued_us=queued * 1e3, single_us=single * 1e3,
                                  queued_gbs=kv_bytes / (queued / MS_PER_S) / GB,
                                  single_gbs=kv_bytes / (single / MS_PER_S) / GB)
                    print(f"decode {system:<12} {dtype} B={B:<2} Hkv={Hkv:<2} Nk={Nk:<6}: "
                          f"{record['queued_gbs']:7.0f} GB/s queued, {record['single_gbs']:7.0f} single "
                          f"({record['single_us']:.1f} us)", flush=True)
                records.append(record)
            free_memory()
    return dict(ceiling_gbs=ceiling, records=records)


def decode_text(decode: dict) -> list:
    lines = [f"Copy ceiling {decode['ceiling_gbs']:.0f} GB/s. Effective K/V read GB/s (queued / single call); "
             f"Hq = {DECODE_HQ}, D = {DECODE_D}, one query row, causal.", "",
             f"cache: flash_attention_with_kvcache, contiguous; paged: pages of {DECODE_PAGE} rows, shuffled "
             "(in order: the table 0, 1, 2, ...).", "",
             "| dtype | B | Hkv | Nk | K+V MB | cupyflash | cache | paged | in order | torch-flash | torch-cudnn "
             "| cupyflash / cuDNN (queued, single) | paged / cache | in order / cache |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    points = {}
    for r in decode["records"]:
        points.setdefault((r["dtype"], r["B"], r["Hkv"], r["Nk"], r["kv_bytes"]), {})[r["system"]] = r

    def cell(r):
        if r is None:
            return "—"
        return r["note"][:40] if "note" in r else f"{r['queued_gbs']:.0f} / {r['single_gbs']:.0f}"

    for (dtype, B, Hkv, Nk, nbytes), by in points.items():
        ours, cudnn = by.get("cupyflash"), by.get("torch-cudnn")
        ratio = "—"
        if ours and cudnn and "note" not in ours and "note" not in cudnn:
            ratio = f"{ours['queued_gbs'] / cudnn['queued_gbs']:.2f}, {ours['single_gbs'] / cudnn['single_gbs']:.2f}"
        cache, paged, in_order = (by.get(f"cupyflash-{name}") for name in ("cache", "paged", "paged-in-order"))

        def over_cache(r):
            ok = cache and r and "note" not in cache and "note" not in r
            return f"{r['queued_gbs'] / cache['queued_gbs']:.2f}" if ok else "—"

        lines.append(f"| {dtype} | {B} | {Hkv} | {Nk} | {nbytes / 1e6:.0f} | {cell(ours)} | {cell(cache)} | "
                     f"{cell(paged)} | {cell(in_order)} | {cell(by.get('torch-flash'))} | {cell(cudnn)} | {ratio} | "
                     f"{over_cache(paged)} | {over_cache(in_order)} |")
    return lines


# ---------------------------------------------------------------------------
# Outputs


def git_commit() -> str | None:
    """Short commit of the checkout (``-dirty`` if modified); ``CUPYFLASH_COMMIT`` where there is no .git."""
    if os.environ.get("CUPYFLASH_COMMIT"):
        return os.environ["CUPYFLASH_COMMIT"]

    def git(*args):
        return subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, check=True).stdout.strip()

    try:
        head = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("-dirty" if dirty else "")


def metadata(warmup: int, repeats: int, torch_note) -> dict:
    name = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"]
    torch = sys.modules.get("torch")
    return dict(
        gpu=name.decode() if isinstance(name, bytes) else name,
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        commit=git_commit(),
        python=platform.python_version(), numpy=numpy.__version__, cupy=cupy.__version__,
        cuda_runtime=cupy.cuda.runtime.runtimeGetVersion(),
        torch=None if torch is None else torch.__version__,
        torch_note=torch_note,
        warmup=warmup,
        repeats=repeats,
    )


def group_key(r: dict) -> tuple:
    return (list(DTYPES).index(r["dtype"]), r["D"], r["causal"], MODES.index(r["mode"]))


def fmt(value, spec=".1f", suffix="") -> str:
    return "—" if value is None else f"{value:{spec}}{suffix}"


def markdown(meta: dict, records: list, floor, long, host=None) -> str:
    lines = ["# cupyflash benchmark", "",
             f"GPU {meta['gpu']}, {meta['date']}, commit {meta['commit'] or 'unknown'}; cupy {meta['cupy']}, "
             f"torch {meta['torch']}; warm-up {meta['warmup']}, median of {meta['repeats']} timed runs.", "",
             f"B = {TOKENS} / N, H = {HIDDEN} / D, layout (B, H, N, D). TFLOP/s from forward FLOPs "
             "4·B·H·N²·D (halved when causal), backward 2.5x, fwd+bwd 3.5x. CUDA events.", ""]
    if meta["torch_note"]:
        lines += [f"torch systems not run: {meta['torch_note']}.", ""]
    if host:
        lines += ["## Host cost (float16, causal)", "", *host_text(host), ""]
    if floor:
        lines += ["## Floor", "", floor_text(floor), ""]
    if long and "error" in long:
        lines += ["## Long sequence", "", long_text(long), ""]
    elif long:
        c = long["config"]
        memory = [("inputs q, k, v", long["inputs_bytes"]), ("outputs o, m, l", long["outputs_bytes"]),
                  ("pool growth during one forward (outputs + workspace)", long["extra_bytes"]),
                  ("naive N×N float32 scores alone", long["naive_scores_bytes"]), ("GPU memory", long["gpu_bytes"])]
        lines += ["## Long sequence", "",
                  f"{c['dtype']}, D={c['D']}, N={c['N']}, B={c['B']}, H={c['H']}, non-causal forward: "
                  f"{long['system']} {long['ms']:.2f} ms, {long['tflops']:.1f} TFLOP/s.", "",
                  "| memory | GB |", "|---|---:|", *(f"| {what} | {size / GB:.2f} |" for what, size in memory), ""]
    groups = sorted({group_key(r): (r["dtype"], r["D"], r["causal"], r["mode"]) for r in records}.items())
    for _, (dtype, D, causal, mode) in groups:
        rows = [r for r in records if (r["dtype"], r["D"], r["causal"], r["mode"]) == (dtype, D, causal, mode)]
        systems = [s for s in SYSTEM_NAMES if any(r["system"] == s for r in rows)]
        others = [s for s in systems if s != FLASH] if FLASH in systems else []
        header = ["N", "B", "H", *systems, *(f"cupyflash / {s}" for s in others)]
        lines += [f"## {dtype}, D={D}, {'causal' if causal else 'non-causal'}, {mode}: TFLOP/s", "",
                  "| " + " | ".join(header) + " |", "|" + "---:|" * len(header)]
        for N in sorted({r["N"] for r in rows}):
            at_n = [r for r in rows if r["N"] == N]
            tflops = {r["system"]: r["tflops"] for r in at_n}
            flash = tflops.get(FLASH)
            ratios = [None if None in (flash, tflops.get(s)) else flash / tflops[s] for s in others]
            cells = [str(N), str(at_n[0]["B"]), str(at_n[0]["H"]),
                     *(fmt(tflops.get(s)) for s in systems), *(fmt(ratio, ".2f", "x") for ratio in ratios)]
            lines.append("| " + " | ".join(cells) + " |")
        notes = [f"- {r['system']}, N={r['N']}: {r['note']}" for r in rows if r["note"]]
        lines += ([""] + notes if notes else []) + [""]
    return "\n".join(lines)


def write_plot(records: list, path: Path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not importable: no {path.name}")
        return
    timed = [r for r in records if r["tflops"] is not None]
    if not timed:
        return
    rows = sorted({(list(DTYPES).index(r["dtype"]), MODES.index(r["mode"])) for r in timed})
    cols = sorted({(r["D"], r["causal"]) for r in timed})
    fig, axes = plt.subplots(len(rows), len(cols), figsize=(4.2 * len(cols), 3.2 * len(rows)), squeeze=False)
    for i, (dtype_index, mode_index) in enumerate(rows):
        dtype, mode = list(DTYPES)[dtype_index], MODES[mode_index]
        for j, (D, causal) in enumerate(cols):
            ax = axes[i][j]
            for system in SYSTEM_NAMES:
                points = sorted((r["N"], r["tflops"]) for r in timed if (r["dtype"], r["mode"], r["D"], r["causal"],
                                                                          r["system"]) == (dtype, mode, D, causal, system))
                if points:
                    ax.plot(*zip(*points), marker="o", label=system, color=f"C{SYSTEM_NAMES.index(system)}")
            seqlens = sorted({r["N"] for r in timed})
            ax.set_xscale("log", base=2)
            ax.set_xticks(seqlens, [str(N) for N in seqlens], fontsize=8)
            ax.minorticks_off()
            ax.set_ylim(bottom=0)
            ax.set_title(f"{dtype} {mode} D={D} {'causal' if causal else 'non-causal'}", fontsize=10)
            ax.set_xlabel("N")
            ax.set_ylabel("TFLOP/s")
            ax.grid(alpha=0.3)
    handles = {}
    for ax in axes.flat:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, handle)
    labels = [s for s in SYSTEM_NAMES if s in handles]
    fig.legend([handles[s] for s in labels], labels, loc="upper center", ncol=len(labels))
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.4 / fig.get_figheight()))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_outputs(out_dir: Path, meta: dict, records: list, floor, long, host=None, decode=None):
    out_dir.mkdir(parents=True, exist_ok=True)
    results = dict(metadata=meta, records=records, floor=floor, long_sequence=long, host_cost=host, decode=decode)
    json_path, md_path, plot_path = (out_dir / name for name in OUTPUT_NAMES)
    json_path.write_text(json.dumps(results, indent=1) + "\n")
    text = markdown(meta, records, floor, long, host)
    if decode:
        text += "\n## Decoding\n\n" + "\n".join(decode_text(decode)) + "\n"
    md_path.write_text(text)
    write_plot(records, plot_path)
    print(f"wrote {json_path}, {md_path}", flush=True)


# ---------------------------------------------------------------------------


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqlens", type=int, nargs="+", metavar="N", help=f"default {SEQLENS}")
    parser.add_argument("--head-dims", type=int, nargs="+", metavar="D", help=f"default {HEAD_DIMS}")
    parser.add_argument("--dtypes", nargs="+", choices=list(DTYPES), help=f"default {' '.join(SWEEP_DTYPES)}")
    parser.add_argument("--causal", choices=("0", "1", "both"), default="both", help="default both")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES), help="default all")
    parser.add_argument("--systems", nargs="+", choices=SYSTEM_NAMES, default=list(SYSTEM_NAMES),
                        help="default all (the torch ones only where torch.cuda is available)")
    parser.add_argument("--warmup", type=int, default=WARMUP, help="untimed calls first (default %(default)s)")
    parser.add_argument("--repeats", type=int, default=REPEATS,
                        help="timed calls, their median reported (default %(default)s)")
    parser.add_argument("--quick", action="store_true",
                        help=f"sweep N in {QUICK_SEQLENS}, D in {QUICK_HEAD_DIMS}, fp16, both causal flags")
    parser.add_argument("--breadth", action="store_true",
                        help=f"issue #16's cases: fp16/bf16 D in {BREADTH_16BIT_HEAD_DIMS} at N in "
                             f"{BREADTH_16BIT_SEQLENS}; fp32/fp64 D in {BREADTH_WIDE_HEAD_DIMS} at (B, H, N) = "
                             f"{BREADTH_WIDE_SHAPE} and N in {BREADTH_WIDE_SEQLENS} (--dtypes, --seqlens, --causal narrow it)")
    parser.add_argument("--long", action="store_true", help="run only the long-sequence memory check")
    parser.add_argument("--floor", action="store_true",
                        help=f"run only the floor check, {FLOOR_SYSTEM} and naive forward at N={FLOOR_CONFIG.N}, "
                             f"D={FLOOR_CONFIG.D}, B={FLOOR_CONFIG.B}, H={FLOOR_CONFIG.H}, fp16 (with --long: both)")
    parser.add_argument("--no-long", action="store_true", help="leave the long-sequence check out of a sweep")
    parser.add_argument("--host", action="store_true", help=f"run only the host-cost check at {HOST_SHAPES}")
    parser.add_argument("--no-host", action="store_true", help="leave the host-cost check out of a sweep")
    parser.add_argument("--decode", action="store_true",
                        help=f"run only the decoding section: one query row, B in {DECODE_BATCHES}, Hq {DECODE_HQ}, "
                             f"Hkv in {DECODE_KV_HEADS}, Nk in {DECODE_KEYS}, D {DECODE_D} (--dtypes picks; default fp16)")
    parser.add_argument("--out-dir", type=Path, default=REPO_ROOT / "benchmarks" if CHECKOUT else Path("benchmarks"),
                        help=f"where {', '.join(OUTPUT_NAMES)} go (default benchmarks/ of the checkout, or of the "
                             "working directory when installed); any run overwrites them")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.warmup < 0:
        parser.error("--repeats must be >= 1 and --warmup >= 0")
    return args


def breadth_configs(args) -> list:
    """Issue #16's cases (``--breadth``), narrowed by ``--dtypes``, ``--seqlens`` and ``--causal``."""
    causals = CAUSAL_FLAGS[args.causal]
    configs = []
    for dtype in args.dtypes or tuple(DTYPES):
        if dtype in SWEEP_DTYPES:
            configs += [protocol_config(dtype, D, N, causal) for D in BREADTH_16BIT_HEAD_DIMS for causal in causals
                        for N in args.seqlens or BREADTH_16BIT_SEQLENS]
            continue
        B, H, N = BREADTH_WIDE_SHAPE
        for D in BREADTH_WIDE_HEAD_DIMS:
            for causal in causals:
                configs.append(Config(dtype, D, N, causal, B=B, H=H))
                configs += [protocol_config(dtype, D, n, causal) for n in args.seqlens or BREADTH_WIDE_SEQLENS]
    return configs


def sweep_configs(args) -> list:
    if args.breadth:
        return breadth_configs(args)
    seqlens = args.seqlens or (QUICK_SEQLENS if args.quick else SEQLENS)
    head_dims = args.head_dims or (QUICK_HEAD_DIMS if args.quick else HEAD_DIMS)
    dtypes = args.dtypes or (QUICK_DTYPES if args.quick else SWEEP_DTYPES)
    causals = CAUSAL_FLAGS[args.causal]
    return [protocol_config(dtype, D, N, causal)
            for dtype in dtypes for D in head_dims for causal in causals for N in seqlens]


def main(argv=None):
    args = parse_args(argv)
    if cupy is None:
        from cupyflash._compile import install_hint

        sys.exit(f"the benchmark needs CuPy and a GPU: {install_hint(',bench')}")
    started = time.perf_counter()
    systems = [s for s in SYSTEMS if s.name in args.systems]
    torch_note = torch_missing() if any(s.needs_torch for s in systems) else None
    if torch_note:
        print(f"{torch_note}: running {', '.join(s.name for s in systems if not s.needs_torch)} only", flush=True)
        systems = [s for s in systems if not s.needs_torch]

    if args.decode:
        use_torch = any(s.needs_torch for s in systems)
        decode = decode_check(args.dtypes or ("fp16",), use_torch, args.warmup, args.repeats)
        print("\n".join(decode_text(decode)), flush=True)
        write_outputs(args.out_dir, metadata(args.warmup, args.repeats, torch_note), [], None, None, None, decode)
        print(f"done in {time.perf_counter() - started:.0f} s", flush=True)
        return
    sweep = not (args.floor or args.long or args.host)
    records = []
    if args.floor:
        floor_systems = [s for s in SYSTEMS if s.name in (FLOOR_SYSTEM, "naive")]
        records = run_sweep([FLOOR_CONFIG], floor_systems, ("fwd",), args.warmup, args.repeats)
    elif sweep:
        records = run_sweep(sweep_configs(args), systems, args.modes, args.warmup, args.repeats)
    floor = floor_summary(records)
    if floor:
        print(floor_text(floor), flush=True)
    long = None
    if args.long or (sweep and not args.no_long):
        try:
            long = long_sequence_check()
        except Exception as error:  # noqa: BLE001 - keep the sweep's results
            long = dict(error=short(error))
        print(long_text(long), flush=True)

    host = None
    if args.host or (sweep and not args.no_host):
        host = host_cost_check([s for s in systems if s.name in (FLASH, "torch-flash")])

    write_outputs(args.out_dir, metadata(args.warmup, args.repeats, torch_note), records, floor, long, host)
    print(f"done in {time.perf_counter() - started:.0f} s", flush=True)


if __name__ == "__main__":
    main()
