"""Test helpers: dtypes, GPU detection and the ``gpu`` marker, inputs (random, poisoned with inf/NaN),
a memory pool poisoned with NaN, the contract's judgement of a forward call, and the faked GPU of
benchmarks/host_path.py.

Tolerances live in tests/tolerances.py, hypothesis strategies in tests/strategies.py.
"""

import math
import shutil
import subprocess
from pathlib import Path

import ml_dtypes
import numpy
import pytest

from tolerances import assert_non_finite_like, on_host

# The four dtypes the API takes
FLOAT16 = numpy.dtype(numpy.float16)
BFLOAT16 = numpy.dtype(ml_dtypes.bfloat16)
FLOAT32 = numpy.dtype(numpy.float32)
FLOAT64 = numpy.dtype(numpy.float64)
FLOAT_DTYPES = (FLOAT16, BFLOAT16, FLOAT32, FLOAT64)
DTYPE_BY_NAME = {dt.name: dt for dt in FLOAT_DTYPES}
UNSUPPORTED_DTYPES = (numpy.dtype(numpy.int32), numpy.dtype(numpy.int64), numpy.dtype(numpy.bool_),
                      numpy.dtype(numpy.complex64), numpy.dtype(ml_dtypes.float8_e4m3fn),
                      numpy.dtype(numpy.longdouble), numpy.dtype(object))
MAX_HEAD_DIM = 256   # docs/semantics.md, Sizes: any head dim 1 <= D <= 256


def _gpu_available() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no cupy, no driver, no device: all mean "no GPU here"
        return False


HAVE_GPU = _gpu_available()
# Every GPU test carries both marks: `-m gpu` selects the GPU tests, `-m "not gpu"` leaves them out,
# and without a GPU they skip. A module of GPU tests says `pytestmark = requires_gpu`; one test, `@gpu_test`.
requires_gpu = [pytest.mark.gpu, pytest.mark.skipif(not HAVE_GPU, reason="needs a CUDA GPU")]


def gpu_test(test):
    """``requires_gpu`` on one test."""
    for mark in requires_gpu:
        test = mark(test)
    return test


# tests that run on NumPy arrays (the CPU path) and, where a GPU is present, on CuPy arrays: parametrize
# by ARRAY_MODULES and take the module with array_module_named
ARRAY_MODULES = ["numpy", pytest.param("cupy", marks=requires_gpu)]


NVCC = shutil.which("nvcc")
# the tests of kernels_cu/ headers compiled for the host: skipped where nvcc is not on the PATH
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc is not on the PATH")


def host_driver(folder, name: str, source: str, defines=()):
    """``source`` (C++ that includes kernels_cu/ headers) built for the host with nvcc in ``folder``, with
    ``-D`` ``defines``: the binary's path (an assertion carrying nvcc's message where it does not build)."""
    from cupyflash import _compile

    folder = Path(folder)
    source_path, binary = folder / f"{name}.cu", folder / name
    source_path.write_text(source)
    build = subprocess.run([NVCC, "-std=c++17", *(f"-D{d}" for d in defines), "-I", str(_compile.kernel_dir()),
                            "-o", str(binary), str(source_path)], capture_output=True, text=True)
    assert build.returncode == 0, build.stderr
    return binary


