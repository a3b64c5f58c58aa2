"""NumPy references for cupyflash attention.

Two kinds of reference live here, both pure NumPy (importable without CuPy):

``attention_forward`` / ``attention_backward``
    Naive attention in float64 that materialises S and P. This is the truth
    every test compares against. They also take the variants (issue #17):
    ``window``, ``softcap``, ``alibi_slopes``, ``bias`` (with ``bias_grad``),
    ``mask`` and ``sink``, applied in the documented order; the kernels and
    the CPU path do not take them yet.
``attention_varlen_forward`` / ``attention_varlen_backward``
    The same over packed variable-length sequences (``cu_seqlens_q``,
    ``cu_seqlens_k``), one sequence at a time.
``merge_attention``
    The ``(o, m, l)`` of a key set from those of its disjoint parts.
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
from ._numpy_ops import (NEG_INF, broadcast_shapes, check_variants, exp_shift, packed_spans, pair_span, pair_view,
                         reciprocal_or_zero, resolve_scale, transpose, unbroadcast, visible_matmul)
from ._expr import flat_batch_index, user_mods
from ._philox import dropout_keep

__all__ = [
    "attention_forward",
    "attention_backward",
    "attention_varlen_forward",
    "attention_varlen_backward",
    "merge_attention",
    "blocked_forward",
    "blocked_backward",
]

# The CPU path, which lives in cupyflash/blocked.py, under its documented names here.
blocked_forward = blocked.forward
blocked_backward = blocked.backward


# ---------------------------------------------------------------------------
# Naive float64 reference
# ---------------------------------------------------------------------------

def _visibility(n_q, n_k, causal, window, mask):
    """Which key each query sees, broadcastable to ``(*batch, Nq, Nk)``; None when every query sees
    every key. With ``off = Nk - Nq``: causal keeps ``j <= i + off``, ``window=(left, right)`` keeps
    ``i + off - left <= j <= i + off + right`` (a None side unbounded), ``mask`` its True pairs."""
    rows, cols = np.arange(n_q)[:, None], np.arange(n_k)[None, :]
    ahead = cols - (rows + (n_k - n_q))   # how far key j lies past query i's diagonal
    vis = None
    bounds = [(None, 0)] if causal else []
    if window is not None:
        bounds.append(tuple(window))
    for left, right in bounds:
        band = np.ones((n_q, n_k), dtype=bool)
        if left is not None:
            band &= ahead >= -left
        if right is not None:
            band &= ahead <= right
        vis = band if vis is None else vis & band
    if mask is not None:
        mask = np.asarray(mask, dtype=bool)
        vis = mask if vis is None else vis & mask
    return vis


class _Scores:
    """The scores of one problem in the reference order: ``s = scale q k^T``, then ``softcap``
    (``s <- c tanh(s / c)``), then ``score_mod``, then ``+ alibi + bias`` (alibi: ``- slope |i + off -
    j|``), then visibility (-inf where hidden; causal, window, ``mask``, ``mask_mod``); and the chain
    from the final scores back to ``scale q k^T``. ``user``: the call's ``_expr.UserMods`` or None."""

    def __init__(self, q, k, scale, *, causal, window, softcap, alibi_slopes, bias, mask, user=None):
        n_q, n_k = q.shape[-2], k.shape[-2]
        self.softcap, self.user = softcap, user
        S = scale * (q @ transpose(k))                                   # (*batch, Nq, Nk)
        self.b, self.rows, self.cols = flat_batch_index(S.shape[:-2]), range(n_q), range(n_k)
        if softcap is not None:
            S = softcap * np.tanh(S / softcap)
        self.capped = S
        if user is not None and user.score is not None:
            S = user.scores(S, self.b, self.rows, self.cols)
        if alibi_slopes is not None:
            distance = np.abs(np.arange(n_q)[:, None] + (n_k - n_q) - np.arange(n_k)[None, :])
            S = S - np.asarray(alibi_slopes, np.float64)[..., None, None] * distance
        if bias is not None:
            S = S + np.asarray(bias, np.float64)
        self.visible = _visibility(n_q, n_k, causal, window, mask)
        if user is not None and user.mask is not None:
            hidden_by_mod = user.visible(self.b, self.rows, self.cols)
            self.visible = hidden_by_mod if self.visible is None else self.visible & hidden_by_mod
        self.S = S if self.visible is None else np.where(self.visible, S, NEG_INF)

    def raw_grad(self, dS):
        """d loss / d(scale q k^T) from d loss / d(final scores) ``dS`` (zero where hidden):
        ``score_mod_grad`` at the capped scores, then the softcap's derivative."""
        if self.user is not None and self.user.score is not None:
            dS = dS * self.user.derivative(self.capped, self.b, self.rows, self.cols)
            if self.visible is not None:   # a hidden pair has no term, whatever the derivative there
                dS = np.where(self.visible, dS, 0)
        return dS if self.softcap is None else dS * (1 - (self.capped / self.softcap) ** 2)


