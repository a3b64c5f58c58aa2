"""The modifiers ``softcap``, ``alibi_slopes`` and ``sink`` on every path: the NumPy path and the
validation on the CPU, every GPU kernel (V1, V2, the Hopper forward and backwards, the non-finite
repair) against the float64 reference.

With ``off = Nk - Nq`` the final score of query ``i`` and key ``j`` is
``c tanh(scale q_i . k_j / c) - slope |i + off - j|`` (softcap ``c``, the batch entry's ALiBi
``slope``), then the mask; ``m``, ``l`` are the statistics of the final scores and of the sink (one
more key of logit ``sink`` and value zero), and the gradients are those of ``scale q k^T`` through
the softcap, and of ``sink``.
"""

import numpy
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import cupyflash
from cupyflash import _flags, _tiles, reference
from helpers import (DTYPE_BY_NAME, assert_non_finite_rules, assert_refused, gpu_test, random_inputs,
                     reproducible_backward, to_gpu)
from strategies import attention_problem_shapes
from test_gpu import check_backward, check_forward
from test_window import SCHEDULES, WINDOWS, assert_float64_close

# a softcap: none, or from "caps most scores" to "caps none" (random scores are a few units)
SOFTCAPS = st.one_of(st.none(), st.sampled_from([0.5, 2.0, 5.0, 30.0]))
# how the slopes broadcast: none, one per entry of the last batch dim (heads), one per entry, one for all
SLOPE_KINDS = st.sampled_from([None, "heads", "entries", "scalar"])


def alibi_slopes(kind, batch_shape, rng):
    """Slopes of ``kind`` for ``batch_shape`` (float32, as ALiBi's geometric slopes are), or None."""
    if kind is None:
        return None
    shape = {"heads": batch_shape[-1:], "entries": tuple(batch_shape), "scalar": ()}[kind]
    return (2.0 ** -rng.uniform(0, 8, shape)).astype(numpy.float32)


@st.composite
def modifier_sets(draw):
    """(softcap, slope kind, sink kind) of one of the sets the GPU tests run: none, each alone, or all
    three (each set is a kernel specialisation of its own, compiled on first use)."""
    chosen = draw(st.sampled_from([(), ("softcap",), ("alibi",), ("sink",), ("softcap", "alibi", "sink")]))
    softcap = draw(SOFTCAPS.filter(lambda c: c is not None)) if "softcap" in chosen else None
    kind = draw(SLOPE_KINDS.filter(lambda k: k is not None)) if "alibi" in chosen else None
    sink_kind = draw(SLOPE_KINDS.filter(lambda k: k is not None)) if "sink" in chosen else None
    return softcap, kind, sink_kind


def drawn_mods(softcap, kind, q_shape, kv_shape, rng, sink_kind=None):
    """The modifier keywords of a drawn case; ``sink_kind`` broadcasts sinks as ``kind`` does slopes."""
    batch = numpy.broadcast_shapes(q_shape[:-2], kv_shape[:-2])
    mods = {}
    if softcap is not None:
        mods["softcap"] = softcap
    slopes = alibi_slopes(kind, batch, rng)
    if slopes is not None:
        mods["alibi_slopes"] = slopes
    sinks = alibi_slopes(sink_kind, batch, rng)
    if sinks is not None:   # logits around the scores' range
        mods["sink"] = (4 * numpy.log2(sinks) / 8 + 2).astype(numpy.float32)
    return mods


# ---------------------------------------------------------------------------
# CPU: the NumPy path, the checks, the specialisations


@settings(deadline=None, max_examples=40)
@given(attention_problem_shapes(), WINDOWS, SOFTCAPS, SLOPE_KINDS, st.integers(0, 2**32 - 1), SLOPE_KINDS)
@example(("float64", (2, 3, 113, 64), (2, 3, 200, 64), True, None), (None, None), 2.0, "heads", 0, "heads")
def test_numpy_path_takes_the_modifiers(problem, window, softcap, kind, seed, sink_kind):
    """The API's NumPy path (the blocked Algorithm 1, float64) equals the float64 reference with any
    softcap, slopes and sinks, under any mask (dsink included)."""
    _, q_shape, kv_shape, causal, scale = problem
    rng = numpy.random.default_rng(seed)
    q, k, v = random_inputs(rng, "float64", q_shape, kv_shape)
    kw = dict(causal=causal, softmax_scale=scale, window=window,
              **drawn_mods(softcap, kind, q_shape, kv_shape, rng, sink_kind))
    out = cupyflash.flash_attention_forward(q, k, v, **kw)
    refs = reference.attention_forward(q, k, v, **kw)
    do = rng.standard_normal(out[0].shape)
    grads = cupyflash.flash_attention_backward(do, q, k, v, *out, **kw)
    ref_grads = reference.attention_backward(do, q, k, v, *refs, **kw)
    assert len(grads) == len(ref_grads) == 3 + ("sink" in kw)
    for name, got, ref in zip(("o", "m", "l", "dq", "dk", "dv", "dsink"), (*out, *grads), (*refs, *ref_grads)):
        assert_float64_close(name, got, ref)


