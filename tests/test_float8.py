"""``cupyflash.float8.flash_attention_forward_fp8``: float8 e4m3 q, k, v with per-tensor or per-entry descales.

On the CPU: the NumPy path (exact float32 arithmetic on the float8 values) against the float64
reference of the descaled inputs, ml_dtypes' arrays against their uint8 bits, the refusals, and the float8
Hopper plan's launches and parameter struct with the GPU faked. On the GPU: the float8 kernel against an
emulation of its arithmetic (P~ rounded to float8 before P~ V, l unrounded) and against the reference,
with causal masks, windows, ragged ends, GQA broadcast, strided inputs, masked NaNs, and the float16 path
of head dims past the kernel's.
"""

import math

import ml_dtypes
import numpy
import pytest

from cupyflash import _launch, _params, reference
from cupyflash._mask import MaskGeometry
from cupyflash.float8 import as_float32, flash_attention_forward_fp8
from helpers import faked_gpu_module, gpu_test, requires_gpu

E4M3 = ml_dtypes.float8_e4m3fn
UNIT = 2.0 ** -4   # float8 e4m3's unit roundoff (3 mantissa bits)
# The float8 tensor cores do not accumulate in full float32: S_ij is off by up to about 2^-12 of
# scale · sum_d |q_id k_jd| (measured on the H200: 2^-11.6 at worst), where 16-bit products are exact
# to float32's rounding. Held to 2^-10 of it.
ACCUMULATION = 2.0 ** -10


def float8_inputs(rng, q_shape, kv_shape, spread=1.0):
    return tuple((rng.standard_normal(shape) * spread).astype(E4M3) for shape in (q_shape, kv_shape, kv_shape))


def score_slack(q, k, descales, softmax_scale=None):
    """Per query row, how far the float8 kernel's S_ij (hence m_i, and log l_i) may lie from the exact ones:
    ACCUMULATION of the largest scale · sum_d |q_id k_jd| over the keys (q, k float8, batch dims broadcast)."""
    qf, kf = (numpy.abs(as_float32(x).astype(numpy.float64)) for x in (q, k))
    scale = (1 / math.sqrt(qf.shape[-1]) if softmax_scale is None else softmax_scale) * descales[0] * descales[1]
    return ACCUMULATION * scale * (qf @ numpy.swapaxes(kf, -1, -2)).max(axis=-1)


def assert_bridge_o(o, want_o, v, v_descale, device):
    """A bridge's ``o`` against flash_attention_forward_fp8's NumPy path on the same values: equal on the CPU
    (that path), within P~'s rounding to float8 (and o's own) of ``max |v_descale · v|`` on CUDA."""
    vmax = numpy.abs(as_float32(v)).max() * v_descale
    tolerance = 0 if device == "cpu" else (UNIT + 2.0 ** -7) * vmax
    assert numpy.abs(numpy.asarray(o).astype(numpy.float32) - want_o.astype(numpy.float32)).max() <= tolerance


def jax_device(jax, device: str):
    """JAX's first device of platform ``device``; the test skips where JAX has none."""
    try:
        return jax.devices(device)[0]
    except RuntimeError:
        pytest.skip(f"no {device} backend in JAX")


def descaled_reference(q, k, v, descales, **kw):
    """The float64 reference of ``descale · x`` for float8 (or uint8 bits) q, k, v."""
    return reference.attention_forward(*(as_float32(x).astype(numpy.float64) * d for x, d in zip((q, k, v), descales)),
                                       **kw)


def emulated(q, k, v, descales, causal=False, window=None, softmax_scale=None):
    """The float8 kernel's arithmetic in float64: S of the descaled float8 values, P~ = exp(S - m) rounded to
    float8 for P~ V, l summed unrounded; rows without a key o = 0."""
    qf, kf, vf = (as_float32(x).astype(numpy.float64) for x in (q, k, v))
    D = qf.shape[-1]
    scale = (1 / math.sqrt(D) if softmax_scale is None else softmax_scale) * descales[0] * descales[1]
    s = scale * qf @ numpy.swapaxes(kf, -1, -2)
    Nq, Nk = s.shape[-2:]
    visible = MaskGeometry(Nq, Nk, causal, *(window or (None, None))).visible(numpy.arange(Nq), numpy.arange(Nk))
    s = numpy.where(visible, s, -numpy.inf)
    m = s.max(axis=-1, keepdims=True)
    p = numpy.where(visible, numpy.exp(s - numpy.where(numpy.isfinite(m), m, 0)), 0)
    l = p.sum(axis=-1)
    p8 = p.astype(E4M3).astype(numpy.float64)
    with numpy.errstate(invalid="ignore", divide="ignore"):
        o = numpy.where(l[..., None] > 0, p8 @ vf * descales[2] / l[..., None], 0)
    return o, m[..., 0], l


