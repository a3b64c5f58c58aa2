"""CPU tests of cupyflash.reference (no CuPy needed).

The naive float64 attention is checked against finite differences and a
directly computed logsumexp; the blocked V1 loops and the same-precision
naive attention are then checked against it, on ragged lengths, broadcast
batch shapes (GQA, MQA, rank 2), causal masks with Nq != Nk, and small tiles.

Rounding errors are measured against error scales (see `error_scales`): each
output's size without cancellation, times the unit roundoff of the precision
that rounds it. A test passes when the error is within ERROR_UNITS of that
scale; an algorithmic slip (a lost key, a wrong alpha) is orders larger.
"""

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cupyflash.reference import attention_backward, attention_forward, blocked_backward, blocked_forward
from helpers import BFLOAT16, FLOAT16, FLOAT32, FLOAT64, FLOAT_DTYPES
from strategies import attention_problems
from tolerances import ERROR_UNITS, FINITE_DIFFERENCE_TOLERANCE, HALF_SMALLEST_SUBNORMAL, UNIT_ROUNDOFF
from yardsticks import naive_same_precision_backward, naive_same_precision_forward

# A NaN made by -inf - (-inf) or 0 / 0 would raise a RuntimeWarning: make it fail the test.
pytestmark = pytest.mark.filterwarnings("error")


FINITE_DIFFERENCE_STEP = 1e-6
LARGE_INPUT_GAIN = 20.0
LARGE_SOFTMAX_SCALE = 30.0


def accumulator_dtype(dtype):
    """The dtype the blocked loops compute in: float64 for float64, float32 otherwise."""
    return FLOAT64 if dtype == FLOAT64 else FLOAT32


# ---------------------------------------------------------------------------
# Error scales
# ---------------------------------------------------------------------------

def batched(problem):
    """q, k, v, dO in float64 with q broadcast to the full batch: (*batch, Nq, D), ..."""
    q, k, v, do = (x.astype(FLOAT64) for x in (problem.q, problem.k, problem.v, problem.do))
    return np.broadcast_to(q, (*do.shape[:-2], *q.shape[-2:])), k, v, do


def scores(problem):
    """S = scale q k^T in float64, (*batch, Nq, Nk), -inf where the key is hidden; computed from scratch."""
    q, k, _, _ = batched(problem)
    n_q, n_k = q.shape[-2], k.shape[-2]
    S = problem.scale * np.einsum("...id,...jd->...ij", q, k)
    hidden = np.arange(n_k)[None, :] > np.arange(n_q)[:, None] + (n_k - n_q)
    return np.where(problem.causal & hidden, -np.inf, S)


def sum_to_shape(x, shape):
    """Sum x down to ``shape``: over its extra leading axes and the axes where ``shape`` has size 1."""
    x = x.sum(axis=tuple(range(x.ndim - len(shape))))
    return x.sum(axis=tuple(a for a, n in enumerate(shape) if n == 1), keepdims=True)


@dataclasses.dataclass
class ErrorScales:
    """Per-element size of the rounding error each output may carry, float64."""

    o: np.ndarray    # (*batch, Nq, D)
    m: np.ndarray    # (*batch, Nq)
    l: np.ndarray    # (*batch, Nq)
    dq: np.ndarray   # shape of q
    dk: np.ndarray   # shape of k
    dv: np.ndarray   # shape of v


