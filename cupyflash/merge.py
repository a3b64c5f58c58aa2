"""Merging attentions over disjoint key sets by their softmax statistics.

Attention of queries over a key set split into disjoint parts is the merge of the parts' results: part
``p`` gives ``(o_p, m_p, l_p)`` (FlashAttention V1's output, row max and row exp-sum), and row by row

    m = max_p m_p,   w_p = l_p exp(m_p - m),   l = sum_p w_p,   o = sum_p (w_p / l) o_p.

That is how split-KV decoding, shared-prefix (cascade) inference and ring attention put their pieces
together. ``merge_attention`` takes the parts one by one, ``merge_attention_stacked`` stacked along an
axis; both run one fused kernel on CuPy arrays (``kernels_cu/flash_merge.cu``) and NumPy's own
arithmetic on NumPy arrays. A call like an earlier one (CuPy arrays of the same shapes, strides, dtypes,
alignment and device, no ``out=``) reuses its checks and launch (``KeptMerge``): a decoding step's
merges cost a launch and an allocation of host time, not the checks.
"""

from __future__ import annotations

import math
import operator
from functools import lru_cache

import numpy

from . import _launch, _params
from ._checks import SUPPORTED_DTYPES, array_module, check_out
from ._tiles import accumulator_dtype, dtype_name
from .api import _into

OUTPUTS = ("o", "m", "l")


def merge_attention(parts, *, out=None):
    """Merge attentions of the same queries over disjoint key sets.

    Parameters
    ----------
    parts : sequence of (o, m, l)
        One triple per part, all NumPy or all CuPy (on one device): ``o (..., Nq, D)`` of float16,
        bfloat16, float32 or float64, ``m, l (..., Nq)`` its statistics (float32, float64 for float64
        ``o``), as ``flash_attention_forward`` returns them; every part of the same shapes and dtypes.
        A part whose row saw no key (``l = 0``, ``m = -inf``) adds nothing to that row.
    out : tuple of 3 arrays, optional
        ``(o, m, l)`` to write into: C-contiguous, of the result's shapes and dtypes, sharing memory
        with no input (on the GPU, 16-byte aligned).

    Returns
    -------
    o : array, (..., Nq, D), the parts' dtype
        ``sum_p (l_p exp(m_p - m) / l) o_p``; 0 in a row no part saw.
    m : array, (..., Nq)
        ``max_p m_p`` over the parts that saw a key; ``-inf`` where none did.
    l : array, (..., Nq)
        ``sum_p l_p exp(m_p - m)``; 0 where no part saw a key.

    Raises
    ------
    TypeError
        Not arrays, a mix of NumPy and CuPy, a dtype other than those above, parts of different dtypes.
    ValueError
        No part, parts of different shapes, statistics whose shape is not ``o``'s without its last
        axis, arrays on different devices, a bad ``out``.

    Notes
    -----
    Exact to rounding: float32 arithmetic for 16-bit and float32 ``o``, float64 for float64, parts added
    in the order given. A single part (or one part with all others empty) comes back unchanged. A NaN
    in a seen part's statistics makes the row NaN. With the merged ``o, m, l``,
    ``flash_attention_backward`` of each part's keys gives that part's ``dk, dv`` and its share of
    ``dq`` (the shares sum to the full ``dq``). More than 16 parts on the GPU are stacked into one
    array first (a copy); ``merge_attention_stacked`` avoids it.
    """
    key = _listed_key(parts) if out is None else None
    kept = _KEPT.get(key) if key is not None else None
    if kept is not None:   # a like call's launch: CuPy parts of the same layout, nothing to check again
        return kept([part[j].data.ptr for j in range(3) for part in parts])
    if not isinstance(parts, (list, tuple)) or not parts:
        raise ValueError(f"parts must be a non-empty list or tuple of (o, m, l), got {_describe(parts)}")
    triples = []
    for i, part in enumerate(parts):
        if not isinstance(part, (list, tuple)) or len(part) != 3:
            raise TypeError(f"parts[{i}] must be an (o, m, l) triple, got {_describe(part)}")
        triples.append(tuple(part))
    named = {f"parts[{i}][{j}] ({name})": x for i, part in enumerate(triples) for j, (name, x) in
             enumerate(zip(OUTPUTS, part))}
    xp = array_module(named)
    o_shape, o_dtype = _check_part(triples[0], 0)
    for i, part in enumerate(triples[1:], 1):
        shape, dtype = _check_part(part, i)
        if (shape, dtype) != (o_shape, o_dtype):
            raise ValueError(f"parts[{i}] has o {shape} {dtype}, parts[0] o {o_shape} {o_dtype}: "
                             "every part must have the same shapes and dtypes")
    device = _one_device(named, xp)
    out = _checked_out(out, o_shape, o_dtype, xp, device, named)
    if xp is numpy:
        return _merge_numpy(numpy.stack([p[0] for p in triples]), numpy.stack([p[1] for p in triples]),
                            numpy.stack([p[2] for p in triples]), out)
    if len(triples) > _params.MERGE_POINTERS:
        stacked = [xp.stack([p[j] for p in triples]) for j in range(3)]
        return _merge_gpu(stacked, len(triples), True, out)
    contiguous = all(x.flags.c_contiguous for part in triples for x in part)
    return _merge_gpu([[x if x.flags.c_contiguous else xp.ascontiguousarray(x) for x in arrays]
                       for arrays in zip(*triples)], len(triples), False, out, key if contiguous else None)


