"""What the overflow tests share: a fleet with an external provider, capacity holders, metrics.

`run_fleet` builds a gateway without provider keys in its environment; `provider_fleet`
adds a simulated provider whose key only the gateway's environment holds.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any, TypeVar

import httpx

from gateway.admission.fleet.metrics_text import samples, values
from gateway.app import create_app
from gateway.config import parse_settings
from loadtest.sim.app import create_sim_app
from loadtest.sim.config import SimConfig
from loadtest.sim.provider import ProviderConfig, create_provider_app
from tests.support.fleet import ADMIN_TOKEN, Fleet, tenant
from tests.support.harness import ServerThread

PROVIDER_KEY_ENV = "HOSTED_API_KEY"
# with a short prompt, fills a backend of 1000 tokens: 992 in blocks of 16, room for no other
HOLD_TOKENS = 980
# a holder holds all of its max_tokens from admission: the overflow tests' pools reserve the
# whole answer, as they did before reservations were learned (admission/fleet/output_lengths.py)
STATIC_RESERVATION = {"mode": "max_tokens"}
T = TypeVar("T")


def chat(content: str, *, model: str = "big", max_tokens: int = 20, **extra: Any) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        **extra,
    }


def sample(fleet: Fleet, name: str, **labels: str) -> float | None:
    """One sample of the gateway's /metrics, or None when absent."""
    found = values(samples(fleet.metrics_text()), name, **labels)
    return found[0] if found else None


def backend_requests(server: ServerThread) -> float:
    """Requests a simulated backend has seen: finished, aborted, running or waiting."""
    text = httpx.get(f"{server.url}/metrics", timeout=5).text
    names = {
        "sim_requests_finished_total",
        "sim_requests_aborted_total",
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
    }
    return sum(s.value for s in samples(text, names))


def eventually(check: Callable[[], bool], *, within_s: float = 5.0) -> None:
    deadline = time.monotonic() + within_s
    while not check():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def provider_stats(provider: ServerThread) -> dict[str, Any]:
    response = httpx.get(f"{provider.url}/sim/stats", timeout=5)
    response.raise_for_status()
    stats: dict[str, Any] = response.json()
    return stats


@contextlib.asynccontextmanager
async def holding(
    client: httpx.AsyncClient, model: str, *, tokens: int = HOLD_TOKENS
) -> AsyncIterator[httpx.Response]:
    """A long streamed answer that holds `tokens` of one backend of `model` until the block
    ends (by default all of a 1000-token backend)."""
    body = chat("hold", model=model, max_tokens=tokens, stream=True)
    request = client.build_request("POST", "/v1/chat/completions", json=body)
    response = await client.send(request, stream=True)
    try:
        assert response.status_code == 200, response.status_code
        assert response.headers["x-spillgate-outcome"] == "local"
        yield response
    finally:
        await response.aclose()  # the gateway sees the disconnect and releases


async def wait_for(check: Callable[[], bool], *, within_s: float = 5.0) -> None:
    deadline = time.monotonic() + within_s
    while not await asyncio.to_thread(check):
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


def pool(name: str, server: ServerThread, model: str, **options: Any) -> dict[str, Any]:
    backend = {"url": server.url, "served_model": model, "capacity": 1000}
    return {
        "name": name,
        "target_fill": 1.0,
        "backends": [backend],
        "reservation": STATIC_RESERVATION,
        **options,
    }


def spilling(*, key: str, backend: str, provider: str, **options: Any) -> dict[str, Any]:
    """The config of a gateway on Redis whose one pool, `big` (served model `m` at
    `backend`), holds nothing locally: every request is the provider `hosted`'s (at
    `provider`, with `options`), or refused."""
    return {
        "redis": {"timeout_ms": 2000},
        "tenants": [tenant("acme", key)],
        "pools": [
            {
                "name": "big",
                "backends": [{"url": backend, "served_model": "m", "capacity": 1}],
                "overflow": ["provider", "reject"],
                "provider": "hosted",
            }
        ],
        "providers": [{"name": "hosted", "base_url": provider + "/v1", **options}],
    }