def error_scales(problem, output_dtype, logit_dtype):
    """Error scales of a computation that rounds outputs to ``output_dtype`` and logits to ``logit_dtype``.

    dS = P * (dP - D) cancels (exactly, when Nk = 1) and o = P V averages
    values of both signs, so an output can be far smaller than the rounding
    errors of its terms. Errors are therefore measured against magnitudes:
    |o| <= P |V|, |dS| <= P * (|dO| |V|^T + rowsum(|dO| |O|)),
    |dq| <= scale |dS| |K|, |dk| <= scale |dS|^T |Q|, |dv| <= P^T |dO|.
    Each query row's terms are weighted by w_i = u_output + u_logit (Nk + 2 A_i):
    rounding an output (or a tensor-core operand) costs u_output; an error of
    u_logit A_i in the logits of row i, where A_i = max_j scale |Q_i| |K_j|^T,
    moves its softmax by up to 2 u_logit A_i; and the online softmax rescales
    O_i and l_i once per K/V tile, up to Nk roundings of u_logit. A value
    rounded to the output dtype (o, a gradient, the P and dS operands) may
    also lose eta, half the smallest subnormal, when it is tiny. m carries
    u_logit (1 + 2 A_i) and l, relative to itself, u_logit (Nk + 2 A_i).
    """
    q, k, v, do = batched(problem)
    S = scores(problem)                                        # (*batch, Nq, Nk)
    visible = np.isfinite(S)
    row_max = np.max(S, axis=-1, initial=-np.inf, keepdims=True)
    P = np.exp(S - np.where(np.isfinite(row_max), row_max, 0))  # hidden keys: exp(-inf) = 0
    l = P.sum(axis=-1)                                         # (*batch, Nq)
    P /= np.maximum(l, np.finfo(FLOAT64).tiny)[..., None]
    A = np.max(problem.scale * np.abs(q) @ np.abs(np.swapaxes(k, -1, -2)), axis=-1, initial=0.0, where=visible)

    output_dtype, logit_dtype = np.dtype(output_dtype), np.dtype(logit_dtype)
    u_output, u_logit = UNIT_ROUNDOFF[output_dtype], UNIT_ROUNDOFF[logit_dtype]
    eta = HALF_SMALLEST_SUBNORMAL[output_dtype]
    logit_error = u_logit * (1 + 2 * A)                        # (*batch, Nq)
    softmax_error = u_logit * (k.shape[-2] + 2 * A)            # (*batch, Nq)
    w = (u_output + softmax_error)[..., None]                  # (*batch, Nq, 1)
    P_error = w * P + eta * visible                            # (*batch, Nq, Nk)
    dS_magnitude = P * (np.abs(do) @ np.abs(np.swapaxes(v, -1, -2))
                        + np.sum(np.abs(do * (P @ v)), axis=-1, keepdims=True))
    dS_error = w * dS_magnitude + eta * visible                # (*batch, Nq, Nk)
    return ErrorScales(
        o=P_error @ np.abs(v) + eta,
        m=logit_error,
        l=l * softmax_error,
        dq=sum_to_shape(problem.scale * dS_error @ np.abs(k), problem.q.shape) + eta,
        dk=sum_to_shape(problem.scale * np.swapaxes(dS_error, -1, -2) @ np.abs(q), problem.k.shape) + eta,
        dv=sum_to_shape(np.swapaxes(P_error, -1, -2) @ np.abs(do), problem.v.shape) + eta,
    )


def blocked_scales(problem):
    """Error scales of the blocked loops: outputs in the input dtype, logits in float32 (float64)."""
    return error_scales(problem, problem.q.dtype, accumulator_dtype(problem.q.dtype))


def assert_within(actual, expected, scale, name):
    """||actual - expected|| <= ERROR_UNITS ||scale|| (Frobenius, float64), shapes equal."""
    assert actual.shape == expected.shape, f"{name}: shape {actual.shape} != {expected.shape}"
    error = np.linalg.norm(np.asarray(actual).astype(FLOAT64) - expected)
    bound = ERROR_UNITS * np.linalg.norm(scale)
    assert error <= bound, f"{name}: error {error:.3e} > {ERROR_UNITS} error scales = {bound:.3e}"


def assert_statistics_within(m, l, m_ref, l_ref, scales):
    """m, l match on rows that see a key; rows that see none have exactly m = -inf, l = 0."""
    empty = m_ref == -np.inf
    assert np.all(m[empty] == -np.inf) and np.all(l[empty] == 0)
    assert np.all(np.isfinite(m[~empty]))
    assert_within(m[~empty], m_ref[~empty], scales.m[~empty], "m")
    assert_within(l, l_ref, scales.l, "l")


