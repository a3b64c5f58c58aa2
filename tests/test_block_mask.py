"""cupyflash.block_mask: a mask_mod's tile maps made once and kept (cupyflash/blockmask.py).

On the CPU: the NumPy path gives with a block mask what it gives with its mask_mod, the refusals name
what is wrong, and the rule by which a call finds its map (``_launch.TileMapPlan.locate``). On the GPU:
the kernels read the kept maps and still equal the reference, each kernel's map written once."""

import numpy
import pytest

import cupyflash
from cupyflash import _launch, reference
from helpers import gpu_test, random_inputs
from test_window import assert_float64_close

DOCUMENTS = numpy.repeat(numpy.arange(4), [30, 7, 50, 13]).astype(numpy.int32)   # 100 positions
DOC_MASK = "doc[q_idx] == doc[kv_idx] && kv_idx <= q_idx"


def inputs(xp=numpy, dtype="float64", batch=(2, 3), n=100, D=16, seed=0):
    rng = numpy.random.default_rng(seed)
    q, k, v = random_inputs(rng, dtype, (*batch, n, D), (*batch, n, D))
    do = rng.standard_normal(q.shape).astype(q.dtype)
    return tuple(xp.asarray(x) for x in (q, k, v, do))


def test_the_numpy_path_gives_the_mask_mods_result():
    q, k, v, do = inputs()
    args = {"doc": DOCUMENTS}
    mask = cupyflash.block_mask(DOC_MASK, (2, 3), 100, 100, mod_args=args)
    with_mask = cupyflash.flash_attention_forward(q, k, v, block_mask=mask)
    plain = cupyflash.flash_attention_forward(q, k, v, mask_mod=DOC_MASK, mod_args=args)
    for x, y in zip(with_mask, plain):
        numpy.testing.assert_array_equal(x, y)
    grads = with_mask.backward(do)   # the forward's block mask, passed on
    plain_grads = cupyflash.flash_attention_backward(do, q, k, v, *plain, mask_mod=DOC_MASK, mod_args=args)
    for x, y in zip(grads, plain_grads):
        numpy.testing.assert_array_equal(x, y)
    want = reference.attention_forward(q, k, v, mask_mod=DOC_MASK, mod_args=args)
    for name, got, ref in zip("oml", with_mask, want):
        assert_float64_close(name, got, ref)
    # the same expression and dict given beside it is allowed
    again = cupyflash.flash_attention(q, k, v, block_mask=mask, mask_mod=DOC_MASK, mod_args=args)
    numpy.testing.assert_array_equal(again, with_mask[0])


@pytest.mark.parametrize("make, error, words", [
    (lambda: cupyflash.block_mask(3, (2,), 4, 4), TypeError, "mask_mod must be a str"),
    (lambda: cupyflash.block_mask("kv_idx <= q_idx", [2], 4, 4), ValueError, "batch_shape must be a tuple"),
    (lambda: cupyflash.block_mask("kv_idx <= q_idx", (2,), -1, 4), ValueError, "Nq must be an int >= 0"),
    (lambda: cupyflash.block_mask("kv_idx <= q_idx", (2,), 4, 2.0), ValueError, "Nk must be an int >= 0"),
    (lambda: cupyflash.block_mask("kv_idx <= nope", (2,), 4, 4), ValueError, "nope"),
])
def test_a_bad_block_mask_is_refused_naming_what_is_wrong(make, error, words):
    with pytest.raises(error, match=words):
        make()


@pytest.mark.parametrize("call_kw, error, words", [
    (dict(block_mask="kv_idx <= q_idx"), TypeError, "block_mask must be a cupyflash.BlockMask"),
    (dict(mask_mod="kv_idx < q_idx"), ValueError, "differs from the block_mask's"),
    (dict(mod_args={"doc": DOCUMENTS}), ValueError, "not the block_mask's own dict"),
])
def test_a_call_that_contradicts_its_block_mask_is_refused(call_kw, error, words):
    q, k, v, do = inputs()
    kw = {"block_mask": cupyflash.block_mask(DOC_MASK, (2, 3), 100, 100, mod_args={"doc": DOCUMENTS}), **call_kw}
    for call in (lambda: cupyflash.flash_attention_forward(q, k, v, **kw),
                 lambda: cupyflash.flash_attention_backward(do, q, k, v, q, q[..., 0], q[..., 0], **kw)):
        with pytest.raises(error, match=words):
            call()


def test_a_call_of_other_shapes_is_refused_naming_them():
    q, k, v, _ = inputs()
    mask = cupyflash.block_mask(DOC_MASK, (2, 3), 100, 90, mod_args={"doc": DOCUMENTS})
    with pytest.raises(ValueError, match=r"serves batch_shape \(2, 3\), Nq 100, Nk 90; the call has q \(2, 3, 100,"):
        cupyflash.flash_attention_forward(q, k, v, block_mask=mask)


