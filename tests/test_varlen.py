"""Packed variable-length sequences: ``flash_attention_varlen_forward`` / ``_backward``.

CPU: the NumPy path against the naive float64 reference (``reference.attention_varlen_*``), the
offsets' validation, inputs unmodified. GPU: every kernel (V1, V2, the Hopper forward and both
Hopper backwards, the portable backward; the repair after a masked NaN) on packed sequences equals
the same kernels run on each sequence alone (which the other GPU tests hold to the reference), with
empty sequences, sequences without keys, GQA broadcasting, windows and the modifiers; and a few
points against the reference itself.
"""

import numpy
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import cupyflash
from cupyflash import reference
from helpers import DTYPE_BY_NAME, gpu_test, to_gpu
from test_window import SCHEDULES
from tolerances import ELEMENT_TOL, ORDER_RTOL, assert_close

VARIANTS = st.sampled_from([
    {}, {"causal": True}, {"window": (7, 3)}, {"causal": True, "window": (40, None)}, {"window": (None, 0)},
    {"softcap": 3.0, "alibi": True}, {"causal": True, "sink": True}, {"causal": True, "softcap": 5.0, "alibi": True, "sink": True},
])


def packed_lengths(rng, n, longest, empty=True):
    """``n`` lengths up to ``longest``, some 0 where ``empty``, as int32 offsets."""
    lengths = rng.integers(0 if empty else 1, longest + 1, n)
    return numpy.concatenate([[0], numpy.cumsum(lengths)]).astype(numpy.int32)


def problem(rng, dtype, batch_q, batch_kv, D, n, longest_q, longest_k, variant):
    """q, k, v, the offsets and the keywords of a packed problem."""
    cq, ck = packed_lengths(rng, n, longest_q), packed_lengths(rng, n, longest_k)
    cast = DTYPE_BY_NAME[dtype]
    q = rng.standard_normal((*batch_q, int(cq[-1]), D)).astype(cast)
    k, v = (rng.standard_normal((*batch_kv, int(ck[-1]), D)).astype(cast) for _ in range(2))
    batch = numpy.broadcast_shapes(batch_q, batch_kv)
    kw = {key: value for key, value in variant.items() if key not in ("alibi", "sink")}
    if variant.get("alibi"):
        kw["alibi_slopes"] = rng.uniform(0.01, 0.3, batch[-1:]).astype(numpy.float32)
    if variant.get("sink"):
        kw["sink"] = rng.standard_normal(batch[-1:]).astype(numpy.float32)
    return q, k, v, cq, ck, kw


# ---------------------------------------------------------------------------
# CPU


@settings(deadline=None, max_examples=25)
@given(st.sampled_from(["float64", "float32"]), st.integers(1, 4), VARIANTS, st.integers(0, 2**32 - 1))
def test_numpy_path_matches_the_reference(dtype, n, variant, seed):
    rng = numpy.random.default_rng(seed)
    q, k, v, cq, ck, kw = problem(rng, dtype, (2, 3), (2, 1), 16, n, 40, 50, variant)
    o, m, l = cupyflash.flash_attention_varlen_forward(q, k, v, cq, ck, **kw)
    ro, rm, rl = reference.attention_varlen_forward(q, k, v, cq, ck, **kw)
    for name, got, ref in (("o", o, ro), ("m", m, rm), ("l", l, rl)):
        assert_close(name, got, ref, dtype)
    do = rng.standard_normal(o.shape).astype(q.dtype)
    grads = cupyflash.flash_attention_varlen_backward(do, q, k, v, o, m, l, cq, ck, **kw)
    refs = reference.attention_varlen_backward(do, q, k, v, o, m, l, cq, ck, **kw)
    assert len(grads) == len(refs)
    for name, got, ref in zip(("dq", "dk", "dv", "dsink"), grads, refs):
        assert got.shape == ref.shape, name
        numpy.testing.assert_allclose(got, ref, rtol=ELEMENT_TOL[dtype] * 10, atol=ELEMENT_TOL[dtype] * 10,
                                      err_msg=name)


