"""cupyflash from PyTorch: attention as an autograd function on torch tensors, with no copies.

    from cupyflash.torch import flash_attention
    o = flash_attention(q, k, v, causal=True)                    # q, k, v (B, H, N, D), as torch SDPA
    o = flash_attention(q, k, v, causal=True, layout="bnhd")     # (B, N, H, D), as flash_attn_func
    o = flash_attention_with_kvcache(q, k_cache, v_cache, lens, k, v)   # decoding; k, v appended in place
    o = flash_attention_fp8(q8, k8, v8, v_descale=0.5, causal=True)   # torch.float8_e4m3fn in, bfloat16 out

The bridge, per call, and why it costs little host time:

- **Views.** Each tensor is read by the kernels as a CuPy array built over its memory
  (``cupy.ndarray`` on a ``cupy.cuda.UnownedMemory``): no DLPack capsule, no copy. The layouts are
  such views: ``bnhd`` is the ``(B, H, N, D)`` view of a ``(B, N, H, D)`` tensor, GQA splits q's head
  axis into ``(H_kv, G)`` and gives k, v a broadcast axis of size 1 (cupyflash sums dK, dV over it).
  How each tensor is viewed is settled once per layout, shapes, strides, dtype and device (``_Plan``,
  kept in ``_PLANS``); the arrays of q, k, v, o, m, l, do and the gradients are kept by address
  (``_views.device_view``, holding no tensor), the modifiers' made per call (holding theirs).
- **Outputs.** ``o``, the statistics ``m``, ``l`` and the gradients are allocated by torch (its
  caching allocator) and passed to cupyflash as ``out=``.
- **Streams.** The kernels run on torch's current stream of the tensors' device, through a
  ``cupy.cuda.ExternalStream`` kept per (device, stream); nothing synchronises. cupyflash's own
  workspaces (the backward's float32 sums, a few counters) come from CuPy's memory pool, on that
  stream.

CPU tensors run cupyflash's NumPy path on NumPy views of the same memory (the same views, outputs
and checks), so the module works, and is tested, without a GPU.

This module imports torch; ``import cupyflash`` does not import it. CuPy is imported at the first
call on CUDA tensors.
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Optional

import ml_dtypes
import numpy
import torch
import torch.autograd.function

from . import _views, api, float8, kvcache

__all__ = ["flash_attention", "flash_attention_varlen", "flash_attention_with_kvcache", "flash_attention_fp8"]

LAYOUTS = ("bhnd", "bnhd")
# the axes of a torch tensor in the order the kernels read it: (batch..., heads, rows, D)
KERNEL_ORDER = {"bhnd": (0, 1, 2, 3), "bnhd": (0, 2, 1, 3), "varlen": (1, 0, 2)}
HEAD_AXIS = {"bhnd": 1, "bnhd": 1, "varlen": 0}   # of the kernel order

# torch dtype -> the NumPy dtype cupyflash reads (bfloat16 is ml_dtypes', as in cupyflash itself)
DTYPES = {torch.float16: numpy.dtype(numpy.float16), torch.bfloat16: numpy.dtype(ml_dtypes.bfloat16),
          torch.float32: numpy.dtype(numpy.float32), torch.float64: numpy.dtype(numpy.float64)}
# the statistics m, l (and sinks, slopes, dbias) are float32, float64 for float64 inputs
STATS_DTYPES = {torch.float16: torch.float32, torch.bfloat16: torch.float32, torch.float32: torch.float32,
                torch.float64: torch.float64}
EXTRA_DTYPES = {**DTYPES, torch.bool: numpy.dtype(numpy.bool_)}   # a mask is bool
# a seed tensor (a device seed): its dtype -> (the words cupyflash reads, how many)
SEED_DTYPES = {torch.int64: (numpy.dtype(numpy.uint64), 1), torch.int32: (numpy.dtype(numpy.uint32), 2)}

MAX_KEPT = 256   # plans and streams kept before their caches start over
MAX_HEAD_DIM = 256   # cupyflash's; the gradient through lse adds a column to D (_gradients_through_lse)


# ---------------------------------------------------------------------------------------------------
# Views: a tensor's memory as an array of given shape and strides

class _View:
    """How the kernels read a tensor: as an array of NumPy ``dtype`` with ``shape`` and ``strides`` (bytes),
    starting ``offset`` bytes into the tensor's memory and spanning ``nbytes`` bytes."""

    __slots__ = ("shape", "strides", "dtype", "offset", "nbytes")

    def __init__(self, shape, strides, dtype: numpy.dtype, offset: int = 0):
        itemsize = dtype.itemsize
        self.shape = tuple(shape)
        self.strides = tuple(s * itemsize for s in strides)
        self.dtype, self.offset = dtype, offset
        self.nbytes = 0 if 0 in self.shape else sum((n - 1) * s for n, s in zip(self.shape, self.strides)) + itemsize


def _contiguous(shape) -> list:
    """C-order element strides of ``shape``."""
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return strides[::-1]


def _output_strides(shape, order) -> tuple:
    """Torch strides of an output of torch ``shape`` that is C-contiguous in the kernel ``order``."""
    kernel = _contiguous([shape[i] for i in order])
    strides = [0] * len(shape)
    for position, axis in enumerate(order):
        strides[axis] = kernel[position]
    return tuple(strides)


def _split_heads(shape, strides, axis: int, kv_heads: int, group: int, query_side: bool):
    """``shape``, ``strides`` (lists, kernel order) with the head axis split into (H_kv, G) for GQA: q's
    (and o's, m's, l's) ``H = H_kv·G`` heads as a view, k's (v's) ``H_kv`` heads with a broadcast axis of
    size 1 after them (stride 0). Unchanged when every head has its own K/V head (``group == 1``)."""
    if group == 1:
        return list(shape), list(strides)
    s = strides[axis]
    heads = [kv_heads, group] if query_side else [kv_heads, 1]
    steps = [group * s, s] if query_side else [s, 0]
    return shape[:axis] + heads + shape[axis + 1:], strides[:axis] + steps + strides[axis + 1:]


class _Host:
    """A tensor's CPU memory seen by NumPy through ``__array_interface__`` (it holds the tensor)."""

    __slots__ = ("__array_interface__", "tensor")

    def __init__(self, tensor, view: _View):
        self.tensor = tensor
        self.__array_interface__ = {"data": (tensor.data_ptr() + view.offset, False), "shape": view.shape,
                                    "strides": view.strides, "typestr": f"<u{view.dtype.itemsize}", "version": 3}


def _host_array(tensor, view: _View, device=None):
    """A NumPy array over the memory of CPU ``tensor`` (it holds the tensor): no copy."""
    return numpy.asarray(_Host(tensor, view)).view(view.dtype)


_CUPY = None   # what a call uses of CuPy, looked up once it is imported (_cupy)


