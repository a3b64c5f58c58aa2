"""The quick GPU tier: every kernel family once plainly, every option and every pair of options once.

    python3 tests/gpu/tier.py quick        # on a GPU machine, from the repository root

Three parts, each against the float64 reference (``cupyflash.reference``):

* **Families.** Every forward schedule (V1, V2 on the portable ``mma.sync`` kernel, V2 on the Hopper
  kernel where the dtype takes it) and every backward, at every dtype and head-dim bucket, forward and
  backward held to twice a naive same-precision attention's error (tests/tolerances.py); float32 in
  both precisions, the backward in both orders (``deterministic``).
* **Options.** A covering design (tests/covering.py) over the schedule, dtype, head dim, batch layout
  (plain, GQA broadcast, packed sequences), causal, window, softcap, ALiBi, sink, bias (with dbias),
  boolean mask, dropout, user expressions, deterministic backward and split-KV: every pair of options
  in at least one case, about 30 cases where the product is millions.
* **Repairs, merge, cache.** The non-finite repair kernels at every dtype and bucket; the merge and the
  K/V cache's append and attention at every dtype.

The full tier (``tests/gpu/tier.py full``) runs every GPU test, this module's included.
"""

import zlib

import numpy
import pytest

import cupyflash
from cupyflash import _tiles, reference
from covering import pairwise
from helpers import (DTYPE_BY_NAME, assert_non_finite_like, assert_non_finite_rules, random_inputs, requires_gpu,
                     to_gpu)
from test_dropout import assert_close_to as assert_near, gradient_term_sizes
from test_gpu import check_backward, check_forward

pytestmark = [*requires_gpu, pytest.mark.quick]

DTYPES = ("float16", "bfloat16", "float32", "float64")
# one head dim in each bucket of _tiles.HEAD_DIM_BUCKETS, none of them a bucket's edge but the last
BUCKET_DIMS = (24, 40, 80, 128, 160, 256)
assert [_tiles.head_dim_bucket(d) for d in BUCKET_DIMS] == list(_tiles.HEAD_DIM_BUCKETS)


@pytest.fixture()
def portable(request, monkeypatch):
    """``schedule`` "v2-mma" runs the portable kernels where the Hopper ones would."""
    from cupyflash import _launch

    monkeypatch.setattr(_launch, "USE_WGMMA", request.param != "v2-mma")
    return request.param.split("-")[0]


# ---------------------------------------------------------------------------
# Families: every forward and backward kernel, dtype and head-dim bucket

def _family_cases():
    for i, (dtype, D) in enumerate((d, D) for d in DTYPES for D in BUCKET_DIMS):
        for schedule in ("v1", "v2", "v2-mma"):
            yield pytest.param(schedule, dtype, D, i % 2 == 0, id=f"{schedule}-{dtype}-D{D}")


@pytest.mark.parametrize("portable, dtype, D, causal", list(_family_cases()), indirect=["portable"])
def test_every_family_dtype_and_bucket(portable, dtype, D, causal):
    """Forward of the schedule, then the backward that follows it (V1's forward shares V2's backward,
    so V1 cases check the deterministic backward): ragged lengths, a GQA-broadcast K/V."""
    rng = numpy.random.default_rng(D)
    q, k, v = random_inputs(rng, dtype, (2, 2, 113, D), (2, 1, 150, D))
    check_forward(dtype, q, k, v, causal, None, portable)
    check_backward(dtype, q, k, v, causal, None, rng, portable, deterministic=portable == "v1")


