"""Public API: validate, then dispatch to the GPU kernels or the NumPy path."""

from __future__ import annotations

import math
import sys
from functools import lru_cache
from operator import itemgetter
from typing import TYPE_CHECKING, Optional, Union

import numpy

from . import _launch, blocked
from .blockmask import BlockMask
from ._flags import ARRAY_FLAGS, BY_NAME, call_arrays
from ._expr import GPU_ARRAY_TYPES, MAX_ARGS, user_code, user_mods
from ._fold import fold_of, foldable, keeps_the_gpu_busy
from ._numpy_ops import unbroadcast
from ._checks import (SCHEDULES, check_backward, check_bool, check_choice, check_disjoint, check_dropout,
                      check_forward, check_out, check_pairwise, check_per_entry, check_seqlens, check_splits,
                      kernel_ready, readable_in_place, seed_value, with_softcap)
from ._tiles import PRECISIONS, accumulator_dtype


if TYPE_CHECKING:
    import cupy

# a NumPy array (the CPU path) or a CuPy array (the GPU kernels)
Array = Union[numpy.ndarray, "cupy.ndarray"]
Outputs = tuple[Array, Array, Array]
# a sliding window's (left, right) sides: ints >= 0, None where unbounded
Window = tuple[Optional[int], Optional[int]]

FORWARD_OUTPUTS = ("o", "m", "l")
BACKWARD_OUTPUTS = ("dq", "dk", "dv")
# the keywords of a forward that its backward takes too, with the same values (ForwardResult.backward)
_SHARED_KEYWORDS = ("causal", "softmax_scale", "window", "softcap", "alibi_slopes", "bias", "mask", "sink",
                    "dropout_p", "seed", "score_mod", "mask_mod", "mod_args", "schedule", "precision")
BACKWARD_KEYWORDS = (*_SHARED_KEYWORDS, "block_mask")
VARLEN_BACKWARD_KEYWORDS = ("max_seqlen_q", "max_seqlen_k", *_SHARED_KEYWORDS)   # packed: no block mask


class ForwardResult(tuple):
    """The ``(o, m, l)`` of a forward call, which remembers the call for its backward.

    A tuple of the three outputs: ``o, m, l = result``, ``result[0]``,
    ``len(result) == 3`` and ``tuple(result)`` are those of the plain tuple;
    ``result.o``, ``result.m``, ``result.l`` name them. Beside them it holds
    the call that made them: the forward's inputs (``q``, ``k``, ``v``; the
    offsets of packed sequences) and the values of its keywords, so that
    :meth:`backward` runs the backward with exactly the forward's arguments.

    Attributes
    ----------
    o : ndarray, shape (*batch, Nq, D)
    m, l : ndarray, shape (*batch, Nq)
        The outputs, as :func:`flash_attention_forward` (or
        :func:`flash_attention_varlen_forward`) documents them.

    Notes
    -----
    Everything is held by reference, nothing is copied: the inputs and the
    keywords' arrays (``bias``, ``mask``, ``alibi_slopes``, ``sink``, the
    ``mod_args`` dict) stay alive while the result does, and an array changed
    in place between the forward and :meth:`backward` is read as it is then,
    as :func:`flash_attention_backward` would read it.
    """

    def __new__(cls, outputs, backward, inputs, offsets, names, values):
        """``outputs`` (o, m, l) of a call that ``backward`` differentiates as ``backward(do, *inputs, o, m, l,
        *offsets, **dict(zip(names, values)), ...)``."""
        result = tuple.__new__(cls, outputs)
        result._call = (backward, inputs, offsets, names, values)
        return result

    def __getnewargs__(self):
        return (tuple(self), *self._call)

    def __repr__(self):
        return f"{type(self).__name__}(o={self[0]!r}, m={self[1]!r}, l={self[2]!r})"

    o = property(itemgetter(0), doc="The attention output, ``result[0]``.")
    m = property(itemgetter(1), doc="The rows' score maxima, ``result[1]``.")
    l = property(itemgetter(2), doc="The rows' exp-sums, ``result[2]``.")

    def backward(self, do: Array, *, score_mod_grad: Optional[str] = None, bias_grad: bool = False,
                 deterministic: bool = False, out: Optional[Outputs] = None) -> tuple:
        """Gradients of this forward call, with its own inputs, outputs and keywords.

        Parameters
        ----------
        do : ndarray, shape (*batch, Nq, D)
            Gradient of the loss with respect to ``o`` (``total_q`` rows for
            packed sequences); dtype of ``q``.
        score_mod_grad : str, optional
            The derivative of the forward's ``score_mod`` by ``s``; required
            when the forward had a ``score_mod`` (the forward does not take it).
        bias_grad, deterministic, out : optional
            As in :func:`flash_attention_backward`: what only the backward
            chooses.

        Returns
        -------
        dq, dk, dv : ndarray
            Of the shapes of ``q``, ``k``, ``v``.
        dbias : ndarray
            With ``bias_grad`` only.
        dsink : ndarray
            With a ``sink`` in the forward only (the last result).

        Raises
        ------
        TypeError, ValueError
            As in :func:`flash_attention_backward` (``do`` of the wrong shape
            or dtype, ``bias_grad`` without a bias in the forward, a
            ``score_mod`` without ``score_mod_grad``, a bad ``out``).

        Notes
        -----
        The call is :func:`flash_attention_backward` (for packed sequences
        :func:`flash_attention_varlen_backward`) of ``do``, the forward's
        ``q``, ``k``, ``v``, this ``o``, ``m``, ``l`` (and the offsets) with
        every keyword the forward was given that the backward takes:
        ``causal``, ``softmax_scale``, ``window``, ``softcap``,
        ``alibi_slopes``, ``bias``, ``mask``, ``sink``, ``dropout_p``,
        ``seed``, ``score_mod``, ``mask_mod``, ``mod_args``, ``schedule``,
        ``precision`` (and ``max_seqlen_q``, ``max_seqlen_k``). So the
        backward differentiates the attention the forward computed, which
        the free function cannot check.

        See Also
        --------
        flash_attention_backward : the same with every argument given.
        """
        backward, inputs, offsets, names, values = self._call
        return backward(do, *inputs, *self, *offsets, **dict(zip(names, values)), score_mod_grad=score_mod_grad,
                        bias_grad=bias_grad, deterministic=deterministic, out=out)


