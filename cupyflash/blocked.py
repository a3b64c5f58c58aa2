"""The CPU path: FlashAttention V1 (Algorithm 1 and its backward) tile by tile in NumPy.

What `cupyflash.flash_attention_forward` and `flash_attention_backward` run
for NumPy inputs. The loops are the kernels' (K/V tiles outer, Q tiles inner,
online softmax, dQ accumulated across K/V tiles), with their accumulator
precision and their masking: every visibility decision (which tiles to visit,
which need an element mask) comes from one `MaskGeometry`, the mirror of the
kernels' mask struct. When a GPU test fails, this tells whether the algorithm
or the CUDA is wrong.

Each tile step is a stack of products over the batch dims, ``(*batch, B_r, D)
@ (*batch, D, B_c)``, so one NumPy call does every head's tile, and the score
tile is updated in place. Memory is O(N): the inputs in the accumulator dtype,
the outputs, and one ``(*batch, B_r, B_c)`` tile at a time.
"""

import numpy as np

from ._mask import EMPTY, PARTIAL, MaskGeometry
from ._philox import dropout_keep
from ._expr import flat_batch_index, user_mods
from ._numpy_ops import (NEG_INF, accumulator_dtype, broadcast_shapes, check_variants, exp_shift, packed_spans,
                         pair_span, pair_view, reciprocal_or_zero, resolve_scale, transpose, unbroadcast,
                         visible_matmul)

__all__ = ["forward", "backward", "varlen_forward", "varlen_backward", "FORWARD_TILE", "BACKWARD_TILE"]

# (B_r, B_c) of each loop, the one place they are chosen. Each tile step costs a few NumPy
# calls, and each product is one BLAS call per head that OpenBLAS splits over its threads;
# large tiles make those calls few and big, which matters most when another process holds a
# core and every thread hand-off waits for it. A float32 score tile of 8 heads is then 4 MiB.
# Measured at (1, 8, 2048, 64) on 2 cores (benchmarks/numpy_path.py): 512 x 256 was the
# fastest non-causal and within 10% of 256 x 256 causal, forward and backward.
FORWARD_TILE = (512, 256)
BACKWARD_TILE = (512, 256)