def merge_attention_stacked(o, m, l, axis=0, *, out=None):
    """Merge attentions over disjoint key sets stacked along ``axis``.

    Parameters
    ----------
    o : array, (..., P, ..., Nq, D)
        The parts' outputs stacked along ``axis`` (float16, bfloat16, float32 or float64).
    m, l : array, (..., P, ..., Nq)
        Their statistics, stacked along the same axis (float32; float64 for float64 ``o``).
    axis : int
        The parts' axis, counted among the axes of ``m`` (negative from its end); not the rows' axis.
    out : tuple of 3 arrays, optional
        As for ``merge_attention``.

    Returns
    -------
    o, m, l : arrays
        As ``merge_attention`` of the parts ``(o[p], m[p], l[p])`` taken along ``axis``: the shapes
        without that axis.

    Raises
    ------
    TypeError, ValueError
        As ``merge_attention``; an ``axis`` out of range or naming the rows' axis; no part.
    """
    key = _launch.call_key((o, m, l), ("stacked", axis)) if out is None else None
    kept = _KEPT.get(key) if key is not None else None
    if kept is not None:
        return kept([o.data.ptr, m.data.ptr, l.data.ptr])
    named = {"o": o, "m": m, "l": l}
    xp = array_module(named)
    if m.ndim < 2:
        raise ValueError(f"m must have shape (..., P, ..., Nq) with the parts' axis before the rows', got {m.shape}")
    try:
        axis = operator.index(axis)
    except TypeError:
        raise TypeError(f"axis must be an int, got {type(axis).__name__}") from None
    ax = axis + m.ndim if axis < 0 else axis
    if not 0 <= ax < m.ndim - 1:
        raise ValueError(f"axis {axis} must name one of the first {m.ndim - 1} axes of m {m.shape} "
                         "(the last holds the rows)")
    if o.ndim != m.ndim + 1:
        raise ValueError(f"o must have one axis more than m (its head dim), got o {o.shape} and m {m.shape}")
    o, m, l = (xp.moveaxis(x, ax, 0) for x in (o, m, l))
    o_shape, o_dtype = _check_part((o, m, l), None)
    parts = o_shape[0]
    if parts == 0:
        raise ValueError(f"axis {axis} of o holds no part (o {o_shape})")
    device = _one_device(named, xp)
    result_shape = o_shape[1:]
    out = _checked_out(out, result_shape, o_dtype, xp, device, named)
    if xp is numpy:
        return _merge_numpy(o, m, l, out)
    contiguous = all(_parts_contiguous(x) for x in (o, m, l))
    stacked = [x if _parts_contiguous(x) else xp.ascontiguousarray(x) for x in (o, m, l)]
    return _merge_gpu(stacked, parts, True, out, key if contiguous else None)


