"""`spillgate demo` as a new user runs it: ready within 60 s, overflows, stops cleanly."""

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter

import httpx
import psutil
import pytest

from loadtest.procs import free_port

KEY = "sk-demo-e2e"
ADMIN = "demo-admin-e2e"


def _wait_ready(url: str, proc: subprocess.Popen[bytes], timeout: float) -> float:
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        assert proc.poll() is None, "spillgate demo exited early"
        try:
            if httpx.get(f"{url}/readyz", timeout=1).status_code == 200:
                return time.monotonic() - started
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    pytest.fail(f"spillgate demo was not ready after {timeout}s")


def _banner(proc: subprocess.Popen[bytes]) -> str:
    """The lines the demo printed before serving (it prints them before it is ready)."""
    assert proc.stdout is not None
    lines = []
    while not lines or not lines[-1].startswith("Press Ctrl-C"):
        lines.append(proc.stdout.readline().decode())
    return "".join(lines)


def _servers(banner: str) -> dict[str, str]:
    """Each server URL the banner names (without /v1), with what it says the server is."""
    servers = {}
    for line in banner.splitlines():
        what = re.search(r"  \((serving .+|the external provider)\)$", line)
        if what:
            for base in re.findall(r"http://127\.0\.0\.1:\d+", line):
                servers[base] = what[1]
    return servers


def _listening_ports(process: psutil.Process) -> set[int]:
    conns = process.net_connections(kind="tcp")
    return {c.laddr.port for c in conns if c.status == psutil.CONN_LISTEN}


def test_demo_serves_overflows_and_stops_cleanly() -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", "demo", "--port", str(port),
         "--api-key", KEY, "--admin-token", ADMIN, "--speed", "4"],
        stdout=subprocess.PIPE, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    try:
        _wait_ready(url, proc, timeout=60)
        children = psutil.Process(proc.pid).children(recursive=True)
        assert len(children) == 5  # four simulated backends and the provider
        headers = {"authorization": f"Bearer {KEY}"}
        models = httpx.get(f"{url}/v1/models", headers=headers).json()
        assert [m["id"] for m in models["data"]] == [
            "llama-3.1-70b",
            "llama-3.1-8b",
            "bge-small-en",
        ]
        embedded = httpx.post(
            f"{url}/v1/embeddings",
            headers=headers,
            json={"model": "bge-small-en", "input": ["Hello!", "Bonjour!"]},
        ).json()
        assert [len(d["embedding"]) for d in embedded["data"]] == [384, 384]
        responded = httpx.post(
            f"{url}/v1/responses",
            headers=headers,
            json={"model": "llama-3.1-70b", "input": "Hello!", "max_output_tokens": 8},
            timeout=30,
        ).json()
        assert responded["status"] == "completed" and responded["usage"]["output_tokens"] == 8
        banner = _banner(proc)
        assert KEY in banner and "curl" in banner
        assert "bge-small-en (1 backend, embeddings: POST /v1/embeddings)" in banner
        assert f"curl -sS {url}/v1/embeddings" in banner and f"{url}/v1/responses" in banner
        dashboard = re.search(r"dashboard: +(\S+)", banner)
        assert dashboard and dashboard[1] == f"{url}/dashboard?token={ADMIN}"
        assert httpx.get(dashboard[1]).status_code == 200
        # the admin endpoints take the token as a header, and the banner says how
        admin = httpx.get(f"{url}/admin/status", headers={"authorization": f"Bearer {ADMIN}"})
        assert f"'Authorization: Bearer {ADMIN}'" in banner and admin.status_code == 200
        # every simulated server the demo started is named, the backends with what they serve
        served = _servers(banner)
        ports = {int(base.rsplit(":", 1)[1]) for base in served}
        assert ports == {port for child in children for port in _listening_ports(child)}
        for base, what in served.items():
            if what.startswith("serving "):
                ids = [m["id"] for m in httpx.get(f"{base}/v1/models").json()["data"]]
                assert ids == [what.removeprefix("serving ")]
        assert list(served.values()).count("the external provider") == 1
        first = next(iter(served))
        assert f"spillgate measure --url {first} --model {served[first][8:]}" in banner

        async def spike() -> Counter[str]:
            body = {
                "model": "llama-3.1-70b",
                "messages": [{"role": "user", "content": "word " * 80}],
                "max_tokens": 256,
                "temperature": 0.7,
            }
            async with httpx.AsyncClient(base_url=url, headers=headers, timeout=60) as client:
                replies = await asyncio.gather(
                    *(client.post("/v1/chat/completions", json=body) for _ in range(40))
                )
            return Counter(r.headers["x-spillgate-outcome"] for r in replies)

        outcomes = asyncio.run(spike())
        assert outcomes["local"] >= 15  # about 20 concurrent requests fill the large pool
        assert sum(outcomes.values()) - outcomes["local"] > 0, outcomes  # the rest overflowed
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=20)
    said = proc.stdout.read().decode() if proc.stdout else ""
    assert said.strip() == "Spillgate demo stopped."
    assert all(not c.is_running() or c.status() == psutil.STATUS_ZOMBIE for c in children)
