"""tests/covering.py: every allowed pair of options meets in a row, no row holds a forbidden pair."""

import itertools

import pytest

from covering import pairwise

FACTORS = {"a": (0, 1, 2), "b": ("x", "y"), "c": (None, 1.5, 2.5, 3.5), "d": (False, True), "e": (1, 2, 3)}


@pytest.mark.parametrize("seed", [0, 1, 7])
def test_every_allowed_pair_meets_and_no_forbidden_one(seed):
    forbidden = [(("a", 0), ("c", None)), (("d", True), ("e", 3))]
    rows = pairwise(FACTORS, forbidden, seed=seed)
    assert all(set(row) == set(FACTORS) and all(row[n] in FACTORS[n] for n in row) for row in rows)
    for (a, xs), (b, ys) in itertools.combinations(FACTORS.items(), 2):
        for x, y in itertools.product(xs, ys):
            held = any(row[a] == x and row[b] == y for row in rows)
            banned = ((a, x), (b, y)) in forbidden or ((b, y), (a, x)) in forbidden
            assert held != banned, (a, x, b, y)
    assert len(rows) <= 24   # the product is 144 rows; the largest pair of factors needs 12


def test_the_rows_are_a_function_of_their_seed():
    assert pairwise(FACTORS, seed=3) == pairwise(FACTORS, seed=3)


def test_a_pair_no_row_can_hold_is_reported():
    # (a=0, b=x) is allowed, but every value of d is forbidden beside one of them
    forbidden = [(("a", 0), ("d", False)), (("b", "x"), ("d", True))]
    with pytest.raises(ValueError, match="no allowed row covers"):
        pairwise({"a": (0, 1), "b": ("x", "y"), "d": (False, True)}, forbidden)