# ---------------------------------------------------------------------------
# CPU: the NumPy path, refusals, the plan

@pytest.mark.parametrize("causal, window", [(False, None), (True, None), (False, (20, 5))])
def test_the_numpy_path_is_exact_attention_of_the_descaled_values(causal, window):
    rng = numpy.random.default_rng(0)
    q, k, v = float8_inputs(rng, (2, 3, 50, 40), (2, 1, 70, 40))
    descales = (0.5, 0.25, 3.0)
    o, m, l = flash_attention_forward_fp8(q, k, v, q_descale=0.5, k_descale=0.25, v_descale=3.0, causal=causal,
                                          window=window)
    ro, rm, rl = descaled_reference(q, k, v, descales, causal=causal, window=window)
    assert o.dtype == ml_dtypes.bfloat16 and m.dtype == l.dtype == numpy.float32
    vmax = numpy.abs(as_float32(v)).max() * 3.0
    assert numpy.abs(o.astype(numpy.float64) - ro).max() <= 2.0 ** -8 * vmax + 1e-6   # o's rounding to bfloat16
    finite = numpy.isfinite(rm)
    assert numpy.array_equal(finite, numpy.isfinite(m))
    numpy.testing.assert_allclose(m[finite], rm[finite], rtol=1e-6, atol=1e-6)
    numpy.testing.assert_allclose(l, rl, rtol=1e-5, atol=0)


def test_uint8_bits_are_the_float8_values_and_inputs_stay_as_they_were():
    rng = numpy.random.default_rng(1)
    q, k, v = float8_inputs(rng, (1, 2, 33, 64), (1, 2, 33, 64))
    copies = [x.copy() for x in (q, k, v)]
    a = flash_attention_forward_fp8(q, k, v, causal=True, out_dtype="float16")
    b = flash_attention_forward_fp8(*(x.view(numpy.uint8) for x in (q, k, v)), causal=True, out_dtype=numpy.float16)
    for x, y in zip(a, b):
        assert x.dtype == y.dtype and numpy.array_equal(x, y, equal_nan=True)
    for x, c in zip((q, k, v), copies):
        assert numpy.array_equal(x.view(numpy.uint8), c.view(numpy.uint8))


def test_out_receives_the_results():
    rng = numpy.random.default_rng(2)
    q, k, v = float8_inputs(rng, (2, 17, 32), (2, 23, 32))
    want = flash_attention_forward_fp8(q, k, v)
    out = (numpy.empty((2, 17, 32), ml_dtypes.bfloat16), numpy.empty((2, 17), numpy.float32),
           numpy.empty((2, 17), numpy.float32))
    got = flash_attention_forward_fp8(q, k, v, out=out)
    assert all(g is o for g, o in zip(got, out))
    for x, y in zip(got, want):
        assert numpy.array_equal(x, y)


@pytest.mark.parametrize("change, error, words", [
    (dict(q="float16"), TypeError, "q has dtype float16"),
    (dict(v="mixed"), TypeError, "share one dtype"),
    (dict(q_descale=0.0), ValueError, "q_descale must be positive"),
    (dict(v_descale=float("nan")), ValueError, "v_descale must be positive"),
    (dict(k_descale="2"), TypeError, "k_descale must be a real number"),
    (dict(q_descale=numpy.ones(3, numpy.float32)), ValueError, "q_descale of shape .3,. does not broadcast"),
    (dict(v_descale=numpy.array([1.0, -1.0])), ValueError, "v_descale must hold positive finite values"),
    (dict(out_dtype="float32"), TypeError, "out_dtype must be float16 or bfloat16"),
    (dict(D=300), ValueError, "head dim D must be in [1, 256]"),
    (dict(softmax_scale=1e38, q_descale=1e10), ValueError, "not finite in float32"),
])
def test_bad_calls_name_the_argument(change, error, words):
    rng = numpy.random.default_rng(3)
    D = change.pop("D", 16)
    q, k, v = float8_inputs(rng, (2, 8, D), (2, 8, D))
    if change.pop("q", None):
        q = q.astype(numpy.float16)
    if change.pop("v", None):
        v = v.view(numpy.uint8)
    with pytest.raises(error, match=words.replace("[", r"\[").replace("]", r"\]")):
        flash_attention_forward_fp8(q, k, v, **change)


def _per_entry_inputs(rng):
    """GQA float8 inputs (q (2, 2, 3, 40, 32), k, v (2, 2, 1, 50, 32)) and positive descales per K/V head."""
    q, k, v = float8_inputs(rng, (2, 2, 3, 40, 32), (2, 2, 1, 50, 32), spread=2.0)
    qd, kd, vd = (rng.uniform(0.25, 4.0, (2, 2, 1)).astype(numpy.float32) for _ in range(3))
    return q, k, v, qd, kd, vd


