"""Context parallelism: attention over a sequence sharded across ranks (ring attention).

Each of ``P`` ranks holds a shard of the sequence axis (-2) of q, k and v. The K/V shards travel
around a ring, rank ``r`` sending to ``r + 1`` and receiving from ``r - 1``; at each of ``P`` steps a
rank attends its queries to the K/V shard it holds and merges that part into its running
``(o, m, l)`` (``cupyflash.merge``: exact, in the accumulator's precision). The backward reuses the
merged ``o, m, l``: the backward of each part, given the merged statistics, is that part's dK, dV and
its share of dQ (docs/semantics.md, "Merging attentions"). dK and dV are summed along the ring behind their K/V
shard and reach home after the last step.

The sequence is cut into chunks of one length. ``layout="contiguous"`` gives rank ``r`` chunk ``r`` of
``P``; ``"zigzag"`` gives it chunks ``r`` and ``2P - 1 - r`` of ``2P``, which balances causal attention
(every rank then sees as many visible pairs). Under a causal mask a query chunk attends a key chunk
before it in full, its own chunk causally, and none after it. ``shard`` and ``unshard`` convert
whole arrays.

On the GPU the transport is NCCL through CuPy (``cupy.cuda.nccl.NcclCommunicator``, or the NCCL backend
of ``cupyx.distributed``): each step's K/V transfer runs on a stream of its own, after an event of the
compute stream, while the compute stream attends the shard it holds; nothing synchronises the host. On
the CPU (NumPy arrays) any object with ``rank``, ``world`` and ``shift(send, recv, stream)`` is a ring
(the tests run ``P`` ranks as threads of one process through such a stand-in).
"""

from __future__ import annotations

import contextlib

import numpy

from ._checks import array_module, check_bool, check_choice
from ._tiles import accumulator_dtype
from .api import flash_attention_backward, flash_attention_forward
from .merge import merge_attention

__all__ = ["ring_attention_forward", "ring_attention_backward", "shard", "unshard", "LAYOUTS"]

LAYOUTS = ("zigzag", "contiguous")


def chunks_of(rank: int, world: int, layout: str) -> tuple:
    """The chunks of the sequence rank ``rank`` of ``world`` holds, in order: ``(r,)`` of ``world``
    chunks (contiguous) or ``(r, 2 world - 1 - r)`` of ``2 world`` (zigzag)."""
    return (rank,) if layout == "contiguous" else (rank, 2 * world - 1 - rank)


def chunks_per_rank(layout: str) -> int:
    """How many chunks each rank holds: 1 (contiguous) or 2 (zigzag)."""
    return 1 if layout == "contiguous" else 2


def shard(x, rank: int, world: int, layout: str = "zigzag", axis: int = -2):
    """Rank ``rank``'s shard of ``x`` along ``axis`` (the sequence axis: -2 for q, k, v, o, -1 for m, l).

    Parameters
    ----------
    x : numpy.ndarray or cupy.ndarray
        The whole array; its length along ``axis`` a multiple of the chunks (``world``, or ``2 world``
        with ``"zigzag"``).
    rank, world : int
        This rank and the ring's size.
    layout : {"zigzag", "contiguous"}
    axis : int

    Returns
    -------
    array
        Its chunks (``chunks_of``) concatenated along ``axis``: a new array.
    """
    check_choice("layout", layout, LAYOUTS)
    xp = array_module({"x": x})
    if not (isinstance(world, int) and world >= 1 and isinstance(rank, int) and 0 <= rank < world):
        raise ValueError(f"rank must be in [0, world) and world >= 1, got rank {rank!r}, world {world!r}")
    n = x.shape[axis]
    pieces = world * chunks_per_rank(layout)
    if n % pieces:
        raise ValueError(f"x's length {n} along axis {axis} (shape {x.shape}) is not a multiple of the {pieces} "
                         f"chunks of a {layout} layout over {world} ranks")
    c = n // pieces
    return xp.concatenate([_along(x, axis, i * c, c) for i in chunks_of(rank, world, layout)], axis=axis)


