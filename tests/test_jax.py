"""cupyflash.jax: attention inside jax.jit and under jax.grad, through XLA's FFI with a ctypes handler.

On the CPU (here and in CI) the handler runs cupyflash's NumPy path inside XLA: values and gradients
against the float64 reference and against ``jax.nn.dot_product_attention``, the lse and its gradient,
vmap, the checks at trace time, the ctypes mirrors against the header installed with jaxlib, and the
handler's answers to XLA (metadata, errors). On a CUDA GPU (``-m gpu``, JAX with CUDA) the same
checks run on the CUDA target, in float16, bfloat16 and float32, on XLA's own stream.
"""

import ctypes
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy
import pytest

# on a GPU, XLA takes 75% of the memory at its first use unless told not to; CuPy (these kernels'
# workspaces, and the other GPU tests of this process) needs its share
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import cupyflash  # noqa: E402
import cupyflash.jax as cfj  # noqa: E402
import yardsticks  # noqa: E402
from cupyflash import _xla_ffi, reference  # noqa: E402
from helpers import gpu_test, random_inputs  # noqa: E402
from tolerances import (BWD_CEILING, FWD_CEILING, assert_gradient, assert_twice_naive, gradient_magnitudes,  # noqa: E402
                        largest_logit, rel_err, stored_output_error)

# (q shape, k/v shape, options): ragged lengths, head dims off the tile sizes, every option, GQA by broadcast
CASES = {
    "one key": ((2, 1, 8), (2, 1, 8), {}),
    "causal, Nq < Nk": ((2, 3, 17, 40), (2, 3, 113, 40), dict(causal=True)),
    "window, Nq > Nk": ((1, 2, 113, 72), (1, 2, 17, 72), dict(window=(5, 3))),
    "softcap, scale": ((2, 33, 16), (2, 33, 16), dict(softcap=2.0, softmax_scale=0.7)),
    "gqa, causal window": ((2, 2, 3, 65, 24), (2, 2, 1, 65, 24), dict(causal=True, window=(9, None))),
    "alibi, mask": ((2, 3, 17, 40), (2, 3, 29, 40), dict(causal=True, alibi_slopes=numpy.array([0.5, 0.25, 0.125]),
                                                         mask=numpy.random.default_rng(1).random((17, 29)) < 0.8)),
    "bias, sink": ((2, 3, 17, 40), (2, 3, 29, 40), dict(causal=True, sink=numpy.array([0.5, -1.0, 2.0]),
                                                        bias=numpy.random.default_rng(2).standard_normal((1, 3, 17, 29)))),
}


def gpu_device():
    """JAX's first CUDA device, or a skip."""
    try:
        return jax.devices("gpu")[0]
    except RuntimeError:
        pytest.skip("needs JAX with CUDA")


def attention_and_grads(device, q, k, v, do, **options):
    """``o`` of ``cupyflash.jax.flash_attention`` and ``jax.grad`` of ``sum(o * do)`` by (q, k, v), both
    jitted, on ``device``; as NumPy arrays."""
    def loss(q, k, v, do):
        o = cfj.flash_attention(q, k, v, **options)
        return jnp.sum(o.astype(jnp.float32 if o.dtype.itemsize < 8 else o.dtype) * do.astype(o.dtype))

    args = [jax.device_put(x, device) for x in (q, k, v, do)]
    o = jax.jit(lambda q, k, v: cfj.flash_attention(q, k, v, **options))(*args[:3])
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*args)
    assert all(x.devices() == {device} for x in (o, *grads))
    return [numpy.asarray(x) for x in (o, *grads)]


def check_against_reference(device, dtype, q_shape, kv_shape, options, seed=0):
    """o and its gradients within twice a naive same-precision attention's error of the float64 reference
    (tests/tolerances.py), with the shapes and dtypes of the inputs."""
    rng = numpy.random.default_rng(seed)
    q, k, v = random_inputs(rng, dtype, q_shape, kv_shape)
    batch = numpy.broadcast_shapes(q.shape[:-2], k.shape[:-2])
    do = rng.standard_normal((*batch, *q.shape[-2:])).astype(q.dtype)
    o, *grads = attention_and_grads(device, q, k, v, do, **options)
    forward = reference.attention_forward(q, k, v, **options)
    refs = reference.attention_backward(do, q, k, v, *forward, **options)
    assert o.dtype == q.dtype and o.shape == forward[0].shape
    assert_twice_naive("o", o, forward[0], yardsticks.naive_same_precision_forward(q, k, v, **options)[0], dtype,
                       FWD_CEILING)
    naive = yardsticks.naive_same_precision_backward(do, q, k, v, **options)
    inherited = stored_output_error(do, q, k, v, (*forward, *refs), q.dtype, **options)
    scale = options.get("softmax_scale") or 1 / numpy.sqrt(q.shape[-1])
    window, causal, mods = options.get("window"), options.get("causal", False), {"softcap": options.get("softcap")}
    mags = gradient_magnitudes(do, q, k, v, causal, scale, window, **mods)
    logit = largest_logit(q, k, causal, scale, window, **mods)
    for name, g, ref, nv, mag, x, err in zip(("dq", "dk", "dv"), grads, refs, naive, mags, (q, k, v), inherited):
        assert g.shape == x.shape and g.dtype == x.dtype, name
        assert_gradient(name, g, ref, nv, mag, dtype, logit, err)


def against_jax_nn(device, dtype, causal, window, seed=0):
    """``flash_attention`` and ``jax.nn.dot_product_attention(implementation="xla")`` on (B, H, N, D)
    inputs with two query heads per K/V head (GQA), values and gradients, each at its precision's ceiling."""
    rng = numpy.random.default_rng(seed)
    B, Hkv, G, N, D = 2, 2, 2, 77, 40
    q = rng.standard_normal((B, Hkv, G, N, D)).astype(dtype)
    k, v = (rng.standard_normal((B, Hkv, 1, N, D)).astype(dtype) for _ in range(2))
    do = rng.standard_normal(q.shape).astype(dtype)
    o, *grads = attention_and_grads(device, q, k, v, do, causal=causal, window=window)

    def theirs(q, k, v):   # (B, Hkv, G, N, D) -> (B, N, H, D), the layout jax.nn takes
        to_bnhd = (lambda x: jnp.moveaxis(x.reshape(B, -1, N, D), 1, 2))
        o = jax.nn.dot_product_attention(to_bnhd(q), to_bnhd(k[:, :, 0]), to_bnhd(v[:, :, 0]), is_causal=causal,
                                         local_window_size=window, implementation="xla")
        return jnp.moveaxis(o, 2, 1).reshape(q.shape)

    args = [jax.device_put(x, device) for x in (q, k, v)]
    with jax.default_matmul_precision("highest"):
        o_ref, vjp = jax.vjp(jax.jit(theirs), *args)
        grads_ref = vjp(jax.device_put(do, device))
    dtype = numpy.dtype(dtype).name
    assert rel_err(o, o_ref) <= FWD_CEILING[dtype], "o"
    for name, g, ref in zip(("dq", "dk", "dv"), grads, grads_ref):
        assert g.shape == ref.shape, name
        assert rel_err(g, ref) <= BWD_CEILING[dtype], name


