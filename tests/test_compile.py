"""Every kernel specialisation compiles through NVRTC for sm_80 and sm_90, no GPU needed.

This runs in CI (which has no GPU): when ``CI`` is set a missing NVRTC is a
failure, not a skip.
"""

import os
import re

import pytest

from cupyflash import _compile, _tiles

# opt-in shared memory per block: A100 (sm_80) and H100/H200 (sm_90)
ARCH_SMEM = {"sm_80": 163 * 1024, "sm_90": 227 * 1024}

if not os.environ.get("CI"):
    pytest.importorskip("cupy_backends.cuda.libs.nvrtc", reason="NVRTC (cupy-cuda*x[ctk]) is not installed")

SPECIALISATIONS = [(arch, cfg) for arch, smem in ARCH_SMEM.items() for cfg in _tiles.all_tile_configs(smem, arch)]


def is_fast(cfg) -> bool:
    """The fast path, which must not spill at D <= 128: the 16-bit V2 forwards.

    The Hopper backward is left out: its producer warpgroup runs on 24 registers so that the
    consumers get 240, and spills a little (the consumers do not; the serialisation check holds).
    """
    return cfg.kernel.startswith("fwd_v2") and cfg.itemsize == 2 and cfg.d_pad <= 128


@pytest.mark.parametrize("arch, cfg", SPECIALISATIONS,
                         ids=[f"{a}-{c.kernel}-{c.dtype}-d{c.d_pad}" for a, c in SPECIALISATIONS])
def test_specialisation_compiles(arch, cfg):
    cubin, log = _compile.compile_for_arch(cfg, arch, verbose=True)
    assert cubin[:4] == b"\x7fELF"
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", log)]
    assert spills, log   # ptxas' report is there to read
    if is_fast(cfg):
        assert max(spills) == 0, f"{cfg} spills on {arch}:\n{log}"
    if cfg.arch:
        assert "serialized" not in log, f"{cfg}: ptxas serialised the warpgroup MMAs:\n{log}"


def test_every_dtype_and_bucket_is_covered():
    """Every (kernel, dtype, bucket) a device can run has a compiled specialisation.

    On sm_80 the V2 forward of float64 beyond D = 192 does not fit (V1 runs); the Hopper
    kernels are sm_90-only and take 16-bit dtypes, the backward D <= 128.
    """
    for arch, smem in ARCH_SMEM.items():
        compiled = {c for a, c in SPECIALISATIONS if a == arch}
        for kernel in _tiles.KERNELS:
            own = _tiles.ARCH_KERNELS.get(kernel)
            if own and not own[0].startswith(arch):
                continue
            for dtype in (own[1] if own else _tiles.DTYPE_CODES):
                for bucket in _tiles.HEAD_DIM_BUCKETS:
                    if ((arch, kernel, dtype, bucket) == ("sm_80", "fwd_v2", "float64", 256)
                            or (kernel == "bwd_sm90" and bucket > _tiles.BWD_SM90_MAX_HEAD_DIM)):
                        with pytest.raises(ValueError):
                            _tiles.choose_tiles(kernel, bucket, dtype, smem)
                        continue
                    assert _tiles.choose_tiles(kernel, bucket, dtype, smem) in compiled


@pytest.mark.parametrize("arch, smem", sorted(ARCH_SMEM.items()))
def test_tiles_fit_and_follow_the_seed_bound(arch, smem):
    """Shared memory fits; forward B_c <= ceil(M / 4d) and B_r <= min(B_c, d) (the V1 seed's tiling formula)."""
    for cfg in _tiles.all_tile_configs(smem, arch):
        assert cfg.smem_bytes <= smem
        assert cfg.d_pad % cfg.d_chunk == 0
        if cfg.kernel == "fwd_v1":
            M = smem // cfg.itemsize
            assert cfg.block_c <= -(-M // (4 * cfg.d_pad))
            assert cfg.block_r <= min(cfg.block_c, cfg.d_pad)
        if cfg.kernel == "bwd_sm90":      # a producer warpgroup, then 64 keys per consumer warpgroup
            assert cfg.block_c == 64 * (cfg.warps // 4 - 1) and cfg.warps % 4 == 0
        elif cfg.kernel == "fwd_v2_sm90":   # a producer warpgroup, then 64 query rows per consumer warpgroup
            assert cfg.block_r == 64 * (cfg.warps // 4 - 1) and cfg.warps % 4 == 0
        elif cfg.kernel.startswith("fwd"):
            assert cfg.block_r == 16 * cfg.warps
        elif cfg.kernel == "repair":        # a row per warp, no shared tiles
            assert cfg.smem_bytes == 0 and cfg.warps == _tiles.REPAIR_WARPS
        else:
            assert cfg.block_c == 16 * cfg.warps


def test_header_edits_change_the_source():
    """The header is pasted into the source, so CuPy's cache (keyed on source text) sees header edits."""
    header = (_compile.kernel_dir() / _compile.HEADER).read_text()
    for kernel in _tiles.KERNELS:
        src = _compile.kernel_source(kernel)
        assert header in src and '#include "flash_common.cuh"' not in src
