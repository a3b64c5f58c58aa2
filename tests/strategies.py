"""Every hypothesis strategy of the test suite, each named by what it draws.

Problem sizes for the kernels' accuracy tests (``attention_problem_shapes`` and its parts), and
arbitrary calls, valid or faulty, for the contract tests (``forward_calls``, ``backward_calls``,
``gpu_forward_calls``).
"""

import dataclasses
import math

import numpy as np
from hypothesis import strategies as st

from cupyflash import flash_attention_forward
from helpers import FLOAT_DTYPES, MAX_HEAD_DIM, UNSUPPORTED_DTYPES, random_array

# ---------------------------------------------------------------------------
# Problem sizes

# Lengths at and one past tile edges, and long ragged ones
RAGGED_LENGTHS = (1, 2, 17, 64, 113, 128, 255, 1023)
# Head dims at bucket edges (32, 64, 96, 128, 192, 256), inside buckets and off the multiples of 16
HEAD_DIMS = (1, 8, 16, 40, 64, 72, 96, 128, 160, 200, 256)
# (q batch, k/v batch): plain, multi-head, MQA, GQA, broadcast q
BATCH_PATTERNS = (((), ()), ((3,), (3,)), ((2, 3), (2, 3)), ((2, 4), (2, 1)), ((2, 2, 3), (2, 2, 1)),
                  ((3,), (1,)), ((1,), (2,)))
# A relative error over a handful of rows is one rounding, not a distribution: problems with
# fewer query rows are stacked until they have this many
MIN_ROWS = 256
DTYPE_NAMES = tuple(sorted(dt.name for dt in FLOAT_DTYPES))


def dtype_names():
    """The name of one of the four float dtypes."""
    return st.sampled_from(DTYPE_NAMES)


def sequence_lengths(max_length=300, ragged=RAGGED_LENGTHS):
    """A length in 1..max_length, or one of ``ragged`` (which may exceed max_length)."""
    return st.one_of(st.sampled_from(ragged), st.integers(1, max_length))


def head_dims(listed=HEAD_DIMS, max_head_dim=MAX_HEAD_DIM):
    """One of ``listed``, or any head dim in 1..max_head_dim (``None``: only ``listed``)."""
    if max_head_dim is None:
        return st.sampled_from(listed)
    return st.one_of(st.sampled_from(listed), st.integers(1, max_head_dim))


def softmax_scales():
    """None (the default 1/sqrt(D)) or an explicit scale in [0.01, 2]."""
    return st.one_of(st.none(), st.floats(0.01, 2.0))