def test_each_sequence_sees_only_its_own_keys():
    """A worked case: two sequences, each row's output is its own sequence's attention, and a
    sequence without keys gets o = 0, m = -inf, l = 0."""
    rng = numpy.random.default_rng(1)
    q, k, v = (rng.standard_normal((1, n, 8)) for n in (6, 7, 7))
    cq, ck = numpy.array([0, 2, 5, 6]), numpy.array([0, 4, 7, 7])
    o, m, l = cupyflash.flash_attention_varlen_forward(q, k, v, cq, ck, causal=True)
    for (a, b), (c, d) in (((0, 2), (0, 4)), ((2, 5), (4, 7))):
        ro, rm, rl = reference.attention_forward(q[:, a:b], k[:, c:d], v[:, c:d], causal=True)
        numpy.testing.assert_allclose(o[:, a:b], ro, atol=1e-12)
        numpy.testing.assert_allclose(m[:, a:b], rm, atol=1e-12)
    assert (o[:, 5] == 0).all() and m[0, 5] == -numpy.inf and l[0, 5] == 0


X = numpy.zeros((2, 5, 8))


@pytest.mark.parametrize("cq, ck, extra, error, words", [
    ([0, 2, 5], [0, 3], {}, ValueError, "same number of sequences"),
    ([1, 2, 5], [0, 2, 5], {}, ValueError, "start at 0"),
    ([0, 3, 2, 5], [0, 1, 2, 5], {}, ValueError, "not decrease"),
    ([0, 2, 4], [0, 2, 5], {}, ValueError, "end at 5"),
    ([[0, 5]], [[0, 5]], {}, ValueError, "1-D integer"),
    (numpy.array([0.0, 5.0]), [0, 5], {}, ValueError, "integer"),
    ([0, 5], [0, 5], {"max_seqlen_q": 4}, ValueError, "max_seqlen_q=4"),
    ([0, 5], [0, 5], {"max_seqlen_k": 2.5}, TypeError, "max_seqlen_k must be an int"),
    ("05", [0, 5], {}, TypeError, "cu_seqlens_q must be a numpy.ndarray"),
])
@pytest.mark.parametrize("call", ["forward", "backward"])
def test_bad_offsets_are_refused_naming_the_argument(cq, ck, extra, error, words, call):
    cq = numpy.asarray(cq) if isinstance(cq, list) else cq
    ck = numpy.asarray(ck)
    with pytest.raises(error, match=words):
        if call == "forward":
            cupyflash.flash_attention_varlen_forward(X, X, X, cq, ck, **extra)
        else:
            m = numpy.zeros((2, 5))
            cupyflash.flash_attention_varlen_backward(X, X, X, X, X, m, m, cq, ck, **extra)


def test_inputs_and_offsets_are_not_modified():
    rng = numpy.random.default_rng(2)
    q, k, v, cq, ck, kw = problem(rng, "float32", (2,), (2,), 16, 3, 20, 20, {"causal": True, "sink": True})
    before = [x.copy() for x in (q, k, v, cq, ck, kw["sink"])]
    o, m, l = cupyflash.flash_attention_varlen_forward(q, k, v, cq, ck, **kw)
    cupyflash.flash_attention_varlen_backward(o, q, k, v, o, m, l, cq, ck, **kw)
    for a, b in zip(before, (q, k, v, cq, ck, kw["sink"])):
        numpy.testing.assert_array_equal(a, b)


# ---------------------------------------------------------------------------
# GPU

GPU_SETTINGS = settings(deadline=None, max_examples=30, suppress_health_check=[HealthCheck.function_scoped_fixture])


def assert_same(name, got, alone, dtype):
    """Packed and alone agree: infinities and NaNs where the other has them, finite values within a
    summation order's rounding (``ORDER_RTOL``) of the largest."""
    got, alone = (numpy.asarray(x, numpy.float64) for x in (got, alone))
    assert got.shape == alone.shape, name
    assert (numpy.isnan(got) == numpy.isnan(alone)).all(), name
    finite = numpy.isfinite(alone)
    assert (got[~finite & ~numpy.isnan(alone)] == alone[~finite & ~numpy.isnan(alone)]).all(), name
    scale = max(1.0, numpy.abs(alone[finite]).max(initial=0))
    err = numpy.abs(got[finite] - alone[finite]).max(initial=0)
    assert err <= ORDER_RTOL[dtype] * scale, f"{name}: {err:.3e} > {ORDER_RTOL[dtype]:.0e} x {scale:.3g}"


