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
import sys
from dataclasses import dataclass, replace
from functools import lru_cache

import numpy

from ._compile import get_kernels
from ._tiles import BWD_SM90_MAX_HEAD_DIM, REPAIR_WARPS, TileConfig, accumulator_dtype, choose_tiles

MAX_BATCH_DIMS = 3  # collapsed batch dims a kernel indexes (flash_common.cuh: split_batch)
VECTOR_BYTES = 16   # width of the vectorised tile loads
PREP_LANES, PREP_THREADS = 8, 256   # flash_bwd_prep_v1: threads per row, per block
CONVERT_THREADS = 256
NULL = numpy.uint64(0)   # a null pointer argument


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

    The Hopper kernel takes the row max of raw scores, so it needs ``scale > 0`` as the kernel reads
    it, in float32: a zero, negative or underflowing scale runs the portable V2 kernel.
    """
    if schedule == "v2" and numpy.float32(scale) > 0 and _hopper(dtype):
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


def capturing(stream=None) -> bool:
    """``stream`` (default: CuPy's current one) is being captured into a CUDA graph."""
    import cupy

    stream = cupy.cuda.get_current_stream() if stream is None else stream
    return stream.ptr != 0 and stream.is_capturing()   # the legacy stream is never captured


def workspace_allocator():
    """``cupy.empty`` for a call's workspaces, or, while the current stream is being captured into a
    CUDA graph, an allocator of stream-ordered memory (cudaMallocAsync, freed with the workspace):
    inside a capture both become nodes of the graph, so its replays own their workspaces. The pool's
    blocks would pass to the next caller once the call returns, while the graph still used them."""
    import cupy

    stream = cupy.cuda.get_current_stream()
    if not capturing(stream):
        return cupy.empty

    def empty(shape, dtype):
        dtype = numpy.dtype(dtype)
        mem = cupy.cuda.memory.MemoryAsync(math.prod(shape) * dtype.itemsize, stream)
        return cupy.ndarray(shape, dtype, memptr=cupy.cuda.MemoryPointer(mem, 0))

    return empty


def _copy_into(target, x):
    target[...] = x
    return target


ZEROED_ALIGN = 256   # bytes: each array ``zeroed`` carves out starts at a multiple of this


def zeroed(workspace, parts) -> list:
    """Zeroed arrays of ``parts`` ((shape, dtype) pairs), carved out of one ``workspace`` buffer and
    cleared by one memset rather than one launch each."""
    if not parts:
        return []
    sizes = [-(-math.prod(shape) * numpy.dtype(dtype).itemsize // ZEROED_ALIGN) * ZEROED_ALIGN
             for shape, dtype in parts]
    buffer = workspace((sum(sizes),), numpy.uint8)
    buffer.fill(0)
    arrays, at = [], 0
    for (shape, dtype), size in zip(parts, sizes):
        n = math.prod(shape) * numpy.dtype(dtype).itemsize
        arrays.append(buffer[at:at + n].view(dtype).reshape(shape))
        at += size
    return arrays


@dataclass(frozen=True)
class Repair:
    """flash_fwd_repair or flash_bwd_repair (flash_repair.cu) over ``flags`` uint32 repair flags."""

    kernel: object            # cupy.RawKernel
    flags: int
    grid: int
    scalars: tuple            # the kernel's arguments after its arrays

    def launch(self, arrays):
        self.kernel((self.grid,), (32 * REPAIR_WARPS,), tuple(arrays) + self.scalars)


def repair_plan(name: str, head_dim: int, dtype, flags: int, scalars: tuple) -> Repair:
    """``flash_{name}_repair`` over ``flags`` flags: a CTA per flag, at most four per SM, each reading
    its share of the flags 256 at a time."""
    kernel = get_kernels(device_tiles("repair", head_dim, dtype))[f"flash_{name}_repair"]
    return Repair(kernel, flags, min(flags, 4 * current_limits().sms), scalars)


@dataclass(frozen=True)
class ForwardPlan:
    """A forward launch with everything but its arrays settled; ``plan(q, k, v)`` returns ``(o, m, l)``."""

    kernel: object            # cupy.RawKernel
    device: int
    grid: int
    threads: int
    smem_bytes: int
    dtype: numpy.dtype
    acc: numpy.dtype          # of m, l and the running O_i
    o_shape: tuple            # (*batch, Nq, D)
    v1: bool                  # the V1 kernel, which takes a running O_i after o
    tile_counter: bool        # the persistent Hopper kernel, which takes a zeroed tile counter after l
    o_run_shape: tuple | None   # V1's running O_i (BH, Nq, d_pad); None with a single K/V tile (m stands in)
    scalars: tuple            # the kernel's arguments after its arrays
    repair: Repair | None     # causal: flash_fwd_repair over the kernel's repair flags, one per Q tile

    def __call__(self, q, k, v, out=None):
        """``(o, m, l)``, in ``out`` (validated: ``_checks.check_out``) when given."""
        import cupy

        acc = self.acc
        with cupy.cuda.Device(self.device):
            if out is None:
                o = cupy.empty(self.o_shape, self.dtype)
                m = cupy.empty(self.o_shape[:-1], acc)
                l = cupy.empty(self.o_shape[:-1], acc)
            else:
                o, m, l = out
            workspace = workspace_allocator()
            if self.v1:
                o_run = m if self.o_run_shape is None else workspace(self.o_run_shape, acc)
                arrays = (q, k, v, o, o_run, m, l)
            else:
                arrays = (q, k, v, o, m, l)
            # the tile counter and the repair flags, zeroed together
            counts = (int(self.tile_counter), self.repair.flags if self.repair else 0)
            counters = zeroed(workspace, [((n,), numpy.uint32) for n in counts if n])
            if self.tile_counter:
                arrays += (counters.pop(0),)
            flags = counters[0] if self.repair else NULL
            self.kernel((self.grid,), (self.threads,), arrays + (flags,) + self.scalars, shared_mem=self.smem_bytes)
            if self.repair:
                self.repair.launch((q, k, v, o, m, l, flags))
        return o, m, l


def forward_plan(q, k, v, *, schedule: str, causal: bool, scale: float, batch_shape, layout: BatchLayout):
    """The ``schedule`` ('v1' or 'v2') forward of validated inputs ``q, k, v`` as a ``ForwardPlan``."""
    Nq, D = q.shape[-2:]
    Nk = k.shape[-2]
    BH = layout.count
    acc = accumulator_dtype(q.dtype)
    cfg = device_tiles(forward_kernel(schedule, q.dtype, scale), D, q.dtype)
    kernel = get_kernels(cfg)[f"flash_{cfg.kernel}"]
    T_r = -(-Nq // cfg.block_r)
    strides = (*_strides4(q, layout.strides[0]), *_strides4(k, layout.strides[1]), *_strides4(v, layout.strides[2]),
               numpy.int64(layout.sizes[1]), numpy.int64(layout.sizes[2]))
    sizes = (numpy.int32(Nq), numpy.int32(Nk), numpy.int32(D), acc.type(scale))
    flags = (numpy.int32(causal), numpy.int32(_vector_ok((q, k, v), D)))
    common = dict(kernel=kernel, device=q.data.device_id, threads=cfg.threads, smem_bytes=cfg.smem_bytes,
                  dtype=q.dtype, acc=acc, o_shape=(*batch_shape, Nq, D))
    # causal: the kernel flags the Q tiles where a masked pair met an inf or NaN, flash_fwd_repair redoes them
    repair = None
    if causal:
        repair = repair_plan("fwd", D, q.dtype, BH * T_r,
                             (*strides, numpy.int64(BH), *sizes, numpy.int32(cfg.block_r), numpy.int32(causal)))
    common.update(repair=repair)
    if schedule == "v2":   # fwd_v2 and fwd_v2_sm90 take the same arguments; the Q tiles of a head share K, V
        group = head_group(BH, 2 * Nk * D * q.itemsize)
        grid, persistent = BH * T_r, cfg.kernel == "fwd_v2_sm90"   # one CTA per tile, or CTAs that claim tiles
        if persistent:
            grid = min(grid, current_limits().sms * cfg.ctas_per_sm)
        return ForwardPlan(grid=grid, v1=False, tile_counter=persistent, o_run_shape=None,
                           scalars=(*strides, group, numpy.int32(BH), *sizes, *flags), **common)
    limits = current_limits()
    slots = limits.sms * max(1, min(4, limits.smem_sm // cfg.smem_bytes))   # CTAs resident at once
    n_splits = choose_splits(BH, T_r, slots)
    # the running O_i between outer steps: with a single K/V tile every step is the last
    o_run_shape = (BH, Nq, cfg.d_pad) if Nk > cfg.block_c else None
    return ForwardPlan(grid=BH * n_splits, v1=True, tile_counter=False, o_run_shape=o_run_shape,
                       scalars=(*strides, *sizes, numpy.int32(n_splits), *flags), **common)


def backward_kernel(schedule: str, dtype, head_dim: int) -> str:
    """The main kernel of a backward ``schedule`` for ``dtype`` and ``head_dim`` on the current device."""
    if schedule != "v1" and head_dim <= BWD_SM90_MAX_HEAD_DIM and _hopper(dtype):
        return "bwd_sm90"
    return "bwd_v1"


@dataclass(frozen=True)
class BackwardPlan:
    """A backward's launches with everything but the arrays settled; ``plan(do, q, k, v, o, m, l)`` returns
    ``(dq, dk, dv)`` (in ``out``, validated by ``_checks.check_out``, when given).

    Three steps: the preparation kernel (D_i and the statistics the main kernel reads), the main
    kernel (dQ into a float32/float64 workspace; dK, dV stored directly, or into workspaces when several
    batch entries share a K/V head) and the conversion of each workspace to the input dtype. Causal,
    the repair of the tiles the main kernel flagged runs between the last two.
    """

    prep: object              # cupy.RawKernel: flash_bwd_prep_v1
    main: object              # cupy.RawKernel: flash_bwd_v1 or flash_bwd_sm90
    convert: object           # cupy.RawKernel: flash_convert
    device: int
    dtype: numpy.dtype
    acc: numpy.dtype          # of the statistics and the workspaces
    rows: tuple               # (BH, Nq): the statistics
    grad_shapes: tuple        # shapes of q, k, v
    lse_stats: bool           # the main kernel reads lse_i log2 e (bwd_sm90), else m_i and 1 / l_i
    kv_atomic: bool           # dK, dV summed over batch entries in workspaces
    turn_shapes: tuple        # deterministic: counters of the ordered adds into dQ (and dK, dV), else ()
    flag_splits: tuple        # causal: repair flags of the dQ tiles and of the dK, dV tiles (counts), else ()
    repair: Repair | None     # causal: flash_bwd_repair over those flags
    prep_grid: int
    prep_scalars: tuple
    main_grid: int
    main_threads: int
    main_smem_bytes: int
    main_scalars: tuple

    def __call__(self, do, q, k, v, o, m, l, out=None):
        import cupy

        acc = self.acc
        with cupy.cuda.Device(self.device):
            # every buffer first: a call that does not fit raises OutOfMemoryError before any launch
            workspace = workspace_allocator()
            m, l = (x if x.flags.c_contiguous else _copy_into(workspace(x.shape, x.dtype), x) for x in (m, l))
            d_sum = workspace(self.rows, acc)
            stats = tuple(workspace(self.rows, acc) for _ in range(1 if self.lse_stats else 2))
            m_b, inv_l, lse2 = (d_sum, d_sum, *stats) if self.lse_stats else (*stats, d_sum)   # d_sum: not written
            grads = tuple(cupy.empty(s, self.dtype) for s in self.grad_shapes) if out is None else out
            # dQ, and dK, dV where several batch entries share a K/V head, are sums: in the gradients
            # themselves when they are of the accumulator dtype, else in workspaces converted at the end.
            # Those workspaces, the turn counters and the repair flags are zeroed with one memset.
            summed = grads if self.kv_atomic else grads[:1]
            cleared = zeroed(workspace, [(g.shape, acc) for g in summed if g.dtype != acc]
                             + [(s, numpy.uint32) for s in self.turn_shapes]
                             + [((n,), numpy.uint32) for n in self.flag_splits])
            sums = tuple(g if g.dtype == acc else cleared.pop(0) for g in summed)
            turns = tuple(cleared.pop(0) for _ in self.turn_shapes)
            flag_parts = tuple(cleared) if self.repair else (NULL, NULL)
            dq_acc = sums[0]
            dk_acc, dv_acc = sums[1:] if self.kv_atomic else (dq_acc, dq_acc)   # not written
            dk_out, dv_out = (q, q) if self.kv_atomic else grads[1:]             # not written / stored directly

            self.prep((self.prep_grid,), (PREP_THREADS,), (o, do, m, l, m_b, inv_l, lse2, d_sum, *self.prep_scalars))
            for g in summed:
                if g.dtype == acc:
                    g.fill(0)
            turns += (NULL,) * (3 - len(turns))   # dQ, dK, dV; null: unordered
            self.main((self.main_grid,), (self.main_threads,),
                      (q, k, v, do, *stats, d_sum, dq_acc, dk_out, dv_out, dk_acc, dv_acc, *turns, *flag_parts,
                       *self.main_scalars),
                      shared_mem=self.main_smem_bytes)
            if self.repair:
                self.repair.launch((q, k, v, do, m, l, d_sum, dq_acc, dk_out, dv_out, dk_acc, dv_acc, *flag_parts))
            for x_acc, g in zip(sums, summed):
                if x_acc is not g and x_acc.size:
                    blocks = min(max(1, -(-x_acc.size // (4 * CONVERT_THREADS))), 65535)   # four elements per thread
                    self.convert((blocks,), (CONVERT_THREADS,), (x_acc, g, numpy.int64(x_acc.size)))
        return tuple(grads)


def backward_plan(do, q, k, v, o, *, schedule: str, causal: bool, scale: float, deterministic: bool,
                  layout: BatchLayout):
    """The backward of ``schedule`` for validated inputs as a ``BackwardPlan``.

    ``layout.strides`` holds, in order, q, k, v, o, do and the contiguous
    own-shape layouts of dq, dk, dv. The preparation (D_i) and conversion
    kernels are the V1 module's; the main kernel is ``backward_kernel``'s.
    """
    Nq, D = q.shape[-2:]
    Nk = k.shape[-2]
    BH = layout.count
    acc = accumulator_dtype(q.dtype)
    kernels = get_kernels(device_tiles("bwd_v1", D, q.dtype))
    main_cfg = replace(device_tiles(backward_kernel(schedule, q.dtype, D), D, q.dtype), ordered=deterministic)
    s_q, s_k, s_v, s_o, s_do, s_dq, s_dk, s_dv = layout.strides
    n1, n2 = numpy.int64(layout.sizes[1]), numpy.int64(layout.sizes[2])
    lse_stats = main_cfg.kernel == "bwd_sm90"
    rows = BH * Nq
    prep_scalars = (*_strides4(o, s_o), *_strides4(do, s_do), n1, n2, numpy.int64(rows), numpy.int32(Nq),
                    numpy.int32(D), numpy.int32(_vector_ok((o, do), D)), numpy.int32(lse_stats))
    # dK, dV are stored directly unless several batch entries share one K/V head
    kv_atomic = math.prod(k.shape[:-2]) < BH or math.prod(v.shape[:-2]) < BH
    T_c = -(-Nk // main_cfg.block_c)
    n_chunks = -(-D // main_cfg.d_chunk)
    # deterministic: a counter per sum that several CTAs add into (flash_common.cuh, "Ordered sums")
    turn_shapes = ()
    if deterministic:
        turn_shapes = ((BH, -(-Nq // main_cfg.block_r), n_chunks),)
        if kv_atomic:
            turn_shapes += tuple((math.prod(x.shape[:-2]), T_c, n_chunks) for x in (k, v))
    # the K/V tiles of a head share Q, dO, the statistics and the dQ workspace
    group = head_group(BH, Nq * (D * (2 * q.itemsize + acc.itemsize) + 2 * acc.itemsize) + 2 * Nk * D * q.itemsize)
    strides = (*_strides4(q, s_q), *_strides4(k, s_k), *_strides4(v, s_v), *_strides4(do, s_do),
               *(numpy.int64(s) for s in (*s_dq, *s_dk, *s_dv)))
    sizes = (numpy.int32(Nq), numpy.int32(Nk), numpy.int32(D), acc.type(scale))
    main_scalars = (*strides, n1, n2, group, *sizes, numpy.int32(causal), numpy.int32(_vector_ok((q, k, v, do), D)),
                    numpy.int32(kv_atomic))
    # causal: the main kernel flags the dQ tiles and the dK, dV tiles (per batch entry) where a masked
    # pair met an inf or NaN, flash_bwd_repair redoes them
    flag_splits, repair = (), None
    if causal:
        flag_splits = (BH * -(-Nq // main_cfg.block_r), BH * T_c)
        repair = repair_plan("bwd", D, q.dtype, sum(flag_splits),
                             (*strides, n1, n2, numpy.int64(BH), *sizes, numpy.int32(main_cfg.block_r),
                              numpy.int32(main_cfg.block_c), numpy.int32(causal), numpy.int32(kv_atomic)))
    return BackwardPlan(
        prep=kernels["flash_bwd_prep_v1"], main=get_kernels(main_cfg)[f"flash_{main_cfg.kernel}"],
        convert=kernels["flash_convert"], device=q.data.device_id, dtype=q.dtype, acc=acc, rows=(BH, Nq),
        grad_shapes=(q.shape, k.shape, v.shape), lse_stats=lse_stats, kv_atomic=kv_atomic, turn_shapes=turn_shapes,
        flag_splits=flag_splits, repair=repair,
        prep_grid=-(-rows * PREP_LANES // PREP_THREADS), prep_scalars=prep_scalars,
        main_grid=BH * T_c * n_chunks, main_threads=main_cfg.threads, main_smem_bytes=main_cfg.smem_bytes,
        main_scalars=main_scalars)


# ---------------------------------------------------------------------------
# Plans of earlier calls. Validation and planning read only the arrays' types, shapes, strides,
# dtypes, devices and 16-byte alignment, the flags and USE_WGMMA: a call that agrees with an earlier
# one in all of them reuses its plan and only allocates and launches.

PLANS: dict = {}
MAX_PLANS = 1024   # past this many the cache starts over


def call_key(arrays, flags):
    """What validating and planning a call of CuPy ``arrays`` and ``flags`` reads; None for other arrays."""
    cupy = sys.modules.get("cupy")
    if cupy is None or any(type(x) is not cupy.ndarray for x in arrays):
        return None
    return (tuple((x.shape, x.strides, x.dtype, x.data.ptr % VECTOR_BYTES, x.data.device_id) for x in arrays),
            tuple((type(f), repr(f)) for f in flags), USE_WGMMA)


def keep_plan(key, plan):
    if key is not None:
        if len(PLANS) >= MAX_PLANS:
            PLANS.clear()
        PLANS[key] = plan
