"""Attention variants on the GPU against FlashAttention-2 and against our own plain kernels, side by
side in one process on the same inputs (issue #17's targets): sliding windows, the score
modifiers (softcap, ALiBi, sink), packed variable-length sequences, a bias with its gradient and a
boolean mask.

    python benchmarks/variants.py [--sweep windows mods varlen bias] [--dtypes fp16 bf16] [--head-dims 64 128]
                                  [--seqlens ...] [--windows 256 1024] [--varlen-multiple 128] [--out DIR]

Windows (default N 4096 8192 16384): for each case of the FlashAttention papers' protocol
(batch = 16384/N, H = 2048/D), causal with a window ``(w, 0)``, the forward and the backward of

- ``cupyflash``: ``schedule="auto"`` with ``window=(w, 0)``,
- ``fa2``: FlashAttention-2 through ``torch.ops.aten._flash_attention_forward``/``_backward`` with
  ``window_size_left=w, window_size_right=0`` (q, k, v viewed as (B, N, H, D) through DLPack, no copy),
- ``cupyflash-causal``: our own causal call without a window (what the window saves).

TFLOP/s count the *visible* pairs only: ``4 · B · H · D · Σ_i |keys row i sees|`` forward, 2.5
times that backward.

Modifiers (default N 1024 4096 16384, causal and not): ``cupyflash`` plain, ``cupyflash-softcap``
(``softcap=30``), ``cupyflash-alibi`` (ALiBi's geometric slopes ``2^(-8 (h + 1) / H)``), both,
``cupyflash-sink`` (a sink logit per head; the backward adds dsink's reductions) and
``cupyflash-dropout`` (``dropout_p=0.1``). The target is
softcap and ALiBi at >= 0.95x our own plain speed. (torch's FlashAttention-2 build
refuses ``alibi_slopes``: "This flash attention build does not support alibi"; it has no softcap.)

Varlen: 64 sequences of lengths drawn uniformly from 128-4096 (seed 0), packed, H = 2048/D, causal
and not: ``cupyflash`` (``flash_attention_varlen_forward``/``_backward`` with CuPy offsets and both
``max_seqlen``: no host copy) against ``fa2``, FlashAttention-2's varlen through
``torch.ops.aten._flash_attention_forward``/``_backward`` with ``cum_seq_q/k`` on the same packed
(total, H, D) memory (ours reads it as (H, total, D) through DLPack, no copy), and ``cupyflash-documents``:
the same memory as one (1, H, total, D) sequence under a document mask by expression,
``doc[q_idx] == doc[kv_idx]`` (causal: ``&& kv_idx <= q_idx``) over an int32 ``mod_args`` array, its tile
maps kept in a ``cupyflash.block_mask`` (issue #38's target: >= 0.9x the varlen functions). TFLOP/s count
each sequence's visible pairs. ``--varlen-multiple 128`` rounds every length up to a multiple of 128, so
that no 128-row tile spans two documents: what the mask's partial tiles cost is the difference.

Bias (default N 1024 2048 4096, not causal): a bias ``(1, H, N, N)`` of the inputs' dtype, the backward
with ``bias_grad=True`` (dbias summed over the batch with atomics), against torch SDPA with the same
bias as a float ``attn_mask`` that requires grad, on its cuDNN backend and on its memory-efficient one
(the backward returns the mask's gradient too), all on the same memory; and ``cupyflash-mask``, a
key-padding boolean mask ``(B, 1, 1, N)`` (the last eighth of each row's keys hidden), against our own
plain call. The target: the bias backward at >= 1.0x cuDNN's.

Expressions (default N 1024 4096 16384, causal): causal by ``mask_mod="kv_idx <= q_idx"`` against
``causal=True`` (the target: >= 0.9x), and the softcap by ``score_mod`` against ``softcap=30``.

Every call is timed two ways: queued (the median of calls issued back to back, one between two
events: the GPU's time) and single (a synchronised call between two events: the host's cost
included). Writes ``variants_results.json`` and ``variants_results.md`` under ``--out``.
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


SOFTCAP = 30.0   # Gemma 2's attention softcap is 50, Grok's 30
SOFTCAP_MOD, SOFTCAP_MOD_GRAD = "c * tanhf(s / c)", "1 - tanhf(s / c) * tanhf(s / c)"   # the softcap by expression
DROPOUT_P = 0.1  # the usual attention dropout


def alibi_slopes(H: int) -> cupy.ndarray:
    """ALiBi's geometric slopes for H heads (Press et al., 2022), float32."""
    return cupy.asarray(2.0 ** (-8.0 * numpy.arange(1, H + 1) / H), dtype=numpy.float32)


