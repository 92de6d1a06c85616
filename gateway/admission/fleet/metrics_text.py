"""Reading a Prometheus text page (a backend's, the gateway's own): prometheus_client's
parser behind every reader, the gateway's and the reports' and the tests'."""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable

from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

_NAME = re.compile(r"[^{\s]+")


def families(text: str) -> list[Metric]:
    """The page's metric families (name, type, samples). Raises ValueError on a line the
    parser cannot read."""
    return list(text_string_to_metric_families(text))


def samples(text: str, names: Collection[str] | None = None) -> list[Sample]:
    """The page's samples, or only those called one of `names`.

    With `names`, the other lines are dropped before parsing: a vLLM page is mostly
    histogram buckets, and the load watcher reads a handful of gauges off it several
    times a second. The kept samples lose their family's type, never their values.
    Raises ValueError on a line the parser cannot read.
    """
    if names is not None:
        kept = []
        for line in text.splitlines():
            name = _NAME.match(line)
            if name is not None and name.group() in names:
                kept.append(line)
        text = "\n".join(kept)
    return [s for family in families(text) for s in family.samples]


def values(found: Iterable[Sample], name: str, **labels: str) -> list[float]:
    """The values of the samples called `name` that carry these label values."""
    return [
        s.value
        for s in found
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    ]


def total(found: Iterable[Sample], name: str, **labels: str) -> float | None:
    """The sum of the samples called `name` with these label values; None when none."""
    found_values = values(found, name, **labels)
    return sum(found_values) if found_values else None
