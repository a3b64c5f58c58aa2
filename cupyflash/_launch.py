"""Shapes to launches: plans of grids, workspaces and parameter structs.

Inputs reach this module validated (``_checks``): CuPy arrays of one dtype on
the current device, last axis contiguous, non-negative element strides, and a
broadcast batch shape. Batch dims are collapsed to at most three (the kernels
index them as ``b0 * s0 + b1 * s1 + b2 * s2``, a zero stride along a
broadcast dim); ``collapse_batch`` returns None when that is impossible and the
caller peels a batch dim off in Python.

A plan (``forward_plan``, ``backward_plan``) settles everything of a call but its
arrays: the kernels, grids, the workspace layout and the parameter struct
(``_params``) with every stride, size and flag filled. Calling it allocates, writes
the pointers into a copy of the struct and launches; a like call reuses it
(``PLANS``). This module never calls back into ``api``.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import sys
from dataclasses import dataclass, field
from functools import lru_cache

import numpy

from . import _flags
from ._compile import get_kernels
from ._expr import UserCode
from ._mask import MaskGeometry
from ._params import BWD, FWD, ZERO_RANGES, Params
from ._philox import keep_threshold
from ._tiles import (KERNELS, TileConfig, accumulator_dtype, auto_forward, choose_tiles, with_flags, with_precision,
                     with_user)

MAX_BATCH_DIMS = 3  # collapsed batch dims a kernel indexes (layout.cuh: split_batch)
VECTOR_BYTES = 16   # width of the vectorised tile loads
MAX_GRID_X = 2**31 - 1


@dataclass(frozen=True)
class BatchLayout:
    """Collapsed batch dims ``sizes`` = (n0, n1, n2) and, per tensor, its element strides along them;
    ``names`` (where given) names the tensors: ``of(name)`` is one's strides."""

    sizes: tuple[int, int, int]
    strides: tuple[tuple[int, int, int], ...]
    names: tuple = ()

    @property
    def count(self) -> int:
        return self.sizes[0] * self.sizes[1] * self.sizes[2]

    def of(self, name: str) -> tuple[int, int, int]:
        """The strides of tensor ``name``."""
        return self.strides[self.names.index(name)]


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


def collapse_batch(batch_shape, tensor_strides, names=()) -> BatchLayout | None:
    """Merge batch dims until at most ``MAX_BATCH_DIMS`` remain.

    Parameters
    ----------
    batch_shape : tuple of int
        Broadcast batch shape.
    tensor_strides : sequence of tuple of int
        Each tensor's strides along ``batch_shape`` (from ``batch_strides``).
    names : sequence of str, optional
        The tensors' names (``BatchLayout.of``).

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
    return BatchLayout(sizes, per_tensor, tuple(names))


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


# A group of heads whose tensors take at most this share of L2 runs side by side (layout.cuh: grid_tile)
L2_SHARE = 0.5


def head_group(heads: int, bytes_per_head: int) -> numpy.int32:
    """Heads per group of the grid order (``grid_tile``): as many as fit ``L2_SHARE`` of L2, one at least."""
    fit = int(current_limits().l2_bytes * L2_SHARE) // max(1, bytes_per_head)
    return numpy.int32(min(max(1, fit), heads))


def forward_schedule(schedule: str, head_dim: int, dtype) -> str:
    """The forward kernel a validated ``schedule`` runs: 'v1' or 'v2'.

    'auto' is the measured table ``_tiles.AUTO_FORWARD`` (``auto_forward``). 'v2' runs V1 where
    V2's tiles do not fit the device.
    """
    if schedule == "auto":
        schedule = auto_forward(head_dim, dtype)
    if schedule == "v2":
        try:
            device_tiles("fwd_v2", head_dim, dtype)
        except ValueError:
            return "v1"
    return schedule


# Run the V2 forward and backward of 16-bit inputs on Hopper's warpgroup MMA (flash_fwd_sm90.cu,
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
        return "fwd_sm90"
    return f"fwd_{schedule}"


def backward_kernel(schedule: str, dtype, head_dim: int, scale: float = 1.0, mods: "Mods" = None) -> str:
    """The main kernel of a backward ``schedule`` for ``dtype`` and ``head_dim`` on the current device.

    The Hopper kernels take modified scores in units of ``scale`` (score_mod.cuh: RawMods): with
    modifiers, a zero scale (as the kernel reads it, in float32) runs the portable kernel; so does
    dbias under a softcap or a score_mod for ``head_dim`` > 128 (the wide kernel has no plain dS there).
    """
    if schedule != "v1" and _hopper(dtype):
        on = mods.on if mods is not None else frozenset()
        scored = any(_flags.BY_NAME[name].scores for name in on) or (mods is not None and mods.user is not None)
        if scored and numpy.float32(scale) == 0:
            return "bwd"
        if head_dim <= KERNELS["bwd_sm90"].max_head_dim:
            return "bwd_sm90"
        # the pairs the wide kernel never takes together (Flag.excludes), and dbias under a score_mod, whose
        # ds'/ds it cannot take either
        excluded = any(family == "bwd_sm90_wide" and other in on
                       for name in on for family, other in _flags.BY_NAME[name].excludes)
        if not excluded and not (mods is not None and mods.user is not None and mods.user.score and "bias_grad" in on):
            return "bwd_sm90_wide"
    return "bwd"


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
    """A Tensor's strides (s0, s1, s2, row) for array ``x`` with collapsed batch strides ``layout_strides``."""
    return (*layout_strides, element_strides(x)[-2])


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


def call_stream():
    """``(stream, alloc)``: the handle of CuPy's current stream, which a call launches on, and the
    allocator (bytes -> ``cupy.cuda.MemoryPointer``) of the call's workspaces: CuPy's pool or, while
    that stream is being captured into a CUDA graph, stream-ordered memory (cudaMallocAsync, freed
    with the workspace). Inside a capture both become nodes of the graph, so its replays own their
    workspaces; the pool's blocks would pass to the next caller once the call returns, while the
    graph still used them."""
    import cupy

    stream = cupy.cuda.get_current_stream()
    if not capturing(stream):
        return stream.ptr, cupy.cuda.alloc

    def alloc(nbytes):
        return cupy.cuda.MemoryPointer(cupy.cuda.memory.MemoryAsync(nbytes, stream), 0)

    return stream.ptr, alloc


@dataclass(frozen=True)
class Launch:
    """One kernel launch of a plan: ``launch(stream, address)`` runs ``kernel`` on ``stream`` with the
    parameter struct at host ``address`` (``Params.pack``) through ``cuLaunchKernel``, which costs a
    fraction of a RawKernel call (that one packs every argument in Python)."""

    kernel: object        # cupy.RawKernel: holds its module
    function: int         # its CUfunction on the plan's device
    grid: tuple           # (x, y)
    threads: int
    smem_bytes: int
    launch_kernel: object  # cupy.cuda.driver.launchKernel, looked up once per plan, not per launch

    def __call__(self, stream: int, address: int):
        self.launch_kernel(self.function, self.grid[0], self.grid[1], 1, self.threads, 1, 1, self.smem_bytes,
                           stream, address, 0)


def launch(kernel, grid, threads: int, smem_bytes: int = 0) -> Launch:
    """The ``Launch`` of RawKernel ``kernel`` on the current device; ``grid`` an int or ``(x, y)``."""
    from cupy.cuda import driver

    grid = (_launch_grid(grid), 1) if isinstance(grid, int) else (_launch_grid(grid[0]), grid[1])
    return Launch(kernel, kernel.kernel.ptr, grid, threads, smem_bytes, driver.launchKernel)


