"""Packed GQA (issue #18; cupyflash/_fold.py): query heads that share a K/V head folded into the rows.

Which calls fold (the dims, the visibility and modifiers that allow it, the GPU's grid rule), and that a
folded call returns what the unfolded one does: forward and backward, MQA and GQA layouts, ``out=``,
on the NumPy path here and on the GPU where there is one (a second, kept-plan call included).
"""

import numpy as np
import pytest

import cupyflash
from cupyflash import reference
from cupyflash._checks import check_forward
from cupyflash._fold import Fold, fold_of, foldable, keeps_the_gpu_busy
from helpers import ARRAY_MODULES, array_module_named, host


def _arrays(*shapes, dtype=np.float32, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s).astype(dtype) for s in shapes]


@pytest.mark.parametrize("q_shape, kv_shape, want", [
    ((2, 4, 3, 5, 8), (2, 4, 1, 7, 8), Fold(1, 3)),     # GQA: (B, Hkv, G, N, D) against (B, Hkv, 1, N, D)
    ((2, 6, 5, 8), (2, 1, 7, 8), Fold(1, 6)),           # MQA
    ((2, 6, 5, 8), (7, 8), Fold(2, 12)),                # one K/V for every batch entry and head
    ((2, 6, 5, 8), (1, 1, 7, 8), Fold(2, 12)),
    ((2, 6, 5, 8), (2, 6, 7, 8), None),                 # MHA: nothing shared
    ((1, 6, 5, 8), (2, 1, 7, 8), Fold(1, 6)),           # q broadcast over the batch, k over the heads
    ((2, 1, 5, 8), (2, 1, 7, 8), None),                 # a group of one
    ((2, 4, 3, 5, 8), (2, 1, 3, 7, 8), None),           # k broadcast, but not along q's last batch dim
])
def test_the_fold_takes_the_trailing_dims_k_and_v_are_broadcast_along(q_shape, kv_shape, want):
    q, k = np.zeros(q_shape, np.float32), np.zeros(kv_shape, np.float32)
    batch = np.broadcast_shapes(q_shape[:-2], kv_shape[:-2])
    assert fold_of(batch, q, k, k) == want


def test_a_q_whose_groups_are_not_beside_its_rows_in_memory_does_not_fold():
    q = np.zeros((2, 5, 6, 8), np.float32).transpose(0, 2, 1, 3)      # (B, H, N, D) with H outside N in memory
    k = np.zeros((2, 1, 7, 8), np.float32)
    assert fold_of((2, 6), q, k, k) is None
    o = np.zeros((2, 6, 5, 8), np.float32)[..., ::2, :]                # an o (do) that is not contiguous
    assert fold_of((2, 6), np.zeros((2, 6, 3, 8), np.float32), k, k, o) is None


@pytest.mark.parametrize("causal, Nq, window, dropout, modifier, want", [
    (False, 5, (None, None), 0.0, None, True),
    (True, 1, (None, None), 0.0, None, True),        # one query row sees every key bottom-right
    (True, 5, (None, None), 0.0, None, False),
    (False, 5, (3, None), 0.0, None, False),
    (False, 5, (None, None), 0.1, None, False),
    (False, 5, (None, None), 0.0, "slopes", False),
])
def test_only_calls_that_treat_every_query_row_alike_fold(causal, Nq, window, dropout, modifier, want):
    q, k = np.zeros((2, 4, Nq, 8), np.float32), np.zeros((2, 1, 7, 8), np.float32)
    prob = check_forward(q, k, k, causal, None, window)
    assert foldable(prob, (modifier, None, None, None, None, None), dropout) == want


def test_on_the_gpu_a_fold_keeps_half_a_wave_of_ctas():
    q, k = np.zeros((16, 8, 4, 1, 8), np.float32), np.zeros((16, 8, 1, 9, 8), np.float32)
    prob = check_forward(q, k, k, False, None)
    fold = fold_of(prob.batch_shape, q, k, k)
    assert keeps_the_gpu_busy(prob, fold, 128, 132)                    # 128 CTAs instead of 512
    small = check_forward(q[:1], k[:1], k[:1], False, None)
    assert not keeps_the_gpu_busy(small, fold_of(small.batch_shape, q[:1], k[:1], k[:1]), 128, 132)   # 8 of 32
    long = check_forward(np.zeros((1, 2, 4, 4096, 8)), np.zeros((1, 2, 1, 4096, 8)), np.zeros((1, 2, 1, 4096, 8)),
                         False, None)
    long_fold = fold_of(long.batch_shape, *(np.zeros(s) for s in ((1, 2, 4, 4096, 8), (1, 2, 1, 4096, 8),
                                                                  (1, 2, 1, 4096, 8))))
    assert keeps_the_gpu_busy(long, long_fold, 128, 132)
    assert keeps_the_gpu_busy(long, long_fold, 64, 132, backward=True)        # 2 heads x 64 K/V tiles: half a wave
    assert not keeps_the_gpu_busy(long, long_fold, 512, 132, backward=True)   # 2 x 8: too few


