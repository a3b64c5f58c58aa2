"""cupyflash from JAX: attention inside ``jax.jit`` and under ``jax.grad``, through XLA's FFI.

``flash_attention(q, k, v, ...)`` is a ``jax.custom_vjp`` function. Its forward rule is one XLA
custom call (``jax.ffi.ffi_call``) to the target ``cupyflash_forward``, whose results are
``o, m, l``; its backward rule one call to ``cupyflash_backward`` with results ``dq, dk, dv``.
``flash_attention_with_kvcache`` (decoding, no gradient) is one call to ``cupyflash_kvcache``, whose
results alias the caches it is given; ``flash_attention_fp8`` (float8 e4m3 inputs, no gradient) one call to
``cupyflash_fp8``.
Both targets are Python functions registered as XLA FFI handlers through ctypes
(``cupyflash._xla_ffi``), so nothing is compiled but cupyflash's own kernels:

- on CUDA the handler asks XLA for the call's stream and device, wraps XLA's buffers in CuPy
  arrays (no copies) and runs ``flash_attention_forward``/``flash_attention_backward`` on XLA's
  stream with ``out=`` XLA's result buffers. Nothing synchronises; XLA orders the kernels with
  the rest of the program.
- on the CPU the same handlers run cupyflash's NumPy path over XLA's host buffers.

The options (causal, scale, window, softcap, precision, deterministic, the user expressions and the
numbers of their ``mod_args``, dropout's p) travel as one XLA attribute (a JSON text, parsed once per
text), checked when the call is traced, by cupyflash's own checks. The modifiers' arrays (ALiBi slopes,
a sink, a bias, a mask), dropout's key and the arrays of ``mod_args`` are operands after the inputs: the
sink and the bias get gradients, the others are constants to the VJP. Dropout's key reaches the kernels
as a device seed (read as they run), so each step's new key needs no new trace and no host read. The handlers run Python at every call (tens of
microseconds of host time) and are not recorded into XLA's command buffers (CUDA graphs).

Importing this module imports JAX; ``import cupyflash`` does not.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import json
import threading
import weakref
from dataclasses import dataclass
from typing import Optional

import jax
import jax.numpy as jnp
import numpy

from . import _xla_ffi, float8, kvcache
from ._checks import (FLOAT8_DTYPES, check_bool, check_choice, check_dropout, check_forward, check_offset_shapes,
                      check_pairwise, check_per_entry, check_seed, check_splits, with_softcap)
from ._expr import user_mods
from ._tiles import PRECISIONS, accumulator_dtype
from ._views import device_view
from .api import (FreshOut, flash_attention_backward, flash_attention_forward, flash_attention_varlen_backward,
                  flash_attention_varlen_forward)
from .blockmask import BlockMask

__all__ = ["flash_attention", "flash_attention_varlen", "flash_attention_with_kvcache", "flash_attention_fp8",
           "flash_attention_forward_ffi", "flash_attention_backward_ffi"]

FORWARD_TARGET = "cupyflash_forward"
BACKWARD_TARGET = "cupyflash_backward"
KVCACHE_TARGET = "cupyflash_kvcache"
FP8_TARGET = "cupyflash_fp8"
OPTIONS = "options"     # the one attribute of both calls: their keywords as JSON (Options.attributes)
NUMBERS = (bool, int, float, numpy.bool_, numpy.number)   # mod_args values that travel in the attribute
# the arrays of cupyflash's keywords JAX takes, operands after the inputs in this order, and cupyflash's check
# of each; a sink and a bias get their gradients (the backward's dsink and, where the bias is differentiated,
# dbias); `seed` is dropout's key as two uint32 words (_key_words), a device seed to the kernels
MODIFIERS = (("alibi_slopes", check_per_entry), ("sink", check_per_entry), ("bias", check_pairwise),
             ("mask", check_pairwise), ("seed", lambda name, x, prob: check_seed(x)))
# the block masks of traced calls by key: held by the calls' Options (so by JAX's caches of them) while used
BLOCK_MASKS: "weakref.WeakValueDictionary[int, BlockMask]" = weakref.WeakValueDictionary()
MAX_HEAD_DIM = 256      # the lse gradient adds one column to D (``_lse_backward``)


@dataclass(frozen=True)
class Options:
    """A call's checked options: static under ``jit`` (hashable, a ``nondiff_argnums`` of the VJP)."""

    causal: bool
    softmax_scale: float
    window: tuple           # (left, right): ints >= 0 or None
    softcap: Optional[float]
    precision: str
    deterministic: bool
    score_mod: Optional[str] = None
    score_mod_grad: Optional[str] = None
    mask_mod: Optional[str] = None
    mod_args: tuple = ()    # ((name, int64 or float64), ...) in the order given
    mod_arrays: tuple = ()  # ((name, shape, dtype name), ...) of mod_args' arrays: operands after the modifiers'
    modifiers: tuple = ()   # the keywords of the modifiers' arrays given (MODIFIERS order): operands after the inputs
    block_mask: Optional[BlockMask] = None   # in place of mask_mod and mod_args (BLOCK_MASKS holds it by id)
    varlen: Optional[tuple] = None   # packed sequences: (max_seqlen_q, max_seqlen_k); their offsets the first operands
                                     # after the inputs
    dropout_p: float = 0.0  # its key an operand among the modifiers' (`seed`)

    def named(self, arrays) -> dict:
        """The modifiers' arrays among ``arrays`` (the operands after the inputs), by keyword."""
        return dict(zip(self.modifiers, arrays[2 if self.varlen else 0:]))

    def attributes(self, backward: bool, bias_grad: bool = False) -> dict:
        """The XLA attributes of the forward's or the backward's call: one, ``OPTIONS``, a JSON text of
        the cupyflash keywords the handler passes (``keywords`` reads it back, its parse kept by text:
        a handler decodes one attribute per call; the backward's with ``bias_grad``), the keywords of the
        modifiers' arrays and the names of mod_args' arrays among the operands, and the block mask's key
        in BLOCK_MASKS. JSON keeps ints from floats and a float's every bit."""
        kw = dict(causal=self.causal, softmax_scale=self.softmax_scale, window=self.window, softcap=self.softcap,
                  precision=self.precision)
        if self.dropout_p:
            kw["dropout_p"] = self.dropout_p
        for name in ("score_mod", "mask_mod", "score_mod_grad") if backward else ("score_mod", "mask_mod"):
            if getattr(self, name) is not None:
                kw[name] = getattr(self, name)
        if self.mod_args:
            kw["mod_args"] = {name: (int if isinstance(x, numpy.integer) else float)(x) for name, x in self.mod_args}
        if backward:
            kw["deterministic"] = self.deterministic
            if bias_grad:
                kw["bias_grad"] = True
        if self.varlen:
            kw["max_seqlen_q"], kw["max_seqlen_k"] = self.varlen
        return {OPTIONS: json.dumps({"keywords": kw, "varlen": bool(self.varlen), "modifiers": list(self.modifiers),
                                     "arrays": [name for name, _, _ in self.mod_arrays],
                                     "block_mask": None if self.block_mask is None else _keep(self.block_mask)})}

    def expressions(self, backward: bool = False):
        """``_expr.user_mods`` of the call's expressions (the block mask's mask_mod and mod_args where it
        has one), each mod_args array as a stand-in of its shape and dtype: the checks, raising as they do."""
        if self.block_mask is not None:
            mask_mod, mod_args = self.block_mask.mask_mod, self.block_mask.mod_args
        else:
            mask_mod = self.mask_mod
            mod_args = {**dict(self.mod_args), **{name: _stand_in(jax.ShapeDtypeStruct(shape, dtype))
                                                  for name, shape, dtype in self.mod_arrays}} or None
        return user_mods(self.score_mod, self.score_mod_grad, mask_mod, mod_args, backward=backward)