def flash_attention_forward(q: Array, k: Array, v: Array, *, causal: bool = False,
                            softmax_scale: Optional[float] = None, window: Optional[Window] = None,
                            softcap: Optional[float] = None, alibi_slopes=None, bias=None, mask=None,
                            sink=None, dropout_p: float = 0.0, seed: Optional[int] = None, score_mod: Optional[str] = None,
                            mask_mod: Optional[str] = None, mod_args: Optional[dict] = None, schedule: str = "auto",
                            precision: str = "highest", num_splits: Optional[int] = None,
                            out: Optional[Outputs] = None, block_mask: Optional[BlockMask] = None) -> ForwardResult:
    """Exact attention with its softmax statistics (FlashAttention's fused forward).

    Parameters
    ----------
    q : cupy.ndarray or numpy.ndarray, shape (..., Nq, D)
    k : cupy.ndarray or numpy.ndarray, shape (..., Nk, D)
    v : cupy.ndarray or numpy.ndarray, shape (..., Nk, D)
        One dtype for all three: float16, bfloat16 (``ml_dtypes.bfloat16``),
        float32 or float64. ``1 <= D <= 256``. The leading (batch) dims
        broadcast as in ``numpy.matmul``, so GQA is ``q (B, Hkv, G, N, D)``
        with ``k, v (B, Hkv, 1, N, D)``. Any strides.
    causal : bool, optional
        Query ``i`` sees key ``j`` iff ``j <= i + (Nk - Nq)`` (bottom-right
        aligned; the lower triangle when ``Nq == Nk``).
    softmax_scale : float, optional
        Multiplies ``q kᵀ``; default ``1 / sqrt(D)``.
    window : (int or None, int or None), optional
        A sliding window ``(left, right)``: query ``i`` sees key ``j`` only if
        ``i + off − left <= j <= i + off + right`` with ``off = Nk − Nq``
        (aligned bottom-right, as ``causal``); a side that is None is
        unbounded. With ``causal=True`` the right side is 0. The kernels
        visit only the K/V tiles inside the band, so the cost grows with the
        visible pairs, not with ``Nq · Nk``. Default None: no window.
    softcap : float, optional
        ``c > 0``: each score becomes ``c · tanh(s / c)`` (after the scale,
        before ALiBi and the mask), as in Gemma 2 and Grok. float16/bfloat16
        inputs take the GPU's ``tanh.approx`` (relative error 2⁻¹¹, the
        rounding of a float16 score), float32/float64 an accurate tanh.
    alibi_slopes : array_like, optional
        One slope per batch entry, broadcastable to the batch shape (``(H,)``
        for ``(B, H, N, D)``, ``(B, H)``, ...): each score loses
        ``slope · |i + off − j|`` (ALiBi, bottom-right aligned like the mask).
        Read in the accumulator dtype (float32; float64 for float64 inputs);
        another dtype, or a NumPy array for CuPy inputs, is converted first.
    bias : ndarray, optional
        Added to the scores (after the softcap and ALiBi): any shape that
        broadcasts to ``(*batch, Nq, Nk)`` without enlarging it, e.g.
        ``(1, H, Nq, Nk)`` or a key-padding ``(B, 1, 1, Nk)``; read in place
        with its strides (0 along a broadcast dim), never expanded. The
        GPU reads it in the inputs' dtype: a bias of another dtype (or a
        NumPy bias for CuPy inputs) is converted first, a copy of its own
        shape. A ``-inf`` bias gives a pair zero weight but, unlike
        ``mask``, keeps its term (``0 · v`` is NaN where ``v`` is).
    mask : ndarray of bool, optional
        Broadcastable to ``(*batch, Nq, Nk)`` like ``bias``; ``True`` =
        visible. A hidden pair has no term at all, exactly as those the
        causal mask and the window hide (a NaN or inf in its key or value
        does not reach the output). The kernels visit every K/V tile the
        causal mask and the window leave: the mask saves no work.
    sink : array_like, optional
        Attention-sink logits, one per batch entry, broadcastable to the
        batch shape like ``alibi_slopes`` (and read the same way): each row
        sees one more key, of logit ``sink`` and value zero. It counts in
        ``m`` and adds ``exp(sink − m)`` to ``l``, so a row that sees no
        key has ``m = sink``, ``l = 1``, ``o = 0``.
    dropout_p : float, optional
        Dropout on ``P``, ``0 <= p < 1``: a pair is dropped (its weight 0)
        with probability ``p`` and the others are scaled by ``1 / (1 − p)``.
        The kept set is a counter-based function of ``(seed, flat batch
        index, i, j)`` (Philox4x32-10, :func:`cupyflash.dropout_mask`), so
        it does not depend on tiles, schedule, kernel or GPU, and the
        backward with the same ``seed`` drops the same pairs. ``m``, ``l``
        are those of the scores before dropout.
    seed : int or array, optional
        Dropout's seed in ``[0, 2⁶⁴)``; needed when ``dropout_p > 0``. Or an array that holds it,
        one ``uint64`` or two ``uint32`` words, the low one first (``jax.random.key_data``'s
        layout): a CuPy one is a *device seed*, read by the kernels as they run, so a captured
        CUDA graph replayed after the array changed (or a jitted JAX step) drops another set.
    score_mod : str, optional
        A C expression (the language of ``cupyflash._expr``: numbers,
        ``+ - * / %``, comparisons, ``&& || !``, ``?:``, casts and float
        functions such as ``tanhf``, ``expf``, ``fabsf``, ``max``) over ``s``
        (the score after ``softcap``), ``b`` (the flat batch index),
        ``q_idx``, ``kv_idx`` (the pair's positions in q and k) and the names
        of ``mod_args``: the new score, before ALiBi and ``bias``. Ints are
        64-bit; float arithmetic is float32 (float64 for float64 inputs).
    mask_mod : str, optional
        An expression over ``b``, ``q_idx``, ``kv_idx`` and ``mod_args``:
        the pair stays visible where it is nonzero (hidden as by ``mask``).
    mod_args : dict, optional
        At most eight names the expressions read: numbers, or arrays (NumPy
        or CuPy) read as 1-D in C order by ``name[index]``.
    schedule : {'auto', 'v1', 'v2'}, optional
        Which GPU kernel runs; all return the same ``(o, m, l)``. 'v1' is
        FlashAttention's Algorithm 1 (K/V-outer, O/m/l through HBM between
        steps), 'v2' the FlashAttention-2 schedule (Q-outer, O/m/l in
        registers), 'auto' the faster of the two as measured on an H200 per
        dtype and head dim (V2, except float64 with D > 128). The NumPy path
        ignores it.
    precision : {'highest', 'tf32'}, optional
        How the GPU kernels multiply float32 inputs. 'highest' keeps float32
        accuracy on the tensor cores: each product is split into TF32 parts
        and summed from three TF32 products ("3xTF32"), with float32
        accumulators. 'tf32' takes one TF32 product (10-bit mantissas, like
        ``torch.backends.cuda.matmul.allow_tf32`` or JAX's default
        precision): relative errors of about 1e-3 instead of 1e-6. float16,
        bfloat16 and float64 inputs, and the NumPy path, accept it and are
        unchanged by it.
    num_splits : int, optional
        Split-KV: each Q tile's K/V tiles in ``num_splits`` runs, one CTA
        each, whose ``(o, m, l)`` are merged (``merge_attention``'s kernel)
        in a fixed order, so the result stays deterministic and equals the
        unsplit one to rounding. None picks the count from the grid and the
        GPU: 1 where the work heads' Q tiles fill it, more for decoding (a
        few query rows against many keys). At most 256 and the K/V tiles there are;
        more than 1 runs the V2 schedule ('auto' takes it; 'v1' refuses), and
        1 where V2 does not fit. The NumPy path computes the unsplit attention.
    out : tuple of three ndarrays, optional
        ``(o, m, l)`` to write into: of exactly the shapes and dtypes below,
        C-contiguous, writeable, of the inputs' kind and device (on the GPU
        also 16-byte aligned), sharing memory with no input and with each
        other. They are the result's items (an earlier result may be passed
        as ``out``).
    block_mask : BlockMask, optional
        A ``mask_mod`` with its ``mod_args`` whose tile maps are kept
        (:func:`cupyflash.block_mask`): the call takes its expression and
        arguments (give no other ``mask_mod``, no ``mod_args``) and its q, k
        must have the shapes it was made for. The first GPU call of a kernel
        on a stream writes the map, later ones read it.

    Returns
    -------
    result : ForwardResult
        The tuple ``(o, m, l)`` of the three arrays below (``o, m, l =
        result``, ``result[0]``, also ``result.o``), which holds this call's
        inputs and keywords by reference (no copies): ``result.backward(do)``
        is :func:`flash_attention_backward` of this very call.
    o : ndarray, shape (*batch, Nq, D)
        ``softmax(S) v`` with ``S = softmax_scale · q kᵀ`` (then softcapped,
        less ALiBi), in the input dtype, C-contiguous; ``batch`` is the
        broadcast batch shape.
    m : ndarray, shape (*batch, Nq)
        Row max of ``S`` over visible keys (those the causal mask, the
        window and ``mask`` leave); float32 (float64 for float64).
    l : ndarray, shape (*batch, Nq)
        ``Σ_j exp(S_j − m)`` over visible keys, natural exp; same dtype as
        ``m``. ``lse = m + log(l)``. A row that sees no key has ``o = 0``,
        ``m = −inf``, ``l = 0``.

    Raises
    ------
    TypeError
        Unsupported or mixed dtypes, non-array inputs, NumPy mixed with CuPy.
    ValueError
        Rank < 2, mismatched ``D`` or ``Nk``, batch dims that do not broadcast,
        ``D`` outside [1, 256], inputs on different devices, a negative window
        side (a window that is not a pair of ints or None is a TypeError), a
        ``softcap`` <= 0 or not finite, ``alibi_slopes`` that do not broadcast
        to the batch shape or lie on another device, a ``bias`` or ``mask``
        that does not broadcast to ``(*batch, Nq, Nk)`` (a ``mask`` that is not
        bool, a ``bias`` that is not real, is a TypeError); an ``out`` array
        of the wrong shape, layout, device or alignment, or overlapping (a
        wrong count, kind or dtype of ``out`` is a TypeError).

    Notes
    -----
    Inside a CUDA-graph capture (CuPy's current stream capturing), with ``out``
    given, the call's workspaces are stream-ordered allocations the graph
    owns; inputs that would need a contiguous copy raise ValueError there.

    CuPy inputs run a fused kernel: ``kernels_cu/flash_fwd_v1.cu``, Algorithm 1
    of FlashAttention (outer loop over K/V tiles, inner loop over Q tiles,
    online softmax, O/m/l carried in HBM between outer steps), or
    ``kernels_cu/flash_fwd_v2.cu``, the FlashAttention-2 loop order; on sm_90
    GPUs V2 of float16/bfloat16 (with ``softmax_scale > 0``) runs
    ``kernels_cu/flash_fwd_sm90.cu``, the same schedule on Hopper's
    warpgroup MMA with FlashAttention-3's warp specialisation. All accumulate in float32 (float64
    for float64) and use tensor cores for 16-bit inputs. Extra memory is O(N).
    NumPy inputs run the blocked Algorithm 1 on the CPU. Inputs are never
    modified. Where k and v are broadcast along q's last batch dims (GQA, MQA)
    and nothing tells the query rows apart (no causal mask over more than one
    row, no window, ALiBi, sink, bias, mask, dropout, expressions or packed
    sequences), the query heads of a group are folded into the rows of one
    work head (``cupyflash._fold``), so K and V are read once per group.

    See Also
    --------
    cupyflash.reference.attention_forward : the naive float64 reference.
    cupyflash.blocked.forward : the NumPy Algorithm 1 (CPU path).
    """
    user, token = (score_mod, None, mask_mod, mod_args), None
    if block_mask is not None:
        user, token = _enter_block_mask(block_mask, q, k, user)
    try:
        outputs = _forward(q, k, v, None, causal, softmax_scale, window, softcap, alibi_slopes, sink, schedule,
                           precision, out, bias, mask, dropout_p, seed, user, num_splits)
    finally:
        if token is not None:
            _launch.BLOCK_MAPS.reset(token)
    return ForwardResult(outputs, flash_attention_backward, (q, k, v), (), BACKWARD_KEYWORDS,
                         (causal, softmax_scale, window, softcap, alibi_slopes, bias, mask, sink, dropout_p, seed,
                          score_mod, mask_mod, mod_args, schedule, precision, block_mask))