@pytest.mark.parametrize("D", (40, 128, 256))
def test_float32_tf32_products(D):
    """``precision="tf32"``: one TF32 product per float32 product, near TF32's rounding."""
    rng = numpy.random.default_rng(3)
    q, k, v = random_inputs(rng, "float32", (2, 3, 130, D), (2, 3, 150, D))
    o, m, l = cupyflash.flash_attention_forward(*to_gpu(q, k, v), causal=True, precision="tf32")
    o_ref = reference.attention_forward(q, k, v, causal=True)[0]
    assert numpy.linalg.norm(o.get() - o_ref) / numpy.linalg.norm(o_ref) < 3e-3
    import cupy

    do = rng.standard_normal(o.shape).astype(numpy.float32)
    grads = cupyflash.flash_attention_backward(cupy.asarray(do), *to_gpu(q, k, v), o, m, l, causal=True,
                                               precision="tf32")
    refs = reference.attention_backward(do, q, k, v, *reference.attention_forward(q, k, v, causal=True), causal=True)
    for name, g, ref in zip(("dq", "dk", "dv"), grads, refs):
        assert numpy.linalg.norm(g.get() - ref) / numpy.linalg.norm(ref) < 1e-2, name


# ---------------------------------------------------------------------------
# Options: a covering design of every option pair

OPTIONS = {
    "schedule": ("v1", "v2", "v2-mma"),
    "dtype": DTYPES,
    "D": (40, 128, 200),
    "layout": ("plain", "gqa", "varlen"),
    "causal": (False, True),
    "window": (None, (48, 16)),
    "softcap": (None, 5.0),
    "alibi": (False, True),
    "sink": (False, True),
    "bias": (None, "bias", "bias_grad"),
    "mask": (False, True),
    "dropout": (0.0, 0.25),
    "user": (None, "score_mod", "mask_mod"),
    "deterministic": (False, True),
    "splits": (None, 3),
}
# split-KV divides the V2 schedule's K/V tiles
REFUSED_TOGETHER = [(("schedule", "v1"), ("splits", 3))]
OPTION_ROWS = pairwise(OPTIONS, REFUSED_TOGETHER, seed=1)

# o, m, l and the gradients are held to test_dropout's rule: within its TOL of the float64 reference,
# relative to the reference's largest magnitude (or to its gradient's largest term, where terms cancel)
N_Q, N_K = 130, 150
CU_Q, CU_K = numpy.array([0, 60, 130], numpy.int32), numpy.array([0, 90, 150], numpy.int32)
SCORE_MOD = dict(score_mod="c * tanhf(s / c) + w[kv_idx]", score_mod_grad="1 - tanhf(s / c) * tanhf(s / c)")
MASK_MOD = "kv_idx <= q_idx + 40 && (q_idx + kv_idx) % 7 != 0"


def _row_id(row):
    on = [f"{name}={value}" for name, value in row.items()
          if name in ("schedule", "dtype", "D", "layout") or value not in (None, False, 0.0)]
    return ",".join(on)


def option_case(row, rng):
    """(q, k, v, forward keywords, backward-only keywords, packed offsets or None) of a covering row,
    NumPy arrays."""
    dtype, D = row["dtype"], row["D"]
    q_batch, kv_batch = {"plain": ((2, 3), (2, 3)), "gqa": ((2, 2, 3), (2, 2, 1)), "varlen": ((2,), (2,))}[row["layout"]]
    q, k, v = random_inputs(rng, dtype, (*q_batch, N_Q, D), (*kv_batch, N_K, D))
    heads = numpy.broadcast_shapes(q_batch, kv_batch)[-1:]
    kw = dict(causal=row["causal"], window=row["window"], softcap=row["softcap"])
    if row["alibi"]:
        kw["alibi_slopes"] = (2.0 ** -rng.uniform(0, 6, heads)).astype(numpy.float32)
    if row["sink"]:
        kw["sink"] = rng.standard_normal(heads).astype(numpy.float32)
    if row["bias"]:
        kw["bias"] = rng.standard_normal((N_Q, N_K)).astype(numpy.float32)
    if row["mask"]:
        kw["mask"] = rng.random((N_Q, N_K)) < 0.8
    if row["dropout"]:
        kw.update(dropout_p=row["dropout"], seed=2**40 + 7)
    backward_only = dict(bias_grad=row["bias"] == "bias_grad", deterministic=row["deterministic"])
    if row["user"] == "score_mod":
        kw.update(score_mod=SCORE_MOD["score_mod"], mod_args={"c": 5.0, "w": rng.standard_normal(N_K).astype(numpy.float32)})
        backward_only["score_mod_grad"] = SCORE_MOD["score_mod_grad"]
    elif row["user"] == "mask_mod":
        kw["mask_mod"] = MASK_MOD
    packed = (CU_Q, CU_K) if row["layout"] == "varlen" else None
    return q, k, v, kw, backward_only, packed


