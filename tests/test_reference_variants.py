"""CPU tests of the attention variants of cupyflash.reference and the CPU path (issues #17 and #18's
ground truth; no CuPy needed).

The naive float64 reference with windows, softcap, ALiBi, bias, boolean masks and sinks is checked
against an independent row-by-row computation (plain Python loops over the visible keys), its
gradients (dq, dk, dv, dbias, dsink) against central finite differences, and its rules: a hidden
pair has no term, a row that sees nothing is empty, bad values raise. The blocked CPU path is held
to the reference with every variant on tiles of 1 to 64; packed sequences to one dense call with a
block-diagonal mask; dropout's Philox to Random123's known answers, its keep set to its rate and
its definition; merging to the attention of the union of the parts.
"""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cupyflash.reference import attention_backward, attention_forward

pytestmark = pytest.mark.filterwarnings("error")

B, H = 2, 3                      # batch dims of every problem here
STEP = 1e-6                      # central finite differences in float64
GRAD_RTOL = 1e-6                 # of the gradient's largest entry
EXACT_RTOL = 1e-12               # reference against the row-by-row loops

# broadcastable shapes of each per-problem array, as a user passes them (None: not passed)
BIAS_SHAPES = (None, "full", "heads")        # (B, H, Nq, Nk); (H, Nq, 1): shared over the batch and the keys
MASK_SHAPES = (None, "full", "shared")       # (B, H, Nq, Nk); (Nq, Nk)
PER_HEAD = (None, "heads", "batch")          # (H,); (B, 1)


def _array(rng, kind, n_q, n_k, what):
    """A random ``what`` ("bias", "mask", "alibi" or "sink") of the shape ``kind`` names; None for None."""
    if kind is None:
        return None
    if what == "bias":
        shape = {"full": (B, H, n_q, n_k), "heads": (H, n_q, 1)}[kind]
        return rng.standard_normal(shape)
    if what == "mask":
        shape = {"full": (B, H, n_q, n_k), "shared": (n_q, n_k)}[kind]
        return rng.random(shape) < 0.7
    shape = {"heads": (H,), "batch": (B, 1)}[kind]
    return rng.random(shape) * (0.5 if what == "alibi" else 2.0) - (0.0 if what == "alibi" else 1.0)


@st.composite
def variant_problems(draw):
    """q, k, v, do and a set of variant keywords on (B, H) heads."""
    n_q, n_k, d = draw(st.integers(1, 7)), draw(st.integers(1, 7)), draw(st.integers(1, 5))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    q, k, v, do = (rng.standard_normal(s) for s in ((B, H, n_q, d), (B, 1, n_k, d), (1, H, n_k, d), (B, H, n_q, d)))
    side = st.one_of(st.none(), st.integers(0, 4))
    kw = dict(causal=draw(st.booleans()),
              softmax_scale=draw(st.sampled_from([None, 0.7, 2.0])),
              window=draw(st.one_of(st.none(), st.tuples(side, side))),
              softcap=draw(st.sampled_from([None, 0.5, 3.0])),
              alibi_slopes=_array(rng, draw(st.sampled_from(PER_HEAD)), n_q, n_k, "alibi"),
              bias=_array(rng, draw(st.sampled_from(BIAS_SHAPES)), n_q, n_k, "bias"),
              mask=_array(rng, draw(st.sampled_from(MASK_SHAPES)), n_q, n_k, "mask"),
              sink=_array(rng, draw(st.sampled_from(PER_HEAD)), n_q, n_k, "sink"))
    return q, k, v, do, kw


