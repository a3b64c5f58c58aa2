"""Covering designs: a few rows of options in which every pair of options meets at least once.

Testing the full product of a dozen options costs thousands of cases, each a kernel specialisation of
its own; a bug that needs two options together to show is met by any row that holds that pair.
``pairwise`` builds such rows greedily (the AETG method: each new row is the best of a few random
candidates, each grown from a pair not yet covered by adding, factor by factor, the value that covers
most new pairs), deterministically for a given seed, skipping the pairs the caller forbids.
"""

from __future__ import annotations

import itertools
import random
from typing import Iterable


def _pairs_of(row: dict, names: list) -> set:
    return {((a, row[a]), (b, row[b])) for a, b in itertools.combinations(names, 2)}


def pairwise(factors: dict, forbidden: Iterable = (), seed: int = 0, candidates: int = 24) -> list[dict]:
    """Rows (dicts factor -> value) covering every allowed pair of values of two factors.

    Parameters
    ----------
    factors : dict
        Factor name -> sequence of its values (hashable).
    forbidden : iterable of ((name, value), (name, value))
        Pairs no row may hold (options the API refuses together).
    seed : int
        The rows are a function of the factors, the forbidden pairs and the seed.
    candidates : int
        Random candidate rows tried for each row kept.

    Returns
    -------
    list of dict
        Every allowed pair is in at least one row; no row holds a forbidden pair.
    """
    names = list(factors)
    order = {name: i for i, name in enumerate(names)}

    def key(a, b):
        return (a, b) if order[a[0]] < order[b[0]] else (b, a)

    banned = {key(*pair) for pair in forbidden}
    uncovered = {key((a, x), (b, y)) for a, b in itertools.combinations(names, 2)
                 for x in factors[a] for y in factors[b]} - banned
    rng = random.Random(seed)
    rows = []
    while uncovered:
        best, best_gain = None, -1
        for _ in range(candidates):
            (a, x), (b, y) = rng.choice(sorted(uncovered, key=repr))
            row = {a: x, b: y}
            rest = [n for n in names if n not in row]
            rng.shuffle(rest)
            for name in rest:
                scored = []
                for value in factors[name]:
                    if any(key((name, value), (n, row[n])) in banned for n in row):
                        continue
                    gain = sum(key((name, value), (n, row[n])) in uncovered for n in row)
                    scored.append((gain, rng.random(), value))
                if not scored:
                    break
                row[name] = max(scored, key=lambda s: s[:2])[2]
            if len(row) < len(names):
                continue
            gain = len(_pairs_of({n: row[n] for n in names}, names) & uncovered)
            if gain > best_gain:
                best, best_gain = {n: row[n] for n in names}, gain
        if best is None or best_gain == 0:
            raise ValueError(f"no allowed row covers the pairs left, e.g. {sorted(uncovered, key=repr)[:3]}")
        rows.append(best)
        uncovered -= _pairs_of(best, names)
    return rows