@np.errstate(invalid="ignore")   # inf - inf and 0 · inf of non-finite inputs are NaN, quietly
def attention_forward(q, k, v, *, causal=False, softmax_scale=None, window=None, softcap=None,
                      alibi_slopes=None, bias=None, mask=None, sink=None, dropout_p=0.0, seed=None,
                      score_mod=None, mask_mod=None, mod_args=None, dropout_origin=(0, 0)):
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
    window : (int or None, int or None), optional
        ``(left, right)``: query ``i`` sees key ``j`` only if
        ``i + off - left <= j <= i + off + right`` with ``off = Nk - Nq``; a None side is
        unbounded. With ``causal`` both apply (right is then at most 0).
    softcap : float, optional
        ``c > 0``: scores become ``c tanh(s / c)`` (after the scale, before alibi and bias).
    alibi_slopes : array_like, optional
        Broadcastable to the batch shape (``(H,)`` for ``(B, H, N, D)``): scores lose
        ``slope · |i + off - j|``.
    bias : array_like, optional
        Broadcastable to ``(*batch, Nq, Nk)``: added to the scores. A ``-inf`` bias gives a pair
        zero weight but keeps its term (``0 · v`` is NaN where ``v`` is; ``inf - inf`` is NaN):
        ``mask`` hides pairs exactly.
    mask : array_like of bool, optional
        Broadcastable to ``(*batch, Nq, Nk)``; True = visible. Hidden pairs, like those outside
        the causal mask and the window, have no term at all.
    sink : array_like, optional
        Broadcastable to the batch shape: the logit of one extra key per batch entry whose value
        is zero. It counts in ``m`` and adds ``exp(sink - m)`` to ``l``.
    dropout_p : float, optional
        Dropout on ``P``: with probability ``p`` (0 <= p < 1) a pair's weight becomes 0, the others
        are scaled by ``1 / (1 - p)``; the kept set is ``cupyflash._philox.dropout_keep(seed, p,
        batch, Nq, Nk)``. A dropped pair keeps its term (``0 · v``). ``m`` and ``l`` are those of
        the scores before dropout.
    seed : int, optional
        The dropout seed, in [0, 2^64); needed when ``dropout_p > 0``.
    score_mod : str, optional
        An expression of ``cupyflash._expr``'s language over ``s`` (the score after the softcap), ``b``
        (the flat batch index), ``q_idx``, ``kv_idx`` (positions in q and k) and ``mod_args``' names:
        the new score (before alibi and bias).
    mask_mod : str, optional
        An expression over ``b``, ``q_idx``, ``kv_idx`` and ``mod_args``' names: the pair stays
        visible where it is nonzero (hidden pairs as ``mask``'s).
    mod_args : dict, optional
        Names the expressions read: numbers, or arrays read as 1-D in C order (``name[index]``).
    dropout_origin : (int, int), optional
        The (query row, key) of this problem's pair (0, 0) in the keep set's coordinates: a packed
        sequence's first row and key 0 (`attention_varlen_forward`). Default (0, 0).

    Returns
    -------
    o : ndarray, shape (*batch, Nq, D), float64
        ``softmax(S) v``; 0 for a row that sees no key.
    m : ndarray, shape (*batch, Nq), float64
        Row max of the final scores ``S`` over visible keys (and the sink); ``-inf`` for a row that
        sees no key and has no sink.
    l : ndarray, shape (*batch, Nq), float64
        ``sum(exp(S - m))`` over visible keys (and the sink; natural exp); 0 for a row that
        sees no key and has no sink. ``m + log(l)`` is the row's logsumexp.

    Notes
    -----
    Materialises ``S`` and ``P`` (``(*batch, Nq, Nk)``), so it is meant for
    test-sized inputs.

    See Also
    --------
    cupyflash.blocked.forward : the same result computed tile by tile, as the kernel does.
    """
    check_variants(window, softcap, dropout_p, seed)
    user = user_mods(score_mod, None, mask_mod, mod_args)
    q, k, v = (np.asarray(x).astype(np.float64) for x in (q, k, v))
    batch, n_q, _ = broadcast_shapes(q, k, v)
    q = np.broadcast_to(q, (*batch, n_q, q.shape[-1]))
    scale = resolve_scale(softmax_scale, q.shape[-1])

    scores = _Scores(q, k, scale, causal=causal, window=window, softcap=softcap, alibi_slopes=alibi_slopes,
                     bias=bias, mask=mask, user=user)
    S = scores.S                                    # (*batch, Nq, Nk)
    m = S.max(axis=-1, initial=NEG_INF)             # (*batch, Nq)
    if sink is not None:
        sink = np.broadcast_to(np.asarray(sink, np.float64), m.shape[:-1])[..., None]   # (*batch, 1)
        m = np.maximum(m, sink)
    P_unnormalised = np.exp(S - exp_shift(m)[..., None])
    l = P_unnormalised.sum(axis=-1)                 # (*batch, Nq)
    if sink is not None:
        l = l + np.exp(sink - exp_shift(m))
    P = P_unnormalised * reciprocal_or_zero(l)[..., None]
    if dropout_p:
        P = P * (_keep(seed, dropout_p, batch, n_q, k.shape[-2], dropout_origin) / (1 - dropout_p))
    o = visible_matmul(P, v, scores.visible)       # (*batch, Nq, D)
    return o, m, l


@np.errstate(invalid="ignore")   # inf - inf and 0 · inf of non-finite inputs are NaN, quietly
def attention_backward(do, q, k, v, o, m, l, *, causal=False, softmax_scale=None, window=None, softcap=None,
                       alibi_slopes=None, bias=None, mask=None, sink=None, dropout_p=0.0, seed=None, bias_grad=False,
                       score_mod=None, score_mod_grad=None, mask_mod=None, mod_args=None, dropout_origin=(0, 0)):
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
    causal, softmax_scale, window, softcap, alibi_slopes, bias, mask, sink, dropout_p, seed, score_mod, mask_mod,
    mod_args, dropout_origin
        As in `attention_forward` (the same seed drops the same pairs).
    score_mod_grad : str, optional
        With ``score_mod`` (required then): its derivative by ``s``, an expression over the same names.
    bias_grad : bool, optional
        Also return ``dbias`` (needs ``bias``).

    Returns
    -------
    dq, dk, dv : ndarray, float64
        Gradients with exactly the shapes of ``q``, ``k`` and ``v``; summed
        over the batch dims each was broadcast along.
    dbias : ndarray, float64
        With ``bias_grad``: the gradient of ``bias``, of its shape (summed over its broadcast dims).
    dsink : ndarray, float64
        With ``sink``: the gradient of ``sink``, of its shape.

    Notes
    -----
    ``P = exp(S - m) / l`` is recomputed from ``q``, ``k`` and the given
    ``m``, ``l`` (pass those of `attention_forward` for exact float64
    gradients), then::

        dV = P_d^T dO,  dP = Z (dO V^T),  D = rowsum(dO * O)   (dropout: Z = keep / (1 - p), P_d = Z P),
        dS = P * (dP - D),  dbias = dS,  dsink = -sum_i P_sink,i D_i,
        dS' = dS score_mod_grad(s_capped) (1 - (s_capped / c)^2),  dQ = scale dS' K,  dK = scale dS'^T Q.

    See Also
    --------
    cupyflash.blocked.backward : the same gradients computed tile by tile.
    """
    check_variants(window, softcap, dropout_p, seed, bias, bias_grad)
    user = user_mods(score_mod, score_mod_grad, mask_mod, mod_args, backward=True)
    shapes = [np.shape(x) for x in (q, k, v)]
    do, q, k, v, o, m, l = (np.asarray(x).astype(np.float64) for x in (do, q, k, v, o, m, l))
    batch, n_q, _ = broadcast_shapes(q, k, v)
    q = np.broadcast_to(q, (*batch, n_q, q.shape[-1]))
    scale = resolve_scale(softmax_scale, q.shape[-1])

    scores = _Scores(q, k, scale, causal=causal, window=window, softcap=softcap, alibi_slopes=alibi_slopes,
                     bias=bias, mask=mask, user=user)
    vis = scores.visible                                                     # broadcastable or None
    vis_t = None if vis is None else transpose(vis)
    inv_l = reciprocal_or_zero(l)
    P = np.exp(scores.S - exp_shift(m)[..., None]) * inv_l[..., None]        # (*batch, Nq, Nk)
    Z = _keep(seed, dropout_p, batch, n_q, k.shape[-2], dropout_origin) / (1 - dropout_p) if dropout_p else 1.0
    dV = visible_matmul(transpose(P * Z), do, vis_t)                       # (*batch, Nk, D)
    dP = (do @ transpose(v)) * Z                                            # (*batch, Nq, Nk)
    D = np.sum(do * o, axis=-1)                                              # (*batch, Nq)
    dS = P * (dP - D[..., None])                                             # (*batch, Nq, Nk)
    if vis is not None:
        dS = np.where(vis, dS, 0)   # a hidden pair has no term, even where dP is not finite
    dS_raw = scores.raw_grad(dS)
    dQ = scale * visible_matmul(dS_raw, k, vis)                             # (*batch, Nq, D)
    dK = scale * visible_matmul(transpose(dS_raw), q, vis_t)               # (*batch, Nk, D)
    grads = [unbroadcast(g, shape) for g, shape in zip((dQ, dK, dV), shapes)]
    if bias_grad:
        grads.append(unbroadcast(np.broadcast_to(dS, (*batch, n_q, k.shape[-2])), np.shape(bias)))
    if sink is not None:
        sink_b = np.broadcast_to(np.asarray(sink, np.float64), batch)[..., None]   # (*batch, 1)
        P_sink = np.exp(sink_b - exp_shift(m)) * inv_l                          # (*batch, Nq)
        grads.append(unbroadcast(-(P_sink * D).sum(axis=-1), np.shape(sink)))
    return tuple(grads)


def _keep(seed, p, batch, n_q, n_k, origin):
    """Dropout's keep set of an (n_q, n_k) problem whose pair (0, 0) lies at ``origin`` of the set."""
    return dropout_keep(seed, p, batch, n_q, n_k, range(origin[0], origin[0] + n_q), range(origin[1], origin[1] + n_k))


def attention_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, *, causal=False, softmax_scale=None, window=None,
                             softcap=None, alibi_slopes=None, bias=None, mask=None, sink=None, dropout_p=0.0,
                             seed=None, score_mod=None, mask_mod=None, mod_args=None):
    """Naive forward of packed variable-length sequences, in float64.

    Parameters
    ----------
    q : array_like, shape (..., total_q, D)
        The queries of every sequence, one after another along the rows.
    k, v : array_like, shape (..., total_k, D)
        The keys and values, packed the same way; batch dims broadcast as in `attention_forward`.
    cu_seqlens_q, cu_seqlens_k : array_like of int, shape (n_seq + 1,)
        Sequence ``s`` holds query rows ``cu_seqlens_q[s] .. cu_seqlens_q[s + 1] - 1`` and key rows
        ``cu_seqlens_k[s] .. cu_seqlens_k[s + 1] - 1``: 0 first, nondecreasing, the totals last.
    causal, softmax_scale, window, softcap, alibi_slopes, sink
        As in `attention_forward`, applied per sequence (causal and the window bottom-right aligned
        in each).
    bias, mask : array_like, optional
        Broadcastable to ``(*batch, total_q, total_k)``: sequence ``s`` reads its own block.
    dropout_p, seed : optional
        As in `attention_forward`, over the packed query rows and each sequence's own keys: sequence
        ``s`` keeps its pair ``(i, j)`` where `dropout_keep` keeps pair ``(cu_seqlens_q[s] + i, j)``.
    score_mod, mask_mod, mod_args : optional
        As in `attention_forward`, per sequence: ``q_idx``, ``kv_idx`` are positions in the sequence.

    Returns
    -------
    o : ndarray, shape (*batch, total_q, D), float64
    m, l : ndarray, shape (*batch, total_q), float64
        Each sequence's rows as `attention_forward` gives them for that sequence alone.
    """
    kw = dict(causal=causal, softmax_scale=softmax_scale, window=window, softcap=softcap, alibi_slopes=alibi_slopes,
              sink=sink, score_mod=score_mod, mask_mod=mask_mod, mod_args=mod_args)
    parts = [attention_forward(np.asarray(q)[..., rq, :], np.asarray(k)[..., rk, :], np.asarray(v)[..., rk, :],
                               bias=pair_view(bias, rq, rk), mask=pair_view(mask, rq, rk), dropout_p=dropout_p,
                               seed=seed, dropout_origin=(rq.start, 0), **kw)
             for rq, rk in packed_spans(cu_seqlens_q, cu_seqlens_k, np.shape(q)[-2], np.shape(k)[-2])]
    if not parts:
        batch = np.broadcast_shapes(np.shape(q)[:-2], np.shape(k)[:-2], np.shape(v)[:-2])
        return np.zeros((*batch, 0, np.shape(q)[-1])), np.zeros((*batch, 0)), np.zeros((*batch, 0))
    return (np.concatenate([p[0] for p in parts], axis=-2), np.concatenate([p[1] for p in parts], axis=-1),
            np.concatenate([p[2] for p in parts], axis=-1))