def _describe(x) -> str:
    return f"{type(x).__name__} of length {len(x)}" if isinstance(x, (list, tuple)) else type(x).__name__


def _check_part(part, index):
    """``(o.shape, o.dtype)`` of one part (``index`` None: the stacked arrays); TypeError/ValueError
    naming the array and the shapes seen."""
    o, m, l = part
    where = "" if index is None else f"parts[{index}] "
    if o.dtype.name not in SUPPORTED_DTYPES or not o.dtype.isnative:
        raise TypeError(f"{where}o has dtype {o.dtype}; supported (native byte order): {', '.join(SUPPORTED_DTYPES)}")
    if o.ndim < 2 or o.shape[-1] == 0:
        raise ValueError(f"{where}o must have shape (..., Nq, D) with D >= 1, got {o.shape}")
    stats = accumulator_dtype(o.dtype)
    for name, x in (("m", m), ("l", l)):
        if x.dtype != stats:
            raise TypeError(f"{where}{name} must be {stats} for {o.dtype} o, got {x.dtype}")
        if x.shape != o.shape[:-1]:
            raise ValueError(f"{where}{name} must have shape {o.shape[:-1]} (o {o.shape} without its head dim), "
                             f"got {x.shape}")
    return o.shape, o.dtype


def _one_device(named: dict, xp):
    if xp is numpy:
        return None
    devices = {x.data.device_id for x in named.values()}
    if len(devices) > 1:
        seen = ", ".join(f"{n}: {x.data.device_id}" for n, x in named.items())
        raise ValueError(f"the parts are on different devices ({seen})")
    return devices.pop()


def _checked_out(out, o_shape, o_dtype, xp, device, inputs):
    if out is None:
        return None
    stats = accumulator_dtype(o_dtype)
    return check_out(out, OUTPUTS, (o_shape, o_shape[:-1], o_shape[:-1]), (o_dtype, stats, stats), xp, device,
                     inputs)


def _parts_contiguous(x) -> bool:
    """Each ``x[p]`` is C-contiguous (the parts may lie at any positive stride apart)."""
    inner = x[0] if x.shape[0] else x
    return inner.flags.c_contiguous and x.strides[0] > 0 and x.strides[0] % x.itemsize == 0


def _merge_numpy(o, m, l, out):
    """The merge of parts stacked along axis 0, in the accumulator precision (NumPy)."""
    acc = accumulator_dtype(o.dtype)
    m, l = m.astype(acc, copy=False), l.astype(acc, copy=False)
    seen = l != 0
    with numpy.errstate(invalid="ignore", over="ignore"):
        shown = numpy.where(seen, m, -numpy.inf)
        m_all = numpy.max(shown, axis=0)                 # NaN wins
        empty = m_all == -numpy.inf
        shift = numpy.where(empty, 0, m_all)
        w = numpy.where(seen, l * numpy.exp(m - shift), 0).astype(acc)
        l_all = numpy.sum(w, axis=0, dtype=acc)
        frac = numpy.where(seen, w / numpy.where(empty, 1, l_all), 0).astype(acc)
        terms = numpy.where(seen[..., None], frac[..., None] * o.astype(acc), 0)
        o_all = numpy.where(empty[..., None], 0, _ordered_sum(terms)).astype(o.dtype)
    l_all = numpy.where(empty, 0, l_all).astype(acc)
    return _into(out, (o_all, m_all.astype(acc), l_all))


def _ordered_sum(terms):
    """``terms[0] + terms[1] + ...`` in that order (NumPy's sum may pair them)."""
    total = terms[0].copy()
    for t in terms[1:]:
        total += t
    return total


