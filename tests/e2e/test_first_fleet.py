"""docs/getting-started.md's config, deploy/examples/first-fleet.yaml, served as the page
serves it: `spillgate serve -c FILE` in a process of its own, against simulated vLLM servers
and a simulated provider, with the secrets in its environment. Its tenants are served, a
spike walks its chain (queue, provider, reject), and the page shows the file itself and
the `--check` line a `/v1` URL gets."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from loadtest.procs import free_port
from loadtest.sim.app import create_sim_app
from loadtest.sim.config import SimConfig
from loadtest.sim.provider import ProviderConfig, create_provider_app
from tests.support.harness import ServerThread
from tests.support.replica import spillgate

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "deploy" / "examples" / "first-fleet.yaml"
PAGE = ROOT / "docs" / "getting-started.md"
EXAMPLES = ROOT / "docs" / "examples.md"
# a small cache at a slow pace: a spike of a few requests fills both servers
KV_TOKENS = 1024
SECRETS = {
    "SPILLGATE_ADMIN_TOKEN": "admin-first-fleet",
    "WEB_API_KEY": "sk-web-first-fleet",
    "MOBILE_API_KEY": "sk-mobile-first-fleet",
    "BATCH_API_KEY": "sk-batch-first-fleet",
    "PROVIDER_API_KEY": "sk-provider-first-fleet",
}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, dict[str, Any]]]:
    """The file with its URLs pointed at simulators on free ports, served by `spillgate
    serve`: the gateway's URL and the config as served."""
    config = yaml.safe_load(CONFIG.read_text())
    (pool,) = config["pools"]
    sims = [
        SimConfig(model=b["served_model"], kv_tokens=KV_TOKENS, speed=0.5) for b in pool["backends"]
    ]
    provider = ProviderConfig(api_key=SECRETS["PROVIDER_API_KEY"], first_token_latency_s=0.05)
    servers = [ServerThread(create_sim_app(sim)).start() for sim in sims]
    servers.append(ServerThread(create_provider_app(provider)).start())
    try:
        for backend, server in zip(pool["backends"], servers, strict=False):
            backend["url"] = server.url
        config["providers"][0]["base_url"] = f"{servers[-1].url}/v1"
        config["server"]["port"] = port = free_port()
        path = tmp_path_factory.mktemp("first-fleet") / "gateway.yaml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        log = path.with_name("gateway.log")
        with log.open("wb") as out:
            gateway = subprocess.Popen(
                [*spillgate(), "serve", "-c", str(path)],
                env={**os.environ, **SECRETS},
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        url = f"http://127.0.0.1:{port}"
        try:
            _wait_ready(url, gateway, log)
            yield url, config
        finally:
            gateway.terminate()
            gateway.wait(timeout=20)
    finally:
        for server in servers:
            server.stop()


def _wait_ready(url: str, gateway: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        assert gateway.poll() is None, log.read_text()
        try:
            if httpx.get(f"{url}/readyz", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    pytest.fail(f"the gateway was not ready in 30 s:\n{log.read_text()}")


def _chat(max_tokens: int) -> dict[str, Any]:
    return {
        "model": "llama-3.1-8b",
        "messages": [{"role": "user", "content": "Hello!"}],
        "max_tokens": max_tokens,
    }


def test_every_tenant_of_the_file_is_served_on_the_servers(
    fleet: tuple[str, dict[str, Any]],
) -> None:
    url, config = fleet
    for tenant in config["tenants"]:
        key = SECRETS[tenant["key_env"]]
        answer = httpx.post(
            f"{url}/v1/chat/completions",
            json=_chat(8),
            headers={"authorization": f"Bearer {key}"},
            timeout=30,
        )
        assert answer.status_code == 200, (tenant["name"], answer.text)
        assert answer.headers["x-spillgate-outcome"] == "local"
    admin = {"authorization": f"Bearer {SECRETS['SPILLGATE_ADMIN_TOKEN']}"}
    status = httpx.get(f"{url}/admin/status", headers=admin, timeout=10).json()
    assert [len(p["backends"]) for p in status["pools"]] == [2]


def test_a_spike_walks_the_files_chain_to_the_provider(
    fleet: tuple[str, dict[str, Any]],
) -> None:
    url, _ = fleet

    async def spike() -> Counter[str]:
        headers = {"authorization": f"Bearer {SECRETS['WEB_API_KEY']}"}
        async with httpx.AsyncClient(base_url=url, headers=headers, timeout=60) as client:
            answers = await asyncio.gather(
                *(client.post("/v1/chat/completions", json=_chat(300)) for _ in range(12))
            )
        assert {a.status_code for a in answers} <= {200, 503}
        return Counter(a.headers["x-spillgate-outcome"] for a in answers)

    outcomes = asyncio.run(spike())
    # the servers hold a few; the rest wait in the queue, then spill to the provider
    assert outcomes["local"] >= 1 and outcomes["provider"] >= 1, outcomes
    assert set(outcomes) <= {"local", "queued", "provider", "rejected"}, outcomes


def test_the_page_shows_the_file_and_the_line_check_gives_a_v1_url(tmp_path: Path) -> None:
    page = PAGE.read_text()
    included = '--8<-- "deploy/examples/first-fleet.yaml"'
    assert included in page and included in EXAMPLES.read_text()
    # the servers the page starts are the ones the file names
    for url in re.findall(r"url: (http://127\.0\.0\.1:\d+)", CONFIG.read_text()):
        assert f"--port {url.rsplit(':', 1)[1]} " in page
    quoted = re.search(r"^gateway\.yaml:\d+: .*drop the `/v1`.*$", page, re.MULTILINE)
    assert quoted, "the page quotes what --check says of a /v1 URL"
    wrong = CONFIG.read_text().replace(
        "url: http://127.0.0.1:8001", "url: http://127.0.0.1:8001/v1"
    )
    (tmp_path / "gateway.yaml").write_text(wrong)
    told = subprocess.run(
        [*spillgate(), "serve", "-c", "gateway.yaml", "--check"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert told.returncode == 2
    assert told.stderr.strip() == quoted[0]
