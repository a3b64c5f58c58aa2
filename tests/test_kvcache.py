"""flash_attention_with_kvcache (issue #18): attention against a contiguous or paged K/V cache after
appending new keys.

The reference is independent of the library's cache handling: each entry's keys are gathered by
hand (the old valid rows, then the new ones) and attended to by ``reference.attention_forward``
with the query heads grouped over the K/V heads. On the CPU: the NumPy path, the append, the
checks. On the GPU: every dtype, decoding and chunked queries, every page size (shuffled tables)
equal to the contiguous cache, split counts, CuPy lengths and tables, and inputs left as they were.
"""

import numpy as np
import pytest

from cupyflash import reference
from cupyflash.kvcache import flash_attention_with_kvcache
from helpers import ARRAY_MODULES, FLOAT_DTYPES, array_module_named, faked_gpu_module, gpu_test, host

TOL = {"float16": 4e-3, "bfloat16": 3e-2, "float32": 2e-5, "float64": 1e-12}


def _case(rng, dtype, B=3, Hkv=2, G=3, Nq=1, D=32, capacity=200, n_new=0, page_size=None, lens=None):
    """``(q, contiguous cache k, v, lens, new k, v, paged caches, table)`` (NumPy) with random lengths
    that leave room for ``n_new`` rows; the paged cache holds the same rows as the contiguous one, in
    shuffled pages (and spare pages)."""
    q = rng.standard_normal((B, Hkv * G, Nq, D)).astype(dtype)
    kc, vc = (rng.standard_normal((B, Hkv, capacity, D)).astype(dtype) for _ in range(2))
    if lens is None:
        lens = rng.integers(0, capacity - n_new + 1, B).astype(np.int32)
    new = [rng.standard_normal((B, Hkv, n_new, D)).astype(dtype) for _ in range(2)] if n_new else [None, None]
    paged = None
    if page_size is not None:
        per = -(-capacity // page_size)
        pages = B * per + 5
        order = rng.permutation(pages)[:B * per].reshape(B, per).astype(np.int32)
        kp, vp = (rng.standard_normal((pages, Hkv, page_size, D)).astype(dtype) for _ in range(2))
        for cache, pc in ((kc, kp), (vc, vp)):
            for b in range(B):
                for p in range(per):
                    rows = cache[b, :, p * page_size:(p + 1) * page_size]
                    pc[order[b, p], :, :rows.shape[1]] = rows
        paged = (kp, vp, order)
    return q, kc, vc, lens, new, paged


def _expected(q, kc, vc, lens, new, causal=True, **kw):
    """The reference (float64): entry b's keys are its first lens[b] rows and then the new ones."""
    B, Hq, Nq, D = q.shape
    Hkv = kc.shape[1]
    o = np.zeros((B, Hq, Nq, D))
    m = np.full((B, Hq, Nq), -np.inf)
    l = np.zeros((B, Hq, Nq))
    slopes = kw.pop("alibi_slopes", None)
    for b in range(B):
        keys = [kc[b, :, :lens[b]], vc[b, :, :lens[b]]]
        if new[0] is not None:
            keys = [np.concatenate([x, n[b]], axis=1) for x, n in zip(keys, new)]
        qb = q[b].reshape(Hkv, Hq // Hkv, Nq, D)
        extra = {} if slopes is None else {"alibi_slopes": np.broadcast_to(slopes, (B, Hq))[b].reshape(Hkv, -1)}
        ob, mb, lb = reference.attention_forward(qb, keys[0][:, None], keys[1][:, None], causal=causal, **kw, **extra)
        o[b], m[b], l[b] = ob.reshape(Hq, Nq, D), mb.reshape(Hq, Nq), lb.reshape(Hq, Nq)
    return o, m, l


def _assert_matches(got, want, dtype):
    o, m, l = (host(x).astype(np.float64) for x in got)
    tol = TOL[np.dtype(dtype).name]
    scale = max(np.abs(want[0]).max(), 1e-30)
    np.testing.assert_allclose(o / scale, want[0] / scale, atol=tol)
    seen = want[2] > 0
    np.testing.assert_array_equal(l > 0, seen)
    np.testing.assert_allclose(m[seen], want[1][seen], rtol=tol, atol=tol)
    np.testing.assert_allclose(l[seen], want[2][seen], rtol=max(tol, 1e-5))
    assert (m[~seen] == -np.inf).all() and not o[~seen].any()


def _call(xp, q, kc, vc, lens, new, paged=None, **kw):
    """The library's call on ``xp`` arrays (the cache copied, so the caller's stays as it was)."""
    to = (lambda x: x.copy()) if xp is np else xp.asarray
    if paged is None:
        caches, table = (to(kc), to(vc)), None
    else:
        caches, table = (to(paged[0]), to(paged[1])), to(paged[2])
    k, v = (None if n is None else to(n) for n in new)
    out = flash_attention_with_kvcache(to(q), *caches, to(lens), k=k, v=v, block_table=table, **kw)
    return out, caches


@pytest.mark.parametrize("xp_name", ARRAY_MODULES)
@pytest.mark.parametrize("page_size", [None, 16, 48])
@pytest.mark.parametrize("Nq,n_new,causal", [(1, 0, True), (1, 1, True), (5, 5, True), (4, 2, False)])
def test_the_attention_sees_each_entrys_cached_and_new_keys(xp_name, page_size, Nq, n_new, causal):
    xp = array_module_named(xp_name)
    rng = np.random.default_rng(Nq * 10 + n_new)
    q, kc, vc, lens, new, paged = _case(rng, np.float32, Nq=Nq, n_new=n_new, page_size=page_size,
                                        lens=np.array([0, 7, 150 - n_new], np.int32))
    got, caches = _call(xp, q, kc, vc, lens, new, paged, causal=causal)
    _assert_matches(got, _expected(q, kc, vc, lens, new, causal=causal), np.float32)


@pytest.mark.parametrize("xp_name", ARRAY_MODULES)
@pytest.mark.parametrize("page_size", [None, 16])
def test_the_new_keys_land_in_the_cache_and_nothing_else_changes(xp_name, page_size):
    xp = array_module_named(xp_name)
    rng = np.random.default_rng(5)
    q, kc, vc, lens, new, paged = _case(rng, np.float32, n_new=3, page_size=page_size)
    inputs = [x.copy() for x in (q, lens, *new)]
    before = [x.copy() for x in (paged[:2] if paged else (kc, vc))]
    _, caches = _call(xp, q, kc, vc, lens, new, paged)
    for x, y in zip((q, lens, *new), inputs):
        np.testing.assert_array_equal(x, y)
    for cache, old, n in zip(caches, before, new):
        cache, want = host(cache), old.copy()
        for b in range(q.shape[0]):
            for t in range(n.shape[2]):
                r = lens[b] + t
                if paged is None:
                    want[b, :, r] = n[b, :, t]
                else:
                    want[paged[2][b, r // page_size], :, r % page_size] = n[b, :, t]
        np.testing.assert_array_equal(cache, want)


@pytest.mark.parametrize("xp_name", ARRAY_MODULES)
def test_windows_softcap_and_alibi_apply_to_each_entrys_keys(xp_name):
    xp = array_module_named(xp_name)
    rng = np.random.default_rng(6)
    q, kc, vc, lens, new, paged = _case(rng, np.float32, Nq=3, n_new=3, page_size=32)
    slopes = rng.uniform(0.01, 0.2, 6).astype(np.float32)
    kw = dict(window=(20, None), softcap=4.0, alibi_slopes=slopes)
    got, _ = _call(xp, q, kc, vc, lens, new, paged, **kw)
    _assert_matches(got, _expected(q, kc, vc, lens, new, **kw), np.float32)


def test_bad_calls_are_refused_naming_what_is_wrong():
    rng = np.random.default_rng(7)
    q, kc, vc, lens, new, paged = _case(rng, np.float32, n_new=2, page_size=16)
    call = flash_attention_with_kvcache
    with pytest.raises(ValueError, match="must have 4 dims"):
        call(q[0], kc, vc, lens)
    with pytest.raises(ValueError, match="multiple of the cache's"):
        call(q[:, :5], kc, vc, lens)
    with pytest.raises(ValueError, match="q's batch B"):
        call(q, kc[:2], vc[:2], lens)
    with pytest.raises(ValueError, match="cache_seqlens must be"):
        call(q, kc, vc, lens[:2])
    with pytest.raises(ValueError, match="capacity"):
        call(q, kc, vc, np.array([0, 1, 199], np.int32), k=new[0], v=new[1])
    with pytest.raises(ValueError, match="capacity"):
        call(q, kc, vc, np.array([0, -1, 5], np.int32))
    with pytest.raises(ValueError, match="come together"):
        call(q, kc, vc, lens, k=new[0])
    with pytest.raises(ValueError, match=r"shape \(B, Hkv, Nnew, D\)"):
        call(q, kc, vc, lens, k=new[0][:, :1], v=new[1][:, :1])
    with pytest.raises(TypeError, match="q's dtype"):
        call(q, kc, vc, lens, k=new[0].astype(np.float64), v=new[1].astype(np.float64))
    with pytest.raises(ValueError, match="outside the cache's"):
        call(q, paged[0], paged[1], lens, block_table=paged[2] + 100)
    with pytest.raises(ValueError, match=r"block_table must have shape"):
        call(q, paged[0], paged[1], lens, block_table=paged[2][:1])
    with pytest.raises(ValueError, match="contiguous last axis"):
        wide = np.zeros((*kc.shape[:3], 2 * kc.shape[3]), kc.dtype)
        call(q, wide[..., ::2], wide[..., ::2], lens)
    with pytest.raises(ValueError, match="alibi_slopes"):
        call(q, kc, vc, lens, alibi_slopes=np.ones(4, np.float32))


@pytest.mark.parametrize("dtype, kernel", [("float16", "flash_fwd_sm90"), ("bfloat16", "flash_fwd_sm90"),
                                           ("float32", "flash_fwd_v2")])
@pytest.mark.parametrize("page_size", [16, 48])
def test_a_paged_cache_runs_the_forward_a_contiguous_one_would(monkeypatch, dtype, kernel, page_size):
    """On an H200 (faked: benchmarks/host_path.py) a paged cache of 16-bit inputs runs the Hopper forward,
    compiled to read pages, like a contiguous one; other dtypes V2's portable kernel. Its struct carries
    the table, the page size and count, and the elements between pages of k and of v."""
    pytest.importorskip("cupy")
    from cupyflash import _launch, _params

    gpu = faked_gpu_module().FakeGPU(patch=monkeypatch.setattr, keep_structs=True)
    configs = []
    kernels = _launch.get_kernels
    monkeypatch.setattr(_launch, "get_kernels", lambda cfg: configs.append(cfg) or kernels(cfg))
    B, Hkv, G, D, pages = 2, 2, 4, 128, 40
    dt = np.dtype(dtype) if dtype != "bfloat16" else FLOAT_DTYPES[1]
    q = gpu.array((B, Hkv * G, 1, D), dt)
    kc, vc = gpu.array((pages, Hkv, page_size, D), dt), gpu.array((pages, Hkv, page_size, D), dt)
    lens, table = gpu.array((B,), np.int32), gpu.array((B, pages // B), np.int32)
    flash_attention_with_kvcache(q, kc, vc, lens, block_table=table)
    name, struct = gpu.structs[0]   # then, split over the keys, the merge of the parts
    assert name == kernel and all(other == "flash_merge" for other, _ in gpu.structs[1:])
    (forward,) = {cfg for cfg in configs if cfg.kernel != "merge"}
    assert forward.kernel == kernel[len("flash_"):] and forward.paged
    fwd = np.frombuffer(struct[:_params.FWD.itemsize], _params.FWD)[0]
    assert fwd["pages"]["table"] == table.data.ptr
    assert (fwd["pages"]["size"], fwd["pages"]["count"]) == (page_size, pages)
    assert fwd["pages"]["page_k"] == fwd["pages"]["page_v"] == Hkv * page_size * D
    assert fwd["seqs"]["len_k"] == lens.data.ptr


def test_the_pages_of_a_cache_laid_out_by_row_are_found_from_its_own_strides(monkeypatch):
    """A paged cache whose pages are (page_size, Hkv, D) in memory (FlashAttention's layout, cupyflash.torch's
    bnhd) viewed as (pages, Hkv, page_size, D): the append's and the forward's structs carry the elements
    between pages of the cache itself (page 0's view, a dim of 1, has any stride; it once gave Hkv D, and
    the GPU wrote and read the wrong pages)."""
    pytest.importorskip("cupy")
    from cupyflash import _params

    gpu = faked_gpu_module().FakeGPU(patch=monkeypatch.setattr, keep_structs=True)
    B, Hkv, G, D, pages, page_size = 2, 2, 3, 64, 32, 16
    q = gpu.array((B, Hkv * G, 2, D))
    kc, vc = (gpu.array((pages, page_size, Hkv, D)).transpose(0, 2, 1, 3) for _ in range(2))
    k, v = gpu.array((B, Hkv, 2, D)), gpu.array((B, Hkv, 2, D))
    lens, table = gpu.array((B,), np.int32), gpu.array((B, pages // B), np.int32)
    flash_attention_with_kvcache(q, kc, vc, lens, k=k, v=v, block_table=table)
    structs = dict(gpu.structs)
    append = np.frombuffer(structs["flash_append"][:_params.APPEND.itemsize], _params.APPEND)[0]
    forward = np.frombuffer(structs["flash_fwd_sm90"][:_params.FWD.itemsize], _params.FWD)[0]
    for struct in (append, forward):
        assert struct["pages"]["page_k"] == struct["pages"]["page_v"] == page_size * Hkv * D
    assert forward["k"]["sn"] == Hkv * D and forward["k"]["s1"] == D   # rows Hkv D apart, heads D


# ---------------------------------------------------------------------------------------------
# GPU


@gpu_test
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("Hkv,G,Nq,D", [(8, 4, 1, 128), (1, 32, 1, 64), (2, 2, 16, 96), (4, 1, 1, 256)])
def test_every_dtype_and_shape_matches_the_reference_on_the_gpu(dtype, Hkv, G, Nq, D):
    import cupy

    rng = np.random.default_rng(D + Nq)
    q, kc, vc, lens, new, paged = _case(rng, dtype, B=4, Hkv=Hkv, G=G, Nq=Nq, D=D, capacity=700, n_new=Nq,
                                        page_size=64)
    want = _expected(q, kc, vc, lens, new)
    for pages in (None, paged):
        got, _ = _call(cupy, q, kc, vc, lens, new, pages)
        _assert_matches(got, want, dtype)


@gpu_test
@pytest.mark.parametrize("hopper", [True, False], ids=["hopper", "portable"])
@pytest.mark.parametrize("page_size", [16, 64, 256, 48, 1])
def test_a_paged_cache_equals_the_contiguous_one_bit_for_bit(page_size, hopper, monkeypatch):
    """Paging changes no bit, on the Hopper forward (16-bit on sm_90, where both caches run it) and on
    V2's portable kernel (every other device), split-KV or not; a page size that is no multiple of the
    rows a copy pass takes (48, 1) crosses pages inside a pass."""
    import cupy

    from cupyflash import _launch

    monkeypatch.setattr(_launch, "USE_WGMMA", hopper)

    rng = np.random.default_rng(page_size)
    q, kc, vc, lens, new, paged = _case(rng, np.float16, B=5, Hkv=4, G=8, D=128, capacity=1500, n_new=1,
                                        page_size=page_size)
    for splits in (1, 3, None):
        a, _ = _call(cupy, q, kc, vc, lens, new, None, num_splits=splits)
        b, _ = _call(cupy, q, kc, vc, lens, new, paged, num_splits=splits)
        for x, y in zip(a, b):
            np.testing.assert_array_equal(x.get(), y.get())
        _assert_matches(b, _expected(q, kc, vc, lens, new), np.float16)


@gpu_test
def test_device_lengths_past_the_capacity_are_clamped_not_read_past():
    """CuPy lengths are not checked: a length past the capacity reads the capacity's rows, a negative one
    none, and new rows past the end are dropped (compute-sanitizer runs this in tests/gpu)."""
    import cupy

    rng = np.random.default_rng(9)
    q, kc, vc, lens, new, paged = _case(rng, np.float32, B=2, capacity=64, page_size=16)
    bad = cupy.asarray(np.array([1000, -5], np.int32))
    for pages in (None, paged):
        caches = (cupy.asarray(kc), cupy.asarray(vc)) if pages is None else (cupy.asarray(paged[0]),
                                                                             cupy.asarray(paged[1]))
        table = None if pages is None else cupy.asarray(paged[2])
        o, m, l = flash_attention_with_kvcache(cupy.asarray(q), *caches, bad, block_table=table)
        want = _expected(q, kc, vc, np.array([64, 0]), [None, None])
        _assert_matches((o, m, l), want, np.float32)


@gpu_test
def test_a_kept_plan_reads_each_calls_own_arrays():
    """The second like call skips checks and planning: it must still append at its own lengths, read its
    own cache and table and write its own out."""
    import cupy

    rng = np.random.default_rng(11)
    q, kc, vc, lens, new, paged = _case(rng, np.float16, B=2, Hkv=2, G=4, D=64, capacity=256, n_new=1, page_size=32)
    for pages in (None, paged):
        for trial in range(3):
            lens_t = rng.integers(0, 255, 2).astype(np.int32)
            out = (cupy.empty((2, 8, 1, 64), np.float16), cupy.empty((2, 8, 1), np.float32),
                   cupy.empty((2, 8, 1), np.float32))
            got, _ = _call(cupy, q, kc, vc, lens_t, new, pages, out=out)
            assert all(a is b for a, b in zip(got, out))
            _assert_matches(got, _expected(q, kc, vc, lens_t, new), np.float16)


@gpu_test
def test_a_decoding_loop_equals_attention_over_the_whole_sequence():
    """Prefill a cache with 40 tokens, then decode 30 more one at a time, advancing the lengths on the
    device: every step's output is the causal attention's row for that token."""
    import cupy

    rng = np.random.default_rng(10)
    B, Hkv, G, D, N = 2, 2, 4, 64, 70
    q, k, v = (rng.standard_normal(s).astype(np.float16) for s in ((B, Hkv * G, N, D), (B, Hkv, N, D), (B, Hkv, N, D)))
    want = reference.attention_forward(q.reshape(B, Hkv, G, N, D), k[:, :, None], v[:, :, None], causal=True)[0]
    want = want.reshape(B, Hkv * G, N, D)
    kc, vc = cupy.zeros((B, Hkv, 128, D), np.float16), cupy.zeros((B, Hkv, 128, D), np.float16)
    lens = cupy.zeros(B, np.int32)
    o, _, _ = flash_attention_with_kvcache(cupy.asarray(q[:, :, :40]), kc, vc, lens, k=cupy.asarray(k[:, :, :40]),
                                           v=cupy.asarray(v[:, :, :40]))
    lens += 40
    outs = [o.get()]
    for t in range(40, N):
        o, _, _ = flash_attention_with_kvcache(cupy.asarray(q[:, :, t:t + 1]), kc, vc, lens,
                                               k=cupy.asarray(k[:, :, t:t + 1]), v=cupy.asarray(v[:, :, t:t + 1]))
        lens += 1
        outs.append(o.get())
    got = np.concatenate(outs, axis=2).astype(np.float64)
    np.testing.assert_allclose(got, want, atol=4e-3)
