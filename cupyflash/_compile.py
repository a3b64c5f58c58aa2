"""Kernel sources, NVRTC compilation and the per-device module cache.

Sources live in ``kernels_cu/``. Each kernel file starts with
``#include "flash_common.cuh"``; the header's text is pasted in its place
before compiling, so CuPy's on-disk cache (keyed on the source text and the
options) sees every edit of the header.
"""

from __future__ import annotations

import threading
from dataclasses import replace
from functools import lru_cache
from pathlib import Path

from ._tiles import TileConfig

HEADER = "flash_common.cuh"
KERNEL_FILES = {"fwd_v1": "flash_fwd_v1.cu", "fwd_v2": "flash_fwd_v2.cu", "fwd_v2_sm90": "flash_fwd_v2_sm90.cu",
                "bwd_v1": "flash_bwd_v1.cu", "bwd_sm90": "flash_bwd_sm90.cu", "repair": "flash_repair.cu"}
KERNEL_NAMES = {
    "fwd_v1": ("flash_fwd_v1",),
    "fwd_v2": ("flash_fwd_v2",),
    "fwd_v2_sm90": ("flash_fwd_v2_sm90",),
    "bwd_v1": ("flash_bwd_prep_v1", "flash_bwd_v1", "flash_convert"),
    "bwd_sm90": ("flash_bwd_sm90",),
    "repair": ("flash_fwd_repair", "flash_bwd_repair"),
}
BASE_OPTIONS = ("-std=c++17",)


def kernel_dir() -> Path:
    """Folder of the CUDA sources: ``kernels_cu/`` beside the package, or inside it."""
    here = Path(__file__).resolve().parent
    for candidate in (here.parent / "kernels_cu", here / "kernels_cu"):
        if (candidate / HEADER).is_file():
            return candidate
    raise FileNotFoundError(f"cupyflash kernel sources ({HEADER}) not found next to {here}")


@lru_cache(maxsize=None)
def kernel_source(kernel: str) -> str:
    """Full translation unit for ``kernel``, the shared header pasted in."""
    folder = kernel_dir()
    header = (folder / HEADER).read_text()
    body = (folder / KERNEL_FILES[kernel]).read_text()
    include = f'#include "{HEADER}"'
    if include not in body:
        raise RuntimeError(f"{KERNEL_FILES[kernel]} does not include {HEADER}")
    return body.replace(include, header, 1)


def nvrtc_options(cfg: TileConfig) -> tuple[str, ...]:
    """Options of ``cfg``; an architecture-specific kernel names its architecture."""
    arch = (f"-arch={cfg.arch}",) if cfg.arch else ()
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

    key = (cfg, cupy.cuda.Device().id)
    kernels = _modules.get(key)
    if kernels is None:
        with _modules_lock:
            kernels = _modules.get(key)
            if kernels is None:
                module = cupy.RawModule(code=kernel_source(cfg.kernel), options=nvrtc_options(cfg))
                kernels = {name: module.get_function(name) for name in KERNEL_NAMES[cfg.kernel]}
                for kern in kernels.values():
                    if cfg.smem_bytes > 48 * 1024:
                        kern.max_dynamic_shared_size_bytes = cfg.smem_bytes
                _modules[key] = kernels
    return kernels


BFLOAT16_CUPY = 14   # the first CuPy major version that holds bfloat16 (ml_dtypes) arrays


def install_hint(extras: str = "") -> str:
    """How to install cupyflash with CuPy, plus ``extras`` (e.g. ``',bench'``)."""
    return f"pip install 'cupyflash[cuda12{extras}]' (CUDA 12) or 'cupyflash[cuda13{extras}]' (CUDA 13)"


def holds_bfloat16(cupy) -> bool:
    """This CuPy can hold bfloat16 arrays."""
    return int(cupy.__version__.split(".")[0]) >= BFLOAT16_CUPY


def precompile(kernels=None, dtypes=None, head_dims=None) -> list[TileConfig]:
    """Compile specialisations for the current GPU now, into CuPy's kernel cache on disk.

    A later process (or this one) then loads them instead of compiling on first
    use. CuPy keys its cache by the GPU architecture, so this needs the GPU the
    kernels will run on (or one of the same compute capability).

    Parameters
    ----------
    kernels : sequence of str, optional
        Names from ``cupyflash._tiles.KERNELS`` (``'fwd_v1'``, ``'fwd_v2'``,
        ``'fwd_v2_sm90'``, ``'bwd_v1'``, ``'bwd_sm90'``, ``'repair'``); default
        all that run here.
    dtypes : sequence of dtype-like, optional
        Default all four (each kernel takes only its own).
    head_dims : sequence of int, optional
        Head dims whose buckets to compile; default every bucket.

    Returns
    -------
    list of TileConfig
        The specialisations now compiled.

    Raises
    ------
    RuntimeError
        Without CuPy or without a CUDA GPU, naming what to install or run on;
        for bfloat16 under a CuPy older than 14, which holds no bfloat16 arrays.
    """
    from ._tiles import DTYPE_CODES, all_tile_configs, choose_tiles, dtype_name

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
        if head_dims is None:
            return True
        for d in head_dims:
            try:
                if choose_tiles(cfg.kernel, d, cfg.dtype, smem) == replace(cfg, ordered=False):
                    return True
            except ValueError:   # that kernel does not take this head dim here
                continue
        return False

    chosen = [cfg for cfg in all_tile_configs(smem, f"sm_{capability}")
              if (kernels is None or cfg.kernel in kernels) and (names is None or cfg.dtype in names) and serves(cfg)]
    for cfg in chosen:
        get_kernels(cfg)
    return chosen


def compile_for_arch(cfg: TileConfig, arch: str, *, verbose: bool = False) -> tuple[bytes, str]:
    """Compile ``cfg`` to a cubin for ``arch`` (e.g. ``'sm_90'``) without a GPU.

    An architecture-specific kernel (``cfg.arch``) is built for its own architecture.

    Returns
    -------
    cubin : bytes
    log : str
        NVRTC's log; with ``verbose`` it holds ptxas' register and spill report.

    Raises
    ------
    RuntimeError
        With the compiler log, when NVRTC rejects the source.
    """
    from cupy_backends.cuda.libs import nvrtc

    options = list(nvrtc_options(cfg))
    if not cfg.arch:
        options.append(f"-arch={arch}")
    if verbose:
        options.append("--ptxas-options=-v")
    prog = nvrtc.createProgram(kernel_source(cfg.kernel), KERNEL_FILES[cfg.kernel], [], [])
    try:
        try:
            nvrtc.compileProgram(prog, options)
        except nvrtc.NVRTCError as err:
            raise RuntimeError(f"NVRTC failed for {cfg} on {arch}:\n{nvrtc.getProgramLog(prog)}") from err
        return nvrtc.getCUBIN(prog), nvrtc.getProgramLog(prog)
    finally:
        nvrtc.destroyProgram(prog)