def _cupy():
    global _CUPY
    if _CUPY is None:
        import cupy

        _CUPY = SimpleNamespace(ExternalStream=cupy.cuda.ExternalStream, Device=cupy.cuda.Device,
                                getDevice=cupy.cuda.runtime.getDevice, setDevice=cupy.cuda.runtime.setDevice,
                                ctxGetCurrent=cupy.cuda.driver.ctxGetCurrent)
    return _CUPY


def _held_array(tensor, view: _View, device: int):
    """A CuPy array over the memory of CUDA ``tensor`` on ``device`` (it holds the tensor): no copy."""
    return _views.view(tensor.data_ptr() + view.offset, view.nbytes, view.shape, view.dtype, view.strides, device,
                       tensor)


def _device_array(tensor, view: _View, device: int):
    """A CuPy array over the memory of CUDA ``tensor`` (which the caller holds for the call): no copy, kept
    by address and view (``_views.device_view``)."""
    return _views.device_view(tensor.data_ptr() + view.offset, view.nbytes, view.shape, view.dtype, view.strides,
                              device)


# ---------------------------------------------------------------------------------------------------
# Streams: torch's current stream as CuPy's, for the length of a call

_STREAMS: dict = {}
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)   # (device) -> cudaStream_t, as an int


def _current_stream(device: int):
    """A ``cupy.cuda.ExternalStream`` of torch's current stream on ``device``, kept per (device, stream)."""
    ptr = _raw_stream(device) if _raw_stream is not None else torch.cuda.current_stream(device).cuda_stream
    stream = _STREAMS.get((device, ptr))
    if stream is None:
        if len(_STREAMS) >= MAX_KEPT:
            _STREAMS.clear()
        stream = _STREAMS[(device, ptr)] = _cupy().ExternalStream(ptr, device)
    return stream


class _NoStream:
    """The context of a NumPy call: none."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _OnDevice:
    """``stream`` current on ``device``, made the current device for the while: a call on tensors of
    another device than the current one."""

    def __init__(self, device: int, stream):
        self.device, self.stream = _CUPY.Device(device), stream

    def __enter__(self):
        self.device.__enter__()
        return self.stream.__enter__()

    def __exit__(self, *exc):
        self.stream.__exit__(*exc)
        return self.device.__exit__(*exc)


_NO_STREAM = _NoStream()


def _torch_stream(device):
    """The context that makes torch's current stream on ``device`` CuPy's current stream (and ``device``
    the current device); none for NumPy calls (``device`` None)."""
    if device is None:
        return _NO_STREAM
    stream = _current_stream(device)
    if not _CUPY.ctxGetCurrent():
        # no CUDA context current on this thread (torch's autograd thread, whose backward may make no
        # runtime call of CuPy's before a kernel loads through the driver): the device's primary one
        _CUPY.setDevice(device)
    return stream if _CUPY.getDevice() == device else _OnDevice(device, stream)


# ---------------------------------------------------------------------------------------------------
# Plans: how one geometry of q, k, v is viewed and which outputs it gets

class _Plan:
    """Everything of a call that depends only on the layout, shapes, strides, dtype and device of q, k, v,
    validated once: their views, and the outputs' torch shapes, strides and views.

    The kernel order of a tensor is ``(batch..., H, rows, D)`` (``KERNEL_ORDER``); outputs are
    C-contiguous in it, and shaped (strided) as their input in torch's order. ``m`` and ``l`` share one
    allocation, ``l`` at a 16-byte boundary (``stats``), which the backward reads back.
    """

    def __init__(self, layout: str, q, k, v):
        self.layout = layout
        varlen = layout == "varlen"
        rank = 3 if varlen else 4
        expect = {"bhnd": "(B, H, N, D)", "bnhd": "(B, N, H, D)", "varlen": "(total, H, D)"}[layout]
        for name, x in (("q", q), ("k", k), ("v", v)):
            if x.dim() != rank:
                raise ValueError(f"{name} must have shape {expect} (layout={layout!r}), got {tuple(x.shape)}")
        if q.dtype not in DTYPES or len({q.dtype, k.dtype, v.dtype}) > 1:
            raise TypeError(f"q, k, v must share one dtype of {', '.join(str(d) for d in DTYPES)}; got "
                            f"q {q.dtype}, k {k.dtype}, v {v.dtype}")
        if len({q.device, k.device, v.device}) > 1 or q.device.type not in ("cpu", "cuda"):
            raise ValueError(f"q, k, v must lie on one CUDA device or the CPU, got {q.device}, {k.device}, {v.device}")
        if tuple(k.shape) != tuple(v.shape):
            raise ValueError(f"k and v must have one shape, got k {tuple(k.shape)}, v {tuple(v.shape)}")
        order, axis = KERNEL_ORDER[layout], HEAD_AXIS[layout]
        kq = [q.shape[i] for i in order]   # (batch..., H, Nq, D)
        kk = [k.shape[i] for i in order]
        heads, kv_heads = kq[axis], kk[axis]
        if kq[:axis] != kk[:axis] or kq[-1] != kk[-1] or kv_heads == 0 or heads % kv_heads:
            raise ValueError(f"q {tuple(q.shape)} and k, v {tuple(k.shape)} {expect} must share the batch size "
                             "and D, and q's heads must be a multiple of k's and v's (GQA)")
        self.order, self.axis, self.kv_heads, self.group = order, axis, kv_heads, heads // kv_heads
        self.device = q.get_device() if q.is_cuda else None
        self.torch_device, self.dtype, self.stats_dtype = q.device, q.dtype, STATS_DTYPES[q.dtype]
        self.array = _host_array if self.device is None else _device_array   # the views a call makes
        self.held = _host_array if self.device is None else _held_array      # the modifiers' views
        dtype, stats = DTYPES[q.dtype], DTYPES[self.stats_dtype]
        self.q, self.k, self.v = self.view(q.shape, q.stride(), True, dtype), \
            self.view(k.shape, k.stride(), False, dtype), self.view(v.shape, v.stride(), False, dtype)
        self.o_shape, self.o_strides, self.o = self._output(q.shape, True, dtype)      # o and dq
        self.dk_shape, self.dk_strides, self.dk = self._output(k.shape, False, dtype)  # dk and dv
        # m and l, (batch..., H, Nq) each, in one allocation: l from a 16-byte boundary (cupyflash's out=)
        self.stats_shape = tuple(kq[:-1])
        self.stats_size = math.prod(self.stats_shape)
        per_line = 16 // stats.itemsize
        self.l_start = -(-self.stats_size // per_line) * per_line
        shape, strides = _split_heads(kq[:-1], _contiguous(kq[:-1]), axis, kv_heads, self.group, True)
        self.m = _View(shape, strides, stats)
        self.l = _View(shape, strides, stats, self.l_start * stats.itemsize)
        self._do_views: dict = {}

    def view(self, shape, strides, query_side: bool, dtype) -> _View:
        """The view of a tensor of torch ``shape`` and ``strides`` in kernel order, heads split for GQA."""
        order = self.order
        return _View(*_split_heads([shape[i] for i in order], [strides[i] for i in order], self.axis, self.kv_heads,
                                   self.group, query_side), dtype)

    def _output(self, shape, query_side: bool, dtype):
        """(torch shape, torch strides, view) of an output of an input's ``shape``, C-contiguous in kernel order."""
        strides = _output_strides(shape, self.order)
        return tuple(shape), strides, self.view(shape, strides, query_side, dtype)

    def do_view(self, do) -> _View:
        """The view of the output's gradient ``do`` (or of another tensor of o's shape), of whatever strides
        autograd hands the backward."""
        key = do.stride()
        view = self._do_views.get(key)
        if view is None:
            view = self._do_views[key] = self.view(do.shape, key, True, self.o.dtype)
        return view

    def stats_pair(self, ml):
        """``(m, l)`` as torch views of their shared allocation ``ml``."""
        n = self.stats_size
        return ml[:n].view(self.stats_shape), ml[self.l_start:self.l_start + n].view(self.stats_shape)

    def seed(self, x):
        """A tensor holding dropout's seed (``SEED_DTYPES``) as an array over its memory (which holds it):
        cupyflash reads a CuPy one on the device as the kernels run."""
        if x.device != self.torch_device:
            raise ValueError(f"seed is on {x.device}, q on {self.torch_device}")
        words = SEED_DTYPES.get(x.dtype)
        if words is None or x.numel() != words[1] or not x.is_contiguous():
            raise ValueError(f"a seed tensor holds one int64 or two int32 words (the low one first), contiguous; got "
                             f"shape {tuple(x.shape)}, dtype {x.dtype}")
        return self.held(x, _View((words[1],), (1,), words[0]), self.device)

    def flat(self, name: str, x):
        """A tensor of ``mod_args`` as a 1-D array (which holds it; a copy where it is not contiguous)."""
        if x.device != self.torch_device:
            raise ValueError(f"mod_args[{name!r}] is on {x.device}, q on {self.torch_device}")
        x = x.contiguous()
        dtype = numpy.dtype(str(x.dtype).removeprefix("torch.")) if x.dtype != torch.bfloat16 else DTYPES[x.dtype]
        return self.held(x, _View((x.numel(),), (1,), dtype), self.device)

    def extra(self, name: str, x, rank: int, trailing: int):
        """A modifier tensor of at most ``rank`` torch dims, right-aligned: ``(..., H)`` per-entry values
        (``trailing=1``: ALiBi slopes, sinks) or ``(..., H, Nq, Nk)`` per pair (``trailing=3``: a bias or
        mask); as an array (which holds it) whose head axis is split for GQA (size H; or 1, broadcast)."""
        if x.device != self.torch_device:
            raise ValueError(f"{name} is on {x.device}, q on {self.torch_device}")
        if x.dim() > rank:
            raise ValueError(f"{name} of shape {tuple(x.shape)} has more than {rank} dims")
        shape = [1] * (rank - x.dim()) + list(x.shape)
        strides = [0] * (rank - x.dim()) + list(x.stride())
        if self.group > 1:
            axis = rank - trailing
            if shape[axis] == 1:
                shape[axis:axis + 1], strides[axis:axis + 1] = [1, 1], [0, 0]
            else:
                shape, strides = _split_heads(shape, strides, axis, self.kv_heads, self.group, True)
        return self.held(x, _View(shape, strides, EXTRA_DTYPES[x.dtype]), self.device)


