"""Checkouts of cupyflash timed against each other in one process on the same inputs: is any
kernel slower than it was?

    python benchmarks/ab.py --base ../old-checkout [--tree NAME=PATH ...] [--sweep protocol variants]
                            [--variants bias mask ...] [--dtypes fp16 bf16] [--head-dims 64 128]
                            [--seqlens ...] [--rounds 2] [--schedule v1] [--deterministic]

Each checkout's ``cupyflash/`` is imported under a name of its own (``cupyflash_base``,
``cupyflash_<NAME>``; without ``--tree``, this checkout as ``head``), beside its own ``kernels_cu/``,
so all run in this process on the same q, k, v, do; the host's speed, which drifts 2-4x between
machines of one kind, cancels out of every ratio. Several ``--tree`` bisect a regression in one run.

Sweeps (forward and backward each, causal and not):

- ``protocol``: the FlashAttention papers' (batch = 16384/N, H = 2048/D), N 512 ... 16384.
- ``variants``: at N 1024 and 4096 (``--variant-seqlens``) a window ``(256, 0)``, ``softcap=30``,
  ALiBi slopes, a sink logit per head, dropout 0.1, a bias ``(1, H, N, N)`` with its gradient, a
  key-padding mask ``(B, 1, 1, N)``, packed sequences (64 of 128-4096 keys, ``varlen``), the softcap by
  expression (``score_mod``, with its derivative) and a document mask by expression in a block mask
  (``documents``: four documents, their ends off the tiles' edges). A checkout without a variant's
  keywords (expressions came after e6f132f) reports the case as one it cannot run.

Times: CUDA events around each of back-to-back calls, the median after warm-up calls (bench.py's
``median_ms``), the checkouts alternating call sets for ``--rounds`` rounds (in order, then reversed,
...); a point's time is the median of its rounds. The table gives each tree's speed over the base's
(> 1: faster) and the least, median and greatest ratio per tree, sweep and mode.

First the kernels every case needs are compiled in ``--jobs`` processes at a small size (a kernel's
specialisation does not depend on N), so the timed run compiles nothing.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import cupy
import numpy

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402 - the protocol's configurations, inputs and clocks
import variants  # noqa: E402 - the variants sweep's settings

VARIANTS = ("plain", "window", "softcap", "alibi", "sink", "dropout", "bias", "mask", "varlen", "score_mod", "documents")
DOCUMENTS = (0.3, 0.55, 0.8)   # ``documents``: where the next document starts, as fractions of N
WARM_N = 256          # the sequence length of the compile-ahead calls
WARMUP, REPEATS = 3, 10


def load_tree(label: str, root: Path):
    """The ``cupyflash`` package of checkout ``root`` imported as ``cupyflash_<label>``."""
    name = f"cupyflash_{label}"
    if name in sys.modules:
        return sys.modules[name]
    init = root / "cupyflash" / "__init__.py"
    if not init.is_file():
        raise SystemExit(f"--{label} {root}: no cupyflash/__init__.py there")
    spec = importlib.util.spec_from_file_location(name, init, submodule_search_locations=[str(init.parent)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def cases(sweeps, dtypes, head_dims, seqlens, variant_seqlens, names=VARIANTS[1:]):
    """(sweep, variant, dtype, D, N, causal) of every point (``names``: the variants sweep's; "plain" is the
    protocol's, and with the variants' lengths where named)."""
    for sweep in sweeps:
        for dtype in dtypes:
            for D in head_dims:
                if sweep == "protocol":
                    for N in seqlens:
                        for causal in (False, True):
                            yield ("protocol", "plain", dtype, D, N, causal)
                else:
                    for variant in names:
                        for N in (variant_seqlens if variant != "varlen" else [0]):
                            for causal in (False, True):
                                yield ("variants", variant, dtype, D, N, causal)


def make_case(case, small: bool = False, schedule: str = "auto", deterministic: bool = False):
    """``(inputs, forward kwargs, backward extra kwargs, offsets or None)`` of a case (``small``: at
    ``WARM_N``) under forward ``schedule``, the backward ``deterministic`` or not; for ``varlen``: q, k, v, do
    as (H, total, D) views of (total, H, D) memory and the sequences' int32 offsets (variants.py's lengths)."""
    _, variant, dtype, D, N, causal = case
    extra = {"deterministic": True} if deterministic else {}   # the backward's own keywords
    H = bench.HIDDEN // D
    if variant == "varlen":
        lengths = (numpy.random.default_rng(0).integers(WARM_N // 4, WARM_N + 1, 4) if small
                   else variants.varlen_lengths())
        total = int(lengths.sum())
        gen = cupy.random.default_rng(bench.SEED)
        q, k, v, do = (gen.standard_normal((total, H, D), dtype=numpy.float32).astype(bench.DTYPES[dtype])
                       .transpose(1, 0, 2) for _ in range(4))
        cu = cupy.asarray(numpy.concatenate([[0], numpy.cumsum(lengths)]), dtype=numpy.int32)
        longest = int(lengths.max())
        kw = dict(causal=causal, max_seqlen_q=longest, max_seqlen_k=longest, schedule=schedule)
        return bench.Inputs(q, k, v, do, causal), kw, extra, cu
    N = WARM_N if small else N
    cfg = bench.protocol_config(dtype, D, N, causal)
    x = bench.make_inputs(cfg, bench.SEED)
    kw = dict(causal=causal, schedule=schedule)
    rng = cupy.random.default_rng(1)
    if variant == "window":
        kw["window"] = (256, 0)
    elif variant == "softcap":
        kw["softcap"] = variants.SOFTCAP
    elif variant == "alibi":
        kw["alibi_slopes"] = variants.alibi_slopes(cfg.H)
    elif variant == "sink":
        kw["sink"] = rng.standard_normal(cfg.H, dtype=numpy.float32)
    elif variant == "dropout":
        kw.update(dropout_p=variants.DROPOUT_P, seed=1)
    elif variant == "bias":
        kw["bias"] = rng.standard_normal((1, cfg.H, N, N), dtype=numpy.float32).astype(x.q.dtype)
        extra["bias_grad"] = True
    elif variant == "mask":
        keep = cupy.ones((cfg.B, 1, 1, N), bool)
        keep[..., N - N // 8:] = False
        kw["mask"] = keep
    elif variant == "score_mod":
        kw.update(score_mod=variants.SOFTCAP_MOD, mod_args={"c": variants.SOFTCAP})
        extra["score_mod_grad"] = variants.SOFTCAP_MOD_GRAD
    elif variant == "documents":   # the document of each position; calls() makes each checkout's block mask
        starts = [0, *(int(f * N) for f in DOCUMENTS), N]
        kw["documents"] = cupy.asarray(numpy.repeat(numpy.arange(len(starts) - 1), numpy.diff(starts)), numpy.int32)
    return x, kw, extra, None


def calls(flash, x, kw, extra, offsets) -> dict:
    """{mode: a zero-argument call} of one checkout's ``flash`` (its cupyflash package)."""
    if offsets is not None:
        cu = offsets   # the same offsets for queries and keys
        saved = tuple(flash.flash_attention_varlen_forward(x.q, x.k, x.v, cu, cu, **kw))
        return {"fwd": lambda: flash.flash_attention_varlen_forward(x.q, x.k, x.v, cu, cu, **kw),
                "bwd": lambda: flash.flash_attention_varlen_backward(x.do, x.q, x.k, x.v, *saved, cu, cu, **kw,
                                                                      **extra)}
    if "documents" in kw:   # this checkout's block mask of the document mask
        kw = dict(kw)
        doc = kw.pop("documents")
        kw["block_mask"] = flash.block_mask("doc[q_idx] == doc[kv_idx]", x.q.shape[:-2], x.q.shape[-2], x.k.shape[-2],
                                            mod_args={"doc": doc})
    saved = tuple(flash.flash_attention_forward(x.q, x.k, x.v, **kw))
    return {"fwd": lambda: flash.flash_attention_forward(x.q, x.k, x.v, **kw),
            "bwd": lambda: flash.flash_attention_backward(x.do, x.q, x.k, x.v, *saved, **kw, **extra)}


