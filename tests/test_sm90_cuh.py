"""The float8 forward's P~ V without shuffles (``kernels_cu/sm90.cuh``: ``frag_to_a_e4m3`` packs a thread's
scores of S_ij into the k32 A fragments as they stand, ``e4m3_key_of`` says which key V^T's column holds;
``flash_fwd_sm90.cu: flash_fp8_values`` writes V^T so), checked on the host: ``e4m3_key_of`` compiled with
nvcc for the host, the two register layouts as the PTX ISA states them (the f32 accumulator of
``wgmma .m64nNk*``, the e4m3 A fragment of ``wgmma .m64nNk32``), and the packing order of
``frag_to_a_e4m3`` as written. The product must pair every score with its own key's value. No GPU
needed; skipped where nvcc is not on the PATH.
"""

import re
import subprocess
from pathlib import Path

import pytest

from helpers import host_driver, needs_nvcc

pytestmark = needs_nvcc

DRIVER = r"""
#include <cstdio>
#include "sm90.cuh"

int main() {
    for (int k = 0; k < 32; ++k) printf("%d\n", e4m3_key_of(k));
    return 0;
}
"""


@pytest.fixture(scope="module")
def key_of(tmp_path_factory):
    binary = host_driver(tmp_path_factory.mktemp("sm90_cuh"), "keys", DRIVER, ("FLASH_DTYPE=1", "FLASH_FP8=1"))
    return [int(line) for line in subprocess.run([str(binary)], capture_output=True, text=True, check=True).stdout.split()]


def accumulator_column(lane: int, n: int, e: int) -> tuple[int, int]:
    """(row, column) of element ``d[n][e]`` of a lane's f32 accumulator in its warp's 16 rows (PTX ISA:
    row g = lane / 4, + 8 for e >= 2; column 8n + 2t + e % 2, t = lane % 4)."""
    g, t = divmod(lane, 4)
    return g + 8 * (e // 2), 8 * n + 2 * t + e % 2


def fragment_column(lane: int, reg: int, byte: int) -> tuple[int, int]:
    """(row, column) of byte ``byte`` (low first) of register ``reg`` of a lane's e4m3 A fragment of a
    k32 wgmma (PTX ISA: a0..a3 row g, a4..a7 row g + 8, a8..a15 the same 16 columns on)."""
    g, t = divmod(lane, 4)
    return g + 8 * (reg % 2), 4 * t + byte + 16 * (reg // 2)


def packing_order():
    """``frag_to_a_e4m3``'s operands as its source writes them: per register, the four (n offset, e) of the
    accumulator it packs, low byte first."""
    source = (Path(__file__).resolve().parents[1] / "kernels_cu" / "sm90.cuh").read_text()
    body = source[source.index("void frag_to_a_e4m3"):]
    body = body[:body.index("\n}\n")]
    order = {}
    for reg, args in re.findall(r"a\[kk\]\[(\d)\] = pack4_e4m3\(([^;]*)\);", body):
        terms = re.findall(r"c\[n(?: \+ (\d))?\]\[(\d)\]", args)
        order[int(reg)] = [(int(dn or 0), int(e)) for dn, e in terms]
    assert sorted(order) == [0, 1, 2, 3] and all(len(v) == 4 for v in order.values())
    return order


def test_e4m3_key_of_is_a_permutation_of_each_32(key_of):
    assert sorted(key_of) == list(range(32))


def test_the_float8_product_pairs_each_score_with_its_own_key(key_of):
    """For every lane and fragment byte: the accumulator element packed there is the score of (row, key), and
    the fragment's (row, column) multiplies V^T's column, which holds key e4m3_key_of(column) — the same."""
    order = packing_order()
    for kk in range(4):   # the 32-key steps of a 128-key tile
        for lane in range(32):
            for reg, terms in order.items():
                for byte, (dn, e) in enumerate(terms):
                    row, key = accumulator_column(lane, 4 * kk + dn, e)
                    frow, column = fragment_column(lane, reg, byte)
                    assert frow == row, (lane, reg, byte)
                    assert 32 * kk + key_of[column] == key, (kk, lane, reg, byte)