def attention_varlen_backward(do, q, k, v, o, m, l, cu_seqlens_q, cu_seqlens_k, *, causal=False, softmax_scale=None,
                              window=None, softcap=None, alibi_slopes=None, bias=None, mask=None, sink=None,
                              bias_grad=False, dropout_p=0.0, seed=None, score_mod=None, score_mod_grad=None,
                              mask_mod=None, mod_args=None):
    """Naive backward of packed variable-length sequences, in float64.

    Parameters
    ----------
    do, o : array_like, shape (*batch, total_q, D)
    q, k, v, cu_seqlens_q, cu_seqlens_k, causal, softmax_scale, window, softcap, alibi_slopes, bias, mask, sink,
    dropout_p, seed, score_mod, mask_mod, mod_args
        As in `attention_varlen_forward`.
    score_mod_grad : str, optional
        As in `attention_backward`.
    bias_grad : bool, optional
        Also return ``dbias`` (needs ``bias``).
    m, l : array_like, shape (*batch, total_q)
        The forward's statistics.

    Returns
    -------
    dq, dk, dv : ndarray, float64
        Of the shapes of ``q``, ``k``, ``v``.
    dbias : ndarray, float64
        With ``bias_grad``: of ``bias``'s shape, each sequence's block its own (0 between sequences).
    dsink : ndarray, float64
        With ``sink``: its gradient, summed over the sequences.
    """
    kw = dict(causal=causal, softmax_scale=softmax_scale, window=window, softcap=softcap, alibi_slopes=alibi_slopes,
              sink=sink, score_mod=score_mod, score_mod_grad=score_mod_grad, mask_mod=mask_mod, mod_args=mod_args)
    q, k, v, do, o, m, l = (np.asarray(x) for x in (q, k, v, do, o, m, l))
    grads = [np.zeros(x.shape) for x in (q, k, v)]
    grads += [np.zeros(np.shape(bias))] if bias_grad else []
    grads += [np.zeros(np.shape(sink))] if sink is not None else []
    for rq, rk in packed_spans(cu_seqlens_q, cu_seqlens_k, np.shape(q)[-2], np.shape(k)[-2]):
        part = attention_backward(do[..., rq, :], q[..., rq, :], k[..., rk, :], v[..., rk, :], o[..., rq, :],
                                  m[..., rq], l[..., rq], bias=pair_view(bias, rq, rk), mask=pair_view(mask, rq, rk),
                                  bias_grad=bias_grad, dropout_p=dropout_p, seed=seed,
                                  dropout_origin=(rq.start, 0), **kw)
        grads[0][..., rq, :] += part[0]
        grads[1][..., rk, :] += part[1]
        grads[2][..., rk, :] += part[2]
        if bias_grad:
            dbias = grads[3]
            dbias.reshape((1,) * max(0, 2 - dbias.ndim) + dbias.shape)[pair_span(dbias.shape, rq, rk)] += part[3]
        if sink is not None:
            grads[-1] += part[-1]
    return tuple(grads)


