"""Naive attention in the input precision: the error yardstick the kernels and the CPU path are held to.

Test code, not library code. ``naive_same_precision_forward`` /
``naive_same_precision_backward`` emulate a naive GPU attention run in the
input dtype, every product rounded to it; their error against the float64
truth (`cupyflash.reference`) is how much error a kernel may have (at most
twice it, FlashAttention's rule).
"""

import numpy as np

from cupyflash._numpy_ops import (NEG_INF, accumulator_dtype, broadcast_shapes, exp_shift, reciprocal_or_zero,
                                  resolve_scale, transpose, unbroadcast)
from cupyflash.reference import _visibility

__all__ = ["naive_same_precision_forward", "naive_same_precision_backward"]


def _naive_scores(q, k, scale, visible):
    """S = scale q k^T in the dtype of q and k, -inf where ``visible`` (None: everywhere) is False."""
    S = scale * (q @ transpose(k))   # (*batch, Nq, Nk)
    return S if visible is None else np.where(visible, S, NEG_INF)


def _rounded(x, dtype):
    """An accumulator result rounded to the input dtype (the product's output tensor)."""
    return x.astype(dtype)


def _modified(S, softcap, alibi_slopes, n_k, bias=None):
    """The score modifiers on S in its own precision (reference order): ``softcap tanh(S / softcap)``,
    then ``- slope |i + off - j|``, then ``+ bias``; also tanh(S / softcap) (None without a softcap)."""
    t = None
    if softcap is not None:
        c = S.dtype.type(softcap)
        t = np.tanh(S / c)
        S = c * t
    if alibi_slopes is not None:
        n_q = S.shape[-2]
        distance = np.abs(np.arange(n_q)[:, None] + (n_k - n_q) - np.arange(n_k)[None, :]).astype(S.dtype)
        S = S - np.asarray(alibi_slopes, S.dtype)[..., None, None] * distance
    if bias is not None:
        S = S + np.asarray(bias).astype(S.dtype)
    return S, t


def _same_precision_forward(q, k, v, causal, softmax_scale, window=None, softcap=None, alibi_slopes=None, sink=None,
                            bias=None, mask=None):
    """Forward of `naive_same_precision_forward`, also returning the rounded P and the softcap's tanh."""
    q, k, v = (np.asarray(x) for x in (q, k, v))
    dtype = q.dtype
    acc = accumulator_dtype(dtype)
    batch, n_q, _ = broadcast_shapes(q, k, v)
    q = np.broadcast_to(q, (*batch, n_q, q.shape[-1]))
    scale = acc.type(resolve_scale(softmax_scale, q.shape[-1]))

    vis = _visibility(n_q, k.shape[-2], causal, window, mask)
    S, t = _modified(_naive_scores(q.astype(acc), k.astype(acc), scale, None), softcap, alibi_slopes, k.shape[-2],
                     bias)
    S = _rounded(S if vis is None else np.where(vis, S, NEG_INF), dtype)            # (*batch, Nq, Nk)
    S_acc = S.astype(acc)
    m = S_acc.max(axis=-1, initial=NEG_INF)                                          # (*batch, Nq)
    if sink is not None:   # one more key of logit sink, value 0
        sink = np.broadcast_to(np.asarray(sink, acc), m.shape[:-1])[..., None]
        m = np.maximum(m, sink)
    P_unnormalised = np.exp(S_acc - exp_shift(m)[..., None])
    l = P_unnormalised.sum(axis=-1)                                                  # (*batch, Nq)
    if sink is not None:
        l = l + np.exp(sink - exp_shift(m))
    P = _rounded(P_unnormalised * reciprocal_or_zero(l)[..., None], dtype)          # (*batch, Nq, Nk)
    o = _rounded(P.astype(acc) @ v.astype(acc), dtype)                               # (*batch, Nq, D)
    return o, m, l, P, t