def _keep(block_mask: BlockMask) -> int:
    """``block_mask``'s key in BLOCK_MASKS, where the handlers find it."""
    BLOCK_MASKS[id(block_mask)] = block_mask
    return id(block_mask)


def keywords(text: str, arrays=()) -> dict:
    """cupyflash's keyword arguments from a call's ``OPTIONS`` attribute (``Options.attributes``) and its
    operands after the inputs: the modifiers' arrays, then those of mod_args, in the attribute's order."""
    kw, _, modifiers, names, block_key = _parsed(text)
    if modifiers:
        kw = {**kw, **dict(zip(modifiers, arrays))}
        arrays = arrays[len(modifiers):]
    if names:
        kw = {**kw, "mod_args": {**kw.get("mod_args", {}), **dict(zip(names, arrays))}}
    if block_key is not None:
        kw = {**kw, "block_mask": BLOCK_MASKS[block_key]}
    return kw


@functools.lru_cache(maxsize=1024)
def _parsed(text: str) -> tuple:
    """``(keywords, packed sequences, modifiers, mod_args array names, block mask key)`` of an ``OPTIONS``
    text, parsed once per text."""
    parsed = json.loads(text)
    kw = parsed["keywords"]
    kw["window"] = tuple(kw["window"])
    return kw, parsed["varlen"], tuple(parsed["modifiers"]), tuple(parsed["arrays"]), parsed["block_mask"]


def _stand_in(x):
    """A zero-strided NumPy array of ``x``'s shape and dtype (no memory): what cupyflash's checks read."""
    return numpy.broadcast_to(numpy.zeros((), numpy.dtype(x.dtype)), numpy.shape(x))


