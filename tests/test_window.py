"""Sliding windows (``window=(left, right)``) on every path: the NumPy path and the validation on the
CPU, every GPU kernel (V1, V2, the Hopper forward and backwards) against the float64 reference.

With ``off = Nk - Nq``, query ``i`` sees key ``j`` iff ``i + off - left <= j <= i + off + right``
(a None side unbounded; ``causal=True`` caps the right side at 0). The kernels visit only the K/V
tiles inside the band, so the drawn problems put the band's edges at every place a tile can cut it.
"""

import numpy
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import cupyflash
from cupyflash import reference
from cupyflash._mask import MaskGeometry
from helpers import DTYPE_BY_NAME, assert_non_finite_rules, gpu_test, random_inputs, reproducible_backward, to_gpu
from strategies import attention_problem_shapes
from test_gpu import check_backward, check_forward
from tolerances import assert_close

# a side: unbounded, inside a tile, or across several tiles of any size the kernels use
SIDES = st.one_of(st.none(), st.integers(0, 3), st.integers(0, 400))
WINDOWS = st.tuples(SIDES, SIDES)


# ---------------------------------------------------------------------------
# CPU: the NumPy path, the checks, the kernels' mask fields


@settings(deadline=None, max_examples=40)
@given(attention_problem_shapes(), WINDOWS, st.integers(0, 2**32 - 1))
@example(("float64", (2, 4, 113, 256), (2, 1, 64, 256), False, 1.5), (None, None), 0)   # dk ~1e-12 off: rounding
@example(("float64", (3, 300, 64), (3, 200, 64), True, None), (17, 3), 1)
def test_numpy_path_takes_the_window(problem, window, seed):
    """The API's NumPy path (the blocked Algorithm 1, in float64 here: its rounding at other dtypes is
    test_reference's) equals the float64 reference under any window."""
    _, q_shape, kv_shape, causal, scale = problem
    dtype = "float64"
    rng = numpy.random.default_rng(seed)
    q, k, v = random_inputs(rng, dtype, q_shape, kv_shape)
    kw = dict(causal=causal, softmax_scale=scale, window=window)
    out = cupyflash.flash_attention_forward(q, k, v, **kw)
    refs = reference.attention_forward(q, k, v, **kw)
    do = rng.standard_normal(out[0].shape).astype(q.dtype)
    grads = cupyflash.flash_attention_backward(do, q, k, v, *out, **kw)
    ref_grads = reference.attention_backward(do, q, k, v, *refs, **kw)
    for name, got, ref in zip(("o", "m", "l", "dq", "dk", "dv"), (*out, *grads), (*refs, *ref_grads)):
        assert_float64_close(name, got, ref)


def assert_float64_close(name, got, ref):
    """float64 results equal to rounding: infinities alike, the rest within 1e-10 of the largest."""
    assert got.shape == ref.shape, name
    with numpy.errstate(invalid="ignore"):   # -inf - -inf where a row sees no key (equal: err 0)
        err = numpy.where(got == ref, 0.0, numpy.abs(got - ref))
    assert not numpy.isnan(err).any(), name
    assert err.max(initial=0) <= 1e-10 * (1 + numpy.abs(numpy.where(numpy.isfinite(ref), ref, 0)).max(initial=0)), name


def test_a_window_wider_than_the_problem_changes_nothing():
    """A side at least as long as the sequences bounds nothing: the same bits as no window."""
    rng = numpy.random.default_rng(0)
    q, k, v = random_inputs(rng, "float32", (2, 50, 16), (2, 70, 16))
    plain = cupyflash.flash_attention_forward(q, k, v, causal=True)
    wide = cupyflash.flash_attention_forward(q, k, v, causal=True, window=(10**12, 10**12))
    for a, b in zip(plain, wide):
        assert a.tobytes() == b.tobytes()


