"""Covering arrays: fewer kernel cases than a full cross product, every combination
of any ``t`` parameters' values still tested."""

import itertools


def covering(t: int, **dims: list) -> list[tuple]:
    """Rows of one value per dimension (in keyword order) such that, for any ``t``
    dimensions, every combination of their values appears in some row. Greedy: each
    row is the first of the full product that covers the most combinations still
    missing, so the rows are the same on every run."""
    names = list(dims)
    product = list(itertools.product(*dims.values()))
    if t >= len(names):
        return product
    groups = list(itertools.combinations(range(len(names)), t))
    missing = {(g, tuple(row[i] for i in g)) for row in product for g in groups}
    rows = []
    while missing:
        best = max(product, key=lambda row: sum((g, tuple(row[i] for i in g)) in missing
                                                for g in groups))
        rows.append(best)
        missing -= {(g, tuple(best[i] for i in g)) for g in groups}
    return rows


def case_id(value) -> str:
    """A readable test id part for a covering row's value (``float32``, not ``dtype0``)."""
    return str(value).removeprefix("torch.")
