"""A provider whose answers report a negative or an absurd usage leaves its concurrency slot
free and its shared budget (in a real redis-server) owing no more than a minute of itself:
the next spill is served as soon as its claim refills, and the spend counts sane dollars.

The pool's one backend holds nothing, so every request spills to a provider of one
concurrency slot, which answers with whatever usage the test tells it.
"""

from __future__ import annotations

import contextlib
import secrets
import time
from collections.abc import Iterator
from typing import Any

import httpx
import redis

from gateway.admission.fleet.metrics_text import samples, values
from gateway.app import create_app
from gateway.config import parse_settings
from loadtest.procs import RedisProcess
from loadtest.sim.app import create_sim_app
from loadtest.sim.config import SimConfig
from tests.support.harness import ServerThread
from tests.support.overflow import spilling
from tests.support.upstream import FakeUpstream

KEY = "sk-acme-" + secrets.token_hex(8)
BUDGET = 60_000  # provider tokens a minute: a thousand a second
PRICES = {"prompt_price_per_m": 1.0, "completion_price_per_m": 3.0}
BUDGET_KEY = "spillgate:provider:ratelimit:{hosted}:tokens"


@contextlib.contextmanager
def spilling_gateway(redis_url: str, usage: dict[str, Any]) -> Iterator[str]:
    backend = ServerThread(create_sim_app(SimConfig(model="m", kv_tokens=4096)))
    provider = ServerThread(FakeUpstream(usage=usage).app)
    with backend, provider:
        settings = parse_settings(
            spilling(
                key=KEY,
                backend=backend.url,
                provider=provider.url,
                tokens_per_minute=BUDGET,
                max_concurrency=1,
                **PRICES,
            )
        )
        with ServerThread(create_app(settings, redis_url=redis_url)) as gateway:
            yield gateway.url


def outcome(client: httpx.Client) -> tuple[int, str]:
    # no output limit named: an answer may be as long as the model's context, which is
    # more than a minute of this budget (a usage checked at its source may say as much)
    body = {"model": "big", "messages": [{"role": "user", "content": "hi"}]}
    response = client.post("/v1/chat/completions", json=body)
    return response.status_code, response.headers["x-spillgate-outcome"]


SPILLED = (200, "provider")


def test_negative_and_huge_usage_leave_the_slot_free_and_the_budget_bounded(
    redis_proc: RedisProcess,
) -> None:
    usage: dict[str, Any] = {"prompt_tokens": 10, "completion_tokens": -500}
    store = redis.Redis.from_url(redis_proc.url, socket_timeout=5)
    with spilling_gateway(redis_proc.url, usage) as url, store:
        headers = {"authorization": f"Bearer {KEY}"}
        with httpx.Client(base_url=url, headers=headers, timeout=10) as client:
            assert outcome(client) == SPILLED
            usage["completion_tokens"] = 10**18
            assert outcome(client) == SPILLED  # the one slot came back
            # a minute of the budget at most: spent, not owed, and the key expires
            assert float(store.hget(BUDGET_KEY, "level")) >= -BUDGET
            assert 0 < store.pttl(BUDGET_KEY) <= 2 * 60_000 + 1_000
            usage["completion_tokens"] = 5
            # served again once the next claim (a few hundred tokens) has refilled
            deadline = time.monotonic() + 3
            while (answered := outcome(client)) != SPILLED and time.monotonic() < deadline:
                time.sleep(0.1)
            assert answered == SPILLED
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
    spend = "spillgate_provider_cost_dollars_total"
    (dollars,) = values(samples(metrics), spend, provider="hosted")
    # the huge answer counts 10 prompt tokens and a minute's 60,000 completion tokens; the
    # others a few hundred tokens at most (the negative one none, or what it was charged)
    huge = (10 * 1.0 + BUDGET * 3.0) / 1e6
    assert huge <= dollars <= huge + 0.002
