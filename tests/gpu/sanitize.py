"""Every kernel specialisation on small ragged problems, forward and backward, for compute-sanitizer.

Run under each tool (zero errors is the pass mark), or all four with ``tests/gpu/sanitize_all.sh``::

    PYTHONPATH=$PWD compute-sanitizer --tool memcheck  --error-exitcode 1 python3 tests/gpu/sanitize.py
    PYTHONPATH=$PWD compute-sanitizer --tool racecheck --error-exitcode 1 python3 tests/gpu/sanitize.py --quick
    PYTHONPATH=$PWD compute-sanitizer --tool initcheck --error-exitcode 1 python3 tests/gpu/sanitize.py
    PYTHONPATH=$PWD compute-sanitizer --tool synccheck --error-exitcode 1 python3 tests/gpu/sanitize.py

Cases: schedules v1, v2 and v2 on the portable kernels ("v2-mma", where the Hopper ones would
run), the four dtypes (float32 under both precisions: 450 cases), one head dim per bucket, Nq != Nk ragged against every tile size, causal and
not, causal with a NaN in each of q, k, v, do inside a diagonal tile (the scans, the flags and
flash_repair.cu), a sliding window without and (causal) with the NaNs, K/V broadcast over a group of
query heads, the backward unordered and deterministic (one kernel, ``uses``' ordered bit); ``--mods all``
runs them with the softcap and ALiBi compiled in and a sink (read at run time), ``--mods pairs`` with a
bias (dbias read at run time) and a boolean mask, ``--mods dropout`` with dropout, ``--mods user`` with a
score_mod and a mask_mod (its tile map's kernels too); under the NaN masks the repair kernels read every
modifier at run time (cupyflash/_flags.py: FLAGS).
``--splits N`` runs the V2 forwards split-KV in N parts (merged by flash_merge.cu);
``--merge`` runs merge_attention's kernel instead (every dtype, 1, 3 and 17 parts listed and stacked, a
head dim of 16-byte rows and one without, empty rows), against the NumPy merge. ``--kvcache`` runs
flash_attention_with_kvcache instead (the append kernel, then the forward that reads the cache: the
Hopper kernel for 16-bit inputs, contiguous and paged, pages of 16, 48 and 1 rows shuffled; GQA; a
length at the capacity and one at 0; split-KV and not), against its NumPy path. ``--fp8`` runs
flash_attention_forward_fp8 instead (the float8 Hopper kernel and its V^T pass on sm_90: ragged, causal with a
NaN in v under the mask, a window, GQA, D 40 and 128, both output dtypes), against its NumPy path.
``--quick`` keeps two head dims, ``--head-dims`` picks some, ``--dtypes`` some dtypes, ``--schedules`` some
schedules, ``--masks`` some masks (racecheck over all six head dims takes
longer than one 10-minute device call: run it in parts). The script also checks each result
against the float64 reference, so a kernel that runs clean but wrong fails too.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import ml_dtypes
import numpy

import cupyflash
from cupyflash import _launch, _tiles, reference

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # tests/, for the suite's tolerances
from tolerances import SANITIZE_REL_ERR  # noqa: E402

# (name, dtype, precision, the tolerance's precision): float32 under both precisions, "tf32" held to
# float16's tolerance (TF32 keeps float16's 10 mantissa bits)
VARIANTS = (("float16", numpy.float16, "highest", "float16"), ("bfloat16", ml_dtypes.bfloat16, "highest", "bfloat16"),
            ("float32", numpy.float32, "highest", "float32"), ("float32-tf32", numpy.float32, "tf32", "float16"),
            ("float64", numpy.float64, "highest", "float64"))
HEAD_DIMS = (24, 64, 80, 128, 160, 256)   # one per bucket: 32, 64, 96, 128, 192, 256
QUICK_HEAD_DIMS = (64, 128)
SCHEDULES = ("v1", "v2", "v2-mma")
# q (B, Hkv, G, Nq, D) against k, v (B, Hkv, 1, Nk, D): broadcast over G query heads
Q_SHAPE, KV_SHAPE = (1, 2, 2, 70), (1, 2, 1, 200)
# Causal, query row i sees keys up to i + 130: a NaN at each of these, where rows of one tile see it
# and rows of the same tile do not
POISON = {"q": (0, 0, 1, 10, 3), "k": (0, 1, 0, 170, 2), "v": (0, 0, 0, 150, 1), "do": (0, 1, 1, 30, 0)}


# (causal, window, NaNs planted): without a mask, causal, causal with NaNs, a window whose both edges
# cut tiles (keys i + 90 .. i + 140 of 200), a causal window (keys i + 40 .. i + 130) with NaNs
MASKS = {"plain": (False, None, False), "causal": (True, None, False), "causal-nan": (True, None, True),
         "window": (False, (40, 10), False), "window-nan": (True, (90, None), True)}


# the modifiers (score_mod.cuh): none, all three score modifiers (softcap, ALiBi slopes per K/V head, a
# sink per query head), or the per-pair arrays (a bias per query head, broadcast over the batch, with
# its gradient, and a mask per batch entry hiding a quarter of the pairs; the bias's values, quarters
# in [-2, 2), are exact in every dtype); the main kernels compile the score modifiers in, the repair reads
# them at run time
_PAIRS = numpy.random.default_rng(7)
MODS = {"none": {}, "all": dict(softcap=4.0, alibi_slopes=numpy.array([[0.5], [0.125]], numpy.float32),
                                sink=numpy.array([[0.5, -1.0], [1.5, 0.0]], numpy.float32)),
        "pairs": dict(bias=_PAIRS.integers(-8, 8, (2, Q_SHAPE[-1], KV_SHAPE[-1])) / 4,
                      mask=_PAIRS.random((Q_SHAPE[0], 1, 1, Q_SHAPE[-1], KV_SHAPE[-1])) < 0.75),
        "dropout": dict(dropout_p=0.25, seed=2**40 + 3),
        # user expressions: a softcap and a per-key weight by score_mod, a mask_mod that hides every third
        # block of 64 keys (whole tiles: the tile map skips them) and, for odd b, the keys past q_idx + 150
        "user": dict(score_mod="c * tanhf(s / c) + w[kv_idx]", score_mod_grad="1 - tanhf(s / c) * tanhf(s / c)",
                     mask_mod="(kv_idx / 64) % 3 != 1 && (b % 2 == 0 || kv_idx <= q_idx + 150)",
                     mod_args={"c": 4.0, "w": (numpy.arange(KV_SHAPE[-1]) % 5 / 4).astype(numpy.float32)})}


def run_case(dtype, precision, D, schedule, causal, window, poison, rng, mods=None, splits=1) -> float:
    """Forward and backward of one case; the worst relative error against the reference."""
    import cupy

    _launch.USE_WGMMA = schedule != "v2-mma"
    q = rng.standard_normal((*Q_SHAPE, D)).astype(dtype)
    k, v = (rng.standard_normal((*KV_SHAPE, D)).astype(dtype) for _ in range(2))
    do = rng.standard_normal(q.shape).astype(dtype)
    if poison:
        for name, x in zip(("q", "k", "v", "do"), (q, k, v, do)):
            x[POISON[name]] = numpy.nan
    api = schedule.split("-")[0]
    qg, kg, vg, dog = (cupy.asarray(x) for x in (q, k, v, do))
    kw = dict(causal=causal, window=window, **(mods or {}))
    if "bias" in kw:
        kw["bias"] = kw["bias"].astype(dtype)
    grad_kw = dict(kw, bias_grad=True) if "bias" in kw else dict(kw)
    kw.pop("score_mod_grad", None)   # the backward's alone
    splits = splits if api != "v1" else 1
    o, m, l = cupyflash.flash_attention_forward(qg, kg, vg, **kw, schedule=api, precision=precision, num_splits=splits)
    grads = cupyflash.flash_attention_backward(dog, qg, kg, vg, o, m, l, **grad_kw, schedule=api, precision=precision)
    ordered = cupyflash.flash_attention_backward(dog, qg, kg, vg, o, m, l, **grad_kw, schedule=api,
                                                 precision=precision, deterministic=True)
    refs = reference.attention_forward(q, k, v, **kw)
    ref_grads = reference.attention_backward(do, q, k, v, *refs, **grad_kw)
    worst = 0.0
    for got, ref in zip((o, m, l, *grads, *ordered), (*refs, *ref_grads, *ref_grads)):
        got, ref = got.get().astype(numpy.float64), numpy.asarray(ref, numpy.float64)
        finite = numpy.isfinite(ref)
        assert numpy.array_equal(numpy.isfinite(got), finite)
        assert numpy.array_equal(got[~finite], ref[~finite], equal_nan=True)
        scale = numpy.linalg.norm(ref[finite]) or 1.0
        worst = max(worst, float(numpy.linalg.norm(got[finite] - ref[finite]) / scale))
    return worst


def merge_cases(rng) -> int:
    """flash_merge.cu on every dtype, listed and stacked parts, D 128 and 40; the failures."""
    import cupy

    failures = cases = 0
    for (name, dtype, _, tolerance), parts, D, stacked in itertools.product(
            [v for v in VARIANTS if v[2] != "tf32"], (1, 3, 17), (128, 40), (False, True)):
        acc = numpy.float64 if dtype == numpy.float64 else numpy.float32
        o = rng.standard_normal((parts, 3, 37, D)).astype(dtype)
        m = (3 * rng.standard_normal((parts, 3, 37))).astype(acc)
        l = rng.uniform(1, 9, (parts, 3, 37)).astype(acc)
        m[:, 0, :4], l[:, 0, :4] = -numpy.inf, 0          # rows no part saw
        want = cupyflash.merge_attention_stacked(o, m, l)
        if stacked:
            got = cupyflash.merge_attention_stacked(*(cupy.asarray(x) for x in (o, m, l)))
        else:
            got = cupyflash.merge_attention([tuple(cupy.asarray(x[p]) for x in (o, m, l)) for p in range(parts)])
        err = max(float(numpy.abs(g.get().astype(numpy.float64) - w.astype(numpy.float64)).max()) for g, w in zip(got, want))
        cases += 1
        if not err <= SANITIZE_REL_ERR[tolerance] * 10:
            failures += 1
            print(f"FAIL merge {name} parts={parts} D={D} stacked={stacked}: error {err:.2e}", flush=True)
    print(f"{cases - failures} of {cases} cases within tolerance", flush=True)
    return failures


def kvcache_cases(rng, dtypes, head_dims) -> int:
    """flash_attention_with_kvcache (append, then attention) on contiguous and paged caches; the failures."""
    import cupy

    failures = cases = 0
    B, Hkv, G, N_max = 3, 2, 4, 96
    for (name, dtype, _, tolerance), D, page, n_new, splits in itertools.product(
            [v for v in VARIANTS if v[2] != "tf32" and (not dtypes or v[0] in dtypes)], head_dims, (None, 16, 48, 1),
            (1, 3), (None, 1)):
        q = rng.standard_normal((B, Hkv * G, n_new, D)).astype(dtype)
        new = [rng.standard_normal((B, Hkv, n_new, D)).astype(dtype) for _ in range(2)]
        lens = numpy.array([N_max - n_new, 0, 37], numpy.int32)
        shape = (B, Hkv, N_max, D) if page is None else (B * N_max // page, Hkv, page, D)
        caches = [rng.standard_normal(shape).astype(dtype) for _ in range(2)]
        table = None if page is None else rng.permutation(shape[0]).reshape(B, -1).astype(numpy.int32)
        want_caches = [c.copy() for c in caches]
        want = cupyflash.flash_attention_with_kvcache(q, *want_caches, lens, k=new[0], v=new[1], block_table=table)
        got_caches = [cupy.asarray(c) for c in caches]
        got = cupyflash.flash_attention_with_kvcache(cupy.asarray(q), *got_caches, cupy.asarray(lens),
                                                     k=cupy.asarray(new[0]), v=cupy.asarray(new[1]),
                                                     block_table=None if table is None else cupy.asarray(table),
                                                     num_splits=splits)
        err = max(float(numpy.abs(g.get().astype(numpy.float64) - w.astype(numpy.float64)).max()
                        / max(1.0, float(numpy.abs(w.astype(numpy.float64)).max())))
                  for g, w in zip(got, want))
        same = all(numpy.array_equal(g.get(), w) for g, w in zip(got_caches, want_caches))
        cases += 1
        if not (err <= SANITIZE_REL_ERR[tolerance] * 10 and same):
            failures += 1
            print(f"FAIL kvcache {name} D={D} page={page} new={n_new} splits={splits}: error {err:.2e}, "
                  f"caches {'equal' if same else 'differ'}", flush=True)
    print(f"{cases - failures} of {cases} cases within tolerance", flush=True)
    return failures


def fp8_cases(rng) -> int:
    """flash_attention_forward_fp8 on float8 e4m3 inputs; the failures. Against the NumPy path (exact float32):
    within P~'s rounding to float8, 2^-4 of max |v| (and o's own)."""
    import cupy

    failures = cases = 0
    E4M3 = ml_dtypes.float8_e4m3fn
    for D, (causal, window, poison), out_dtype in itertools.product((40, 128), MASKS.values(),
                                                                     ("float16", "bfloat16")):
        q, k, v = (rng.standard_normal(shape + (D,)).astype(E4M3) for shape in (Q_SHAPE, KV_SHAPE, KV_SHAPE))
        if poison:   # a NaN in v under the causal mask of the rows that do not see it
            v = v.view(numpy.uint8).copy()
            v[POISON["v"][:-1] + (min(POISON["v"][-1], D - 1),)] = 0x7F
            v = v.view(E4M3)
        kw = dict(causal=causal, window=window, v_descale=0.5, out_dtype=out_dtype)
        want = cupyflash.flash_attention_forward_fp8(q, k, v, **kw)
        got = cupyflash.flash_attention_forward_fp8(*(cupy.asarray(x.view(numpy.uint8)) for x in (q, k, v)), **kw)
        o, w = got[0].get().astype(numpy.float64), want[0].astype(numpy.float64)
        vmax = float(numpy.nanmax(numpy.abs(v.astype(numpy.float64)))) * 0.5
        same_nan = numpy.array_equal(numpy.isnan(o), numpy.isnan(w))
        err = float(numpy.nanmax(numpy.abs(o - w))) / vmax
        cases += 1
        if not (same_nan and err <= 2.0 ** -4 + 2.0 ** -7):
            failures += 1
            print(f"FAIL fp8 D={D} causal={causal} window={window} poison={poison} {out_dtype}: error {err:.2e} "
                  f"of max |v|, NaNs {'where' if same_nan else 'not where'} the NumPy path has them", flush=True)
    print(f"{cases - failures} of {cases} cases within tolerance", flush=True)
    return failures


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"head dims {QUICK_HEAD_DIMS} only")
    parser.add_argument("--head-dims", type=int, nargs="+", metavar="D",
                        help=f"these head dims instead (default {HEAD_DIMS}): racecheck, the slowest tool, "
                             "takes all of them in more than one 10-minute run")
    parser.add_argument("--dtypes", nargs="+", choices=[v[0] for v in VARIANTS], metavar="NAME",
                        help=f"these dtypes only (default all: {' '.join(v[0] for v in VARIANTS)})")
    parser.add_argument("--schedules", nargs="+", choices=SCHEDULES, metavar="NAME",
                        help=f"these schedules only (default all: {' '.join(SCHEDULES)}; v2 runs the Hopper kernels)")
    parser.add_argument("--masks", nargs="+", choices=list(MASKS), metavar="NAME",
                        help=f"these masks only (default all: {' '.join(MASKS)})")
    parser.add_argument("--mods", nargs="+", choices=list(MODS), default=["none"], metavar="NAME",
                        help=f"the modifier sets (default none; all: {' '.join(MODS['all'])})")
    parser.add_argument("--merge", action="store_true", help="merge_attention's kernel only")
    parser.add_argument("--kvcache", action="store_true", help="flash_attention_with_kvcache only")
    parser.add_argument("--fp8", action="store_true", help="flash_attention_forward_fp8 only")
    parser.add_argument("--splits", type=int, default=1, help="the forwards' num_splits (V2 schedules; default 1)")
    args = parser.parse_args(argv)
    if args.merge:
        return 1 if merge_cases(numpy.random.default_rng(0)) else 0
    if args.fp8:
        return 1 if fp8_cases(numpy.random.default_rng(0)) else 0
    head_dims = args.head_dims or (QUICK_HEAD_DIMS if args.quick else HEAD_DIMS)
    if any(not 1 <= d <= _tiles.MAX_HEAD_DIM for d in head_dims):
        parser.error(f"--head-dims must lie in 1..{_tiles.MAX_HEAD_DIM}, got {head_dims}")
    if args.kvcache:
        return 1 if kvcache_cases(numpy.random.default_rng(0), args.dtypes, head_dims) else 0
    rng = numpy.random.default_rng(0)
    failures = 0
    masks = [MASKS[name] for name in args.masks or MASKS]
    variants = [v for v in VARIANTS if not args.dtypes or v[0] in args.dtypes]
    cases = list(itertools.product(variants, head_dims, args.schedules or SCHEDULES, masks, args.mods))
    for (name, dtype, precision, tolerance), D, schedule, (causal, window, poison), mods in cases:
        err = run_case(dtype, precision, D, schedule, causal, window, poison, rng, MODS[mods], args.splits)
        ok = err <= SANITIZE_REL_ERR[tolerance]
        failures += not ok
        if not ok:
            print(f"FAIL {name} D={D} {schedule} causal={causal} window={window} poison={poison} mods={mods}: "
                  f"relative error {err:.2e}",
                  flush=True)
    print(f"{len(cases) - failures} of {len(cases)} cases within tolerance", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
