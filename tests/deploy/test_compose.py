"""The local compose stack: the file parses, every file it mounts or builds from exists, and
its services, the gateway config, Prometheus and Grafana all point at one another."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from gateway.config import Settings, load_settings

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
COMPOSE = DEPLOY / "compose.yaml"
SIM_SERVICES = {"sim-70b-0", "sim-70b-1", "sim-8b-0", "sim-provider"}


@pytest.fixture(scope="module")
def services() -> dict[str, dict[str, Any]]:
    compose = yaml.safe_load(COMPOSE.read_text())
    found: dict[str, dict[str, Any]] = compose["services"]
    return found


def bind_mounts(service: dict[str, Any]) -> dict[str, Path]:
    """Container path → host path of each bind mount (short syntax, relative to deploy/)."""
    mounts = {}
    for volume in service.get("volumes", []):
        source, target, *_ = volume.split(":")
        assert source.startswith("./"), f"bind mounts only, relative to deploy/: {volume}"
        mounts[target] = (DEPLOY / source).resolve()
    return mounts


def gateway_config(service: dict[str, Any]) -> Settings:
    command = service["command"]
    container_path = command[command.index("-c") + 1]
    return load_settings(bind_mounts(service)[container_path])


def flag(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


def test_stack_has_two_gateways_one_redis_sims_prometheus_and_grafana(
    services: dict[str, dict[str, Any]],
) -> None:
    gateways = {n for n, s in services.items() if s.get("command", [None])[0] == "serve"}
    assert gateways == {"gateway-1", "gateway-2"}
    assert SIM_SERVICES | {"redis", "prometheus", "grafana"} <= set(services)
    for name in gateways:
        redis = urlsplit(services[name]["environment"]["SPILLGATE_REDIS_URL"])
        assert redis.hostname == "redis"
    host_ports = [p.split(":")[0] for s in services.values() for p in s.get("ports", [])]
    assert len(host_ports) == len(set(host_ports)), "each host port is published once"


def test_every_referenced_file_exists(services: dict[str, dict[str, Any]]) -> None:
    for name, service in services.items():
        for target, source in bind_mounts(service).items():
            assert source.exists(), f"{name}: {source} (mounted at {target}) does not exist"
        build = service.get("build")
        if build:
            context = (DEPLOY / build["context"]).resolve()
            assert (context / build["dockerfile"]).is_file(), name
            assert context == ROOT
        for dependency in service.get("depends_on", []):
            assert dependency in services, f"{name} depends on unknown {dependency}"


def test_spillgate_services_run_the_image_built_from_the_dockerfile(
    services: dict[str, dict[str, Any]],
) -> None:
    for name in {"gateway-1", "gateway-2"} | SIM_SERVICES:
        assert services[name]["image"] == "spillgate:local", name
        assert services[name]["build"]["dockerfile"] == "Dockerfile", name


def test_gateway_config_loads_and_points_at_the_simulated_fleet(
    services: dict[str, dict[str, Any]],
) -> None:
    settings = gateway_config(services["gateway-1"])
    assert gateway_config(services["gateway-2"]) == settings
    environment = services["gateway-1"]["environment"]
    needed = {settings.server.admin_token_env, settings.redis.url_env}
    needed |= {t.key_env for t in settings.tenants if t.key_env}
    needed |= {p.api_key_env for p in settings.providers if p.api_key_env}
    assert needed <= set(environment), sorted(needed - set(environment))
    assert settings.ratelimit.replicas == 2
    for pool in settings.pools:
        for backend in pool.backends:
            url = urlsplit(backend.url)
            command = services[url.hostname or ""]["command"]
            assert command[0] == "sim" and "--provider" not in command
            assert int(flag(command, "--port")) == url.port
            assert flag(command, "--host") == "0.0.0.0"
            assert flag(command, "--model") == (backend.served_model or pool.name)
    for provider in settings.providers:
        url = urlsplit(provider.base_url)
        service = services[url.hostname or ""]
        assert "--provider" in service["command"]
        assert int(flag(service["command"], "--port")) == url.port
        key = provider.api_key_env or ""
        assert service["environment"]["SPILLGATE_SIM_PROVIDER_KEY"] == environment[key]


def test_health_checks_of_simulated_services_probe_their_own_port(
    services: dict[str, dict[str, Any]],
) -> None:
    for name in SIM_SERVICES:
        url = urlsplit(services[name]["environment"]["SPILLGATE_HEALTH_URL"])
        assert url.port == int(flag(services[name]["command"], "--port")), name


def test_prometheus_scrapes_the_stack_with_the_alert_rules(
    services: dict[str, dict[str, Any]],
) -> None:
    mounts = bind_mounts(services["prometheus"])
    config_path = Path(flag_value(services["prometheus"]["command"], "--config.file"))
    host_dir = mounts[str(config_path.parent)]
    config = yaml.safe_load((host_dir / config_path.name).read_text())
    rule_files = [p for pattern in config["rule_files"] for p in host_dir.glob(pattern)]
    assert rule_files == sorted((DEPLOY / "prometheus" / "rules").glob("*.yaml"))
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    targets = {t for c in jobs["spillgate"]["static_configs"] for t in c["targets"]}
    assert targets == {"gateway-1:8080", "gateway-2:8080"}
    for job in jobs.values():
        for static in job["static_configs"]:
            for target in static["targets"]:
                host = target.split(":")[0]
                assert host == "localhost" or host in services, target


def flag_value(command: list[str], name: str) -> str:
    (value,) = (arg.split("=", 1)[1] for arg in command if arg.startswith(name + "="))
    return value


def test_grafana_provisions_the_prometheus_datasource_and_the_dashboard(
    services: dict[str, dict[str, Any]],
) -> None:
    mounts = bind_mounts(services["grafana"])
    provisioning = mounts["/etc/grafana/provisioning"]
    (source,) = yaml.safe_load((provisioning / "datasources" / "prometheus.yaml").read_text())[
        "datasources"
    ]
    assert urlsplit(source["url"]).hostname == "prometheus" and source["isDefault"]
    (provider,) = yaml.safe_load((provisioning / "dashboards" / "spillgate.yaml").read_text())[
        "providers"
    ]
    dashboards = mounts[provider["options"]["path"]]
    assert (dashboards / "spillgate.json").is_file()
    home = services["grafana"]["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert (dashboards / Path(home).name).is_file()


def test_every_gateway_config_under_deploy_loads() -> None:
    """Any YAML under deploy/ with pools and tenants is a gateway config and must load."""
    loaded = []
    for path in sorted(DEPLOY.rglob("*.yaml")):
        documents = list(yaml.safe_load_all(path.read_text()))
        data = documents[0] if len(documents) == 1 else None
        if isinstance(data, dict) and {"pools", "tenants"} <= set(data):
            load_settings(path)  # refuses a file with any problem, unknown policies included
            loaded.append(path.relative_to(DEPLOY).as_posix())
    assert {"compose/gateway.yaml", "examples/gateway.yaml"} <= set(loaded)


def has_docker_compose() -> bool:
    if shutil.which("docker") is None:
        return False
    probe = ["docker", "compose", "version"]
    return subprocess.run(probe, capture_output=True, timeout=10, check=False).returncode == 0


@pytest.mark.skipif(not has_docker_compose(), reason="docker compose is not installed")
def test_docker_compose_accepts_the_file() -> None:
    subprocess.run(
        ["docker", "compose", "-f", str(COMPOSE), "config", "--quiet"],
        check=True,
        timeout=60,
        capture_output=True,
    )