def naive_same_precision_forward(q, k, v, *, causal=False, softmax_scale=None, window=None, softcap=None,
                                 alibi_slopes=None, sink=None, bias=None, mask=None):
    """Naive attention forward in the input precision.

    Emulates a naive GPU attention run in the input dtype: each product is
    accumulated in float32 (float64 for float64 inputs) and its result
    rounded to the input dtype; the softmax is computed in float32 and
    rounded. For float32 and float64 inputs this is plain arithmetic in that
    dtype.

    Parameters
    ----------
    q : array_like, shape (..., Nq, D)
        Queries; float16, bfloat16, float32 or float64.
    k : array_like, shape (..., Nk, D)
        Keys; batch dims broadcast as in ``numpy.matmul``.
    v : array_like, shape (..., Nk, D)
        Values.
    causal : bool, optional
        Bottom-right aligned causal mask, as in `cupyflash.reference.attention_forward`.
    window : (int or None, int or None), optional
        A sliding window, as in `cupyflash.reference.attention_forward`.
    softcap, alibi_slopes, sink, bias, mask : optional
        The modifiers, as in `cupyflash.reference.attention_forward`, applied in the
        accumulator precision before the scores are rounded.
    softmax_scale : float, optional
        Defaults to ``1 / sqrt(D)``; applied to the ``q k^T`` product before
        it is rounded.

    Returns
    -------
    o : ndarray, shape (*batch, Nq, D), dtype of ``q``
        Attention output; 0 for a row that sees no key.
    m : ndarray, shape (*batch, Nq), float32 (float64 for float64 inputs)
        Row max of the rounded ``S``; ``-inf`` for a row that sees no key.
    l : ndarray, shape (*batch, Nq), float32 (float64 for float64 inputs)
        ``sum(exp(S - m))``; 0 for a row that sees no key.

    Notes
    -----
    ``S = round(scale q k^T)``, ``P = round(softmax(S))``, ``o = round(P v)``.
    Materialises ``S`` and ``P``; meant for test-sized inputs.

    See Also
    --------
    cupyflash.reference.attention_forward : the float64 truth this is compared against.
    """
    o, m, l, _, _ = _same_precision_forward(q, k, v, causal, softmax_scale, window, softcap, alibi_slopes, sink, bias,
                                            mask)
    return o, m, l


def naive_same_precision_backward(do, q, k, v, *, causal=False, softmax_scale=None, window=None, softcap=None,
                                  alibi_slopes=None, sink=None, bias=None, mask=None):
    """Naive attention backward in the input precision.

    Recomputes the forward of `naive_same_precision_forward` and
    differentiates through the same rounded products.

    Parameters
    ----------
    do : array_like, shape (*batch, Nq, D)
        Gradient of the loss with respect to ``o``; dtype of ``q``.
    q : array_like, shape (..., Nq, D)
        Queries; float16, bfloat16, float32 or float64.
    k : array_like, shape (..., Nk, D)
        Keys.
    v : array_like, shape (..., Nk, D)
        Values.
    causal : bool, optional
        Bottom-right aligned causal mask, as in `cupyflash.reference.attention_forward`.
    window : (int or None, int or None), optional
        A sliding window, as in `cupyflash.reference.attention_forward`.
    softcap, alibi_slopes, sink, bias, mask : optional
        The modifiers, as in `cupyflash.reference.attention_forward`, applied in the
        accumulator precision before the scores are rounded.
    softmax_scale : float, optional
        Defaults to ``1 / sqrt(D)``.

    Returns
    -------
    dq, dk, dv : ndarray, dtype of ``q``
        Gradients with exactly the shapes of ``q``, ``k`` and ``v``. Where an
        input was broadcast, the rounded per-copy gradients are summed in
        float32 (float64) and rounded once more.

    Notes
    -----
    With ``round`` meaning "rounded to the input dtype"::

        dV = round(P^T dO),  dP = round(dO V^T),  D = rowsum(dO * O),
        dS = round(P * (dP - D)),  dQ = round(scale dS K),  dK = round(scale dS^T Q)

    where ``P`` and ``O`` are the rounded forward values and ``D`` and
    ``P * (dP - D)`` are computed in float32 (float64).

    See Also
    --------
    cupyflash.reference.attention_backward : the float64 truth this is compared against.
    """
    shapes = [np.shape(x) for x in (q, k, v)]
    o, _, _, P, t = _same_precision_forward(q, k, v, causal, softmax_scale, window, softcap, alibi_slopes, sink, bias,
                                            mask)
    do, q, k, v = (np.asarray(x) for x in (do, q, k, v))
    dtype = q.dtype
    acc = accumulator_dtype(dtype)
    scale = acc.type(resolve_scale(softmax_scale, q.shape[-1]))
    do_acc, q_acc, k_acc, v_acc, P_acc = (x.astype(acc) for x in (do, q, k, v, P))

    dV = _rounded(transpose(P_acc) @ do_acc, dtype)                        # (*batch, Nk, D)
    dP = _rounded(do_acc @ transpose(v_acc), dtype)                        # (*batch, Nq, Nk)
    D = np.sum(do_acc * o.astype(acc), axis=-1)                             # (*batch, Nq)
    dS = P_acc * (dP.astype(acc) - D[..., None])
    if t is not None:   # by scale q k^T through the softcap
        dS = dS * (1 - t * t)
    dS = _rounded(dS, dtype)                                                # (*batch, Nq, Nk)
    dS_acc = dS.astype(acc)
    dQ = _rounded(scale * (dS_acc @ k_acc), dtype)                          # (*batch, Nq, D)
    dK = _rounded(scale * (transpose(dS_acc) @ q_acc), dtype)              # (*batch, Nk, D)
    return tuple(unbroadcast(g.astype(acc), shape).astype(dtype) for g, shape in zip((dQ, dK, dV), shapes))
