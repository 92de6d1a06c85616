"""A traced gateway on loopback for the tracing tests: simulated backends and a simulated
provider, each behind a recorder that keeps the headers of every POST it receives (so the
`traceparent` the gateway sends on can be matched with its client span), and an
in-memory span exporter handed to create_app."""

from __future__ import annotations

import contextlib
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import openai
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.app import create_app
from gateway.config import parse_settings
from gateway.front.parse import parse_request
from gateway.request import Endpoint
from loadtest.sim.app import create_sim_app
from loadtest.sim.config import SimConfig
from loadtest.sim.provider import ProviderConfig, create_provider_app
from tests.support.fleet import ADMIN_TOKEN, tenant
from tests.support.harness import ServerThread

PROVIDER_KEY = "sk-hosted"


class Recorder:
    """Passes every request to `app`, keeping the headers of each POST."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.posts: list[dict[str, str]] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            self.posts.append({k.decode(): v.decode() for k, v in scope["headers"]})
        await self.app(scope, receive, send)


async def failing(scope: Scope, receive: Receive, send: Send) -> None:
    """A backend that is up (its /health answers) but answers every request with 503."""
    if scope["type"] == "lifespan":
        await receive()
        await send({"type": "lifespan.startup.complete"})
        await receive()
        await send({"type": "lifespan.shutdown.complete"})
        return
    if scope["method"] == "POST":
        while (await receive()).get("more_body"):
            pass
        status = 503
    else:  # a listing of nothing, no metrics: the probes learn nothing
        status = 200
    await send({"type": "http.response.start", "status": status, "headers": []})
    await send({"type": "http.response.body", "body": b"{}"})


@dataclass
class Traced:
    gateway: ServerThread
    key: str
    exporter: InMemorySpanExporter
    recorders: dict[str, Recorder] = field(default_factory=dict)
    ports: dict[str, int] = field(default_factory=dict)

    def client(self, **kwargs: Any) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"{self.gateway.url}/v1", api_key=self.key, max_retries=0, timeout=20, **kwargs
        )

    def spans(self, kind: SpanKind | None = None) -> list[ReadableSpan]:
        """The finished spans, once the server span has ended: an error answer reaches the
        client just before its request's span ends."""
        deadline = time.monotonic() + 5
        while not any(s.kind is SpanKind.SERVER for s in self.exporter.get_finished_spans()):
            assert time.monotonic() < deadline, "no server span"
            time.sleep(0.01)
        spans = self.exporter.get_finished_spans()
        return [s for s in spans if kind is None or s.kind is kind]


def _backend(url: str, model: str, **options: Any) -> dict[str, Any]:
    return {"url": url, "served_model": model, "capacity": 1000, **options}


@contextlib.contextmanager
def traced_fleet(*, enabled: bool) -> Iterator[Traced]:
    """Pools `chat` and `stream` (one backend each), `flaky` (a failing backend listed
    first, then a good one), `dead` (the failing one alone), `queued` (one backend, then
    the queue), `tiny` (too small for any request: it spills through queue and provider),
    and `split` (a prefill backend and a decode backend)."""
    key = "sk-" + secrets.token_hex(8)
    started: list[ServerThread] = []
    try:
        recorders = {
            name: Recorder(create_sim_app(SimConfig(model=f"{name}-served", kv_tokens=4096)))
            for name in ("chat", "stream", "flaky", "queued")
        }
        for name in ("prefill", "decode"):
            recorders[name] = Recorder(
                create_sim_app(SimConfig(model="split-served", kv_tokens=4096))
            )
        recorders["embed"] = Recorder(
            create_sim_app(SimConfig(model="embed-served", kv_tokens=4096, embedding_dim=8))
        )
        recorders["failing"] = Recorder(failing)
        recorders["hosted"] = Recorder(create_provider_app(ProviderConfig(api_key=PROVIDER_KEY)))
        servers = {name: ServerThread(app).start() for name, app in recorders.items()}
        started += servers.values()
        tiny = ServerThread(create_sim_app(SimConfig(model="tiny", kv_tokens=1024))).start()
        started.append(tiny)
        url = {name: s.url for name, s in servers.items()}
        config = {
            "tenants": [tenant("acme", key)],
            "pools": [
                {"name": "chat", "backends": [_backend(url["chat"], "chat-served")]},
                {"name": "stream", "backends": [_backend(url["stream"], "stream-served")]},
                {
                    "name": "embed",
                    "kind": "embedding",
                    "backends": [_backend(url["embed"], "embed-served")],
                },
                {
                    "name": "flaky",
                    "backends": [
                        _backend(url["failing"], "flaky-served", name="bad"),
                        _backend(url["flaky"], "flaky-served", name="good"),
                    ],
                },
                {"name": "dead", "backends": [_backend(url["failing"], "dead", name="dead")]},
                {
                    "name": "split",
                    "backends": [
                        _backend(url["prefill"], "split-served", name="prefill", role="prefill"),
                        _backend(url["decode"], "split-served", name="decode", role="decode"),
                    ],
                    "prefill": {"kv_transfer": "shared", "min_prompt_tokens": 16},
                },
                {
                    "name": "queued",
                    "backends": [_backend(url["queued"], "queued-served")],
                    "overflow": ["queue", "reject"],
                    "queue": {"max_wait_s": 15},
                    # the holder holds all of its max_tokens: nothing else fits beside it
                    "reservation": {"mode": "max_tokens"},
                },
                {
                    "name": "tiny",
                    "backends": [_backend(tiny.url, "tiny", capacity=10)],
                    "overflow": ["queue", "provider", "reject"],
                    "provider": "hosted",
                },
            ],
            "providers": [
                {
                    "name": "hosted",
                    "base_url": url["hosted"] + "/v1",
                    "api_key_env": "HOSTED_KEY",
                    "models": {"tiny": "hosted-model"},
                }
            ],
            "tracing": {"enabled": enabled, "service_name": "gateway-under-test"},
        }
        exporter = InMemorySpanExporter()
        env = {"SPILLGATE_ADMIN_TOKEN": ADMIN_TOKEN, "HOSTED_KEY": PROVIDER_KEY}
        app = create_app(parse_settings(config), environ=env, span_exporter=exporter)
        gateway = ServerThread(app).start()
        started.append(gateway)
        ports = {name: s.port for name, s in servers.items()}
        yield Traced(gateway=gateway, key=key, exporter=exporter, recorders=recorders, ports=ports)
    finally:
        for server in reversed(started):
            server.stop()


def traceparent(span: ReadableSpan) -> str:
    assert span.context is not None
    c = span.context
    return f"00-{c.trace_id:032x}-{c.span_id:016x}-{c.trace_flags:02x}"


def one(spans: list[ReadableSpan]) -> ReadableSpan:
    assert len(spans) == 1, [s.name for s in spans]
    return spans[0]


def reserved_tokens(body: dict[str, Any]) -> int:
    """What the gateway reserves for a pool's first request (its estimator still untrained)."""
    request = parse_request(
        body,
        endpoint=Endpoint.CHAT,
        tenant="acme",
        pool=body["model"],
        priority="standard",
        default_max_tokens=256,
        max_model_len=4096,
        chars_per_token=4.0,
    )
    return request.charge_tokens
