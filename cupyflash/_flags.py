"""The switches of a kernel specialisation: one table, ``FLAGS``, one row per modifier or call layout.

Every switch a call can turn on is one :class:`Flag`: the score modifiers (``score_mod.cuh``), the
backward's dbias, packed sequences, a paged K/V cache and the deterministic backward. From this table
come

* the flags of a :class:`~cupyflash._tiles.TileConfig` and its NVRTC defines (``_tiles.with_flags``):
  in the families a row's ``compiled`` names the switch is a compile-time branch of the inner loop,
  each value a specialisation of its own (``-DFLASH_<NAME>=1`` where on, no define where off);
* the run-time word ``uses`` of the parameter structs (``params.cuh``: ``Uses``), a bit per row in
  table order: every family that reads a row but does not compile it (``at_run_time``) is built with
  ``-DFLASH_<NAME>=2`` (``AT_RUN_TIME``) and tests its bit instead (``_params.layout_checks`` asserts
  the device's bits);
* the members of the device's ``ScoreMods`` (``fields``, in table order; ``_params.SCORE_MODS``);
* the call's array a row reads (``array``, ``per``): its check (``_checks.check_per_entry``,
  ``check_pairwise``), its place in the batch layout and in a kept plan's key, and the pointer a
  call writes (``pointer``);
* the count of specialisations that can exist (``_tiles.specialisation_count``).

Adding a modifier is a row here and its device hook (its ``ScoreMods`` members and the code that
reads them, ``score_mod.cuh``), plus its argument in the public API. The device code of every switch
takes both forms (``types.cuh``: ``SWITCH_ON``), so a row's ``compiled`` column alone decides, family
by family, whether a switch is a compile-time flag or a run-time word: adding a family there makes it
a flag again (``tests/test_compile.py`` compiles every row into every family that reads it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

# FLASH_<NAME> of a family that reads flag <name> at run time (types.cuh: FLASH_AT_RUN_TIME)
AT_RUN_TIME = 2

# Kernel families (``_tiles.KERNELS``) by what they do
FORWARD = ("fwd_v1", "fwd_v2", "fwd_sm90")
BACKWARD = ("bwd", "bwd_sm90", "bwd_sm90_wide")
MAIN = FORWARD + BACKWARD            # the kernels whose inner loop computes scores
SCORED = MAIN + ("repair",)          # every family that computes scores (flash_repair.cu: the slow path)


@dataclass(frozen=True)
class Flag:
    """One switch of a specialisation.

    Attributes
    ----------
    name : str
        The ``TileConfig`` flag, the define ``FLASH_<NAME>`` and the run-time bit ``USES_<NAME>``.
    reads : tuple of str
        The families whose code reads it.
    compiled : tuple of str
        Those of them that compile it in (a specialisation with and one without); the others read its
        bit of the run-time word ``uses``.
    requires : str or None
        A flag it needs, where that one is compiled in too (dbias needs the bias).
    excludes : tuple of (str, str)
        (family, flag): that family never compiles the two together (the host runs another kernel, or
        no call takes both).
    beside : tuple of (str, str)
        (family, flag): that family compiles it only in the specialisations that compile that other flag
        too, and reads it at run time in the rest (a switch whose run-time form costs only beside the other).
    plain : bool
        A call with no modifier may take it: ``all_tile_configs`` lists its families both ways.
    pair_tiles : bool
        It reads or draws a value per pair in the inner loop: the Hopper forward takes smaller K/V tiles
        and the Hopper backward smaller Q tiles (``_tiles.PAIR_BLOCK_C``, ``PAIR_BLOCK_R``).
    scores : bool
        It changes the scores: the Hopper backward takes them in units of the scale (``RawMods``), so a
        call whose scale is 0 runs the portable backward (``_launch.backward_kernel``).
    fields : tuple of (str, str)
        Its members of ``ScoreMods``, in order: (name, type code of ``_params.FIELD_TYPES``).
    array : str or None
        The API argument it reads, an array (``alibi_slopes``, ``sink``, ``bias``, ``mask``).
    per : str or None
        That array's shape: ``"entry"``, one value per batch entry (broadcastable to the batch shape),
        or ``"pair"``, one per (query, key) pair (broadcastable to ``(*batch, Nq, Nk)``).
    """

    name: str
    reads: tuple
    compiled: tuple
    requires: Optional[str] = None
    excludes: tuple = ()
    beside: tuple = ()
    plain: bool = False
    pair_tiles: bool = False
    scores: bool = False
    fields: tuple = ()
    array: Optional[str] = None
    per: Optional[str] = None

    @property
    def define(self) -> str:
        return f"FLASH_{self.name.upper()}"

    @property
    def at_run_time(self) -> tuple:
        """The families that read it from the run-time word: ``reads`` less ``compiled``."""
        return tuple(f for f in self.reads if f not in self.compiled)

    def read_at_run_time(self, kernel: str, flags) -> bool:
        """A specialisation of ``kernel`` that compiles ``flags`` tests this switch's bit of ``uses``."""
        return kernel in self.at_run_time or any(family == kernel and other not in flags
                                                 for family, other in self.beside)

    @property
    def bit(self) -> int:
        """Its bit of the run-time word ``uses``."""
        return 1 << FLAG_NAMES.index(self.name)

    @property
    def pointer(self) -> Optional[str]:
        """The parameter-struct field a call writes its array's address into (``mods.<field>.ptr``)."""
        return f"mods.{self.fields[0][0]}.ptr" if self.array is not None else None