def unshard(shards, layout: str = "zigzag", axis: int = -2):
    """The whole array from every rank's shard (``shards[r]`` rank ``r``'s), the inverse of ``shard``."""
    check_choice("layout", layout, LAYOUTS)
    shards = list(shards)
    if not shards:
        raise ValueError("shards must hold one array per rank, got none")
    xp = array_module({f"shards[{r}]": s for r, s in enumerate(shards)})
    world, per = len(shards), chunks_per_rank(layout)
    if any(s.shape != shards[0].shape for s in shards) or shards[0].shape[axis] % per:
        raise ValueError(f"shards must share one shape whose length along axis {axis} is a multiple of {per}, "
                         f"got {[s.shape for s in shards]}")
    c = shards[0].shape[axis] // per
    pieces = [None] * (world * per)
    for rank, s in enumerate(shards):
        for position, i in enumerate(chunks_of(rank, world, layout)):
            pieces[i] = _along(s, axis, position * c, c)
    return xp.concatenate(pieces, axis=axis)


def _along(x, axis: int, start: int, length: int):
    """The view of ``x`` from ``start``, ``length`` long, along ``axis``."""
    index = [slice(None)] * x.ndim
    index[axis] = slice(start, start + length)
    return x[tuple(index)]


# ---------------------------------------------------------------------------------------------------
# The ring: who sends what to whom, and on which stream

class _NcclRing:
    """The ring over an NCCL communicator: ``cupy.cuda.nccl.NcclCommunicator`` or the NCCL backend of
    ``cupyx.distributed`` (which keeps one as ``_comm``). A shift is one NCCL group: every array of
    ``send`` to the next rank, the same number of bytes into ``recv`` from the previous one."""

    def __init__(self, comm):
        from cupy.cuda import nccl

        self.nccl, self.comm = nccl, getattr(comm, "_comm", comm)
        self.rank, self.world = self.comm.rank_id(), self.comm.size()

    def shift(self, send, recv, stream):
        after, before = (self.rank + 1) % self.world, (self.rank - 1) % self.world
        self.nccl.groupStart()
        try:
            for x, y in zip(send, recv):
                self.comm.send(x.data.ptr, x.nbytes, self.nccl.NCCL_UINT8, after, stream.ptr)
                self.comm.recv(y.data.ptr, y.nbytes, self.nccl.NCCL_UINT8, before, stream.ptr)
        finally:
            self.nccl.groupEnd()


def _ring(comm):
    """``comm`` as a ring: itself where it has ``rank``, ``world`` and ``shift``, else an NCCL one."""
    if all(hasattr(comm, name) for name in ("rank", "world", "shift")):
        ring = comm
    else:
        try:
            ring = _NcclRing(comm)
        except (AttributeError, ImportError) as error:
            raise TypeError("comm must be a cupy.cuda.nccl.NcclCommunicator, cupyx.distributed's NCCL backend, or "
                            f"an object with rank, world and shift(send, recv, stream); got {type(comm).__name__}"
                            ) from error
    if not (isinstance(ring.world, int) and ring.world >= 1 and 0 <= ring.rank < ring.world):
        raise ValueError(f"comm has rank {ring.rank!r} of world {ring.world!r}")
    return ring


class _Shifts:
    """The transfers of one call. On the GPU: each on the transfer stream after an event of the compute
    stream (what it sends is ready, what it overwrites is read), the compute stream waiting on its own
    event before it reads what arrived; the arrays in flight are held until then. On the CPU: at once."""

    def __init__(self, xp, stream):
        self.gpu = xp is not numpy
        if self.gpu:
            import cupy

            self.compute = stream if stream is not None else cupy.cuda.get_current_stream()
            self.transfer = _transfer_stream(cupy.cuda.Device().id)
        else:
            self.compute = self.transfer = None
        self.pending = {}   # name -> (done event, arrays held)

    def start(self, name: str, ring, send, recv):
        if self.gpu:
            self.transfer.wait_event(self.compute.record())
            ring.shift(send, recv, self.transfer)
            self.pending[name] = (self.transfer.record(), (send, recv))
        else:
            ring.shift(send, recv, None)

    def finish(self, name: str):
        if self.gpu and name in self.pending:
            self.compute.wait_event(self.pending.pop(name)[0])


_TRANSFER_STREAMS: dict = {}


def _transfer_stream(device: int):
    import cupy

    stream = _TRANSFER_STREAMS.get(device)
    if stream is None:
        stream = _TRANSFER_STREAMS[device] = cupy.cuda.Stream(non_blocking=True)
    return stream


# ---------------------------------------------------------------------------------------------------
# Forward and backward

