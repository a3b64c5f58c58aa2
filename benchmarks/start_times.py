"""Start-up cost of a new process on a GPU: cold (empty kernel cache) against warm (CuPy's disk cache).

    PYTHONPATH=$PWD python3 benchmarks/start_times.py [--repeats 3]

Each measurement is a fresh Python process with its own ``CUPY_CACHE_DIR``: the first run of a
directory compiles (cold), the later ones load the binaries CuPy wrote there (warm). A child times
``import cupyflash``, the CUDA context, and the first forward and backward (fp16, D = 64, causal,
to completion), then a second forward, which is the steady state. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

CHILD = r"""
import json, time
t0 = time.perf_counter()
import cupy, numpy, cupyflash
t1 = time.perf_counter()
cupy.cuda.runtime.free(cupy.cuda.runtime.malloc(1))     # creates the context
t2 = time.perf_counter()
rng = numpy.random.default_rng(0)
q, k, v, do = (cupy.asarray(rng.standard_normal((1, 8, 512, 64)).astype(numpy.float16)) for _ in range(4))
def forward():
    out = cupyflash.flash_attention_forward(q, k, v, causal=True)
    cupy.cuda.get_current_stream().synchronize()
    return out
o, m, l = forward()
t3 = time.perf_counter()
cupyflash.flash_attention_backward(do, q, k, v, o, m, l, causal=True)
cupy.cuda.get_current_stream().synchronize()
t4 = time.perf_counter()
forward()
t5 = time.perf_counter()
print(json.dumps({"import": t1 - t0, "context": t2 - t1, "first forward": t3 - t2, "first backward": t4 - t3,
                  "second forward": t5 - t4}))
"""


def run_child(cache_dir: str) -> dict:
    env = {**os.environ, "CUPY_CACHE_DIR": cache_dir}
    done = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, check=True,
                          timeout=600)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="warm processes after the cold one")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as cache_dir:
        rows = [("cold", run_child(cache_dir))] + [(f"warm {i + 1}", run_child(cache_dir)) for i in range(args.repeats)]
    keys = list(rows[0][1])
    print("| process | " + " | ".join(keys) + " |")
    print("|---|" + "---:|" * len(keys))
    for name, times in rows:
        print(f"| {name} | " + " | ".join(f"{times[key] * 1e3:.0f} ms" for key in keys) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
