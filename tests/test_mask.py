"""CPU tests of cupyflash._mask.MaskGeometry against the visibility rule checked pair by pair.

The rule (bottom-right aligned, off = Nk - Nq): query i sees key j iff j < Nk, not causal or
j <= i + off, and with a window (left, right) i + off - left <= j <= i + off + right. Every answer
of the geometry, element masks, K/V starts and stops, Q starts and stops and tile kinds, is compared
with a brute force over the pairs it speaks for, on ragged lengths (Nq != Nk, 1, 17, 113), windows
from 0 wide to unbounded, and tiles of 1 to 128 rows and keys.
"""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from cupyflash._mask import EMPTY, FULL, PARTIAL, MaskGeometry
from cupyflash.blocked import _tiles

RAGGED_LENGTHS = (1, 17, 64, 113, 128, 130)
TILE_SIZES = (1, 3, 16, 17, 64, 128)


def sees(geometry, i, j):
    """The rule itself, for one pair."""
    diag = i + geometry.n_k - geometry.n_q
    return (0 <= j < geometry.n_k and (not geometry.causal or j <= diag)
            and (geometry.left is None or j >= diag - geometry.left)
            and (geometry.right is None or j <= diag + geometry.right))


def lengths():
    """Sequence lengths in 1..130, favouring ragged and tile-edge ones."""
    return st.one_of(st.sampled_from(RAGGED_LENGTHS), st.integers(1, 130))


@st.composite
def geometries(draw):
    """A MaskGeometry of drawn lengths (Nq and Nk drawn apart), causality and window sides."""
    side = st.one_of(st.none(), st.sampled_from([0, 1, 16]), st.integers(0, 140))
    windowed = draw(st.booleans())
    return MaskGeometry(draw(lengths()), draw(lengths()), draw(st.booleans()),
                        *((draw(side), draw(side)) if windowed else (None, None)))


