"""The kernel registry and the tile sizes: the one place that says what each kernel is and chooses its tiles.

``KERNELS`` is the table of kernel families: source file, entry points, architecture, dtypes, head
dims, tile candidates and shared-memory formula. Planning (``_launch``), compiling and
``precompile`` (``_compile``) and the compile test all read it; a new kernel is a new row.

A :class:`TileConfig` fixes one specialisation of a family. The same object gives the NVRTC
defines (``FLASH_*``) and the dynamic shared-memory byte count used at launch; the kernels
``static_assert`` that their own layout matches ``FLASH_SMEM_BYTES``, so the two cannot drift.

How tiles are chosen (``choose_tiles``):

* The head dim ``D`` is padded up to a bucket ``DP`` in ``HEAD_DIM_BUCKETS`` (multiples of 16,
  the tensor-core k-step); padding columns are zero-filled.
* ``fwd_v1``, FlashAttention V1 (Algorithm 1). The V1 seed bounds the tiles by the shared memory
  ``M`` (in elements): ``B_c <= ceil(M / 4d)`` and ``B_r <= min(B_c, d)``. Inside that bound the
  first candidate whose layout fits: B_r = 16 x warps (each warp owns 16 query rows), B_c = 128
  keys while the score tile stays in registers (D <= 128), else 64. float64 tiles are smaller
  because every element is 8 bytes.
* ``fwd_v2`` (FlashAttention-2 schedule): B_r = 16 x warps query rows per CTA with O_i in
  registers, B_c keys per step, K/V double-buffered; B_c = 64 up to D = 128, 32 above, where O_i
  takes half the registers.
* ``fwd_sm90`` (FlashAttention-3 style, 16-bit, sm_90a): a producer warpgroup and consumer
  warpgroups of 64 query rows each, three up to D = 64 (B_r = 192), two above (B_r = 128);
  B_c = 128 keys up to D = 128, 96 at D = 192 and 64 at 256; the head dim is padded to whole
  64-column swizzle blocks. The CTAs are persistent, one per SM, with Q_i double-buffered where two fit
  (``q_stages``).
* ``fwd_fp8`` (the Hopper forward on float8 e4m3 q, k, v, 16-bit o; sm_90a, D <= 128): ``fwd_sm90``'s
  kernel compiled with float8 operands, B_c = 128, two consumers (three at D <= 64), the head dim padded to one
  128-byte swizzle column block (DP = 128 for every D), whose first 64 columns alone the products cover at
  D <= 64 (``d_chunk``); its V^T is written first (``flash_fp8_values``).
* ``bwd``: each warp owns 16 key rows of a K/V tile (B_c = 16 x warps); the Q tiles walked by the
  inner loop have B_r rows. dK_j and dV_j live in registers, so the head dim is split into chunks
  of ``d_chunk`` columns, one CTA per chunk (S and dP are recomputed per chunk; D <= 128 is one
  chunk).
* ``bwd_sm90`` (16-bit, sm_90a, D <= 128): a producer warpgroup and two consumers of 64 keys each
  (B_c = 128), B_r = 128 queries per step at D = 64, 64 at D = 128.
* ``bwd_sm90_wide`` (16-bit, sm_90a, 128 < D <= 256): a producer warpgroup and two consumers that
  share B_c = 64 keys, one holding dV_j and one dK_j; B_r = 64, with Q_i and dO_i double-buffered
  where two fit (``q_stages``: D <= 192).
* ``bwd_prep`` (D_i and the statistics before a backward, the conversion after it):
  ``PREP_ROWS`` rows per CTA of ``PREP_WARPS`` warps, any head dim (one module per dtype).
* ``repair`` (flash_repair.cu: the rows where a masked pair met an inf or NaN): one row per warp,
  ``REPAIR_WARPS`` warps, no shared tiles; the head dim bucket sets the elements per lane.
* ``merge`` (flash_merge.cu: ``merge_attention``): ``MERGE_WARPS`` warps, ``MergeParams.lanes``
  threads per row, any head dim (one module per dtype).
* ``append`` (flash_append.cu: new keys into a K/V cache): ``APPEND_WARPS`` warps, a thread per 16
  bytes of a row, any head dim (one module per dtype, and one per dtype for a paged cache).
* The warp-specialised kernels split the register file between producer and consumers in one
  place, :attr:`TileConfig.registers`.
* The switches a call turns on (the score modifiers of ``score_mod.cuh``, dbias, packed
  variable-length sequences, a paged K/V cache, the deterministic backward) are the rows of
  ``_flags.FLAGS``: compile-time flags of a specialisation in the families a row compiles
  (``with_flags``), a bit of the run-time word ``uses`` elsewhere. They change no tile size but the
  Hopper forward's B_c and the Hopper backward's B_r under per-pair work (``PAIR_BLOCK_C``,
  ``PAIR_BLOCK_R``). ``specialisation_count`` counts the
  specialisations that can exist.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable, Optional

import numpy

from . import _flags
from ._expr import UserCode

HEAD_DIM_BUCKETS = (32, 64, 96, 128, 192, 256)
MAX_HEAD_DIM = HEAD_DIM_BUCKETS[-1]
DTYPE_CODES = {"float16": 0, "bfloat16": 1, "float32": 2, "float64": 3}
ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}
SIXTEEN_BIT = ("float16", "bfloat16")
SMEM_PAD_BYTES = 16  # one 16-byte pad per shared row (types.cuh: SMEM_PAD_BYTES)
SM90_SMEM_BLOCK = 227 * 1024   # shared memory a block may opt in to on sm_90 (H100, H200)
REGISTER_FILE = 65536          # 32-bit registers per SM (sm_80, sm_90)
WARP_SIZE = 32
BWD_SM90_MAX_HEAD_DIM = 128    # dK_j, dV_j of 64 keys per warpgroup in registers; the wide kernel above
FP8_HEAD_DIM = 128             # the float8 forward's one padded head dim: a 128-byte swizzle line of float8
REPAIR_WARPS = 8               # flash_repair.cu: rows in flight per CTA
PREP_WARPS, PREP_ROWS = 8, 32  # flash_bwd_prep.cu: 256 threads, 8 per row; flash_convert: 256 threads
MERGE_WARPS = 8                # flash_merge.cu: 256 threads, MergeParams.lanes per row
APPEND_WARPS = 8               # flash_append.cu: 256 threads

# (B_r, B_c, warps) in order of preference
_FWD_V1_CANDIDATES = {
    "16bit": ((64, 128, 4), (64, 64, 4), (32, 64, 2), (16, 32, 1)),
    "float32": ((64, 64, 4), (32, 64, 2), (32, 32, 2), (16, 16, 1)),
    "float64": ((32, 32, 2), (16, 32, 1), (16, 16, 1)),
}
# (B_r, B_c, warps) in order of preference, keyed by the largest padded head dim they serve (O_i
# (16, DP) lives in registers next to the (16, B_c) scores). 16-bit: 128 x 64 spills at D <= 64;
# float64: B_c = 64 only at D <= 64 (measured, H200: 64 x 64 15.9 TFLOP/s at D = 64; at D = 128
# 64 x 32 gives 19.5 where 64 x 64 gives 7.5)
_FWD_V2_CANDIDATES = {
    "16bit": {64: ((64, 64, 4),), 128: ((128, 64, 8), (64, 64, 4)), 256: ((64, 32, 4), (32, 32, 2), (16, 16, 1))},
    "float32": {256: ((64, 32, 4), (32, 32, 2), (16, 16, 1))},
    "float64": {64: ((64, 64, 4), (64, 32, 4), (32, 32, 2), (16, 16, 1)), 256: ((64, 32, 4), (32, 32, 2), (16, 16, 1))},
}
# (B_r, B_c, warps) of the Hopper forward by padded head dim: a producer warpgroup and consumer
# warpgroups of 64 query rows each. Three consumers up to D = 64 (measured 1.1-1.3x two at
# N >= 2048, equal at 512), two above, where O_i needs the registers; B_c = 128 keys up to
# D = 128, 96 at D = 192 (the most whose K/V ring fits beside one Q_i), 64 at D = 256.
_FWD_SM90_CANDIDATES = {64: (192, 128, 16), 128: (128, 128, 12), 192: (128, 96, 12), 256: (128, 64, 12)}
# (B_r, B_c, warps, max d_chunk) in order of preference
_BWD_CANDIDATES = {
    "16bit": ((32, 64, 4, 128), (32, 32, 2, 128), (16, 16, 1, 64)),
    "float32": ((32, 64, 4, 128), (32, 32, 2, 64), (16, 16, 1, 32)),
    "float64": ((32, 64, 4, 64), (32, 32, 2, 32), (16, 16, 1, 32)),
}
# float64 chunks of 64 columns (measured, H200, D = 128: 11.9 TFLOP/s; 8.5 with 32, 8.8 with 128)
# The portable backward's CTAs per SM that ptxas must leave registers for, by precision class and padded
# head dim. 16-bit at D = 64: three of 128 threads (168 registers each; left to itself ptxas took 205-238
# and two CTAs). Against e6f132f's kernels (H200, benchmarks/RESULTS.md, fourteenth session): ALiBi 0.80x
# -> 0.98x with the bound, plain 0.99x -> 1.00x, and softcap 1.2x, bias 1.3x, mask 1.2x, dropout 1.16x.
# At D = 32 the bound was not measured alone (the bias backward there was 15-20% slower than e6f132f
# with it): ptxas's own choice, as everywhere else.
_BWD_MIN_CTAS = {"16bit": {64: 3}}

# The forward schedule "auto" runs, by precision class and padded head dim: (largest bucket, schedule),
# measured on the H200 (benchmarks/RESULTS.md). V2 wins wherever its O_i fits the registers: 16-bit
# 1.6-2x V1, float32 1.4-1.9x, float64 D <= 128 1.2-2.7x; float64 above 128 keeps V1 (V2's
# (16, D) float64 O_i spills a kilobyte).
AUTO_FORWARD = {
    "16bit": ((256, "v2"),),
    "float32": ((256, "v2"),),
    "float64": ((128, "v2"), (256, "v1")),
}
# registers setmaxnreg leaves the producer warpgroup of a warp-specialised kernel, by consumers
_PRODUCER_REGS = {"fwd_sm90": {2: 40, 3: 32}, "fwd_fp8": {2: 40, 3: 32}, "bwd_sm90": {2: 24}, "bwd_sm90_wide": {2: 24}}


def dtype_name(dtype) -> str:
    """Canonical name of a supported dtype (``'bfloat16'`` for ml_dtypes')."""
    name = dtype if isinstance(dtype, str) else numpy.dtype(dtype).name
    if name not in DTYPE_CODES:
        raise TypeError(f"unsupported dtype {name}")
    return name


def accumulator_dtype(dtype) -> numpy.dtype:
    """What the kernels accumulate in, and the dtype of m and l: float64 for float64, else float32."""
    return numpy.dtype(numpy.float64 if dtype_name(dtype) == "float64" else numpy.float32)


def auto_forward(head_dim: int, dtype) -> str:
    """The forward schedule of ``schedule="auto"`` at ``head_dim`` and ``dtype`` (``AUTO_FORWARD``)."""
    d_pad = head_dim_bucket(head_dim)
    return next(schedule for bucket, schedule in AUTO_FORWARD[_precision_class(dtype_name(dtype))] if d_pad <= bucket)


def head_dim_bucket(head_dim: int) -> int:
    """Smallest bucket in ``HEAD_DIM_BUCKETS`` holding ``head_dim``."""
    for bucket in HEAD_DIM_BUCKETS:
        if head_dim <= bucket:
            return bucket
    raise ValueError(f"head dim {head_dim} > {MAX_HEAD_DIM}")


def _precision_class(dtype: str) -> str:
    return "16bit" if dtype in SIXTEEN_BIT else dtype


@dataclass(frozen=True)
class TileConfig:
    """One compiled kernel specialisation.

    Attributes
    ----------
    kernel : str
        A key of ``KERNELS``.
    dtype : str
        Element dtype name.
    d_pad : int
        Head dim padded to its bucket (``DP``; 0 for a kernel that takes any head dim).
    block_r : int
        ``B_r``, query rows per tile.
    block_c : int
        ``B_c``, key rows per tile.
    warps : int
        Warps per CTA.
    d_chunk : int
        Head-dim columns of one output chunk (``DC``).
    fp32_mma : int
        float32 products (``mma_sm80.cuh``): 0 exact FMA, 1 3xTF32, 2 one TF32 product on the
        tensor cores (``with_precision``).
    flags : tuple of str
        The switches compiled in (rows of ``_flags.FLAGS``, in table order; ``with_flags``); a plain
        call's kernel has none. ``cfg.<name>`` says whether flag ``<name>`` is compiled in.
    user : _expr.UserCode or None
        User expressions (score_mod, score_mod_grad, mask_mod) compiled in (``with_user``).
    """

    kernel: str
    dtype: str
    d_pad: int
    block_r: int
    block_c: int
    warps: int
    d_chunk: int
    fp32_mma: int = 0
    flags: tuple = ()
    user: Optional[UserCode] = None

    def __getattr__(self, name: str):
        if name in _flags.BY_NAME:   # cfg.bias: the bias compiled in
            return name in self.flags
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

    @property
    def spec(self) -> "KernelSpec":
        return KERNELS[self.kernel]

    @property
    def entries(self) -> tuple[str, ...]:
        """Its kernels: the family's and, with a mask_mod compiled into a main kernel, the two that write
        its tile map (tile_map.cuh)."""
        if self.user is not None and self.user.mask is not None and self.kernel in TILE_MAP_KERNELS:
            return (*self.spec.entries, *TILE_MAP_ENTRIES)
        return self.spec.entries

    @property
    def itemsize(self) -> int:
        return ITEMSIZE[self.dtype]

    @property
    def operand_itemsize(self) -> int:
        """Bytes of an element of q, k, v: the dtype's, or a float8 family's 1 (``KernelSpec.float8``)."""
        return 1 if self.spec.float8 else self.itemsize

    @property
    def acc_itemsize(self) -> int:
        """Bytes of the accumulator type (float32, float64 for float64)."""
        return accumulator_dtype(self.dtype).itemsize

    @property
    def threads(self) -> int:
        return WARP_SIZE * self.warps

    @property
    def pitch(self) -> int:
        """Elements of a padded shared row of ``d_pad`` columns (the mma.sync kernels)."""
        return self.d_pad + SMEM_PAD_BYTES // self.itemsize

    @property
    def smem_bytes(self) -> int:
        """Dynamic shared memory of the kernel's layout (the family's formula, ``KernelSpec.smem``)."""
        return self.spec.smem(self)

    @property
    def q_stages(self) -> int:
        """Q_i buffers of the persistent Hopper forward and of the wide Hopper backward's Q_i, dO_i
        ring: two (the next Q tile lands under the current one) where they fit sm_90's shared
        memory, else one."""
        if self.kernel not in _STAGED:
            return 1
        return 2 if _STAGED[self.kernel](self, 2) <= SM90_SMEM_BLOCK else 1

    @property
    def registers(self) -> Optional[tuple[int, int]]:
        """(producer, consumer) registers per thread of a warp-specialised kernel after setmaxnreg:
        the fewest the producer's copies need, the rest of the CTA's allocation shared by the
        consumer warpgroups (multiples of 8, at most 256); None for the other kernels."""
        if self.kernel not in _PRODUCER_REGS:
            return None
        consumers = self.warps // 4 - 1
        producer = _PRODUCER_REGS[self.kernel][consumers]
        entry = REGISTER_FILE // self.threads // 8 * 8   # per thread at launch, one CTA per SM
        return producer, min(256, ((1 + consumers) * entry - producer) // consumers // 8 * 8)

    @property
    def min_ctas(self) -> int:
        """CTAs per SM the portable backward's ``__launch_bounds__`` asks registers for
        (``_BWD_MIN_CTAS``); 0: no bound beyond the threads (the other kernels, other buckets)."""
        if self.kernel != "bwd":
            return 0
        return _BWD_MIN_CTAS.get(_precision_class(self.dtype), {}).get(self.d_pad, 0)

    def defines(self) -> tuple[str, ...]:
        """NVRTC ``-D`` options of this specialisation."""
        out = [
            f"-DFLASH_DTYPE={DTYPE_CODES[self.dtype]}",
            f"-DFLASH_DP={self.d_pad}",
            f"-DFLASH_BR={self.block_r}",
            f"-DFLASH_BC={self.block_c}",
            f"-DFLASH_WARPS={self.warps}",
            f"-DFLASH_DC={self.d_chunk}",
            f"-DFLASH_SMEM_BYTES={self.smem_bytes}",
        ]
        if self.dtype == "float32":
            out.append(f"-DFLASH_FP32_MMA={self.fp32_mma}")
        if self.spec.float8:
            out.append("-DFLASH_FP8=1")
        # the flags compiled in, and those the family reads at run time (types.cuh: FLASH_<NAME>)
        out += [f"-D{flag.define}={1 if flag.name in self.flags else _flags.AT_RUN_TIME}" for flag in _flags.FLAGS
                if flag.name in self.flags or flag.read_at_run_time(self.kernel, self.flags)]
        if self.user is not None:
            out += self.user.defines()
        if self.kernel in _STAGED:
            out.append(f"-DFLASH_Q_STAGES={self.q_stages}")
        if self.registers:
            out += [f"-DFLASH_PRODUCER_REGS={self.registers[0]}", f"-DFLASH_CONSUMER_REGS={self.registers[1]}"]
        if self.min_ctas:
            out.append(f"-DFLASH_MIN_CTAS={self.min_ctas}")
        return tuple(out)


def _head_dim_chunk(d_pad: int, max_chunk: int, multiple: int) -> int:
    """Width of the fewest equal chunks of ``d_pad`` columns, at most ``max_chunk`` wide, each a multiple of ``multiple``."""
    n = math.ceil(d_pad / max_chunk)
    while d_pad % n or (d_pad // n) % multiple:
        n += 1
    return d_pad // n


# ---------------------------------------------------------------------------------------------
# Shared-memory layouts, one formula per family (the .cu file's header lists the same buffers)

def _fwd_v1_bytes(c: TileConfig) -> int:
    # s_K, s_V (B_c, DP); s_Q (B_r, DP); s_P (B_r, B_c)
    pad = SMEM_PAD_BYTES // c.itemsize
    return ((2 * c.block_c + c.block_r) * c.pitch + c.block_r * (c.block_c + pad)) * c.itemsize


def _fwd_v2_bytes(c: TileConfig) -> int:
    # s_Q (B_r, DP); two stages of K_j, V_j (B_c, DP); s_P (B_r, B_c) for the FMA dtypes only
    pad = SMEM_PAD_BYTES // c.itemsize
    elems = (c.block_r + 2 * 2 * c.block_c) * c.pitch
    if c.dtype not in SIXTEEN_BIT:
        elems += c.block_r * (c.block_c + pad)
    return elems * c.itemsize


def _fwd_sm90_bytes(c: TileConfig, q_stages: Optional[int] = None) -> int:
    # a ring of q_stages Q_i (B_r, DP); rings of two K_j and two V_j (B_c, DP), swizzled;
    # 2 q_stages + 8 mbarriers; q_stages + 1 tile indices (8 bytes each); + slack to align the tiles to 1024 bytes
    q_stages = c.q_stages if q_stages is None else q_stages
    return ((q_stages * c.block_r + 4 * c.block_c) * c.d_pad * c.operand_itemsize + (2 * q_stages + 8) * 8
            + (q_stages + 1) * 8 + 1024)


def _bwd_bytes(c: TileConfig) -> int:
    # s_K, s_V (B_c, DP); s_Q, s_dO (B_r, DP); s_dS (B_c, B_r); s_m, s_inv_l, s_D (B_r)
    pad = SMEM_PAD_BYTES // c.itemsize
    elems = (2 * c.block_c + 2 * c.block_r) * c.pitch + c.block_c * (c.block_r + pad)
    return elems * c.itemsize + 3 * c.block_r * c.acc_itemsize


def _bwd_sm90_bytes(c: TileConfig) -> int:
    # s_K, s_V (B_c, DP); rings of two Q_i, dO_i (B_r, DP); two dS^T (B_c, B_r); float32 dQ_i
    # (B_r, DP + 4); two (2, B_r) statistics; five mbarriers; + slack to align the tiles to 1024 bytes
    elems = (2 * c.block_c + 4 * c.block_r) * c.d_pad + 2 * c.block_c * c.block_r
    return (elems * c.itemsize + c.block_r * (c.d_pad + 4) * 4 + 2 * 2 * c.block_r * c.acc_itemsize + 5 * 8
            + 1024)


def _bwd_sm90_wide_bytes(c: TileConfig, q_stages: Optional[int] = None) -> int:
    # s_K, s_V (B_c, DP); rings of q_stages Q_i, dO_i (B_r, DP); dS^T (B_c, B_r); float32 P^T
    # (B_c, B_r) and dQ_i (B_r, DP + 4); q_stages (2, B_r) statistics; 1 + 2 q_stages mbarriers;
    # + slack to align the tiles to 1024 bytes
    q_stages = c.q_stages if q_stages is None else q_stages
    elems = (2 * c.block_c + 2 * q_stages * c.block_r) * c.d_pad + c.block_c * c.block_r
    return (elems * c.itemsize + (c.block_c * c.block_r + c.block_r * (c.d_pad + 4)) * 4
            + q_stages * 2 * c.block_r * c.acc_itemsize + (1 + 2 * q_stages) * 8 + 1024)


# the families whose Q ring has one or two stages by what fits (TileConfig.q_stages)
_STAGED = {"fwd_sm90": _fwd_sm90_bytes, "fwd_fp8": _fwd_sm90_bytes, "bwd_sm90_wide": _bwd_sm90_wide_bytes}


def _no_smem(c: TileConfig) -> int:
    return 0


# ---------------------------------------------------------------------------------------------
# Tile choice, one function per family: (family, head dim, dtype name, shared memory) -> TileConfig

def _first_fit(configs, smem_limit):
    for cfg in configs:
        if cfg.smem_bytes <= smem_limit:
            return cfg
    return None


def _fwd_v1_tiles(kernel, head_dim, name, smem_limit):
    d_pad, prec = head_dim_bucket(head_dim), _precision_class(name)
    seed_bc = math.ceil(smem_limit / ITEMSIZE[name] / (4 * d_pad))  # B_c <= ceil(M / 4d)
    d_chunk = _head_dim_chunk(d_pad, {"16bit": 128, "float32": 64, "float64": 32}[prec], 16)
    return _first_fit((TileConfig(kernel, name, d_pad, br, bc, w, d_chunk)
                       for br, bc, w in _FWD_V1_CANDIDATES[prec]
                       # B_r <= min(B_c, d); the (16, B_c) score tile stays in registers
                       if bc <= seed_bc and br <= min(bc, d_pad) and not (bc > 64 and d_pad > 128)), smem_limit)


def _fwd_v2_tiles(kernel, head_dim, name, smem_limit):
    d_pad, table = head_dim_bucket(head_dim), _FWD_V2_CANDIDATES[_precision_class(name)]
    candidates = table[min(b for b in table if d_pad <= b)]
    return _first_fit((TileConfig(kernel, name, d_pad, br, bc, w, d_pad) for br, bc, w in candidates), smem_limit)


def _fwd_sm90_tiles(kernel, head_dim, name, smem_limit):
    d_pad = -(-head_dim_bucket(head_dim) // 64) * 64   # whole 64-column swizzle blocks, zero-filled
    br, bc, w = _FWD_SM90_CANDIDATES[min(b for b in _FWD_SM90_CANDIDATES if d_pad <= b)]
    return _first_fit((TileConfig(kernel, name, d_pad, br, bc, w, d_pad),), smem_limit)


def _fwd_fp8_tiles(kernel, head_dim, name, smem_limit):
    # one 128-byte column block of float8 (DP = 128 for every D <= 128), B_c = 128: V^T's rows are one block
    # of B_c keys. At D <= 64 the products cover half the line (d_chunk 64) and three consumers fit (measured,
    # H200, bf16 o: 1.14-1.23x two at N 4096-16384); above, two, as the 16-bit kernel
    if head_dim <= 64:
        return _first_fit((TileConfig(kernel, name, FP8_HEAD_DIM, 192, 128, 16, 64),), smem_limit)
    return _first_fit((TileConfig(kernel, name, FP8_HEAD_DIM, 128, 128, 12, FP8_HEAD_DIM),), smem_limit)


def _bwd_tiles(kernel, head_dim, name, smem_limit):
    d_pad, prec = head_dim_bucket(head_dim), _precision_class(name)
    # chunks of 32 columns: the dQ product splits a chunk over two warps of even n-tiles
    return _first_fit((TileConfig(kernel, name, d_pad, br, bc, w, _head_dim_chunk(d_pad, chunk, 32))
                       for br, bc, w, chunk in _BWD_CANDIDATES[prec]), smem_limit)


def _bwd_sm90_tiles(kernel, head_dim, name, smem_limit):
    d_pad = -(-head_dim_bucket(head_dim) // 64) * 64
    # a producer warpgroup and two consumers of 64 keys each; 128 queries per step at D = 64 (64 under
    # per-pair work: PAIR_BLOCK_R), 64 at D = 128 (dK_j, dV_j, S_ij^T and dP_ij^T share the registers)
    return _first_fit((TileConfig(kernel, name, d_pad, 128 if d_pad <= 64 else 64, 128, 12, d_pad),), smem_limit)


def _bwd_sm90_wide_tiles(kernel, head_dim, name, smem_limit):
    d_pad = -(-head_dim_bucket(head_dim) // 64) * 64
    # two consumers share 64 keys (one holds dV_j, the other dK_j), 64 queries per step
    return _first_fit((TileConfig(kernel, name, d_pad, 64, 64, 12, d_pad),), smem_limit)


def _bwd_prep_tiles(kernel, head_dim, name, smem_limit):
    return TileConfig(kernel, name, 0, PREP_ROWS, 1, PREP_WARPS, 0)


def _merge_tiles(kernel, head_dim, name, smem_limit):
    return TileConfig(kernel, name, 0, 1, 1, MERGE_WARPS, 0)


def _append_tiles(kernel, head_dim, name, smem_limit):
    return TileConfig(kernel, name, 0, 1, 1, APPEND_WARPS, 0)


def _repair_tiles(kernel, head_dim, name, smem_limit):
    d_pad = head_dim_bucket(head_dim)
    return TileConfig(kernel, name, d_pad, 1, 1, REPAIR_WARPS, d_pad)


@dataclass(frozen=True)
class KernelSpec:
    """One kernel family: a source file of ``kernels_cu/`` and how to build and launch it."""

    source: str                    # file in kernels_cu/
    entries: tuple[str, ...]       # its kernels (extern "C" names)
    params: tuple[str, ...]        # the parameter struct each entry takes (params.cuh, _params.STRUCTS)
    arch: Optional[str]            # NVRTC -arch of an architecture-specific kernel, None for any
    dtypes: tuple[str, ...]        # element dtypes it takes
    max_head_dim: int
    tiles: Callable                # (family, head dim, dtype name, shared memory) -> TileConfig or None
    smem: Callable                 # TileConfig -> dynamic shared-memory bytes
    min_head_dim: int = 1          # the smallest head dim it takes (the wide Hopper backward: 129)
    any_head_dim: bool = False     # one specialisation per dtype serves every head dim
    fp32_products: bool = False    # its float32 products follow ``precision`` (FP32_PRODUCTS)
    score_mods: bool = True        # computes scores, so takes the score modifiers (_flags.SCORED)
    float8: bool = False           # q, k, v are float8 e4m3 (FLASH_FP8); ``dtypes`` are o's


ALL_DTYPES = tuple(DTYPE_CODES)
KERNELS = {
    "fwd_v1": KernelSpec("flash_fwd_v1.cu", ("flash_fwd_v1",), ("FwdParams",), None, ALL_DTYPES, MAX_HEAD_DIM,
                         _fwd_v1_tiles, _fwd_v1_bytes, fp32_products=True),
    "fwd_v2": KernelSpec("flash_fwd_v2.cu", ("flash_fwd_v2",), ("FwdParams",), None, ALL_DTYPES, MAX_HEAD_DIM,
                         _fwd_v2_tiles, _fwd_v2_bytes, fp32_products=True),
    "fwd_sm90": KernelSpec("flash_fwd_sm90.cu", ("flash_fwd_sm90",), ("FwdParams",), "sm_90a", SIXTEEN_BIT,
                           MAX_HEAD_DIM, _fwd_sm90_tiles, _fwd_sm90_bytes),
    "fwd_fp8": KernelSpec("flash_fwd_sm90.cu", ("flash_fwd_sm90", "flash_fp8_values"), ("FwdParams",) * 2, "sm_90a",
                          SIXTEEN_BIT, FP8_HEAD_DIM, _fwd_fp8_tiles, _fwd_sm90_bytes, score_mods=False, float8=True),
    "bwd_prep": KernelSpec("flash_bwd_prep.cu", ("flash_bwd_prep", "flash_convert"), ("BwdParams",) * 2, None,
                           ALL_DTYPES, MAX_HEAD_DIM, _bwd_prep_tiles, _no_smem, any_head_dim=True, score_mods=False),
    "bwd": KernelSpec("flash_bwd.cu", ("flash_bwd",), ("BwdParams",), None, ALL_DTYPES, MAX_HEAD_DIM,
                      _bwd_tiles, _bwd_bytes, fp32_products=True),
    "bwd_sm90": KernelSpec("flash_bwd_sm90.cu", ("flash_bwd_sm90",), ("BwdParams",), "sm_90a", SIXTEEN_BIT,
                           BWD_SM90_MAX_HEAD_DIM, _bwd_sm90_tiles, _bwd_sm90_bytes),
    "bwd_sm90_wide": KernelSpec("flash_bwd_sm90_wide.cu", ("flash_bwd_sm90_wide",), ("BwdParams",), "sm_90a",
                                SIXTEEN_BIT, MAX_HEAD_DIM, _bwd_sm90_wide_tiles, _bwd_sm90_wide_bytes,
                                min_head_dim=BWD_SM90_MAX_HEAD_DIM + 1),
    "repair": KernelSpec("flash_repair.cu", ("flash_fwd_repair", "flash_bwd_repair"), ("FwdParams", "BwdParams"),
                         None, ALL_DTYPES, MAX_HEAD_DIM, _repair_tiles, _no_smem),
    "merge": KernelSpec("flash_merge.cu", ("flash_merge",), ("MergeParams",), None, ALL_DTYPES, MAX_HEAD_DIM,
                        _merge_tiles, _no_smem, any_head_dim=True, score_mods=False),
    "append": KernelSpec("flash_append.cu", ("flash_append",), ("AppendParams",), None, ALL_DTYPES, MAX_HEAD_DIM,
                         _append_tiles, _no_smem, any_head_dim=True, score_mods=False),
}

assert {k for k, spec in KERNELS.items() if spec.score_mods} == set(_flags.SCORED)


# float32 products of each ``precision`` (TileConfig.fp32_mma, mma_sm80.cuh): "highest" 3xTF32 on
# the tensor cores (float32 accuracy), "tf32" one TF32 product. 0 would be the exact FMA tiles.
FP32_PRODUCTS = {"highest": 1, "tf32": 2}
PRECISIONS = tuple(FP32_PRODUCTS)
PRECISION_OF = {code: name for name, code in FP32_PRODUCTS.items()}


# the main kernels, which visit the tiles of mask_mod's tile map, and the kernels that write it (tile_map.cuh)
TILE_MAP_KERNELS = _flags.MAIN
TILE_MAP_ENTRIES = ("flash_tile_map", "flash_tile_lists")

# K/V tile rows of the Hopper forward, and Q tile rows of the Hopper backward, that read a bias or a mask,
# or draw dropout's keep set (the flags with ``pair_tiles``): each consumer thread loads (or draws) one value
# per score it holds, and at B_c = 128 (the forward at D 64, and with two per-pair flags at D 128) or
# B_r = 128 (the backward, D <= 64) that spills hundreds of bytes (NVRTC 13)
PAIR_BLOCK_C = {"fwd_sm90": 64}
PAIR_BLOCK_R = {"bwd_sm90": 64}
# ... but for these per-pair flags alone, by (family, head-dim bucket): the family's own B_c, measured faster
# than PAIR_BLOCK_C's (H100, RESULTS.md, twenty-first session: D 64 mask 1.03-1.12x, though it spills 352
# bytes; D 128 bias 1.21-1.28x and mask 1.10-1.18x, spill-free). Slower at B_c = 128: D 64 bias 0.85-0.92x,
# D 64 dropout 0.89-0.98x; D 128 dropout even
PAIR_WIDE_C = {("fwd_sm90", 64): {("mask",)}, ("fwd_sm90", 128): {("bias",), ("mask",)}}


def _flag_sets(kernel: str, names) -> tuple:
    """The flags among ``names`` that ``kernel``'s family compiles in, in table order: those whose
    requirement is there too (or not compiled in this family) and, for a flag compiled only beside another
    in this family (``Flag.beside``), that one. Raises ValueError for a pair the family never compiles
    together (``Flag.excludes``)."""
    names = set(names)
    compiled = {f.name for f in _flags.compiled_in(kernel)}
    on = tuple(f.name for f in _flags.compiled_in(kernel)
               if f.name in names and (f.requires is None or f.requires in names or f.requires not in compiled)
               and all(other in names for family, other in f.beside if family == kernel))
    for name in on:
        for family, other in _flags.BY_NAME[name].excludes:
            if family == kernel and other in on:
                raise ValueError(f"{kernel} does not compile {name} with {other}")
    return on


def with_flags(cfg: TileConfig, names) -> TileConfig:
    """``cfg`` with the flags among ``names`` (``_flags.FLAGS``) that its family compiles in, and no
    others: those it reads at run time and those it does not read are left to the run-time word. With
    per-pair work (a bias, a mask, dropout) the Hopper forward takes smaller K/V tiles (``PAIR_BLOCK_C``,
    but for ``PAIR_WIDE_C``) and the Hopper backward smaller Q tiles (``PAIR_BLOCK_R``)."""
    on = _flag_sets(cfg.kernel, names)
    block_r, block_c = cfg.block_r, cfg.block_c
    pairs = tuple(name for name in on if _flags.BY_NAME[name].pair_tiles)
    if pairs:
        block_r = min(block_r, PAIR_BLOCK_R.get(cfg.kernel, block_r))
        if pairs not in PAIR_WIDE_C.get((cfg.kernel, cfg.d_pad), ()):
            block_c = min(block_c, PAIR_BLOCK_C.get(cfg.kernel, block_c))
    return replace(cfg, flags=on, block_r=block_r, block_c=block_c)


def with_user(cfg: TileConfig, user: Optional[UserCode]) -> TileConfig:
    """``cfg`` with a call's user expressions (``_expr.UserCode``, or None); with a score_mod the Hopper
    forward takes the smaller K/V tiles a bias takes (``PAIR_BLOCK_C``: at D = 64 and B_c = 128 the
    expression spills; a mask_mod alone does not)."""
    if not cfg.spec.score_mods or user is None:
        return cfg
    block_c = cfg.block_c
    if user.score is not None:
        block_c = min(block_c, PAIR_BLOCK_C.get(cfg.kernel, block_c))
    return replace(cfg, user=user, block_c=block_c)


def with_precision(cfg: TileConfig, precision: str) -> TileConfig:
    """``cfg`` with the float32 products of ``precision``; other dtypes and kernels are unchanged."""
    if cfg.dtype != "float32" or not cfg.spec.fp32_products:
        return cfg
    return replace(cfg, fp32_mma=FP32_PRODUCTS[precision])


def choose_tiles(kernel: str, head_dim: int, dtype, smem_limit: int) -> TileConfig:
    """Tile sizes for ``kernel`` at ``head_dim`` and ``dtype`` on a device.

    Parameters
    ----------
    kernel : str
        A key of ``KERNELS``.
    head_dim : int
        ``D``, 1 <= D <= the family's ``max_head_dim``.
    dtype : dtype-like
    smem_limit : int
        Shared memory a block may use on the device (bytes, opt-in maximum).

    Returns
    -------
    TileConfig

    Raises
    ------
    ValueError
        An unknown family, a dtype or head dim it does not take, or no tiles that fit.
    """
    name = dtype_name(dtype)
    spec = KERNELS.get(kernel)
    if spec is None:
        raise ValueError(f"unknown kernel {kernel!r}; the kernels are {', '.join(KERNELS)}")
    if name not in spec.dtypes or not spec.min_head_dim <= head_dim <= spec.max_head_dim:
        raise ValueError(f"{kernel} takes {' and '.join(spec.dtypes)} with {spec.min_head_dim} <= D <= {spec.max_head_dim}, "
                         f"not {name} with D = {head_dim}")
    cfg = spec.tiles(kernel, head_dim, name, smem_limit)
    if cfg is None:
        raise ValueError(f"no {kernel} tiles fit {smem_limit} bytes of shared memory (D={head_dim}, {name})")
    return cfg


def runs_on(spec: KernelSpec, arch: str) -> bool:
    """``spec`` is built for devices of ``arch`` (e.g. ``'sm_90'``): any, or its own family only."""
    return spec.arch is None or spec.arch.startswith(arch)


def _base_configs(smem_limit: int, arch: str):
    """(family, TileConfig) of every family that runs on ``arch``, dtype it takes and padded head dim, in one
    variant per precision, no flag compiled in."""
    for kernel, spec in KERNELS.items():
        if not runs_on(spec, arch):
            continue
        seen = []
        for dtype in spec.dtypes:
            for bucket in (HEAD_DIM_BUCKETS[:1] if spec.any_head_dim else HEAD_DIM_BUCKETS):
                if not spec.min_head_dim <= bucket <= spec.max_head_dim:
                    continue
                cfg = spec.tiles(kernel, bucket, dtype, smem_limit)
                if cfg is None:
                    if kernel in ("fwd_v1", "bwd"):   # the portable kernels serve every call
                        raise ValueError(f"no {kernel} tiles fit {smem_limit} bytes (D={bucket}, {dtype})")
                    continue
                for base in (with_precision(cfg, p) for p in PRECISIONS):
                    if base not in seen:
                        seen.append(base)
                        yield base


def _subsets(names):
    """Every subset of ``names`` (a tuple), the empty one first."""
    for mask in range(1 << len(names)):
        yield tuple(name for i, name in enumerate(names) if mask >> i & 1)


def all_tile_configs(smem_limit: int, arch: str = "sm_90", *, plain_flags: bool = True) -> list[TileConfig]:
    """Every specialisation the library can launch on a device of ``arch`` with ``smem_limit`` for a call
    without modifiers.

    V1 always fits; a V2 forward whose double-buffered tiles do not fit (float64 with D > 192
    below 167 KB) is left out: that call runs V1. Architecture-specific kernels are listed for
    their architecture's family only, for the dtypes and head dims they take; buckets that share
    a padded head dim give one configuration; the families that compile a ``plain`` flag (one a call
    without modifiers may take, ``_flags.Flag.plain``) come with and without it (only without when
    ``plain_flags`` is false: the compile test covers them in ``modified_tile_configs``), and those
    whose float32 products follow ``precision`` in one variant per precision.
    """
    configs = []
    for base in _base_configs(smem_limit, arch):
        plain = tuple(f.name for f in _flags.compiled_in(base.kernel) if f.plain) if plain_flags else ()
        configs += [with_flags(base, names) for names in _subsets(plain)]
    return list(dict.fromkeys(configs))   # a plain flag compiled only beside another adds none


def family_flag_sets(kernel: str) -> list[tuple]:
    """Every set of flags ``kernel``'s family compiles, each once: the subsets of its compiled flags that
    ``with_flags`` keeps as they are (requirements met, no excluded pair)."""
    compiled = tuple(f.name for f in _flags.compiled_in(kernel))
    out = []
    for names in _subsets(compiled):
        try:
            if _flag_sets(kernel, names) == names:
                out.append(names)
        except ValueError:   # a pair the family never compiles together
            continue
    return out


def specialisation_count(smem_limit: int = SM90_SMEM_BLOCK, arch: str = "sm_90") -> int:
    """How many distinct specialisations can exist on a device of ``arch`` with ``smem_limit`` bytes of
    shared memory, user expressions aside: every family, dtype, padded head dim and precision
    (``all_tile_configs`` without its flags) times the sets of flags the family compiles
    (``family_flag_sets``). Each is a compile of its own, 0.5-3 s, the first time a call needs it."""
    sets = {kernel: len(family_flag_sets(kernel)) for kernel in KERNELS}
    return sum(sets[base.kernel] for base in _base_configs(smem_limit, arch))


def modified_tile_configs(smem_limit: int, arch: str = "sm_90") -> list[TileConfig]:
    """The flagged specialisations the compile test builds besides ``all_tile_configs(...,
    plain_flags=False)``, a covering set: each family with every flag it compiles in (each an ``if
    constexpr`` block of its own, so this compiles every modifier, varlen, paged and ordered line of
    every kernel) at as many (dtype, bucket) pairs as the family has dtypes or buckets, whichever is
    more (``_covering_pairs``), so that each flag meets each dtype and each bucket once (``all_tile_configs``
    builds every pair plainly); where the family never runs two flags together (``Flag.excludes``: the
    paged V2 forward has no bias, mask or dropout), once without the row and once without the flags it
    excludes (and without the family's other such rows). The per-precision variants change nothing the
    flags touch and are not repeated."""
    out = []
    bases = [base for base in _base_configs(smem_limit, arch) if base.fp32_mma in (0, FP32_PRODUCTS["highest"])]
    for kernel in dict.fromkeys(base.kernel for base in bases):
        full = tuple(f.name for f in _flags.compiled_in(kernel))
        if not full:
            continue
        by_pair = {(base.dtype, base.d_pad): base for base in bases if base.kernel == kernel}
        # each row that excludes flags here: once without it, once without what it excludes
        rows = {f.name: {other for family, other in f.excludes if family == kernel} for f in _flags.FLAGS
                if any(family == kernel for family, _ in f.excludes)}
        sets = [full] if not rows else [tuple(n for n in full if n not in drop) for name, others in rows.items()
                                        for drop in ({name} | {r for r in rows if r != name}, others)]
        for pair in _covering_pairs(list(by_pair), KERNELS[kernel].dtypes):
            out += list(dict.fromkeys(with_flags(by_pair[pair], names) for names in sets))
    return out


def _covering_pairs(pairs: list, dtypes) -> list:
    """Few of ``pairs`` (dtype, bucket) among which every dtype and every bucket of them appears: greedily
    the pair that covers the most not yet covered, the widest bucket first, then ``dtypes``' order."""
    order = {dtype: i for i, dtype in enumerate(dtypes)}
    left_dtypes, left_buckets = {d for d, _ in pairs}, {b for _, b in pairs}
    chosen = []
    while left_dtypes or left_buckets:
        best = max(pairs, key=lambda p: ((p[0] in left_dtypes) + (p[1] in left_buckets), p[1], -order[p[0]]))
        chosen.append(best)
        left_dtypes.discard(best[0])
        left_buckets.discard(best[1])
    return chosen