def check(q, k, v, causal, softmax_scale, window, softcap, precision, deterministic, score_mod=None,
          score_mod_grad=None, mask_mod=None, mod_args=None, block_mask=None, alibi_slopes=None, sink=None,
          bias=None, mask=None, varlen=None, dropout_p=0.0, dropout_rng=None):
    """``(Problem, Options, arrays)`` of a call, by cupyflash's own checks (``_checks``,
    ``_expr.user_mods``): a TypeError or ValueError naming the argument, raised while the call is traced.
    ``varlen``: packed sequences' ``(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)``.
    ``arrays``: the operands after q, k, v as JAX arrays: the offsets with ``varlen``, the modifiers' and
    dropout's key (``Options.modifiers``), those of ``mod_args`` (``Options.mod_arrays``)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise TypeError(f"{name} must be an array, got {type(x).__name__}")
    prob = with_softcap(check_forward(*(_stand_in(x) for x in (q, k, v)), causal, softmax_scale, window), softcap)
    check_choice("precision", precision, PRECISIONS)
    check_bool("deterministic", deterministic)
    offsets, maxima = _packed(varlen, prob)
    words = None if dropout_rng is None else _key_words(dropout_rng)
    dropout_p = check_dropout(dropout_p, 0 if words is None else _stand_in(words))[0]   # p's checks
    if dropout_p and words is None:
        raise ValueError("dropout_p > 0 needs dropout_rng, a JAX PRNG key (jax.random.key(...) or PRNGKey(...))")
    words = words if dropout_p else None
    modifiers = _modifier_arrays(prob, {"alibi_slopes": alibi_slopes, "sink": sink, "bias": bias, "mask": mask,
                                        "seed": words})
    if block_mask is not None:
        if not isinstance(block_mask, BlockMask):
            raise TypeError(f"block_mask must be a cupyflash.BlockMask (cupyflash.block_mask(...)), got "
                            f"{type(block_mask).__name__}")
        if mod_args is not None:
            raise ValueError("mod_args is given with a block_mask: the expressions read the block mask's own "
                             "mod_args (leave mod_args out)")
        block_mask.check_call(_stand_in(q), _stand_in(k), mask_mod, None)
        if varlen is not None:
            raise TypeError("block_mask is not for packed sequences: their tile maps depend on each call's offsets")
        options = Options(prob.causal, prob.scale, prob.window, prob.softcap, precision, bool(deterministic),
                          score_mod, score_mod_grad, None, (), (), tuple(modifiers), block_mask, dropout_p=dropout_p)
        options.expressions()
        return prob, options, tuple(modifiers.values())
    mod_args, arrays = _mod_arrays(mod_args)
    user = user_mods(score_mod, score_mod_grad, mask_mod, mod_args)
    numbers = () if user is None else tuple((name, x) for name, x in user.args.items() if name not in arrays)
    specs = tuple((name, tuple(x.shape), numpy.dtype(x.dtype).name) for name, x in arrays.items())
    return prob, Options(prob.causal, prob.scale, prob.window, prob.softcap, precision, bool(deterministic),
                         score_mod, score_mod_grad, mask_mod, numbers, specs, tuple(modifiers), varlen=maxima,
                         dropout_p=dropout_p), (*offsets, *modifiers.values(), *arrays.values())


def _key_words(key):
    """Dropout's key as the kernels' seed: the two uint32 words of a JAX PRNG key (a typed key's
    ``jax.random.key_data``, or a raw ``PRNGKey``), the low one first: the seed ``words[0] + 2^32
    words[1]`` of :func:`cupyflash.flash_attention_forward`."""
    if not hasattr(key, "dtype"):
        key = jnp.asarray(key)
    if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.key_data(key)
    if key.dtype != jnp.uint32 or key.shape != (2,):
        raise ValueError(f"dropout_rng must be one JAX PRNG key of two uint32 words (jax.random.key or PRNGKey, "
                         f"threefry), got shape {key.shape}, dtype {key.dtype}")
    return key


def _packed(varlen, prob) -> tuple:
    """``(offsets, maxima)`` of packed sequences (``((), None)`` without): the offsets as JAX arrays
    (1-D, integer, one length, traced: their values are not read) and the maxima as ints, which a
    compiled call fixes, checked against the rows there are."""
    if varlen is None:
        return (), None
    offsets = tuple(jnp.asarray(cu) for cu in varlen[:2])
    check_offset_shapes(*offsets)
    maxima = []
    for name, n, total in (("max_seqlen_q", varlen[2], prob.Nq), ("max_seqlen_k", varlen[3], prob.Nk)):
        if isinstance(n, bool) or not isinstance(n, (int, numpy.integer)) or not 0 <= n <= total:
            raise ValueError(f"{name} must be an int from 0 to the packed rows ({total}), got {n!r}: "
                             f"a compiled call fixes it")
        maxima.append(int(n))
    return offsets, tuple(maxima)


def _mod_arrays(mod_args) -> tuple:
    """``(mod_args, arrays)``: the numbers of ``mod_args`` stay (they go in the attribute), anything else
    becomes a JAX array (a tracer under jit, an operand) in ``arrays`` by name and a stand-in of its shape
    and dtype in the ``mod_args`` returned, which the checks read; not a dict: as given, for them to refuse."""
    if not isinstance(mod_args, dict):
        return mod_args, {}
    arrays = {}
    for name, x in mod_args.items():
        if not isinstance(x, NUMBERS):
            try:
                arrays[name] = jnp.asarray(x)
            except (TypeError, ValueError) as error:
                raise TypeError(f"mod_args[{name!r}] must be a number or an array of numbers, got "
                                f"{type(x).__name__}") from error
    return {name: _stand_in(arrays[name]) if name in arrays else x for name, x in mod_args.items()}, arrays


def _modifier_arrays(prob, given: dict) -> dict:
    """The modifiers' arrays of ``given`` (keyword -> array or None) as JAX arrays, each checked as
    cupyflash checks it (``MODIFIERS``) through a stand-in of its shape and dtype."""
    arrays = {}
    for name, check_array in MODIFIERS:
        x = given[name]
        if x is None:
            continue
        try:
            x = jnp.asarray(x)
        except (TypeError, ValueError) as error:
            raise TypeError(f"{name} must be an array, got {type(x).__name__}") from error
        check_array(name, _stand_in(x), prob)
        arrays[name] = x
    return arrays


def _check_backward(options: Options):
    """ValueError, while the gradient is traced, where a score_mod has no score_mod_grad."""
    options.expressions(backward=True)


# ---------------------------------------------------------------------------------------------------------
# The handlers
# ---------------------------------------------------------------------------------------------------------


def _host_array(buf: _xla_ffi.BufferView):
    """A NumPy array over an XLA host buffer, writeable, no copy."""
    if buf.nbytes == 0:
        return numpy.empty(buf.shape, buf.dtype)
    raw = (ctypes.c_char * buf.nbytes).from_address(buf.data)
    return numpy.frombuffer(raw, buf.dtype).reshape(buf.shape)


def _device_array(buf: _xla_ffi.BufferView, device: int):
    """A CuPy array over an XLA device buffer, no copy (XLA owns the memory), kept by address, shape and
    dtype (``_views.device_view``)."""
    return device_view(buf.data, buf.nbytes, buf.shape, buf.dtype, None, device)


class _XlaStream:
    """XLA's stream, by the CUDA stream protocol (what ``cupy.cuda.Stream.from_external`` reads)."""

    def __init__(self, handle: int):
        self.handle = handle

    def __cuda_stream__(self):
        return (0, self.handle)


_streams: dict = {}   # (device, stream handle) -> cupy.cuda.Stream: XLA keeps its streams for the process


def _cupy_stream(handle: int, device: int):
    stream = _streams.get((device, handle))
    if stream is None:
        import cupy

        stream = _streams[(device, handle)] = cupy.cuda.Stream.from_external(_XlaStream(handle))
    return stream


# the function a handler calls, by (backward, packed sequences), and its positional inputs
FUNCTIONS = {(False, False): (flash_attention_forward, 3), (True, False): (flash_attention_backward, 7),
             (False, True): (flash_attention_varlen_forward, 5), (True, True): (flash_attention_varlen_backward, 9)}


@contextlib.contextmanager
def _buffers(call: _xla_ffi.Call, on_gpu: bool):
    """``(args, rets)``: a call's operand and result buffers as arrays over their memory, NumPy on the CPU, CuPy
    on the GPU, where the block runs on the call's device and stream."""
    if not on_gpu:
        yield [_host_array(b) for b in call.args], [_host_array(b) for b in call.rets]
        return
    import cupy

    device = call.device()
    with cupy.cuda.Device(device), _cupy_stream(call.stream(), device):
        yield [_device_array(b, device) for b in call.args], [_device_array(b, device) for b in call.rets]


