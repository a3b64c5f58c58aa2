"""Reliability on the GPU (skipped cleanly without one): streams, threads, memory, scale, fuzzing.

What is promised is stated in docs/guarantees.md; each test here checks one
promise against the float64 reference or against the same call run alone.
"""

import math
import threading

import numpy
import pytest
from hypothesis import HealthCheck, given, settings

import cupyflash
from cupyflash import reference
from helpers import (DTYPE_BY_NAME, assert_non_finite_rules, forward_contract_errors, random_inputs, requires_gpu,
                     to_gpu)
from strategies import gpu_forward_calls
from tolerances import ORDER_RTOL, assert_close, fuzz_tolerance

pytestmark = requires_gpu


def check_forward_against_reference(q, k, v, outputs, causal=False):
    o_ref, m_ref, l_ref = reference.attention_forward(q, k, v, causal=causal)
    name = numpy.dtype(q.dtype).name
    for label, got, ref in zip("oml", outputs, (o_ref, m_ref, l_ref)):
        assert_close(label, got.get(), ref, name)


# ---------------------------------------------------------------------------
# Streams and threads


def test_calls_launch_on_the_current_stream_and_never_synchronise():
    """Forward and backward on a non-blocking stream, with CuPy's synchronisation detector armed."""
    import cupy
    import cupyx

    rng = numpy.random.default_rng(1)
    q, k, v = random_inputs(rng, numpy.float16, (2, 3, 200, 64), (2, 3, 170, 64))
    qg, kg, vg = to_gpu(q, k, v)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream, cupyx.allow_synchronize(False):
        o, m, l = cupyflash.flash_attention_forward(qg, kg, vg, causal=True)
        grads = cupyflash.flash_attention_backward(o, qg, kg, vg, o, m, l, causal=True)
        done = cupy.cuda.Event()
        done.record(stream)
    done.synchronize()
    check_forward_against_reference(q, k, v, (o, m, l), causal=True)
    assert all(g.shape == x.shape for g, x in zip(grads, (q, k, v)))


def test_concurrent_streams_compute_what_one_stream_does():
    """Calls queued on four non-blocking streams at once give the bits (forward) and the
    gradients (to rounding: dQ is summed with atomics) of the same calls run one by one."""
    import cupy

    rng = numpy.random.default_rng(2)
    problems = [to_gpu(*random_inputs(rng, dt, (2, 4, n, 64), (2, 4, n + 30, 64)))
                for dt, n in ((numpy.float16, 300), (numpy.float16, 130), (numpy.float32, 90), (numpy.float64, 40))]

    def run(q, k, v):
        o, m, l = cupyflash.flash_attention_forward(q, k, v, causal=True)
        return (o, m, l), cupyflash.flash_attention_backward(o, q, k, v, o, m, l, causal=True)

    alone = [run(*p) for p in problems]
    cupy.cuda.Device().synchronize()
    streams = [cupy.cuda.Stream(non_blocking=True) for _ in problems]
    together = []
    for stream, p in zip(streams, problems):
        with stream:
            together.append(run(*p))
    for stream in streams:
        stream.synchronize()
    for (fwd_a, bwd_a), (fwd_t, bwd_t), p in zip(alone, together, problems):
        for a, t in zip(fwd_a, fwd_t):
            assert a.tobytes() == t.tobytes()
        name = numpy.dtype(p[0].dtype).name
        for a, t in zip(bwd_a, bwd_t):
            assert_close("grad", t.get(), a.get(), name)


