"""Dropout (``dropout_p``, ``seed``) on every path: the keep set (``cupyflash.dropout_mask``, the NumPy
definition in ``cupyflash._philox`` and the kernels' ``philox.cuh``), the NumPy path and the validation
on the CPU, every GPU kernel against the float64 reference with the same keep set.

A pair is dropped with probability ``p`` by a counter-based draw of (seed, flat batch index, i, j): the
kept set is the same on any tiling, schedule, kernel or GPU, and the backward drops what the forward
dropped. ``m``, ``l`` are the statistics before dropout.
"""

import math

import numpy
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cupyflash
from cupyflash import _philox, blocked, reference
from cupyflash._checks import seed_value
from helpers import DTYPE_BY_NAME, assert_refused, gpu_test, random_inputs, to_gpu
from strategies import attention_problem_shapes
from test_window import SCHEDULES, WINDOWS, assert_float64_close
import tolerances

# ---------------------------------------------------------------------------
# CPU: the keep set, the NumPy path, the checks


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_the_keep_rate_is_one_minus_p(p):
    """Over 2^20 pairs the kept share is 1 - p within five standard deviations, in every batch entry,
    row block and key residue mod 4 (each Philox word)."""
    keep = cupyflash.dropout_mask(12345, p, (4,), 512, 512)
    n = keep.size
    assert abs(keep.mean() - (1 - p)) < 5 * math.sqrt(p * (1 - p) / n)
    for part in (keep[0], keep[:, :128], keep[..., 1::4]):
        assert abs(part.mean() - (1 - p)) < 5 * math.sqrt(p * (1 - p) / part.size)


def test_the_keep_set_depends_on_seed_entry_row_and_key_only():
    """dropout_mask is _philox.dropout_keep; a tile of it is the tile drawn alone; another seed or
    another batch entry draws another set."""
    keep = cupyflash.dropout_mask(7, 0.3, (2, 3), 70, 90)
    numpy.testing.assert_array_equal(keep, _philox.dropout_keep(7, 0.3, (2, 3), 70, 90))
    tile = _philox.dropout_keep(7, 0.3, (2, 3), 70, 90, range(16, 48), range(33, 90))
    numpy.testing.assert_array_equal(keep[..., 16:48, 33:90], tile)
    assert (keep != cupyflash.dropout_mask(8, 0.3, (2, 3), 70, 90)).mean() > 0.3
    assert (keep[0, 0] != keep[0, 1]).mean() > 0.3
    assert cupyflash.dropout_mask(None, 0.0, (2,), 5, 6).all()


@settings(deadline=None, max_examples=30)
@given(attention_problem_shapes(), WINDOWS, st.sampled_from([0.1, 0.5]), st.integers(0, 2**64 - 1))
def test_numpy_path_takes_dropout(problem, window, p, seed):
    """The NumPy path equals the float64 reference with dropout; m, l are those without it."""
    _, q_shape, kv_shape, causal, scale = problem
    rng = numpy.random.default_rng(seed % 2**32)
    q, k, v = random_inputs(rng, "float64", q_shape, kv_shape)
    kw = dict(causal=causal, softmax_scale=scale, window=window, dropout_p=p, seed=seed)
    out = cupyflash.flash_attention_forward(q, k, v, **kw)
    refs = reference.attention_forward(q, k, v, **kw)
    plain = reference.attention_forward(q, k, v, causal=causal, softmax_scale=scale, window=window)
    do = rng.standard_normal(out[0].shape)
    grads = cupyflash.flash_attention_backward(do, q, k, v, *out, **kw)
    ref_grads = reference.attention_backward(do, q, k, v, *refs, **kw)
    for name, got, ref in zip(("o", "m", "l", "dq", "dk", "dv"), (*out, *grads), (*refs, *ref_grads)):
        assert_float64_close(name, got, ref)
    assert_float64_close("m", out[1], plain[1])
    assert_float64_close("l", out[2], plain[2])