# The score modifiers (score_mod.cuh) are compiled into the main kernels (MAIN), where they sit in the inner
# loop, and read at run time by the repair (SCORED less MAIN), a slow path that only inputs with inf or NaN
# under a mask reach: one repair specialisation per dtype and head-dim bucket.
FLAGS = (
    # s <- c tanh(s / c)
    Flag("softcap", SCORED, MAIN, scores=True, fields=(("softcap", "f64"),)),
    # s <- s - slope |i + off - j|, a slope per batch entry
    Flag("alibi", SCORED, MAIN, scores=True, fields=(("alibi", "entry"),), array="alibi_slopes", per="entry"),
    # one more key of logit sink and value zero, folded into the forward's final m_i, l_i: only the forwards
    # read it (the backward's P = exp(S - lse) takes it through m, l; the repair reads m, l; dsink is formed
    # from flash_bwd_prep's D_i: BackwardPlan.row_sums),
    # in their epilogues, once per row: a run-time word (types.cuh: SWITCH_ON; params.cuh: sink_of)
    Flag("sink", FORWARD, (), fields=(("sink", "entry"),), array="sink", per="entry"),
    # s <- s + bias_ij
    Flag("bias", SCORED, MAIN, pair_tiles=True, scores=True, fields=(("bias", "pair"),), array="bias", per="pair"),
    # the backward adds dS_ij into dbias_ij: in the bias kernels, a uniform branch per tile of dS (score_mod.cuh:
    # add_dbias_quad); compiled into the 16-bit Hopper backward, whose bias kernel (it spills) ran 10-19% slower
    # with it at run time beside the deterministic order's flag, and a run-time word elsewhere (RESULTS.md,
    # fourteenth session); the wide Hopper backward has no plain dS under a softcap
    Flag("bias_grad", BACKWARD, ("bwd_sm90",), requires="bias", excludes=(("bwd_sm90_wide", "softcap"),),
         fields=(("dbias", "pair"), ("dbias_add", "i32"))),
    # s <- -inf where mask_ij is false
    Flag("mask", SCORED, MAIN, pair_tiles=True, scores=True, fields=(("keep", "pair"),), array="mask", per="pair"),
    # P's pairs dropped by a Philox keep set, the rest scaled by 1 / (1 - p)
    Flag("dropout", SCORED, MAIN, pair_tiles=True,
         fields=(("threshold", "u32"), ("keep_scale", "f64"), ("seed", "u64"))),
    # packed variable-length sequences (params.cuh: Seqs), or a K/V cache's lengths: where each CTA's sequence
    # and its Mask come from, once per CTA (seq_of), a run-time word (types.cuh: SWITCH_ON) but in the
    # Hopper kernels, whose producer warpgroup (24-40 registers) finds each tile's sequence: there the packed
    # path and its Mask in registers spill every plain call (fwd_sm90 D64: 0 -> 164 bytes)
    Flag("varlen", SCORED, ("fwd_sm90", "bwd_sm90", "bwd_sm90_wide")),
    # keys in a paged K/V cache (params.cuh: Pages, KeyRows): compiled in where every K/V tile's rows are
    # found through the table in the loop (the Hopper forward's producer, fwd_v2, append); a run-time word
    # in the repair. Only flash_attention_with_kvcache pages, and it takes no bias, mask or dropout
    Flag("paged", ("fwd_sm90", "fwd_v2", "repair", "append"), ("fwd_sm90", "fwd_v2", "append"), requires="varlen",
         excludes=tuple((family, other) for family in ("fwd_sm90", "fwd_v2") for other in ("bias", "mask", "dropout"))),
    # the backward's sums over CTAs added in grid order (deterministic=True): a uniform branch around each
    # tile's adds into dQ_i and the dK_j, dV_j stores (SWITCH_ON(ORDERED, p.uses)); compiled into the portable
    # backward, whose float32 kernel ran 2-4% slower with it at run time (RESULTS.md, twelfth session), and
    # into the 16-bit Hopper backward beside a bias, whose kernel (it spills) ran 15-20% slower with it at run
    # time, deterministic or not (thirteenth session); a run-time word in the other Hopper backwards, which
    # lost nothing
    Flag("ordered", BACKWARD, ("bwd", "bwd_sm90"), beside=(("bwd_sm90", "bias"),), plain=True),
    # dropout's seed read from device memory as the kernels run (a CuPy array seed: graph replays, jitted steps),
    # not from the struct: compiled into the Hopper forward, where the loaded key holds two registers through
    # the loop and the kernel ran 3-4% slower with it at run time, int seeds too (RESULTS.md, nineteenth
    # session); a run-time word elsewhere (the backwards lost nothing). Last in the table, its member right
    # after dropout's seed
    Flag("device_seed", SCORED, ("fwd_sm90",), requires="dropout", fields=(("seed_at", "ptr"),)),
)
FLAG_NAMES = tuple(f.name for f in FLAGS)
BY_NAME = {f.name: f for f in FLAGS}
# the rows that read an array of the call, in table order
ARRAY_FLAGS = tuple(f for f in FLAGS if f.array is not None)


def compiled_in(kernel: str) -> tuple:
    """The flags ``kernel``'s family compiles in, in table order."""
    return tuple(f for f in FLAGS if kernel in f.compiled)


def uses_word(names) -> int:
    """The run-time word ``uses`` of a call that uses the flags ``names``."""
    return sum(BY_NAME[name].bit for name in set(names))


def call_arrays(**given) -> dict:
    """``{flag name: array}`` of the modifiers' arrays a call gives, from its API arguments (``alibi_slopes=...``,
    None where not given), in table order."""
    return {f.name: given[f.array] for f in ARRAY_FLAGS if given.get(f.array) is not None}