@pytest.mark.parametrize("window, error, words", [
    ((-1, 0), ValueError, "left side must be >= 0"),
    ((0, -3), ValueError, "right side must be >= 0"),
    ((1,), TypeError, "pair"),
    (5, TypeError, "pair"),
    ((1.5, 0), TypeError, "left side must be an int"),
    ((True, 0), TypeError, "left side must be an int"),
    (("1", None), TypeError, "left side must be an int"),
])
@pytest.mark.parametrize("call", ["forward", "backward", "flash_attention"])
def test_bad_windows_are_refused_naming_the_side(window, error, words, call):
    q = numpy.zeros((4, 8), numpy.float32)
    with pytest.raises(error, match=words):
        if call == "forward":
            cupyflash.flash_attention_forward(q, q, q, window=window)
        elif call == "flash_attention":
            cupyflash.flash_attention(q, q, q, window=window)
        else:
            m = numpy.zeros(4, numpy.float32)
            cupyflash.flash_attention_backward(q, q, q, q, q, m, m, window=window)


@given(st.integers(0, 300), st.integers(0, 300), st.booleans(), WINDOWS)
def test_kernel_fields_are_the_geometry_as_a_band(n_q, n_k, causal, window):
    """The kernels' Mask fields (Nq, Nk, lo, hi): query i sees key j iff lo <= j - i <= hi and j < Nk,
    with -Nq <= lo <= hi <= Nk (int32 whatever the window's sides); mask.cuh's key_start and key_stop
    (i + lo and i + hi + 1, clipped to [0, Nk]) give every row the geometry's keys; banded() is
    whether the problem has a masked pair."""
    geometry = MaskGeometry(n_q, n_k, causal, *window)
    Nq, Nk, lo, hi = geometry.kernel_fields()
    assert (Nq, Nk) == (n_q, n_k) and -n_q <= lo <= hi <= n_k
    rows, keys = numpy.arange(n_q)[:, None], numpy.arange(n_k)[None, :]
    band = (keys - rows >= lo) & (keys - rows <= hi)
    assert (band == geometry.visible(rows[:, 0], keys[0])).all()
    start, stop = numpy.clip(rows + lo, 0, Nk), numpy.clip(rows + hi + 1, 0, Nk)
    assert (((keys >= start) & (keys < stop)) == band).all()
    if n_q and n_k:   # (the GPU is not called with no query or no key)
        assert (lo > 1 - Nq or hi < Nk - 1) == geometry.has_masked_pairs(0, 0, n_k)


# ---------------------------------------------------------------------------
# GPU: every kernel against the reference