def rowwise(q, k, v, causal, softmax_scale, window, softcap, alibi_slopes, bias, mask, sink):
    """o, m, l by plain loops: per batch entry and query, the visible keys' scores in the documented
    order (scale, softcap, alibi, bias), the sink as one more logit of value zero."""
    n_q, n_k, d = q.shape[-2], k.shape[-2], q.shape[-1]
    scale = 1 / math.sqrt(d) if softmax_scale is None else softmax_scale
    q, k, v = (np.broadcast_to(x, (B, H, *x.shape[-2:])) for x in (q, k, v))
    bias = None if bias is None else np.broadcast_to(bias, (B, H, n_q, n_k))
    mask = None if mask is None else np.broadcast_to(mask, (B, H, n_q, n_k))
    slopes = None if alibi_slopes is None else np.broadcast_to(alibi_slopes, (B, H))
    sinks = None if sink is None else np.broadcast_to(sink, (B, H))
    left, right = window if window is not None else (None, None)
    o, m, l = np.zeros((B, H, n_q, d)), np.full((B, H, n_q), -np.inf), np.zeros((B, H, n_q))
    for b in range(B):
        for h in range(H):
            for i in range(n_q):
                diag = i + n_k - n_q
                logits, values = [], []
                for j in range(n_k):
                    if (causal and j > diag) or (left is not None and j < diag - left) \
                            or (right is not None and j > diag + right) or (mask is not None and not mask[b, h, i, j]):
                        continue
                    s = scale * float(np.dot(q[b, h, i], k[b, h, j]))
                    if softcap is not None:
                        s = softcap * math.tanh(s / softcap)
                    if slopes is not None:
                        s -= slopes[b, h] * abs(diag - j)
                    if bias is not None:
                        s += bias[b, h, i, j]
                    logits.append(s)
                    values.append(v[b, h, j])
                if sinks is not None:
                    logits.append(sinks[b, h])
                    values.append(np.zeros(d))
                if not logits:
                    continue
                mx = max(logits)
                weights = [math.exp(s - mx) for s in logits]
                m[b, h, i], l[b, h, i] = mx, sum(weights)
                o[b, h, i] = sum(w * x for w, x in zip(weights, values)) / l[b, h, i]
    return o, m, l


@settings(max_examples=150, deadline=None)
@given(variant_problems())
def test_forward_matches_the_row_by_row_loops(problem):
    q, k, v, _, kw = problem
    got, want = attention_forward(q, k, v, **kw), rowwise(q, k, v, **kw)
    for name, g, w in zip("oml", got, want):
        assert g.shape == w.shape, name
        assert np.array_equal(np.isinf(g), np.isinf(w)), name
        finite = np.isfinite(w)
        np.testing.assert_allclose(g[finite], w[finite], rtol=EXACT_RTOL, atol=EXACT_RTOL, err_msg=name)


def _loss(q, k, v, do, kw):
    return float(np.sum(attention_forward(q, k, v, **kw)[0] * do))


def _numeric_grad(f, x):
    """d f / d x by central differences, entry by entry (x is modified and restored)."""
    g = np.zeros_like(x)
    for idx in np.ndindex(x.shape):
        saved = x[idx]
        x[idx] = saved + STEP
        up = f()
        x[idx] = saved - STEP
        down = f()
        x[idx] = saved
        g[idx] = (up - down) / (2 * STEP)
    return g


@settings(max_examples=40, deadline=None)
@given(variant_problems())
def test_gradients_match_finite_differences(problem):
    q, k, v, do, kw = problem
    bias_grad = kw["bias"] is not None
    o, m, l = attention_forward(q, k, v, **kw)
    grads = attention_backward(do, q, k, v, o, m, l, bias_grad=bias_grad, **kw)
    inputs = [q, k, v] + ([kw["bias"]] if bias_grad else []) + ([kw["sink"]] if kw["sink"] is not None else [])
    assert len(grads) == len(inputs)
    for got, x in zip(grads, inputs):
        assert got.shape == np.shape(x)
        want = _numeric_grad(lambda: _loss(q, k, v, do, kw), x)
        np.testing.assert_allclose(got, want, rtol=0, atol=GRAD_RTOL * max(1.0, np.abs(want).max()))


