"""Metric names in PromQL expressions, and the series names the gateway really exports."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml
from prometheus_client import CollectorRegistry

from gateway.metrics import GatewayMetrics

ADAPTER_VALUES = (
    Path(__file__).resolve().parents[2]
    / "deploy"
    / "k8s"
    / "monitoring"
    / "prometheus-adapter.values.yaml"
)
# The sample names prometheus-client exposes for a family of each type.
SUFFIXES = {
    "counter": ("_total", "_created"),
    "gauge": ("",),
    "histogram": ("_bucket", "_count", "_sum", "_created"),
    "summary": ("", "_count", "_sum", "_created"),
    "info": ("_info",),
}
KEYWORDS = {
    "sum", "min", "max", "avg", "count", "stddev", "stdvar", "topk", "bottomk", "quantile",
    "count_values", "group", "by", "without", "on", "ignoring", "group_left", "group_right",
    "bool", "and", "or", "unless", "offset", "inf", "nan",
}  # fmt: skip

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'')
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_MATCHERS = re.compile(r"\{[^}]*\}")
_RANGE = re.compile(r"\[[^\]]*\]")
_IDENT = re.compile(r"(?<![\w$.])([a-zA-Z_:][a-zA-Z0-9_:]*)(\s*\()?")


def metric_names(expr: str) -> set[str]:
    """Names of the series an expression selects (functions, keywords and labels left out)."""
    text = _STRING.sub('""', expr)
    text = _GROUPING.sub(" ", text)
    text = _MATCHERS.sub(" ", text)
    text = _RANGE.sub(" ", text)
    names = set()
    for match in _IDENT.finditer(text):
        name, call = match.group(1), match.group(2)
        if call is None and name.lower() not in KEYWORDS:
            names.add(name)
    return names


def exported_names(registry: CollectorRegistry | None = None) -> set[str]:
    """Every series name the gateway's registry exposes, from its collected families.

    A family's samples are named after the family and its type (`spillgate_requests` is
    exposed as `spillgate_requests_total`); labelled families with no children yet have no
    samples to collect, so their names are derived from the type.
    """
    registry = registry or GatewayMetrics().registry
    names: set[str] = set()
    for family in registry.collect():
        names.update(family.name + suffix for suffix in SUFFIXES[family.type])
        names.update(sample.name for sample in family.samples)
    return names


def adapter_rules() -> list[dict[str, Any]]:
    rules: list[dict[str, Any]] = yaml.safe_load(ADAPTER_VALUES.read_text())["rules"]["external"]
    return rules


def adapter_query(rule: dict[str, Any]) -> str:
    """The rule's metricsQuery as prometheus-adapter would send it for one namespace."""
    (series,) = metric_names(rule["seriesQuery"])
    query: str = rule["metricsQuery"]
    for placeholder, value in {
        "<<.Series>>": series,
        "<<.LabelMatchers>>": 'namespace="spillgate"',
        "<<.GroupBy>>": "namespace",
    }.items():
        query = query.replace(placeholder, value)
    assert "<<" not in query, query
    return query
