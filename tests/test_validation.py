"""CPU tests of input validation in cupyflash's public API (no GPU needed).

Bad input raises the documented error before anything is computed, with a
message that names the argument and the shapes or dtypes it saw; valid edge
cases (D = 1 and 256, rank 2, empty sequences, GQA/MQA broadcasting, strided
views, every float dtype) return outputs of the documented shapes and dtypes;
inputs are never modified. A hypothesis test then draws arbitrary calls and
checks that each one either succeeds as documented or raises ValueError or
TypeError, and which of the two when the contract decides it.
"""

import math
import re

import numpy as np
import pytest
from hypothesis import given, settings

import cupyflash
from cupyflash import flash_attention, flash_attention_backward, flash_attention_forward
from helpers import (BFLOAT16, FLOAT16, FLOAT32, FLOAT64, FLOAT_DTYPES, MAX_HEAD_DIM, UNSUPPORTED_DTYPES,
                     assert_non_finite_rules, forward_contract_errors, gpu_test, random_array)
from strategies import backward_calls, forward_calls
from tolerances import VIEW_RTOL, largest_logit

# Valid calls on random data emit no warning; an overflow or 0/0 would be a bug.
pytestmark = pytest.mark.filterwarnings("error")

# A well-formed multi-head problem: q (B, H, Nq, D), k and v (B, H, Nk, D).
Q_SHAPE = (2, 3, 5, 8)
KV_SHAPE = (2, 3, 7, 8)
OUT_SHAPE = Q_SHAPE         # (*batch, Nq, D)
STATS_SHAPE = Q_SHAPE[:-1]  # (*batch, Nq)

FORWARD_ENTRY_POINTS = ("flash_attention_forward", "flash_attention", "flash_attention_backward")

# ---------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------

def statistics_dtype(dtype):
    """The documented dtype of m and l: float64 for float64 inputs, else float32."""
    return FLOAT64 if dtype == FLOAT64 else FLOAT32


def message_naming(names, seen=()):
    """A ``match=`` pattern: every argument in ``names`` as a word and every string in ``seen`` verbatim."""
    parts = [rf"(?=.*(?<!\w){re.escape(n)}(?!\w))" for n in names]
    parts += [f"(?=.*{re.escape(s)})" for s in seen]
    return "(?s)^" + "".join(parts)


def backward_companions(q, k, v):
    """``do, o, m, l`` as a backward call on ``q, k, v`` needs them, as far as ``q, k, v`` define them.

    Lets a bad ``q, k, v`` be tested through the backward without a second,
    unrelated fault in ``do, o, m, l``.
    """
    q_like = q if isinstance(q, np.ndarray) and q.ndim >= 2 else np.zeros((1, 1), FLOAT32)
    batch_dims = [x.shape[:-2] for x in (q_like, k, v) if isinstance(x, np.ndarray) and x.ndim >= 2]
    try:
        batch = np.broadcast_shapes(*batch_dims)
    except ValueError:
        batch = q_like.shape[:-2]
    out = np.zeros((*batch, *q_like.shape[-2:]), q_like.dtype)
    stats = np.zeros((*batch, q_like.shape[-2]), statistics_dtype(q_like.dtype))
    return out, out.copy(), stats, stats.copy()


def call_entry_point(entry_point, q, k, v, **flags):
    """Call one public function on ``q, k, v``; the backward gets matching ``do, o, m, l``."""
    if entry_point == "flash_attention_backward":
        do, o, m, l = backward_companions(q, k, v)
        return flash_attention_backward(do, q, k, v, o, m, l, **flags)
    return getattr(cupyflash, entry_point)(q, k, v, **flags)


def valid_backward_arguments(dtype=FLOAT32):
    """``(do, q, k, v, o, m, l)`` of the well-formed problem, every one of its documented shape and dtype.

    The values are random (validation does not look at them), so no forward runs.
    """
    q, k, v = random_array(Q_SHAPE, dtype), random_array(KV_SHAPE, dtype), random_array(KV_SHAPE, dtype)
    do, o = random_array(OUT_SHAPE, dtype), random_array(OUT_SHAPE, dtype)
    m = random_array(STATS_SHAPE, statistics_dtype(dtype))
    l = 1 + np.abs(random_array(STATS_SHAPE, statistics_dtype(dtype)))
    return do, q, k, v, o, m, l


@pytest.fixture
def computation_forbidden(monkeypatch):
    """Make the CPU path fail loudly if it is entered: errors must come from validation."""
    def must_not_run(*args, **kwargs):
        raise AssertionError("the computation ran although the input was invalid")

    monkeypatch.setattr(cupyflash.blocked, "forward", must_not_run)
    monkeypatch.setattr(cupyflash.blocked, "backward", must_not_run)


# ---------------------------------------------------------------------------
# Bad input raises, before anything runs, naming what it saw
# ---------------------------------------------------------------------------

def _one_argument_replaced(argument, value, dtype=FLOAT32):
    """Well-formed ``q, k, v`` of ``dtype`` with ``argument`` replaced by ``value``."""
    arrays = {"q": random_array(Q_SHAPE, dtype), "k": random_array(KV_SHAPE, dtype),
              "v": random_array(KV_SHAPE, dtype)}
    arrays[argument] = value
    return arrays["q"], arrays["k"], arrays["v"]


