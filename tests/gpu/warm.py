"""Compile, in parallel, every kernel specialisation the GPU suite loads into CuPy's disk cache, so that a run
outside the tiers (a sanitizer run, a serial pytest) compiles nothing on first use. The tiers
(tests/gpu/tier.py) do not use it: their pytest-xdist workers compile what they load side by side,
which takes less time than compiling all of these first.

    PYTHONPATH=$PWD python3 tests/gpu/warm.py [count] [--jobs 16] [--with bias,mask,dropout]

The plain specialisations (every family, dtype, head-dim bucket, precision), each
score-modifier set the tests draw (softcap, ALiBi, sink, bias, mask, dbias, dropout) on every family, and
packed sequences at the head dims tests/test_varlen.py, tests/test_bias_mask.py and tests/test_dropout.py
use. ``count`` only prints how many there are; ``--with`` keeps those that compile in any of the modifiers
named. About 1190 specialisations (``count`` says; 3024 before the sink, varlen, dbias and repair
switches became run-time words), about 225 s for 1158 on 16 cores of the H200 machine.
"""

import argparse
import time

from cupyflash import _compile, _tiles

SMEM = 227 * 1024
ARCH = "sm_90"
# flag sets (_flags.FLAGS) of tests/test_score_mods.py's modifiers
SCORE_SETS = [("softcap",), ("alibi",), ("sink",), ("softcap", "alibi", "sink"), ("softcap", "alibi")]
# (bias, mask) sets of tests/test_bias_mask.py, each with and without a softcap; dbias in the backwards
PAIR_SETS = [("bias",), ("mask",), ("bias", "mask")]
# head dims of the packed-sequence tests
VARLEN_DIMS = (16, 32, 64, 96, 128, 200, 256)
# flag sets the packed-sequence tests compile (with varlen)
VARLEN_SETS = [(), ("softcap", "alibi"), ("sink",), ("softcap", "alibi", "sink"), ("bias", "mask", "bias_grad"),
               ("dropout",)]


def _varlen_pads(kernel: str, dtype: str) -> set:
    pads = set()
    for D in VARLEN_DIMS:
        try:
            pads.add(_tiles.choose_tiles(kernel, D, dtype, SMEM).d_pad)
        except ValueError:
            pass
    return pads


def _flagged(cfg, names):
    """``cfg`` with ``names`` compiled in where its family compiles them; None for a pair it never compiles
    together (the host runs another kernel)."""
    try:
        return _tiles.with_flags(cfg, names)
    except ValueError:
        return None


def specialisations() -> list:
    out = []
    pads = {}
    for cfg in _tiles.all_tile_configs(SMEM, ARCH):
        out.append(cfg)
        if not cfg.spec.score_mods or cfg.fp32_mma not in (0, 1):
            continue
        sets = list(SCORE_SETS) + [("dropout",), ("softcap", "dropout")]
        sets += [softcap + pair + grad for softcap in ((), ("softcap",)) for pair in PAIR_SETS
                 for grad in (((), ("bias_grad",)) if "bias" in pair else ((),))]
        key = (cfg.kernel, cfg.dtype)
        if key not in pads:
            pads[key] = _varlen_pads(cfg.kernel, cfg.dtype)
        if cfg.d_pad in pads[key] or cfg.kernel == "repair":
            sets += [names + ("varlen",) for names in VARLEN_SETS]
        out += [_flagged(cfg, names) for names in sets]
    return [cfg for cfg in dict.fromkeys(out) if cfg is not None]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("count", nargs="?", help="only print how many specialisations there are")
    parser.add_argument("--jobs", type=int, default=16)
    parser.add_argument("--with", dest="mods", help="comma-separated modifier fields, e.g. bias,mask,dropout")
    args = parser.parse_args()
    todo = specialisations()
    if args.mods:
        todo = [cfg for cfg in todo if any(name in cfg.flags for name in args.mods.split(","))]
    print(len(todo), "specialisations", flush=True)
    if args.count:
        return
    start = time.time()
    with _compile._spawn_pool(args.jobs) as pool:
        list(pool.map(_compile._load_on_device, todo, [0] * len(todo), chunksize=4))
    print(f"compiled in {time.time() - start:.0f} s", flush=True)


if __name__ == "__main__":
    main()