def test_window_is_the_documented_band():
    """window=(left, right): query i sees key j iff i + off - left <= j <= i + off + right; causal caps right at 0."""
    rng = np.random.default_rng(1)
    n_q, n_k, d = 5, 9, 3
    q, k, v = (rng.standard_normal((n, d)) for n in (n_q, n_k, n_k))
    off = n_k - n_q
    for window, causal in (((2, 1), False), ((None, 0), False), ((1, None), False), ((3, 2), True), ((0, 0), False)):
        left, right = window
        if causal:
            right = 0 if right is None else min(right, 0)
        band = np.array([[(left is None or j >= i + off - left) and (right is None or j <= i + off + right)
                          for j in range(n_k)] for i in range(n_q)])
        want = attention_forward(q, k, v, mask=band)
        got = attention_forward(q, k, v, window=window, causal=causal)
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g, w)


def test_a_bias_of_minus_infinity_hides_like_a_mask():
    rng = np.random.default_rng(2)
    q, k, v = (rng.standard_normal((H, n, 4)) for n in (6, 8, 8))
    mask = rng.random((H, 6, 8)) < 0.5
    mask[:, :, 0] = True   # every row sees a key
    by_mask = attention_forward(q, k, v, mask=mask)
    by_bias = attention_forward(q, k, v, bias=np.where(mask, 0.0, -np.inf))
    for a, b in zip(by_mask, by_bias):
        np.testing.assert_allclose(a, b, rtol=1e-14, atol=0)


def _blocked_forward(*args, **kw):
    from cupyflash import blocked

    return blocked.forward(*args, block_r=2, block_c=4, **kw)


def _blocked_backward(*args, **kw):
    from cupyflash import blocked

    return blocked.backward(*args, block_r=2, block_c=4, **kw)


PATHS = {"reference": (attention_forward, attention_backward), "blocked": (_blocked_forward, _blocked_backward)}


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("how", ["mask", "window"])
def test_a_hidden_pair_has_no_term_even_when_not_finite(how, path):
    """A NaN in v, or an inf in k, at a key that a row does not see reaches none of that row's outputs,
    in the reference and on the CPU path (tiles of 2 x 4). (A bias adds: -inf gives a pair zero
    weight, not no term, and inf + -inf is NaN.)"""
    forward, backward = PATHS[path]
    rng = np.random.default_rng(3)
    q, k, v, do = (rng.standard_normal((n, 4)) for n in (4, 6, 6, 4))
    seen = np.ones((4, 6), dtype=bool)
    seen[0, 5] = False   # row 0 does not see key 5; the others do
    if how == "window":   # off = 2, right = 1: row i sees keys j <= i + 3 (rows 0, 1 not key 5)
        seen = np.array([[j <= i + 3 for j in range(6)] for i in range(4)])
    kw = {"mask": dict(mask=seen), "window": dict(window=(None, 1))}[how]
    v[5, 1] = np.nan
    k[5, 2] = np.inf
    o, m, l = forward(q, k, v, **kw)
    rows = ~seen[:, 5]   # the rows that do not see key 5
    assert np.isfinite(o[rows]).all() and np.isfinite(m[rows]).all() and np.isfinite(l[rows]).all()
    assert not np.isfinite(o[~rows]).all()
    dq = backward(do, q, k, v, o, m, l, **kw)[0]
    assert np.isfinite(dq[rows]).all()
    zero = np.zeros((4, 6))   # a bias beside the hiding: its gradient is 0 at every hidden pair
    o, m, l = forward(q, k, v, bias=zero, **kw)
    dbias = backward(do, q, k, v, o, m, l, bias=zero, bias_grad=True, **kw)[3]
    assert (dbias[~seen] == 0).all() and np.isfinite(dbias[rows]).all()


