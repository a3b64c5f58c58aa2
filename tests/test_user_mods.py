"""score_mod, score_mod_grad, mask_mod and mod_args on the float64 reference, the blocked CPU path, the
API's NumPy path and every GPU kernel: expressions that restate a built-in variant give its result
exactly, the blocked path equals the reference on any tiling, the kernels equal the reference.

The GPU tests compile specialisations of their own (each expression text is one), which
tests/gpu/warm.py does not hold; the full tier (tests/gpu/tier.py) compiles them in its workers."""

import numpy
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import cupyflash
from cupyflash import blocked, reference
from helpers import assert_refused, gpu_test, random_inputs

SLOPES = numpy.array([0.5, 0.25, 0.125])
SOFTCAP = "c * tanhf(s / c)"
SOFTCAP_GRAD = "1 - tanhf(s / c) * tanhf(s / c)"


def inputs(seed=0, n_q=70, n_k=90):
    return random_inputs(numpy.random.default_rng(seed), "float64", (2, 3, n_q, 16), (2, 3, n_k, 16))


@pytest.mark.parametrize("builtin, user", [
    (dict(causal=True), dict(mask_mod="kv_idx <= q_idx + off", mod_args={"off": 20})),
    (dict(window=(8, 3)), dict(mask_mod="kv_idx >= q_idx + 20 - 8 && kv_idx <= q_idx + 20 + 3")),
    (dict(softcap=2.0), dict(score_mod=SOFTCAP, score_mod_grad=SOFTCAP_GRAD, mod_args={"c": 2.0})),
    (dict(alibi_slopes=SLOPES), dict(score_mod="s - sl[b % 3] * abs(q_idx + 20 - kv_idx)", score_mod_grad="1",
                                     mod_args={"sl": SLOPES})),
    (dict(softcap=3.0, causal=True), dict(score_mod=SOFTCAP, score_mod_grad=SOFTCAP_GRAD,
                                          mask_mod="kv_idx <= q_idx + 20", mod_args={"c": 3.0})),
])
def test_expressions_restating_a_builtin_variant_give_its_result(builtin, user):
    q, k, v = inputs()
    plain = reference.attention_forward(q, k, v, **builtin)
    fwd = {key: x for key, x in user.items() if key != "score_mod_grad"}
    for got, want in zip(reference.attention_forward(q, k, v, **fwd), plain):
        numpy.testing.assert_allclose(got, want, rtol=1e-13, atol=1e-13)
    do = numpy.random.default_rng(1).standard_normal(plain[0].shape)
    want = reference.attention_backward(do, q, k, v, *plain, **builtin)
    got = reference.attention_backward(do, q, k, v, *plain, **user)
    for x, y in zip(got, want):
        numpy.testing.assert_allclose(x, y, rtol=1e-12, atol=1e-12)