# ---------------------------------------------------------------------------
# Naive float64 truth
# ---------------------------------------------------------------------------

@settings(deadline=None, max_examples=40)
@given(attention_problems(dtypes=(FLOAT64, FLOAT32)))
def test_m_plus_log_l_is_logsumexp(problem):
    S = scores(problem)
    with np.errstate(divide="ignore"):  # a row with no visible key has logsumexp log(0) = -inf
        logsumexp = np.log(np.sum(np.exp(S), axis=-1))
    row_max = np.max(S, axis=-1, initial=-np.inf)
    for name, forward, kwargs, scales in [
        ("naive", attention_forward, {}, error_scales(problem, FLOAT64, FLOAT64)),
        ("blocked", blocked_forward, problem.tiles, blocked_scales(problem)),
    ]:
        _, m, l = forward(problem.q, problem.k, problem.v, **problem.options, **kwargs)
        seen = l > 0
        assert np.array_equal(seen, np.isfinite(logsumexp)), name
        assert np.all(m[~seen] == -np.inf), name
        # d(m + log l) = dm + dl / l
        assert_within(m[seen] + np.log(l[seen]), logsumexp[seen], 2 * scales.m[seen], f"{name} m + log(l)")
        assert_within(m[seen], row_max[seen], scales.m[seen], f"{name} m")


@settings(deadline=None, max_examples=30)
@given(attention_problems(dtypes=(FLOAT64,), lengths=st.integers(1, 5), dims=st.integers(1, 4)))
def test_attention_backward_matches_finite_differences(problem):
    q, k, v, do = problem.q, problem.k, problem.v, problem.do

    def loss(q, k, v):
        return np.sum(attention_forward(q, k, v, **problem.options)[0] * do)

    def central_difference(x, loss_of):
        grad = np.zeros_like(x)
        for index in np.ndindex(x.shape):
            step = np.zeros_like(x)
            step[index] = FINITE_DIFFERENCE_STEP
            grad[index] = (loss_of(x + step) - loss_of(x - step)) / (2 * FINITE_DIFFERENCE_STEP)
        return grad

    expected = (central_difference(q, lambda x: loss(x, k, v)),
                central_difference(k, lambda x: loss(q, x, v)),
                central_difference(v, lambda x: loss(q, k, x)))
    forward = attention_forward(q, k, v, **problem.options)
    grads = attention_backward(do, q, k, v, *forward, **problem.options)
    # Each central difference carries rounding noise of about eps |L| / h, |L| <= sum |o dO|.
    noise = np.finfo(FLOAT64).eps * np.sum(np.abs(forward[0] * do)) / FINITE_DIFFERENCE_STEP
    for name, grad, fd in zip(("dq", "dk", "dv"), grads, expected):
        assert grad.shape == fd.shape, name
        error = np.linalg.norm(grad - fd)
        bound = FINITE_DIFFERENCE_TOLERANCE * np.linalg.norm(fd) + 10 * np.sqrt(fd.size) * noise
        assert error <= bound, f"{name}: |grad - fd| = {error:.3e} > {bound:.3e}, |fd| = {np.linalg.norm(fd):.3e}"


# ---------------------------------------------------------------------------
# Blocked V1 loops against the truth
# ---------------------------------------------------------------------------

@settings(deadline=None, max_examples=80)
@given(attention_problems())
def test_blocked_forward_matches_naive(problem):
    dtype = problem.q.dtype
    o_ref, m_ref, l_ref = attention_forward(problem.q, problem.k, problem.v, **problem.options)
    o, m, l = blocked_forward(problem.q, problem.k, problem.v, **problem.options, **problem.tiles)

    statistics_dtype = accumulator_dtype(dtype)
    assert (o.dtype, m.dtype, l.dtype) == (dtype, statistics_dtype, statistics_dtype)
    assert (m.shape, l.shape) == (m_ref.shape, l_ref.shape)
    assert np.all(np.isfinite(o.astype(FLOAT64)))
    scales = blocked_scales(problem)
    assert_within(o, o_ref, scales.o, "o")
    assert_statistics_within(m, l, m_ref, l_ref, scales)


