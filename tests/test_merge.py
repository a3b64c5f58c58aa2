"""merge_attention and merge_attention_stacked (issue #18): attention over a key set split into disjoint
parts is the merge of the parts' (o, m, l).

Every test runs on NumPy arrays (the CPU path) and, where a GPU is present, on CuPy arrays (the fused
kernel, flash_merge.cu). Parts come from the library's own forward over a random partition of the keys
(empty parts included); the merge is held to the float64 reference (``cupyflash.reference``) with the
error the parts carry in, plus the merge's own rounding. Its rules: two parts commute exactly, an empty
part changes nothing bit for bit, a row no part saw is (0, -inf, 0), a NaN stays in the rows it
reaches; and with the merged statistics each part's backward gives its share of the gradients.
"""

import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import cupyflash
from cupyflash import reference
from helpers import ARRAY_MODULES, FLOAT16, FLOAT32, FLOAT64, FLOAT_DTYPES, array_module_named, gpu_test, host
from tolerances import ACCUMULATOR_ROUNDOFF, UNIT_ROUNDOFF, precision


def _stats_dtype(dtype):
    return np.float64 if dtype == FLOAT64 else np.float32


def _split_problem(rng, dtype, batch, n_q, n_k, D, parts, causal=False):
    """q, k, v (NumPy) and each key's part (``owner``, some parts possibly empty)."""
    q, k, v = (rng.standard_normal((*batch, n, D)).astype(dtype) for n in (n_q, n_k, n_k))
    owner = rng.integers(0, parts, n_k)
    return q, k, v, owner


def _parts(xp, q, k, v, owner, parts):
    """Each part's (o, m, l) by the library's forward over its own keys, on ``xp``'s arrays."""
    out = []
    for p in range(parts):
        keys = np.flatnonzero(owner == p)
        out.append(cupyflash.flash_attention_forward(*(xp.asarray(x) for x in (q, k[..., keys, :], v[..., keys, :]))))
    return out


def _exact_parts(q, k, v, owner, parts):
    keys = [np.flatnonzero(owner == p) for p in range(parts)]
    return [reference.attention_forward(q, k[..., idx, :], v[..., idx, :]) for idx in keys]


@settings(max_examples=25, deadline=None)
@given(dtype=st.sampled_from(FLOAT_DTYPES), parts=st.integers(1, 6), n_q=st.sampled_from([1, 3, 17, 64]),
       n_k=st.sampled_from([1, 5, 40, 130]), D=st.sampled_from([1, 8, 40, 64, 128, 200]),
       batch=st.sampled_from([(), (2,), (2, 3)]), seed=st.integers(0, 2**32 - 1))
@pytest.mark.parametrize("xp_name", ARRAY_MODULES)
def test_the_merge_of_key_splits_is_attention_over_all_keys(xp_name, dtype, parts, n_q, n_k, D, batch, seed):
    """Against the float64 attention over every key (the float64 merge of the exact parts, which is
    that attention to float64 rounding): o within the largest error a part brought in plus
    the merge's rounding (the merge is a convex combination), m within the parts' (max is 1-Lipschitz),
    l within the parts' relative error plus the sum's rounding."""
    xp = array_module_named(xp_name)
    rng = np.random.default_rng(seed)
    q, k, v, owner = _split_problem(rng, dtype, batch, n_q, n_k, D, parts)
    got_parts = _parts(xp, q, k, v, owner, parts)
    exact_parts = _exact_parts(q, k, v, owner, parts)
    o, m, l = (host(x) for x in cupyflash.merge_attention(got_parts))
    # the float64 merge of the exact parts: the attention over every key, to float64 rounding
    o_ref, m_ref, l_ref = reference.merge_attention(exact_parts)
    for x, y in zip((o_ref, m_ref, l_ref), reference.attention_forward(q, k, v)):
        np.testing.assert_allclose(x, y, rtol=1e-12, atol=1e-12)
    assert o.dtype == dtype and m.dtype == l.dtype == _stats_dtype(dtype)
    assert o.shape == o_ref.shape and m.shape == l.shape == m_ref.shape

    host_parts = [[host(x).astype(np.float64) for x in part] for part in got_parts]
    seen = [e[2] > 0 for e in exact_parts]
    o_in = max(np.abs(p[0] - e[0]).max() for p, e in zip(host_parts, exact_parts))
    m_in = max(np.abs(p[1][s] - e[1][s]).max(initial=0) for p, e, s in zip(host_parts, exact_parts, seen))
    l_in = max(np.abs(p[2][s] / e[2][s] - 1).max(initial=0) for p, e, s in zip(host_parts, exact_parts, seen))
    u, u_acc = UNIT_ROUNDOFF[precision(dtype)], ACCUMULATOR_ROUNDOFF[precision(dtype)]
    v_max = float(np.abs(v.astype(np.float64)).max())
    # the weights' rounding: exp of a difference of m's that each carry m_in, and 2 (P + 2) roundings
    weights = 2 * m_in + 2 * (parts + 2) * u_acc + 2 * l_in
    assert np.abs(o - o_ref).max() <= o_in + (u + weights) * v_max + 1e-300
    assert np.abs(m.astype(np.float64) - m_ref).max() <= m_in
    assert np.abs(l / l_ref - 1).max() <= l_in + m_in * 2 + (parts + 2) * u_acc * 2