_PLANS: dict = {}


def _plan(layout: str, q, k, v) -> _Plan:
    """The ``_Plan`` of q, k, v, kept per geometry."""
    key = (layout, q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype, k.dtype, v.dtype,
           q.device, k.device, v.device)
    plan = _PLANS.get(key)
    if plan is None:
        plan = _Plan(layout, q, k, v)
        if len(_PLANS) >= MAX_KEPT:
            _PLANS.clear()
        _PLANS[key] = plan
    return plan


# ---------------------------------------------------------------------------------------------------
# The autograd function

class _Call:
    """One call's settings: ``kw`` the keywords both passes take, ``varlen`` (cu_seqlens_q, cu_seqlens_k,
    max_seqlen_q, max_seqlen_k) or None, the modifiers that get no gradient, and the backward's own."""

    __slots__ = ("layout", "kw", "varlen", "alibi_slopes", "mask", "return_lse", "backward_kw", "seed_tensor")

    def __init__(self, layout, kw, varlen, alibi_slopes, mask, return_lse, backward_kw):
        self.layout, self.kw, self.varlen = layout, kw, varlen
        self.alibi_slopes, self.mask, self.return_lse, self.backward_kw = alibi_slopes, mask, return_lse, backward_kw
        self.seed_tensor = isinstance(kw.get("seed"), torch.Tensor)   # a device seed (SEED_DTYPES)

    def keywords(self, plan: _Plan, sink, bias) -> dict:
        """The keywords of a forward (and, with ``backward_kw``, a backward) call, the modifiers given as
        arrays over their tensors' memory."""
        if sink is None and bias is None and self.alibi_slopes is None and self.mask is None and self.varlen is None \
                and "mod_args" not in self.kw and not self.seed_tensor:
            return self.kw
        kw = dict(self.kw)
        if self.seed_tensor:
            kw["seed"] = plan.seed(kw["seed"])
        if isinstance(kw.get("mod_args"), dict):   # tensors among them as 1-D arrays, in C order
            kw["mod_args"] = {name: plan.flat(name, x) if isinstance(x, torch.Tensor) else x
                              for name, x in kw["mod_args"].items()}
        batch_rank = 1 if plan.layout == "varlen" else 2   # (H,) or (B, H)
        if self.alibi_slopes is not None:
            kw["alibi_slopes"] = plan.extra("alibi_slopes", self.alibi_slopes, batch_rank, 1)
        if sink is not None:
            kw["sink"] = plan.extra("sink", sink, batch_rank, 1)
        if bias is not None:
            kw["bias"] = plan.extra("bias", bias, batch_rank + 2, 3)
        if self.mask is not None:
            kw["mask"] = plan.extra("mask", self.mask, batch_rank + 2, 3)
        if self.varlen is not None:
            for name, cu in zip(("cu_seqlens_q", "cu_seqlens_k"), self.varlen[:2]):
                if cu.dim() != 1 or cu.dtype not in (torch.int32, torch.int64):
                    raise ValueError(f"{name} must be a 1-D int32 tensor of n_seq + 1 offsets, got shape "
                                     f"{tuple(cu.shape)}, dtype {cu.dtype}")
                if cu.device != plan.torch_device:
                    raise ValueError(f"{name} is on {cu.device}, q on {plan.torch_device}")
                dtype = numpy.dtype(numpy.int32 if cu.dtype == torch.int32 else numpy.int64)
                kw[name] = plan.held(cu, _View(cu.shape, cu.stride(), dtype), plan.device)
            kw["max_seqlen_q"], kw["max_seqlen_k"] = self.varlen[2:]
        return kw