def _num_tiles(n, block):
    """ceil(n / block): T_r or T_c."""
    return -(-n // block)


def _as_operand(x, dtype):
    """Round an accumulator tile to the input dtype, as it is stored before a tensor-core product.

    ``x`` itself for float32 and float64 inputs; for float16/bfloat16 it
    rounds to nearest even and returns to the accumulator dtype.
    """
    return x if x.dtype == dtype else x.astype(dtype).astype(x.dtype)


def _scaled_queries(q, scale, batch, acc):
    """``scale q`` in the accumulator dtype, broadcast to the full batch: (*batch, Nq, D)."""
    Q = np.empty((*batch, *q.shape[-2:]), acc)
    np.multiply(q.astype(acc, copy=False), scale, out=Q)
    return Q


def _operands(q, k, v, causal, softmax_scale, window=None):
    """What both loops start from: ``(batch, acc, scale, geometry, Q, K, V)``, with ``Q = scale q``
    broadcast to the batch (*batch, Nq, D) and K, V (*batch_k, Nk, D) in the accumulator dtype."""
    batch, n_q, n_k = broadcast_shapes(q, k, v)
    acc = accumulator_dtype(q.dtype)
    scale = acc.type(resolve_scale(softmax_scale, q.shape[-1]))
    Q = _scaled_queries(q, scale, batch, acc)
    left, right = (None, None) if window is None else window
    geometry = MaskGeometry(n_q, n_k, causal, left, right)
    return batch, acc, scale, geometry, Q, k.astype(acc, copy=False), v.astype(acc, copy=False)


def _tiles(geometry, B_r, B_c):
    """The (rows, cols, partial) tiles of the loops, K/V tiles outer: for each K/V tile the Q tiles
    that see a key of it (`MaskGeometry.q_start` to `q_stop`), EMPTY ones left out; ``partial``:
    the tile needs an element mask."""
    for j in range(_num_tiles(geometry.n_k, B_c)):
        cols = range(j * B_c, min((j + 1) * B_c, geometry.n_k))
        for i in range(geometry.q_start(cols.start) // B_r, _num_tiles(geometry.q_stop(cols.stop), B_r)):
            rows = range(i * B_r, min((i + 1) * B_r, geometry.n_q))
            kind = geometry.tile(rows.start, rows.stop, cols.start, cols.stop)
            if kind != EMPTY:
                yield rows, cols, kind == PARTIAL


class _Variants:
    """The score modifiers of one call (the reference order, `cupyflash.reference.attention_forward`):
    ``softcap``, then ``score_mod``, then ``+ alibi + bias``, then visibility (the geometry's causal
    mask and window, ``mask`` and ``mask_mod``), tile by tile; their backward chain; and the sink.
    Arrays are broadcast views of the full ``(*batch, Nq, Nk)`` (``(*batch,)`` for the per-head ones),
    never copied to full size. ``user``: the call's ``_expr.UserMods`` or None."""

    def __init__(self, batch, n_q, n_k, acc, softcap=None, alibi_slopes=None, bias=None, mask=None, sink=None,
                 dropout_p=0.0, seed=None, dropout_origin=(0, 0), user=None):
        self.batch, self.n_q, self.n_k, self.acc, self.user = batch, n_q, n_k, acc, user
        self.b = flat_batch_index(batch)                    # (*batch, 1, 1)
        self.dropout_p, self.seed, self.origin = dropout_p, seed, dropout_origin
        self.softcap = None if softcap is None else acc.type(softcap)
        self.slopes = None if alibi_slopes is None else np.asarray(alibi_slopes, acc)[..., None, None]
        self.bias = None if bias is None else np.broadcast_to(np.asarray(bias), (*batch, n_q, n_k))
        self.mask = None if mask is None else np.broadcast_to(np.asarray(mask, dtype=bool), (*batch, n_q, n_k))
        self.sink = None if sink is None else np.broadcast_to(np.asarray(sink, acc), batch)[..., None]   # (*batch, 1)

    def scores(self, Q_i, K_j, geometry, rows, cols, partial):
        """``(S_ij, chain, visible)``: the final scores of the tile, (*batch, B_r, B_c), -inf where
        the pair is hidden; for the backward, ``(capped, before_mod)``: ``softcap tanh(S / softcap)``
        (None without a softcap) and the scores ``score_mod`` took (None without one); the tile's
        visibility, None when every pair is visible."""
        S_ij = Q_i @ transpose(K_j)                         # (scale Q_i) K_j^T
        capped = before_mod = None
        if self.softcap is not None:
            S_ij /= self.softcap
            np.tanh(S_ij, out=S_ij)
            S_ij *= self.softcap
            capped = S_ij.copy()
        if self.user is not None and self.user.score is not None:
            before_mod = S_ij.copy()
            S_ij = self.user.scores(S_ij, self.b, rows, cols)
        if self.slopes is not None:
            distance = np.abs(np.arange(rows.start, rows.stop)[:, None] + (self.n_k - self.n_q)
                              - np.arange(cols.start, cols.stop)[None, :])
            S_ij -= self.slopes * distance.astype(self.acc)
        if self.bias is not None:
            S_ij += self.bias[..., rows.start:rows.stop, cols.start:cols.stop]
        visible = geometry.visible(rows, cols) if partial else None
        if self.mask is not None:
            tile = self.mask[..., rows.start:rows.stop, cols.start:cols.stop]
            visible = tile if visible is None else visible & tile
        if self.user is not None and self.user.mask is not None:
            tile = self.user.visible(self.b, rows, cols)
            visible = tile if visible is None else visible & tile
        if visible is not None:
            visible = np.broadcast_to(visible, S_ij.shape)
            np.copyto(S_ij, NEG_INF, where=~visible)
        return S_ij, (capped, before_mod), visible

    def dropout_scale(self, rows, cols):
        """Z_ij = keep_ij / (1 - p) of the tile (the reference's keep set, drawn for the tile alone),
        (*batch, B_r, B_c); None without dropout."""
        if not self.dropout_p:
            return None
        (r, c) = self.origin   # the problem's pair (0, 0) in the keep set
        keep = dropout_keep(self.seed, self.dropout_p, self.batch, self.n_q, self.n_k,
                            range(rows.start + r, rows.stop + r), range(cols.start + c, cols.stop + c))
        return keep.astype(self.acc) / self.acc.type(1 - self.dropout_p)

    def raw_grad(self, dS_ij, chain, rows, cols, visible):
        """d loss / d((scale Q_i) K_j^T) from d loss / d S_ij (``chain`` and ``visible`` of `scores`):
        ``score_mod_grad``'s factor (hidden pairs kept 0), then the softcap's derivative, in place."""
        capped, before_mod = chain
        if before_mod is not None:
            dS_ij *= self.user.derivative(before_mod, self.b, rows, cols)
            if visible is not None:
                np.copyto(dS_ij, 0, where=~visible)
        if capped is not None:
            capped /= self.softcap
            np.multiply(capped, capped, out=capped)
            dS_ij *= 1 - capped
        return dS_ij


@np.errstate(invalid="ignore")   # inf - inf and 0 · inf of non-finite inputs are NaN, quietly
def forward(q, k, v, *, causal=False, softmax_scale=None, window=None, softcap=None, alibi_slopes=None, bias=None,
            mask=None, sink=None, dropout_p=0.0, seed=None, score_mod=None, mask_mod=None, mod_args=None,
            block_r=FORWARD_TILE[0], block_c=FORWARD_TILE[1], dropout_origin=(0, 0)):
    """FlashAttention V1 forward (Algorithm 1), tile by tile in NumPy: the CPU path.

    Parameters
    ----------
    q : array_like, shape (..., Nq, D)
        Queries; float16, bfloat16, float32 or float64.
    k : array_like, shape (..., Nk, D)
        Keys; batch dims broadcast as in ``numpy.matmul``.
    v : array_like, shape (..., Nk, D)
        Values.
    causal : bool, optional
        Bottom-right aligned causal mask: query ``i`` sees key ``j`` iff
        ``j <= i + (Nk - Nq)``.
    softmax_scale : float, optional
        Defaults to ``1 / sqrt(D)``.
    window, softcap, alibi_slopes, bias, mask, sink, dropout_p, seed, score_mod, mask_mod, mod_args, dropout_origin
        The variants of `cupyflash.reference.attention_forward`, with its meanings, all optional;
        tiles outside the causal mask and the window are never visited.
    block_r : int, optional
        B_r, query rows per tile; default `FORWARD_TILE`.
    block_c : int, optional
        B_c, key rows per tile; default `FORWARD_TILE`.

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
    O (kept normalised), m and l start as 0, -inf and 0 in "HBM" arrays (with a
    sink: m = sink, l = 1, the sink a first key of value 0). The scores of a
    tile take the variants in the reference's order (`_Variants.scores`).
    The outer loop walks the T_c K/V tiles, the inner loop the Q tiles that
    see a key of K_j (`MaskGeometry.q_start` to `q_stop`); a tile that sees none is
    skipped, and only a partially visible one is masked element by element.
    One step for tile (i, j)::

        S_ij    = (scale Q_i) K_j^T
        m~_ij   = rowmax(S_ij)
        m_i^new = max(m_i, m~_ij)
        P~_ij   = exp(S_ij - m_i^new)
        alpha   = exp(m_i - m_i^new)
        l_i^new = alpha l_i + rowsum(P~_ij)
        O_i     = (alpha l_i / l_i^new) O_i + (1 / l_i^new) P~_ij V_j

    Arithmetic is float32 (float64 for float64 inputs); ``q`` is scaled once,
    up front. For float16/bfloat16 ``P~_ij`` is rounded to the input dtype
    before ``P~_ij V_j``, as the tensor-core product takes it. Rows that see
    no key are never visited and keep O_i = 0, m_i = -inf, l_i = 0.

    See Also
    --------
    cupyflash.reference.attention_forward : the naive float64 truth.
    """
    check_variants(window, softcap, dropout_p, seed)
    q, k, v = (np.asarray(x) for x in (q, k, v))
    batch, acc, scale, geometry, Q, K, V = _operands(q, k, v, causal, softmax_scale, window)   # Q: (*batch, Nq, D)
    n_q = geometry.n_q
    mods = _Variants(batch, n_q, geometry.n_k, acc, softcap, alibi_slopes, bias, mask, sink, dropout_p, seed,
                     dropout_origin, user_mods(score_mod, None, mask_mod, mod_args))
    O = np.zeros((*batch, n_q, v.shape[-1]), acc)          # "HBM", (*batch, Nq, D), normalised output
    m = np.full((*batch, n_q), NEG_INF, acc)               # (*batch, Nq)
    l = np.zeros((*batch, n_q), acc)                       # (*batch, Nq)
    if mods.sink is not None:   # the sink is a key seen first, of value 0: m = sink, l = exp(sink - sink)
        m[...] = mods.sink
        l[...] = np.exp(mods.sink - exp_shift(mods.sink))

    # outer loop: K/V tiles j; inner loop: the Q tiles i that see K_j
    for rows, cols, partial in _tiles(geometry, block_r, block_c):
        (r0, r1), (c0, c1) = (rows.start, rows.stop), (cols.start, cols.stop)
        K_j, V_j = K[..., c0:c1, :], V[..., c0:c1, :]       # (*batch_k, B_c, D)
        O_i, m_i, l_i = O[..., r0:r1, :], m[..., r0:r1], l[..., r0:r1]   # views into "HBM"

        S_ij, _, visible = mods.scores(Q[..., r0:r1, :], K_j, geometry, rows, cols, partial)   # (*batch, B_r, B_c)
        m_new = np.maximum(m_i, S_ij.max(axis=-1))          # m_i^new = max(m_i, rowmax(S_ij)), (*batch, B_r)
        shift = exp_shift(m_new)
        S_ij -= shift[..., None]
        P_tilde = np.exp(S_ij, out=S_ij)                    # P~_ij = exp(S_ij - m_i^new), in place
        alpha = np.exp(m_i - shift)                         # alpha = exp(m_i - m_i^new)
        l_new = alpha * l_i + P_tilde.sum(axis=-1)          # l_i^new = alpha l_i + rowsum(P~_ij)
        inv_l_new = reciprocal_or_zero(l_new)
        Z_ij = mods.dropout_scale(rows, cols)
        if Z_ij is not None:
            P_tilde *= Z_ij                                 # dropout after l: m, l are the scores' own
        PV = visible_matmul(_as_operand(P_tilde, q.dtype), V_j, visible)   # P~_ij V_j, (*batch, B_r, D)
        PV *= inv_l_new[..., None]
        O_i *= (alpha * l_i * inv_l_new)[..., None]
        O_i += PV                                           # O_i = (alpha l_i / l_i^new) O_i + P~_ij V_j / l_i^new
        m_i[...] = m_new
        l_i[...] = l_new

    return O.astype(q.dtype, copy=False), m, l


@np.errstate(invalid="ignore")   # inf - inf and 0 · inf of non-finite inputs are NaN, quietly
def backward(do, q, k, v, o, m, l, *, causal=False, softmax_scale=None, window=None, softcap=None, alibi_slopes=None,
             bias=None, mask=None, sink=None, dropout_p=0.0, seed=None, bias_grad=False, score_mod=None,
             score_mod_grad=None, mask_mod=None, mod_args=None, dropout_origin=(0, 0), block_r=BACKWARD_TILE[0],
             block_c=BACKWARD_TILE[1]):
    """FlashAttention V1 backward, tile by tile in NumPy: the CPU path.

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
        Bottom-right aligned causal mask, as in `forward`.
    softmax_scale : float, optional
        Defaults to ``1 / sqrt(D)``.
    window, softcap, alibi_slopes, bias, mask, sink, dropout_p, seed, score_mod, mask_mod, mod_args, dropout_origin
        As in `forward`, all optional (the same seed drops the same pairs).
    bias_grad : bool, optional
        Also return ``dbias`` (needs ``bias``).
    score_mod_grad : str, optional
        With ``score_mod`` (required then): its derivative by ``s``
        (`cupyflash.reference.attention_backward`).
    block_r : int, optional
        B_r, query rows per tile; default `BACKWARD_TILE`.
    block_c : int, optional
        B_c, key rows per tile; default `BACKWARD_TILE`.

    Returns
    -------
    dq, dk, dv : ndarray, dtype of ``q``
        Gradients with exactly the shapes of ``q``, ``k`` and ``v``; summed
        over the batch dims each was broadcast along.
    dbias : ndarray, float32 (float64 for float64 inputs)
        With ``bias_grad``: of ``bias``'s shape, summed over its broadcast dims.
    dsink : ndarray, float32 (float64 for float64 inputs)
        With ``sink``: of its shape.

    Notes
    -----
    First ``D_i = rowsum(dO_i * O_i)`` for every row. Then the outer loop
    walks the T_c K/V tiles, accumulating dK_j and dV_j; the inner loop walks
    the Q tiles that see a key of K_j (`MaskGeometry.q_start` to `q_stop`, EMPTY
    tiles skipped, PARTIAL ones masked) and adds into dQ_i in HBM (a float32
    array)::

        S_ij  = (scale Q_i) K_j^T
        P_ij  = diag(l_i)^-1 exp(S_ij - m_i)
        dV_j += P_ij^T dO_i
        dP_ij = dO_i V_j^T
        dS_ij = P_ij * (dP_ij - D_i)
        dQ_i += dS_ij K_j                (times scale once, at the end)
        dK_j += dS_ij^T (scale Q_i)

    Arithmetic is float32 (float64 for float64 inputs); for float16/bfloat16
    ``P_ij`` and ``dS_ij`` are rounded to the input dtype before they enter a
    product, as tensor-core operands.

    See Also
    --------
    cupyflash.reference.attention_backward : the naive float64 truth.
    """
    check_variants(window, softcap, dropout_p, seed, bias, bias_grad)
    do, q, k, v, o, m, l = (np.asarray(x) for x in (do, q, k, v, o, m, l))
    batch, acc, scale, geometry, Q, K, V = _operands(q, k, v, causal, softmax_scale, window)   # Q: (*batch, Nq, D)
    mods = _Variants(batch, geometry.n_q, geometry.n_k, acc, softcap, alibi_slopes, bias, mask, sink, dropout_p, seed,
                     dropout_origin, user_mods(score_mod, score_mod_grad, mask_mod, mod_args, backward=True))
    dB = np.zeros(np.shape(bias), acc) if bias_grad else None   # dbias, bias's own shape
    dB_2d = None if dB is None else dB.reshape((1,) * max(0, 2 - dB.ndim) + dB.shape)   # its (Nq, Nk) dims, 1 if none
    dO = do.astype(acc, copy=False)                         # (*batch, Nq, D)
    D = np.sum(dO * o.astype(acc, copy=False), axis=-1)     # D_i = rowsum(dO_i * O_i), (*batch, Nq)
    shift = exp_shift(m.astype(acc, copy=False))            # m_i, 0 for rows that see no key, (*batch, Nq)
    inv_l = reciprocal_or_zero(l.astype(acc, copy=False))   # 1 / l_i, 0 for rows that see no key, (*batch, Nq)
    dQ = np.zeros((*batch, geometry.n_q, q.shape[-1]), acc)   # HBM, (*batch, Nq, D), unscaled until the end
    dK = np.zeros((*batch, geometry.n_k, k.shape[-1]), acc)   # HBM, (*batch, Nk, D)
    dV = np.zeros((*batch, geometry.n_k, v.shape[-1]), acc)   # HBM, (*batch, Nk, D)

    # outer loop: K/V tiles j, dK_j and dV_j accumulated in place; inner loop: the Q tiles i that see K_j
    for rows, cols, partial in _tiles(geometry, block_r, block_c):
        (r0, r1), (c0, c1) = (rows.start, rows.stop), (cols.start, cols.stop)
        K_j, V_j = K[..., c0:c1, :], V[..., c0:c1, :]       # (*batch_k, B_c, D), (*batch_v, B_c, D)
        dK_j, dV_j = dK[..., c0:c1, :], dV[..., c0:c1, :]   # (*batch, B_c, D)
        Q_i, dO_i = Q[..., r0:r1, :], dO[..., r0:r1, :]      # (*batch, B_r, D)

        S_ij, chain, visible = mods.scores(Q_i, K_j, geometry, rows, cols, partial)   # (*batch, B_r, B_c)
        visible_t = None if visible is None else transpose(visible)
        S_ij -= shift[..., r0:r1, None]
        P_ij = np.exp(S_ij, out=S_ij)
        P_ij *= inv_l[..., r0:r1, None]                     # P_ij = diag(l_i)^-1 exp(S_ij - m_i), in place
        Z_ij = mods.dropout_scale(rows, cols)               # dropout: keep / (1 - p), else None
        P_kept = P_ij if Z_ij is None else P_ij * Z_ij
        dV_j += visible_matmul(transpose(_as_operand(P_kept, q.dtype)), dO_i, visible_t)   # dV_j += (Z P_ij)^T dO_i
        dS_ij = dO_i @ transpose(V_j)                       # dP_ij = dO_i V_j^T, (*batch, B_r, B_c)
        if Z_ij is not None:
            dS_ij *= Z_ij
        dS_ij -= D[..., r0:r1, None]
        dS_ij *= P_ij                                       # dS_ij = P_ij * (dP_ij - D_i), in place
        if visible is not None:
            np.copyto(dS_ij, 0, where=~visible)             # a hidden pair has no term, even where dP is not finite
        if dB is not None:                                  # dbias += dS_ij, into bias's broadcast shape
            at = (..., slice(r0, r1) if dB_2d.shape[-2] > 1 else slice(0, 1),
                  slice(c0, c1) if dB_2d.shape[-1] > 1 else slice(0, 1))
            dB_2d[at] += unbroadcast(dS_ij, dB_2d[at].shape)
        dS_ij = _as_operand(mods.raw_grad(dS_ij, chain, rows, cols, visible), q.dtype)
        dQ[..., r0:r1, :] += visible_matmul(dS_ij, K_j, visible)           # dQ_i += dS_ij K_j
        dK_j += visible_matmul(transpose(dS_ij), Q_i, visible_t)          # dK_j += dS_ij^T (scale Q_i)

    dQ *= scale
    grads = [unbroadcast(g, x.shape).astype(q.dtype, copy=False) for g, x in zip((dQ, dK, dV), (q, k, v))]
    if dB is not None:
        grads.append(dB)
    if mods.sink is not None:   # dsink = -sum_i P_sink,i D_i, P_sink = exp(sink - m_i) / l_i
        P_sink = np.exp(mods.sink - shift) * inv_l
        grads.append(unbroadcast(-(P_sink * D).sum(axis=-1), np.shape(sink)))
    return tuple(grads)


def varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, **kw):
    """`forward` of packed variable-length sequences: each sequence alone, into its rows of ``o, m, l``.

    ``q (..., total_q, D)``, ``k, v (..., total_k, D)``; sequence ``s`` holds query rows
    ``cu_seqlens_q[s] ..`` and key rows ``cu_seqlens_k[s] ..`` (`cupyflash.flash_attention_varlen_forward`).
    ``kw`` as in `forward`.
    """
    spans = packed_spans(cu_seqlens_q, cu_seqlens_k, q.shape[-2], k.shape[-2]) or [(slice(0, 0), slice(0, 0))]
    bias, mask = kw.pop("bias", None), kw.pop("mask", None)
    parts = [forward(q[..., rq, :], k[..., rk, :], v[..., rk, :], bias=pair_view(bias, rq, rk),
                     mask=pair_view(mask, rq, rk), dropout_origin=(rq.start, 0), **kw) for rq, rk in spans]
    return (np.concatenate([p[0] for p in parts], axis=-2), np.concatenate([p[1] for p in parts], axis=-1),
            np.concatenate([p[2] for p in parts], axis=-1))


def varlen_backward(do, q, k, v, o, m, l, cu_seqlens_q, cu_seqlens_k, **kw):
    """`backward` of packed variable-length sequences: each sequence alone, into its rows of ``dq, dk,
    dv`` and its block of ``dbias`` (a ``dsink`` summed over the sequences). Arguments as in
    `varlen_forward` and `backward`."""
    spans = packed_spans(cu_seqlens_q, cu_seqlens_k, q.shape[-2], k.shape[-2]) or [(slice(0, 0), slice(0, 0))]
    bias, mask = kw.pop("bias", None), kw.pop("mask", None)
    dbias = np.zeros(np.shape(bias), accumulator_dtype(q.dtype)) if kw.get("bias_grad") else None
    grads = None
    for rq, rk in spans:
        part = list(backward(do[..., rq, :], q[..., rq, :], k[..., rk, :], v[..., rk, :], o[..., rq, :], m[..., rq],
                             l[..., rq], bias=pair_view(bias, rq, rk), mask=pair_view(mask, rq, rk),
                             dropout_origin=(rq.start, 0), **kw))
        if dbias is not None:   # its block of the packed pairs (a broadcast dim sums over the sequences)
            block = part.pop(3)
            dbias.reshape((1,) * max(0, 2 - dbias.ndim) + dbias.shape)[pair_span(dbias.shape, rq, rk)] += block
        if grads is None:
            grads = [np.empty(x.shape, g.dtype) for x, g in zip((q, k, v), part)] + [np.zeros_like(g) for g in part[3:]]
        grads[0][..., rq, :] = part[0]   # every row lies in exactly one sequence
        grads[1][..., rk, :] = part[1]
        grads[2][..., rk, :] = part[2]
        for total, g in zip(grads[3:], part[3:]):
            total += g
    return tuple(grads[:3]) + ((dbias,) if dbias is not None else ()) + tuple(grads[3:])
