"""A paged cache's row walk (``kernels_cu/params.cuh``: ``KeyRows::walk``, ``step``, ``page_rows``, as the
Hopper forward's producer uses them in ``sm90.cuh: load_pages_sw128``), compiled for the host with nvcc:
the rows a copy thread visits, one pass of ``ROWS_PER_PASS`` rows at a time from its first, lie where
the page table puts them (``row``, and an independent formula here), for pages of any size (smaller
than a pass, equal, larger, not dividing it), from any first key, with page numbers past the cache
clamped. No GPU needed; skipped where nvcc is not on the PATH.
"""

import subprocess

import numpy
import pytest

from helpers import host_driver, needs_nvcc

pytestmark = needs_nvcc

DRIVER = r"""
#include <cstdio>
#include <vector>
#include "params.cuh"

// per case on stdin: "first size count sn page tile_rows pass r_first entries" then the table's entries;
// out: per row the walk reaches, "r walked direct" as offsets from the cache's start
int main() {
    int first, size, count, tile_rows, pass, r_first, entries;
    long long sn, page;
    while (scanf("%d %d %d %lld %lld %d %d %d %d", &first, &size, &count, &sn, &page, &tile_rows, &pass, &r_first,
                 &entries) == 9) {
        std::vector<int> table(entries);
        for (int& t : table) scanf("%d", &t);
        static elem_t cache[1];
        const KeyRows<const elem_t> rows{cache, sn, table.data(), page, size, count, first};
        auto at = rows.walk(r_first);
        for (int r = r_first; r < tile_rows; r += pass) {
            printf("%d %lld %lld\n", r, (long long)(rows.page_rows(at.page) + at.row * rows.sn - cache),
                   (long long)(rows.row(r) - cache));
            rows.step(at, pass);
        }
        printf("end\n");
    }
    return 0;
}
"""


def cases():
    """(first, size, count, sn, page, tile_rows, pass, r_first, table): the Hopper forward's tiles (64 to 128
    rows, 8 to 16 rows a pass) over pages of 1 to 300 rows, shuffled tables, some entries past the cache."""
    rng = numpy.random.default_rng(0)
    out = []
    for size in (1, 3, 8, 16, 48, 64, 128, 300):
        for tile_rows, passes in ((128, 8), (64, 16), (128, 16)):
            for _ in range(4):
                first = int(rng.integers(0, 4 * size + 3))
                entries = -(-(first + tile_rows) // size) + 1
                count = int(rng.integers(max(2, entries // 2), 2 * entries + 2))
                table = rng.integers(0, count + 3, entries)   # a few past the cache: clamped to its last page
                out.append((first, size, count, 136, size * 136 * 2, tile_rows, passes, int(rng.integers(0, passes)),
                            table))
    return out


@pytest.fixture(scope="module")
def walked(tmp_path_factory):
    binary = host_driver(tmp_path_factory.mktemp("params_cuh"), "walk", DRIVER,
                         ("FLASH_DTYPE=0", "FLASH_PAGED=1", "FLASH_VARLEN=1"))
    stdin = "".join(" ".join(map(str, (*c[:8], len(c[8]), *c[8]))) + "\n" for c in cases())
    run = subprocess.run([str(binary)], input=stdin, capture_output=True, text=True, check=True)
    results, current = [], []
    for line in run.stdout.splitlines():
        if line == "end":
            results.append(current)
            current = []
        else:
            current.append(tuple(map(int, line.split())))
    return list(zip(cases(), results))


def test_a_copy_threads_walk_finds_each_row_where_the_table_puts_it(walked):
    assert len(walked) == 96
    for (first, size, count, sn, page, tile_rows, passes, r_first, table), rows in walked:
        assert [r for r, _, _ in rows] == list(range(r_first, tile_rows, passes))
        for r, walked_at, direct in rows:
            key = first + r
            want = min(int(table[key // size]), count - 1) * page + (key % size) * sn
            assert (walked_at, direct) == (want, want), (first, size, r)
