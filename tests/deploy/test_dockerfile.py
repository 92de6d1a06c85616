"""The production image as the Dockerfile describes it: multi-stage, slim, non-root, health
checked, `spillgate serve` as entry point, built only from files that reach the context."""

from __future__ import annotations

import fnmatch
import json
import os
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.app import create_app
from gateway.config import ServerSettings, hash_key, parse_settings
from loadtest.procs import free_port
from tests.support.harness import ServerThread

ROOT = Path(__file__).resolve().parents[2]
Instruction = tuple[str, str]


def instructions(text: str) -> list[Instruction]:
    """(KEYWORD, arguments) of each instruction, continuation lines joined, comments dropped."""
    out: list[Instruction] = []
    pending = ""
    for line in text.splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        keyword, _, args = (pending + stripped).partition(" ")
        out.append((keyword.upper(), args.strip()))
        pending = ""
    return out


@pytest.fixture(scope="module")
def dockerfile() -> list[Instruction]:
    return instructions((ROOT / "Dockerfile").read_text())


def stages(steps: list[Instruction]) -> list[list[Instruction]]:
    out: list[list[Instruction]] = []
    for keyword, args in steps:
        if keyword == "FROM":
            out.append([])
        if out:
            out[-1].append((keyword, args))
    return out


def args_of(stage: list[Instruction], keyword: str) -> list[str]:
    return [args for k, args in stage if k == keyword]


def test_multi_stage_build_on_slim_python_311(dockerfile: list[Instruction]) -> None:
    (base_arg,) = (a for k, a in dockerfile if k == "ARG" and a.startswith("PYTHON_IMAGE="))
    assert base_arg.split("=", 1)[1].startswith("python:3.11-slim")
    build, runtime = stages(dockerfile)
    assert args_of(build, "FROM") == ["${PYTHON_IMAGE} AS build"]
    assert args_of(runtime, "FROM") == ["${PYTHON_IMAGE}"]
    assert any("pip wheel" in a and "venv" in a for a in args_of(build, "RUN"))
    assert args_of(runtime, "COPY") == ["--from=build /opt/spillgate /opt/spillgate"]


def test_runtime_runs_as_a_numeric_non_root_user(dockerfile: list[Instruction]) -> None:
    runtime = stages(dockerfile)[-1]
    (user,) = args_of(runtime, "USER")
    uid, _, gid = user.partition(":")
    assert uid.isdigit() and int(uid) != 0, "numeric, so runAsNonRoot can verify it"
    assert gid.isdigit() and int(gid) != 0
    assert any(f"--uid {uid}" in a for a in args_of(runtime, "RUN"))
    assert [k for k, _ in runtime][-3:] == ["HEALTHCHECK", "ENTRYPOINT", "CMD"]
    assert runtime.index(("USER", user)) < runtime.index(("ENTRYPOINT", '["spillgate"]'))


def test_entry_point_serves_the_mounted_config(dockerfile: list[Instruction]) -> None:
    runtime = stages(dockerfile)[-1]
    (entrypoint,) = args_of(runtime, "ENTRYPOINT")
    (cmd,) = args_of(runtime, "CMD")
    assert json.loads(entrypoint) == ["spillgate"]
    assert json.loads(cmd) == ["serve", "-c", "/etc/spillgate/gateway.yaml", "--host", "0.0.0.0"]
    (expose,) = args_of(runtime, "EXPOSE")
    assert int(expose) == ServerSettings().port


def healthcheck(dockerfile: list[Instruction]) -> tuple[list[str], str]:
    """The health check's exec-form command and the image's default SPILLGATE_HEALTH_URL."""
    runtime = stages(dockerfile)[-1]
    (check,) = args_of(runtime, "HEALTHCHECK")
    command = json.loads(check[check.index("CMD ") + 4 :])
    env = " ".join(args_of(runtime, "ENV"))
    (default,) = (w.split("=", 1)[1] for w in env.split() if w.startswith("SPILLGATE_HEALTH_URL="))
    return command, default


def test_health_check_probes_healthz_on_the_exposed_port(dockerfile: list[Instruction]) -> None:
    command, default = healthcheck(dockerfile)
    assert command[0] == "python", "the slim image has no curl"
    assert default == f"http://127.0.0.1:{ServerSettings().port}/healthz"