def test_rows_that_see_nothing_are_empty_and_a_sink_fills_them():
    rng = np.random.default_rng(4)
    q, k, v, do = (rng.standard_normal((H, n, 3)) for n in (5, 4, 4, 5))
    mask = np.ones((5, 4), dtype=bool)
    mask[2] = False
    o, m, l = attention_forward(q, k, v, mask=mask)
    assert (o[:, 2] == 0).all() and (m[:, 2] == -np.inf).all() and (l[:, 2] == 0).all()
    dq = attention_backward(do, q, k, v, o, m, l, mask=mask)[0]
    assert (dq[:, 2] == 0).all()
    sink = np.array([0.5, -1.0, 2.0])
    o, m, l = attention_forward(q, k, v, mask=mask, sink=sink)
    assert (o[:, 2] == 0).all() and np.array_equal(m[:, 2], sink) and (l[:, 2] == 1).all()
    assert (m >= sink[:, None]).all()


def test_dbias_sums_over_the_dims_it_broadcasts_along():
    rng = np.random.default_rng(5)
    q, k, v, do = (rng.standard_normal(s) for s in ((B, H, 4, 3), (B, H, 5, 3), (B, H, 5, 3), (B, H, 4, 3)))
    full = rng.standard_normal((B, H, 4, 5))
    shared = full[:1, :, :, :1].copy()   # (1, H, 4, 1)
    o, m, l = attention_forward(q, k, v, bias=np.broadcast_to(shared, full.shape))
    d_full = attention_backward(do, q, k, v, o, m, l, bias=np.broadcast_to(shared, full.shape), bias_grad=True)[3]
    o, m, l = attention_forward(q, k, v, bias=shared)
    d_shared = attention_backward(do, q, k, v, o, m, l, bias=shared, bias_grad=True)[3]
    assert d_shared.shape == shared.shape
    np.testing.assert_allclose(d_shared, d_full.sum(axis=(0, 3), keepdims=True), rtol=1e-12, atol=1e-15)


BAD_VARIANTS = [(dict(window=(-1, 0)), "window"), (dict(window=(1,)), "window"), (dict(window=(1.5, 0)), "window"),
                (dict(softcap=0.0), "softcap"), (dict(softcap=-2.0), "softcap"), (dict(softcap=math.inf), "softcap"),
                (dict(dropout_p=1.0, seed=1), "dropout_p"), (dict(dropout_p=-0.1, seed=1), "dropout_p"),
                (dict(dropout_p=0.5), "seed"), (dict(dropout_p=0.5, seed=-1), "seed"),
                (dict(dropout_p=0.5, seed=2**64), "seed"), (dict(dropout_p=0.5, seed=1.5), "seed")]


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("kw, match", BAD_VARIANTS)
def test_bad_variant_values_raise(kw, match, path):
    """In the reference and on the CPU path, forward and backward, before anything is computed."""
    forward, backward = PATHS[path]
    x = np.ones((2, 4))
    with pytest.raises(ValueError, match=match):
        forward(x, x, x, **kw)
    o, m, l = forward(x, x, x)
    with pytest.raises(ValueError, match=match):
        backward(x, x, x, x, o, m, l, **kw)


@pytest.mark.parametrize("path", sorted(PATHS))
def test_bias_grad_needs_a_bias(path):
    forward, backward = PATHS[path]
    x = np.ones((2, 4))
    o, m, l = forward(x, x, x)
    with pytest.raises(ValueError, match="bias_grad"):
        backward(x, x, x, x, o, m, l, bias_grad=True)


@st.composite
def packed_problems(draw):
    """q, k, v, do of n_seq packed sequences (some empty) on (H,) heads, their offsets, and keywords."""
    n_seq = draw(st.integers(1, 4))
    lens_q = draw(st.lists(st.integers(0, 5), min_size=n_seq, max_size=n_seq))
    lens_k = draw(st.lists(st.integers(0, 5), min_size=n_seq, max_size=n_seq))
    d = draw(st.integers(1, 4))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    cq, ck = np.cumsum([0, *lens_q]), np.cumsum([0, *lens_k])
    q, do = (rng.standard_normal((H, int(cq[-1]), d)) for _ in range(2))
    k, v = (rng.standard_normal((H, int(ck[-1]), d)) for _ in range(2))
    side = st.one_of(st.none(), st.integers(0, 3))
    kw = dict(causal=draw(st.booleans()), window=draw(st.one_of(st.none(), st.tuples(side, side))),
              softcap=draw(st.sampled_from([None, 2.0])),
              alibi_slopes=draw(st.sampled_from([None, np.array([0.1, 0.2, 0.3])])),
              sink=draw(st.sampled_from([None, np.array([0.5, -0.5, 1.0])])))
    return q, k, v, do, cq, ck, kw


