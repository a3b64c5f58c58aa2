"""cupyflash.distributed: ring attention's algebra on the CPU, P ranks as threads of one process.

The ranks run the library's code path (ring_attention_forward/backward) on NumPy shards; only the
transport is a stand-in (``ThreadRing``: each shift hands every rank's arrays to the next through a
shared board). The whole attention of the gathered sequence is the float64 reference's.
"""

import threading

import numpy
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cupyflash import reference
from cupyflash.distributed import (LAYOUTS, chunks_per_rank, ring_attention_backward, ring_attention_forward,
                                   shard, unshard)
from helpers import gpu_test, to_gpu
from tolerances import BWD_CEILING, FWD_CEILING

DTYPES = ("float64", "float32", "float16")


class Board:
    """What the threads of one simulated ring share: a slot per rank and a barrier."""

    def __init__(self, world: int):
        self.slots = [None] * world
        self.barrier = threading.Barrier(world)


class ThreadRing:
    """Rank ``rank`` of a ring of threads: ``shift`` sends to rank + 1 and receives from rank - 1, as the
    NCCL ring does (every rank shifts at the same points of the algorithm)."""

    def __init__(self, rank: int, world: int, board: Board):
        self.rank, self.world, self.board = rank, world, board
        self.shifts = 0

    def shift(self, send, recv, stream):
        assert stream is None   # NumPy arrays: no stream
        self.board.slots[self.rank] = [numpy.array(x) for x in send]
        self.board.barrier.wait()
        for y, x in zip(recv, self.board.slots[(self.rank - 1) % self.world]):
            assert y.shape == x.shape and y.dtype == x.dtype
            y[...] = x
        self.board.barrier.wait()
        self.shifts += 1


def run_ring(world: int, work, ring_type=None):
    """``work(ring)`` on every rank of a thread ring (``ring_type``, default ``ThreadRing``), its results in
    rank order (a rank's error raised)."""
    board, results, errors = Board(world), [None] * world, []
    ring_type = ring_type or ThreadRing

    def rank_main(rank):
        try:
            results[rank] = work(ring_type(rank, world, board))
        except BaseException as error:  # noqa: BLE001 - re-raised in the caller
            errors.append(error)
            board.barrier.abort()

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def inputs(rng, dtype, batch, n, D, kv_batch=None):
    q = rng.standard_normal((*batch, n, D))
    k, v = (rng.standard_normal((*(kv_batch or batch), n, D)) for _ in range(2))
    do = rng.standard_normal(q.shape)
    return [x.astype(dtype) for x in (q, k, v, do)]


def assert_near(name, got, ref, dtype):
    """Within the library's ceiling for its dtype (tests/tolerances.py), relative to the largest magnitude."""
    ceiling = (FWD_CEILING if name in ("o", "m", "l") else BWD_CEILING)[dtype]
    scale = max(numpy.abs(ref).max(initial=0.0), 1e-30)
    numpy.testing.assert_allclose(numpy.asarray(got, numpy.float64) / scale, ref / scale, atol=ceiling, rtol=0,
                                  err_msg=name)


def ring_case(world, layout, causal, dtype, batch=(2, 3), n_chunk=5, D=16, kv_batch=None, seed=0):
    rng = numpy.random.default_rng(seed)
    n = n_chunk * world * chunks_per_rank(layout)
    q, k, v, do = inputs(rng, dtype, batch, n, D, kv_batch)
    originals = [x.copy() for x in (q, k, v, do)]

    def work(ring):
        mine = [shard(x, ring.rank, world, layout) for x in (q, k, v, do)]
        o, m, l = ring_attention_forward(*mine[:3], ring, causal=causal, layout=layout)
        grads = ring_attention_backward(mine[3], *mine[:3], o, m, l, ring, causal=causal, layout=layout)
        return (o, m, l), grads, ring.shifts

    results = run_ring(world, work)
    for x, y in zip((q, k, v, do), originals):   # inputs never modified
        numpy.testing.assert_array_equal(x, y)
    o, m, l = (unshard([r[0][i] for r in results], layout, axis=-2 if i == 0 else -1) for i in range(3))
    grads = [unshard([r[1][i] for r in results], layout) for i in range(3)]
    f64 = [x.astype(numpy.float64) for x in (q, k, v, do)]
    o_ref, m_ref, l_ref = reference.attention_forward(*f64[:3], causal=causal)
    ref_grads = reference.attention_backward(f64[3], *f64[:3], o_ref, m_ref, l_ref, causal=causal)
    return (o, m, l), grads, (o_ref, m_ref, l_ref), ref_grads, [r[2] for r in results]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_a_ring_of_ranks_gives_the_whole_attention_and_its_gradients(world, causal, layout):
    out, grads, ref, ref_grads, shifts = ring_case(world, layout, causal, "float64")
    for name, got, want in zip(("o", "m", "l"), out, ref):
        numpy.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12, err_msg=name)
    for name, got, want in zip(("dq", "dk", "dv"), grads, ref_grads):
        numpy.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-10, err_msg=name)
    # world - 1 K/V shifts forward; world - 1 K/V and world dK/dV shifts backward
    assert shifts == [0 if world == 1 else 3 * world - 2] * world


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_dtype_within_its_tolerance(dtype, layout):
    out, grads, ref, ref_grads, _ = ring_case(3, layout, True, dtype, seed=1)
    assert out[0].dtype == numpy.dtype(dtype) and grads[1].dtype == numpy.dtype(dtype)
    for name, got, want in zip(("o", "m", "l", "dq", "dk", "dv"), (*out, *grads), (*ref, *ref_grads)):
        assert_near(name, got, want, dtype)


