"""XLA's FFI C API in ctypes: a Python function as an XLA custom-call handler, with no C++ build.

An XLA FFI handler is one C function, ``XLA_FFI_Error* handler(XLA_FFI_CallFrame* frame)``. The
frame carries the call's argument and result buffers, its attributes, the execution stage, and the
``XLA_FFI_Api`` function table through which a handler asks for its stream or reports an error.
This module mirrors the structs it reads from ``xla/ffi/api/c_api.h``, the header installed with
jaxlib (``jax.ffi.include_dir()``), field for field; ``tests/test_jax.py`` compiles a C file against
that header and compares every offset and size with these mirrors where a C compiler is present.

``Handler`` turns a Python function into such a C function (a ``ctypes.CFUNCTYPE`` callback) and
wraps its address in the PyCapsule that ``jax.ffi.register_ffi_target`` takes. The callback answers
XLA's metadata query (a frame whose extension chain holds ``XLA_FFI_Metadata_Extension``, sent at
registration: which API version the handler was built for, which traits it has) and runs the Python
function at the execute stage; a Python exception becomes an ``XLA_FFI_Error``, which XLA raises in
the caller. It claims no traits: XLA never records it into a command buffer (a CUDA graph).

Nothing here imports JAX: ``cupyflash.jax`` does, and registers the handlers.
"""

from __future__ import annotations

import ctypes
import math
import os
import re
import traceback
from typing import NamedTuple

import ml_dtypes
import numpy

c_size_t, c_int, c_int32, c_int64, c_uint32, c_void_p = (ctypes.c_size_t, ctypes.c_int, ctypes.c_int32, ctypes.c_int64,
                                                         ctypes.c_uint32, ctypes.c_void_p)

# enums of c_api.h (C enums are ints)
EXTENSION_METADATA = 1                         # XLA_FFI_Extension_Metadata
STAGE_EXECUTE = 3                              # XLA_FFI_ExecutionStage_EXECUTE
ATTR_ARRAY, ATTR_DICTIONARY, ATTR_SCALAR, ATTR_STRING = 1, 2, 3, 4   # XLA_FFI_AttrType
ERROR_UNKNOWN, ERROR_INVALID_ARGUMENT, ERROR_INTERNAL = 2, 3, 13      # XLA_FFI_Error_Code
NO_TRAITS = 0                                  # not XLA_FFI_HANDLER_TRAITS_COMMAND_BUFFER_COMPATIBLE

# XLA_FFI_DataType (xla::PrimitiveType) of the dtypes a handler here reads: buffers and scalar attributes
DTYPES = {1: numpy.dtype(numpy.bool_), 4: numpy.dtype(numpy.int32), 5: numpy.dtype(numpy.int64),
          8: numpy.dtype(numpy.uint32), 9: numpy.dtype(numpy.uint64),
          10: numpy.dtype(numpy.float16), 11: numpy.dtype(numpy.float32), 12: numpy.dtype(numpy.float64),
          16: numpy.dtype(ml_dtypes.bfloat16),
          20: numpy.dtype(numpy.uint8)}   # F8E4M3FN, read as its bits (cupyflash.float8 takes them; CuPy has no float8)
SCALAR_CTYPES = {1: ctypes.c_bool, 4: c_int32, 5: c_int64, 11: ctypes.c_float, 12: ctypes.c_double}


class ExtensionBase(ctypes.Structure):
    pass


ExtensionBase._fields_ = [("struct_size", c_size_t), ("type", c_int), ("next", ctypes.POINTER(ExtensionBase))]


class ApiVersion(ctypes.Structure):
    _fields_ = [("struct_size", c_size_t), ("extension_start", c_void_p), ("major_version", c_int),
                ("minor_version", c_int)]


class ErrorCreateArgs(ctypes.Structure):
    _fields_ = [("struct_size", c_size_t), ("extension_start", c_void_p), ("message", ctypes.c_char_p),
                ("errc", c_int)]


class Buffer(ctypes.Structure):
    _fields_ = [("struct_size", c_size_t), ("extension_start", c_void_p), ("dtype", c_int), ("data", c_void_p),
                ("rank", c_int64), ("dims", ctypes.POINTER(c_int64))]


class Args(ctypes.Structure):
    _fields_ = [("struct_size", c_size_t), ("extension_start", c_void_p), ("size", c_int64),
                ("types", ctypes.POINTER(c_int)), ("args", ctypes.POINTER(c_void_p))]


class Rets(ctypes.Structure):
    _fields_ = [("struct_size", c_size_t), ("extension_start", c_void_p), ("size", c_int64),
                ("types", ctypes.POINTER(c_int)), ("rets", ctypes.POINTER(c_void_p))]