# ---------------------------------------------------------------------------------------------------------
# The seam: imports, the ctypes mirrors, the handler's answers to XLA
# ---------------------------------------------------------------------------------------------------------


def test_import_cupyflash_imports_no_jax():
    code = "import sys, cupyflash; assert 'jax' not in sys.modules, 'jax imported'"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert done.returncode == 0, done.stderr


C_PROGRAM = """
#include <stddef.h>
#include <stdio.h>
#include "xla/ffi/api/c_api.h"
int main(void) {{
{lines}
  return 0;
}}
"""


# names a later c_api.h gives the same struct or API-table slot (the layouts are unchanged): XLA 0.11's
HEADER_RENAMES = {"XLA_FFI_Extension_Base": "XLA_FFI_InternalExtension",
                  "XLA_FFI_Error_GetMessage": "XLA_FFI_Error_GetDetails",
                  "XLA_FFI_ExecutionContext_Get": "XLA_FFI_InvokeContext_Get"}


def test_mirrors_match_the_header_installed_with_jaxlib(tmp_path):
    """Every field of every ctypes mirror at the offset and of the size the C compiler gives it in
    ``c_api.h`` as jaxlib installs it; the struct sizes the handler reports, the header's own."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler")
    header = (Path(jax.ffi.include_dir()) / "xla" / "ffi" / "api" / "c_api.h").read_text()
    lines, expected = [], []
    for mirror, c_name in _xla_ffi.MIRRORS:
        for field, _ in mirror._fields_:
            c_struct, c_field = (name if name in header else HEADER_RENAMES.get(name, name) for name in (c_name, field))
            lines.append(f'  printf("%zu %zu\\n", offsetof({c_struct}, {c_field}), sizeof((({c_struct}*)0)->{c_field}));')
            described = getattr(mirror, field)
            expected.append((f"{c_name}.{field}", described.offset, described.size))
    sizes = {"XLA_FFI_CallFrame": _xla_ffi.CALL_FRAME_SIZE, "XLA_FFI_Error_Create_Args": _xla_ffi.ERROR_CREATE_ARGS_SIZE,
             "XLA_FFI_Stream_Get_Args": _xla_ffi.STREAM_GET_ARGS_SIZE,
             "XLA_FFI_DeviceOrdinal_Get_Args": _xla_ffi.DEVICE_ORDINAL_GET_ARGS_SIZE,
             "XLA_FFI_Api_Version": _xla_ffi.API_VERSION_SIZE, "XLA_FFI_Metadata": _xla_ffi.METADATA_SIZE,
             "XLA_FFI_Metadata_Extension": _xla_ffi.METADATA_EXTENSION_SIZE}
    for c_name, size in sizes.items():
        lines.append(f'  printf("%zu %zu\\n", (size_t){c_name}_STRUCT_SIZE, (size_t)0);')
        expected.append((f"{c_name}_STRUCT_SIZE", size, 0))
    source = tmp_path / "offsets.c"
    source.write_text(C_PROGRAM.format(lines="\n".join(lines)))
    binary = tmp_path / "offsets"
    subprocess.run([compiler, "-I", jax.ffi.include_dir(), str(source), "-o", str(binary)], check=True, timeout=120)
    printed = subprocess.run([str(binary)], capture_output=True, text=True, check=True).stdout.splitlines()
    assert len(printed) == len(expected)
    for (what, offset, size), line in zip(expected, printed):
        assert tuple(map(int, line.split())) == (offset, size), what


def test_metadata_answer_names_the_version_and_no_traits():
    """XLA's metadata query (a frame with the metadata extension and no API table, as XLA sends at
    registration) gets the handler's version and no traits (not command-buffer compatible)."""
    called = []
    handler = _xla_ffi.Handler("probe", called.append, (0, 7))
    metadata = _xla_ffi.Metadata(_xla_ffi.METADATA_SIZE)
    metadata.traits = 0xFF
    extension = _xla_ffi.MetadataExtension(
        _xla_ffi.ExtensionBase(_xla_ffi.METADATA_EXTENSION_SIZE, _xla_ffi.EXTENSION_METADATA, None),
        ctypes.pointer(metadata))
    frame = _xla_ffi.CallFrame(_xla_ffi.CALL_FRAME_SIZE,
                               ctypes.cast(ctypes.pointer(extension), ctypes.POINTER(_xla_ffi.ExtensionBase)))
    assert handler.callback(ctypes.pointer(frame)) is None
    assert (metadata.api_version.major_version, metadata.api_version.minor_version) == (0, 7)
    assert metadata.traits == _xla_ffi.NO_TRAITS and not called


def test_stream_device_and_errors_go_through_the_api_table():
    """What the CUDA handler asks XLA (stream, device ordinal) and how it fails, against a table of
    Python functions standing in for XLA's: the arguments each gets, the answers read back, and an
    exception turned into the error the table's XLA_FFI_Error_Create made."""
    asked, made = [], []

    def stream_get(args):
        asked.append(("stream", args.contents.struct_size, args.contents.ctx))
        args.contents.stream = 0xC0FFEE
        return None

    def device_get(args):
        asked.append(("device", args.contents.struct_size, args.contents.ctx))
        args.contents.device_ordinal = 3
        return None

    def error_create(args):
        made.append((args.contents.struct_size, args.contents.message.decode(), args.contents.errc))
        return 0xBAD

    table = _xla_ffi.Api(ctypes.sizeof(_xla_ffi.Api))
    functions = (_xla_ffi.StreamGet(stream_get), _xla_ffi.DeviceOrdinalGet(device_get),
                 _xla_ffi.ErrorCreate(error_create))
    table.XLA_FFI_Stream_Get, table.XLA_FFI_DeviceOrdinal_Get, table.XLA_FFI_Error_Create = functions
    seen = []

    def execute(call):
        seen.append((call.stream(), call.device(), call.args, call.rets, call.attrs))
        raise RuntimeError("stop")

    dims = (ctypes.c_int64 * 2)(5, 7)
    buffer = _xla_ffi.Buffer(ctypes.sizeof(_xla_ffi.Buffer), None, 16, 0x1000, 2, dims)   # BF16 (5, 7)
    pointers = (ctypes.c_void_p * 1)(ctypes.addressof(buffer))
    kinds = (ctypes.c_int * 1)(1)
    frame = _xla_ffi.CallFrame(_xla_ffi.CALL_FRAME_SIZE, None, ctypes.pointer(table), 0x42, _xla_ffi.STAGE_EXECUTE,
                               _xla_ffi.Args(ctypes.sizeof(_xla_ffi.Args), None, 1, kinds, pointers),
                               _xla_ffi.Rets(ctypes.sizeof(_xla_ffi.Rets), None, 1, kinds, pointers),
                               _xla_ffi.Attrs(ctypes.sizeof(_xla_ffi.Attrs)))
    handler = _xla_ffi.Handler("probe", execute, (0, 1))
    assert handler.callback(ctypes.pointer(frame)) == 0xBAD
    bf16 = _xla_ffi.BufferView(0x1000, (5, 7), numpy.dtype("bfloat16"))
    assert seen == [(0xC0FFEE, 3, [bf16], [bf16], {})]
    assert asked == [("stream", _xla_ffi.STREAM_GET_ARGS_SIZE, 0x42),
                     ("device", _xla_ffi.DEVICE_ORDINAL_GET_ARGS_SIZE, 0x42)]
    assert made == [(_xla_ffi.ERROR_CREATE_ARGS_SIZE, "probe: RuntimeError: stop", _xla_ffi.ERROR_INTERNAL)]
    frame.stage = 0   # instantiate: nothing runs
    assert handler.callback(ctypes.pointer(frame)) is None and len(seen) == 1