def test_many_threads_at_once_first_use_included(monkeypatch):
    """Sixteen threads, each its own shape, dtype and schedule, start together on empty kernel and
    plan caches, so compilation and planning race; every result matches the reference."""
    from cupyflash import _compile, _launch

    monkeypatch.setattr(_compile, "_modules", {})
    monkeypatch.setattr(_launch, "PLANS", {})
    rng = numpy.random.default_rng(3)
    jobs = [(random_inputs(rng, dt, (2, n, d), (2, n + 7, d)), schedule)
            for dt in (numpy.float16, numpy.float32) for d in (40, 128) for n in (33, 150)
            for schedule in ("v1", "v2")]
    barrier = threading.Barrier(len(jobs), timeout=120)
    errors = []

    def work(arrays, schedule):
        try:
            q, k, v = to_gpu(*arrays)
            barrier.wait()
            outputs = cupyflash.flash_attention_forward(q, k, v, causal=True, schedule=schedule)
            check_forward_against_reference(*arrays, outputs, causal=True)
        except BaseException as error:  # noqa: BLE001 - reported below, with its thread's job
            errors.append((arrays[0].shape, arrays[0].dtype, schedule, error))

    threads = [threading.Thread(target=work, args=job) for job in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


# ---------------------------------------------------------------------------
# out= buffers


@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("kv_heads", [3, 1])   # 1: GQA, whose dK, dV are summed in workspaces
def test_out_buffers_on_the_gpu(dtype, kv_heads, monkeypatch):
    """Results land in the given buffers (forward bits equal to a call without them; gradients to
    rounding, dQ being summed with atomics), also through a kept plan, whose calls still refuse an
    out buffer that overlaps an input."""
    import cupy

    from cupyflash import _launch

    monkeypatch.setattr(_launch, "PLANS", {})
    rng = numpy.random.default_rng(10)
    q, k, v = to_gpu(*random_inputs(rng, dtype, (2, 3, 150, 64), (2, kv_heads, 170, 64)))
    expected = cupyflash.flash_attention_forward(q, k, v, causal=True)
    do = cupy.asarray(rng.standard_normal(expected[0].shape).astype(dtype))
    grads = cupyflash.flash_attention_backward(do, q, k, v, *expected, causal=True)
    for _ in range(2):   # the second call through the kept plans
        out = tuple(cupy.full(x.shape, cupy.nan, x.dtype) for x in expected)
        got = cupyflash.flash_attention_forward(q, k, v, causal=True, out=out)
        assert all(g is b for g, b in zip(got, out))
        for g, e in zip(got, expected):
            assert g.tobytes() == e.tobytes()
        out = tuple(cupy.full(x.shape, cupy.nan, x.dtype) for x in (q, k, v))
        got = cupyflash.flash_attention_backward(do, q, k, v, *expected, causal=True, out=out)
        assert all(g is b for g, b in zip(got, out))
        for g, e in zip(got, grads):
            assert_close("grad", g.get(), e.get(), dtype)
    with pytest.raises(ValueError, match="overlaps q"):
        cupyflash.flash_attention_forward(q, k, v, causal=True, out=(q, *expected[1:]))
    shifted = cupy.empty(expected[0].size + 1, expected[0].dtype)[1:].reshape(expected[0].shape)
    with pytest.raises(ValueError, match="16-byte boundary"):
        cupyflash.flash_attention_forward(q, k, v, causal=True, out=(shifted, *expected[1:]))


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_forward_and_backward_captured_in_a_cuda_graph(dtype):
    """With out= buffers, a forward + backward sequence (GQA: dK, dV summed in workspaces) captured
    on a non-blocking stream replays like eager calls, with new values in the captured inputs and
    the memory pool churned between replays."""
    import cupy

    from cupyflash._tiles import accumulator_dtype

    rng = numpy.random.default_rng(11)
    q, k, v = to_gpu(*random_inputs(rng, dtype, (2, 2, 2, 300, 64), (2, 2, 1, 260, 64)))
    do = cupy.asarray(rng.standard_normal(q.shape).astype(dtype))
    acc = accumulator_dtype(q.dtype)
    fwd_out = (cupy.empty(q.shape, q.dtype), cupy.empty(q.shape[:-1], acc), cupy.empty(q.shape[:-1], acc))
    bwd_out = tuple(cupy.empty(x.shape, x.dtype) for x in (q, k, v))

    def step():
        cupyflash.flash_attention_forward(q, k, v, causal=True, out=fwd_out)
        cupyflash.flash_attention_backward(do, q, k, v, *fwd_out, causal=True, out=bwd_out)

    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        step()   # compiles and plans outside the capture
        stream.synchronize()
        stream.begin_capture()
        try:
            step()
        finally:
            graph = stream.end_capture()
    for _ in range(2):
        with stream:
            for x in (q, k, v, do):
                x[...] = cupy.asarray(rng.standard_normal(x.shape).astype(dtype))
            churn = [cupy.full(n, cupy.nan, cupy.float32) for n in (1 << 22, 1 << 16, 333)]
            graph.launch(stream)
            del churn
        stream.synchronize()
        expected = cupyflash.flash_attention_forward(q, k, v, causal=True)
        grads = cupyflash.flash_attention_backward(do, q, k, v, *expected, causal=True)
        for got, ref in zip(fwd_out, expected):
            assert got.tobytes() == ref.tobytes()
        for got, ref in zip(bwd_out, grads):
            assert_close("grad", got.get(), ref.get(), dtype)


def test_a_capture_refuses_a_call_that_needs_temporaries():
    """A strided last axis would be copied into a pool array the graph could not keep: ValueError,
    raised before anything is enqueued."""
    import cupy

    rng = numpy.random.default_rng(12)
    q, k, v = to_gpu(*random_inputs(rng, numpy.float16, (2, 100, 64), (2, 90, 64)))
    strided_q = cupy.repeat(q, 2, axis=-1)[..., ::2]
    out = (cupy.empty(q.shape, q.dtype), cupy.empty(q.shape[:-1], cupy.float32), cupy.empty(q.shape[:-1], cupy.float32))
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        try:
            with pytest.raises(ValueError, match="CUDA graph capture"):
                cupyflash.flash_attention_forward(strided_q, k, v, out=out)
        finally:
            stream.end_capture()


# ---------------------------------------------------------------------------
# Determinism, memory and scale


@pytest.mark.parametrize("schedule", ["v1", "v2"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_forward_is_bitwise_reproducible(schedule, dtype):
    rng = numpy.random.default_rng(4)
    q, k, v = to_gpu(*random_inputs(rng, dtype, (3, 4, 700, 64), (3, 1, 900, 64)))
    runs = [cupyflash.flash_attention_forward(q, k, v, causal=True, schedule=schedule) for _ in range(3)]
    for later in runs[1:]:
        for a, b in zip(runs[0], later):
            assert a.tobytes() == b.tobytes()


@pytest.mark.parametrize("schedule", ["v1", "v2"])
@pytest.mark.parametrize("dtype, D", [("float16", 64), ("bfloat16", 128), ("float16", 62), ("float16", 200),
                                      ("bfloat16", 130), ("float16", 160), ("float32", 64), ("float64", 40)])
@pytest.mark.parametrize("causal", [False, True])
def test_deterministic_backward_is_bitwise_reproducible(schedule, dtype, D, causal):
    """deterministic=True: dQ summed over 8 K/V tiles (Hopper tiles at 16-bit under v2, D > 128 the wide
    kernel's; D = 62 and 130 take their atomics) and dK, dV over the query
    heads of a group (k broadcast along the heads, v along the batch) in one order: every run gives the
    same bits, within rounding of the unordered backward."""
    import cupy

    rng = numpy.random.default_rng(12)
    q, k, v = (cupy.asarray(rng.standard_normal(s).astype(DTYPE_BY_NAME[dtype]))
               for s in ((2, 3, 333, D), (2, 1, 1000, D), (1, 3, 1000, D)))
    o, m, l = cupyflash.flash_attention_forward(q, k, v, causal=causal, schedule=schedule)
    do = cupy.asarray(rng.standard_normal(q.shape).astype(DTYPE_BY_NAME[dtype]))
    runs = [cupyflash.flash_attention_backward(do, q, k, v, o, m, l, causal=causal, schedule=schedule,
                                               deterministic=True) for _ in range(4)]
    for later in runs[1:]:
        for a, b in zip(runs[0], later):
            assert a.tobytes() == b.tobytes()
    unordered = cupyflash.flash_attention_backward(do, q, k, v, o, m, l, causal=causal, schedule=schedule)
    for a, b in zip(runs[0], unordered):
        a, b = a.get().astype(numpy.float64), b.get().astype(numpy.float64)
        assert numpy.abs(a - b).max() <= ORDER_RTOL[dtype] * numpy.abs(b).max()


@pytest.mark.parametrize("schedule", ["v1", "v2", "v2-mma"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", ["q", "k", "v", "do"])
@pytest.mark.parametrize("head_dim", [64, 200])
def test_non_finite_inputs_reach_the_outputs_the_reference_says(schedule, dtype, causal, case, head_dim,
                                                                monkeypatch):
    """The non-finite rules (docs/semantics.md), on every kernel ("v2-mma": the portable V2 forward where the Hopper one would
    run; D = 200: the wide Hopper backward under "v2"): o, m, l and the gradients non-finite exactly where the
    mask-exact reference's are, masked pairs of a diagonal tile included; rows that see no key keep
    o = 0, m = -inf, l = 0 and dq = 0."""
    from cupyflash import _launch

    monkeypatch.setattr(_launch, "USE_WGMMA", schedule != "v2-mma")
    assert_non_finite_rules(dtype, causal, case, to_gpu, head_dim, schedule=schedule.split("-")[0])


@pytest.mark.parametrize("schedule", ["v1", "v2"])
@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("case", ["q", "k", "v", "do"])
@pytest.mark.parametrize("layout", ["kv_shared", "q_shared"])
def test_non_finite_inputs_with_shared_heads_reach_the_outputs_the_reference_says(schedule, dtype, case, layout):
    """The same rules, causal, with k, v shared by two query heads (their gradients summed over both, in
    the repair too) or q shared by two batch entries (dq summed over both)."""
    assert_non_finite_rules(dtype, True, case, to_gpu, layout=layout, schedule=schedule)


def test_a_call_too_big_for_the_gpu_raises_out_of_memory_and_the_next_call_works():
    """Broadcast views (stride 0) make inputs that cost nothing but outputs of about 1 TB: the
    allocation fails before any launch, and the process goes on."""
    import cupy

    free, _ = cupy.cuda.runtime.memGetInfo()
    D, N = 128, 4096
    batch = -(-4 * free // (N * D * 2))   # o alone would need four times the free memory
    q = cupy.broadcast_to(cupy.ones((1, N, D), cupy.float16), (batch, N, D))
    with pytest.raises(cupy.cuda.memory.OutOfMemoryError):
        cupyflash.flash_attention_forward(q, q, q)
    o1 = cupy.broadcast_to(cupy.ones((1, N, D), cupy.float16), (batch, N, D))
    m1 = cupy.broadcast_to(cupy.zeros((1, N), cupy.float32), (batch, N))
    with pytest.raises(cupy.cuda.memory.OutOfMemoryError):
        cupyflash.flash_attention_backward(o1, q, q, q, o1, m1, m1 + 1)
    rng = numpy.random.default_rng(5)
    arrays = random_inputs(rng, numpy.float16, (2, 100, 64), (2, 90, 64))
    check_forward_against_reference(*arrays, cupyflash.flash_attention_forward(*to_gpu(*arrays)))


@pytest.mark.parametrize("schedule", ["v1", "v2"])
def test_more_heads_than_a_grid_dimension_holds(schedule):
    """100000 heads of 8 queries: more CTAs than gridDim.y or .z could hold (65535)."""
    rng = numpy.random.default_rng(6)
    q, k, v = random_inputs(rng, numpy.float16, (100_000, 8, 32), (100_000, 12, 32))
    outputs = cupyflash.flash_attention_forward(*to_gpu(q, k, v), causal=True, schedule=schedule)
    check_forward_against_reference(q, k, v, outputs, causal=True)
    do = rng.standard_normal(q.shape).astype(numpy.float16)
    grads = cupyflash.flash_attention_backward(*to_gpu(do, q, k, v), *outputs, causal=True, schedule=schedule)
    refs = reference.attention_backward(do, q, k, v, *reference.attention_forward(q, k, v, causal=True), causal=True)
    for name, g, ref in zip(("dq", "dk", "dv"), grads, refs):
        assert_close(name, g.get(), ref, "float16")


def test_tensors_past_two_to_the_31_elements():
    """K and V of 2^31 elements each (1, 64, 262144, 128) with 4 queries per head: sampled heads
    against the reference, forward and backward (dK, dV sampled at rows across the whole length)."""
    import cupy

    n_k, heads, D = 262_144, 64, 128
    rng = cupy.random.default_rng(7)
    k = rng.standard_normal((1, heads, n_k, D), dtype=cupy.float32).astype(cupy.float16)
    v = rng.standard_normal((1, heads, n_k, D), dtype=cupy.float32).astype(cupy.float16)
    q = rng.standard_normal((1, heads, 4, D), dtype=cupy.float32).astype(cupy.float16)
    assert k.size == 2**31
    o, m, l = cupyflash.flash_attention_forward(q, k, v)
    do = rng.standard_normal(o.shape, dtype=cupy.float32).astype(cupy.float16)
    dq, dk, dv = cupyflash.flash_attention_backward(do, q, k, v, o, m, l)
    rows = numpy.array([0, 1, 77_777, 2**17 + 5, n_k - 1])
    for h in (0, 37, heads - 1):   # the last head's rows lie past 2^31 elements
        qh, kh, vh, doh = (x[0, h].get() for x in (q, k, v, do))
        o_ref, m_ref, l_ref = reference.attention_forward(qh, kh, vh)
        for name, got, ref in (("o", o[0, h], o_ref), ("m", m[0, h], m_ref), ("l", l[0, h], l_ref)):
            assert_close(name, got.get(), ref, "float16")
        dq_ref, dk_ref, dv_ref = reference.attention_backward(doh, qh, kh, vh, o_ref, m_ref, l_ref)
        assert_close("dq", dq[0, h].get(), dq_ref, "float16")
        assert_close("dk", dk[0, h, rows].get(), dk_ref[rows], "float16")
        assert_close("dv", dv[0, h, rows].get(), dv_ref[rows], "float16")


def test_a_sequence_of_262144_forward_and_backward_in_linear_memory():
    """B = H = 1, N = 262144, D = 64, causal: the pool grows by O(N) (a score matrix would be
    2^36 elements); sampled rows against the reference (dK, dV rows from the kernel's own lse and o,
    which are checked first)."""
    import cupy

    N, D = 262_144, 64
    scale = 1 / math.sqrt(D)
    rng = cupy.random.default_rng(8)
    q, k, v, do = (rng.standard_normal((1, 1, N, D), dtype=cupy.float32).astype(cupy.float16) for _ in range(4))
    pool = cupy.get_default_memory_pool()
    cupy.cuda.Device().synchronize()
    pool.free_all_blocks()
    before = pool.total_bytes()
    o, m, l = cupyflash.flash_attention_forward(q, k, v, causal=True)
    dq, dk, dv = cupyflash.flash_attention_backward(do, q, k, v, o, m, l, causal=True)
    cupy.cuda.Device().synchronize()
    assert pool.total_bytes() - before < 64 * N * D   # outputs, gradients, float32 workspaces: O(N D)

    qh, kh, vh, doh, oh = (x[0, 0].get().astype(numpy.float64) for x in (q, k, v, do, o))
    lse = (m[0, 0] + cupy.log(l[0, 0])).get().astype(numpy.float64)
    for i in (0, 1, 5000, N // 2 + 3, N - 1):   # rows i see keys 0..i
        s = kh[: i + 1] @ qh[i] * scale
        p = numpy.exp(s - s.max())
        o_ref = p @ vh[: i + 1] / p.sum()
        assert_close("o", oh[i], o_ref, "float16")
        assert_close("lse", lse[i], s.max() + math.log(p.sum()), "float32")
        dp = vh[: i + 1] @ doh[i]
        ds = p / p.sum() * (dp - doh[i] @ oh[i])
        assert_close("dq", dq[0, 0, i].get(), ds @ kh[: i + 1] * scale, "float16")
    d_sum = numpy.einsum("nd,nd->n", doh, oh)
    for j in (0, 3, N // 3, N - 2, N - 1):   # key j is seen by rows j..N-1
        s = qh[j:] @ kh[j] * scale
        p = numpy.exp(s - lse[j:])
        dp = doh[j:] @ vh[j]
        assert_close("dv", dv[0, 0, j].get(), p @ doh[j:], "float16")
        assert_close("dk", dk[0, 0, j].get(), (p * (dp - d_sum[j:])) @ qh[j:] * scale, "float16")


def test_arrays_on_another_device_run_there_and_mixed_devices_are_refused():
    import cupy

    if cupy.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs two GPUs")
    rng = numpy.random.default_rng(9)
    arrays = random_inputs(rng, numpy.float16, (2, 64, 64), (2, 80, 64))
    with cupy.cuda.Device(1):
        q, k, v = to_gpu(*arrays)
    with cupy.cuda.Device(0):
        o, m, l = cupyflash.flash_attention_forward(q, k, v)
        assert o.device.id == 1
        k0 = cupy.asarray(arrays[1])
        with pytest.raises(ValueError, match="different devices"):
            cupyflash.flash_attention_forward(q, k0, v)
    check_forward_against_reference(*arrays, (o, m, l))


# ---------------------------------------------------------------------------
# Fuzzing the GPU path: the arbitrary calls test_validation.py makes on the CPU (strategies.forward_calls),
# on CuPy arrays, some as strided views


def to_device(x, view):
    """``x`` on the GPU: as is, one element off the 16-byte grid, or a column slice of a wider array.
    Anything but a NumPy array, or one of a dtype CuPy cannot hold, stays as it is (a mixed call)."""
    import cupy

    if not isinstance(x, numpy.ndarray):
        return x
    try:
        y = cupy.asarray(x)
    except Exception:  # noqa: BLE001 - e.g. longdouble: the call mixes NumPy and CuPy, a TypeError
        return x
    if view == "plain" or y.ndim == 0:
        return y
    if view == "offset":
        out = cupy.empty(y.size + 1, y.dtype)[1:].reshape(y.shape)
        out[...] = y
        return out
    wide = cupy.zeros((*y.shape[:-1], y.shape[-1] + 3), y.dtype)
    wide[..., : y.shape[-1]] = y
    return wide[..., : y.shape[-1]]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(call=gpu_forward_calls())
def test_any_gpu_call_succeeds_correctly_or_raises_value_or_type_error(call):
    """Valid calls: o, m, l within rounding of the reference, and a backward of the documented shapes,
    dtypes and finite values (its accuracy is test_gpu.py's); invalid calls: the documented error."""
    q, k, v, causal, scale, views = call
    allowed = forward_contract_errors(q, k, v, causal, scale)
    args = [to_device(x, view) for x, view in zip((q, k, v), views)]
    if allowed:
        with pytest.raises(tuple(allowed)):
            cupyflash.flash_attention_forward(*args, causal=causal, softmax_scale=scale)
        return
    outputs = cupyflash.flash_attention_forward(*args, causal=causal, softmax_scale=scale)
    refs = reference.attention_forward(q, k, v, causal=bool(causal), softmax_scale=scale)
    name = q.dtype.name
    tol = fuzz_tolerance(q, k, scale, name)
    for label, got, ref in zip("oml", outputs, refs):
        got, ref = got.get().astype(numpy.float64), numpy.asarray(ref, numpy.float64)
        assert got.shape == ref.shape, label
        same = (got == ref) | (numpy.abs(got - ref) <= tol * (1 + numpy.abs(ref)))
        assert same.all(), f"{label}: {numpy.abs(got - ref).max()} over {tol:.1e}"
    do = cupyflash.flash_attention(*args, causal=causal, softmax_scale=scale)
    grads = cupyflash.flash_attention_backward(do, *args, *outputs, causal=causal, softmax_scale=scale)
    ref_grads = reference.attention_backward(do.get(), q, k, v, *refs, causal=bool(causal), softmax_scale=scale)
    huge = float(numpy.finfo(numpy.float16).max) / 2 if name == "float16" else math.inf
    for g, x, ref in zip(grads, (q, k, v), ref_grads):
        assert (g.shape, g.dtype) == (x.shape, x.dtype) and g.flags.c_contiguous
        # finite wherever the exact gradient is representable (scale 100 at D = 256 can pass float16's range)
        assert bool((numpy.isfinite(g.get().astype(numpy.float64)) | (numpy.abs(ref) > huge)).all())
