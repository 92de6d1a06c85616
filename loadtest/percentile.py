"""The one percentile every report uses (the load generator, measure, drill, the benches).

Nearest rank: the smallest value that at least q % of the values are at or below. It is
always a figure some request really saw, never one interpolated between a fast answer
and a slow one, and p100 is the maximum; for the p99 of a latency, which is what reports
compare against a budget, that is the reading a target means ("99 % were at most this").
"""

from __future__ import annotations

import math
from collections.abc import Iterable


def percentile(values: Iterable[float], q: float) -> float | None:
    """The q-th percentile (q in [0, 100]) by nearest rank; None for no values."""
    ordered = sorted(values)
    if not ordered:
        return None
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


def percentile_or_nan(values: Iterable[float], q: float) -> float:
    """The same figure for a table's float column: NaN for no values."""
    value = percentile(values, q)
    return math.nan if value is None else value