def _warm(job) -> str:
    """Compile what ``case`` needs in both checkouts (a worker process): one small forward and backward."""
    roots, case, schedule, deterministic = job
    try:
        x, kw, extra, offsets = make_case(case, small=True, schedule=schedule, deterministic=deterministic)
        for label, root in roots.items():
            for call in calls(load_tree(label, Path(root)), x, kw, extra, offsets).values():
                call()
        cupy.cuda.Device().synchronize()
        return ""
    except Exception as error:  # noqa: BLE001 - reported; the timed run reports it again
        return f"{case}: {bench.short(error)}"


def time_case(trees, case, rounds: int, schedule: str = "auto", deterministic: bool = False) -> dict:
    """``{mode: {label: ms}}`` of one case, the checkouts alternating."""
    x, kw, extra, offsets = make_case(case, schedule=schedule, deterministic=deterministic)
    runs = {label: calls(flash, x, kw, extra, offsets) for label, flash in trees.items()}
    clock = bench.cupy_clock()
    times = {mode: {label: [] for label in trees} for mode in ("fwd", "bwd")}
    labels = list(trees)
    for r in range(rounds):
        for label in (labels if r % 2 == 0 else labels[::-1]):
            for mode, call in runs[label].items():
                times[mode][label].append(bench.median_ms(call, clock, WARMUP, REPEATS))
    del x, runs
    bench.free_memory()
    return {mode: {label: statistics.median(t) for label, t in by.items()} for mode, by in times.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--base", type=Path, required=True, help="the checkout to compare against")
    parser.add_argument("--tree", action="append", default=[], metavar="NAME=PATH",
                        help="a checkout to time against the base (repeatable; default head=this checkout)")
    parser.add_argument("--sweep", nargs="+", choices=("protocol", "variants"), default=["protocol", "variants"])
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS[1:]))
    parser.add_argument("--dtypes", nargs="+", choices=tuple(bench.DTYPES), default=["fp16", "bf16"])
    parser.add_argument("--schedule", choices=("auto", "v1", "v2"), default="auto",
                        help="the forward schedule of every call (the API's schedule=)")
    parser.add_argument("--deterministic", action="store_true", help="every backward with deterministic=True")
    parser.add_argument("--head-dims", nargs="+", type=int, default=[64, 128])
    parser.add_argument("--seqlens", nargs="+", type=int, default=[512, 1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--variant-seqlens", nargs="+", type=int, default=[1024, 4096])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--jobs", type=int, default=16, help="compile-ahead processes (0: none)")
    args = parser.parse_args(argv)
    roots = {"base": str(args.base.resolve())}
    for tree in args.tree or [f"head={Path(__file__).resolve().parent.parent}"]:
        name, _, path = tree.partition("=")
        if not name.isidentifier() or not path or name == "base":
            raise SystemExit(f"--tree {tree!r}: want NAME=PATH, NAME an identifier other than base")
        roots[name] = str(Path(path).resolve())
    points = list(cases(args.sweep, args.dtypes, args.head_dims, args.seqlens, args.variant_seqlens, args.variants))
    if args.jobs:
        import multiprocessing

        with ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            warm_cases = sorted({(c[0], c[1], c[2], c[3], 0, c[5]) for c in points})
            for error in pool.map(_warm, [(roots, c, args.schedule, args.deterministic) for c in warm_cases]):
                if error:
                    print("compile-ahead:", error, flush=True)
    trees = {label: load_tree(label, Path(root)) for label, root in roots.items()}
    others = [label for label in trees if label != "base"]
    gpu = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"].decode()
    print(f"base {roots['base']}; " + "; ".join(f"{t} {roots[t]}" for t in others)
          + f"; schedule {args.schedule}{'; deterministic backwards' if args.deterministic else ''}; on {gpu}")
    columns = [f"{mode} {t}/base" for mode in ("fwd", "bwd") for t in others]
    print("| sweep | variant | dtype | D | N | causal | fwd base ms | bwd base ms | " + " | ".join(columns) + " |")
    print("|---|---|---|---:|---:|---|---:|---:|" + "---:|" * len(columns))
    ratios = {}
    for case in points:
        try:
            t = time_case(trees, case, args.rounds, args.schedule, args.deterministic)
        except Exception as error:  # noqa: BLE001 - recorded: a case a checkout cannot run
            print(f"| {' | '.join(map(str, case))} | {bench.short(error)} |", flush=True)
            continue
        row = [f"{t['fwd']['base']:.3f}", f"{t['bwd']['base']:.3f}"]
        for mode in ("fwd", "bwd"):
            for label in others:
                ratio = t[mode]["base"] / t[mode][label]
                ratios.setdefault((label, case[0], mode), []).append((ratio, case))
                row.append(f"{ratio:.3f}")
        print(f"| {' | '.join(map(str, case))} | {' | '.join(row)} |", flush=True)
    print("\n| tree | sweep | mode | points | least (at) | median | greatest |")
    print("|---|---|---|---:|---|---:|---:|")
    for (label, sweep, mode), rs in ratios.items():
        least = min(rs)
        print(f"| {label} | {sweep} | {mode} | {len(rs)} | {least[0]:.3f} ({' '.join(map(str, least[1][1:]))}) | "
              f"{statistics.median(r for r, _ in rs):.3f} | {max(rs)[0]:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