@pytest.fixture(scope="module")
def gateway() -> Iterator[ServerThread]:
    """A real gateway whose only backend is down: alive, but not ready."""
    settings = parse_settings(
        {
            "tenants": [{"name": "t", "key_sha256": hash_key("k")}],
            "pools": [{"name": "p", "backends": [{"url": f"http://127.0.0.1:{free_port()}"}]}],
        }
    )
    with ServerThread(create_app(settings, environ={})) as server:
        yield server


def run_healthcheck(dockerfile: list[Instruction], url: str) -> int:
    command, _ = healthcheck(dockerfile)
    env = {**os.environ, "SPILLGATE_HEALTH_URL": url}
    return subprocess.run(
        [sys.executable, *command[1:]], env=env, capture_output=True, timeout=10, check=False
    ).returncode


def test_health_check_command_passes_on_a_live_gateway_and_fails_otherwise(
    dockerfile: list[Instruction], gateway: ServerThread
) -> None:
    assert run_healthcheck(dockerfile, f"{gateway.url}/healthz") == 0
    assert run_healthcheck(dockerfile, f"{gateway.url}/readyz") != 0, "503 must fail it"
    assert run_healthcheck(dockerfile, f"http://127.0.0.1:{free_port()}/healthz") != 0


def dockerignore_allows(path: str) -> bool:
    """Whether `path` reaches the build context (last matching pattern wins)."""
    allowed = True
    for line in (ROOT / ".dockerignore").read_text().splitlines():
        pattern = line.strip()
        if not pattern or pattern.startswith("#"):
            continue
        negate = pattern.startswith("!")
        pattern = pattern.lstrip("!").rstrip("/").removeprefix("**/")
        parts = Path(path).parts
        if any(fnmatch.fnmatch("/".join(parts[: i + 1]), pattern) for i in range(len(parts))) or (
            fnmatch.fnmatch(Path(path).name, pattern)
        ):
            allowed = negate
    return allowed


def test_context_holds_every_package_the_wheel_needs(dockerfile: list[Instruction]) -> None:
    build = stages(dockerfile)[0]
    sources = [
        word
        for copy in args_of(build, "COPY")
        for word in copy.split()[:-1]
        if not word.startswith("--")
    ]
    for source in sources:
        if "*" not in source:
            assert (ROOT / source).exists(), source
            assert dockerignore_allows(source), f"{source} is kept out of the build context"
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    patterns = pyproject["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = {p.rstrip("*") for p in patterns}
    assert packages <= set(sources), f"not copied: {sorted(packages - set(sources))}"
    readme = pyproject["project"].get("readme")
    if readme:
        assert any(fnmatch.fnmatch(readme, s) for s in sources), "the readme the wheel names"
    assert dockerignore_allows("gateway/capacity/catalog.yaml")
    assert not dockerignore_allows("gateway/__pycache__/app.cpython-311.pyc")
    assert not dockerignore_allows(".venv/bin/python")
    assert not dockerignore_allows("tests/conftest.py")
    assert dockerignore_allows("loadtest/sim/app.py")
    assert not dockerignore_allows("loadtest/bench/overhead.py")


def wheel_packages() -> set[str]:
    """The packages pyproject.toml's find section picks, as setuptools matches them."""
    find = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    include, exclude = find["find"]["include"], find["find"].get("exclude", [])
    found = set()
    tops = [d for d in ROOT.iterdir() if d.is_dir() and not d.name.startswith(".")]
    for init in (i for top in tops for i in top.glob("**/__init__.py")):
        name = ".".join(init.parent.relative_to(ROOT).parts)
        picked = any(fnmatch.fnmatchcase(name, p) for p in include)
        if picked and not any(fnmatch.fnmatchcase(name, p) for p in exclude):
            found.add(name)
    return found


def test_wheel_ships_gateway_policies_planner_and_simulator_not_bench_or_tests() -> None:
    packages = wheel_packages()
    shipped = {
        "gateway.config",
        "gateway.front",
        "gateway.admission",
        "gateway.ops",
        "gateway.capacity",
    }
    assert shipped | {"policies.cache", "loadtest.sim", "loadtest.drill"} <= packages
    assert not {p for p in packages if p.startswith(("loadtest.bench", "tests"))}
    for data in ("ops/dashboard.html", "ops/openapi.yaml", "admission/ledger/ledger.lua",
                 "ratelimit/bucket.lua", "capacity/catalog.yaml"):  # fmt: skip
        path = ROOT / "gateway" / data
        assert path.exists(), data
        assert ".".join(path.parent.relative_to(ROOT).parts) in packages, data