def _enter_block_mask(block_mask, q, k, user) -> tuple:
    """``(user, token)`` of a call that passes ``block_mask``: its expressions (score_mod, score_mod_grad,
    mask_mod, mod_args) with the block mask's mask_mod and arguments, the arrays on the inputs' GPU
    (``BlockMask.args_on``), and the token that ends its maps' being the ones the call's kernels read and
    keep (``_launch.BLOCK_MAPS``; the caller resets it)."""
    if not isinstance(block_mask, BlockMask):
        raise TypeError(f"block_mask must be a cupyflash.BlockMask (cupyflash.block_mask(...)), got "
                        f"{type(block_mask).__name__}")
    block_mask.check_call(q, k, user[2], user[3])
    cupy = sys.modules.get("cupy")
    on_gpu = cupy is not None and isinstance(q, cupy.ndarray)
    args = block_mask.args_on(q.device.id) if on_gpu else block_mask.mod_args
    return (*user[:2], block_mask.mask_mod, args), _launch.BLOCK_MAPS.set(block_mask._maps)


def _forward(q, k, v, varlen, causal, softmax_scale, window, softcap, alibi_slopes, sink, schedule, precision, out,
             bias=None, mask=None, dropout_p=0.0, seed=None, user=(None,) * 4, num_splits=None):
    """``flash_attention_forward``, or with ``varlen`` = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
    max_seqlen_k) ``flash_attention_varlen_forward``; ``user``: (score_mod, score_mod_grad, mask_mod,
    mod_args)."""
    dropout = check_dropout(dropout_p, seed, q)
    expressions = user_mods(*user)
    arrays = call_arrays(alibi_slopes=alibi_slopes, sink=sink, bias=bias, mask=mask)
    inputs = _with_arrays({"q": q, "k": k, "v": v}, arrays)
    mod_key = _mod_args_key(user[3])
    flags = (causal, softmax_scale, window, softcap, schedule, precision, *_dropout_key(dropout), tuple(arrays), *user[:3],
             num_splits, mod_key)
    offsets, flags = _with_offsets(inputs, flags, varlen)
    plan, key = _kept_plan(inputs, out, FORWARD_OUTPUTS, flags, _plan_keepable(varlen) and mod_key is not None)
    if plan is not None:
        return plan(q, k, v, out, arrays, offsets, dropout[1])
    prob = with_softcap(check_forward(q, k, v, causal, softmax_scale, window), softcap)
    check_choice("schedule", schedule, SCHEDULES)
    check_choice("precision", precision, PRECISIONS)
    num_splits = check_splits(num_splits, schedule)
    gpu_user, _kept_alive = _gpu_user(expressions, prob, q)
    arrays, key = _checked_mods(prob, q, key, arrays)
    seqs, key = _seqlens(varlen, prob, q, key)
    acc = accumulator_dtype(prob.dtype)
    stats = (*prob.batch_shape, prob.Nq)
    if out is not None:
        out = check_out(out, FORWARD_OUTPUTS, ((*stats, prob.D), stats, stats), (prob.dtype, acc, acc), prob.xp,
                        _device_id(q, prob), {"q": q, "k": k, "v": v})
    fold_ok = foldable(prob, (*arrays.values(), expressions, seqs), dropout[0])
    if prob.xp is numpy:
        kw = dict(causal=prob.causal, softmax_scale=prob.scale, window=prob.window, softcap=prob.softcap,
                  **_by_argument(arrays), dropout_p=dropout[0], seed=dropout[1], score_mod=user[0], mask_mod=user[2],
                  mod_args=user[3])
        if seqs is not None:
            return _into(out, blocked.varlen_forward(q, k, v, seqs.cu_q, seqs.cu_k, **kw))
        fold = fold_of(prob.batch_shape, q, k, v) if fold_ok else None
        if fold is not None:   # the same rows, in fewer and longer matrices
            o, m, l = blocked.forward(fold.rows(q), fold.keys(k), fold.keys(v), **dict(kw, causal=fold.problem(prob).causal))
            return _into(out, (o.reshape(*stats, prob.D), m.reshape(stats), l.reshape(stats)))
        return _into(out, blocked.forward(q, k, v, **kw))
    import cupy

    with q.device:
        if _empty(prob):   # every row sees no key: o = 0, m = -inf, l = 0 (the sink alone: m = sink, l = 1)
            if out is None:
                out = (cupy.empty((*stats, prob.D), prob.dtype), cupy.empty(stats, acc), cupy.empty(stats, acc))
            for x, value in zip(out, (0, -numpy.inf, 0)):
                x.fill(value)
            if "sink" in arrays and prob.Nq:
                out[1][...] = cupy.broadcast_to(arrays["sink"], prob.batch_shape)[..., None]
                out[2][...] = cupy.where(out[1] == -numpy.inf, 0, cupy.exp(out[1] - out[1]))
            return out
        ready, key = _kernel_ready((q, k, v), key)
        # split-KV runs the V2 schedule's kernels (auto picks V2 for it)
        schedule = _launch.forward_schedule("v2" if schedule == "auto" and (num_splits or 1) > 1 else schedule,
                                            prob.D, prob.dtype)
        kernel = _launch.forward_kernel(schedule, prob.dtype, prob.scale)
        # packed GQA: K/V read once per group of query heads (_fold.py); split-KV keeps the GPU busy unless
        # num_splits = 1 holds the grid to the work heads' Q tiles
        fold = _gpu_fold(prob, ready, (), kernel, busy_rule=num_splits == 1) if fold_ok else None
        if fold is not None:
            fprob = fold.problem(prob)
            return _forward_gpu(fold.rows(ready[0]), *(fold.keys(x) for x in ready[1:]), {},
                                fprob.batch_shape, fprob, schedule, precision, key, out, stats_shape=stats,
                                kv_splits=num_splits)
        return _forward_gpu(*ready, arrays, prob.batch_shape, prob, schedule, precision, key, out, *_packed(seqs),
                            dropout=dropout, user=gpu_user, kv_splits=num_splits)


def _gpu_fold(prob, inputs, rows_like, kernel: str, backward: bool = False, busy_rule: bool = True):
    """The ``_fold.Fold`` of a foldable GPU call's ``inputs`` (q, k, v; ``rows_like`` o, do), where it
    keeps the GPU busy (``busy_rule``; else wherever it folds), else None."""
    fold = fold_of(prob.batch_shape, *inputs, *rows_like)
    if fold is None or not busy_rule:
        return fold
    cfg = _launch.device_tiles(kernel, prob.D, prob.dtype)
    block = cfg.block_c if backward else cfg.block_r
    return fold if keeps_the_gpu_busy(prob, fold, block, _launch.current_limits().sms, backward) else None


def _mod_args_key(mod_args):
    """What a kept plan's mod_args slots hold: each number's type and value, each CuPy array's dtype,
    shape, device and address; None (no plan kept) where a call would copy an array (a NumPy one, a
    strided one, one of a dtype the kernels do not read: ``_gpu_user``)."""
    if not isinstance(mod_args, dict):
        return () if mod_args is None else None
    cupy, out = sys.modules.get("cupy"), []
    for name, value in mod_args.items():
        if cupy is not None and type(value) is cupy.ndarray:
            if value.dtype.name not in GPU_ARRAY_TYPES or not value.flags.c_contiguous:
                return None
            out.append((name, value.dtype.name, value.shape, value.data.device_id, value.data.ptr))
        elif numpy.ndim(value) == 0 and not hasattr(value, "__cuda_array_interface__") \
                and not isinstance(value, numpy.ndarray):
            out.append((name, type(value).__name__, repr(value)))
        else:
            return None
    return tuple(out)