def block_diagonal(cq, ck, causal, window):
    """The dense (total_q, total_k) mask of packed sequences: same sequence, and inside it the causal
    mask and the window, bottom-right aligned per sequence."""
    rows, cols = [], []
    for s in range(len(cq) - 1):
        rows += [(s, i - cq[s], cq[s + 1] - cq[s]) for i in range(cq[s], cq[s + 1])]
    for s in range(len(ck) - 1):
        cols += [(s, j - ck[s], ck[s + 1] - ck[s]) for j in range(ck[s], ck[s + 1])]
    left, right = window if window is not None else (None, None)
    if causal:
        right = 0 if right is None else min(right, 0)
    mask = np.zeros((len(rows), len(cols)), dtype=bool)
    for a, (s, i, nq) in enumerate(rows):
        for b, (t, j, nk) in enumerate(cols):
            diag = i + nk - nq
            mask[a, b] = s == t and (left is None or j >= diag - left) and (right is None or j <= diag + right)
    return mask


@settings(max_examples=60, deadline=None)
@given(packed_problems())
def test_packed_sequences_are_a_block_diagonal_mask(problem):
    """Varlen equals one dense call whose mask keeps each sequence to itself (no ALiBi there: its distance
    is per sequence), forward and backward; with ALiBi, each sequence alone."""
    from cupyflash.reference import attention_varlen_backward, attention_varlen_forward

    q, k, v, do, cq, ck, kw = problem
    o, m, l = attention_varlen_forward(q, k, v, cq, ck, **kw)
    grads = attention_varlen_backward(do, q, k, v, o, m, l, cq, ck, **kw)
    assert o.shape == q.shape and m.shape == l.shape == q.shape[:-1]
    assert [g.shape for g in grads[:3]] == [q.shape, k.shape, v.shape]
    if kw["alibi_slopes"] is None and q.shape[-2] and k.shape[-2]:
        dense = dict(kw, causal=False, window=None, mask=block_diagonal(cq, ck, kw["causal"], kw["window"]))
        want = attention_forward(q, k, v, **dense)
        for g, w in zip((o, m, l), want):
            np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-14)
        want = attention_backward(do, q, k, v, *want, **dense)
        for g, w in zip(grads, want):
            np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-12)
    for s in range(len(cq) - 1):
        rq, rk = slice(cq[s], cq[s + 1]), slice(ck[s], ck[s + 1])
        alone = attention_forward(q[:, rq], k[:, rk], v[:, rk], **kw)
        for g, w in zip((o[:, rq], m[:, rq], l[:, rq]), alone):
            np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("cu, match", [([1, 3], "start at 0"), ([0, 4, 3], "not decrease"), ([0, 2], "end at 3"),
                                       ([[0, 3]], "1-D"), ([0.0, 3.0], "integer")])
def test_bad_sequence_offsets_raise_naming_the_argument(cu, match):
    from cupyflash.reference import attention_varlen_forward

    x = np.ones((3, 2))
    with pytest.raises(ValueError, match=f"cu_seqlens_q.*{match}"):
        attention_varlen_forward(x, x, x, cu, [0, 3])


def test_offsets_must_count_the_same_sequences():
    from cupyflash.reference import attention_varlen_forward

    x = np.ones((3, 2))
    with pytest.raises(ValueError, match="same number of sequences"):
        attention_varlen_forward(x, x, x, [0, 1, 3], [0, 3])


