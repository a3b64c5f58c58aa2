"""GPU kernels against the float64 reference (skipped cleanly without a GPU).

Every call runs on a memory pool left full of NaN, so an output element the
kernels never write shows up. Tolerances: tests/tolerances.py; strategies: tests/strategies.py.
"""

import math

import ml_dtypes
import numpy
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import cupyflash
from cupyflash import _tiles, reference
from helpers import DTYPE_BY_NAME, poison_pool, random_inputs, requires_gpu, to_gpu
from strategies import DTYPE_NAMES, attention_problem_shapes
from tolerances import (FWD_CEILING, GPU_AGAINST_NUMPY_FLOAT32, L_CEILING, M_CEILING, assert_gradient,
                        assert_twice_naive, assert_under, gradient_magnitudes, largest_logit, row_max_slack,
                        stored_output_error)
import yardsticks

pytestmark = requires_gpu

# "v2-mma": schedule="v2" on the portable mma.sync kernel even where the Hopper kernel would run
SCHEDULES = pytest.mark.parametrize("schedule", ["v1", "v2", "v2-mma"])
GPU_SETTINGS = settings(deadline=None, max_examples=60, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(autouse=True)
def _v2_kernel(request):
    """Run a "v2-mma" case with the Hopper V2 forward switched off."""
    from cupyflash import _launch

    params = getattr(request.node, "callspec", None)
    portable = params is not None and params.params.get("schedule") == "v2-mma"
    saved = _launch.USE_WGMMA
    _launch.USE_WGMMA = not portable
    yield
    _launch.USE_WGMMA = saved


def api_schedule(schedule):
    return schedule.split("-")[0]


def run_forward(q, k, v, causal, scale, schedule, window=None, **mods):
    poison_pool()
    o, m, l = cupyflash.flash_attention_forward(*to_gpu(q, k, v), causal=causal, softmax_scale=scale, window=window,
                                                schedule=api_schedule(schedule), **mods)
    return o.get(), m.get(), l.get()


def check_forward(dtype, q, k, v, causal, scale, schedule, window=None, **mods):
    """The GPU forward of ``schedule`` against the float64 reference, within twice a naive same-precision
    attention's error; ``mods`` the score modifiers (softcap, alibi_slopes)."""
    o, m, l = run_forward(q, k, v, causal, scale, schedule, window, **mods)
    o_ref, m_ref, l_ref = reference.attention_forward(q, k, v, causal=causal, softmax_scale=scale, window=window,
                                                      **mods)
    o_naive, m_naive, l_naive = yardsticks.naive_same_precision_forward(q, k, v, causal=causal, softmax_scale=scale,
                                                                        window=window, **mods)
    assert o.dtype == q.dtype and o.shape == o_ref.shape and o.flags.c_contiguous
    assert m.dtype == l.dtype == (numpy.float64 if dtype == "float64" else numpy.float32)
    assert_twice_naive("o", o, o_ref, o_naive, dtype, FWD_CEILING)
    scale_used = scale if scale is not None else 1 / math.sqrt(q.shape[-1])
    assert_twice_naive("m", m, m_ref, m_naive, dtype, M_CEILING,
                       inherited=row_max_slack(m_ref, q, k, scale_used, dtype, **mods))
    assert_twice_naive("l", l, l_ref, l_naive, dtype, L_CEILING)


def check_backward(dtype, q, k, v, causal, scale, rng, schedule, window=None, deterministic=False, **mods):
    """The GPU backward of ``schedule`` (after its forward) against the float64 reference; ``mods`` as in
    check_forward."""
    import cupy

    qg, kg, vg = to_gpu(q, k, v)
    mask = dict(causal=causal, softmax_scale=scale, window=window, **mods)
    o, m, l = cupyflash.flash_attention_forward(qg, kg, vg, **mask, schedule=api_schedule(schedule))
    do = rng.standard_normal(o.shape).astype(DTYPE_BY_NAME[dtype])
    poison_pool()
    grads = cupyflash.flash_attention_backward(cupy.asarray(do), qg, kg, vg, o, m, l, **mask,
                                               schedule=api_schedule(schedule), deterministic=deterministic)
    forward = reference.attention_forward(q, k, v, **mask)
    refs = reference.attention_backward(do, q, k, v, *forward, **mask)
    inherited = stored_output_error(do, q, k, v, (*forward, *refs), DTYPE_BY_NAME[dtype], **mask)
    naive = yardsticks.naive_same_precision_backward(do, q, k, v, **mask)
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    mags = gradient_magnitudes(do, q, k, v, causal, scale, window, **mods)
    logit = largest_logit(q, k, causal, scale, window, **mods)
    for name, g, ref, nv, mag, x, err in zip(("dq", "dk", "dv"), grads, refs, naive, mags, (q, k, v), inherited):
        g = g.get()
        assert g.shape == x.shape and g.dtype == x.dtype and g.flags.c_contiguous
        assert_gradient(name, g, ref, nv, mag, dtype, logit, err)


@SCHEDULES
@GPU_SETTINGS
@given(attention_problem_shapes(), st.integers(0, 2**32 - 1))
@example(("float16", (2, 4, 1023, 128), (2, 1, 1023, 128), True, None), 0)
@example(("bfloat16", (1, 113, 200), (1, 1023, 200), True, None), 1)
@example(("float32", (2, 77, 96), (2, 1, 96), False, 0.5), 2)
@example(("float64", (3, 17, 40), (3, 255, 40), True, None), 3)
@example(("float16", (2, 400, 64), (2, 400, 64), True, None), 4)   # a Hopper tile's last warpgroups: no rows
def test_forward_matches_reference(schedule, problem, seed):
    dtype, q_shape, kv_shape, causal, scale = problem
    q, k, v = random_inputs(numpy.random.default_rng(seed), dtype, q_shape, kv_shape)
    check_forward(dtype, q, k, v, causal, scale, schedule)


@SCHEDULES
@GPU_SETTINGS
@given(attention_problem_shapes(), st.integers(0, 2**32 - 1))
@example(("float16", (2, 4, 1023, 128), (2, 1, 1023, 128), True, None), 0)
@example(("bfloat16", (2, 2, 3, 113, 72), (2, 2, 1, 300, 72), True, None), 1)
@example(("float32", (3, 200, 256), (1, 64, 256), False, None), 2)
@example(("float64", (17, 40), (255, 40), True, 0.3), 3)
# two keys, causal: dP - D cancels, so the naive float32 error is the products' (3xTF32 with a truncated
# high part was 1.8x over the rule here)
@example(("float32", (4, 64, 1), (4, 2, 1), True, None), 0)
@example(("float32", (43, 3, 2, 64), (43, 3, 2, 64), True, 2.0), 0)
@example(("float32", (1023, 160), (1, 160), True, 1.5), 125)   # one visible key: the naive dv is exact
def test_backward_matches_reference(schedule, problem, seed):
    dtype, q_shape, kv_shape, causal, scale = problem
    rng = numpy.random.default_rng(seed)
    q, k, v = random_inputs(rng, dtype, q_shape, kv_shape)
    check_backward(dtype, q, k, v, causal, scale, rng, schedule)


@SCHEDULES
@pytest.mark.parametrize("dtype", DTYPE_NAMES)
@pytest.mark.parametrize("causal", [False, True])
def test_large_logits(dtype, causal, schedule):
    """Scores in the hundreds: the online softmax must not overflow, and stays within twice naive."""
    rng = numpy.random.default_rng(7)
    q, k, v = random_inputs(rng, dtype, (2, 130, 64), (2, 150, 64), spread=4.0)
    check_forward(dtype, q, k, v, causal, 2.0, schedule)
    check_backward(dtype, q, k, v, causal, 2.0, rng, schedule)


@SCHEDULES
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("scale", [-0.7, 0.0, 1e-300])
def test_nonpositive_scale(dtype, scale, schedule):
    """A zero or negative softmax_scale, or one that is zero in the kernels' float32 (the Hopper kernel
    hands these to the portable one)."""
    rng = numpy.random.default_rng(8)
    q, k, v = random_inputs(rng, dtype, (2, 3, 100, 64), (2, 3, 130, 64))
    check_forward(dtype, q, k, v, True, scale, schedule)
    check_backward(dtype, q, k, v, True, scale, rng, schedule)


@SCHEDULES
@pytest.mark.parametrize("dtype", DTYPE_NAMES)
def test_strided_inputs(dtype, schedule):
    """Transposed (B, N, H, D) views, every other row, and a misaligned base pointer (scalar loads)."""
    import cupy

    rng = numpy.random.default_rng(11)
    B, N, H, D = 2, 70, 3, 64
    q, k, v = (cupy.asarray(x) for x in random_inputs(rng, dtype, (B, 2 * N, H, D), (B, 2 * N, H, D)))
    views = [x.swapaxes(1, 2)[:, :, ::2, :] for x in (q, k, v)]           # (B, H, N, D), row stride 2*H*D
    flat = cupy.asarray(rng.standard_normal(B * H * N * D + 1).astype(DTYPE_BY_NAME[dtype]))
    misaligned = flat[1:].reshape(B, H, N, D)                               # base pointer off by one element
    for qv, kv, vv in (views, (misaligned, views[1], views[2])):
        host = [x.get() for x in (qv, kv, vv)]
        poison_pool()
        o, m, l = cupyflash.flash_attention_forward(qv, kv, vv, causal=True, schedule=api_schedule(schedule))
        o_ref, m_ref, _ = reference.attention_forward(*host, causal=True)
        o_naive = yardsticks.naive_same_precision_forward(*host, causal=True)[0]
        assert_twice_naive("o", o.get(), o_ref, o_naive, dtype, FWD_CEILING)
        assert_under("m", m.get(), m_ref, M_CEILING[dtype])
        do = cupy.asarray(rng.standard_normal(o.shape).astype(DTYPE_BY_NAME[dtype]))
        grads = cupyflash.flash_attention_backward(do.swapaxes(0, 1).copy().swapaxes(0, 1), qv, kv, vv, o, m, l,
                                                   causal=True)
        do_host = do.get()
        refs = reference.attention_backward(do_host, *host, *reference.attention_forward(*host, causal=True),
                                            causal=True)
        naive = yardsticks.naive_same_precision_backward(do_host, *host, causal=True)
        mags = gradient_magnitudes(do_host, *host, True, 1 / math.sqrt(D))
        for name, g, ref, nv, mag in zip(("dq", "dk", "dv"), grads, refs, naive, mags):
            assert_gradient(name, g.get(), ref, nv, mag, dtype)


@SCHEDULES
@pytest.mark.parametrize("dtype", DTYPE_NAMES)
def test_rows_that_see_no_key(dtype, schedule):
    """Causal with Nq > Nk: the first Nq - Nk rows see nothing: o = 0, m = -inf, l = 0, no gradient."""
    import cupy

    rng = numpy.random.default_rng(3)
    Nq, Nk = 150, 40
    q, k, v = to_gpu(*random_inputs(rng, dtype, (2, Nq, 72), (2, Nk, 72)))
    poison_pool()
    o, m, l = cupyflash.flash_attention_forward(q, k, v, causal=True, schedule=api_schedule(schedule))
    blind = Nq - Nk
    assert (o[:, :blind].get().astype(numpy.float64) == 0).all()
    assert (m[:, :blind].get() == -numpy.inf).all() and (l[:, :blind].get() == 0).all()
    assert numpy.isfinite(o[:, blind:].get().astype(numpy.float64)).all()
    do = cupy.asarray(rng.standard_normal(o.shape).astype(DTYPE_BY_NAME[dtype]))
    dq, dk, dv = cupyflash.flash_attention_backward(do, q, k, v, o, m, l, causal=True)
    assert (dq[:, :blind].get().astype(numpy.float64) == 0).all()
    for g in (dq, dk, dv):
        assert numpy.isfinite(g.get().astype(numpy.float64)).all()


def test_empty_queries_launch_nothing():
    import cupy

    q = cupy.zeros((2, 0, 64), cupy.float16)
    k = cupy.ones((2, 5, 64), cupy.float16)
    o, m, l = cupyflash.flash_attention_forward(q, k, k)
    assert o.shape == (2, 0, 64) and m.shape == l.shape == (2, 0)
    dq, dk, dv = cupyflash.flash_attention_backward(o, q, k, k, o, m, l)
    assert dq.shape == q.shape and dk.shape == k.shape and float(abs(dk).max()) == 0


def test_an_empty_batch_launches_nothing():
    """A zero batch dim with queries and keys: empty outputs, zero gradients of the inputs' shapes (q
    broadcast along the empty dim included), and the GPU is fine afterwards. (CuPy runs a grid of
    0 CTAs as one; such a launch read and wrote out of bounds.)"""
    import cupy

    rng = numpy.random.default_rng(7)
    for dtype in ("float16", "float32"):
        q = cupy.asarray(rng.standard_normal((1, 4, 8)).astype(dtype))
        k = cupy.asarray(rng.standard_normal((0, 3, 8)).astype(dtype))
        for schedule in ("v1", "v2"):
            o, m, l = cupyflash.flash_attention_forward(q, k, k, causal=True, schedule=schedule)
            assert o.shape == (0, 4, 8) and m.shape == l.shape == (0, 4)
            dq, dk, dv = cupyflash.flash_attention_backward(o, q, k, k, o, m, l, causal=True, schedule=schedule)
            assert dq.shape == q.shape and dk.shape == dv.shape == k.shape and float(abs(dq).max()) == 0
    cupy.cuda.Device().synchronize()
    check_forward("float16", *random_inputs(rng, "float16", (2, 50, 64), (2, 40, 64)), True, None, "v2")


def test_inputs_not_modified():
    import cupy

    rng = numpy.random.default_rng(5)
    arrays = to_gpu(*random_inputs(rng, "float16", (2, 100, 64), (2, 90, 64)))
    before = [a.copy() for a in arrays]
    o, m, l = cupyflash.flash_attention_forward(*arrays, causal=True)
    do = cupy.asarray(rng.standard_normal(o.shape).astype(numpy.float16))
    saved = [x.copy() for x in (do, o, m, l)]
    cupyflash.flash_attention_backward(do, *arrays, o, m, l, causal=True)
    for a, b in zip(arrays + [do, o, m, l], before + saved):
        assert cupy.array_equal(a, b)


@SCHEDULES
def test_uncollapsible_batch_dims_are_peeled(schedule):
    """Four batch dims whose broadcast pattern cannot be merged into three run through the peeling path."""
    rng = numpy.random.default_rng(9)
    q_shape, kv_shape = (2, 3, 2, 2, 33, 40), (2, 1, 2, 1, 47, 40)
    q, k, v = random_inputs(rng, "float16", q_shape, kv_shape)
    check_forward("float16", q, k, v, True, None, schedule)
    check_backward("float16", q, k, v, True, None, rng, schedule)


def test_flash_attention_returns_o():
    rng = numpy.random.default_rng(2)
    q, k, v = to_gpu(*random_inputs(rng, "bfloat16", (3, 50, 96), (3, 60, 96)))
    o = cupyflash.flash_attention(q, k, v, causal=True)
    o2, _, _ = cupyflash.flash_attention_forward(q, k, v, causal=True)
    assert (o.view(numpy.uint16) == o2.view(numpy.uint16)).all()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
@pytest.mark.parametrize("head_dim", [64, 160])
def test_auto_schedule_is_the_documented_one(dtype, head_dim):
    resolved = _tiles.auto_forward(head_dim, dtype)
    rng = numpy.random.default_rng(6)
    q, k, v = to_gpu(*random_inputs(rng, dtype, (2, 70, head_dim), (2, 90, head_dim)))
    auto = cupyflash.flash_attention_forward(q, k, v, causal=True)
    chosen = cupyflash.flash_attention_forward(q, k, v, causal=True, schedule=resolved)
    for a, b in zip(auto, chosen):
        assert a.tobytes() == b.tobytes()


@SCHEDULES
@pytest.mark.parametrize("group", [1, 3, 7])
@pytest.mark.parametrize("causal", [False, True])
def test_grid_order_of_head_groups(group, causal, schedule, monkeypatch):
    """The V2 kernels and the backward walk their grid in groups of heads (sized to L2, here forced):
    a last group short of heads, one head per group and one group for all give the same function
    (D = 200: the V1 backward's tiles are two head-dim chunks)."""
    from cupyflash import _launch

    monkeypatch.setattr(_launch, "head_group", lambda heads, _bytes: numpy.int32(min(group, heads)))
    monkeypatch.setattr(_launch, "PLANS", {})   # plans of the unpatched grouping must not be reused
    rng = numpy.random.default_rng(group)
    for q_shape, kv_shape in (((2, 4, 300, 64), (2, 4, 260, 64)), ((2, 3, 130, 200), (2, 3, 150, 200))):
        q, k, v = random_inputs(rng, "bfloat16", q_shape, kv_shape)
        check_forward("bfloat16", q, k, v, causal, None, schedule)
        check_backward("bfloat16", q, k, v, causal, None, rng, schedule)


@pytest.mark.parametrize("sms", [1, 3])
@pytest.mark.parametrize("causal", [False, True])
def test_persistent_ctas_walk_many_tiles(sms, causal, monkeypatch):
    """The Hopper forward's CTAs claim tile after tile; with one or three of them (sms forced) each
    walks many, across heads, ragged ends, idle warpgroups and both Q buffer counts (D = 256: one)."""
    import dataclasses

    from cupyflash import _launch

    limits = _launch.current_limits()
    monkeypatch.setattr(_launch, "current_limits", lambda: dataclasses.replace(limits, sms=sms))
    monkeypatch.setattr(_launch, "PLANS", {})
    rng = numpy.random.default_rng(sms)
    for dtype, q_shape, kv_shape in (("float16", (3, 2, 400, 64), (3, 2, 300, 64)),
                                     ("bfloat16", (2, 4, 130, 128), (2, 1, 700, 128)),
                                     ("float16", (5, 70, 256), (5, 333, 256))):
        q, k, v = random_inputs(rng, dtype, q_shape, kv_shape)
        check_forward(dtype, q, k, v, causal, None, "v2")


@SCHEDULES
def test_like_calls_reuse_their_plan(schedule, monkeypatch):
    """A call like an earlier one (its arrays' shapes, strides, dtypes, devices and 16-byte alignment,
    its flags) reuses that call's plan and computes the same bits; a call unlike every earlier one is
    validated and planned afresh."""
    import cupy

    from cupyflash import _launch

    monkeypatch.setattr(_launch, "PLANS", {})
    rng = numpy.random.default_rng(6)
    q_np, k_np, v_np = random_inputs(rng, "float16", (2, 3, 130, 64), (2, 3, 150, 64))
    q, k, v = to_gpu(q_np, k_np, v_np)
    kw = dict(causal=True, schedule=api_schedule(schedule))
    first = cupyflash.flash_attention_forward(q, k, v, **kw)
    again = cupyflash.flash_attention_forward(q.copy(), k.copy(), v.copy(), **kw)
    assert len(_launch.PLANS) == 1
    for a, b in zip(first, again):
        assert a.tobytes() == b.tobytes()
    do = cupy.asarray(rng.standard_normal(first[0].shape).astype(numpy.float16))
    grads = [cupyflash.flash_attention_backward(do, q, k, v, *first, **kw) for _ in range(2)]
    assert len(_launch.PLANS) == 2
    for a, b in zip(*grads):
        assert a.tobytes() == b.tobytes()

    check_forward("float16", q_np, k_np, v_np, True, None, schedule)   # through the kept plan
    assert len(_launch.PLANS) == 2

    # a view off the 16-byte grid: a plan of its own (scalar loads), the same bits
    shifted = cupy.empty(q.size + 1, q.dtype)[1:].reshape(q.shape)
    shifted[...] = q
    for a, b in zip(cupyflash.flash_attention_forward(shifted, k, v, **kw), first):
        assert a.tobytes() == b.tobytes()
    assert len(_launch.PLANS) == 3
    # flags equal in value but not in type are checked again, and refused
    with pytest.raises(TypeError, match="causal"):
        cupyflash.flash_attention_forward(q, k, v, causal=1, schedule=kw["schedule"])
    with pytest.raises(ValueError, match="softmax_scale"):
        cupyflash.flash_attention_forward(q, k, v, causal=True, softmax_scale=math.nan)
    assert len(_launch.PLANS) == 3


def test_v2_runs_the_hopper_kernels_on_sm90():
    """schedule="v2" of 16-bit inputs runs the warpgroup-MMA kernels on sm_90 (so the "v2" cases test them)."""
    import cupy

    from cupyflash import _launch

    hopper = cupy.cuda.Device().compute_capability == "90"
    assert _launch.forward_kernel("v2", ml_dtypes.bfloat16) == ("fwd_sm90" if hopper else "fwd_v2")
    assert _launch.forward_kernel("v2", numpy.float32) == "fwd_v2"
    assert _launch.forward_kernel("v1", numpy.float16) == "fwd_v1"
    assert _launch.backward_kernel("v2", numpy.float16, 128) == ("bwd_sm90" if hopper else "bwd")
    assert _launch.backward_kernel("auto", numpy.float16, 200) == ("bwd_sm90_wide" if hopper else "bwd")
    assert _launch.backward_kernel("auto", numpy.float32, 200) == "bwd"
    assert _launch.backward_kernel("v1", ml_dtypes.bfloat16, 64) == "bwd"


@pytest.mark.parametrize("dtype, D", [("float16", 130), ("bfloat16", 160), ("float16", 192), ("bfloat16", 196),
                                      ("float16", 256)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", ["ragged", "gqa"])
def test_wide_heads_backward(dtype, D, causal, shape):
    """The backward at 128 < D <= 256 (the Hopper kernel flash_bwd_sm90_wide.cu on sm_90; two ring
    stages at D <= 192, one above; D = 130 adds dQ with atomics, 196 copies without 16-byte vectors):
    ragged tiles on both sides, more keys than queries and fewer, and K/V heads shared by query heads."""
    q_shape, kv_shape = {"ragged": ((2, 333, D), (2, 1000, D)), "gqa": ((2, 4, 1000, D), (2, 1, 201, D))}[shape]
    rng = numpy.random.default_rng(D)
    q, k, v = random_inputs(rng, dtype, q_shape, kv_shape)
    check_backward(dtype, q, k, v, causal, None, rng, "v2")


def test_gpu_and_numpy_paths_agree():
    """The CPU path (blocked NumPy) and the kernels compute the same function."""
    rng = numpy.random.default_rng(4)
    q, k, v = random_inputs(rng, "float32", (2, 3, 90, 72), (2, 1, 70, 72))
    o_cpu, m_cpu, l_cpu = cupyflash.flash_attention_forward(q, k, v, causal=True)
    o_gpu, m_gpu, l_gpu = run_forward(q, k, v, True, None, "auto")
    for name, got, ref in zip("oml", (o_gpu, m_gpu, l_gpu), (o_cpu, m_cpu, l_cpu)):
        assert_under(name, got, ref, GPU_AGAINST_NUMPY_FLOAT32[name])


@pytest.mark.parametrize("dtype", ["float16", "float64"])
def test_the_parameter_structs_lie_on_the_device_as_their_mirror_says(dtype):
    """The device's sizeof and offsetof of FwdParams and BwdParams (written by a tiny kernel, compiled
    by this machine's NVRTC) are exactly the NumPy mirror's (cupyflash/_params.py)."""
    import cupy

    from cupyflash import _compile, _params, _tiles

    probe, labels = _params.layout_probe()
    cfg = _tiles.choose_tiles("bwd_prep", 1, dtype, 0)
    module = cupy.RawModule(code=_compile.kernel_source("bwd_prep") + "\n" + probe, options=_compile.nvrtc_options(cfg))
    out = cupy.zeros(len(labels), cupy.uint64)
    module.get_function("flash_params_layout")((1,), (1,), (out,))
    got = [int(x) for x in out.get()]
    assert [(name, g, w) for name, g, w in zip(labels, got, _params.mirror_layout()) if g != w] == []
