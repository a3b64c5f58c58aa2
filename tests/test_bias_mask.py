"""``bias`` (with ``bias_grad``) and ``mask`` on every path: the NumPy path and the validation on the
CPU, every GPU kernel (V1, V2, the Hopper forward and backwards, the non-finite repair) against the
float64 reference, plain and packed (varlen).

The final score of query ``i`` and key ``j`` is ``s + bias_ij`` (after the softcap and ALiBi), and a
pair whose ``mask_ij`` is False is hidden exactly like one outside the causal mask or the window: no
term at all, even where its key or value is not finite. ``dbias`` is ``dS = P o (dP - D)`` summed
over the dims along which the bias broadcasts.
"""

import math

import numpy
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import cupyflash
from cupyflash import _launch, reference
from helpers import DTYPE_BY_NAME, assert_refused, gpu_test, random_inputs, to_gpu
from strategies import attention_problem_shapes
from test_gpu import check_backward, check_forward
from test_window import SCHEDULES, WINDOWS, assert_float64_close
from tolerances import _softmax_rows

# how a per-pair array broadcasts against (*batch, Nq, Nk)
PAIR_KINDS = ("full", "shared", "heads", "keys", "rows", "strided", "vector")


def pair_shape(kind, batch, n_q, n_k):
    """The shape of a per-pair array of ``kind`` (``strided``: full, laid out keys-major; ``vector``: 1-D,
    one value per key)."""
    return {"full": (*batch, n_q, n_k), "shared": (n_q, n_k), "heads": (*batch[-1:], n_q, n_k),
            "keys": (*batch, 1, n_k), "rows": (n_q, 1), "strided": (*batch, n_q, n_k), "vector": (n_k,)}[kind]


def pair_array(kind, batch, n_q, n_k, rng, dtype, is_mask):
    """A bias (values around the scores' range, in ``dtype``) or a mask (about 70% visible) of ``kind``;
    ``strided`` is a transposed view, so its key stride is not 1."""
    shape = pair_shape(kind, batch, n_q, n_k)
    if kind == "strided":
        shape = (*shape[:-2], shape[-1], shape[-2])
    x = rng.random(shape) < 0.7 if is_mask else rng.standard_normal(shape).astype(DTYPE_BY_NAME[dtype])
    return numpy.swapaxes(x, -1, -2) if kind == "strided" else x


@st.composite
def pair_mods(draw):
    """(bias kind, mask kind): either may be None, not both."""
    bias = draw(st.sampled_from((None, *PAIR_KINDS)))
    mask = draw(st.sampled_from((None, *PAIR_KINDS)) if bias is not None else st.sampled_from(PAIR_KINDS))
    return bias, mask


def drawn_pairs(kinds, dtype, q_shape, kv_shape, rng):
    batch = numpy.broadcast_shapes(q_shape[:-2], kv_shape[:-2])
    n_q, n_k = q_shape[-2], kv_shape[-2]
    mods = {}
    if kinds[0] is not None:
        mods["bias"] = pair_array(kinds[0], batch, n_q, n_k, rng, dtype, False)
    if kinds[1] is not None:
        mods["mask"] = pair_array(kinds[1], batch, n_q, n_k, rng, dtype, True)
    return mods


# ---------------------------------------------------------------------------
# CPU: the NumPy path, the checks, the dbias buffers


