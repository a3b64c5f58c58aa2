"""Throughput ceilings of the multiply instructions the float32 and float64 kernels can use.

Each kernel keeps CHAINS independent accumulator tiles per warp and issues ITERS rounds of one
instruction on each (no memory traffic), on WAVES CTAs per SM; TFLOP/s = 2·m·n·k per mma (2 per
FMA) over the elapsed time of the launch (CUDA events, median of REPEATS). Run on a GPU:

    PYTHONPATH=$PWD python3 benchmarks/mma_ceilings.py

The float64 shapes beyond m8n8k4 exist on sm_90 only; they are skipped elsewhere. Use the numbers
to pick the instruction of a warp tile (kernels_cu/mma_sm80.cuh), and quote them beside a kernel's
TFLOP/s in benchmarks/RESULTS.md.
"""

from __future__ import annotations

import numpy

CHAINS = 4          # independent accumulators per warp: enough to cover the MMA latency
ITERS = 4096        # rounds per launch
WARPS = 4           # per CTA
WAVES = 4           # CTAs per SM
REPEATS = 5

# name: (least sm, flops per instruction per warp, (type, registers) of C, of A and of B, the instruction)
_F64 = "double"
INSTRUCTIONS = {
    "f64 mma m8n8k4": (80, 2 * 8 * 8 * 4, (_F64, 2), (_F64, 1), (_F64, 1),
                       "mma.sync.aligned.m8n8k4.row.col.f64.f64.f64.f64"),
    "f64 mma m16n8k4": (90, 2 * 16 * 8 * 4, (_F64, 4), (_F64, 2), (_F64, 1),
                        "mma.sync.aligned.m16n8k4.row.col.f64.f64.f64.f64"),
    "f64 mma m16n8k8": (90, 2 * 16 * 8 * 8, (_F64, 4), (_F64, 4), (_F64, 2),
                        "mma.sync.aligned.m16n8k8.row.col.f64.f64.f64.f64"),
    "f64 mma m16n8k16": (90, 2 * 16 * 8 * 16, (_F64, 4), (_F64, 8), (_F64, 4),
                         "mma.sync.aligned.m16n8k16.row.col.f64.f64.f64.f64"),
    "tf32 mma m16n8k8": (80, 2 * 16 * 8 * 8, ("float", 4), ("unsigned", 4), ("unsigned", 2),
                         "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32"),
    "f16 mma m16n8k16": (80, 2 * 16 * 8 * 16, ("float", 4), ("unsigned", 4), ("unsigned", 2),
                         "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32"),
}
CONSTRAINT = {"double": "d", "float": "f", "unsigned": "r"}


def mma_source(name: str) -> str:
    """A kernel ``ceiling(out)`` issuing ``name`` ITERS x CHAINS times per warp."""
    _, _, (c_type, n_c), (a_type, n_a), (b_type, n_b), ptx = INSTRUCTIONS[name]
    regs = ", ".join(f"%{i}" for i in range(n_c))
    a_regs = ", ".join(f"%{n_c + i}" for i in range(n_a))
    b_regs = ", ".join(f"%{n_c + n_a + i}" for i in range(n_b))
    outs = ", ".join(f'"+{CONSTRAINT[c_type]}"(c[ch][{i}])' for i in range(n_c))
    ins = ", ".join([f'"{CONSTRAINT[a_type]}"(a[{i}])' for i in range(n_a)]
                    + [f'"{CONSTRAINT[b_type]}"(b[{i}])' for i in range(n_b)])
    return f"""
extern "C" __global__ void ceiling({c_type}* out, int iters) {{
    {c_type} c[{CHAINS}][{n_c}];
    {a_type} a[{n_a}];
    {b_type} b[{n_b}];
    for (int ch = 0; ch < {CHAINS}; ++ch)
        for (int i = 0; i < {n_c}; ++i) c[ch][i] = ({c_type})0;
    for (int i = 0; i < {n_a}; ++i) a[i] = ({a_type})(threadIdx.x + i);
    for (int i = 0; i < {n_b}; ++i) b[i] = ({b_type})(threadIdx.x * 3 + i);
    for (int it = 0; it < iters; ++it) {{
#pragma unroll
        for (int ch = 0; ch < {CHAINS}; ++ch)
            asm volatile("{ptx} {{{regs}}}, {{{a_regs}}}, {{{b_regs}}}, {{{regs}}};" : {outs} : {ins});
    }}
    {c_type} sum = 0;
    for (int ch = 0; ch < {CHAINS}; ++ch)
        for (int i = 0; i < {n_c}; ++i) sum += c[ch][i];
    out[blockIdx.x * blockDim.x + threadIdx.x] = sum;
}}
"""


def fma_source(c_type: str) -> str:
    """A kernel ``ceiling(out)`` of 8 x CHAINS independent FMA chains per thread."""
    return f"""
extern "C" __global__ void ceiling({c_type}* out, int iters) {{
    {c_type} c[{8 * CHAINS}];
    const {c_type} x = ({c_type})1.000001, y = ({c_type})threadIdx.x * ({c_type})1e-9;
    for (int i = 0; i < {8 * CHAINS}; ++i) c[i] = ({c_type})i;
    for (int it = 0; it < iters; ++it) {{
#pragma unroll
        for (int i = 0; i < {8 * CHAINS}; ++i) c[i] = fma(c[i], x, y);
    }}
    {c_type} sum = 0;
    for (int i = 0; i < {8 * CHAINS}; ++i) sum += c[i];
    out[blockIdx.x * blockDim.x + threadIdx.x] = sum;
}}
"""


def sources() -> dict:
    """name -> (minimum sm, flops per warp per round, source, output dtype)."""
    out = {}
    for name, (sm, flops, (c_type, _), *_rest) in INSTRUCTIONS.items():
        out[name] = (sm, flops * CHAINS, mma_source(name), numpy.float64 if c_type == _F64 else numpy.float32)
    for c_type, dtype in (("float", numpy.float32), ("double", numpy.float64)):
        out[f"{c_type} FMA"] = (0, 2 * 8 * CHAINS * 32, fma_source(c_type), dtype)
    return out


def main() -> int:
    import cupy

    device = cupy.cuda.Device()
    sm = int(device.compute_capability)
    sms = device.attributes["MultiProcessorCount"]
    grid, threads = sms * WAVES, WARPS * 32
    print(f"{cupy.cuda.runtime.getDeviceProperties(device.id)['name'].decode()}: {sms} SMs, "
          f"{WAVES} CTAs of {WARPS} warps per SM, {CHAINS} chains, {ITERS} rounds")
    for name, (min_sm, flops, source, dtype) in sources().items():
        if sm < min_sm:
            print(f"{name:<18} needs sm_{min_sm}")
            continue
        arch = "-arch=sm_90a" if sm == 90 else f"-arch=sm_{sm}"
        kernel = cupy.RawModule(code=source, options=(arch,)).get_function("ceiling")
        out = cupy.empty(grid * threads, dtype)
        kernel((grid,), (threads,), (out, numpy.int32(ITERS)))   # warm-up
        times = []
        for _ in range(REPEATS):
            start, stop = cupy.cuda.Event(), cupy.cuda.Event()
            start.record()
            kernel((grid,), (threads,), (out, numpy.int32(ITERS)))
            stop.record()
            stop.synchronize()
            times.append(cupy.cuda.get_elapsed_time(start, stop) / 1e3)
        total = flops * ITERS * grid * WARPS
        print(f"{name:<18} {total / numpy.median(times) / 1e12:8.1f} TFLOP/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
