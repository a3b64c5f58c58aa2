"""Mask geometry: which (query, key) pairs are visible, and which tiles that makes full, partial or empty.

The NumPy mirror of the kernels' mask-geometry struct: the same names and the
same meanings, so that the CPU path and the CUDA code ask one question one
way. Causal masks are bottom-right aligned: with ``offset = n_k - n_q``,
query ``i`` sees key ``j`` iff ``j < n_k and (not causal or j <= i + offset)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# What a tile of query rows [q0, q1) x keys [k0, k1) holds
FULL = 0      # every pair visible: no element mask needed
PARTIAL = 1   # some pairs visible: mask element by element
EMPTY = 2     # no pair visible: skip the tile


@dataclass(frozen=True)
class MaskGeometry:
    """The visibility rule of one attention problem.

    Parameters
    ----------
    n_q : int
        Nq, query rows.
    n_k : int
        Nk, keys.
    causal : bool
        Bottom-right aligned causal mask.
    """

    n_q: int
    n_k: int
    causal: bool

    @property
    def offset(self) -> int:
        """Nk - Nq: query i sees keys up to i + offset under the causal mask."""
        return self.n_k - self.n_q

    def visible(self, rows, cols) -> np.ndarray:
        """Boolean ``(len(rows), len(cols))``: whether query ``rows[r]`` sees key ``cols[c]``."""
        rows, cols = np.asarray(rows)[:, None], np.asarray(cols)[None, :]
        seen = cols < self.n_k
        return seen & (cols <= rows + self.offset) if self.causal else np.broadcast_to(seen, (rows.size, cols.size))

    def kv_stop(self, q0: int, q1: int) -> int:
        """One past the last key any query row in [q0, q1) sees; 0 if none does."""
        if not self.causal:
            return self.n_k
        return int(np.clip(min(q1, self.n_q) - 1 + self.offset + 1, 0, self.n_k))

    def q_start(self, k0: int) -> int:
        """The first query row that sees key ``k0``; ``n_q`` if none does."""
        if not self.causal:
            return 0
        return int(np.clip(k0 - self.offset, 0, self.n_q))

    def tile(self, q0: int, q1: int, k0: int, k1: int) -> int:
        """`FULL`, `PARTIAL` or `EMPTY`: what the tile of rows [q0, q1) x keys [k0, k1) holds.

        Row i sees the keys [0, min(n_k, i + offset + 1)) (all n_k without the
        causal mask), a prefix that grows with i: the tile is empty when its
        last row sees none of [k0, k1) and full when its first row sees all of
        them. A tile with no row or no key is empty.
        """
        if q0 >= q1 or k0 >= k1:
            return EMPTY
        if k0 >= self._keys_seen(q1 - 1):
            return EMPTY
        return FULL if k1 <= self._keys_seen(q0) else PARTIAL

    def has_masked_pairs(self, q0: int, k0: int, k1: int) -> bool:
        """The tile of rows [q0, ...) x keys [k0, k1) has a masked pair that is not past a ragged end:
        a key of it after the last one row q0 sees (mask.cuh: Mask::has_masked_pairs). Only there can
        an inf or NaN operand reach a masked pair, so only then do the kernels flag and repair."""
        return self.causal and min(k1, self.n_k) - 1 > q0 + self.offset

    def _keys_seen(self, i: int) -> int:
        """How many keys query row i sees: it sees keys [0, that)."""
        return min(self.n_k, max(i + self.offset + 1, 0)) if self.causal else self.n_k
