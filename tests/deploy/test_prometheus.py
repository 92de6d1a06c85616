"""The Prometheus side: alert rules pass `promtool check rules` and their unit tests, and
both scrape configs pass `promtool check config`."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.deploy.promql import adapter_query, adapter_rules

ROOT = Path(__file__).resolve().parents[2]
PROMETHEUS = ROOT / "deploy" / "prometheus"
PROMTOOL = shutil.which("promtool")
DASHBOARDS = sorted((ROOT / "deploy" / "grafana" / "dashboards").glob("*.json"))
# What Grafana puts in place of its variables before it sends a query.
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$__range": "1h", "$pool": ".*"}

needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool is not installed (Debian package: prometheus)"
)


def promtool(*args: str | Path) -> str:
    assert PROMTOOL is not None
    result = subprocess.run(
        [PROMTOOL, *map(str, args)], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout + result.stderr


@needs_promtool
def test_alert_rules_pass_promtool_check() -> None:
    rules = sorted((PROMETHEUS / "rules").glob("*.yaml"))
    assert rules
    out = promtool("check", "rules", *rules)
    assert "SUCCESS" in out


@needs_promtool
def test_alerts_fire_on_the_series_they_watch() -> None:
    tests = sorted((PROMETHEUS / "tests").glob("*.test.yaml"))
    assert tests
    promtool("test", "rules", *tests)


@needs_promtool
def test_every_alert_has_a_unit_test() -> None:
    alerts = {
        rule["alert"]
        for path in (PROMETHEUS / "rules").glob("*.yaml")
        for group in yaml.safe_load(path.read_text())["groups"]
        for rule in group["rules"]
        if "alert" in rule
    }
    tested = {
        case["alertname"]
        for path in (PROMETHEUS / "tests").glob("*.test.yaml")
        for test in yaml.safe_load(path.read_text())["tests"]
        for case in test.get("alert_rule_test", [])
    }
    assert alerts == tested


@needs_promtool
def test_compose_scrape_config_passes_promtool_check() -> None:
    out = promtool("check", "config", PROMETHEUS / "prometheus.yml")
    assert "1 rule files found" in out


@needs_promtool
def test_kubernetes_scrape_config_passes_promtool_check(tmp_path: Path) -> None:
    """Debian's promtool is built without Kubernetes discovery, so the pod discovery is swapped
    for a static target; everything else (relabelling, rule files) is checked as written."""
    config = yaml.safe_load((PROMETHEUS / "kubernetes.yml").read_text())
    for job in config["scrape_configs"]:
        assert job.pop("kubernetes_sd_configs") == [{"role": "pod"}]
        job["static_configs"] = [{"targets": ["pod.example:8080"]}]
    kept = {
        r.get("target_label") for job in config["scrape_configs"] for r in job["relabel_configs"]
    }
    assert {"namespace", "pod"} <= kept, "the adapter scopes metrics by namespace"
    shutil.copytree(PROMETHEUS / "rules", tmp_path / "rules")
    path = tmp_path / "kubernetes.yml"
    path.write_text(yaml.safe_dump(config))
    out = promtool("check", "config", path)
    assert "1 rule files found" in out


def dashboard_queries() -> list[str]:
    queries = []
    stack = [p for path in DASHBOARDS for p in json.loads(path.read_text())["panels"]]
    while stack:
        panel = stack.pop()
        stack += panel.get("panels", [])
        for target in panel.get("targets", []):
            query = target["expr"]
            for variable, value in GRAFANA_VARIABLES.items():
                query = query.replace(variable, value)
            assert "$" not in query, f"an unknown Grafana variable in {query}"
            queries.append(query)
    return queries


@needs_promtool
def test_dashboard_and_autoscaler_queries_are_valid_promql(tmp_path: Path) -> None:
    """promtool has no expression check of its own: the queries go in as recording rules."""
    queries = dashboard_queries() + [adapter_query(rule) for rule in adapter_rules()]
    assert len(queries) > 20
    rules = [{"record": f"spillgate:query_{i}", "expr": q} for i, q in enumerate(queries)]
    path = tmp_path / "queries.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "queries", "rules": rules}]}))
    out = promtool("check", "rules", path)
    assert f"SUCCESS: {len(queries)} rules found" in out


def test_prometheus_chart_values_load_the_rules_configmap() -> None:
    values = yaml.safe_load((ROOT / "deploy/k8s/monitoring/prometheus.values.yaml").read_text())
    (mount,) = values["server"]["extraConfigmapMounts"]
    rule_files = values["serverFiles"]["prometheus.yml"]["rule_files"]
    assert f"{mount['mountPath']}/*.yaml" in rule_files
    readme = (ROOT / "deploy" / "README.md").read_text()
    command = f"create configmap {mount['configMap']} --from-file=deploy/prometheus/rules/"
    assert command in readme


def test_the_fleets_desired_backends_is_the_sum_of_its_replicas() -> None:
    """Each gateway process publishes the backends its own traffic needs; the autoscaler
    and the dashboard add them up over the fleet's replicas (a max or an average would
    scale a pool for one replica's share of the demand)."""
    (rule,) = [r for r in adapter_rules() if r["name"]["as"] == "spillgate_pool_desired_backends"]
    assert adapter_query(rule) == (
        'sum by (namespace, pool) (spillgate_pool_desired_backends{namespace="spillgate"})'
    )
    panels = [q for q in dashboard_queries() if "spillgate_pool_desired_backends" in q]
    assert panels and all(
        q.startswith("sum by (pool) (spillgate_pool_desired_backends") for q in panels
    )
