"""The switch table (``cupyflash._flags.FLAGS``) and what comes from it: the specialisations that can exist,
the device's run-time bits, the ScoreMods mirror, the plans' pointers."""

import re
from itertools import product

import pytest

from cupyflash import _compile, _flags, _launch, _params, _tiles

SM90_SMEM = 227 * 1024


def test_every_row_names_families_that_exist_and_compiles_only_what_it_reads():
    for flag in _flags.FLAGS:
        assert set(flag.reads) <= set(_tiles.KERNELS), flag.name
        assert set(flag.compiled) <= set(flag.reads), flag.name
        assert flag.requires is None or flag.requires in _flags.BY_NAME
        assert all(family in flag.reads and other in _flags.BY_NAME for family, other in flag.excludes)
        assert (flag.array is None) == (flag.per is None) and flag.per in (None, "entry", "pair")
        assert all(code in _params.FIELD_TYPES for _, code in flag.fields)
        if flag.array is not None:   # its array's pointer is the first member's
            assert flag.fields[0][1] == flag.per


def test_the_scoremods_mirror_is_the_rows_members_in_table_order():
    members = [name for flag in _flags.FLAGS for name, _ in flag.fields]
    assert list(_params.SCORE_MODS.names) == [*members, "batch0", "user"]


def test_the_device_bits_of_the_run_time_word_are_the_tables():
    """``Uses`` in types.cuh holds one bit per row, in table order (the compiled sources assert the same:
    ``_params.layout_checks``)."""
    text = (_compile.kernel_dir() / "types.cuh").read_text()
    bits = dict(re.findall(r"USES_(\w+) = 1u << (\d+)", text))
    assert {name.lower(): 1 << int(shift) for name, shift in bits.items()} == {f.name: f.bit for f in _flags.FLAGS}
    checks = _params.layout_checks()
    assert all(f"USES_{f.name.upper()} == {f.bit}u" in checks for f in _flags.FLAGS)


def test_the_flags_are_compiled_only_where_the_table_says():
    for kernel in _tiles.KERNELS:
        cfg = next(c for c in _tiles.all_tile_configs(SM90_SMEM) if c.kernel == kernel)
        everything = _tiles.with_flags(cfg, [f.name for f in _flags.FLAGS
                                             if not any(fam == kernel for fam, _ in f.excludes)])
        assert set(everything.flags) == {f.name for f in _flags.compiled_in(kernel)
                                         if not any(fam == kernel for fam, _ in f.excludes)}


def test_a_flag_whose_requirement_is_missing_is_not_compiled_in():
    for flag in _flags.FLAGS:
        if flag.requires is None:
            continue
        for kernel in flag.compiled:
            cfg = next(c for c in _tiles.all_tile_configs(SM90_SMEM) if c.kernel == kernel and not c.flags)
            needed = flag.requires in {f.name for f in _flags.compiled_in(kernel)}
            assert (flag.name in _tiles.with_flags(cfg, (flag.name,)).flags) == (not needed), (flag.name, kernel)


def test_a_flag_compiled_only_beside_another_is_read_at_run_time_without_it():
    """``Flag.beside``: the family compiles the flag where the other is compiled too (its define 1, or none
    where the call does not use it) and tests its run-time bit in its other specialisations (define 2)."""
    pairs = [(flag, family, other) for flag in _flags.FLAGS for family, other in flag.beside]
    assert pairs   # the table has one: else this test would hold of nothing
    for flag, family, other in pairs:
        assert family in flag.compiled and other in {f.name for f in _flags.compiled_in(family)}
        cfg = next(c for c in _tiles.all_tile_configs(SM90_SMEM) if c.kernel == family and not c.flags)
        alone, together = _tiles.with_flags(cfg, (flag.name,)), _tiles.with_flags(cfg, (flag.name, other))
        partner_only = _tiles.with_flags(cfg, (other,))
        assert flag.name not in alone.flags and f"-D{flag.define}={_flags.AT_RUN_TIME}" in alone.defines()
        assert flag.name in together.flags and f"-D{flag.define}=1" in together.defines()
        assert not any(d.startswith(f"-D{flag.define}=") for d in partner_only.defines())
        assert alone == _tiles.with_flags(cfg, ())   # one specialisation serves the call with it and without