@settings(max_examples=120, deadline=None)
@given(variant_problems(), st.sampled_from([(1, 1), (2, 3), (3, 2), (64, 64)]))
def test_the_blocked_cpu_path_matches_the_reference(problem, tile):
    """cupyflash.blocked with every variant, on tiles of 1 to 64 rows and keys (float64 inputs: the
    blocked loops compute in float64 too), forward and backward, dbias and dsink included."""
    from cupyflash import blocked

    q, k, v, do, kw = problem
    B_r, B_c = tile
    bias_grad = kw["bias"] is not None
    want = attention_forward(q, k, v, **kw)
    got = blocked.forward(q, k, v, block_r=B_r, block_c=B_c, **kw)
    for name, g, w in zip("oml", got, want):
        assert g.shape == w.shape, name
        np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-13, err_msg=name)
    want = attention_backward(do, q, k, v, *want, bias_grad=bias_grad, **kw)
    got = blocked.backward(do, q, k, v, *got, bias_grad=bias_grad, block_r=B_r, block_c=B_c, **kw)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.shape == w.shape
        np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-12 * max(1.0, np.abs(w).max()))


def test_the_blocked_path_skips_the_tiles_outside_a_window():
    """A (2, 0) window on 64 queries and keys in tiles of 8 visits 15 of the 64 tiles: the diagonal
    ones and the ones just left of them."""
    from cupyflash._mask import MaskGeometry
    from cupyflash.blocked import _tiles

    visited = list(_tiles(MaskGeometry(64, 64, False, 2, 0), 8, 8))
    assert len(visited) == 8 + 7


@pytest.mark.parametrize("dtype, rtol", [("float32", 1e-5), ("bfloat16", 2e-2), ("float16", 5e-3)])
def test_the_blocked_path_keeps_its_precision_with_every_variant(dtype, rtol):
    """float32 arithmetic for 16-bit and float32 inputs, with window, softcap, ALiBi, bias, mask and sink at once."""
    import ml_dtypes

    from cupyflash import blocked

    dt = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
    rng = np.random.default_rng(6)
    n_q, n_k, d = 40, 70, 16
    q, k, v, do = (rng.standard_normal(s).astype(dt) for s in ((B, H, n_q, d), (B, 1, n_k, d), (1, H, n_k, d),
                                                                (B, H, n_q, d)))
    kw = dict(causal=True, window=(20, None), softcap=5.0, alibi_slopes=np.array([0.05, 0.1, 0.2]),
              bias=rng.standard_normal((H, n_q, n_k)).astype(np.float32), mask=rng.random((n_q, n_k)) < 0.9,
              sink=np.array([[0.5], [-0.5]]))
    want = attention_forward(q, k, v, **kw)
    got = blocked.forward(q, k, v, block_r=16, block_c=32, **kw)
    for g, w in zip(got, want):
        finite = np.isfinite(w)
        err = np.linalg.norm(g.astype(np.float64)[finite] - w[finite]) / np.linalg.norm(w[finite])
        assert err <= rtol
    want = attention_backward(do, q, k, v, *want, bias_grad=True, **kw)
    got = blocked.backward(do, q, k, v, *got, bias_grad=True, block_r=16, block_c=32, **kw)
    for g, w in zip(got, want):
        assert g.shape == w.shape
        err = np.linalg.norm(g.astype(np.float64) - w) / np.linalg.norm(w)
        assert err <= 4 * rtol


# ---------------------------------------------------------------------------
# Dropout: the counter-based keep set (cupyflash._philox) and its use in the reference and the CPU path

PHILOX_KNOWN_ANSWERS = (   # Random123's kat_vectors for Philox4x32-10: counter, key, output
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
)


@pytest.mark.parametrize("counter, key, want", PHILOX_KNOWN_ANSWERS)
def test_philox_gives_the_known_answers(counter, key, want):
    from cupyflash._philox import philox4x32

    assert tuple(int(w) for w in philox4x32(counter, key)) == want


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_the_keep_rate_is_one_minus_p(p):
    from cupyflash._philox import dropout_keep

    keep = dropout_keep(12345, p, (4, 8), 128, 256)
    n = keep.size
    assert abs(keep.mean() - (1 - p)) <= 5 * math.sqrt(p * (1 - p) / n)
    # and the pairs are not alike along any axis: each row's and column's rate is near 1 - p as well
    assert np.abs(keep.mean(axis=(0, 1, 3)) - (1 - p)).max() <= 6 * math.sqrt(p * (1 - p) / (32 * 256))
    assert np.abs(keep.mean(axis=(0, 1, 2)) - (1 - p)).max() <= 6 * math.sqrt(p * (1 - p) / (32 * 128))


