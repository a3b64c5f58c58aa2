"""Attention on float8 e4m3 inputs: FlashAttention-3's FP8 forward on Hopper.

``flash_attention_forward_fp8`` takes q, k, v in float8 e4m3 (``ml_dtypes.float8_e4m3fn``, the OCP
"fn" variant: no infinities, max 448) with descale factors per tensor or per batch entry (per head),
as FlashAttention-3 does, and returns o in float16 or bfloat16 with m and l in float32. On sm_90 GPUs at D <= 128 both
products run on float8 tensor cores (``kernels_cu/flash_fwd_sm90.cu`` compiled with FLASH_FP8); the
probabilities P~ are rounded to float8 before P~ V. Elsewhere (other GPUs, D > 128, a scale that is
not positive) the inputs are converted exactly to float16 and run the 16-bit kernels; the NumPy path
is the blocked algorithm in float32. Forward only: there is no float8 backward.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Optional

import numpy

from . import _launch, blocked
from ._checks import FLOAT8_DTYPES, check_forward, check_out, check_per_entry
from .api import _batch_strides, _empty, _into, _kept_plan, _kernel_ready, flash_attention_forward
from ._tiles import FP8_HEAD_DIM, SIXTEEN_BIT, dtype_name

OUTPUTS = ("o", "m", "l")
DESCALES = ("q_descale", "k_descale", "v_descale")


def flash_attention_forward_fp8(q, k, v, *, q_descale=1.0, k_descale=1.0, v_descale=1.0,
                                out_dtype="bfloat16", causal: bool = False, softmax_scale: Optional[float] = None,
                                window=None, out=None) -> tuple:
    """Attention of float8 e4m3 inputs with its softmax statistics (FlashAttention-3's FP8 forward).

    Computes the attention of ``q_descale · q``, ``k_descale · k``, ``v_descale · v``, exactly as
    `cupyflash.flash_attention_forward` does for the same values, except that on the float8 kernel the
    probabilities ``P~_ij = exp(S_ij − m_i)`` are rounded to float8 (round to nearest) before they
    multiply ``v``; ``l`` sums them unrounded.

    Parameters
    ----------
    q : numpy.ndarray or cupy.ndarray, shape (..., Nq, D)
    k : numpy.ndarray or cupy.ndarray, shape (..., Nk, D)
    v : numpy.ndarray or cupy.ndarray, shape (..., Nk, D)
        float8 e4m3: NumPy arrays of ``ml_dtypes.float8_e4m3fn``, or their bits as ``uint8`` (CuPy has
        no float8 dtype: ``cupy.asarray(x.view(numpy.uint8))``, or a torch float8 tensor's
        ``.view(torch.uint8)`` through DLPack). One dtype for all three; ``1 <= D <= 256``; batch dims
        broadcast as in `cupyflash.flash_attention_forward` (GQA: ``k, v (B, Hkv, 1, N, D)``); any strides.
    q_descale, k_descale, v_descale : float or array, optional
        Positive finite factors that turn each tensor's float8 values into the values it stands for:
        one number per tensor, or an array of one per batch entry (per head: FlashAttention-3's ``(B,
        Hkv)`` descales are ``(B, Hkv, 1)`` here for ``q (B, Hkv, G, N, D)``) whose shape broadcasts to the
        batch shape; float32 (other dtypes are converted), a CuPy array for CuPy inputs (a NumPy one is
        copied to the GPU). The values of a CuPy array are not checked (that would wait for the GPU): they
        must be positive and finite. Default 1.
    out_dtype : {"bfloat16", "float16"} or dtype, optional
        The dtype of ``o``. Default bfloat16.
    causal, softmax_scale, window : optional
        As in `cupyflash.flash_attention_forward` (the scale multiplies the descaled scores).
    out : tuple of three arrays, optional
        ``(o, m, l)`` to write into: C-contiguous, of exactly the shapes and dtypes returned.

    Returns
    -------
    o : ndarray, shape (*batch, Nq, D), ``out_dtype``
    m : ndarray, shape (*batch, Nq), float32
        Row max of the scaled scores, natural units; ``-inf`` for a row that sees no key.
    l : ndarray, shape (*batch, Nq), float32
        Row sum of ``exp(S − m)``; 0 for a row that sees no key.

    Notes
    -----
    Error against the float64 reference of the descaled inputs: the float8 tensor cores do not accumulate
    in full float32, so a score ``S_ij`` (hence ``m``, and ``l`` relatively) is off by up to about 2⁻¹² of
    ``softmax_scale · q_descale · k_descale · Σ_d |q_id k_jd|`` (measured on the H200; the 16-bit kernels'
    scores are exact to float32's rounding); ``o`` adds the rounding of each ``P~_ij`` to float8 (relative
    2⁻⁴ at most, ``P~ < 2⁻¹⁰`` flushed to zero): at most ``2⁻⁴ · max |v_descale · v|`` and measured at
    about 3·10⁻³ of it (mean 4·10⁻⁴), plus ``o``'s own rounding. A NaN in ``v`` at a key that a row's mask
    hides does not reach that row (the kernel recomputes such rows exactly). There is no backward.
    """
    # a CuPy call like an earlier one (shapes, strides, dtypes, keywords; out's too; descale arrays' shapes and
    # strides) runs that call's plan
    numbers = (q_descale, k_descale, v_descale)
    per_entry = {}
    if not all(type(x) is float for x in numbers):   # (the usual call: three Python floats)
        per_entry = {name: x for name, x in zip(DESCALES, numbers) if _is_array(x)}
        numbers = tuple(None if name in per_entry else x for name, x in zip(DESCALES, numbers))
    plan, key = _kept_plan({"q": q, "k": k, "v": v, **per_entry}, out, OUTPUTS,
                           ("fp8", causal, softmax_scale, window, *numbers, out_dtype))
    if plan is not None:
        return plan(q, k, v, out, descales=_launch.NO_DESCALES if not per_entry else
                    tuple(per_entry.get(name) for name in DESCALES))
    prob = check_forward(q, k, v, causal, softmax_scale, window, supported=FLOAT8_DTYPES)
    device = None if prob.xp is numpy else q.device.id
    qd, kd, vd = (1.0 if x is None else _check_descale(name, x) for name, x in zip(DESCALES, numbers))
    arrays = {name: _check_descale_array(name, x, prob, device) for name, x in per_entry.items()}
    o_dtype = _check_out_dtype(out_dtype)
    scale = prob.scale * qd * kd
    if not math.isfinite(scale) or abs(scale) > float(numpy.finfo(numpy.float32).max) / 2:
        raise ValueError(f"softmax_scale · q_descale · k_descale = {scale} is not finite in float32")
    stats = (*prob.batch_shape, prob.Nq)
    shapes, dtypes = ((*stats, prob.D), stats, stats), (o_dtype, numpy.dtype(numpy.float32), numpy.dtype(numpy.float32))
    if prob.xp is numpy:
        if out is not None:
            out = check_out(out, OUTPUTS, shapes, dtypes, numpy, None, {"q": q, "k": k, "v": v})
        return _into(out, _descaled(blocked.forward, *(as_float32(x) for x in (q, k, v)), arrays, vd, o_dtype,
                                    causal=prob.causal, softmax_scale=scale, window=prob.window))
    import cupy

    with q.device:
        if out is not None:
            out = check_out(out, OUTPUTS, shapes, dtypes, cupy, q.device.id, {"q": q, "k": k, "v": v})
        if _empty(prob):
            results = out or tuple(cupy.empty(shape, dtype) for shape, dtype in zip(shapes, dtypes))
            for x, value in zip(results, (0, -numpy.inf, 0)):
                x.fill(value)
            return results
        (q, k, v), key = _kernel_ready((q, k, v), key)
        if any(x is not per_entry.get(name) for name, x in arrays.items()):
            key = None   # a descale array copied or converted: a like call does so again
        layout = None
        if prob.D <= FP8_HEAD_DIM and numpy.float32(scale) > 0 and _launch._hopper(numpy.float16):
            # a descale array lies over the batch dims as a batch of 1 x 1 matrices (as ALiBi's slopes)
            named = {"q": q, "k": k, "v": v, **{name: x.reshape(*x.shape, 1, 1) for name, x in arrays.items()}}
            layout = _launch.collapse_batch(prob.batch_shape, _batch_strides(named.values(), prob.batch_shape),
                                            tuple(named))
        if layout is not None:
            plan = _launch.fp8_forward_plan(q, k, v, out_dtype=o_dtype, geometry=prob.geometry, scale=scale,
                                            v_scale=vd, batch_shape=prob.batch_shape, layout=layout,
                                            per_entry=tuple(name[0] for name in arrays))
            _launch.keep_plan(key, plan)
            return plan(q, k, v, out, descales=tuple(arrays.get(name) for name in DESCALES))
        if not arrays:   # no float8 kernel here: the exact float16 values through the 16-bit kernels
            o, m, l = flash_attention_forward(*(_float16(x) for x in (q, k, v)), causal=prob.causal,
                                              softmax_scale=scale, window=prob.window)
            return _into(out, ((o.astype(numpy.float32) * numpy.float32(vd)).astype(o_dtype), m, l))
        # ... and with per-entry descales, their float32 values through the float32 kernels
        return _into(out, _descaled(flash_attention_forward, *(_float16(x).astype(numpy.float32) for x in (q, k, v)),
                                    arrays, vd, o_dtype, causal=prob.causal, softmax_scale=scale, window=prob.window))


def as_float32(x) -> numpy.ndarray:
    """A NumPy float8 e4m3 array (``ml_dtypes.float8_e4m3fn``, or its bits as uint8) as float32, exactly."""
    import ml_dtypes

    if x.dtype == numpy.uint8:
        x = x.view(ml_dtypes.float8_e4m3fn)
    return x.astype(numpy.float32)


def _is_array(x) -> bool:
    """``x`` is a NumPy or CuPy array (a per-entry descale), not a number."""
    return isinstance(x, numpy.ndarray) or type(x).__module__.split(".")[0] == "cupy"


def _check_descale_array(name: str, x, prob, device):
    """A per-entry descale array as the kernel reads it (``check_per_entry``, float32); a NumPy one's values
    checked positive and finite (a CuPy one's are not read)."""
    x = check_per_entry(name, x, prob, device, dtype=numpy.float32)
    if isinstance(x, numpy.ndarray) and not (numpy.isfinite(x).all() and (x > 0).all()):
        raise ValueError(f"{name} must hold positive finite values, got min {x.min()}, max {x.max()}")
    return x


def _descaled(forward, q, k, v, arrays: dict, vd: float, o_dtype, **kw) -> tuple:
    """``(o, m, l)`` of ``forward`` (the NumPy path's or the GPU's) on float32 values with per-entry descale
    ``arrays``: q times its entry's q and k descales before, o times its entry's v descale and the number
    ``vd`` after, in ``o_dtype``."""
    o, m, l = forward(_times_entries(q, _scores_descale(arrays)), k, v, **kw)
    return _times_entries(o * numpy.float32(vd), arrays.get("v_descale")).astype(o_dtype), m, l


def _scores_descale(arrays: dict):
    """The per-entry factor of the scores, q's descales times k's (None: neither is an array)."""
    q, k = arrays.get("q_descale"), arrays.get("k_descale")
    return q if k is None else k if q is None else q * k


def _times_entries(x, factors):
    """``x`` (batch..., rows, D) times one factor per batch entry (``factors`` broadcasting to the batch
    dims; None: ``x`` as it is)."""
    return x if factors is None else x * factors[..., None, None]


def _check_descale(name: str, value) -> float:
    real = (int, float, numpy.integer, numpy.floating)
    if isinstance(value, (bool, numpy.bool_)) or not isinstance(value, real):
        raise TypeError(f"{name} must be a real number or an array of one per batch entry, got {type(value).__name__}")
    value = float(value)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be positive and finite, got {value}")
    return value


def _check_out_dtype(out_dtype) -> numpy.dtype:
    try:
        name = dtype_name(out_dtype)
    except TypeError:
        name = None
    if name not in SIXTEEN_BIT:
        raise TypeError(f"out_dtype must be float16 or bfloat16, got {out_dtype!r}")
    if name == "bfloat16":
        import ml_dtypes

        return numpy.dtype(ml_dtypes.bfloat16)
    return numpy.dtype(numpy.float16)


def _float16(x):
    """CuPy float8 e4m3 bits (uint8) as float16, exactly (every e4m3 value is a float16; NaN stays NaN)."""
    return _to_float16()(x)


@lru_cache(maxsize=None)
def _to_float16():
    """The CuPy elementwise kernel of ``_float16`` (one per process)."""
    import cupy

    return cupy.ElementwiseKernel(
        "uint8 x", "float16 y",
        """
        const int e = (x >> 3) & 15, m = x & 7;
        float f = (x & 0x7f) == 0x7f ? __int_as_float(0x7fc00000)
                : e == 0 ? m * 0.001953125f : ldexpf(1.0f + m * 0.125f, e - 7);
        y = (x & 0x80) ? -f : f;
        """, "cupyflash_e4m3_to_float16")