def _brute_force_count(smem: int, arch: str) -> int:
    """Every plain specialisation with every subset of every flag in the table, through ``with_flags``,
    counted once each."""
    seen = set()
    names = _flags.FLAG_NAMES
    for cfg in _tiles.all_tile_configs(smem, arch):
        for mask in product((False, True), repeat=len(names)):
            try:
                seen.add(_tiles.with_flags(cfg, [n for n, on in zip(names, mask) if on]))
            except ValueError:   # a pair the family never compiles together
                pass
    return len(seen)


@pytest.mark.parametrize("arch, smem", [("sm_90", SM90_SMEM), ("sm_80", 163 * 1024)])
def test_the_specialisation_count_is_every_family_times_its_flag_sets(arch, smem):
    assert _tiles.specialisation_count(smem, arch) == _brute_force_count(smem, arch)


SM90_LIMIT = 6000   # the specialisations a user may wait for on sm_90, and a full compile test must build


def test_at_most_sm90_limit_specialisations_can_exist_on_sm90():
    """Every compile-time flag doubles the families that compile it: a switch the inner loop does not read
    is a run-time word (``_flags.Flag.compiled``), so that what can exist stays within reach."""
    assert _tiles.specialisation_count(SM90_SMEM, "sm_90") <= SM90_LIMIT


def test_the_count_of_a_family_is_the_product_of_its_independent_flags():
    """A family whose compiled flags neither need nor exclude each other has 2^n flag sets."""
    for kernel in _tiles.KERNELS:
        compiled = _flags.compiled_in(kernel)
        names = {f.name for f in compiled}
        if any(f.requires in names or any(fam == kernel for fam, _ in f.excludes + f.beside) for f in compiled):
            continue
        assert len(_tiles.family_flag_sets(kernel)) == 2 ** len(compiled), kernel


def test_the_forward_and_backward_plans_write_every_modifier_array_by_its_flag():
    for flag in _flags.ARRAY_FLAGS:
        assert flag.pointer in _launch.FWD_POINTERS and flag.pointer in _launch.BWD_POINTERS
        assert _params.pointer_word(_params.FWD, flag.pointer) >= 0


def test_call_arrays_keeps_the_given_ones_by_flag_in_table_order():
    assert _flags.call_arrays(mask=1, alibi_slopes=2, sink=None, bias=None) == {"alibi": 2, "mask": 1}
    assert list(_flags.call_arrays(mask=1, bias=3, sink=4, alibi_slopes=5)) == ["alibi", "sink", "bias", "mask"]


def test_the_device_code_of_every_row_takes_both_forms():
    """Each row's define is read where it may be compiled in (1) or read at run time (FLASH_AT_RUN_TIME):
    through SWITCH_ON (types.cuh) or a comparison with FLASH_AT_RUN_TIME, so a row's ``compiled`` column
    alone decides the form (tests/test_compile.py compiles every row into every family that reads it)."""
    text = "\n".join(p.read_text() for p in sorted(_compile.kernel_dir().glob("*.cu*")))
    for flag in _flags.FLAGS:
        assert re.search(rf"SWITCH_ON\({flag.name.upper()},|{flag.define} == FLASH_AT_RUN_TIME", text), flag.name


@pytest.mark.parametrize("head_dim", [32, 64, 96, 128])
def test_per_pair_work_takes_the_smaller_kv_tiles_but_where_measured_faster_without(head_dim):
    """The Hopper forward under a bias, a mask or dropout takes PAIR_BLOCK_C's K/V tiles, but for the
    per-pair flags alone that PAIR_WIDE_C keeps at the family's own (the head-dim bucket's entry)."""
    cfg = _tiles.choose_tiles("fwd_sm90", head_dim, "float16", SM90_SMEM)
    wide = _tiles.PAIR_WIDE_C[("fwd_sm90", cfg.d_pad)]
    for names in [("bias",), ("mask",), ("dropout",), ("bias", "mask"), ("mask", "dropout"), ("softcap", "mask")]:
        pairs = tuple(n for n in names if _flags.BY_NAME[n].pair_tiles)
        got = _tiles.with_flags(cfg, names)
        assert got.block_c == (cfg.block_c if pairs in wide else _tiles.PAIR_BLOCK_C["fwd_sm90"]), names
        assert got.block_r == cfg.block_r
    assert _tiles.with_flags(cfg, ("softcap", "alibi")).block_c == cfg.block_c   # no per-pair work
    assert ("mask",) in wide and ("dropout",) not in wide