def _checked(q, k, v, ring, causal, layout, more=None):
    """``(xp, chunk length)`` of a ring call; ValueError/TypeError naming what is wrong (softmax_scale is
    checked by the attention calls it reaches unchanged)."""
    check_choice("layout", layout, LAYOUTS)
    xp = array_module({"q": q, "k": k, "v": v, **(more or {})})
    check_bool("causal", causal)
    if q.ndim < 2 or k.ndim != q.ndim or v.ndim != q.ndim:
        raise ValueError(f"q, k, v must have the same rank >= 2, got {q.shape}, {k.shape}, {v.shape}")
    n, per = q.shape[-2], chunks_per_rank(layout)
    if k.shape[-2] != n or v.shape[-2] != n:
        raise ValueError(f"each rank's q, k and v shards must hold one length of the sequence (axis -2), got "
                         f"q {q.shape}, k {k.shape}, v {v.shape}")
    if n % per:
        raise ValueError(f"a {layout} shard holds {per} chunks of one length: its length {n} (q {q.shape}) is "
                         f"not a multiple of {per}")
    if ring.world > 1 and xp is numpy and isinstance(ring, _NcclRing):
        raise TypeError("an NCCL ring moves CuPy arrays; q, k, v are NumPy arrays")
    return xp, n // per


def _own(xp, x, ring):
    """The K or V shard a rank starts the ring with: a C-contiguous copy where it will be overwritten by
    what arrives (the caller's arrays are never written), else ``x`` itself."""
    return xp.array(x, order="C", copy=True) if ring.world > 1 else x


def _rows(x, position: int, c: int):
    """Chunk ``position`` (length ``c``) of a shard along its sequence axis (-2)."""
    return x[..., position * c:(position + 1) * c, :]


def _pairs(rank: int, source: int, world: int, layout: str, causal: bool):
    """``(query position, key position, causal)`` of every chunk pair rank ``rank`` attends with the K/V
    shard of rank ``source``: a key chunk after the query chunk is skipped under a causal mask, the
    query's own chunk attended causally."""
    for qp, qc in enumerate(chunks_of(rank, world, layout)):
        for kp, kc in enumerate(chunks_of(source, world, layout)):
            if not causal or kc < qc:
                yield qp, kp, False
            elif kc == qc:
                yield qp, kp, True


def ring_attention_forward(q, k, v, comm, *, causal: bool = False, softmax_scale=None, layout: str = "zigzag",
                           stream=None):
    """Attention of this rank's queries over the whole sharded sequence (ring attention).

    Parameters
    ----------
    q, k, v : arrays, (..., N_local, D)
        This rank's shards of the sequence axis (-2; ``shard``), in ``flash_attention_forward``'s shapes
        (k, v may broadcast along the batch dims: GQA); all NumPy or all CuPy; every rank the same shapes.
    comm : NCCL communicator or ring
        ``cupy.cuda.nccl.NcclCommunicator`` (one process per GPU), the NCCL backend of
        ``cupyx.distributed``, or any object with ``rank``, ``world`` and ``shift(send, recv, stream)``
        (send each array of ``send`` to rank + 1, fill ``recv`` from rank - 1).
    causal : bool
        The causal mask over the whole sequence's positions.
    softmax_scale : float, optional
        Default ``1/sqrt(D)``.
    layout : {"zigzag", "contiguous"}
        How the sequence was sharded (``shard``).
    stream : cupy.cuda.Stream, optional
        The stream to compute on (default the current one); transfers run on a stream of their own.

    Returns
    -------
    o : array, (..., N_local, D), q's dtype
    m, l : arrays, (..., N_local)
        This rank's rows of the whole attention and of its statistics (float32; float64 for float64),
        as ``flash_attention_forward`` over the gathered sequence returns them, to rounding.

    Raises
    ------
    TypeError, ValueError
        A bad layout, comm, or shards of different lengths; and what ``flash_attention_forward`` raises.
    """
    ring = _ring(comm)
    xp, c = _checked(q, k, v, ring, causal, layout)
    acc = accumulator_dtype(q.dtype)
    mine = chunks_of(ring.rank, ring.world, layout)
    running = [None] * len(mine)
    shifts = _Shifts(xp, stream)
    with (shifts.compute if shifts.gpu else contextlib.nullcontext()):
        held = [_own(xp, k, ring), _own(xp, v, ring)]
        spare = [xp.empty_like(x) for x in held] if ring.world > 1 else None
        for step in range(ring.world):
            if step + 1 < ring.world:
                shifts.start("kv", ring, held, spare)
            source = (ring.rank - step) % ring.world
            for qp, kp, diagonal in _pairs(ring.rank, source, ring.world, layout, causal):
                o, m, l = flash_attention_forward(_rows(q, qp, c), _rows(held[0], kp, c), _rows(held[1], kp, c),
                                                  causal=diagonal, softmax_scale=softmax_scale)
                part = (o.astype(acc, copy=False), m, l)
                running[qp] = part if running[qp] is None else tuple(merge_attention([running[qp], part]))
            if step + 1 < ring.world:
                shifts.finish("kv")
                held, spare = spare, held
        o = xp.concatenate([r[0] for r in running], axis=-2).astype(q.dtype, copy=False)
        m = xp.concatenate([r[1] for r in running], axis=-1)
        l = xp.concatenate([r[2] for r in running], axis=-1)
    return o, m, l


