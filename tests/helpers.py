"""Test helpers: GPU detection, a poisoned memory pool, error measures and tolerances."""

import ml_dtypes
import numpy
import pytest

# The four dtypes the API takes
FLOAT16 = numpy.dtype(numpy.float16)
BFLOAT16 = numpy.dtype(ml_dtypes.bfloat16)
FLOAT32 = numpy.dtype(numpy.float32)
FLOAT64 = numpy.dtype(numpy.float64)
FLOAT_DTYPES = (FLOAT16, BFLOAT16, FLOAT32, FLOAT64)
DTYPE_BY_NAME = {dt.name: dt for dt in FLOAT_DTYPES}


def _gpu_available() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no cupy, no driver, no device: all mean "no GPU here"
        return False


HAVE_GPU = _gpu_available()
requires_gpu = pytest.mark.skipif(not HAVE_GPU, reason="needs a CUDA GPU")

POISON_BYTES = 256 << 20


def random_inputs(rng, dtype, q_shape, kv_shape, spread=1.0):
    """q, k, v (NumPy) of standard-normal values times ``spread``; ``dtype`` a dtype or its name."""
    cast = DTYPE_BY_NAME.get(dtype, dtype)
    return [(spread * rng.standard_normal(s)).astype(cast) for s in (q_shape, kv_shape, kv_shape)]


def to_gpu(*arrays):
    import cupy

    return [cupy.asarray(a) for a in arrays]


