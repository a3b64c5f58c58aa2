"""The kernels' mask geometry (``kernels_cu/mask.cuh``), compiled for the host with nvcc, against the
pairs it describes: every answer a kernel asks of a ``Mask`` (each row's keys, the K/V tiles a block
of rows visits, the Q tiles a K/V tile visits, full tiles, tiles with masked pairs) checked by brute
force over the visible pairs of ``MaskGeometry`` (``cupyflash/_mask.py``), whose ``kernel_fields``
fill the struct. Causal masks, sliding windows and both, ragged lengths, the tile shapes the
kernels use. No GPU needed; skipped where nvcc is not on the PATH.
"""

import subprocess

import numpy
import pytest

from cupyflash._mask import MaskGeometry
from helpers import host_driver, needs_nvcc

pytestmark = needs_nvcc

# (B_R, B_C) of the kernels' tiles (forwards, backwards, the Hopper kernels' warpgroup rows)
TILES = ((16, 16), (64, 32), (64, 64), (128, 64), (64, 128), (128, 128))

DRIVER = r"""
#include <cstdio>
#include "mask.cuh"

// per case "Nq Nk lo hi" on stdin: per row its key range, then per tile shape every answer by tile
template <int B_R, int B_C>
void answer(const Mask& m) {
    printf("tiles %d %d\n", B_R, B_C);
    for (int q0 = 0; q0 < m.Nq; q0 += B_R) printf("kv %d %d %d\n", q0, m.kv_tile_first<B_C>(q0), m.kv_tile_stop<B_C>(q0, B_R));
    for (int k0 = 0; k0 < m.Nk; k0 += B_C) printf("q %d %d %d\n", k0, m.q_tile_first<B_R>(k0), m.q_tile_stop<B_R, B_C>(k0));
    for (int q0 = 0; q0 < m.Nq; q0 += B_R)
        for (int k0 = 0; k0 < m.Nk; k0 += B_C)
            printf("t %d %d %d %d\n", q0, k0, (int)m.full(q0, B_R, k0, B_C), (int)m.has_masked_pairs(q0, B_R, k0, B_C));
}

int main() {
    Mask m;
    while (scanf("%d %d %d %d", &m.Nq, &m.Nk, &m.lo, &m.hi) == 4) {
        printf("case %d %d %d %d banded %d first_row %d\n", m.Nq, m.Nk, m.lo, m.hi, (int)m.banded(), m.first_row());
        for (int i = 0; i < m.Nq; ++i) printf("row %d %d %d\n", i, m.key_start(i), m.key_stop(i));
        answer<16, 16>(m); answer<64, 32>(m); answer<64, 64>(m); answer<128, 64>(m); answer<64, 128>(m); answer<128, 128>(m);
        printf("end\n");
    }
    return 0;
}
"""


def geometries():
    """Causal, windows, both and neither, on ragged lengths either way round."""
    rng = numpy.random.default_rng(0)
    cases = [MaskGeometry(300, 300, True), MaskGeometry(129, 1000, False, 0, None), MaskGeometry(900, 600, False, 37, 5),
             MaskGeometry(70, 200, False, 40, 10), MaskGeometry(70, 200, True, 90, None), MaskGeometry(1, 1, True),
             MaskGeometry(257, 3, True, 1, 0), MaskGeometry(5, 400, False, None, 0), MaskGeometry(200, 200, False),
             MaskGeometry(400, 100, True, 0, 0), MaskGeometry(100, 400, True, 250, None)]
    side = lambda: None if rng.random() < 0.3 else int(rng.choice([rng.integers(0, 4), rng.integers(0, 600)]))  # noqa: E731
    for _ in range(60):
        cases.append(MaskGeometry(int(rng.integers(1, 400)), int(rng.integers(1, 400)), bool(rng.random() < 0.5),
                                  side(), side()))
    return cases


@pytest.fixture(scope="module")
def answers(tmp_path_factory):
    """The driver's output for every case of `geometries`, parsed: {case index: {...}}."""
    binary = host_driver(tmp_path_factory.mktemp("mask_cuh"), "mask_driver", DRIVER)
    cases = geometries()
    stdin = "".join("%d %d %d %d\n" % g.kernel_fields() for g in cases)
    run = subprocess.run([str(binary)], input=stdin, capture_output=True, text=True, check=True)
    parsed, current, tiles = [], None, None
    for line in run.stdout.splitlines():
        word, *values = line.split()
        if word == "case":
            current = {"banded": int(values[5]), "first_row": int(values[7]), "rows": {}, "tiles": {}}
        elif word == "row":
            current["rows"][int(values[0])] = (int(values[1]), int(values[2]))
        elif word == "tiles":
            tiles = current["tiles"].setdefault(tuple(map(int, values)), {"kv": {}, "q": {}, "t": {}})
        elif word == "kv" or word == "q":
            tiles[word][int(values[0])] = (int(values[1]), int(values[2]))
        elif word == "t":
            tiles["t"][int(values[0]), int(values[1])] = (bool(int(values[2])), bool(int(values[3])))
        elif word == "end":
            parsed.append(current)
    assert len(parsed) == len(cases)
    return list(zip(cases, parsed))


