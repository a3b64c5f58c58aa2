"""Every kernel specialisation compiles through NVRTC, no GPU needed; the sources and the parameter
structs hold together.

This runs in CI (which has no GPU): when ``CI`` is set a missing NVRTC is a failure, not a skip.
The specialisations compile side by side in worker processes, one per core
(``_compile.compile_all``), once per test session. ptxas assembles those whose report a rule here
reads (``assembled``: the warp-specialised Hopper kernels, checked for serialised warpgroup MMAs, and
the fast plain forwards, checked for spills); the others compile to PTX, which takes NVRTC's front
end and optimiser over every line at about half the time (CI's two cores are its limit).
"""

import os
import re
import sys
from pathlib import Path

import numpy
import pytest

from cupyflash import _compile, _params, _tiles

# opt-in shared memory per block: A100 (sm_80) and H100/H200 (sm_90)
ARCH_SMEM = {"sm_90": 227 * 1024, "sm_80": 163 * 1024}

if not os.environ.get("CI"):
    pytest.importorskip("cupy_backends.cuda.libs.nvrtc", reason="NVRTC (cupy-cuda*x[ctk]) is not installed")


def _specialisations():
    """(arch, cfg) for every specialisation some device runs, each once: for sm_90 where it runs
    there, else for sm_80 (the tiles that only A100's smaller shared memory picks); then, for sm_90,
    every family, dtype and bucket with the score modifiers compiled in (``modified_tile_configs``, which
    covers the flags a plain call may take too)."""
    seen, out = set(), []
    for arch, smem in ARCH_SMEM.items():
        for cfg in _tiles.all_tile_configs(smem, arch, plain_flags=False):
            if cfg not in seen:
                seen.add(cfg)
                out.append((arch, cfg))
    out += [("sm_90", cfg) for cfg in _tiles.modified_tile_configs(ARCH_SMEM["sm_90"], "sm_90")]
    return out


SPECIALISATIONS = _specialisations()


_BACKGROUND = []   # the compile of SPECIALISATIONS started during the session's other tests, if it was


def _lower_priority():
    os.nice(10)