def test_device_arrays_are_kept_per_buffer_and_see_its_memory():
    """The GPU handler's CuPy arrays over XLA's buffers (``_device_array``) are made once per (address,
    shape, dtype, device) and read the buffer's memory: here host memory stands in for the device's (no
    GPU is touched to make them), as the same address with another shape gets an array of its own."""
    pytest.importorskip("cupy")
    host = numpy.arange(24, dtype=numpy.float32)
    buffer = _xla_ffi.BufferView(host.ctypes.data, (2, 3, 4), numpy.dtype(numpy.float32))
    first = cfj._device_array(buffer, 0)
    assert cfj._device_array(buffer, 0) is first
    assert first.data.ptr == host.ctypes.data and first.shape == (2, 3, 4) and first.dtype == numpy.float32
    other = cfj._device_array(buffer._replace(shape=(6, 4)), 0)
    assert other is not first and other.shape == (6, 4) and other.data.ptr == host.ctypes.data
    assert _xla_ffi.BufferView(0, (0, 5), numpy.dtype(numpy.float16)).nbytes == 0 and buffer.nbytes == 96


def test_header_version_is_read_and_a_refusal_names_the_framework_version():
    assert _xla_ffi.header_version(jax.ffi.include_dir())[0] == 0
    message = ("FFI handler registration for f on platform Host (canonical host) failed because the hander's API "
               "version (0.1) is incompatible with the framework's API version (0.4)")
    assert _xla_ffi.framework_version(message) == (0, 4)
    assert _xla_ffi.framework_version("something else") is None


def test_a_python_exception_in_a_handler_is_an_xla_error_with_its_message():
    def refuse(call):
        raise ValueError(f"refused {len(call.args)} args, attrs {sorted(call.attrs.items())}")

    handler = _xla_ffi.Handler("cupyflash_test_refuse", refuse, cfj._version())
    jax.ffi.register_ffi_target("cupyflash_test_refuse", handler.capsule, platform="cpu")
    call = jax.ffi.ffi_call("cupyflash_test_refuse", jax.ShapeDtypeStruct((2,), jnp.float32))
    x = jax.device_put(jnp.ones(2), jax.devices("cpu")[0])
    with pytest.raises(Exception, match=r"ValueError: refused 1 args, attrs \[\('a', 3\), \('b', 'x'\)"):
        jax.jit(lambda x: call(x, a=numpy.int64(3), b="x"))(x).block_until_ready()


# ---------------------------------------------------------------------------------------------------------
# The CPU target: cupyflash's NumPy path inside XLA
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES)
def test_float64_values_and_gradients_match_reference(case):
    with jax.enable_x64(True):
        check_against_reference(jax.devices("cpu")[0], "float64", *CASES[case])


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_each_dtype_within_twice_naive_on_the_cpu(dtype):
    check_against_reference(jax.devices("cpu")[0], dtype, (2, 3, 65, 40), (2, 3, 65, 40), dict(causal=True))


# jax.nn.dot_product_attention takes its softmax in float32 whatever the inputs: float32 is its precision
@pytest.mark.parametrize("causal, window", [(False, None), (True, None), (True, (8, 0)), (False, (5, 3))])
def test_matches_jax_dot_product_attention_on_the_cpu(causal, window):
    against_jax_nn(jax.devices("cpu")[0], "float32", causal, window)


def attention_jnp(q, k, v, causal):
    """Plain attention in jax.numpy, with its lse, for JAX's own autodiff."""
    s = jnp.einsum("...qd,...kd->...qk", q, k) / jnp.sqrt(q.shape[-1])
    if causal:
        n_q, n_k = s.shape[-2:]
        s = jnp.where(jnp.arange(n_k)[None, :] <= jnp.arange(n_q)[:, None] + (n_k - n_q), s, -jnp.inf)
    lse = jax.nn.logsumexp(s, axis=-1)
    return jnp.einsum("...qk,...kd->...qd", jnp.exp(s - lse[..., None]), v), lse


@pytest.mark.parametrize("causal", [False, True])
def test_lse_and_gradients_through_it(causal):
    """``return_lse``: lse = m + log l of the reference; gradients of a loss of o and lse equal JAX's
    autodiff of plain attention (float64); a loss of o alone gets the gradients without lse."""
    rng = numpy.random.default_rng(5)
    q, k, v = random_inputs(rng, "float64", (2, 37, 24), (2, 53, 24))
    do, g = rng.standard_normal(q.shape), rng.standard_normal(q.shape[:-1])
    with jax.enable_x64(True):
        def loss(attention):
            def f(q, k, v):
                o, lse = attention(q, k, v)
                return jnp.sum(o * do) + jnp.sum(lse * g)
            return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2)))

        ours = loss(lambda *x: cfj.flash_attention(*x, causal=causal, return_lse=True))(q, k, v)
        theirs = loss(lambda *x: attention_jnp(*x, causal))(q, k, v)
        o, lse = jax.jit(lambda *x: cfj.flash_attention(*x, causal=causal, return_lse=True))(q, k, v)
        o_only = jax.jit(jax.grad(lambda *x: jnp.sum(cfj.flash_attention(*x, causal=causal, return_lse=True)[0] * do),
                                  argnums=(0, 1, 2)))(q, k, v)
        plain = jax.jit(jax.grad(lambda *x: jnp.sum(cfj.flash_attention(*x, causal=causal) * do),
                                 argnums=(0, 1, 2)))(q, k, v)
    _, m, l = reference.attention_forward(q, k, v, causal=causal)
    assert lse.dtype == numpy.float64 and rel_err(lse, m + numpy.log(l)) <= 1e-12
    assert rel_err(ours[0], theirs[0]) <= 1e-12
    for name, a, b in zip(("dq", "dk", "dv"), ours[1], theirs[1]):
        assert rel_err(a, b) <= BWD_CEILING["float64"], name
    for a, b in zip(o_only, plain):
        numpy.testing.assert_array_equal(a, b)


