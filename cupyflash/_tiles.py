"""Tile sizes: the one place that chooses them.

A :class:`TileConfig` fixes one kernel specialisation. The same object gives
the NVRTC defines (``FLASH_*``) and the dynamic shared-memory byte count used
at launch; the kernels ``static_assert`` that their own layout matches
``FLASH_SMEM_BYTES``, so the two can never drift apart.

How tiles are chosen (``choose_tiles``):

* The head dim ``D`` is padded up to a bucket ``DP`` in ``HEAD_DIM_BUCKETS``
  (multiples of 16, the tensor-core k-step); padding columns are zero-filled.
* Forward, FlashAttention V1 (Algorithm 1). The V1 seed bounds the tiles by
  the shared memory ``M`` (in elements): ``B_c <= ceil(M / 4d)`` and
  ``B_r <= min(B_c, d)``. Inside that bound we take the first candidate of
  ``_FWD_CANDIDATES`` whose layout fits: B_r = 16 x warps (each warp owns 16
  query rows), B_c = 128 keys while the score tile stays in registers
  (D <= 128), else 64. fp64 tiles are smaller because every element is 8 bytes.
* Forward, V2 (FlashAttention-2 schedule): B_r = 16 x warps query rows per
  CTA with O_i in registers, B_c keys per step, K/V double-buffered; B_c = 64
  up to D = 128, 32 above, where O_i takes half the registers.
* Forward, V2 on Hopper (``fwd_v2_sm90``, 16-bit, sm_90a): a producer
  warpgroup and consumer warpgroups of 64 query rows each, three up to D = 64
  (B_r = 192), two above (B_r = 128); B_c = 128 keys up to D = 128 and 64
  above; the head dim is padded to whole 64-column swizzle blocks. The CTAs
  are persistent (``ctas_per_sm`` per SM), with Q_i double-buffered where two
  fit (``q_stages``).
* Backward: each warp owns 16 key rows of a K/V tile (B_c = 16 x warps); the
  Q tiles walked by the inner loop have B_r rows. dK_j and dV_j live in
  registers, so the head dim is split into chunks of ``d_chunk`` columns, one
  CTA per chunk (S and dP are recomputed per chunk; D <= 128 is one chunk).
* Backward on Hopper (``bwd_sm90``, 16-bit, sm_90a, D <= 128): a producer
  warpgroup and two consumers of 64 keys each (B_c = 128), B_r = 128 queries
  per step at D = 64, 64 at D = 128.
* Repair (``repair``, flash_repair.cu: the rows where a masked pair met an inf
  or NaN): one row per warp, ``REPAIR_WARPS`` warps, no shared tiles; the head
  dim bucket sets the elements per lane.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy

HEAD_DIM_BUCKETS = (32, 64, 96, 128, 192, 256)
MAX_HEAD_DIM = HEAD_DIM_BUCKETS[-1]
DTYPE_CODES = {"float16": 0, "bfloat16": 1, "float32": 2, "float64": 3}
ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}
KERNELS = ("fwd_v1", "fwd_v2", "fwd_v2_sm90", "bwd_v1", "bwd_sm90", "repair")
# kernels built for one architecture only (NVRTC -arch), and the dtypes they take
ARCH_KERNELS = {"fwd_v2_sm90": ("sm_90a", ("float16", "bfloat16")), "bwd_sm90": ("sm_90a", ("float16", "bfloat16"))}
BWD_SM90_MAX_HEAD_DIM = 128   # dK_j, dV_j of 64 keys per warpgroup in registers
SMEM_PAD_BYTES = 16  # one 16-byte pad per shared row (flash_common.cuh: SMEM_PAD_BYTES)
SM90_SMEM_BLOCK = 227 * 1024   # shared memory a block may opt in to on sm_90 (H100, H200)
REPAIR_WARPS = 8   # flash_repair.cu: rows in flight per CTA

# (B_r, B_c, warps) in order of preference
_FWD_CANDIDATES = {
    "16bit": ((64, 128, 4), (64, 64, 4), (32, 64, 2), (16, 32, 1)),
    "float32": ((64, 64, 4), (32, 64, 2), (32, 32, 2), (16, 16, 1)),
    "float64": ((32, 32, 2), (16, 32, 1), (16, 16, 1)),
}
# (B_r, B_c, warps) in order of preference; 16-bit: the first for D <= 64 (128 x 64 spills there),
# the next two for D <= 128, the rest above
_FWD_V2_CANDIDATES = {
    "16bit": ((64, 64, 4), (128, 64, 8), (64, 64, 4), (64, 32, 4), (32, 32, 2), (16, 16, 1)),
    "float32": ((64, 32, 4), (32, 32, 2), (16, 16, 1)),
    "float64": ((32, 32, 2), (16, 16, 1)),
}
# (B_r, B_c, warps) of the Hopper V2 forward: a producer warpgroup and consumer warpgroups of 64
# query rows each. Three consumers up to D = 64 (measured 1.1-1.3x two at N >= 2048, equal at 512),
# two above, where O_i needs the registers; B_c = 128 keys up to D = 128, 64 above.
_FWD_V2_SM90_CANDIDATES = {64: ((192, 128, 16),), 128: ((128, 128, 12),), 256: ((128, 64, 12),)}
# (B_r, B_c, warps, max d_chunk) in order of preference
_BWD_CANDIDATES = {
    "16bit": ((32, 64, 4, 128), (32, 32, 2, 128), (16, 16, 1, 64)),
    "float32": ((32, 64, 4, 128), (32, 32, 2, 64), (16, 16, 1, 32)),
    "float64": ((32, 64, 4, 32), (32, 32, 2, 32), (16, 16, 1, 32)),
}


def dtype_name(dtype) -> str:
    """Canonical name of a supported dtype (``'bfloat16'`` for ml_dtypes')."""
    name = dtype if isinstance(dtype, str) else numpy.dtype(dtype).name
    if name not in DTYPE_CODES:
        raise TypeError(f"unsupported dtype {name}")
    return name


def accumulator_dtype(dtype) -> numpy.dtype:
    """What the kernels accumulate in, and the dtype of m and l: float64 for float64, else float32."""
    return numpy.dtype(numpy.float64 if dtype_name(dtype) == "float64" else numpy.float32)


def head_dim_bucket(head_dim: int) -> int:
    """Smallest bucket in ``HEAD_DIM_BUCKETS`` holding ``head_dim``."""
    for bucket in HEAD_DIM_BUCKETS:
        if head_dim <= bucket:
            return bucket
    raise ValueError(f"head dim {head_dim} > {MAX_HEAD_DIM}")


def _precision_class(dtype: str) -> str:
    return "16bit" if dtype in ("float16", "bfloat16") else dtype


@dataclass(frozen=True)
class TileConfig:
    """One compiled kernel specialisation.

    Attributes
    ----------
    kernel : str
        One of ``KERNELS``.
    dtype : str
        Element dtype name.
    d_pad : int
        Head dim padded to its bucket (``DP``).
    block_r : int
        ``B_r``, query rows per tile.
    block_c : int
        ``B_c``, key rows per tile.
    warps : int
        Warps per CTA.
    d_chunk : int
        Head-dim columns of one output chunk (``DC``).
    ordered : bool
        A backward whose sums over CTAs are added in grid order
        (``deterministic=True``); its own specialisation, so that the
        default backward carries none of it.
    """

    kernel: str
    dtype: str
    d_pad: int
    block_r: int
    block_c: int
    warps: int
    d_chunk: int
    ordered: bool = False

    @property
    def itemsize(self) -> int:
        return ITEMSIZE[self.dtype]

    @property
    def acc_itemsize(self) -> int:
        """Bytes of the accumulator type (float32, float64 for float64)."""
        return accumulator_dtype(self.dtype).itemsize

    @property
    def threads(self) -> int:
        return 32 * self.warps

    @property
    def smem_bytes(self) -> int:
        """Dynamic shared memory of the kernel's layout (see the .cu headers)."""
        pad = SMEM_PAD_BYTES // self.itemsize
        qkv_pitch = self.d_pad + pad
        if self.kernel == "repair":
            return 0
        if self.kernel == "fwd_v1":
            # s_K, s_V (B_c, DP); s_Q (B_r, DP); s_P (B_r, B_c)
            elems = (2 * self.block_c + self.block_r) * qkv_pitch + self.block_r * (self.block_c + pad)
            return elems * self.itemsize
        if self.kernel == "fwd_v2_sm90":
            return self._fwd_sm90_bytes(self.q_stages)
        if self.kernel == "fwd_v2":
            # s_Q (B_r, DP); two stages of K_j, V_j (B_c, DP); s_P (B_r, B_c) for the FMA dtypes only
            elems = (self.block_r + 2 * 2 * self.block_c) * qkv_pitch
            if _precision_class(self.dtype) != "16bit":
                elems += self.block_r * (self.block_c + pad)
            return elems * self.itemsize
        if self.kernel == "bwd_sm90":
            # s_K, s_V (B_c, DP); rings of two Q_i, dO_i (B_r, DP); two dS^T (B_c, B_r); float32 dQ_i
            # (B_r, DP + 4); two (2, B_r) statistics; five mbarriers; + slack to align the tiles to 1024 bytes
            elems = (2 * self.block_c + 4 * self.block_r) * self.d_pad + 2 * self.block_c * self.block_r
            return (elems * self.itemsize + self.block_r * (self.d_pad + 4) * 4
                    + 2 * 2 * self.block_r * self.acc_itemsize + 5 * 8 + 1024)
        # s_K, s_V (B_c, DP); s_Q, s_dO (B_r, DP); s_dS (B_c, B_r); s_m, s_inv_l, s_D (B_r)
        elems = (2 * self.block_c + 2 * self.block_r) * qkv_pitch + self.block_c * (self.block_r + pad)
        return elems * self.itemsize + 3 * self.block_r * self.acc_itemsize

    def _fwd_sm90_bytes(self, q_stages: int) -> int:
        # a ring of q_stages Q_i (B_r, DP); rings of two K_j and two V_j (B_c, DP), swizzled;
        # 2 q_stages + 8 mbarriers; q_stages + 1 tile indices (8 bytes each); + slack to align the tiles to 1024 bytes
        return ((q_stages * self.block_r + 4 * self.block_c) * self.d_pad * self.itemsize + (2 * q_stages + 8) * 8
                + (q_stages + 1) * 8 + 1024)

    @property
    def q_stages(self) -> int:
        """Q_i buffers of the persistent Hopper forward: two (a CTA's next Q tile lands under its
        current one) where they fit sm_90's shared memory, else one."""
        if self.kernel != "fwd_v2_sm90":
            return 1
        return 2 if self._fwd_sm90_bytes(2) <= SM90_SMEM_BLOCK else 1

    @property
    def ctas_per_sm(self) -> int:
        """CTAs of the persistent Hopper forward per SM: two with one consumer warpgroup (they
        keep each other's tensor cores busy), else one (the consumers ping-pong)."""
        return 2 if self.kernel == "fwd_v2_sm90" and self.warps == 8 else 1

    @property
    def arch(self) -> str | None:
        """The one architecture this kernel is built for (NVRTC ``-arch``), or None for any."""
        return ARCH_KERNELS[self.kernel][0] if self.kernel in ARCH_KERNELS else None

    def defines(self) -> tuple[str, ...]:
        """NVRTC ``-D`` options of this specialisation."""
        return (
            f"-DFLASH_WGMMA={int(self.kernel in ARCH_KERNELS)}",
            f"-DFLASH_DTYPE={DTYPE_CODES[self.dtype]}",
            f"-DFLASH_DP={self.d_pad}",
            f"-DFLASH_BR={self.block_r}",
            f"-DFLASH_BC={self.block_c}",
            f"-DFLASH_WARPS={self.warps}",
            f"-DFLASH_DC={self.d_chunk}",
            f"-DFLASH_SMEM_BYTES={self.smem_bytes}",
            f"-DFLASH_Q_STAGES={self.q_stages}",
            f"-DFLASH_CTAS_PER_SM={self.ctas_per_sm}",
            f"-DFLASH_ORDERED={int(self.ordered)}",
        )


def _head_dim_chunk(d_pad: int, max_chunk: int, multiple: int) -> int:
    """Width of the fewest equal chunks of ``d_pad`` columns, at most ``max_chunk`` wide, each a multiple of ``multiple``."""
    n = math.ceil(d_pad / max_chunk)
    while d_pad % n or (d_pad // n) % multiple:
        n += 1
    return d_pad // n


def choose_tiles(kernel: str, head_dim: int, dtype, smem_limit: int) -> TileConfig:
    """Tile sizes for ``kernel`` at ``head_dim`` and ``dtype`` on a device.

    Parameters
    ----------
    kernel : str
        One of ``KERNELS``.
    head_dim : int
        ``D``, 1 <= D <= 256.
    dtype : dtype-like
    smem_limit : int
        Shared memory a block may use on the device (bytes, opt-in maximum).

    Returns
    -------
    TileConfig
    """
    name = dtype_name(dtype)
    d_pad = head_dim_bucket(head_dim)
    prec = _precision_class(name)
    itemsize = ITEMSIZE[name]
    if kernel == "fwd_v1":
        seed_bc = math.ceil(smem_limit / itemsize / (4 * d_pad))  # B_c <= ceil(M / 4d)
        for block_r, block_c, warps in _FWD_CANDIDATES[prec]:
            if block_c > seed_bc or block_r > min(block_c, d_pad):
                continue
            if block_c > 64 and d_pad > 128:  # the (16, B_c) score tile would not stay in registers
                continue
            # chunks of whole mma k-steps (16 columns)
            d_chunk = _head_dim_chunk(d_pad, {"16bit": 128, "float32": 64, "float64": 32}[prec], 16)
            cfg = TileConfig(kernel, name, d_pad, block_r, block_c, warps, d_chunk)
            if cfg.smem_bytes <= smem_limit:
                return cfg
    elif kernel == "fwd_v2":
        # O_i (16, DP) lives in registers next to the (16, B_c) scores: B_c = 64 only up to D = 128
        candidates = _FWD_V2_CANDIDATES[prec]
        if prec == "16bit":
            candidates = candidates[:1] if d_pad <= 64 else candidates[1:3] if d_pad <= 128 else candidates[3:]
        for block_r, block_c, warps in candidates:
            cfg = TileConfig(kernel, name, d_pad, block_r, block_c, warps, d_pad)
            if cfg.smem_bytes <= smem_limit:
                return cfg
    elif kernel == "fwd_v2_sm90":
        if name not in ARCH_KERNELS[kernel][1]:
            raise ValueError(f"{kernel} takes {' and '.join(ARCH_KERNELS[kernel][1])}, not {name}")
        d_pad = -(-d_pad // 64) * 64   # whole 64-column swizzle blocks; the padding is zero-filled
        for block_r, block_c, warps in _FWD_V2_SM90_CANDIDATES[min(b for b in _FWD_V2_SM90_CANDIDATES if d_pad <= b)]:
            cfg = TileConfig(kernel, name, d_pad, block_r, block_c, warps, d_pad)
            if cfg.smem_bytes <= smem_limit:
                return cfg
    elif kernel == "bwd_sm90":
        if name not in ARCH_KERNELS[kernel][1] or d_pad > BWD_SM90_MAX_HEAD_DIM:
            raise ValueError(f"{kernel} takes {' and '.join(ARCH_KERNELS[kernel][1])} with D <= "
                             f"{BWD_SM90_MAX_HEAD_DIM}, not {name} with D = {head_dim}")
        d_pad = -(-d_pad // 64) * 64
        # a producer warpgroup and two consumers of 64 keys each; 128 queries per step at D = 64,
        # 64 at D = 128 (dK_j, dV_j, S_ij^T and dP_ij^T share the registers)
        cfg = TileConfig(kernel, name, d_pad, 128 if d_pad <= 64 else 64, 128, 12, d_pad)
        if cfg.smem_bytes <= smem_limit:
            return cfg
    elif kernel == "repair":
        return TileConfig(kernel, name, d_pad, 1, 1, REPAIR_WARPS, d_pad)
    elif kernel == "bwd_v1":
        for block_r, block_c, warps, max_chunk in _BWD_CANDIDATES[prec]:
            # chunks of 32 columns: the dQ product splits a chunk over two warps of even n-tiles
            cfg = TileConfig(kernel, name, d_pad, block_r, block_c, warps, _head_dim_chunk(d_pad, max_chunk, 32))
            if cfg.smem_bytes <= smem_limit:
                return cfg
    else:
        raise ValueError(f"unknown kernel {kernel!r}")
    raise ValueError(f"no {kernel} tiles fit {smem_limit} bytes of shared memory (D={head_dim}, {name})")


def all_tile_configs(smem_limit: int, arch: str = "sm_90") -> list[TileConfig]:
    """Every specialisation the library can launch on a device of ``arch`` with ``smem_limit``.

    V1 always fits; a V2 forward whose double-buffered tiles do not fit (float64
    with D > 192 below 167 KB) is left out: that call runs V1. Architecture-specific
    kernels (``ARCH_KERNELS``) are listed for their architecture's family only
    (``fwd_v2_sm90`` for sm_90), for the dtypes they take; buckets that share a
    padded head dim give one configuration; each backward kernel comes ordered
    (``deterministic=True``) and not.
    """
    configs = []
    for kernel in KERNELS:
        own = ARCH_KERNELS.get(kernel)
        if own and not own[0].startswith(arch):
            continue
        for dtype in (own[1] if own else DTYPE_CODES):
            for bucket in HEAD_DIM_BUCKETS:
                try:
                    cfg = choose_tiles(kernel, bucket, dtype, smem_limit)
                except ValueError:
                    if kernel != "fwd_v2" and not own:   # V1 always fits; the others may not
                        raise
                    continue
                for variant in (cfg, replace(cfg, ordered=True)) if kernel.startswith("bwd") else (cfg,):
                    if variant not in configs:
                        configs.append(variant)
    return configs