@st.composite
def attention_problem_shapes(draw):
    """(dtype name, q shape, k/v shape, causal, softmax_scale), with N·N·batch of at most 400000 (else
    both lengths are cut to 300) and at least MIN_ROWS query rows (independent problems stacked)."""
    dtype = draw(dtype_names())
    Nq, Nk, D = draw(sequence_lengths()), draw(sequence_lengths()), draw(head_dims())
    q_batch, kv_batch = draw(st.sampled_from(BATCH_PATTERNS))
    if math.prod(q_batch) * Nq * Nk > 400_000:
        Nq, Nk = min(Nq, 300), min(Nk, 300)
    stack = -(-MIN_ROWS // (math.prod(q_batch) * Nq))
    if stack > 1:
        q_batch, kv_batch = (stack, *q_batch), (stack, *kv_batch)
    causal = draw(st.booleans())
    scale = draw(softmax_scales())
    return dtype, (*q_batch, Nq, D), (*kv_batch, Nk, D), causal, scale


# ---------------------------------------------------------------------------
# Arbitrary calls: valid, or with faults the contract names


@st.composite
def broadcastable_batch_dims(draw, batch):
    """Batch dims that broadcast to ``batch``: ``batch`` itself, some dims set to 1, or leading dims dropped."""
    kind = draw(st.sampled_from(["same", "stretched", "shorter"]))
    if kind == "same":
        return tuple(batch)
    if kind == "stretched":
        return tuple(1 if draw(st.booleans()) else n for n in batch)
    return tuple(batch[draw(st.integers(0, len(batch))):])


VIEWS = ("contiguous", "contiguous", "batch axes swapped", "reversed", "column slice", "every other column")


def strided_copy(x, view):
    """``x``'s values in a view of another layout: batch axes swapped, rows reversed (a negative
    stride), a slice of wider rows, or every other column of a twice-as-wide array."""
    if view == "contiguous" or x.ndim < 2 or (view == "batch axes swapped" and x.ndim < 4):
        return x
    if view == "batch axes swapped":
        return np.ascontiguousarray(x.swapaxes(0, 1)).swapaxes(0, 1)
    if view == "reversed":
        return x[..., ::-1, :].copy()[..., ::-1, :]
    if view == "column slice":
        wide = np.zeros((*x.shape[:-1], x.shape[-1] + 3), x.dtype)
        wide[..., : x.shape[-1]] = x
        return wide[..., : x.shape[-1]]
    return np.repeat(x, 2, axis=-1)[..., ::2]


FORWARD_FAULTS = ("unsupported dtype", "mixed dtypes", "non-array", "rank below 2", "head dim mismatch",
                  "key count mismatch", "free batch dims", "head dim out of range", "non-bool causal",
                  "non-number scale", "non-finite scale")


@st.composite
def forward_calls(draw):
    """Arguments ``(q, k, v, causal, softmax_scale)`` of a forward call: valid, or with up to two faults.

    A valid call has broadcastable batch dims (MHA, GQA/MQA, rank 2, zero-size),
    Nq, Nk in [0, 4], D in [1, 256], one supported dtype, any layout (``VIEWS``), and a bool ``causal``
    and a finite real (or no) scale; each fault of ``FORWARD_FAULTS`` breaks one
    of these. Whether a call is valid is judged by ``helpers.forward_contract_errors``,
    not by the fault's name (free batch dims may happen to broadcast).
    """
    n_faults = draw(st.sampled_from([0, 0, 0, 1, 1, 1, 2]))
    faults = set(draw(st.lists(st.sampled_from(FORWARD_FAULTS), min_size=n_faults, max_size=n_faults,
                               unique=True)))
    arrays = ("q", "k", "v")

    batch = draw(st.lists(st.integers(0, 3), max_size=3))
    n_q, n_k = draw(st.integers(0, 4)), draw(st.integers(0, 4))
    head_dim = draw(st.sampled_from([1, 2, 3, 8, MAX_HEAD_DIM]))
    if "head dim out of range" in faults:
        head_dim = draw(st.sampled_from([0, MAX_HEAD_DIM + 1]))
    shapes = {"q": [*draw(broadcastable_batch_dims(batch)), n_q, head_dim],
              "k": [*draw(broadcastable_batch_dims(batch)), n_k, head_dim],
              "v": [*draw(broadcastable_batch_dims(batch)), n_k, head_dim]}
    if "head dim mismatch" in faults:
        shapes[draw(st.sampled_from(arrays))][-1] += draw(st.integers(1, 3))
    if "key count mismatch" in faults:
        shapes[draw(st.sampled_from(["k", "v"]))][-2] += draw(st.integers(1, 3))
    if "free batch dims" in faults:
        name = draw(st.sampled_from(arrays))
        shapes[name][:-2] = draw(st.lists(st.integers(0, 3), max_size=3))
    if "rank below 2" in faults:
        name = draw(st.sampled_from(arrays))
        shapes[name] = draw(st.sampled_from([[], shapes[name][-1:]]))

    dtype = draw(st.sampled_from(FLOAT_DTYPES))
    if "unsupported dtype" in faults:
        dtype = draw(st.sampled_from(UNSUPPORTED_DTYPES))
    dtypes = dict.fromkeys(arrays, dtype)
    if "mixed dtypes" in faults:
        dtypes[draw(st.sampled_from(arrays))] = draw(st.sampled_from(FLOAT_DTYPES + UNSUPPORTED_DTYPES))
    values = {name: strided_copy(random_array(tuple(shapes[name]), dtypes[name]), draw(st.sampled_from(VIEWS)))
              for name in arrays}
    if "non-array" in faults:
        name = draw(st.sampled_from(arrays))
        values[name] = values[name].tolist()

    causal = draw(st.sampled_from([False, True, np.bool_(False), np.bool_(True)]))
    if "non-bool causal" in faults:
        causal = draw(st.sampled_from([0, 1, 1.0, None, "yes", np.int8(1)]))
    softmax_scale = draw(st.one_of(st.none(), st.floats(-100, 100), st.integers(-5, 5),
                                   st.sampled_from([np.float32(0.5), np.float16(2), np.int64(3)])))
    if "non-number scale" in faults:
        softmax_scale = draw(st.sampled_from(["0.5", [1.0], True, np.bool_(False), 1j, np.complex128(0.5 + 1j)]))
    if "non-finite scale" in faults:
        softmax_scale = draw(st.sampled_from([math.inf, -math.inf, math.nan, np.float32("inf"), 10**400]))
    return values["q"], values["k"], values["v"], causal, softmax_scale


GPU_VIEWS = ("plain", "offset", "sliced")


@st.composite
def gpu_forward_calls(draw):
    """A ``forward_calls`` draw and, for each of q, k, v, how to put it on the GPU (``GPU_VIEWS``:
    as is, one element off the 16-byte grid, or a column slice of a wider array)."""
    q, k, v, causal, scale = draw(forward_calls())
    views = [draw(st.sampled_from(GPU_VIEWS)) for _ in range(3)]
    return q, k, v, causal, scale, views


@st.composite
def backward_calls(draw):
    """A valid forward problem and its backward arguments, with at most one of do, o, m, l made wrong.

    Returns ``(arguments, error)``: the seven backward arguments and the error the
    contract demands (None when nothing was made wrong).
    """
    dtype = draw(st.sampled_from(FLOAT_DTYPES))
    batch = tuple(draw(st.lists(st.integers(1, 3), max_size=2)))
    kv_batch = tuple(1 if draw(st.booleans()) else n for n in batch)
    n_q, n_k, d = draw(st.integers(0, 4)), draw(st.integers(0, 4)), draw(st.sampled_from([1, 8, 16]))
    q, k, v = (random_array((*batch, n_q, d), dtype), random_array((*kv_batch, n_k, d), dtype),
               random_array((*kv_batch, n_k, d), dtype))
    o, m, l = flash_attention_forward(q, k, v)
    arguments = {"do": random_array(o.shape, dtype), "q": q, "k": k, "v": v, "o": o, "m": m, "l": l}

    fault = draw(st.sampled_from([None, None, "shape", "dtype", "non-array"]))
    if fault is None:
        return arguments, None
    name = draw(st.sampled_from(["do", "o", "m", "l"]))
    x = arguments[name]
    if fault == "shape":
        if x.ndim and draw(st.booleans()):
            axis = draw(st.integers(0, x.ndim - 1))
            bad_shape = tuple(n + 1 if a == axis else n for a, n in enumerate(x.shape))
        else:
            bad_shape = (*x.shape, 1)
        arguments[name] = random_array(bad_shape, x.dtype)
        return arguments, ValueError
    if fault == "dtype":
        other = [dt for dt in FLOAT_DTYPES + UNSUPPORTED_DTYPES[:3] if dt != x.dtype]
        arguments[name] = random_array(x.shape, draw(st.sampled_from(other)))
        return arguments, TypeError
    arguments[name] = x.tolist()
    return arguments, TypeError


# ---------------------------------------------------------------------------
# The CPU references' problems (tests/test_reference.py): inputs with tile sizes for the blocked
# loops, small enough for them in Python

REFERENCE_LENGTHS = (1, 17, 64, 113, 128, 130)
REFERENCE_HEAD_DIMS = (1, 8, 40, 64, 72, 96)
BLOCK_SIZES = (1, 3, 16, 64, 128)
MAX_TILE_STEPS = 200  # T_r * T_c cap: keeps one blocked call (a Python loop) fast


@st.composite
def batch_shapes(draw):
    """Batch shapes (q_batch, k_batch, v_batch) that broadcast: rank 2, MHA, GQA, MQA, or free."""
    pattern = draw(st.sampled_from(["rank2", "mha", "gqa", "mqa", "free"]))
    small = st.integers(1, 3)
    if pattern == "rank2":
        return (), (), ()
    if pattern == "mha":
        batch = (draw(small), draw(small))
        return batch, batch, batch
    if pattern == "gqa":
        b, h_kv, group = draw(st.integers(1, 2)), draw(small), draw(st.integers(2, 3))
        return (b, h_kv, group), (b, h_kv, 1), (b, h_kv, 1)
    if pattern == "mqa":
        b, h = draw(st.integers(1, 2)), draw(st.integers(2, 4))
        kv = draw(st.sampled_from([(b, 1), (1,), ()]))
        return (b, h), kv, kv
    full = tuple(draw(st.lists(small, min_size=1, max_size=3)))

    def derived():
        dropped = draw(st.integers(0, len(full)))
        return tuple(1 if draw(st.booleans()) else n for n in full[dropped:])

    return derived(), derived(), derived()


@st.composite
def tile_sizes(draw, n_q, n_k):
    """(B_r, B_c) from BLOCK_SIZES with at most MAX_TILE_STEPS tile steps."""
    def steps(n, block):
        return -(-n // block)

    B_r = draw(st.sampled_from([b for b in BLOCK_SIZES if steps(n_q, b) <= MAX_TILE_STEPS // 3]))
    B_c = draw(st.sampled_from([b for b in BLOCK_SIZES if steps(n_q, B_r) * steps(n_k, b) <= MAX_TILE_STEPS]))
    return B_r, B_c


@dataclasses.dataclass
class AttentionProblem:
    """Inputs of one attention call, with the tile sizes for the blocked versions."""

    q: np.ndarray   # (*q_batch, Nq, D)
    k: np.ndarray   # (*k_batch, Nk, D)
    v: np.ndarray   # (*v_batch, Nk, D)
    do: np.ndarray  # (*batch, Nq, D)
    causal: bool
    softmax_scale: object
    block_r: int
    block_c: int

    @property
    def options(self):
        return {"causal": self.causal, "softmax_scale": self.softmax_scale}

    @property
    def tiles(self):
        return {"block_r": self.block_r, "block_c": self.block_c}

    @property
    def scale(self):
        return 1 / np.sqrt(self.q.shape[-1]) if self.softmax_scale is None else self.softmax_scale


@st.composite
def attention_problems(draw, dtypes=FLOAT_DTYPES, lengths=sequence_lengths(130, REFERENCE_LENGTHS),
                       dims=head_dims(REFERENCE_HEAD_DIMS, None),
                       scales=softmax_scales(), causal=st.booleans(), gain=1.0, extra_queries=None):
    """Random q, k, v, dO (standard normal times ``gain``, rounded to the drawn dtype).

    With ``extra_queries``, Nq = Nk + a drawn count, so that under ``causal``
    that many leading query rows see no key.
    """
    dtype = draw(st.sampled_from(dtypes))
    q_batch, k_batch, v_batch = draw(batch_shapes())
    n_q, n_k, d = draw(lengths), draw(lengths), draw(dims)
    if extra_queries is not None:
        n_q = n_k + draw(extra_queries)
    block_r, block_c = draw(tile_sizes(n_q, n_k))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    batch = np.broadcast_shapes(q_batch, k_batch, v_batch)
    q, k, v, do = (gain * rng.standard_normal(shape) for shape in
                   ((*q_batch, n_q, d), (*k_batch, n_k, d), (*v_batch, n_k, d), (*batch, n_q, d)))
    return AttentionProblem(q.astype(dtype), k.astype(dtype), v.astype(dtype), do.astype(dtype),
                            draw(causal), draw(scales), block_r, block_c)
