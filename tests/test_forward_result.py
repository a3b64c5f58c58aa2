"""The forward's result (``cupyflash.ForwardResult``): the tuple ``(o, m, l)`` as before, and
``.backward(do)``, which is the free backward of the same call with every keyword the forward had.

CPU: bit-equal to ``flash_attention_backward`` (``_varlen_backward``) given the same keywords, for each
modifier; without them the gradients differ, so the comparison can fail; the keywords passed are
exactly those the forward and the backward share, by identity. GPU: the same comparison with the
deterministic backward, bit for bit.
"""

import copy
import inspect
import pickle
import weakref

import numpy
import pytest

import cupyflash
from cupyflash import api
from helpers import ARRAY_MODULES, array_module_named, gpu_test, random_inputs, to_gpu

Q_SHAPE, KV_SHAPE = (2, 3, 17, 16), (2, 3, 23, 16)
SOFTCAP_MOD, SOFTCAP_MOD_GRAD = "c * tanhf(s / c)", "1 - tanhf(s / c) * tanhf(s / c)"


def keywords_of(name, rng, xp, dtype, batch=(2, 3), n_q=17, n_k=23):
    """``(forward keywords, backward-only keywords)`` of the variant ``name``, arrays in ``xp``."""
    heads = batch[-1:]
    if name == "plain":
        return {}, {}
    if name == "causal":
        return {"causal": True}, {}
    if name == "window":
        return {"window": (5, 2)}, {}
    if name == "softmax_scale":
        return {"softmax_scale": 0.3}, {}
    if name == "softcap":
        return {"softcap": 4.0}, {}
    if name == "alibi":
        return {"alibi_slopes": xp.asarray(rng.uniform(0.05, 0.5, heads).astype(numpy.float32))}, {}
    if name == "bias":
        return {"bias": xp.asarray(rng.standard_normal((*heads, n_q, n_k)).astype(dtype))}, {"bias_grad": True}
    if name == "mask":
        return {"mask": xp.asarray(rng.random((*batch[:-1], 1, n_q, n_k)) < 0.7)}, {}
    if name == "sink":
        return {"sink": xp.asarray(rng.standard_normal(heads).astype(numpy.float32))}, {}
    if name == "dropout":
        return {"dropout_p": 0.25, "seed": 1234}, {}
    if name == "score_mod":
        return {"score_mod": SOFTCAP_MOD, "mod_args": {"c": 2.0}}, {"score_mod_grad": SOFTCAP_MOD_GRAD}
    if name == "mask_mod":
        return {"mask_mod": "(q_idx + kv_idx) % 3 != 0 || kv_idx < w[b % 2]",
                "mod_args": {"w": numpy.array([4, 9])}}, {}
    if name == "causal softcap alibi sink bias":
        kw, own = keywords_of("bias", rng, xp, dtype, batch, n_q, n_k)
        for part in ("alibi", "sink", "softcap", "causal"):
            kw.update(keywords_of(part, rng, xp, dtype, batch, n_q, n_k)[0])
        return kw, own
    assert name == "schedule precision", name
    return {"schedule": "v1", "precision": "tf32"}, {}


# variants whose keywords change the attention (the NumPy path ignores schedule and precision)
CHANGING = ["causal", "window", "softmax_scale", "softcap", "alibi", "bias", "mask", "sink", "dropout", "score_mod",
            "mask_mod", "causal softcap alibi sink bias"]
VARIANTS = ["plain", *CHANGING, "schedule precision"]
VARLEN_VARIANTS = ["plain", "causal", "window", "alibi", "bias", "sink", "dropout", "score_mod", "mask_mod",
                   "causal softcap alibi sink bias"]
# three packed sequences: 5, 0 and 12 query rows against 9, 4 and 10 keys
CU_Q, CU_K = numpy.array([0, 5, 5, 17], numpy.int32), numpy.array([0, 9, 13, 23], numpy.int32)


def inputs(xp, dtype, seed, q_shape=Q_SHAPE, kv_shape=KV_SHAPE):
    rng = numpy.random.default_rng(seed)
    arrays = random_inputs(rng, dtype, q_shape, kv_shape) + [rng.standard_normal(q_shape).astype(dtype)]
    return rng, (arrays if xp is numpy else to_gpu(*arrays))


def bits(x) -> bytes:
    """The bytes of a NumPy or CuPy array, or of a NumPy scalar (the dsink of a scalar sink)."""
    return (x.get() if hasattr(x, "__cuda_array_interface__") else numpy.asarray(x)).tobytes()


