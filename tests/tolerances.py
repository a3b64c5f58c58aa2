"""Every tolerance of the test suite, each tied to a precision, and the assertions that apply them.

The rule for the kernels is FlashAttention's: an output's relative Frobenius error against the
float64 reference may be at most twice that of a naive attention computed in the same precision
(``tests/yardsticks.py``: ``naive_same_precision_forward`` / ``_backward``), and must also stay under a fixed
ceiling of its precision (``assert_twice_naive``; gradients through ``assert_gradient``). The
other tolerances are for comparisons that have no naive twin: per-element bounds on the GPU
reliability tests and the fuzzer, two summation orders, strided against contiguous inputs, and
outputs next to planted inf/NaN.

A precision is named by its dtype name ("float16", "bfloat16", "float32", "float64"); every table
here is a ``PerPrecision``, which also takes a NumPy dtype or scalar type as its key.

Two precisions matter for each dtype: the *input* precision, to which q, k, v, the outputs and
the 16-bit tensor-core operands are rounded (``UNIT_ROUNDOFF``), and the *accumulator*
precision, in which scores, softmax statistics and sums are kept: float32 for every dtype but
float64 (``ACCUMULATOR_ROUNDOFF``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy


def precision(dtype) -> str:
    """The name of a precision: ``dtype`` itself when it is a string, else its NumPy dtype's name."""
    return dtype if isinstance(dtype, str) else numpy.dtype(dtype).name


class PerPrecision(Mapping):
    """A read-only table keyed by precision; looked up by dtype name, NumPy dtype or scalar type."""

    def __init__(self, **values):
        self._values = values

    def __getitem__(self, dtype):
        return self._values[precision(dtype)]

    def __iter__(self):
        return iter(self._values)

    def __len__(self):
        return len(self._values)

    def __repr__(self):
        return f"PerPrecision({self._values})"


# ---------------------------------------------------------------------------
# Roundoff of each precision

# Unit roundoff 2^-(mantissa bits + 1) of the input dtype
UNIT_ROUNDOFF = PerPrecision(float16=2.0**-11, bfloat16=2.0**-8, float32=2.0**-24, float64=2.0**-53)
# Unit roundoff of the accumulator: float32 for 16- and 32-bit inputs, float64 for float64
ACCUMULATOR_ROUNDOFF = PerPrecision(float16=2.0**-24, bfloat16=2.0**-24, float32=2.0**-24, float64=2.0**-53)
# Half the smallest subnormal: the absolute error of rounding a tiny value to each dtype
# (2^-1075 itself underflows to 0 in float64)
HALF_SMALLEST_SUBNORMAL = PerPrecision(float16=2.0**-25, bfloat16=2.0**-134, float32=2.0**-150, float64=0.0)


# ---------------------------------------------------------------------------
# FlashAttention's rule: at most twice a same-precision naive attention's error, under fixed ceilings

# Ceilings on the relative error against float64: unless the naive same-precision attention is
# itself worse, no output may exceed these.
FWD_CEILING = PerPrecision(float16=2e-3, bfloat16=1.5e-2, float32=1e-5, float64=1e-10)     # o
BWD_CEILING = PerPrecision(float16=5e-3, bfloat16=3e-2, float32=1e-4, float64=1e-9)        # dq, dk, dv
M_CEILING = PerPrecision(float16=1e-5, bfloat16=1e-5, float32=1e-5, float64=1e-10)         # m (accumulator)
L_CEILING = PerPrecision(float16=1e-3, bfloat16=1e-3, float32=1e-5, float64=1e-10)         # l (accumulator)
# Where both errors sit at the accumulator's rounding level, "twice naive" is noise: allow this
# many units of the accumulator's roundoff on top of it.
ROUNDOFF_SLACK_UNITS = 16
ROUNDOFF_SLACK = PerPrecision(**{p: ROUNDOFF_SLACK_UNITS * u for p, u in ACCUMULATOR_ROUNDOFF.items()})
# A gradient that vanishes in exact arithmetic (one visible key per row makes dq, dk zero) is held
# to this many units of the input roundoff of its terms' size, instead of a relative error
ZERO_NOISE_ULPS = 16
EXACTLY_ZERO = 2.0**-26   # ||ref|| below this fraction of its terms' size: zero in exact arithmetic

