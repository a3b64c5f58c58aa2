"""``precision=``: float32 on the tensor cores, 'highest' (3xTF32) at float32 accuracy and 'tf32' at its
documented error, judged against the exact FMA tiles (``FLASH_FP32_MMA=0``) on the same inputs."""

import numpy
import pytest

import cupyflash
from cupyflash import _launch, _tiles, reference
from helpers import requires_gpu, to_gpu

pytestmark = requires_gpu

# (B, H, N, D) with logits up to ~30 (q scaled) and rows of 2048 keys
SHAPE = (1, 4, 2048, 128)
LOGIT_SCALE = 3.0
# 'tf32' (10-bit mantissas): the worst error of o and of each gradient, relative to the largest
# magnitude of the reference, is at most this (README, precision)
TF32_REL_ERR = 1e-2


def problem(causal):
    rng = numpy.random.default_rng(11)
    q, k, v, do = (rng.standard_normal(SHAPE).astype(numpy.float32) for _ in range(4))
    q *= LOGIT_SCALE
    o, m, l = reference.attention_forward(q, k, v, causal=causal)
    grads = reference.attention_backward(do, q, k, v, o, m, l, causal=causal)
    return (q, k, v, do), (o, *grads)


def errors(arrays, truth, causal, precision, schedule):
    """|result - truth| of o, dq, dk, dv of one GPU run."""
    q, k, v, do = to_gpu(*arrays)
    o, m, l = cupyflash.flash_attention_forward(q, k, v, causal=causal, precision=precision, schedule=schedule)
    grads = cupyflash.flash_attention_backward(do, q, k, v, o, m, l, causal=causal, precision=precision,
                                               schedule=schedule)
    return [numpy.abs(x.get().astype(numpy.float64) - t) for x, t in zip((o, *grads), truth)]


@pytest.mark.parametrize("schedule", ["v1", "v2"])
@pytest.mark.parametrize("causal", [False, True])
def test_highest_has_the_error_distribution_of_float32_fma(causal, schedule, monkeypatch):
    """3xTF32 against the exact FMA tiles on the same inputs: median, 99th percentile and worst error of
    o and every gradient within 2x."""
    arrays, truth = problem(causal)
    tensor_cores = errors(arrays, truth, causal, "highest", schedule)
    monkeypatch.setitem(_tiles.FP32_PRODUCTS, "highest", 0)
    monkeypatch.setattr(_launch, "PLANS", {})
    fma = errors(arrays, truth, causal, "highest", schedule)
    for name, tc, ref in zip(("o", "dq", "dk", "dv"), tensor_cores, fma):
        for q in (0.5, 0.99, 1.0):   # median, tail, worst
            assert numpy.quantile(tc, q) <= 2 * numpy.quantile(ref, q) + 1e-30, (name, q)


@pytest.mark.parametrize("causal", [False, True])
def test_tf32_is_within_its_documented_error_and_is_tf32(causal):
    arrays, truth = problem(causal)
    tf32 = errors(arrays, truth, causal, "tf32", "v2")
    highest = errors(arrays, truth, causal, "highest", "v2")
    for name, err, hi, t in zip(("o", "dq", "dk", "dv"), tf32, highest, truth):
        assert err.max() <= TF32_REL_ERR * numpy.abs(t).max(), name
        assert numpy.median(err) > 10 * numpy.median(hi), name   # one TF32 product, not three


def test_precision_changes_nothing_for_other_dtypes():
    rng = numpy.random.default_rng(5)
    for dtype in (numpy.float16, numpy.float64):
        q, k, v = to_gpu(*(rng.standard_normal((2, 2, 130, 64)).astype(dtype) for _ in range(3)))
        a = cupyflash.flash_attention_forward(q, k, v, causal=True, precision="highest")
        b = cupyflash.flash_attention_forward(q, k, v, causal=True, precision="tf32")
        for x, y in zip(a, b):
            assert x.get().tobytes() == y.get().tobytes()