def visible_pairs(g: MaskGeometry) -> numpy.ndarray:
    return g.visible(numpy.arange(g.n_q), numpy.arange(g.n_k))


def test_every_row_sees_the_keys_of_its_band(answers):
    for g, got in answers:
        vis = visible_pairs(g)
        for i in range(g.n_q):
            start, stop = got["rows"][i]
            keys = numpy.flatnonzero(vis[i])
            if keys.size:
                assert (start, stop) == (keys[0], keys[-1] + 1), (g, i)
            else:
                assert stop <= start, (g, i)
        seeing = numpy.flatnonzero(vis.any(axis=1))
        assert got["first_row"] == (seeing[0] if seeing.size else g.n_q), g
        assert bool(got["banded"]) == (not vis.all()), g


def _runs(flags) -> list:
    """The indices where ``flags`` hold, which must be one run."""
    idx = numpy.flatnonzero(flags)
    assert idx.size == 0 or idx[-1] - idx[0] + 1 == idx.size
    return idx


def test_the_tiles_a_kernel_visits_are_exactly_those_with_a_visible_pair(answers):
    """kv_tile_first/stop: the K/V tiles of a block of rows (at least one, inside the tiles there are);
    q_tile_first/stop: the Q tiles of a K/V tile (none where no row sees it). Both are exact, so
    a K/V tile visits a Q tile iff the Q tile's range holds the K/V tile (the ordered dQ turns)."""
    for g, got in answers:
        vis = visible_pairs(g)
        for (B_R, B_C), tiles in got["tiles"].items():
            T_r, T_c = -(-g.n_q // B_R), -(-g.n_k // B_C)
            seen = numpy.zeros((T_r, T_c), bool)
            for i in range(T_r):
                for j in range(T_c):
                    seen[i, j] = vis[i * B_R:(i + 1) * B_R, j * B_C:(j + 1) * B_C].any()
            for i in range(T_r):
                first, stop = tiles["kv"][i * B_R]
                js = _runs(seen[i])
                if js.size:
                    assert (first, stop) == (js[0], js[-1] + 1), (g, B_R, B_C, i)
                else:
                    assert stop == first + 1 and 0 <= first < T_c, (g, B_R, B_C, i)
            for j in range(T_c):
                first, stop = tiles["q"][j * B_C]
                i_s = _runs(seen[:, j])
                if i_s.size:
                    assert (first, stop) == (i_s[0], i_s[-1] + 1), (g, B_R, B_C, j)
                else:
                    assert stop <= first, (g, B_R, B_C, j)


def test_full_and_masked_tiles(answers):
    """full: every pair visible, ragged rows counting as rows that must see the tile's keys too (so
    it is exact inside the ragged ends and never claims a ragged key tile); has_masked_pairs: some
    pair inside the ragged ends is masked, exactly."""
    for g, got in answers:
        vis = visible_pairs(g)
        for (B_R, B_C), tiles in got["tiles"].items():
            for (q0, k0), (full, masked) in tiles["t"].items():
                block = vis[q0:q0 + B_R, k0:k0 + B_C]
                assert masked == (not block.all()), (g, B_R, B_C, q0, k0)
                if full:
                    assert block.all() and k0 + B_C <= g.n_k, (g, B_R, B_C, q0, k0)
                if q0 + B_R <= g.n_q and k0 + B_C <= g.n_k:
                    assert full == block.all(), (g, B_R, B_C, q0, k0)


BAND_DRIVER = r"""
#include <cstdio>
#include "mask.cuh"

// per case "left right Nq Nk" on stdin: the sequence's Mask that Band::of gives
int main() {
    Band b;
    int Nq, Nk;
    while (scanf("%d %d %d %d", &b.left, &b.right, &Nq, &Nk) == 4) {
        const Mask m = b.of(Nq, Nk);
        printf("%d %d %d %d\n", m.Nq, m.Nk, m.lo, m.hi);
    }
    return 0;
}
"""


def test_a_band_gives_each_sequence_the_mask_of_its_own_lengths(tmp_path):
    """Packed sequences share one Band (``MaskGeometry.band_fields``); ``Band::of`` must give each
    sequence exactly the Mask a call of its lengths gets (``kernel_fields``), sides that bound
    nothing included, and lengths of 0."""
    binary = host_driver(tmp_path, "band_driver", BAND_DRIVER)
    cases = geometries() + [MaskGeometry(0, 5, True), MaskGeometry(5, 0, False, 3, None), MaskGeometry(0, 0, True, 2, 2),
                            MaskGeometry(7, 9, False, 2**31 - 1, 2**31 - 1)]
    stdin = "".join("%d %d %d %d\n" % (*g.band_fields(), g.n_q, g.n_k) for g in cases)
    run = subprocess.run([str(binary)], input=stdin, capture_output=True, text=True, check=True)
    got = [tuple(int(x) for x in line.split()) for line in run.stdout.splitlines()]
    assert got == [g.kernel_fields() for g in cases]