def test_vmap_runs_the_batch_in_one_call():
    rng = numpy.random.default_rng(3)
    q, k, v = random_inputs(rng, "float32", (3, 2, 29, 16), (3, 2, 31, 16))
    attention = jax.jit(jax.vmap(lambda q, k, v: cfj.flash_attention(q, k, v, causal=True)))
    batched = attention(q, k, v)
    whole = cfj.flash_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), causal=True)
    numpy.testing.assert_array_equal(numpy.asarray(batched), numpy.asarray(whole))
    assert jax.jit(jax.vmap(cfj.flash_attention)).lower(q, k, v).as_text().count("cupyflash_forward") == 1
    loss = (lambda q, k, v: jnp.sum(cfj.flash_attention(q, k, v, causal=True) ** 2))
    per_entry = jax.jit(jax.vmap(jax.grad(loss, argnums=(0, 1, 2))))(q, k, v)
    for got, want in zip(per_entry, jax.grad(loss, argnums=(0, 1, 2))(q, k, v)):
        numpy.testing.assert_allclose(numpy.asarray(got), numpy.asarray(want), rtol=1e-5, atol=1e-6)


# expressions restating built-in variants (mod_args numbers travel as XLA attributes, arrays as operands)
EXPRESSIONS = {
    "softcap": (dict(score_mod="c * tanhf(s / c)", score_mod_grad="1 - tanhf(s / c) * tanhf(s / c)",
                     mod_args={"c": 2.0}), dict(softcap=2.0)),
    "causal": (dict(mask_mod="kv_idx <= q_idx + off", mod_args={"off": 7}), dict(causal=True)),
    "window, scaled": (dict(mask_mod="kv_idx >= q_idx + 7 - 5 && kv_idx <= q_idx + 7 + 3", score_mod="s * 2.0f",
                            score_mod_grad="2.0f"), dict(window=(5, 3), softmax_scale=2 / numpy.sqrt(16))),
    "causal and scaled, by arrays": (dict(mask_mod="kv_idx <= q_idx + off[1]", score_mod="s * c[0]",
                                          score_mod_grad="c[0]", mod_args={"off": numpy.array([0, 7], numpy.int32),
                                                                           "c": numpy.array([2.0])}),
                                     dict(causal=True, softmax_scale=2 / numpy.sqrt(16))),
}


def expressions_against_builtin(device, dtype, case, tolerance):
    """Values and gradients (jitted) of the expressions of ``case`` and of the built-in variant they restate,
    on (2, 3, 20, 16) queries against 27 keys, within ``tolerance`` of each other (relative to the largest)."""
    user, builtin = EXPRESSIONS[case]
    rng = numpy.random.default_rng(3)
    q, k, v = random_inputs(rng, dtype, (2, 3, 20, 16), (2, 3, 27, 16))
    do = rng.standard_normal(q.shape).astype(q.dtype)
    got = attention_and_grads(device, q, k, v, do, **user)
    want = attention_and_grads(device, q, k, v, do, **builtin)
    for name, a, b in zip(("o", "dq", "dk", "dv"), got, want):
        a, b = a.astype(numpy.float64), b.astype(numpy.float64)
        assert numpy.abs(a - b).max() <= tolerance * numpy.abs(b).max(), name


@pytest.mark.parametrize("case", EXPRESSIONS)
def test_expressions_give_the_builtin_variants_they_restate(case):
    with jax.enable_x64(True):
        expressions_against_builtin(jax.devices("cpu")[0], "float64", case, 1e-12)


