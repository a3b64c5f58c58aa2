"""Attention variants on the GPU against FlashAttention-2, side by side in one process on the same
inputs (issue #17's targets). Today: sliding windows.

    python benchmarks/variants.py [--dtypes fp16 bf16] [--head-dims 64 128] [--seqlens 4096 8192 16384]
                                  [--windows 256 1024] [--out DIR]

For each case of the FlashAttention papers' protocol (batch = 16384/N, H = 2048/D), causal with a
window ``(w, 0)``, it times the forward and the backward of

- ``cupyflash``: ``schedule="auto"`` with ``window=(w, 0)``,
- ``fa2``: FlashAttention-2 through ``torch.ops.aten._flash_attention_forward``/``_backward`` with
  ``window_size_left=w, window_size_right=0`` (q, k, v viewed as (B, N, H, D) through DLPack, no copy),
- ``cupyflash-causal``: our own causal call without a window (what the window saves),

each two ways: queued (the median of calls issued back to back, one between two events: the GPU's
time) and single (a synchronised call between two events: the host's cost included). TFLOP/s count
the *visible* pairs only: ``4 · B · H · D · Σ_i |keys row i sees|`` forward, 2.5 times that
backward. Writes ``variants_results.json`` and ``variants_results.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import cupy
import numpy

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402 - the sweep's inputs, clocks and timing

import cupyflash  # noqa: E402
from cupyflash._mask import MaskGeometry  # noqa: E402

SINGLE_CALLS = 20
BWD_FLOP_FACTOR = 2.5


def visible_pairs(n: int, causal: bool, window) -> int:
    """Σ over query rows of the keys each sees (Nq = Nk = n)."""
    geometry = MaskGeometry(n, n, causal, *window)
    rows = numpy.arange(n)
    return int(numpy.maximum(geometry.hi(rows) - geometry.lo(rows), 0).sum())


def cupyflash_runs(x: bench.Inputs, window) -> dict:
    kw = dict(causal=True, window=window)
    saved = cupyflash.flash_attention_forward(x.q, x.k, x.v, **kw)
    return {"fwd": lambda: cupyflash.flash_attention_forward(x.q, x.k, x.v, **kw),
            "bwd": lambda: cupyflash.flash_attention_backward(x.do, x.q, x.k, x.v, *saved, **kw)}


def fa2_runs(x: bench.Inputs, window) -> dict:
    """FlashAttention-2's window through ATen: (B, N, H, D) views of the (B, H, N, D) inputs."""
    import torch

    q, k, v, do = (torch.from_dlpack(a).transpose(1, 2) for a in (x.q, x.k, x.v, x.do))
    B, N = q.shape[:2]
    left, right = (-1 if side is None else side for side in window)
    flags = dict(scale=None, window_size_left=left, window_size_right=right)
    forward = torch.ops.aten._flash_attention_forward

    def run_forward():
        return forward(q, k, v, None, None, N, N, 0.0, True, False, **flags)

    out, lse, rng_state, unused, _ = run_forward()

    def backward_with(no_seqlens):
        return lambda: torch.ops.aten._flash_attention_backward(do, q, k, v, out, lse, no_seqlens, no_seqlens, N, N,
                                                                0.0, True, rng_state, unused, **flags)

    # the backward's cum_seq_q/k are not optional in the schema: an undefined tensor means "not varlen"
    for no_seqlens in (None, torch.empty(0, dtype=torch.int32, device=q.device)):
        try:
            run_backward = backward_with(no_seqlens)
            run_backward()
            break
        except (RuntimeError, TypeError) as error:
            failure = error
    else:
        raise failure
    return {"fwd": run_forward, "bwd": run_backward}


def window_cases(dtypes, head_dims, seqlens, windows):
    for dtype in dtypes:
        for D in head_dims:
            for N in seqlens:
                for w in windows:
                    yield bench.protocol_config(dtype, D, N, True), (w, 0)