def _gpu_user(expressions, prob, q) -> tuple:
    """``((UserCode, slots), arrays)`` of a call's expressions for the kernels, ``(None, ())`` without
    them: their text in the kernels' real type (double for float64), each mod_args array as a contiguous
    CuPy array on the inputs' device of a type the kernels read (``_expr.GPU_ARRAY_TYPES``; others as
    float32 or int64; a NumPy array is copied over), its address in its slot, a number's bits in its.
    ``arrays`` must live until the kernels are queued."""
    if expressions is None or prob.xp is numpy:
        return None, ()
    import cupy

    slots, types, arrays = [], {}, []
    for name, value in expressions.args.items():
        if numpy.ndim(value) == 0 and not hasattr(value, "__cuda_array_interface__"):
            slots.append(int(numpy.asarray(value).view(numpy.uint64)))   # int64 or float64 bits
            continue
        with q.device:
            array = cupy.asarray(value)
            if array.dtype.name not in GPU_ARRAY_TYPES:
                array = array.astype(numpy.float32 if array.dtype.kind == "f" or array.dtype.name == "bfloat16"
                                     else numpy.int64)
            array = cupy.ascontiguousarray(array).reshape(-1)
        types[name] = GPU_ARRAY_TYPES[array.dtype.name]
        arrays.append(array)
        slots.append(array.data.ptr)
    real = "double" if numpy.dtype(prob.dtype) == numpy.float64 else "float"
    code = user_code(expressions, real, types, fast=numpy.dtype(prob.dtype).itemsize == 2)
    return (code, tuple(slots) + (0,) * (MAX_ARGS - len(slots))), arrays


def _with_offsets(inputs: dict, flags: tuple, varlen):
    """``(offsets, flags)`` of a call: with ``varlen`` (as in ``_forward``) its offsets, which also join
    ``inputs`` (they key a kept plan), and its maxima added to ``flags``; else ``((None, None), flags)``."""
    if varlen is None:
        return (None, None), flags
    inputs.update(cu_seqlens_q=varlen[0], cu_seqlens_k=varlen[1])
    return tuple(varlen[:2]), flags + tuple(varlen[2:])


def _plan_keepable(varlen) -> bool:
    """A call of packed sequences keeps a plan only with both maxima given: its grid would otherwise
    come from the offsets' values, which a plan's key does not see."""
    return varlen is None or (varlen[2] is not None and varlen[3] is not None)


def _seqlens(varlen, prob, q, key):
    """The validated offsets of packed sequences (``_checks.Seqlens``; None without) and ``key``, or None
    where they had to be converted (a like call converts them again)."""
    if varlen is None:
        return None, key
    seqs = check_seqlens(*varlen, prob, _device_id(q, prob))
    if seqs.cu_q is not varlen[0] or seqs.cu_k is not varlen[1]:
        key = None
    return seqs, key


def _packed(seqs) -> tuple:
    """``(packed, offsets)`` of a plan: ``_launch.Packed`` and the device offsets, or ``(None, (None, None))``."""
    if seqs is None:
        return None, (None, None)
    return _launch.Packed(seqs.n, seqs.max_q, seqs.max_k), (seqs.cu_q, seqs.cu_k)


def _with_arrays(inputs: dict, arrays: dict) -> dict:
    """``inputs`` and the modifiers' arrays given (``_flags.call_arrays``), by their arguments' names (they
    key a kept plan too)."""
    if arrays:
        inputs.update((BY_NAME[name].array, x) for name, x in arrays.items())
    return inputs


def _by_argument(arrays: dict) -> dict:
    """The modifiers' arrays as keyword arguments of the NumPy path (``alibi_slopes=...``; None where
    not given)."""
    return {flag.array: arrays.get(flag.name) for flag in ARRAY_FLAGS}


def _checked_mods(prob, q, key, arrays: dict):
    """``(arrays, key)``: the modifiers' arrays (by flag, ``_flags.call_arrays``) as the kernels or the
    NumPy path read them (``check_per_entry``, ``check_pairwise`` by the flag's ``per``), and ``key``,
    or None where one was converted (a like call converts it again, so no plan is kept)."""
    device = _device_id(q, prob)
    checked = {}
    for name, x in arrays.items():
        flag = BY_NAME[name]
        checked[name] = (check_per_entry if flag.per == "entry" else check_pairwise)(flag.array, x, prob, device)
        if checked[name] is not x:
            key = None
    return checked, key


class FreshOut(tuple):
    """``out=`` arrays their caller has just allocated for this call (cupyflash.torch, cupyflash.jax): they
    share memory with nothing, so a kept plan skips the overlap check (a call that makes a plan still
    validates them in full)."""

    __slots__ = ()


def _kept_plan(inputs: dict, out, names, flags, keepable=True):
    """The plan an earlier like call kept (None if none) and this call's key (``_call_key``; None where
    not ``keepable``). With a plan, ``out`` is checked against the inputs here (but ``FreshOut``):
    aliasing is what the key cannot see."""
    key = _call_key(tuple(inputs.values()), out, flags) if keepable else None
    plan = _launch.PLANS.get(key)
    if plan is not None and out is not None and type(out) is not FreshOut:
        check_disjoint(out, names, inputs)
    return plan, key


def _call_key(arrays, out, flags):
    """``_launch.call_key`` of a call, its ``out`` arrays included; None where no plan can be kept."""
    if out is None:
        return _launch.call_key(arrays, flags)
    if not isinstance(out, tuple) or len(out) != 3:   # a ForwardResult passed back in too
        return None
    return _launch.call_key((*arrays, *out), flags)


def _kernel_ready(arrays, key):
    """The arrays as the kernels read them (``kernel_ready``), and ``key``, or None where one had to be
    copied: a like call copies it again, so its plan is not kept."""
    if all(readable_in_place(x) for x in arrays):
        return arrays, key
    _refuse_while_capturing("an input whose last axis is not contiguous (or with a negative stride) is copied")
    return tuple(kernel_ready(x) for x in arrays), None


def _refuse_while_capturing(what):
    """ValueError inside a CUDA-graph capture for a call that needs temporaries from CuPy's pool."""
    if _launch.capturing():
        raise ValueError(f"{what} into temporary arrays, which a CUDA graph capture cannot keep: "
                         "pass C-contiguous inputs with at most three unmergeable batch dims")


def _device_id(x, prob):
    return None if prob.xp is numpy else x.device.id


def _into(out, results):
    """``results``, or ``out`` with ``results`` copied into it."""
    if out is None:
        return tuple(results)
    for target, result in zip(out, results):
        target[...] = result
    return out


def _empty(prob) -> bool:
    """No query, no key or no batch entry: nothing to launch (CuPy would run a grid of 0 CTAs as 1)."""
    return prob.Nq == 0 or prob.Nk == 0 or 0 in prob.batch_shape


def _dropout_key(dropout) -> tuple:
    """What a kept plan's key holds of dropout's ``(p, seed)``: p, and whether the seed is a device seed (the
    Hopper forward compiles that in); the seed itself comes with each call."""
    return dropout[0], not isinstance(dropout[1], int)


def _mods(prob, arrays: dict, dbias=None, dropout=(0.0, 0), batch0=0, user=None) -> "_launch.Mods":
    """The ``_launch.Mods`` of a call's validated modifiers: its arrays by flag, the softcap and dropout's
    ``(p, seed)`` (``dbias``: its ``_launch.DbiasBuffer``; ``batch0`` the flat batch index of a peeled
    piece's first entry; ``user`` as ``_gpu_user`` gives it)."""
    dropout_p, device_seed = _dropout_key(dropout)
    on = set(arrays) | {name for name, used in (("softcap", prob.softcap is not None), ("dropout", dropout_p > 0),
                                                ("device_seed", dropout_p > 0 and device_seed),
                                                ("bias_grad", dbias is not None)) if used}
    pairs = [(name, _launch.pair_strides(x)) for name, x in arrays.items() if BY_NAME[name].per == "pair"]
    if dbias is not None:
        pairs.append(("bias_grad", dbias.pair_strides))
    return _launch.Mods(frozenset(on), prob.softcap, dropout_p, tuple(pairs), batch0,
                        *(user or (None, (0,) * MAX_ARGS)))


def _laid_out(arrays: dict) -> dict:
    """The modifiers' arrays as they lay out over the batch dims: a per-entry array (ALiBi slopes, sinks)
    as a batch of 1 x 1 matrices, so that it lays out as the tensors do."""
    return {name: x.reshape(*x.shape, 1, 1) if BY_NAME[name].per == "entry" else x for name, x in arrays.items()}