@st.composite
def restatements(draw):
    """``(n_q, n_k, built-in keywords, the same by expressions)``: causal, a window, a softcap, ALiBi
    slopes, a document mask (self-attention over documents of drawn lengths) and a bias from a drawn
    ``mod_args`` table, each alone or a few together, an expression possibly beside a built-in."""
    n_q, n_k = draw(st.integers(1, 60)), draw(st.integers(1, 60))
    off = n_k - n_q                                   # bottom-right alignment: row i sits at key i + off
    builtin, masks, scores, grads, args = {}, [], [], [], {"off": off}
    kinds = draw(st.sets(st.sampled_from(["causal", "window", "softcap", "alibi", "documents", "table"]),
                         min_size=1, max_size=3))
    if "documents" in kinds:                          # documents need one position per query and key
        n_k, off = n_q, 0
        args["off"] = 0
        cuts = sorted(draw(st.sets(st.integers(1, max(1, n_q - 1)), max_size=4)) if n_q > 1 else [])
        doc = numpy.searchsorted(numpy.array(cuts, numpy.int64), numpy.arange(n_q), side="right").astype(numpy.int32)
        builtin["mask"] = doc[:, None] == doc[None, :]
        masks.append("doc[q_idx] == doc[kv_idx]")
        args["doc"] = doc
    if "causal" in kinds:
        builtin["causal"] = True
        masks.append("kv_idx <= q_idx + off")
    if "window" in kinds:
        left, right = draw(st.integers(0, 20)), draw(st.integers(0, 20))
        builtin["window"] = (left, right)
        masks.append("kv_idx >= q_idx + off - wl && kv_idx <= q_idx + off + wr")
        args.update(wl=left, wr=right)
    if "table" in kinds:                              # a bias by a periodic table
        table = draw(st.lists(st.floats(-3, 3), min_size=35, max_size=35))
        args["tab"] = numpy.array(table)
        builtin["bias"] = args["tab"][(numpy.arange(n_q)[:, None] % 5) * 7 + numpy.arange(n_k)[None, :] % 7]
        scores.append("tab[(q_idx % 5) * 7 + kv_idx % 7]")
        grads.append(None)
    if "alibi" in kinds:
        slopes = numpy.array(draw(st.lists(st.floats(0.01, 1.0), min_size=3, max_size=3)))
        builtin["alibi_slopes"] = slopes
        scores.append("-sl[b % 3] * abs(q_idx + off - kv_idx)")
        args["sl"] = slopes
    user = dict(mod_args=args)
    if "softcap" in kinds:                            # the softcap first: the others add to the capped score
        c = draw(st.floats(0.5, 10.0))
        builtin["softcap"] = c
        args["c"] = c
        user["score_mod"] = " + ".join([SOFTCAP] + scores) if scores else SOFTCAP
        user["score_mod_grad"] = SOFTCAP_GRAD
    elif scores:
        user["score_mod"] = " + ".join(["s"] + scores)
        user["score_mod_grad"] = "1"
    if masks:
        # an expression may stand beside a built-in: one drawn mask stays a keyword
        others = len(masks) > 1 or "score_mod" in user      # an expression remains beside the kept one
        kept = draw(st.sampled_from([None] + [k for k in ("causal", "window") if k in kinds and others]))
        if kept is not None:
            masks.remove({"causal": "kv_idx <= q_idx + off",
                          "window": "kv_idx >= q_idx + off - wl && kv_idx <= q_idx + off + wr"}[kept])
            user[kept] = builtin[kept]
        if masks:
            user["mask_mod"] = " && ".join(f"({m})" for m in masks)
    return n_q, n_k, builtin, user


@settings(deadline=None, max_examples=60)
@given(restatements(), st.integers(0, 2**32 - 1))
def test_drawn_expressions_restating_built_ins_give_their_results(case, seed):
    """The reference and the API's NumPy path (the blocked Algorithm 1), forward and backward: expressions
    restating causal, a window, a softcap, ALiBi, a document mask and a bias table (alone, together, and
    beside built-in keywords) give the built-in keywords' results to rounding."""
    import cupyflash

    n_q, n_k, builtin, user = case
    rng = numpy.random.default_rng(seed)
    q, k, v = random_inputs(rng, "float64", (2, 3, n_q, 16), (2, 3, n_k, 16))
    forward_kw = {key: x for key, x in user.items() if key != "score_mod_grad"}
    want = reference.attention_forward(q, k, v, **builtin)
    do = rng.standard_normal(want[0].shape)
    want_grads = reference.attention_backward(do, q, k, v, *want, **builtin)
    for forward, backward in ((reference.attention_forward, reference.attention_backward),
                              (cupyflash.flash_attention_forward, cupyflash.flash_attention_backward)):
        got = forward(q, k, v, **forward_kw)
        for name, x, y in zip("oml", got, want):
            numpy.testing.assert_allclose(x, y, rtol=1e-12, atol=1e-12, err_msg=name)
        for name, x, y in zip(("dq", "dk", "dv"), backward(do, q, k, v, *want, **user), want_grads):
            numpy.testing.assert_allclose(x, y, rtol=1e-10, atol=1e-10, err_msg=name)