# The kernels against the CPU path on one float32 problem (both accumulate in float32)
GPU_AGAINST_NUMPY_FLOAT32 = {"o": 1e-5, "m": 1e-6, "l": 1e-5}


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


def assert_twice_naive(name, got, ref, naive, dtype, ceilings, slack_units=1.0, inherited=0.0):
    """FlashAttention's rule: error at most twice a naive same-precision attention's, and under the ceiling.

    For float64 the naive same-precision attention *is* the float64 reference
    (its error is 0), so only the ceiling applies. ``slack_units`` scales ROUNDOFF_SLACK;
    ``inherited``, an error the inputs carry in exact arithmetic, is added to both bounds.
    """
    dtype = precision(dtype)
    err, base = rel_err(got, ref), rel_err(naive, ref)
    if dtype != "float64":
        bound = 2 * base + slack_units * ROUNDOFF_SLACK[dtype] + inherited
        assert err <= bound, f"{name}: error {err:.3e} > 2 x naive {base:.3e} + inherited {inherited:.3e}"
    bound = max(ceilings[dtype], base) + inherited
    assert err <= bound, f"{name}: error {err:.3e} over ceiling {ceilings[dtype]:.0e} + inherited {inherited:.3e}"


def row_max_slack(m_ref, q, k, scale, dtype, bias=None, alibi_slopes=None, **_) -> float:
    """The rounding of the row maxima ``m`` as ``assert_twice_naive``'s ``inherited`` (relative, over the
    finite entries): each m_i is one score, whose rounding is the accumulator's unit roundoff of its
    largest term (``scale |q_i| |k_j|``, Cauchy-Schwarz over every pair, plus the largest bias and ALiBi
    offset), however small the terms' sum (a lone key nearly orthogonal to its query)."""
    finite = numpy.isfinite(m_ref)
    norm = numpy.linalg.norm(m_ref[finite])
    if not finite.any() or norm == 0:
        return 0.0
    f64 = (lambda x: numpy.asarray(x, dtype=numpy.float64))
    term = scale * numpy.linalg.norm(f64(q), axis=-1).max() * numpy.linalg.norm(f64(k), axis=-1).max()
    if bias is not None:
        term += numpy.abs(f64(bias)).max(initial=0.0)
    if alibi_slopes is not None:
        term += numpy.abs(f64(alibi_slopes)).max(initial=0.0) * max(q.shape[-2], k.shape[-2])
    return float(ACCUMULATOR_ROUNDOFF[precision(dtype)] * term * math.sqrt(finite.sum()) / norm)


def _visible(Nq, Nk, causal, window):
    """Which pairs the causal mask and the window leave visible, (Nq, Nk); None: all."""
    from cupyflash.reference import _visibility

    return _visibility(Nq, Nk, causal, window, None)


def _final_scores(q, k, causal, scale, window=None, **mods):
    """The final scores (float64) of the reference semantics (score modifiers ``mods``: softcap,
    alibi_slopes), -inf where hidden."""
    from cupyflash.reference import _Scores

    q, k = (numpy.asarray(x, numpy.float64) for x in (q, k))
    return _Scores(q, k, scale, causal=causal, window=window, softcap=mods.get("softcap"),
                   alibi_slopes=mods.get("alibi_slopes"), bias=mods.get("bias"), mask=mods.get("mask")).S


def _softmax_rows(q, k, causal, scale, window=None, **mods):
    """P (float64) of the reference semantics; rows that see no key are 0."""
    S = _final_scores(q, k, causal, scale, window, **mods)
    m = S.max(axis=-1, keepdims=True)
    P = numpy.exp(S - numpy.where(numpy.isfinite(m), m, 0))
    denom = P.sum(axis=-1, keepdims=True)
    return P / numpy.where(denom > 0, denom, 1)