class ByteSpan(ctypes.Structure):
    _fields_ = [("ptr", c_void_p), ("len", c_size_t)]


class Scalar(ctypes.Structure):
    _fields_ = [("dtype", c_int), ("value", c_void_p)]


class Attrs(ctypes.Structure):
    _fields_ = [("struct_size", c_size_t), ("extension_start", c_void_p), ("size", c_int64),
                ("types", ctypes.POINTER(c_int)), ("names", ctypes.POINTER(ctypes.POINTER(ByteSpan))),
                ("attrs", ctypes.POINTER(c_void_p))]


class StreamGetArgs(ctypes.Structure):
    _fields_ = [("struct_size", c_size_t), ("extension_start", c_void_p), ("ctx", c_void_p), ("stream", c_void_p)]


class DeviceOrdinalGetArgs(ctypes.Structure):
    _fields_ = [("struct_size", c_size_t), ("extension_start", c_void_p), ("ctx", c_void_p),
                ("device_ordinal", c_int32)]


ErrorCreate = ctypes.CFUNCTYPE(c_void_p, ctypes.POINTER(ErrorCreateArgs))
StreamGet = ctypes.CFUNCTYPE(c_void_p, ctypes.POINTER(StreamGetArgs))
DeviceOrdinalGet = ctypes.CFUNCTYPE(c_void_p, ctypes.POINTER(DeviceOrdinalGetArgs))


class Api(ctypes.Structure):
    """``XLA_FFI_Api``: the function table, in the header's order; the three called here are typed."""

    _fields_ = [("struct_size", c_size_t), ("extension_start", c_void_p), ("api_version", ApiVersion),
                ("internal_api", c_void_p), ("XLA_FFI_Error_Create", ErrorCreate),
                ("XLA_FFI_Error_GetMessage", c_void_p), ("XLA_FFI_Error_Destroy", c_void_p),
                ("XLA_FFI_Handler_Register", c_void_p), ("XLA_FFI_Stream_Get", StreamGet),
                ("XLA_FFI_Type_Register", c_void_p), ("XLA_FFI_ExecutionContext_Get", c_void_p),
                ("XLA_FFI_State_Set", c_void_p), ("XLA_FFI_State_Get", c_void_p),
                ("XLA_FFI_DeviceMemory_Allocate", c_void_p), ("XLA_FFI_DeviceMemory_Free", c_void_p),
                ("XLA_FFI_ThreadPool_Schedule", c_void_p), ("XLA_FFI_ThreadPool_NumThreads", c_void_p),
                ("XLA_FFI_Future_Create", c_void_p), ("XLA_FFI_Future_SetAvailable", c_void_p),
                ("XLA_FFI_Future_SetError", c_void_p), ("XLA_FFI_RunId_Get", c_void_p),
                ("XLA_FFI_DeviceOrdinal_Get", DeviceOrdinalGet)]


class CallFrame(ctypes.Structure):
    _fields_ = [("struct_size", c_size_t), ("extension_start", ctypes.POINTER(ExtensionBase)),
                ("api", ctypes.POINTER(Api)), ("ctx", c_void_p), ("stage", c_int), ("args", Args),
                ("rets", Rets), ("attrs", Attrs), ("future", c_void_p)]


class Metadata(ctypes.Structure):
    _fields_ = [("struct_size", c_size_t), ("api_version", ApiVersion), ("traits", c_uint32),
                ("state_type_id", c_int64)]


class MetadataExtension(ctypes.Structure):
    _fields_ = [("extension_base", ExtensionBase), ("metadata", ctypes.POINTER(Metadata))]


# each mirror and its name in c_api.h (its fields carry the header's names)
MIRRORS = ((ExtensionBase, "XLA_FFI_Extension_Base"), (ApiVersion, "XLA_FFI_Api_Version"),
           (ErrorCreateArgs, "XLA_FFI_Error_Create_Args"), (Buffer, "XLA_FFI_Buffer"), (Args, "XLA_FFI_Args"),
           (Rets, "XLA_FFI_Rets"), (ByteSpan, "XLA_FFI_ByteSpan"), (Scalar, "XLA_FFI_Scalar"), (Attrs, "XLA_FFI_Attrs"),
           (StreamGetArgs, "XLA_FFI_Stream_Get_Args"), (DeviceOrdinalGetArgs, "XLA_FFI_DeviceOrdinal_Get_Args"),
           (Api, "XLA_FFI_Api"), (CallFrame, "XLA_FFI_CallFrame"), (Metadata, "XLA_FFI_Metadata"),
           (MetadataExtension, "XLA_FFI_Metadata_Extension"))