@settings(deadline=None, max_examples=40)
@given(attention_problem_shapes(), WINDOWS, pair_mods(), st.integers(0, 2**32 - 1), st.sampled_from([None, 3.0]))
@example(("float64", (2, 3, 113, 64), (2, 3, 200, 64), True, None), (None, None), ("heads", "keys"), 0, 3.0)
def test_numpy_path_takes_bias_and_mask(problem, window, kinds, seed, softcap):
    """The API's NumPy path equals the float64 reference with any bias and mask, dbias included."""
    _, q_shape, kv_shape, causal, scale = problem
    rng = numpy.random.default_rng(seed)
    q, k, v = random_inputs(rng, "float64", q_shape, kv_shape)
    kw = dict(causal=causal, softmax_scale=scale, window=window, softcap=softcap,
              **drawn_pairs(kinds, "float64", q_shape, kv_shape, rng))
    out = cupyflash.flash_attention_forward(q, k, v, **kw)
    refs = reference.attention_forward(q, k, v, **kw)
    do = rng.standard_normal(out[0].shape)
    grad_kw = dict(kw, bias_grad="bias" in kw)
    grads = cupyflash.flash_attention_backward(do, q, k, v, *out, **grad_kw)
    ref_grads = reference.attention_backward(do, q, k, v, *refs, **grad_kw)
    assert len(grads) == len(ref_grads) == 3 + ("bias" in kw)
    for name, got, ref in zip(("o", "m", "l", "dq", "dk", "dv", "dbias"), (*out, *grads), (*refs, *ref_grads)):
        assert_float64_close(name, got, ref)
    if "bias" in kw:
        assert grads[3].shape == numpy.shape(kw["bias"])


def test_a_mask_hides_pairs_exactly_and_a_minus_inf_bias_keeps_their_terms():
    """Worked values: a hidden key's NaN value does not reach o; a -inf bias gives its pair zero weight
    but 0 · NaN is NaN; a row the mask hides entirely has o = 0, m = -inf, l = 0 and no gradient."""
    q = numpy.array([[[1.0, 0.0], [0.0, 1.0]]])            # (1, 2, 2)
    k = numpy.array([[[1.0, 0.0], [2.0, 0.0]]])
    v = numpy.array([[[1.0, 2.0], [numpy.nan, 0.0]]])
    mask = numpy.array([[True, False], [False, False]])
    o, m, l = cupyflash.flash_attention_forward(q, k, v, softmax_scale=1.0, mask=mask)
    numpy.testing.assert_array_equal(o[0], [[1.0, 2.0], [0.0, 0.0]])
    assert m[0, 0] == 1.0 and l[0, 0] == 1.0 and m[0, 1] == -numpy.inf and l[0, 1] == 0
    bias = numpy.array([[0.0, -numpy.inf], [0.0, 0.0]])
    o, m, l = cupyflash.flash_attention_forward(q, k, v, softmax_scale=1.0, bias=bias)
    assert numpy.isnan(o[0, 0, 0]) and o[0, 0, 1] == 2.0
    v[0, 1, 0] = 5.0
    o, m, l = cupyflash.flash_attention_forward(q, k, v, softmax_scale=1.0, mask=mask, bias=numpy.ones((1, 2)))
    dq, dk, dv, dbias = cupyflash.flash_attention_backward(numpy.ones_like(o), q, k, v, o, m, l, softmax_scale=1.0,
                                                           mask=mask, bias=numpy.ones((1, 2)), bias_grad=True)
    assert not dq[0, 1].any() and not dv[0, 1].any()       # nothing sees key 1; row 1 sees nothing
    assert dbias.shape == (1, 2) and dbias[0, 1] == 0      # a single visible pair: dS = P (dP - D) = 0
    assert dbias[0, 0] == pytest.approx(0.0, abs=1e-15)


BAD = [
    (dict(bias=numpy.ones((2, 10, 12))), ValueError, "bias of shape (2, 10, 12) does not broadcast to (*batch,"),
    (dict(bias=numpy.ones((2, 3, 10, 13))), ValueError, "does not broadcast"),
    (dict(bias=numpy.ones((4, 2, 3, 10, 12))), ValueError, "does not broadcast"),
    (dict(bias=numpy.array([["a"] * 12] * 10)), TypeError, "bias must hold real numbers"),
    (dict(mask=numpy.ones((10, 12))), TypeError, "mask must be a bool array"),
    (dict(mask=numpy.ones((10, 11), bool)), ValueError, "mask of shape (10, 11) does not broadcast"),
    (dict(mask=object()), TypeError, "mask must be a bool array"),
]


@pytest.mark.parametrize("kw, error, words", BAD)
@pytest.mark.parametrize("call", ["forward", "backward", "flash_attention", "varlen"])
def test_bad_bias_and_masks_are_refused_naming_the_argument(kw, error, words, call):
    assert_refused(call, error, words, **kw)


