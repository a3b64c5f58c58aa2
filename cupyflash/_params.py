"""The kernels' parameter structs (``kernels_cu/params.cuh``) as NumPy structured dtypes.

Each kernel family takes one struct by value: ``FwdParams`` (the forward kernels and their
repair), ``BwdParams`` (the backward's preparation, main, repair and conversion kernels) and
``MergeParams`` (merging attentions over disjoint key sets) and ``AppendParams`` (new keys into a K/V
cache).
This module is their one mirror on the host, checked against the device side twice:
``layout_checks`` turns it into ``static_assert``s of ``sizeof`` and of every field's offset, which
``_compile.compile_for_arch`` appends to every source it compiles (CI compiles every
specialisation so, with no GPU: a drifted mirror fails to compile), and ``layout_probe`` is a tiny
kernel that writes the device's sizes and offsets, which the GPU tests compare with the mirror
(for NVRTCs without ``__builtin_offsetof``).

A plan fills a :class:`Params` once (strides, sizes, flags); a call then writes only its
pointers into a copy and launches the kernels with it through ``cuLaunchKernel``.
"""

from __future__ import annotations

import ctypes

import numpy

from ._flags import FLAGS

_ptr, _i64, _i32, _f64 = numpy.uint64, numpy.int64, numpy.int32, numpy.float64


def _struct(fields) -> numpy.dtype:
    return numpy.dtype(fields, align=True)


# Tensor<T>: base pointer, strides of the three collapsed batch dims and of a row (elements)
TENSOR = _struct([("ptr", _ptr), ("s0", _i64), ("s1", _i64), ("s2", _i64), ("sn", _i64)])
BATCH = _struct([("n1", _i64), ("n2", _i64), ("count", _i64)])
MASK = _struct([("Nq", _i32), ("Nk", _i32), ("lo", _i32), ("hi", _i32)])
# Band (mask.cuh): a window's sides for sequences of any length (_mask.MaskGeometry.band_fields)
BAND = _struct([("left", _i32), ("right", _i32)])
# Seqs (params.cuh): packed variable-length sequences (or a K/V cache's lengths) and the work heads of the grid
SEQS = _struct([("cu_q", _ptr), ("cu_k", _ptr), ("len_k", _ptr), ("len_s0", _i64), ("len_s1", _i64),
                ("len_s2", _i64), ("heads", _i64), ("n", _i32), ("rows_q", _i32), ("rows_k", _i32), ("len_add", _i32),
                ("band", BAND)])
# Pages (params.cuh): a paged K/V cache's table (pointer, collapsed batch strides of its rows), the
# elements between pages of k and v, rows per page, pages
PAGES = _struct([("table", _ptr), ("s0", _i64), ("s1", _i64), ("s2", _i64), ("page_k", _i64), ("page_v", _i64),
                 ("size", _i32), ("count", _i32)])
# TileMap (mask.cuh): mask_mod's tile map, its bytes per map head, the kernel's tiles, a map head per work head
TILE_MAP = _struct([("base", _ptr), ("head_bytes", _i64), ("T_r", _i32), ("T_c", _i32), ("by_entry", _i32)])
# PairArray<T> (score_mod.cuh): a per-pair array (bias, mask, dbias): pointer, collapsed batch strides,
# the query and key strides (elements, 0 along a broadcast dim)
PAIR_ARRAY = _struct([("ptr", _ptr), ("s0", _i64), ("s1", _i64), ("s2", _i64), ("si", _i64), ("sj", _i64)])
# EntryArray<T> (score_mod.cuh): a per-entry array (ALiBi slopes, sink logits): pointer, collapsed batch strides
ENTRY_ARRAY = _struct([("ptr", _ptr), ("s0", _i64), ("s1", _i64), ("s2", _i64)])
# UserArgs (score_mod.cuh): mod_args, each slot an array's address or a number's bits
USER_ARGS = _struct([("slot", numpy.uint64, (8,))])
# the type codes of _flags.Flag.fields
FIELD_TYPES = {"entry": ENTRY_ARRAY, "pair": PAIR_ARRAY, "i32": _i32, "u32": numpy.uint32, "f64": _f64,
               "u64": numpy.uint64, "ptr": _ptr}
# ScoreMods (score_mod.cuh): the members of each row of _flags.FLAGS in table order (softcap, the ALiBi
# slopes, the sink logits, the bias, dbias, the mask, dropout's threshold, scale, seed and device seed), then the flat
# batch index of the call's entry 0 and the user expressions' mod_args (UserArgs: eight 64-bit slots)
SCORE_MODS = _struct([(name, FIELD_TYPES[code]) for flag in FLAGS for name, code in flag.fields]
                     + [("batch0", _i64), ("user", USER_ARGS)])
