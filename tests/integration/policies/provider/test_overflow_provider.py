"""The provider path passes requests on when its budget is spent, the provider refuses with
429 and Retry-After, or it stalls past the first-token timeout: the breaker then keeps
further requests away from it.

The pool here is a single backend too small for any request, so every request overflows.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import httpx

from loadtest.sim.config import SimConfig
from loadtest.sim.provider import ProviderConfig
from tests.support.fleet import Fleet
from tests.support.harness import ServerThread
from tests.support.overflow import chat, provider_fleet, provider_stats, sample

KEY = "sk-hosted"


@contextlib.contextmanager
def spill_fleet(
    provider: ProviderConfig, **options: Any
) -> Iterator[tuple[Fleet, ServerThread, httpx.Client]]:
    def pools(servers: dict[str, ServerThread]) -> list[dict[str, Any]]:
        backend = {"url": servers["tiny"].url, "served_model": "m", "capacity": 10}
        return [
            {
                "name": "tiny",
                "backends": [backend],
                "overflow": ["provider", "reject"],
                "provider": "hosted",
            }
        ]

    with (
        provider_fleet(
            provider=provider,
            provider_options={
                "timeouts": {"connect": 1, "first_token": 0.5, "total": 5},
                **options,
            },
            pools=pools,
            tenants={"acme": {}},
            sims={"tiny": SimConfig(model="m", kv_tokens=1024, speed=5.0)},
        ) as (fleet, hosted),
        fleet.client("acme") as client,
    ):
        yield fleet, hosted, client


def ask(client: httpx.Client, *, stream: bool = False) -> tuple[int, str]:
    body = chat("hi", model="tiny", max_tokens=60, stream=stream)
    response = client.post("/v1/chat/completions", json=body)
    return response.status_code, response.headers["x-spillgate-outcome"]


SPILLED, PASSED_ON = (200, "provider"), (503, "rejected")


def test_a_spent_budget_passes_requests_on_without_asking_the_provider() -> None:
    with spill_fleet(ProviderConfig(api_key=KEY), tokens_per_minute=100) as (_, hosted, client):
        assert ask(client) == SPILLED  # ~66 tokens of the 100 a minute
        assert ask(client) == PASSED_ON
        assert provider_stats(hosted)["requests"] == 1


def test_a_429_opens_the_breaker_for_the_providers_retry_after() -> None:
    provider = ProviderConfig(api_key=KEY, requests_per_minute=1)
    with spill_fleet(provider, breaker_failures=5) as (fleet, hosted, client):
        assert ask(client) == SPILLED
        assert ask(client) == PASSED_ON  # the provider's own limit: 429 + Retry-After
        assert provider_stats(hosted)["by_status"] == {"200": 1, "429": 1}
        assert sample(fleet, "spillgate_provider_breaker_open", provider="hosted") == 1
        assert ask(client) == PASSED_ON  # one 429 was enough: the breaker stays open
        assert provider_stats(hosted)["requests"] == 2


def test_a_stalled_provider_times_out_and_trips_the_breaker() -> None:
    with spill_fleet(ProviderConfig(api_key=KEY), breaker_failures=1) as (fleet, hosted, client):
        stall = {"seconds": 1.5, "count": 1}
        httpx.post(f"{hosted.url}/sim/delay", json=stall, timeout=5).raise_for_status()
        assert ask(client, stream=True) == PASSED_ON  # no first token in 0.5 s: next policy
        assert ask(client, stream=True) == PASSED_ON
        assert provider_stats(hosted)["requests"] == 1
        errors = sample(fleet, "spillgate_upstream_errors_total", target="hosted")
        assert errors == 1
