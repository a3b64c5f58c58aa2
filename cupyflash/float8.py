"""Attention on float8 e4m3 inputs: FlashAttention-3's FP8 forward on Hopper.

``flash_attention_forward_fp8`` takes q, k, v in float8 e4m3 (``ml_dtypes.float8_e4m3fn``, the OCP
"fn" variant: no infinities, max 448) with one descale factor per tensor, as FlashAttention-3 does,
and returns o in float16 or bfloat16 with m and l in float32. On sm_90 GPUs at D <= 128 both
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
from ._checks import FLOAT8_DTYPES, check_forward, check_out
from .api import _batch_strides, _empty, _into, _kept_plan, _kernel_ready, flash_attention_forward
from ._tiles import FP8_HEAD_DIM, SIXTEEN_BIT, dtype_name

OUTPUTS = ("o", "m", "l")


def flash_attention_forward_fp8(q, k, v, *, q_descale: float = 1.0, k_descale: float = 1.0, v_descale: float = 1.0,
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
    q_descale, k_descale, v_descale : float, optional
        Positive finite factors that turn each tensor's float8 values into the values it stands for
        (FlashAttention-3's per-tensor descales). Default 1.
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
    # a CuPy call like an earlier one (shapes, strides, dtypes, keywords; out's too) runs that call's plan
    plan, key = _kept_plan({"q": q, "k": k, "v": v}, out, OUTPUTS, ("fp8", causal, softmax_scale, window, q_descale,
                                                                   k_descale, v_descale, out_dtype))
    if plan is not None:
        return plan(q, k, v, out)
    prob = check_forward(q, k, v, causal, softmax_scale, window, supported=FLOAT8_DTYPES)
    qd, kd, vd = (_check_descale(name, x) for name, x in (("q_descale", q_descale), ("k_descale", k_descale),
                                                          ("v_descale", v_descale)))
    o_dtype = _check_out_dtype(out_dtype)
    scale = prob.scale * qd * kd
    if not math.isfinite(scale) or abs(scale) > float(numpy.finfo(numpy.float32).max) / 2:
        raise ValueError(f"softmax_scale · q_descale · k_descale = {scale} is not finite in float32")
    stats = (*prob.batch_shape, prob.Nq)
    shapes, dtypes = ((*stats, prob.D), stats, stats), (o_dtype, numpy.dtype(numpy.float32), numpy.dtype(numpy.float32))
    if prob.xp is numpy:
        if out is not None:
            out = check_out(out, OUTPUTS, shapes, dtypes, numpy, None, {"q": q, "k": k, "v": v})
        o, m, l = blocked.forward(*(as_float32(x) for x in (q, k, v)), causal=prob.causal, softmax_scale=scale,
                                  window=prob.window)
        return _into(out, ((o * numpy.float32(vd)).astype(o_dtype), m, l))
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
        layout = None
        if prob.D <= FP8_HEAD_DIM and numpy.float32(scale) > 0 and _launch._hopper(numpy.float16):
            named = {"q": q, "k": k, "v": v}
            layout = _launch.collapse_batch(prob.batch_shape, _batch_strides(named.values(), prob.batch_shape),
                                            tuple(named))
        if layout is not None:
            plan = _launch.fp8_forward_plan(q, k, v, out_dtype=o_dtype, geometry=prob.geometry, scale=scale,
                                            v_scale=vd, batch_shape=prob.batch_shape, layout=layout)
            _launch.keep_plan(key, plan)
            return plan(q, k, v, out)
        # no float8 kernel here: the exact float16 values through the 16-bit kernels
        o, m, l = flash_attention_forward(*(_float16(x) for x in (q, k, v)), causal=prob.causal,
                                          softmax_scale=scale, window=prob.window)
        return _into(out, ((o.astype(numpy.float32) * numpy.float32(vd)).astype(o_dtype), m, l))


def as_float32(x) -> numpy.ndarray:
    """A NumPy float8 e4m3 array (``ml_dtypes.float8_e4m3fn``, or its bits as uint8) as float32, exactly."""
    import ml_dtypes

    if x.dtype == numpy.uint8:
        x = x.view(ml_dtypes.float8_e4m3fn)
    return x.astype(numpy.float32)


def _check_descale(name: str, value) -> float:
    real = (int, float, numpy.integer, numpy.floating)
    if isinstance(value, (bool, numpy.bool_)) or not isinstance(value, real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
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