def compile_in_the_background():
    """Start compiling SPECIALISATIONS in worker processes, one per core, at a lower priority than the
    tests (tests/conftest.py calls this after collection and runs this module last): the CPU tests keep
    their share of the cores and the compiles take the rest (CI has two)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    if not _BACKGROUND:
        pool = ProcessPoolExecutor(_compile.default_workers(), mp_context=multiprocessing.get_context("spawn"),
                                   initializer=_lower_priority)
        _BACKGROUND.append((pool, [pool.submit(_compile._compile_logged, (cfg, arch, assembled(cfg)))
                                   for arch, cfg in SPECIALISATIONS]))


def stop_compiling():
    """Cancel what the background compile has not begun (the session ends)."""
    for pool, _ in _BACKGROUND:
        pool.shutdown(wait=False, cancel_futures=True)


@pytest.fixture(scope="module")
def compiled():
    """(the first bytes of the cubin or PTX, the log) of every specialisation, compiled in parallel (the log
    holds NVRTC's error where one does not compile, and ptxas' report where ``assembled``)."""
    if _BACKGROUND:
        pool, futures = _BACKGROUND[0]
        with pool:
            return dict(zip(SPECIALISATIONS, [future.result() for future in futures]))
    jobs = [(cfg, arch, assembled(cfg)) for arch, cfg in SPECIALISATIONS]
    return dict(zip(SPECIALISATIONS, _compile.compile_all(jobs)))


# ptxas allocates registers differently from one CUDA release to the next; the zero-spill rule holds
# for the NVRTC that CI installs (cupy-cuda13x[ctk], 13.5 or later), where ptxas' report is read.
SPILL_RULE_NVRTC = (13, 5)


def nvrtc_version() -> tuple:
    from cupy_backends.cuda.libs import nvrtc

    return tuple(nvrtc.getVersion())


def is_fast(cfg) -> bool:
    """The kernels that must not spill: the plain V2 forwards (and the float8 one), 16-bit at D <= 128 and float32 (both
    precisions) at D <= 192. With score modifiers some spill a few bytes: they are held to their
    measured speed (benchmarks/variants.py) instead.

    The Hopper backward is left out: its producer warpgroup runs on 24 registers so that the
    consumers get 240, and spills a little (the consumers do not; the serialisation check holds).
    """
    if cfg.softcap or cfg.alibi or cfg.bias or cfg.mask:
        return False
    if cfg.kernel == "fwd_v2" and cfg.dtype == "float32":
        return cfg.d_pad <= 192
    return cfg.kernel in ("fwd_v2", "fwd_sm90", "fwd_fp8") and cfg.itemsize == 2 and cfg.d_pad <= 128


def assembled(cfg) -> bool:
    """ptxas assembles ``cfg`` here: a rule reads its report (serialisation of a Hopper kernel's
    warpgroup MMAs, spills of a fast kernel); the GPU tiers assemble every specialisation they run."""
    return bool(cfg.spec.arch) or is_fast(cfg)


def assert_compiled(cfg, magic: bytes, log: str, assemble: bool):
    """NVRTC built ``cfg``: a cubin where ``assemble``, else PTX."""
    assert magic[:4] == (b"\x7fELF" if assemble else b"//\n/"), f"{cfg}:\n{log}"


# Spill bytes measured harmless, by (arch, kernel, dtype, DP): the float32 V2 forward at DP = 32 keeps two
# pointers in local memory since the sliding window's tile range (16 bytes at most under NVRTC 13.5); its
# speed is unchanged (H200, D = 32, N = 4096: 32.7 TFLOP/s against 32.8 before, benchmarks/RESULTS.md)
SPILL_ALLOWANCE = {("sm_90", "fwd_v2", "float32", 32): 16}


@pytest.mark.parametrize("arch, cfg", SPECIALISATIONS,
                         ids=[f"{a}-{c.kernel}-{c.dtype}-d{c.d_pad}{'-ordered' if c.ordered else ''}"
                              f"{'-mods' if set(c.flags) - {'ordered'} else ''}" for a, c in SPECIALISATIONS])
def test_specialisation_compiles(arch, cfg, compiled):
    magic, log = compiled[(arch, cfg)]
    assert_compiled(cfg, magic, log, assembled(cfg))
    if not assembled(cfg):
        return
    # ptxas' report of every entry is there to read (an out-of-line device function, e.g. the Hopper
    # forward's repair, has a report of its own: not an entry's)
    reports = dict(re.findall(r"Function properties for (\w+)\n[^\n]*?(\d+) bytes spill stores", log))
    spills = [int(reports[name]) for name in cfg.entries if name in reports]
    assert len(spills) == len(cfg.entries), log
    if is_fast(cfg) and nvrtc_version() >= SPILL_RULE_NVRTC:
        allowed = SPILL_ALLOWANCE.get((arch, cfg.kernel, cfg.dtype, cfg.d_pad), 0)
        assert max(spills) <= allowed, f"{cfg} spills on {arch} (allowed: {allowed} bytes):\n{log}"
    if cfg.spec.arch:
        assert "serialized" not in log, f"{cfg}: ptxas serialised the warpgroup MMAs:\n{log}"


def test_every_dtype_and_bucket_is_covered():
    """Every (kernel, dtype, bucket) a device can run has a compiled specialisation.

    On sm_80 the V2 forward of float64 beyond D = 192 does not fit (V1 runs); the Hopper
    kernels are sm_90-only and take 16-bit dtypes, the backward D <= 128 and its wide kernel above.
    """
    compiled = {c for _, c in SPECIALISATIONS}
    for arch, smem in ARCH_SMEM.items():
        for kernel, spec in _tiles.KERNELS.items():
            if not _tiles.runs_on(spec, arch):
                continue
            for dtype in spec.dtypes:
                for bucket in _tiles.HEAD_DIM_BUCKETS:
                    if (arch, kernel, dtype, bucket) == ("sm_80", "fwd_v2", "float64", 256) or not spec.min_head_dim <= bucket <= spec.max_head_dim:
                        with pytest.raises(ValueError):
                            _tiles.choose_tiles(kernel, bucket, dtype, smem)
                        continue
                    cfg = _tiles.choose_tiles(kernel, bucket, dtype, smem)
                    for precision in _tiles.PRECISIONS:
                        assert _tiles.with_precision(cfg, precision) in compiled


@pytest.mark.parametrize("arch, smem", sorted(ARCH_SMEM.items()))
def test_tiles_fit_and_follow_the_seed_bound(arch, smem):
    """Shared memory fits; forward B_c <= ceil(M / 4d) and B_r <= min(B_c, d) (the V1 seed's tiling formula)."""
    for cfg in _tiles.all_tile_configs(smem, arch):
        assert cfg.smem_bytes <= smem
        if cfg.d_pad:
            assert cfg.d_pad % cfg.d_chunk == 0
        if cfg.kernel == "fwd_v1":
            M = smem // cfg.itemsize
            assert cfg.block_c <= -(-M // (4 * cfg.d_pad))
            assert cfg.block_r <= min(cfg.block_c, cfg.d_pad)
        if cfg.kernel == "bwd_sm90":      # a producer warpgroup, then 64 keys per consumer warpgroup
            assert cfg.block_c == 64 * (cfg.warps // 4 - 1) and cfg.warps % 4 == 0
        elif cfg.kernel == "bwd_sm90_wide":   # a producer warpgroup, then two consumers sharing 64 keys
            assert (cfg.block_r, cfg.block_c, cfg.warps) == (64, 64, 12)
        elif cfg.kernel in ("fwd_sm90", "fwd_fp8"):   # a producer warpgroup, then 64 query rows per consumer warpgroup
            assert cfg.block_r == 64 * (cfg.warps // 4 - 1) and cfg.warps % 4 == 0
        elif cfg.kernel in ("fwd_v1", "fwd_v2"):
            assert cfg.block_r == 16 * cfg.warps
        elif cfg.kernel in ("repair", "bwd_prep", "merge", "append"):   # no shared tiles
            assert cfg.smem_bytes == 0
        else:
            assert cfg.block_c == 16 * cfg.warps


@pytest.mark.parametrize("kernel", sorted(_tiles.KERNELS))
def test_a_source_is_its_file_and_every_header_it_includes_once(kernel):
    """Local includes are pasted in, recursively and once each, so CuPy's cache (keyed on the source
    text) sees an edit of any header."""
    src = _compile.kernel_source(kernel)
    assert '#include "' not in src and "#pragma once" not in src
    headers = _compile.included_headers(kernel)
    assert "params.cuh" in headers and "types.cuh" in headers
    for header in headers:
        body = (_compile.kernel_dir() / header).read_text().replace("#pragma once\n", "")
        first_line = body.splitlines()[0]
        assert src.count(first_line) == 1, (kernel, header)


@pytest.mark.parametrize("kernel", sorted(_tiles.KERNELS))
def test_each_entry_takes_the_parameter_struct_the_registry_names(kernel):
    """The registry's ``params`` is what the source declares: each entry point takes that one struct,
    by value (a ``__grid_constant__`` where a device function takes its address), and the host mirrors
    it (``_params.STRUCTS``)."""
    spec = _tiles.KERNELS[kernel]
    source = (_compile.kernel_dir() / spec.source).read_text()
    assert len(spec.params) == len(spec.entries)
    for entry, struct in zip(spec.entries, spec.params):
        assert struct in _params.STRUCTS
        assert re.search(rf"\b{entry}\(const (__grid_constant__ )?{struct} p\)", source), (entry, struct)


def test_the_compile_test_checks_the_parameter_layout():
    """Where CI compiles (NVRTC of the CUDA 13 wheels), every source it compiles carries the checks."""
    if os.environ.get("CI"):
        assert _compile.nvrtc_has_offsetof()


def test_a_drifted_parameter_mirror_fails_to_compile(monkeypatch):
    """The layout checks can fail: a mirror with one field moved does not compile."""
    if not _compile.nvrtc_has_offsetof():
        pytest.skip("this NVRTC has no __builtin_offsetof: the GPU test of _params.layout_probe checks the layout")
    moved = numpy.dtype({"names": list(_params.FWD.names), "formats": [_params.FWD.fields[n][0] for n in _params.FWD.names],
                         "offsets": [_params.FWD.fields[n][1] + (8 if n == "scale" else 0) for n in _params.FWD.names],
                         "itemsize": _params.FWD.itemsize + 8})
    monkeypatch.setitem(_params.STRUCTS, "FwdParams", moved)
    _compile.kernel_source.cache_clear()
    cfg = _tiles.choose_tiles("fwd_v2", 64, "float32", ARCH_SMEM["sm_90"])
    try:
        with pytest.raises(RuntimeError, match="differs from _params.py"):
            _compile.compile_for_arch(cfg, "sm_90")
    finally:
        monkeypatch.undo()
        _compile.kernel_source.cache_clear()


@pytest.mark.parametrize("kernel", ["fwd_v1", "fwd_v2", "bwd"])
@pytest.mark.parametrize("head_dim", [64, 256])
def test_the_exact_float32_fma_tiles_compile(kernel, head_dim):
    """The exact FMA tiles of float32 (FLASH_FP32_MMA=0), which no precision runs but the accuracy test
    compares the tensor-core tiles with, still compile."""
    cfg = _tiles.choose_tiles(kernel, head_dim, "float32", ARCH_SMEM["sm_90"])
    assert cfg.fp32_mma == 0 and "-DFLASH_FP32_MMA=0" in cfg.defines()
    magic, _ = _compile.compile_for_arch(cfg, "sm_90")
    assert magic[:4] == b"\x7fELF"


def test_float32_specialisations_come_in_one_variant_per_precision():
    configs = _tiles.all_tile_configs(ARCH_SMEM["sm_90"], "sm_90")
    for kernel in ("fwd_v1", "fwd_v2", "bwd"):
        modes = {c.fp32_mma for c in configs if c.kernel == kernel and c.dtype == "float32"}
        assert modes == set(_tiles.FP32_PRODUCTS.values())
    assert {c.fp32_mma for c in configs if c.dtype != "float32" or not c.spec.fp32_products} == {0}


def test_the_ceiling_kernels_of_benchmarks_mma_ceilings_compile():
    """benchmarks/mma_ceilings.py's kernels (one per instruction) compile for the architectures they need."""
    from cupy_backends.cuda.libs import nvrtc

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    try:
        import mma_ceilings
    finally:
        sys.path.pop(0)
    for name, (min_sm, _, source, _) in mma_ceilings.sources().items():
        prog = nvrtc.createProgram(source, "ceiling.cu", [], [])
        try:
            nvrtc.compileProgram(prog, ["-arch=sm_90a" if min_sm >= 90 else "-arch=sm_80"])
        except nvrtc.NVRTCError:
            pytest.fail(f"{name}: {nvrtc.getProgramLog(prog)}")
        finally:
            nvrtc.destroyProgram(prog)


def test_user_expressions_compile_into_every_family():
    """score_mod (with score_mod_grad) and mask_mod reading arrays, floats and ints compile into every
    family and dtype (one bucket each; for float64 in double) beside every other modifier but dropout
    (the wide Hopper backward takes no dbias under a score_mod), and into every family alone (in its
    first dtype: a covering set of the expressions' lines and the other modifiers' absence). bfloat16
    is left to float16, whose score path it shares (the expressions see float scores; the loads and
    conversions that differ compile at every dtype in ``test_specialisation_compiles``)."""
    from cupyflash import _expr

    user = _expr.user_mods("c * tanhf(s / c) + w[kv_idx % n] - (b % 3 == 0 ? 0.5f : 0.0f)",
                           "1 - tanhf(s / c) * tanhf(s / c)", "kv_idx <= q_idx + n && doc[q_idx] == doc[kv_idx]",
                           {"c": 3.0, "w": numpy.zeros(4, numpy.float32), "n": 4, "doc": numpy.zeros(8, numpy.int32)},
                           backward=True)
    seen, alone, jobs = set(), set(), []
    for cfg in _tiles.all_tile_configs(ARCH_SMEM["sm_90"], "sm_90"):
        if not cfg.spec.score_mods or cfg.fp32_mma not in (0, 1) or cfg.dtype == "bfloat16" \
                or (cfg.kernel, cfg.dtype) in seen:
            continue
        seen.add((cfg.kernel, cfg.dtype))
        code = _expr.user_code(user, "double" if cfg.dtype == "float64" else "float", {"w": "float", "doc": "int"})
        assert f"-DFLASH_USER_MASK={code.mask}" in _tiles.with_user(cfg, code).defines()
        if cfg.kernel not in alone:
            alone.add(cfg.kernel)
            jobs.append((_tiles.with_user(cfg, code), "sm_90"))
        grad = cfg.kernel != "bwd_sm90_wide"
        flags = ("softcap", "alibi", "sink", "bias", "mask") + (("bias_grad",) if grad else ())
        jobs.append((_tiles.with_user(_tiles.with_flags(cfg, flags), code), "sm_90"))
    # to PTX: what is checked here is that the expressions' lines compile (test_specialisation_compiles
    # assembles the kernels without them)
    jobs = [(cfg, arch, False) for cfg, arch in jobs]
    for (cfg, _, _), (magic, log) in zip(jobs, _compile.compile_all(jobs)):
        assert_compiled(cfg, magic, log, False)


def test_every_flag_compiles_into_every_family_that_reads_it(monkeypatch):
    """The device code of every switch takes both forms (types.cuh: SWITCH_ON): with every row of
    ``_flags.FLAGS`` compiled into every family that reads it, each family still compiles, so moving a
    family between a compile-time flag and the run-time word is a change of its row only."""
    from dataclasses import replace

    from cupyflash import _flags

    rows = tuple(replace(f, compiled=f.reads) for f in _flags.FLAGS)
    monkeypatch.setattr(_flags, "FLAGS", rows)
    monkeypatch.setattr(_flags, "BY_NAME", {f.name: f for f in rows})
    seen, jobs = set(), []
    for cfg in _tiles.all_tile_configs(ARCH_SMEM["sm_90"], "sm_90"):
        if cfg.kernel in seen or not _flags.compiled_in(cfg.kernel):
            continue
        seen.add(cfg.kernel)
        # all but the pairs a family never runs together (the wide Hopper backward: dbias under a softcap)
        names = [f.name for f in rows if cfg.kernel in f.reads]
        names = [n for n in names if not any(family == cfg.kernel and other in names
                                             for family, other in _flags.BY_NAME[n].excludes)]
        flagged = _tiles.with_flags(cfg, names)
        assert set(flagged.flags) == set(names)
        assert {f"-D{_flags.BY_NAME[n].define}=1" for n in names} <= set(flagged.defines())
        jobs.append((flagged, "sm_90", False))
    # compiled in worker processes, whose table is the real one: every row read is among the flags, so a
    # worker's defines are these (each =1); to PTX, which holds every line of both forms
    for (cfg, _, _), (magic, log) in zip(jobs, _compile.compile_all(jobs)):
        assert_compiled(cfg, magic, log, False)