def _leading_arrays(arrays: dict, index: int, nb: int) -> dict:
    """Entry ``index`` of each modifier array along the leading batch dim (``_leading_entries`` of a
    per-entry one, ``_take_leading`` of a per-pair one)."""
    return {name: (_leading_entries if BY_NAME[name].per == "entry" else _take_leading)(x, index, nb)
            for name, x in arrays.items()}


def _batch_strides(arrays, batch_shape):
    return [_launch.batch_strides(x.shape, _launch.element_strides(x)[:-2], batch_shape) for x in arrays]


def _forward_gpu(q, k, v, arrays, batch_shape, prob, schedule, precision, key=None, out=None, packed=None,
                 offsets=(None, None), dropout=(0.0, 0), batch0=0, user=None, stats_shape=None, kv_splits=1, cached=()):
    """Plan and run; a single launch's plan is kept under ``key`` (``_call_key``) for like calls. ``arrays``
    the modifiers' arrays by flag (``_checked_mods``). With ``packed`` sequences (``_launch.Packed``)
    ``offsets`` are their device offsets; ``dropout`` its ``(p, seed)``; ``batch0`` the flat batch index
    of the first entry (of a peeled piece); ``user`` the expressions (``_gpu_user``); ``stats_shape`` the
    shape of the m, l returned (a folded call's: the caller's; o's is it and D); ``kv_splits`` split-KV's
    count (None: chosen by the plan); ``cached`` a cache's lengths and page table (with ``packed.cache``;
    laid out as the batch dims, as ``_laid_out`` lays out slopes)."""
    nb = len(batch_shape)
    named = {"q": q, "k": k, "v": v, **dict(zip(("lens", "table"), cached)), **_laid_out(arrays)}
    layout = _launch.collapse_batch(batch_shape, _batch_strides(named.values(), batch_shape), tuple(named))
    if layout is not None:
        plan = _launch.forward_plan(q, k, v, schedule=schedule, precision=precision, geometry=prob.geometry,
                                    scale=prob.scale, batch_shape=batch_shape, layout=layout,
                                    mods=_mods(prob, arrays, dropout=dropout, batch0=batch0, user=user),
                                    packed=packed, stats_shape=stats_shape, kv_splits=kv_splits)
        _launch.keep_plan(key, plan)
        return plan(q, k, v, out, arrays, offsets, dropout[1], *cached)
    assert not cached, "a cache's batch dims (B, K/V heads, group) always collapse"
    # more than three batch dims that cannot be merged: peel the leading one
    import cupy

    _refuse_while_capturing("more than three batch dims that cannot be merged are computed piece by piece")

    parts = [_forward_gpu(*(_take_leading(x, i, nb) for x in (q, k, v)), _leading_arrays(arrays, i, nb),
                          batch_shape[1:], prob, schedule, precision, packed=packed, offsets=offsets, dropout=dropout,
                          batch0=batch0 + i * math.prod(batch_shape[1:]), user=user, kv_splits=kv_splits)
             for i in range(batch_shape[0])]
    results = [cupy.stack([p[n] for p in parts]) for n in range(3)]
    if stats_shape is not None:
        results = [x.reshape(shape) for x, shape in zip(results, ((*stats_shape, prob.D), stats_shape, stats_shape))]
    return _into(out, results)


def _leading_entries(values, index, nb):
    """Entry ``index`` of per-entry values (slopes, sinks) along the leading batch dim (their dims
    right-aligned to ``nb``)."""
    if values is None or values.ndim < nb:
        return values
    return values[0] if values.shape[0] == 1 else values[index]


def _take_leading(x, index, nb):
    """Entry ``index`` of the leading broadcast batch dim of ``x`` (its batch dims right-aligned to ``nb``;
    None stays None)."""
    if x is None or x.ndim - 2 < nb:
        return x
    return x[0] if x.shape[0] == 1 else x[index]


def flash_attention_backward(do: Array, q: Array, k: Array, v: Array, o: Array, m: Array, l: Array, *,
                             causal: bool = False, softmax_scale: Optional[float] = None,
                             window: Optional[Window] = None, softcap: Optional[float] = None,
                             alibi_slopes=None, bias=None, mask=None, sink=None, bias_grad: bool = False,
                             dropout_p: float = 0.0, seed: Optional[int] = None, score_mod: Optional[str] = None,
                             score_mod_grad: Optional[str] = None, mask_mod: Optional[str] = None,
                             mod_args: Optional[dict] = None, schedule: str = "auto", precision: str = "highest",
                             deterministic: bool = False, out: Optional[Outputs] = None,
                             block_mask: Optional[BlockMask] = None) -> Outputs:
    """Gradients of exact attention from the forward's outputs (FlashAttention's recomputation backward).

    For callers that keep ``o``, ``m``, ``l`` themselves. Every argument but
    ``do``, ``bias_grad``, ``score_mod_grad``, ``deterministic`` and ``out``
    must be what the forward was given (or returned); nothing can check it, and
    other values give the gradients of another attention without an error.
    ``result.backward(do)`` on the forward's :class:`ForwardResult` passes
    them all itself.

    Parameters
    ----------
    do : ndarray, shape (*batch, Nq, D)
        Gradient of the loss with respect to ``o``; dtype of ``q``.
    q, k, v : ndarray
        The forward's inputs, shapes ``(..., Nq, D)``, ``(..., Nk, D)``,
        ``(..., Nk, D)``.
    o : ndarray, shape (*batch, Nq, D)
        The forward's output.
    m, l : ndarray, shape (*batch, Nq)
        The forward's statistics, float32 (float64 for float64 inputs).
    causal, softmax_scale, window, softcap, alibi_slopes, bias, mask, sink : optional
        As in the forward (the same values the forward was called with). The
        gradients are those of ``softmax_scale · q kᵀ`` through the softcap
        (``dS · (1 − tanh²)``); the slopes get no gradient.
    bias_grad : bool, optional
        Also return ``dbias`` (needs ``bias``).
    dropout_p, seed : optional
        The forward's dropout (the same values): the same pairs are dropped,
        ``dV = (Z ∘ P)ᵀ dO`` and ``dS = P ∘ (Z ∘ dP − D)`` with
        ``Z = keep / (1 − p)``.
    score_mod, mask_mod, mod_args : optional
        The forward's expressions (the same values).
    score_mod_grad : str, optional
        The derivative of ``score_mod`` by ``s``, an expression over the same
        names; required with ``score_mod``. dS is multiplied by it before the
        softcap's derivative.
    schedule : {'auto', 'v1', 'v2'}, optional
        'v1' runs the portable recomputation kernel (below); 'v2' and 'auto'
        run the Hopper warpgroup-MMA kernels for float16/bfloat16 on sm_90
        GPUs (one for D <= 128, one for 128 < D <= 256), and the portable
        kernel everywhere else. All walk FlashAttention-2's loop order (K/V
        tiles outer, dQ accumulated with atomics) and return the same
        gradients up to rounding.
    precision : {'highest', 'tf32'}, optional
        As in the forward, for the backward's products.
    deterministic : bool, optional
        Bitwise-identical gradients run to run. The CTAs that add into one
        sum (``dQ_i`` over the K/V tiles; ``dK_j``, ``dV_j`` over the query
        heads that share a K/V head) then take turns in a fixed order instead
        of racing with float atomics, at a measured cost in speed
        (``benchmarks/RESULTS.md``). A ``dbias`` of a bias that broadcasts is
        then written in full, ``(*batch, Nq, Nk)`` in the accumulator dtype,
        and summed by CuPy (memory of that size for the call). The NumPy
        path is always deterministic.
    out : tuple of three ndarrays, optional
        ``(dq, dk, dv)`` to write into, under the forward's rules for ``out``;
        returned.
    block_mask : BlockMask, optional
        As in :func:`flash_attention_forward` (the backward's kernel has maps
        of its own tiles, kept in the same block mask).

    Returns
    -------
    dq, dk, dv : ndarray
        Exactly the shapes of ``q``, ``k``, ``v`` (summed over the batch dims
        along which an input was broadcast), in the input dtype, C-contiguous.
        Rows that saw no key contribute nothing.
    dbias : ndarray
        With ``bias_grad`` only (after ``dv``, never written into ``out``):
        ``dS = P ∘ (dP − D)``, the gradient of the final scores, summed over
        the dims along which ``bias`` broadcasts; ``bias``'s shape, float32
        (float64 for float64 inputs); 0 for hidden pairs. Without
        ``deterministic`` a bias that broadcasts is summed with float atomics.
    dsink : ndarray
        With ``sink`` only (the last result, never written into ``out``):
        ``−Σ_i exp(sink − m_i) / l_i · D_i`` with ``D_i = rowsum(dO_i ∘ O_i)``,
        summed over the batch dims along which ``sink`` broadcasts; ``sink``'s
        shape, float32 (float64 for float64 inputs).

    Raises
    ------
    TypeError, ValueError
        As in the forward; also ``do``/``o`` of the wrong shape or dtype and
        ``m``/``l`` of the wrong shape or dtype.

    Notes
    -----
    The recomputation backward (``kernels_cu/flash_bwd.cu``, FlashAttention-2's
    loop order): first ``D_i = rowsum(dO_i ∘ O_i)`` (``kernels_cu/flash_bwd_prep.cu``);
    then one CTA per K/V tile recomputes
    ``P_ij = exp(S_ij − m_i) / l_i`` from the saved statistics, accumulates
    ``dK_j``, ``dV_j`` on chip and ``dQ_i`` in a float32 (float64) buffer.
    No N×N matrix is materialised. On sm_90 the Hopper kernels
    (``kernels_cu/flash_bwd_sm90.cu`` for float16/bfloat16 with D <= 128,
    ``flash_bwd_sm90_wide.cu`` above) compute the same products with
    warpgroup MMA, with ``P = exp(S − lse)`` from ``lse = m + log l``.
    NumPy inputs run the blocked NumPy version.

    See Also
    --------
    ForwardResult.backward : this backward of a forward's result, with the forward's arguments.
    cupyflash.reference.attention_backward : the naive float64 reference.
    cupyflash.blocked.backward : the NumPy version (CPU path).
    """
    user, token = (score_mod, score_mod_grad, mask_mod, mod_args), None
    if block_mask is not None:
        user, token = _enter_block_mask(block_mask, q, k, user)
    try:
        return _backward(do, q, k, v, o, m, l, None, causal, softmax_scale, window, softcap, alibi_slopes, sink,
                         schedule, precision, deterministic, out, bias, mask, bias_grad, dropout_p, seed, user)
    finally:
        if token is not None:
            _launch.BLOCK_MAPS.reset(token)


