"""NumPy references for cupyflash attention.

Three kinds of reference live here, all pure NumPy (importable without CuPy):

``attention_forward`` / ``attention_backward``
    Naive attention in float64 that materialises S and P. This is the truth
    every test compares against.
``blocked_forward`` / ``blocked_backward``
    FlashAttention V1 (Algorithm 1 and its backward) written tile by tile,
    with the loop order, accumulator precision and masking of the CUDA
    kernels. When a GPU test fails, this tells whether the algorithm or the
    CUDA is wrong.
``naive_same_precision_forward`` / ``naive_same_precision_backward``
    Naive attention in the input precision, every product rounded to the
    input dtype. Its error against the float64 truth is the yardstick for how
    much error a kernel may have.

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

import math

import numpy as np

__all__ = [
    "attention_forward",
    "attention_backward",
    "blocked_forward",
    "blocked_backward",
    "naive_same_precision_forward",
    "naive_same_precision_backward",
]

NEG_INF = -np.inf  # score of a key a query may not see; m of a row that has seen no key


# ---------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------

def _broadcast_shapes(q, k, v):
    """Return ``(batch, Nq, Nk)``: the broadcast batch shape and both sequence lengths."""
    batch = np.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    return batch, q.shape[-2], k.shape[-2]


def _accumulator_dtype(dtype):
    """float64 for float64 inputs; float32 for float32, float16 and bfloat16."""
    return np.dtype(np.float64) if np.dtype(dtype) == np.float64 else np.dtype(np.float32)


def _resolve_scale(softmax_scale, head_dim):
    """The softmax scale, ``1 / sqrt(D)`` unless given."""
    return 1.0 / math.sqrt(head_dim) if softmax_scale is None else float(softmax_scale)


def _num_tiles(n, block):
    """ceil(n / block): T_r or T_c."""
    return -(-n // block)


def _causal_visible(rows, cols, n_q, n_k):
    """Boolean ``(len(rows), len(cols))``: query row r sees key col c iff c <= r + (Nk - Nq)."""
    return cols[None, :] <= rows[:, None] + (n_k - n_q)


def _tile_sees_key(r1, c0, n_q, n_k):
    """Whether any row of a Q tile ending before row ``r1`` sees the first key ``c0`` of a K/V tile.

    The last row of the tile sees the most keys, and the first key of the K/V
    tile is its most visible one, so this one comparison decides the tile.
    """
    return c0 <= (r1 - 1) + (n_k - n_q)


def _exp_shift(m):
    """The row max to subtract inside exp(S - m).

    A row that has seen no key has m = -inf, and exp(-inf - (-inf)) would be
    NaN; shifting by 0 instead gives exp(-inf - 0) = 0, the right weight.
    """
    return np.where(m == NEG_INF, 0, m)


def _reciprocal_or_zero(l):
    """1 / l, 0 where l = 0 (a row that saw no key); NaN stays NaN."""
    return np.divide(1, l, out=np.zeros_like(l), where=l != 0)


def _visible_matmul(A, B, visible):
    """``A @ B`` (``(..., I, K) @ (..., K, J)``) over the visible pairs (i, k) only.

    ``visible`` is ``(I, K)``, or None when every pair is. The term of an
    invisible pair is absent, not ``0 · B[k, j]``, which is NaN where
    ``B[k, j]`` is inf or NaN; so B's non-finite values reach exactly the
    outputs whose sums see them.
    """
    if visible is None:
        return A @ B
    batch = np.broadcast_shapes(A.shape[:-2], B.shape[:-2])
    A = np.broadcast_to(np.where(visible, A, 0), (*batch, *A.shape[-2:]))
    B = np.broadcast_to(B, (*batch, *B.shape[-2:]))
    finite = np.isfinite(B)
    out = A @ np.where(finite, B, 0)
    for *b, k, j in np.argwhere(~finite):   # the visible terms of B's non-finite values, one by one
        at = tuple(b)
        out[(*at, slice(None), j)] += np.where(visible[:, k], A[(*at, slice(None), k)] * B[(*at, k, j)], 0)
    return out


def _as_operand(x, dtype):
    """Round an accumulator tile to the input dtype, as it is stored before a tensor-core product.

    A no-op for float32 and float64 inputs; for float16/bfloat16 it rounds to
    nearest even and returns to the accumulator dtype.
    """
    return x.astype(dtype).astype(x.dtype)


def _unbroadcast(grad, shape):
    """Sum ``grad`` over the axes that broadcasting added to an input of ``shape``; reshape to it."""
    n_lead = grad.ndim - len(shape)
    stretched = tuple(n_lead + a for a, n in enumerate(shape) if n == 1 and grad.shape[n_lead + a] != 1)
    return grad.sum(axis=tuple(range(n_lead)) + stretched).reshape(shape)


def _transpose(x):
    """Swap the last two axes: K_j -> K_j^T."""
    return np.swapaxes(x, -1, -2)


# ---------------------------------------------------------------------------
# Naive float64 reference
# ---------------------------------------------------------------------------

def _visible(n_q, n_k, causal):
    """(Nq, Nk): which key each query sees; None when every query sees every key."""
    return _causal_visible(np.arange(n_q), np.arange(n_k), n_q, n_k) if causal else None


def _naive_scores(q, k, scale, visible):
    """S = scale q k^T with invisible keys set to -inf, in the dtype of q and k; ``visible`` as `_visible`."""
    S = scale * (q @ _transpose(k))  # (*batch, Nq, Nk)
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
    blocked_forward : the same result computed tile by tile, as the kernel does.
    """
    q, k, v = (np.asarray(x).astype(np.float64) for x in (q, k, v))
    batch, n_q, _ = _broadcast_shapes(q, k, v)
    q = np.broadcast_to(q, (*batch, n_q, q.shape[-1]))
    scale = _resolve_scale(softmax_scale, q.shape[-1])

    vis = _visible(n_q, k.shape[-2], causal)        # (Nq, Nk) or None
    S = _naive_scores(q, k, scale, vis)             # (*batch, Nq, Nk)
    m = S.max(axis=-1, initial=NEG_INF)             # (*batch, Nq)
    P_unnormalised = np.exp(S - _exp_shift(m)[..., None])
    l = P_unnormalised.sum(axis=-1)                 # (*batch, Nq)
    P = P_unnormalised * _reciprocal_or_zero(l)[..., None]
    o = _visible_matmul(P, v, vis)                  # (*batch, Nq, D)
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
    blocked_backward : the same gradients computed tile by tile.
    """
    shapes = [np.shape(x) for x in (q, k, v)]
    do, q, k, v, o, m, l = (np.asarray(x).astype(np.float64) for x in (do, q, k, v, o, m, l))
    batch, n_q, _ = _broadcast_shapes(q, k, v)
    q = np.broadcast_to(q, (*batch, n_q, q.shape[-1]))
    scale = _resolve_scale(softmax_scale, q.shape[-1])

    vis = _visible(n_q, k.shape[-2], causal)                                 # (Nq, Nk) or None
    vis_t = None if vis is None else vis.T
    S = _naive_scores(q, k, scale, vis)                                      # (*batch, Nq, Nk)
    P = np.exp(S - _exp_shift(m)[..., None]) * _reciprocal_or_zero(l)[..., None]
    dV = _visible_matmul(_transpose(P), do, vis_t)                           # (*batch, Nk, D)
    dP = do @ _transpose(v)                                                  # (*batch, Nq, Nk)
    D = np.sum(do * o, axis=-1)                                              # (*batch, Nq)
    dS = P * (dP - D[..., None])                                             # (*batch, Nq, Nk)
    dQ = scale * _visible_matmul(dS, k, vis)                                 # (*batch, Nq, D)
    dK = scale * _visible_matmul(_transpose(dS), q, vis_t)                   # (*batch, Nk, D)
    return tuple(_unbroadcast(g, shape) for g, shape in zip((dQ, dK, dV), shapes))


# ---------------------------------------------------------------------------
# Blocked FlashAttention V1, mirroring the kernels
# ---------------------------------------------------------------------------

@np.errstate(invalid="ignore")   # inf - inf and 0 · inf of non-finite inputs are NaN, quietly
def blocked_forward(q, k, v, *, causal=False, softmax_scale=None, block_r=64, block_c=128):
    """FlashAttention V1 forward (Algorithm 1), tile by tile in NumPy.

    Parameters
    ----------
    q : array_like, shape (..., Nq, D)
        Queries; float16, bfloat16, float32 or float64.
    k : array_like, shape (..., Nk, D)
        Keys; batch dims broadcast as in ``numpy.matmul``.
    v : array_like, shape (..., Nk, D)
        Values.
    causal : bool, optional
        Bottom-right aligned causal mask, as in `attention_forward`.
    softmax_scale : float, optional
        Defaults to ``1 / sqrt(D)``.
    block_r : int, optional
        B_r, query rows per tile.
    block_c : int, optional
        B_c, key rows per tile.

    Returns
    -------
    o : ndarray, shape (*batch, Nq, D), dtype of ``q``
        Attention output; 0 for a row that sees no key.
    m : ndarray, shape (*batch, Nq), float32 (float64 for float64 inputs)
        Row max of ``S`` over visible keys; ``-inf`` for a row that sees no key.
    l : ndarray, shape (*batch, Nq), float32 (float64 for float64 inputs)
        ``sum(exp(S - m))`` over visible keys; 0 for a row that sees no key.

    Notes
    -----
    The outer loop walks the T_c K/V tiles, the inner loop the T_r Q tiles;
    O_i (kept normalised), m_i and l_i live in "HBM" arrays between outer
    steps. One step for tile (i, j)::

        S_ij    = scale Q_i K_j^T
        m~_ij   = rowmax(S_ij)
        m_i^new = max(m_i, m~_ij)
        P~_ij   = exp(S_ij - m_i^new)
        alpha   = exp(m_i - m_i^new)
        l_i^new = alpha l_i + rowsum(P~_ij)
        O_i     = (alpha l_i / l_i^new) O_i + (1 / l_i^new) P~_ij V_j

    Arithmetic is float32 (float64 for float64 inputs); for float16/bfloat16
    ``P~_ij`` is rounded to the input dtype before ``P~_ij V_j``, as the
    tensor-core product takes it. With ``causal``, a Q tile visits only the
    K/V tiles holding a key it can see, except that every Q tile is visited
    at j = 0, which starts it from O_i = 0, m_i = -inf, l_i = 0; rows that
    see no key therefore end with exactly those values.

    The batch dims, which the kernel spreads over its grid, are carried
    along vectorised.

    See Also
    --------
    attention_forward : the naive float64 truth.
    """
    q, k, v = (np.asarray(x) for x in (q, k, v))
    batch, n_q, n_k = _broadcast_shapes(q, k, v)
    d_v = v.shape[-1]
    acc = _accumulator_dtype(q.dtype)
    scale = acc.type(_resolve_scale(softmax_scale, q.shape[-1]))
    B_r, B_c = block_r, block_c
    T_r = _num_tiles(n_q, B_r)
    T_c = max(_num_tiles(n_k, B_c), 1)  # at least the j = 0 step, which writes every Q tile

    # "HBM": O, m, l persist between outer steps. They start as NaN so that a
    # Q tile the schedule forgot to visit at j = 0 shows up instead of reading as zero.
    O = np.full((*batch, n_q, d_v), np.nan, acc)   # (*batch, Nq, D), normalised output
    m = np.full((*batch, n_q), np.nan, acc)        # (*batch, Nq)
    l = np.full((*batch, n_q), np.nan, acc)        # (*batch, Nq)

    for j in range(T_c):                                    # outer loop: K/V tiles
        c0, c1 = j * B_c, min((j + 1) * B_c, n_k)
        K_j = k[..., c0:c1, :].astype(acc)                  # (*batch_k, B_c, D)
        V_j = v[..., c0:c1, :].astype(acc)                  # (*batch_v, B_c, D)

        for i in range(T_r):                                # inner loop: Q tiles
            r0, r1 = i * B_r, min((i + 1) * B_r, n_q)
            if causal and j > 0 and not _tile_sees_key(r1, c0, n_q, n_k):
                continue                                    # K_j lies wholly above the diagonal for Q_i
            Q_i = q[..., r0:r1, :].astype(acc)              # (*batch_q, B_r, D)
            if j == 0:
                O_i = np.zeros((*batch, r1 - r0, d_v), acc) # (*batch, B_r, D)
                m_i = np.full((*batch, r1 - r0), NEG_INF, acc)
                l_i = np.zeros((*batch, r1 - r0), acc)
            else:
                O_i, m_i, l_i = O[..., r0:r1, :], m[..., r0:r1], l[..., r0:r1]

            S_ij = scale * (Q_i @ _transpose(K_j))          # S_ij = scale Q_i K_j^T, (*batch, B_r, B_c)
            visible = _causal_visible(np.arange(r0, r1), np.arange(c0, c1), n_q, n_k) if causal else None
            if visible is not None:
                S_ij = np.where(visible, S_ij, NEG_INF)
            m_tilde = S_ij.max(axis=-1, initial=NEG_INF)    # m~_ij = rowmax(S_ij), (*batch, B_r)
            m_new = np.maximum(m_i, m_tilde)                # m_i^new = max(m_i, m~_ij)
            shift = _exp_shift(m_new)
            P_tilde = np.exp(S_ij - shift[..., None])       # P~_ij = exp(S_ij - m_i^new)
            alpha = np.exp(m_i - shift)                     # alpha = exp(m_i - m_i^new)
            l_new = alpha * l_i + P_tilde.sum(axis=-1)      # l_i^new = alpha l_i + rowsum(P~_ij)
            inv_l_new = _reciprocal_or_zero(l_new)
            PV = _visible_matmul(_as_operand(P_tilde, q.dtype), V_j, visible)   # P~_ij V_j, (*batch, B_r, D)
            O[..., r0:r1, :] = (alpha * l_i * inv_l_new)[..., None] * O_i + inv_l_new[..., None] * PV
            m[..., r0:r1] = m_new
            l[..., r0:r1] = l_new

    return O.astype(q.dtype), m, l


@np.errstate(invalid="ignore")   # inf - inf and 0 · inf of non-finite inputs are NaN, quietly
def blocked_backward(do, q, k, v, o, m, l, *, causal=False, softmax_scale=None, block_r=64, block_c=64):
    """FlashAttention V1 backward, tile by tile in NumPy.

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
    block_r : int, optional
        B_r, query rows per tile.
    block_c : int, optional
        B_c, key rows per tile.

    Returns
    -------
    dq, dk, dv : ndarray, dtype of ``q``
        Gradients with exactly the shapes of ``q``, ``k`` and ``v``; summed
        over the batch dims each was broadcast along.

    Notes
    -----
    First ``D_i = rowsum(dO_i * O_i)`` for every row. Then the outer loop
    walks the T_c K/V tiles, keeping dK_j and dV_j on chip; the inner loop
    walks the T_r Q tiles and adds into dQ_i in HBM (a float32 array)::

        S_ij  = scale Q_i K_j^T
        P_ij  = diag(l_i)^-1 exp(S_ij - m_i)
        dV_j += P_ij^T dO_i
        dP_ij = dO_i V_j^T
        dS_ij = P_ij * (dP_ij - D_i)
        dQ_i += scale dS_ij K_j
        dK_j += scale dS_ij^T Q_i

    Arithmetic is float32 (float64 for float64 inputs); for float16/bfloat16
    ``P_ij`` and ``dS_ij`` are rounded to the input dtype before they enter a
    product, as tensor-core operands. With ``causal``, Q tiles none of whose
    rows see a key of tile j are skipped.

    See Also
    --------
    attention_backward : the naive float64 truth.
    """
    do, q, k, v, o, m, l = (np.asarray(x) for x in (do, q, k, v, o, m, l))
    batch, n_q, n_k = _broadcast_shapes(q, k, v)
    d, d_v = q.shape[-1], v.shape[-1]
    acc = _accumulator_dtype(q.dtype)
    scale = acc.type(_resolve_scale(softmax_scale, d))
    B_r, B_c = block_r, block_c
    T_r, T_c = _num_tiles(n_q, B_r), _num_tiles(n_k, B_c)
    m, l = m.astype(acc), l.astype(acc)

    D = np.sum(do.astype(acc) * o.astype(acc), axis=-1)    # D_i = rowsum(dO_i * O_i), (*batch, Nq)
    dQ = np.zeros((*batch, n_q, d), acc)                    # HBM, (*batch, Nq, D)
    dK = np.zeros((*batch, n_k, d), acc)                    # HBM, (*batch, Nk, D)
    dV = np.zeros((*batch, n_k, d_v), acc)                  # HBM, (*batch, Nk, D)

    for j in range(T_c):                                    # outer loop: K/V tiles
        c0, c1 = j * B_c, min((j + 1) * B_c, n_k)
        K_j = k[..., c0:c1, :].astype(acc)                  # (*batch_k, B_c, D)
        V_j = v[..., c0:c1, :].astype(acc)                  # (*batch_v, B_c, D)
        dK_j = np.zeros((*batch, c1 - c0, d), acc)          # on chip, (*batch, B_c, D)
        dV_j = np.zeros((*batch, c1 - c0, d_v), acc)        # on chip, (*batch, B_c, D)

        for i in range(T_r):                                # inner loop: Q tiles
            r0, r1 = i * B_r, min((i + 1) * B_r, n_q)
            if causal and not _tile_sees_key(r1, c0, n_q, n_k):
                continue                                    # no row of Q_i sees a key of K_j
            Q_i = q[..., r0:r1, :].astype(acc)              # (*batch_q, B_r, D)
            dO_i = do[..., r0:r1, :].astype(acc)            # (*batch, B_r, D)
            m_i, l_i, D_i = m[..., r0:r1], l[..., r0:r1], D[..., r0:r1]   # (*batch, B_r)

            S_ij = scale * (Q_i @ _transpose(K_j))          # S_ij = scale Q_i K_j^T, (*batch, B_r, B_c)
            visible = _causal_visible(np.arange(r0, r1), np.arange(c0, c1), n_q, n_k) if causal else None
            if visible is not None:
                S_ij = np.where(visible, S_ij, NEG_INF)
            visible_t = None if visible is None else visible.T
            P_ij = (np.exp(S_ij - _exp_shift(m_i)[..., None])
                    * _reciprocal_or_zero(l_i)[..., None])  # P_ij = diag(l_i)^-1 exp(S_ij - m_i)
            dV_j += _visible_matmul(_transpose(_as_operand(P_ij, q.dtype)), dO_i, visible_t)   # dV_j += P_ij^T dO_i
            dP_ij = dO_i @ _transpose(V_j)                  # dP_ij = dO_i V_j^T, (*batch, B_r, B_c)
            dS_ij = _as_operand(P_ij * (dP_ij - D_i[..., None]), q.dtype)  # dS_ij = P_ij * (dP_ij - D_i)
            dQ[..., r0:r1, :] += scale * _visible_matmul(dS_ij, K_j, visible)          # dQ_i += scale dS_ij K_j
            dK_j += scale * _visible_matmul(_transpose(dS_ij), Q_i, visible_t)         # dK_j += scale dS_ij^T Q_i

        dK[..., c0:c1, :] = dK_j
        dV[..., c0:c1, :] = dV_j

    return tuple(_unbroadcast(g, x.shape).astype(q.dtype) for g, x in zip((dQ, dK, dV), (q, k, v)))


# ---------------------------------------------------------------------------
# Naive attention in the input precision (the error yardstick for kernels)
# ---------------------------------------------------------------------------

def _rounded(x, dtype):
    """An accumulator result rounded to the input dtype (the product's output tensor)."""
    return x.astype(dtype)


def _same_precision_forward(q, k, v, causal, softmax_scale):
    """Forward of `naive_same_precision_forward`, also returning the rounded P."""
    q, k, v = (np.asarray(x) for x in (q, k, v))
    dtype = q.dtype
    acc = _accumulator_dtype(dtype)
    batch, n_q, _ = _broadcast_shapes(q, k, v)
    q = np.broadcast_to(q, (*batch, n_q, q.shape[-1]))
    scale = acc.type(_resolve_scale(softmax_scale, q.shape[-1]))

    vis = _visible(n_q, k.shape[-2], causal)
    S = _rounded(_naive_scores(q.astype(acc), k.astype(acc), scale, vis), dtype)     # (*batch, Nq, Nk)
    S_acc = S.astype(acc)
    m = S_acc.max(axis=-1, initial=NEG_INF)                                          # (*batch, Nq)
    P_unnormalised = np.exp(S_acc - _exp_shift(m)[..., None])
    l = P_unnormalised.sum(axis=-1)                                                  # (*batch, Nq)
    P = _rounded(P_unnormalised * _reciprocal_or_zero(l)[..., None], dtype)          # (*batch, Nq, Nk)
    o = _rounded(P.astype(acc) @ v.astype(acc), dtype)                               # (*batch, Nq, D)
    return o, m, l, P


def naive_same_precision_forward(q, k, v, *, causal=False, softmax_scale=None):
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
        Bottom-right aligned causal mask, as in `attention_forward`.
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
    attention_forward : the float64 truth this is compared against.
    """
    o, m, l, _ = _same_precision_forward(q, k, v, causal, softmax_scale)
    return o, m, l


def naive_same_precision_backward(do, q, k, v, *, causal=False, softmax_scale=None):
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
        Bottom-right aligned causal mask, as in `attention_forward`.
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
    attention_backward : the float64 truth this is compared against.
    """
    shapes = [np.shape(x) for x in (q, k, v)]
    o, _, _, P = _same_precision_forward(q, k, v, causal, softmax_scale)
    do, q, k, v = (np.asarray(x) for x in (do, q, k, v))
    dtype = q.dtype
    acc = _accumulator_dtype(dtype)
    scale = acc.type(_resolve_scale(softmax_scale, q.shape[-1]))
    do_acc, q_acc, k_acc, v_acc, P_acc = (x.astype(acc) for x in (do, q, k, v, P))

    dV = _rounded(_transpose(P_acc) @ do_acc, dtype)                        # (*batch, Nk, D)
    dP = _rounded(do_acc @ _transpose(v_acc), dtype)                        # (*batch, Nq, Nk)
    D = np.sum(do_acc * o.astype(acc), axis=-1)                             # (*batch, Nq)
    dS = _rounded(P_acc * (dP.astype(acc) - D[..., None]), dtype)           # (*batch, Nq, Nk)
    dS_acc = dS.astype(acc)
    dQ = _rounded(scale * (dS_acc @ k_acc), dtype)                          # (*batch, Nq, D)
    dK = _rounded(scale * (_transpose(dS_acc) @ q_acc), dtype)              # (*batch, Nk, D)
    return tuple(_unbroadcast(g.astype(acc), shape).astype(dtype) for g, shape in zip((dQ, dK, dV), shapes))