def _run(call: _xla_ffi.Call, on_gpu: bool, backward: bool):
    """One call of either target: cupyflash over XLA's buffers, writing into XLA's results. The operands
    are the inputs (do, q, k, v, o, m, l of the backward, q, k, v of the forward, then with packed
    sequences their offsets), the modifiers' arrays and those of mod_args (``keywords``)."""
    text = call.attrs[OPTIONS]
    function, inputs = FUNCTIONS[(backward, _parsed(text)[1])]
    with _buffers(call, on_gpu) as (args, rets):
        _into_rets(function(*args[:inputs], out=FreshOut(rets[:3]), **keywords(text, args[inputs:])), rets)


def _into_rets(results, rets):
    """The results past the three the call wrote in place (the backward's dbias, dsink) into XLA's
    result buffers, cast to their dtypes (on the GPU, a copy on the call's stream)."""
    for ret, result in zip(rets[3:], results[3:]):
        ret[...] = result


def _run_kvcache(call: _xla_ffi.Call, on_gpu: bool):
    """One call of the K/V cache's target: its operands q, k_cache, v_cache, cache_seqlens, then those the
    attribute names (k, v, block_table, alibi_slopes); its results o, m, l and the caches, which alias the
    caches given (XLA's ``input_output_aliases``): the new keys are written into those, then attended."""
    kw, names = _parsed_call(call.attrs[OPTIONS])
    with _buffers(call, on_gpu) as (args, rets):
        kvcache.flash_attention_with_kvcache(args[0], rets[3], rets[4], args[3], out=FreshOut(rets[:3]), **kw,
                                             **dict(zip(names, args[4:])))


@functools.lru_cache(maxsize=256)
def _parsed_call(text: str) -> tuple:
    """``(keywords, names of the optional operands)`` of the K/V cache's or the float8 call's ``OPTIONS`` text,
    parsed once per text."""
    parsed = json.loads(text)
    kw = parsed["keywords"]
    kw["window"] = tuple(kw["window"])
    return kw, tuple(parsed["operands"])


def _run_fp8(call: _xla_ffi.Call, on_gpu: bool):
    """One call of the float8 target: operands q, k, v (float8 e4m3, as their bits), then the per-entry descales
    the attribute names; results o, m, l (o's dtype the call's out_dtype)."""
    kw, names = _parsed_call(call.attrs[OPTIONS])
    with _buffers(call, on_gpu) as (args, rets):
        float8.flash_attention_forward_fp8(*args[:3], out_dtype=rets[0].dtype, out=FreshOut(rets), **kw,
                                           **dict(zip(names, args[3:])))


# (target, platform as JAX names it, whether the handler runs CuPy)
TARGETS = tuple((target, platform, platform == "CUDA") for platform in ("cpu", "CUDA")
                for target in (FORWARD_TARGET, BACKWARD_TARGET, KVCACHE_TARGET, FP8_TARGET))
RUNS = {KVCACHE_TARGET: _run_kvcache, FP8_TARGET: _run_fp8}   # the targets but the forward's and backward's
_handlers: dict = {}          # (target, platform) -> _xla_ffi.Handler, alive as long as XLA may call it
_registering = threading.Lock()


def _version() -> tuple:
    """The FFI API version of the header installed with jaxlib; (0, 1) where none is found (XLA's
    refusal then names its own, and registration tries that)."""
    try:
        return _xla_ffi.header_version(jax.ffi.include_dir())
    except (OSError, AttributeError, ValueError):
        return (0, 1)


@functools.lru_cache(maxsize=1)
def _platforms() -> frozenset:
    """The platforms of JAX's backends that the handlers serve: 'cpu' and, with CUDA GPUs, 'CUDA'
    (asking starts the backends, which are then fixed for the process)."""
    found = {"cpu"}
    try:
        if jax.devices("cuda"):
            found.add("CUDA")
    except RuntimeError:   # no CUDA backend
        pass
    return frozenset(found)


def register() -> None:
    """Register the handlers with XLA for each platform present (once; later calls return at once).

    Backends are started first (``jax.devices()``), so a registration XLA refuses raises here. A
    refusal of the handler's API version is retried once with the version XLA names.
    """
    with _registering:
        platforms = _platforms()
        for target, platform, on_gpu in TARGETS:
            if platform not in platforms or (target, platform) in _handlers:
                continue
            execute = (functools.partial(RUNS[target], on_gpu=on_gpu) if target in RUNS else
                       functools.partial(_run, on_gpu=on_gpu, backward=target == BACKWARD_TARGET))
            handler = _xla_ffi.Handler(target, execute, _version())
            try:
                jax.ffi.register_ffi_target(target, handler.capsule, platform=platform)
            except Exception as e:   # jaxlib's XlaRuntimeError; its class differs between versions
                version = _xla_ffi.framework_version(str(e))
                if version is None or version == handler.version:
                    raise
                handler.version = version
                jax.ffi.register_ffi_target(target, handler.capsule, platform=platform)
            _handlers[(target, platform)] = handler


# ---------------------------------------------------------------------------------------------------------
# The calls and their VJP
# ---------------------------------------------------------------------------------------------------------


def _batch_shape(q, k, v) -> tuple:
    return tuple(numpy.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2]))


def _ffi_call(target: str, results, options: Options):
    """``jax.ffi.ffi_call`` of ``target``: under ``vmap`` one call over the broadcast batch, or one call
    per batch entry where mod_args arrays ride along (broadcast, they would gain the batch's dims) or a
    block mask serves the unbatched shapes."""
    per_entry = options.mod_arrays or options.modifiers or options.block_mask is not None or options.varlen
    return jax.ffi.ffi_call(target, results, vmap_method="sequential" if per_entry else "broadcast_all")