def test_a_document_mask_reads_an_array_traced_under_jit_vmap_and_grad():
    """mod_args arrays are operands of the custom calls: a document mask over a traced int array (another
    array, another mask, no retrace), under jit, grad (by q, k, v; none reaches the array) and vmap, equals
    the float64 reference with the same expression and array."""
    rng = numpy.random.default_rng(5)
    q, k, v, do = (rng.standard_normal((3, 2, 24, 8)) for _ in range(4))
    mask_mod = "doc[q_idx] == doc[kv_idx] && kv_idx <= q_idx"
    with jax.enable_x64(True):
        loss = jax.jit(lambda q, k, v, doc: jnp.sum(cfj.flash_attention(q, k, v, mask_mod=mask_mod,
                                                                        mod_args={"doc": doc}) * do))
        value_and_grads = jax.value_and_grad(loss, argnums=(0, 1, 2, 3), allow_int=True)
        for doc in (numpy.repeat(numpy.arange(4, dtype=numpy.int32), 6), numpy.arange(24, dtype=numpy.int32) // 10):
            forward = reference.attention_forward(q, k, v, mask_mod=mask_mod, mod_args={"doc": doc})
            grads = reference.attention_backward(do, q, k, v, *forward, mask_mod=mask_mod, mod_args={"doc": doc})
            value, (dq, dk, dv, ddoc) = jax.jit(value_and_grads)(q, k, v, doc)
            numpy.testing.assert_allclose(value, numpy.sum(forward[0] * do), rtol=1e-12)
            for got, want in zip((dq, dk, dv), grads):
                numpy.testing.assert_allclose(numpy.asarray(got), want, rtol=1e-10, atol=1e-12)
            assert ddoc.dtype == jax.dtypes.float0
        per_head = jax.jit(jax.vmap(lambda q, k, v: cfj.flash_attention(q, k, v, mask_mod=mask_mod,
                                                                        mod_args={"doc": doc}), in_axes=1, out_axes=1))
        numpy.testing.assert_allclose(numpy.asarray(per_head(q, k, v)), forward[0], rtol=1e-10, atol=1e-12)
        # through lse too: a single document is the causal mask
        def through_lse(**options):
            return jax.jit(jax.grad(lambda q, k, v: jnp.sum(cfj.flash_attention(q, k, v, return_lse=True, **options)[1]
                                                            * do[..., 0]), argnums=(0, 1, 2)))(q, k, v)

        one = numpy.zeros(24, numpy.int32)
        for got, want in zip(through_lse(mask_mod=mask_mod, mod_args={"doc": one}), through_lse(causal=True)):
            numpy.testing.assert_allclose(numpy.asarray(got), numpy.asarray(want), rtol=1e-10, atol=1e-12)


def block_mask_against_mask_mod(device, dtype, tolerance):
    """Values and gradients (jitted) with a block mask equal those of its mask_mod and mod_args given
    directly, within ``tolerance`` (relative to the largest); so does a vmap over the leading batch dim
    with a block mask made for the unbatched shapes."""
    mask_mod = "kv_idx <= q_idx + 7 && w[kv_idx % 4] > 0"
    w = numpy.array([1, 0, 1, 1], numpy.int32)
    rng = numpy.random.default_rng(8)
    q, k, v = random_inputs(rng, dtype, (2, 3, 20, 16), (2, 3, 27, 16))
    do = rng.standard_normal(q.shape).astype(q.dtype)
    got = attention_and_grads(device, q, k, v, do, block_mask=cupyflash.block_mask(mask_mod, (2, 3), 20, 27, {"w": w}))
    want = attention_and_grads(device, q, k, v, do, mask_mod=mask_mod, mod_args={"w": w})
    per_entry = cupyflash.block_mask(mask_mod, (3,), 20, 27, {"w": w})
    o = jax.jit(jax.vmap(lambda q, k, v: cfj.flash_attention(q, k, v, block_mask=per_entry)))(
        *(jax.device_put(x, device) for x in (q, k, v)))
    for name, a, b in zip(("o", "dq", "dk", "dv", "o by vmap"), (*got, numpy.asarray(o)), (*want, want[0])):
        a, b = a.astype(numpy.float64), b.astype(numpy.float64)
        assert numpy.abs(a - b).max() <= tolerance * numpy.abs(b).max(), name


def test_a_block_mask_gives_its_mask_mods_values_and_gradients():
    with jax.enable_x64(True):
        block_mask_against_mask_mod(jax.devices("cpu")[0], "float64", 1e-12)


def test_a_block_mask_is_refused_where_it_does_not_serve_the_call():
    q = jnp.zeros((2, 3, 20, 16), jnp.float32)
    bm = cupyflash.block_mask("kv_idx <= q_idx", (2, 3), 20, 20)
    with pytest.raises(TypeError, match="block_mask must be a cupyflash.BlockMask"):
        cfj.flash_attention(q, q, q, block_mask="kv_idx <= q_idx")
    with pytest.raises(ValueError, match=r"block_mask serves batch_shape \(2, 3\)"):
        cfj.flash_attention(q[:1], q[:1], q[:1], block_mask=bm)
    with pytest.raises(ValueError, match="mod_args is given with a block_mask"):
        cfj.flash_attention(q, q, q, block_mask=bm, mod_args={"w": 1})
    with pytest.raises(ValueError, match="differs from the block_mask's"):
        cfj.flash_attention(q, q, q, block_mask=bm, mask_mod="kv_idx >= q_idx")


def test_expressions_refuse_a_zero_d_array_and_a_gradient_without_score_mod_grad():
    q = jnp.zeros((1, 4, 8), jnp.float32)
    with pytest.raises(ValueError, match=r"mod_args\['w'\] is a 0-d array"):
        cfj.flash_attention(q, q, q, mask_mod="w > 0", mod_args={"w": jnp.ones(())})
    with pytest.raises(TypeError, match=r"mod_args\['w'\] must be a number or an array of numbers"):
        cfj.flash_attention(q, q, q, mask_mod="w[0] > 0", mod_args={"w": numpy.array(["a"])})
    with pytest.raises(TypeError, match=r"mod_args\['w'\] must hold numbers"):
        cfj.flash_attention(q, q, q, mask_mod="w[0] > 0", mod_args={"w": jnp.array([1 + 2j])})
    with pytest.raises(ValueError, match="score_mod_grad"):
        jax.grad(lambda q: jnp.sum(cfj.flash_attention(q, q, q, score_mod="s * 2.0f")))(q)
    with pytest.raises(ValueError, match="score_mod"):
        cfj.flash_attention(q, q, q, score_mod="s * nope")


@pytest.mark.parametrize("change, error, words", [
    (dict(k=numpy.zeros((2, 9, 8), numpy.float16)), TypeError, "share one dtype"),
    (dict(q=numpy.zeros((2, 9, 300), numpy.float32), k=numpy.zeros((2, 9, 300), numpy.float32),
          v=numpy.zeros((2, 9, 300), numpy.float32)), ValueError, "head dim"),
    (dict(q=numpy.zeros((2, 9, 8), numpy.int32)), TypeError, "dtype"),
    (dict(window=(-1, 0)), ValueError, "window"),
    (dict(precision="bogus"), ValueError, "precision"),
    (dict(softcap=-1.0), ValueError, "softcap"),
    (dict(k=numpy.zeros((3, 9, 8), numpy.float32), v=numpy.zeros((3, 9, 8), numpy.float32)), ValueError, "broadcast"),
])
def test_bad_inputs_raise_while_tracing(change, error, words):
    args = dict(q=numpy.zeros((2, 9, 8), numpy.float32), k=numpy.zeros((2, 9, 8), numpy.float32),
                v=numpy.zeros((2, 9, 8), numpy.float32))
    args.update(change)
    with pytest.raises(error, match=words):
        jax.jit(lambda q, k, v: cfj.flash_attention(q, k, v, **{n: x for n, x in args.items() if n not in "qkv"}))(
            args["q"], args["k"], args["v"])


def test_the_gradient_through_lse_needs_room_for_one_more_column():
    q = jnp.zeros((1, 4, 256), jnp.float32)
    with pytest.raises(NotImplementedError, match="D < 256"):
        jax.grad(lambda q: jnp.sum(cfj.flash_attention(q, q, q, return_lse=True)[1]))(q)


# ---------------------------------------------------------------------------------------------------------
# The CUDA target: cupyflash's kernels on XLA's stream
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("case", CASES)
@gpu_test
def test_gpu_values_and_gradients_match_reference(case, dtype):
    check_against_reference(gpu_device(), dtype, *CASES[case])


@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("case", EXPRESSIONS)
@gpu_test
def test_gpu_expressions_give_the_builtin_variants_they_restate(case, dtype):
    expressions_against_builtin(gpu_device(), dtype, case, 2e-2 if dtype == "float16" else 1e-4)


@pytest.mark.parametrize("dtype", ["float16", "float32"])
@gpu_test
def test_gpu_block_mask_gives_its_mask_mods_values_and_gradients(dtype):
    block_mask_against_mask_mod(gpu_device(), dtype, 2e-2 if dtype == "float16" else 1e-4)


@pytest.mark.parametrize("dtype", ["float16", "float32"])
@gpu_test
def test_gpu_packed_sequences_match_the_reference(dtype):
    """flash_attention_varlen on the GPU, jitted, values and gradients within a dtype's tolerance of the
    float64 reference (relative to the largest), a sequence without queries among them."""
    rng = numpy.random.default_rng(13)
    cu_q, cu_k = (numpy.cumsum([0] + n).astype(numpy.int32) for n in ([70, 0, 129, 33], [90, 17, 129, 5]))
    q, k, v = random_inputs(rng, dtype, (4, 232, 64), (4, 241, 64))
    do = rng.standard_normal(q.shape).astype(q.dtype)
    device = gpu_device()

    def loss(q, k, v, do):
        o = cfj.flash_attention_varlen(q, k, v, cu_q, cu_k, 129, 129, causal=True)
        return jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32))

    args = [jax.device_put(x, device) for x in (q, k, v, do)]
    o = jax.jit(lambda q, k, v: cfj.flash_attention_varlen(q, k, v, cu_q, cu_k, 129, 129, causal=True))(*args[:3])
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*args)
    q64, k64, v64, do64 = (x.astype(numpy.float64) for x in (q, k, v, do))
    forward = reference.attention_varlen_forward(q64, k64, v64, cu_q, cu_k, causal=True)
    want = (forward[0], *reference.attention_varlen_backward(do64, q64, k64, v64, *forward, cu_q, cu_k, causal=True))
    tolerance = 2e-2 if dtype == "float16" else 1e-4
    for name, a, b in zip(("o", "dq", "dk", "dv"), (o, *grads), want):
        assert numpy.abs(numpy.asarray(a).astype(numpy.float64) - b).max() <= tolerance * numpy.abs(b).max(), name


@pytest.mark.parametrize("causal, window", [(False, None), (True, None), (False, (5, 3))])
@gpu_test
def test_gpu_matches_jax_dot_product_attention(causal, window):
    against_jax_nn(gpu_device(), "float32", causal, window)