def _entry_by_entry(q, k, v, qd, kd, vd, call, **kw):
    """``call`` with per-tensor descales, one K/V head (batch entry of the descales) at a time, stacked."""
    outs = [[call(q[b, h], k[b, h], v[b, h], q_descale=float(qd[b, h, 0]), k_descale=float(kd[b, h, 0]),
                  v_descale=float(vd[b, h, 0]), **kw) for h in range(q.shape[1])] for b in range(q.shape[0])]
    return [numpy.stack([numpy.stack([numpy.asarray(entry[i]) for entry in row]) for row in outs]) for i in range(3)]


@pytest.mark.parametrize("given", ["qkv", "q", "kv"])
def test_per_entry_descales_are_one_call_per_entry(given):
    """Descale arrays (one value per K/V head, broadcast over its query heads) give what per-tensor descales
    give entry by entry (to float32's rounding: the kernels and the NumPy path scale q, not the scores); a
    descale left a number applies to every entry."""
    rng = numpy.random.default_rng(8)
    q, k, v, qd, kd, vd = _per_entry_inputs(rng)
    arrays = {"q_descale": qd, "k_descale": kd, "v_descale": vd}
    kw = {name: arrays[name] if name[0] in given else 0.5 for name in arrays}
    o, m, l = flash_attention_forward_fp8(q, k, v, causal=True, out_dtype="float16", **kw)
    each = [numpy.broadcast_to(x, (2, 2, 1)) if isinstance(x, numpy.ndarray) else numpy.full((2, 2, 1), x, numpy.float32)
            for x in kw.values()]
    eo, em, el = _entry_by_entry(q, k, v, *each, flash_attention_forward_fp8, causal=True, out_dtype="float16")
    assert o.shape == eo.shape == (2, 2, 3, 40, 32) and m.shape == em.shape
    vmax = numpy.abs(eo.astype(numpy.float32)).max()
    assert numpy.abs(o.astype(numpy.float32) - eo.astype(numpy.float32)).max() <= 2.0 ** -9 * vmax
    numpy.testing.assert_allclose(m, em, rtol=1e-5, atol=1e-6)
    numpy.testing.assert_allclose(l, el, rtol=1e-5)


def _layout(q, k, v, batch):
    """The plan's batch layout of q, k, v (as flash_attention_forward_fp8 makes it)."""
    from cupyflash import api

    return _launch.collapse_batch(batch, api._batch_strides((q, k, v), batch), ("q", "k", "v"))


