"""`spillgate demo` as a new user runs it: ready within 60 s, overflows, stops cleanly."""

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections import Counter

import httpx
import psutil
import pytest

from loadtest.harness import free_port

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
        assert len(children) == 4  # three simulated backends and the provider
        headers = {"authorization": f"Bearer {KEY}"}
        models = httpx.get(f"{url}/v1/models", headers=headers).json()
        assert [m["id"] for m in models["data"]] == ["llama-3.1-70b", "llama-3.1-8b"]

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
    banner = proc.stdout.read().decode() if proc.stdout else ""
    assert KEY in banner and f"{url}" in banner and "curl" in banner
    assert all(not c.is_running() or c.status() == psutil.STATUS_ZOMBIE for c in children)