def test_a_softcap_bends_large_scores_and_alibi_moves_them_by_distance():
    """Worked values: with one query and two keys, the final scores are c tanh(s / c) - slope |off - j|,
    so m is their max and l their exp-sum around it."""
    q = numpy.array([[[1.0, 0.0]]])                       # (1, 1, 2)
    k = numpy.array([[[8.0, 0.0], [0.5, 0.0]]])           # scores 8 and 0.5 (scale 1)
    v = numpy.array([[[1.0, 0.0], [0.0, 1.0]]])
    o, m, l = cupyflash.flash_attention_forward(q, k, v, softmax_scale=1.0, softcap=4.0,
                                                alibi_slopes=numpy.array([0.25]))
    s = numpy.array([4 * numpy.tanh(2.0) - 0.25 * 1, 4 * numpy.tanh(0.125) - 0.0])   # off = 1: distances 1, 0
    assert m[0, 0] == pytest.approx(s.max(), rel=1e-12)
    assert l[0, 0] == pytest.approx(numpy.exp(s - s.max()).sum(), rel=1e-12)
    weights = numpy.exp(s - s.max()) / numpy.exp(s - s.max()).sum()
    numpy.testing.assert_allclose(o[0, 0], weights, rtol=1e-12)


def test_a_sink_is_one_more_key_of_value_zero():
    """Worked values: the sink counts in m and l but adds nothing to o; a row that sees no key has
    m = sink, l = 1, o = 0; dsink = -sum_i exp(sink - m_i) / l_i D_i."""
    q = numpy.array([[[0.0, 1.0], [1.0, 0.0]]])           # (1, 2, 2): row 0 sees no key (causal, off = -1)
    k = numpy.array([[[2.0, 0.0]]])                       # (1, 1, 2): score 2 for row 1
    v = numpy.array([[[3.0, 4.0]]])
    o, m, l = cupyflash.flash_attention_forward(q, k, v, softmax_scale=1.0, sink=numpy.array([1.0]), causal=True)
    assert list(m[0]) == pytest.approx([1.0, 2.0]) and list(l[0]) == pytest.approx([1.0, 1 + numpy.exp(-1.0)])
    numpy.testing.assert_allclose(o[0, 1], v[0, 0] / (1 + numpy.exp(-1.0)), rtol=1e-12)
    assert not o[0, 0].any()
    do = numpy.ones_like(o)
    *_, dsink = cupyflash.flash_attention_backward(do, q, k, v, o, m, l, softmax_scale=1.0, sink=numpy.array([1.0]),
                                                   causal=True)
    D = (do * o).sum(-1)[0]
    assert dsink.shape == (1,)
    assert dsink[0] == pytest.approx(-(1.0 * D[0] + numpy.exp(1.0 - 2.0) / l[0, 1] * D[1]), rel=1e-12)


