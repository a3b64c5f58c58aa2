"""Test helpers: GPU detection, a poisoned memory pool, error measures and tolerances."""

import numpy
import pytest


def _gpu_available() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no cupy, no driver, no device: all mean "no GPU here"
        return False


HAVE_GPU = _gpu_available()
requires_gpu = pytest.mark.skipif(not HAVE_GPU, reason="needs a CUDA GPU")

POISON_BYTES = 256 << 20


def poison_pool():
    """Leave NaN in CuPy's memory pool, so that an output element a kernel forgets to write fails the test."""
    import cupy

    pool = cupy.get_default_memory_pool()
    pool.free_all_blocks()
    junk = cupy.full(POISON_BYTES // 4, cupy.nan, dtype=cupy.float32)
    del junk  # the NaN-filled block returns to the pool and is carved up by the next allocations


def rel_err(got, ref) -> float:
    """Relative Frobenius error ||got - ref|| / ||ref|| over finite entries; inf if the non-finite entries differ."""
    got = numpy.asarray(got, dtype=numpy.float64)
    ref = numpy.asarray(ref, dtype=numpy.float64)
    assert got.shape == ref.shape, (got.shape, ref.shape)
    finite = numpy.isfinite(ref)
    if not numpy.array_equal(numpy.isfinite(got), finite) or not numpy.array_equal(got[~finite], ref[~finite]):
        return numpy.inf
    denom = numpy.linalg.norm(ref[finite])
    diff = numpy.linalg.norm(got[finite] - ref[finite])
    return float(diff / denom) if denom > 0 else float(diff)


# Ceilings on the relative error against float64 (issue #2): unless the naive
# same-precision attention is itself worse, no output may exceed these.
FWD_CEILING = {"float16": 2e-3, "bfloat16": 1.5e-2, "float32": 1e-5, "float64": 1e-10}
BWD_CEILING = {"float16": 5e-3, "bfloat16": 3e-2, "float32": 1e-4, "float64": 1e-9}
M_CEILING = {"float16": 1e-5, "bfloat16": 1e-5, "float32": 1e-5, "float64": 1e-10}
L_CEILING = {"float16": 1e-3, "bfloat16": 1e-3, "float32": 1e-5, "float64": 1e-10}
# Where both errors sit at the accumulator's rounding level, "twice naive" is
# noise: allow a few units of roundoff of the accumulator on top of it.
ROUNDOFF_SLACK = {"float16": 16 * 2.0**-24, "bfloat16": 16 * 2.0**-24, "float32": 16 * 2.0**-24,
                  "float64": 16 * 2.0**-53}


def assert_twice_naive(name, got, ref, naive, dtype_name, ceilings):
    """FlashAttention's rule: error at most twice a naive same-precision attention's, and under the ceiling."""
    err, base = rel_err(got, ref), rel_err(naive, ref)
    assert err <= 2 * base + ROUNDOFF_SLACK[dtype_name], f"{name}: error {err:.3e} > 2 x naive {base:.3e}"
    assert err <= max(ceilings[dtype_name], base), f"{name}: error {err:.3e} over ceiling {ceilings[dtype_name]:.0e}"


def assert_under(name, got, ref, ceiling):
    err = rel_err(got, ref)
    assert err <= ceiling, f"{name}: error {err:.3e} > {ceiling:.0e}"