def _on_device(kw):
    import cupy

    out = dict(kw)
    if "mod_args" in kw:
        out["mod_args"] = {name: cupy.asarray(x) if isinstance(x, numpy.ndarray) else x
                           for name, x in kw["mod_args"].items()}
    return out


def _term_floor(do, q, k, v, kw, packed):
    """The largest term of dq, dk and dv where the reference's scores are the tolerance's (no packed
    sequences, no user expression): a gradient that cancels is held to its terms' size."""
    if packed is not None or "score_mod" in kw or "mask_mod" in kw:
        return (0.0, 0.0, 0.0)
    mods = {name: kw[name] for name in ("softcap", "alibi_slopes", "bias", "mask") if kw.get(name) is not None}
    return gradient_term_sizes(do, q, k, v, kw["causal"], None, kw["window"], kw.get("dropout_p", 0.0), **mods)


@pytest.mark.parametrize("row", OPTION_ROWS, ids=[_row_id(r) for r in OPTION_ROWS])
def test_every_pair_of_options(row, monkeypatch):
    import cupy
    from cupyflash import _launch

    monkeypatch.setattr(_launch, "USE_WGMMA", row["schedule"] != "v2-mma")
    schedule = row["schedule"][:2]
    dtype = row["dtype"]
    rng = numpy.random.default_rng(zlib.crc32(_row_id(row).encode()))
    q, k, v, kw, backward_only, packed = option_case(row, rng)
    gq, gk, gv = to_gpu(q, k, v)
    gkw = _on_device(kw)
    if packed is None:
        out = cupyflash.flash_attention_forward(gq, gk, gv, schedule=schedule, num_splits=row["splits"], **gkw)
        refs = reference.attention_forward(q, k, v, **kw)
    else:
        out = cupyflash.flash_attention_varlen_forward(gq, gk, gv, *packed, schedule=schedule,
                                                       num_splits=row["splits"], **gkw)
        refs = reference.attention_varlen_forward(q, k, v, *packed, **kw)
    for name, got, ref in zip("oml", out, refs):
        assert_near(name, got.get(), ref, dtype)

    do = rng.standard_normal(refs[0].shape).astype(DTYPE_BY_NAME[dtype])
    host_out = [x.get() for x in out]
    bkw = dict(kw, **backward_only)
    deterministic = bkw.pop("deterministic")

    def backward():
        if packed is None:
            return cupyflash.flash_attention_backward(cupy.asarray(do), gq, gk, gv, *out, schedule=schedule,
                                                      deterministic=deterministic, **_on_device(bkw))
        return cupyflash.flash_attention_varlen_backward(cupy.asarray(do), gq, gk, gv, *out, *packed,
                                                         schedule=schedule, deterministic=deterministic,
                                                         **_on_device(bkw))

    grads = backward()
    ref_grads = (reference.attention_backward(do, q, k, v, *host_out, **bkw) if packed is None else
                 reference.attention_varlen_backward(do, q, k, v, *host_out, *packed, **bkw))
    names = ["dq", "dk", "dv"] + ["dbias"] * bkw["bias_grad"] + ["dsink"] * ("sink" in kw)
    assert len(grads) == len(ref_grads) == len(names)
    floors = (*_term_floor(do, q, k, v, kw, packed), 0.0, 0.0)
    for name, got, ref, floor in zip(names, grads, ref_grads, floors):
        assert got.shape == ref.shape, name
        assert_near(name, got.get(), ref, dtype, floor)
    if deterministic:
        for name, first, second in zip(names, grads, backward()):
            assert cupy.array_equal(first, second), f"{name} differs between two deterministic backwards"