@np.errstate(invalid="ignore")   # inf - inf of non-finite statistics is NaN, quietly
def merge_attention(parts):
    """The attention of a key set from the attentions of its parts, in float64 (issue #18's ground truth).

    Parameters
    ----------
    parts : sequence of (o, m, l)
        ``o (*batch, Nq, D)``, ``m, l (*batch, Nq)`` of the same queries over disjoint key sets (as
        `attention_forward` returns them: ``m`` the row max, ``l`` the row exp-sum after it).

    Returns
    -------
    o : ndarray, shape (*batch, Nq, D), float64
    m, l : ndarray, shape (*batch, Nq), float64
        Those of the union of the key sets: ``m = max m_i``, ``l = sum l_i exp(m_i - m)``,
        ``o = sum l_i exp(m_i - m) o_i / l``. A part whose row saw no key (``m_i = -inf``,
        ``l_i = 0``) adds nothing; a row no part saw gets ``o = 0``, ``m = -inf``, ``l = 0``.
    """
    if not parts:
        raise ValueError("merge_attention needs at least one (o, m, l) part")
    os_, ms, ls = zip(*((np.asarray(o, np.float64), np.asarray(m, np.float64), np.asarray(l, np.float64))
                        for o, m, l in parts))
    m = np.max(np.stack(np.broadcast_arrays(*ms)), axis=0)
    weights = [l_i * np.exp(m_i - exp_shift(m)) for m_i, l_i in zip(ms, ls)]   # l_i e^(m_i - m), 0 for empty parts
    l = sum(weights)
    o = sum(w[..., None] * o_i for w, o_i in zip(weights, os_))
    return o * reciprocal_or_zero(l)[..., None], m, l