def flash_attention_forward_ffi(q, k, v, options: Options, arrays=()):
    """The forward target on JAX arrays: one XLA custom call, no VJP of its own.

    Parameters
    ----------
    q, k, v : jax.Array
        As in :func:`flash_attention`.
    options : Options
        From :func:`check` (which validates q, k, v with them).
    arrays : tuple of jax.Array
        The operands after q, k, v, from :func:`check`: the modifiers' arrays, then mod_args'.

    Returns
    -------
    o : jax.Array, shape (*batch, Nq, D)
    m, l : jax.Array, shape (*batch, Nq)
        Row max and row exp-sum, float32 (float64 for float64 inputs), as
        :func:`cupyflash.flash_attention_forward` returns them.
    """
    register()
    stats = jax.ShapeDtypeStruct((*_batch_shape(q, k, v), q.shape[-2]), accumulator_dtype(q.dtype))
    results = (jax.ShapeDtypeStruct((*stats.shape, q.shape[-1]), q.dtype), stats, stats)
    return _ffi_call(FORWARD_TARGET, results, options)(q, k, v, *arrays, **options.attributes(backward=False))


def flash_attention_backward_ffi(do, q, k, v, o, m, l, options: Options, arrays=(), bias_grad: bool = False):
    """The backward target on JAX arrays: one XLA custom call.

    Parameters
    ----------
    do : jax.Array, shape (*batch, Nq, D)
        The cotangent of ``o``.
    q, k, v, o, m, l : jax.Array
        The forward's inputs and :func:`flash_attention_forward_ffi`'s results.
    options, arrays
        The forward's.
    bias_grad : bool, optional
        Also return dbias (the options must have a bias).

    Returns
    -------
    dq, dk, dv : jax.Array
        Each of its input's shape and dtype, summed over the batch dims along
        which that input broadcast (:func:`cupyflash.flash_attention_backward`).
    dbias : jax.Array
        With ``bias_grad``: of the bias's shape and dtype.
    dsink : jax.Array
        Where the options have a sink: of its shape and dtype.
    """
    register()
    given = options.named(arrays)
    extra = [given[name] for name in (("bias",) if bias_grad else ()) + ("sink",) if name in given]
    results = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v, *extra))
    call = _ffi_call(BACKWARD_TARGET, results, options)
    return call(do, q, k, v, o, m, l, *arrays, **options.attributes(backward=True, bias_grad=bias_grad))


def _lse(m, l):
    """``lse = m + log l`` (``-inf`` for a row that saw no key)."""
    return m + jnp.log(l)


# The modifiers' and mod_args' arrays are inputs of the VJP functions: a sink's cotangent is its dsink, a
# bias's its dbias where the bias is differentiated (symbolic_zeros tells: else it is not computed), the
# others' None (zero), constants to it.