@settings(deadline=None, max_examples=60)
@given(attention_problems())
def test_blocked_backward_matches_naive(problem):
    dtype = problem.q.dtype
    q, k, v, do = problem.q, problem.k, problem.v, problem.do
    expected = attention_backward(do, q, k, v, *attention_forward(q, k, v, **problem.options), **problem.options)
    forward = blocked_forward(q, k, v, **problem.options, **problem.tiles)
    grads = blocked_backward(do, q, k, v, *forward, **problem.options, **problem.tiles)
    scales = blocked_scales(problem)

    for name, grad, grad_ref, x in zip(("dq", "dk", "dv"), grads, expected, (q, k, v)):
        assert grad.dtype == dtype and grad.shape == x.shape, name
        assert np.all(np.isfinite(grad.astype(FLOAT64))), name
        assert_within(grad, grad_ref, getattr(scales, name), name)


@settings(deadline=None, max_examples=30)
@given(attention_problems(lengths=st.integers(1, 40), causal=st.just(True), extra_queries=st.integers(1, 40)))
def test_rows_that_see_no_key_are_exactly_empty(problem):
    """Causal with Nq > Nk: the first Nq - Nk rows give o = 0, m = -inf, l = 0 and dq = 0."""
    q, k, v, do = problem.q, problem.k, problem.v, problem.do
    hidden = q.shape[-2] - k.shape[-2]
    forwards = {
        "naive": attention_forward(q, k, v, **problem.options),
        "blocked": blocked_forward(q, k, v, **problem.options, **problem.tiles),
        "same precision": naive_same_precision_forward(q, k, v, **problem.options),
    }
    for name, (o, m, l) in forwards.items():
        assert np.all(o[..., :hidden, :].astype(FLOAT64) == 0), name
        assert np.all(m[..., :hidden] == -np.inf) and np.all(l[..., :hidden] == 0), name
        assert np.all(np.isfinite(m[..., hidden:])) and np.all(l[..., hidden:] > 0), name
    backwards = {
        "naive": attention_backward(do, q, k, v, *forwards["naive"], **problem.options),
        "blocked": blocked_backward(do, q, k, v, *forwards["blocked"], **problem.options, **problem.tiles),
        "same precision": naive_same_precision_backward(do, q, k, v, **problem.options),
    }
    for name, (dq, dk, dv) in backwards.items():
        assert np.all(dq[..., :hidden, :].astype(FLOAT64) == 0), name
        assert all(np.all(np.isfinite(g.astype(FLOAT64))) for g in (dq, dk, dv)), name


@settings(deadline=None, max_examples=30)
@given(attention_problems(dtypes=(FLOAT32, FLOAT64), scales=st.just(None), gain=LARGE_INPUT_GAIN)
       | attention_problems(dtypes=(FLOAT32, FLOAT64), scales=st.just(LARGE_SOFTMAX_SCALE)))
def test_blocked_forward_survives_large_logits(problem):
    """Logits in the hundreds or thousands overflow a bare exp; the running max keeps o finite and right."""
    o_ref, m_ref, l_ref = attention_forward(problem.q, problem.k, problem.v, **problem.options)
    o, m, l = blocked_forward(problem.q, problem.k, problem.v, **problem.options, **problem.tiles)
    assert np.all(np.isfinite(o)) and np.all(np.isfinite(l))
    scales = blocked_scales(problem)
    assert_within(o, o_ref, scales.o, "o")
    assert_statistics_within(m, l, m_ref, l_ref, scales)


# ---------------------------------------------------------------------------
# Same-precision naive attention
# ---------------------------------------------------------------------------