def test_bias_grad_needs_a_bias_and_a_bool():
    rng = numpy.random.default_rng(0)
    q, k, v = random_inputs(rng, "float32", (2, 10, 8), (2, 12, 8))
    o, m, l = cupyflash.flash_attention_forward(q, k, v)
    with pytest.raises(ValueError, match="bias_grad=True needs a bias"):
        cupyflash.flash_attention_backward(o, q, k, v, o, m, l, bias_grad=True)
    with pytest.raises(TypeError, match="bias_grad"):
        cupyflash.flash_attention_backward(o, q, k, v, o, m, l, bias=numpy.zeros((10, 12)), bias_grad="yes")


def test_inputs_bias_and_mask_are_not_modified():
    rng = numpy.random.default_rng(1)
    q, k, v = random_inputs(rng, "float32", (2, 3, 20, 8), (2, 3, 30, 8))
    bias = rng.standard_normal((3, 20, 30)).astype(numpy.float32)
    mask = rng.random((2, 1, 20, 30)) < 0.5
    before = [x.copy() for x in (q, k, v, bias, mask)]
    kw = dict(bias=bias, mask=mask, causal=True)
    out = cupyflash.flash_attention_forward(q, k, v, **kw)
    cupyflash.flash_attention_backward(out[0], q, k, v, *out, bias_grad=True, **kw)
    for a, b in zip(before, (q, k, v, bias, mask)):
        assert a.tobytes() == b.tobytes()


@settings(deadline=None, max_examples=25)
@given(st.lists(st.integers(0, 40), min_size=1, max_size=4), st.lists(st.integers(0, 40), min_size=1, max_size=4),
       st.sampled_from(["full", "heads", "keys", "shared"]), st.integers(0, 2**32 - 1), st.booleans())
def test_numpy_path_of_packed_sequences_takes_bias_and_mask(lens_q, lens_k, kind, seed, causal):
    """Packed sequences read their own block of the packed pairs; dbias between sequences is 0."""
    n = min(len(lens_q), len(lens_k))
    cu_q, cu_k = (numpy.concatenate([[0], numpy.cumsum(x[:n])]) for x in (lens_q, lens_k))
    rng = numpy.random.default_rng(seed)
    q, k, v = random_inputs(rng, "float64", (2, int(cu_q[-1]), 16), (2, int(cu_k[-1]), 16))
    batch, n_q, n_k = (2,), int(cu_q[-1]), int(cu_k[-1])
    kw = dict(causal=causal, bias=pair_array(kind, batch, n_q, n_k, rng, "float64", False),
              mask=pair_array(kind, batch, n_q, n_k, rng, "float64", True))
    out = cupyflash.flash_attention_varlen_forward(q, k, v, cu_q, cu_k, **kw)
    refs = reference.attention_varlen_forward(q, k, v, cu_q, cu_k, **kw)
    do = rng.standard_normal(out[0].shape)
    grads = cupyflash.flash_attention_varlen_backward(do, q, k, v, *out, cu_q, cu_k, bias_grad=True, **kw)
    ref_grads = reference.attention_varlen_backward(do, q, k, v, *refs, cu_q, cu_k, bias_grad=True, **kw)
    for name, got, ref in zip(("o", "m", "l", "dq", "dk", "dv", "dbias"), (*out, *grads), (*refs, *ref_grads)):
        assert_float64_close(name, got, ref)


@pytest.mark.parametrize("bias_shape, batch, deterministic, shape, add, to", [
    ((2, 3, 5, 7), (2, 3), False, (2, 3, 5, 7), False, None),     # one writer per element: stores
    ((3, 5, 7), (1, 3), True, (3, 5, 7), False, None),            # batch (1, 3): still one writer
    ((3, 5, 7), (2, 3), False, (3, 5, 7), True, None),            # shared by the batch entries: atomics
    ((2, 3, 1, 7), (2, 3), False, (2, 3, 1, 7), True, None),      # shared by the rows
    ((3, 5, 7), (2, 3), True, (2, 3, 5, 7), False, (3, 5, 7)),    # deterministic: in full, then summed
])
def test_dbias_buffers_store_where_one_writes_and_add_where_several_do(bias_shape, batch, deterministic, shape, add,
                                                                       to):
    buf = _launch.dbias_buffer(bias_shape, batch, 5, 7, deterministic)
    assert (buf.shape, buf.add, buf.to) == (shape, add, to)


