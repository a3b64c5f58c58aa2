"""Mask geometry: which (query, key) pairs are visible, and which tiles that makes full, partial or empty.

The NumPy mirror of the kernels' mask-geometry struct: the same names and the
same meanings, so that the CPU path and the CUDA code ask one question one
way. Causal masks are bottom-right aligned: with ``offset = n_k - n_q``,
query ``i`` sees key ``j`` iff ``j < n_k and (not causal or j <= i + offset)``;
a sliding window bounds ``j`` to ``[i + offset - left, i + offset + right]``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

# What a tile of query rows [q0, q1) x keys [k0, k1) holds
FULL = 0      # every pair visible: no element mask needed
PARTIAL = 1   # some pairs visible: mask element by element
EMPTY = 2     # no pair visible: skip the tile

UNBOUNDED = 2**31 - 1   # a side of the kernels' Band that bounds nothing (mask.cuh)


@dataclass(frozen=True)
class MaskGeometry:
    """The visibility rule of one attention problem.

    Query row ``i`` sees the keys ``[lo(i), hi(i))``: with ``off = n_k - n_q``, ``lo(i) = i + off -
    left`` (0 without a left bound) and ``hi(i) = i + off + right + 1`` (``n_k`` without a right
    bound), both clipped to ``[0, n_k]``; the causal mask is the right bound 0 (with a window's
    right side, the smaller of the two). Both ends grow by one per row, so the rows that see
    anything are ``[first_row, n_q)`` and every question below has a closed form.

    Parameters
    ----------
    n_q : int
        Nq, query rows.
    n_k : int
        Nk, keys.
    causal : bool
        Bottom-right aligned causal mask.
    left, right : int or None, optional
        A sliding window's sides (``window=(left, right)``, ints >= 0): query ``i`` sees key ``j``
        only if ``i + off - left <= j <= i + off + right``. None: unbounded.
    """

    n_q: int
    n_k: int
    causal: bool
    left: Optional[int] = None
    right: Optional[int] = None

    @property
    def offset(self) -> int:
        """Nk - Nq: query i sees keys up to i + offset under the causal mask."""
        return self.n_k - self.n_q

    @property
    def right_bound(self) -> Optional[int]:
        """How far past its diagonal a row sees: the causal mask's 0, the window's right side, the
        smaller of both; None when unbounded."""
        bounds = [b for b in ((0 if self.causal else None), self.right) if b is not None]
        return min(bounds) if bounds else None

    def kernel_fields(self) -> tuple:
        """The kernels' ``Mask`` (mask.cuh): ``(Nq, Nk, lo, hi)``, the band ``lo <= j - i <= hi`` of the
        keys ``j`` query ``i`` sees (``lo = off - left``, ``hi = off + right_bound``), with a side that
        bounds no row at ``lo = -Nq`` or ``hi = Nk``: every field fits an int32, and a problem with no
        masked pair has none there either."""
        lo, hi = -self.n_q, self.n_k
        if self.left is not None and self.left < self.n_k - 1:
            lo = self.offset - self.left
        r = self.right_bound
        if r is not None and r < self.n_q - 1:
            hi = self.offset + r
        return self.n_q, self.n_k, lo, hi

    def band_fields(self) -> tuple:
        """The kernels' ``Band`` (mask.cuh): ``(left, right)``, the sides that hold for sequences of any
        length (packed variable-length sequences), ``UNBOUNDED`` where a side bounds nothing;
        ``Band::of(Nq, Nk)`` is ``kernel_fields`` of a sequence of those lengths."""
        r = self.right_bound
        return (UNBOUNDED if self.left is None else min(self.left, UNBOUNDED),
                UNBOUNDED if r is None else min(r, UNBOUNDED))

    @property
    def first_row(self) -> int:
        """The first query row that sees any key (every row from it on does); n_q if none does."""
        if self.n_k == 0:
            return self.n_q
        r = self.right_bound
        return 0 if r is None else min(self.n_q, max(0, -self.offset - r))

    def lo(self, i):
        """The first key row(s) ``i`` see (array or int)."""
        if self.left is None:
            return np.zeros_like(i) if isinstance(i, np.ndarray) else 0
        return np.clip(i + self.offset - self.left, 0, self.n_k)

    def hi(self, i):
        """One past the last key row(s) ``i`` see (array or int); <= lo where they see none."""
        r = self.right_bound
        if r is None:
            return np.full_like(i, self.n_k) if isinstance(i, np.ndarray) else self.n_k
        return np.clip(i + self.offset + r + 1, 0, self.n_k)

    def visible(self, rows, cols) -> np.ndarray:
        """Boolean ``(len(rows), len(cols))``: whether query ``rows[r]`` sees key ``cols[c]``."""
        rows, cols = np.asarray(rows)[:, None], np.asarray(cols)[None, :]
        return (cols >= self.lo(rows)) & (cols < self.hi(rows)) & (cols < self.n_k)

    def kv_stop(self, q0: int, q1: int) -> int:
        """One past the last key any query row in [q0, q1) sees; 0 if none does."""
        last = min(q1, self.n_q) - 1
        return int(self.hi(last)) if last >= max(q0, self.first_row) else 0

    def kv_start(self, q0: int, q1: int) -> int:
        """The first key any query row in [q0, q1) sees; n_k if none does."""
        first = max(q0, self.first_row)
        return int(self.lo(first)) if first < min(q1, self.n_q) else self.n_k

    def q_start(self, k0: int) -> int:
        """The first query row that sees a key of [k0, n_k) (under the causal mask alone: the
        first that sees key k0); ``n_q`` if none does."""
        if k0 >= self.n_k:
            return self.n_q
        r = self.right_bound
        return min(self.n_q, max(self.first_row, k0 - self.offset - r) if r is not None else self.first_row)

    def q_stop(self, k1: int) -> int:
        """One past the last query row that sees a key of [0, k1); 0 if none does."""
        if k1 <= 0:
            return 0
        stop = self.n_q if self.left is None else min(self.n_q, k1 - self.offset + self.left)
        return stop if stop > self.first_row else 0

    def tile(self, q0: int, q1: int, k0: int, k1: int) -> int:
        """`FULL`, `PARTIAL` or `EMPTY`: what the tile of rows [q0, q1) x keys [k0, k1) holds.

        The rows that see a key of [k0, k1) are [q_start(k0), q_stop(k1)): the tile is empty
        when it holds none of them; full when its last row's first key and its first row's last
        key bracket [k0, k1). A tile with no row or no key is empty.
        """
        q1, k1 = min(q1, self.n_q), min(k1, self.n_k)
        if q0 >= q1 or k0 >= k1 or max(q0, self.q_start(k0)) >= min(q1, self.q_stop(k1)):
            return EMPTY
        full = q0 >= self.first_row and self.lo(q1 - 1) <= k0 and self.hi(q0) >= k1
        return FULL if full else PARTIAL

    def has_masked_pairs(self, q0: int, k0: int, k1: int, q1: Optional[int] = None) -> bool:
        """The tile of rows [q0, q1) (default: to n_q) x keys [k0, k1) has a masked pair that is not
        past a ragged end (mask.cuh: Mask::has_masked_pairs, rows to n_q). Only there can an inf or
        NaN operand reach a masked pair, so only then do the kernels flag and repair."""
        q1, k1 = min(self.n_q if q1 is None else q1, self.n_q), min(k1, self.n_k)
        return q0 < q1 and k0 < k1 and self.tile(q0, q1, k0, k1) != FULL