@pytest.mark.usefixtures("computation_forbidden")
@pytest.mark.parametrize("entry_point", FORWARD_ENTRY_POINTS)
@pytest.mark.parametrize("argument", ["q", "k", "v"])
@pytest.mark.parametrize("dtype", UNSUPPORTED_DTYPES, ids=str)
def test_unsupported_dtype_raises_type_error(entry_point, argument, dtype):
    shape = Q_SHAPE if argument == "q" else KV_SHAPE
    q, k, v = _one_argument_replaced(argument, random_array(shape, dtype))
    with pytest.raises(TypeError, match=message_naming([argument], [str(dtype)])):
        call_entry_point(entry_point, q, k, v)


@pytest.mark.usefixtures("computation_forbidden")
@pytest.mark.parametrize("entry_point", FORWARD_ENTRY_POINTS)
@pytest.mark.parametrize("argument", ["q", "k", "v"])
@pytest.mark.parametrize(("shared", "odd"), [(FLOAT32, FLOAT64), (FLOAT16, BFLOAT16), (BFLOAT16, FLOAT32),
                                             (FLOAT64, FLOAT16)], ids=str)
def test_mixed_dtypes_raise_type_error(entry_point, argument, shared, odd):
    shape = Q_SHAPE if argument == "q" else KV_SHAPE
    q, k, v = _one_argument_replaced(argument, random_array(shape, odd), dtype=shared)
    with pytest.raises(TypeError, match=message_naming([argument], [str(odd), str(shared)])):
        call_entry_point(entry_point, q, k, v)


NON_ARRAYS = [
    pytest.param(lambda x: x.tolist(), "list", id="nested-list"),
    pytest.param(lambda x: tuple(x.tolist()), "tuple", id="tuple"),
    pytest.param(lambda x: 1.0, "float", id="float"),
    pytest.param(lambda x: None, "NoneType", id="None"),
    pytest.param(lambda x: memoryview(x), "memoryview", id="memoryview"),
]


@pytest.mark.usefixtures("computation_forbidden")
@pytest.mark.parametrize("entry_point", FORWARD_ENTRY_POINTS)
@pytest.mark.parametrize("argument", ["q", "k", "v"])
@pytest.mark.parametrize(("as_non_array", "type_name"), NON_ARRAYS)
def test_non_array_input_raises_type_error(entry_point, argument, as_non_array, type_name):
    shape = Q_SHAPE if argument == "q" else KV_SHAPE
    q, k, v = _one_argument_replaced(argument, as_non_array(random_array(shape)))
    with pytest.raises(TypeError, match=message_naming([argument], [type_name])):
        call_entry_point(entry_point, q, k, v)


BACKWARD_ARGUMENTS = ("do", "q", "k", "v", "o", "m", "l")


@pytest.mark.usefixtures("computation_forbidden")
@pytest.mark.parametrize("argument", ["do", "o", "m", "l"])
@pytest.mark.parametrize(("as_non_array", "type_name"), NON_ARRAYS)
def test_non_array_backward_input_raises_type_error(argument, as_non_array, type_name):
    arguments = dict(zip(BACKWARD_ARGUMENTS, valid_backward_arguments()))
    arguments[argument] = as_non_array(arguments[argument])
    with pytest.raises(TypeError, match=message_naming([argument], [type_name])):
        flash_attention_backward(*arguments.values())


@gpu_test
@pytest.mark.usefixtures("computation_forbidden")
@pytest.mark.parametrize("argument", BACKWARD_ARGUMENTS)
def test_mixing_numpy_and_cupy_raises_type_error(argument):
    import cupy

    arguments = dict(zip(BACKWARD_ARGUMENTS, valid_backward_arguments()))
    arguments[argument] = cupy.zeros(arguments[argument].shape, arguments[argument].dtype)
    pattern = message_naming([argument], ["cupy", "numpy"])
    with pytest.raises(TypeError, match=pattern):
        flash_attention_backward(*arguments.values())
    if argument in ("q", "k", "v"):
        forward = {name: arguments[name] for name in ("q", "k", "v")}
        with pytest.raises(TypeError, match=pattern):
            flash_attention_forward(**forward)
        with pytest.raises(TypeError, match=pattern):
            flash_attention(**forward)


@pytest.mark.usefixtures("computation_forbidden")
@pytest.mark.parametrize("entry_point", FORWARD_ENTRY_POINTS)
@pytest.mark.parametrize("causal", [1, 0, 1.0, "True", None, np.int64(1), [True]], ids=repr)
def test_non_bool_causal_raises_type_error(entry_point, causal):
    q, k, v = random_array(Q_SHAPE), random_array(KV_SHAPE), random_array(KV_SHAPE)
    with pytest.raises(TypeError, match=message_naming(["causal"], [type(causal).__name__])):
        call_entry_point(entry_point, q, k, v, causal=causal)


@pytest.mark.usefixtures("computation_forbidden")
@pytest.mark.parametrize("entry_point", FORWARD_ENTRY_POINTS)
@pytest.mark.parametrize("softmax_scale", [
    pytest.param("0.5", id="str"),
    pytest.param([0.5], id="list"),
    pytest.param(True, id="bool"),
    pytest.param(np.bool_(True), id="numpy-bool"),
    pytest.param(0.5 + 1j, id="complex"),
    pytest.param(np.complex128(0.5 + 1j), id="numpy-complex"),  # not real: must not lose its imaginary part
])
def test_non_number_softmax_scale_raises_type_error(entry_point, softmax_scale):
    q, k, v = random_array(Q_SHAPE), random_array(KV_SHAPE), random_array(KV_SHAPE)
    with pytest.raises(TypeError, match=message_naming(["softmax_scale"], [type(softmax_scale).__name__])):
        call_entry_point(entry_point, q, k, v, softmax_scale=softmax_scale)


