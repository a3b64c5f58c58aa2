"""The Hopper kernels' pairs loaded ahead (``kernels_cu/score_mod.cuh``: ``PairTile::words_of``),
compiled for the host with nvcc, against the values a warp's accumulator layout holds: for every lane,
row ``r0 + g + 8h`` and columns ``c0 + 8n + 2t + {0, 1}`` of a per-pair array (16-bit values and bytes),
the even column's value in the low bits, 0 past the lengths; rows queries (the forward's S) or keys
(``TRANSPOSED``, the backward's S^T); with a key stride of 1 and aligned rows (one load a word) and
without (one a value), broadcast strides, tiles inside the lengths and on their ragged edges. No GPU
needed; skipped where nvcc is not on the PATH.
"""

import subprocess

import numpy
import pytest

from helpers import host_driver, needs_nvcc

pytestmark = needs_nvcc

NT = 8   # n-tiles of 8 keys: the Hopper forward's 64-key tiles under a bias or mask

DRIVER = r"""
#include <cstdio>
#include <vector>
#include "score_mod.cuh"

// per case "transposed bytes Nq Nk si sj offset r0 c0" on stdin: the words of every lane, over a buffer
// whose element x holds x % 251 + 1 (bytes) or x % 65521 + 1 (16-bit values), the array starting
// `offset` elements in
template <bool TRANSPOSED, typename T>
void lanes(int Nq, int Nk, int si, int sj, int off, int r0, int c0) {
    std::vector<T> buf(off + (size_t)Nq * si + (size_t)Nk * sj + 64);
    for (size_t x = 0; x < buf.size(); ++x) buf[x] = (T)(x % (sizeof(T) == 1 ? 251 : 65521) + 1);
    const Pairs<const T> a{buf.data() + off, si, sj};
    for (int lane = 0; lane < 32; ++lane) {
        unsigned w[NT][2];
        PairTile<NT, TRANSPOSED>::words_of(w, a, Nq, Nk, r0, c0, lane);
        for (int n = 0; n < NT; ++n) printf("%u %u ", w[n][0], w[n][1]);
        printf("\n");
    }
}

int main() {
    int transposed, bytes, Nq, Nk, si, sj, off, r0, c0;
    while (scanf("%d %d %d %d %d %d %d %d %d", &transposed, &bytes, &Nq, &Nk, &si, &sj, &off, &r0, &c0) == 9) {
        if (transposed && bytes) lanes<true, unsigned char>(Nq, Nk, si, sj, off, r0, c0);
        if (transposed && !bytes) lanes<true, elem_t>(Nq, Nk, si, sj, off, r0, c0);
        if (!transposed && bytes) lanes<false, unsigned char>(Nq, Nk, si, sj, off, r0, c0);
        if (!transposed && !bytes) lanes<false, elem_t>(Nq, Nk, si, sj, off, r0, c0);
    }
    return 0;
}
""".replace("NT", str(NT))

# (transposed, bytes, Nq, Nk, si, sj, offset, r0, c0): aligned rows inside the lengths; ragged row and key
# edges; an odd offset or row stride (no pair loads); a key stride of 2 and 0; a query stride of 0 (one
# row for all); a key-padding-like (1, N) row; tiles of keys inside the lengths (two queries' pairs a word,
# and with a query stride of 0, one load a row); a keys-major array (rows of keys: one load a word); each with
# rows of queries and of keys
CASES = [(tr, b, *case) for tr in (0, 1) for b in (0, 1) for case in (
    (100, 200, 200, 1, 0, 16, 64), (100, 200, 200, 1, 0, 96, 128), (37, 70, 70, 1, 0, 32, 64),
    (100, 200, 200, 1, 1, 16, 64), (100, 200, 201, 1, 0, 16, 64), (100, 200, 400, 2, 0, 16, 64),
    (50, 80, 0, 1, 0, 16, 0), (50, 80, 0, 1, 0, 48, 64), (30, 90, 90, 0, 0, 0, 0), (64, 64, 64, 1, 2, 48, 0),
    (200, 100, 100, 1, 0, 16, 64), (200, 100, 0, 1, 1, 16, 64), (200, 100, 1, 0, 0, 80, 128),
    (64, 64, 1, 64, 0, 16, 0))]


def expected(transposed, bytes_, Nq, Nk, si, sj, off, r0, c0) -> numpy.ndarray:
    """(32, NT, 2) words, by the accumulator layout and the buffer's values."""
    modulus, bits = (251, 8) if bytes_ else (65521, 16)
    words = numpy.zeros((32, NT, 2), numpy.uint64)
    for lane in range(32):
        g, t = divmod(lane, 4)
        for n in range(NT):
            for h in range(2):
                row, col = r0 + g + 8 * h, c0 + 8 * n + 2 * t
                pairs = [(c, row) if transposed else (row, c) for c in (col, col + 1)]   # (query, key)
                value = [(off + i * si + j * sj) % modulus + 1 if i < Nq and j < Nk else 0 for i, j in pairs]
                words[lane, n, h] = value[0] | value[1] << bits
    return words


@pytest.fixture(scope="module")
def driver(tmp_path_factory):
    return host_driver(tmp_path_factory.mktemp("score_mod_cuh"), "words_of", DRIVER,
                       ("FLASH_DTYPE=0", "FLASH_BIAS=1", "FLASH_MASK=1"))


@pytest.mark.parametrize("case", CASES, ids=[" ".join(map(str, c)) for c in CASES])
def test_each_lane_holds_its_pairs_as_the_accumulator_layout_places_them(driver, case):
    run = subprocess.run([str(driver)], input=" ".join(map(str, case)) + "\n", capture_output=True, text=True,
                         check=True)
    got = numpy.array([line.split() for line in run.stdout.splitlines()], numpy.uint64).reshape(32, NT, 2)
    numpy.testing.assert_array_equal(got, expected(*case))