@pytest.mark.parametrize("D, rows, block_r", [(96, 128, 128), (48, 64, 192)])
def test_the_hopper_plan_writes_v_transposed_then_runs_the_float8_kernel(monkeypatch, D, rows, block_r):
    """GQA (k, v broadcast over 4 query heads), 300 keys: flash_fp8_values over every call entry and run of 128
    keys, then the persistent main kernel; V^T one (rows, 384) block per K/V head (64 rows at D <= 64, whose
    products cover half the 128-byte line), its batch strides 0 along the broadcast dim; the scale carries the
    descales of q and k, v_scale v's."""
    gpu = faked_gpu_module().FakeGPU(patch=monkeypatch.setattr, keep_structs=True)
    B, Hkv, G, N = 2, 2, 4, 300
    q = gpu.array((B, Hkv, G, N, D), numpy.uint8)
    k, v = gpu.array((B, Hkv, 1, N, D), numpy.uint8), gpu.array((B, Hkv, 1, N, D), numpy.uint8)
    batch = (B, Hkv, G)
    layout = _layout(q, k, v, batch)
    plan = _launch.fp8_forward_plan(q, k, v, out_dtype=numpy.float16, geometry=MaskGeometry(N, N, True, None, None),
                                    scale=0.125 * 0.5, v_scale=2.0, batch_shape=batch, layout=layout)
    o, m, l = plan(q, k, v)
    assert (o.shape, o.dtype, m.shape, l.dtype) == ((B, Hkv, G, N, D), numpy.float16, batch + (N,), numpy.float32)
    assert [name for name, _ in gpu.structs] == ["flash_fp8_values", "flash_fwd_sm90"]
    assert plan.before[0].grid[0] == B * Hkv * G * 3   # runs of 128 keys
    assert plan.launches[0].grid[0] == B * Hkv * G * -(-N // block_r)   # Q tiles (fewer than the SMs here)
    struct = numpy.frombuffer(gpu.structs[1][1][:_params.FWD.itemsize], _params.FWD)[0]
    assert gpu.structs[0][1][:_params.FWD.itemsize] == gpu.structs[1][1][:_params.FWD.itemsize]
    assert tuple(struct["vt"])[1:] == (0, rows * 384, 0, 384)   # (ptr, s0, s1, s2, sn): per K/V head, not per group
    assert struct["vt"]["ptr"] != 0 and struct["v_scale"] == 2.0 and struct["scale"] == numpy.float32(0.0625)
    assert (struct["D"], struct["vec"], struct["kv_splits"], struct["tile_rows"]) == (D, 1, 1, block_r)
    assert plan.launches[0].kernel.name == "flash_fwd_sm90" and plan.before[0].kernel.name == "flash_fp8_values"
    vt_bytes = B * Hkv * rows * 384
    assert plan.fresh.nbytes >= vt_bytes and plan.given.nbytes >= vt_bytes


def test_the_hopper_plan_reads_per_entry_descales_where_each_call_puts_them(monkeypatch):
    """Descale arrays lie over the batch dims as (1, 1) matrices: the struct holds their collapsed batch
    strides (0 along the query heads of a K/V head), each call their addresses; a descale given as a number
    has none (its factor is in scale or v_scale)."""
    from cupyflash import api

    gpu = faked_gpu_module().FakeGPU(patch=monkeypatch.setattr, keep_structs=True)
    B, Hkv, G, N, D = 2, 2, 4, 100, 64
    q = gpu.array((B, Hkv, G, N, D), numpy.uint8)
    k, v = gpu.array((B, Hkv, 1, N, D), numpy.uint8), gpu.array((B, Hkv, 1, N, D), numpy.uint8)
    qd, vd = gpu.array((B, Hkv, 1), numpy.float32), gpu.array((Hkv, 1), numpy.float32)
    batch = (B, Hkv, G)
    named = {"q": q, "k": k, "v": v, "q_descale": qd.reshape(B, Hkv, 1, 1, 1), "v_descale": vd.reshape(Hkv, 1, 1, 1)}
    layout = _launch.collapse_batch(batch, api._batch_strides(named.values(), batch), tuple(named))
    plan = _launch.fp8_forward_plan(q, k, v, out_dtype=numpy.float16, geometry=MaskGeometry(N, N, False, None, None),
                                    scale=0.125 * 0.5, v_scale=1.0, batch_shape=batch, layout=layout,
                                    per_entry=("q", "v"))
    for qd_now, vd_now in ((qd, vd), (gpu.array((B, Hkv, 1), numpy.float32), gpu.array((Hkv, 1), numpy.float32))):
        gpu.structs.clear()
        plan(q, k, v, descales=(qd_now, None, vd_now))
        struct = numpy.frombuffer(gpu.structs[1][1][:_params.FWD.itemsize], _params.FWD)[0]
        d = struct["descales"]
        assert (d["q"]["ptr"], d["k"]["ptr"], d["v"]["ptr"]) == (qd_now.data.ptr, 0, vd_now.data.ptr)
        assert tuple(d["q"])[1:] == layout.of("q_descale") and tuple(d["v"])[1:] == layout.of("v_descale")
        assert layout.of("v_descale") != (0, 0, 0) and struct["scale"] == numpy.float32(0.0625)
    gpu.structs.clear()
    plan(q, k, v)   # no arrays: null pointers (per-tensor descales alone)
    struct = numpy.frombuffer(gpu.structs[1][1][:_params.FWD.itemsize], _params.FWD)[0]
    assert all(struct["descales"][x]["ptr"] == 0 for x in "qkv")


# ---------------------------------------------------------------------------
# GPU

@gpu_test
@pytest.mark.parametrize("given", ["qkv", "kv"])
def test_per_entry_descales_on_the_gpu_are_one_call_per_entry(given):
    """The float8 kernel with descale arrays (CuPy, float32, one per K/V head) against per-tensor calls
    entry by entry on the GPU (the same kernel, so the same arithmetic to float32's rounding of the scale),
    and a like call with other arrays (the kept plan) against the same; D 64 and 128 tiles."""
    import cupy

    rng = numpy.random.default_rng(9)
    for D in (64, 128):
        q, k, v = float8_inputs(rng, (2, 2, 3, 200, D), (2, 2, 1, 300, D), spread=2.0)
        for _ in range(2):   # the second call finds the first's plan
            qd, kd, vd = (rng.uniform(0.25, 4.0, (2, 2, 1)).astype(numpy.float32) for _ in range(3))
            arrays = {"q_descale": qd, "k_descale": kd, "v_descale": vd}
            kw = {name: cupy.asarray(x) if name[0] in given else 0.5 for name, x in arrays.items()}
            got = _gpu_call(q, k, v, causal=True, **kw)
            each = [x if name[0] in given else numpy.full((2, 2, 1), 0.5, numpy.float32) for name, x in arrays.items()]
            want = _entry_by_entry(q, k, v, *each, _gpu_call, causal=True)
            vmax = numpy.abs(want[0].astype(numpy.float32)).max()
            assert numpy.abs(got[0].astype(numpy.float32) - want[0].astype(numpy.float32)).max() <= 2.0 ** -6 * vmax
            numpy.testing.assert_allclose(got[1], want[1], rtol=1e-5, atol=1e-5)
            numpy.testing.assert_allclose(got[2], want[2], rtol=1e-4)


def _gpu_call(q, k, v, **kw):
    import cupy

    return [x.get() for x in flash_attention_forward_fp8(*(cupy.asarray(x.view(numpy.uint8)) for x in (q, k, v)),
                                                         **kw)]


def _check(got, q, k, v, descales, causal=False, window=None, emulate=True):
    """The float8 kernel against its emulation (the same roundings: differences where exp2's approximation
    or the accumulation moves a P~ across a float8 rounding boundary, rare) and against the float64 reference
    (P~'s rounding at most 2^-4 of max |v|); m within the accumulation's slack (``score_slack``), l within
    twice it relative."""
    o, m, l = got
    o = o.astype(numpy.float64)
    ro, rm, rl = descaled_reference(q, k, v, descales, causal=causal, window=window)
    vmax = max(numpy.nanmax(numpy.abs(as_float32(v))) * descales[2], 1e-30)
    assert numpy.array_equal(numpy.isnan(o), numpy.isnan(ro))
    both = ~numpy.isnan(ro)
    assert numpy.abs(o - ro)[both].max() <= (UNIT + 2.0 ** -7) * vmax
    if emulate:
        eo, _, _ = emulated(q, k, v, descales, causal=causal, window=window)
        assert numpy.abs(o - eo)[both].mean() <= 2e-3 * vmax
    finite = numpy.isfinite(rm)
    assert numpy.array_equal(finite, numpy.isfinite(m))
    slack = numpy.broadcast_to(score_slack(q, k, descales), m.shape)
    assert numpy.all(numpy.abs(m - rm)[finite] <= slack[finite] + 2e-6 * numpy.abs(rm[finite]))
    assert numpy.all(numpy.abs(l / numpy.where(finite, rl, 1) - 1)[finite] <= 2 * slack[finite] + 2e-5)
    assert numpy.all(l[~finite] == 0)


@gpu_test
@pytest.mark.parametrize("shape, causal, window, D", [
    (((1, 2, 128), (1, 2, 128)), False, None, 128),          # one tile
    (((2, 4, 200), (2, 4, 300)), True, None, 128),           # ragged, bottom-right causal
    (((1, 2, 77), (1, 2, 1000)), False, None, 64),           # D padded to 128, few rows
    (((1, 2, 256), (1, 2, 256)), True, (32, 0), 96),         # a window: the left side's masked pairs
    (((3, 513), (3, 700)), False, (100, 50), 128),           # both sides of a window
])
def test_the_float8_kernel_against_its_emulation_and_the_reference(shape, causal, window, D):
    rng = numpy.random.default_rng(4)
    (q_shape, k_shape) = shape
    q, k, v = float8_inputs(rng, (*q_shape, D), (*k_shape, D), spread=2.0)
    descales = (0.5, 0.25, 3.0)
    got = _gpu_call(q, k, v, q_descale=0.5, k_descale=0.25, v_descale=3.0, causal=causal, window=window)
    _check(got, q, k, v, descales, causal=causal, window=window)


@gpu_test
def test_gqa_broadcast_and_strided_inputs():
    """k, v (B, Hkv, 1, N, D) broadcast over 4 query heads (V^T written once per K/V head), q a strided view."""
    import cupy

    rng = numpy.random.default_rng(5)
    q = (rng.standard_normal((2, 2, 4, 300, 256)) * 2).astype(E4M3)[..., :128]   # D 128, rows 256 bytes apart
    k, v = (rng.standard_normal((2, 2, 1, 300, 128)).astype(E4M3) for _ in range(2))
    got = [x.get() for x in flash_attention_forward_fp8(cupy.asarray(q.view(numpy.uint8)), *(cupy.asarray(x.view(numpy.uint8))
                                                        for x in (k, v)), causal=True, out_dtype="float16")]
    assert got[0].dtype == numpy.float16
    _check(got, numpy.ascontiguousarray(q), k, v, (1.0, 1.0, 1.0), causal=True)


@gpu_test
def test_a_nan_in_a_masked_value_does_not_reach_the_rows_that_do_not_see_it():
    """The last key's value is NaN: under the causal mask only the last row sees it (the kernel flags the
    tiles where a masked pair meets it and recomputes their rows exactly)."""
    rng = numpy.random.default_rng(6)
    q, k, v = float8_inputs(rng, (1, 2, 300, 128), (1, 2, 300, 128))
    bits = v.view(numpy.uint8).copy()
    bits[..., -1, 0] = 0x7f
    v = bits.view(E4M3)
    got = _gpu_call(q, k, v, causal=True)
    assert numpy.isnan(got[0][..., -1, 0]).all() and not numpy.isnan(got[0][..., :-1, :]).any()
    _check(got, q, k, v, (1.0, 1.0, 1.0), causal=True, emulate=False)


@gpu_test
@pytest.mark.parametrize("D", [200, 256])
def test_head_dims_past_the_kernel_run_the_float16_path(D):
    rng = numpy.random.default_rng(7)
    q, k, v = float8_inputs(rng, (2, 90, D), (2, 120, D))
    got = _gpu_call(q, k, v, v_descale=0.5, causal=True)
    o, m, l = got
    ro, rm, rl = descaled_reference(q, k, v, (1.0, 1.0, 0.5), causal=True)
    vmax = numpy.abs(as_float32(v)).max() * 0.5
    assert numpy.abs(o.astype(numpy.float64) - ro).max() <= 2.0 ** -7 * vmax   # no float8 P~: float16 o, bfloat16 out
    numpy.testing.assert_allclose(m, rm, rtol=2e-6, atol=2e-6)


@gpu_test
def test_inputs_are_left_as_they_were_and_like_calls_agree():
    import cupy

    rng = numpy.random.default_rng(8)
    q, k, v = (cupy.asarray(x.view(numpy.uint8)) for x in float8_inputs(rng, (2, 3, 257, 128), (2, 3, 257, 128)))
    copies = [x.copy() for x in (q, k, v)]
    first = [x.get() for x in flash_attention_forward_fp8(q, k, v, causal=True)]
    second = [x.get() for x in flash_attention_forward_fp8(q, k, v, causal=True)]   # the kept plan
    for a, b in zip(first, second):
        assert numpy.array_equal(a, b, equal_nan=True)
    for x, c in zip((q, k, v), copies):
        assert bool((x == c).all())


# ---------------------------------------------------------------------------
# cupyflash.torch

@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=requires_gpu)])
@pytest.mark.parametrize("layout", ["bhnd", "bnhd"])
def test_torch_float8_tensors_give_what_cupyflash_gives(device, layout):
    """torch.float8_e4m3fn q (8 heads), k, v (2 heads: GQA), either layout: o and lse as
    flash_attention_forward_fp8 on the same values (on CUDA, against the NumPy path within P~'s rounding)."""
    torch = pytest.importorskip("torch")
    from cupyflash.torch import flash_attention_fp8

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(shape, generator=g).to(torch.float8_e4m3fn)
               for shape in ((2, 8, 70, 64), (2, 2, 90, 64), (2, 2, 90, 64)))
    want_o, want_m, want_l = flash_attention_forward_fp8(
        *(x.view(torch.uint8).numpy().view(E4M3).reshape(shape) for x, shape in
          ((q, (2, 2, 4, 70, 64)), (k, (2, 2, 1, 90, 64)), (v, (2, 2, 1, 90, 64)))),
        causal=True, v_descale=0.5, out_dtype="float16")
    args = [x.to(device) for x in (q, k, v)]
    if layout == "bnhd":
        args = [x.transpose(1, 2) for x in args]
    o, lse = flash_attention_fp8(*args, causal=True, v_descale=0.5, out_dtype=torch.float16, layout=layout,
                                 return_lse=True)
    if layout == "bnhd":
        o = o.transpose(1, 2)
    assert o.dtype == torch.float16 and o.shape == (2, 8, 70, 64) and lse.shape == (2, 8, 70)
    assert_bridge_o(o.float().cpu().numpy().reshape(want_o.shape), want_o, v.view(torch.uint8).numpy(), 0.5, device)
    inputs = [x.view(torch.uint8).numpy() for x in (q, k)]
    slack = 0 if device == "cpu" else 3 * score_slack(inputs[0].reshape(2, 2, 4, 70, 64), inputs[1][:, :, None], (1, 1, 1))
    assert numpy.all(numpy.abs(lse.cpu().numpy().reshape(want_m.shape) - (want_m + numpy.log(want_l)))
                     <= slack + 1e-5 * (1 + numpy.abs(want_m)))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=requires_gpu)])