@pytest.mark.usefixtures("computation_forbidden")
@pytest.mark.parametrize("entry_point", FORWARD_ENTRY_POINTS)
@pytest.mark.parametrize("argument", ["q", "k", "v"])
@pytest.mark.parametrize("shape", [(), (8,)], ids=str)
def test_rank_below_two_raises_value_error(entry_point, argument, shape):
    q, k, v = _one_argument_replaced(argument, random_array(shape))
    with pytest.raises(ValueError, match=message_naming([argument], [str(shape)])):
        call_entry_point(entry_point, q, k, v)


@pytest.mark.usefixtures("computation_forbidden")
@pytest.mark.parametrize("entry_point", FORWARD_ENTRY_POINTS)
@pytest.mark.parametrize(("argument", "shape"), [
    ("q", (2, 3, 5, 16)), ("k", (2, 3, 7, 9)), ("v", (2, 3, 7, 4)), ("k", (7, 1)),
], ids=str)
def test_mismatched_head_dim_raises_value_error(entry_point, argument, shape):
    q, k, v = _one_argument_replaced(argument, random_array(shape))
    with pytest.raises(ValueError, match=message_naming([argument], [str(shape)])):
        call_entry_point(entry_point, q, k, v)


@pytest.mark.usefixtures("computation_forbidden")
@pytest.mark.parametrize("entry_point", FORWARD_ENTRY_POINTS)
@pytest.mark.parametrize(("k_shape", "v_shape"), [
    ((2, 3, 7, 8), (2, 3, 6, 8)), ((2, 3, 0, 8), (2, 3, 1, 8)), ((7, 8), (2, 3, 8, 8)),
], ids=str)
def test_mismatched_key_count_raises_value_error(entry_point, k_shape, v_shape):
    q, k, v = random_array(Q_SHAPE), random_array(k_shape), random_array(v_shape)
    with pytest.raises(ValueError, match=message_naming(["k", "v"], [str(k_shape), str(v_shape)])):
        call_entry_point(entry_point, q, k, v)


@pytest.mark.usefixtures("computation_forbidden")
@pytest.mark.parametrize("entry_point", FORWARD_ENTRY_POINTS)
@pytest.mark.parametrize(("q_shape", "kv_shape"), [
    ((2, 5, 8), (3, 7, 8)),          # batch 2 against 3
    ((2, 3, 5, 8), (2, 2, 7, 8)),    # heads 3 against 2
    ((4, 2, 5, 8), (4, 7, 8)),       # right-aligned: 2 against 4
    ((2, 3, 2, 5, 8), (2, 2, 1, 7, 8)),  # GQA with a wrong number of KV heads
], ids=str)
def test_non_broadcastable_batch_raises_value_error(entry_point, q_shape, kv_shape):
    q, k, v = random_array(q_shape), random_array(kv_shape), random_array(kv_shape)
    with pytest.raises(ValueError, match=message_naming(["q", "k"], [str(q_shape), str(kv_shape)])):
        call_entry_point(entry_point, q, k, v)


@pytest.mark.usefixtures("computation_forbidden")
@pytest.mark.parametrize("entry_point", FORWARD_ENTRY_POINTS)
@pytest.mark.parametrize("head_dim", [0, MAX_HEAD_DIM + 1, 512])
def test_head_dim_outside_supported_range_raises_value_error(entry_point, head_dim):
    q_shape, kv_shape = (2, 5, head_dim), (2, 7, head_dim)
    q, k, v = random_array(q_shape), random_array(kv_shape), random_array(kv_shape)
    with pytest.raises(ValueError, match=message_naming(["q"], [str(q_shape)])):
        call_entry_point(entry_point, q, k, v)


@pytest.mark.usefixtures("computation_forbidden")
@pytest.mark.parametrize("entry_point", FORWARD_ENTRY_POINTS)
@pytest.mark.parametrize("softmax_scale", [
    pytest.param(math.inf, id="inf"),
    pytest.param(-math.inf, id="-inf"),
    pytest.param(math.nan, id="nan"),
    pytest.param(np.float32("inf"), id="float32-inf"),
    pytest.param(np.float16("nan"), id="float16-nan"),
    pytest.param(10**400, id="int-beyond-float-range"),  # float(10**400) has no finite value
])
def test_non_finite_softmax_scale_raises_value_error(entry_point, softmax_scale):
    q, k, v = random_array(Q_SHAPE), random_array(KV_SHAPE), random_array(KV_SHAPE)
    with pytest.raises(ValueError, match=message_naming(["softmax_scale"])):
        call_entry_point(entry_point, q, k, v, softmax_scale=softmax_scale)


def _backward_with(argument, make_replacement, dtype=FLOAT32):
    """The well-formed backward arguments of ``dtype`` with ``argument`` replaced by ``make_replacement(old)``."""
    arguments = dict(zip(BACKWARD_ARGUMENTS, valid_backward_arguments(dtype)))
    arguments[argument] = make_replacement(arguments[argument])
    return arguments