@st.composite
def tiles(draw, geometry):
    """(q0, q1, k0, k1): a tile of B_r x B_c in 1..128 on the tile grid, the ragged last ones included."""
    B_r = draw(st.one_of(st.sampled_from(TILE_SIZES), st.integers(1, 128)))
    B_c = draw(st.one_of(st.sampled_from(TILE_SIZES), st.integers(1, 128)))
    i = draw(st.integers(0, -(-geometry.n_q // B_r) - 1))
    j = draw(st.integers(0, -(-geometry.n_k // B_c) - 1))
    return i * B_r, min((i + 1) * B_r, geometry.n_q), j * B_c, min((j + 1) * B_c, geometry.n_k)


@settings(deadline=None, max_examples=200)
@given(geometries())
def test_visible_is_the_rule(geometry):
    rows, cols = np.arange(geometry.n_q), np.arange(geometry.n_k + 3)   # three keys past the end
    expected = np.array([[sees(geometry, i, j) for j in cols] for i in rows], dtype=bool).reshape(rows.size, -1)
    visible = geometry.visible(rows, cols)
    assert visible.shape == (rows.size, cols.size) and visible.dtype == bool
    assert np.array_equal(visible, expected)
    assert np.array_equal(geometry.visible(range(geometry.n_q), range(geometry.n_k + 3)), expected)


@settings(deadline=None, max_examples=300)
@given(st.data())
def test_kv_stop_is_one_past_the_last_key_any_row_sees(data):
    geometry = data.draw(geometries())
    q0, q1, _, _ = data.draw(tiles(geometry))
    seen = [j for i in range(q0, q1) for j in range(geometry.n_k) if sees(geometry, i, j)]
    assert geometry.kv_stop(q0, q1) == (max(seen) + 1 if seen else 0)


@settings(deadline=None, max_examples=300)
@given(st.data())
def test_kv_start_is_the_first_key_any_row_sees(data):
    geometry = data.draw(geometries())
    q0, q1, _, _ = data.draw(tiles(geometry))
    seen = [j for i in range(q0, q1) for j in range(geometry.n_k) if sees(geometry, i, j)]
    assert geometry.kv_start(q0, q1) == (min(seen) if seen else geometry.n_k)


@settings(deadline=None, max_examples=300)
@given(st.data())
def test_q_start_and_q_stop_bound_the_rows_that_see_a_key_range(data):
    geometry = data.draw(geometries())
    k0 = data.draw(st.integers(0, geometry.n_k))
    rows = [i for i in range(geometry.n_q) if any(sees(geometry, i, j) for j in range(k0, geometry.n_k))]
    assert geometry.q_start(k0) == (rows[0] if rows else geometry.n_q)
    rows = [i for i in range(geometry.n_q) if any(sees(geometry, i, j) for j in range(k0))]
    assert geometry.q_stop(k0) == (rows[-1] + 1 if rows else 0)


@settings(deadline=None, max_examples=200)
@given(geometries())
def test_the_rows_that_see_anything_start_at_first_row(geometry):
    rows = [i for i in range(geometry.n_q) if any(sees(geometry, i, j) for j in range(geometry.n_k))]
    assert rows == list(range(geometry.first_row, geometry.n_q))


def test_under_the_causal_mask_alone_q_start_is_the_first_row_that_sees_the_key():
    geometry = MaskGeometry(17, 113, True)
    for k0 in range(113):
        assert geometry.q_start(k0) == next((i for i in range(17) if sees(geometry, i, k0)), 17)


@settings(deadline=None, max_examples=500)
@given(st.data())
def test_tile_kind_is_what_its_pairs_say(data):
    geometry = data.draw(geometries())
    q0, q1, k0, k1 = data.draw(tiles(geometry))
    pairs = [sees(geometry, i, j) for i in range(q0, q1) for j in range(k0, k1)]
    expected = FULL if all(pairs) else EMPTY if not any(pairs) else PARTIAL
    assert geometry.tile(q0, q1, k0, k1) == expected


@settings(deadline=None, max_examples=100)
@given(geometries(), st.integers(1, 128), st.integers(1, 128))
def test_tiles_from_q_start_on_cover_every_visible_pair(geometry, B_r, B_c):
    """The walk the CPU path takes (cupyflash.blocked._tiles: per K/V tile, the Q tiles from q_start
    to q_stop, EMPTY ones skipped) visits every visible pair exactly once and masks every tile but
    the FULL ones."""
    covered = np.zeros((geometry.n_q, geometry.n_k), int)
    for rows, cols, partial in _tiles(geometry, B_r, B_c):
        visible = geometry.visible(rows, cols)
        assert visible.any() and visible.all() == (not partial)
        covered[rows.start:rows.stop, cols.start:cols.stop] += visible
    expected = geometry.visible(np.arange(geometry.n_q), np.arange(geometry.n_k))
    assert np.array_equal(covered, expected.astype(int))


def test_a_tile_with_no_row_or_no_key_is_empty():
    geometry = MaskGeometry(17, 113, False)
    assert geometry.tile(5, 5, 0, 10) == EMPTY and geometry.tile(0, 10, 7, 7) == EMPTY
    assert geometry.tile(0, 17, 0, 113) == FULL


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_has_masked_pairs_is_a_masked_pair_inside_the_ragged_ends(data):
    """has_masked_pairs(q0, k0, k1[, q1]) (the kernels' Mask::has_masked_pairs, rows to Nq) is true
    exactly when some row of [q0, q1) misses some key of [k0, min(k1, Nk))."""
    geometry = data.draw(geometries())
    q0, q1, k0, k1 = data.draw(tiles(geometry))
    brute = any(not sees(geometry, i, j) for i in range(q0, geometry.n_q) for j in range(k0, min(k1, geometry.n_k)))
    assert geometry.has_masked_pairs(q0, k0, k1) == brute
    brute = any(not sees(geometry, i, j) for i in range(q0, q1) for j in range(k0, min(k1, geometry.n_k)))
    assert geometry.has_masked_pairs(q0, k0, k1, q1) == brute
    whole = any(not sees(geometry, i, j) for i in range(geometry.n_q) for j in range(geometry.n_k))
    assert geometry.has_masked_pairs(0, 0, geometry.n_k) == whole


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_packed_sequences_said_to_have_no_masked_pair_have_none(data):
    """Where the plans say packed sequences have no masked pair (``_launch._masked_pairs``: no flags, no
    repair; a decoding step's one causal row), no sequence of any lengths up to the maxima has one; and
    a causal mask over more than one query row, or a window, is said to have them."""
    from cupyflash import _launch

    max_q, max_k = data.draw(st.integers(0, 3)), data.draw(st.integers(0, 300))
    causal = data.draw(st.booleans())
    left, right = (data.draw(st.one_of(st.none(), st.integers(0, 50))) for _ in range(2))
    packed = _launch.Packed(4, max_q, max_k)
    said = _launch._masked_pairs(MaskGeometry(max_q, max_k, causal, left, right), packed)
    if not said:
        for _ in range(4):
            nq, nk = data.draw(st.integers(0, max_q)), data.draw(st.integers(0, max_k))
            assert not MaskGeometry(nq, nk, causal, left, right).has_masked_pairs(0, 0, nk)
    assert said == ((causal and max_q > 1) or left is not None or right is not None)