def test_torch_per_head_descales_give_what_cupyflash_gives(device):
    """FlashAttention-3's per-head descales as torch tensors ((B, Hkv), and (1, Hkv) broadcasting to it), GQA:
    o as flash_attention_forward_fp8 with the same factors as (B, Hkv, 1) arrays; a shape that does not
    broadcast is refused naming the argument and both shapes."""
    torch = pytest.importorskip("torch")
    from cupyflash.torch import flash_attention_fp8

    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(shape, generator=g).to(torch.float8_e4m3fn)
               for shape in ((2, 4, 40, 64), (2, 2, 50, 64), (2, 2, 50, 64)))
    qd = torch.tensor([[0.5, 2.0], [1.5, 0.25]])
    kd = torch.tensor([[3.0, 0.75]])
    want_o, _, _ = flash_attention_forward_fp8(
        *(x.view(torch.uint8).numpy().view(E4M3).reshape(shape) for x, shape in
          ((q, (2, 2, 2, 40, 64)), (k, (2, 2, 1, 50, 64)), (v, (2, 2, 1, 50, 64)))),
        q_descale=qd.numpy()[:, :, None], k_descale=kd.numpy()[:, :, None], v_descale=0.5, out_dtype="float16")
    o = flash_attention_fp8(*(x.to(device) for x in (q, k, v)), q_descale=qd.to(device), k_descale=kd.to(device),
                            v_descale=0.5, out_dtype=torch.float16)
    assert_bridge_o(o.float().cpu().numpy().reshape(want_o.shape), want_o, v.view(torch.uint8).numpy(), 0.5, device)
    with pytest.raises(ValueError, match=r"q_descale must broadcast to \(B, Hkv\) = \(2, 2\), got shape \(3,\)"):
        flash_attention_fp8(*(x.to(device) for x in (q, k, v)), q_descale=torch.ones(3, device=device))
    with pytest.raises(TypeError, match="v_descale must have dtype torch.float32"):
        flash_attention_fp8(*(x.to(device) for x in (q, k, v)), v_descale=torch.ones(2, 2, dtype=torch.float64,
                                                                                      device=device))