@pytest.mark.usefixtures("computation_forbidden")
@pytest.mark.parametrize("argument", ["do", "o"])
@pytest.mark.parametrize("bad_shape", [
    (2, 3, 5, 9),      # wrong D
    (2, 3, 6, 8),      # wrong Nq
    (3, 5, 8),         # batch dims missing
    (1, 3, 5, 8),      # broadcastable to the output, but not its shape
    (2, 3, 5, 8, 1),   # an extra axis
], ids=str)
def test_backward_output_of_wrong_shape_raises_value_error(argument, bad_shape):
    arguments = _backward_with(argument, lambda x: random_array(bad_shape, x.dtype))
    with pytest.raises(ValueError, match=message_naming([argument], [str(bad_shape), str(OUT_SHAPE)])):
        flash_attention_backward(*arguments.values())


@pytest.mark.usefixtures("computation_forbidden")
def test_backward_output_must_have_the_broadcast_batch_shape():
    """With q (1, Nq, D) broadcast against k, v (3, Nk, D), o is (3, Nq, D): q's own shape is wrong for do."""
    q, k, v = random_array((1, 5, 8)), random_array((3, 7, 8)), random_array((3, 7, 8))
    o, m, l = random_array((3, 5, 8)), random_array((3, 5)), 1 + np.abs(random_array((3, 5)))
    with pytest.raises(ValueError, match=message_naming(["do"], [str(q.shape), str(o.shape)])):
        flash_attention_backward(random_array(q.shape), q, k, v, o, m, l)


@pytest.mark.usefixtures("computation_forbidden")
@pytest.mark.parametrize("argument", ["do", "o"])
@pytest.mark.parametrize(("dtype", "bad_dtype"), [
    (FLOAT32, FLOAT64), (FLOAT32, FLOAT16), (FLOAT16, BFLOAT16), (BFLOAT16, FLOAT32), (FLOAT64, FLOAT32),
    (FLOAT32, np.dtype(np.int32)),
], ids=str)
def test_backward_output_of_wrong_dtype_raises_type_error(argument, dtype, bad_dtype):
    arguments = _backward_with(argument, lambda x: x.astype(bad_dtype), dtype)
    with pytest.raises(TypeError, match=message_naming([argument], [str(bad_dtype), str(dtype)])):
        flash_attention_backward(*arguments.values())


@pytest.mark.usefixtures("computation_forbidden")
@pytest.mark.parametrize("argument", ["m", "l"])
@pytest.mark.parametrize("bad_shape", [
    (2, 3, 6),         # wrong Nq
    (2, 3),            # Nq missing
    (2, 3, 5, 1),      # an extra axis
    (2, 3, 5, 8),      # the shape of o
    (3, 5),            # batch dims missing
], ids=str)
def test_backward_statistics_of_wrong_shape_raise_value_error(argument, bad_shape):
    arguments = _backward_with(argument, lambda x: random_array(bad_shape, x.dtype))
    with pytest.raises(ValueError, match=message_naming([argument], [str(bad_shape), str(STATS_SHAPE)])):
        flash_attention_backward(*arguments.values())


@pytest.mark.usefixtures("computation_forbidden")
@pytest.mark.parametrize("argument", ["m", "l"])
@pytest.mark.parametrize(("dtype", "bad_dtype"), [
    (FLOAT16, FLOAT16),    # statistics stay float32 for 16-bit inputs
    (BFLOAT16, BFLOAT16),
    (FLOAT32, FLOAT64),
    (FLOAT64, FLOAT32),    # and are float64 for float64 inputs
    (FLOAT32, np.dtype(np.int32)),
], ids=str)
def test_backward_statistics_of_wrong_dtype_raise_type_error(argument, dtype, bad_dtype):
    arguments = _backward_with(argument, lambda x: x.astype(bad_dtype), dtype)
    expected = statistics_dtype(dtype)
    with pytest.raises(TypeError, match=message_naming([argument], [str(bad_dtype), str(expected)])):
        flash_attention_backward(*arguments.values())


# ---------------------------------------------------------------------------
# Valid edge cases return the documented shapes and dtypes
# ---------------------------------------------------------------------------

def assert_forward_outputs(outputs, batch, n_q, head_dim, dtype):
    """o (*batch, Nq, D) in ``dtype``; m, l (*batch, Nq) in the statistics dtype; all C-contiguous."""
    o, m, l = outputs
    assert (o.shape, o.dtype) == ((*batch, n_q, head_dim), dtype)
    for name, x in (("m", m), ("l", l)):
        assert (x.shape, x.dtype) == ((*batch, n_q), statistics_dtype(dtype)), name
    for name, x in (("o", o), ("m", m), ("l", l)):
        assert isinstance(x, np.ndarray) and x.flags.c_contiguous, name


def assert_gradients(gradients, q, k, v):
    """dq, dk, dv have exactly the shapes of q, k, v, their dtype, and are C-contiguous."""
    assert len(gradients) == 3
    for name, g, x in zip(("dq", "dk", "dv"), gradients, (q, k, v)):
        assert isinstance(g, np.ndarray), name
        assert (g.shape, g.dtype) == (x.shape, x.dtype), name
        assert g.flags.c_contiguous, name


