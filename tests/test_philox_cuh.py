"""The kernels' Philox4x32-10 (``kernels_cu/philox.cuh``), compiled for the host with nvcc, against
``cupyflash._philox``, the definition of dropout's keep set: the same four words for counters and keys
across the 32-bit range, and so the same keep set. No GPU needed; skipped where nvcc is not on the PATH.
"""

import subprocess

import numpy
import pytest

from cupyflash import _philox
from helpers import host_driver, needs_nvcc

pytestmark = needs_nvcc

DRIVER = r"""
#include <cstdio>
#include "philox.cuh"

// per line "c0 c1 c2 c3 k0 k1" on stdin: the four words
int main() {
    unsigned c0, c1, c2, c3, k0, k1;
    while (scanf("%u %u %u %u %u %u", &c0, &c1, &c2, &c3, &k0, &k1) == 6) {
        const Words4 r = philox4x32(c0, c1, c2, c3, k0, k1);
        printf("%u %u %u %u\n", r.w[0], r.w[1], r.w[2], r.w[3]);
    }
}
"""


@pytest.fixture(scope="module")
def philox_binary(tmp_path_factory):
    return host_driver(tmp_path_factory.mktemp("philox"), "driver", DRIVER)


def test_the_kernels_words_are_the_definitions(philox_binary):
    rng = numpy.random.default_rng(0)
    cases = rng.integers(0, 2**32, (2000, 6), dtype=numpy.uint64).astype(numpy.uint32)
    cases[:4] = [[0] * 6, [2**32 - 1] * 6, [1, 2, 3, 4, 5, 6], [0, 0, 0, 0, 2**32 - 1, 0]]
    run = subprocess.run([str(philox_binary)], input="\n".join(" ".join(map(str, c)) for c in cases),
                         capture_output=True, text=True, check=True)
    got = numpy.array([line.split() for line in run.stdout.splitlines()], dtype=numpy.uint64)
    want = numpy.stack(_philox.philox4x32(cases[:, :4].T, cases[:, 4:].T), axis=1).astype(numpy.uint64)
    numpy.testing.assert_array_equal(got, want)