def _forward(q, k, v, sink, bias, call: _Call):
    """``(o, ml, plan, arrays)``: o and the statistics' shared allocation (``_Plan.stats_pair``) as torch
    tensors, and the CuPy arrays of q, k, v, o, m, l the call read and wrote (the backward's too)."""
    plan = _plan(call.layout, q, k, v)
    o = torch.empty_strided(plan.o_shape, plan.o_strides, dtype=plan.dtype, device=plan.torch_device)
    ml = torch.empty(plan.l_start + plan.stats_size, dtype=plan.stats_dtype, device=plan.torch_device)
    array, device = plan.array, plan.device
    inputs = (array(q, plan.q, device), array(k, plan.k, device), array(v, plan.v, device))
    out = (array(o, plan.o, device), array(ml, plan.m, device), array(ml, plan.l, device))
    run = api.flash_attention_forward if call.varlen is None else _varlen_forward
    kw = call.keywords(plan, sink, bias)
    with _torch_stream(device):
        run(*inputs, out=api.FreshOut(out), **kw)
    return o, ml, plan, (*inputs, *out)


def _varlen_forward(q, k, v, *, cu_seqlens_q, cu_seqlens_k, **kw):
    return api.flash_attention_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, **kw)


def _varlen_backward(do, q, k, v, o, m, l, *, cu_seqlens_q, cu_seqlens_k, **kw):
    return api.flash_attention_varlen_backward(do, q, k, v, o, m, l, cu_seqlens_q, cu_seqlens_k, **kw)


def _lse(ml, plan: _Plan):
    """``m + log(l)``: the rows' log-sum-exp (``-inf`` where a row sees no key)."""
    m, l = plan.stats_pair(ml)
    return torch.log(l).add_(m)


def _gradients(plan: _Plan, call: _Call, do, q, k, v, o, ml, sink, bias, bias_grad: bool, saved=None):
    """``(dq, dk, dv, dbias, dsink)`` (None where not asked or not given) of cupyflash's backward; ``saved``
    the forward's CuPy arrays of q, k, v, o, m, l where these are its tensors (``_forward``)."""
    dq = torch.empty_strided(plan.o_shape, plan.o_strides, dtype=plan.dtype, device=plan.torch_device)
    dk = torch.empty_strided(plan.dk_shape, plan.dk_strides, dtype=plan.dtype, device=plan.torch_device)
    dv = torch.empty_strided(plan.dk_shape, plan.dk_strides, dtype=plan.dtype, device=plan.torch_device)
    array, device = plan.array, plan.device
    if saved is None:
        o_view = plan.o if o.stride() == plan.o_strides else plan.do_view(o)   # the forward's o, or another
        saved = (array(q, plan.q, device), array(k, plan.k, device), array(v, plan.v, device),
                 array(o, o_view, device), array(ml, plan.m, device), array(ml, plan.l, device))
    args = (array(do, plan.do_view(do), device), *saved)
    out = (array(dq, plan.o, device), array(dk, plan.dk, device), array(dv, plan.dk, device))
    kw = {**call.keywords(plan, sink, bias), **call.backward_kw}
    if bias_grad:
        kw["bias_grad"] = True
    run = api.flash_attention_backward if call.varlen is None else _varlen_backward
    with _torch_stream(device):
        grads = run(*args, out=api.FreshOut(out), **kw)
    dbias = _as_tensor(grads[3], bias, plan) if bias_grad else None
    dsink = _as_tensor(grads[-1], sink, plan) if sink is not None else None
    return dq, dk, dv, dbias, dsink


def _backward(ctx, do, dlse=None):
    """The gradients of ``_FlashAttention``'s inputs: q, k, v, the sink's and the bias's (None where not
    given, or for the bias, not wanted), none for the settings; ``dlse`` the cotangent of ``lse``, if any."""
    q, k, v, o, ml, sink, bias = ctx.saved_tensors
    call, plan = ctx.call, ctx.plan
    bias_grad = bias is not None and ctx.needs_input_grad[4]
    if do is None:   # o unused: only lse reached the loss
        do = torch.zeros_like(o)
    if dlse is None:
        dq, dk, dv, dbias, dsink = _gradients(plan, call, do, q, k, v, o, ml, sink, bias, bias_grad, ctx.arrays)
    else:
        dq, dk, dv, dbias, dsink = _gradients_through_lse(plan, call, do, dlse, q, k, v, o, ml, sink, bias, bias_grad)
    return dq, dk, dv, dsink, dbias, None


def _gradients_through_lse(plan: _Plan, call: _Call, do, dlse, q, k, v, o, ml, sink, bias, bias_grad: bool):
    """``_gradients`` with a cotangent ``g`` of ``lse`` too, by one backward over a head dim one wider.

    ``d lse_i / d s_ij = P_ij``, so ``dS_ij = P_ij (dP_ij − D_i + g_i)`` with ``dP = dO Vᵀ`` and
    ``D_i = rowsum(dO_i ∘ O_i)``: the backward computes exactly that from ``v' = [v, 1]``,
    ``do' = [do, g]``, ``o' = [o, 0]`` and ``q' = [q, 0]``, ``k' = [k, 0]`` (``dP' = dP + g``, ``D' = D``,
    the scores unchanged at the original scale). ``dq``, ``dk``, ``dv`` are the first D columns, ``dbias``
    is right as it comes; a sink's ``d lse_i / d sink = P_sink,i = exp(sink − m_i) / l_i`` is added.
    Costs copies of every tensor; ``g`` is rounded to the inputs' dtype.
    """
    D = plan.q.shape[-1]
    if D + 1 > MAX_HEAD_DIM:
        raise NotImplementedError(f"the gradient through lse needs a head dim D < {MAX_HEAD_DIM}, got D={D}")
    if call.kw["dropout_p"]:
        raise NotImplementedError("the gradient through lse with dropout: lse is that of the scores before "
                                  "dropout, which the widened backward would drop")
    g = dlse.permute(_inverse(plan.order[:-1]))[..., None]   # lse's (kernel order) in o's order, one column

    def wide(x, column):
        return torch.cat([x, column.to(x.dtype).expand(*x.shape[:-1], 1)], dim=-1)

    zero, one = torch.zeros((), device=q.device), torch.ones((), device=q.device)
    q2, k2, v2, o2, do2 = wide(q, zero), wide(k, zero), wide(v, one), wide(o, zero), wide(do, g)
    scale = call.kw["softmax_scale"]
    wide_call = _Call(call.layout, {**call.kw, "softmax_scale": D ** -0.5 if scale is None else scale}, call.varlen,
                      call.alibi_slopes, call.mask, call.return_lse, call.backward_kw)
    wide_plan = _plan(call.layout, q2, k2, v2)
    dq, dk, dv, dbias, dsink = _gradients(wide_plan, wide_call, do2, q2, k2, v2, o2, ml, sink, bias, bias_grad)
    if dsink is not None:
        m, l = plan.stats_pair(ml)
        p_sink = torch.exp(sink[..., None] - m) / l   # (batch..., H, Nq): the sink's share of each row
        dsink = dsink + _sum_to((dlse * p_sink).sum(-1), sink.shape)
    return dq[..., :D], dk[..., :D], dv[..., :D], dbias, dsink