def modified_runs(x: bench.Inputs, mods: dict) -> dict:
    kw = dict(causal=x.causal, **mods)
    saved = cupyflash.flash_attention_forward(x.q, x.k, x.v, **kw)
    return {"fwd": lambda: cupyflash.flash_attention_forward(x.q, x.k, x.v, **kw),
            "bwd": lambda: cupyflash.flash_attention_backward(x.do, x.q, x.k, x.v, *saved, **kw)}


def bias_runs(x: bench.Inputs, bias, mask=None, bias_grad=False) -> dict:
    kw = dict(causal=x.causal, bias=bias, mask=mask)
    saved = cupyflash.flash_attention_forward(x.q, x.k, x.v, **kw)
    return {"fwd": lambda: cupyflash.flash_attention_forward(x.q, x.k, x.v, **kw),
            "bwd": lambda: cupyflash.flash_attention_backward(x.do, x.q, x.k, x.v, *saved, bias_grad=bias_grad, **kw)}


def torch_bias_runs(backend_name: str, x: bench.Inputs, bias) -> dict:
    """torch SDPA with ``bias`` as a float ``attn_mask`` that requires grad (the same memory)."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, backend_name)
    q, k, v, do, b = (torch.from_dlpack(a) for a in (x.q, x.k, x.v, x.do, bias))
    leaves = tuple(t.detach().requires_grad_() for t in (q, k, v, b))

    def sdpa(q, k, v, b):
        with sdpa_kernel(backend):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=b)

    try:
        out = sdpa(*leaves)
        grads = torch.autograd.grad(out, leaves, do, retain_graph=True)
    except RuntimeError as error:
        raise bench.Unavailable(f"{backend_name} cannot run this: {bench.short(error)}") from error
    assert grads[3].shape == b.shape
    return {"fwd": lambda: sdpa(q, k, v, b), "bwd": lambda: torch.autograd.grad(out, leaves, do, retain_graph=True)}


def run_bias(args) -> list:
    records = []
    for dtype in args.dtypes:
        for D in args.head_dims:
            for N in args.seqlens or [1024, 2048, 4096]:
                cfg = bench.protocol_config(dtype, D, N, False)
                x = bench.make_inputs(cfg, bench.SEED)
                rng = cupy.random.default_rng(1)
                bias = rng.standard_normal((1, cfg.H, N, N), dtype=numpy.float32).astype(x.q.dtype)
                keep = cupy.ones((cfg.B, 1, 1, N), bool)
                keep[..., N - N // 8:] = False
                systems = {"cupyflash": (lambda: modified_runs(x, {}), bench.cupy_clock),
                           "cupyflash-bias": (lambda: bias_runs(x, bias, bias_grad=True), bench.cupy_clock),
                           "cupyflash-mask": (lambda: bias_runs(x, None, keep), bench.cupy_clock),
                           "torch-cudnn-bias": (lambda: torch_bias_runs("CUDNN_ATTENTION", x, bias), bench.torch_clock),
                           "torch-efficient-bias": (lambda: torch_bias_runs("EFFICIENT_ATTENTION", x, bias),
                                                    bench.torch_clock)}
                pairs = visible_pairs(N, False, (None, None))
                for name, (runs_of, clock_of) in systems.items():
                    try:
                        runs = runs_of()
                    except Exception as error:  # noqa: BLE001 - recorded: a system that cannot run this case
                        records.append(dict(system=name, sweep="bias", dtype=dtype, D=D, N=N, note=bench.short(error)))
                        print(f"{name} {cfg}: {bench.short(error)}", flush=True)
                        continue
                    clock = clock_of()
                    for mode, call in runs.items():
                        records.append(timed(name, mode, cfg, call, clock, pairs, causal=False, sweep="bias"))
                del x, bias, keep
                bench.free_memory()
    return records


def bias_table(records) -> str:
    """A row per case and mode: our plain, bias and mask speeds and cuDNN's and the efficient kernel's
    with the bias (queued TFLOP/s), and our bias over theirs (queued, single in parentheses)."""
    index = {(r["system"], r["mode"], r["dtype"], r["D"], r["N"]): r for r in records
             if r.get("sweep") == "bias" and "mode" in r}
    names = ("cupyflash", "cupyflash-bias", "cupyflash-mask", "torch-cudnn-bias", "torch-efficient-bias")
    lines = ["| dtype | D | N | mode | plain | bias | mask | cuDNN bias | efficient bias | bias / cuDNN "
             "| bias / efficient | mask / plain |", "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    speed = lambda r: f"{r['tflops_queued']:.1f}" if r else "—"   # noqa: E731

    def ratio(a, b):
        if not (a and b):
            return "—"
        return f"{a['tflops_queued'] / b['tflops_queued']:.2f} ({a['tflops_single'] / b['tflops_single']:.2f})"

    for (system, mode, *case) in list(index):
        if system != "cupyflash":
            continue
        plain, bias, mask, cudnn, eff = (index.get((name, mode, *case)) for name in names)
        dtype, D, N = case
        lines.append(f"| {dtype} | {D} | {N} | {mode} | {speed(plain)} | {speed(bias)} | {speed(mask)} | "
                     f"{speed(cudnn)} | {speed(eff)} | {ratio(bias, cudnn)} | {ratio(bias, eff)} | "
                     f"{ratio(mask, plain)} |")
    return "\n".join(lines) + "\n"


def mods_cases(dtypes, head_dims, seqlens):
    for dtype in dtypes:
        for D in head_dims:
            for N in seqlens:
                for causal in (False, True):
                    yield bench.protocol_config(dtype, D, N, causal)


def run_mods(args) -> list:
    records = []
    for cfg in mods_cases(args.dtypes, args.head_dims, args.seqlens or [1024, 4096, 16384]):
        x = bench.make_inputs(cfg, bench.SEED)
        slopes = alibi_slopes(cfg.H)
        sinks = cupy.zeros(cfg.H, numpy.float32)   # one learned logit per head (gpt-oss)
        systems = {"cupyflash": (lambda: modified_runs(x, {}), bench.cupy_clock),
                   "cupyflash-softcap": (lambda: modified_runs(x, {"softcap": SOFTCAP}), bench.cupy_clock),
                   "cupyflash-alibi": (lambda: modified_runs(x, {"alibi_slopes": slopes}), bench.cupy_clock),
                   "cupyflash-both": (lambda: modified_runs(x, {"softcap": SOFTCAP, "alibi_slopes": slopes}),
                                      bench.cupy_clock),
                   "cupyflash-sink": (lambda: modified_runs(x, {"sink": sinks}), bench.cupy_clock),
                   "cupyflash-dropout": (lambda: modified_runs(x, {"dropout_p": DROPOUT_P, "seed": 1}),
                                         bench.cupy_clock)}
        pairs = visible_pairs(cfg.N, cfg.causal, (None, None))
        for name, (runs_of, clock_of) in systems.items():
            try:
                runs = runs_of()
            except Exception as error:  # noqa: BLE001 - recorded: a system that cannot run this case
                records.append(dict(system=name, dtype=cfg.dtype, D=cfg.D, N=cfg.N, B=cfg.B, H=cfg.H,
                                    causal=cfg.causal, note=bench.short(error)))
                print(f"{name} {cfg}: {bench.short(error)}", flush=True)
                continue
            clock = clock_of()
            for mode, call in runs.items():
                records.append(timed(name, mode, cfg, call, clock, pairs, causal=cfg.causal))
        del x
        bench.free_memory()
    return records


def timed(name, mode, cfg, call, clock, pairs, **case) -> dict:
    """One system's call timed queued and single, as a record (TFLOP/s of ``pairs`` visible pairs)."""
    flops = 4.0 * cfg.B * cfg.H * cfg.D * pairs * (BWD_FLOP_FACTOR if mode == "bwd" else 1.0)
    queued = bench.median_ms(call, clock, bench.WARMUP, bench.REPEATS)
    single = bench.single_ms(call, clock, SINGLE_CALLS)
    record = dict(system=name, mode=mode, dtype=cfg.dtype, D=cfg.D, N=cfg.N, B=cfg.B, H=cfg.H, **case,
                  visible_pairs=pairs, queued_ms=queued, single_ms=single,
                  tflops_queued=flops / queued / 1e9, tflops_single=flops / single / 1e9)
    print(f"{name:<17} {mode} {cfg.dtype} D={cfg.D} N={cfg.N:>5} {case}: "
          f"{record['tflops_queued']:6.1f} TFLOP/s queued, {record['tflops_single']:6.1f} single", flush=True)
    return record