# ---------------------------------------------------------------------------
# cupyflash.jax

@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=requires_gpu)])
def test_jax_float8_arrays_inside_jit_give_what_cupyflash_gives(device):
    """jnp.float8_e4m3fn q (B, Hkv, G, N, D) against k, v (B, Hkv, 1, N, D) inside jax.jit: o and lse as
    flash_attention_forward_fp8 on the same values (on CUDA within P~'s rounding of the NumPy path's o)."""
    jax = pytest.importorskip("jax")
    from cupyflash.jax import flash_attention_fp8

    on = jax_device(jax, device)
    rng = numpy.random.default_rng(10)
    q, k, v = float8_inputs(rng, (2, 2, 4, 60, 64), (2, 2, 1, 75, 64))
    want_o, want_m, want_l = flash_attention_forward_fp8(q, k, v, causal=True, q_descale=2.0, v_descale=0.5)
    step = jax.jit(lambda q, k, v: flash_attention_fp8(q, k, v, causal=True, q_descale=2.0, v_descale=0.5,
                                                       return_lse=True))
    o, lse = step(*(jax.device_put(x, on) for x in (q, k, v)))
    assert o.dtype == ml_dtypes.bfloat16 and o.shape == want_o.shape
    assert_bridge_o(o, want_o, v, 0.5, device)
    slack = 0 if device == "cpu" else 3 * score_slack(q, k, (2.0, 1.0, 1.0))
    assert numpy.all(numpy.abs(numpy.asarray(lse) - (want_m + numpy.log(want_l))) <= slack + 1e-5 * (1 + numpy.abs(want_m)))
    with pytest.raises(TypeError, match="q must have dtype float8_e4m3fn"):
        flash_attention_fp8(numpy.zeros((2, 8, 16), numpy.float16), k[0, 0], v[0, 0])


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=requires_gpu)])
def test_jax_per_entry_descales_are_traced_operands(device):
    """Per-entry descales as JAX arrays inside jax.jit: o as flash_attention_forward_fp8 with the same arrays;
    new values run the same trace; a float64 or a shape that does not broadcast is refused."""
    jax = pytest.importorskip("jax")
    from cupyflash.jax import flash_attention_fp8

    on = jax_device(jax, device)
    rng = numpy.random.default_rng(11)
    q, k, v = float8_inputs(rng, (2, 2, 3, 30, 64), (2, 2, 1, 45, 64))
    traces = []

    def attend(q, k, v, qd, vd):
        traces.append(1)
        return flash_attention_fp8(q, k, v, causal=True, q_descale=qd, k_descale=1.5, v_descale=vd)

    step = jax.jit(attend)
    for seed in (0, 1):
        qd, vd = (numpy.random.default_rng(seed).uniform(0.25, 4, shape).astype(numpy.float32)
                  for shape in ((2, 2, 1), (2, 1, 1)))
        want_o, _, _ = flash_attention_forward_fp8(q, k, v, causal=True, q_descale=qd, k_descale=1.5, v_descale=vd)
        o = step(*(jax.device_put(x, on) for x in (q, k, v, qd, vd)))
        assert_bridge_o(o, want_o, v, vd.max(), device)
    assert len(traces) == 1
    with pytest.raises(TypeError, match="q_descale must be a number or a float32 array, got dtype float64"):
        flash_attention_fp8(q, k, v, q_descale=numpy.ones((2, 2, 1)))
    with pytest.raises(ValueError, match=r"k_descale of shape \(3, 1\) does not broadcast to the batch shape "
                                         r"\(2, 2, 3\)"):
        flash_attention_fp8(q, k, v, k_descale=numpy.ones((3, 1), numpy.float32))


