"""Ring attention on every GPU of this machine, one process per GPU over NCCL (cupyflash.distributed).

    PYTHONPATH=$PWD python3 tests/gpu/ring.py check [--gpus P] [--n-per-gpu N]   # against one GPU's attention
    PYTHONPATH=$PWD python3 tests/gpu/ring.py bench [--gpus P]    # N = 128k per GPU, D 128, causal bf16

``check``: for each dtype (fp16, bf16, fp32) and layout, causal and not, every rank makes the same random
q, k, v, do of the whole sequence (N per GPU, default 4096; the issue's size is ``--n-per-gpu 131072``;
B 1, H 4, D 64), runs ring_attention_forward/backward on its shard, and compares it on its own GPU with
its shard of cupyflash's forward and backward of the whole sequence (tests/tolerances.py's ceilings,
relative to the largest magnitude of the whole); rank 0 prints one line per case (the worst rank's
errors) and the run exits 1 on any failure. Nothing whole crosses a process.

``bench``: the issue's target shape (N_total = 128k x P, B 1, H 16, D 128, causal, bf16, zigzag): the ring's
forward + backward time on every GPU at once (CUDA events on each rank's compute stream, median of 3 after
1) against one GPU's forward + backward of the whole sequence, the throughput ratio (the target: >= 1.8x
at P = 2), and the memory each holds: CuPy's pool after the calls (its blocks, used or cached, so the
most the calls held at once), per rank and for the one GPU. NCCL runs as the machine sets it up (leave
NCCL_NVLS_ENABLE alone).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
from pathlib import Path

import numpy

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

CHECK = dict(batch=(1, 4), n_per_gpu=4096, D=64)
BENCH = dict(batch=(1, 16), n_per_gpu=128 * 1024, D=128)
REPEATS = 3          # timed calls of the benchmark, after one
RESULT_WAIT_S = 540  # the longest a rank's result is waited for


def inputs(seed, dtype, batch, n, D, xp=None):
    """q, k, v, do of the whole sequence, on the current GPU (or in ``xp``'s memory): the same on every rank
    (one seed)."""
    if xp is None:
        import cupy as xp
    rng = xp.random.default_rng(seed)
    return [rng.standard_normal((*batch, n, D), dtype=numpy.float32).astype(dtype) for _ in range(4)]


def rank_main(rank, world, uid_queue, out_queue, mode, n_per_gpu):
    import cupy
    from cupy.cuda import nccl

    import cupyflash.distributed as cfd

    cupy.cuda.Device(rank).use()
    uid = nccl.get_unique_id() if rank == 0 else None
    if rank == 0:
        for _ in range(world - 1):
            uid_queue.put(uid)
    else:
        uid = uid_queue.get()
    comm = nccl.NcclCommunicator(world, uid, rank)
    if mode == "check":
        for dtype in ("float16", "bfloat16", "float32"):
            for layout in cfd.LAYOUTS:
                for causal in (False, True):
                    out_queue.put((rank, (dtype, layout, causal), check_case(comm, rank, world, dtype, layout,
                                                                             causal, n_per_gpu, cupy)))
    else:
        n = BENCH["n_per_gpu"] * world
        import ml_dtypes

        q, k, v, do = (cfd.shard(x, rank, world, "zigzag")
                       for x in inputs(0, ml_dtypes.bfloat16, BENCH["batch"], n, BENCH["D"]))
        times = []
        pool = cupy.get_default_memory_pool()
        pool.free_all_blocks()
        for i in range(REPEATS + 1):
            comm_barrier(comm)
            start, stop = cupy.cuda.Event(), cupy.cuda.Event()
            start.record()
            o, m, l = cfd.ring_attention_forward(q, k, v, comm, causal=True)
            cfd.ring_attention_backward(do, q, k, v, o, m, l, comm, causal=True)
            stop.record()
            stop.synchronize()
            if i >= 1:
                times.append(cupy.cuda.get_elapsed_time(start, stop))
        out_queue.put((rank, "bench", (statistics.median(times), pool.total_bytes())))


def comm_barrier(comm):
    """Every rank here before any goes on: an all-reduce of one word."""
    import cupy
    from cupy.cuda import nccl

    word = cupy.zeros(1, cupy.float32)
    comm.allReduce(word.data.ptr, word.data.ptr, 1, nccl.NCCL_FLOAT32, nccl.NCCL_SUM,
                   cupy.cuda.get_current_stream().ptr)
    cupy.cuda.get_current_stream().synchronize()


def check_case(comm, rank, world, dtype, layout, causal, n_per_gpu, xp) -> dict:
    """{name: error} of this rank's ring results for one case against its shard of one GPU's attention
    over the whole sequence, each relative to the largest magnitude of the whole (``xp``: cupy, or numpy
    with a stand-in ring: tests/test_distributed.py)."""
    import cupyflash
    import cupyflash.distributed as cfd

    n = n_per_gpu * world
    from helpers import DTYPE_BY_NAME

    whole = inputs(0, DTYPE_BY_NAME[dtype], CHECK["batch"], n, CHECK["D"], xp)
    q, k, v, do = (cfd.shard(x, rank, world, layout) for x in whole)
    o, m, l = cfd.ring_attention_forward(q, k, v, comm, causal=causal, layout=layout)
    got = (o, m, l, *cfd.ring_attention_backward(do, q, k, v, o, m, l, comm, causal=causal, layout=layout))
    del q, k, v, do
    ref = cupyflash.flash_attention_forward(*whole[:3], causal=causal)
    ref = (*ref, *cupyflash.flash_attention_backward(whole[3], *whole[:3], *ref, causal=causal))
    errors = {}
    for name, g, r in zip(("o", "m", "l", "dq", "dk", "dv"), got, ref):
        scale = max(float(xp.abs(r.astype(xp.float64)).max()), 1e-30)
        mine = cfd.shard(r, rank, world, layout, axis=-1 if name in ("m", "l") else -2)
        errors[name] = float(xp.abs(g.astype(xp.float64) - mine.astype(xp.float64)).max()) / scale
    return errors


def check(results) -> bool:
    """Print each case's worst errors over the ranks against tests/tolerances.py's ceilings."""
    from tolerances import BWD_CEILING, FWD_CEILING

    ok = True
    for case in sorted({key for _, key, _ in results}, key=str):
        dtype, layout, causal = case
        worst = {}
        for _, key, errors in results:
            if key == case:
                worst = {name: max(err, worst.get(name, 0.0)) for name, err in errors.items()}
        for name, err in worst.items():
            ok &= bool(err <= (FWD_CEILING if name in ("o", "m", "l") else BWD_CEILING)[dtype])
        print(f"{dtype:9s} {layout:10s} causal={causal!s:5s}  " + "  ".join(f"{n} {e:.1e}" for n, e in worst.items()),
              flush=True)
    return ok


def bench(world, ring):
    import cupy
    import ml_dtypes

    import cupyflash

    n = BENCH["n_per_gpu"] * world
    q, k, v, do = inputs(0, ml_dtypes.bfloat16, BENCH["batch"], n, BENCH["D"])
    times = []
    pool = cupy.get_default_memory_pool()
    pool.free_all_blocks()
    for i in range(REPEATS + 1):
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        o, m, l = cupyflash.flash_attention_forward(q, k, v, causal=True)
        cupyflash.flash_attention_backward(do, q, k, v, o, m, l, causal=True)
        stop.record()
        stop.synchronize()
        if i >= 1:
            times.append(cupy.cuda.get_elapsed_time(start, stop))
    one, one_bytes = statistics.median(times), pool.total_bytes()
    ring_ms = [ms for ms, _ in ring]
    flops = 3.5 * 4 * numpy.prod(BENCH["batch"]) * n * n * BENCH["D"] / 2
    print(f"N {n} (= {BENCH['n_per_gpu']} x {world}), B {BENCH['batch'][0]}, H {BENCH['batch'][1]}, D {BENCH['D']}, "
          f"causal bf16 zigzag, forward + backward:")
    print(f"  one GPU: {one:.1f} ms ({flops / one / 1e9:.0f} TFLOP/s)")
    print(f"  ring over {world}: {max(ring_ms):.1f} ms (slowest rank; {flops / max(ring_ms) / 1e9:.0f} TFLOP/s in all)")
    print(f"  throughput ratio ring / one GPU: {one / max(ring_ms):.2f}")
    print(f"  memory: one GPU {one_bytes / 2**30:.2f} GiB; each rank of the ring "
          + ", ".join(f"{b / 2**30:.2f}" for _, b in ring) + " GiB (CuPy's pool after the calls)")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("mode", choices=("check", "bench"))
    parser.add_argument("--gpus", type=int, default=None, help="ranks (default: every GPU)")
    parser.add_argument("--n-per-gpu", type=int, default=CHECK["n_per_gpu"], help="check: sequence rows per GPU")
    args = parser.parse_args(argv)
    import cupy

    world = args.gpus or cupy.cuda.runtime.getDeviceCount()
    ctx = mp.get_context("spawn")
    uid_queue, out_queue = ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, world, uid_queue, out_queue, args.mode, args.n_per_gpu)) for r in range(world)]
    for p in procs:
        p.start()
    expected = world * (12 if args.mode == "check" else 1)
    import queue

    try:
        results = [out_queue.get(timeout=RESULT_WAIT_S) for _ in range(expected)]
    except queue.Empty:
        print(f"no result within {RESULT_WAIT_S} s: a rank failed or hung", [p.exitcode for p in procs])
        for p in procs:
            p.kill()
        return 1
    for p in procs:
        p.join()
    if any(p.exitcode for p in procs):
        print("a rank failed:", [p.exitcode for p in procs])
        return 1
    if args.mode == "check":
        return 0 if check(results) else 1
    bench(world, [value for _, _, value in results])
    return 0


if __name__ == "__main__":
    sys.exit(main())