# ---------------------------------------------------------------------------
# Repairs, merge and the K/V cache

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D", BUCKET_DIMS)
def test_the_repair_kernels_at_every_dtype_and_bucket(dtype, D):
    """An inf key beside masked pairs: the forward and backward repairs redo the rows it reached."""
    assert_non_finite_rules(dtype, True, "k", to_gpu, head_dim=D)


@pytest.mark.parametrize("portable", ["v2", "v2-mma", "v1"], indirect=True)
def test_a_kept_forward_leaves_its_scratch_zero(portable):
    """A kept plan's tile counters and repair flags (``_launch.Scratch``) live from call to call on the
    stream: the persistent forward's last CTA resets the counters and flash_fwd_repair clears the flags it
    reads. Calls in a row, one with an inf value under masked pairs (flagged, repaired), each against the
    reference; then every kept scratch is zero."""
    import cupy

    from cupyflash import _launch

    rng = numpy.random.default_rng(11)
    for n in range(4):
        q, k, v = random_inputs(rng, "float16", (2, 3, 200, 64), (2, 3, 200, 64))
        if n == 1:
            v[:, :, -1, :] = numpy.inf   # only the last query row sees the last key
        o, m, l = cupyflash.flash_attention_forward(*to_gpu(q, k, v), causal=True, schedule=portable)
        o_ref, m_ref, l_ref = reference.attention_forward(q, k, v, causal=True)
        seen = numpy.isfinite(o_ref)
        assert numpy.array_equal(numpy.isfinite(o.get()), seen), n
        for name, got, ref in (("o", o.get()[seen], o_ref[seen]), ("m", m.get(), m_ref), ("l", l.get(), l_ref)):
            assert_near(f"{name} of call {n}", got, ref, "float16")
    cupy.cuda.get_current_stream().synchronize()
    kept = [(plan, memory) for plan in _launch.PLANS.values() if isinstance(plan, _launch.ForwardPlan)
            for memory in plan.scratch.kept.values()]
    assert kept
    for plan, memory in kept:
        words = cupy.ndarray((plan.scratch.block.nbytes,), numpy.uint8, memptr=memory)
        assert not words.any(), plan


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("window", [None, (100, 0)])
def test_the_hopper_forward_repairs_the_tiles_it_flags(num_splits, window):
    """Without split-KV the Hopper forward's CTAs recompute the Q tiles they flagged themselves (no
    flash_fwd_repair after it); with split-KV flash_fwd_repair does, after the merge. More Q tiles than
    CTAs, so a CTA claims several, some flagged and some not; infs and NaNs in values that masked pairs
    meet in many tiles. Twice in a row on a kept plan, each against the reference, then the kept scratch
    is zero."""
    import cupy

    from cupyflash import _launch

    if not _launch._hopper(numpy.float16):
        pytest.skip("the Hopper forward runs on sm_90")
    rng = numpy.random.default_rng(12)
    q, k, v = random_inputs(rng, "float16", (4, 16, 1000, 64), (4, 16, 1000, 64))
    rows = rng.choice(1000, size=40, replace=False)
    heads = rng.integers(0, 16, size=40)
    v[rows % 4, heads, rows, :] = numpy.where(rows[:, None] % 2 == 0, numpy.inf, numpy.nan)
    refs = reference.attention_forward(q, k, v, causal=True, window=window)
    assert not numpy.isfinite(refs[0]).all()
    for _ in range(2):
        out = cupyflash.flash_attention_forward(*to_gpu(q, k, v), causal=True, window=window, num_splits=num_splits)
        for name, got, ref in zip("oml", out, refs):
            assert_non_finite_like(name, got, ref, "float16")
    cupy.cuda.get_current_stream().synchronize()
    plans = [plan for plan in _launch.PLANS.values() if isinstance(plan, _launch.ForwardPlan)
             and plan.outputs[0][0] == q.shape and (plan.merge is None) == (num_splits == 1)]
    assert plans and all(plan.launches[0].kernel.name == "flash_fwd_sm90" for plan in plans)
    assert all(len(plan.launches) == (1 if num_splits == 1 else 2) for plan in plans)   # + flash_fwd_repair
    for plan in plans:
        for memory in plan.scratch.kept.values():
            words = cupy.ndarray((plan.scratch.block.nbytes,), numpy.uint8, memptr=memory)
            assert not words.any(), plan