def assert_same_bits(got, expected):
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert g.shape == e.shape and g.dtype == e.dtype
        assert bits(g) == bits(e)


def differ(got, other) -> bool:
    """Two backwards' results differ in count (a sink's dsink) or in the bits of one gradient."""
    return len(got) != len(other) or any(bits(a) != bits(b) for a, b in zip(got, other))


def keyword_only(function) -> set:
    return {n for n, p in inspect.signature(function).parameters.items() if p.kind is p.KEYWORD_ONLY}


# ---------------------------------------------------------------------------
# a tuple as before


@pytest.mark.parametrize("xp_name", ARRAY_MODULES)
def test_the_result_unpacks_and_indexes_as_the_tuple_o_m_l(xp_name):
    xp = array_module_named(xp_name)
    _, (q, k, v, _) = inputs(xp, numpy.float32, 0)
    result = cupyflash.flash_attention_forward(q, k, v, causal=True)
    o, m, l = result
    assert isinstance(result, tuple) and isinstance(result, cupyflash.ForwardResult) and len(result) == 3
    assert (result.o, result.m, result.l) == (result[0], result[1], result[2]) == (result[-3], result[-2], result[-1])
    assert all(a is b for a, b in zip((o, m, l), (result.o, result.m, result.l)))
    plain = tuple(result)
    assert type(plain) is tuple and all(a is b for a, b in zip(plain, result))
    assert type(result[:2]) is tuple and len(result[:2]) == 2 and result[2:][0] is l
    assert o.shape == (2, 3, 17, 16) and m.shape == l.shape == (2, 3, 17)
    assert_same_bits(result, cupyflash.flash_attention_forward(q, k, v, causal=True))
    assert repr(result).startswith("ForwardResult(o=")


@pytest.mark.parametrize("xp_name", ARRAY_MODULES)
def test_out_buffers_are_the_results_items_and_a_result_is_a_valid_out(xp_name):
    xp = array_module_named(xp_name)
    _, (q, k, v, do) = inputs(xp, numpy.float32, 1)
    first = cupyflash.flash_attention_forward(q, k, v, causal=True)
    buffers = tuple(xp.full(x.shape, numpy.nan, x.dtype) for x in first)
    again = cupyflash.flash_attention_forward(q, k, v, causal=True, out=buffers)
    assert all(a is b for a, b in zip(again, buffers))
    third = cupyflash.flash_attention_forward(q, k, v, causal=True, out=again)   # a result as out=: its arrays
    assert all(a is b for a, b in zip(third, buffers))
    assert_same_bits(third, first)
    assert_same_bits(third.backward(do, deterministic=True), first.backward(do, deterministic=True))


def test_a_varlen_result_is_the_tuple_o_m_l_too():
    _, (q, k, v, _) = inputs(numpy, numpy.float32, 2, (3, 17, 16), (3, 23, 16))
    result = cupyflash.flash_attention_varlen_forward(q, k, v, CU_Q, CU_K, causal=True)
    o, m, l = result
    assert isinstance(result, cupyflash.ForwardResult) and len(result) == 3 and result[2] is l is result.l
    assert_same_bits(tuple(result), cupyflash.flash_attention_varlen_forward(q, k, v, CU_Q, CU_K, causal=True))


def test_a_kvcache_step_returns_a_plain_tuple_as_it_has_no_backward():
    rng = numpy.random.default_rng(3)
    q, k_cache, v_cache = random_inputs(rng, "float32", (2, 4, 1, 16), (2, 2, 32, 16))
    result = cupyflash.flash_attention_with_kvcache(q, k_cache, v_cache, numpy.array([7, 20]))
    assert type(result) is tuple and len(result) == 3


# ---------------------------------------------------------------------------
# .backward is the free backward of the same call


@pytest.mark.parametrize("variant", VARIANTS)
def test_backward_of_the_result_is_the_free_backward_with_the_forwards_keywords(variant):
    rng, (q, k, v, do) = inputs(numpy, numpy.float32, 4)
    kw, own = keywords_of(variant, rng, numpy, numpy.float32)
    result = cupyflash.flash_attention_forward(q, k, v, **kw)
    got = result.backward(do, **own)
    assert len(got) == 3 + ("bias_grad" in own) + ("sink" in kw)
    assert_same_bits(got, cupyflash.flash_attention_backward(do, q, k, v, *result, **kw, **own))


