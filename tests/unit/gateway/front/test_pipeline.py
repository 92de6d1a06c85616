"""The completions pipeline as an ASGI app, on a real router, ledger and local token
buckets, forwarding to fake upstreams on loopback: what the client gets, and that every
ending gives the reservation back and settles the tenant's bucket."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

import gateway.front
from gateway.admission.fleet.backends import build_pools
from gateway.admission.ledger.reservations import LocalLedger
from gateway.admission.routing.route import Route
from gateway.admission.routing.router import Router
from gateway.clock import ManualClock
from gateway.config import BackendSettings, PoolSettings, Settings, TenantSettings
from gateway.front.auth import Authenticator
from gateway.front.pipeline import EndpointRules, Pipeline, PipelineDeps
from gateway.metrics import GatewayMetrics
from gateway.ratelimit.local import LocalRateLimiter
from gateway.request import Endpoint
from gateway.slo import Latencies
from gateway.upstream.forward import Forwarder
from gateway.upstream.pool import UpstreamPool
from tests.support.upstream import (
    ANSWER,
    COMPLETION_TOKENS,
    PROMPT_TOKENS,
    Client,
    FakeUpstream,
    serving,
)
from tests.support.upstream import run as serve

TOKENS_PER_MINUTE = 10_000
CAPACITY = 1000
KEY = "sk-acme"
CHAT = {"model": "big", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}


@pytest.fixture(scope="module")
def fakes() -> Iterator[dict[str, tuple[FakeUpstream, str]]]:
    made = {"good": FakeUpstream(), "bad": FakeUpstream(status=503)}
    with serving(**made) as urls:
        yield {name: (made[name], urls[name]) for name in made}


class Gateway:
    """One pipeline over a pool `big` of one backend at `url`, its overflow chain empty."""

    def __init__(self, url: str) -> None:
        self.clock = ManualClock()
        settings = Settings(
            tenants=[
                TenantSettings(name="acme", key_env="ACME_KEY", tokens_per_minute=TOKENS_PER_MINUTE)
            ],
            pools=[
                PoolSettings(
                    name="big",
                    backends=[BackendSettings(url=url, capacity=CAPACITY, block_size=1)],
                    target_fill=1.0,
                    max_model_len=4096,
                    overflow=[],
                )
            ],
        )
        self.auth = Authenticator(settings, {"ACME_KEY": KEY})
        self.limits = self.auth.by_name["acme"].limits
        self.router = Router(
            build_pools(settings.pools, clock=self.clock), ledger=LocalLedger(), clock=self.clock
        )
        self.limiter = LocalRateLimiter(self.clock)
        self.metrics = GatewayMetrics()
        self.upstream = UpstreamPool(max_connections=4)
        deps = PipelineDeps(
            auth=self.auth,
            limiter=self.limiter,
            router=self.router,
            chains={"big": []},
            forwarder=Forwarder(self.upstream, clock=self.clock),
            metrics=self.metrics,
            clock=self.clock,
            latencies=Latencies(self.clock),
            max_body_bytes=1 << 20,
        )
        self.endpoint = Pipeline(EndpointRules(endpoint=Endpoint.CHAT), deps)

    async def post(self, body: dict[str, Any], *, key: str = KEY) -> Client:
        client = Client()
        scope = {
            "type": "http",
            "method": "POST",
            "path": "/v1/chat/completions",
            "headers": [
                (b"authorization", f"Bearer {key}".encode()),
                (b"content-type", b"application/json"),
            ],
        }
        await self.endpoint(scope, _receive(orjson.dumps(body)), client.send)
        return client

    async def tokens_left(self) -> int:
        """The tenant's token bucket now, read by taking one token."""
        return (await self.limiter.acquire(self.limits, 1)).remaining_tokens + 1

    def in_flight(self) -> int:
        return self.router.ledger.tokens_in_flight("big-0")

    def requests(self, outcome: str) -> float | None:
        self.metrics.tally.flush()  # the tally counts in memory until a scrape
        return self.metrics.registry.get_sample_value(
            "spillgate_requests_total", {"pool": "big", "tenant": "acme", "outcome": outcome}
        )


def _receive(body: bytes) -> Any:
    """A client that sends `body` and then stays until the response has ended."""
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    return receive


def run(url: str, scenario: Callable[[Gateway], Awaitable[None]]) -> None:
    serve(lambda: Gateway(url), scenario)


