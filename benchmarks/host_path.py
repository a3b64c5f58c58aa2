"""The host time of a call with a kept plan, on any machine: cupyflash's Python with the GPU faked.

    python benchmarks/host_path.py [--shape 1 1 64 64] [--calls 20000] [--profile] [--top 20]

A call that agrees with an earlier one (shapes, strides, dtypes, keywords) finds that call's plan and
only allocates its outputs, writes its pointers into the kept parameter struct and launches
(``cupyflash/_launch.py``). This times that path, float16 and causal as ``benchmarks/host_profile.py``,
the float8 forward of the same shape, then a decoding step against a K/V cache (contiguous and paged,
with a key appended or not) and merges, with everything the GPU would do replaced: the arrays are CuPy
arrays over host memory (never read), CuPy's pool allocator hands out addresses in that memory, the
device queries answer as an H200 would, and a kernel launch is a Python call that does nothing. What is left is the library's own Python and
the CuPy objects it makes; on a GPU host CuPy's pool allocation (about 1.5 us) and each
``cuLaunchKernel`` (about 5 us on the H200's host: ``host_profile.py --sections`` prints both there)
come on top, once per allocation and launch printed. The numbers move with the host; compare trees on
one machine, in one run each. ``--profile``: cProfile's functions with the most time of their own.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
from pathlib import Path

import numpy

REPO_ROOT = Path(__file__).resolve().parents[1]
if (REPO_ROOT / "cupyflash" / "__init__.py").is_file():   # run from a checkout
    sys.path.insert(0, str(REPO_ROOT))

import cupyflash  # noqa: E402
from cupyflash import _launch, api  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from torch_host_cost import best_of  # noqa: E402 - the same clock as the torch wrapper's host time (no torch import)

H200 = _launch.DeviceLimits("90", 232448, 233472, 132, 60 * 2**20)


class FakeGPU:
    """The device side of CuPy and of cupyflash's plans, answered on the host: device 0, an H200's
    limits, allocations in ``memory`` (a host buffer, handed out in order and never read), kernels
    that are names and launches that only count (``structs``: the parameter struct of each, as
    ``(kernel name, 4096 bytes from its start)``, when ``keep_structs``). ``patch(module, name, value)`` installs each
    stand-in (``setattr``, or a test's ``monkeypatch.setattr``)."""

    def __init__(self, nbytes: int = 1 << 26, patch=setattr, keep_structs: bool = False):
        import cupy

        self.memory = numpy.zeros(nbytes, numpy.uint8)
        self.base, self.at, self.launches, self.allocations = self.memory.ctypes.data, 0, 0, 0
        self.structs = [] if keep_structs else None
        patch(cupy.cuda.runtime, "getDevice", lambda: 0)
        patch(cupy.cuda.runtime, "memsetAsync", lambda *args: None)
        patch(cupy.cuda, "alloc", self.alloc)
        patch(cupy.cuda, "get_current_stream", lambda device_id=-1, stream=FakeStream(): stream)
        patch(_launch, "_device_limits", lambda device_id: H200)
        patch(_launch, "current_limits", lambda: H200)
        patch(_launch, "get_kernels", lambda cfg: {name: FakeKernel(name) for name in cfg.spec.entries})
        patch(_launch, "launch", self.launch)

    def alloc(self, nbytes: int):
        import cupy

        self.allocations += 1
        nbytes = -(-max(nbytes, 1) // 512) * 512
        if self.at + nbytes > self.memory.nbytes:
            self.at = 0
        memory = cupy.cuda.UnownedMemory(self.base + self.at, nbytes, self.memory, 0)
        self.at += nbytes
        return cupy.cuda.MemoryPointer(memory, 0)

    def array(self, shape, dtype=numpy.float16):
        import cupy

        return cupy.ndarray(shape, dtype, self.alloc(int(numpy.prod(shape)) * numpy.dtype(dtype).itemsize))

    def launch(self, kernel, grid, threads: int, smem_bytes: int = 0):
        grid = (grid, 1) if isinstance(grid, int) else grid

        def run(function, *args):   # cuLaunchKernel's arguments: ..., stream, kernel_params, extra
            self.launches += 1
            if self.structs is not None:
                import ctypes

                address = ctypes.c_uint64.from_address(args[-2]).value
                self.structs.append((kernel.name, ctypes.string_at(address, 4096)))

        return _launch.Launch(kernel, 0, grid, threads, smem_bytes, run)


class FakeStream:
    """CuPy's legacy default stream, as ``call_stream`` reads it."""

    ptr = 0

    def is_capturing(self) -> bool:
        return False


class FakeKernel:
    def __init__(self, name: str):
        self.name = name


def first_call(call, make_plan):
    """Run ``call`` once as a first call: it validates and, without a driver, fails where it enters the
    device (CuPy's ``with q.device``, which is not faked); ``make_plan(key)`` then plans it with the key
    the call computed, as the GPU path would have, so that the next like call finds the plan."""
    keys = []
    kept_plan = api._kept_plan

    def recording(*args, **kwargs):
        plan, key = kept_plan(*args, **kwargs)
        keys.append(key)
        return plan, key

    api._kept_plan = recording
    try:
        call()
    except Exception:   # CUDARuntimeError: no driver behind `with q.device`
        pass
    finally:
        api._kept_plan = kept_plan
    assert keys and keys[0] is not None, "the call keeps no plan"
    return make_plan(keys[0])


def decoding_calls(gpu) -> dict:
    """Kept calls of a decoding step, on the faked GPU: one query row of 32 heads over 8 K/V heads (D 128,
    fp16) against a contiguous cache of 16384 rows and a paged one (pages of 256), with and without a new
    key appended, and merges of 2 and 8 parts of those rows; each made once first (a like call keeps it)."""
    B, Hkv, G, D = 1, 8, 4, 128
    q, lens, new = gpu.array((B, Hkv * G, 1, D)), gpu.array((B,), numpy.int32), gpu.array((B, Hkv, 1, D))
    contiguous = (gpu.array((B, Hkv, 16384, D)), gpu.array((B, Hkv, 16384, D)), None)
    paged = (gpu.array((64, Hkv, 256, D)), gpu.array((64, Hkv, 256, D)), gpu.array((B, 64), numpy.int32))
    parts = [(gpu.array((B, Hkv * G, 1, D)), gpu.array((B, Hkv * G, 1), numpy.float32),
              gpu.array((B, Hkv * G, 1), numpy.float32)) for _ in range(8)]
    calls = {}
    for name, (k_cache, v_cache, table) in (("decode, contiguous cache", contiguous), ("decode, paged cache", paged)):
        calls[name] = lambda k_cache=k_cache, v_cache=v_cache, table=table: cupyflash.flash_attention_with_kvcache(
            q, k_cache, v_cache, lens, block_table=table)
        calls[name + ", a key appended"] = lambda k_cache=k_cache, v_cache=v_cache, table=table: \
            cupyflash.flash_attention_with_kvcache(q, k_cache, v_cache, lens, k=new, v=new, block_table=table)
    for n in (2, 8):
        calls[f"merge of {n} parts"] = lambda n=n: cupyflash.merge_attention(parts[:n])
    for call in calls.values():
        call()
    return calls


def float8_call(gpu, shape):
    """A kept call of the float8 forward (float8 bits of ``shape``, causal, float16 o), made once first: its
    plan made for the first call's key as the GPU path would (the first call fails where it enters the device)."""
    from cupyflash import float8

    q, k, v = (gpu.array(tuple(shape), numpy.uint8) for _ in range(3))
    keys, kept = [], float8._kept_plan
    float8._kept_plan = lambda *args: keys.append(kept(*args)[1]) or kept(*args)
    try:
        float8.flash_attention_forward_fp8(q, k, v, causal=True, out_dtype="float16")
    except Exception:   # CUDARuntimeError: no driver behind `with q.device`
        pass
    finally:
        float8._kept_plan = kept
    prob = api.check_forward(q, k, v, True, None, None, supported=("uint8",))
    layout = _launch.collapse_batch(prob.batch_shape, api._batch_strides((q, k, v), prob.batch_shape), ("q", "k", "v"))
    _launch.keep_plan(keys[0], _launch.fp8_forward_plan(q, k, v, out_dtype=numpy.float16, geometry=prob.geometry,
                                                        scale=prob.scale, v_scale=1.0, batch_shape=prob.batch_shape,
                                                        layout=layout))
    call = lambda: float8.flash_attention_forward_fp8(q, k, v, causal=True, out_dtype="float16")  # noqa: E731
    call()   # its scratch (tile counter, repair flags), kept from then on
    return call


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", type=int, nargs=4, default=(1, 1, 64, 64), metavar=("B", "H", "N", "D"))
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--profile", action="store_true", help="cProfile the calls instead of timing them")
    parser.add_argument("--top", type=int, default=20)
    args = parser.parse_args()
    gpu = FakeGPU()
    q, k, v, do = (gpu.array(tuple(args.shape)) for _ in range(4))
    prob = api.check_forward(q, k, v, True, None, None)
    schedule = _launch.forward_schedule("auto", prob.D, prob.dtype)
    o, m, l = first_call(lambda: cupyflash.flash_attention_forward(q, k, v, causal=True),
                         lambda key: api._forward_gpu(q, k, v, {}, prob.batch_shape, prob, schedule, "highest", key))
    bprob = api.check_backward(do, q, k, v, o, m, l, True, None, None)
    first_call(lambda: cupyflash.flash_attention_backward(do, q, k, v, o, m, l, causal=True),
               lambda key: api._backward_gpu(do, q, k, v, o, m, l, {}, bprob.batch_shape, bprob, "auto", "highest",
                                             False, key))
    calls = {"forward": lambda: cupyflash.flash_attention_forward(q, k, v, causal=True),
             "backward": lambda: cupyflash.flash_attention_backward(do, q, k, v, o, m, l, causal=True),
             "forward, float8": float8_call(gpu, args.shape), **decoding_calls(gpu)}
    print(f"cupyflash on a faked GPU, float16, causal, shape {tuple(args.shape)}, kept plans\n")
    print("| call | us per call (the library's Python) | launches | allocations |")
    print("|---|---:|---:|---:|")
    for name, call in calls.items():
        launches, allocations = gpu.launches, gpu.allocations
        call()
        launches, allocations = gpu.launches - launches, gpu.allocations - allocations
        if args.profile:
            profile = cProfile.Profile()
            profile.enable()
            for _ in range(args.calls):
                call()
            profile.disable()
            print(f"\n{name}:")
            pstats.Stats(profile).sort_stats("tottime").print_stats(args.top)
        else:
            print(f"| {name} | {best_of(call, args.calls):.1f} | {launches} | {allocations} |")


if __name__ == "__main__":
    main()
