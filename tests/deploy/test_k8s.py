"""The Kubernetes manifests: every overlay renders, validates against the Kubernetes schemas,
and hangs together (selectors, ports, secrets, autoscaler targets, the gateway config)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import kubernetes_validate
import pytest
import yaml

from gateway.config import Settings, load_settings
from tests.deploy.kustomize import KustomizeError, Resource, load_documents, pod_spec, render

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
OVERLAYS = sorted(p for p in (K8S / "overlays").iterdir() if (p / "kustomization.yaml").exists())
KUBERNETES_VERSION = "1.30.0"
PLACEHOLDER = "REPLACE_ME"
QUANTITY = re.compile(r"^\d+(\.\d+)?(m|k|M|G|T|Ki|Mi|Gi|Ti)?$")
STATEFUL_POD_HOST = re.compile(r"^(?P<set>[a-z0-9-]+)-(?P<ordinal>\d+)\.(?P<service>[a-z0-9-]+)$")

overlay_params = pytest.mark.parametrize("overlay", OVERLAYS, ids=[p.name for p in OVERLAYS])


def find(resources: list[Resource], kind: str, name: str) -> Resource | None:
    return next((r for r in resources if r["kind"] == kind and r["metadata"]["name"] == name), None)


def get(resources: list[Resource], kind: str, name: str) -> Resource:
    resource = find(resources, kind, name)
    assert resource is not None, f"no {kind}/{name} in the render"
    return resource


def gateway_container(resources: list[Resource]) -> dict[str, Any]:
    spec = pod_spec(get(resources, "Deployment", "spillgate"))
    assert spec is not None
    (container,) = (c for c in spec["containers"] if c["name"] == "gateway")
    return container


def gateway_settings(resources: list[Resource], tmp_path: Path) -> Settings:
    config = get(resources, "ConfigMap", "spillgate-config")
    path = tmp_path / "gateway.yaml"
    path.write_text(config["data"]["gateway.yaml"])
    return load_settings(path)


def secret_example(overlay: Path) -> Resource:
    (secret,) = load_documents(overlay / "secret.example.yaml")
    return secret


def workloads(resources: list[Resource]) -> list[Resource]:
    return [r for r in resources if pod_spec(r) is not None]


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def test_dev_and_prod_overlays_exist() -> None:
    assert {"dev", "prod"} <= {p.name for p in OVERLAYS}


def test_renderer_refuses_kustomize_features_it_does_not_implement(tmp_path: Path) -> None:
    (tmp_path / "kustomization.yaml").write_text("resources: []\ncommonLabels: {a: b}\n")
    with pytest.raises(KustomizeError, match="commonLabels"):
        render(tmp_path)


@overlay_params
def test_every_object_validates_against_the_kubernetes_schema(overlay: Path) -> None:
    resources = [*render(overlay), secret_example(overlay)]
    kinds = {r["kind"] for r in resources}
    assert {"Deployment", "Service", "ConfigMap", "PodDisruptionBudget"} <= kinds
    assert "HorizontalPodAutoscaler" in kinds
    for resource in resources:
        where = f"{resource['kind']}/{resource['metadata']['name']}"
        try:
            kubernetes_validate.validate(resource, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            path = ".".join(str(p) for p in exc.path)
            pytest.fail(f"{overlay.name}: {where}: {path}: {exc.message}")


@overlay_params
def test_namespaced_objects_land_in_the_spillgate_namespace(overlay: Path) -> None:
    for resource in render(overlay):
        if resource["kind"] == "Namespace":
            assert resource["metadata"]["name"] == "spillgate"
        else:
            assert resource["metadata"].get("namespace") == "spillgate", resource["kind"]


@overlay_params
def test_pods_run_as_non_root_with_probes_and_resources(overlay: Path) -> None:
    for workload in workloads(render(overlay)):
        spec = pod_spec(workload)
        assert spec is not None
        name = workload["metadata"]["name"]
        pod_security = spec["securityContext"]
        assert pod_security["runAsNonRoot"] is True, name
        assert pod_security["runAsUser"] != 0, name
        for c in spec["containers"]:
            security = c["securityContext"]
            assert security["allowPrivilegeEscalation"] is False, name
            assert security["readOnlyRootFilesystem"] is True, name
            assert security["capabilities"]["drop"] == ["ALL"], name
            assert {"cpu", "memory"} <= set(c["resources"]["requests"]), name
            assert "memory" in c["resources"]["limits"], name
            for amounts in c["resources"].values():
                for amount in amounts.values():
                    assert QUANTITY.match(str(amount)), f"{name}: quantity {amount!r}"
            assert "readinessProbe" in c and "livenessProbe" in c, name
            port_names = {p.get("name") for p in c.get("ports", [])}
            for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
                check = c.get(probe, {}).get("httpGet") or c.get(probe, {}).get("tcpSocket")
                if check is not None and isinstance(check["port"], str):
                    assert check["port"] in port_names, f"{name} {probe}"


@overlay_params
def test_gateway_probes_readiness_and_liveness_endpoints(overlay: Path) -> None:
    container = gateway_container(render(overlay))
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["args"][:3] == ["serve", "-c", "/etc/spillgate/gateway.yaml"]
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    assert mounts["/etc/spillgate"]["readOnly"] is True


@overlay_params
def test_selectors_match_the_pods_they_are_meant_for(overlay: Path) -> None:
    resources = render(overlay)
    pods = workloads(resources)
    for workload in pods:
        labels = workload["spec"]["template"]["metadata"]["labels"]
        assert selects(workload["spec"]["selector"]["matchLabels"], labels)
    for service in (r for r in resources if r["kind"] == "Service"):
        name = service["metadata"]["name"]
        chosen = [w for w in pods if selects(service["spec"]["selector"], _pod_labels(w))]
        assert len(chosen) == 1, f"Service/{name} selects {len(chosen)} workloads"
        spec = pod_spec(chosen[0])
        assert spec is not None
        ports = {p.get("name") for c in spec["containers"] for p in c.get("ports", [])}
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in ports, f"Service/{name} targets {port['targetPort']}"
    gateway_labels = _pod_labels(get(resources, "Deployment", "spillgate"))
    pdb = get(resources, "PodDisruptionBudget", "spillgate")
    assert selects(pdb["spec"]["selector"]["matchLabels"], gateway_labels)
    policy = get(resources, "NetworkPolicy", "redis")
    assert selects(
        policy["spec"]["podSelector"]["matchLabels"],
        _pod_labels(get(resources, "Deployment", "redis")),
    )
    (source,) = policy["spec"]["ingress"][0]["from"]
    assert selects(source["podSelector"]["matchLabels"], gateway_labels)


def _pod_labels(workload: Resource) -> dict[str, str]:
    labels: dict[str, str] = workload["spec"]["template"]["metadata"]["labels"]
    return labels


@overlay_params
def test_gateway_config_loads_and_every_secret_it_names_is_provided(
    overlay: Path, tmp_path: Path
) -> None:
    resources = render(overlay)
    settings = gateway_settings(resources, tmp_path)
    container = gateway_container(resources)
    secret = secret_example(overlay)
    assert set(secret["stringData"].values()) == {PLACEHOLDER}, "commit placeholders only"
    (source,) = container["envFrom"]
    assert source["secretRef"]["name"] == secret["metadata"]["name"]
    provided = {e["name"] for e in container["env"]} | set(secret["stringData"])
    needed = {settings.server.admin_token_env, settings.redis.url_env}
    needed |= {t.key_env for t in settings.tenants if t.key_env}
    needed |= {p.api_key_env for p in settings.providers if p.api_key_env}
    assert needed <= provided, f"not provided: {sorted(needed - provided)}"
    for workload in workloads(resources):
        spec = pod_spec(workload)
        assert spec is not None
        for c in spec["containers"]:
            for env in c.get("env", []):
                ref = env.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    assert ref["name"] == secret["metadata"]["name"]
                    assert ref["key"] in secret["stringData"], f"{ref['key']} not in the example"


@overlay_params
def test_gateway_reaches_redis_through_its_service(overlay: Path) -> None:
    resources = render(overlay)
    env = {e["name"]: e for e in gateway_container(resources)["env"]}
    url = urlsplit(env["SPILLGATE_REDIS_URL"]["value"])
    assert url.scheme == "redis"
    service = get(resources, "Service", url.hostname or "")
    assert url.port in {p["port"] for p in service["spec"]["ports"]}
    password = env[url.password.strip("$()")] if url.password else None
    assert password is not None, "the Redis URL carries the password from the Secret"


@overlay_params
def test_in_cluster_backends_resolve_to_stateful_pods_or_services(
    overlay: Path, tmp_path: Path
) -> None:
    """A backend `set-N.set` is pod N of a StatefulSet, rendered here or scaled by an HPA here;
    every ordinal the autoscaler may create is listed in the gateway config."""
    resources = render(overlay)
    settings = gateway_settings(resources, tmp_path)
    hpa_targets = {
        r["spec"]["scaleTargetRef"]["name"]: r
        for r in resources
        if r["kind"] == "HorizontalPodAutoscaler"
    }
    ordinals: dict[str, set[int]] = {}
    hosts = [urlsplit(b.url) for pool in settings.pools for b in pool.backends]
    hosts += [urlsplit(p.base_url) for p in settings.providers]
    for url in hosts:
        host = url.hostname or ""
        match = STATEFUL_POD_HOST.match(host)
        if match:
            assert match["set"] == match["service"], host
            ordinals.setdefault(match["set"], set()).add(int(match["ordinal"]))
            statefulset = find(resources, "StatefulSet", match["set"])
            if statefulset is None:
                assert match["set"] in hpa_targets, f"{host}: no StatefulSet and no autoscaler"
            else:
                assert statefulset["spec"]["serviceName"] == match["service"]
                service = get(resources, "Service", match["service"])
                assert service["spec"]["clusterIP"] == "None", "a headless Service"
        elif "." not in host:
            service = get(resources, "Service", host)
            assert url.port in {p["port"] for p in service["spec"]["ports"]}, host
    for name, hpa in hpa_targets.items():
        if hpa["spec"]["scaleTargetRef"]["kind"] == "StatefulSet":
            assert ordinals.get(name) == set(range(hpa["spec"]["maxReplicas"])), name


@overlay_params
def test_autoscalers_scale_the_gateway_and_backends_on_spillgate_metrics(
    overlay: Path, tmp_path: Path
) -> None:
    resources = render(overlay)
    settings = gateway_settings(resources, tmp_path)
    hpas = [r for r in resources if r["kind"] == "HorizontalPodAutoscaler"]
    gateway = get(resources, "HorizontalPodAutoscaler", "spillgate")
    assert gateway["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": "spillgate",
    }
    assert gateway["spec"]["minReplicas"] >= 2, "the PodDisruptionBudget needs two to drain one"
    assert gateway["spec"]["minReplicas"] == settings.ratelimit.replicas
    metrics = [m["external"]["metric"]["name"] for m in gateway["spec"]["metrics"]]
    assert metrics == ["spillgate_fleet_active_sessions"]
    backends = [h for h in hpas if h is not gateway]
    assert backends, "an autoscaler for the backends"
    pools = {p.name for p in settings.pools}
    targets = {"Value": "value", "AverageValue": "averageValue"}
    for hpa in hpas:
        for metric in hpa["spec"]["metrics"]:
            target = metric["external"]["target"]
            assert set(target) == {"type", targets[target["type"]]}
            assert QUANTITY.match(target[targets[target["type"]]])
    for hpa in backends:
        names = set()
        for metric in hpa["spec"]["metrics"]:
            names.add(metric["external"]["metric"]["name"])
            assert metric["external"]["metric"]["selector"]["matchLabels"]["pool"] in pools
        assert names == {"spillgate_pool_desired_backends", "spillgate_ttft_p99_seconds"}


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
@overlay_params
def test_renderer_agrees_with_kubectl_kustomize(overlay: Path) -> None:
    out = subprocess.run(
        ["kubectl", "kustomize", str(overlay)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout

    def key(r: Resource) -> tuple[str, str]:
        return r["kind"], r["metadata"]["name"]

    expected = sorted((d for d in yaml.safe_load_all(out) if d), key=key)
    assert sorted(render(overlay), key=key) == expected