@settings(deadline=None, max_examples=30)
@given(attention_problems(dtypes=(FLOAT32, FLOAT64)))
def test_same_precision_is_plain_arithmetic_for_float32_and_float64(problem):
    dtype = problem.q.dtype
    q, k, v, do = problem.q, problem.k, problem.v, problem.do
    o_ref, m_ref, l_ref = attention_forward(q, k, v, **problem.options)
    o, m, l = naive_same_precision_forward(q, k, v, **problem.options)
    scales = error_scales(problem, dtype, dtype)
    assert o.dtype == dtype and m.dtype == dtype and l.dtype == dtype
    assert_within(o, o_ref, scales.o, "o")
    assert_statistics_within(m, l, m_ref, l_ref, scales)
    expected = attention_backward(do, q, k, v, o_ref, m_ref, l_ref, **problem.options)
    grads = naive_same_precision_backward(do, q, k, v, **problem.options)
    for name, grad, grad_ref, x in zip(("dq", "dk", "dv"), grads, expected, (q, k, v)):
        assert grad.dtype == dtype and grad.shape == x.shape, name
        assert_within(grad, grad_ref, getattr(scales, name), name)


@settings(deadline=None, max_examples=40)
@given(attention_problems(dtypes=(FLOAT16, BFLOAT16)))
def test_blocked_is_within_twice_the_same_precision_error(problem):
    """The criterion the GPU kernels are held to, met by the blocked loops they mirror.

    Errors are max |error| against the float64 truth, plus a slack of one
    error scale for problems where the naive attention happens to be exact
    (e.g. Nk = 1). The same-precision attention, which rounds S to the input
    dtype too, must itself stay within its error scales.
    """
    dtype = problem.q.dtype
    q, k, v, do = problem.q, problem.k, problem.v, problem.do
    truth_forward = attention_forward(q, k, v, **problem.options)
    truth = (truth_forward[0], *attention_backward(do, q, k, v, *truth_forward, **problem.options))
    same_o, same_m, same_l = naive_same_precision_forward(q, k, v, **problem.options)
    same = (same_o, *naive_same_precision_backward(do, q, k, v, **problem.options))
    blocked_out = blocked_forward(q, k, v, **problem.options, **problem.tiles)
    blocked = (blocked_out[0], *blocked_backward(do, q, k, v, *blocked_out, **problem.options, **problem.tiles))
    scales = error_scales(problem, dtype, dtype)

    assert same_o.dtype == dtype and same_m.dtype == FLOAT32 and same_l.dtype == FLOAT32
    for name, ref, naive, ours in zip(("o", "dq", "dk", "dv"), truth, same, blocked):
        scale = getattr(scales, name)
        assert naive.dtype == dtype and naive.shape == ref.shape, name
        naive_error = np.max(np.abs(naive.astype(FLOAT64) - ref), initial=0.0)
        blocked_error = np.max(np.abs(ours.astype(FLOAT64) - ref), initial=0.0)
        slack = np.max(scale, initial=0.0)
        assert blocked_error <= 2 * naive_error + slack, f"{name}: {blocked_error:.3e} vs naive {naive_error:.3e}"
        assert_within(naive, ref, scale, f"same-precision {name}")


# ---------------------------------------------------------------------------
# Contract: inputs untouched, empty queries
# ---------------------------------------------------------------------------

@settings(deadline=None, max_examples=15)
@given(attention_problems(lengths=st.integers(1, 40)))
def test_inputs_are_not_modified(problem):
    inputs = (problem.do, problem.q, problem.k, problem.v)
    copies = [x.copy() for x in inputs]
    do, q, k, v = inputs
    naive = attention_forward(q, k, v, **problem.options)
    attention_backward(do, q, k, v, *naive, **problem.options)
    blocked = blocked_forward(q, k, v, **problem.options, **problem.tiles)
    blocked_copies = [x.copy() for x in blocked]
    blocked_backward(do, q, k, v, *blocked, **problem.options, **problem.tiles)
    naive_same_precision_forward(q, k, v, **problem.options)
    naive_same_precision_backward(do, q, k, v, **problem.options)
    for x, copy in zip((*inputs, *blocked), (*copies, *blocked_copies)):
        assert x.dtype == copy.dtype and np.array_equal(x, copy)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("causal", [False, True])