@pytest.mark.parametrize("xp_name", ARRAY_MODULES)
@pytest.mark.parametrize("q_shape, kv_shape, causal", [
    ((16, 8, 4, 1, 64), (16, 8, 1, 300, 64), True),     # decoding, GQA x4 (causal: one row sees every key)
    ((2, 3, 4, 70, 40), (2, 3, 1, 90, 40), False),      # prefill, not causal
    ((3, 6, 33, 64), (3, 1, 50, 64), False),            # MQA
])
def test_a_folded_call_returns_what_the_unfolded_call_does(xp_name, q_shape, kv_shape, causal):
    """The same call on q laid out so that it cannot fold (its heads outside its rows in memory) gives
    the same o, m, l and gradients to rounding, and both match the float64 reference."""
    xp = array_module_named(xp_name)
    q, k, v = _arrays(q_shape, kv_shape, kv_shape)
    do = _arrays(q_shape, seed=1)[0]
    g = [xp.asarray(x) for x in (q, k, v, do)]
    unfold = lambda x: xp.ascontiguousarray(xp.moveaxis(x, -2, 0)).transpose(  # noqa: E731  same values, rows outermost
        *range(1, x.ndim - 1), 0, x.ndim - 1)
    out = cupyflash.flash_attention_forward(*g[:3], causal=causal)
    plain = cupyflash.flash_attention_forward(unfold(g[0]), *g[1:3], causal=causal)
    ref = reference.attention_forward(q, k, v, causal=causal)
    for got, want, exact in zip(out, plain, ref):
        assert got.shape == want.shape == exact.shape
        np.testing.assert_allclose(host(got), host(want), rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(host(got), exact, rtol=1e-4, atol=1e-5)
    grads = cupyflash.flash_attention_backward(g[3], *g[:3], *out, causal=causal)
    plain_grads = cupyflash.flash_attention_backward(unfold(g[3]), unfold(g[0]), *g[1:3], unfold(out[0]), *out[1:],
                                                     causal=causal)
    ref_grads = reference.attention_backward(do, q, k, v, *(host(x) for x in out), causal=causal)
    for got, want, exact in zip(grads, plain_grads, ref_grads):
        assert got.shape == want.shape == exact.shape
        scale = np.abs(exact).max()
        np.testing.assert_allclose(host(got) / scale, host(want) / scale, atol=1e-5)
        np.testing.assert_allclose(host(got) / scale, exact / scale, atol=1e-4)
    again = cupyflash.flash_attention_forward(*g[:3], causal=causal)       # a kept plan on the GPU
    for x, y in zip(again, out):
        assert x.shape == y.shape
        np.testing.assert_array_equal(host(x), host(y))


@pytest.mark.parametrize("xp_name", ARRAY_MODULES)
def test_a_folded_call_fills_out(xp_name):
    xp = array_module_named(xp_name)
    q, k, v = (xp.asarray(x) for x in _arrays((2, 2, 4, 3, 32), (2, 2, 1, 50, 32), (2, 2, 1, 50, 32)))
    want = cupyflash.flash_attention_forward(q, k, v)
    out = tuple(xp.empty_like(x) for x in want)
    got = cupyflash.flash_attention_forward(q, k, v, out=out)
    assert all(a is b for a, b in zip(got, out))
    for x, y in zip(out, want):
        np.testing.assert_array_equal(host(x), host(y))
    do = xp.asarray(_arrays((2, 2, 4, 3, 32), seed=3)[0])
    grads = cupyflash.flash_attention_backward(do, q, k, v, *want, deterministic=True)   # the same sums' order
    out = tuple(xp.empty_like(x) for x in (q, k, v))
    got = cupyflash.flash_attention_backward(do, q, k, v, *want, out=out, deterministic=True)
    for x, y, z in zip(got, out, grads):
        assert x is y
        np.testing.assert_array_equal(host(x), host(z))


def test_the_numpy_path_runs_a_foldable_call_folded(monkeypatch):
    """The CPU path folds too (fewer, longer matrices), so these tests see the reshapes the GPU path makes."""
    from cupyflash import blocked

    seen = []
    forward, backward = blocked.forward, blocked.backward
    monkeypatch.setattr(blocked, "forward", lambda q, k, v, **kw: seen.append((q.shape, k.shape)) or forward(q, k, v, **kw))
    monkeypatch.setattr(blocked, "backward", lambda do, q, k, v, *a, **kw: seen.append((q.shape, k.shape))
                        or backward(do, q, k, v, *a, **kw))
    q, k, v, do = _arrays((2, 3, 4, 5, 8), (2, 3, 1, 6, 8), (2, 3, 1, 6, 8), (2, 3, 4, 5, 8))
    o, m, l = cupyflash.flash_attention_forward(q, k, v)
    cupyflash.flash_attention_backward(do, q, k, v, o, m, l)
    assert seen == [((2, 3, 20, 8), (2, 3, 6, 8))] * 2
    assert o.shape == (2, 3, 4, 5, 8) and m.shape == l.shape == (2, 3, 4, 5)
