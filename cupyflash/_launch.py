"""Shapes to launches: grids, workspaces and kernel arguments.

Inputs reach this module validated (``_checks``): CuPy arrays of one dtype on
the current device, last axis contiguous, non-negative element strides, and a
broadcast batch shape. Batch dims are collapsed to at most three (the kernels
index them as ``b0 * s0 + b1 * s1 + b2 * s2``, a zero stride along a
broadcast dim); ``collapse_batch`` returns None when that is impossible and the
caller peels a batch dim off in Python.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy

from ._compile import get_kernels
from ._tiles import BWD_SM90_MAX_HEAD_DIM, TileConfig, accumulator_dtype, choose_tiles

MAX_BATCH_DIMS = 3  # collapsed batch dims a kernel indexes (flash_common.cuh: split_batch)
VECTOR_BYTES = 16   # width of the vectorised tile loads
PREP_LANES, PREP_THREADS = 8, 256   # flash_bwd_prep_v1: threads per row, per block
CONVERT_THREADS = 256


@dataclass(frozen=True)
class BatchLayout:
    """Collapsed batch dims ``sizes`` = (n0, n1, n2) and, per tensor, its element strides along them."""

    sizes: tuple[int, int, int]
    strides: tuple[tuple[int, int, int], ...]

    @property
    def count(self) -> int:
        return self.sizes[0] * self.sizes[1] * self.sizes[2]


def element_strides(x) -> tuple[int, ...]:
    return tuple(s // x.itemsize for s in x.strides)


def batch_strides(shape, strides, batch_shape) -> tuple[int, ...]:
    """Strides of a tensor along the broadcast batch dims (0 where it broadcasts)."""
    nb = len(batch_shape)
    own = len(shape) - 2
    out = []
    for axis in range(nb):
        src = axis - (nb - own)
        out.append(0 if src < 0 or shape[src] == 1 else strides[src])
    return tuple(out)


def contiguous_strides(shape) -> tuple[int, ...]:
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= n
    return tuple(reversed(out))


def collapse_batch(batch_shape, tensor_strides) -> BatchLayout | None:
    """Merge batch dims until at most ``MAX_BATCH_DIMS`` remain.

    Parameters
    ----------
    batch_shape : tuple of int
        Broadcast batch shape.
    tensor_strides : sequence of tuple of int
        Each tensor's strides along ``batch_shape`` (from ``batch_strides``).

    Returns
    -------
    BatchLayout or None
        None when more than ``MAX_BATCH_DIMS`` dims cannot be merged.
    """
    dims = [(n, [s[a] for s in tensor_strides]) for a, n in enumerate(batch_shape) if n != 1]
    merged: list = []
    for n, strides in dims:
        if merged:
            pn, ps = merged[-1]
            if all(p == s * n for p, s in zip(ps, strides)):
                merged[-1] = (pn * n, strides)
                continue
        merged.append((n, strides))
    if len(merged) > MAX_BATCH_DIMS:
        return None
    while len(merged) < MAX_BATCH_DIMS:
        merged.insert(0, (1, [0] * len(tensor_strides)))
    sizes = tuple(n for n, _ in merged)
    per_tensor = tuple(tuple(merged[a][1][t] for a in range(MAX_BATCH_DIMS)) for t in range(len(tensor_strides)))
    return BatchLayout(sizes, per_tensor)


@dataclass(frozen=True)
class DeviceLimits:
    """What the launches need to know of a device."""

    compute_capability: str   # e.g. "90"
    smem_block: int           # shared memory a block may opt in to (bytes)
    smem_sm: int              # shared memory per multiprocessor (bytes)
    sms: int                  # multiprocessors
    l2_bytes: int             # L2 cache


@lru_cache(maxsize=None)
def _device_limits(device_id: int) -> DeviceLimits:
    import cupy

    device = cupy.cuda.Device(device_id)
    attrs = device.attributes
    return DeviceLimits(device.compute_capability, attrs["MaxSharedMemoryPerBlockOptin"],
                        attrs["MaxSharedMemoryPerMultiprocessor"], attrs["MultiProcessorCount"], attrs["L2CacheSize"])


def current_limits() -> DeviceLimits:
    import cupy

    return _device_limits(cupy.cuda.Device().id)


def device_tiles(kernel: str, head_dim: int, dtype) -> TileConfig:
    """``choose_tiles`` for the current device."""
    return choose_tiles(kernel, head_dim, dtype, current_limits().smem_block)


# A group of heads whose tensors take at most this share of L2 runs side by side (flash_common.cuh: grid_tile)
L2_SHARE = 0.5


def head_group(heads: int, bytes_per_head: int) -> numpy.int32:
    """Heads per group of the grid order (``grid_tile``): as many as fit ``L2_SHARE`` of L2, one at least."""
    fit = int(current_limits().l2_bytes * L2_SHARE) // max(1, bytes_per_head)
    return numpy.int32(min(max(1, fit), heads))


def forward_schedule(schedule: str, head_dim: int, dtype) -> str:
    """The forward kernel a validated ``schedule`` runs: 'v1' or 'v2'.

    'auto' is V2 for 16-bit inputs, measured about twice as fast as V1 on an
    H200 (benchmarks/RESULTS.md), and V1 for float32 and float64, whose V2
    kernels keep O_i in registers and spill at large head dims (ptxas report;
    their speeds are not yet compared). 'v2' runs V1 where V2's tiles do not
    fit the device.
    """
    if schedule == "auto":
        schedule = "v2" if numpy.dtype(dtype).itemsize == 2 else "v1"
    if schedule == "v2":
        try:
            device_tiles("fwd_v2", head_dim, dtype)
        except ValueError:
            return "v1"
    return schedule


# Run the V2 forward and backward of 16-bit inputs on Hopper's warpgroup MMA (flash_fwd_v2_sm90.cu,
# flash_bwd_sm90.cu) on sm_90 devices. Tests and the benchmark turn it off to reach the portable
# mma.sync kernels there.
USE_WGMMA = True


def _hopper(dtype) -> bool:
    """The Hopper kernels take ``dtype`` on the current device."""
    return USE_WGMMA and numpy.dtype(dtype).itemsize == 2 and current_limits().compute_capability == "90"


def forward_kernel(schedule: str, dtype, scale: float = 1.0) -> str:
    """The kernel of a forward ``schedule`` ('v1' or 'v2') for ``dtype`` on the current device.

    The Hopper kernel takes the row max of raw scores, so it needs ``scale > 0``; a zero or
    negative scale runs the portable V2 kernel.
    """
    if schedule == "v2" and scale > 0 and _hopper(dtype):
        return "fwd_v2_sm90"
    return f"fwd_{schedule}"


def _vector_ok(arrays, head_dim: int) -> bool:
    """16-byte tile loads are safe: aligned base, rows and batch strides; whole vectors per row."""
    itemsize = arrays[0].itemsize
    if head_dim % (VECTOR_BYTES // itemsize):
        return False
    for x in arrays:
        if x.data.ptr % VECTOR_BYTES or any(s % VECTOR_BYTES for s in x.strides[:-1]):
            return False
    return True


def _strides4(x, layout_strides) -> tuple:
    """Kernel stride arguments (s0, s1, s2, row) as int64."""
    return tuple(numpy.int64(s) for s in layout_strides) + (numpy.int64(element_strides(x)[-2]),)


@lru_cache(maxsize=1024)
def choose_splits(heads: int, T_r: int, slots: int) -> int:
    """Q-tile splits per (batch, head) for the V1 forward grid.

    Each CTA walks ``ceil(T_r / n)`` Q tiles and ``heads * n`` CTAs run in
    ``ceil(heads * n / slots)`` waves; take the ``n`` with the fewest tile
    steps in total, the smallest on ties (every split re-reads K and V).
    """
    return min(range(1, T_r + 1), key=lambda n: (-(-heads * n // slots)) * (-(-T_r // n)))


def forward(q, k, v, *, schedule: str, causal: bool, scale: float, batch_shape, layout: BatchLayout):
    """Launch the ``schedule`` ('v1' or 'v2') forward on validated inputs; returns ``(o, m, l)``."""
    import cupy

    Nq, D = q.shape[-2:]
    Nk = k.shape[-2]
    BH = layout.count
    acc = accumulator_dtype(q.dtype)
    cfg = device_tiles(forward_kernel(schedule, q.dtype, scale), D, q.dtype)
    kernel = get_kernels(cfg)[f"flash_{cfg.kernel}"]

    o = cupy.empty((*batch_shape, Nq, D), q.dtype)
    m = cupy.empty((*batch_shape, Nq), acc)
    l = cupy.empty((*batch_shape, Nq), acc)
    T_r = -(-Nq // cfg.block_r)
    strides = (*_strides4(q, layout.strides[0]), *_strides4(k, layout.strides[1]), *_strides4(v, layout.strides[2]),
               numpy.int64(layout.sizes[1]), numpy.int64(layout.sizes[2]))
    sizes = (numpy.int32(Nq), numpy.int32(Nk), numpy.int32(D), acc.type(scale))
    flags = (numpy.int32(causal), numpy.int32(_vector_ok((q, k, v), D)))
    if schedule == "v2":   # fwd_v2 and fwd_v2_sm90 take the same arguments; the Q tiles of a head share K, V
        group = head_group(BH, 2 * Nk * D * q.itemsize)
        kernel((BH * T_r,), (cfg.threads,), (q, k, v, o, m, l, *strides, group, *sizes, *flags),
               shared_mem=cfg.smem_bytes)
        return o, m, l

    # V1: the running O_i between outer steps (with a single K/V tile every step is the last)
    o_run = cupy.empty((BH, Nq, cfg.d_pad), acc) if Nk > cfg.block_c else m
    limits = current_limits()
    slots = limits.sms * max(1, min(4, limits.smem_sm // cfg.smem_bytes))   # CTAs resident at once
    n_splits = choose_splits(BH, T_r, slots)
    kernel((BH * n_splits,), (cfg.threads,), (q, k, v, o, o_run, m, l, *strides, *sizes, numpy.int32(n_splits), *flags),
           shared_mem=cfg.smem_bytes)
    return o, m, l


def backward_kernel(schedule: str, dtype, head_dim: int) -> str:
    """The main kernel of a backward ``schedule`` for ``dtype`` and ``head_dim`` on the current device."""
    if schedule != "v1" and head_dim <= BWD_SM90_MAX_HEAD_DIM and _hopper(dtype):
        return "bwd_sm90"
    return "bwd_v1"


def backward(do, q, k, v, o, m, l, *, schedule: str, causal: bool, scale: float, batch_shape, layout: BatchLayout):
    """Launch the backward of ``schedule`` on validated inputs; returns ``(dq, dk, dv)``.

    ``layout.strides`` holds, in order, q, k, v, o, do and the contiguous
    own-shape layouts of dq, dk, dv. The preparation (D_i) and conversion
    kernels are the V1 module's; the main kernel is ``backward_kernel``'s.
    """
    import cupy

    Nq, D = q.shape[-2:]
    Nk = k.shape[-2]
    BH = layout.count
    acc = accumulator_dtype(q.dtype)
    cfg = device_tiles("bwd_v1", D, q.dtype)
    kernels = get_kernels(cfg)
    main_cfg = device_tiles(backward_kernel(schedule, q.dtype, D), D, q.dtype)
    main = get_kernels(main_cfg)[f"flash_{main_cfg.kernel}"]
    s_q, s_k, s_v, s_o, s_do, s_dq, s_dk, s_dv = layout.strides
    n1, n2 = numpy.int64(layout.sizes[1]), numpy.int64(layout.sizes[2])

    # D_i = rowsum(dO_i o O_i) and the statistics the main kernel reads: m_i and 1 / l_i (bwd_v1),
    # lse_i log2 e (bwd_sm90)
    m = cupy.ascontiguousarray(m)
    l = cupy.ascontiguousarray(l)
    lse_stats = main_cfg.kernel == "bwd_sm90"
    d_sum = cupy.empty((BH, Nq), acc)
    stats = tuple(cupy.empty((BH, Nq), acc) for _ in range(1 if lse_stats else 2))
    m_b, inv_l, lse2 = (d_sum, d_sum, *stats) if lse_stats else (*stats, d_sum)   # d_sum where not written
    rows = BH * Nq
    kernels["flash_bwd_prep_v1"](
        (-(-rows * PREP_LANES // PREP_THREADS),), (PREP_THREADS,),
        (o, do, m, l, m_b, inv_l, lse2, d_sum, *_strides4(o, s_o), *_strides4(do, s_do),
         n1, n2, numpy.int64(rows), numpy.int32(Nq), numpy.int32(D),
         numpy.int32(_vector_ok((o, do), D)), numpy.int32(lse_stats)))

    # dK, dV are stored directly unless several batch entries share one K/V head
    kv_atomic = math.prod(k.shape[:-2]) < BH or math.prod(v.shape[:-2]) < BH
    dq_acc = cupy.zeros(q.shape, acc)
    if kv_atomic:
        dk_acc, dv_acc = cupy.zeros(k.shape, acc), cupy.zeros(v.shape, acc)
        dk_out, dv_out = q, q   # not written
    else:
        dk_out, dv_out = cupy.empty(k.shape, q.dtype), cupy.empty(v.shape, q.dtype)
        dk_acc, dv_acc = dq_acc, dq_acc   # not written
    T_c = -(-Nk // main_cfg.block_c)
    n_chunks = -(-D // main_cfg.d_chunk)
    # the K/V tiles of a head share Q, dO, the statistics and the dQ workspace
    group = head_group(BH, Nq * (D * (2 * q.itemsize + acc.itemsize) + 2 * acc.itemsize) + 2 * Nk * D * q.itemsize)
    main(
        (BH * T_c * n_chunks,), (main_cfg.threads,),
        (q, k, v, do, *stats, d_sum,
         dq_acc, dk_out, dv_out, dk_acc, dv_acc,
         *_strides4(q, s_q), *_strides4(k, s_k), *_strides4(v, s_v), *_strides4(do, s_do),
         *(numpy.int64(s) for s in s_dq), *(numpy.int64(s) for s in s_dk), *(numpy.int64(s) for s in s_dv),
         n1, n2, group, numpy.int32(Nq), numpy.int32(Nk), numpy.int32(D),
         acc.type(scale),
         numpy.int32(causal), numpy.int32(_vector_ok((q, k, v, do), D)), numpy.int32(kv_atomic)),
        shared_mem=main_cfg.smem_bytes)

    def to_dtype(x_acc):
        if x_acc.dtype == q.dtype:
            return x_acc
        out = cupy.empty(x_acc.shape, q.dtype)
        n = x_acc.size
        if n:
            blocks = min(max(1, -(-n // (4 * CONVERT_THREADS))), 65535)   # four elements per thread
            kernels["flash_convert"]((blocks,), (CONVERT_THREADS,), (x_acc, out, numpy.int64(n)))
        return out

    dq = to_dtype(dq_acc)
    if kv_atomic:
        return dq, to_dtype(dk_acc), to_dtype(dv_acc)
    return dq, dk_out, dv_out
