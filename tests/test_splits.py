"""Split-KV (issue #18): ``num_splits`` runs each Q tile's K/V tiles in that many CTAs and merges their
``(o, m, l)`` (flash_merge.cu) in a fixed order.

On the CPU: the keyword's checks, the rule that picks the count, and the NumPy path (which computes
the unsplit attention). On the GPU: every split count gives the unsplit result to rounding, run to run
identically, on the V2 kernels (Hopper and portable) and every dtype, with the variants that touch a
split (a sink counted once, dropout's keep set, a mask_mod's tile map, windows, packed sequences) and
with packed GQA decoding.
"""

import numpy as np
import pytest

import cupyflash
from cupyflash import _launch
from helpers import FLOAT_DTYPES, gpu_test


def test_num_splits_is_checked_before_anything_runs():
    q = np.zeros((2, 8, 16), np.float32)
    for bad, error, words in ((0, ValueError, "num_splits must be >= 1"), (True, TypeError, "num_splits must be an int"),
                              (2.0, TypeError, "num_splits must be an int")):
        with pytest.raises(error, match=words):
            cupyflash.flash_attention_forward(q, q, q, num_splits=bad)
    with pytest.raises(ValueError, match="schedule='v2'"):
        cupyflash.flash_attention_forward(q, q, q, num_splits=2, schedule="v1")


def test_the_numpy_path_takes_num_splits_and_computes_the_unsplit_attention():
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal(s).astype(np.float32) for s in ((2, 3, 40, 16), (2, 3, 300, 16), (2, 3, 300, 16)))
    for x, y in zip(cupyflash.flash_attention_forward(q, k, v, num_splits=4), cupyflash.flash_attention_forward(q, k, v)):
        np.testing.assert_array_equal(x, y)


def test_the_split_count_fills_the_gpu_only_where_the_grid_does_not():
    assert _launch.choose_kv_splits(ctas=4096, kv_tiles=64, slots=132) == 1            # training: the grid fills it
    assert _launch.choose_kv_splits(ctas=8, kv_tiles=3, slots=132) == 1                # too few K/V tiles to split
    n = _launch.choose_kv_splits(ctas=8, kv_tiles=256, slots=132)                      # B 1, 8 K/V heads, decoding
    assert n > 1 and 8 * n / 132 / np.ceil(8 * n / 132) >= 0.8
    assert _launch.choose_kv_splits(ctas=1, kv_tiles=10, slots=132) <= 5               # two tiles a split at least


def _gpu():
    import cupy

    return cupy


def _run(q, k, v, **kw):
    return [x.get() for x in cupyflash.flash_attention_forward(q, k, v, **kw)]


def _assert_same_attention(split, whole, dtype):
    """o to a rounding of the dtype (the parts' o are rounded once more), m exactly, l to float32's."""
    o_tol = {"float16": 2e-3, "bfloat16": 1.6e-2, "float32": 1e-5, "float64": 1e-12}[np.dtype(dtype).name]
    scale = max(np.abs(whole[0].astype(np.float64)).max(), 1e-30)
    np.testing.assert_allclose(split[0].astype(np.float64) / scale, whole[0].astype(np.float64) / scale, atol=o_tol)
    np.testing.assert_array_equal(split[1], whole[1])
    np.testing.assert_allclose(split[2], whole[2], rtol=1e-5 if np.dtype(dtype) != np.float64 else 1e-12)


@gpu_test
@pytest.mark.parametrize("schedule", ["v2", "v2-mma"])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("causal", [False, True])
def test_every_split_count_gives_the_unsplit_attention(schedule, dtype, causal, monkeypatch):
    cupy = _gpu()
    monkeypatch.setattr(_launch, "USE_WGMMA", schedule == "v2")
    rng = np.random.default_rng(1)
    for q_shape, kv_shape in (((2, 3, 70, 64), (2, 3, 333, 64)), ((4, 2, 1, 128), (4, 2, 1000, 128))):
        q, k, v = (cupy.asarray(rng.standard_normal(s).astype(dtype)) for s in (q_shape, kv_shape, kv_shape))
        whole = _run(q, k, v, causal=causal, num_splits=1)
        for n in (2, 3, 7, 64, None):
            split = _run(q, k, v, causal=causal, num_splits=n)
            _assert_same_attention(split, whole, dtype)
            again = _run(q, k, v, causal=causal, num_splits=n)
            for x, y in zip(split, again):
                np.testing.assert_array_equal(x, y)


@gpu_test
@pytest.mark.parametrize("variant", ["sink", "dropout", "mask_mod", "window", "softcap-alibi", "bias", "varlen"])
def test_split_kv_with_the_variants_that_touch_a_split(variant):
    cupy = _gpu()
    rng = np.random.default_rng(2)
    q, k, v = (cupy.asarray(rng.standard_normal(s).astype(np.float16)) for s in ((2, 2, 50, 64), (2, 2, 600, 64),
                                                                                  (2, 2, 600, 64)))
    kw = {"sink": dict(sink=cupy.asarray(rng.standard_normal(2).astype(np.float32) + 3)),
          "dropout": dict(dropout_p=0.2, seed=7),
          "mask_mod": dict(mask_mod="(kv_idx / 64) % 3 != 1"),
          "window": dict(window=(200, 30), causal=False),
          "softcap-alibi": dict(softcap=5.0, alibi_slopes=cupy.asarray(np.array([0.1, 0.02], np.float32))),
          "bias": dict(bias=cupy.asarray(rng.standard_normal((50, 600)).astype(np.float16)))}.get(variant, {})
    if variant == "varlen":
        cu_q, cu_k = np.array([0, 20, 50], np.int32), np.array([0, 450, 600], np.int32)
        whole = [x.get() for x in cupyflash.flash_attention_varlen_forward(q, k, v, cu_q, cu_k, num_splits=1)]
        split = [x.get() for x in cupyflash.flash_attention_varlen_forward(q, k, v, cu_q, cu_k, num_splits=5)]
    else:
        whole, split = _run(q, k, v, num_splits=1, **kw), _run(q, k, v, num_splits=5, **kw)
    _assert_same_attention(split, whole, np.float16)


@gpu_test
@pytest.mark.parametrize("Hkv", [8, 1])
def test_packed_gqa_decoding_with_splits_gives_the_reference(Hkv):
    """A decoding step (one query row, causal) of 32 query heads against Hkv K/V heads: folded, split by
    the chosen count and merged, against the float64 reference; ``out=`` and a kept plan too."""
    cupy = _gpu()
    from cupyflash import reference

    rng = np.random.default_rng(3)
    G = 32 // Hkv
    q, k, v = (rng.standard_normal(s).astype(np.float16) for s in ((2, Hkv, G, 1, 128), (2, Hkv, 1, 3000, 128),
                                                                   (2, Hkv, 1, 3000, 128)))
    g = [cupy.asarray(x) for x in (q, k, v)]
    ref = reference.attention_forward(q, k, v, causal=True)
    out = cupyflash.flash_attention_forward(*g, causal=True)
    for got, want in zip(out, ref):
        scale = np.abs(want).max()
        np.testing.assert_allclose(got.get().astype(np.float64) / scale, want / scale, atol=2e-3)
    given = tuple(cupy.empty_like(x) for x in out)
    again = cupyflash.flash_attention_forward(*g, causal=True, out=given)
    for x, y in zip(again, out):
        np.testing.assert_array_equal(x.get(), y.get())