def poison_pool():
    """Leave NaN in CuPy's memory pool, so that an output element a kernel forgets to write fails the test."""
    import cupy

    pool = cupy.get_default_memory_pool()
    pool.free_all_blocks()
    junk = cupy.full(POISON_BYTES // 4, cupy.nan, dtype=cupy.float32)
    del junk  # the NaN-filled block returns to the pool and is carved up by the next allocations


def rel_err(got, ref) -> float:
    """Relative Frobenius error ||got - ref|| / ||ref|| over finite entries; inf if the non-finite entries differ."""
    got = numpy.asarray(got, dtype=numpy.float64)
    ref = numpy.asarray(ref, dtype=numpy.float64)
    assert got.shape == ref.shape, (got.shape, ref.shape)
    finite = numpy.isfinite(ref)
    if not numpy.array_equal(numpy.isfinite(got), finite) or not numpy.array_equal(got[~finite], ref[~finite]):
        return numpy.inf
    denom = numpy.linalg.norm(ref[finite])
    diff = numpy.linalg.norm(got[finite] - ref[finite])
    return float(diff / denom) if denom > 0 else float(diff)


# Ceilings on the relative error against float64 (issue #2): unless the naive
# same-precision attention is itself worse, no output may exceed these.
FWD_CEILING = {"float16": 2e-3, "bfloat16": 1.5e-2, "float32": 1e-5, "float64": 1e-10}
BWD_CEILING = {"float16": 5e-3, "bfloat16": 3e-2, "float32": 1e-4, "float64": 1e-9}
M_CEILING = {"float16": 1e-5, "bfloat16": 1e-5, "float32": 1e-5, "float64": 1e-10}
L_CEILING = {"float16": 1e-3, "bfloat16": 1e-3, "float32": 1e-5, "float64": 1e-10}
# Where both errors sit at the accumulator's rounding level, "twice naive" is
# noise: allow a few units of roundoff of the accumulator on top of it.
ROUNDOFF_SLACK = {"float16": 16 * 2.0**-24, "bfloat16": 16 * 2.0**-24, "float32": 16 * 2.0**-24,
                  "float64": 16 * 2.0**-53}


def assert_twice_naive(name, got, ref, naive, dtype_name, ceilings):
    """FlashAttention's rule: error at most twice a naive same-precision attention's, and under the ceiling.

    For float64 the naive same-precision attention *is* the float64 reference
    (its error is 0), so only the ceiling applies.
    """
    err, base = rel_err(got, ref), rel_err(naive, ref)
    if dtype_name != "float64":
        assert err <= 2 * base + ROUNDOFF_SLACK[dtype_name], f"{name}: error {err:.3e} > 2 x naive {base:.3e}"
    assert err <= max(ceilings[dtype_name], base), f"{name}: error {err:.3e} over ceiling {ceilings[dtype_name]:.0e}"


# unit roundoff of each input dtype (the precision a 16-bit product is rounded to)
UNIT_ROUNDOFF = {"float16": 2.0**-11, "bfloat16": 2.0**-8, "float32": 2.0**-24, "float64": 2.0**-53}
ZERO_NOISE_ULPS = 16
EXACTLY_ZERO = 2.0**-26   # ||ref|| below this fraction of its terms: zero in exact arithmetic


def _softmax_rows(q, k, causal, scale):
    """P (float64) of the reference semantics; rows that see no key are 0."""
    S = scale * (q @ numpy.swapaxes(k, -1, -2))
    Nq, Nk = S.shape[-2:]
    if causal:
        visible = numpy.arange(Nk)[None, :] <= numpy.arange(Nq)[:, None] + (Nk - Nq)
        S = numpy.where(visible, S, -numpy.inf)
    m = S.max(axis=-1, keepdims=True)
    P = numpy.exp(S - numpy.where(numpy.isfinite(m), m, 0))
    denom = P.sum(axis=-1, keepdims=True)
    return P / numpy.where(denom > 0, denom, 1)


def gradient_magnitudes(do, q, k, v, causal, scale):
    """||dq||, ||dk||, ||dv|| computed from the absolute values of their terms (no cancellation)."""
    do, q, k, v = (numpy.asarray(x, numpy.float64) for x in (do, q, k, v))
    P = _softmax_rows(q, k, causal, scale)
    o = P @ v
    dS_bound = P * (numpy.abs(do) @ numpy.swapaxes(numpy.abs(v), -1, -2)
                    + numpy.abs((do * o).sum(-1, keepdims=True)))
    mags = (scale * dS_bound @ numpy.abs(k), scale * numpy.swapaxes(dS_bound, -1, -2) @ numpy.abs(q),
            numpy.swapaxes(P, -1, -2) @ numpy.abs(do))
    return [float(numpy.linalg.norm(m)) for m in mags]


def assert_gradient(name, got, ref, naive, magnitude, dtype_name):
    """The twice-naive rule for a gradient; one that is zero in exact arithmetic must be rounding noise.

    With one visible key per row (Nk = 1, say) the softmax is constant and dq, dk
    vanish identically: their relative error is noise over noise, so they are held
    to ZERO_NOISE_ULPS units of roundoff of their terms' size instead.
    """
    ref64 = numpy.asarray(ref, numpy.float64)
    if numpy.linalg.norm(ref64) <= EXACTLY_ZERO * magnitude:
        err = float(numpy.linalg.norm(numpy.asarray(got, numpy.float64) - ref64))
        bound = ZERO_NOISE_ULPS * UNIT_ROUNDOFF[dtype_name] * magnitude
        assert err <= bound, f"{name}: vanishing gradient off by {err:.3e} > {bound:.3e}"
        return
    assert_twice_naive(name, got, ref, naive, dtype_name, BWD_CEILING)


def assert_under(name, got, ref, ceiling):
    err = rel_err(got, ref)
    assert err <= ceiling, f"{name}: error {err:.3e} > {ceiling:.0e}"


# Non-finite inputs (README, Semantics): planted values, and the check of an output against the reference.
# Where both are finite: within this much of the largest finite reference value.
NON_FINITE_RTOL = {"float16": 2e-2, "bfloat16": 6e-2, "float32": 1e-4, "float64": 1e-9}


# Batch shapes (q, k and v) of the poisoned inputs: every head its own, k and v shared by the two
# query heads of a batch entry (GQA), q shared by the two batch entries
POISON_LAYOUTS = {"own": ((2, 2), (2, 2)), "kv_shared": ((2, 2), (2, 1)), "q_shared": ((1, 2), (2, 2))}


def poisoned_inputs(rng, dtype, case, head_dim=64, layout="own"):
    """q (..., 300, D), k, v (..., 260, D) of ``POISON_LAYOUTS[layout]``, do (2, 2, 300, D), with inf/NaN
    planted in ``case`` (one of them).

    Causal, rows 0-39 see no key, and every planted value lies in a diagonal tile (any tile size the
    kernels use), where rows of the same tile see its key or query while others do not.
    """
    q_batch, kv_batch = POISON_LAYOUTS[layout]
    q, k, v = random_inputs(rng, dtype, (*q_batch, 300, head_dim), (*kv_batch, 260, head_dim))
    do = rng.standard_normal((2, 2, 300, head_dim)).astype(q.dtype)
    x = {"q": q, "k": k, "v": v, "do": do}[case]
    planted = {"q": (((0, 1, 100, 5), numpy.nan), ((1, 0, 7, 0), numpy.inf)),   # row 7 sees no key when causal
               "k": (((1, 0, 200, 7), numpy.inf),   # +inf scores (NaN rows) where q_i7 > 0, ignored where < 0
                     ((0, 1, 3, 9), numpy.nan)),
               "v": (((0, 0, 150, 3), numpy.nan), ((1, 1, 20, 9), -numpy.inf)),
               "do": (((0, 1, 120, 4), numpy.nan), ((1, 0, 250, head_dim - 1), numpy.inf))}[case]
    for index, value in planted:   # a shared dim has one entry: the value lands there
        x[tuple(min(i, n - 1) for i, n in zip(index, x.shape))] = value
    return q, k, v, do


def _on_host(x):
    return (x.get() if hasattr(x, "get") else x).astype(numpy.float64)


def assert_non_finite_like(name, got, ref, dtype):
    """got is non-finite exactly where the reference is, and close where both are finite."""
    got, ref = _on_host(got), numpy.asarray(ref, numpy.float64)
    bad, ref_bad = ~numpy.isfinite(got), ~numpy.isfinite(ref)
    assert (bad | ~ref_bad).all(), f"{name}: finite where the reference is not"
    assert numpy.array_equal(bad, ref_bad), f"{name}: {int((bad & ~ref_bad).sum())} extra non-finite"
    both = ~bad & ~ref_bad
    scale = max(numpy.abs(ref[both]).max(initial=0), 1e-30)
    assert numpy.abs(got[both] - ref[both]).max(initial=0) <= NON_FINITE_RTOL[dtype] * scale, name


def assert_non_finite_rules(dtype, causal, case, to_device=lambda *arrays: arrays, head_dim=64, layout="own",
                            **options):
    """Forward and backward of ``poisoned_inputs`` (arrays through ``to_device``, calls with ``options``)
    against the mask-exact reference: o, m, l and the gradients non-finite exactly where its are, and
    close where both are finite; rows 0-39, which see no key when causal, empty (o = 0, m = -inf, l = 0,
    dq = 0). ``case`` "do" poisons only the backward's input."""
    from cupyflash import flash_attention_backward, flash_attention_forward, reference

    rng = numpy.random.default_rng(13)
    q, k, v, do = poisoned_inputs(rng, dtype, case, head_dim, layout)
    out = flash_attention_forward(*to_device(q, k, v), causal=causal, **options)
    refs = reference.attention_forward(q, k, v, causal=causal)
    for name, got, ref in zip("oml", out, refs):
        assert_non_finite_like(name, got, ref, dtype)
    grads = flash_attention_backward(*to_device(do, q, k, v), *out, causal=causal, **options)
    ref_grads = reference.attention_backward(do, q, k, v, *refs, causal=causal)
    for name, got, ref in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert_non_finite_like(name, got, ref, dtype)
    if causal:
        o, m, l, dq = (_on_host(x) for x in (*out, grads[0]))
        assert not o[..., :40, :].any() and (m[..., :40] == -numpy.inf).all() and not l[..., :40].any()
        assert not dq[..., :40, :].any()