def run_packed(q, k, v, cq, ck, do, kw, schedule, deterministic, offsets="numpy"):
    """Forward and backward of the packed problem on the GPU, as NumPy arrays."""
    import cupy

    qg, kg, vg, dog = to_gpu(q, k, v, do)
    extra = {}
    if offsets == "cupy":
        cq, ck = cupy.asarray(cq), cupy.asarray(ck)
        extra = dict(max_seqlen_q=int(numpy.diff(cq.get()).max(initial=0)), max_seqlen_k=int(numpy.diff(ck.get()).max(initial=0)))
    kw = {key: (cupy.asarray(x) if isinstance(x, numpy.ndarray) else x) for key, x in kw.items()}
    o, m, l = cupyflash.flash_attention_varlen_forward(qg, kg, vg, cq, ck, **kw, **extra, schedule=schedule)
    grads = cupyflash.flash_attention_varlen_backward(dog, qg, kg, vg, o, m, l, cq, ck, **kw, **extra,
                                                      schedule=schedule, deterministic=deterministic)
    return [x.get() for x in (o, m, l, *grads)]


def run_alone(q, k, v, cq, ck, do, kw, schedule, deterministic):
    """The same, each sequence alone through flash_attention_forward / _backward, put together."""
    import cupy

    kw = {key: (cupy.asarray(x) if isinstance(x, numpy.ndarray) else x) for key, x in kw.items()}
    out = None
    for s in range(len(cq) - 1):
        rq, rk = slice(int(cq[s]), int(cq[s + 1])), slice(int(ck[s]), int(ck[s + 1]))
        qg, kg, vg, dog = to_gpu(*(numpy.ascontiguousarray(x) for x in (q[..., rq, :], k[..., rk, :], v[..., rk, :],
                                                                         do[..., rq, :])))
        o, m, l = cupyflash.flash_attention_forward(qg, kg, vg, **kw, schedule=schedule)
        grads = cupyflash.flash_attention_backward(dog, qg, kg, vg, o, m, l, **kw, schedule=schedule,
                                                   deterministic=deterministic)
        parts = [x.get() for x in (o, m, l, *grads)]
        if out is None:
            batch = numpy.broadcast_shapes(q.shape[:-2], k.shape[:-2])
            out = [numpy.zeros((*batch, q.shape[-2], q.shape[-1]), parts[0].dtype),
                   numpy.zeros((*batch, q.shape[-2]), parts[1].dtype), numpy.zeros((*batch, q.shape[-2]), parts[2].dtype),
                   numpy.zeros(q.shape, q.dtype), numpy.zeros(k.shape, k.dtype), numpy.zeros(v.shape, v.dtype)]
            out += [numpy.zeros_like(g) for g in parts[6:]]
        out[0][..., rq, :], out[1][..., rq], out[2][..., rq] = parts[:3]
        out[3][..., rq, :], out[4][..., rk, :], out[5][..., rk, :] = parts[3:6]
        for total, g in zip(out[6:], parts[6:]):
            total += g
    return out


NAMES = ("o", "m", "l", "dq", "dk", "dv", "dsink")


@gpu_test
@SCHEDULES
@GPU_SETTINGS
@given(st.sampled_from(["float16", "bfloat16", "float32", "float64"]), st.sampled_from([16, 64, 128, 200, 256]),
       st.integers(1, 5), VARIANTS, st.booleans(), st.booleans(), st.integers(0, 2**32 - 1))
@example("float16", 64, 4, {"causal": True}, False, False, 0)
@example("bfloat16", 128, 3, {}, True, True, 1)
@example("float16", 256, 3, {"causal": True, "window": (40, None)}, True, False, 2)
@example("float32", 64, 2, {"window": (7, 3)}, False, True, 3)
@example("float64", 128, 3, {"causal": True, "softcap": 5.0, "alibi": True, "sink": True}, True, False, 4)
def test_packed_sequences_equal_each_sequence_alone(gpu_schedule, dtype, D, n, variant, gqa, deterministic, seed):
    rng = numpy.random.default_rng(seed)
    q, k, v, cq, ck, kw = problem(rng, dtype, (2, 3), (2, 1) if gqa else (2, 3), D, n, 300, 300, variant)
    do = rng.standard_normal((*numpy.broadcast_shapes(q.shape[:-2], k.shape[:-2]), q.shape[-2], D)).astype(q.dtype)
    packed = run_packed(q, k, v, cq, ck, do, kw, gpu_schedule, deterministic)
    alone = run_alone(q, k, v, cq, ck, do, kw, gpu_schedule, deterministic)
    assert len(packed) == len(alone)
    for name, got, ref in zip(NAMES, packed, alone):
        assert_same(name, got, ref, dtype)


