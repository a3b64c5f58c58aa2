"""Where a call's host time goes: cProfile over back-to-back calls of the forward and the backward.

    python3 benchmarks/host_profile.py [--shape 1 1 64 64] [--calls 3000] [--top 25] [--sections]

The calls are float16 and causal, as the host-cost check of benchmarks/bench.py (``--host``). Prints the
wall time per call without the profiler (back to back, the GPU idle most of the time at these shapes,
so the host's time is the call's), then the functions that take the most time of their own under it.
With ``--sections``, instead of the profile: the forward's parts timed one by one without a profiler
(the kept plan's look-up, the plan's call, its launches, CuPy's floor of one empty kernel launch and
one pool allocation), each the mean of back-to-back repetitions.
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
    parser.add_argument("--sections", action="store_true", help="time the forward's parts instead of profiling")
    args = parser.parse_args()
    rng = numpy.random.default_rng(0)
    q, k, v, do = (cupy.asarray(rng.standard_normal(args.shape).astype(numpy.float16)) for _ in range(4))
    o, m, l = cupyflash.flash_attention_forward(q, k, v, causal=True)
    calls = {
        "forward": lambda: cupyflash.flash_attention_forward(q, k, v, causal=True),
        "backward": lambda: cupyflash.flash_attention_backward(do, q, k, v, o, m, l, causal=True),
    }
    for name, call in calls.items():
        print(f"{name} {tuple(args.shape)}: {per_call(call, args.calls):.1f} us per call, back to back", flush=True)
        if args.sections:
            continue
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(args.calls):
            call()
        profile.disable()
        cupy.cuda.Device().synchronize()
        pstats.Stats(profile).sort_stats("tottime").print_stats(args.top)
    if args.sections:
        forward_sections(q, k, v, args.calls)


def per_call(call, calls: int) -> float:
    """Microseconds per ``call()``, back to back after 100 untimed calls, the GPU's queue drained."""
    for _ in range(100):
        call()
    cupy.cuda.Device().synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        call()
    cupy.cuda.Device().synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def forward_sections(q, k, v, calls: int) -> None:
    """The causal forward's host time, part by part."""
    from cupyflash import _launch, api

    # the key api._forward makes of this call
    inputs = {"q": q, "k": k, "v": v}
    flags = (True, None, None, None, "auto", "highest", *api._dropout_key(api.check_dropout(0.0, None)), (), None, None,
             None, None,
             api._mod_args_key(None))
    _, flags = api._with_offsets(inputs, flags, None)
    plan, key = api._kept_plan(inputs, None, api.FORWARD_OUTPUTS, flags)
    assert plan is not None, "no kept plan under the flags this script assumes: update it beside api._forward"
    empty = cupy.RawKernel("extern \"C\" __global__ void empty() {}", "empty")
    stream = cupy.cuda.get_current_stream()
    pointers = [q.data.ptr, k.data.ptr, v.data.ptr] + [0] * (len(plan.params.words) - 3)   # FWD_POINTERS' order
    rows = [
        ("the API call (flash_attention_forward)", lambda: cupyflash.flash_attention_forward(q, k, v, causal=True)),
        ("api._forward (no ForwardResult)", lambda: api._forward(q, k, v, None, True, None, None, None, None, None,
                                                                "auto", "highest", None)),
        ("the kept plan's look-up (api._kept_plan)", lambda: api._kept_plan(inputs, None, api.FORWARD_OUTPUTS, flags)),
        ("the plan's call (ForwardPlan.__call__)", lambda: plan(q, k, v)),
        ("_launch.call_stream", _launch.call_stream),
        ("its outputs' allocation (Block.allocate + arrays)",
         lambda: plan.fresh.arrays(plan.fresh.allocate(cupy.cuda.alloc, stream.ptr)[0], plan.outputs)),
        ("its kept scratch (Scratch.locate)", lambda: plan.scratch.locate(cupy.cuda.alloc, stream.ptr)),
        ("the parameter struct (params.pack)", lambda: plan.params.pack(pointers)),
        ("CuPy: one empty RawKernel launch", lambda: empty((1,), (32,), ())),
        ("CuPy: one 256-byte pool allocation", lambda: cupy.cuda.alloc(256)),
    ]
    print(f"\nforward sections, {tuple(q.shape)} float16 causal, {len(plan.launches)} launches a call, "
          "us per call (back to back):")
    for name, call in rows:
        print(f"  {per_call(call, calls):7.2f}  {name}", flush=True)


if __name__ == "__main__":
    main()
