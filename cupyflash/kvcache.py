"""Attention against a K/V cache, the decoding step: ``flash_attention_with_kvcache``.

Each batch entry ``b`` holds its keys and values in a cache, contiguous ``(B, Hkv, N_max, D)`` or paged
``(pages, Hkv, page_size, D)`` with a page table ``(B, pages_per_entry)``; its first
``cache_seqlens[b]`` rows are valid. New keys and values, where given, are written at
``cache_seqlens[b]`` first (in place), and the queries then attend to the first ``cache_seqlens[b] +
Nnew`` keys, causal and windows bottom-right aligned to them.

On the GPU one kernel appends (``kernels_cu/flash_append.cu``) and the forward reads each entry's
length on the device (``params.cuh``: Seqs::len_k) and, for a paged cache, each tile's rows through the
table (Pages, KeyRows), in the forward a contiguous cache runs; query heads that share a K/V head fold
into one work head's rows (``_fold``) where the visibility allows it, and split-KV keeps the GPU busy.
NumPy inputs run the blocked CPU path one batch entry at a time.
"""

from __future__ import annotations

import numbers
from dataclasses import replace
from typing import Optional

import numpy

from . import _launch
from ._checks import _cupy, array_module, check_disjoint, check_forward, check_out, check_splits, with_softcap
from ._flags import call_arrays
from ._fold import Fold, fold_of, foldable
from ._tiles import accumulator_dtype
from .api import FORWARD_OUTPUTS, _checked_mods, _device_id, _forward_gpu, _into, flash_attention_forward