def run_forward_and_backward(q, k, v, **flags):
    """Forward, flash_attention and backward on q, k, v; returns the forward outputs and the gradients."""
    outputs = flash_attention_forward(q, k, v, **flags)
    o_only = flash_attention(q, k, v, **flags)
    np.testing.assert_array_equal(o_only, outputs[0])
    do = random_array(outputs[0].shape, q.dtype)
    gradients = flash_attention_backward(do, q, k, v, *outputs, **flags)
    return outputs, gradients


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("q_shape", "kv_shape", "batch"), [
    pytest.param((2, 5, 1), (2, 7, 1), (2,), id="D=1"),
    pytest.param((1, 3, 256), (1, 4, 256), (1,), id="D=256"),
    pytest.param((5, 8), (7, 8), (), id="rank-2"),
    pytest.param((2, 3, 0, 8), (2, 3, 7, 8), (2, 3), id="Nq=0"),
    pytest.param((2, 3, 5, 8), (2, 3, 0, 8), (2, 3), id="Nk=0"),
    pytest.param((0, 5, 8), (1, 7, 8), (0,), id="empty-batch"),
    pytest.param((2, 3, 2, 5, 8), (2, 3, 1, 7, 8), (2, 3, 2), id="GQA"),
    pytest.param((2, 4, 5, 8), (2, 1, 7, 8), (2, 4), id="MQA"),
    pytest.param((2, 4, 5, 8), (7, 8), (2, 4), id="MQA-rank-2-kv"),
    pytest.param((1, 5, 8), (3, 7, 8), (3,), id="q-broadcast"),
    pytest.param((4, 1, 8), (4, 1, 8), (4,), id="Nq=Nk=1"),
])
def test_valid_shapes_return_documented_shapes_and_dtypes(q_shape, kv_shape, batch, causal, dtype):
    q, k, v = random_array(q_shape, dtype), random_array(kv_shape, dtype), random_array(kv_shape, dtype)
    outputs, gradients = run_forward_and_backward(q, k, v, causal=causal)
    assert_forward_outputs(outputs, batch, q_shape[-2], q_shape[-1], dtype)
    assert_gradients(gradients, q, k, v)


def test_empty_queries_give_empty_outputs():
    q, k, v = random_array((2, 3, 0, 8)), random_array((2, 3, 7, 8)), random_array((2, 3, 7, 8))
    o, m, l = flash_attention_forward(q, k, v)
    assert (o.shape, m.shape, l.shape) == ((2, 3, 0, 8), (2, 3, 0), (2, 3, 0))
    dq, dk, dv = flash_attention_backward(np.zeros_like(o), q, k, v, o, m, l)
    assert dq.shape == (2, 3, 0, 8)
    np.testing.assert_array_equal(dk, 0)  # no query, so no gradient reaches k or v
    np.testing.assert_array_equal(dv, 0)


@pytest.mark.parametrize("softmax_scale", [
    pytest.param(2, id="int"),
    pytest.param(np.int64(3), id="numpy-int64"),
    pytest.param(np.float32(0.5), id="numpy-float32"),
    pytest.param(np.float64(0.25), id="numpy-float64"),
    pytest.param(np.float16(0.125), id="numpy-float16"),
    pytest.param(0, id="zero"),
    pytest.param(-1.5, id="negative"),
])
@pytest.mark.parametrize("causal", [False, True, np.bool_(True)], ids=repr)
def test_numeric_softmax_scale_means_its_float_value(softmax_scale, causal):
    q, k, v = random_array(Q_SHAPE), random_array(KV_SHAPE), random_array(KV_SHAPE)
    outputs, gradients = run_forward_and_backward(q, k, v, causal=causal, softmax_scale=softmax_scale)
    assert_forward_outputs(outputs, Q_SHAPE[:-2], Q_SHAPE[-2], Q_SHAPE[-1], FLOAT32)
    assert_gradients(gradients, q, k, v)
    as_float = flash_attention_forward(q, k, v, causal=bool(causal), softmax_scale=float(softmax_scale))
    for name, x, y in zip("oml", outputs, as_float):
        np.testing.assert_array_equal(x, y, err_msg=name)


def test_default_softmax_scale_is_inverse_sqrt_head_dim():
    q, k, v = random_array(Q_SHAPE), random_array(KV_SHAPE), random_array(KV_SHAPE)
    default = flash_attention_forward(q, k, v)
    explicit = flash_attention_forward(q, k, v, softmax_scale=1 / math.sqrt(Q_SHAPE[-1]))
    for name, x, y in zip("oml", default, explicit):
        np.testing.assert_array_equal(x, y, err_msg=name)


def _bnhd_view(b, h, n, d, dtype):
    """(B, H, N, D) view of a (B, N, H, D) array, the layout most models keep."""
    return random_array((b, n, h, d), dtype).swapaxes(1, 2)


def _every_other_row(b, h, n, d, dtype):
    return random_array((b, h, 2 * n, d), dtype)[..., ::2, :]


def _reversed_rows(b, h, n, d, dtype):
    return random_array((b, h, n, d), dtype)[..., ::-1, :]


def _every_other_column(b, h, n, d, dtype):
    return random_array((b, h, n, 2 * d), dtype)[..., ::2]


def _fortran_order(b, h, n, d, dtype):
    return np.asfortranarray(random_array((b, h, n, d), dtype))


