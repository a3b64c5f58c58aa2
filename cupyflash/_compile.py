"""Kernel sources, NVRTC compilation and the per-device module cache.

Sources live in ``kernels_cu/``: one ``.cu`` file per kernel family (``_tiles.KERNELS``) and
headers by concern (types, parameters, mask, layout, copies, mma, sm90, softmax, non-finite
scans, epilogue). ``kernel_source`` pastes every local ``#include`` in place, recursively and once
each: the translation unit NVRTC compiles is one string, so CuPy's on-disk cache (keyed on the
source text and the options) sees every edit of every header. ``compile_for_arch`` (no GPU; the
compile test) also appends the parameter structs' layout checks (``_params.layout_checks``).

Compiling is slow (0.5-3 s a specialisation), so ``precompile`` and ``compile_all`` spread it over
the machine's cores in worker processes.
"""

from __future__ import annotations

import os
import re
import threading
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from functools import lru_cache
from pathlib import Path

from ._params import layout_checks
from ._tiles import KERNELS, TileConfig

BASE_OPTIONS = ("-std=c++17",)
_INCLUDE = re.compile(r'^#include "([^"]+)"[ \t]*$', re.M)
_PRAGMA_ONCE = re.compile(r"^#pragma once[ \t]*\n", re.M)


def kernel_dir() -> Path:
    """Folder of the CUDA sources: ``kernels_cu/`` beside the package (a checkout, an editable install),
    or inside it (a built package: setup.py copies it there)."""
    here = Path(__file__).resolve().parent
    for candidate in (here.parent / "kernels_cu", here / "kernels_cu"):
        if (candidate / "params.cuh").is_file():
            return candidate
    raise FileNotFoundError(f"cupyflash kernel sources (kernels_cu/params.cuh) not found next to {here}")


def _expand(folder: Path, name: str, seen: set) -> str:
    """``name`` with each local include replaced by its (expanded) text, the first time only."""
    path = folder / name
    if not path.is_file():
        raise FileNotFoundError(f"{name}, included by a cupyflash kernel, is not in {folder}")
    seen.add(name)

    def paste(match):
        header = match.group(1)
        return "" if header in seen else _expand(folder, header, seen)

    return _INCLUDE.sub(paste, _PRAGMA_ONCE.sub("", path.read_text()))


@lru_cache(maxsize=None)
def kernel_source(kernel: str) -> str:
    """The whole translation unit of ``kernel``'s family: its file and every header it pulls in."""
    return _expand(kernel_dir(), KERNELS[kernel].source, set())


def included_headers(kernel: str) -> list[str]:
    """The headers (recursively) that ``kernel``'s source pulls in."""
    seen: set = set()
    _expand(kernel_dir(), KERNELS[kernel].source, seen)
    return sorted(seen - {KERNELS[kernel].source})


def nvrtc_options(cfg: TileConfig) -> tuple[str, ...]:
    """Options of ``cfg``; an architecture-specific kernel names its architecture."""
    arch = (f"-arch={cfg.spec.arch}",) if cfg.spec.arch else ()
    return BASE_OPTIONS + cfg.defines() + arch


_modules: dict = {}
_modules_lock = threading.Lock()


def get_kernels(cfg: TileConfig):
    """Compiled kernels of ``cfg`` on the current device, compiled once per device.

    Returns
    -------
    dict
        Kernel name -> ``cupy.RawKernel``, dynamic shared memory already opted in.
    """
    import cupy

    key = (cfg, cupy.cuda.runtime.getDevice())
    kernels = _modules.get(key)
    if kernels is None:
        with _modules_lock:
            kernels = _modules.get(key)
            if kernels is None:
                module = cupy.RawModule(code=kernel_source(cfg.kernel), options=nvrtc_options(cfg))
                kernels = {name: module.get_function(name) for name in cfg.entries}
                for kern in kernels.values():
                    if cfg.smem_bytes > 48 * 1024:
                        kern.max_dynamic_shared_size_bytes = cfg.smem_bytes
                _modules[key] = kernels
    return kernels


BFLOAT16_CUPY = 14   # the first CuPy major version that holds bfloat16 (ml_dtypes) arrays


