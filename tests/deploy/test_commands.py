"""Every `spillgate` command line the compose stack and the manifests run is one the CLI
accepts, with the same parsers `spillgate COMMAND` uses."""

from __future__ import annotations

import argparse
import importlib
from pathlib import Path

import pytest
import yaml

from gateway.cli import COMMANDS
from loadtest.sim.cli import provider_config, sim_config
from loadtest.sim.config import resolve
from tests.deploy.kustomize import pod_spec, render

ROOT = Path(__file__).resolve().parents[2]
OVERLAYS = sorted((ROOT / "deploy" / "k8s" / "overlays").glob("*/kustomization.yaml"))


def command_lines() -> list[tuple[str, list[str]]]:
    """(where, argv after `spillgate`) of each container that runs the spillgate image."""
    found = []
    compose = yaml.safe_load((ROOT / "deploy" / "compose.yaml").read_text())
    for name, service in compose["services"].items():
        if service.get("image") == "spillgate:local":
            found.append((f"compose:{name}", service["command"]))
    for kustomization in OVERLAYS:
        for resource in render(kustomization.parent):
            spec = pod_spec(resource)
            for container in (spec or {}).get("containers", []):
                if container["image"].rpartition(":")[0].endswith("spillgate"):
                    where = f"{kustomization.parent.name}:{resource['metadata']['name']}"
                    found.append((where, container["args"]))
    return found


COMMAND_LINES = command_lines()


def parse(argv: list[str]) -> argparse.Namespace:
    module = importlib.import_module(COMMANDS[argv[0]][0])
    parser = argparse.ArgumentParser(prog=f"spillgate {argv[0]}", exit_on_error=False)
    module.add_arguments(parser)
    try:
        return parser.parse_args(argv[1:])
    except SystemExit as exc:  # argparse exits on unknown arguments despite exit_on_error
        raise AssertionError(f"spillgate rejects {argv}") from exc


def test_both_gateways_and_every_simulator_are_found() -> None:
    wheres = {where for where, _ in COMMAND_LINES}
    assert {"compose:gateway-1", "compose:gateway-2", "compose:sim-provider"} <= wheres
    assert {"dev:spillgate", "dev:sim-70b", "prod:spillgate"} <= wheres


@pytest.mark.parametrize("where,argv", COMMAND_LINES, ids=[w for w, _ in COMMAND_LINES])
def test_command_line_is_accepted(where: str, argv: list[str]) -> None:
    args = parse(argv)
    assert args.host == "0.0.0.0", "listen beyond the container's loopback"
    if argv[0] == "serve":
        assert args.config == "/etc/spillgate/gateway.yaml"
    elif args.provider:
        assert provider_config(args).requests_per_minute > 0
    else:
        assert resolve(sim_config(args)).kv_tokens == args.kv_tokens
