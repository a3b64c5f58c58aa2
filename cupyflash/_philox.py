"""Philox4x32-10 (Salmon, Moraes, Dror and Shaw, 2011, "Parallel random numbers: as easy as 1, 2, 3"),
vectorised over NumPy arrays: the counter-based generator behind dropout's keep set.

A counter-based generator maps (counter, key) to random words with no state, so any tile of any
kernel can draw the word of any (batch entry, query, key) on its own and every schedule draws the
same. This module is the definition; kernels_cu/philox.cuh is the kernels' twin (tests/test_philox_cuh.py
checks them bit for bit).
"""

import numpy as np

_M0, _M1 = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)    # round multipliers
_W0, _W1 = np.uint32(0x9E3779B9), np.uint32(0xBB67AE85)    # key schedule (Weyl) increments
ROUNDS = 10
_LOW = np.uint64(0xFFFFFFFF)
_SHIFT = np.uint64(32)


def _mulhilo(m, x):
    """(high, low) 32-bit words of the 64-bit product of uint32 ``x`` by the multiplier ``m``."""
    product = x.astype(np.uint64) * m
    return (product >> _SHIFT).astype(np.uint32), (product & _LOW).astype(np.uint32)


def philox4x32(counter, key):
    """Philox4x32-10 of ``counter`` (four uint32 arrays) under ``key`` (two uint32 arrays); the arrays
    broadcast together. Returns the four uint32 output words."""
    c0, c1, c2, c3 = (np.asarray(c, dtype=np.uint32) for c in counter)
    k0, k1 = (np.asarray(k, dtype=np.uint32) for k in key)
    with np.errstate(over="ignore"):   # the key schedule wraps mod 2^32
        for r in range(ROUNDS):
            if r:
                k0, k1 = k0 + _W0, k1 + _W1
            hi0, lo0 = _mulhilo(_M0, c0)
            hi1, lo1 = _mulhilo(_M1, c2)
            c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3


def keep_threshold(p: float) -> np.uint64:
    """The 32-bit word below which a pair is dropped: round(p · 2^32), so P(drop) = p to 2^-33."""
    return np.uint64(round(p * 2.0**32))


def check_dropout(p, seed):
    """``dropout_p`` in [0, 1) and, where it is not 0, an int ``seed`` in [0, 2^64)."""
    if not 0 <= p < 1:
        raise ValueError(f"dropout_p must satisfy 0 <= p < 1, got {p!r}")
    if p and (seed is None or int(seed) != seed or not 0 <= seed < 2**64):
        raise ValueError(f"dropout_p > 0 needs an int seed in [0, 2^64), got {seed!r}")


def dropout_keep(seed: int, p: float, batch_shape, n_q: int, n_k: int, rows=None, cols=None) -> np.ndarray:
    """The keep set of dropout with probability ``p`` under ``seed``: bool ``(*batch_shape, n_q, n_k)``,
    or of the query ``rows`` and key ``cols`` ranges only (a tile).

    Pair (query ``i``, key ``j``) of flat batch entry ``b`` (C order over ``batch_shape``) is kept iff
    word ``j % 4`` of Philox4x32-10 at counter ``(j // 4, i, b mod 2^32, b >> 32)`` under key
    ``(seed mod 2^32, seed >> 32)`` is at least ``keep_threshold(p)``. It depends on nothing else:
    not on tiles, schedules, kernels or GPUs.
    """
    check_dropout(p, seed)
    seed = int(seed)
    batch = int(np.prod(batch_shape, dtype=np.int64))
    rows, cols = range(n_q) if rows is None else rows, range(n_k) if cols is None else cols
    b = np.arange(batch, dtype=np.uint64)[:, None, None]
    i = np.arange(rows.start, rows.stop, dtype=np.uint32)[None, :, None]
    j = np.arange(cols.start, cols.stop, dtype=np.uint32)[None, None, :]
    words = philox4x32((j // np.uint32(4), i, (b & _LOW).astype(np.uint32), (b >> _SHIFT).astype(np.uint32)),
                       (np.uint32(seed & 0xFFFFFFFF), np.uint32(seed >> 32)))
    word = np.choose((j % np.uint32(4)).astype(np.intp), np.broadcast_arrays(*words))
    return (word.astype(np.uint64) >= keep_threshold(p)).reshape((*tuple(batch_shape), len(rows), len(cols)))
