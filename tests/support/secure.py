"""A gateway on loopback for the security tests: a backend that records every request it
receives, a decoy, a simulated backend and a simulated provider, with three tenants."""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gateway.app import create_app
from gateway.config import parse_settings
from loadtest.sim.app import create_sim_app
from loadtest.sim.config import SimConfig
from loadtest.sim.provider import ProviderConfig, create_provider_app
from loadtest.sim.wire import Kind, full_response
from tests.support.fleet import ADMIN_TOKEN, Fleet, tenant
from tests.support.harness import ServerThread
from tests.support.overflow import STATIC_RESERVATION
from tests.support.upstream import MODELS_ROUTE

PROVIDER_KEY_ENV = "HOSTED_API_KEY"
ROOM = 100_000  # tokens the recording backend holds
HOLD = 980  # with a short prompt, fills the big pool's backend of 1000 tokens (992 in blocks)


@dataclass
class Recorder:
    """A backend that writes down every request it receives and answers a fixed completion."""

    name: str
    seen: list[tuple[dict[str, str], dict[str, Any]]] = field(default_factory=list)

    def app(self) -> Starlette:
        async def complete(request: Request) -> Response:
            body = orjson.loads(await request.body())
            self.seen.append((dict(request.headers), body))
            answer = full_response(
                kind=Kind.CHAT,
                model=body.get("model", "?"),
                text=f"answered by {self.name}",
                finish_reason="stop",
                prompt_tokens=3,
                completion_tokens=4,
            )
            return Response(answer, media_type="application/json")

        async def health(request: Request) -> Response:
            return Response(b"ok")

        return Starlette(
            routes=[
                Route("/v1/chat/completions", complete, methods=["POST"]),
                Route("/health", health),
                MODELS_ROUTE,
            ]
        )


@dataclass
class SecureFleet:
    fleet: Fleet
    recorder: Recorder
    decoy: Recorder
    decoy_url: str
    hosted: ServerThread
    provider_key: str


@contextlib.contextmanager
def secure_fleet() -> Iterator[SecureFleet]:
    """A recording backend (pool `rec`), a decoy one, a simulated backend too small to
    hold much (pool `big`: cache, then a provider) and the provider; tenant `gamma` may
    use `rec` only."""
    keys = {name: f"sk-{name}-" + secrets.token_hex(12) for name in ("acme", "beta", "gamma")}
    provider_key = "sk-provider-" + secrets.token_hex(12)
    recorder, decoy = Recorder("recorder"), Recorder("decoy")
    started: list[ServerThread] = []
    try:
        rec = ServerThread(recorder.app()).start()
        dec = ServerThread(decoy.app()).start()
        big = ServerThread(create_sim_app(SimConfig(model="m", kv_tokens=4096, speed=5.0))).start()
        hosted = ServerThread(create_provider_app(ProviderConfig(api_key=provider_key))).start()
        started += [rec, dec, big, hosted]
        recording = {"url": rec.url, "served_model": "r", "capacity": ROOM}
        config = {
            "tenants": [
                tenant(name, key, pools=["rec"] if name == "gamma" else [])
                for name, key in keys.items()
            ],
            "pools": [
                {"name": "rec", "backends": [recording]},
                {"name": "big", "target_fill": 1.0, "cache": {"ttl_s": 60},
                 "overflow": ["cache", "provider", "reject"], "provider": "hosted",
                 "reservation": STATIC_RESERVATION,
                 "backends": [{"url": big.url, "served_model": "m", "capacity": 1000}]},
            ],
            "providers": [
                {"name": "hosted", "base_url": hosted.url + "/v1", "api_key_env": PROVIDER_KEY_ENV}
            ],
        }  # fmt: skip
        settings = parse_settings(config)
        env = {"SPILLGATE_ADMIN_TOKEN": ADMIN_TOKEN, PROVIDER_KEY_ENV: provider_key}
        gateway = ServerThread(create_app(settings, environ=env)).start()
        started.append(gateway)
        fleet = Fleet(gateway=gateway, backends={"big": [big]}, settings=settings, keys=keys)
        yield SecureFleet(
            fleet=fleet,
            recorder=recorder,
            decoy=decoy,
            decoy_url=dec.url,
            hosted=hosted,
            provider_key=provider_key,
        )
    finally:
        for server in reversed(started):
            server.stop()