def run(args) -> list:
    records = []
    systems = {"cupyflash": (cupyflash_runs, bench.cupy_clock, None),
               "fa2": (fa2_runs, bench.torch_clock, None),
               "cupyflash-causal": (cupyflash_runs, bench.cupy_clock, (None, None))}
    for cfg, window in window_cases(args.dtypes, args.head_dims, args.seqlens, args.windows):
        x = bench.make_inputs(cfg, bench.SEED)
        for name, (runs_of, clock_of, own_window) in systems.items():
            w = window if own_window is None else own_window
            pairs = visible_pairs(cfg.N, True, w)
            try:
                runs = runs_of(x, w)
            except Exception as error:  # noqa: BLE001 - recorded: a system that cannot run this case
                records.append(dict(system=name, dtype=cfg.dtype, D=cfg.D, N=cfg.N, B=cfg.B, H=cfg.H,
                                    window=list(window), note=bench.short(error)))
                print(f"{name} {cfg}: {bench.short(error)}", flush=True)
                continue
            clock = clock_of()
            for mode, call in runs.items():
                flops = 4.0 * cfg.B * cfg.H * cfg.D * pairs * (BWD_FLOP_FACTOR if mode == "bwd" else 1.0)
                queued = bench.median_ms(call, clock, bench.WARMUP, bench.REPEATS)
                single = bench.single_ms(call, clock, SINGLE_CALLS)
                record = dict(system=name, mode=mode, dtype=cfg.dtype, D=cfg.D, N=cfg.N, B=cfg.B, H=cfg.H,
                              window=list(window), visible_pairs=pairs, queued_ms=queued, single_ms=single,
                              tflops_queued=flops / queued / 1e9, tflops_single=flops / single / 1e9)
                records.append(record)
                print(f"{name:<17} {mode} {cfg.dtype} D={cfg.D} N={cfg.N:>5} window={window}: "
                      f"{record['tflops_queued']:6.1f} TFLOP/s queued, {record['tflops_single']:6.1f} single",
                      flush=True)
        del x
        bench.free_memory()
    return records


def table(records) -> str:
    """A row per case and mode: cupyflash, FA2 and their ratios, queued and single."""
    index = {(r["system"], r["mode"], r["dtype"], r["D"], r["N"], tuple(r["window"])): r
             for r in records if "mode" in r}
    lines = ["| dtype | D | N | window | mode | cupyflash TFLOP/s (queued / single) | FA2 (queued / single) "
             "| ratio queued | ratio single | causal, no window (queued) |",
             "|---|---:|---:|---|---|---:|---:|---:|---:|---:|"]
    pair = lambda r: f"{r['tflops_queued']:.1f} / {r['tflops_single']:.1f}" if r else "—"   # noqa: E731
    for (system, mode, *case), r in index.items():
        if system != "cupyflash":
            continue
        fa2 = index.get(("fa2", mode, *case))
        causal = index.get(("cupyflash-causal", mode, *case))
        ratios = [f"{r[key] / fa2[key]:.2f}" if fa2 else "—" for key in ("tflops_queued", "tflops_single")]
        dtype, D, N, window = case
        own = f"{causal['tflops_queued']:.1f}" if causal else "—"
        lines.append(f"| {dtype} | {D} | {N} | {window} | {mode} | {pair(r)} | {pair(fa2)} | {ratios[0]} | {ratios[1]} "
                     f"| {own} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", nargs="+", default=["fp16", "bf16"], choices=["fp16", "bf16"])
    parser.add_argument("--head-dims", nargs="+", type=int, default=[64, 128])
    parser.add_argument("--seqlens", nargs="+", type=int, default=[4096, 8192, 16384])
    parser.add_argument("--windows", nargs="+", type=int, default=[256, 1024])
    parser.add_argument("--out", type=Path, default=Path("."))
    args = parser.parse_args(argv)
    records = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    device = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"].decode()
    (args.out / "variants_results.json").write_text(json.dumps(dict(device=device, commit=bench.git_commit(),
                                                                    records=records), indent=1))
    (args.out / "variants_results.md").write_text(f"{device}, commit {bench.git_commit()}\n\n" + table(records))
    print(table(records))
    return 0


if __name__ == "__main__":
    sys.exit(main())