@pytest.mark.parametrize("xp_name", ARRAY_MODULES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda d: d.name)
def test_two_parts_commute_exactly_and_an_empty_part_changes_nothing(xp_name, dtype):
    xp = array_module_named(xp_name)
    rng = np.random.default_rng(7)
    q, k, v, owner = _split_problem(rng, dtype, (2, 3), 33, 70, 64, 2)
    a, b = _parts(xp, q, k, v, owner, 2)
    ab, ba = cupyflash.merge_attention([a, b]), cupyflash.merge_attention([b, a])
    for x, y in zip(ab, ba):
        np.testing.assert_array_equal(host(x), host(y))
    empty = (xp.zeros_like(a[0]), xp.full_like(a[1], -np.inf), xp.zeros_like(a[2]))
    for merged in (cupyflash.merge_attention([a]), cupyflash.merge_attention([empty, a, empty])):
        for x, y in zip(merged, a):
            np.testing.assert_array_equal(host(x), host(y))


@pytest.mark.parametrize("xp_name", ARRAY_MODULES)
@pytest.mark.parametrize("dtype", [FLOAT16, FLOAT32, FLOAT64], ids=lambda d: d.name)
def test_merging_is_associative_to_rounding(xp_name, dtype):
    """merge(merge(a, b), c) = merge(a, merge(b, c)) = merge(a, b, c), up to the rounding of the
    intermediate o to the dtype and a few accumulator roundings."""
    xp = array_module_named(xp_name)
    rng = np.random.default_rng(11)
    q, k, v, owner = _split_problem(rng, dtype, (4,), 50, 90, 40, 3)
    a, b, c = _parts(xp, q, k, v, owner, 3)
    merge = cupyflash.merge_attention
    flat = [host(x).astype(np.float64) for x in merge([a, b, c])]
    u, u_acc = UNIT_ROUNDOFF[precision(dtype)], ACCUMULATOR_ROUNDOFF[precision(dtype)]
    for grouped in (merge([merge([a, b]), c]), merge([a, merge([b, c])])):
        grouped = [host(x).astype(np.float64) for x in grouped]
        np.testing.assert_allclose(grouped[0], flat[0], rtol=0, atol=(2 * u + 16 * u_acc) * np.abs(flat[0]).max())
        np.testing.assert_array_equal(grouped[1], flat[1])
        np.testing.assert_allclose(grouped[2], flat[2], rtol=16 * u_acc)


