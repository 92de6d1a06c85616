"""deploy/README.md's commands name files that exist and the secrets the overlays need."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "deploy" / "README.md"
BLOCK = re.compile(r"```sh\n(.*?)```", re.DOTALL)
REPO_PATH = re.compile(r"(?<![\w/.-])(?:deploy/[\w./*-]*|Dockerfile)")
LITERAL_KEY = re.compile(r"--from-literal=([A-Z0-9_]+)=")
COMPOSE_DEFAULT = re.compile(r"\$\{(\w+):-([^}]+)\}")


def blocks() -> list[str]:
    return BLOCK.findall(README.read_text())


def test_every_path_in_the_commands_exists() -> None:
    paths = {p.rstrip("/.") for block in blocks() for p in REPO_PATH.findall(block)}
    assert {"deploy/compose.yaml", "deploy/k8s/overlays/dev", "deploy/k8s/overlays/prod"} <= paths
    for path in sorted(paths):
        assert list(ROOT.glob(path)), f"README names {path}, which does not exist"


def test_secret_commands_create_exactly_the_keys_each_overlay_needs() -> None:
    created = [
        frozenset(LITERAL_KEY.findall(block))
        for block in blocks()
        if "create secret generic spillgate-secrets" in block
    ]
    needed = []
    for example in sorted((ROOT / "deploy" / "k8s" / "overlays").glob("*/secret.example.yaml")):
        (secret,) = yaml.safe_load_all(example.read_text())
        needed.append(frozenset(secret["stringData"]))
    assert sorted(created, key=sorted) == sorted(needed, key=sorted)


def test_local_defaults_it_quotes_are_the_compose_defaults() -> None:
    text = README.read_text()
    defaults = dict(COMPOSE_DEFAULT.findall((ROOT / "deploy" / "compose.yaml").read_text()))
    for variable in ("SPILLGATE_DEMO_KEY", "SPILLGATE_ADMIN_TOKEN"):
        assert variable in text
        assert f"`{defaults[variable]}`" in text, variable
        assert f"Bearer {defaults[variable]}" in text, variable