def gradient_magnitudes(do, q, k, v, causal, scale, window=None, **mods):
    """||dq||, ||dk||, ||dv|| computed from the absolute values of their terms (no cancellation; the
    softcap's factor 1 - tanh^2 <= 1 is bounded by 1)."""
    do, q, k, v = (numpy.asarray(x, numpy.float64) for x in (do, q, k, v))
    P = _softmax_rows(q, k, causal, scale, window, **mods)
    o = P @ v
    dS_bound = P * (numpy.abs(do) @ numpy.swapaxes(numpy.abs(v), -1, -2)
                    + numpy.abs((do * o).sum(-1, keepdims=True)))
    mags = (scale * dS_bound @ numpy.abs(k), scale * numpy.swapaxes(dS_bound, -1, -2) @ numpy.abs(q),
            numpy.swapaxes(P, -1, -2) @ numpy.abs(do))
    return [float(numpy.linalg.norm(m)) for m in mags]


def largest_logit(q, k, causal, scale, window=None, **mods) -> float:
    """max |s| of the final scores (scale q_i . k_j, modified by ``mods``) over the visible pairs (0
    where there are none)."""
    S = numpy.abs(_final_scores(q, k, causal, scale, window, **mods))
    return float(numpy.where(numpy.isfinite(S), S, 0.0).max(initial=0.0))


def assert_gradient(name, got, ref, naive, magnitude, dtype, logit=0.0, inherited=0.0):
    """The twice-naive rule for a gradient; one that is zero in exact arithmetic must be rounding noise.

    With one visible key per row (Nk = 1, say) the softmax is constant and dq, dk
    vanish identically: their relative error is noise over noise, so they are held
    to ZERO_NOISE_ULPS units of roundoff of their terms' size instead.

    The backward recomputes P = exp(s - lse) from the saved statistics (the seed's backward), so
    P carries the rounding of a score s recomputed in another order than the forward's, |s| units of
    roundoff, where the naive attention, which forms P once, has none (a row with one visible key
    gets P = 1 exactly): the slack is scaled by ``logit``, the largest |s| (``largest_logit``).

    The backward takes O as stored, rounded to the input dtype, into D_i = rowsum(dO o O_i) (the
    seed's backward); where dS_ij = P_ij (dP_ij - D_i) nearly cancels (one key takes almost all of a
    row beside a sink) that rounding alone moves the exact gradient: ``inherited``, the relative error of
    the float64 backward given the rounded O (``stored_output_error``), is added to the bounds.
    """
    ref64 = numpy.asarray(ref, numpy.float64)
    if numpy.linalg.norm(ref64) <= EXACTLY_ZERO * magnitude:
        err = float(numpy.linalg.norm(numpy.asarray(got, numpy.float64) - ref64))
        bound = ZERO_NOISE_ULPS * UNIT_ROUNDOFF[dtype] * magnitude
        assert err <= bound, f"{name}: vanishing gradient off by {err:.3e} > {bound:.3e}"
        return
    assert_twice_naive(name, got, ref, naive, dtype, BWD_CEILING, slack_units=max(1.0, logit), inherited=inherited)


def stored_output_error(do, q, k, v, refs, dtype, **kw) -> list[float]:
    """The relative error of each float64 gradient of ``reference.attention_backward`` (keywords ``kw``)
    when it is given o rounded to ``dtype`` instead of the exact o (``refs`` = o, m, l, dq, dk, dv)."""
    from cupyflash import reference

    o, m, l, *grads = refs
    stored = numpy.asarray(o, dtype).astype(numpy.float64)
    return [rel_err(g, ref) for g, ref in zip(reference.attention_backward(do, q, k, v, stored, m, l, **kw), grads)]


def assert_under(name, got, ref, ceiling):
    """Relative Frobenius error (``rel_err``) at most ``ceiling``."""
    err = rel_err(got, ref)
    assert err <= ceiling, f"{name}: error {err:.3e} > {ceiling:.0e}"


# ---------------------------------------------------------------------------
# Per-element bounds, for comparisons without a naive twin