def struct_size(struct, last_field: str) -> int:
    """``XLA_FFI_STRUCT_SIZE(struct, last_field)``: the bytes up to the end of ``last_field``, the size a
    caller that knows the struct up to that field puts in ``struct_size``."""
    field = getattr(struct, last_field)
    return field.offset + field.size


# the last field of each struct as the header's XLA_FFI_DEFINE_STRUCT_TRAITS names it
CALL_FRAME_SIZE = struct_size(CallFrame, "attrs")
ERROR_CREATE_ARGS_SIZE = struct_size(ErrorCreateArgs, "errc")
STREAM_GET_ARGS_SIZE = struct_size(StreamGetArgs, "stream")
DEVICE_ORDINAL_GET_ARGS_SIZE = struct_size(DeviceOrdinalGetArgs, "device_ordinal")
API_VERSION_SIZE = struct_size(ApiVersion, "minor_version")
METADATA_SIZE = struct_size(Metadata, "traits")
METADATA_EXTENSION_SIZE = struct_size(MetadataExtension, "metadata")

# ---------------------------------------------------------------------------------------------------------
# The API version a handler reports
# ---------------------------------------------------------------------------------------------------------

VERSION_PATTERN = r"#define\s+XLA_FFI_API_{}\s+(\d+)"
# XLA refuses a handler whose version is not its own; its message names its own version last
REFUSED_VERSION = re.compile(r"API version \((\d+)\.(\d+)\) is incompatible with the framework's API version "
                             r"\((\d+)\.(\d+)\)")


def header_version(include_dir: str) -> tuple[int, int]:
    """``(XLA_FFI_API_MAJOR, XLA_FFI_API_MINOR)`` of ``c_api.h`` under ``include_dir``."""
    with open(os.path.join(include_dir, "xla", "ffi", "api", "c_api.h")) as f:
        text = f.read()
    return tuple(int(re.search(VERSION_PATTERN.format(part), text).group(1)) for part in ("MAJOR", "MINOR"))


def framework_version(message: str):
    """The framework's ``(major, minor)`` named in XLA's refusal of a handler's version, else None."""
    found = REFUSED_VERSION.search(message)
    return None if found is None else (int(found.group(3)), int(found.group(4)))


# ---------------------------------------------------------------------------------------------------------
# A call, as the Python function sees it
# ---------------------------------------------------------------------------------------------------------


class BufferView(NamedTuple):
    """One argument or result buffer: its device (or host) address, shape and dtype."""

    data: int
    shape: tuple
    dtype: numpy.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


class XlaError(Exception):
    """An ``XLA_FFI_Error`` an API function returned: the handler passes it on to XLA as it is."""

    def __init__(self, pointer: int, what: str):
        super().__init__(what)
        self.pointer = pointer


def _buffer(address: int) -> BufferView:
    buf = Buffer.from_address(address)
    dtype = DTYPES.get(buf.dtype)
    if dtype is None:
        raise TypeError(f"buffer of XLA data type {buf.dtype}, not one of {sorted(DTYPES)}")
    return BufferView(buf.data or 0, tuple(buf.dims[:buf.rank]), dtype)


def _attribute(kind: int, address: int):
    if kind == ATTR_STRING:
        span = ByteSpan.from_address(address)
        return ctypes.string_at(span.ptr, span.len).decode() if span.len else ""
    if kind == ATTR_SCALAR:
        scalar = Scalar.from_address(address)
        if scalar.dtype not in SCALAR_CTYPES:
            raise TypeError(f"scalar attribute of XLA data type {scalar.dtype}, not one of {sorted(SCALAR_CTYPES)}")
        return SCALAR_CTYPES[scalar.dtype].from_address(scalar.value).value
    raise TypeError(f"attribute of kind {kind}: only scalars and strings are read")