@gpu_test
def test_gpu_runs_on_xla_stream_in_order(monkeypatch):
    """The kernels run on the stream XLA hands the handler (not CuPy's), between XLA's own producer and
    consumer of their buffers, with no synchronisation: the results are right only if ordered."""
    device = gpu_device()
    import cupy

    seen = []
    original = cfj._cupy_stream

    def recording(handle, ordinal):
        seen.append((handle, ordinal))
        return original(handle, ordinal)

    monkeypatch.setattr(cfj, "_cupy_stream", recording)
    rng = numpy.random.default_rng(9)
    q, k, v = random_inputs(rng, "float32", (4, 8, 1024, 64), (4, 8, 1024, 64))

    @jax.jit
    def step(q, k, v):
        o = cfj.flash_attention(q * 2.0, jnp.flip(k, -2), v + 1.0, causal=True)   # XLA produces the inputs
        return jnp.cumsum(o, axis=-2)                                                # and consumes o

    got = numpy.asarray(step(*(jax.device_put(x, device) for x in (q, k, v))))
    want = numpy.cumsum(reference.attention_forward(q * 2, numpy.flip(k, -2), v + 1, causal=True)[0], axis=-2)
    assert rel_err(got, want) <= 1e-4   # out of order, o would be of stale or unwritten memory
    assert seen and all(h != 0 and h != cupy.cuda.get_current_stream().ptr for h, _ in seen)
    assert {o for _, o in seen} == {getattr(device, "local_hardware_id", device.id)}



def test_shard_map_runs_each_device_on_its_slice():
    """Two CPU devices (a process of its own: the device count is fixed at JAX's start), the batch
    sharded by ``jax.shard_map``: the gradients equal the unsharded call's. ``check_vma=False``: an XLA
    custom call's results carry no varying manual axes, so JAX's check refuses the VJP's types."""
    code = textwrap.dedent("""
        import numpy, jax, jax.numpy as jnp
        from jax.sharding import Mesh, PartitionSpec
        import cupyflash.jax as cfj
        mesh = Mesh(numpy.array(jax.devices("cpu")[:2]), ("batch",))
        x = numpy.random.default_rng(0).standard_normal((3, 4, 2, 33, 16)).astype(numpy.float32)
        loss = lambda q, k, v: jnp.sum(cfj.flash_attention(q, k, v, causal=True) ** 2)
        sharded = jax.jit(jax.shard_map(jax.grad(loss, argnums=(0, 1, 2)), mesh=mesh, check_vma=False,
                                        in_specs=PartitionSpec("batch"), out_specs=PartitionSpec("batch")))
        for got, want in zip(sharded(*x), jax.grad(loss, argnums=(0, 1, 2))(*x)):
            numpy.testing.assert_allclose(numpy.asarray(got), numpy.asarray(want), rtol=1e-5, atol=1e-6)
        print("OK")
    """)
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0 and done.stdout.strip() == "OK", done.stdout + done.stderr


def test_the_training_benchmark_runs_on_the_cpu():
    """benchmarks/train_step_jax.py end to end at a toy size on the CPU: both arms, one loss curve."""
    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks",
                          "train_step_jax.py")
    done = subprocess.run([sys.executable, script, "--platform", "cpu", "--layers", "1", "--seq", "32", "--batch", "2",
                           "--steps", "3", "--warmup", "1", "--dtype", "float32"], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert done.returncode == 0, done.stdout + done.stderr
    gap = float(done.stdout.split("largest |difference| ")[1].split()[0])
    assert gap <= 1e-4, done.stdout


def test_alibi_slopes_and_a_mask_are_traced_operands_with_values_and_gradients_of_the_reference():
    """ALiBi slopes per head and a boolean mask, JAX arrays traced under jit (another mask: no retrace),
    values and gradients by q, k, v against the float64 reference with the same arrays; under vmap one
    call per entry; a bad shape is refused while tracing, naming the argument."""
    rng = numpy.random.default_rng(9)
    q, k, v, do = (rng.standard_normal((2, 3, 17, 8)) for _ in range(4))
    slopes = rng.uniform(0.1, 1.0, 3)
    with jax.enable_x64(True):
        loss = jax.jit(lambda q, k, v, slopes, mask: jnp.sum(
            cfj.flash_attention(q, k, v, causal=True, alibi_slopes=slopes, mask=mask) * do))
        for mask in (rng.random((17, 17)) < 0.7, rng.random((2, 1, 17, 17)) < 0.5):
            forward = reference.attention_forward(q, k, v, causal=True, alibi_slopes=slopes, mask=mask)
            grads = reference.attention_backward(do, q, k, v, *forward, causal=True, alibi_slopes=slopes, mask=mask)
            value, got = jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v, slopes, mask)
            numpy.testing.assert_allclose(value, numpy.sum(forward[0] * do), rtol=1e-12)
            for a, b in zip(got, grads):
                numpy.testing.assert_allclose(numpy.asarray(a), b, rtol=1e-10, atol=1e-12)
        per_entry = jax.jit(jax.vmap(lambda q, k, v, mask: cfj.flash_attention(q, k, v, causal=True,
                                                                               alibi_slopes=slopes, mask=mask)))
        numpy.testing.assert_allclose(numpy.asarray(per_entry(q, k, v, mask)), forward[0], rtol=1e-10, atol=1e-12)
        with pytest.raises(ValueError, match="alibi_slopes"):
            cfj.flash_attention(q, k, v, alibi_slopes=jnp.ones(4))
        with pytest.raises(TypeError, match="mask must be a bool array"):
            cfj.flash_attention(q, k, v, mask=jnp.ones((17, 17)))


def _naive_with_bias_and_sink(q, k, v, bias, sink):
    """Causal attention in jax.numpy with a bias and a sink logit per head (a column in the softmax's
    denominator with no value): o and lse, differentiable by JAX itself."""
    s = jnp.einsum("...qd,...kd->...qk", q, k) / numpy.sqrt(q.shape[-1]) + bias
    s = jnp.where(jnp.tril(jnp.ones(s.shape[-2:], bool)), s, -jnp.inf)
    sinks = jnp.broadcast_to(sink[:, None, None], (*s.shape[:-1], 1))
    lse = jax.scipy.special.logsumexp(jnp.concatenate([s, sinks], -1), axis=-1)
    return jnp.exp(s - lse[..., None]) @ v, lse