@pytest.mark.parametrize("dtype", DTYPES)
def test_merging_parts_gives_the_whole(dtype):
    """Attention over two key ranges, merged on the GPU, against the whole."""
    rng = numpy.random.default_rng(5)
    q, k, v = to_gpu(*random_inputs(rng, dtype, (2, 3, 77, 96), (2, 3, 300, 96)))
    parts = [cupyflash.flash_attention_forward(q, k[..., a:b, :], v[..., a:b, :]) for a, b in ((0, 100), (100, 300))]
    o, m, l = cupyflash.merge_attention(parts)
    o_ref, m_ref, l_ref = reference.attention_forward(*(x.get() for x in (q, k, v)))
    for name, got, ref in zip("oml", (o, m, l), (o_ref, m_ref, l_ref)):
        assert_near(name, got.get(), ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("page_size", [None, 48])
def test_a_decoding_step_against_the_cache(dtype, page_size):
    """New keys appended into a contiguous or paged cache, then GQA decoding over each entry's keys."""
    import cupy
    from test_kvcache import _assert_matches, _call, _case, _expected

    rng = numpy.random.default_rng(6)
    q, kc, vc, lens, new, paged = _case(rng, DTYPE_BY_NAME[dtype], B=3, Hkv=2, G=4, Nq=2, D=64, capacity=200,
                                        n_new=2, page_size=page_size)
    out, caches = _call(cupy, q, kc, vc, lens, new, paged, causal=True)
    _assert_matches(out, _expected(q, kc, vc, lens, new, causal=True), dtype)


@pytest.mark.parametrize("page_size", [16, 48])
def test_a_paged_cache_on_the_hopper_forward_equals_the_contiguous_one(page_size, monkeypatch):
    """The Hopper forward reading pages through the table (16-bit, sm_90; elsewhere the portable kernel):
    bit for bit the contiguous cache's, split-KV or not (tests/test_kvcache.py)."""
    from test_kvcache import test_a_paged_cache_equals_the_contiguous_one_bit_for_bit as paged_equals_contiguous

    paged_equals_contiguous(page_size, True, monkeypatch)


def test_a_device_seed_drops_what_its_int_drops(monkeypatch):
    """A CuPy seed read by the dropout kernels as they run, forward and backward, a graph replay included
    (tests/test_dropout.py), on the default schedule."""
    from test_dropout import test_a_device_seed_is_read_as_the_kernels_run as device_seed

    device_seed("auto", monkeypatch)


@pytest.mark.parametrize("D", [40, 128])
def test_the_float8_forward(D):
    """The float8 Hopper forward (the fwd_fp8 family, both of its specialisations: products over half the
    line at D <= 64, over all of it above; elsewhere its float16 path): GQA, ragged, causal."""
    from test_float8 import _check, _gpu_call, float8_inputs

    rng = numpy.random.default_rng(9)
    q, k, v = float8_inputs(rng, (2, 2, 2, 200, D), (2, 2, 1, 333, D), spread=2.0)
    _check(_gpu_call(q, k, v, q_descale=0.5, k_descale=0.25, v_descale=3.0, causal=True), q, k, v, (0.5, 0.25, 3.0),
           causal=True)
