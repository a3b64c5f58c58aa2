"""Input validation: every check runs here, before anything launches.

CuPy's raw kernels check nothing, so shapes, dtypes, devices and strides are
settled in Python. Errors name the argument and the shapes or dtypes seen.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, replace
from typing import Optional

import numpy

from ._mask import MaskGeometry
from ._philox import keep_threshold
from ._tiles import MAX_HEAD_DIM, accumulator_dtype, dtype_name

SUPPORTED_DTYPES = ("float16", "bfloat16", "float32", "float64")
# float8 e4m3 inputs (cupyflash.float8): ml_dtypes' NumPy dtype, or their bits as uint8 (CuPy has no float8)
FLOAT8_DTYPES = ("float8_e4m3fn", "uint8")
LOG2E = math.log2(math.e)


def _cupy():
    try:
        import cupy
    except ImportError:
        return None
    return cupy


def array_module(arrays: dict):
    """``numpy`` or ``cupy`` for the named arrays; TypeError on anything else or on a mix."""
    cupy = _cupy()
    kinds = {}
    for name, x in arrays.items():
        if isinstance(x, numpy.ndarray):
            kinds[name] = "numpy"
        elif cupy is not None and isinstance(x, cupy.ndarray):
            kinds[name] = "cupy"
        else:
            raise TypeError(f"{name} must be a numpy.ndarray or cupy.ndarray, got {type(x).__name__}")
    if len(set(kinds.values())) > 1:
        seen = ", ".join(f"{n}: {k}" for n, k in kinds.items())
        raise TypeError(f"cannot mix NumPy and CuPy arrays ({seen})")
    return numpy if "numpy" in kinds.values() else cupy


@dataclass(frozen=True)
class Problem:
    """What a validated call computes."""

    xp: object              # numpy or cupy
    dtype: numpy.dtype
    batch_shape: tuple
    Nq: int
    Nk: int
    D: int
    scale: float
    causal: bool
    window: tuple = (None, None)   # (left, right): ints >= 0 or None (unbounded)
    softcap: Optional[float] = None   # c > 0: scores become c tanh(s / c)

    @property
    def geometry(self) -> MaskGeometry:
        """Which pairs are visible: the causal mask and the window (``_mask.MaskGeometry``)."""
        return MaskGeometry(self.Nq, self.Nk, self.causal, *self.window)


SCHEDULES = ("auto", "v1", "v2")


def check_bool(name: str, value) -> bool:
    if not isinstance(value, (bool, numpy.bool_)):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return bool(value)


def check_choice(name: str, value, choices) -> str:
    """``value`` of keyword ``name``, one of the strings ``choices``."""
    if not isinstance(value, str):
        raise TypeError(f"{name} must be one of {choices}, got {type(value).__name__}")
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")
    return value


def check_window(window) -> tuple:
    """``window`` as ``(left, right)``: None, or a pair whose sides are ints >= 0 or None."""
    if window is None:
        return (None, None)
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise TypeError(f"window must be a pair (left, right) of ints >= 0 or None, got {window!r}")
    sides = []
    for name, side in zip(("left", "right"), window):
        if side is not None:
            if isinstance(side, (bool, numpy.bool_)) or not isinstance(side, (int, numpy.integer)):
                raise TypeError(f"window's {name} side must be an int >= 0 or None, got {type(side).__name__}")
            if side < 0:
                raise ValueError(f"window's {name} side must be >= 0 or None, got {side} (window={window!r})")
            side = int(side)
        sides.append(side)
    return tuple(sides)


def check_softcap(softcap, dtype) -> Optional[float]:
    """``softcap``: None, or a real number > 0 whose reciprocal is finite in the accumulator precision."""
    if softcap is None:
        return None
    real = (int, float, numpy.integer, numpy.floating)
    if isinstance(softcap, (bool, numpy.bool_)) or not isinstance(softcap, real):
        raise TypeError(f"softcap must be a real number > 0 or None, got {type(softcap).__name__}")
    acc = accumulator_dtype(dtype).type
    with numpy.errstate(all="ignore"):
        c = acc(softcap)
        ok = numpy.isfinite(c) and c > 0 and numpy.isfinite(acc(1) / c)
    if not ok:
        raise ValueError(f"softcap must be a finite number > 0 (with a finite reciprocal in {numpy.dtype(acc)}), "
                         f"got {softcap!r}")
    return float(softcap)


def _is_cupy_of_inputs(name: str, x, on_gpu: bool, device) -> bool:
    """``x`` is a CuPy array, allowed only for GPU inputs and on their ``device``."""
    cupy = _cupy()
    if cupy is None or not isinstance(x, cupy.ndarray):
        return False
    if not on_gpu:
        raise TypeError(f"{name} is a cupy.ndarray but q, k, v are NumPy arrays: pass it as a NumPy array")
    if x.device.id != device:
        raise ValueError(f"{name} is on device {x.device.id}, q on device {device}")
    return True


def _given_array(name: str, values, on_gpu: bool, device):
    """A modifier's ``values`` as an array: a CuPy array as it is (for GPU inputs, on their ``device``),
    anything else through ``numpy.asarray``."""
    if _is_cupy_of_inputs(name, values, on_gpu, device):
        return values
    try:
        return numpy.asarray(values)
    except (TypeError, ValueError) as error:
        raise TypeError(f"{name} must be an array, got {type(values).__name__}") from error


def _check_real(name: str, x):
    if x.dtype.kind not in "fiu" and x.dtype.name != "bfloat16":
        raise TypeError(f"{name} must hold real numbers, got dtype {x.dtype}")


def check_per_entry(name: str, values, prob: "Problem", device=None, dtype=None):
    """``values`` (``alibi_slopes``, ``sink``, the float8 forward's descales: one number per batch entry) as
    the kernels (or the NumPy path) read them: None, or an array of the inputs' kind (on their device) in
    ``dtype`` (default the accumulator dtype) whose shape broadcasts to the batch shape. A NumPy array or
    sequence is moved to the GPU for CuPy inputs, another dtype converted."""
    if values is None:
        return None
    acc = accumulator_dtype(prob.dtype) if dtype is None else numpy.dtype(dtype)
    cupy = _cupy()
    on_gpu = prob.xp is not numpy
    x = _given_array(name, values, on_gpu, device)
    _check_real(name, x)
    try:
        fits = numpy.broadcast_shapes(x.shape, prob.batch_shape) == tuple(prob.batch_shape)
    except ValueError:
        fits = False
    if not fits:
        raise ValueError(f"{name} of shape {x.shape} does not broadcast to the batch shape "
                         f"{tuple(prob.batch_shape)} (one value per batch entry, e.g. (H,) for (B, H, N, D))")
    if on_gpu:
        if not isinstance(x, cupy.ndarray) or x.dtype != acc:
            with cupy.cuda.Device(device):
                x = cupy.asarray(x, dtype=acc)
        elif any(s < 0 or s % x.itemsize for s in x.strides):
            with cupy.cuda.Device(device):
                x = cupy.ascontiguousarray(x)
        return x
    return x.astype(acc, copy=False)


def check_pairwise(name: str, values, prob: "Problem", device=None):
    """``values`` (``bias``: real numbers, ``mask``: bools, one per (query, key) pair) as the kernels (or
    the NumPy path) read them: None, or an array of the inputs' kind (on their device) of at least two
    dims whose shape broadcasts to ``(*batch, Nq, Nk)`` (fewer dims gain leading ones, a view). On the
    GPU a bias is read in the inputs' dtype: another dtype, or a NumPy array, is converted (a copy of
    its own shape, never of the broadcast one); any strides are read in place."""
    if values is None:
        return None
    cupy = _cupy()
    on_gpu = prob.xp is not numpy
    x = _given_array(name, values, on_gpu, device)
    if name == "mask" and x.dtype != numpy.bool_:
        raise TypeError(f"mask must be a bool array (True = visible), got dtype {x.dtype}")
    if name != "mask":
        _check_real(name, x)
    full = (*prob.batch_shape, prob.Nq, prob.Nk)
    try:
        fits = numpy.broadcast_shapes(x.shape, full) == full
    except ValueError:
        fits = False
    if not fits:
        raise ValueError(f"{name} of shape {x.shape} does not broadcast to (*batch, Nq, Nk) = {full}")
    if x.ndim < 2:
        x = x.reshape((1,) * (2 - x.ndim) + x.shape)
    if not on_gpu:
        return x
    with cupy.cuda.Device(device):
        if name != "mask" and (not isinstance(x, cupy.ndarray) or x.dtype != prob.dtype):
            return cupy.asarray(x, dtype=prob.dtype)
        if not isinstance(x, cupy.ndarray):
            return cupy.asarray(x)
        # the kernels take the query and key strides as int32 (score_mod.cuh: Pairs)
        if any(s % x.itemsize for s in x.strides) or any(abs(s // x.itemsize) >= 2**31 for s in x.strides[-2:]):
            return cupy.ascontiguousarray(x)
    return x


def check_splits(num_splits, schedule: str):
    """``num_splits``: None or an int >= 1; more than 1 runs the V2 schedule, so not with ``schedule='v1'``."""
    if num_splits is None:
        return None
    if isinstance(num_splits, (bool, numpy.bool_)) or not isinstance(num_splits, (int, numpy.integer)):
        raise TypeError(f"num_splits must be an int or None, got {type(num_splits).__name__}")
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    if num_splits > 1 and schedule == "v1":
        raise ValueError(f"num_splits={num_splits} splits the K/V tiles of the V2 schedule: pass schedule='v2' or "
                         "'auto', not 'v1'")
    return int(num_splits)


def check_dropout(dropout_p, seed, q=None) -> tuple:
    """``(p, seed)`` of dropout, validated: ``dropout_p`` a real number in [0, 1) (not so close to 1 that
    round(p 2^32), the kernels' threshold, leaves 32 bits), and for p > 0 a seed (``check_seed``; a device
    seed on the device of ``q``, where given); ``(0.0, 0)`` without dropout."""
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float, numpy.integer, numpy.floating)):
        raise TypeError(f"dropout_p must be a real number, got {type(dropout_p).__name__}")
    if not 0 <= dropout_p < 1:
        raise ValueError(f"dropout_p must satisfy 0 <= p < 1, got {dropout_p!r}")
    if not dropout_p:
        return 0.0, 0
    if int(keep_threshold(float(dropout_p))) >= 2**32:
        raise ValueError(f"dropout_p must be below 1 - 2^-33, got {dropout_p!r}")
    seed = check_seed(seed)
    if not isinstance(seed, int) and q is not None:
        if isinstance(q, numpy.ndarray):
            raise TypeError("seed is a cupy.ndarray but q, k, v are NumPy arrays: pass an int or a NumPy array")
        if seed.device.id != q.device.id:
            raise ValueError(f"seed is on device {seed.device.id}, q on device {q.device.id}")
    return float(dropout_p), seed


def check_seed(seed):
    """Dropout's seed as the kernels take it: an int in [0, 2^64), from an int or from an array that holds
    it, one uint64 or two uint32 words (the low word first: ``jax.random.key_data`` of a key), NumPy's
    read here; a CuPy array of those is a device seed, kept as it is (read by the kernels as they run,
    so a captured graph or a jitted step draws a new seed from the same call), C-contiguous and
    8-byte aligned."""
    if isinstance(seed, (int, numpy.integer)) and not isinstance(seed, bool):
        if not 0 <= seed < 2**64:
            raise ValueError(f"dropout_p > 0 needs an int seed in [0, 2^64), got {seed!r}")
        return int(seed)
    shape = getattr(seed, "shape", None)
    dtype = getattr(seed, "dtype", None)
    words = {numpy.dtype(numpy.uint64): 1, numpy.dtype(numpy.uint32): 2}.get(dtype)
    if shape is None or words is None or math.prod(shape) != words:
        seen = repr(seed) if shape is None else f"an array of shape {shape}, dtype {dtype}"
        raise ValueError("dropout_p > 0 needs an int seed in [0, 2^64), or an array of one uint64 or two uint32 "
                         f"words (the low one first), got {seen}")
    if isinstance(seed, numpy.ndarray):
        return seed_value(seed)
    cupy = _cupy()
    if cupy is None or not isinstance(seed, cupy.ndarray):
        raise TypeError(f"seed must be an int, a NumPy or a CuPy array, got {type(seed).__name__}")
    if not seed.flags.c_contiguous or seed.data.ptr % 8:
        raise ValueError("a CuPy seed must be C-contiguous and 8-byte aligned (the kernels read it as one uint64)")
    return seed


def seed_value(seed) -> int:
    """The int of a seed ``check_seed`` took (a CuPy one read back to the host: the CPU path's)."""
    if isinstance(seed, int):
        return seed
    words = numpy.asarray(seed.get() if hasattr(seed, "get") else seed).reshape(-1)
    return int(words[0]) if words.dtype == numpy.uint64 else int(words[0]) | int(words[1]) << 32


def with_softcap(prob: "Problem", softcap) -> "Problem":
    """``prob`` with its validated ``softcap``."""
    return replace(prob, softcap=check_softcap(softcap, prob.dtype))


def check_forward(q, k, v, causal, softmax_scale, window=None, supported=SUPPORTED_DTYPES) -> Problem:
    """Validate ``q, k, v`` and the flags of a forward call (of one of the ``supported`` dtypes)."""
    xp = array_module({"q": q, "k": k, "v": v})
    dtypes = {name: x.dtype for name, x in (("q", q), ("k", k), ("v", v))}
    for name, dt in dtypes.items():
        if dt.name not in supported or not dt.isnative:
            raise TypeError(f"{name} has dtype {dt}; supported (native byte order): {', '.join(supported)}")
    if len(set(dtypes.values())) > 1:
        raise TypeError("q, k, v must share one dtype, got " + ", ".join(f"{n}: {d}" for n, d in dtypes.items()))
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim < 2:
            raise ValueError(f"{name} must have shape (..., N, D), got shape {x.shape}")
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(f"k and v must have the same number of keys Nk, got k {k.shape} and v {v.shape}")
    D = q.shape[-1]
    if k.shape[-1] != D or v.shape[-1] != D:
        raise ValueError(f"q, k, v must share the head dim D, got q {q.shape}, k {k.shape}, v {v.shape}")
    if not 1 <= D <= MAX_HEAD_DIM:
        raise ValueError(f"head dim D must be in [1, {MAX_HEAD_DIM}], got D={D} (q {q.shape})")
    try:
        batch_shape = numpy.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    except ValueError:
        raise ValueError(f"batch dims of q {q.shape}, k {k.shape}, v {v.shape} do not broadcast") from None
    check_bool("causal", causal)
    if softmax_scale is None:
        scale = 1.0 / math.sqrt(D)
    else:
        real = (int, float, numpy.integer, numpy.floating)
        if isinstance(softmax_scale, (bool, numpy.bool_)) or not isinstance(softmax_scale, real):
            raise TypeError(f"softmax_scale must be a real number or None, got {type(softmax_scale).__name__}")
        try:
            scale = float(softmax_scale)
        except OverflowError:
            scale = math.inf
        # the kernels multiply in float32 (float64 for float64 inputs): the scale must be finite there
        limit = numpy.finfo(numpy.float32 if q.dtype.name in FLOAT8_DTYPES else accumulator_dtype(q.dtype)).max
        if not math.isfinite(scale) or abs(scale) * LOG2E > limit:
            raise ValueError(f"softmax_scale must be finite in the accumulator precision, got {softmax_scale}")
    if xp is not numpy:
        devices = {name: x.device.id for name, x in (("q", q), ("k", k), ("v", v))}
        if len(set(devices.values())) > 1:
            raise ValueError("q, k, v are on different devices: " + ", ".join(f"{n}: {d}" for n, d in devices.items()))
    return Problem(xp, q.dtype, tuple(batch_shape), q.shape[-2], k.shape[-2], D, scale, bool(causal),
                   check_window(window))


def check_backward(do, q, k, v, o, m, l, causal, softmax_scale, window=None) -> Problem:
    """Validate a backward call: ``q, k, v`` as in the forward, then ``do, o, m, l`` against them."""
    array_module({"do": do, "q": q, "k": k, "v": v, "o": o, "m": m, "l": l})
    prob = check_forward(q, k, v, causal, softmax_scale, window)
    out_shape = (*prob.batch_shape, prob.Nq, prob.D)
    stats_shape = (*prob.batch_shape, prob.Nq)
    for name, x in (("do", do), ("o", o)):
        if x.dtype != prob.dtype:
            raise TypeError(f"{name} must have the dtype of q ({prob.dtype}), got {x.dtype}")
        if x.shape != out_shape:
            raise ValueError(f"{name} must have the output shape {out_shape}, got {x.shape}")
    stats_dtype = accumulator_dtype(prob.dtype)
    for name, x in (("m", m), ("l", l)):
        if x.dtype != stats_dtype:
            raise TypeError(f"{name} must be {stats_dtype} for {prob.dtype} inputs, got {x.dtype}")
        if x.shape != stats_shape:
            raise ValueError(f"{name} must have shape {stats_shape} (batch..., Nq), got {x.shape}")
    if prob.xp is not numpy:
        for name, x in (("do", do), ("o", o), ("m", m), ("l", l)):
            if x.device.id != q.device.id:
                raise ValueError(f"{name} is on device {x.device.id}, q on device {q.device.id}")
    return prob


OUT_ALIGNMENT = 16   # bytes: the kernels store whole vectors into o, dq, dk, dv


def _extent(x, cupy_ndarray=None) -> tuple[int, int]:
    """Bytes [lo, hi) of memory that ``x`` can touch (0, 0 when it holds nothing: an empty array, or
    an input that is not an array, such as a number or a list of slopes, which the call converts);
    ``cupy_ndarray`` CuPy's array type where CuPy is imported."""
    is_array = isinstance(x, numpy.ndarray) or (cupy_ndarray is not None and isinstance(x, cupy_ndarray))
    if not is_array or x.size == 0:
        return 0, 0
    if type(x) is cupy_ndarray and x.flags.c_contiguous:   # the usual case: outputs, a kept plan's inputs
        return x.data.ptr, x.data.ptr + x.nbytes
    lo = hi = x.ctypes.data if isinstance(x, numpy.ndarray) else x.data.ptr
    for s, n in zip(x.strides, x.shape):
        if s > 0:
            hi += s * (n - 1)
        elif s < 0:
            lo += s * (n - 1)
    return lo, hi + x.itemsize


def check_disjoint(out, names, inputs: dict):
    """ValueError when an ``out`` array shares memory with another or with an input. (Run on every call
    with ``out``, a kept plan's too: the labels are made only for the message.)"""
    cupy = sys.modules.get("cupy")   # not imported: no CuPy array exists
    cupy_ndarray = cupy.ndarray if cupy is not None else None
    extents = [_extent(x, cupy_ndarray) for x in out]
    extents += [_extent(x, cupy_ndarray) for x in inputs.values()]
    for i in range(len(out)):
        lo, hi = extents[i]
        for j in range(i + 1, len(extents)):
            if lo < extents[j][1] and extents[j][0] < hi:
                labels = [f"out[{n}] ({name})" for n, name in enumerate(names)] + list(inputs)
                raise ValueError(f"{labels[i]} overlaps {labels[j]} in memory")


def check_out(out, names, shapes, dtypes, xp, device, inputs: dict) -> tuple:
    """Validate ``out=``: one C-contiguous array per output, of exactly its shape and dtype, of the
    inputs' kind (and device, 16-byte aligned, on the GPU), writeable, sharing memory with nothing."""
    if not isinstance(out, (tuple, list)) or len(out) != len(names):
        raise TypeError(f"out must be a tuple of {len(names)} arrays ({', '.join(names)}), got {type(out).__name__}")
    kind = numpy.ndarray if xp is numpy else xp.ndarray
    for i, (x, name, shape, dtype) in enumerate(zip(out, names, shapes, dtypes)):
        label = f"out[{i}] ({name})"
        if not isinstance(x, kind):
            raise TypeError(f"{label} must be a {kind.__module__}.ndarray like the inputs, got {type(x).__name__}")
        if x.dtype != dtype:
            raise TypeError(f"{label} must have dtype {dtype}, got {x.dtype}")
        if x.shape != tuple(shape):
            raise ValueError(f"{label} must have shape {tuple(shape)}, got {x.shape}")
        if not x.flags.c_contiguous:
            raise ValueError(f"{label} must be C-contiguous (strides {x.strides} for shape {x.shape})")
        if xp is numpy:
            if not x.flags.writeable:
                raise ValueError(f"{label} is read-only")
        else:
            if x.device.id != device:
                raise ValueError(f"{label} is on device {x.device.id}, the inputs on device {device}")
            if x.data.ptr % OUT_ALIGNMENT:
                raise ValueError(f"{label} must start on a {OUT_ALIGNMENT}-byte boundary (address {x.data.ptr:#x})")
    check_disjoint(out, names, inputs)
    return tuple(out)


def readable_in_place(x) -> bool:
    """The kernels can read ``x`` through its strides: last axis contiguous, every stride a
    non-negative multiple of the item size (zero strides, broadcast views, included)."""
    itemsize = x.itemsize
    return x.size == 0 or ((x.shape[-1] == 1 or x.strides[-1] == itemsize)
                           and all(s >= 0 and s % itemsize == 0 for s in x.strides))


def kernel_ready(x):
    """``x`` itself when ``readable_in_place``, else a C-contiguous copy."""
    if readable_in_place(x):
        return x
    import cupy

    return cupy.ascontiguousarray(x)


__all__ = ["OUT_ALIGNMENT", "Problem", "SCHEDULES", "array_module", "check_backward", "check_bool",
           "check_choice", "check_per_entry", "check_softcap", "with_softcap",
           "check_disjoint", "check_forward", "check_out", "dtype_name", "kernel_ready", "readable_in_place"]


@dataclass(frozen=True)
class Seqlens:
    """Validated offsets of packed variable-length sequences."""

    cu_q: object          # the offsets as the kernels (int32, on the inputs' device) or the NumPy path read them
    cu_k: object
    n: int                # sequences
    max_q: int            # the longest sequence's query rows and keys
    max_k: int
    checked: bool         # their values were read and checked on the host (not for CuPy offsets with both maxima)


INT32_MAX = 2**31 - 1


def _check_max(name: str, value, longest, total: int) -> int:
    """``max_seqlen_q``/``_k``: None (the longest sequence's, read from the offsets) or an int bounding it."""
    if value is None:
        return longest
    if isinstance(value, (bool, numpy.bool_)) or not isinstance(value, (int, numpy.integer)):
        raise TypeError(f"{name} must be an int or None, got {type(value).__name__}")
    if value < 0 or (longest is not None and value < longest):
        raise ValueError(f"{name}={value} must be >= 0 and at least the longest sequence's length"
                         + (f" ({longest})" if longest is not None else ""))
    return min(int(value), total)


def check_offset_shapes(cu_seqlens_q, cu_seqlens_k):
    """The offsets of packed sequences are 1-D integer arrays of one length ``n + 1`` (any arrays with a
    shape and a dtype: traced ones too, whose values are not read)."""
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if cu.ndim != 1 or cu.size < 1 or numpy.dtype(cu.dtype).kind not in "iu":
            raise ValueError(f"{name} must be a 1-D integer array of n_seq + 1 offsets, got shape "
                             f"{tuple(cu.shape)}, dtype {cu.dtype}")
    if cu_seqlens_q.size != cu_seqlens_k.size:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must hold the same number of sequences, "
                         f"got shapes {tuple(cu_seqlens_q.shape)} and {tuple(cu_seqlens_k.shape)}")