def test_a_bias_and_a_sink_get_their_gradients_through_o_and_lse():
    """A (1, H, N, N) bias and a sink per head, traced and differentiated with q, k, v: values and every
    gradient against the float64 reference (a loss of o) and against JAX's own autodiff of attention in
    jax.numpy (a loss of o and lse); a bias that is not differentiated costs no dbias and changes nothing."""
    rng = numpy.random.default_rng(10)
    q, k, v, do = (rng.standard_normal((2, 3, 19, 8)) for _ in range(4))
    bias, sink, g = rng.standard_normal((1, 3, 19, 19)), rng.standard_normal(3), rng.standard_normal((2, 3, 19))
    with jax.enable_x64(True):
        def loss(q, k, v, bias, sink):
            return jnp.sum(cfj.flash_attention(q, k, v, causal=True, bias=bias, sink=sink) * do)

        forward = reference.attention_forward(q, k, v, causal=True, bias=bias, sink=sink)
        want = reference.attention_backward(do, q, k, v, *forward, causal=True, bias=bias, sink=sink, bias_grad=True)
        got = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))(q, k, v, bias, sink)
        for name, a, b in zip(("dq", "dk", "dv", "dbias", "dsink"), got, want):
            numpy.testing.assert_allclose(numpy.asarray(a), b, rtol=1e-9, atol=1e-11, err_msg=name)
        dq = jax.jit(jax.grad(loss))(q, k, v, bias, sink)   # the bias a constant here: no dbias computed
        numpy.testing.assert_allclose(numpy.asarray(dq), want[0], rtol=1e-9, atol=1e-11)
        for argnums, computed in (((0,), False), ((0, 3), True)):
            assert ("bias_grad" in jax.jit(jax.grad(loss, argnums)).lower(q, k, v, bias, sink).as_text()) == computed

        def with_lse(attention):
            def loss(q, k, v, bias, sink):
                o, lse = attention(q, k, v, bias, sink)
                return jnp.sum(o * do) + jnp.sum(lse * g)
            return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4)))(q, k, v, bias, sink)

        ours = with_lse(lambda *x: cfj.flash_attention(*x[:3], causal=True, bias=x[3], sink=x[4], return_lse=True))
        theirs = with_lse(_naive_with_bias_and_sink)
        numpy.testing.assert_allclose(ours[0], theirs[0], rtol=1e-12)
        for name, a, b in zip(("dq", "dk", "dv", "dbias", "dsink"), ours[1], theirs[1]):
            numpy.testing.assert_allclose(numpy.asarray(a), numpy.asarray(b), rtol=1e-9, atol=1e-11, err_msg=name)


def test_packed_sequences_against_the_reference_and_against_a_call_per_sequence():
    """flash_attention_varlen under jit and grad: values and gradients against the float64 reference's
    varlen functions (a sequence without queries, one without keys past its queries), another packing
    of the same totals through the same compiled call; through lse, equal to a call per sequence;
    refusals name the argument."""
    rng = numpy.random.default_rng(12)
    with jax.enable_x64(True):
        def loss(q, k, v, cu_q, cu_k, do):
            return jnp.sum(cfj.flash_attention_varlen(q, k, v, cu_q, cu_k, 13, 13, causal=True) * do)

        step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
        for lengths_q, lengths_k in (([5, 0, 12, 7], [9, 3, 12, 1]), ([13, 4, 6, 1], [1, 13, 10, 1])):
            cu_q, cu_k = (numpy.cumsum([0] + n).astype(numpy.int32) for n in (lengths_q, lengths_k))
            q = rng.standard_normal((2, 24, 8))
            k, v = (rng.standard_normal((2, 25, 8)) for _ in range(2))
            do = rng.standard_normal(q.shape)
            forward = reference.attention_varlen_forward(q, k, v, cu_q, cu_k, causal=True)
            want = reference.attention_varlen_backward(do, q, k, v, *forward, cu_q, cu_k, causal=True)
            value, got = step(q, k, v, cu_q, cu_k, do)
            numpy.testing.assert_allclose(value, numpy.sum(forward[0] * do), rtol=1e-12)
            for name, a, b in zip(("dq", "dk", "dv"), got, want):
                numpy.testing.assert_allclose(numpy.asarray(a), b, rtol=1e-10, atol=1e-12, err_msg=name)
        assert step._cache_size() == 1   # one trace for both packings

        g = rng.standard_normal((2, 24))
        sequences = list(zip(zip(cu_q[:-1], cu_q[1:]), zip(cu_k[:-1], cu_k[1:])))

        def through_lse(q, k, v):
            o, lse = cfj.flash_attention_varlen(q, k, v, cu_q, cu_k, 13, 13, causal=True, return_lse=True)
            return jnp.sum(o * do) + jnp.sum(lse * g)

        def per_sequence(q, k, v):
            total = 0.0
            for (q0, q1), (k0, k1) in sequences:
                o, lse = cfj.flash_attention(q[:, q0:q1], k[:, k0:k1], v[:, k0:k1], causal=True, return_lse=True)
                total = total + jnp.sum(o * do[:, q0:q1]) + jnp.sum(lse * g[:, q0:q1])
            return total

        ours, theirs = (jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2)))(q, k, v) for f in (through_lse, per_sequence))
        numpy.testing.assert_allclose(ours[0], theirs[0], rtol=1e-12)
        for a, b in zip(ours[1], theirs[1]):
            numpy.testing.assert_allclose(numpy.asarray(a), numpy.asarray(b), rtol=1e-10, atol=1e-12)
        with pytest.raises(ValueError, match="max_seqlen_q must be an int from 0 to the packed rows"):
            cfj.flash_attention_varlen(q, k, v, cu_q, cu_k, 25, 13)
        with pytest.raises(ValueError, match="cu_seqlens_k must be a 1-D integer array"):
            cfj.flash_attention_varlen(q, k, v, cu_q, cu_k[None], 13, 13)
        with pytest.raises(ValueError, match="the same number of sequences"):
            cfj.flash_attention_varlen(q, k, v, cu_q, cu_k[:-1], 13, 13)


def dropout_against_the_api(device, dtype, tolerance):
    """Dropout under jit and grad: o and dq, dk, dv equal (to ``tolerance`` relative to the largest) to
    cupyflash's own forward and backward with the seed the key's two words hold; a typed and a raw key
    of one value drop alike, another key drops otherwise through the same compiled call; the reference
    with that seed agrees."""
    rng = numpy.random.default_rng(14)
    q, k, v = random_inputs(rng, dtype, (2, 3, 37, 24), (2, 1, 45, 24))
    do = rng.standard_normal((2, 3, 37, 24)).astype(q.dtype)
    kw = dict(causal=True, dropout_p=0.3)
    traces = []

    def loss(q, k, v, do, key):
        traces.append(1)
        o = cfj.flash_attention(q, k, v, dropout_rng=key, **kw)
        return jnp.sum(o.astype(jnp.float32 if o.dtype.itemsize < 8 else o.dtype) * do.astype(o.dtype)), o

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))
    args = [jax.device_put(x, device) for x in (q, k, v, do)]
    results = {}
    for name, key in (("typed", jax.random.key(5)), ("raw", jax.random.PRNGKey(5)), ("other", jax.random.key(6))):
        (_, o), grads = step(*args, jax.device_put(key, device))
        words = numpy.asarray(jax.random.key_data(key) if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key)
                              else key)
        seed = int(words[0]) | int(words[1]) << 32
        ours = cupyflash.flash_attention_forward(q, k, v, seed=seed, **kw)
        want = (ours[0], *cupyflash.flash_attention_backward(do, q, k, v, *ours, seed=seed, **kw))
        for part, a, b in zip(("o", "dq", "dk", "dv"), (o, *grads), want):
            a, b = numpy.asarray(a).astype(numpy.float64), b.astype(numpy.float64)
            assert numpy.abs(a - b).max() <= tolerance * numpy.abs(b).max(), (name, part)
        results[name] = numpy.asarray(o)
    assert len(traces) == 2   # a typed key and a raw one trace apart; another key of either kind does not
    numpy.testing.assert_array_equal(results["typed"], results["raw"])
    assert not numpy.array_equal(results["typed"], results["other"])
    q64, k64, v64 = (x.astype(numpy.float64) for x in (q, k, v))
    reference_o = reference.attention_forward(q64, k64, v64, seed=seed, **kw)[0]
    assert numpy.abs(results["other"] - reference_o).max() <= max(tolerance, 1e-9) * numpy.abs(reference_o).max()