def _copy_into(x, alloc):
    """A C-contiguous copy of CuPy array ``x`` in memory from ``alloc`` (``call_stream``)."""
    import cupy

    target = cupy.ndarray(x.shape, x.dtype, memptr=alloc(max(1, x.nbytes)))
    target[...] = x
    return target


def _on_device(device: int):
    """A scope on ``device``: nothing to do when it is current already (the usual case)."""
    import cupy

    return contextlib.nullcontext() if cupy.cuda.runtime.getDevice() == device else cupy.cuda.Device(device)


WORKSPACE_ALIGN = 256   # bytes: each part of a call's workspace starts at a multiple of this
PREP_ZERO_WORDS = 64    # words of the zeroed ranges a thread of flash_bwd_prep zeroes, at most (but for huge ranges)


@dataclass(frozen=True)
class Block:
    """Memory of a call carved out of one allocation: part ``i`` at the ``WORKSPACE_ALIGN``-aligned
    byte ``offsets[i]`` (None: a part of no bytes), the zeroed parts after the others, so that a call
    allocates once and one memset of ``[zero_from, nbytes)`` clears them all."""

    offsets: tuple
    zero_from: int
    nbytes: int

    def allocate(self, alloc, stream: int, clear: bool = True):
        """``(memory, base address)``: a new ``cupy.cuda.MemoryPointer`` from ``alloc``
        (``call_stream``), its zeroed parts cleared on ``stream`` unless ``clear`` is False (a kernel
        of the call clears them); ``(None, 0)`` for a block of no bytes."""
        if not self.nbytes:
            return None, 0
        memory = alloc(self.nbytes)
        base = memory.ptr
        if clear and self.zero_from < self.nbytes:
            import cupy   # a plain import of a loaded module: no `from` machinery on the call path

            cupy.cuda.runtime.memsetAsync(base + self.zero_from, 0, self.nbytes - self.zero_from, stream)
        return memory, base

    def pointers(self, base: int) -> list:
        """Each part's address in the block at ``base`` (0 for a part of no bytes)."""
        return [0 if off is None else base + off for off in self.offsets]

    def arrays(self, memory, specs) -> list:
        """CuPy arrays of ``specs`` ((shape, dtype) pairs) on the block's first parts in ``memory``."""
        import cupy

        # (positional arguments and a pointer made from the allocation: a third of a microsecond less per array)
        mem, pointer, at = memory.mem, cupy.cuda.MemoryPointer, memory.ptr - memory.mem.ptr
        return [cupy.ndarray(shape, dtype, pointer(mem, at + off)) for (shape, dtype), off in zip(specs, self.offsets)]


@dataclass(frozen=True)
class Scratch:
    """Words a call's kernels share across CTAs and leave as they found them, zero: the persistent
    forward's tile counters, the repair flags. Kept per stream from call to call (``kept``), so a call
    neither allocates nor clears them; calls on one stream are ordered, each finding them zero. While
    the stream is being captured into a CUDA graph a call gets a cleared block of its own (a graph's
    replays must not share them with the calls around them)."""

    block: Block                                         # every part zeroed
    kept: dict = field(default_factory=dict, compare=False, repr=False)   # stream -> MemoryPointer

    def locate(self, alloc, stream: int) -> tuple:
        """``(base address, memory)``: this call's block on ``stream``, and what holds it; ``alloc`` the
        call's allocator (``call_stream``: CuPy's pool, or stream-ordered memory while capturing)."""
        import cupy

        if not self.block.nbytes:
            return 0, None
        if alloc is not cupy.cuda.alloc:   # capturing
            memory, base = self.block.allocate(alloc, stream)
            return base, memory
        memory = self.kept.get(stream)
        if memory is None:
            if len(self.kept) >= MAX_KEPT_SCRATCH:
                self.kept.clear()
            memory, _ = self.block.allocate(alloc, stream)   # cleared once, on the stream that uses it
            self.kept[stream] = memory
        return memory.ptr, memory


MAX_KEPT_SCRATCH = 8   # streams a plan keeps its scratch on at once


