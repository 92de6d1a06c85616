"""`spillgate drill` passes against `spillgate demo` and fails loudly when a path is broken."""

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from loadtest.procs import free_port
from loadtest.sim.config import SimConfig
from tests.support.fleet import ADMIN_TOKEN, Fleet, run_fleet

DRILL_TIMEOUT_S = 150


def drill(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gateway.cli", "drill", *args],
        capture_output=True, text=True, timeout=DRILL_TIMEOUT_S,
    )  # fmt: skip


def test_drill_passes_against_the_demo_it_starts(tmp_path: Path) -> None:
    # with a shared system prompt, so the demo's two big backends' prefix caches are checked
    done = drill("--json", str(tmp_path / "drill.json"), "--shared-prefix-tokens", "256")
    lines = done.stdout.splitlines()
    assert done.returncode == 0, done.stdout + done.stderr
    checks = [line for line in lines if line.startswith(("PASS", "FAIL"))]
    assert len(checks) == 12 and all(line.startswith("PASS") for line in checks), checks
    for path in ("queue", "degrade", "provider", "cache", "reject"):
        assert any(line.startswith(f"PASS  overflow path '{path}' engaged") for line in lines)
    assert checks[-1].startswith("PASS  backends' prefix caches found the shared system prompt")
    assert lines[-1] == "drill passed: 12 checks"
    assert f"wrote {tmp_path / 'drill.json'}" in done.stderr.splitlines()
    verdicts = json.loads((tmp_path / "drill.json").read_text())
    assert verdicts["passed"] is True and len(verdicts["checks"]) == 12
    assert set(verdicts["outcomes"]) >= {"queued", "degraded", "provider", "cached", "rejected"}
    assert verdicts["script"]["shared_prefix_tokens"] == 256
    cache = verdicts["prefix_cache"]
    assert cache["hit_rate"] > 0.17, cache  # about 0.4 where it works; 0.03 without the prefix
    note = f"note  backends' prefix-cache hit rate {cache['hit_rate'] * 100:.1f} % ("
    assert any(line.startswith(note) for line in lines), lines


@pytest.fixture
def fleet_with_dead_provider() -> Iterator[Fleet]:
    """The demo's shape, but its provider's URL refuses connections."""
    big = [SimConfig(model="big-model", kv_tokens=4096) for _ in range(2)]
    small = [SimConfig(model="small-model", kv_tokens=4096)]
    dead = f"http://127.0.0.1:{free_port()}/v1"
    with run_fleet(
        pools={"big": big, "small": small},
        pool_options={
            "big": {
                "overflow": ["queue", "degrade", "provider", "cache", "reject"],
                "queue": {"max_depth": 16, "max_wait_s": 1.0},
                "degrade_to": "small",
                "provider": "hosted",
            },
            "small": {
                "overflow": ["queue", "reject"],
                "queue": {"max_depth": 8, "max_wait_s": 0.5},
            },
        },
        tenants={"acme": {"requests_per_minute": 100_000, "tokens_per_minute": 50_000_000}},
        extra={"providers": [{
            "name": "hosted", "base_url": dead, "models": {"big": "hosted-large"},
            "tokens_per_minute": 20_000, "max_concurrency": 8,
            "timeouts": {"connect": 0.5, "first_token": 2.0, "total": 10.0},
        }]},
    ) as fleet:  # fmt: skip
        yield fleet


def test_drill_fails_naming_the_path_when_the_provider_refuses_connections(
    fleet_with_dead_provider: Fleet, tmp_path: Path
) -> None:
    fleet = fleet_with_dead_provider
    config = tmp_path / "drill.yaml"
    config.write_text(yaml.safe_dump({
        "url": fleet.url, "key": fleet.keys["acme"], "admin_token": ADMIN_TOKEN, "model": "big",
        "spike_s": 2.5,
    }))  # fmt: skip
    done = drill("-c", str(config))
    lines = done.stdout.splitlines()
    assert done.returncode == 1, done.stdout + done.stderr
    provider = next(line for line in lines if "overflow path 'provider'" in line)
    assert provider.startswith("FAIL  overflow path 'provider' engaged: no request ended")
    assert "upstream errors: hosted" in provider
    assert any(line.startswith("PASS  overflow path 'queue' engaged") for line in lines)
    assert any(line.startswith("PASS  everything reserved was released") for line in lines)
    # no shared prefix asked for: the hit rate is a note, not a check
    assert any(line.startswith("note  backends' prefix-cache hit rate ") for line in lines)
    assert not any("prefix caches found" in line for line in lines)
    assert lines[-1].startswith("drill FAILED: ")