def test_a_like_call_runs_the_kept_plan_with_or_without_out(monkeypatch):
    """CuPy calls like an earlier one (the bridges pass ``out=`` fresh arrays each call) find its plan and only
    launch: flash_fp8_values then the main kernel, into ``out`` where given. GPU faked: the first call's key
    is recorded where it enters the device, and the plan is made for it as the GPU path would."""
    pytest.importorskip("cupy")
    from cupyflash import api, float8

    gpu = faked_gpu_module().FakeGPU(patch=monkeypatch.setattr, keep_structs=True)
    q, k, v = (gpu.array((2, 4, 200, 128), numpy.uint8) for _ in range(3))
    stats = (2, 4, 200)
    for out in (None, api.FreshOut((gpu.array((*stats, 128), numpy.float16), gpu.array(stats, numpy.float32),
                                    gpu.array(stats, numpy.float32)))):
        keys = []
        kept = float8._kept_plan
        monkeypatch.setattr(float8, "_kept_plan", lambda *a: keys.append(kept(*a)[1]) or kept(*a))
        with pytest.raises(Exception):   # no driver behind `with q.device`
            flash_attention_forward_fp8(q, k, v, causal=True, out_dtype="float16", out=out)
        monkeypatch.setattr(float8, "_kept_plan", kept)
        batch = (2, 4)
        layout = _layout(q, k, v, batch)
        _launch.keep_plan(keys[0], _launch.fp8_forward_plan(
            q, k, v, out_dtype=numpy.float16, geometry=MaskGeometry(200, 200, True, None, None),
            scale=1 / math.sqrt(128), v_scale=1.0, batch_shape=batch, layout=layout))
        gpu.structs.clear()
        o, m, l = flash_attention_forward_fp8(q, k, v, causal=True, out_dtype="float16", out=out)
        assert [name for name, _ in gpu.structs] == ["flash_fp8_values", "flash_fwd_sm90"]
        assert o.shape == (*stats, 128) and o.dtype == numpy.float16 and m.shape == l.shape == stats
        if out is not None:
            assert all(got is given for got, given in zip((o, m, l), out))
            struct = numpy.frombuffer(gpu.structs[1][1][:_params.FWD.itemsize], _params.FWD)[0]
            assert (struct["o"], struct["m"], struct["l"]) == tuple(x.data.ptr for x in out)