def block_layout(parts) -> Block:
    """The ``Block`` of ``parts``, (bytes, zeroed) pairs; ``offsets`` follows their order."""
    offsets, at = [None] * len(parts), 0
    zero_from = 0
    for zeroed in (False, True):
        if zeroed:
            zero_from = at
        for i, (nbytes, z) in enumerate(parts):
            if z == zeroed:
                offsets[i] = at if nbytes else None
                at += -(-nbytes // WORKSPACE_ALIGN) * WORKSPACE_ALIGN
    return Block(tuple(offsets), zero_from, at)


def array_parts(specs) -> list:
    """(bytes, not zeroed) block parts of arrays of ``specs`` ((shape, dtype) pairs)."""
    return [(math.prod(shape) * numpy.dtype(dtype).itemsize, False) for shape, dtype in specs]


def _launch_grid(n: int) -> int:
    if n > MAX_GRID_X:
        raise ValueError(f"{n} CTAs exceed a grid's {MAX_GRID_X}")
    return n


@dataclass(frozen=True)
class Mods:
    """The modifiers of a call: the rows of ``_flags.FLAGS`` it uses among the score modifiers and dbias
    (``on``), the softcap c, dropout's p, the query and key strides of each per-pair array (``pairs``:
    (flag, (si, sj)) of the bias, the mask, dbias; ``pair_strides``), and the user expressions. A
    plan's batch layout names each array by its flag (``BatchLayout.of``); the call brings them by
    flag too (``ForwardPlan``, ``BackwardPlan``)."""

    on: frozenset = frozenset()
    softcap: float | None = None
    dropout: float = 0.0      # p; the seed comes with each call
    pairs: tuple = ()
    batch0: int = 0           # the flat batch index of entry 0 (a peeled piece's), dropout's counter
    user: UserCode | None = None   # the user expressions compiled in
    user_slots: tuple = (0,) * 8   # ... and the call's mod_args (UserArgs: addresses, numbers' bits)

    def fields(self, layout: "BatchLayout", dbias_add: bool = False) -> dict:
        """``ScoreMods`` but its pointers and seed, by member: each array's collapsed batch strides (the
        layout's tensor of its flag's name) and, per pair, its query and key strides; ``dbias_add``;
        dropout's threshold and 1 / (1 - p); the softcap; the batch offset and the mod_args slots."""
        pairs = dict(self.pairs)
        out = {"softcap": 0.0 if self.softcap is None else float(self.softcap), "dbias_add": int(dbias_add),
               "threshold": int(keep_threshold(self.dropout)), "keep_scale": 1.0 / (1.0 - self.dropout),
               "batch0": self.batch0, "user": {"slot": self.user_slots}}
        for flag in _flags.FLAGS:
            if flag.name not in self.on or not flag.fields or flag.fields[0][1] not in ("entry", "pair"):
                continue
            member, kind = flag.fields[0]
            out[member] = dict(zip(("s0", "s1", "s2"), layout.of(flag.name)))
            if kind == "pair":
                out[member].update(zip(("si", "sj"), pairs[flag.name]))
        return out


PLAIN = Mods()


@dataclass(frozen=True)
class Cache:
    """A K/V cache's keys (``flash_attention_with_kvcache``): each batch entry's first ``lens + add``
    (``params.cuh``: Seqs::len_k, its lengths coming with the call), in place or, with ``page_size``, in
    a paged cache of ``pages`` pages (``Pages``: the table comes with the call); ``page_strides`` the
    elements between pages of k and v."""

    add: int
    page_size: int = 0
    pages: int = 0
    page_strides: tuple = (0, 0)

    @property
    def paged(self) -> bool:
        return self.page_size > 0


@dataclass(frozen=True)
class Packed:
    """Packed variable-length sequences of a call (``params.cuh``: Seqs): ``n`` per batch entry, the
    longest one's query rows and keys (the grid's tiles). Their offsets come with the call. With a
    ``cache``, one sequence per batch entry (no offsets) whose keys the cache's lengths cut."""

    n: int
    max_q: int
    max_k: int
    cache: Cache | None = None

    @property
    def paged(self) -> bool:
        return self.cache is not None and self.cache.paged


def _grid_lengths(packed, rows_q: int, rows_k: int, entries: int) -> tuple[int, int, int]:
    """``(Nq, Nk, heads)`` of a plan's grid: the query rows and keys whose tiles it covers (the longest
    sequence's with ``packed`` sequences, else all of them) and its work heads (one per batch entry and
    sequence)."""
    if packed is None:
        return rows_q, rows_k, entries
    return packed.max_q, packed.max_k, entries * packed.n


def call_flags(mods: Mods, packed=None, deterministic: bool = False) -> frozenset:
    """The rows of ``_flags.FLAGS`` a call uses: its modifiers, packed sequences (and a paged cache), the
    deterministic backward."""
    layout = {"varlen": packed is not None, "paged": packed is not None and packed.paged, "ordered": deterministic}
    return mods.on | {name for name, used in layout.items() if used}


def _variant(cfg: TileConfig, mods: Mods, flags: frozenset) -> TileConfig:
    """``cfg`` with those of a call's ``flags`` (``call_flags``) that its family compiles in, and its user
    expressions."""
    return with_user(with_flags(cfg, flags), mods.user)


def _sequence_fields(geometry: MaskGeometry, packed, heads: int, rows_q: int, rows_k: int,
                     len_strides=(0, 0, 0)) -> dict:
    """``mask`` and ``seqs`` of a parameter struct: the call's Mask and one sequence, or with ``packed``
    sequences the longest one's lengths (the grid's) and the Band every sequence applies; with a
    cache, its lengths' collapsed batch strides ``len_strides``."""
    if packed is None:
        return dict(mask=geometry.kernel_fields(),
                    seqs=(0, 0, 0, 0, 0, 0, heads, 1, rows_q, rows_k, 0, geometry.band_fields()))
    add = 0 if packed.cache is None else packed.cache.add
    return dict(mask=(packed.max_q, packed.max_k, -packed.max_q, packed.max_k),
                seqs=(0, 0, 0, *len_strides, heads * packed.n, packed.n, rows_q, rows_k, add, geometry.band_fields()))


def _page_fields(packed, table_strides=(0, 0, 0)) -> tuple:
    """``pages`` of a FwdParams: a paged cache's table strides, page strides, page size and pages."""
    if packed is None or not packed.paged:
        return (0, 0, 0, 0, 0, 0, 0, 0)
    c = packed.cache
    return (0, *table_strides, *c.page_strides, c.page_size, c.pages)


def _address(x) -> int:
    """Device address of CuPy array ``x``, 0 for None."""
    return 0 if x is None else x.data.ptr


def pair_strides(x) -> tuple[int, int]:
    """The query and key element strides of a per-pair array ``x`` (..., Nq or 1, Nk or 1): 0 along a
    dim of 1, which broadcasts."""
    rows, cols = x.shape[-2:]
    si, sj = element_strides(x)[-2:]
    return (si if rows != 1 else 0, sj if cols != 1 else 0)


def _masked_pairs(geometry: MaskGeometry, packed=None, mods: Mods = None) -> bool:
    """Some pair of the whole problem is masked inside the ragged ends: the tile of every row and key
    has masked pairs (a causal mask or a window that bounds some row); of packed sequences, which may
    be of any lengths, wherever a window applies, or a causal mask over sequences of more than one query
    row (bottom-right aligned, a sequence's one row sees all its keys: a decoding step); under a boolean
    mask or a mask_mod always."""
    if mods is not None and ("mask" in mods.on or (mods.user is not None and mods.user.mask is not None)):
        return True
    if packed is not None:
        return (geometry.causal and packed.max_q > 1) or geometry.left is not None or geometry.right is not None
    return geometry.has_masked_pairs(0, 0, geometry.n_k)


# ---------------------------------------------------------------------------
# mask_mod's tile map (mask.cuh: TileMap; tile_map.cuh writes it)

TILE_MAP_THREADS = 128          # tile_map.cuh: TILE_MAP_THREADS
TILE_MAP_CTAS_PER_SM = 16       # the map kernels' grids (grid-stride loops) past this many CTAs an SM
KEPT_MAPS: dict = {}            # maps that depend on nothing a call brings, by their plan's key and stream
MAX_KEPT_MAPS = 16              # past this many the cache starts over
# the maps of the BlockMask a call passes (cupyflash.blockmask), by plan key and stream, while it runs
BLOCK_MAPS: contextvars.ContextVar = contextvars.ContextVar("cupyflash_block_maps", default=None)


def tile_map_bytes(T_r: int, T_c: int) -> int:
    """Bytes of one map head (mask.cuh: TileMap): the tiles' states padded to 16 bytes, then the int32
    counts and lists of both directions, padded to 16 bytes."""
    states = -(-T_r * T_c // 16) * 16
    return -(-(states + 4 * (T_r + T_c + 2 * T_r * T_c)) // 16) * 16


@dataclass(frozen=True)
class TileMapPlan:
    """mask_mod's tile map of a plan: its bytes, the launches of the module's two map kernels, the key it
    is kept under from call to call (None where packed sequences' offsets come with the call) and whether
    every like call may share it (not where mask_mod reads a mod_args array, whose values may change,
    unless the call passes a BlockMask, whose arrays are promised not to: ``BLOCK_MAPS``)."""

    nbytes: int
    launches: tuple
    key: tuple | None
    shared: bool = True

    def locate(self, alloc, stream: int):
        """``(address, memory, fresh)``: where this call's map lies, what holds it and whether the call
        writes it (launches ``launches`` before the main kernel); ``alloc`` the call's allocator
        (``call_stream``). A kept map is per stream, so the call that wrote it is ordered before every call
        that reads it. A call under graph capture makes none to keep and reads only a block mask's (which
        the caller keeps alive, as it keeps the graph)."""
        import cupy

        block = BLOCK_MAPS.get()
        maps = block if block is not None else KEPT_MAPS if self.shared else None
        capture = alloc is not cupy.cuda.alloc   # call_stream's stream-ordered allocator: capturing
        kept = None
        if maps is not None and self.key is not None and not (capture and block is None):
            kept = maps.get((self.key, stream))
        if kept is not None:
            return kept.data.ptr, kept, False
        if maps is None or self.key is None or capture:
            memory = alloc(self.nbytes)
            return memory.ptr, memory, True
        if maps is KEPT_MAPS and len(KEPT_MAPS) >= MAX_KEPT_MAPS:
            KEPT_MAPS.clear()
        kept = maps[(self.key, stream)] = cupy.empty(self.nbytes, numpy.uint8)
        return kept.data.ptr, kept, True


def tile_map_plan(cfg: TileConfig, kernels: dict, mods: "Mods", geometry: MaskGeometry, packed, heads: int,
                  Nq: int, Nk: int) -> tuple:
    """``(TileMapPlan, fields)`` of a main kernel ``cfg`` (its ``kernels``) under a mask_mod, ``(None,
    (0,) * 5)`` without one: the map at the kernel's tiles over the grid's lengths ``Nq``, ``Nk``, a map
    head per work head (of ``heads``) where mask_mod reads b, else per sequence; ``fields`` the params'
    ``tiles`` but its base."""
    if mods.user is None or mods.user.mask is None:
        return None, (0, 0, 0, 0, 0)
    T_r, T_c = -(-Nq // cfg.block_r), -(-Nk // cfg.block_c)
    by_entry = mods.user.mask_by_entry
    map_heads = heads if by_entry else (1 if packed is None else packed.n)
    head_bytes = tile_map_bytes(T_r, T_c)
    cap = TILE_MAP_CTAS_PER_SM * current_limits().sms
    warps = TILE_MAP_THREADS // 32
    launches = (launch(kernels["flash_tile_map"], min(map_heads * T_r * T_c, cap), TILE_MAP_THREADS),
                launch(kernels["flash_tile_lists"], min(-(-map_heads * (T_r + T_c) // warps), cap), TILE_MAP_THREADS))
    key = None
    if packed is None:
        key = (cfg, geometry.kernel_fields(), mods.user_slots, heads if by_entry else 0,
               mods.batch0 if by_entry else 0, _current_device())
    return (TileMapPlan(map_heads * head_bytes, launches, key, not mods.user.mask_reads_arrays),
            (0, head_bytes, T_r, T_c, int(by_entry)))


def _current_device() -> int:
    import cupy

    return cupy.cuda.runtime.getDevice()


# a call without modifier arrays: their addresses (array_addresses); a forward without per-entry descales
NO_ARRAYS = (0,) * len(_flags.ARRAY_FLAGS)
NO_DESCALES = (None, None, None)
NO_DESCALE_ADDRESSES = (0, 0, 0)


@dataclass(frozen=True)
class ForwardPlan:
    """A forward with everything but its arrays settled; ``plan(q, k, v)`` returns ``(o, m, l)``.

    One ``FwdParams`` serves the main kernel and, masked, ``flash_fwd_repair`` after it, which
    recomputes the Q tiles the main kernel flagged (a masked pair met an inf or NaN); the Hopper forward
    recomputes its own, but after split-KV, whose merge comes first.
    """

    launches: tuple           # Launch of the main kernel, then of flash_fwd_repair where it runs
    device: int
    outputs: tuple            # ((shape, dtype) of o, m, l)
    fresh: Block              # o, m, l, the splits' parts and the float8 forward's V^T
    given: Block              # the same but o, m, l: a call with ``out``
    scratch: Scratch          # the tile counters and the repair flags, kept per stream
    o_run: int                # bytes of V1's running O_i (0: not used), a workspace of its own
    params: Params            # FwdParams
    tile_map: TileMapPlan | None = None   # mask_mod's, written before the main kernel where the call must
    merge: tuple | None = None   # split-KV: (Launch of flash_merge, its MergeParams), after the main kernel
    before: tuple = ()        # Launches before the main kernel's (the float8 forward's flash_fp8_values)

    def __call__(self, q, k, v, out=None, arrays=None, offsets=(None, None), seed=0, lens=None, table=None,
                 descales=NO_DESCALES):
        """``(o, m, l)``, in ``out`` (validated: ``_checks.check_out``) when given; ``arrays`` the
        modifiers' arrays by flag (``_flags.call_arrays``: ALiBi slopes, sink logits, bias, mask; those of
        ``Mods.on``) as laid out for the plan; ``offsets`` the int32 offsets of packed sequences (with
        ``Packed``); ``seed`` dropout's (with ``Mods.dropout``: ``seed_words``); ``lens``, ``table`` a cache's int32
        lengths and page table (with ``Packed.cache``); ``descales`` the float8 forward's per-entry descale
        arrays of q, k, v (None where a number: ``fp8_forward_plan``)."""
        with _on_device(self.device):
            stream, alloc = call_stream()
            if out is None:   # the outputs and the workspace in one allocation from CuPy's pool
                import cupy

                memory, base = self.fresh.allocate(cupy.cuda.alloc, stream)
                o, m, l = self.fresh.arrays(memory, self.outputs)
                parts = self.fresh.pointers(base)   # o, m, l, the splits' parts, V^T
            else:
                o, m, l = out
                memory, base = self.given.allocate(alloc, stream)
                parts = self.given.pointers(base)
                parts[:3] = o.data.ptr, m.data.ptr, l.data.ptr
            scratch_base, scratch_memory = self.scratch.locate(alloc, stream)
            o_run = alloc(self.o_run) if self.o_run else None
            tiles, tile_memory, fresh_map = self.tile_map.locate(alloc, stream) if self.tile_map else (0, None, False)
            struct, address = self.params.pack((
                q.data.ptr, k.data.ptr, v.data.ptr, *parts, *self.scratch.block.pointers(scratch_base),
                o_run.ptr if o_run else 0, _address(offsets[0]), _address(offsets[1]), *seed_words(seed), tiles, _address(lens),
                _address(table), *(array_addresses(arrays) if arrays else NO_ARRAYS),
                *(NO_DESCALE_ADDRESSES if descales is NO_DESCALES else map(_address, descales))))
            for step in (self.tile_map.launches if fresh_map else ()) + self.before + self.launches[:1]:
                step(stream, address)
            if self.merge is not None:   # the splits' parts into o, m, l, before the repair reads them
                merge_launch, merge_params = self.merge
                merge_struct, merge_address = merge_params.pack((*parts[3:6], *parts[:3]))
                merge_launch(stream, merge_address)
            for step in self.launches[1:]:
                step(stream, address)
        return o, m, l



def seed_words(seed) -> tuple:
    """``(mods.seed, mods.seed_at)`` of dropout's ``seed``: an int, or a device seed (a CuPy array the
    kernels read it from, ``_checks.check_seed``)."""
    return (seed, 0) if isinstance(seed, int) else (0, seed.data.ptr)


def array_addresses(arrays: dict) -> list:
    """The addresses of a call's modifier arrays (by flag, ``_flags.call_arrays``) in ``ARRAY_FLAGS``
    order, 0 for those it does not give."""
    return [arrays[f.name].data.ptr if f.name in arrays else 0 for f in _flags.ARRAY_FLAGS]


# the workspace parts of a forward after o, m, l: ForwardPlan.fresh's (and .given's), then its scratch's
FWD_PARTS = ("o_parts", "m_parts", "l_parts", "vt.ptr", "tile_counter", "repair_flags")
# the pointers a forward call writes, in this order (ForwardPlan.__call__): inputs, outputs, workspace parts,
# V1's running O, packed sequences' offsets, dropout's seed, the tile map, a cache's lengths and page table,
# the modifiers' arrays (_flags.Flag.pointer), the float8 forward's per-entry descales
FWD_POINTERS = ("q.ptr", "k.ptr", "v.ptr", "o", "m", "l", *FWD_PARTS, "o_run", "seqs.cu_q", "seqs.cu_k", "mods.seed",
                "mods.seed_at", "tiles.base", "seqs.len_k", "pages.table", *(f.pointer for f in _flags.ARRAY_FLAGS),
                "descales.q.ptr", "descales.k.ptr", "descales.v.ptr")


def _repair(head_dim: int, dtype, flags: int, mods: Mods, used: frozenset):
    """``flash_repair.cu``'s kernels and the grid over ``flags`` flags: a CTA per flag, at most four
    per SM, each reading its share of the flags in blocks of its threads; ``used`` the call's flags
    (``call_flags``)."""
    cfg = _variant(device_tiles("repair", head_dim, dtype), mods, used)
    return get_kernels(cfg), min(flags, 4 * current_limits().sms)


def choose_kv_splits(ctas: int, kv_tiles: int, slots: int) -> int:
    """Split-KV for a grid of ``ctas`` CTAs (work heads x Q tiles) whose Q tiles visit up to ``kv_tiles``
    K/V tiles, on a GPU that holds ``slots`` CTAs at once: 1 where the grid fills most of it; else, among
    the counts that leave every split two K/V tiles, the fewest whose last wave is at least 85% as full
    as the fullest count's (FlashAttention-2's rule)."""
    if ctas >= 0.8 * slots or kv_tiles < 4:
        return 1
    fill = {n: ctas * n / slots / math.ceil(ctas * n / slots) for n in range(1, min(MAX_KV_SPLITS, kv_tiles // 2) + 1)}
    best = max(fill.values())
    return min(n for n, f in fill.items() if f >= 0.85 * best)


MAX_KV_SPLITS = 64      # the most choose_kv_splits picks
LIMIT_KV_SPLITS = 256   # the most a call gets (Visits::split multiplies a count of K/V tiles by it in 32 bits)


def forward_plan(q, k, v, *, schedule: str, precision: str, geometry: MaskGeometry, scale: float, batch_shape,
                 layout: BatchLayout, mods: Mods = PLAIN, packed: Packed | None = None, stats_shape=None,
                 kv_splits: int | None = 1):
    """The ``schedule`` ('v1' or 'v2') forward of validated inputs ``q, k, v`` as a ``ForwardPlan``;
    ``layout`` names q, k, v, with a cache its lengths ``lens`` (and a paged one's ``table``), and the
    modifiers' arrays by flag (``Mods``; a per-entry array as a batch of 1 x 1 matrices). With ``packed``
    sequences the rows of q and k are theirs, and a CTA's tiles those of one sequence; a paged cache runs
    the Hopper forward where it may, else V2's portable kernel (V1 reads no pages).
    ``stats_shape``: the shape of m and l the plan returns (default ``(*batch_shape, rows)``; a folded
    call's, ``_fold``, is the caller's). ``kv_splits``: split-KV (V2 and the Hopper forward: each Q tile's
    K/V tiles in that many runs, one CTA each, merged by flash_merge.cu; None: ``choose_kv_splits``; at
    most the K/V tiles there are and LIMIT_KV_SPLITS)."""
    rows_q, D = q.shape[-2:]
    rows_k = packed.max_k if packed is not None and packed.paged else k.shape[-2]   # a paged cache's capacity
    BH = layout.count
    Nq, Nk, heads = _grid_lengths(packed, rows_q, rows_k, BH)
    acc = accumulator_dtype(q.dtype)
    family = forward_kernel(schedule, q.dtype, scale)
    if packed is not None and packed.paged and family not in _flags.BY_NAME["paged"].compiled:
        family = "fwd_v2"   # of the portable forwards, the one that reads pages
    used = call_flags(mods, packed)
    cfg = _variant(with_precision(device_tiles(family, D, q.dtype), precision), mods, used)
    kernel = get_kernels(cfg)[cfg.spec.entries[0]]
    T_r, T_c = -(-Nq // cfg.block_r), -(-Nk // cfg.block_c)
    limits = current_limits()
    slots = limits.sms * max(1, min(4, limits.smem_sm // max(cfg.smem_bytes, 1)))   # CTAs resident at once
    if cfg.kernel == "fwd_v1":
        n_splits, kv_splits = choose_splits(heads, T_r, slots), 1
        grid = heads * n_splits
    else:
        n_splits = 1
        if cfg.kernel == "fwd_sm90":   # persistent CTAs that claim tiles, one per SM
            slots = limits.sms
        kv_splits = (choose_kv_splits(heads * T_r, T_c, slots) if kv_splits is None
                     else max(1, min(kv_splits, T_c, LIMIT_KV_SPLITS)))
        grid = (heads * T_r, kv_splits)
        if cfg.kernel == "fwd_sm90":
            grid = min(heads * T_r * kv_splits, limits.sms)
    # V1's running O_i between outer steps: with a single K/V tile every step is the last
    o_run = BH * rows_q * cfg.d_pad * acc.itemsize if cfg.kernel == "fwd_v1" and Nk > cfg.block_c else 0
    counter = 8 if cfg.kernel == "fwd_sm90" else 0   # tiles claimed, CTAs done claiming
    # masked: the kernel flags the Q tiles where a masked pair met an inf or NaN, flash_fwd_repair redoes them
    flags = heads * T_r if _masked_pairs(geometry, packed, mods) else 0
    launches = [launch(kernel, grid, cfg.threads, cfg.smem_bytes)]
    # the Hopper forward repairs its own rows, but under split-KV (the merge writes them after it) and in
    # its packed-sequence kernels (flash_fwd_sm90.cu: SELF_REPAIR)
    if flags and (cfg.kernel != "fwd_sm90" or kv_splits > 1 or "varlen" in cfg.flags):
        kernels, repair_grid = _repair(D, q.dtype, flags, mods, used)
        launches.append(launch(kernels["flash_fwd_repair"], repair_grid, KERNELS_THREADS["repair"]))
    tile_map, tile_fields = tile_map_plan(cfg, get_kernels(cfg), mods, geometry, packed, heads, Nq, Nk)
    # a cache's lengths and page table, named in the layout
    cached = packed is not None and packed.cache is not None
    params = Params(FWD, FWD_POINTERS,
                    q=_strides4(q, layout.of("q")), k=_strides4(k, layout.of("k")), v=_strides4(v, layout.of("v")),
                    batch=(layout.sizes[1], layout.sizes[2], BH),
                    **_sequence_fields(geometry, packed, BH, rows_q, rows_k, *((layout.of("lens"),) if cached else ())),
                    tiles=tile_fields, mods=mods.fields(layout),
                    pages=_page_fields(packed, *((layout.of("table"),) if cached and packed.paged else ())), D=D,
                    vec=int(_vector_ok((q, k, v), D)), head_group=head_group(heads, 2 * Nk * D * q.itemsize),
                    n_splits=n_splits, kv_splits=kv_splits, tile_rows=cfg.block_r, uses=_flags.uses_word(used),
                    scale=float(acc.type(scale)))
    stats_shape = tuple(stats_shape or (*batch_shape, rows_q))
    outputs = (((*stats_shape, D), q.dtype), (stats_shape, acc), (stats_shape, acc))
    rows = BH * rows_q
    split_parts = [(kv_splits * rows * D * q.itemsize, False), (kv_splits * rows * acc.itemsize, False),
                   (kv_splits * rows * acc.itemsize, False)] if kv_splits > 1 else [(0, False)] * 3
    merge = merge_plan(q.dtype, rows, D, kv_splits) if kv_splits > 1 else None
    return ForwardPlan(launches=tuple(launches), device=q.data.device_id, outputs=outputs,
                       fresh=block_layout(array_parts(outputs) + split_parts + [(0, False)]),
                       given=block_layout([(0, False)] * 3 + split_parts + [(0, False)]),
                       scratch=Scratch(block_layout([(counter, True), (4 * flags, True)])),
                       o_run=o_run, params=params, tile_map=tile_map, merge=merge)


def fp8_forward_plan(q, k, v, *, out_dtype, geometry: MaskGeometry, scale: float, v_scale: float, batch_shape,
                     layout: BatchLayout, per_entry: tuple = ()):
    """The float8 Hopper forward (``fwd_fp8``) of validated float8 e4m3 ``q, k, v`` (CuPy uint8 arrays of
    their bits, D <= FP8_HEAD_DIM) as a ``ForwardPlan``: ``flash_fp8_values`` writes V^T into the call's
    workspace (one (d_chunk, Nk rounded up to B_c) block per batch entry of v, broadcast entries once), then the
    persistent main kernel; o of ``out_dtype``, m and l float32. ``scale`` multiplies q k^T (softmax_scale
    times q's and k's descales where numbers), ``v_scale`` o; ``per_entry`` names the descales that are
    arrays instead (``"q"``, ``"k"``, ``"v"``), laid out in ``layout`` as ``"<name>_descale"``: their
    addresses come with each call (``ForwardPlan.__call__``'s ``descales``)."""
    rows_q, D = q.shape[-2:]
    rows_k = k.shape[-2]
    BH = layout.count
    cfg = device_tiles("fwd_fp8", D, out_dtype)
    kernels = get_kernels(cfg)
    T_r, T_c = -(-rows_q // cfg.block_r), -(-rows_k // cfg.block_c)
    keys = T_c * cfg.block_c   # V^T's row stride: every run of B_c keys written, zero past Nk
    # V^T's collapsed batch strides: contiguous over the dims along which v does not broadcast
    vt_strides, size = [0, 0, 0], cfg.d_chunk * keys   # rows: the head-dim columns the products cover
    for axis in (2, 1, 0):
        if layout.of("v")[axis]:
            vt_strides[axis] = size
            size *= layout.sizes[axis]
    flags = BH * T_r if _masked_pairs(geometry) else 0   # the main kernel repairs the Q tiles it flags
    sms = current_limits().sms
    params = Params(FWD, FWD_POINTERS,
                    q=_strides4(q, layout.of("q")), k=_strides4(k, layout.of("k")), v=_strides4(v, layout.of("v")),
                    vt=(*vt_strides, keys), batch=(layout.sizes[1], layout.sizes[2], BH),
                    **_sequence_fields(geometry, None, BH, rows_q, rows_k), D=D, vec=int(_vector_ok((q, k, v), D)),
                    head_group=head_group(BH, 2 * rows_k * D), n_splits=1, kv_splits=1, tile_rows=cfg.block_r,
                    scale=float(numpy.float32(scale)), v_scale=float(numpy.float32(v_scale)),
                    descales={name: dict(zip(("s0", "s1", "s2"), layout.of(f"{name}_descale"))) for name in per_entry})
    stats = (*batch_shape, rows_q)
    outputs = (((*stats, D), numpy.dtype(out_dtype)), (stats, numpy.float32), (stats, numpy.float32))
    vt_part = [(size, False)]
    return ForwardPlan(launches=(launch(kernels["flash_fwd_sm90"], min(BH * T_r, sms), cfg.threads, cfg.smem_bytes),),
                       device=q.data.device_id, outputs=outputs,
                       fresh=block_layout(array_parts(outputs) + [(0, False)] * 3 + vt_part),
                       given=block_layout([(0, False)] * 6 + vt_part),
                       scratch=Scratch(block_layout([(8, True), (4 * flags, True)])), o_run=0, params=params,
                       before=(launch(kernels["flash_fp8_values"], _launch_grid(BH * T_c), FP8_VALUES_THREADS),))


# threads of flash_fp8_values (flash_fwd_sm90.cu: VALUES_THREADS)
FP8_VALUES_THREADS = 256


def merge_plan(dtype, rows: int, D: int, parts: int, strides=None, vec: bool | None = None,
               listed: bool = False) -> tuple:
    """``(Launch, Params)`` of flash_merge.cu over ``parts`` parts of ``rows`` rows of ``D``: stacked
    (``strides``: elements between the parts of o, m, l; default back to back), a call packing the
    parts' bases and then o, m, l; or ``listed``, a call packing every part's o, then every m, every l,
    then o, m, l. ``vec``: 16-byte accesses of o (default where the rows are 16-byte multiples; the
    parts must then start 16-byte aligned)."""
    from ._params import MERGE, MERGE_POINTERS as SLOTS
    from ._tiles import MERGE_WARPS

    cfg = device_tiles("merge", D, dtype)
    item = numpy.dtype(dtype).itemsize
    vec = D * item % VECTOR_BYTES == 0 if vec is None else vec
    strides = (0, 0, 0) if listed else strides or (rows * D, rows, rows)
    per_lane = VECTOR_BYTES // item if vec else 1
    lanes = 1
    while lanes < 32 and lanes * per_lane < D:
        lanes *= 2
    empty = (0,) * SLOTS
    pointers = [f"{a}.ptr[{i}]" for a in "oml" for i in range(parts if listed else 1)] + ["o_out", "m_out", "l_out"]
    params = Params(MERGE, pointers, o=(empty, strides[0]), m=(empty, strides[1]), l=(empty, strides[2]),
                    rows=rows, D=D, parts=parts, lanes=lanes, vec=int(vec))
    threads = MERGE_WARPS * 32
    return launch(get_kernels(cfg)["flash_merge"], -(-rows * lanes // threads), threads), params


def append_plan(k, v, k_new, v_new, layout: BatchLayout, cache: Cache, capacity: int) -> tuple:
    """``(Launch, Params)`` of flash_append.cu: ``k_new``, ``v_new`` into the cache ``k``, ``v`` (a paged
    one's page 0) at the lengths, rows ``capacity`` and on; ``layout.strides`` holds k, v, k_new, v_new,
    the lengths and (paged) the table. A call packs k, v, k_new, v_new, the lengths and the table."""
    from ._params import APPEND

    cfg = with_flags(device_tiles("append", 1, k.dtype), ("paged",) if cache.paged else ())
    D, n_new = k.shape[-1], k_new.shape[-2]
    vec = _vector_ok((k, v, k_new, v_new), D)
    packed = Packed(1, 0, capacity, cache)
    params = Params(APPEND, ("k.ptr", "v.ptr", "k_new.ptr", "v_new.ptr", "seqs.len_k", "pages.table"),
                    k=_strides4(k, layout.strides[0]), v=_strides4(v, layout.strides[1]),
                    k_new=_strides4(k_new, layout.strides[2]), v_new=_strides4(v_new, layout.strides[3]),
                    batch=(layout.sizes[1], layout.sizes[2], layout.count),
                    seqs=_sequence_fields(MaskGeometry(0, 0, False), packed, layout.count, 0, capacity,
                                          layout.strides[4])["seqs"],
                    pages=_page_fields(packed, *layout.strides[5:6]), n_new=n_new, D=D, vec=int(vec))
    chunks = -(-D // (VECTOR_BYTES // k.itemsize)) if vec else D
    grid = max(1, min(-(-layout.count * n_new * chunks // cfg.threads), 8 * current_limits().sms))
    return launch(get_kernels(cfg)["flash_append"], grid, cfg.threads), params


# the workspace parts of a backward, in BackwardPlan.parts order; from BWD_SUMS on the three sums
BWD_PARTS = ("m_b", "inv_l", "lse2", "Dsum", "dq_acc.ptr", "dk_acc", "dv_acc", "dq_turns", "dk_turns", "dv_turns",
             "dq_flags", "kv_flags")
BWD_DSUM = BWD_PARTS.index("Dsum")
BWD_SUMS = 4
# flash_bwd_prep's zero ranges (BwdParams.zero): the workspace's zeroed part, dbias, then the gradients
# that are the sums themselves
ZERO_DBIAS = 1
ZERO_SUMS = 2
NO_SUMS = (0,) * (ZERO_RANGES - ZERO_SUMS)
# the pointers a backward call writes, in this order (BackwardPlan.__call__): inputs, gradients, workspace
# parts, packed sequences' offsets, dbias, dropout's seed, the tile map, the ranges flash_bwd_prep zeroes
# (the workspace's zeroed part, dbias, the sums), the modifiers' arrays (_flags.Flag.pointer)
BWD_POINTERS = ("q.ptr", "k.ptr", "v.ptr", "o.ptr", "dO.ptr", "m", "l", "dq", "dk.ptr", "dv.ptr", *BWD_PARTS,
                "seqs.cu_q", "seqs.cu_k", "mods.dbias.ptr", "mods.seed", "mods.seed_at", "tiles.base",
                *(f"zero[{i}].ptr" for i in range(ZERO_RANGES)), *(f.pointer for f in _flags.ARRAY_FLAGS))


@dataclass(frozen=True)
class DbiasBuffer:
    """Where a backward's kernels write dbias (``EntryMods::add_dbias``): a zeroed, contiguous buffer
    of the accumulator dtype and ``shape``. A bias that broadcasts nowhere has one writer per element:
    stores into a buffer of its shape. One that broadcasts has several: float atomics into its shape
    or, deterministic, stores into the full ``(*batch, Nq, Nk)`` that CuPy then sums to ``to`` (its
    shape) in a fixed order."""

    shape: tuple
    add: bool                  # several writers per element: atomics
    to: tuple | None = None    # the bias's shape the buffer is summed to, or None

    @property
    def batch_shape(self) -> tuple:
        return self.shape[:-2]

    @property
    def pair_strides(self) -> tuple[int, int]:
        rows, cols = self.shape[-2:]
        return (cols if rows != 1 else 0, 1 if cols != 1 else 0)


def dbias_buffer(bias_shape, batch_shape, rows_q: int, rows_k: int, deterministic: bool) -> DbiasBuffer:
    """The ``DbiasBuffer`` of a backward of ``batch_shape``, ``rows_q`` x ``rows_k`` pairs per entry
    (packed rows with varlen), for a bias of ``bias_shape``."""
    full = (*batch_shape, rows_q, rows_k)
    if math.prod(bias_shape) == math.prod(full):
        return DbiasBuffer(tuple(bias_shape), False)
    if deterministic:
        return DbiasBuffer(full, False, tuple(bias_shape))
    return DbiasBuffer(tuple(bias_shape), True)


@dataclass(frozen=True)
class BackwardPlan:
    """A backward with everything but its arrays settled; ``plan(do, q, k, v, o, m, l)`` returns
    ``(dq, dk, dv)`` (in ``out``, validated by ``_checks.check_out``, when given).

    Its steps share one ``BwdParams``: ``flash_bwd_prep`` (zeroes the sums; D_i and the statistics the
    main kernel reads), the main kernel (dQ summed into a float32/float64 workspace; dK, dV stored
    directly, or summed when several batch entries share a K/V head), masked ``flash_bwd_repair``
    (the tiles the main kernel flagged) and, for 16-bit inputs, ``flash_convert`` of the sums.
    """

    launches: tuple           # Launch of each step, in order
    device: int
    grads: tuple              # ((shape, dtype) of dq, dk, dv): the shapes of q, k, v
    sums: int                 # gradients that are the sums themselves: 0 (16-bit), 1 (dq) or 3 (dq, dk, dv)
    params: Params            # BwdParams
    workspace: Block          # BWD_PARTS; flash_bwd_prep zeroes its zeroed parts (BwdParams.zero[0])
    grad_block: Block         # dq, dk, dv in one allocation
    dbias: DbiasBuffer | None = None   # with bias_grad; flash_bwd_prep zeroes it (BwdParams.zero[ZERO_DBIAS])
    tile_map: TileMapPlan | None = None   # mask_mod's, written before the main kernel where the call must
    row_sums: bool = False    # return flash_bwd_prep's D_i too (a sink's gradient reads them)

    def __call__(self, do, q, k, v, o, m, l, out=None, arrays=None, offsets=(None, None), seed=0):
        """``(dq, dk, dv)`` and, with ``dbias``, dbias (of the accumulator dtype and the bias's
        shape), then with ``row_sums`` the rows' D_i = rowsum(dO_i o O_i) (of the accumulator dtype and
        m's shape); the modifiers' arrays and the seed as in ``ForwardPlan``."""
        with _on_device(self.device):
            # every buffer first: a call that does not fit raises OutOfMemoryError before any launch
            stream, alloc = call_stream()
            if not m.flags.c_contiguous:
                m = _copy_into(m, alloc)
            if not l.flags.c_contiguous:
                l = _copy_into(l, alloc)
            memory, base = self.workspace.allocate(alloc, stream, clear=False)
            if out is None:
                import cupy

                grads = self.grad_block.arrays(self.grad_block.allocate(cupy.cuda.alloc, stream)[0], self.grads)
            else:
                grads = out
            dbias = None
            if self.dbias is not None:
                import cupy

                acc = accumulator_dtype(q.dtype)
                dbias = cupy.ndarray(self.dbias.shape, acc, alloc(math.prod(self.dbias.shape) * acc.itemsize))
            dq, dk, dv = grads[0].data.ptr, grads[1].data.ptr, grads[2].data.ptr
            parts = self.workspace.pointers(base)
            sums = (dq, dk, dv)[:self.sums]
            parts[BWD_SUMS:BWD_SUMS + self.sums] = sums   # the gradients of the accumulator dtype are the sums
            tiles, tile_memory, fresh_map = self.tile_map.locate(alloc, stream) if self.tile_map else (0, None, False)
            dbias_at = _address(dbias)
            struct, address = self.params.pack((
                q.data.ptr, k.data.ptr, v.data.ptr, o.data.ptr, do.data.ptr, m.data.ptr, l.data.ptr, dq, dk, dv, *parts,
                _address(offsets[0]), _address(offsets[1]), dbias_at, *seed_words(seed), tiles, base + self.workspace.zero_from,
                dbias_at, *sums, *NO_SUMS[self.sums:], *(array_addresses(arrays) if arrays else NO_ARRAYS)))
            for step in (self.tile_map.launches if fresh_map else ()) + self.launches:
                step(stream, address)
        extra = ()
        if dbias is not None:
            if self.dbias.to is not None:
                from ._numpy_ops import unbroadcast

                dbias = unbroadcast(dbias, self.dbias.to)
            extra = (dbias,)
        if self.row_sums:   # the workspace's Dsum part (the array holds the workspace alive while it is read)
            import cupy

            extra += (cupy.ndarray(m.shape, m.dtype, memory + (parts[BWD_DSUM] - base)),)
        return (*grads, *extra)


def backward_plan(do, q, k, v, o, *, schedule: str, precision: str, geometry: MaskGeometry, scale: float,
                  deterministic: bool, layout: BatchLayout, mods: Mods = PLAIN, packed: Packed | None = None,
                  dbias: DbiasBuffer | None = None, grad_shapes=None):
    """The backward of ``schedule`` for validated inputs as a ``BackwardPlan``; ``grad_shapes`` the
    shapes of the dq, dk, dv it returns (default q's, k's, v's; a folded call's, ``_fold``, the caller's).

    ``layout`` names q, k, v, o, do, the contiguous own-shape layouts of dq, dk, dv (``dq``, ``dk``,
    ``dv``), the modifiers' arrays by flag as in ``forward_plan`` and dbias's buffer (``bias_grad``, with
    ``dbias``). ``packed`` as in ``forward_plan``.
    """
    rows_q, D = q.shape[-2:]
    rows_k = packed.max_k if packed is not None and packed.paged else k.shape[-2]   # a paged cache's capacity
    BH = layout.count
    Nq, Nk, heads = _grid_lengths(packed, rows_q, rows_k, BH)
    n_seqs = heads // BH
    acc = accumulator_dtype(q.dtype)
    prep = get_kernels(device_tiles("bwd_prep", D, q.dtype))
    used = call_flags(mods, packed, deterministic)
    main_cfg = _variant(with_precision(device_tiles(backward_kernel(schedule, q.dtype, D, scale, mods), D, q.dtype),
                                       precision), mods, used)
    main = get_kernels(main_cfg)[main_cfg.spec.entries[0]]
    s_q, s_k, s_v, s_o, s_do, s_dq, s_dk, s_dv = (layout.of(name) for name in ("q", "k", "v", "o", "do", "dq", "dk",
                                                                               "dv"))
    lse_stats = main_cfg.kernel in ("bwd_sm90", "bwd_sm90_wide")
    rows = BH * rows_q
    # dK, dV are stored directly unless several batch entries share one K/V head
    kv_atomic = math.prod(k.shape[:-2]) < BH or math.prod(v.shape[:-2]) < BH
    T_r, T_c = -(-Nq // main_cfg.block_r), -(-Nk // main_cfg.block_c)
    n_chunks = -(-D // main_cfg.d_chunk)
    converted = q.dtype != acc   # the sums are workspaces, converted at the end
    grads = tuple((shape, q.dtype) for shape in (grad_shapes or (q.shape, k.shape, v.shape)))
    # deterministic: a counter per sum that several CTAs add into (layout.cuh, "Ordered sums")
    turns = (heads * T_r * n_chunks,) if deterministic else (0,)
    turns += tuple(math.prod(x.shape[:-2]) * n_seqs * T_c * n_chunks if deterministic and kv_atomic else 0
                   for x in (k, v))
    # masked: the main kernel flags the dQ tiles and the dK, dV tiles (per batch entry) where a masked
    # pair met an inf or NaN, flash_bwd_repair redoes them
    masked = _masked_pairs(geometry, packed, mods)
    sizes = {
        "m_b": (rows * acc.itemsize * (not lse_stats), False), "inv_l": (rows * acc.itemsize * (not lse_stats), False),
        "lse2": (rows * acc.itemsize * lse_stats, False), "Dsum": (rows * acc.itemsize, False),
        "dq_acc.ptr": (q.size * acc.itemsize * converted, True),
        "dk_acc": (k.size * acc.itemsize * (converted and kv_atomic), True),
        "dv_acc": (v.size * acc.itemsize * (converted and kv_atomic), True),
        "dq_turns": (4 * turns[0], True), "dk_turns": (4 * turns[1], True), "dv_turns": (4 * turns[2], True),
        "dq_flags": (4 * heads * T_r * masked, True), "kv_flags": (4 * heads * T_c * masked, True),
    }
    space = block_layout([sizes[name] for name in BWD_PARTS])
    convert_elems = (q.size, k.size * kv_atomic, v.size * kv_atomic) if converted else (0, 0, 0)
    convert_threads = KERNELS_THREADS["bwd_prep"]
    convert_grid = (min(max(1, -(-max(convert_elems) // (4 * convert_threads))), 65535), 3 if kv_atomic else 1)
    # the K/V tiles of a head share Q, dO, the statistics and the dQ workspace
    group = head_group(heads, Nq * (D * (2 * q.itemsize + acc.itemsize) + 2 * acc.itemsize) + 2 * Nk * D * q.itemsize)
    # flash_bwd_prep zeroes the workspace's zeroed part and the gradients that are the sums
    sums = 0 if converted else 3 if kv_atomic else 1
    zero_words = [(space.nbytes - space.zero_from) // 4, math.prod(dbias.shape) * acc.itemsize // 4 if dbias else 0]
    zero_words += [math.prod(x.shape) * acc.itemsize // 4 for x in (q, k, v)[:sums]]
    zero_words += [0] * (ZERO_RANGES - len(zero_words))
    tile_map, tile_fields = tile_map_plan(main_cfg, get_kernels(main_cfg), mods, geometry, packed, heads, Nq, Nk)
    params = Params(BWD, BWD_POINTERS,
                    q=_strides4(q, s_q), k=_strides4(k, s_k), v=_strides4(v, s_v), o=_strides4(o, s_o),
                    dO=_strides4(do, s_do), dq_acc=(*s_dq, D), dk=(*s_dk, D), dv=(*s_dv, D),
                    dk_heads=[s // (k.shape[-2] * D) for s in s_dk], dv_heads=[s // (v.shape[-2] * D) for s in s_dv],
                    convert_elems=convert_elems, batch=(layout.sizes[1], layout.sizes[2], BH),
                    **_sequence_fields(geometry, packed, BH, rows_q, rows_k), tiles=tile_fields,
                    mods=mods.fields(layout, dbias is not None and dbias.add), D=D,
                    vec=int(_vector_ok((q, k, v, do), D)),
                    prep_vec=int(_vector_ok((o, do), D)), head_group=group, kv_atomic=int(kv_atomic),
                    lse_stats=int(lse_stats), tile_r=main_cfg.block_r, tile_c=main_cfg.block_c,
                    uses=_flags.uses_word(used), zero=[(0, n) for n in zero_words], scale=float(acc.type(scale)))
    prep_cfg = device_tiles("bwd_prep", D, q.dtype)
    # a CTA per prep_cfg.block_r rows, and enough CTAs to zero at PREP_ZERO_WORDS words a thread
    prep_grid = max(-(-rows // prep_cfg.block_r),
                    min(-(-sum(zero_words) // (PREP_ZERO_WORDS * prep_cfg.threads)), 8 * current_limits().sms))
    launches = [launch(prep["flash_bwd_prep"], prep_grid, prep_cfg.threads),
                launch(main, heads * T_c * n_chunks, main_cfg.threads, main_cfg.smem_bytes)]
    if masked:
        kernels, repair_grid = _repair(D, q.dtype, heads * (T_r + T_c), mods, used)
        launches.append(launch(kernels["flash_bwd_repair"], repair_grid, KERNELS_THREADS["repair"]))
    if converted:
        launches.append(launch(prep["flash_convert"], convert_grid, convert_threads))
    return BackwardPlan(launches=tuple(launches), device=q.data.device_id, grads=grads, sums=sums, params=params,
                        workspace=space, grad_block=block_layout(array_parts(grads)), dbias=dbias, tile_map=tile_map,
                        row_sums="sink" in mods.on)


# threads per CTA of the kernels whose CTA shape does not depend on the call (their TileConfigs)
KERNELS_THREADS = {"bwd_prep": choose_tiles("bwd_prep", 1, "float32", 0).threads,
                   "repair": choose_tiles("repair", 1, "float32", 0).threads}


# ---------------------------------------------------------------------------
# Plans of earlier calls. Validation and planning read only the arrays' types, shapes, strides,
# dtypes, devices and 16-byte alignment, the flags and USE_WGMMA: a call that agrees with an earlier
# one in all of them reuses its plan and only allocates and launches.

PLANS: dict = {}
MAX_PLANS = 1024   # past this many the cache starts over


def call_key(arrays, flags):
    """What validating and planning a call of CuPy ``arrays`` and ``flags`` reads; None for other arrays."""
    cupy = sys.modules.get("cupy")
    if cupy is None:
        return None
    ndarray, described = cupy.ndarray, []
    for x in arrays:
        if type(x) is not ndarray:
            return None
        data = x.data
        described.append((x.shape, x.strides, x.dtype, data.ptr % VECTOR_BYTES, data.device_id))
    # the flags by type and repr, which tell 1 from 1.0 and True (equal, and of one hash), in C loops
    return tuple(described), tuple(map(type, flags)), repr(flags), USE_WGMMA


def keep_plan(key, plan):
    if key is not None:
        if len(PLANS) >= MAX_PLANS:
            PLANS.clear()
        PLANS[key] = plan
