"""Every kernel specialisation compiles through NVRTC for sm_80 and sm_90, no GPU needed.

This runs in CI (which has no GPU): when ``CI`` is set a missing NVRTC is a
failure, not a skip.
"""

import os

import pytest

from cupyflash import _compile, _tiles

# opt-in shared memory per block: A100 (sm_80) and H100/H200 (sm_90)
ARCH_SMEM = {"sm_80": 163 * 1024, "sm_90": 227 * 1024}

if not os.environ.get("CI"):
    pytest.importorskip("cupy_backends.cuda.libs.nvrtc", reason="NVRTC (cupy-cuda*x[ctk]) is not installed")

SPECIALISATIONS = [(arch, cfg) for arch, smem in ARCH_SMEM.items() for cfg in _tiles.all_tile_configs(smem)]


@pytest.mark.parametrize("arch, cfg", SPECIALISATIONS,
                         ids=[f"{a}-{c.kernel}-{c.dtype}-d{c.d_pad}" for a, c in SPECIALISATIONS])
def test_specialisation_compiles(arch, cfg):
    cubin, _ = _compile.compile_for_arch(cfg, arch)
    assert cubin[:4] == b"\x7fELF"


def test_every_dtype_and_bucket_is_covered():
    """Every (kernel, dtype, bucket) has tiles on sm_90; on sm_80 only float64 V2 beyond D = 192 is missing (V1 runs)."""
    expected = {(k, d, b) for k in _tiles.KERNELS for d in _tiles.DTYPE_CODES for b in _tiles.HEAD_DIM_BUCKETS}
    for arch in ARCH_SMEM:
        seen = {(c.kernel, c.dtype, c.d_pad) for a, c in SPECIALISATIONS if a == arch}
        allowed_missing = set() if arch == "sm_90" else {("fwd_v2", "float64", 256)}
        assert expected - seen <= allowed_missing and seen <= expected, arch


@pytest.mark.parametrize("smem", sorted(ARCH_SMEM.values()))
def test_tiles_fit_and_follow_the_seed_bound(smem):
    """Shared memory fits; forward B_c <= ceil(M / 4d) and B_r <= min(B_c, d) (the V1 seed's tiling formula)."""
    for cfg in _tiles.all_tile_configs(smem):
        assert cfg.smem_bytes <= smem
        assert cfg.d_pad % cfg.d_chunk == 0
        if cfg.kernel == "fwd_v1":
            M = smem // cfg.itemsize
            assert cfg.block_c <= -(-M // (4 * cfg.d_pad))
            assert cfg.block_r <= min(cfg.block_c, cfg.d_pad)
        if cfg.kernel.startswith("fwd"):
            assert cfg.block_r == 16 * cfg.warps
        else:
            assert cfg.block_c == 16 * cfg.warps


def test_header_edits_change_the_source():
    """The header is pasted into the source, so CuPy's cache (keyed on source text) sees header edits."""
    header = (_compile.kernel_dir() / _compile.HEADER).read_text()
    for kernel in _tiles.KERNELS:
        src = _compile.kernel_source(kernel)
        assert header in src and '#include "flash_common.cuh"' not in src