@gpu_test
@settings(deadline=None, max_examples=12)
@given(restatements(), st.integers(0, 2**32 - 1))
def test_drawn_expressions_restating_built_ins_give_their_results_on_the_gpu(case, seed):
    """The same on the GPU in float64 (each drawn expression text a specialisation of its own): the
    kernels with the expressions against the kernels with the built-in keywords, both against the
    reference."""
    import cupy

    import cupyflash

    n_q, n_k, builtin, user = case
    rng = numpy.random.default_rng(seed)
    q, k, v = random_inputs(rng, "float64", (2, 3, n_q, 16), (2, 3, n_k, 16))
    do = rng.standard_normal((2, 3, n_q, 16))
    to_gpu = (lambda kw: {key: cupy.asarray(x) if isinstance(x, numpy.ndarray) and key != "mod_args" else x
                          for key, x in kw.items()})
    gq, gk, gv, gdo = (cupy.asarray(x) for x in (q, k, v, do))
    forward_kw = {key: x for key, x in user.items() if key != "score_mod_grad"}
    want = reference.attention_forward(q, k, v, **builtin)
    want_grads = reference.attention_backward(do, q, k, v, *want, **builtin)
    plain = cupyflash.flash_attention_forward(gq, gk, gv, **to_gpu(builtin))
    plain_grads = cupyflash.flash_attention_backward(gdo, gq, gk, gv, *plain, **to_gpu(builtin))
    got = cupyflash.flash_attention_forward(gq, gk, gv, **to_gpu(forward_kw))
    grads = cupyflash.flash_attention_backward(gdo, gq, gk, gv, *got, **to_gpu(user))
    for name, x, y, ref in zip(("o", "m", "l", "dq", "dk", "dv"), (*got, *grads), (*plain, *plain_grads),
                               (*want, *want_grads)):
        numpy.testing.assert_allclose(x.get(), y.get(), rtol=1e-10, atol=1e-10, err_msg=name)
        numpy.testing.assert_allclose(x.get(), ref, rtol=1e-9, atol=1e-9, err_msg=name)


@settings(deadline=None, max_examples=25)
@given(st.integers(1, 80), st.integers(1, 80), st.sampled_from([(16, 16), (16, 64), (64, 32)]),
       st.booleans(), st.integers(0, 2**32 - 1))
def test_the_blocked_path_equals_the_reference(n_q, n_k, tile, causal, seed):
    q, k, v = inputs(seed, n_q, n_k)
    weights = numpy.random.default_rng(seed).standard_normal(n_k)
    kw = dict(causal=causal, score_mod="s * (1 + 0.1f * w[kv_idx]) + (b % 2 ? 0.5f : 0.0f)",
              mask_mod="(q_idx * 7 + kv_idx * 3 + b) % 4 != 0", mod_args={"w": weights})
    out = blocked.forward(q, k, v, block_r=tile[0], block_c=tile[1], **kw)
    ref = reference.attention_forward(q, k, v, **kw)
    for got, want in zip(out, ref):
        numpy.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    do = numpy.random.default_rng(seed + 1).standard_normal(ref[0].shape)
    grad_kw = dict(kw, score_mod_grad="1 + 0.1f * w[kv_idx]")
    grads = blocked.backward(do, q, k, v, *ref, block_r=tile[0], block_c=tile[1], **grad_kw)
    for got, want in zip(grads, reference.attention_backward(do, q, k, v, *ref, **grad_kw)):
        numpy.testing.assert_allclose(got, want, rtol=1e-11, atol=1e-11)


def test_a_score_mod_gradient_matches_finite_differences():
    """score_mod_grad is used as the derivative: d(sum o * do)/dq by central differences."""
    q, k, v = inputs(3, 5, 6)
    kw = dict(score_mod="s * s * 0.5f + w[kv_idx] * s", mod_args={"w": numpy.linspace(-1, 1, 6)})
    do = numpy.random.default_rng(4).standard_normal((2, 3, 5, 16))
    out = reference.attention_forward(q, k, v, **kw)
    dq = reference.attention_backward(do, q, k, v, *out, score_mod_grad="s + w[kv_idx]", **kw)[0]
    h, at = 1e-6, (1, 2, 3, 4)
    qp, qm = q.copy(), q.copy()
    qp[at] += h
    qm[at] -= h
    numeric = ((reference.attention_forward(qp, k, v, **kw)[0] - reference.attention_forward(qm, k, v, **kw)[0])
               * do).sum() / (2 * h)
    assert dq[at] == pytest.approx(numeric, rel=1e-6)