@pytest.mark.parametrize("kw, error, words", [
    (dict(sink=numpy.ones((3, 2))), ValueError, "sink of shape (3, 2) does not broadcast to the batch shape (2, 3)"),
    (dict(sink=numpy.array([None, 1, 2])), TypeError, "sink must hold real numbers"),
    (dict(softcap=0.0), ValueError, "softcap must be a finite number > 0"),
    (dict(softcap=-2), ValueError, "softcap must be a finite number > 0"),
    (dict(softcap=float("inf")), ValueError, "softcap must be a finite number > 0"),
    (dict(softcap=1e-320), ValueError, "finite reciprocal"),
    (dict(softcap="3"), TypeError, "softcap must be a real number"),
    (dict(softcap=True), TypeError, "softcap must be a real number"),
    (dict(alibi_slopes=numpy.ones(5)), ValueError,
     "alibi_slopes of shape (5,) does not broadcast to the batch shape (2, 3)"),
    (dict(alibi_slopes=numpy.ones((2, 3, 1))), ValueError, "does not broadcast"),
    (dict(alibi_slopes=numpy.array(["a", "b", "c"])), TypeError, "alibi_slopes must hold real numbers"),
    (dict(alibi_slopes=object()), TypeError, "alibi_slopes must hold real numbers"),
])
@pytest.mark.parametrize("call", ["forward", "backward", "flash_attention"])
def test_bad_modifiers_are_refused_naming_the_argument(kw, error, words, call):
    assert_refused(call, error, words, **kw)


def test_inputs_and_slopes_are_not_modified():
    rng = numpy.random.default_rng(1)
    q, k, v = random_inputs(rng, "float32", (2, 3, 20, 8), (2, 3, 30, 8))
    slopes = numpy.array([0.5, 0.25, 0.125], numpy.float32)
    before = [x.copy() for x in (q, k, v, slopes)]
    out = cupyflash.flash_attention_forward(q, k, v, softcap=3.0, alibi_slopes=slopes, causal=True)
    cupyflash.flash_attention_backward(out[0], q, k, v, *out, softcap=3.0, alibi_slopes=slopes, causal=True)
    for a, b in zip(before, (q, k, v, slopes)):
        assert a.tobytes() == b.tobytes()


def test_a_plain_call_compiles_no_flag_and_a_flagged_one_only_its_own():
    """A plain specialisation's NVRTC options (CuPy's cache key) name no switch its family compiles in
    (``_flags.FLAGS``), only those it reads at run time (``FLASH_<NAME>=2``); each flag a family compiles
    adds exactly its define (and that of a flag it needs), the others change nothing."""
    def named(cfg):   # the flags' defines of cfg (the Hopper forward's B_c follows per-pair work too)
        return {d for f in _flags.FLAGS for d in cfg.defines() if d.startswith(f"-D{f.define}=")}

    for kernel in ("fwd_v2", "fwd_sm90", "bwd", "repair", "bwd_prep"):
        cfg = _tiles.choose_tiles(kernel, 64, "float16", 227 * 1024)
        assert named(cfg) == {f"-D{f.define}={_flags.AT_RUN_TIME}" for f in _flags.FLAGS if kernel in f.at_run_time}
        for flag in _flags.FLAGS:
            names = (flag.name, flag.requires) if flag.requires else (flag.name,)
            added = named(_tiles.with_flags(cfg, names)) - named(cfg)
            compiled = {f"-D{_flags.BY_NAME[n].define}=1" for n in names if kernel in _flags.BY_NAME[n].compiled}
            assert added == compiled, (kernel, flag.name)