# ---------------------------------------------------------------------------
# GPU: every kernel against the reference

GPU_SETTINGS = settings(deadline=None, max_examples=25,
                        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


@gpu_test
@SCHEDULES
@GPU_SETTINGS
@given(attention_problem_shapes(), WINDOWS, pair_mods(), st.integers(0, 2**32 - 1), st.sampled_from([None, 5.0]))
@example(("float16", (2, 4, 1023, 128), (2, 1, 1023, 128), True, None), (None, None), ("heads", "keys"), 0, None)
@example(("bfloat16", (2, 3, 700, 64), (2, 1, 900, 64), False, None), (257, None), ("strided", None), 1, 5.0)
@example(("float16", (1, 2, 513, 200), (1, 2, 513, 200), True, None), (None, None), ("full", "rows"), 2, None)
@example(("float32", (3, 300, 64), (3, 280, 64), False, 0.5), (None, None), (None, "strided"), 3, None)
@example(("float64", (2, 250, 40), (2, 330, 40), True, None), (30, None), ("keys", "full"), 4, 5.0)
@example(("float16", (2, 4, 300, 256), (2, 4, 300, 256), False, None), (None, None), ("shared", "shared"), 5, None)
def test_forward_with_bias_and_mask_matches_reference(gpu_schedule, problem, window, kinds, seed, softcap):
    dtype, q_shape, kv_shape, causal, scale = problem
    rng = numpy.random.default_rng(seed)
    q, k, v = random_inputs(rng, dtype, q_shape, kv_shape)
    check_forward(dtype, q, k, v, causal, scale, gpu_schedule, window, softcap=softcap,
                  **drawn_pairs(kinds, dtype, q_shape, kv_shape, rng))


def assert_dbias_close(got, ref, terms, dtype):
    """dbias against the reference, relative to the largest sum of its terms' magnitudes ``terms``
    (``dbias_terms``): a sum may cancel to nothing (a bias along the rows only sums P (dP - D) over
    each row, which is 0), and its error is that of its terms (o, from which D is taken, is rounded
    to the input dtype)."""
    tol = {"float16": 2e-2, "bfloat16": 6e-2, "float32": 1e-4, "float64": 1e-10}[dtype]
    scale = max(terms.max(initial=0.0), 1e-30)
    numpy.testing.assert_allclose(got / scale, ref / scale, atol=tol, rtol=0)


def dbias_terms(do, v, P, bias_shape):
    """Per element of a bias of ``bias_shape``, the sum of the magnitudes of the terms of the dS_ij it
    adds up, before they cancel: P_ij (|dO_i| . |v_j| + |D_i|) (``P``: the reference's probabilities,
    float64), as ``tolerances.gradient_magnitudes`` bounds dS for dq and dk."""
    from cupyflash._numpy_ops import unbroadcast

    do, v = (numpy.asarray(x, numpy.float64) for x in (do, v))
    D = numpy.abs((do * (P @ v)).sum(-1, keepdims=True))
    return unbroadcast(P * (numpy.abs(do) @ numpy.swapaxes(numpy.abs(v), -1, -2) + D), bias_shape)


@gpu_test
@SCHEDULES
@GPU_SETTINGS
@given(attention_problem_shapes(), WINDOWS, pair_mods(), st.integers(0, 2**32 - 1), st.booleans(),
       st.sampled_from([None, 5.0]))
@example(("float16", (2, 4, 1023, 128), (2, 1, 1023, 128), True, None), (None, None), ("heads", "keys"), 0, False,
         None)
@example(("bfloat16", (2, 3, 700, 64), (2, 1, 900, 64), False, None), (257, None), ("strided", None), 1, True, 5.0)
@example(("bfloat16", (1, 2, 513, 200), (1, 2, 513, 200), True, None), (None, None), ("full", "rows"), 2, True, None)
@example(("float16", (1, 2, 513, 200), (1, 2, 513, 200), True, None), (None, None), ("keys", None), 2, False, 5.0)
@example(("float32", (3, 300, 64), (3, 280, 64), False, 0.5), (None, None), ("rows", "strided"), 3, False, None)
@example(("float64", (2, 250, 40), (2, 330, 40), True, None), (30, None), ("keys", "full"), 4, True, 5.0)
@example(("float16", (2, 4, 300, 256), (2, 4, 300, 256), False, None), (None, None), ("shared", "shared"), 5, False,
         None)
@example(("float16", (2, 3, 700, 64), (2, 3, 650, 64), False, None), (None, None), ("full", "keys"), 6, False, None)
@example(("bfloat16", (1, 2, 600, 256), (1, 2, 640, 256), True, None), (None, None), ("heads", "keys"), 7, True, None)
def test_backward_with_bias_and_mask_matches_reference(gpu_schedule, problem, window, kinds, seed, deterministic,
                                                       softcap):
    """dq, dk, dv by the twice-naive rule; dbias against the reference."""
    import cupy

    dtype, q_shape, kv_shape, causal, scale = problem
    rng = numpy.random.default_rng(seed)
    q, k, v = random_inputs(rng, dtype, q_shape, kv_shape)
    pairs = drawn_pairs(kinds, dtype, q_shape, kv_shape, rng)
    check_backward(dtype, q, k, v, causal, scale, rng, gpu_schedule, window, deterministic, softcap=softcap, **pairs)
    if "bias" not in pairs:
        return
    kw = dict(causal=causal, softmax_scale=scale, window=window, softcap=softcap, **pairs)
    schedule = "v1" if gpu_schedule == "v1" else "v2"
    o, m, l = cupyflash.flash_attention_forward(*to_gpu(q, k, v), schedule=schedule, **kw)
    do = rng.standard_normal(o.shape).astype(DTYPE_BY_NAME[dtype])
    *_, dbias = cupyflash.flash_attention_backward(cupy.asarray(do), *to_gpu(q, k, v), o, m, l, schedule=schedule,
                                                   deterministic=deterministic, bias_grad=True, **kw)
    refs = reference.attention_forward(q, k, v, **kw)
    *_, ref = reference.attention_backward(do, q, k, v, *refs, bias_grad=True, **kw)
    assert dbias.shape == numpy.shape(pairs["bias"]) and dbias.dtype == m.dtype
    P = _softmax_rows(q, k, causal, 1 / math.sqrt(q.shape[-1]) if scale is None else scale, window,
                      softcap=softcap, **pairs)
    assert_dbias_close(dbias.get(), ref, dbias_terms(do, v, P, ref.shape), dtype)


@gpu_test
@pytest.mark.parametrize("schedule", ["v1", "v2", "v2-mma"])
@pytest.mark.parametrize("dtype, D", [("float16", 64), ("bfloat16", 200), ("float32", 96), ("float64", 32)])
def test_packed_sequences_with_bias_and_mask_match_the_reference(schedule, dtype, D, monkeypatch):
    """varlen reads each sequence's block of the packed pairs (dbias 0 between sequences)."""
    import cupy

    monkeypatch.setattr(_launch, "USE_WGMMA", schedule != "v2-mma")
    rng = numpy.random.default_rng(6)
    cu_q, cu_k = numpy.array([0, 130, 130, 400], numpy.int32), numpy.array([0, 70, 200, 390], numpy.int32)
    q, k, v = random_inputs(rng, dtype, (2, 400, D), (2, 390, D))
    bias = rng.standard_normal((400, 390)).astype(DTYPE_BY_NAME[dtype])
    mask = rng.random((2, 1, 390)) < 0.8
    kw = dict(causal=True, bias=bias, mask=mask)
    o, m, l = cupyflash.flash_attention_varlen_forward(*to_gpu(q, k, v), cu_q, cu_k, schedule=schedule[:2],
                                                       bias=cupy.asarray(bias), mask=cupy.asarray(mask), causal=True)
    refs = reference.attention_varlen_forward(q, k, v, cu_q, cu_k, **kw)
    tol = {"float16": 3e-3, "bfloat16": 2e-2, "float32": 1e-5, "float64": 1e-12}[dtype]
    for got, ref in zip((o, m, l), refs):
        numpy.testing.assert_allclose(got.get().astype(numpy.float64), ref, rtol=tol, atol=tol)
    do = rng.standard_normal(o.shape).astype(DTYPE_BY_NAME[dtype])
    grads = cupyflash.flash_attention_varlen_backward(cupy.asarray(do), *to_gpu(q, k, v), o, m, l, cu_q, cu_k,
                                                      schedule=schedule[:2], bias_grad=True, **kw)
    ref_grads = reference.attention_varlen_backward(do, q, k, v, *refs, cu_q, cu_k, bias_grad=True, **kw)
    for got, ref in zip(grads[:3], ref_grads[:3]):
        scale = numpy.abs(ref).max()
        numpy.testing.assert_allclose(got.get().astype(numpy.float64) / scale, ref / scale, atol=10 * tol)
    full = dict(kw, bias=numpy.broadcast_to(bias, (2, 400, 390)))   # dS itself: the terms dbias sums
    *_, dS = reference.attention_varlen_backward(do, q, k, v, *refs, cu_q, cu_k, bias_grad=True, **full)
    assert_dbias_close(grads[3].get(), ref_grads[3], numpy.abs(dS).sum(axis=0), dtype)
    assert not grads[3].get()[:130, 70:].any()   # pairs between sequences


@gpu_test
@pytest.mark.parametrize("schedule", ["v1", "v2", "v2-mma"])
@pytest.mark.parametrize("dtype, D", [("float16", 64), ("float16", 200), ("float32", 64), ("float64", 40)])
@pytest.mark.parametrize("where", ["k", "v"])
def test_a_hidden_key_or_value_that_is_not_finite_reaches_nothing(schedule, dtype, D, where, monkeypatch):
    """The exact-masked-pairs rule under a mask: NaN and inf in keys and values that the mask hides from
    some rows reach only the rows that see them (the repair kernels redo the rest), in o and in every
    gradient; dbias of hidden pairs is 0."""
    import cupy

    monkeypatch.setattr(_launch, "USE_WGMMA", schedule != "v2-mma")
    rng = numpy.random.default_rng(9)
    q, k, v = random_inputs(rng, dtype, (2, 2, 300, D), (2, 2, 280, D))
    bad = {"k": k, "v": v}[where]
    bad[0, 1, 17, 3] = numpy.nan
    bad[1, 0, 200, 0] = numpy.inf
    mask = rng.random((300, 280)) < 0.9
    mask[:, 17] = mask[:, 200] = False
    mask[5, 17] = mask[250, 200] = True                  # rows 5 and 250 see them
    bias = rng.standard_normal((2, 1, 300, 280)).astype(DTYPE_BY_NAME[dtype])
    kw = dict(mask=mask, bias=bias)
    o, m, l = cupyflash.flash_attention_forward(*to_gpu(q, k, v), schedule=schedule[:2], mask=cupy.asarray(mask),
                                                bias=cupy.asarray(bias))
    refs = reference.attention_forward(q, k, v, **kw)
    o = o.get().astype(numpy.float64)
    numpy.testing.assert_array_equal(numpy.isfinite(o), numpy.isfinite(refs[0]))
    do = rng.standard_normal(o.shape).astype(DTYPE_BY_NAME[dtype])
    grads = cupyflash.flash_attention_backward(cupy.asarray(do), *to_gpu(q, k, v), cupy.asarray(o.astype(q.dtype)),
                                               m, l, schedule=schedule[:2], bias_grad=True, **kw)
    ref_grads = reference.attention_backward(do, q, k, v, *refs, bias_grad=True, **kw)
    for got, ref in zip(grads, ref_grads):
        numpy.testing.assert_array_equal(numpy.isfinite(got.get().astype(numpy.float64)), numpy.isfinite(ref))
    assert not grads[3].get()[..., ~mask].any()


@gpu_test
@pytest.mark.parametrize("where", ["cupy", "numpy", "float32-for-float16", "strided", "peeled", "1d"])
def test_bias_of_any_kind_and_layout_gives_the_reference(where):
    """A bias as a CuPy array read in place, a NumPy array (moved), another dtype (converted), a strided
    view with a zero stride (read in place), with more than three batch dims that do not merge (peeled),
    and a 1-D key bias."""
    import cupy

    rng = numpy.random.default_rng(3)
    q_shape, kv_shape = (2, 3, 100, 64), (2, 3, 140, 64)
    bias = rng.standard_normal((3, 100, 140)).astype(numpy.float16)
    if where == "peeled":   # q (2, 1, 3, 2, N, D) against k, v (1, 2, 1, 2, N, D): four batch dims
        q_shape, kv_shape = (2, 1, 3, 2, 100, 64), (1, 2, 1, 2, 140, 64)
        bias = rng.standard_normal((2, 1, 3, 1, 100, 140)).astype(numpy.float16)
    if where == "1d":
        bias = rng.standard_normal(140).astype(numpy.float16)
    q, k, v = random_inputs(rng, "float16", q_shape, kv_shape)
    if where == "strided":   # a zero key stride (one value per row, broadcast along the keys)
        bias = numpy.broadcast_to(bias[:, :, :1], bias.shape)
        given = cupy.broadcast_to(cupy.asarray(bias[:, :, :1]), bias.shape)
    else:
        convert = {"numpy": lambda x: x, "float32-for-float16": lambda x: cupy.asarray(x, "float32")}
        given = convert.get(where, cupy.asarray)(bias)
    kw = dict(causal=True, softcap=5.0)
    o, m, l = cupyflash.flash_attention_forward(*to_gpu(q, k, v), bias=given, **kw)
    o_ref, m_ref, l_ref = reference.attention_forward(q, k, v, bias=bias, **kw)
    numpy.testing.assert_allclose(m.get(), m_ref, atol=2e-2)
    numpy.testing.assert_allclose(l.get(), l_ref, rtol=2e-2)
    numpy.testing.assert_allclose(o.get().astype(numpy.float64), o_ref, atol=2e-2)
    do = cupy.asarray(rng.standard_normal(o.shape).astype(numpy.float16))
    grads = cupyflash.flash_attention_backward(do, *to_gpu(q, k, v), o, m, l, bias=given, bias_grad=True, **kw)
    refs = reference.attention_backward(do.get(), q, k, v, o_ref, m_ref, l_ref, bias=bias, bias_grad=True, **kw)
    assert grads[3].shape == given.shape
    for got, ref in zip(grads, refs):
        scale = numpy.abs(ref).max()
        numpy.testing.assert_allclose(got.get().astype(numpy.float64) / scale, ref / scale, atol=2e-2)


@gpu_test
@pytest.mark.parametrize("dtype, D", [("float16", 64), ("bfloat16", 128), ("float16", 200), ("float32", 64)])
@pytest.mark.parametrize("bias_shape", [(3, 500, 700), (2, 1, 1, 700)])
def test_deterministic_dbias_is_bitwise_reproducible(dtype, D, bias_shape):
    """deterministic=True with a bias that broadcasts: dbias (written in full, summed by CuPy) and every
    gradient have the same bits run to run."""
    import cupy

    rng = numpy.random.default_rng(5)
    q, k, v = (cupy.asarray(rng.standard_normal(s).astype(DTYPE_BY_NAME[dtype]))
               for s in ((2, 3, 500, D), (2, 1, 700, D), (1, 3, 700, D)))
    bias = cupy.asarray(rng.standard_normal(bias_shape).astype(DTYPE_BY_NAME[dtype]))
    mask = cupy.asarray(rng.random((500, 700)) < 0.9)
    kw = dict(causal=True, bias=bias, mask=mask)
    o, m, l = cupyflash.flash_attention_forward(q, k, v, **kw)
    do = cupy.asarray(rng.standard_normal(q.shape).astype(DTYPE_BY_NAME[dtype]))
    runs = [[g.get() for g in cupyflash.flash_attention_backward(do, q, k, v, o, m, l, deterministic=True,
                                                                 bias_grad=True, **kw)] for _ in range(3)]
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            assert a.tobytes() == b.tobytes()