@pytest.mark.parametrize("xp_name", ARRAY_MODULES)
def test_rows_no_part_saw_are_empty_and_nan_stays_in_the_rows_it_reaches(xp_name):
    xp = array_module_named(xp_name)
    rows, D = 6, 16
    o1 = np.full((rows, D), 0.5, np.float32)
    m1 = np.array([0.0, -np.inf, 1.0, np.nan, 2.0, -np.inf], np.float32)
    l1 = np.array([2.0, 0.0, 1.0, 1.0, 1.0, 0.0], np.float32)
    o2 = np.full((rows, D), 0.25, np.float32)
    o2[4, 3] = np.nan                                        # a seen part's NaN reaches its own column
    o2[5] = np.nan                                           # an empty part's NaN reaches nothing
    m2 = np.array([0.0, -np.inf, -np.inf, 0.0, 1.0, -np.inf], np.float32)
    l2 = np.array([2.0, 0.0, 0.0, 1.0, 3.0, 0.0], np.float32)
    o, m, l = (host(x) for x in cupyflash.merge_attention([tuple(xp.asarray(x) for x in (o1, m1, l1)),
                                                            tuple(xp.asarray(x) for x in (o2, m2, l2))]))
    np.testing.assert_allclose(o[0], 0.375, rtol=1e-6)       # equal weights
    np.testing.assert_array_equal(o[1], 0)                   # no part saw row 1
    assert m[1] == -np.inf and l[1] == 0
    np.testing.assert_array_equal(o[2], 0.5)                 # one seen part: unchanged
    assert m[2] == 1 and l[2] == 1
    assert np.isnan(o[3]).all() and np.isnan(m[3]) and np.isnan(l[3])
    assert np.isnan(o[4, 3]) and np.isfinite(np.delete(o[4], 3)).all() and m[4] == 2
    np.testing.assert_array_equal(o[5], 0)
    assert m[5] == -np.inf and l[5] == 0


@pytest.mark.parametrize("xp_name", ARRAY_MODULES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda d: d.name)
def test_stacked_parts_merge_as_listed_ones_and_out_is_filled(xp_name, dtype):
    """merge_attention_stacked along any axis equals merge_attention of the parts one by one, bit for
    bit (one order of the same sums); ``out=`` receives the result; the inputs are left as they were."""
    xp = array_module_named(xp_name)
    rng = np.random.default_rng(3)
    q, k, v, owner = _split_problem(rng, dtype, (2, 3), 21, 60, 72, 4)
    parts = _parts(xp, q, k, v, owner, 4)
    before = [[host(x).copy() for x in p] for p in parts]
    listed = [host(x) for x in cupyflash.merge_attention(parts)]
    for axis in (0, 2, -2):   # among the stacked m's four axes: -2 is 2
        ax = axis % 4
        stacked = [xp.stack([p[j] for p in parts], axis=ax) for j in range(3)]
        got = cupyflash.merge_attention_stacked(*stacked, axis=axis)
        for x, y in zip(got, listed):
            np.testing.assert_array_equal(host(x), y)
    out = tuple(xp.empty_like(x) for x in parts[0])
    returned = cupyflash.merge_attention(parts, out=out)
    assert all(r is o for r, o in zip(returned, out))
    for x, y in zip(out, listed):
        np.testing.assert_array_equal(host(x), y)
    for p, b in zip(parts, before):
        for x, y in zip(p, b):
            np.testing.assert_array_equal(host(x), y)