@lru_cache(maxsize=64)
def _plan(dtype: str, rows: int, D: int, parts: int, strides: tuple, vec: bool, device: int) -> tuple:
    """``_launch.merge_plan`` of a call's parts on ``device`` (current): stacked where ``strides`` are not 0."""
    return _launch.merge_plan(dtype, rows, D, parts, strides, vec, listed=not strides[0])


def _merge_gpu(arrays, parts: int, stacked: bool, out, key=None):
    """The merge on the GPU: ``arrays`` = [o, m, l], each a list of C-contiguous parts or (``stacked``)
    one array of C-contiguous parts along axis 0. Without ``out`` its launch is kept under ``key`` (the
    call's ``_launch.call_key``; None: not kept) for like calls."""
    o = arrays[0] if stacked else arrays[0][0]
    o_shape = o.shape[1:] if stacked else o.shape
    dtype, device = o.dtype, o.data.device_id
    acc = accumulator_dtype(dtype)
    rows, D = math.prod(o_shape[:-1]), o_shape[-1]
    bases = [[x.data.ptr] for x in arrays] if stacked else [[x.data.ptr for x in group] for group in arrays]
    strides = tuple(x.strides[0] // x.itemsize for x in arrays) if stacked else (0, 0, 0)
    item = dtype.itemsize
    vec = D * item % 16 == 0 and all(b % 16 == 0 for b in bases[0]) and (strides[0] * item) % 16 == 0
    with _launch._on_device(device):
        step = _plan(dtype_name(dtype), rows, D, parts, strides, vec, device) if rows else None
        pointers = [*bases[0], *bases[1], *bases[2]]
        if out is None:
            specs = ((o_shape, dtype), (o_shape[:-1], acc), (o_shape[:-1], acc))
            merge = KeptMerge(device, specs, _output_block(specs), step)
            if key is not None:
                if len(_KEPT) >= MAX_KEPT:
                    _KEPT.clear()
                _KEPT[key] = merge
            return merge(pointers)
        if step is not None:
            _launch_step(step, pointers, out)
    return tuple(out)


@lru_cache(maxsize=64)
def _output_block(specs) -> "_launch.Block":
    return _launch.block_layout(_launch.array_parts(specs))


def _launch_step(step, pointers, out):
    """flash_merge.cu's launch (``_launch.merge_plan``) over the parts at ``pointers`` (every o, every m,
    every l) into ``out``, on the current stream."""
    merge, params = step
    stream, _ = _launch.call_stream()
    buffer, address = params.pack([*pointers, *(x.data.ptr for x in out)])
    merge(stream, address)   # cuLaunchKernel copies the struct: `buffer` may go once it returns


class KeptMerge:
    """A merge with everything but its parts' addresses settled: ``merge(pointers)`` (every part's o, then
    every m, every l; or the stacked o, m, l) returns new ``(o, m, l)`` from one allocation of CuPy's pool."""

    __slots__ = ("device", "specs", "block", "step")

    def __init__(self, device: int, specs, block, step):
        self.device, self.specs, self.block, self.step = device, specs, block, step

    def __call__(self, pointers):
        import cupy

        with _launch._on_device(self.device):
            out = self.block.arrays(cupy.cuda.alloc(max(self.block.nbytes, 1)), self.specs)
            if self.step is not None:   # rows to merge
                _launch_step(self.step, pointers, out)
        return tuple(out)


# Merges of earlier calls (CuPy arrays, no out=): their checks and plan read only the arrays' types,
# shapes, strides, dtypes, 16-byte alignment and devices (``_launch.call_key``), so a like call reuses them
_KEPT: dict = {}
MAX_KEPT = 256


def _listed_key(parts):
    """``_launch.call_key`` of ``merge_attention``'s parts (o, m, l of each, in order), or None where they
    are not a list or tuple of at most MERGE_POINTERS triples of CuPy arrays."""
    if not isinstance(parts, (list, tuple)) or not 0 < len(parts) <= _params.MERGE_POINTERS:
        return None
    arrays = []
    for part in parts:
        if not isinstance(part, (list, tuple)) or len(part) != 3:
            return None
        arrays += part
    return _launch.call_key(arrays, ("listed", len(parts)))