# ZeroRange: 4-byte words flash_bwd_prep zeroes (the workspace, up to three sums, dbias)
ZERO_RANGE = _struct([("ptr", _ptr), ("words", _i64)])
ZERO_RANGES = 5

# Descales (params.cuh): the float8 forward's per-entry descales of q, k, v (null pointers: none)
DESCALES = _struct([("q", ENTRY_ARRAY), ("k", ENTRY_ARRAY), ("v", ENTRY_ARRAY)])

FWD = _struct([
    ("q", TENSOR), ("k", TENSOR), ("v", TENSOR),
    ("o", _ptr), ("m", _ptr), ("l", _ptr), ("o_run", _ptr), ("tile_counter", _ptr), ("repair_flags", _ptr),
    ("o_parts", _ptr), ("m_parts", _ptr), ("l_parts", _ptr),
    ("batch", BATCH), ("mask", MASK), ("seqs", SEQS), ("tiles", TILE_MAP), ("mods", SCORE_MODS), ("pages", PAGES),
    ("D", _i32), ("vec", _i32), ("head_group", _i32), ("n_splits", _i32), ("kv_splits", _i32), ("tile_rows", _i32),
    ("uses", numpy.uint32), ("scale", _f64), ("v_scale", _f64), ("vt", TENSOR), ("descales", DESCALES),
])

BWD = _struct([
    ("q", TENSOR), ("k", TENSOR), ("v", TENSOR), ("o", TENSOR), ("dO", TENSOR),
    ("dq_acc", TENSOR), ("dk", TENSOR), ("dv", TENSOR),
    ("dk_acc", _ptr), ("dv_acc", _ptr), ("dq", _ptr), ("m", _ptr), ("l", _ptr),
    ("m_b", _ptr), ("inv_l", _ptr), ("lse2", _ptr), ("Dsum", _ptr),
    ("dq_turns", _ptr), ("dk_turns", _ptr), ("dv_turns", _ptr), ("dk_heads", _i64, (3,)), ("dv_heads", _i64, (3,)),
    ("dq_flags", _ptr), ("kv_flags", _ptr),
    ("zero", ZERO_RANGE, (ZERO_RANGES,)),
    ("convert_elems", _i64, (3,)),
    ("batch", BATCH), ("mask", MASK), ("seqs", SEQS), ("tiles", TILE_MAP), ("mods", SCORE_MODS),
    ("D", _i32), ("vec", _i32), ("prep_vec", _i32), ("head_group", _i32), ("kv_atomic", _i32), ("lse_stats", _i32),
    ("tile_r", _i32), ("tile_c", _i32), ("uses", numpy.uint32),
    ("scale", _f64),
])

# PartSet<T> (params.cuh): the parts of a merge, one pointer each or stacked at a stride (elements)
MERGE_POINTERS = 16
PART_SET = _struct([("ptr", _ptr, (MERGE_POINTERS,)), ("stride", _i64)])
MERGE = _struct([("o", PART_SET), ("m", PART_SET), ("l", PART_SET), ("o_out", _ptr), ("m_out", _ptr), ("l_out", _ptr),
                 ("rows", _i64), ("D", _i32), ("parts", _i32), ("lanes", _i32), ("vec", _i32)])

APPEND = _struct([("k", TENSOR), ("v", TENSOR), ("k_new", TENSOR), ("v_new", TENSOR), ("batch", BATCH),
                  ("seqs", SEQS), ("pages", PAGES), ("n_new", _i32), ("D", _i32), ("vec", _i32)])

STRUCTS = {"FwdParams": FWD, "BwdParams": BWD, "MergeParams": MERGE, "AppendParams": APPEND}


def _members(dtype: numpy.dtype, prefix: str = "", base: int = 0):
    """(designator, offset) of every member of ``dtype``: nested ones as ``a.b``, array elements as
    ``a[i]``."""
    for name in dtype.names:
        sub, offset = dtype.fields[name][:2]
        yield from _member(sub, prefix + name, base + offset)


def _member(dtype: numpy.dtype, designator: str, offset: int):
    yield designator, offset
    if dtype.subdtype is not None:
        element, shape = dtype.subdtype
        for i in range(shape[0]):
            yield from _member(element, f"{designator}[{i}]", offset + i * element.itemsize)
    elif dtype.names:
        yield from _members(dtype, f"{designator}.", offset)


def layout_checks() -> str:
    """C++ ``static_assert``s that ``params.cuh`` lays out each struct as its mirror here."""
    lines = ["// cupyflash/_params.py: the host's mirror of params.cuh"]
    for struct, dtype in STRUCTS.items():
        lines.append(f'static_assert(sizeof({struct}) == {dtype.itemsize}, "{struct}: size differs from _params.py");')
        for member, offset in _members(dtype):
            lines.append(f'static_assert(__builtin_offsetof({struct}, {member}) == {offset}, '
                         f'"{struct}.{member}: offset differs from _params.py");')
    lines += [f'static_assert(USES_{flag.name.upper()} == {flag.bit}u, "Uses: the bit of {flag.name} differs from '
              f'_flags.FLAGS");' for flag in FLAGS]
    return "\n".join(lines) + "\n"