def test_the_blocked_path_drops_the_same_pairs_on_any_tiling():
    rng = numpy.random.default_rng(2)
    q, k, v = random_inputs(rng, "float32", (2, 130, 32), (2, 150, 32))
    kw = dict(dropout_p=0.4, seed=99, causal=True)
    a = blocked.forward(q, k, v, block_r=16, block_c=32, **kw)
    b = blocked.forward(q, k, v, block_r=64, block_c=16, **kw)
    for x, y in zip(a, b):
        numpy.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kw, error, words", [
    (dict(dropout_p=1.0, seed=1), ValueError, "dropout_p must satisfy 0 <= p < 1"),
    (dict(dropout_p=-0.1, seed=1), ValueError, "dropout_p must satisfy 0 <= p < 1"),
    (dict(dropout_p=0.5), ValueError, "needs an int seed"),
    (dict(dropout_p=0.5, seed=2**64), ValueError, "needs an int seed"),
    (dict(dropout_p=0.5, seed=1.5), ValueError, "needs an int seed"),
    (dict(dropout_p=0.5, seed=True), ValueError, "needs an int seed"),
    (dict(dropout_p=0.5, seed=numpy.zeros(3, numpy.uint32)), ValueError, "got an array of shape (3,), dtype uint32"),
    (dict(dropout_p=0.5, seed=numpy.zeros(2, numpy.int32)), ValueError, "got an array of shape (2,), dtype int32"),
    (dict(dropout_p=1 - 2**-40, seed=1), ValueError, "dropout_p must be below 1 - 2^-33"),
    (dict(dropout_p=True, seed=1), TypeError, "dropout_p must be a real number"),
    (dict(dropout_p="0.1", seed=1), TypeError, "dropout_p must be a real number"),
])
@pytest.mark.parametrize("call", ["forward", "backward", "flash_attention", "varlen"])
def test_bad_dropout_is_refused_naming_the_argument(kw, error, words, call):
    assert_refused(call, error, words, **kw)


@pytest.mark.parametrize("call", ["forward", "backward"])
def test_a_seed_held_in_an_array_drops_what_its_int_drops(call):
    """A seed given as one uint64 or as two uint32 words (the low one first, jax.random.key_data's layout)
    is the int they hold: the NumPy path gives the same bits."""
    rng = numpy.random.default_rng(6)
    q, k, v = random_inputs(rng, "float32", (2, 3, 40, 16), (2, 3, 50, 16))
    do = rng.standard_normal(q.shape).astype(numpy.float32)
    seed = 0x0123456789ABCDEF
    held = (numpy.array([seed], numpy.uint64), numpy.array([seed & 0xFFFFFFFF, seed >> 32], numpy.uint32),
            numpy.array([[seed & 0xFFFFFFFF], [seed >> 32]], numpy.uint32))

    def run(s):
        o, m, l = cupyflash.flash_attention_forward(q, k, v, causal=True, dropout_p=0.3, seed=s)
        if call == "forward":
            return o, m, l
        return cupyflash.flash_attention_backward(do, q, k, v, o, m, l, causal=True, dropout_p=0.3, seed=s)

    want = run(seed)
    for s in held:
        for x, y in zip(run(s), want):
            assert x.tobytes() == y.tobytes()
    assert not numpy.array_equal(run(seed + 1)[0], want[0])
    assert seed_value(held[1]) == seed


@settings(deadline=None, max_examples=20)
@given(st.lists(st.integers(0, 40), min_size=1, max_size=4), st.lists(st.integers(0, 40), min_size=1, max_size=4),
       st.integers(0, 2**64 - 1), st.booleans())
