"""The one percentile the reports share: nearest rank."""

import math

from loadtest.percentile import percentile, percentile_or_nan


def test_percentile_is_nearest_rank() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile(range(1, 101), 50) == 50
    assert percentile(range(1, 101), 99) == 99
    assert percentile(range(1, 101), 100) == 100
    assert percentile(range(1, 101), 0) == 1
    assert percentile([5.0], 99) == 5.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 90) == 4.0  # never between two values


def test_a_tables_percentile_is_nan_without_values() -> None:
    assert math.isnan(percentile_or_nan([], 99))
    assert percentile_or_nan([float(v) for v in range(1, 101)], 99) == 99.0