@pytest.mark.parametrize("xp_name", ARRAY_MODULES)
@pytest.mark.parametrize("causal", [False, True])
def test_each_parts_backward_with_the_merged_statistics_is_its_share(xp_name, causal):
    """With the merged (o, m, l), the backward over part p's keys gives dk, dv of those keys and a dq
    share; the shares sum to the backward over every key (ring attention's identity)."""
    xp = array_module_named(xp_name)
    rng = np.random.default_rng(5)
    n_q, n_k, D = 40, 96, 32
    q, k, v = (rng.standard_normal((2, n, D)) for n in (n_q, n_k, n_k))
    do = rng.standard_normal((2, n_q, D))
    bounds = (0, 30, 31, 96)                         # contiguous pieces (causal stays bottom-right only whole)
    pieces = [slice(a, b) for a, b in zip(bounds, bounds[1:])]
    dev = [xp.asarray(x) for x in (q, k, v, do)]
    whole = cupyflash.flash_attention_forward(*dev[:3])
    if causal:   # bottom-right causal over all keys: query i sees keys j <= i + n_k - n_q, as a mask per part
        visible = np.arange(n_k)[None, :] <= np.arange(n_q)[:, None] + n_k - n_q
    parts = []
    for s in pieces:
        kw = {"mask": xp.asarray(visible[:, s])} if causal else {}
        parts.append(cupyflash.flash_attention_forward(dev[0], dev[1][:, s], dev[2][:, s], **kw))
    merged = cupyflash.merge_attention(parts)
    for x, y in zip(merged, cupyflash.flash_attention_forward(dev[0], dev[1], dev[2],
                                                              **({"causal": True} if causal else {}))):
        np.testing.assert_allclose(host(x), host(y), rtol=1e-12, atol=1e-12)
    full = cupyflash.flash_attention_backward(dev[3], *dev[:3], *merged, causal=causal)
    dq = np.zeros_like(q)
    for s, part in zip(pieces, parts):
        kw = {"mask": xp.asarray(visible[:, s])} if causal else {}
        dq_p, dk_p, dv_p = (host(x) for x in cupyflash.flash_attention_backward(dev[3], dev[0], dev[1][:, s],
                                                                                 dev[2][:, s], *merged, **kw))
        np.testing.assert_allclose(dk_p, host(full[1])[:, s], rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(dv_p, host(full[2])[:, s], rtol=1e-10, atol=1e-12)
        dq += dq_p
    np.testing.assert_allclose(dq, host(full[0]), rtol=1e-10, atol=1e-12)
    del whole


@gpu_test
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("parts", [2, 8, 17])
def test_the_gpu_merge_matches_the_numpy_merge(dtype, parts):
    """The kernel against the CPU path on the same parts (D 128 takes 16-byte vectors, D 40 in
    float16 does not; 17 parts are stacked first): to the accumulator's rounding and one rounding of o."""
    import cupy

    rng = np.random.default_rng(parts)
    for D in (128, 40):
        o = rng.standard_normal((parts, 3, 65, D)).astype(dtype)
        m = (3 * rng.standard_normal((parts, 3, 65))).astype(_stats_dtype(dtype))
        l = rng.uniform(1, 50, (parts, 3, 65)).astype(_stats_dtype(dtype))
        l[0, 0, :5], m[0, 0, :5] = 0, -np.inf                  # empty rows of a part
        host = [(o[p], m[p], l[p]) for p in range(parts)]
        want = cupyflash.merge_attention(host)
        got = [x.get() for x in cupyflash.merge_attention([tuple(cupy.asarray(x) for x in p) for p in host])]
        u, u_acc = UNIT_ROUNDOFF[precision(dtype)], ACCUMULATOR_ROUNDOFF[precision(dtype)]
        np.testing.assert_allclose(got[0].astype(np.float64), want[0].astype(np.float64), rtol=0,
                                   atol=(u + 8 * parts * u_acc) * np.abs(o.astype(np.float64)).max())
        np.testing.assert_array_equal(got[1], want[1])
        np.testing.assert_allclose(got[2], want[2], rtol=8 * parts * u_acc)


MERGE_FAULTS = {
    "no part": (lambda a, b: [], ValueError, "non-empty"),
    "not a triple": (lambda a, b: [a[:2]], TypeError, "parts[0] must be an (o, m, l) triple"),
    "dtypes differ": (lambda a, b: [a, (b[0].astype(np.float32), b[1], b[2])], ValueError, "parts[1] has o"),
    "shapes differ": (lambda a, b: [a, (b[0][:, :3], b[1][:, :3], b[2][:, :3])], ValueError, "(2, 3, 8)"),
    "m of the wrong dtype": (lambda a, b: [a, (b[0], b[1].astype(np.float64), b[2])], TypeError, "parts[1] m must be float32"),
    "l of the wrong shape": (lambda a, b: [a, (b[0], b[1], b[2][..., :2])], ValueError, "parts[1] l must have shape (2, 5)"),
    "unsupported dtype": (lambda a, b: [(a[0].astype(np.int32), a[1], a[2])], TypeError, "int32"),
    "no head dim": (lambda a, b: [(a[0][..., :0], a[1], a[2])], ValueError, "D >= 1"),
    "not an array": (lambda a, b: [(a[0].tolist(), a[1], a[2])], TypeError, "parts[0][0] (o) must be"),
}


@pytest.mark.parametrize("fault", MERGE_FAULTS)
def test_bad_parts_are_refused_naming_the_part_and_the_shapes(fault):
    rng = np.random.default_rng(1)
    a, b = ((rng.standard_normal((2, 5, 8)).astype(np.float16), np.zeros((2, 5), np.float32),
             np.ones((2, 5), np.float32)) for _ in range(2))
    make, error, words = MERGE_FAULTS[fault]
    with pytest.raises(error, match=re.escape(words)):
        cupyflash.merge_attention(make(a, b))


def test_bad_stacks_and_outs_are_refused():
    o = np.zeros((3, 2, 5, 8), np.float16)
    m, l = np.zeros((3, 2, 5), np.float32), np.ones((3, 2, 5), np.float32)
    with pytest.raises(ValueError, match="axis 2 must name one of the first 2 axes"):
        cupyflash.merge_attention_stacked(o, m, l, axis=2)
    with pytest.raises(ValueError, match="axis -1 must name"):
        cupyflash.merge_attention_stacked(o, m, l, axis=-1)
    with pytest.raises(TypeError, match="axis must be an int"):
        cupyflash.merge_attention_stacked(o, m, l, axis=0.5)
    with pytest.raises(ValueError, match="holds no part"):
        cupyflash.merge_attention_stacked(o[:0], m[:0], l[:0])
    with pytest.raises(ValueError, match="one axis more than m"):
        cupyflash.merge_attention_stacked(o[..., 0], m, l)
    with pytest.raises(ValueError, match=r"out\[0\] \(o\) must have shape \(2, 5, 8\)"):
        cupyflash.merge_attention_stacked(o, m, l, out=(np.zeros((2, 5, 9), np.float16), m[0].copy(), l[0].copy()))
    with pytest.raises(ValueError, match="overlaps"):
        cupyflash.merge_attention_stacked(o, m, l, out=(o[0], m[0], l[0]))


@pytest.mark.parametrize("stacked", [False, True], ids=["listed", "stacked"])
def test_a_like_merge_reuses_its_launch_and_reads_its_own_parts(monkeypatch, stacked):
    """A second merge of CuPy parts of the same layout skips the checks and the plan (the GPU faked,
    benchmarks/host_path.py): its launch's struct names its own parts and fresh outputs; a part of another
    layout plans anew."""
    pytest.importorskip("cupy")
    from cupyflash import _params, merge
    from helpers import faked_gpu_module

    gpu = faked_gpu_module().FakeGPU(patch=monkeypatch.setattr, keep_structs=True)
    monkeypatch.setattr(merge, "_KEPT", {})

    def call(n=3, rows=5):
        if stacked:
            o, m, l = gpu.array((n, 2, rows, 64)), gpu.array((n, 2, rows), np.float32), gpu.array((n, 2, rows), np.float32)
            return (o, m, l), cupyflash.merge_attention_stacked(o, m, l)
        parts = [(gpu.array((2, rows, 64)), gpu.array((2, rows), np.float32), gpu.array((2, rows), np.float32))
                 for _ in range(n)]
        return parts, cupyflash.merge_attention(parts)

    for trial in range(3):
        gpu.structs.clear()
        given, result = call()
        (name, raw), = gpu.structs
        struct = np.frombuffer(raw[:_params.MERGE.itemsize], _params.MERGE)[0]
        if stacked:
            assert [struct[x]["ptr"][0] for x in "oml"] == [x.data.ptr for x in given]
            assert [struct[x]["stride"] for x in "oml"] == [2 * 5 * 64, 2 * 5, 2 * 5]
        else:
            assert [list(struct[x]["ptr"][:3]) for x in "oml"] == [[p[j].data.ptr for p in given] for j in range(3)]
        assert [struct[f"{x}_out"] for x in "oml"] == [x.data.ptr for x in result]
        assert [x.shape for x in result] == [(2, 5, 64), (2, 5), (2, 5)]
        assert len(merge._KEPT) == 1
    call(rows=6)
    assert len(merge._KEPT) == 2