def install_hint(extras: str = "") -> str:
    """How to install cupyflash with CuPy, plus ``extras`` (e.g. ``',bench'``): from a checkout or a
    built wheel, as no package index serves cupyflash yet."""
    return (f'from a checkout: python -m pip install -e ".[cuda13{extras}]" (CUDA 13) or ".[cuda12{extras}]" '
            f'(CUDA 12); from a built wheel: python -m pip install "cupyflash-<version>-py3-none-any.whl[cuda13{extras}]"')


def holds_bfloat16(cupy) -> bool:
    """This CuPy can hold bfloat16 arrays."""
    return int(cupy.__version__.split(".")[0]) >= BFLOAT16_CUPY


def default_workers() -> int:
    """Worker processes for compiling: the cores this process may use."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:   # not Linux
        return max(1, os.cpu_count() or 1)


def _spawn_pool(workers: int) -> ProcessPoolExecutor:
    import multiprocessing

    # spawn, not fork: a forked CUDA context is unusable, and NVRTC holds no state worth inheriting
    return ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn"))


def _load_on_device(cfg: TileConfig, device: int) -> None:
    """Worker: compile ``cfg`` through CuPy on ``device``, so that it lands in CuPy's disk cache."""
    import cupy

    with cupy.cuda.Device(device):
        cupy.RawModule(code=kernel_source(cfg.kernel), options=nvrtc_options(cfg)).compile()


def precompile(kernels=None, dtypes=None, head_dims=None, workers=None) -> list[TileConfig]:
    """Compile specialisations for the current GPU now, into CuPy's kernel cache on disk.

    A later process (or this one) then loads them instead of compiling on first
    use. CuPy keys its cache by the GPU architecture, so this needs the GPU the
    kernels will run on (or one of the same compute capability).

    Parameters
    ----------
    kernels : sequence of str, optional
        Families from ``cupyflash._tiles.KERNELS`` (``'fwd_v1'``, ``'fwd_v2'``,
        ``'fwd_sm90'``, ``'bwd_prep'``, ``'bwd'``, ``'bwd_sm90'``, ``'bwd_sm90_wide'``,
        ``'repair'``);
        default all that run here.
    dtypes : sequence of dtype-like, optional
        Default all four (each kernel takes only its own).
    head_dims : sequence of int, optional
        Head dims whose buckets to compile; default every bucket.
    workers : int, optional
        Processes that compile side by side (each with its own CUDA context);
        default one per core of this machine. 1 compiles in this process.

    Returns
    -------
    list of TileConfig
        The specialisations now compiled.

    Raises
    ------
    ValueError
        A name in ``kernels`` that is not a kernel family.
    RuntimeError
        Without CuPy or without a CUDA GPU, naming what to install or run on;
        for bfloat16 under a CuPy older than 14, which holds no bfloat16 arrays.
    """
    from ._tiles import DTYPE_CODES, all_tile_configs, choose_tiles, dtype_name

    if kernels is not None:
        unknown = sorted(set(kernels) - set(KERNELS))
        if unknown:
            raise ValueError(f"kernels: {', '.join(unknown)} not among the kernel families {', '.join(KERNELS)}")
    try:
        import cupy
    except ImportError:
        raise RuntimeError(f"precompile needs CuPy: {install_hint()}") from None
    try:
        device = cupy.cuda.Device()
        capability = device.compute_capability
        smem = device.attributes["MaxSharedMemoryPerBlockOptin"]
    except cupy.cuda.runtime.CUDARuntimeError as error:
        raise RuntimeError(f"precompile needs a CUDA GPU, whose architecture keys CuPy's cache: {error}") from None
    names = None if dtypes is None else {dtype_name(d) for d in dtypes}
    if not holds_bfloat16(cupy):
        if names is not None and "bfloat16" in names:
            raise RuntimeError(f"bfloat16 on the GPU needs CuPy >= {BFLOAT16_CUPY}, found CuPy {cupy.__version__}")
        names = (set(DTYPE_CODES) if names is None else names) - {"bfloat16"}

    def serves(cfg):   # the specialisation a call of one of head_dims would run
        if head_dims is None or cfg.spec.any_head_dim:
            return True
        for d in head_dims:
            try:
                if choose_tiles(cfg.kernel, d, cfg.dtype, smem) == replace(cfg, flags=(), fp32_mma=0):
                    return True
            except ValueError:   # that kernel does not take this head dim here
                continue
        return False

    chosen = [cfg for cfg in all_tile_configs(smem, f"sm_{capability}")
              if (kernels is None or cfg.kernel in kernels) and (names is None or cfg.dtype in names) and serves(cfg)]
    workers = default_workers() if workers is None else workers
    if workers > 1 and len(chosen) > 1:
        with _spawn_pool(min(workers, len(chosen))) as pool:
            for done in [pool.submit(_load_on_device, cfg, device.id) for cfg in chosen]:
                done.result()
    for cfg in chosen:   # from the disk cache now
        get_kernels(cfg)
    return chosen