def _backward(do, q, k, v, o, m, l, varlen, causal, softmax_scale, window, softcap, alibi_slopes, sink, schedule,
              precision, deterministic, out, bias=None, mask=None, bias_grad=False, dropout_p=0.0, seed=None,
              user=(None,) * 4):
    """``flash_attention_backward``, or with ``varlen`` (as in ``_forward``) ``flash_attention_varlen_backward``:
    ``_gradients``, with dbias in the shape of the bias given (read as (1, Nk) where 1-D)."""
    grads = _gradients(do, q, k, v, o, m, l, varlen, causal, softmax_scale, window, softcap, alibi_slopes, sink,
                       schedule, precision, deterministic, out, bias, mask, bias_grad, dropout_p, seed, user)
    if bias_grad:   # validated by _gradients
        grads = (*grads[:3], grads[3].reshape(numpy.shape(bias)), *grads[4:])
    return grads


def _gradients(do, q, k, v, o, m, l, varlen, causal, softmax_scale, window, softcap, alibi_slopes, sink, schedule,
               precision, deterministic, out, bias, mask, bias_grad, dropout_p, seed, user):
    """dq, dk, dv (dbias, dsink where asked) of ``_backward``'s call."""
    dropout = check_dropout(dropout_p, seed, q)
    expressions = user_mods(*user, backward=True)
    arrays = call_arrays(alibi_slopes=alibi_slopes, sink=sink, bias=bias, mask=mask)
    inputs = _with_arrays({"do": do, "q": q, "k": k, "v": v, "o": o, "m": m, "l": l}, arrays)
    mod_key = _mod_args_key(user[3])
    flags = (causal, softmax_scale, window, softcap, schedule, precision, deterministic, bias_grad,
             *_dropout_key(dropout), tuple(arrays), *user[:3], mod_key)
    offsets, flags = _with_offsets(inputs, flags, varlen)
    plan, key = _kept_plan(inputs, out, BACKWARD_OUTPUTS, flags, _plan_keepable(varlen) and mod_key is not None)
    if plan is not None:
        return _with_sink_grad(plan(do, q, k, v, o, m, l, out, arrays, offsets, dropout[1]), m, l, arrays.get("sink"))
    prob = with_softcap(check_backward(do, q, k, v, o, m, l, causal, softmax_scale, window), softcap)
    check_choice("schedule", schedule, SCHEDULES)
    check_choice("precision", precision, PRECISIONS)
    deterministic = check_bool("deterministic", deterministic)
    bias_grad = check_bool("bias_grad", bias_grad)
    if bias_grad and bias is None:
        raise ValueError("bias_grad=True needs a bias")
    gpu_user, _kept_alive = _gpu_user(expressions, prob, q)
    arrays, key = _checked_mods(prob, q, key, arrays)
    seqs, key = _seqlens(varlen, prob, q, key)
    if out is not None:
        out = check_out(out, BACKWARD_OUTPUTS, (q.shape, k.shape, v.shape), (prob.dtype,) * 3, prob.xp,
                        _device_id(q, prob), inputs)
    fold_ok = foldable(prob, (*arrays.values(), expressions, seqs), dropout[0])
    if prob.xp is numpy:
        kw = dict(causal=prob.causal, softmax_scale=prob.scale, window=prob.window, softcap=prob.softcap,
                  **_by_argument(arrays), bias_grad=bias_grad, dropout_p=dropout[0], seed=dropout[1],
                  score_mod=user[0], score_mod_grad=user[1], mask_mod=user[2], mod_args=user[3])
        fold = fold_of(prob.batch_shape, q, k, v, do, o) if fold_ok else None
        if seqs is not None:
            grads = blocked.varlen_backward(do, q, k, v, o, m, l, seqs.cu_q, seqs.cu_k, **kw)
        elif fold is not None:   # the same rows, in fewer and longer matrices
            grads = blocked.backward(fold.rows(do), fold.rows(q), fold.keys(k), fold.keys(v), fold.rows(o),
                                     fold.stats(m), fold.stats(l), **dict(kw, causal=fold.problem(prob).causal))
            grads = tuple(g.reshape(x.shape) for g, x in zip(grads, (q, k, v)))
        else:
            grads = blocked.backward(do, q, k, v, o, m, l, **kw)
        return (*_into(out, grads[:3]), *grads[3:])
    import cupy

    with q.device:
        if _empty(prob):
            if out is None:
                out = tuple(cupy.empty(x.shape, prob.dtype) for x in (q, k, v))
            for x in out:
                x.fill(0)
            if bias_grad:
                out = (*out, cupy.zeros(arrays["bias"].shape, m.dtype))
            return _with_sink_grad(out, m, l, arrays.get("sink"), (do, o))
        ready, key = _kernel_ready((do, q, k, v, o), key)
        kernel = _launch.backward_kernel(schedule, prob.dtype, prob.D, prob.scale)
        fold = _gpu_fold(prob, ready[1:4], (ready[0], ready[4]), kernel, backward=True) if fold_ok else None
        if fold is not None:   # packed GQA: dK, dV of a group in one CTA, no sums across heads (_fold.py)
            fprob = fold.problem(prob)
            do_f, q_f, k_f, v_f, o_f = fold.rows(ready[0]), fold.rows(ready[1]), *map(fold.keys, ready[2:4]), \
                fold.rows(ready[4])
            return _backward_gpu(do_f, q_f, k_f, v_f, o_f, fold.stats(m), fold.stats(l), {},
                                 fprob.batch_shape, fprob, schedule, precision, deterministic, key, out,
                                 grad_shapes=(q.shape, k.shape, v.shape))
        grads = _backward_gpu(*ready, m, l, arrays, prob.batch_shape, prob, schedule, precision, deterministic, key,
                              out, *_packed(seqs), bias_grad=bias_grad, dropout=dropout, user=gpu_user)
        return _with_sink_grad(grads, m, l, arrays.get("sink"))


def _with_sink_grad(grads, m, l, sinks, do_o=None):
    """``grads``, and with ``sinks`` the sinks' gradient in place of the rows' ``D_i`` that end them (the
    backward plan's, ``BackwardPlan.row_sums``; formed from ``do_o = (do, o)`` where given instead):
    ``dsink = -sum_i exp(sink - m_i) / l_i · D_i``, ``D_i = rowsum(dO_i o O_i)``, summed to the sinks' shape
    (one elementwise kernel and one sum over the rows, on the call's stream)."""
    if sinks is None:
        return grads
    import cupy

    if do_o is None:
        *grads, D = grads                                                                       # (*batch, Nq)
    else:
        do, o = (x.astype(m.dtype, copy=False) for x in do_o)
        D = cupy.einsum("...d,...d->...", do, o)
    s = cupy.broadcast_to(sinks, m.shape[:-1])[..., None]                                       # (*batch, 1)
    return (*grads, unbroadcast(-_sink_terms()(m, l, D, s).sum(axis=-1), sinks.shape))