def check_seqlens(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, prob: Problem, device=None) -> Seqlens:
    """Offsets of packed sequences for q of ``prob.Nq`` rows and k, v of ``prob.Nk``: 1-D integer arrays of
    one length ``n + 1``, 0 first, nondecreasing, the totals last. NumPy offsets are read and checked on
    the host (and copied to the GPU for CuPy inputs); CuPy offsets are copied to the host for that (a
    synchronisation) unless both ``max_seqlen_*`` are given, in which case their values are not checked."""
    from ._numpy_ops import packed_spans

    cupy = _cupy()
    on_gpu = prob.xp is not numpy
    arrays = {"cu_seqlens_q": cu_seqlens_q, "cu_seqlens_k": cu_seqlens_k}
    for name, cu in arrays.items():
        if not _is_cupy_of_inputs(name, cu, on_gpu, device) and not isinstance(cu, numpy.ndarray):
            raise TypeError(f"{name} must be a numpy.ndarray or cupy.ndarray of int32 offsets, got {type(cu).__name__}")
    check_offset_shapes(cu_seqlens_q, cu_seqlens_k)
    for name, total in (("q", prob.Nq), ("k", prob.Nk)):
        if total > INT32_MAX:
            raise ValueError(f"packed {name} has {total} rows; the offsets are int32 (at most {INT32_MAX})")
    n = cu_seqlens_q.size - 1
    read = not (on_gpu and max_seqlen_q is not None and max_seqlen_k is not None
                and all(isinstance(cu, cupy.ndarray) for cu in arrays.values()))
    longest = [None, None]
    if read:
        host = [cu if isinstance(cu, numpy.ndarray) else cu.get() for cu in arrays.values()]
        spans = packed_spans(*host, prob.Nq, prob.Nk)
        longest = [max((s.stop - s.start for s in side), default=0) for side in zip(*spans)] if spans else [0, 0]
    max_q = _check_max("max_seqlen_q", max_seqlen_q, longest[0], prob.Nq)
    max_k = _check_max("max_seqlen_k", max_seqlen_k, longest[1], prob.Nk)
    if on_gpu:
        with cupy.cuda.Device(device):
            cu_q, cu_k = (cupy.ascontiguousarray(cupy.asarray(cu, dtype=numpy.int32)) for cu in arrays.values())
    else:
        cu_q, cu_k = cu_seqlens_q, cu_seqlens_k
    return Seqlens(cu_q, cu_k, n, max_q, max_k, read)
