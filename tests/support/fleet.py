"""A gateway in front of simulated backends on loopback, in threads of the test process."""

from __future__ import annotations

import contextlib
import secrets
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx

from gateway.app import create_app
from gateway.config import Settings, hash_key, parse_settings
from loadtest.sim.app import create_sim_app
from loadtest.sim.config import SimConfig
from tests.support.harness import ServerThread

ADMIN_TOKEN = "test-admin-token"


def tenant(name: str, key: str, **limits: Any) -> dict[str, Any]:
    return {"name": name, "key_sha256": hash_key(key), **limits}


@dataclass
class Fleet:
    gateway: ServerThread
    backends: dict[str, list[ServerThread]]
    settings: Settings
    keys: dict[str, str] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return self.gateway.url

    def client(self, tenant: str = "acme", **kwargs: Any) -> httpx.Client:
        return httpx.Client(
            base_url=self.url,
            headers={"authorization": f"Bearer {self.keys[tenant]}"},
            timeout=kwargs.pop("timeout", 30.0),
            **kwargs,
        )

    def metrics_text(self) -> str:
        return httpx.get(f"{self.url}/metrics", timeout=10).text

    def status(self) -> dict[str, Any]:
        return admin_status(self.url)


def admin_status(url: str, *, token: str = ADMIN_TOKEN, timeout: float = 10) -> dict[str, Any]:
    """A gateway's GET /admin/status."""
    response = httpx.get(
        f"{url}/admin/status", headers={"authorization": f"Bearer {token}"}, timeout=timeout
    )
    response.raise_for_status()
    data: dict[str, Any] = response.json()
    return data


@contextlib.contextmanager
def run_fleet(
    *,
    pools: dict[str, list[SimConfig]],
    pool_options: dict[str, dict[str, Any]] | None = None,
    tenants: dict[str, dict[str, Any]] | None = None,
    extra: dict[str, Any] | None = None,
    capacity: dict[str, int | str] | None = None,
    redis_url: str | None = None,
) -> Iterator[Fleet]:
    """Start simulated backends per pool, then a gateway in front of them.

    `capacity` maps a pool to its backends' configured capacity ("auto" reads their metrics).
    """
    keys = {name: "sk-" + secrets.token_hex(8) for name in (tenants or {"acme": {}})}
    started: list[ServerThread] = []
    try:
        backends: dict[str, list[ServerThread]] = {}
        for pool, sims in pools.items():
            backends[pool] = [ServerThread(create_sim_app(sim)).start() for sim in sims]
            started += backends[pool]
        config: dict[str, Any] = {
            "tenants": [
                tenant(name, keys[name], **opts) for name, opts in (tenants or {"acme": {}}).items()
            ],
            "pools": [
                {
                    "name": pool,
                    "backends": [
                        {
                            "url": s.url,
                            "served_model": sims[i].model,
                            "capacity": (capacity or {}).get(pool, "auto"),
                        }
                        for i, s in enumerate(backends[pool])
                    ],
                    **(pool_options or {}).get(pool, {}),
                }
                for pool, sims in pools.items()
            ],
            **(extra or {}),
        }
        # each fleet its own batch store, so that no batch outlives the test that made it
        config.setdefault("batch", {"dir": tempfile.mkdtemp(prefix="spillgate-batch-")})
        settings = parse_settings(config)
        env = {"SPILLGATE_ADMIN_TOKEN": ADMIN_TOKEN}
        app = create_app(settings, environ=env, redis_url=redis_url)
        gateway = ServerThread(app).start()
        started.append(gateway)
        yield Fleet(gateway=gateway, backends=backends, settings=settings, keys=keys)
    finally:
        for server in reversed(started):
            server.stop()


def until_ready(fleet: Fleet, *, within_s: float = 20.0) -> None:
    """Until the gateway's /readyz says every pool has a backend it has read (its listing,
    its capacity)."""
    deadline = time.monotonic() + within_s
    while httpx.get(f"{fleet.url}/readyz", timeout=2).status_code != 200:
        assert time.monotonic() < deadline, "the gateway never became ready"
        time.sleep(0.05)


def post_chat(fleet: Fleet, model: str, tenant: str = "acme", **body: Any) -> httpx.Response:
    """A one-message chat for `model` as `tenant`, its answer as it came (errors too)."""
    return httpx.post(
        f"{fleet.url}/v1/chat/completions",
        json={"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
        | body,
        headers={"authorization": f"Bearer {fleet.keys[tenant]}"},
        timeout=30,
    )


@asynccontextmanager
async def holding(
    fleet: Fleet, model: str, tenant: str = "acme", *, max_tokens: int = 3000
) -> AsyncIterator[None]:
    """A stream for `model` of `max_tokens`, held from its first event until the block ends."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "go on"}],
        "max_tokens": max_tokens,
        "stream": True,
    }
    headers = {"authorization": f"Bearer {fleet.keys[tenant]}"}
    async with (
        httpx.AsyncClient(base_url=fleet.url, headers=headers, timeout=30) as http,
        http.stream("POST", "/v1/chat/completions", json=body) as response,
    ):
        assert response.status_code == 200
        lines = response.aiter_lines()
        async for line in lines:
            if line.startswith("data:"):
                break
        yield