def ring_attention_backward(do, q, k, v, o, m, l, comm, *, causal: bool = False, softmax_scale=None,
                            layout: str = "zigzag", stream=None):
    """The gradients of ``ring_attention_forward`` on this rank's shards.

    Parameters
    ----------
    do : array, (..., N_local, D)
        The gradient of this rank's ``o``.
    q, k, v : arrays
        As in the forward.
    o, m, l : arrays
        This rank's ``ring_attention_forward`` result.
    comm, causal, softmax_scale, layout, stream
        As in the forward (the same).

    Returns
    -------
    dq, dk, dv : arrays of q's, k's, v's shapes and dtype
        This rank's shards of the gradients of the whole attention (dk, dv summed over every rank's
        queries, and over broadcast batch dims as ``flash_attention_backward`` sums them).

    Raises
    ------
    TypeError, ValueError
        As in the forward; and what ``flash_attention_backward`` raises.
    """
    ring = _ring(comm)
    xp, c = _checked(q, k, v, ring, causal, layout, {"do": do, "o": o, "m": m, "l": l})
    if do.shape != q.shape or o.shape != q.shape or m.shape != q.shape[:-1] or l.shape != q.shape[:-1]:
        raise ValueError(f"do and o must have q's shape {q.shape}, m and l {q.shape[:-1]}; got do {do.shape}, "
                         f"o {o.shape}, m {m.shape}, l {l.shape}")
    acc = accumulator_dtype(q.dtype)
    shifts = _Shifts(xp, stream)
    with (shifts.compute if shifts.gpu else contextlib.nullcontext()):
        dq = xp.zeros(q.shape, acc)
        held = [_own(xp, k, ring), _own(xp, v, ring)]
        spare = [xp.empty_like(x) for x in held] if ring.world > 1 else None
        arrived = [xp.empty(k.shape, acc), xp.empty(v.shape, acc)] if ring.world > 1 else None
        sums = None
        for step in range(ring.world):
            if step + 1 < ring.world:
                shifts.start("kv", ring, held, spare)
            source = (ring.rank - step) % ring.world
            part = [xp.zeros(k.shape, acc), xp.zeros(v.shape, acc)]   # dK, dV of the shard held, from here
            for qp, kp, diagonal in _pairs(ring.rank, source, ring.world, layout, causal):
                rows = slice(qp * c, (qp + 1) * c)
                grads = flash_attention_backward(_rows(do, qp, c), _rows(q, qp, c), _rows(held[0], kp, c),
                                                 _rows(held[1], kp, c), _rows(o, qp, c), m[..., rows], l[..., rows],
                                                 causal=diagonal, softmax_scale=softmax_scale)
                dq[..., rows, :] += grads[0]
                part[0][..., kp * c:(kp + 1) * c, :] += grads[1]
                part[1][..., kp * c:(kp + 1) * c, :] += grads[2]
            if step > 0:   # the sums of the ranks before, for the same shard, sent at their last step
                shifts.finish("dkv")
                part[0] += arrived[0]
                part[1] += arrived[1]
                arrived = [xp.empty(k.shape, acc), xp.empty(v.shape, acc)]
            sums = part
            if ring.world > 1:   # on to the next rank: its next shard, or home after the last step
                shifts.start("dkv", ring, sums, arrived)
            if step + 1 < ring.world:
                shifts.finish("kv")
                held, spare = spare, held
        if ring.world > 1:
            shifts.finish("dkv")
            sums = arrived
        return dq.astype(q.dtype), sums[0].astype(k.dtype), sums[1].astype(v.dtype)