def _inverse(permutation) -> list:
    """The axes that undo ``permutation``: ``x.permute(permutation).permute(_inverse(permutation))`` is ``x``."""
    inverse = [0] * len(permutation)
    for position, axis in enumerate(permutation):
        inverse[axis] = position
    return inverse


def _sum_to(x, shape):
    """``x`` summed over the dims along which ``shape`` broadcasts to it (leading ones, and size-1 ones)."""
    lead = x.dim() - len(shape)
    if lead:
        x = x.sum(dim=tuple(range(lead)))
    dims = tuple(i for i, n in enumerate(shape) if n == 1 and x.shape[i] != 1)
    return x.sum(dim=dims, keepdim=True) if dims else x


class _FlashAttention(torch.autograd.Function):
    """cupyflash's forward and backward as one autograd node; ``sink`` and ``bias`` get gradients too."""

    @staticmethod
    def forward(ctx, q, k, v, sink, bias, call):
        o, ml, plan, arrays = _forward(q, k, v, sink, bias, call)
        ctx.save_for_backward(q, k, v, o, ml, sink, bias)   # (torch checks them unchanged as the backward unpacks them)
        ctx.call, ctx.plan, ctx.arrays = call, plan, arrays
        if call.return_lse:
            ctx.set_materialize_grads(False)   # an lse the loss does not use: None, the plain backward
            return o, _lse(ml, plan)
        return o

    @staticmethod
    def backward(ctx, do, dlse=None):
        # under create_graph, gradients that raise if differentiated again; else the plain call
        return (_backward_once if torch.is_grad_enabled() else _backward)(ctx, do, dlse)


_backward_once = torch.autograd.function.once_differentiable(_backward)


def _as_tensor(grad, like, plan: _Plan):
    """A gradient cupyflash allocated (dbias, dsink: the accumulator dtype, ``like``'s elements, C order)
    copied into a torch tensor of ``like``'s shape and dtype."""
    target = torch.empty(like.shape, dtype=plan.stats_dtype, device=plan.torch_device)
    view = plan.held(target, _View(grad.shape, _contiguous(grad.shape), grad.dtype), plan.device)
    with _torch_stream(plan.device):
        view[...] = grad
    return target.to(like.dtype)


# ---------------------------------------------------------------------------------------------------
# The public functions

def _settings(causal, softmax_scale, window, softcap, dropout_p, seed, score_mod, mask_mod, mod_args, schedule,
              precision, block_mask=None) -> dict:
    """The keywords the forward and the backward both take; a dropout seed drawn from torch's default
    generator where none is given (so ``torch.manual_seed`` repeats it)."""
    if dropout_p and seed is None:
        seed = int(torch.randint(0, 2**62, ()))
    kw = dict(causal=causal, softmax_scale=softmax_scale, window=window, softcap=softcap, dropout_p=dropout_p,
              seed=seed, schedule=schedule, precision=precision)
    if score_mod is not None or mask_mod is not None or mod_args is not None:
        kw.update(score_mod=score_mod, mask_mod=mask_mod, mod_args=mod_args)
    if block_mask is not None:
        kw["block_mask"] = block_mask
    return kw


def _backward_settings(deterministic, score_mod_grad) -> dict:
    """The keywords only the backward takes."""
    kw = {"deterministic": deterministic}
    if score_mod_grad is not None:
        kw["score_mod_grad"] = score_mod_grad
    return kw


def _check_tensors(q, k, v):
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")


def _tensor(x, dtype, device):
    """A modifier as a tensor of ``dtype``: a tensor cast (a cast autograd follows; on its own device,
    which must be q's), an array-like made a tensor on ``device``; None stays None."""
    if x is None:
        return None
    return x.to(dtype) if isinstance(x, torch.Tensor) else torch.as_tensor(x, dtype=dtype, device=device)