# |got - ref| <= ELEMENT_TOL * (1 + |ref|) per element, for inputs already in the dtype (the
# reference sees the same rounded values): the kernels accumulate in float32 (float64 for float64)
ELEMENT_TOL = PerPrecision(float16=4e-3, bfloat16=3e-2, float32=2e-5, float64=1e-12)


def assert_close(name, got, ref, dtype):
    """Every element within ``ELEMENT_TOL[dtype] * (1 + |ref|)``; infinities must be equal, no NaN."""
    got = numpy.asarray(got, numpy.float64)
    ref = numpy.asarray(ref, numpy.float64)
    assert got.shape == ref.shape, name
    same_inf = numpy.isinf(ref) & (got == ref)
    err = numpy.where(same_inf, 0.0, numpy.abs(got - ref) / (1 + numpy.abs(ref)))
    tol = ELEMENT_TOL[dtype]
    assert not numpy.isnan(err).any() and err.max(initial=0) <= tol, f"{name}: {err.max(initial=0):.2e}"


def fuzz_tolerance(q, k, scale, dtype):
    """Per-element bound for o, m, l of a fuzzed call: output rounding plus the accumulator's rounding
    of scores as large as |scale| max|q| max|k| D (drawn scales reach 100)."""
    D = q.shape[-1]
    scale = 1 / math.sqrt(D) if scale is None else abs(float(scale))
    logits = scale * float(numpy.abs(q).max(initial=0)) * float(numpy.abs(k).max(initial=0)) * D
    return 4 * UNIT_ROUNDOFF[dtype] + 8 * D * ACCUMULATOR_ROUNDOFF[dtype] * (1 + logits)


# The gradients of two summation orders (deterministic against atomic): max |a - b| within this
# fraction of max |b|, a rounding of the output dtype (the accumulator's for 32/64-bit)
ORDER_RTOL = PerPrecision(float16=2.0**-9, bfloat16=2.0**-6, float32=1e-5, float64=1e-13)

# Strided and contiguous inputs may take different BLAS paths on the CPU: a rounding apart in the
# output dtype (used as rtol and atol of numpy.testing.assert_allclose)
VIEW_RTOL = PerPrecision(float16=2e-3, bfloat16=1.6e-2, float32=1e-5, float64=1e-12)


# ---------------------------------------------------------------------------
# Outputs next to planted inf/NaN (docs/semantics.md, Non-finite values)

# Where both are finite: within this fraction of the largest finite reference value
NON_FINITE_RTOL = PerPrecision(float16=2e-2, bfloat16=6e-2, float32=1e-4, float64=1e-9)


# tests/gpu/sanitize.py: the relative Frobenius error over finite entries of each of its small
# cases (q (1, 2, 2, 70, D) against k, v (1, 2, 1, 200, D), some with a NaN planted)
SANITIZE_REL_ERR = PerPrecision(float16=2e-2, bfloat16=6e-2, float32=1e-4, float64=1e-9)


def on_host(x):
    """``x`` (NumPy or CuPy) as a float64 NumPy array."""
    return (x.get() if hasattr(x, "get") else x).astype(numpy.float64)


def assert_non_finite_like(name, got, ref, dtype):
    """got is non-finite exactly where the reference is, and close where both are finite."""
    got, ref = on_host(got), numpy.asarray(ref, numpy.float64)
    bad, ref_bad = ~numpy.isfinite(got), ~numpy.isfinite(ref)
    assert (bad | ~ref_bad).all(), f"{name}: finite where the reference is not"
    assert numpy.array_equal(bad, ref_bad), f"{name}: {int((bad & ~ref_bad).sum())} extra non-finite"
    both = ~bad & ~ref_bad
    scale = max(numpy.abs(ref[both]).max(initial=0), 1e-30)
    assert numpy.abs(got[both] - ref[both]).max(initial=0) <= NON_FINITE_RTOL[dtype] * scale, name


# ---------------------------------------------------------------------------
# The NumPy references' own error scales (tests/test_reference.py)

ERROR_UNITS = 4   # allowed error, in error scales (observed errors stay below 1)
FINITE_DIFFERENCE_TOLERANCE = 1e-6   # relative, of the float64 backward against central differences