def _broadcast_heads(b, h, n, d, dtype):
    """Zero stride along H: one head repeated, as np.broadcast_to gives it (read-only)."""
    return np.broadcast_to(random_array((b, 1, n, d), dtype), (b, h, n, d))


def _contiguous(b, h, n, d, dtype):
    return random_array((b, h, n, d), dtype)


# id -> (view of q, view of k and v)
STRIDED_LAYOUTS = {
    "swapaxes-BNHD": (_bnhd_view, _bnhd_view),
    "q-rows-sliced": (_every_other_row, _contiguous),
    "kv-rows-sliced": (_contiguous, _every_other_row),
    "reversed-rows": (_reversed_rows, _reversed_rows),
    "columns-sliced": (_every_other_column, _every_other_column),
    "fortran-order": (_fortran_order, _fortran_order),
    "broadcast-to-kv": (_contiguous, _broadcast_heads),
}


@pytest.mark.parametrize("layout", STRIDED_LAYOUTS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_strided_views_compute_what_their_contiguous_copies_do(layout, dtype):
    b, h, n_q, n_k, d = 2, 3, 5, 7, 8
    q_view, kv_view = STRIDED_LAYOUTS[layout]
    q, k, v = q_view(b, h, n_q, d, dtype), kv_view(b, h, n_k, d, dtype), kv_view(b, h, n_k, d, dtype)
    outputs, gradients = run_forward_and_backward(q, k, v, causal=True)
    assert_forward_outputs(outputs, (b, h), n_q, d, dtype)
    assert_gradients(gradients, q, k, v)

    copies = [np.ascontiguousarray(x) for x in (q, k, v)]
    for name, x, y in zip("oml", outputs, flash_attention_forward(*copies, causal=True)):
        np.testing.assert_array_equal(x, y, err_msg=name)


# ---------------------------------------------------------------------------
# Inputs are never modified
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("q_shape", "kv_shape"), [
    pytest.param(Q_SHAPE, KV_SHAPE, id="MHA"),
    pytest.param((2, 3, 2, 5, 8), (2, 3, 1, 7, 8), id="GQA"),
    pytest.param((1, 6, 8), (3, 4, 8), id="q-broadcast"),
])
def test_inputs_are_never_modified(q_shape, kv_shape, causal, dtype):
    q, k, v = random_array(q_shape, dtype), random_array(kv_shape, dtype), random_array(kv_shape, dtype)
    forward_inputs = {"q": q, "k": k, "v": v}
    before = {name: x.copy() for name, x in forward_inputs.items()}
    o, m, l = flash_attention_forward(q, k, v, causal=causal)
    flash_attention(q, k, v, causal=causal)

    do = random_array(o.shape, dtype)
    backward_inputs = {"do": do, "q": q, "k": k, "v": v, "o": o, "m": m, "l": l}
    before.update({name: x.copy() for name, x in backward_inputs.items() if name not in before})
    flash_attention_backward(*backward_inputs.values(), causal=causal)

    for name, x in backward_inputs.items():
        assert x.tobytes() == before[name].tobytes(), f"{name} was modified"


# ---------------------------------------------------------------------------
# Arbitrary calls: documented outputs, or ValueError / TypeError
# ---------------------------------------------------------------------------

@settings(max_examples=100, deadline=None)
@given(call=forward_calls())
def test_any_forward_call_succeeds_as_documented_or_raises_value_or_type_error(call):
    q, k, v, causal, softmax_scale = call
    allowed = forward_contract_errors(*call)
    if allowed:
        with pytest.raises(tuple(allowed)):
            flash_attention_forward(q, k, v, causal=causal, softmax_scale=softmax_scale)
        return
    outputs, gradients = run_forward_and_backward(q, k, v, causal=causal, softmax_scale=softmax_scale)
    batch = np.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    assert_forward_outputs(outputs, batch, q.shape[-2], q.shape[-1], q.dtype)
    assert_gradients(gradients, q, k, v)
    # strided views compute what their contiguous copies do, to a rounding of the scores: BLAS may sum
    # them in another order, and a score's rounding grows with its size (scale 2 at D 256: hundreds)
    same = flash_attention_forward(*(np.ascontiguousarray(x) for x in (q, k, v)), causal=causal,
                                   softmax_scale=softmax_scale)
    scale = 1 / np.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    tolerance = VIEW_RTOL[q.dtype] * max(1.0, largest_logit(q, k, causal, scale))
    for got, want in zip(outputs, same):
        np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=tolerance, atol=tolerance)


@settings(max_examples=100, deadline=None)
@given(call=backward_calls())
def test_any_backward_call_succeeds_as_documented_or_raises_the_documented_error(call):
    arguments, error = call
    if error is not None:
        with pytest.raises(error):
            flash_attention_backward(*arguments.values())
        return
    gradients = flash_attention_backward(*arguments.values())
    assert_gradients(gradients, arguments["q"], arguments["k"], arguments["v"])


# ---------------------------------------------------------------------------
# out= buffers: the results land in them, and bad ones are refused before anything runs
# ---------------------------------------------------------------------------

def nan_buffers(shapes_dtypes):
    return tuple(np.full(shape, np.nan, dtype) for shape, dtype in shapes_dtypes)