class Call:
    """What a handler reads of one call frame: ``args`` and ``rets`` (``BufferView``), ``attrs`` (a dict
    of scalars and strings), ``stream()`` and ``device()``, read from the frame while the call runs."""

    def __init__(self, frame):
        self.frame = frame
        args, rets, attrs = frame.args, frame.rets, frame.attrs
        self.args = [_buffer(args.args[i]) for i in range(args.size)]
        self.rets = [_buffer(rets.rets[i]) for i in range(rets.size)]
        self.attrs = {}
        for i in range(attrs.size):
            name = attrs.names[i].contents
            self.attrs[ctypes.string_at(name.ptr, name.len).decode()] = _attribute(attrs.types[i], attrs.attrs[i])

    def _api_function(self, name: str):
        api = self.frame.api.contents
        if api.struct_size < struct_size(Api, name):
            raise RuntimeError(f"this XLA's FFI API has no {name}")
        return getattr(api, name)

    def stream(self) -> int:
        """The platform stream XLA runs this call on (``cudaStream_t`` on CUDA)."""
        args = StreamGetArgs(STREAM_GET_ARGS_SIZE, None, self.frame.ctx, None)
        _check(self._api_function("XLA_FFI_Stream_Get")(ctypes.byref(args)), "XLA_FFI_Stream_Get")
        return args.stream or 0

    def device(self) -> int:
        """The ordinal of the device XLA runs this call on."""
        args = DeviceOrdinalGetArgs(DEVICE_ORDINAL_GET_ARGS_SIZE, None, self.frame.ctx, 0)
        _check(self._api_function("XLA_FFI_DeviceOrdinal_Get")(ctypes.byref(args)), "XLA_FFI_DeviceOrdinal_Get")
        return args.device_ordinal


def _check(error, what: str):
    if error:
        raise XlaError(error, what)


# ---------------------------------------------------------------------------------------------------------
# The handler
# ---------------------------------------------------------------------------------------------------------

HANDLER = ctypes.CFUNCTYPE(c_void_p, ctypes.POINTER(CallFrame))   # XLA_FFI_Handler


def capsule(address: int):
    """A PyCapsule (no name, no destructor) holding ``address``: what ``register_ffi_target`` takes."""
    new = ctypes.pythonapi.PyCapsule_New
    new.restype = ctypes.py_object
    new.argtypes = (c_void_p, ctypes.c_char_p, c_void_p)
    return new(address, None, None)


class Handler:
    """``execute(call: Call)`` as an XLA FFI handler.

    ``version`` is the ``(major, minor)`` the handler reports in its metadata: XLA registers a
    handler only for its own version (a frame that carries the API table names it; the metadata query
    at registration carries none, so the version of the header installed with jaxlib is given).
    Keep the object alive as long as XLA may call it: ``capsule`` holds the bare address of
    ``callback``.
    """

    def __init__(self, name: str, execute, version: tuple[int, int]):
        self.name, self.execute, self.version = name, execute, tuple(version)
        self.callback = HANDLER(self._call)
        self.capsule = capsule(ctypes.cast(self.callback, c_void_p).value)

    def _call(self, frame_pointer):
        frame = frame_pointer.contents
        try:
            extension = _metadata_extension(frame)
            if extension is not None:
                self._answer_metadata(frame, extension)
                return None
            if frame.struct_size < CALL_FRAME_SIZE:
                return self._error(frame, ERROR_INVALID_ARGUMENT, f"XLA_FFI_CallFrame of {frame.struct_size} bytes, "
                                   f"expected at least {CALL_FRAME_SIZE}")
            if frame.stage != STAGE_EXECUTE:
                return None
            self.execute(Call(frame))
            return None
        except XlaError as e:
            return e.pointer
        except BaseException as e:   # a Python exception must not unwind through XLA's C frames
            detail = "".join(traceback.format_exception_only(type(e), e)).strip()
            return self._error(frame, ERROR_INVALID_ARGUMENT if isinstance(e, (TypeError, ValueError))
                               else ERROR_INTERNAL, f"{self.name}: {detail}")

    def _answer_metadata(self, frame, extension):
        if extension.extension_base.struct_size < METADATA_EXTENSION_SIZE or not extension.metadata \
                or extension.metadata.contents.struct_size < METADATA_SIZE:
            raise ValueError("XLA_FFI_Metadata_Extension smaller than this handler's c_api.h lays it out")
        metadata = extension.metadata.contents
        version = self.version
        if frame.api:   # a frame with the API table: the framework's own version
            own = frame.api.contents.api_version
            version = (own.major_version, own.minor_version)
        metadata.api_version = ApiVersion(API_VERSION_SIZE, None, *version)
        metadata.traits = NO_TRAITS

    def _error(self, frame, code: int, message: str):
        """An ``XLA_FFI_Error`` of ``message`` (None where the frame has no API table to make one)."""
        if not frame.api:
            traceback.print_exc()
            return None
        args = ErrorCreateArgs(ERROR_CREATE_ARGS_SIZE, None, message.encode(errors="replace"), code)
        return frame.api.contents.XLA_FFI_Error_Create(ctypes.byref(args))


def _metadata_extension(frame):
    """The frame's ``XLA_FFI_Metadata_Extension`` (XLA asks for the handler's metadata), else None."""
    node = frame.extension_start
    while node:
        if node.contents.type == EXTENSION_METADATA:
            return ctypes.cast(node, ctypes.POINTER(MetadataExtension)).contents
        node = node.contents.next
    return None