@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _attention(q, k, v, arrays, options):
    return flash_attention_forward_ffi(q, k, v, options, arrays)[0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _attention_lse(q, k, v, arrays, options):
    o, m, l = flash_attention_forward_ffi(q, k, v, options, arrays)
    return o, _lse(m, l)


def _forward_saving(q, k, v, arrays, options):
    """``(o, m, l)`` and the residuals of either VJP: the primals (unwrapped from symbolic_zeros'
    wrappers), o, m, l, and whether dbias is wanted, as the residuals' structure (``((),)`` or ``()``)."""
    bias_grad = "bias" in options.modifiers and options.named(arrays)["bias"].perturbed
    q, k, v = (x.value for x in (q, k, v))
    arrays = tuple(x.value for x in arrays)
    o, m, l = flash_attention_forward_ffi(q, k, v, options, arrays)
    return (o, m, l), (q, k, v, arrays, o, m, l, ((),) if bias_grad else ())


def _attention_fwd(q, k, v, arrays, options):
    (o, _, _), saved = _forward_saving(q, k, v, arrays, options)
    return o, saved


def _attention_lse_fwd(q, k, v, arrays, options):
    (o, m, l), saved = _forward_saving(q, k, v, arrays, options)
    return (o, _lse(m, l)), saved


def _gradients(options, saved, do, dlse=None):
    """The cotangents of ``(q, k, v, arrays)`` from ``do`` (and ``dlse``, the cotangent of lse, if any)."""
    _check_backward(options)
    q, k, v, arrays, o, m, l, wants = saved
    bias_grad = bool(wants)
    if isinstance(do, jax.custom_derivatives.SymbolicZero):
        do = jnp.zeros(o.shape, o.dtype)
    if dlse is None:
        dq, dk, dv, *extra = flash_attention_backward_ffi(do, q, k, v, o, m, l, options, arrays, bias_grad)
    else:
        dq, dk, dv, *extra = _lse_backward(do, dlse, q, k, v, o, m, l, options, arrays, bias_grad)
    got = dict(zip((("bias",) if bias_grad else ()) + (("sink",) if "sink" in options.modifiers else ()), extra))
    offsets = (None, None) if options.varlen else ()
    return dq, dk, dv, (*offsets, *(got.get(name) for name in options.modifiers)) + (None,) * len(options.mod_arrays)


def _attention_bwd(options, saved, do):
    return _gradients(options, saved, do)


def _attention_lse_bwd(options, saved, cotangents):
    do, dlse = cotangents
    return _gradients(options, saved, do, None if isinstance(dlse, jax.custom_derivatives.SymbolicZero) else dlse)


_attention.defvjp(_attention_fwd, _attention_bwd, symbolic_zeros=True)
_attention_lse.defvjp(_attention_lse_fwd, _attention_lse_bwd, symbolic_zeros=True)


def _lse_backward(do, dlse, q, k, v, o, m, l, options, arrays, bias_grad):
    """Gradients with a cotangent ``g`` of ``lse`` too, by one backward over a head dim one wider.

    ``d lse_i / d s_ij = P_ij``, so ``dS_ij = P_ij (dP_ij - D_i + g_i)`` with ``dP = dO Vᵀ`` and
    ``D_i = rowsum(dO_i ∘ O_i)``. The backward computes exactly that from ``v' = [v, 1]``,
    ``do' = [do, g]`` and ``o' = [o, 0]``: ``dP' = dP + g``, ``D' = D``. Its ``dv'`` less the last
    column is ``dv``; ``dq``, ``dk`` are unchanged by the extra column of ``q``, ``k`` (zeros), dbias is
    right as it comes; a sink's ``d lse_i / d sink = P_sink,i = exp(sink - m_i) / l_i`` is added to dsink.
    """
    if q.shape[-1] + 1 > MAX_HEAD_DIM:
        raise NotImplementedError(f"the gradient through lse needs a head dim D < {MAX_HEAD_DIM}, got D={q.shape[-1]}")
    if options.dropout_p:   # the extra column's g_i would be dropped with the pair's dP_ij: lse is dropout's outside
        raise NotImplementedError("the gradient through lse is not taken with dropout (lse is the statistic before "
                                  "dropout; the wider backward that carries it would drop its term too)")
    wide = (lambda x, c: jnp.concatenate([x, jnp.broadcast_to(c, (*x.shape[:-1], 1)).astype(x.dtype)], axis=-1))
    dq, dk, dv, *extra = flash_attention_backward_ffi(wide(do, dlse[..., None]), wide(q, 0), wide(k, 0), wide(v, 1),
                                                      wide(o, 0), m, l, options, arrays, bias_grad)
    if "sink" in options.modifiers:
        sink = options.named(arrays)["sink"]
        p_sink = jnp.exp(jnp.broadcast_to(sink, m.shape[:-1])[..., None] - m) / l   # (*batch, Nq)
        extra[-1] = extra[-1] + _sum_to((dlse * p_sink).sum(-1), sink.shape).astype(sink.dtype)
    return (dq[..., :-1], dk[..., :-1], dv[..., :-1], *extra)


def _sum_to(x, shape):
    """``x`` summed over the dims along which ``shape`` broadcasts to ``x.shape``."""
    lead = x.ndim - len(shape)
    x = x.sum(axis=tuple(range(lead))) if lead else x
    return x.sum(axis=tuple(i for i, n in enumerate(shape) if n == 1 and x.shape[i] != 1), keepdims=True)


def flash_attention(q, k, v, *, causal: bool = False, softmax_scale: Optional[float] = None,
                    window=None, softcap: Optional[float] = None, alibi_slopes=None, sink=None, bias=None,
                    mask=None, dropout_p: float = 0.0, dropout_rng=None, precision: str = "highest",
                    deterministic: bool = False, return_lse: bool = False, score_mod: Optional[str] = None,
                    score_mod_grad: Optional[str] = None, mask_mod: Optional[str] = None,
                    mod_args: Optional[dict] = None, block_mask: Optional[BlockMask] = None):
    """Exact attention on JAX arrays, differentiable, inside or outside ``jax.jit``.

    Parameters
    ----------
    q : jax.Array, shape (..., Nq, D)
    k, v : jax.Array, shape (..., Nk, D)
        One dtype: float16, bfloat16, float32, or float64 (with ``jax_enable_x64``).
        ``1 <= D <= 256``. The batch dims broadcast as in ``numpy.matmul``, so GQA
        is ``q (B, Hkv, G, N, D)`` with ``k, v (B, Hkv, 1, N, D)``.
    causal, softmax_scale, window, softcap, precision
        As in :func:`cupyflash.flash_attention_forward`. Static: each distinct set
        is a distinct compiled call.
    alibi_slopes : jax.Array, optional
        ALiBi's slope per batch entry (broadcasting to the batch shape), as in
        :func:`cupyflash.flash_attention_forward`. Traced; no gradient reaches it.
    sink : jax.Array, optional
        A sink logit per batch entry, as there. Traced, differentiable (dsink).
    bias : jax.Array, optional
        Added to the scores, broadcasting to ``(*batch, Nq, Nk)``, as there.
        Traced, differentiable: dbias is computed where the bias is differentiated.
    mask : jax.Array of bool, optional
        Visible pairs, broadcasting to ``(*batch, Nq, Nk)``, as there. Traced; no
        gradient.
    dropout_p : float, optional
        Dropout on the attention probabilities, as in
        :func:`cupyflash.flash_attention_forward`. Static.
    dropout_rng : jax.Array, optional
        A JAX PRNG key (``jax.random.key(...)`` or ``jax.random.PRNGKey(...)``),
        needed when ``dropout_p > 0``. Traced: its two words are the kernels' seed,
        read on the device as they run (``words[0] + 2³² words[1]``, the seed
        :func:`cupyflash.dropout_mask` takes), so a new key each step needs no new
        trace; the backward drops what the forward dropped. Split it per step
        as usual; an unbatched key under ``vmap`` drops alike in every entry.
    deterministic : bool, optional
        Bitwise-identical gradients run to run (:func:`cupyflash.flash_attention_backward`).
    return_lse : bool, optional
        Also return ``lse = m + log l``, shape ``(*batch, Nq)``, float32 (float64
        for float64 inputs). It is differentiable too (for ``D < 256``, without
        dropout): its gradient takes one backward over a head dim one wider.
    score_mod, score_mod_grad, mask_mod : str, optional
        User expressions, as in :func:`cupyflash.flash_attention_forward` and
        :func:`cupyflash.flash_attention_backward`; a gradient through a
        ``score_mod`` needs ``score_mod_grad`` (a ValueError while the gradient is traced).
    mod_args : dict, optional
        What the expressions read by name: numbers (ints and floats, static as
        the other options) and arrays (JAX or NumPy, traced: operands of the
        custom calls, read as constants, so no gradient reaches them; the
        expressions index them flat, in C order).
    block_mask : cupyflash.BlockMask, optional
        A ``mask_mod`` with its tile maps kept (:func:`cupyflash.block_mask`),
        in place of ``mask_mod`` and ``mod_args`` (the expressions read its
        ``mod_args``); made for the unbatched shapes under ``vmap``. Static.

    Returns
    -------
    o : jax.Array, shape (*batch, Nq, D)
        ``softmax(S) v`` in the input dtype; ``batch`` is the broadcast batch shape.
    lse : jax.Array, shape (*batch, Nq)
        With ``return_lse`` only.

    Raises
    ------
    TypeError, ValueError
        As :func:`cupyflash.flash_attention_forward` for bad inputs or options, while
        the call is traced.

    Notes
    -----
    The forward and backward each run as one XLA custom call whose handler is Python
    (``cupyflash._xla_ffi``): on a CUDA device it runs cupyflash's kernels on XLA's stream,
    reading and writing XLA's buffers in place; on the CPU, cupyflash's NumPy path. Gradients
    are FlashAttention's recomputation backward from the saved ``o, m, l``. Under ``jax.vmap``
    each call runs once over the broadcast batch.

    See Also
    --------
    cupyflash.flash_attention_forward, cupyflash.flash_attention_backward : the calls each handler makes.
    cupyflash.reference.attention_forward : the naive float64 reference.
    """
    _, options, arrays = check(q, k, v, causal, softmax_scale, window, softcap, precision, deterministic,
                               score_mod, score_mod_grad, mask_mod, mod_args, block_mask, alibi_slopes, sink, bias,
                               mask, dropout_p=dropout_p, dropout_rng=dropout_rng)
    return _attention_lse(q, k, v, arrays, options) if return_lse else _attention(q, k, v, arrays, options)


def flash_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int, *,
                           causal: bool = False, softmax_scale: Optional[float] = None, window=None,
                           softcap: Optional[float] = None, alibi_slopes=None, sink=None, bias=None, mask=None,
                           dropout_p: float = 0.0, dropout_rng=None, precision: str = "highest",
                           deterministic: bool = False, return_lse: bool = False,
                           score_mod: Optional[str] = None, score_mod_grad: Optional[str] = None,
                           mask_mod: Optional[str] = None, mod_args: Optional[dict] = None):
    """Exact attention over packed variable-length sequences on JAX arrays, inside or outside ``jax.jit``.

    Parameters
    ----------
    q : jax.Array, shape (..., total_q, D)
    k, v : jax.Array, shape (..., total_k, D)
        The sequences' rows one after another, as in
        :func:`cupyflash.flash_attention_varlen_forward`.
    cu_seqlens_q, cu_seqlens_k : jax.Array of int, shape (n_seq + 1,)
        The sequences' offsets (traced: another packing needs no retrace; their
        values are not checked, as cupyflash does not with both maxima given).
    max_seqlen_q, max_seqlen_k : int
        Bounds of the sequences' lengths, static (a compiled call fixes its grid).
    causal, ..., mod_args
        As in :func:`flash_attention` (no ``block_mask``: maps of packed sequences
        depend on the offsets).

    Returns
    -------
    o : jax.Array, shape (*batch, total_q, D)
    lse : jax.Array, shape (*batch, total_q)
        With ``return_lse`` only.
    """
    _, options, arrays = check(q, k, v, causal, softmax_scale, window, softcap, precision, deterministic,
                               score_mod, score_mod_grad, mask_mod, mod_args, None, alibi_slopes, sink, bias, mask,
                               (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k), dropout_p, dropout_rng)
    return _attention_lse(q, k, v, arrays, options) if return_lse else _attention(q, k, v, arrays, options)