def test_packed_sequences_drop_on_packed_rows_and_their_own_keys(lens_q, lens_k, seed, causal):
    """Dropout over packed sequences keys on the packed query rows and each sequence's own keys: the NumPy
    path equals the reference, and sequence s's output is that of its own problem with rows
    cu_q[s].. and keys 0.. of the keep set."""
    n = min(len(lens_q), len(lens_k))
    cu_q, cu_k = (numpy.concatenate([[0], numpy.cumsum(x[:n])]) for x in (lens_q, lens_k))
    rng = numpy.random.default_rng(seed % 2**32)
    q, k, v = random_inputs(rng, "float64", (2, int(cu_q[-1]), 16), (2, int(cu_k[-1]), 16))
    kw = dict(causal=causal, dropout_p=0.3, seed=seed)
    out = cupyflash.flash_attention_varlen_forward(q, k, v, cu_q, cu_k, **kw)
    refs = reference.attention_varlen_forward(q, k, v, cu_q, cu_k, **kw)
    do = rng.standard_normal(out[0].shape)
    grads = cupyflash.flash_attention_varlen_backward(do, q, k, v, *out, cu_q, cu_k, **kw)
    ref_grads = reference.attention_varlen_backward(do, q, k, v, *refs, cu_q, cu_k, **kw)
    for name, got, ref in zip(("o", "m", "l", "dq", "dk", "dv"), (*out, *grads), (*refs, *ref_grads)):
        assert_float64_close(name, got, ref)
    keep = cupyflash.dropout_mask(seed, 0.3, (2,), int(cu_q[-1]), int(max(numpy.diff(cu_k), default=0)))
    for s in range(n):
        rq, rk = slice(cu_q[s], cu_q[s + 1]), slice(cu_k[s], cu_k[s + 1])
        if rq.stop > rq.start and rk.stop > rk.start:
            P = reference.attention_forward(q[:, rq], k[:, rk], numpy.eye(rk.stop - rk.start)[None], causal=causal)[0]
            own = keep[:, rq, :rk.stop - rk.start]
            numpy.testing.assert_allclose(out[0][:, rq], P * own / 0.7 @ v[:, rk], atol=1e-12)


# ---------------------------------------------------------------------------
# GPU: every kernel against the reference, with the same keep set