def test_a_like_call_with_descale_arrays_runs_the_kept_plan_with_their_addresses(monkeypatch):
    """Descale arrays are part of a call's key by shape, strides and dtype, not by value: a like call with
    other arrays finds the plan and writes their addresses (GPU faked, as above)."""
    pytest.importorskip("cupy")
    from cupyflash import api, float8

    gpu = faked_gpu_module().FakeGPU(patch=monkeypatch.setattr, keep_structs=True)
    q, k, v = (gpu.array((2, 4, 200, 128), numpy.uint8) for _ in range(3))
    keys, kept = [], float8._kept_plan
    monkeypatch.setattr(float8, "_kept_plan", lambda *a: keys.append(kept(*a)[1]) or kept(*a))
    with pytest.raises(Exception):   # no driver behind `with q.device`
        flash_attention_forward_fp8(q, k, v, k_descale=gpu.array((2, 4), numpy.float32), v_descale=2.0)
    monkeypatch.setattr(float8, "_kept_plan", kept)
    batch = (2, 4)
    kd = gpu.array((2, 4), numpy.float32)
    named = {"q": q, "k": k, "v": v, "k_descale": kd.reshape(2, 4, 1, 1)}
    layout = _launch.collapse_batch(batch, api._batch_strides(named.values(), batch), tuple(named))
    _launch.keep_plan(keys[0], _launch.fp8_forward_plan(
        q, k, v, out_dtype=numpy.dtype(ml_dtypes.bfloat16), geometry=MaskGeometry(200, 200, False, None, None),
        scale=1 / math.sqrt(128), v_scale=2.0, batch_shape=batch, layout=layout, per_entry=("k",)))
    for _ in range(2):
        kd = gpu.array((2, 4), numpy.float32)
        gpu.structs.clear()
        flash_attention_forward_fp8(q, k, v, k_descale=kd, v_descale=2.0)
        struct = numpy.frombuffer(gpu.structs[1][1][:_params.FWD.itemsize], _params.FWD)[0]
        assert [struct["descales"][x]["ptr"] for x in "qkv"] == [0, kd.data.ptr, 0]
    assert keys[0] is not None and keys[0] in _launch.PLANS
