"""NumPy references for cupyflash attention.

Two kinds of reference live here, both pure NumPy (importable without CuPy):

``attention_forward`` / ``attention_backward``
    Naive attention in float64 that materialises S and P. This is the truth
    every test compares against.
``blocked_forward`` / ``blocked_backward``
    The CPU path, `cupyflash.blocked.forward` / `cupyflash.blocked.backward`
    under these names: FlashAttention V1 (Algorithm 1 and its backward)
    written tile by tile, with the loop order, accumulator precision and
    masking of the CUDA kernels.

Semantics shared by every function
----------------------------------
``q`` is ``(..., Nq, D)``, ``k`` and ``v`` are ``(..., Nk, D)``; the leading
batch dims broadcast as in ``numpy.matmul`` (GQA: ``q (B, Hkv, G, Nq, D)``
with ``k, v (B, Hkv, 1, Nk, D)``; MQA: ``k, v (B, 1, Nk, D)``). Outputs
``o`` are ``(*batch, Nq, D)`` with ``batch`` the broadcast batch shape, ``m``
and ``l`` are ``(*batch, Nq)``, and the gradients have exactly the shapes of
``q``, ``k``, ``v`` (summed over broadcast dims).

With ``S = softmax_scale * q k^T`` (default scale ``1 / sqrt(D)``):
``m = rowmax(S)`` over visible keys, ``l = sum(exp(S - m))`` (natural exp) and
``o = softmax(S) v``, so ``m + log(l)`` is the row's logsumexp.

``causal=True`` is bottom-right aligned: query ``i`` sees key ``j`` iff
``j <= i + (Nk - Nq)``. A row that sees no key has ``o = 0``, ``m = -inf``,
``l = 0`` and contributes no gradient.

Non-finite inputs (the naive references): a pair (query ``i``, key ``j``)
that is masked has no term at all, so an inf or NaN reaches exactly the
outputs and gradients whose sums hold a visible term with it (0 · inf is not
formed). A NaN score makes its row's ``m``, ``l`` and ``o`` NaN.
"""

import numpy as np

from . import blocked
from ._numpy_ops import (NEG_INF, broadcast_shapes, exp_shift, reciprocal_or_zero, resolve_scale, transpose,
                         unbroadcast, visible_matmul)

__all__ = [
    "attention_forward",
    "attention_backward",
    "blocked_forward",
    "blocked_backward",
]

# The CPU path, which lives in cupyflash/blocked.py, under its documented names here.
blocked_forward = blocked.forward
blocked_backward = blocked.backward


# ---------------------------------------------------------------------------
# Naive float64 reference
# ---------------------------------------------------------------------------

def _causal_visible(rows, cols, n_q, n_k):
    """Boolean ``(len(rows), len(cols))``: query row r sees key col c iff c <= r + (Nk - Nq)."""
    return cols[None, :] <= rows[:, None] + (n_k - n_q)


def _visible(n_q, n_k, causal):
    """(Nq, Nk): which key each query sees; None when every query sees every key."""
    return _causal_visible(np.arange(n_q), np.arange(n_k), n_q, n_k) if causal else None


def _naive_scores(q, k, scale, visible):
    """S = scale q k^T with invisible keys set to -inf, in the dtype of q and k; ``visible`` as `_visible`."""
    S = scale * (q @ transpose(k))  # (*batch, Nq, Nk)
    return S if visible is None else np.where(visible, S, NEG_INF)