def test_the_compile_test_meets_every_flag_with_every_dtype_and_every_bucket():
    """``modified_tile_configs`` builds each family with each flag it compiles in (the plain ones too,
    which ``all_tile_configs`` lists both ways for the device and only without for the compile test) at
    every dtype and at every bucket the family runs, so every line of every ``if constexpr`` block
    compiles beside each dtype and each bucket (a covering set: as many pairs as the family has dtypes or
    buckets, whichever is more); a pair a family never compiles together (the paged V2 forward and a bias,
    a mask or dropout) is built once without each."""
    smem = 227 * 1024
    plain = {(c.kernel, c.dtype, c.d_pad) for c in _tiles.all_tile_configs(smem, plain_flags=False)}
    assert all(not c.flags for c in _tiles.all_tile_configs(smem, plain_flags=False))
    configs = _tiles.modified_tile_configs(smem)
    for flag in _flags.FLAGS:
        with_it = {(c.kernel, c.dtype, c.d_pad) for c in configs if flag.name in c.flags}
        if flag.plain:   # the device's list: every plain specialisation with it and without
            # (but in a family that compiles it only beside another flag: Flag.beside)
            alone = [family for family in flag.compiled if all(fam != family for fam, _ in flag.beside)]
            assert {(c.kernel, c.dtype, c.d_pad) for c in _tiles.all_tile_configs(smem) if flag.name in c.flags} == {
                key for key in plain if key[0] in alone}
        assert with_it <= plain, flag.name
        for family in flag.compiled:
            runs = {(dtype, d_pad) for kernel, dtype, d_pad in plain if kernel == family}
            met = {(dtype, d_pad) for kernel, dtype, d_pad in with_it if kernel == family}
            assert {d for d, _ in met} == {d for d, _ in runs} and {b for _, b in met} == {b for _, b in runs}, \
                (flag.name, family)
    assert len(configs) < len(plain) / 2   # a covering set, not the product
    for kernel in {c.kernel for c in configs}:   # each (dtype, bucket) pair once per flag set at most
        built = [c for c in configs if c.kernel == kernel]
        dtypes, buckets, sets = {c.dtype for c in built}, {c.d_pad for c in built}, {c.flags for c in built}
        assert len(built) == len(sets) * max(len(dtypes), len(buckets)), kernel
    # a flag's lines that compile only without another (Flag.excludes) are built too: with its requirement,
    # without the other
    for flag in _flags.FLAGS:
        for family, other in flag.excludes:
            # (read at run time there, its lines are in every specialisation that compiles its requirement)
            needed = flag.requires is not None and flag.requires in {f.name for f in _flags.compiled_in(family)}
            built = {(c.dtype, c.d_pad) for c in configs if c.kernel == family and other not in c.flags
                     and (family not in flag.compiled or flag.name in c.flags)
                     and (not needed or flag.requires in c.flags)}
            runs = {(dtype, d_pad) for kernel, dtype, d_pad in plain if kernel == family}
            assert {d for d, _ in built} == {d for d, _ in runs} and {b for _, b in built} == {b for _, b in runs}, \
                flag.name


# ---------------------------------------------------------------------------
# GPU: every kernel against the reference