def test_a_tile_draws_the_same_pairs_as_the_whole_and_seeds_differ():
    from cupyflash._philox import dropout_keep

    whole = dropout_keep(7, 0.3, (2, 3), 50, 70)
    tile = dropout_keep(7, 0.3, (2, 3), 50, 70, rows=range(13, 29), cols=range(5, 67))
    assert np.array_equal(tile, whole[..., 13:29, 5:67])
    assert not np.array_equal(whole, dropout_keep(8, 0.3, (2, 3), 50, 70))
    assert (dropout_keep(2**64 - 1, 0.0, (1,), 3, 3)).all()


def test_dropout_scales_the_kept_weights_and_leaves_m_and_l():
    from cupyflash._philox import dropout_keep

    rng = np.random.default_rng(8)
    q, k, v = (rng.standard_normal(s) for s in ((B, H, 9, 4), (B, H, 11, 4), (B, H, 11, 4)))
    o0, m0, l0 = attention_forward(q, k, v, causal=True)
    o, m, l = attention_forward(q, k, v, causal=True, dropout_p=0.25, seed=99)
    assert np.array_equal(m, m0) and np.array_equal(l, l0)
    S = np.where(np.arange(11)[None, :] <= np.arange(9)[:, None] + 2, q @ np.swapaxes(k, -1, -2) / 2.0, -np.inf)
    P = np.exp(S - m[..., None]) / l[..., None]
    want = (P * dropout_keep(99, 0.25, (B, H), 9, 11) / 0.75) @ v
    np.testing.assert_allclose(o, want, rtol=1e-12, atol=1e-14)
    assert not np.allclose(o, o0)


@settings(max_examples=30, deadline=None)
@given(variant_problems(), st.sampled_from([0.2, 0.6]), st.integers(0, 2**64 - 1))
def test_dropout_gradients_match_finite_differences(problem, p, seed):
    q, k, v, do, kw = problem
    kw = dict(kw, dropout_p=p, seed=seed)
    bias_grad = kw["bias"] is not None
    o, m, l = attention_forward(q, k, v, **kw)
    grads = attention_backward(do, q, k, v, o, m, l, bias_grad=bias_grad, **kw)
    inputs = [q, k, v] + ([kw["bias"]] if bias_grad else []) + ([kw["sink"]] if kw["sink"] is not None else [])
    for got, x in zip(grads, inputs):
        want = _numeric_grad(lambda: _loss(q, k, v, do, kw), x)
        np.testing.assert_allclose(got, want, rtol=0, atol=GRAD_RTOL * max(1.0, np.abs(want).max()))


@settings(max_examples=40, deadline=None)
@given(variant_problems(), st.sampled_from([(1, 1), (2, 3), (64, 64)]), st.integers(0, 2**64 - 1))
def test_the_blocked_path_drops_the_pairs_the_reference_drops(problem, tile, seed):
    from cupyflash import blocked

    q, k, v, do, kw = problem
    kw = dict(kw, dropout_p=0.4, seed=seed)
    want = attention_forward(q, k, v, **kw)
    got = blocked.forward(q, k, v, block_r=tile[0], block_c=tile[1], **kw)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-13)
    want = attention_backward(do, q, k, v, *want, **kw)
    got = blocked.backward(do, q, k, v, *got, block_r=tile[0], block_c=tile[1], **kw)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-12 * max(1.0, np.abs(w).max()))


