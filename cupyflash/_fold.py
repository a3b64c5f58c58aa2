"""Packed GQA: query heads that share a K/V head folded into the query rows.

With grouped-query attention as broadcasting, ``q (B, Hkv, G, Nq, D)`` against ``k, v (B, Hkv, 1, Nk,
D)``, every query head is a work head of its own and reads its K/V head again: G times the traffic.
Where the G dims of a C-contiguous ``q`` sit just before its rows, ``q`` *is* ``(B, Hkv, G·Nq, D)``:
one work head per K/V head, whose tiles hold the rows of the whole group, so K and V are read once
per group and the backward's dK, dV need no sums across heads. The result is the same attention, row
for row, as long as nothing tells the folded rows apart by their query index or head: no causal mask
or window over more than one query row, no ALiBi, sink, bias, boolean mask, dropout, user expressions
or packed sequences (``foldable``). ``fold_of`` finds the dims; ``Fold`` reshapes (views only).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Fold:
    """The ``dims`` trailing batch dims (of ``group`` entries together) folded into q's rows."""

    dims: int
    group: int

    def rows(self, x):
        """q, o, do ``(*batch, N, D)`` -> ``(*batch[:-dims], group N, D)`` (a view)."""
        return x.reshape(*x.shape[:-2 - self.dims], self.group * x.shape[-2], x.shape[-1])

    def stats(self, x):
        """m, l ``(*batch, N)`` -> ``(*batch[:-dims], group N)``."""
        return x.reshape(*x.shape[:-1 - self.dims], self.group * x.shape[-1])

    def keys(self, x):
        """k, v: without their last ``dims`` batch dims (each 1, or absent)."""
        return x.reshape(*x.shape[:max(0, x.ndim - 2 - self.dims)], *x.shape[-2:])

    def problem(self, prob):
        """``prob`` (``_checks.Problem``) of the folded call: fewer batch dims, ``group`` times the rows;
        causal only where it hid something (a single query row sees every key bottom-right)."""
        return replace(prob, batch_shape=prob.batch_shape[:-self.dims], Nq=self.group * prob.Nq,
                       causal=prob.causal and prob.Nq > 1)


def foldable(prob, modifiers, dropout_p: float) -> bool:
    """None of ``modifiers`` given (ALiBi slopes, sinks, bias, mask, user expressions, packed sequences:
    None where absent), no dropout, and a visibility that is the same for every query row."""
    trivial = prob.window == (None, None) and (not prob.causal or prob.Nq == 1)
    return trivial and dropout_p == 0 and all(x is None for x in modifiers)


def _c_contiguous_tail(x, axes: int) -> bool:
    """The last ``axes`` axes of ``x`` are laid out as a C-contiguous block (any layout before them)."""
    expected = x.itemsize
    for n, s in zip(reversed(x.shape[-axes:]), reversed(x.strides[-axes:])):
        if n != 1 and s != expected:
            return False
        expected *= n
    return True


def fold_of(batch_shape, q, k, v, *rows_like) -> Fold | None:
    """The widest ``Fold`` of the trailing batch dims along which ``k`` and ``v`` are broadcast (1 or
    absent) and ``q`` is not, where q and ``rows_like`` (o, do) are C-contiguous from those dims on;
    None where there is none (or it folds only dims of 1)."""
    nb = len(batch_shape)

    def dim(x, d):   # x's batch dim at broadcast position d (1 where absent)
        at = d - (nb - (x.ndim - 2))
        return x.shape[at] if at >= 0 else 1

    dims = 0
    while dims < nb and dim(k, nb - 1 - dims) == 1 == dim(v, nb - 1 - dims) \
            and dim(q, nb - 1 - dims) == batch_shape[nb - 1 - dims]:
        dims += 1
    while dims and not all(x.ndim - 2 >= dims and _c_contiguous_tail(x, dims + 2) for x in (q, *rows_like)):
        dims -= 1
    group = math.prod(batch_shape[nb - dims:])
    return Fold(dims, group) if dims and group > 1 else None


def keeps_the_gpu_busy(prob, fold: Fold, block: int, sms: int, backward: bool = False) -> bool:
    """Fold on the GPU where the folded grid keeps at least half a wave of CTAs (or as many as the
    unfolded one had): the forward's grid is (work head, Q tile of ``block`` rows), so it loses CTAs only
    where a group's rows fit in fewer tiles (decoding); the backward's is (work head, K/V tile of
    ``block`` keys), which loses a factor ``group``."""
    heads = math.prod(prob.batch_shape)
    if backward:
        tiles = folded_tiles = -(-prob.Nk // block)
    else:
        tiles, folded_tiles = -(-prob.Nq // block), -(-fold.group * prob.Nq // block)
    return heads // fold.group * folded_tiles >= min(heads * tiles, sms // 2)