@pytest.mark.parametrize("kw, error, words", [
    (dict(mod_args={"c": 1.0}), ValueError, "mod_args is given without"),
    (dict(mask_mod="s > 0"), ValueError, "mask_mod: unknown name 's'"),
    (dict(score_mod="s", mod_args={"q_idx": 1}), ValueError, "mod_args name 'q_idx' is not free"),
    (dict(score_mod="s", mod_args={"float": 1}), ValueError, "mod_args name 'float' is not free"),
    (dict(score_mod="s", mod_args={"args": 1}), ValueError, "mod_args name 'args' is not free"),
    (dict(score_mod="s", mod_args={"LOG2E": 1}), ValueError, "mod_args name 'LOG2E' is not free"),
    (dict(score_mod="s", mod_args={"_x": 1}), ValueError, "mod_args name '_x' is not free"),
    (dict(score_mod="s", mod_args={"x": "a"}), TypeError, "mod_args['x'] must hold numbers"),
    (dict(score_mod="s", mod_args=[1]), TypeError, "mod_args must be a dict"),
    (dict(score_mod=3), TypeError, "score_mod must be a str"),
    (dict(score_mod="s +"), ValueError, "score_mod: unexpected end"),
])
def test_bad_expressions_and_arguments_are_refused_naming_them(kw, error, words):
    q, k, v = inputs(0, 4, 5)
    with pytest.raises(error) as raised:
        reference.attention_forward(q, k, v, **kw)
    assert words in str(raised.value)


def test_the_backward_of_a_score_mod_needs_its_derivative_and_only_then():
    q, k, v = inputs(0, 4, 5)
    out = reference.attention_forward(q, k, v, score_mod="2 * s")
    with pytest.raises(ValueError, match="needs score_mod_grad"):
        reference.attention_backward(out[0], q, k, v, *out, score_mod="2 * s")
    with pytest.raises(ValueError, match="score_mod_grad is given without a score_mod"):
        blocked.backward(out[0], q, k, v, *out, score_mod_grad="2")


