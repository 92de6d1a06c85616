"""What the benches read of the engines they run: their metrics pages' samples, and the
ports of a pair of real engines given on the command line."""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client.parser import text_string_to_metric_families

Counts = dict[tuple[str, str], float]  # (sample name, the label that tells it apart) → value


def samples(text: str, *, by: Sequence[str], handler: str | None = None) -> Counts:
    """A metrics page's samples by name and the first of the labels `by` that a sample sets,
    summed over the others; with `handler`, only those of that handler where they name one
    (an engine's HTTP metrics count every route)."""
    found: Counts = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if handler is not None and s.labels.get("handler", handler) != handler:
                continue
            label = next((s.labels[k] for k in by if s.labels.get(k)), "")
            found[(s.name, label)] = found.get((s.name, label), 0.0) + s.value
    return found


def port_pair(text: str) -> tuple[int, int]:
    """`--ports 8121,8122`: the two real engines' ports."""
    first, second = (int(p) for p in text.split(","))
    return first, second