class _Shape:
    """What cupyflash's shape checks read of a JAX array (``kvcache._check_shapes``): its shape, dtype and
    the strides of a C-ordered array of them."""

    def __init__(self, x):
        self.shape, self.dtype = tuple(x.shape), numpy.dtype(x.dtype)
        self.ndim, self.itemsize = len(self.shape), self.dtype.itemsize
        strides, step = [], self.itemsize
        for n in reversed(self.shape):
            strides.append(step)
            step *= max(n, 1)
        self.strides = tuple(reversed(strides))


def flash_attention_with_kvcache(q, k_cache, v_cache, cache_seqlens, k=None, v=None, *, block_table=None,
                                 causal: bool = True, softmax_scale: Optional[float] = None, window=None,
                                 softcap: Optional[float] = None, alibi_slopes=None, num_splits: Optional[int] = None,
                                 return_lse: bool = False):
    """Attention of new queries against a K/V cache on JAX arrays, the new keys appended first, inside or
    outside ``jax.jit`` (decoding; no gradient).

    Parameters
    ----------
    q, k_cache, v_cache, cache_seqlens, k, v, block_table, causal, softmax_scale, window, softcap,
    alibi_slopes, num_splits
        As in :func:`cupyflash.flash_attention_with_kvcache`: q ``(B, Hq, Nq, D)``, a contiguous cache
        ``(B, Hkv, N_max, D)`` or a paged one ``(pages, Hkv, page_size, D)`` with ``block_table``
        (int32), ``cache_seqlens`` int32 ``(B,)``, new keys and values ``(B, Hkv, Nnew, D)``. Traced:
        arrays; static: the rest.
    return_lse : bool, optional
        Also return ``lse = m + log l``, shape ``(B, Hq, Nq)``.

    Returns
    -------
    o : jax.Array, q's shape and dtype
    k_cache, v_cache : jax.Array
        The caches with the new keys and values written at ``cache_seqlens`` (the caller advances it).
        The call's results alias the caches given: donated (``jax.jit(..., donate_argnums=...)``) they
        are written in place; otherwise XLA copies them first.
    lse : jax.Array, shape (B, Hq, Nq)
        With ``return_lse`` only.

    Raises
    ------
    TypeError, ValueError
        As :func:`cupyflash.flash_attention_with_kvcache` for bad shapes, dtypes or options, while
        the call is traced; lengths past the capacity where the CPU reads them (as there, the GPU clamps
        and does not check).
    """
    register()
    given = {name: jnp.asarray(x) for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache),
                                                  ("k", k), ("v", v), ("block_table", block_table))
             if x is not None}
    q, k_cache, v_cache = given["q"], given["k_cache"], given["v_cache"]
    B, Hq, Nq, D, Hkv, capacity, n_new = kvcache._check_shapes(
        *(None if given.get(name) is None else _Shape(given[name])
          for name in ("q", "k_cache", "v_cache", "k", "v", "block_table")))
    for name in ("k_cache", "v_cache"):
        if given[name].dtype != q.dtype:
            raise TypeError(f"{name} must have q's dtype {q.dtype}, got {given[name].dtype}")
    G = Hq // Hkv
    stand = (_stand_in(jax.ShapeDtypeStruct(s, q.dtype)) for s in ((B, Hkv, G, Nq, D), (B, Hkv, 1, capacity, D)))
    q5, k5 = stand
    prob = with_softcap(check_forward(q5, k5, k5, causal, softmax_scale, window), softcap)
    num_splits = check_splits(num_splits, "auto")
    lens = jnp.asarray(cache_seqlens)
    if lens.shape != (B,) or not jnp.issubdtype(lens.dtype, jnp.integer):
        raise ValueError(f"cache_seqlens must hold B = {B} integer lengths, got shape {lens.shape}, dtype {lens.dtype}")
    operands, names = [q, k_cache, v_cache, lens.astype(jnp.int32)], []
    if k is not None:
        operands += [given["k"], given["v"]]
        names += ["k", "v"]
    if block_table is not None:
        operands.append(given["block_table"].astype(jnp.int32))
        names.append("block_table")
    acc = accumulator_dtype(q.dtype)
    if alibi_slopes is not None:
        slopes = jnp.asarray(alibi_slopes)
        try:
            slopes = jnp.broadcast_to(slopes, (B, Hq)).astype(acc)
        except ValueError:
            raise ValueError(f"alibi_slopes of shape {slopes.shape} does not broadcast to (B, Hq) = ({B}, {Hq})") \
                from None
        operands.append(slopes)
        names.append("alibi_slopes")
    kw = dict(causal=prob.causal, softmax_scale=prob.scale, window=prob.window, softcap=prob.softcap,
              num_splits=num_splits)
    stats = jax.ShapeDtypeStruct((B, Hq, Nq), acc)
    results = (jax.ShapeDtypeStruct(q.shape, q.dtype), stats, stats, jax.ShapeDtypeStruct(k_cache.shape, q.dtype),
               jax.ShapeDtypeStruct(v_cache.shape, q.dtype))
    call = jax.ffi.ffi_call(KVCACHE_TARGET, results, input_output_aliases={1: 3, 2: 4}, vmap_method="sequential")
    o, m, l, k_cache, v_cache = call(*operands, **{OPTIONS: json.dumps({"keywords": kw, "operands": names})})
    return (o, k_cache, v_cache, _lse(m, l)) if return_lse else (o, k_cache, v_cache)