@pytest.mark.parametrize("variant", CHANGING)
def test_the_backward_without_the_forwards_keywords_differs(variant):
    """What ``.backward`` guards against: each variant's keywords matter to the gradients (a sink's to
    dsink alone: its dq, dk, dv come from m and l), so the comparison above would catch one left out."""
    rng, (q, k, v, do) = inputs(numpy, numpy.float32, 5)
    kw, own = keywords_of(variant, rng, numpy, numpy.float32)
    result = cupyflash.flash_attention_forward(q, k, v, **kw)
    kept = result.backward(do, **own)
    dropped = cupyflash.flash_attention_backward(do, q, k, v, *result)
    assert differ(kept[:3] if variant != "sink" else kept, dropped)


@pytest.mark.parametrize("variant", VARLEN_VARIANTS)
def test_backward_of_a_varlen_result_is_the_free_varlen_backward(variant):
    rng, (q, k, v, do) = inputs(numpy, numpy.float32, 6, (3, 17, 16), (3, 23, 16))
    kw, own = keywords_of(variant, rng, numpy, numpy.float32, batch=(3,))
    kw = dict(kw, max_seqlen_q=12, max_seqlen_k=10) if variant == "causal" else kw
    result = cupyflash.flash_attention_varlen_forward(q, k, v, CU_Q, CU_K, **kw)
    got = result.backward(do, **own)
    assert len(got) == 3 + ("bias_grad" in own) + ("sink" in kw)
    assert_same_bits(got, cupyflash.flash_attention_varlen_backward(do, q, k, v, *result, CU_Q, CU_K, **kw, **own))
    if variant != "plain":
        dropped = cupyflash.flash_attention_varlen_backward(do, q, k, v, *result, CU_Q, CU_K)
        assert differ(got[:3] if variant != "sink" else got, dropped)


def test_backward_takes_out_buffers_and_deterministic():
    rng, (q, k, v, do) = inputs(numpy, numpy.float32, 7, (2, 3, 17, 16), (2, 1, 23, 16))
    result = cupyflash.flash_attention_forward(q, k, v, causal=True, sink=numpy.float32(0.5))
    out = tuple(numpy.full(x.shape, numpy.nan, x.dtype) for x in (q, k, v))
    got = result.backward(do, deterministic=True, out=out)
    assert all(g is b for g, b in zip(got, out)) and len(got) == 4
    assert_same_bits(got, cupyflash.flash_attention_backward(do, q, k, v, *result, causal=True,
                                                             sink=numpy.float32(0.5)))


def test_backward_refuses_what_the_free_backward_refuses():
    rng, (q, k, v, do) = inputs(numpy, numpy.float32, 8)
    with pytest.raises(ValueError, match="bias_grad=True needs a bias"):
        cupyflash.flash_attention_forward(q, k, v).backward(do, bias_grad=True)
    result = cupyflash.flash_attention_forward(q, k, v, score_mod=SOFTCAP_MOD, mod_args={"c": 2.0})
    with pytest.raises(ValueError, match="score_mod_grad"):
        result.backward(do)
    with pytest.raises(ValueError, match="do"):
        result.backward(do[..., :-1], score_mod_grad=SOFTCAP_MOD_GRAD)


# ---------------------------------------------------------------------------
# what it passes, and what it holds


def test_backward_passes_every_keyword_the_forward_and_the_backward_share():
    own = keyword_only(cupyflash.ForwardResult.backward)
    for forward, backward, names in (
            (cupyflash.flash_attention_forward, cupyflash.flash_attention_backward, api.BACKWARD_KEYWORDS),
            (cupyflash.flash_attention_varlen_forward, cupyflash.flash_attention_varlen_backward,
             api.VARLEN_BACKWARD_KEYWORDS)):
        shared = keyword_only(forward) & keyword_only(backward)
        assert set(names) == shared - own, backward.__name__
        assert keyword_only(backward) <= shared | own, backward.__name__   # the backward takes nothing else


ALL_KEYWORDS = dict(causal=True, softmax_scale=0.3, window=(6, 0), softcap=5.0, dropout_p=0.1, seed=3,
                    score_mod=SOFTCAP_MOD, mask_mod="kv_idx != 1", schedule="v1", precision="tf32")