def test_dropout_takes_a_jax_key_as_a_traced_seed():
    with jax.enable_x64(True):
        dropout_against_the_api(jax.devices("cpu")[0], "float64", 1e-12)


def test_dropout_refuses_a_missing_or_strange_key_and_a_gradient_through_lse():
    q = jnp.zeros((1, 4, 8), jnp.float32)
    with pytest.raises(ValueError, match="needs dropout_rng"):
        cfj.flash_attention(q, q, q, dropout_p=0.1)
    with pytest.raises(ValueError, match="dropout_rng must be one JAX PRNG key"):
        cfj.flash_attention(q, q, q, dropout_p=0.1, dropout_rng=jnp.zeros(4, jnp.uint32))
    with pytest.raises(ValueError, match="dropout_p must satisfy"):
        cfj.flash_attention(q, q, q, dropout_p=1.5, dropout_rng=jax.random.key(0))
    with pytest.raises(NotImplementedError, match="through lse is not taken with dropout"):
        jax.grad(lambda q: jnp.sum(cfj.flash_attention(q, q, q, return_lse=True, dropout_p=0.1,
                                                       dropout_rng=jax.random.key(0))[1]))(q)


@pytest.mark.parametrize("dtype", ["float16", "float32"])
@gpu_test
def test_gpu_dropout_takes_a_jax_key_as_a_device_seed(dtype):
    dropout_against_the_api(gpu_device(), dtype, 2e-2 if dtype == "float16" else 1e-4)


def kvcache_against_the_api(device, dtype, tolerance, paged):
    """A jitted decoding step of ``cupyflash.jax.flash_attention_with_kvcache`` (the caches donated):
    o, lse and the caches it returns against cupyflash's own call on NumPy copies (the new keys written
    at the lengths, GQA, a paged cache's shuffled pages)."""
    rng = numpy.random.default_rng(15)
    B, Hkv, G, Nq, D, N_max, page = 2, 2, 3, 2, 32, 48, 16
    q = rng.standard_normal((B, Hkv * G, Nq, D)).astype(dtype)
    k, v = (rng.standard_normal((B, Hkv, Nq, D)).astype(dtype) for _ in range(2))
    lens = numpy.array([7, N_max - Nq], numpy.int32)
    shape = (B * N_max // page, Hkv, page, D) if paged else (B, Hkv, N_max, D)
    kc, vc = (rng.standard_normal(shape).astype(dtype) for _ in range(2))
    table = rng.permutation(shape[0]).reshape(B, -1).astype(numpy.int32) if paged else None
    want_kc, want_vc = kc.copy(), vc.copy()
    want = cupyflash.flash_attention_with_kvcache(q, want_kc, want_vc, lens, k=k, v=v, block_table=table,
                                                  softcap=5.0)

    def step(q, kc, vc, lens, k, v, table):
        return cfj.flash_attention_with_kvcache(q, kc, vc, lens, k, v, block_table=table, softcap=5.0,
                                                return_lse=True)

    put = (lambda x: None if x is None else jax.device_put(x, device))
    o, new_kc, new_vc, lse = jax.jit(step, donate_argnums=(1, 2))(*map(put, (q, kc, vc, lens, k, v, table)))
    for name, a, b in (("o", o, want[0]), ("lse", lse, want[1] + numpy.log(want[2])), ("k_cache", new_kc, want_kc),
                       ("v_cache", new_vc, want_vc)):
        a, b = numpy.asarray(a).astype(numpy.float64), numpy.asarray(b).astype(numpy.float64)
        assert a.shape == b.shape, name
        assert numpy.abs(a - b).max() <= tolerance * numpy.abs(b).max(), name


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_kvcache_step_under_jit_appends_and_attends_as_cupyflash_does(paged):
    with jax.enable_x64(True):
        kvcache_against_the_api(jax.devices("cpu")[0], "float64", 1e-12, paged)


def test_kvcache_leaves_caches_it_was_not_given_to_keep_unchanged():
    """Without donation the caches returned are new arrays (XLA copies before the in-place write); the
    arrays given keep their values, eager or jitted."""
    rng = numpy.random.default_rng(16)
    q, kc = (jnp.asarray(rng.standard_normal(s).astype(numpy.float32)) for s in ((1, 2, 1, 16), (1, 2, 8, 16)))
    before, new = numpy.asarray(kc).copy(), jnp.ones((1, 2, 1, 16), jnp.float32)
    for call in (cfj.flash_attention_with_kvcache, jax.jit(cfj.flash_attention_with_kvcache)):
        _, k_cache, v_cache = call(q, kc, kc, jnp.array([3], jnp.int32), new, new)
        numpy.testing.assert_array_equal(numpy.asarray(kc), before)
        for cache in (k_cache, v_cache):
            numpy.testing.assert_array_equal(numpy.asarray(cache)[0, :, 3], 1.0)
            numpy.testing.assert_array_equal(numpy.delete(numpy.asarray(cache), 3, axis=2), numpy.delete(before, 3, axis=2))


def test_kvcache_refuses_what_cupyflash_refuses_while_tracing():
    q, kc = jnp.zeros((2, 6, 1, 16)), jnp.zeros((2, 2, 32, 16))
    lens = jnp.zeros(2, jnp.int32)
    with pytest.raises(ValueError, match="multiple of the cache's"):
        cfj.flash_attention_with_kvcache(jnp.zeros((2, 5, 1, 16)), kc, kc, lens)
    with pytest.raises(ValueError, match="k and v .* come together"):
        cfj.flash_attention_with_kvcache(q, kc, kc, lens, jnp.zeros((2, 2, 1, 16)))
    with pytest.raises(ValueError, match="cache_seqlens must hold B = 2"):
        cfj.flash_attention_with_kvcache(q, kc, kc, jnp.zeros(3, jnp.int32))
    with pytest.raises(TypeError, match="v_cache must have q's dtype"):
        cfj.flash_attention_with_kvcache(q, kc, kc.astype(jnp.float16), lens)
    with pytest.raises(ValueError, match="window"):
        cfj.flash_attention_with_kvcache(q, kc, kc, lens, window=(-2, 0))


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("dtype", ["float16", "float32"])
@gpu_test
def test_gpu_kvcache_step_under_jit_appends_and_attends(dtype, paged):
    kvcache_against_the_api(gpu_device(), dtype, 2e-3 if dtype == "float16" else 1e-5, paged)