@pytest.mark.parametrize("varlen", [False, True])
def test_the_api_numpy_path_takes_the_expressions(varlen):
    """flash_attention_forward/_backward (and the varlen pair: positions per sequence) on NumPy inputs
    equal the reference with the same expressions."""
    import cupyflash

    q, k, v = inputs(5, 40, 50)
    kw = dict(score_mod="s * g + w[kv_idx]", mask_mod="q_idx + kv_idx != 7",
              mod_args={"g": 0.8, "w": numpy.linspace(-1, 1, 50)})
    grad_kw = dict(kw, score_mod_grad="g")
    do = numpy.random.default_rng(6).standard_normal((2, 3, 40, 16))
    if varlen:
        cu_q, cu_k = numpy.array([0, 15, 40]), numpy.array([0, 30, 50])
        out = cupyflash.flash_attention_varlen_forward(q, k, v, cu_q, cu_k, **kw)
        ref = reference.attention_varlen_forward(q, k, v, cu_q, cu_k, **kw)
        grads = cupyflash.flash_attention_varlen_backward(do, q, k, v, *out, cu_q, cu_k, **grad_kw)
        ref_grads = reference.attention_varlen_backward(do, q, k, v, *ref, cu_q, cu_k, **grad_kw)
    else:
        out = cupyflash.flash_attention_forward(q, k, v, **kw)
        ref = reference.attention_forward(q, k, v, **kw)
        grads = cupyflash.flash_attention_backward(do, q, k, v, *out, **grad_kw)
        ref_grads = reference.attention_backward(do, q, k, v, *ref, **grad_kw)
    for got, want in zip((*out, *grads), (*ref, *ref_grads)):
        numpy.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    numpy.testing.assert_allclose(cupyflash.flash_attention(q, k, v, **kw), out[0] if not varlen else
                                  cupyflash.flash_attention_forward(q, k, v, **kw)[0], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("call", ["forward", "backward", "flash_attention", "varlen"])
def test_the_api_refuses_bad_expressions_naming_them(call):
    assert_refused(call, ValueError, "mask_mod: unknown name 's'", mask_mod="s > 0")
    assert_refused(call, TypeError, "mod_args must be a dict", mask_mod="kv_idx > 0", mod_args=[1])


GPU_TOL = {"float16": 2e-2, "bfloat16": 6e-2, "float32": 1e-4, "float64": 1e-10}


def assert_close_to(name, got, ref, dtype):
    """``got`` against the float64 reference, relative to the reference's largest magnitude."""
    got = numpy.asarray(got, numpy.float64)
    scale = max(numpy.abs(ref[numpy.isfinite(ref)]).max(initial=0.0), 1e-30)
    numpy.testing.assert_allclose(got / scale, ref / scale, atol=GPU_TOL[dtype], rtol=0, err_msg=name)


@gpu_test
@pytest.mark.parametrize("schedule", ["v1", "v2", "v2-mma"])
@pytest.mark.parametrize("dtype, D", [("float16", 64), ("bfloat16", 128), ("float16", 200), ("float32", 64),
                                      ("float64", 40)])
@pytest.mark.parametrize("varlen", [False, True])
def test_expressions_on_every_kernel_match_the_reference(schedule, dtype, D, varlen, monkeypatch):
    """score_mod (a softcap by expression plus a per-key weight read from a CuPy array), its derivative
    and a mask_mod (a band with holes) on every kernel, packed sequences too, against the reference."""
    import cupy
    import cupyflash
    from cupyflash import _launch

    monkeypatch.setattr(_launch, "USE_WGMMA", schedule != "v2-mma")
    rng = numpy.random.default_rng(7)
    q, k, v = random_inputs(rng, dtype, (2, 2, 130, D), (2, 2, 150, D))
    kw = dict(score_mod="c * tanhf(s / c) + w[kv_idx]", mask_mod="kv_idx <= q_idx + 40 && (q_idx + kv_idx) % 7 != 0",
              mod_args={"c": 5.0, "w": cupy.asarray(rng.standard_normal(150).astype(numpy.float32)), "n": 3})
    grad_kw = dict(kw, score_mod_grad="1 - tanhf(s / c) * tanhf(s / c)")
    gq, gk, gv = (cupy.asarray(x) for x in (q, k, v))
    do = rng.standard_normal((2, 2, 130, D)).astype(q.dtype)
    if varlen:
        cu_q, cu_k = numpy.array([0, 60, 130], numpy.int32), numpy.array([0, 90, 150], numpy.int32)
        out = cupyflash.flash_attention_varlen_forward(gq, gk, gv, cu_q, cu_k, schedule=schedule[:2], **kw)
        ref = reference.attention_varlen_forward(q, k, v, cu_q, cu_k, **kw)
        grads = cupyflash.flash_attention_varlen_backward(cupy.asarray(do), gq, gk, gv, *out, cu_q, cu_k,
                                                          schedule=schedule[:2], **grad_kw)
        ref_grads = reference.attention_varlen_backward(do, q, k, v, *(x.get() for x in out), cu_q, cu_k, **grad_kw)
    else:
        out = cupyflash.flash_attention_forward(gq, gk, gv, schedule=schedule[:2], **kw)
        ref = reference.attention_forward(q, k, v, **kw)
        grads = cupyflash.flash_attention_backward(cupy.asarray(do), gq, gk, gv, *out, schedule=schedule[:2], **grad_kw)
        ref_grads = reference.attention_backward(do, q, k, v, *(x.get() for x in out), **grad_kw)
    for name, got, want in zip(("o", "m", "l", "dq", "dk", "dv"), (*out, *grads), (*ref, *ref_grads)):
        assert_close_to(name, got.get(), want, dtype)


@gpu_test
def test_a_mask_mod_restating_causal_gives_the_causal_result():
    import cupy
    import cupyflash

    q, k, v = (cupy.asarray(x) for x in random_inputs(numpy.random.default_rng(8), "float16", (2, 4, 300, 64),
                                                        (2, 4, 300, 64)))
    plain = cupyflash.flash_attention_forward(q, k, v, causal=True)
    by_expression = cupyflash.flash_attention_forward(q, k, v, mask_mod="kv_idx <= q_idx")
    for x, y in zip(plain, by_expression):
        numpy.testing.assert_allclose(x.get().astype(numpy.float64), y.get().astype(numpy.float64), rtol=2e-3,
                                      atol=2e-3)


def gpu_attention(q, k, v, do, schedule, deterministic=False, varlen=None, **kw):
    """Forward and backward of NumPy inputs on the GPU under ``schedule`` ("v2-mma": the portable kernels
    where the Hopper ones would run), as NumPy arrays: o, m, l, dq, dk, dv."""
    import cupy
    import cupyflash

    gq, gk, gv, gdo = (cupy.asarray(x) for x in (q, k, v, do))
    if varlen is None:
        out = cupyflash.flash_attention_forward(gq, gk, gv, schedule=schedule[:2], **kw)
        grads = cupyflash.flash_attention_backward(gdo, gq, gk, gv, *out, schedule=schedule[:2],
                                                   deterministic=deterministic, **kw)
    else:
        out = cupyflash.flash_attention_varlen_forward(gq, gk, gv, *varlen, schedule=schedule[:2], **kw)
        grads = cupyflash.flash_attention_varlen_backward(gdo, gq, gk, gv, *out, *varlen, schedule=schedule[:2],
                                                          deterministic=deterministic, **kw)
    return [x.get() for x in (*out, *grads)]


def reference_attention(q, k, v, do, stored, varlen=None, **kw):
    """The reference's o, m, l and its gradients from ``stored`` (o, m, l as the kernels stored them)."""
    if varlen is None:
        return [*reference.attention_forward(q, k, v, **kw), *reference.attention_backward(do, q, k, v, *stored, **kw)]
    return [*reference.attention_varlen_forward(q, k, v, *varlen, **kw),
            *reference.attention_varlen_backward(do, q, k, v, *stored, *varlen, **kw)]


def assert_matches_reference(q, k, v, do, dtype, schedule, deterministic=False, varlen=None, **kw):
    got = gpu_attention(q, k, v, do, schedule, deterministic, varlen, **kw)
    want = reference_attention(q, k, v, do, got[:3], varlen, **kw)
    for name, x, y in zip(("o", "m", "l", "dq", "dk", "dv"), got, want):
        assert_close_to(name, x, y, dtype)


# Hides whole K/V tiles (keys in every other block of 96) and every key of the rows from 250 on: the tile
# map skips tiles, and rows and K/V tiles visit none
SPARSE_MASK = "q_idx < 250 && (kv_idx / 96) % 2 == 0"


@gpu_test
@pytest.mark.parametrize("schedule", ["v1", "v2", "v2-mma"])
@pytest.mark.parametrize("dtype, D", [("float16", 64), ("bfloat16", 200), ("float32", 64)])
@pytest.mark.parametrize("deterministic", [False, True])
def test_a_sparse_mask_mod_skips_tiles_on_every_kernel(schedule, dtype, D, deterministic, monkeypatch):
    """A mask_mod hiding whole tiles and whole rows: the tile map's visits (forward, backward and its
    deterministic dQ turns, which count only visited tiles) give the reference's result; rows that see
    no key get o = 0, m = -inf, l = 0 and no gradient."""
    from cupyflash import _launch

    monkeypatch.setattr(_launch, "USE_WGMMA", schedule != "v2-mma")
    rng = numpy.random.default_rng(11)
    q, k, v = random_inputs(rng, dtype, (2, 2, 300, D), (2, 2, 420, D))
    do = rng.standard_normal(q.shape).astype(q.dtype)
    assert_matches_reference(q, k, v, do, dtype, schedule, deterministic, mask_mod=SPARSE_MASK)


@gpu_test
@pytest.mark.parametrize("schedule", ["v2", "v2-mma"])
@pytest.mark.parametrize("case", ["by_entry", "documents", "documents-varlen", "with-causal"])
def test_tile_maps_per_entry_from_arrays_and_packed(schedule, case, monkeypatch):
    """Tile maps that differ by batch entry (mask_mod reads b), that read a mod_args array (written at
    every call, never kept), of packed sequences (per sequence) and beside causal=True."""
    import cupy
    from cupyflash import _launch

    monkeypatch.setattr(_launch, "USE_WGMMA", schedule != "v2-mma")
    rng = numpy.random.default_rng(12)
    q, k, v = random_inputs(rng, "float16", (2, 3, 330, 64), (2, 3, 330, 64))
    do = rng.standard_normal(q.shape).astype(q.dtype)
    documents = numpy.repeat(numpy.arange(5), [100, 37, 150, 1, 42]).astype(numpy.int32)
    kw = {"by_entry": dict(mask_mod="b % 2 == 0 ? kv_idx <= q_idx : kv_idx > q_idx + 64"),
          "documents": dict(mask_mod="doc[q_idx] == doc[kv_idx]", mod_args={"doc": cupy.asarray(documents)}),
          "documents-varlen": dict(mask_mod="doc[q_idx] == doc[kv_idx] || kv_idx < 8", mod_args={"doc": documents}),
          "with-causal": dict(mask_mod="(q_idx / 64) % 2 == 0 || kv_idx % 3 == 0", causal=True)}[case]
    varlen = None
    if case.endswith("varlen"):
        varlen = (numpy.array([0, 200, 330], numpy.int32), numpy.array([0, 130, 330], numpy.int32))
    assert_matches_reference(q, k, v, do, "float16", schedule, varlen=varlen, **kw)
    if case == "by_entry":   # the kept plan and map, read again
        assert_matches_reference(q, k, v, do, "float16", schedule, varlen=varlen, **kw)
    if case == "documents":  # the kept plan, the array changed in place: its map is written anew
        kw["mod_args"]["doc"][...] = cupy.asarray(numpy.repeat(numpy.arange(3), [30, 200, 100]).astype(numpy.int32))
        assert_matches_reference(q, k, v, do, "float16", schedule, varlen=varlen, **kw)


@pytest.mark.parametrize("varlen", [False, True])
@pytest.mark.parametrize("mod_args, keepable", [({"c": 2.0}, True), ({"w": numpy.array([4, 9])}, False)])
def test_a_call_that_copies_a_mod_args_array_keeps_no_plan(varlen, mod_args, keepable, monkeypatch):
    """A NumPy mod_args array is copied to the GPU each call, so no launch plan may keep the copy's
    address; numbers may be kept. With packed sequences the maxima join the plan's flags after mod_args'
    key, which once hid it: varlen calls kept plans pointing at the first call's freed copy."""
    import cupyflash.api as api

    seen = []
    kept_plan = api._kept_plan

    def record(inputs, out, names, flags, keepable=True):
        seen.append(keepable)
        return kept_plan(inputs, out, names, flags, keepable)

    monkeypatch.setattr(api, "_kept_plan", record)
    q, k, v = inputs()
    kw = dict(score_mod="s + (float)w[kv_idx % 2]" if "w" in mod_args else "c * s",
              score_mod_grad="1.0f" if "w" in mod_args else "c", mod_args=mod_args)
    if varlen:
        cu_q, cu_k = numpy.array([0, 30, 70], numpy.int32), numpy.array([0, 50, 90], numpy.int32)
        lens = dict(max_seqlen_q=40, max_seqlen_k=50)
        o, m, l = cupyflash.flash_attention_varlen_forward(q, k, v, cu_q, cu_k, score_mod=kw["score_mod"],
                                                           mod_args=mod_args, **lens)
        cupyflash.flash_attention_varlen_backward(o, q, k, v, o, m, l, cu_q, cu_k, **kw, **lens)
    else:
        o, m, l = cupyflash.flash_attention_forward(q, k, v, score_mod=kw["score_mod"], mod_args=mod_args)
        cupyflash.flash_attention_backward(o, q, k, v, o, m, l, **kw)
    assert seen == [keepable, keepable]


@gpu_test
def test_a_numpy_mod_args_array_changed_between_varlen_calls_is_read_anew():
    """Two varlen calls with a NumPy mod_args array of new values: each reads its own (the second call
    once read the first call's freed copy through a kept plan), and a deterministic backward run twice
    gives the same bits."""
    import cupy

    rng = numpy.random.default_rng(3)
    q, k, v = random_inputs(rng, "float16", (3, 17, 16), (3, 23, 16))
    do = rng.standard_normal(q.shape).astype(q.dtype)
    cu_q, cu_k = numpy.array([0, 5, 5, 17], numpy.int32), numpy.array([0, 9, 13, 23], numpy.int32)
    gq, gk, gv, gdo, gcu_q, gcu_k = (cupy.asarray(x) for x in (q, k, v, do, cu_q, cu_k))
    lens = dict(max_seqlen_q=12, max_seqlen_k=10)
    mask_mod = "(q_idx + kv_idx) % 3 != 0 || kv_idx < w[b % 2]"
    for w in ([4, 9], [1, 2], [7, 3]):
        kw = dict(mask_mod=mask_mod, mod_args={"w": numpy.array(w)})
        o, m, l = cupyflash.flash_attention_varlen_forward(gq, gk, gv, gcu_q, gcu_k, **kw, **lens)
        ref = reference.attention_varlen_forward(q, k, v, cu_q, cu_k, **kw)
        for name, got, want in zip(("o", "m", "l"), (o, m, l), ref):
            numpy.testing.assert_allclose(got.get(), want, rtol=2e-2, atol=2e-2, err_msg=f"{name}, w = {w}")
        grads = [cupyflash.flash_attention_varlen_backward(gdo, gq, gk, gv, o, m, l, gcu_q, gcu_k,
                                                           deterministic=True, **kw, **lens) for _ in range(2)]
        ref_grads = reference.attention_varlen_backward(do, q, k, v, *ref, cu_q, cu_k, **kw)
        for name, a, b, want in zip(("dq", "dk", "dv"), *grads, ref_grads):
            assert a.get().tobytes() == b.get().tobytes(), f"{name}, w = {w}"
            numpy.testing.assert_allclose(a.get(), want, rtol=2e-2, atol=5e-2, err_msg=f"{name}, w = {w}")


@gpu_test
@pytest.mark.parametrize("schedule", ["v1", "v2", "v2-mma"])
@pytest.mark.parametrize("dtype, D", [("float16", 64), ("float16", 128), ("float32", 64)])
@pytest.mark.parametrize("where", ["k", "v"])
def test_a_key_or_value_that_is_not_finite_reaches_only_the_rows_a_mask_mod_lets_see_it(schedule, dtype, D, where,
                                                                                          monkeypatch):
    """The exact-masked-pairs rule under a document mask by expression: NaN and inf in keys and values
    reach only the rows of their own document, in o and in every gradient, both where their tile is
    one the tile map marks ALL (no scan needed there) and where it spans two documents (the scan flags
    it and the repair kernels redo the rows)."""
    import cupy
    from cupyflash import _launch
    from helpers import DTYPE_BY_NAME, to_gpu

    monkeypatch.setattr(_launch, "USE_WGMMA", schedule != "v2-mma")
    rng = numpy.random.default_rng(10)
    q, k, v = random_inputs(rng, dtype, (2, 2, 400, D), (2, 2, 400, D))
    bad = {"k": k, "v": v}[where]
    bad[0, 1, 250, 3] = numpy.nan     # document 1 (rows and keys 100 .. 299): tile (128.., 128..) is ALL
    bad[1, 0, 40, 0] = numpy.inf      # document 0 (0 .. 99), beside document 1's rows in the first tiles
    bad[1, 1, 330, 5] = -numpy.inf    # document 2 (300 .. 399)
    doc = numpy.repeat(numpy.arange(3), [100, 200, 100]).astype(numpy.int32)
    kw = dict(mask_mod="doc[q_idx] == doc[kv_idx]", mod_args={"doc": doc})
    gkw = dict(kw, mod_args={"doc": cupy.asarray(doc)})
    o, m, l = cupyflash.flash_attention_forward(*to_gpu(q, k, v), schedule=schedule[:2], **gkw)
    refs = reference.attention_forward(q, k, v, **kw)
    got = o.get().astype(numpy.float64)
    numpy.testing.assert_array_equal(numpy.isfinite(got), numpy.isfinite(refs[0]))
    assert not numpy.isfinite(refs[0]).all() and numpy.isfinite(refs[0]).any()
    fine = numpy.isfinite(refs[0])
    numpy.testing.assert_allclose(got[fine], refs[0][fine], atol=2e-2 if dtype == "float16" else 1e-4)
    do = rng.standard_normal(o.shape).astype(DTYPE_BY_NAME[dtype])
    grads = cupyflash.flash_attention_backward(cupy.asarray(do), *to_gpu(q, k, v), o, m, l, schedule=schedule[:2],
                                               **gkw)
    ref_grads = reference.attention_backward(do, q, k, v, *refs, **kw)
    for name, g, ref in zip(("dq", "dk", "dv"), grads, ref_grads):
        numpy.testing.assert_array_equal(numpy.isfinite(g.get().astype(numpy.float64)), numpy.isfinite(ref),
                                         err_msg=name)