SCHEDULES = pytest.mark.parametrize("gpu_schedule", ["v1", "v2", "v2-mma"], indirect=True)
GPU_SETTINGS = settings(deadline=None, max_examples=40,
                        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


@gpu_test
@SCHEDULES
@GPU_SETTINGS
@given(attention_problem_shapes(), WINDOWS, st.integers(0, 2**32 - 1))
@example(("float16", (2, 4, 1023, 128), (2, 1, 1023, 128), False, None), (100, 0), 0)
@example(("bfloat16", (2, 3, 700, 64), (2, 1, 900, 64), True, None), (257, None), 1)   # off = 200
@example(("float16", (2, 2, 900, 96), (2, 2, 600, 96), False, None), (37, 5), 2)        # off = -300
@example(("float16", (1, 2, 513, 200), (1, 2, 513, 200), False, None), (0, 0), 3)       # one key per row
@example(("float32", (3, 300, 64), (3, 300, 64), False, 0.5), (None, 70), 4)
@example(("float64", (2, 250, 40), (2, 330, 40), True, None), (3, 1), 5)
@example(("float16", (4, 129, 64), (4, 1000, 64), False, None), (0, None), 6)          # rows see the end only
def test_forward_with_a_window_matches_reference(gpu_schedule, problem, window, seed):
    dtype, q_shape, kv_shape, causal, scale = problem
    q, k, v = random_inputs(numpy.random.default_rng(seed), dtype, q_shape, kv_shape)
    check_forward(dtype, q, k, v, causal, scale, gpu_schedule, window)


@gpu_test
@SCHEDULES
@GPU_SETTINGS
@given(attention_problem_shapes(), WINDOWS, st.integers(0, 2**32 - 1), st.booleans())
@example(("float16", (2, 4, 1023, 128), (2, 1, 1023, 128), False, None), (100, 0), 0, False)
@example(("bfloat16", (2, 3, 700, 64), (2, 1, 900, 64), True, None), (257, None), 1, True)
@example(("float16", (2, 2, 900, 96), (2, 2, 600, 96), False, None), (37, 5), 2, True)
@example(("bfloat16", (1, 2, 513, 200), (1, 2, 513, 200), False, None), (300, 20), 3, True)   # the wide backward
@example(("float32", (3, 300, 64), (3, 300, 64), False, 0.5), (None, 70), 4, False)
@example(("float64", (2, 250, 40), (2, 330, 40), True, None), (3, 1), 5, True)
@example(("float16", (4, 129, 64), (4, 1000, 64), False, None), (0, None), 6, True)   # keys that no row sees
def test_backward_with_a_window_matches_reference(gpu_schedule, problem, window, seed, deterministic):
    dtype, q_shape, kv_shape, causal, scale = problem
    rng = numpy.random.default_rng(seed)
    q, k, v = random_inputs(rng, dtype, q_shape, kv_shape)
    check_backward(dtype, q, k, v, causal, scale, rng, gpu_schedule, window, deterministic)


@gpu_test
@pytest.mark.parametrize("schedule", ["v1", "v2"])
@pytest.mark.parametrize("dtype, D", [("float16", 64), ("bfloat16", 128), ("float16", 200), ("float32", 64),
                                      ("float64", 40)])
@pytest.mark.parametrize("window, causal", [((300, None), False), ((130, 0), True), ((None, 90), False)])
def test_deterministic_backward_with_a_window_is_bitwise_reproducible(schedule, dtype, D, window, causal):
    """deterministic=True under a window: the adds into dQ_i are numbered from the first K/V tile that
    Q tile i sees (not from tile 0), so every run gives the same bits and none waits forever."""
    import cupy

    rng = numpy.random.default_rng(21)
    q, k, v = (cupy.asarray(rng.standard_normal(s).astype(DTYPE_BY_NAME[dtype]))
               for s in ((2, 3, 700, D), (2, 1, 1000, D), (1, 3, 1000, D)))
    kw = dict(causal=causal, window=window, schedule=schedule)
    do = cupy.asarray(rng.standard_normal(q.shape).astype(DTYPE_BY_NAME[dtype]))
    grads = reproducible_backward(q, k, v, do, **kw)
    refs = reference.attention_backward(*(x.get() for x in (do, q, k, v)),
                                        *reference.attention_forward(q.get(), k.get(), v.get(), causal=causal,
                                                                     window=window),
                                        causal=causal, window=window)
    for name, got, ref in zip(("dq", "dk", "dv"), grads, refs):
        assert_close(name, got.get(), ref, dtype)


@gpu_test
@pytest.mark.parametrize("schedule", ["v1", "v2", "v2-mma"])
@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("case", ["q", "k", "v", "do"])
@pytest.mark.parametrize("window, causal", [((30, None), False), ((50, 10), True)])
@pytest.mark.parametrize("head_dim", [64, 200])
def test_non_finite_inputs_under_a_window_reach_the_outputs_the_reference_says(schedule, dtype, case, window,
                                                                              causal, head_dim, monkeypatch):
    """The mask-exact rules with the window's left edge cutting tiles too: an inf or NaN beyond a row's
    window reaches none of its outputs."""
    from cupyflash import _launch

    monkeypatch.setattr(_launch, "USE_WGMMA", schedule != "v2-mma")
    assert_non_finite_rules(dtype, causal, case, to_gpu, head_dim, window=window, schedule=schedule.split("-")[0])