def layout_probe() -> tuple[str, list[str]]:
    """A kernel ``flash_params_layout(unsigned long long* out)`` (to append to a source that includes
    params.cuh) that writes, for each struct, its size and then every member's offset, in the order of
    the returned labels."""
    labels, lines = [], []
    for struct, dtype in STRUCTS.items():
        labels.append(f"sizeof({struct})")
        lines.append(f"    out[{len(labels) - 1}] = sizeof({struct});")
        var = struct.lower()
        for member, _ in _members(dtype):
            labels.append(f"{struct}.{member}")
            lines.append(f"    out[{len(labels) - 1}] = (const char*)&{var}.{member} - (const char*)&{var};")
    decls = "".join(f"    {struct} {struct.lower()};\n" for struct in STRUCTS)
    return ('extern "C" __global__ void flash_params_layout(unsigned long long* out) {\n' + decls
            + "\n".join(lines) + "\n}\n", labels)


def mirror_layout() -> list[int]:
    """The sizes and offsets ``layout_probe``'s kernel writes, as the mirror has them."""
    out = []
    for dtype in STRUCTS.values():
        out.append(dtype.itemsize)
        out.extend(offset for _, offset in _members(dtype))
    return out


def pointer_word(dtype: numpy.dtype, field: str) -> int:
    """Index of the 8-byte word that holds pointer ``field`` (``'q.ptr'``, ``'o'``) in ``dtype``."""
    offset = dict(_members(dtype))[field]
    assert offset % 8 == 0, field
    return offset // 8


def _by_name(dtype: numpy.dtype, value):
    """``value`` for a field of ``dtype`` as NumPy assigns it: a struct given as a dict of its members by
    name (nested dicts alike; members not named are 0) becomes the tuple of its members, in order."""
    if dtype.names is None or not isinstance(value, dict):
        return value
    unknown = set(value) - set(dtype.names)
    if unknown:
        raise KeyError(f"no member {', '.join(sorted(unknown))} in {dtype.names}")
    return tuple(_by_name(dtype.fields[n][0], value[n]) if n in value else numpy.zeros((), dtype.fields[n][0])[()]
                 for n in dtype.names)


class Params:
    """One parameter struct of a plan: everything but the pointers filled once, the pointers per call.

    Parameters
    ----------
    dtype : numpy.dtype
        ``FWD``, ``BWD``, ``MERGE`` or ``APPEND``.
    pointers : sequence of str
        The pointer fields a call writes (``'q.ptr'``, ``'mods.bias.ptr'``), in the order :meth:`pack`
        takes their addresses.
    **values
        Field values by name; a tensor field takes a tuple ``(s0, s1, s2, sn)`` of strides (its pointer is
        one of ``pointers``), a struct field a dict of its members by name (nested alike, members left
        out are 0) or a tuple of them.

    Notes
    -----
    A call's struct is a ctypes array of 8-byte words, ``[&struct, struct...]``: the struct and, in
    front of it, the one-entry argument array ``cuLaunchKernel`` reads (``kernel_params``). Writing
    it costs about a microsecond, a NumPy structured scalar through CuPy's RawKernel tens.
    """

    def __init__(self, dtype: numpy.dtype, pointers, **values):
        assert dtype.itemsize % 8 == 0
        filled = numpy.zeros(1, dtype)
        for name, value in values.items():
            if dtype.fields[name][0] == TENSOR:
                value = (0, *value)
            filled[name] = _by_name(dtype.fields[name][0], value)
        self.template = b"\0" * 8 + filled.tobytes()
        self.words = tuple(1 + pointer_word(dtype, f) for f in pointers)
        self._array = ctypes.c_uint64 * (1 + dtype.itemsize // 8)

    def pack(self, pointers):
        """``(buffer, address)``: the struct with ``pointers`` written after its argument word, a device
        address (0 for none) for each field the plan named, in that order; ``address`` is the
        ``kernel_params`` of a launch (``Launch``), valid while ``buffer`` lives."""
        if len(pointers) != len(self.words):
            raise ValueError(f"{len(pointers)} pointers for a struct whose plan names {len(self.words)}")
        buffer = self._array.from_buffer_copy(self.template)
        address = ctypes.addressof(buffer)
        buffer[0] = address + 8
        for word, pointer in zip(self.words, pointers):
            buffer[word] = pointer
        return buffer, address