def forward_buffers(dtype):
    stats = statistics_dtype(dtype)
    return nan_buffers(((OUT_SHAPE, dtype), (STATS_SHAPE, stats), (STATS_SHAPE, stats)))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("q_shape", "kv_shape"), [(Q_SHAPE, KV_SHAPE), ((2, 3, 5, 8), (2, 1, 7, 8)),
                                                   ((2, 3, 0, 8), (2, 3, 7, 8)), ((2, 3, 5, 8), (2, 3, 0, 8))],
                         ids=["MHA", "GQA", "Nq=0", "Nk=0"])
def test_out_buffers_receive_the_results_and_are_returned(dtype, causal, q_shape, kv_shape):
    q, k, v = random_array(q_shape, dtype), random_array(kv_shape, dtype), random_array(kv_shape, dtype)
    expected = flash_attention_forward(q, k, v, causal=causal)
    stats = statistics_dtype(dtype)
    out = nan_buffers(((expected[0].shape, dtype), (expected[1].shape, stats), (expected[2].shape, stats)))
    got = flash_attention_forward(q, k, v, causal=causal, out=out)
    assert all(g is b for g, b in zip(got, out))
    for g, e in zip(got, expected):
        np.testing.assert_array_equal(g, e)
    do = random_array(expected[0].shape, dtype)
    grads = flash_attention_backward(do, q, k, v, *expected, causal=causal)
    out = nan_buffers((x.shape, dtype) for x in (q, k, v))
    got = flash_attention_backward(do, q, k, v, *expected, causal=causal, out=out)
    assert all(g is b for g, b in zip(got, out))
    for g, e in zip(got, grads):
        np.testing.assert_array_equal(g, e)


@pytest.mark.parametrize("kw", [{"sink": 0.5}, {"sink": np.float32(0.5)}, {"alibi_slopes": [0.1, 0.2, 0.3]}],
                         ids=["float sink", "numpy scalar sink", "list of slopes"])
def test_out_buffers_beside_a_sink_or_slopes_that_are_not_arrays(kw):
    """A number or a list (converted by the call) shares no memory with an out buffer."""
    q, k, v = random_array(Q_SHAPE), random_array(KV_SHAPE), random_array(KV_SHAPE)
    o, m, l = flash_attention_forward(q, k, v, **kw)
    out = nan_buffers((x.shape, FLOAT32) for x in (q, k, v))
    got = flash_attention_backward(o, q, k, v, o, m, l, out=out, **kw)
    assert all(g is b for g, b in zip(got, out))
    for g, e in zip(got, flash_attention_backward(o, q, k, v, o, m, l, **kw)):
        np.testing.assert_array_equal(g, e)


def _bad_forward_out(fault, q):
    o, m, l = forward_buffers(FLOAT32)
    if fault == "not a tuple":
        return o, TypeError, ["out"]
    if fault == "two arrays":
        return (o, m), TypeError, ["out"]
    if fault == "a list inside":
        return (o, m.tolist(), l), TypeError, ["out", "m"]
    if fault == "dtype":
        return (o, m.astype(np.float64), l), TypeError, ["out", "m"]
    if fault == "shape":
        return (o[:, :, :-1], m, l), ValueError, ["out", "o"]
    if fault == "layout":
        return (np.ones(OUT_SHAPE[::-1], FLOAT32).T, m, l), ValueError, ["out", "o"]
    if fault == "read-only":
        o.flags.writeable = False
        return (o, m, l), ValueError, ["out", "o"]
    if fault == "input":
        return (q, m, l), ValueError, ["out", "o", "q"]
    return (o, m, m), ValueError, ["out", "m", "l"]   # two outputs in one buffer


@pytest.mark.usefixtures("computation_forbidden")
@pytest.mark.parametrize("fault", ["not a tuple", "two arrays", "a list inside", "dtype", "shape", "layout",
                                   "read-only", "input", "shared"])
def test_bad_forward_out_raises_before_anything_runs(fault):
    q, k, v = random_array(Q_SHAPE), random_array(KV_SHAPE), random_array(KV_SHAPE)
    out, error, names = _bad_forward_out(fault, q)
    with pytest.raises(error, match=message_naming(names)):
        flash_attention_forward(q, k, v, out=out)


@pytest.mark.usefixtures("computation_forbidden")
@pytest.mark.parametrize("fault", ["dtype", "shape", "an input", "shared"])
def test_bad_backward_out_raises_before_anything_runs(fault):
    do, q, k, v, o, m, l = valid_backward_arguments()
    dq, dk, dv = nan_buffers((x.shape, FLOAT32) for x in (q, k, v))
    out, error, names = {"dtype": ((dq, dk.astype(np.float16), dv), TypeError, ["out", "dk"]),
                         "shape": ((dq, dk, dv[..., :-1]), ValueError, ["out", "dv"]),
                         "an input": ((do, dk, dv), ValueError, ["out", "dq", "do"]),
                         "shared": ((dq, dk, dk), ValueError, ["out", "dk", "dv"])}[fault]
    with pytest.raises(error, match=message_naming(names)):
        flash_attention_backward(do, q, k, v, o, m, l, out=out)


@pytest.mark.parametrize("keyword, value, error", [
    ("schedule", "v3", ValueError), ("schedule", "V2", ValueError), ("schedule", 2, TypeError),
    ("schedule", None, TypeError), ("precision", "high", ValueError), ("precision", "TF32", ValueError),
    ("precision", "fp32", ValueError), ("precision", 1, TypeError), ("precision", None, TypeError)])