def compile_for_arch(cfg: TileConfig, arch: str, *, verbose: bool = False, assemble: bool = True) -> tuple[bytes, str]:
    """Compile ``cfg`` to a cubin for ``arch`` (e.g. ``'sm_90'``) without a GPU, or only to PTX.

    An architecture-specific kernel (``cfg.spec.arch``) is built for its own architecture.

    Parameters
    ----------
    cfg : TileConfig
    arch : str
    verbose : bool
        ptxas reports each entry's registers and spills into the log.
    assemble : bool
        False: NVRTC's front end and optimiser only, the PTX for ``compute_XX`` (about half the time of
        the cubin; ptxas neither runs nor reports).

    Returns
    -------
    cubin : bytes
        Or the PTX text.
    log : str
        NVRTC's log; with ``verbose`` (and ``assemble``) it holds ptxas' register and spill report.

    Raises
    ------
    RuntimeError
        With the compiler log, when NVRTC rejects the source.
    """
    from cupy_backends.cuda.libs import nvrtc

    options = list(nvrtc_options(cfg))
    if not cfg.spec.arch:
        options.append(f"-arch={arch}")
    if not assemble:   # the same architecture's virtual one: sm_90 -> compute_90, sm_90a -> compute_90a
        options = [o.replace("-arch=sm_", "-arch=compute_") for o in options]
    elif verbose:
        options.append("--ptxas-options=-v")
    source = kernel_source(cfg.kernel) + ("\n" + layout_checks() if nvrtc_has_offsetof() else "")
    prog = nvrtc.createProgram(source, cfg.spec.source, [], [])
    try:
        try:
            nvrtc.compileProgram(prog, options)
        except nvrtc.NVRTCError as err:
            raise RuntimeError(f"NVRTC failed for {cfg} on {arch}:\n{nvrtc.getProgramLog(prog)}") from err
        return (nvrtc.getCUBIN(prog) if assemble else bytes(nvrtc.getPTX(prog))), nvrtc.getProgramLog(prog)
    finally:
        nvrtc.destroyProgram(prog)


@lru_cache(maxsize=None)
def nvrtc_has_offsetof() -> bool:
    """This NVRTC takes ``__builtin_offsetof`` in a constant expression (older ones do not: there the
    GPU tests check the layout with ``_params.layout_probe``)."""
    from cupy_backends.cuda.libs import nvrtc

    prog = nvrtc.createProgram("struct S { int a; long long b; };\n"
                               "static_assert(__builtin_offsetof(S, b) == 8, \"\");\n", "probe.cu", [], [])
    try:
        nvrtc.compileProgram(prog, list(BASE_OPTIONS))
        return True
    except nvrtc.NVRTCError:
        return False
    finally:
        nvrtc.destroyProgram(prog)


def _compile_logged(job):
    cfg, arch, assemble = (*job, True)[:3]
    try:
        cubin, log = compile_for_arch(cfg, arch, verbose=True, assemble=assemble)
    except RuntimeError as error:   # NVRTC rejected it: the log says why
        return b"", str(error)
    return cubin[:4], log


def compile_all(jobs, workers=None) -> list[tuple[bytes, str]]:
    """``compile_for_arch(cfg, arch, verbose=True, assemble=assemble)`` of every ``(cfg, arch)`` or ``(cfg,
    arch, assemble)`` in ``jobs``, in worker processes (no GPU needed): the first four bytes of each cubin
    or PTX (empty where NVRTC failed) and the log, in order."""
    jobs = list(jobs)
    workers = default_workers() if workers is None else workers
    if workers <= 1 or len(jobs) <= 1:
        return [_compile_logged(job) for job in jobs]
    with _spawn_pool(min(workers, len(jobs))) as pool:
        return list(pool.map(_compile_logged, jobs))
