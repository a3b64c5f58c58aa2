"""The NumPy path (cupyflash.blocked) against naive NumPy attention, on the CPU.

Naive attention, in the input dtype (float32 arithmetic for float32 inputs):
  forward              S = scale q kᵀ, mask (-inf), softmax (max, exp, sum, divide), o = P v
  backward, recompute  recomputes P from q, k as the forward does, then
                       dV = Pᵀ dO, dP = dO Vᵀ, D = rowsum(dO ∘ O), dS = P ∘ (dP − D),
                       dQ = scale dS K, dK = scale dSᵀ Q: the fair comparison, since
                       the blocked backward recomputes P too
  backward, keep P     the same with P kept from the forward (not timed)
Both naive versions hold N×N arrays per head; the blocked path holds one tile.

Times: the best of --repeats runs after one warm-up run, the versions taking
turns run by run. Ratio = ours / naive (lower is better). Prints a markdown table, preceded by the machine, NumPy
version and BLAS.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import time

import numpy as np

from cupyflash import blocked


def naive_forward(q, k, v, causal, scale):
    """o, P of naive attention: S and P materialised, (*batch, Nq, Nk)."""
    S = q @ np.swapaxes(k, -1, -2)
    S *= scale
    if causal:
        n_q, n_k = S.shape[-2:]
        hidden = np.arange(n_k)[None, :] > np.arange(n_q)[:, None] + (n_k - n_q)
        S[..., hidden] = -np.inf
    S -= S.max(axis=-1, keepdims=True)
    P = np.exp(S, out=S)
    P /= P.sum(axis=-1, keepdims=True)
    return P @ v, P


def naive_backward_from_P(do, q, k, v, o, P, scale):
    """dq, dk, dv of naive attention given its P."""
    dv = np.swapaxes(P, -1, -2) @ do
    dS = do @ np.swapaxes(v, -1, -2)
    dS -= np.sum(do * o, axis=-1)[..., None]
    dS *= P
    return scale * (dS @ k), scale * (np.swapaxes(dS, -1, -2) @ q), dv


def naive_backward(do, q, k, v, o, causal, scale):
    """dq, dk, dv of naive attention, P recomputed from q and k."""
    _, P = naive_forward(q, k, v, causal, scale)
    return naive_backward_from_P(do, q, k, v, o, P, scale)


def best_times(fns, repeats):
    """Best wall time of ``repeats`` calls of each of ``fns``, after one warm-up call of each.

    The calls take turns (one of each per round), so that load from other
    processes on the machine falls on all of them alike.
    """
    for fn in fns:
        fn()
    best = [math.inf] * len(fns)
    for _ in range(repeats):
        for n, fn in enumerate(fns):
            start = time.perf_counter()
            fn()
            best[n] = min(best[n], time.perf_counter() - start)
    return best


def machine():
    """One line: cores, CPU model, NumPy version and its BLAS."""
    model = platform.processor() or "?"
    try:
        with open("/proc/cpuinfo") as f:
            model = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    blas = np.show_config(mode="dicts")["Build Dependencies"]["blas"]
    threads = os.environ.get("OPENBLAS_NUM_THREADS", "unset")
    return (f"{os.cpu_count()} cores ({model}); NumPy {np.__version__}, BLAS {blas['name']} {blas['version']}"
            f" ({blas.get('openblas configuration', '')}), OPENBLAS_NUM_THREADS {threads}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", type=int, nargs=4, default=(1, 8, 2048, 64), metavar=("B", "H", "N", "D"))
    parser.add_argument("--dtypes", nargs="+", default=("float32", "float64"))
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    B, H, N, D = args.shape
    scale = 1 / math.sqrt(D)
    print(machine())
    print(f"\nshape (B, H, N, D) = ({B}, {H}, {N}, {D}); best of {args.repeats} after a warm-up; seconds\n")
    print("| dtype | causal | pass | ours (s) | naive (s) | ours / naive | naive keeping P (s) | ours / it |")
    print("|---|---|---|---:|---:|---:|---:|---:|")
    rng = np.random.default_rng(0)
    for dtype in args.dtypes:
        q, k, v, do = (rng.standard_normal((B, H, N, D)).astype(dtype) for _ in range(4))
        for causal in (False, True):
            ours, naive = best_times((lambda: blocked.forward(q, k, v, causal=causal),
                                      lambda: naive_forward(q, k, v, causal, scale)), args.repeats)
            print(f"| {dtype} | {'yes' if causal else 'no'} | forward | {ours:.3f} | {naive:.3f} | "
                  f"{ours / naive:.2f} | | |", flush=True)

            o, m, l = blocked.forward(q, k, v, causal=causal)
            P = naive_forward(q, k, v, causal, scale)[1]
            ours, naive, kept = best_times((lambda: blocked.backward(do, q, k, v, o, m, l, causal=causal),
                                            lambda: naive_backward(do, q, k, v, o, causal, scale),
                                            lambda: naive_backward_from_P(do, q, k, v, o, P, scale)), args.repeats)
            del P
            print(f"| {dtype} | {'yes' if causal else 'no'} | backward | {ours:.3f} | {naive:.3f} | "
                  f"{ours / naive:.2f} | {kept:.3f} | {ours / kept:.2f} |", flush=True)

if __name__ == "__main__":
    main()