def test_a_word_at_the_threshold_is_kept():
    """Pair (0, 0) of entry 0 under seed 0 draws word 0 of Philox at counter 0, key 0 (0x6627E8D5, the
    first known answer): kept at p = that / 2^32 (threshold equal to the word), dropped one step above."""
    from cupyflash._philox import dropout_keep

    word = 0x6627E8D5
    assert dropout_keep(0, word / 2**32, (1,), 1, 1)[0, 0, 0]
    assert not dropout_keep(0, (word + 1) / 2**32, (1,), 1, 1)[0, 0, 0]


# ---------------------------------------------------------------------------
# Merging partial attentions (issue #18's ground truth)

@settings(max_examples=80, deadline=None)
@given(st.integers(1, 6), st.integers(1, 12), st.integers(1, 4), st.integers(1, 4), st.booleans(),
       st.integers(0, 2**32 - 1))
def test_merging_the_parts_of_a_key_set_gives_its_attention(n_q, n_k, n_parts, d, causal, seed):
    """Keys split into n_parts disjoint sets (by a mask, any split; some parts empty for some rows):
    the merge of the parts' (o, m, l) is the whole's, and with the merged statistics each part's
    backward gives its keys' dK, dV and its share of dQ, which sum to the whole backward's."""
    from cupyflash.reference import merge_attention

    rng = np.random.default_rng(seed)
    q, k, v, do = (rng.standard_normal(s) for s in ((H, n_q, d), (H, n_k, d), (H, n_k, d), (H, n_q, d)))
    owner = rng.integers(0, n_parts, size=n_k)          # which part holds each key
    whole = attention_forward(q, k, v, causal=causal)
    parts = [attention_forward(q, k, v, causal=causal, mask=np.broadcast_to(owner == p, (n_q, n_k)))
             for p in range(n_parts)]
    merged = merge_attention(parts)
    for name, g, w in zip("oml", merged, whole):
        assert np.array_equal(np.isinf(g), np.isinf(w)), name
        finite = np.isfinite(w)
        np.testing.assert_allclose(g[finite], w[finite], rtol=1e-12, atol=1e-14, err_msg=name)
    full = attention_backward(do, q, k, v, *whole, causal=causal)
    shares = [attention_backward(do, q, k, v, *merged, causal=causal, mask=np.broadcast_to(owner == p, (n_q, n_k)))
              for p in range(n_parts)]
    np.testing.assert_allclose(sum(s[0] for s in shares), full[0], rtol=1e-10, atol=1e-12)
    for p, s in enumerate(shares):
        mine = owner == p
        np.testing.assert_allclose(s[1][:, mine], full[1][:, mine], rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(s[2][:, mine], full[2][:, mine], rtol=1e-10, atol=1e-12)
        assert not s[1][:, ~mine].any() and not s[2][:, ~mine].any()


def test_empty_parts_add_nothing_and_a_row_no_part_saw_is_empty():
    from cupyflash.reference import merge_attention

    rng = np.random.default_rng(9)
    q, k, v = (rng.standard_normal((n, 3)) for n in (4, 5, 5))
    part = attention_forward(q, k, v)
    empty = (np.zeros((4, 3)), np.full(4, -np.inf), np.zeros(4))
    for g, w in zip(merge_attention([empty, part, empty]), part):
        np.testing.assert_allclose(g, w, rtol=1e-15, atol=0)
    o, m, l = merge_attention([empty, empty])
    assert not o.any() and (m == -np.inf).all() and not l.any()
    with pytest.raises(ValueError, match="at least one"):
        merge_attention([])


def test_a_non_finite_value_in_one_part_reaches_the_merged_rows_that_saw_it():
    from cupyflash.reference import merge_attention

    rng = np.random.default_rng(10)
    q, k, v = (rng.standard_normal((n, 3)) for n in (4, 6, 6))
    v[4, 0] = np.nan
    first, second = (attention_forward(q, k[s], v[s]) for s in (slice(0, 3), slice(3, 6)))
    o, m, l = merge_attention([first, second])
    assert np.isnan(o[:, 0]).all() and np.isfinite(o[:, 1:]).all() and np.isfinite(m).all() and np.isfinite(l).all()