@gpu_test
@pytest.mark.parametrize("dtype, D, causal", [("float16", 64, True), ("bfloat16", 128, False), ("float32", 32, True),
                                              ("float64", 96, False), ("float16", 256, True)])
def test_packed_sequences_match_the_reference(dtype, D, causal):
    rng = numpy.random.default_rng(D)
    q, k, v, cq, ck, kw = problem(rng, dtype, (2, 2), (2, 2), D, 4, 200, 260, {"causal": causal})
    do = rng.standard_normal(q.shape).astype(q.dtype)
    got = run_packed(q, k, v, cq, ck, do, kw, "auto", False, offsets="cupy")
    ro, rm, rl = reference.attention_varlen_forward(q, k, v, cq, ck, **kw)
    for name, g, r in zip("oml", got[:3], (ro, rm, rl)):
        assert_close(name, g, r, dtype)
    refs = reference.attention_varlen_backward(do, q, k, v, got[0], got[1], got[2], cq, ck, **kw)
    for name, g, r in zip(("dq", "dk", "dv"), got[3:], refs):
        scale = numpy.abs(r).max()
        assert numpy.abs(g - r).max() <= 20 * ELEMENT_TOL[dtype] * scale, name


@gpu_test
@pytest.mark.parametrize("schedule", ["v1", "v2"])
def test_a_nan_stays_in_its_sequence_and_its_visible_pairs(schedule):
    """A NaN key of one sequence reaches no other sequence; inside its own, under a causal mask, only
    the rows that see it (the repair of masked pairs runs per sequence)."""
    rng = numpy.random.default_rng(5)
    q, k, v, cq, ck, kw = problem(rng, "float16", (1, 2), (1, 2), 64, 3, 200, 200, {"causal": True})
    cq, ck = numpy.array([0, 150, 300, 420], numpy.int32), numpy.array([0, 150, 300, 420], numpy.int32)
    q, k, v = (numpy.resize(x, (1, 2, 420, 64)) for x in (q, k, v))
    k[..., 200, :] = numpy.nan   # key 50 of sequence 1: rows 50.. of it see it
    v[..., 210, :] = numpy.inf
    do = rng.standard_normal(q.shape).astype(q.dtype)
    packed = run_packed(q, k, v, cq, ck, do, kw, schedule, False)
    alone = run_alone(q, k, v, cq, ck, do, kw, schedule, False)
    for name, got, ref in zip(NAMES, packed, alone):
        assert_same(name, got, ref, "float16")
    assert numpy.isfinite(packed[0][..., :150, :]).all() and numpy.isfinite(packed[0][..., 300:, :]).all()
    assert numpy.isfinite(packed[0][..., 150:200, :]).all()   # rows before the NaN key do not see it


@gpu_test
def test_cupy_offsets_with_both_maxima_keep_a_plan_and_give_the_same():
    import cupy

    from cupyflash import _launch

    rng = numpy.random.default_rng(6)
    q, k, v, cq, ck, kw = problem(rng, "bfloat16", (2, 4), (2, 1), 128, 5, 300, 300, {"causal": True})
    do = rng.standard_normal((2, 4, q.shape[-2], 128)).astype(q.dtype)
    with_numpy = run_packed(q, k, v, cq, ck, do, kw, "auto", True)
    _launch.PLANS.clear()
    with_cupy = run_packed(q, k, v, cq, ck, do, kw, "auto", True, offsets="cupy")
    assert len(_launch.PLANS) == 2   # the forward's and the backward's
    again = run_packed(q, k, v, cq, ck, do, kw, "auto", True, offsets="cupy")
    assert len(_launch.PLANS) == 2
    for name, a, b, c in zip(NAMES, with_numpy, with_cupy, again):
        numpy.testing.assert_array_equal(a, b, err_msg=name)
        numpy.testing.assert_array_equal(b, c, err_msg=name)
    with pytest.raises(TypeError, match="NumPy"):
        cupyflash.flash_attention_varlen_forward(q, k, v, cupy.asarray(cq), ck)