def test_a_bad_choice_keyword_raises_naming_it(keyword, value, error):
    q = np.zeros((4, 8), np.float32)
    match = f"{keyword} must be one of"
    with pytest.raises(error, match=match):
        cupyflash.flash_attention_forward(q, q, q, **{keyword: value})
    o, m, l = cupyflash.flash_attention_forward(q, q, q)
    with pytest.raises(error, match=match):
        cupyflash.flash_attention_backward(o, q, q, q, o, m, l, **{keyword: value})
    with pytest.raises(error, match=match):
        cupyflash.flash_attention(q, q, q, **{keyword: value})


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_the_numpy_path_takes_every_precision_and_computes_the_same(dtype):
    """The CPU path multiplies at its dtype's own precision whatever ``precision`` says."""
    rng = np.random.default_rng(4)
    q, k, v = (rng.standard_normal((2, 20, 8)).astype(dtype) for _ in range(3))
    results = [cupyflash.flash_attention_forward(q, k, v, causal=True, precision=p) for p in ("highest", "tf32")]
    grads = [cupyflash.flash_attention_backward(q, q, k, v, *results[0], causal=True, precision=p)
             for p in ("highest", "tf32")]
    for a, b in zip(results[0] + grads[0], results[1] + grads[1]):
        assert a.tobytes() == b.tobytes()


@pytest.mark.parametrize("deterministic", [0, 1, None, "yes", 1.0])
def test_non_bool_deterministic_raises_type_error(deterministic):
    q = np.zeros((4, 8), np.float32)
    o, m, l = cupyflash.flash_attention_forward(q, q, q)
    with pytest.raises(TypeError, match="deterministic"):
        cupyflash.flash_attention_backward(o, q, q, q, o, m, l, deterministic=deterministic)


def test_deterministic_backward_on_the_numpy_path_is_the_same_backward():
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal(s).astype(np.float32) for s in ((2, 30, 16), (1, 40, 16), (1, 40, 16)))
    o, m, l = cupyflash.flash_attention_forward(q, k, v, causal=True)
    plain = cupyflash.flash_attention_backward(o, q, k, v, o, m, l, causal=True)
    ordered = cupyflash.flash_attention_backward(o, q, k, v, o, m, l, causal=True, deterministic=np.bool_(True))
    for a, b in zip(plain, ordered):
        assert a.tobytes() == b.tobytes()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", ["q", "k", "v", "do"])
@pytest.mark.parametrize("layout", ["own", "kv_shared", "q_shared"])
def test_non_finite_inputs_on_the_numpy_path_follow_the_gpu_rules(dtype, causal, case, layout):
    """The NumPy path keeps the non-finite rules (docs/semantics.md) as the kernels do (test_reliability.py): o, m, l
    and the gradients non-finite exactly where the mask-exact reference's are, with k, v or q shared
    between heads too, and rows that see no key empty (o = 0, m = -inf, l = 0, dq = 0)."""
    assert_non_finite_rules(dtype, causal, case, layout=layout)


def test_the_extent_of_a_cupy_array_is_its_numpy_twins():
    """``_checks._extent`` (what ``check_disjoint`` compares on every call with ``out=``) takes a
    C-contiguous CuPy array's bytes from its address and size: the same as the stride walk of a NumPy
    array over the same memory, for contiguous, strided, reversed, transposed, empty and one-element
    views. The CuPy arrays lie over host memory (no GPU is touched to make them)."""
    cupy = pytest.importorskip("cupy")
    from numpy.lib.stride_tricks import as_strided

    from cupyflash import _checks

    host = np.zeros(8192, np.uint8)
    memory = cupy.cuda.UnownedMemory(host.ctypes.data, host.nbytes, host, 0)
    whole = cupy.ndarray((host.nbytes,), np.uint8, cupy.cuda.MemoryPointer(memory, 0))
    x = whole[64:64 + 960].view(np.float32).reshape(4, 6, 10)
    for view in (x, x[1:3], x[:, ::2], x[::-1], x.transpose(2, 0, 1), x[:0], x[2:3, 4:5, 7:8], x[:, :, 3]):
        offset = view.data.ptr - host.ctypes.data
        twin = as_strided(host[offset:].view(np.float32), view.shape, view.strides) if view.size else \
            np.empty(view.shape, np.float32)
        want = (0, 0) if not view.size else tuple(a - twin.ctypes.data + view.data.ptr for a in _checks._extent(twin))
        assert _checks._extent(view, cupy.ndarray) == want, (view.shape, view.strides)


def test_fresh_out_arrays_are_written_as_any_out_tuple():
    """``api.FreshOut`` (out= arrays cupyflash.torch and cupyflash.jax have just allocated) is an out tuple
    like any other: validated where a call makes its plan, written in place, the same results."""
    from cupyflash import api

    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((2, 3, 9, 16)).astype(np.float32) for _ in range(3))
    expected = cupyflash.flash_attention_forward(q, k, v, causal=True)
    out = api.FreshOut(np.empty_like(x) for x in expected)
    result = cupyflash.flash_attention_forward(q, k, v, causal=True, out=out)
    for got, x, want in zip(result, out, expected):
        assert got is x
        np.testing.assert_array_equal(x, want)
    with pytest.raises(ValueError, match="shape"):
        cupyflash.flash_attention_forward(q, k, v, out=api.FreshOut((out[0][:1], out[1], out[2])))