def mods_table(records) -> str:
    """A row per case and mode: our plain, softcap, ALiBi, both and sink speeds (queued) and their
    ratios to plain (queued, single in parentheses)."""
    index = {(r["system"], r["mode"], r["dtype"], r["D"], r["N"], r["causal"]): r
             for r in records if "mode" in r and "causal" in r and "sweep" not in r}
    variants = ("cupyflash-softcap", "cupyflash-alibi", "cupyflash-both", "cupyflash-sink", "cupyflash-dropout")
    lines = ["| dtype | D | N | causal | mode | plain TFLOP/s | softcap | ALiBi | both | sink | dropout | softcap / plain "
             "| ALiBi / plain | both / plain | sink / plain | dropout / plain |",
             "|---|---:|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    speed = lambda r: f"{r['tflops_queued']:.1f}" if r else "—"   # noqa: E731

    def ratio(a, b):
        if not (a and b):
            return "—"
        return f"{a['tflops_queued'] / b['tflops_queued']:.2f} ({a['tflops_single'] / b['tflops_single']:.2f})"

    for (system, mode, *case), plain in index.items():
        if system != "cupyflash":
            continue
        got = [index.get((name, mode, *case)) for name in variants]
        dtype, D, N, causal = case
        lines.append(f"| {dtype} | {D} | {N} | {causal} | {mode} | {speed(plain)} | "
                     + " | ".join(speed(r) for r in got) + " | " + " | ".join(ratio(r, plain) for r in got) + " |")
    return "\n".join(lines) + "\n"


def expression_runs(x: bench.Inputs, grad=None, **kw) -> dict:
    """The forward and backward of ``kw``; ``grad`` the backward's score_mod_grad."""
    saved = cupyflash.flash_attention_forward(x.q, x.k, x.v, **kw)
    back = dict(kw, score_mod_grad=grad) if grad else kw
    return {"fwd": lambda: cupyflash.flash_attention_forward(x.q, x.k, x.v, **kw),
            "bwd": lambda: cupyflash.flash_attention_backward(x.do, x.q, x.k, x.v, *saved, **back)}


def run_expressions(args) -> list:
    """Causal by expression (``mask_mod="kv_idx <= q_idx"``, its tile map kept from call to call) against
    ``causal=True``, and the softcap by expression (``score_mod``) against ``softcap=30``, both causal."""
    records = []
    for dtype in args.dtypes:
        for D in args.head_dims:
            for N in args.seqlens or [1024, 4096, 16384]:
                cfg = bench.protocol_config(dtype, D, N, True)
                x = bench.make_inputs(cfg, bench.SEED)
                cap = dict(score_mod=SOFTCAP_MOD, grad=SOFTCAP_MOD_GRAD, mod_args={"c": SOFTCAP})
                systems = {"cupyflash": dict(causal=True), "cupyflash-mask-mod": dict(mask_mod="kv_idx <= q_idx"),
                           "cupyflash-softcap": dict(causal=True, softcap=SOFTCAP),
                           "cupyflash-score-mod": dict(causal=True, **cap)}
                pairs = visible_pairs(N, True, (None, None))
                for name, kw in systems.items():
                    runs = expression_runs(x, **kw)
                    for mode, call in runs.items():
                        records.append(timed(name, mode, cfg, call, bench.cupy_clock(), pairs, causal=True,
                                             sweep="expressions"))
                del x
                bench.free_memory()
    return records


def expressions_table(records) -> str:
    """A row per case and mode: causal=True against causal by mask_mod, the softcap against it by
    score_mod (queued TFLOP/s; the ratios queued, single in parentheses)."""
    index = {(r["system"], r["mode"], r["dtype"], r["D"], r["N"]): r for r in records if r.get("sweep") == "expressions"}
    lines = ["| dtype | D | N | mode | causal=True | mask_mod | mask_mod / causal | softcap | score_mod "
             "| score_mod / softcap |", "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|"]
    for (system, mode, *case), plain in index.items():
        if system != "cupyflash":
            continue
        by_mask, cap, by_score = (index.get((name, mode, *case)) for name in
                                  ("cupyflash-mask-mod", "cupyflash-softcap", "cupyflash-score-mod"))
        ratio = lambda a, b: (f"{a['tflops_queued'] / b['tflops_queued']:.2f} "   # noqa: E731
                              f"({a['tflops_single'] / b['tflops_single']:.2f})")
        lines.append(f"| {case[0]} | {case[1]} | {case[2]} | {mode} | {plain['tflops_queued']:.1f} | "
                     f"{by_mask['tflops_queued']:.1f} | {ratio(by_mask, plain)} | {cap['tflops_queued']:.1f} | "
                     f"{by_score['tflops_queued']:.1f} | {ratio(by_score, cap)} |")
    return "\n".join(lines) + "\n"


def window_cases(dtypes, head_dims, seqlens, windows):
    for dtype in dtypes:
        for D in head_dims:
            for N in seqlens:
                for w in windows:
                    yield bench.protocol_config(dtype, D, N, True), (w, 0)


def run_windows(args) -> list:
    records = []
    systems = {"cupyflash": (cupyflash_runs, bench.cupy_clock, None),
               "fa2": (fa2_runs, bench.torch_clock, None),
               "cupyflash-causal": (cupyflash_runs, bench.cupy_clock, (None, None))}
    for cfg, window in window_cases(args.dtypes, args.head_dims, args.seqlens or [4096, 8192, 16384], args.windows):
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
                records.append(timed(name, mode, cfg, call, clock, pairs, window=list(window)))
        del x
        bench.free_memory()
    return records


def table(records) -> str:
    """A row per case and mode: cupyflash, FA2 and their ratios, queued and single."""
    index = {(r["system"], r["mode"], r["dtype"], r["D"], r["N"], tuple(r["window"])): r
             for r in records if "mode" in r and "window" in r}
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


VARLEN_SEQS, VARLEN_LENGTHS = 64, (128, 4096)


VARLEN_MULTIPLE = 1   # --varlen-multiple: each length rounded up to a multiple of it


def varlen_lengths():
    """The varlen sweep's sequence lengths (a fixed draw, rounded up to ``VARLEN_MULTIPLE``)."""
    drawn = numpy.random.default_rng(0).integers(VARLEN_LENGTHS[0], VARLEN_LENGTHS[1] + 1, VARLEN_SEQS)
    return -(-drawn // VARLEN_MULTIPLE) * VARLEN_MULTIPLE


def varlen_case(dtype: str, D: int, causal: bool):
    """(torch q, k, v, do as (total, H, D), offsets, longest, visible pairs) of the varlen sweep."""
    import torch

    lengths = varlen_lengths()
    cu = torch.tensor(numpy.concatenate([[0], numpy.cumsum(lengths)]), dtype=torch.int32, device="cuda")
    H, total = 2048 // D, int(lengths.sum())
    gen = torch.Generator(device="cuda").manual_seed(bench.SEED)
    tdtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[dtype]
    q, k, v, do = (torch.randn(total, H, D, device="cuda", dtype=tdtype, generator=gen) for _ in range(4))
    pairs = int(sum(n * (n + 1) // 2 if causal else n * n for n in lengths))
    return q, k, v, do, cu, int(lengths.max()), pairs


def varlen_runs(system, q, k, v, do, cu, longest, causal) -> dict:
    import torch

    if system == "fa2":
        out, lse, rng_state, unused, _ = torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, longest, longest,
                                                                                 0.0, causal, False)
        return {"fwd": lambda: torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, longest, longest, 0.0, causal,
                                                                       False),
                "bwd": lambda: torch.ops.aten._flash_attention_backward(do, q, k, v, out, lse, cu, cu, longest, longest,
                                                                        0.0, causal, rng_state, unused)}
    qc, kc, vc, doc = (cupy.from_dlpack(x).transpose(1, 0, 2) for x in (q, k, v, do))   # (H, total, D) views
    if system == "cupyflash-documents":   # one sequence of every document, a block mask between them
        qc, kc, vc, doc = (x[None] for x in (qc, kc, vc, doc))
        ids = cupy.repeat(cupy.arange(VARLEN_SEQS, dtype=cupy.int32), cupy.asarray(varlen_lengths()))
        mask = cupyflash.block_mask("doc[q_idx] == doc[kv_idx]" + (" && kv_idx <= q_idx" if causal else ""),
                                    qc.shape[:2], qc.shape[2], kc.shape[2], mod_args={"doc": ids})
        saved = cupyflash.flash_attention_forward(qc, kc, vc, block_mask=mask)
        return {"fwd": lambda: cupyflash.flash_attention_forward(qc, kc, vc, block_mask=mask),
                "bwd": lambda: saved.backward(doc)}
    cuc = cupy.from_dlpack(cu)
    kw = dict(causal=causal, max_seqlen_q=longest, max_seqlen_k=longest)
    saved = cupyflash.flash_attention_varlen_forward(qc, kc, vc, cuc, cuc, **kw)
    return {"fwd": lambda: cupyflash.flash_attention_varlen_forward(qc, kc, vc, cuc, cuc, **kw),
            "bwd": lambda: cupyflash.flash_attention_varlen_backward(doc, qc, kc, vc, *saved, cuc, cuc, **kw)}


def run_varlen(args) -> list:
    records = []
    for dtype in args.dtypes:
        for D in args.head_dims:
            for causal in (False, True):
                q, k, v, do, cu, longest, pairs = varlen_case(dtype, D, causal)
                cfg = bench.Config(dtype, D, longest, causal, B=1, H=2048 // D)
                for name, clock_of in (("cupyflash", bench.cupy_clock), ("fa2", bench.torch_clock),
                                       ("cupyflash-documents", bench.cupy_clock)):
                    try:
                        runs = varlen_runs(name, q, k, v, do, cu, longest, causal)
                    except Exception as error:  # noqa: BLE001 - recorded: a system that cannot run this case
                        records.append(dict(system=name, sweep="varlen", dtype=dtype, D=D, causal=causal,
                                            note=bench.short(error)))
                        print(f"{name} varlen {dtype} D={D}: {bench.short(error)}", flush=True)
                        continue
                    clock = clock_of()
                    for mode, call in runs.items():
                        records.append(timed(name, mode, cfg, call, clock, pairs, causal=causal, sweep="varlen"))
                del q, k, v, do
                bench.free_memory()
    return records


def varlen_table(records) -> str:
    """A row per case and mode: cupyflash and FA2 varlen, TFLOP/s queued / single, and their ratios."""
    index = {(r["system"], r["mode"], r["dtype"], r["D"], r["causal"]): r
             for r in records if r.get("sweep") == "varlen" and "mode" in r}
    lines = ["| dtype | D | causal | mode | cupyflash TFLOP/s (queued / single) | FA2 varlen (queued / single) "
             "| ratio queued | ratio single | documents by block mask (queued / single) | documents / varlen "
             "(queued) |", "|---|---:|---|---|---:|---:|---:|---:|---:|---:|"]
    pair = lambda r: f"{r['tflops_queued']:.1f} / {r['tflops_single']:.1f}" if r else "—"   # noqa: E731
    for (system, mode, *case), r in index.items():
        if system != "cupyflash":
            continue
        fa2, docs = index.get(("fa2", mode, *case)), index.get(("cupyflash-documents", mode, *case))
        ratios = [f"{r[key] / fa2[key]:.2f}" if fa2 else "—" for key in ("tflops_queued", "tflops_single")]
        by_docs = f"{docs['tflops_queued'] / r['tflops_queued']:.2f}" if docs else "—"
        dtype, D, causal = case
        lines.append(f"| {dtype} | {D} | {causal} | {mode} | {pair(r)} | {pair(fa2)} | {ratios[0]} | {ratios[1]} "
                     f"| {pair(docs)} | {by_docs} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", nargs="+", default=["fp16", "bf16"], choices=["fp16", "bf16"])
    parser.add_argument("--head-dims", nargs="+", type=int, default=[64, 128])
    parser.add_argument("--sweep", nargs="+", default=["windows", "mods", "varlen", "bias", "expressions"],
                        choices=["windows", "mods", "varlen", "bias", "expressions"])
    parser.add_argument("--seqlens", nargs="+", type=int, default=None, help="default: per sweep (module doc)")
    parser.add_argument("--windows", nargs="+", type=int, default=[256, 1024])
    parser.add_argument("--varlen-multiple", type=int, default=1,
                        help="varlen: round each length up to a multiple of this (128: no tile spans two documents)")
    parser.add_argument("--out", type=Path, default=Path("."))
    args = parser.parse_args(argv)
    global VARLEN_MULTIPLE
    VARLEN_MULTIPLE = args.varlen_multiple
    records = ((run_windows(args) if "windows" in args.sweep else []) + (run_mods(args) if "mods" in args.sweep else [])
               + (run_varlen(args) if "varlen" in args.sweep else [])
               + (run_bias(args) if "bias" in args.sweep else [])
               + (run_expressions(args) if "expressions" in args.sweep else []))
    args.out.mkdir(parents=True, exist_ok=True)
    device = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"].decode()
    (args.out / "variants_results.json").write_text(json.dumps(dict(device=device, commit=bench.git_commit(),
                                                                    records=records), indent=1))
    tables = (table(records) + "\n" + mods_table(records) + "\n" + varlen_table(records) + "\n" + bias_table(records)
              + "\n" + expressions_table(records))
    (args.out / "variants_results.md").write_text(f"{device}, commit {bench.git_commit()}\n\n" + tables)
    print(tables)
    return 0


if __name__ == "__main__":
    sys.exit(main())
