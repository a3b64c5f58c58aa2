"""NumPy pieces shared by the references (`cupyflash.reference`) and the CPU path (`cupyflash.blocked`)."""

import math

import numpy as np

from ._philox import check_dropout

NEG_INF = -np.inf  # score of a key a query may not see; m of a row that has seen no key


def broadcast_shapes(q, k, v):
    """Return ``(batch, Nq, Nk)``: the broadcast batch shape and both sequence lengths."""
    batch = np.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    return batch, q.shape[-2], k.shape[-2]


def accumulator_dtype(dtype):
    """float64 for float64 inputs; float32 for float32, float16 and bfloat16."""
    return np.dtype(np.float64) if np.dtype(dtype) == np.float64 else np.dtype(np.float32)


def resolve_scale(softmax_scale, head_dim):
    """The softmax scale, ``1 / sqrt(D)`` unless given."""
    return 1.0 / math.sqrt(head_dim) if softmax_scale is None else float(softmax_scale)


def check_variants(window, softcap, dropout_p, seed, bias=None, bias_grad=False):
    """The variant keywords' values: ``window`` a pair of ints >= 0 or None, ``softcap`` > 0,
    ``dropout_p`` in [0, 1) with a seed where it is not 0 (``_philox.check_dropout``), and a
    ``bias`` wherever ``bias_grad`` asks for its gradient."""
    if window is not None:
        if len(window) != 2 or any(w is not None and (int(w) != w or w < 0) for w in window):
            raise ValueError(f"window must be (left, right) of ints >= 0 or None, got {window!r}")
    if softcap is not None and not (np.isfinite(softcap) and softcap > 0):
        raise ValueError(f"softcap must be a finite float > 0, got {softcap!r}")
    check_dropout(dropout_p, seed)
    if bias_grad and bias is None:
        raise ValueError("bias_grad=True needs a bias")


def exp_shift(m):
    """The row max to subtract inside exp(S - m).

    A row that has seen no key has m = -inf, and exp(-inf - (-inf)) would be
    NaN; shifting by 0 instead gives exp(-inf - 0) = 0, the right weight.
    """
    return np.where(m == NEG_INF, 0, m)


def reciprocal_or_zero(l):
    """1 / l, 0 where l = 0 (a row that saw no key); NaN stays NaN."""
    return np.divide(1, l, out=np.zeros_like(l), where=l != 0)


def visible_matmul(A, B, visible):
    """``A @ B`` (``(..., I, K) @ (..., K, J)``) over the visible pairs (i, k) only.

    ``visible`` is boolean, broadcastable to A's shape (``(I, K)`` for every batch entry alike, or
    per entry), or None when every pair is. The term of an invisible pair is absent, not
    ``0 · B[k, j]``, which is NaN where ``B[k, j]`` is inf or NaN; so B's non-finite values reach
    exactly the outputs whose sums see them.
    """
    if visible is None:
        return A @ B
    A = np.where(visible, A, 0)
    finite = np.isfinite(B)
    if finite.all():   # every term of an invisible pair is 0 · B[k, j] = 0
        return A @ B
    batch = np.broadcast_shapes(A.shape[:-2], B.shape[:-2])
    A = np.broadcast_to(A, (*batch, *A.shape[-2:]))
    B = np.broadcast_to(B, (*batch, *B.shape[-2:]))
    visible = np.broadcast_to(visible, A.shape)
    finite = np.broadcast_to(finite, B.shape)
    out = A @ np.where(finite, B, 0)
    for *b, k, j in np.argwhere(~finite):   # the visible terms of B's non-finite values, one by one
        at = tuple(b)
        rows = (*at, slice(None), k)
        out[(*at, slice(None), j)] += np.where(visible[rows], A[rows] * B[(*at, k, j)], 0)
    return out


def unbroadcast(grad, shape):
    """Sum ``grad`` over the axes that broadcasting added to an input of ``shape``; reshape to it."""
    n_lead = grad.ndim - len(shape)
    stretched = tuple(n_lead + a for a, n in enumerate(shape) if n == 1 and grad.shape[n_lead + a] != 1)
    return grad.sum(axis=tuple(range(n_lead)) + stretched).reshape(shape)


def transpose(x):
    """Swap the last two axes: K_j -> K_j^T."""
    return np.swapaxes(x, -1, -2)


def _sequence_bounds(cu_seqlens, total, name):
    """``cu_seqlens`` as Python ints, checked: 1-D integers starting at 0, nondecreasing, ending at ``total``."""
    cu = np.asarray(cu_seqlens)
    if cu.ndim != 1 or cu.size < 1 or not np.issubdtype(cu.dtype, np.integer):
        raise ValueError(f"{name} must be a 1-D integer array of n_seq + 1 offsets, got shape {cu.shape}, {cu.dtype}")
    if cu[0] != 0 or cu[-1] != total or (np.diff(cu) < 0).any():
        raise ValueError(f"{name} must start at 0, not decrease and end at {total} (the packed length), "
                         f"got {cu.tolist()}")
    return [int(x) for x in cu]


def packed_spans(cu_seqlens_q, cu_seqlens_k, total_q, total_k):
    """(query rows, key rows) slices of each packed variable-length sequence, the offsets checked
    against the packed lengths ``total_q``, ``total_k``."""
    cq = _sequence_bounds(cu_seqlens_q, total_q, "cu_seqlens_q")
    ck = _sequence_bounds(cu_seqlens_k, total_k, "cu_seqlens_k")
    if len(cq) != len(ck):
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must hold the same number of sequences, "
                         f"got {len(cq) - 1} and {len(ck) - 1}")
    return [(slice(cq[s], cq[s + 1]), slice(ck[s], ck[s + 1])) for s in range(len(cq) - 1)]


def pair_span(x, rows, cols):
    """The index of one sequence's block (``rows`` x ``cols`` slices of the packed pairs) in a per-pair
    array of shape ``x_shape`` (..., total_q or 1, total_k or 1): a dim of 1 broadcasts and is kept."""
    shape = (1,) * max(0, 2 - len(x)) + tuple(x)
    return (..., rows if shape[-2] != 1 else slice(None), cols if shape[-1] != 1 else slice(None))


def pair_view(x, rows, cols):
    """A per-pair array's block of one sequence (``pair_span``), or None for None."""
    if x is None:
        return None
    x = np.asarray(x)
    return x.reshape((1,) * max(0, 2 - x.ndim) + x.shape)[pair_span(x.shape, rows, cols)]