def test_keys_and_values_broadcast_along_the_batch_dims_gqa():
    out, grads, ref, ref_grads, _ = ring_case(2, "zigzag", True, "float64", batch=(2, 2, 3), kv_batch=(2, 2, 1), seed=2)
    assert grads[1].shape == (2, 2, 1, 20, 16)
    for name, got, want in zip(("o", "dq", "dk", "dv"), (out[0], *grads), (ref[0], *ref_grads)):
        numpy.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-10, err_msg=name)


@settings(max_examples=12, deadline=None)
@given(world=st.integers(1, 5), layout=st.sampled_from(LAYOUTS), causal=st.booleans(),
       n_chunk=st.integers(1, 9), D=st.sampled_from([8, 24]), seed=st.integers(0, 2 ** 16))
def test_drawn_rings(world, layout, causal, n_chunk, D, seed):
    out, grads, ref, ref_grads, _ = ring_case(world, layout, causal, "float64", batch=(2,), n_chunk=n_chunk, D=D,
                                              seed=seed)
    for name, got, want in zip(("o", "m", "l", "dq", "dk", "dv"), (*out, *grads), (*ref, *ref_grads)):
        numpy.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-10, err_msg=name)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("world", [1, 2, 5])
def test_shard_and_unshard_are_inverse(world, layout):
    x = numpy.arange(2 * world * 2 * 3 * 4, dtype=numpy.float32).reshape(2, world * 2 * 3, 4)
    shards = [shard(x, r, world, layout) for r in range(world)]
    assert all(s.shape == (2, x.shape[1] // world, 4) for s in shards)
    numpy.testing.assert_array_equal(unshard(shards, layout), x)
    if layout == "zigzag" and world == 2:   # rank 0: chunks 0 and 3 of 4; rank 1: chunks 1 and 2
        numpy.testing.assert_array_equal(shards[0][:, :3], x[:, :3])
        numpy.testing.assert_array_equal(shards[0][:, 3:], x[:, 9:])
    stats = numpy.arange(world * 4.0).reshape(1, world * 4)
    numpy.testing.assert_array_equal(unshard([shard(stats, r, world, layout, axis=-1) for r in range(world)],
                                             layout, axis=-1), stats)


def test_zigzag_balances_causal_pairs():
    """Every rank of a zigzag ring attends the same number of chunk pairs under a causal mask."""
    from cupyflash.distributed import _pairs

    for world in (2, 3, 4, 8):
        counts = {sum(1 for s in range(world) for _ in _pairs(r, s, world, "zigzag", True)) for r in range(world)}
        assert len(counts) == 1, world


def test_refusals_name_what_is_wrong():
    q = numpy.zeros((1, 8, 4))
    ring = ThreadRing(0, 2, Board(2))
    with pytest.raises(ValueError, match="layout"):
        ring_attention_forward(q, q, q, ring, layout="ring")
    with pytest.raises(ValueError, match="one length of the sequence"):
        ring_attention_forward(q, q[:, :4], q[:, :4], ring)
    with pytest.raises(ValueError, match="multiple of 2"):
        ring_attention_forward(q[:, :7], q[:, :7], q[:, :7], ring)
    with pytest.raises(TypeError, match="comm"):
        ring_attention_forward(q, q, q, object())
    with pytest.raises(ValueError, match="rank"):
        ring_attention_forward(q, q, q, ThreadRing(3, 2, Board(2)))
    with pytest.raises(ValueError, match="not a multiple of the 6 chunks"):
        shard(numpy.zeros((7, 2)), 0, 3, "zigzag", axis=0)
    with pytest.raises(ValueError, match="rank"):
        shard(q, 2, 2)
    with pytest.raises(ValueError, match="q's shape"):
        ring_attention_backward(q[:, :4], q, q, q, q, q[..., 0], q[..., 0], ring)
    for scale in (True, "0.5"):   # reaches the attention calls as given: refused as they refuse it
        with pytest.raises(TypeError, match="softmax_scale must be a real number"):
            ring_attention_forward(q, q, q, ThreadRing(0, 1, Board(1)), softmax_scale=scale)


# ---------------------------------------------------------------------------------------------------
# On a GPU (not run on the CPU): the streams and events of the real path, and NCCL at world size 1

class StreamRing(ThreadRing):
    """A thread ring over CuPy arrays on one GPU: the copy runs on the stream the library hands it (its
    transfer stream), as an NCCL transfer would; the board holds device copies made there."""

    def shift(self, send, recv, stream):
        import cupy

        assert isinstance(stream, cupy.cuda.Stream)
        with stream:
            self.board.slots[self.rank] = [x.copy() for x in send]
            stream.synchronize()   # the stand-in's copies are complete before another thread reads them
        self.board.barrier.wait()
        with stream:
            for y, x in zip(recv, self.board.slots[(self.rank - 1) % self.world]):
                y[...] = x
            stream.synchronize()
        self.board.barrier.wait()
        self.shifts += 1


@gpu_test
@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_gpu_path_with_its_transfer_stream(layout):
    """P = 3 ranks as threads on one GPU, CuPy shards, transfers on the library's transfer stream: the
    gathered result and gradients against the float64 reference."""
    import cupy

    world, rng = 3, numpy.random.default_rng(4)
    n = 8 * world * chunks_per_rank(layout)
    q, k, v, do = inputs(rng, "float32", (2, 2), n, 32)

    def work(ring):
        mine = [cupy.asarray(shard(x, ring.rank, world, layout)) for x in (q, k, v, do)]
        o, m, l = ring_attention_forward(*mine[:3], ring, causal=True, layout=layout)
        grads = ring_attention_backward(mine[3], *mine[:3], o, m, l, ring, causal=True, layout=layout)
        cupy.cuda.get_current_stream().synchronize()
        return [x.get() for x in (o, m, l, *grads)]

    results = run_ring(world, work, StreamRing)
    got = [unshard([res[i] for res in results], layout, axis=-1 if i in (1, 2) else -2) for i in range(6)]
    f64 = [x.astype(numpy.float64) for x in (q, k, v, do)]
    ref = reference.attention_forward(*f64[:3], causal=True)
    ref_grads = reference.attention_backward(f64[3], *f64[:3], *ref, causal=True)
    for name, g, want in zip(("o", "m", "l", "dq", "dk", "dv"), got, (*ref, *ref_grads)):
        assert_near(name, g, want, "float32")


@gpu_test
def test_an_nccl_communicator_of_one_rank():
    """The real transport's type, at world size 1 (no transfer): the whole attention."""
    import cupy

    nccl = pytest.importorskip("cupy.cuda.nccl")
    if not getattr(nccl, "available", True) or not hasattr(nccl, "NcclCommunicator"):
        pytest.skip("CuPy was built without NCCL, or libnccl is not installed")
    comm = nccl.NcclCommunicator(1, nccl.get_unique_id(), 0)
    rng = numpy.random.default_rng(6)
    q, k, v, do = inputs(rng, "float32", (1, 2), 64, 32)
    o, m, l = ring_attention_forward(*to_gpu(q, k, v), comm, causal=True)
    ref = reference.attention_forward(*(x.astype(numpy.float64) for x in (q, k, v)), causal=True)
    for name, g, want in zip("oml", (o, m, l), ref):
        assert_near(name, cupy.asnumpy(g), want, "float32")


def _ring_script():
    """tests/gpu/ring.py, the multi-GPU script, as a module."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent / "gpu" / "ring.py"
    spec = importlib.util.spec_from_file_location("ring_script_under_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_multi_gpu_scripts_check_holds_a_right_ring_and_catches_a_wrong_one(layout, monkeypatch):
    """tests/gpu/ring.py check compares each rank's shard on its own GPU: run here on NumPy through the
    stand-in ring, its errors are within the ceilings, and a ring whose o is off by 1% is caught."""
    script = _ring_script()
    errors = run_ring(2, lambda ring: script.check_case(ring, ring.rank, 2, "float32", layout, True, 8, numpy))
    assert script.check([(rank, ("float32", layout, True), e) for rank, e in enumerate(errors)])
    import cupyflash.distributed as cfd

    right = cfd.ring_attention_forward
    def off(*args, **kw):
        o, m, l = right(*args, **kw)
        return o * 1.01, m, l

    monkeypatch.setattr(cfd, "ring_attention_forward", off)
    errors = run_ring(2, lambda ring: script.check_case(ring, ring.rank, 2, "float32", layout, True, 8, numpy))
    assert max(e["o"] for e in errors) > FWD_CEILING["float32"]
    assert not script.check([(rank, ("float32", layout, True), e) for rank, e in enumerate(errors)])