@lru_cache(maxsize=None)
def _sink_terms():
    """``P_sink,i D_i`` per row, as the reference forms it: ``exp(sink - m_i) · (1 / l_i) · D_i``, with
    ``1 / l_i`` read as 0 where ``l_i = 0`` and ``m_i = -inf`` as 0 (a row of no key and no sink); CuPy's
    elementwise kernel, broadcasting the sink over the rows."""
    import cupy

    return cupy.ElementwiseKernel(
        "T m, T l, T d, S s", "T t",
        "t = exp((T)s - (isinf(m) && m < (T)0 ? (T)0 : m)) * (l == (T)0 ? (T)0 : (T)1 / l) * d",
        "cupyflash_sink_terms")


def _backward_gpu(do, q, k, v, o, m, l, arrays, batch_shape, prob, schedule, precision, deterministic, key=None,
                  out=None, packed=None, offsets=(None, None), bias_grad=False, dropout=(0.0, 0), batch0=0, user=None,
                  grad_shapes=None):
    """Plan and run; a single plan is kept under ``key`` (``_call_key``) for like calls; ``arrays``,
    ``packed``, ``offsets``, ``dropout``, ``batch0``, ``user`` as in ``_forward_gpu``; ``bias_grad``: dbias
    too (after dv); ``grad_shapes`` the shapes of the dq, dk, dv returned (a folded call's: the caller's)."""
    nb = len(batch_shape)
    own = [_launch.contiguous_strides(x.shape)[:-2] for x in (q, k, v)]
    laid = _laid_out(arrays)
    names = ["q", "k", "v", "o", "do", "dq", "dk", "dv", *laid]
    strides = _batch_strides((q, k, v, o, do), batch_shape)
    strides += [_launch.batch_strides(x.shape, s, batch_shape) for x, s in zip((q, k, v), own)]
    strides += _batch_strides(laid.values(), batch_shape)
    dbias = None
    if bias_grad:
        dbias = _launch.dbias_buffer(arrays["bias"].shape, batch_shape, q.shape[-2], k.shape[-2], deterministic)
        if dbias.to is not None:
            _refuse_while_capturing("a deterministic dbias of a broadcast bias is summed")
        strides.append(_launch.batch_strides(dbias.shape, _launch.contiguous_strides(dbias.shape)[:-2], batch_shape))
        names.append("bias_grad")
    layout = _launch.collapse_batch(batch_shape, strides, names)
    if layout is not None:
        plan = _launch.backward_plan(do, q, k, v, o, schedule=schedule, precision=precision, geometry=prob.geometry,
                                     scale=prob.scale, deterministic=deterministic, layout=layout,
                                     mods=_mods(prob, arrays, dbias, dropout, batch0, user),
                                     packed=packed, dbias=dbias, grad_shapes=grad_shapes)
        _launch.keep_plan(key, plan)
        return plan(do, q, k, v, o, m, l, out, arrays, offsets, dropout[1])
    # peel the leading batch dim; a gradient is summed where its input broadcast along it
    import cupy

    _refuse_while_capturing("more than three batch dims that cannot be merged are computed piece by piece")

    parts = [_backward_gpu(do[i], *(_take_leading(x, i, nb) for x in (q, k, v)), o[i], m[i], l[i],
                           _leading_arrays(arrays, i, nb), batch_shape[1:], prob, schedule, precision, deterministic,
                           packed=packed, offsets=offsets, bias_grad=bias_grad, dropout=dropout,
                           batch0=batch0 + i * math.prod(batch_shape[1:]), user=user)
             for i in range(batch_shape[0])]
    grads = []
    for n, x in enumerate((q, k, v, arrays["bias"]) if bias_grad else (q, k, v)):
        g = [p[n] for p in parts]
        if x.ndim - 2 < nb:
            grads.append(sum(g[1:], g[0]))
        elif x.shape[0] == 1:
            grads.append(sum(g[1:], g[0])[None])
        else:
            grads.append(cupy.stack(g))
    if "sink" in arrays:   # each piece's rows' D_i (BackwardPlan.row_sums), laid out as m
        grads.append(cupy.stack([p[-1] for p in parts]))
    if grad_shapes is not None:
        grads[:3] = [g.reshape(shape) for g, shape in zip(grads[:3], grad_shapes)]
    return (*_into(out, grads[:3]), *grads[3:])


def flash_attention(q: Array, k: Array, v: Array, *, causal: bool = False, softmax_scale: Optional[float] = None,
                    window: Optional[Window] = None, softcap: Optional[float] = None, alibi_slopes=None,
                    bias=None, mask=None, sink=None, dropout_p: float = 0.0, seed: Optional[int] = None,
                    score_mod: Optional[str] = None, mask_mod: Optional[str] = None, mod_args: Optional[dict] = None,
                    schedule: str = "auto", precision: str = "highest",
                    block_mask: Optional[BlockMask] = None) -> Array:
    """Exact attention ``softmax(softmax_scale · q kᵀ) v``; the ``o`` of :func:`flash_attention_forward`.

    Parameters
    ----------
    q, k, v, causal, softmax_scale, window, softcap, alibi_slopes, bias, mask, sink, dropout_p, seed, score_mod,
    mask_mod, mod_args, schedule, precision, block_mask
        As in :func:`flash_attention_forward`.

    Returns
    -------
    o : ndarray, shape (*batch, Nq, D)

    See Also
    --------
    flash_attention_forward : also returns the statistics ``m`` and ``l``.
    """
    return flash_attention_forward(q, k, v, causal=causal, softmax_scale=softmax_scale, window=window,
                                   softcap=softcap, alibi_slopes=alibi_slopes, bias=bias, mask=mask, sink=sink,
                                   dropout_p=dropout_p, seed=seed, score_mod=score_mod, mask_mod=mask_mod,
                                   mod_args=mod_args, schedule=schedule, precision=precision,
                                   block_mask=block_mask)[0]


def flash_attention_varlen_forward(q: Array, k: Array, v: Array, cu_seqlens_q: Array, cu_seqlens_k: Array, *,
                                   max_seqlen_q: Optional[int] = None, max_seqlen_k: Optional[int] = None,
                                   causal: bool = False, softmax_scale: Optional[float] = None,
                                   window: Optional[Window] = None, softcap: Optional[float] = None,
                                   alibi_slopes=None, bias=None, mask=None, sink=None, dropout_p: float = 0.0,
                                   seed: Optional[int] = None, score_mod: Optional[str] = None,
                                   mask_mod: Optional[str] = None, mod_args: Optional[dict] = None,
                                   schedule: str = "auto", precision: str = "highest",
                                   num_splits: Optional[int] = None,
                                   out: Optional[Outputs] = None) -> ForwardResult:
    """Exact attention over packed variable-length sequences, with its softmax statistics.

    Parameters
    ----------
    q : ndarray, shape (..., total_q, D)
        The queries of every sequence, one after another along the rows.
    k, v : ndarray, shape (..., total_k, D)
        The keys and values, packed the same way. dtypes, head dims and
        batch dims (broadcast, GQA) as in :func:`flash_attention_forward`.
    cu_seqlens_q, cu_seqlens_k : ndarray of int, shape (n_seq + 1,)
        Sequence ``s`` is the query rows ``cu_seqlens_q[s] .. cu_seqlens_q[s+1] - 1``
        and the key rows ``cu_seqlens_k[s] .. cu_seqlens_k[s+1] - 1``; it sees
        only its own keys. 0 first, nondecreasing, ``total_q``/``total_k``
        last (a sequence may be empty). NumPy or CuPy (for CuPy inputs);
        read as int32.
    max_seqlen_q, max_seqlen_k : int, optional
        Bounds of the sequences' lengths (FlashAttention's ``max_seqlen``),
        which size the GPU grid. Omitted, they are read from the offsets:
        for CuPy offsets that is a copy to the host, which waits for the
        stream. With CuPy offsets and both bounds given nothing is copied
        and **the offsets' values are not checked** (a bound below a
        sequence's length leaves its extra rows unwritten, offsets out of
        order read out of bounds); everywhere else they are checked.
    causal, window
        Applied per sequence, bottom-right aligned in each (``off = Nk_s −
        Nq_s`` of sequence ``s``).
    softmax_scale, softcap, alibi_slopes, sink, schedule, precision, num_splits, out
        As in :func:`flash_attention_forward` (ALiBi distances are per
        sequence; slopes and sinks are per batch entry, shared by its
        sequences).
    bias, mask : ndarray, optional
        As in :func:`flash_attention_forward` over the packed pairs:
        broadcastable to ``(*batch, total_q, total_k)``; sequence ``s``
        reads the block of its own rows and keys (pairs between two
        sequences are never read).
    dropout_p, seed
        As in :func:`flash_attention_forward` over the packed query rows and
        each sequence's own keys: sequence ``s`` keeps its pair ``(i, j)``
        where ``dropout_mask(seed, p, batch, total_q, n_k)`` keeps pair
        ``(cu_seqlens_q[s] + i, j)``.
    score_mod, mask_mod, mod_args
        As in :func:`flash_attention_forward`, per sequence: ``q_idx``,
        ``kv_idx`` are the pair's positions in its sequence.

    Returns
    -------
    result : ForwardResult
        The tuple ``(o, m, l)`` of the arrays below, holding this call's
        inputs, offsets and keywords by reference: ``result.backward(do)``
        is :func:`flash_attention_varlen_backward` of this very call.
    o : ndarray, shape (*batch, total_q, D)
    m, l : ndarray, shape (*batch, total_q)
        Each sequence's rows as :func:`flash_attention_forward` gives them
        for that sequence alone (a query sequence with no keys: ``o = 0,
        m = −inf, l = 0``).

    Raises
    ------
    TypeError, ValueError
        As in :func:`flash_attention_forward`; also offsets that are not
        1-D integer arrays of one length, that do not start at 0, decrease
        or end elsewhere than at the packed lengths (where they are read),
        a ``max_seqlen_*`` that is not an int or lies below the longest
        sequence, CuPy offsets for NumPy inputs.

    Notes
    -----
    Every kernel of :func:`flash_attention_forward` takes packed sequences
    (a run-time word of its parameters; the Hopper kernels compile them in,
    ``FLASH_VARLEN``): the grid covers the longest
    sequence's tiles for every (batch entry, sequence) and each CTA works
    inside one sequence, so the cost follows each sequence's own pairs.
    NumPy inputs run the blocked CPU path one sequence at a time.

    See Also
    --------
    cupyflash.reference.attention_varlen_forward : the naive float64 reference.
    """
    outputs = _forward(q, k, v, (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k), causal, softmax_scale,
                       window, softcap, alibi_slopes, sink, schedule, precision, out, bias, mask, dropout_p, seed,
                       (score_mod, None, mask_mod, mod_args), num_splits)
    return ForwardResult(outputs, flash_attention_varlen_backward, (q, k, v), (cu_seqlens_q, cu_seqlens_k),
                         VARLEN_BACKWARD_KEYWORDS,
                         (max_seqlen_q, max_seqlen_k, causal, softmax_scale, window, softcap, alibi_slopes, bias, mask,
                          sink, dropout_p, seed, score_mod, mask_mod, mod_args, schedule, precision))