def test_packed_sequences_take_no_block_mask():
    q, k, v, _ = inputs(batch=(3,))
    offsets = numpy.array([0, 40, 100], numpy.int32)
    with pytest.raises(TypeError, match="block_mask"):
        cupyflash.flash_attention_varlen_forward(q, k, v, offsets, offsets,
                                                 block_mask=cupyflash.block_mask("kv_idx <= q_idx", (3,), 100, 100))


class _Memory:
    """A stand-in for a CuPy array or pool block: an address."""

    def __init__(self, ptr):
        self.ptr = ptr
        self.data = self


@pytest.fixture
def locate_here(monkeypatch):
    """TileMapPlan.locate with its allocations made here: (kept maps by cupy.empty, a call's by alloc)."""
    import cupy

    made = []
    monkeypatch.setattr(cupy, "empty", lambda n, dtype: made.append(("kept", n)) or _Memory(1000 + len(made)))
    monkeypatch.setattr(_launch, "KEPT_MAPS", {})

    def alloc(n):   # CuPy's pool, as call_stream gives it outside a capture
        made.append(("call", n))
        return _Memory(len(made))

    def capturing_alloc(n):   # call_stream's stream-ordered allocator during a capture
        return alloc(n)

    monkeypatch.setattr(cupy.cuda, "alloc", alloc)
    return made, alloc, capturing_alloc


@pytest.mark.parametrize("shared", [True, False])
def test_where_a_call_finds_its_map(locate_here, shared):
    """Kept where every like call may share it (in KEPT_MAPS) or where the call passes a block mask (in its
    store), per stream; written at every call otherwise, and under graph capture (which reads only a
    block mask's kept map)."""
    made, alloc, capturing_alloc = locate_here
    plan = _launch.TileMapPlan(64, (), ("key",), shared)
    first, second = plan.locate(alloc, 7), plan.locate(alloc, 7)
    assert first[2] and not second[2] if shared else first[2] and second[2]
    assert (first[0] == second[0]) == shared
    assert plan.locate(alloc, 8)[2]   # another stream writes its own
    store = {}
    token = _launch.BLOCK_MAPS.set(store)
    try:
        written, read = plan.locate(alloc, 7), plan.locate(alloc, 7)
        assert written[2] and not read[2] and written[0] == read[0] and list(store) == [(("key",), 7)]
        assert plan.locate(capturing_alloc, 7) == read   # the block mask's, also under capture
        captured = plan.locate(capturing_alloc, 9)       # none kept for this stream: the graph's own, not kept
        assert captured[2] and list(store) == [(("key",), 7)]
    finally:
        _launch.BLOCK_MAPS.reset(token)
    assert plan.locate(capturing_alloc, 7)[2]            # under capture without a block mask: never a kept map
    packed = _launch.TileMapPlan(64, (), None, shared)   # offsets come with the call: never kept
    assert packed.locate(alloc, 7)[2] and packed.locate(alloc, 7)[2]


# ---------------------------------------------------------------------------
# GPU


@gpu_test
@pytest.mark.parametrize("schedule", ["v2", "v1"])
@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_the_kernels_read_the_kept_maps_and_equal_the_mask_mods_result(schedule, dtype):
    """A document mask over a NumPy array (copied to the GPU once): forward and backward with the block
    mask equal the same calls with its mask_mod bit for bit, each kernel's map is written once per
    stream and read by the later calls, and the result is the reference's."""
    import cupy

    q, k, v, do = inputs(cupy, dtype, n=100, D=64)
    args = {"doc": DOCUMENTS}
    mask = cupyflash.block_mask(DOC_MASK, (2, 3), 100, 100, mod_args=args)
    plain = cupyflash.flash_attention_forward(q, k, v, mask_mod=DOC_MASK, mod_args=args, schedule=schedule)
    plain_grads = cupyflash.flash_attention_backward(do, q, k, v, *plain, mask_mod=DOC_MASK, mod_args=args,
                                                     schedule=schedule, deterministic=True)
    for _ in range(2):
        out = cupyflash.flash_attention_forward(q, k, v, block_mask=mask, schedule=schedule)
        grads = out.backward(do, deterministic=True)
        for x, y in zip((*out, *grads), (*plain, *plain_grads)):
            numpy.testing.assert_array_equal(x.get(), y.get())
        assert len(mask._maps) == 2   # the forward's and the backward's map, on this stream
    want = reference.attention_forward(*(x.get() for x in (q, k, v)), mask_mod=DOC_MASK, mod_args=args)
    numpy.testing.assert_allclose(out[0].get().astype(numpy.float64), want[0], rtol=2e-2, atol=2e-2)
