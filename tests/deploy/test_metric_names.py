"""Every metric the dashboard, the alert rules and the autoscalers query is one the gateway
exports, by the names in gateway.metrics.GatewayMetrics' own registry."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy.kustomize import render
from tests.deploy.promql import adapter_query, adapter_rules, exported_names, metric_names

ROOT = Path(__file__).resolve().parents[2]
DASHBOARDS = sorted((ROOT / "deploy" / "grafana" / "dashboards").glob("*.json"))
RULE_FILES = sorted((ROOT / "deploy" / "prometheus" / "rules").glob("*.yaml"))
OVERLAYS = sorted((ROOT / "deploy" / "k8s" / "overlays").glob("*/kustomization.yaml"))
LABEL_VALUES = re.compile(r"^label_values\((?P<metric>[^,{)]+)(\{[^}]*\})?,\s*\w+\)$")


@pytest.fixture(scope="module")
def exported() -> set[str]:
    names = exported_names()
    assert "spillgate_requests_total" in names and "spillgate_ttft_seconds_bucket" in names
    return names


def assert_known(where: str, expr: str, exported: set[str]) -> None:
    names = metric_names(expr)
    assert names, f"{where}: selects no metric: {expr}"
    unknown = names - exported
    assert not unknown, f"{where}: the gateway exports no {sorted(unknown)}: {expr}"


def test_the_check_catches_a_misspelt_or_foreign_metric(exported: set[str]) -> None:
    assert metric_names('sum by (pool) (rate(spillgate_request_total{pool="a"}[5m]))') == {
        "spillgate_request_total"
    }
    for bad in ("rate(spillgate_request_total[5m])", "spillgate_requests", "up == 0"):
        with pytest.raises(AssertionError, match="exports no"):
            assert_known("probe", bad, exported)


def panels(items: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in items:
        yield panel
        yield from panels(panel.get("panels", []))


@pytest.mark.parametrize("path", DASHBOARDS, ids=[p.name for p in DASHBOARDS])
def test_dashboard_queries_only_exported_metrics(path: Path, exported: set[str]) -> None:
    dashboard = json.loads(path.read_text())
    queried = 0
    ids = [p["id"] for p in panels(dashboard["panels"])]
    assert len(ids) == len(set(ids)), "panel ids are unique"
    for panel in panels(dashboard["panels"]):
        for target in panel.get("targets", []):
            assert_known(f"panel {panel['title']!r}", target["expr"], exported)
            assert target["datasource"]["uid"] == "${datasource}"
            queried += 1
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            match = LABEL_VALUES.match(variable["query"]["query"])
            assert match, variable["query"]
            assert_known(f"variable {variable['name']}", match["metric"], exported)
    assert queried >= 20


def test_dashboard_covers_the_fleet_views(exported: set[str]) -> None:
    (path,) = DASHBOARDS
    queried = set()
    for panel in panels(json.loads(path.read_text())["panels"]):
        for target in panel.get("targets", []):
            queried |= metric_names(target["expr"])
    wanted = {
        "spillgate_inflight_tokens", "spillgate_capacity_tokens", "spillgate_active_sessions",
        "spillgate_requests_total", "spillgate_ttft_seconds_bucket", "spillgate_queue_depth",
        "spillgate_queue_wait_seconds_bucket", "spillgate_tokens_total",
        "spillgate_provider_cost_dollars_total", "spillgate_ratelimit_mode",
        "spillgate_ratelimit_store_errors_total", "spillgate_pool_fill_ratio",
        "spillgate_ledger_mode", "spillgate_ledger_store_errors_total",
    }  # fmt: skip
    assert wanted <= queried, sorted(wanted - queried)


@pytest.mark.parametrize("path", RULE_FILES, ids=[p.name for p in RULE_FILES])
def test_alert_rules_query_only_exported_metrics(path: Path, exported: set[str]) -> None:
    groups = yaml.safe_load(path.read_text())["groups"]
    rules = [rule for group in groups for rule in group["rules"]]
    for rule in rules:
        assert_known(rule.get("alert") or rule["record"], rule["expr"], exported)
    alerts = {rule["alert"]: rule["expr"] for rule in rules if "alert" in rule}
    assert "spillgate_pool_fill_ratio" in alerts["SpillgateFleetFillHigh"]
    assert "spillgate_queue_wait_seconds_bucket" in alerts["SpillgateQueueWaitP99High"]
    assert "provider|degraded|rejected" in alerts["SpillgateSpillRateHigh"]
    assert "spillgate_ratelimit_store_errors_total" in alerts["SpillgateRateLimitStoreErrors"]
    assert "spillgate_provider_breaker_open" in alerts["SpillgateProviderBreakerOpen"]
    assert "spillgate_ledger_store_errors_total" in alerts["SpillgateLedgerStoreErrors"]


def test_autoscaler_metrics_come_from_exported_series(exported: set[str]) -> None:
    served: dict[str, dict[str, Any]] = {}
    for rule in adapter_rules():
        assert_known(rule["name"]["as"], rule["seriesQuery"], exported)
        assert_known(rule["name"]["as"], adapter_query(rule), exported)
        served[rule["name"]["as"]] = rule
    for kustomization in OVERLAYS:
        for hpa in render(kustomization.parent):
            if hpa["kind"] != "HorizontalPodAutoscaler":
                continue
            for metric in hpa["spec"]["metrics"]:
                wanted = metric["external"]["metric"]
                assert wanted["name"] in served, f"no adapter rule serves {wanted['name']}"
                series_query = served[wanted["name"]]["seriesQuery"]
                for label in wanted.get("selector", {}).get("matchLabels", {}):
                    assert f'{label}!=""' in series_query, f"{wanted['name']} has no {label}"
