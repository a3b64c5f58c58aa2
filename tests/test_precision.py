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
# magnitude of the reference, is at most this (docs/semantics.md, precision of float32)
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


@pytest.mark.parametrize("schedule", ["v1", "v2"])
@pytest.mark.parametrize("causal", [False, True])
def test_operands_whose_tf32_rounding_would_overflow_are_split_exactly(causal, schedule, monkeypatch):
    """3xTF32 splits an operand without guards only where its tile is finite and below 2^127
    (mma_sm80.cuh, Split): a q, k or v element at the top of the float32 range (where rounding to TF32
    would carry past it) must make its tiles take the guarded split and still give FMA's result."""
    rng = numpy.random.default_rng(17)
    q, k, v = (rng.standard_normal((1, 2, 200, 64)).astype(numpy.float32) for _ in range(3))
    big = numpy.uint32(0x7F7FF800).view(numpy.float32)   # 3.4027e38: rounded to TF32 it would be inf
    assert (int(big.view(numpy.uint32)) + 0x1000) & 0xFFFFE000 == 0x7F800000
    # q . k stays finite; 2^-100 keeps the low TF32 parts of the small factors normal (the tensor cores
    # count subnormal operands as 0, docs/semantics.md: precision of float32), the scale keeps the softmax from saturating
    tiny = lambda x: numpy.copysign(1 + numpy.abs(x), x) * numpy.float32(2.0**-100)
    scale = 2.0**-30
    q[0, 0, 150, 3], k[..., 3] = big, tiny(k[..., 3])
    k[0, 1, 7, 10], q[..., 10] = -big, tiny(q[..., 10])
    v[0, 0, 11, 20] = big   # P~ V stays finite: one key holds it

    def run():
        a, b, c = to_gpu(q, k, v)
        return [x.get() for x in cupyflash.flash_attention_forward(a, b, c, causal=causal, softmax_scale=scale,
                                                                    schedule=schedule)]

    tensor_cores = run()
    monkeypatch.setitem(_tiles.FP32_PRODUCTS, "highest", 0)
    monkeypatch.setattr(_launch, "PLANS", {})
    fma = run()
    for name, tc, ref in zip("oml", tensor_cores, fma):
        assert numpy.isfinite(ref).all() and numpy.isfinite(tc).all(), name
        numpy.testing.assert_allclose(tc, ref, rtol=1e-5, atol=1e-5, err_msg=name)