def flash_attention_with_kvcache(q, k_cache, v_cache, cache_seqlens, *, k=None, v=None, block_table=None,
                                 causal: bool = True, softmax_scale: Optional[float] = None,
                                 num_splits: Optional[int] = None, window=None, softcap: Optional[float] = None,
                                 alibi_slopes=None, out=None):
    """Attention of new queries against a K/V cache, after appending new keys to it.

    Parameters
    ----------
    q : ndarray, shape (B, Hq, Nq, D)
        The queries: ``Nq`` rows per sequence (1 when decoding a token). ``Hq`` a multiple of the
        cache's ``Hkv`` (grouped-query attention: query head ``h`` reads K/V head ``h // (Hq // Hkv)``).
    k_cache, v_cache : ndarray
        Contiguous, shape ``(B, Hkv, N_max, D)``: entry ``b``'s key ``j`` at ``k_cache[b, :, j]``. Paged
        (with ``block_table``), shape ``(pages, Hkv, page_size, D)``: entry ``b``'s key ``j`` in page
        ``block_table[b, j // page_size]`` at row ``j % page_size`` (any page size). q's dtype; the
        last axis contiguous. Written in place where ``k``, ``v`` are given.
    cache_seqlens : int or ndarray of int, shape (B,)
        The valid keys of each entry before the append (int32 on the GPU; another integer dtype is
        converted).
    k, v : ndarray, shape (B, Hkv, Nnew, D), optional
        New keys and values, written into the cache at rows ``cache_seqlens[b] ..
        cache_seqlens[b] + Nnew - 1`` before attending (both or neither). The caller advances
        ``cache_seqlens`` afterwards.
    block_table : ndarray of int, shape (B, pages_per_entry), optional
        Page numbers of a paged cache (int32 on the GPU).
    causal : bool, optional
        Query row ``i`` of entry ``b`` sits at position ``L_b - Nq + i`` with ``L_b = cache_seqlens[b]
        + Nnew`` (bottom-right) and sees the keys up to it. Default True.
    softmax_scale, window, softcap, alibi_slopes, num_splits
        As in :func:`cupyflash.flash_attention_forward`, over each entry's ``L_b`` keys
        (``alibi_slopes`` broadcastable to ``(B, Hq)``).
    out : tuple of ndarray, optional
        ``(o, m, l)`` to write into, of the shapes returned.

    Returns
    -------
    o : ndarray, shape (B, Hq, Nq, D)
    m, l : ndarray, shape (B, Hq, Nq)
        As :func:`cupyflash.flash_attention_forward` returns them for entry ``b`` against its first
        ``L_b`` keys (rows that see no key: ``o = 0, m = -inf, l = 0``); float32 (float64 for float64).
        A plain tuple, not a :class:`cupyflash.ForwardResult`: there is no backward through a cache.

    Raises
    ------
    TypeError, ValueError
        Bad shapes, dtypes or flags, named with the shapes seen; lengths below 0 or past the cache's
        capacity (``N_max``, or ``pages_per_entry * page_size``) with the new keys, and page numbers
        outside ``[0, pages)`` — checked where the lengths and the table are NumPy arrays or ints.

    Notes
    -----
    With CuPy lengths or a CuPy table nothing is copied to the host, so their values are **not
    checked**: the kernels clamp each length to ``[0, capacity]`` and each page number to ``[0,
    pages)``, so bad values give wrong results, never reads or writes outside the cache. New rows
    past the capacity are not written. ``q``, ``k``, ``v``, the lengths and the table are never
    modified; the cache is, by the append only.
    """
    arrays = {"q": q, "k_cache": k_cache, "v_cache": v_cache}
    arrays.update({n: x for n, x in (("k", k), ("v", v)) if x is not None})
    # a call like an earlier one (CuPy arrays of the same shapes, strides, dtypes, alignment; the same flags)
    # reuses its plan: no checks, no planning, the launches only
    key = None
    if alibi_slopes is None and (out is None or type(out) is tuple and len(out) == 3):
        given = (q, k_cache, v_cache, cache_seqlens, *(x for x in (block_table, k, v) if x is not None), *(out or ()))
        flags = ("kvcache", block_table is not None, k is not None, out is not None, causal, softmax_scale, num_splits,
                 window, softcap)
        key = _launch.call_key(given, flags)
        kept = _KEPT.get(key) if key is not None else None
        if kept is not None:
            if out is not None:
                check_disjoint(out, FORWARD_OUTPUTS, arrays)
            return kept(q, k_cache, v_cache, cache_seqlens, block_table, k, v, out)
    xp = array_module(arrays)
    paged = block_table is not None
    B, Hq, Nq, D, Hkv, capacity, n_new = _check_shapes(q, k_cache, v_cache, k, v, block_table)
    G = Hq // Hkv
    # the problem as the library's forward sees it: q (B, Hkv, G, Nq, D) against (B, Hkv, 1, keys, D)
    q5 = q.reshape(B, Hkv, G, Nq, D)
    k5, v5 = (_as_keys(x, B, Hkv, paged) for x in (k_cache, v_cache))
    # the cache's capacity as the key count (a paged cache's view holds one page)
    prob = replace(with_softcap(check_forward(q5, k5, v5, causal, softmax_scale, window), softcap), Nk=capacity)
    num_splits = check_splits(num_splits, "auto")
    device = _device_id(q, prob)
    lens = _check_lengths(cache_seqlens, B, n_new, capacity, xp, device)
    table = _check_table(block_table, k_cache.shape[0], xp, device) if paged else None
    if lens is not cache_seqlens or table is not block_table:   # converted: a like call converts again
        key = None
    slopes = _checked_mods(prob, q, None, call_arrays(alibi_slopes=_grouped(alibi_slopes, B, Hq, Hkv)))[0].get("alibi")
    acc = accumulator_dtype(prob.dtype)
    stats = (B, Hq, Nq)
    if out is not None:
        out = check_out(out, FORWARD_OUTPUTS, ((*stats, D), stats, stats), (prob.dtype, acc, acc), xp, device,
                        {n: x for n, x in arrays.items() if n in ("q", "k", "v")})
    if xp is numpy:
        return _into(out, _cpu(q5, k_cache, v_cache, k, v, lens, table, prob, slopes, stats))
    # the elements between pages, of the caches themselves (k5, v5 hold page 0 only: a dim of 1, whose stride
    # is anything)
    pages = (k_cache.shape[0], *(x.strides[0] // x.itemsize for x in (k_cache, v_cache))) if paged else (0, 0, 0)
    return _gpu(q5, k5, v5, k, v, lens, table, prob, slopes, stats, out, num_splits, capacity, pages, n_new, key)


_KEPT: dict = {}        # CachePlan of earlier calls, by their key
MAX_KEPT = 256         # past this many the cache starts over


class CachePlan:
    """A kept call: the append's launch and struct (None without new keys) and the forward's plan."""

    def __init__(self, append, forward):
        self.append, self.forward = append, forward

    def __call__(self, q, k_cache, v_cache, lens, table, k, v, out):
        if self.append is not None:
            with _launch._on_device(q.data.device_id):
                _append(self.append, k_cache, v_cache, k, v, lens, table)
        return self.forward(q, k_cache, v_cache, out, None, (None, None), 0, lens, table)


def _append(plan, k_cache, v_cache, k, v, lens, table):
    """Launch ``_launch.append_plan``'s ``plan`` on the current stream: ``k``, ``v`` into the cache."""
    step, params = plan
    struct, address = params.pack((k_cache.data.ptr, v_cache.data.ptr, k.data.ptr, v.data.ptr, lens.data.ptr,
                                   0 if table is None else table.data.ptr))
    step(_launch.call_stream()[0], address)


def _check_shapes(q, k_cache, v_cache, k, v, block_table) -> tuple:
    """``(B, Hq, Nq, D, Hkv, capacity, Nnew)`` of a call, or the error that names what does not fit."""
    for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if x.ndim != 4:
            raise ValueError(f"{name} must have 4 dims, got shape {x.shape}"
                             + (" (B, Hq, Nq, D)" if name == "q" else " (B, Hkv, N_max, D) or (pages, Hkv, page_size, D)"))
    B, Hq, Nq, D = q.shape
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache must have one shape, got {k_cache.shape} and {v_cache.shape}")
    n0, Hkv, rows, Dc = k_cache.shape
    if Dc != D:
        raise ValueError(f"q and the cache must share the head dim D, got q {q.shape}, k_cache {k_cache.shape}")
    if Hkv == 0 or Hq % Hkv:
        raise ValueError(f"q's heads ({Hq}) must be a multiple of the cache's ({Hkv}): q {q.shape}, "
                         f"k_cache {k_cache.shape}")
    for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
        if x.shape[-1] > 1 and x.strides[-1] != x.itemsize:
            raise ValueError(f"{name} must have a contiguous last axis (it is written in place), got strides "
                             f"{x.strides} for shape {x.shape}")
    if block_table is None:
        if n0 != B:
            raise ValueError(f"a contiguous cache must have q's batch B = {B} first, got k_cache {k_cache.shape}")
        capacity = rows
    else:
        if block_table.ndim != 2 or block_table.shape[0] != B:
            raise ValueError(f"block_table must have shape (B, pages_per_entry) with B = {B}, "
                             f"got {block_table.shape}")
        if block_table.dtype.kind not in "iu":
            raise TypeError(f"block_table must hold integers, got dtype {block_table.dtype}")
        if rows == 0 or n0 == 0 and block_table.shape[1]:
            raise ValueError(f"a paged cache needs pages, of at least one row each, got k_cache {k_cache.shape}")
        capacity = block_table.shape[1] * rows
    if (k is None) != (v is None):
        raise ValueError("k and v (the new keys and values) come together or not at all")
    n_new = 0
    if k is not None:
        if k.ndim != 4 or k.shape[:2] != (B, Hkv) or k.shape[3] != D or v.shape != k.shape:
            raise ValueError(f"k and v must have shape (B, Hkv, Nnew, D) = ({B}, {Hkv}, Nnew, {D}), got k {k.shape}, "
                             f"v {v.shape}")
        if k.dtype != q.dtype or v.dtype != q.dtype:
            raise TypeError(f"k and v must have q's dtype {q.dtype}, got {k.dtype} and {v.dtype}")
        n_new = k.shape[2]
    if capacity >= 2**31:
        raise ValueError(f"a cache of {capacity} rows per entry exceeds the kernels' int32 row index")
    return B, Hq, Nq, D, Hkv, capacity, n_new


def _grouped(alibi_slopes, B: int, Hq: int, Hkv: int):
    """ALiBi slopes broadcastable to ``(B, Hq)`` as ``(B, Hkv, G)`` (the problem's batch); None stays None."""
    if alibi_slopes is None:
        return None
    cupy = _cupy()
    mod = cupy if cupy is not None and isinstance(alibi_slopes, cupy.ndarray) else numpy
    x = mod.asarray(alibi_slopes)
    try:
        x = mod.broadcast_to(x, (B, Hq))
    except ValueError:
        raise ValueError(f"alibi_slopes of shape {x.shape} does not broadcast to (B, Hq) = ({B}, {Hq})") from None
    return x.reshape(B, Hkv, Hq // Hkv)


def _as_keys(x, B: int, Hkv: int, paged: bool):
    """The cache as the forward's keys ``(B, Hkv, 1, rows, D)``; a paged one as its page 0 ``(1, Hkv, 1,
    page_size, D)``, which the kernels' batch strides and the table take from there."""
    if paged:
        x = x[:1]
    return x.reshape(x.shape[0], Hkv, 1, *x.shape[2:])


def _check_lengths(cache_seqlens, B: int, n_new: int, capacity: int, xp, device):
    """The lengths as the kernels (int32, on the inputs' device) or the CPU path read them: ``(B,)``; a
    host value (an int, a NumPy array) is checked to lie in ``[0, capacity - n_new]``."""
    cupy = _cupy()
    if isinstance(cache_seqlens, numbers.Integral) and not isinstance(cache_seqlens, bool):
        cache_seqlens = numpy.full(B, int(cache_seqlens))
    on_device = cupy is not None and isinstance(cache_seqlens, cupy.ndarray)
    if on_device and xp is numpy:
        raise TypeError("cache_seqlens is a cupy.ndarray but q is a NumPy array: pass it as a NumPy array")
    x = cache_seqlens if on_device else numpy.asarray(cache_seqlens)
    if x.dtype.kind not in "iu" or x.shape != (B,):
        raise ValueError(f"cache_seqlens must be an int or an integer array of shape (B,) = ({B},), got "
                         f"{x.dtype} of shape {x.shape}")
    if not on_device:
        if B and (x.min() < 0 or x.max() + n_new > capacity):
            raise ValueError(f"cache_seqlens + {n_new} new keys must lie in [0, {capacity}] (the cache's "
                             f"capacity), got cache_seqlens from {x.min()} to {x.max()}")
        if xp is numpy:
            return x.astype(numpy.int64)
    return _kernel_int32("cache_seqlens", x, device)


def _check_table(block_table, pages: int, xp, device):
    """A paged cache's table as the kernels (int32, C-contiguous, on the inputs' device) or the CPU path
    read it; a NumPy one is checked: every page number in ``[0, pages)``."""
    cupy = _cupy()
    on_device = cupy is not None and isinstance(block_table, cupy.ndarray)
    if on_device and xp is numpy:
        raise TypeError("block_table is a cupy.ndarray but q is a NumPy array: pass it as a NumPy array")
    if not on_device:
        t = numpy.asarray(block_table)
        if t.size and (t.min() < 0 or t.max() >= pages):
            bad = t[(t < 0) | (t >= pages)]
            raise ValueError(f"block_table holds page {bad.flat[0]}, outside the cache's {pages} pages")
        if xp is numpy:
            return t.astype(numpy.int64)
        block_table = t
    return _kernel_int32("block_table", block_table, device)


def _kernel_int32(name: str, x, device):
    """``x`` (NumPy or CuPy integers) as the kernels read it: a C-contiguous int32 CuPy array on ``device``
    (the same array where it is one; a CuPy array on another device is refused)."""
    import cupy

    if isinstance(x, cupy.ndarray) and x.device.id != device:
        raise ValueError(f"{name} is on device {x.device.id}, q on device {device}")
    if x.dtype == numpy.int32 and x.flags.c_contiguous and isinstance(x, cupy.ndarray):
        return x
    with cupy.cuda.Device(device):
        return cupy.ascontiguousarray(cupy.asarray(x, dtype=numpy.int32))


def _entry_keys(cache, b: int, rows: int, table):
    """Entry ``b``'s first ``rows`` rows of a NumPy cache, ``(Hkv, rows, D)`` (gathered from its pages)."""
    if table is None:
        return cache[b, :, :rows]
    size = cache.shape[2]
    pages = [cache[table[b, p]] for p in range(-(-rows // size))]
    if not pages:
        return numpy.zeros((cache.shape[1], 0, cache.shape[3]), cache.dtype)
    return numpy.concatenate(pages, axis=1)[:, :rows]


def _append_cpu(cache, new, lens, table):
    """``new`` (B, Hkv, Nnew, D) into a NumPy cache at the lengths."""
    size = cache.shape[2]
    for b in range(new.shape[0]):
        for t in range(new.shape[2]):
            r = int(lens[b]) + t
            if table is None:
                cache[b, :, r] = new[b, :, t]
            else:
                cache[table[b, r // size], :, r % size] = new[b, :, t]


def _cpu(q5, k_cache, v_cache, k, v, lens, table, prob, slopes, stats):
    """The CPU path: append, then each entry's attention against its keys (the blocked forward)."""
    if k is not None:
        _append_cpu(k_cache, k, lens, table)
        _append_cpu(v_cache, v, lens, table)
    n_new = 0 if k is None else k.shape[2]
    acc = accumulator_dtype(prob.dtype)
    B, Hkv, G, Nq, D = q5.shape
    o, m, l = numpy.empty((*stats, D), prob.dtype), numpy.empty(stats, acc), numpy.empty(stats, acc)
    for b in range(B):
        rows = int(lens[b]) + n_new
        keys = _entry_keys(k_cache, b, rows, table)[:, None]
        values = _entry_keys(v_cache, b, rows, table)[:, None]
        ob, mb, lb = flash_attention_forward(q5[b], keys, values, causal=prob.causal, softmax_scale=prob.scale,
                                             window=prob.window, softcap=prob.softcap,
                                             alibi_slopes=None if slopes is None else slopes[b])
        o[b], m[b], l[b] = ob.reshape(-1, Nq, D), mb.reshape(-1, Nq), lb.reshape(-1, Nq)
    return o, m, l


def _gpu(q5, k5, v5, k, v, lens, table, prob, slopes, stats, out, num_splits, capacity: int, pages: tuple,
         n_new: int, key=None):
    """The GPU path: the append kernel, then the forward over each entry's keys (folded where it can); the
    two kept under ``key`` (None: not kept) for like calls. ``pages``: a paged cache's page count and the
    elements between pages of k and of v (zeros for a contiguous cache)."""
    import cupy

    paged = table is not None
    B, Hkv, G = q5.shape[:3]
    cache = _launch.Cache(n_new, k5.shape[-2] if paged else 0, pages[0], pages[1:])
    lens5 = lens.reshape(B, 1, 1, 1, 1)
    table5 = table.reshape(B, 1, 1, 1, -1) if paged else None
    append = None
    with _launch._on_device(q5.data.device_id):
        if n_new and B and Hkv and k5.shape[-1]:
            k4, v4 = k5.reshape(-1, Hkv, *k5.shape[-2:]), v5.reshape(-1, Hkv, *v5.shape[-2:])
            extra = (lens5[:, :, 0], *((table5[:, :, 0],) if paged else ()))
            layout = _launch.collapse_batch((B, Hkv), [_launch.batch_strides(x.shape, _launch.element_strides(x)[:-2],
                                                                             (B, Hkv)) for x in (k4, v4, k, v, *extra)])
            append = _launch.append_plan(k4, v4, k, v, layout, cache, capacity)
            _append(append, k4, v4, k, v, lens, table)
        if 0 in q5.shape or capacity == 0:   # nothing to launch: every row sees no key
            acc = accumulator_dtype(prob.dtype)
            res = (cupy.zeros((*stats, q5.shape[-1]), prob.dtype), cupy.full(stats, -numpy.inf, acc),
                   cupy.zeros(stats, acc))
            return _into(out, res)
        schedule = _launch.forward_schedule("v2" if (num_splits or 1) > 1 else "auto", prob.D, prob.dtype)
        batch_shape = (B, Hkv, G)
        cached = (lens5, *((table5,) if paged else ()))
        # the query heads of a group fold into rows where fold_of finds q's layout allows it; only those (a
        # paged view's batch dim of 1 is no broadcast)
        fold = Fold(1, G) if foldable(prob, (slopes,), 0.0) and fold_of(batch_shape, q5, k5, v5) else None
        packed = _launch.Packed(1, prob.Nq * (fold.group if fold else 1), capacity, cache)
        plan_key = None if key is None else ("kvcache",) + key
        if fold is not None:
            fprob = fold.problem(prob)
            result = _forward_gpu(fold.rows(q5), fold.keys(k5), fold.keys(v5), {}, fprob.batch_shape, fprob,
                                  schedule, "highest", plan_key, out, packed, stats_shape=stats, kv_splits=num_splits,
                                  cached=tuple(fold.keys(x) for x in cached))
        else:
            result = _forward_gpu(q5, k5, v5, call_arrays(alibi_slopes=slopes), batch_shape, prob, schedule, "highest",
                                  plan_key, out, packed, stats_shape=stats, kv_splits=num_splits, cached=cached)
    forward = _launch.PLANS.get(plan_key) if plan_key is not None else None
    if forward is not None:
        if len(_KEPT) >= MAX_KEPT:
            _KEPT.clear()
        _KEPT[key] = CachePlan(append, forward)
    return result