GPU_SETTINGS = settings(deadline=None, max_examples=30,
                        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


@gpu_test
@SCHEDULES
@GPU_SETTINGS
@given(attention_problem_shapes(), WINDOWS, modifier_sets(), st.integers(0, 2**32 - 1))
@example(("float16", (2, 4, 1023, 128), (2, 1, 1023, 128), True, None), (None, None), (5.0, "heads", "heads"), 0)
@example(("bfloat16", (2, 3, 700, 64), (2, 1, 900, 64), False, None), (257, None), (2.0, None, None), 1)
@example(("float16", (1, 2, 513, 200), (1, 2, 513, 200), True, None), (None, None), (None, "entries", None), 2)
@example(("float32", (3, 300, 64), (3, 280, 64), False, 0.5), (None, None), (0.5, "scalar", "entries"), 3)
@example(("float64", (2, 250, 40), (2, 330, 40), True, None), (30, None), (30.0, "heads", "heads"), 4)
@example(("float16", (2, 4, 300, 256), (2, 4, 300, 256), False, None), (None, None), (5.0, None, None), 5)
@example(("float16", (2, 2, 300, 64), (2, 2, 100, 64), True, None), (10, None), (None, None, "heads"), 6)  # no-key rows
def test_forward_with_modifiers_matches_reference(gpu_schedule, problem, window, mods, seed):
    softcap, kind, sink_kind = mods
    dtype, q_shape, kv_shape, causal, scale = problem
    rng = numpy.random.default_rng(seed)
    q, k, v = random_inputs(rng, dtype, q_shape, kv_shape)
    check_forward(dtype, q, k, v, causal, scale, gpu_schedule, window,
                  **drawn_mods(softcap, kind, q_shape, kv_shape, rng, sink_kind))


@gpu_test
@SCHEDULES
@GPU_SETTINGS
@given(attention_problem_shapes(), WINDOWS, modifier_sets(), st.integers(0, 2**32 - 1), st.booleans())
@example(("float16", (2, 4, 1023, 128), (2, 1, 1023, 128), True, None), (None, None), (5.0, "heads", "heads"), 0, False)
@example(("bfloat16", (2, 3, 700, 64), (2, 1, 900, 64), False, None), (257, None), (2.0, None, None), 1, True)
@example(("bfloat16", (1, 2, 513, 200), (1, 2, 513, 200), True, None), (None, None), (5.0, "entries", "scalar"), 2,
         True)
@example(("float32", (3, 300, 64), (3, 280, 64), False, 0.5), (None, None), (0.5, "scalar", "scalar"), 3, False)
@example(("float64", (2, 250, 40), (2, 330, 40), True, None), (30, None), (30.0, "heads", "entries"), 4, True)
@example(("float16", (2, 4, 300, 256), (2, 4, 300, 256), False, None), (None, None), (5.0, None, None), 5, False)
@example(("float16", (256, 1, 1), (256, 2, 1), False, None), (None, None), (0.5, None, None), 0, False)   # saturated
@example(("float16", (2, 2, 300, 64), (2, 2, 100, 64), True, None), (10, None), (None, None, "heads"), 6, False)
def test_backward_with_modifiers_matches_reference(gpu_schedule, problem, window, mods, seed, deterministic):
    softcap, kind, sink_kind = mods
    dtype, q_shape, kv_shape, causal, scale = problem
    rng = numpy.random.default_rng(seed)
    q, k, v = random_inputs(rng, dtype, q_shape, kv_shape)
    check_backward(dtype, q, k, v, causal, scale, rng, gpu_schedule, window, deterministic,
                   **drawn_mods(softcap, kind, q_shape, kv_shape, rng, sink_kind))


@gpu_test
@pytest.mark.parametrize("where", ["cupy", "numpy", "float64", "strided", "peeled"])
def test_slopes_of_any_kind_and_layout_give_the_reference(where):
    """Slopes as a CuPy float32 array, a NumPy array (moved), another dtype (converted), a strided view,
    and with more than three batch dims that do not merge (peeled one at a time)."""
    import cupy

    rng = numpy.random.default_rng(3)
    q_shape, kv_shape = (2, 3, 100, 64), (2, 3, 140, 64)
    slopes = (2.0 ** -rng.uniform(0, 8, (3,))).astype(numpy.float32)
    if where == "peeled":   # q (2, 1, 3, 2, N, D) against k, v (1, 2, 1, 2, N, D): four batch dims
        q_shape, kv_shape = (2, 1, 3, 2, 100, 64), (1, 2, 1, 2, 140, 64)
        slopes = (2.0 ** -rng.uniform(0, 8, (2, 1, 3, 1))).astype(numpy.float32)
    q, k, v = random_inputs(rng, "float16", q_shape, kv_shape)
    given_slopes = {"cupy": cupy.asarray(slopes), "numpy": slopes, "float64": cupy.asarray(slopes, numpy.float64),
                    "strided": cupy.asarray(numpy.repeat(slopes, 2))[::2], "peeled": cupy.asarray(slopes)}[where]
    if where == "strided":
        given_slopes[...] = cupy.asarray(slopes)
    kw = dict(causal=True, softcap=5.0, sink=numpy.float32(0.5))
    o, m, l = cupyflash.flash_attention_forward(*to_gpu(q, k, v), alibi_slopes=given_slopes, **kw)
    o_ref, m_ref, l_ref = reference.attention_forward(q, k, v, alibi_slopes=slopes, **kw)
    numpy.testing.assert_allclose(m.get(), m_ref, atol=2e-2)
    numpy.testing.assert_allclose(l.get(), l_ref, rtol=2e-2)
    numpy.testing.assert_allclose(o.get().astype(numpy.float64), o_ref, atol=2e-2)
    do = cupy.asarray(rng.standard_normal(o.shape).astype(numpy.float16))
    grads = cupyflash.flash_attention_backward(do, *to_gpu(q, k, v), o, m, l, alibi_slopes=given_slopes, **kw)
    refs = reference.attention_backward(do.get(), q, k, v, o_ref, m_ref, l_ref, alibi_slopes=slopes, **kw)
    for got, ref in zip(grads, refs):
        scale = numpy.abs(ref).max()
        numpy.testing.assert_allclose(got.get().astype(numpy.float64) / scale, ref / scale, atol=2e-2)


@gpu_test
def test_slopes_on_another_device_are_refused():
    import cupy

    if cupy.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs two GPUs")
    q, k, v = to_gpu(*random_inputs(numpy.random.default_rng(0), "float16", (1, 2, 16, 8), (1, 2, 16, 8)))
    with cupy.cuda.Device(1):
        slopes = cupy.ones(2, numpy.float32)
    with pytest.raises(ValueError, match="alibi_slopes is on device 1"):
        cupyflash.flash_attention_forward(q, k, v, alibi_slopes=slopes)


@gpu_test
@pytest.mark.parametrize("schedule", ["v1", "v2", "v2-mma"])
@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("case", ["q", "k", "v", "do"])
@pytest.mark.parametrize("head_dim", [64, 200])
def test_non_finite_inputs_with_modifiers_reach_the_outputs_the_reference_says(schedule, dtype, case, head_dim,
                                                                              monkeypatch):
    """The mask-exact rules through the modifiers: the repair kernels recompute flagged rows with the
    softcap and the slopes (a softcap turns an infinite score finite; NaN stays NaN)."""
    from cupyflash import _launch

    monkeypatch.setattr(_launch, "USE_WGMMA", schedule != "v2-mma")
    mods = dict(softcap=4.0, alibi_slopes=numpy.array([0.5, 0.03125], numpy.float32),
                sink=numpy.array([1.0, -0.5], numpy.float32))
    assert_non_finite_rules(dtype, True, case, to_gpu, head_dim, mods=mods, schedule=schedule.split("-")[0])


@gpu_test
@pytest.mark.parametrize("dtype, D", [("float16", 64), ("bfloat16", 128), ("float16", 200), ("float32", 64)])
def test_deterministic_backward_with_modifiers_is_bitwise_reproducible(dtype, D):
    """deterministic=True with every modifier: the same bits run to run (dsink's reductions included)."""
    import cupy

    rng = numpy.random.default_rng(5)
    q, k, v = (cupy.asarray(rng.standard_normal(s).astype(DTYPE_BY_NAME[dtype]))
               for s in ((2, 3, 500, D), (2, 1, 700, D), (1, 3, 700, D)))
    kw = dict(causal=True, softcap=3.0, alibi_slopes=cupy.asarray([0.5, 0.25, 0.125], numpy.float32),
              sink=cupy.asarray([0.0, 1.0, -1.0], numpy.float32))
    do = cupy.asarray(rng.standard_normal(q.shape).astype(DTYPE_BY_NAME[dtype]))
    assert len(reproducible_backward(q, k, v, do, **kw)) == 4


@gpu_test
@pytest.mark.parametrize("schedule", ["v1", "v2", "v2-mma"])
@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
@pytest.mark.parametrize("sink_shape, n_k", [((3,), 140), ((2, 1), 140), ((), 1), ((3,), 0)])
def test_sink_statistics_and_gradient_match_the_reference(schedule, dtype, sink_shape, n_k, monkeypatch):
    """m, l, o and dsink (summed over the dims the sink broadcasts along) against the reference; causal with
    Nq > Nk leaves rows that see no key (m = sink, l = 1), and Nk = 0 no key at all."""
    import cupy
    from cupyflash import _launch

    monkeypatch.setattr(_launch, "USE_WGMMA", schedule != "v2-mma")
    rng = numpy.random.default_rng(8)
    q, k, v = random_inputs(rng, dtype, (2, 3, 200, 64), (2, 3, n_k, 64))
    sink = rng.uniform(-2, 2, sink_shape).astype(numpy.float32)
    kw = dict(causal=True, sink=sink)
    o, m, l = cupyflash.flash_attention_forward(*to_gpu(q, k, v), schedule=schedule.split("-")[0], **kw)
    o_ref, m_ref, l_ref = reference.attention_forward(q, k, v, **kw)
    tol = {"float16": 3e-3, "float32": 1e-5, "float64": 1e-12}[dtype]
    numpy.testing.assert_allclose(m.get(), m_ref, rtol=tol, atol=tol)
    numpy.testing.assert_allclose(l.get(), l_ref, rtol=tol, atol=tol)
    numpy.testing.assert_allclose(o.get().astype(numpy.float64), o_ref, rtol=tol, atol=tol)
    do = rng.standard_normal(o.shape).astype(DTYPE_BY_NAME[dtype])
    grads = cupyflash.flash_attention_backward(cupy.asarray(do), *to_gpu(q, k, v), o, m, l,
                                               schedule=schedule.split("-")[0], **kw)
    refs = reference.attention_backward(do, q, k, v, o_ref, m_ref, l_ref, **kw)
    assert len(grads) == 4 and grads[3].shape == sink.shape
    assert grads[3].dtype == (numpy.float64 if dtype == "float64" else numpy.float32)
    scale = max(1.0, float(numpy.abs(refs[3]).max()))
    numpy.testing.assert_allclose(grads[3].get() / scale, refs[3] / scale, atol=10 * tol)


@gpu_test
@pytest.mark.parametrize("first, then", [("alibi_slopes", "sink"), ("sink", "alibi_slopes")])
def test_slopes_and_sinks_of_one_layout_do_not_share_a_kept_plan(first, then):
    """A call keeps its plan under its arrays' layouts: slopes and sinks of the same shape, strides and
    dtype must not reuse each other's plan (each runs another specialisation)."""
    import cupy

    rng = numpy.random.default_rng(4)
    q, k, v = to_gpu(*random_inputs(rng, "float16", (2, 3, 64, 32), (2, 3, 64, 32)))
    values = cupy.asarray([0.5, 0.25, 0.125], numpy.float32)
    for name in (first, then):
        o, m, l = cupyflash.flash_attention_forward(q, k, v, **{name: values})
        o_ref, m_ref, l_ref = reference.attention_forward(q.get(), k.get(), v.get(), **{name: values.get()})
        numpy.testing.assert_allclose(m.get(), m_ref, atol=2e-2)
        numpy.testing.assert_allclose(l.get(), l_ref, rtol=2e-2)


@pytest.mark.parametrize("on", [(), ("alibi",), ("sink", "mask"), ("alibi", "sink", "bias", "bias_grad"),
                                ("softcap", "alibi", "sink", "bias", "mask", "bias_grad", "dropout")])
def test_the_kernels_modifier_fields_come_by_name_from_the_layout(on):
    """ScoreMods (params.cuh) from a call's batch layout, by member: each array's collapsed strides are
    those of the layout's tensor of its flag's name (wherever it lies), a per-pair array's with its query
    and key strides; dbias_add, the softcap, dropout's threshold and scale; the members of a modifier
    not used are 0 (pointers and the seed are written per call)."""
    from cupyflash import _params
    from cupyflash._launch import BatchLayout, Mods

    strides = {"alibi": (0, 1, 0), "sink": (3, 0, 0), "bias": (0, 7, 0), "mask": (11, 0, 0), "bias_grad": (13, 0, 0)}
    member = {"alibi": "alibi", "sink": "sink", "bias": "bias", "mask": "keep", "bias_grad": "dbias"}
    pairs = {"bias": (5, 1), "mask": (0, 1), "bias_grad": (7, 0)}
    names = [name for name in reversed(list(strides)) if name in on] + ["q", "k", "v"]   # any order
    layout = BatchLayout((4, 5, 6), tuple(strides.get(n, (100, 10, 1)) for n in names), tuple(names))
    mods = Mods(frozenset(on), 2.5 if "softcap" in on else None, 0.25 if "dropout" in on else 0.0,
                tuple((n, ij) for n, ij in pairs.items() if n in on))
    filled = _params.Params(_params.FWD, (), mods=mods.fields(layout, "bias_grad" in on))
    got = numpy.frombuffer(filled.template[8:], _params.FWD)[0]["mods"]
    for name, m in member.items():
        want = (0, *strides[name], *pairs.get(name, ())) if name in on else (0,) * len(got[m])
        assert tuple(got[m]) == want, name
    assert got["dbias_add"] == ("bias_grad" in on) and got["softcap"] == (2.5 if "softcap" in on else 0)
    assert (got["threshold"], got["keep_scale"]) == ((2**30, 1 / 0.75) if "dropout" in on else (0, 1.0))
    assert got["seed"] == 0 and got["batch0"] == 0 and not got["user"]["slot"].any()


@pytest.mark.parametrize("name", ["alibi_slopes", "sink"])
def test_a_cupy_array_of_values_with_numpy_inputs_is_refused(name, monkeypatch):
    """Per-entry values of the other array kind than q, k, v: a TypeError naming both (a stand-in for
    cupy.ndarray, so that the check runs without a GPU)."""
    import types

    from cupyflash import _checks

    class FakeCupyArray:
        shape, dtype = (3,), numpy.dtype(numpy.float32)

    monkeypatch.setattr(_checks, "_cupy", lambda: types.SimpleNamespace(ndarray=FakeCupyArray))
    q, k, v = random_inputs(numpy.random.default_rng(0), "float32", (2, 3, 10, 8), (2, 3, 12, 8))
    with pytest.raises(TypeError, match=f"{name} is a cupy.ndarray but q, k, v are NumPy arrays"):
        cupyflash.flash_attention_forward(q, k, v, **{name: FakeCupyArray()})