@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
def test_backward_hands_on_the_forwards_own_objects(varlen, monkeypatch):
    """Every argument reaches the backward as the very object the forward was given or returned: held by
    reference, never copied, each under its own name."""
    calls = []
    name = "flash_attention_varlen_backward" if varlen else "flash_attention_backward"
    monkeypatch.setattr(api, name, lambda *args, **kw: calls.append((args, kw)) or "gradients")
    batch = (3,) if varlen else (2, 3)
    rng, (q, k, v, do) = inputs(numpy, numpy.float32, 9, (*batch, 17, 16), (*batch, 23, 16))
    kw = dict(ALL_KEYWORDS, alibi_slopes=rng.uniform(0.1, 0.5, 3).astype(numpy.float32),
              bias=rng.standard_normal((3, 17, 23)).astype(numpy.float32), mask=rng.random((17, 23)) < 0.8,
              sink=rng.standard_normal(3).astype(numpy.float32), mod_args={"c": 2.0})
    if varlen:
        kw.update(max_seqlen_q=12, max_seqlen_k=10)
        result = cupyflash.flash_attention_varlen_forward(q, k, v, CU_Q, CU_K, **kw)
    else:   # the block mask serves the same mask_mod and mod_args, the very dict
        kw["block_mask"] = cupyflash.block_mask(kw["mask_mod"], batch, 17, 23, mod_args=kw["mod_args"])
        result = cupyflash.flash_attention_forward(q, k, v, num_splits=1, **kw)
    own = dict(score_mod_grad=SOFTCAP_MOD_GRAD, bias_grad=True, deterministic=True, out=None)
    assert result.backward(do, **own) == "gradients"
    ((args, passed),) = calls
    expected = (do, q, k, v, *result, *((CU_Q, CU_K) if varlen else ()))
    assert len(args) == len(expected) and all(a is b for a, b in zip(args, expected))
    assert passed.keys() == {*kw, *own}
    assert all(passed[n] is value for n, value in {**kw, **own}.items())


def test_a_copied_or_pickled_result_keeps_its_call():
    rng, (q, k, v, do) = inputs(numpy, numpy.float32, 13)
    kw, own = keywords_of("causal softcap alibi sink bias", rng, numpy, numpy.float32)
    result = cupyflash.flash_attention_forward(q, k, v, **kw)
    expected = result.backward(do, **own)
    for again in (copy.copy(result), copy.deepcopy(result), pickle.loads(pickle.dumps(result))):
        assert type(again) is cupyflash.ForwardResult and len(again) == 3
        assert_same_bits(again, result)
        assert_same_bits(again.backward(do, **own), expected)


def test_the_result_keeps_the_forwards_inputs_alive_and_nothing_more():
    _, (q, k, v, do) = inputs(numpy, numpy.float32, 10)
    bias = numpy.zeros((17, 23), numpy.float32)
    result = cupyflash.flash_attention_forward(q, k, v, bias=bias)
    held = [weakref.ref(x) for x in (q, k, v, bias)]
    del q, k, v, bias
    assert all(ref() is not None for ref in held)
    result.backward(do, bias_grad=True)
    del result
    assert all(ref() is None for ref in held)


# ---------------------------------------------------------------------------
# GPU: the same, with the deterministic backward


@gpu_test
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", [numpy.float16, numpy.float32])
def test_backward_of_a_gpu_result_is_the_free_backward(variant, dtype):
    import cupy

    rng, (q, k, v, do) = inputs(cupy, dtype, 11)
    kw, own = keywords_of(variant, rng, cupy, dtype)
    result = cupyflash.flash_attention_forward(q, k, v, **kw)
    got = result.backward(do, deterministic=True, **own)
    assert_same_bits(got, cupyflash.flash_attention_backward(do, q, k, v, *result, deterministic=True, **kw, **own))


@gpu_test
@pytest.mark.parametrize("variant", VARLEN_VARIANTS)
def test_backward_of_a_gpu_varlen_result_is_the_free_varlen_backward(variant):
    import cupy

    rng, (q, k, v, do) = inputs(cupy, numpy.float16, 12, (3, 17, 16), (3, 23, 16))
    kw, own = keywords_of(variant, rng, cupy, numpy.float16, batch=(3,))
    cu_q, cu_k = to_gpu(CU_Q, CU_K)
    kw.update(max_seqlen_q=12, max_seqlen_k=10)
    result = cupyflash.flash_attention_varlen_forward(q, k, v, cu_q, cu_k, **kw)
    got = result.backward(do, deterministic=True, **own)
    assert_same_bits(got, cupyflash.flash_attention_varlen_backward(do, q, k, v, *result, cu_q, cu_k,
                                                                    deterministic=True, **kw, **own))