def flash_attention_fp8(q, k, v, *, q_descale=1.0, k_descale=1.0, v_descale=1.0,
                        out_dtype=jnp.bfloat16, causal: bool = False, softmax_scale: Optional[float] = None,
                        window=None, return_lse: bool = False):
    """Attention of float8 e4m3 JAX arrays with descales per tensor or per batch entry, inside or outside
    ``jax.jit`` (FlashAttention-3's FP8 forward; no gradient).

    Parameters
    ----------
    q, k, v : jax.Array of ``jnp.float8_e4m3fn``, shapes (..., Nq, D), (..., Nk, D)
        Batch dims broadcast as in :func:`cupyflash.flash_attention_forward_fp8` (GQA: ``k, v (B, Hkv, 1, N,
        D)`` against ``q (B, Hkv, G, N, D)``). Traced.
    q_descale, k_descale, v_descale : float or jax.Array, optional
        As in :func:`cupyflash.flash_attention_forward_fp8`: a number (static), or a float32 array of one
        factor per batch entry whose shape broadcasts to the batch shape (per head: ``(B, Hkv, 1)``;
        traced, its values not checked: positive and finite).
    causal, softmax_scale, window
        As in :func:`cupyflash.flash_attention_forward_fp8`. Static.
    out_dtype : jnp.bfloat16 or jnp.float16, optional
    return_lse : bool, optional
        Also return ``lse = m + log l``, float32.

    Returns
    -------
    o : jax.Array, shape (*batch, Nq, D), ``out_dtype``
    lse : jax.Array, shape (*batch, Nq)
        With ``return_lse`` only.
    """
    register()
    q, k, v = (jnp.asarray(x) for x in (q, k, v))
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dtype != jnp.float8_e4m3fn:
            raise TypeError(f"{name} must have dtype float8_e4m3fn, got {x.dtype}")
    prob = check_forward(*(_stand_in(x) for x in (q, k, v)), causal, softmax_scale, window, supported=FLOAT8_DTYPES)
    kw = dict(causal=prob.causal, softmax_scale=prob.scale, window=prob.window)
    arrays = {}   # the per-entry descales, operands after q, k, v
    for name, value in zip(float8.DESCALES, (q_descale, k_descale, v_descale)):
        if isinstance(value, (jax.Array, numpy.ndarray)):   # (a tracer is a jax.Array)
            arrays[name] = _descale_operand(name, value, prob)
        else:
            kw[name] = float8._check_descale(name, value)
    o_dtype = float8._check_out_dtype(numpy.dtype(out_dtype))
    stats = jax.ShapeDtypeStruct((*prob.batch_shape, prob.Nq), jnp.float32)
    results = (jax.ShapeDtypeStruct((*prob.batch_shape, prob.Nq, prob.D), o_dtype), stats, stats)
    o, m, l = jax.ffi.ffi_call(FP8_TARGET, results, vmap_method="broadcast_all")(
        q, k, v, *arrays.values(), **{OPTIONS: json.dumps({"keywords": kw, "operands": list(arrays)})})
    return (o, _lse(m, l)) if return_lse else o


def _descale_operand(name: str, value, prob):
    """A per-entry descale as the float8 target's operand: float32, its shape broadcasting to the batch
    shape (``check_per_entry`` on a stand-in, as the modifiers' arrays are checked)."""
    if value.dtype != jnp.float32:   # (before jnp.asarray, which would take a float64 one to float32)
        raise TypeError(f"{name} must be a number or a float32 array, got dtype {value.dtype}")
    check_per_entry(name, _stand_in(value), prob, dtype=numpy.float32)
    return jnp.asarray(value)