def faked_gpu_module():
    """benchmarks/host_path.py, whose ``FakeGPU`` answers CuPy's and the plans' device side on the host
    (imported from the checkout): a kept call's launches and parameter structs, on any machine."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "host_path.py"
    spec = importlib.util.spec_from_file_location("host_path_under_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def array_module_named(name: str):
    if name == "numpy":
        return numpy
    import cupy

    return cupy


def host(x):
    """``x`` (NumPy or CuPy) as a NumPy array of its own dtype."""
    return x if isinstance(x, numpy.ndarray) else x.get()


POISON_BYTES = 256 << 20


def random_inputs(rng, dtype, q_shape, kv_shape, spread=1.0):
    """q, k, v (NumPy) of standard-normal values times ``spread``; ``dtype`` a dtype or its name."""
    cast = DTYPE_BY_NAME.get(dtype, dtype)
    return [(spread * rng.standard_normal(s)).astype(cast) for s in (q_shape, kv_shape, kv_shape)]


_rng = numpy.random.default_rng(20240611)


def random_array(shape, dtype=FLOAT32):
    """Standard-normal values of ``shape`` cast to ``dtype`` (any dtype numpy can cast to)."""
    return _rng.standard_normal(shape).astype(dtype)


def to_gpu(*arrays):
    import cupy

    return [cupy.asarray(a) for a in arrays]


def poison_pool():
    """Leave NaN in CuPy's memory pool, so that an output element a kernel forgets to write fails the test."""
    import cupy

    pool = cupy.get_default_memory_pool()
    pool.free_all_blocks()
    junk = cupy.full(POISON_BYTES // 4, cupy.nan, dtype=cupy.float32)
    del junk  # the NaN-filled block returns to the pool and is carved up by the next allocations


# Batch shapes (q, k and v) of the poisoned inputs: every head its own, k and v shared by the two
# query heads of a batch entry (GQA), q shared by the two batch entries
POISON_LAYOUTS = {"own": ((2, 2), (2, 2)), "kv_shared": ((2, 2), (2, 1)), "q_shared": ((1, 2), (2, 2))}


def poisoned_inputs(rng, dtype, case, head_dim=64, layout="own"):
    """q (..., 300, D), k, v (..., 260, D) of ``POISON_LAYOUTS[layout]``, do (2, 2, 300, D), with inf/NaN
    planted in ``case`` (one of them).

    Causal, rows 0-39 see no key, and every planted value lies in a diagonal tile (any tile size the
    kernels use), where rows of the same tile see its key or query while others do not.
    """
    q_batch, kv_batch = POISON_LAYOUTS[layout]
    q, k, v = random_inputs(rng, dtype, (*q_batch, 300, head_dim), (*kv_batch, 260, head_dim))
    do = rng.standard_normal((2, 2, 300, head_dim)).astype(q.dtype)
    x = {"q": q, "k": k, "v": v, "do": do}[case]
    planted = {"q": (((0, 1, 100, 5), numpy.nan), ((1, 0, 7, 0), numpy.inf)),   # row 7 sees no key when causal
               "k": (((1, 0, 200, 7), numpy.inf),   # +inf scores (NaN rows) where q_i7 > 0, ignored where < 0
                     ((0, 1, 3, 9), numpy.nan)),
               "v": (((0, 0, 150, 3), numpy.nan), ((1, 1, 20, 9), -numpy.inf)),
               "do": (((0, 1, 120, 4), numpy.nan), ((1, 0, 250, head_dim - 1), numpy.inf))}[case]
    for index, value in planted:   # a shared dim has one entry: the value lands there
        x[tuple(min(i, n - 1) for i, n in zip(index, x.shape))] = value
    return q, k, v, do


def assert_non_finite_rules(dtype, causal, case, to_device=lambda *arrays: arrays, head_dim=64, layout="own",
                            window=None, mods=None, **options):
    """Forward and backward of ``poisoned_inputs`` (arrays through ``to_device``, calls with ``options``)
    against the mask-exact reference: o, m, l and the gradients non-finite exactly where its are, and
    close where both are finite; rows 0-39, which see no key when causal, empty (o = 0, m = -inf, l = 0,
    dq = 0). ``case`` "do" poisons only the backward's input; ``window`` and the score modifiers ``mods``
    (a dict: softcap, alibi_slopes) go to every call."""
    from cupyflash import flash_attention_backward, flash_attention_forward, reference

    rng = numpy.random.default_rng(13)
    q, k, v, do = poisoned_inputs(rng, dtype, case, head_dim, layout)
    mods = mods or {}
    out = flash_attention_forward(*to_device(q, k, v), causal=causal, window=window, **mods, **options)
    refs = reference.attention_forward(q, k, v, causal=causal, window=window, **mods)
    for name, got, ref in zip("oml", out, refs):
        assert_non_finite_like(name, got, ref, dtype)
    grads = flash_attention_backward(*to_device(do, q, k, v), *out, causal=causal, window=window, **mods, **options)
    ref_grads = reference.attention_backward(do, q, k, v, *refs, causal=causal, window=window, **mods)
    for name, got, ref in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert_non_finite_like(name, got, ref, dtype)
    if causal:   # (with a sink such rows have m = sink, l = 1: the comparison above holds them)
        o, m, l, dq = (on_host(x) for x in (*out, grads[0]))
        assert not o[..., :40, :].any() and not dq[..., :40, :].any()
        if "sink" not in mods:
            assert (m[..., :40] == -numpy.inf).all() and not l[..., :40].any()


# ---------------------------------------------------------------------------
# The contract of a forward call (docs/semantics.md, Sizes and Errors)


def _finite_as_float(number):
    """Whether ``number`` has a finite float value (an int beyond the float range has none)."""
    try:
        return math.isfinite(float(number))
    except OverflowError:
        return False


def forward_contract_errors(q, k, v, causal, softmax_scale):
    """The error classes the contract allows for this forward call; empty when it must succeed."""
    arrays = {"q": q, "k": k, "v": v}
    if not all(isinstance(x, numpy.ndarray) for x in arrays.values()):
        return {TypeError}
    errors = set()
    dtypes = {x.dtype for x in arrays.values()}
    if len(dtypes) > 1 or not dtypes <= set(FLOAT_DTYPES):
        errors.add(TypeError)
    if not isinstance(causal, (bool, numpy.bool_)):
        errors.add(TypeError)
    if softmax_scale is not None:
        if isinstance(softmax_scale, (bool, numpy.bool_)) or not isinstance(
                softmax_scale, (int, float, numpy.integer, numpy.floating)):
            errors.add(TypeError)
        elif not _finite_as_float(softmax_scale):
            errors.add(ValueError)
    if any(x.ndim < 2 for x in arrays.values()):
        errors.add(ValueError)
    else:
        head_dims = {x.shape[-1] for x in arrays.values()}
        try:
            numpy.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
            broadcasts = True
        except ValueError:
            broadcasts = False
        if (k.shape[-2] != v.shape[-2] or len(head_dims) > 1 or not 1 <= q.shape[-1] <= MAX_HEAD_DIM
                or not broadcasts):
            errors.add(ValueError)
    return errors


def call_with_keywords(call, q, k, v, **kw):
    """Run public function ``call`` ('forward', 'backward' after a plain forward, 'flash_attention', or
    'varlen': two packed sequences of q's and k's rows) on ``q, k, v`` with keywords ``kw``."""
    import cupyflash

    if call == "forward":
        return cupyflash.flash_attention_forward(q, k, v, **kw)
    if call == "flash_attention":
        return cupyflash.flash_attention(q, k, v, **kw)
    if call == "varlen":
        n_q, n_k = q.shape[-2], k.shape[-2]
        return cupyflash.flash_attention_varlen_forward(q, k, v, numpy.array([0, n_q // 2, n_q]),
                                                        numpy.array([0, n_k // 2, n_k]), **kw)
    o, m, l = cupyflash.flash_attention_forward(q, k, v)
    return cupyflash.flash_attention_backward(o, q, k, v, o, m, l, **kw)


def assert_refused(call, error, words, **kw):
    """``call_with_keywords(call, ...)`` on small float32 inputs (a batch of (2, 3), 10 queries, 12 keys,
    D 8) with keywords ``kw`` raises ``error`` whose message holds ``words``."""
    q, k, v = random_inputs(numpy.random.default_rng(0), "float32", (2, 3, 10, 8), (2, 3, 12, 8))
    with pytest.raises(error) as raised:
        call_with_keywords(call, q, k, v, **kw)
    assert words in str(raised.value)


def reproducible_backward(q, k, v, do, runs=3, **kw):
    """The deterministic backward of the CuPy inputs, run ``runs`` times after one forward (both with
    ``kw``): asserts every run gives the same bits and returns the first's results."""
    import cupyflash

    o, m, l = cupyflash.flash_attention_forward(q, k, v, **kw)
    results = [cupyflash.flash_attention_backward(do, q, k, v, o, m, l, deterministic=True, **kw) for _ in range(runs)]
    for later in results[1:]:
        for a, b in zip(results[0], later):
            assert a.tobytes() == b.tobytes()
    return results[0]