def flash_attention_varlen_backward(do: Array, q: Array, k: Array, v: Array, o: Array, m: Array, l: Array,
                                    cu_seqlens_q: Array, cu_seqlens_k: Array, *, max_seqlen_q: Optional[int] = None,
                                    max_seqlen_k: Optional[int] = None, causal: bool = False,
                                    softmax_scale: Optional[float] = None, window: Optional[Window] = None,
                                    softcap: Optional[float] = None, alibi_slopes=None, bias=None, mask=None,
                                    sink=None, bias_grad: bool = False, dropout_p: float = 0.0,
                                    seed: Optional[int] = None, score_mod: Optional[str] = None,
                                    score_mod_grad: Optional[str] = None, mask_mod: Optional[str] = None,
                                    mod_args: Optional[dict] = None, schedule: str = "auto", precision: str = "highest",
                                    deterministic: bool = False, out: Optional[Outputs] = None) -> Outputs:
    """Gradients of attention over packed variable-length sequences.

    As in :func:`flash_attention_backward`, every argument but ``do``,
    ``bias_grad``, ``score_mod_grad``, ``deterministic`` and ``out`` must be
    the forward's, unchecked; ``result.backward(do)`` on the result of
    :func:`flash_attention_varlen_forward` passes them itself.

    Parameters
    ----------
    do, o : ndarray, shape (*batch, total_q, D)
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k
        As in :func:`flash_attention_varlen_forward` (the same values).
    m, l : ndarray, shape (*batch, total_q)
        The forward's statistics.
    causal, softmax_scale, window, softcap, alibi_slopes, bias, mask, sink, bias_grad, dropout_p, seed, score_mod,
    score_mod_grad, mask_mod, mod_args, schedule, precision, deterministic, out
        As in :func:`flash_attention_backward` (``bias``, ``mask`` and the
        expressions' ``q_idx``, ``kv_idx`` as in
        :func:`flash_attention_varlen_forward`).

    Returns
    -------
    dq, dk, dv : ndarray
        Of the shapes of ``q``, ``k``, ``v``: each sequence's rows as
        :func:`flash_attention_backward` gives them for that sequence alone.
    dbias : ndarray
        With ``bias_grad`` only: of ``bias``'s shape (pairs between two
        sequences get 0).
    dsink : ndarray
        With ``sink`` only, summed over the sequences (and broadcast dims).

    Raises
    ------
    TypeError, ValueError
        As in :func:`flash_attention_backward` and
        :func:`flash_attention_varlen_forward`.

    See Also
    --------
    ForwardResult.backward : this backward of a forward's result, with the forward's arguments.
    cupyflash.reference.attention_varlen_backward : the naive float64 reference.
    """
    return _backward(do, q, k, v, o, m, l, (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k), causal,
                     softmax_scale, window, softcap, alibi_slopes, sink, schedule, precision, deterministic, out, bias,
                     mask, bias_grad, dropout_p, seed, (score_mod, score_mod_grad, mask_mod, mod_args))


def dropout_mask(seed: int, p: float, batch_shape, n_q: int, n_k: int, *, xp=numpy) -> Array:
    """The pairs that dropout with probability ``p`` under ``seed`` keeps.

    Parameters
    ----------
    seed : int or array
        In ``[0, 2⁶⁴)`` (any value when ``p == 0``), or an array holding it as the forward takes it.
    p : float
        ``0 <= p < 1``.
    batch_shape : tuple of int
        The broadcast batch shape of the call; entries are counted in C order.
    n_q, n_k : int
        Query rows and keys.
    xp : module, optional
        ``numpy`` (default) or ``cupy``: where the mask is made (CuPy draws it on the current device
        with the kernels' own generator, ``kernels_cu/philox.cuh``).

    Returns
    -------
    keep : ndarray of bool, shape (*batch_shape, n_q, n_k)
        Pair ``(i, j)`` of flat batch entry ``b`` is kept iff word ``j % 4`` of Philox4x32-10 at
        counter ``(j // 4, i, b mod 2³², b >> 32)`` under key ``(seed mod 2³², seed >> 32)`` is at least
        ``round(p · 2³²)`` (``cupyflash._philox``): the set :func:`flash_attention_forward` and
        :func:`flash_attention_backward` keep with ``dropout_p=p, seed=seed``, on any kernel.
    """
    p, seed = check_dropout(p, seed)
    seed = seed_value(seed)
    shape = (*tuple(int(n) for n in batch_shape), int(n_q), int(n_k))
    if xp is numpy:
        from ._philox import dropout_keep

        return dropout_keep(seed, p, shape[:-2], n_q, n_k)
    from ._philox import keep_threshold

    keep = xp.empty(shape, dtype=bool)
    if keep.size:
        _keep_kernel()(numpy.uint32(n_q), numpy.uint32(n_k), numpy.uint64(seed), numpy.uint32(keep_threshold(p)),
                       keep)
    return keep


_KEEP_BODY = """
const unsigned long long key = (unsigned long long)i % n_k, rest = (unsigned long long)i / n_k;
const unsigned long long b = rest / n_q;
const Words4 r = philox4x32((unsigned)(key >> 2), (unsigned)(rest % n_q), (unsigned)b, (unsigned)(b >> 32),
                            (unsigned)seed, (unsigned)(seed >> 32));
const unsigned w = (unsigned)(key & 3);
keep = ((w & 2) ? ((w & 1) ? r.w[3] : r.w[2]) : ((w & 1) ? r.w[1] : r.w[0])) >= threshold;
"""


def _keep_kernel():
    """The CuPy elementwise kernel of ``dropout_mask`` (one per process), on ``philox.cuh``."""
    global _KEEP_KERNEL
    if _KEEP_KERNEL is None:
        import cupy

        from ._compile import kernel_dir

        _KEEP_KERNEL = cupy.ElementwiseKernel("uint32 n_q, uint32 n_k, uint64 seed, uint32 threshold", "bool keep",
                                              _KEEP_BODY, "cupyflash_dropout_keep",
                                              preamble=(kernel_dir() / "philox.cuh").read_text())
    return _KEEP_KERNEL


_KEEP_KERNEL = None