GPU_SETTINGS = settings(deadline=None, max_examples=20,
                        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
TOL = {"float16": 2e-2, "bfloat16": 6e-2, "float32": 1e-4, "float64": 1e-10}


def assert_close_to(name, got, ref, dtype, size=0.0):
    """``got`` against the float64 reference, relative to the reference's largest magnitude or ``size``,
    the largest size of its terms, where that is larger (a gradient that cancels to 0, dq with one key,
    is rounding noise over noise otherwise)."""
    got = numpy.asarray(got, numpy.float64)
    scale = max(numpy.abs(ref[numpy.isfinite(ref)]).max(initial=0.0), size, 1e-30)
    numpy.testing.assert_allclose(got / scale, ref / scale, atol=TOL[dtype], rtol=0, err_msg=name)


@gpu_test
def test_the_gpu_draws_the_same_keep_set():
    import cupy

    for shape, p in (((2, 3), 0.3), ((5,), 0.9), ((), 0.01)):
        got = cupyflash.dropout_mask(2**63 + 5, p, shape, 77, 130, xp=cupy)
        numpy.testing.assert_array_equal(got.get(), cupyflash.dropout_mask(2**63 + 5, p, shape, 77, 130))


@gpu_test
@SCHEDULES
@GPU_SETTINGS
@given(attention_problem_shapes(), WINDOWS, st.sampled_from([0.1, 0.5]), st.integers(0, 2**64 - 1), st.booleans(),
       st.sampled_from([None, 5.0]))
def test_dropout_on_every_kernel_matches_the_reference(gpu_schedule, problem, window, p, seed, deterministic,
                                                       softcap):
    """o, m, l and the gradients with dropout (and a softcap) against the float64 reference with the same
    keep set: the kernels drop exactly the pairs `dropout_mask` names."""
    import cupy

    dtype, q_shape, kv_shape, causal, scale = problem
    rng = numpy.random.default_rng(seed % 2**32)
    q, k, v = random_inputs(rng, dtype, q_shape, kv_shape)
    kw = dict(causal=causal, softmax_scale=scale, window=window, softcap=softcap, dropout_p=p, seed=seed)
    schedule = "v1" if gpu_schedule == "v1" else "v2"
    o, m, l = cupyflash.flash_attention_forward(*to_gpu(q, k, v), schedule=schedule, **kw)
    refs = reference.attention_forward(q, k, v, **kw)
    for name, got, ref in zip(("o", "m", "l"), (o, m, l), refs):
        assert_close_to(name, got.get(), ref, dtype)
    do = rng.standard_normal(o.shape).astype(DTYPE_BY_NAME[dtype])
    grads = cupyflash.flash_attention_backward(cupy.asarray(do), *to_gpu(q, k, v), o, m, l, schedule=schedule,
                                               deterministic=deterministic, **kw)
    ref_grads = reference.attention_backward(do, q, k, v, o.get(), m.get(), l.get(), **kw)
    sizes = gradient_term_sizes(do, q, k, v, causal, scale, window, p, softcap=softcap)
    for name, got, ref, size in zip(("dq", "dk", "dv"), grads, ref_grads, sizes):
        assert_close_to(name, got.get(), ref, dtype, size)


def gradient_term_sizes(do, q, k, v, causal, scale, window, p, **mods):
    """The largest size of a term of dq, dk, dv under dropout ``p``, whatever the keep set: with
    |Z o P / (1 - p)| <= P / (1 - p) and |D_i| <= sum_j P_ij |dO_i| |v_j| / (1 - p), dS_ij is bounded by
    P_ij (|dO_i| |v_j| + sum_j' P_ij' |dO_i| |v_j'|) / (1 - p) (the softcap's factor is at most 1)."""
    do, q, k, v = (numpy.asarray(x, numpy.float64) for x in (do, q, k, v))
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    P = tolerances._softmax_rows(q, k, causal, scale, window, **mods)
    dov = numpy.abs(do) @ numpy.swapaxes(numpy.abs(v), -1, -2)
    dS = P * (dov + (P * dov).sum(-1, keepdims=True)) / (1 - p)
    sizes = (scale * dS @ numpy.abs(k), scale * numpy.swapaxes(dS, -1, -2) @ numpy.abs(q),
             numpy.swapaxes(P, -1, -2) @ numpy.abs(do) / (1 - p))
    return [float(x.max(initial=0.0)) for x in sizes]


@gpu_test
@pytest.mark.parametrize("dtype, D", [("float16", 64), ("bfloat16", 128), ("float16", 200), ("float32", 64)])
def test_a_deterministic_backward_with_dropout_is_bitwise_reproducible(dtype, D):
    import cupy

    rng = numpy.random.default_rng(4)
    q, k, v = (cupy.asarray(rng.standard_normal(s).astype(DTYPE_BY_NAME[dtype]))
               for s in ((2, 3, 300, D), (2, 1, 400, D), (1, 3, 400, D)))
    kw = dict(causal=True, dropout_p=0.2, seed=2024)
    o, m, l = cupyflash.flash_attention_forward(q, k, v, **kw)
    do = cupy.asarray(rng.standard_normal(q.shape).astype(DTYPE_BY_NAME[dtype]))
    runs = [[g.get() for g in cupyflash.flash_attention_backward(do, q, k, v, o, m, l, deterministic=True, **kw)]
            for _ in range(3)]
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            assert a.tobytes() == b.tobytes()


@gpu_test
def test_dropout_counts_batch_entries_across_peeled_dims():
    """More than three batch dims that do not merge are computed piece by piece: each piece draws with
    the flat batch index of the whole call."""
    rng = numpy.random.default_rng(5)
    q, k, v = random_inputs(rng, "float32", (2, 1, 3, 2, 60, 32), (1, 2, 1, 2, 70, 32))
    kw = dict(dropout_p=0.3, seed=11)
    o, m, l = cupyflash.flash_attention_forward(*to_gpu(q, k, v), **kw)
    assert_close_to("o", o.get(), reference.attention_forward(q, k, v, **kw)[0], "float32")


@gpu_test
@pytest.mark.parametrize("schedule", ["v1", "v2", "v2-mma"])
@pytest.mark.parametrize("dtype, D", [("float16", 64), ("bfloat16", 200), ("float32", 96)])
def test_packed_sequences_with_dropout_match_the_reference(schedule, dtype, D, monkeypatch):
    import cupy
    from cupyflash import _launch

    monkeypatch.setattr(_launch, "USE_WGMMA", schedule != "v2-mma")
    rng = numpy.random.default_rng(6)
    cu_q, cu_k = numpy.array([0, 130, 130, 400], numpy.int32), numpy.array([0, 70, 201, 390], numpy.int32)
    q, k, v = random_inputs(rng, dtype, (2, 400, D), (2, 390, D))
    kw = dict(causal=True, dropout_p=0.25, seed=77)
    o, m, l = cupyflash.flash_attention_varlen_forward(*to_gpu(q, k, v), cu_q, cu_k, schedule=schedule[:2], **kw)
    refs = reference.attention_varlen_forward(q, k, v, cu_q, cu_k, **kw)
    for name, got, ref in zip(("o", "m", "l"), (o, m, l), refs):
        assert_close_to(name, got.get(), ref, dtype)
    do = rng.standard_normal(o.shape).astype(DTYPE_BY_NAME[dtype])
    grads = cupyflash.flash_attention_varlen_backward(cupy.asarray(do), *to_gpu(q, k, v), o, m, l, cu_q, cu_k,
                                                      schedule=schedule[:2], **kw)
    ref_grads = reference.attention_varlen_backward(do, q, k, v, o.get(), m.get(), l.get(), cu_q, cu_k, **kw)
    for name, got, ref in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert_close_to(name, got.get(), ref, dtype)


@gpu_test
@pytest.mark.parametrize("schedule", ["auto", "v1", "v2-mma"])
def test_a_device_seed_is_read_as_the_kernels_run(schedule, monkeypatch):
    """A CuPy seed (two uint32 words, the low one first) drops what its int drops, forward and backward;
    rewritten between calls, the kept plan reads the new value; and a captured forward + backward,
    replayed after the array was rewritten, drops the new seed's set."""
    import cupy

    from cupyflash import _launch

    monkeypatch.setattr(_launch, "USE_WGMMA", schedule != "v2-mma")
    schedule = "v2" if schedule == "v2-mma" else schedule
    rng = numpy.random.default_rng(7)
    q, k, v = to_gpu(*random_inputs(rng, "float16", (2, 3, 200, 64), (2, 3, 230, 64)))
    do = cupy.asarray(rng.standard_normal(q.shape).astype(numpy.float16))
    words = lambda s: cupy.asarray(numpy.array([s & 0xFFFFFFFF, s >> 32], numpy.uint32))   # noqa: E731
    kw = dict(causal=True, dropout_p=0.25, schedule=schedule)

    def step(seed, fwd_out=None, bwd_out=None):
        o, m, l = cupyflash.flash_attention_forward(q, k, v, seed=seed, out=fwd_out, **kw)
        return (o, m, l), cupyflash.flash_attention_backward(do, q, k, v, o, m, l, seed=seed, out=bwd_out,
                                                             deterministic=True, **kw)   # bits comparable

    def assert_same(a, b):
        for x, y in zip((*a[0], *a[1]), (*b[0], *b[1])):
            assert x.tobytes() == y.tobytes()

    device_seed = words(2**40 + 17)
    assert_same(step(device_seed), step(2**40 + 17))
    device_seed[...] = words(99)
    assert_same(step(device_seed), step(99))

    fwd_out = tuple(cupy.empty_like(x) for x in step(99)[0])
    bwd_out = tuple(cupy.empty_like(x) for x in (q, k, v))
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        step(device_seed, fwd_out, bwd_out)   # plans outside the capture
        stream.synchronize()
        stream.begin_capture()
        try:
            step(device_seed, fwd_out, bwd_out)
        finally:
            graph = stream.end_capture()
        device_seed[...] = words(12345)
        graph.launch(stream)
        stream.synchronize()
    assert_same((fwd_out, bwd_out), step(12345))