def test_empty_queries_give_empty_outputs(dtype, causal):
    q = np.zeros((2, 3, 0, 8), dtype)
    k = np.ones((2, 1, 5, 8), dtype)
    v = np.ones((1, 5, 8), dtype)
    do = np.zeros((2, 3, 0, 8), dtype)
    options = {"causal": causal}
    forwards = {
        "naive": attention_forward(q, k, v, **options),
        "blocked": blocked_forward(q, k, v, **options),
        "same precision": naive_same_precision_forward(q, k, v, **options),
    }
    for name, (o, m, l) in forwards.items():
        assert (o.shape, m.shape, l.shape) == ((2, 3, 0, 8), (2, 3, 0), (2, 3, 0)), name
    backwards = {
        "naive": attention_backward(do, q, k, v, *forwards["naive"], **options),
        "blocked": blocked_backward(do, q, k, v, *forwards["blocked"], **options),
        "same precision": naive_same_precision_backward(do, q, k, v, **options),
    }
    for name, (dq, dk, dv) in backwards.items():
        assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape), name
        assert not np.any(dk.astype(FLOAT64)) and not np.any(dv.astype(FLOAT64)), name


def _poisoned(causal):
    """q (2, 9, 4), k, v (2, 7, 4) with a NaN in v at key 5 and an inf in k at key 6 (batch 1), and the
    visibility of key j to query i (bottom-right causal: i sees j iff j <= i - 2)."""
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal(s) for s in ((2, 9, 4), (2, 7, 4), (2, 7, 4)))
    v[0, 5, 1] = np.nan
    k[1, 6, 2] = np.inf
    rows, cols = np.arange(9)[:, None], np.arange(7)[None, :]
    sees = cols <= rows - 2 if causal else np.ones((9, 7), bool)
    return q, k, v, sees


@pytest.mark.parametrize("causal", [False, True])
def test_non_finite_values_reach_exactly_the_rows_that_see_them(causal):
    q, k, v, sees = _poisoned(causal)
    o, m, l = attention_forward(q, k, v, causal=causal)
    # v[0, 5, 1]: column 1 of the batch-0 rows that see key 5; m and l never see v
    assert np.array_equal(np.isnan(o[0]), sees[:, 5, None] & (np.arange(4) == 1))
    assert not np.isnan(m[0]).any() and not np.isnan(l[0]).any()
    # k[1, 6, 2] = inf: score +-inf in the batch-1 rows that see key 6 (NaN rows where +inf)
    plus = sees[:, 6] & (q[1, :, 2] > 0)
    assert np.array_equal(np.isnan(l[1]), plus) and np.array_equal(np.isnan(o[1]).all(-1), plus)
    assert np.array_equal(np.isposinf(m[1]), plus) and np.isfinite(o[1][~plus]).all()
    # rows that see no key (causal: 0 and 1) stay empty
    if causal:
        assert (o[:, :2] == 0).all() and (m[:, :2] == -np.inf).all() and (l[:, :2] == 0).all()


@pytest.mark.parametrize("causal", [False, True])
def test_non_finite_gradients_reach_exactly_the_pairs_that_see_them(causal):
    q, k, v, sees = _poisoned(causal)
    q[1, 4, 0] = np.nan   # a NaN query row: its row's dq, and the dk, dv of the keys it sees
    do = np.random.default_rng(1).standard_normal(q.shape)
    dq, dk, dv = attention_backward(do, q, k, v, *attention_forward(q, k, v, causal=causal), causal=causal)
    assert np.isnan(dq[1, 4]).all() and np.isnan(dk[1][sees[4]]).all() and np.isnan(dv[1][sees[4]]).all()
    assert np.isfinite(dv[0]).all()                          # v's NaN is no term of dv
    assert np.array_equal(~np.isfinite(dq[0]).all(-1), sees[:, 5])   # dP_i5 = do_i . v_5 for the rows seeing key 5
    if causal:
        assert (dq[:, :2] == 0).all()                        # rows that see no key
        assert np.isfinite(dk[1][~sees[4] & ~sees[:, 6].any()]).all()