def _apply(q, k, v, call: _Call, sink, bias):
    """Through autograd where a gradient is wanted, straight to the forward where none is."""
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad
                                    or (sink is not None and sink.requires_grad)
                                    or (bias is not None and bias.requires_grad)):
        return _FlashAttention.apply(q, k, v, sink, bias, call)
    o, ml, plan, _ = _forward(q, k, v, sink, bias, call)
    return (o, _lse(ml, plan)) if call.return_lse else o


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                    softmax_scale: Optional[float] = None, window=None, softcap: Optional[float] = None,
                    alibi_slopes=None, sink=None, bias=None, mask=None, dropout_p: float = 0.0,
                    seed: Optional[int] = None, layout: str = "bhnd", return_lse: bool = False,
                    deterministic: bool = False, score_mod: Optional[str] = None,
                    score_mod_grad: Optional[str] = None, mask_mod: Optional[str] = None,
                    mod_args: Optional[dict] = None, block_mask=None, schedule: str = "auto",
                    precision: str = "highest"):
    """Exact attention ``softmax(softmax_scale · q kᵀ) v`` on torch tensors, differentiable.

    Runs cupyflash's fused forward and, through autograd, its backward, on the tensors' memory (no copies)
    and on torch's current stream; CPU tensors run the NumPy path.

    Parameters
    ----------
    q : torch.Tensor, shape (B, H, Nq, D), or (B, Nq, H, D) with ``layout="bnhd"``
    k, v : torch.Tensor, shape (B, H_kv, Nk, D), or (B, Nk, H_kv, D) with ``layout="bnhd"``
        One dtype for all three: float16, bfloat16, float32 or float64; one device (CUDA, or the CPU);
        any strides (read in place where the last axis is contiguous). ``H`` a multiple of ``H_kv``:
        grouped-query attention, query head ``h`` reading K/V head ``h // (H / H_kv)``; ``H_kv = 1``
        is multi-query attention. ``1 <= D <= 256``.
    causal : bool, optional
        Query ``i`` sees key ``j`` iff ``j <= i + Nk − Nq`` (bottom-right aligned, as FlashAttention ≥ 2.1;
        ``is_causal`` of torch SDPA is top-left aligned: the same when ``Nq == Nk``).
    softmax_scale : float, optional
        Default ``1 / sqrt(D)``.
    window : (int or None, int or None), optional
        A sliding window ``(left, right)``, as in :func:`cupyflash.flash_attention_forward`.
    softcap : float, optional
        Scores become ``softcap · tanh(s / softcap)``.
    alibi_slopes : torch.Tensor, shape (H,) or (B, H), optional
        ALiBi: each score loses ``slope · |i + Nk − Nq − j|``. Read in float32 (float64 for float64
        inputs); no gradient.
    sink : torch.Tensor, shape (H,) or (B, H), optional
        Attention-sink logits, one per head: each row sees one more key of logit ``sink`` and value zero.
        Differentiable (its gradient in float32, cast to the sink's dtype).
    bias : torch.Tensor, broadcastable to (B, H, Nq, Nk), optional
        Added to the scores; read in place with its strides (a broadcast view is not expanded), in q's
        dtype. Differentiable: with ``bias.requires_grad`` the backward also computes ``dbias``.
    mask : torch.Tensor of bool, broadcastable to (B, H, Nq, Nk), optional
        True = visible; a hidden pair has no term at all.
    dropout_p : float, optional
        Dropout on the attention weights (``0 <= p < 1``); the backward drops the same pairs.
    seed : int or torch.Tensor, optional
        Dropout's seed in ``[0, 2⁶⁴)``; default: drawn from torch's default generator (so
        ``torch.manual_seed`` repeats it). Or a tensor on q's device holding it (one int64, its bits
        the seed, or two int32 words, the low one first): on a GPU the kernels read it as they run, so a
        captured CUDA graph replayed after the tensor was rewritten drops another set.
    layout : {'bhnd', 'bnhd'}, optional
        'bhnd' (default): torch SDPA's ``(B, H, N, D)``. 'bnhd': FlashAttention's ``flash_attn_func``
        ``(B, N, H, D)``, read in place as the ``(B, H, N, D)`` view of the same memory.
    return_lse : bool, optional
        Also return the rows' log-sum-exp, differentiable: a loss that uses it (a z-loss, a merge of
        partial attentions) adds ``g_i P_ij`` to ``dS`` (one backward over a head dim one wider:
        ``D < 256``, no dropout; the cotangent ``g`` is rounded to the inputs' dtype).
    deterministic : bool, optional
        A bitwise-reproducible backward (slower).
    score_mod, score_mod_grad, mask_mod, mod_args : optional
        User expressions, as in :func:`cupyflash.flash_attention_forward` and
        :func:`cupyflash.flash_attention_backward` (``b`` counts the batch entries of the kernels'
        batch shape: ``(B, H)``, or ``(B, H_kv, H / H_kv)`` under GQA).
    block_mask : cupyflash.BlockMask, optional
        A ``mask_mod`` with its tile maps kept (:func:`cupyflash.block_mask`), in place of ``mask_mod``
        and ``mod_args``, made for the kernels' batch shape (as ``b`` above), ``Nq`` and ``Nk``; both
        passes read it.
    schedule : {'auto', 'v1', 'v2'}, optional
    precision : {'highest', 'tf32'}, optional
        As in :func:`cupyflash.flash_attention_forward` (float32 inputs: 3xTF32 or plain TF32).

    Returns
    -------
    o : torch.Tensor
        Of q's shape, layout and dtype, on q's device. With ``layout="bnhd"`` it is a ``(B, Nq, H, D)``
        view of memory laid out as ``(B, H, Nq, D)`` (as torch SDPA's output after ``transpose(1, 2)``).
    lse : torch.Tensor, shape (B, H, Nq)
        With ``return_lse`` only: ``m + log(l)`` in float32 (float64 for float64 inputs), ``-inf`` for a
        row that sees no key; in this (B, H, Nq) order for both layouts, as FlashAttention's.

    Raises
    ------
    TypeError
        Not tensors, unsupported or mixed dtypes.
    ValueError
        Wrong ranks, mismatched batch sizes or head dims, ``H`` not a multiple of ``H_kv``, tensors on
        different devices; and every error of :func:`cupyflash.flash_attention_forward`.

    Notes
    -----
    The kernels read each tensor through a CuPy array made over its memory (``cupy.ndarray`` on
    ``cupy.cuda.UnownedMemory``, no DLPack); ``o``, the statistics ``m``, ``l`` saved for the backward
    and the gradients are allocated by torch and written through cupyflash's ``out=``. Both passes run
    on ``torch.cuda.current_stream()`` of the tensors' device and do not synchronise; cupyflash's own
    workspaces come from CuPy's memory pool on that stream. How the tensors are viewed is settled once
    per shape, strides, dtype and device and kept. With no gradient wanted (``torch.no_grad``, or no
    input that requires one) the forward runs without an autograd node.

    CPU tensors run the same views on NumPy arrays through cupyflash's NumPy path (float32
    arithmetic; slow, for tests and small problems).

    See Also
    --------
    cupyflash.flash_attention_forward, cupyflash.flash_attention_backward : the calls made.
    flash_attention_varlen : packed variable-length sequences.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    _check_tensors(q, k, v)
    kw = _settings(causal, softmax_scale, window, softcap, dropout_p, seed, score_mod, mask_mod, mod_args,
                   schedule, precision, block_mask)
    stats = STATS_DTYPES.get(q.dtype, torch.float32)
    call = _Call(layout, kw, None, _tensor(alibi_slopes, stats, q.device), _tensor(mask, torch.bool, q.device),
                 return_lse, _backward_settings(deterministic, score_mod_grad))
    return _apply(q, k, v, call, _tensor(sink, stats, q.device), _tensor(bias, q.dtype, q.device))


def flash_attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                           cu_seqlens_k: torch.Tensor, max_seqlen_q: Optional[int] = None,
                           max_seqlen_k: Optional[int] = None, *, causal: bool = False,
                           softmax_scale: Optional[float] = None, window=None, softcap: Optional[float] = None,
                           alibi_slopes=None, sink=None, bias=None, mask=None, dropout_p: float = 0.0,
                           seed: Optional[int] = None, return_lse: bool = False, deterministic: bool = False,
                           score_mod: Optional[str] = None, score_mod_grad: Optional[str] = None,
                           mask_mod: Optional[str] = None, mod_args: Optional[dict] = None, schedule: str = "auto",
                           precision: str = "highest"):
    """Exact attention over packed variable-length sequences, differentiable (FlashAttention's
    ``flash_attn_varlen_func`` layout).

    Parameters
    ----------
    q : torch.Tensor, shape (total_q, H, D)
        The queries of every sequence, one after another.
    k, v : torch.Tensor, shape (total_k, H_kv, D)
        The keys and values, packed the same way; dtypes, devices, strides and GQA as in
        :func:`flash_attention`.
    cu_seqlens_q, cu_seqlens_k : torch.Tensor of int32, shape (n_seq + 1,)
        Sequence ``s`` is the query rows ``cu_seqlens_q[s] .. cu_seqlens_q[s+1] − 1`` and the key rows
        ``cu_seqlens_k[s] .. cu_seqlens_k[s+1] − 1``; on q's device.
    max_seqlen_q, max_seqlen_k : int, optional
        Bounds of the sequences' lengths. Give both: without them the offsets are copied to the host to
        find them, which waits for the stream. With both, on the GPU the offsets' values are not checked
        (as in :func:`cupyflash.flash_attention_varlen_forward`).
    causal, softmax_scale, window, softcap, alibi_slopes, sink, dropout_p, seed, return_lse, deterministic, schedule, precision
        As in :func:`flash_attention` (per sequence, bottom-right aligned in each; ``alibi_slopes`` and
        ``sink`` of shape ``(H,)``).
    bias, mask : torch.Tensor, broadcastable to (H, total_q, total_k), optional
        As in :func:`flash_attention` over the packed pairs: sequence ``s`` reads the block of its own
        rows and keys (a bias that requires grad gets ``dbias`` there, zero between sequences).
    score_mod, score_mod_grad, mask_mod, mod_args : optional
        As in :func:`flash_attention`, per sequence: ``q_idx``, ``kv_idx`` are the pair's positions in
        its sequence, ``b`` the head (``(H,)``, or ``(H_kv, H / H_kv)`` under GQA).

    Returns
    -------
    o : torch.Tensor, shape (total_q, H, D)
        A view of memory laid out as ``(H, total_q, D)``.
    lse : torch.Tensor, shape (H, total_q)
        With ``return_lse`` only.

    Raises
    ------
    TypeError, ValueError
        As in :func:`flash_attention` and :func:`cupyflash.flash_attention_varlen_forward`.

    See Also
    --------
    cupyflash.flash_attention_varlen_forward, cupyflash.flash_attention_varlen_backward : the calls made.
    """
    _check_tensors(q, k, v)
    kw = _settings(causal, softmax_scale, window, softcap, dropout_p, seed, score_mod, mask_mod, mod_args, schedule,
                   precision)
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(cu, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor of int32 offsets, got {type(cu).__name__}")
    stats = STATS_DTYPES.get(q.dtype, torch.float32)
    call = _Call("varlen", kw, (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k),
                 _tensor(alibi_slopes, stats, q.device), _tensor(mask, torch.bool, q.device), return_lse,
                 _backward_settings(deterministic, score_mod_grad))
    return _apply(q, k, v, call, _tensor(sink, stats, q.device), _tensor(bias, q.dtype, q.device))


# ---------------------------------------------------------------------------------------------------
# Decoding against a K/V cache (no gradient)

def _tensor_array(name: str, x, dtypes: dict, order, device):
    """A tensor as cupyflash reads it (a CuPy view of a CUDA tensor's memory, kept by address: the caller
    holds the tensor for the call; a NumPy one of a CPU tensor's), its axes in ``order``; its dtype one of
    ``dtypes`` (torch -> NumPy) and its device q's."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype {' or '.join(str(d) for d in dtypes)}, got {x.dtype}")
    if (x.get_device() if x.is_cuda else None) != device or x.device.type not in ("cpu", "cuda"):
        raise ValueError(f"{name} is on {x.device}, q on {'cpu' if device is None else f'cuda:{device}'}")
    if x.dim() != len(order):
        raise ValueError(f"{name} must have {len(order)} dims, got shape {tuple(x.shape)}")
    view = _View([x.shape[i] for i in order], [x.stride()[i] for i in order], dtypes[x.dtype])
    return (_host_array if device is None else _device_array)(x, view, device)


def _query_device(q, layout: str):
    """q's CUDA device index, None on the CPU, after checking q and ``layout`` (the no-gradient calls')."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"q must be a torch.Tensor, got {type(q).__name__}")
    if q.device.type not in ("cpu", "cuda"):
        raise ValueError(f"q must lie on a CUDA device or the CPU, got {q.device}")
    return q.get_device() if q.is_cuda else None


def flash_attention_with_kvcache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                 cache_seqlens: torch.Tensor, k: Optional[torch.Tensor] = None,
                                 v: Optional[torch.Tensor] = None, *, block_table: Optional[torch.Tensor] = None,
                                 causal: bool = True, softmax_scale: Optional[float] = None, window=None,
                                 softcap: Optional[float] = None, alibi_slopes=None,
                                 num_splits: Optional[int] = None, layout: str = "bhnd", return_lse: bool = False):
    """Attention of new queries against a K/V cache on torch tensors, appending new keys in place first
    (decoding; FlashAttention's ``flash_attn_with_kvcache``). No gradient.

    Parameters
    ----------
    q : torch.Tensor, shape (B, Hq, Nq, D), or (B, Nq, Hq, D) with ``layout="bnhd"``
        float16, bfloat16, float32 or float64, on a CUDA device or the CPU.
    k_cache, v_cache : torch.Tensor
        Contiguous cache ``(B, Hkv, N_max, D)`` (``bnhd``: ``(B, N_max, Hkv, D)``), or paged
        ``(pages, Hkv, page_size, D)`` (``bnhd``: ``(pages, page_size, Hkv, D)``) with ``block_table``;
        q's dtype and device, any strides with a contiguous last axis. ``Hq`` a multiple of ``Hkv``
        (GQA). Written in place where ``k``, ``v`` are given.
    cache_seqlens : torch.Tensor of int32, shape (B,)
        Each entry's valid keys before this call; on q's device (read there, not checked on the GPU:
        :func:`cupyflash.flash_attention_with_kvcache`).
    k, v : torch.Tensor, shape (B, Hkv, Nnew, D) (``bnhd``: (B, Nnew, Hkv, D)), optional
        New keys and values, written into the cache at ``cache_seqlens`` before attending (the caller
        advances ``cache_seqlens``).
    block_table : torch.Tensor of int32, shape (B, max_pages), optional
        Page numbers of a paged cache.
    causal, softmax_scale, window, softcap, alibi_slopes, num_splits
        As in :func:`cupyflash.flash_attention_with_kvcache` (``causal`` aligns the new queries with the
        last keys; ``alibi_slopes`` float32 of shape ``(Hq,)`` or ``(B, Hq)``).
    layout : {'bhnd', 'bnhd'}, optional
        The axes of q, the caches, k, v and o.
    return_lse : bool, optional
        Also return ``lse = m + log l``, shape ``(B, Hq, Nq)``, float32 (float64 for float64 inputs).

    Returns
    -------
    o : torch.Tensor, q's shape and dtype
        ``bnhd``: a view of memory laid out as ``(B, Hq, Nq, D)``.
    lse : torch.Tensor, shape (B, Hq, Nq)
        With ``return_lse`` only.

    Raises
    ------
    TypeError, ValueError
        A tensor of another kind, dtype, device or rank than named above, and whatever
        :func:`cupyflash.flash_attention_with_kvcache` refuses (naming the argument).

    See Also
    --------
    cupyflash.flash_attention_with_kvcache : the call made, on views of the tensors' memory.
    """
    device = _query_device(q, layout)
    order, int32 = KERNEL_ORDER[layout], {torch.int32: numpy.dtype(numpy.int32)}
    same = {q.dtype: DTYPES[q.dtype]} if q.dtype in DTYPES else DTYPES
    arrays = {name: _tensor_array(name, x, same, order, device)
              for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("k", k), ("v", v))
              if x is not None}
    lens = _tensor_array("cache_seqlens", cache_seqlens, int32, (0,), device)
    table = None if block_table is None else _tensor_array("block_table", block_table, int32, (0, 1), device)
    slopes = None
    if alibi_slopes is not None:
        slopes = _tensor(alibi_slopes, STATS_DTYPES[q.dtype], q.device)
        slopes = _tensor_array("alibi_slopes", slopes, {slopes.dtype: DTYPES[slopes.dtype]}, range(slopes.dim()),
                               device)
    B, Hq, Nq, D = arrays["q"].shape
    o = torch.empty_strided(tuple(q.shape), _output_strides(q.shape, order), dtype=q.dtype, device=q.device)
    m, l = (torch.empty((B, Hq, Nq), dtype=STATS_DTYPES[q.dtype], device=q.device) for _ in range(2))
    stats = DTYPES[STATS_DTYPES[q.dtype]]
    out = (_tensor_array("o", o, {o.dtype: DTYPES[o.dtype]}, order, device),
           *(_tensor_array(name, x, {x.dtype: stats}, (0, 1, 2), device) for name, x in (("m", m), ("l", l))))
    with _torch_stream(device):
        kvcache.flash_attention_with_kvcache(arrays["q"], arrays["k_cache"], arrays["v_cache"], lens, k=arrays.get("k"),
                                             v=arrays.get("v"), block_table=table, causal=causal,
                                             softmax_scale=softmax_scale, window=window, softcap=softcap,
                                             alibi_slopes=slopes, num_splits=num_splits, out=api.FreshOut(out))
    return (o, torch.log(l).add_(m)) if return_lse else o


# float8 e4m3 tensors as cupyflash reads them: their bits (CuPy has no float8 dtype)
FLOAT8_DTYPES = {torch.float8_e4m3fn: numpy.dtype(numpy.uint8), torch.uint8: numpy.dtype(numpy.uint8)}


def flash_attention_fp8(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, q_descale=1.0, k_descale=1.0,
                        v_descale=1.0, out_dtype: torch.dtype = torch.bfloat16, causal: bool = False,
                        softmax_scale: Optional[float] = None, window=None, layout: str = "bhnd",
                        return_lse: bool = False):
    """Attention of float8 e4m3 torch tensors with descales per tensor or per head (FlashAttention-3's FP8
    forward). No gradient.

    Parameters
    ----------
    q : torch.Tensor, shape (B, Hq, Nq, D), or (B, Nq, Hq, D) with ``layout="bnhd"``
    k, v : torch.Tensor, shape (B, Hkv, Nk, D) (``bnhd``: (B, Nk, Hkv, D))
        ``torch.float8_e4m3fn`` (or its bits as ``torch.uint8``), on one CUDA device or the CPU, any
        strides with a contiguous last axis; ``Hq`` a multiple of ``Hkv`` (GQA).
    q_descale, k_descale, v_descale : float or torch.Tensor, optional
        A number, or FlashAttention-3's per-head descales: a float32 tensor of shape ``(B, Hkv)`` (or one
        broadcasting to it) on q's device, its values positive and finite (not read on the GPU). As
        :func:`cupyflash.flash_attention_forward_fp8` defines them. Default 1.
    causal, softmax_scale, window
        As in :func:`cupyflash.flash_attention_forward_fp8`.
    out_dtype : torch.float16 or torch.bfloat16, optional
    layout : {'bhnd', 'bnhd'}, optional
    return_lse : bool, optional
        Also return ``lse = m + log l``, shape ``(B, Hq, Nq)``, float32.

    Returns
    -------
    o : torch.Tensor, q's shape, ``out_dtype``
        ``bnhd``: a view of memory laid out as ``(B, Hq, Nq, D)``.
    lse : torch.Tensor, shape (B, Hq, Nq)
        With ``return_lse`` only.

    See Also
    --------
    cupyflash.flash_attention_forward_fp8 : the call made, on views of the tensors' memory.
    """
    device = _query_device(q, layout)
    if out_dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"out_dtype must be torch.float16 or torch.bfloat16, got {out_dtype}")
    order = KERNEL_ORDER[layout]
    q_, k_, v_ = (_tensor_array(name, x, FLOAT8_DTYPES, order, device) for name, x in (("q", q), ("k", k), ("v", v)))
    B, Hq, Nq, D = q_.shape
    Hkv = k_.shape[1]
    if Hkv == 0 or Hq % Hkv or v_.shape[1] != Hkv:
        raise ValueError(f"q's heads must be a multiple of k's and v's, got q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)} ({layout})")
    G = Hq // Hkv
    descales = {name: _descale_array(name, x, B, Hkv, device)
                for name, x in zip(float8.DESCALES, (q_descale, k_descale, v_descale))}
    o = torch.empty_strided(tuple(q.shape), _output_strides(q.shape, order), dtype=out_dtype, device=q.device)
    m, l = (torch.empty((B, Hq, Nq), dtype=torch.float32, device=q.device) for _ in range(2))
    out = (_tensor_array("o", o, {out_dtype: DTYPES[out_dtype]}, order, device),
           *(_tensor_array(name, x, {torch.float32: DTYPES[torch.float32]}, (0, 1, 2), device)
             for name, x in (("m", m), ("l", l))))
    # GQA: q's heads as (Hkv, G), k's and v's with a broadcast axis of 1
    out = tuple(x.reshape(B, Hkv, G, *x.shape[2:]) for x in out)
    with _torch_stream(device):
        float8.flash_attention_forward_fp8(q_.reshape(B, Hkv, G, Nq, D), k_[:, :, None], v_[:, :, None], **descales,
                                           out_dtype=DTYPES[out_dtype], causal=causal, softmax_scale=softmax_scale,
                                           window=window, out=out)
    return (o, torch.log(l).add_(m)) if return_lse else o


def _descale_array(name: str, x, B: int, Hkv: int, device):
    """A descale as the float8 call takes it: a number as it is; a per-head tensor broadcasting to ``(B, Hkv)``
    as an array ``(B, Hkv, 1)`` over its memory (q's heads as ``(Hkv, G)``)."""
    if not isinstance(x, torch.Tensor):
        return x
    try:
        x = x.expand(B, Hkv)
    except RuntimeError:
        raise ValueError(f"{name} must broadcast to (B, Hkv) = {(B, Hkv)}, got shape {tuple(x.shape)}") from None
    return _tensor_array(name, x, {torch.float32: DTYPES[torch.float32]}, (0, 1), device)[:, :, None]