def test_a_completion_is_served_locally_and_its_bucket_settled_by_usage(fakes) -> None:
    fake, url = fakes["good"]

    async def scenario(g: Gateway) -> None:
        client = await g.post(CHAT)
        assert client.status == 200
        assert client.headers["x-spillgate-outcome"] == "local"
        assert client.headers["x-ratelimit-limit-tokens"] == str(TOKENS_PER_MINUTE)
        answer = orjson.loads(client.body)
        assert answer["model"] == "big"
        assert answer["choices"][0]["message"]["content"] == ANSWER
        assert fake.bodies[-1]["model"] == "big" and fake.bodies[-1]["max_tokens"] == 8
        assert g.in_flight() == 0
        assert await g.tokens_left() == TOKENS_PER_MINUTE - PROMPT_TOKENS - COMPLETION_TOKENS
        assert g.requests("local") == 1.0

    run(url, scenario)


def test_a_wrong_key_is_refused_before_anything_is_reserved_or_sent(fakes) -> None:
    fake, url = fakes["good"]

    async def scenario(g: Gateway) -> None:
        before = len(fake.bodies)
        client = await g.post(CHAT, key="sk-wrong")
        assert client.status == 401
        assert orjson.loads(client.body)["error"]["message"] == "Incorrect API key provided."
        assert len(fake.bodies) == before
        assert await g.tokens_left() == TOKENS_PER_MINUTE

    run(url, scenario)


def test_a_full_pool_with_no_overflow_is_rejected_and_the_bucket_refunded(fakes) -> None:
    fake, url = fakes["good"]

    async def scenario(g: Gateway) -> None:
        held = await g.router.reserve(Route("big", CAPACITY))
        assert held is not None
        before = len(fake.bodies)
        client = await g.post(CHAT)
        assert client.status == 503
        assert client.headers["x-spillgate-outcome"] == "rejected"
        assert int(client.headers["retry-after"]) >= 1
        assert orjson.loads(client.body)["error"]["message"] == "Pool 'big' is at capacity."
        assert len(fake.bodies) == before
        assert g.in_flight() == CAPACITY  # only what the test holds
        assert await g.tokens_left() == TOKENS_PER_MINUTE
        assert g.requests("rejected") == 1.0
        await g.router.release(held)

    run(url, scenario)


def test_an_upstream_failure_is_a_502_that_gives_everything_back(fakes) -> None:
    fake, url = fakes["bad"]

    async def scenario(g: Gateway) -> None:
        before = len(fake.bodies)
        client = await g.post(CHAT)
        assert client.status == 502
        assert client.headers["x-spillgate-outcome"] == "error"
        assert client.headers["retry-after"] == "1"
        assert len(fake.bodies) == before + 1  # one backend: no other to retry on
        assert g.in_flight() == 0
        assert await g.tokens_left() == TOKENS_PER_MINUTE
        assert g.requests("error") == 1.0

    run(url, scenario)


STAGES = ("auth", "prepare", "parse", "throttle", "admit", "ladder", "exchange", "settle")


def stage_calls(into: set[str]) -> tuple[list[tuple[str, str]], Callable[..., None]]:
    """A profiler that notes each call from one file of gateway/front/ into another, as
    (caller, callee) file stems, for the callers in `into`."""
    seen: list[tuple[str, str]] = []
    front = str(Path(gateway.front.__file__).parent)

    # the frames entered already, kept alive so that no new frame takes one's id: a
    # coroutine's resume is no new entry
    entered: dict[int, Any] = {}

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event != "call" or frame.f_back is None:
            return
        if id(frame) in entered:
            return
        entered[id(frame)] = frame
        callee, caller = frame.f_code.co_filename, frame.f_back.f_code.co_filename
        if callee == caller or not callee.startswith(front) or not caller.startswith(front):
            return
        pair = (Path(caller).stem, Path(callee).stem)
        if pair[0] in into and pair[1] in STAGES:
            seen.append(pair)

    return seen, profile


def test_a_completion_enters_each_stage_once_in_the_order_of_the_pipeline(fakes) -> None:
    _, url = fakes["good"]

    async def scenario(g: Gateway) -> None:
        seen, profile = stage_calls({"pipeline", "ladder"})
        sys.setprofile(profile)
        try:
            client = await g.post(CHAT)
        finally:
            sys.setprofile(None)
        assert client.status == 200
        # the pipeline builds the request's exchange (its context) before the stages run
        from_pipeline = [callee for caller, callee in seen if caller == "pipeline"]
        assert from_pipeline == [
            "auth",
            "prepare",
            "exchange",  # the request's exchange, its context, built before the stages use it
            "throttle",
            "admit",
            "ladder",
            "settle",
        ]
        assert [callee for caller, callee in seen if caller == "ladder"] == ["exchange"]

    run(url, scenario)