@np.errstate(invalid="ignore")   # inf - inf and 0 · inf of non-finite inputs are NaN, quietly
def attention_forward(q, k, v, *, causal=False, softmax_scale=None):
    """Naive attention forward in float64: the ground truth.

    Parameters
    ----------
    q : array_like, shape (..., Nq, D)
        Queries; any float dtype (float16, bfloat16, float32, float64).
    k : array_like, shape (..., Nk, D)
        Keys; batch dims broadcast against ``q`` and ``v`` as in ``numpy.matmul``.
    v : array_like, shape (..., Nk, D)
        Values.
    causal : bool, optional
        Bottom-right aligned causal mask: query ``i`` sees key ``j`` iff
        ``j <= i + (Nk - Nq)``.
    softmax_scale : float, optional
        Multiplies ``q k^T``; defaults to ``1 / sqrt(D)``.

    Returns
    -------
    o : ndarray, shape (*batch, Nq, D), float64
        ``softmax(S) v``; 0 for a row that sees no key.
    m : ndarray, shape (*batch, Nq), float64
        Row max of ``S`` over visible keys; ``-inf`` for a row that sees no key.
    l : ndarray, shape (*batch, Nq), float64
        ``sum(exp(S - m))`` over visible keys (natural exp); 0 for a row that
        sees no key. ``m + log(l)`` is the row's logsumexp.

    Notes
    -----
    Materialises ``S`` and ``P`` (``(*batch, Nq, Nk)``), so it is meant for
    test-sized inputs.

    See Also
    --------
    cupyflash.blocked.forward : the same result computed tile by tile, as the kernel does.
    """
    q, k, v = (np.asarray(x).astype(np.float64) for x in (q, k, v))
    batch, n_q, _ = broadcast_shapes(q, k, v)
    q = np.broadcast_to(q, (*batch, n_q, q.shape[-1]))
    scale = resolve_scale(softmax_scale, q.shape[-1])

    vis = _visible(n_q, k.shape[-2], causal)        # (Nq, Nk) or None
    S = _naive_scores(q, k, scale, vis)             # (*batch, Nq, Nk)
    m = S.max(axis=-1, initial=NEG_INF)             # (*batch, Nq)
    P_unnormalised = np.exp(S - exp_shift(m)[..., None])
    l = P_unnormalised.sum(axis=-1)                 # (*batch, Nq)
    P = P_unnormalised * reciprocal_or_zero(l)[..., None]
    o = visible_matmul(P, v, vis)                  # (*batch, Nq, D)
    return o, m, l


@np.errstate(invalid="ignore")   # inf - inf and 0 · inf of non-finite inputs are NaN, quietly
def attention_backward(do, q, k, v, o, m, l, *, causal=False, softmax_scale=None):
    """Naive attention backward in float64: the ground truth.

    Parameters
    ----------
    do : array_like, shape (*batch, Nq, D)
        Gradient of the loss with respect to ``o``.
    q : array_like, shape (..., Nq, D)
        Queries.
    k : array_like, shape (..., Nk, D)
        Keys.
    v : array_like, shape (..., Nk, D)
        Values.
    o : array_like, shape (*batch, Nq, D)
        Forward output, used for ``D_i = rowsum(dO_i * O_i)``.
    m : array_like, shape (*batch, Nq)
        Forward row max (``-inf`` for a row that sees no key).
    l : array_like, shape (*batch, Nq)
        Forward row sum of ``exp(S - m)`` (0 for a row that sees no key).
    causal : bool, optional
        Bottom-right aligned causal mask, as in `attention_forward`.
    softmax_scale : float, optional
        Defaults to ``1 / sqrt(D)``.

    Returns
    -------
    dq, dk, dv : ndarray, float64
        Gradients with exactly the shapes of ``q``, ``k`` and ``v``; summed
        over the batch dims each was broadcast along.

    Notes
    -----
    ``P = exp(S - m) / l`` is recomputed from ``q``, ``k`` and the given
    ``m``, ``l`` (pass those of `attention_forward` for exact float64
    gradients), then::

        dV = P^T dO,  dP = dO V^T,  D = rowsum(dO * O),
        dS = P * (dP - D),  dQ = scale dS K,  dK = scale dS^T Q.

    See Also
    --------
    cupyflash.blocked.backward : the same gradients computed tile by tile.
    """
    shapes = [np.shape(x) for x in (q, k, v)]
    do, q, k, v, o, m, l = (np.asarray(x).astype(np.float64) for x in (do, q, k, v, o, m, l))
    batch, n_q, _ = broadcast_shapes(q, k, v)
    q = np.broadcast_to(q, (*batch, n_q, q.shape[-1]))
    scale = resolve_scale(softmax_scale, q.shape[-1])

    vis = _visible(n_q, k.shape[-2], causal)                                 # (Nq, Nk) or None
    vis_t = None if vis is None else vis.T
    S = _naive_scores(q, k, scale, vis)                                      # (*batch, Nq, Nk)
    P = np.exp(S - exp_shift(m)[..., None]) * reciprocal_or_zero(l)[..., None]
    dV = visible_matmul(transpose(P), do, vis_t)                           # (*batch, Nk, D)
    dP = do @ transpose(v)                                                  # (*batch, Nq, Nk)
    D = np.sum(do * o, axis=-1)                                              # (*batch, Nq)
    dS = P * (dP - D[..., None])                                             # (*batch, Nq, Nk)
    dQ = scale * visible_matmul(dS, k, vis)                                 # (*batch, Nq, D)
    dK = scale * visible_matmul(transpose(dS), q, vis_t)                   # (*batch, Nk, D)
    return tuple(unbroadcast(g, shape) for g, shape in zip((dQ, dK, dV), shapes))
