"""What the replica tests share: `spillgate serve` processes, simulated backends, a spike.

Every gateway is a real `spillgate serve` process (a kill -9 must kill a whole replica);
the simulated backends run as servers in the test process and report, through their own
metrics, the most tokens ever present at once and every preemption.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

from loadtest.procs import free_port
from loadtest.sim.app import create_sim_app
from loadtest.sim.config import SimConfig
from tests.support.fleet import ADMIN_TOKEN, admin_status, tenant
from tests.support.harness import ServerThread
from tests.support.metrics import metric_sum, text_sum

KV_TOKENS = 1024
TARGET_FILL = 0.85
LEASE_TTL_S = 2.0
KEY = "sk-" + secrets.token_hex(8)


@dataclass
class GatewayProcess:
    proc: subprocess.Popen[bytes]
    port: int
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def kill(self) -> None:
        """kill -9: no shutdown, no releases; only the leases' TTL frees what it held.
        The whole process group goes, so no worker of `--workers N` outlives its parent."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.kill()

    def status(self) -> dict[str, Any]:
        return admin_status(self.url, timeout=5)

    def reserved(self) -> dict[str, tuple[int, int]]:
        """backend → (tokens in flight, sessions) as this gateway sees them."""
        return {
            b["name"]: (b["tokens_in_flight"], b["active_sessions"])
            for pool in self.status()["pools"]
            for b in pool["backends"]
        }

    def metric(self, name: str, **labels: str) -> float:
        return metric_sum(self.url, name, **labels)


def spillgate() -> list[str]:
    script = Path(sys.executable).with_name("spillgate")
    if script.exists():
        return [str(script)]
    return [sys.executable, "-m", "gateway.cli"]


def write_config(path: Path, backends: list[str], *, redis: bool) -> Path:
    config: dict[str, Any] = {
        "tenants": [tenant("acme", KEY, requests_per_minute=100_000, tokens_per_minute=10**8)],
        "pools": [
            {
                "name": "big",
                "backends": [
                    {"url": url, "served_model": "m", "capacity": KV_TOKENS} for url in backends
                ],
                "target_fill": TARGET_FILL,
                "overflow": ["queue", "reject"],
                "queue": {"max_depth": 128, "max_wait_s": 15.0},
                # each request holds its whole max_tokens from admission on, so that what
                # the replicas hold is known exactly: these tests are about sharing it
                "reservation": {"mode": "max_tokens"},
            }
        ],
    }
    if redis:
        config["redis"] = {"timeout_ms": 250}
        config["ratelimit"] = {"replicas": 3, "cooldown_s": 0.5}
        config["ledger"] = {"lease_ttl_s": LEASE_TTL_S, "refresh_s": 0.1}
    path.write_text(yaml.safe_dump(config))
    return path


def start_gateways(
    config: Path, count: int, *, redis_url: str | None, workers: int = 1, **env: str
) -> list[GatewayProcess]:
    gateways: list[GatewayProcess] = []
    environ = {**os.environ, "SPILLGATE_ADMIN_TOKEN": ADMIN_TOKEN, **env}
    environ.pop("SPILLGATE_REDIS_URL", None)
    for i in range(count):
        port = free_port()
        args = [*spillgate(), "serve", "-c", str(config), "--port", str(port)]
        args += ["--log-level", "warning", "--workers", str(workers)]
        if redis_url is not None:
            args += ["--redis", redis_url]
        log = config.with_name(f"gateway-{i}.log")
        with log.open("wb") as out:
            proc = subprocess.Popen(
                args, stdout=out, stderr=subprocess.STDOUT, env=environ, start_new_session=True
            )
        gateways.append(GatewayProcess(proc=proc, port=port, log=log))
    try:
        for gateway in gateways:
            wait_ready(gateway)
    except BaseException:
        for gateway in gateways:
            gateway.stop()
        raise
    return gateways


@contextlib.contextmanager
def gateways_running(
    config: Path, count: int, *, redis_url: str | None
) -> Iterator[list[GatewayProcess]]:
    """`start_gateways`, stopped again however the block ends."""
    gateways = start_gateways(config, count, redis_url=redis_url)
    try:
        yield gateways
    finally:
        for gateway in gateways:
            gateway.stop()


def wait_ready(gateway: GatewayProcess, *, within_s: float = 30.0) -> None:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if gateway.proc.poll() is not None:
            raise RuntimeError(f"gateway exited: {gateway.log.read_text()[-2000:]}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{gateway.url}/readyz", timeout=1).status_code == 200:
                return
        time.sleep(0.05)
    raise TimeoutError(f"gateway on {gateway.port} not ready: {gateway.log.read_text()[-2000:]}")


@contextlib.contextmanager
def fleet(
    tmp: Path, *, redis_url: str | None, count: int = 3
) -> Iterator[tuple[list[GatewayProcess], list[ServerThread]]]:
    """Two simulated backends of KV_TOKENS each behind `count` gateway processes."""
    sim = SimConfig(model="m", kv_tokens=KV_TOKENS, speed=2.0)
    sims = [ServerThread(create_sim_app(sim)).start() for _ in range(2)]
    try:
        urls = [s.url for s in sims]
        config = write_config(tmp / "gateway.yaml", urls, redis=redis_url is not None)
        gateways = start_gateways(config, count, redis_url=redis_url)
        try:
            yield gateways, sims
        finally:
            for gateway in gateways:
                gateway.stop()
    finally:
        for server in sims:
            server.stop()


def backend_stats(sim: ServerThread) -> dict[str, float]:
    text = httpx.get(f"{sim.url}/metrics", timeout=5).text
    names = (
        "sim_kv_capacity_tokens",
        "sim_peak_reserved_tokens",
        "sim_reserved_tokens",
        "vllm:num_preemptions_total",
        "vllm:num_requests_running",
    )
    return {name: text_sum(text, name) for name in names}


def chat(max_tokens: int) -> dict[str, Any]:
    return {
        "model": "big",
        "messages": [{"role": "user", "content": "Tell me a story"}],
        "max_tokens": max_tokens,
        "stream": True,
    }


@dataclass(frozen=True)
class Answer:
    status: int
    outcome: str
    complete: bool  # the stream ended with [DONE]


async def stream(client: httpx.AsyncClient, url: str, max_tokens: int) -> Answer:
    body = chat(max_tokens)
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        text = (await response.aread()).decode()
    return Answer(
        status=response.status_code,
        outcome=response.headers.get("x-spillgate-outcome", ""),
        complete=text.rstrip().endswith("data: [DONE]"),
    )


async def spike(urls: list[str], count: int, *, max_tokens: int) -> list[Answer]:
    """`count` concurrent streams, dealt round-robin across the gateways."""
    headers = {"authorization": f"Bearer {KEY}"}
    async with httpx.AsyncClient(headers=headers, timeout=30) as client:
        return await asyncio.gather(
            *(stream(client, urls[i % len(urls)], max_tokens) for i in range(count))
        )


def until(check: Any, *, within_s: float, what: str) -> float:
    """Seconds until `check()` is true; fails after `within_s`."""
    started = time.monotonic()
    while not check():
        assert time.monotonic() - started < within_s, f"{what}: not within {within_s}s"
        time.sleep(0.02)
    return time.monotonic() - started