@contextlib.contextmanager
def provider_fleet(
    *,
    provider: ProviderConfig,
    provider_options: dict[str, Any],
    pools: Callable[[dict[str, ServerThread]], list[dict[str, Any]]],
    tenants: dict[str, dict[str, Any]],
    sims: dict[str, SimConfig],
) -> Iterator[tuple[Fleet, ServerThread]]:
    """Simulated backends (`sims`), a simulated provider named `hosted`, and a gateway."""
    keys = {name: "sk-" + secrets.token_hex(8) for name in tenants}
    started: list[ServerThread] = []
    try:
        servers = {name: ServerThread(create_sim_app(sim)).start() for name, sim in sims.items()}
        started += servers.values()
        hosted = ServerThread(create_provider_app(provider)).start()
        started.append(hosted)
        config = {
            "tenants": [tenant(name, keys[name], **opts) for name, opts in tenants.items()],
            "pools": pools(servers),
            "providers": [
                {
                    "name": "hosted",
                    "base_url": hosted.url + "/v1",
                    "api_key_env": PROVIDER_KEY_ENV,
                    **provider_options,
                }
            ],
        }
        settings = parse_settings(config)
        env = {"SPILLGATE_ADMIN_TOKEN": ADMIN_TOKEN, PROVIDER_KEY_ENV: provider.api_key}
        gateway = ServerThread(create_app(settings, environ=env)).start()
        started.append(gateway)
        fleet = Fleet(
            gateway=gateway,
            backends={name: [s] for name, s in servers.items()},
            settings=settings,
            keys=keys,
        )
        yield fleet, hosted
    finally:
        for server in reversed(started):
            server.stop()


def async_client(fleet: Fleet, tenant_name: str, **kwargs: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        base_url=fleet.url,
        headers={"authorization": f"Bearer {fleet.keys[tenant_name]}"},
        timeout=kwargs.pop("timeout", 15.0),
        **kwargs,
    )


def queue_wait_s(response: httpx.Response) -> float:
    """The queue wait the gateway reports in `server-timing` (0 when it never queued)."""
    for phase in response.headers.get("server-timing", "").split(","):
        name, _, duration = phase.strip().partition(";dur=")
        if name == "queue":
            return float(duration) / 1000
    return 0.0


async def steady(send: Callable[[], Awaitable[T]], *, every_s: float, for_s: float) -> list[T]:
    """Call `send` every `every_s` seconds for `for_s` seconds, one call at a time: a call
    that takes longer delays the next one, so the sender never queues behind itself."""
    loop = asyncio.get_running_loop()
    start, results = loop.time(), []
    while loop.time() - start < for_s:
        results.append(await send())
        await asyncio.sleep(max(0.0, start + len(results) * every_s - loop.time()))
    return results


@contextlib.asynccontextmanager
async def flooding(
    send: Callable[[], Awaitable[httpx.Response]], *, in_flight: int, into: list[httpx.Response]
) -> AsyncIterator[None]:
    """Keep `in_flight` requests outstanding (closed loop) until the block ends; a refused
    client waits its Retry-After (at most 1 s) with jitter, as a well-behaved client does."""
    jitter = random.Random(in_flight)

    async def loop() -> None:
        while True:
            response = await send()
            into.append(response)
            if response.status_code in (429, 503):
                retry_after = min(1.0, float(response.headers.get("retry-after", 1)))
                await asyncio.sleep(retry_after * jitter.uniform(0.5, 1.0))

    tasks = [asyncio.create_task(loop()) for _ in range(in_flight)]
    try:
        yield
    finally:
        for task in tasks:
            task.cancel()  # the gateway sees each client leave
        await asyncio.gather(*tasks, return_exceptions=True)
