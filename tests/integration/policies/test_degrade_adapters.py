"""`degrade` sends a request for an adapter to the smaller pool only where the adapter names
the smaller pool's adapter to ask for in its place (`adapters[].degrade_to`); a request for
an adapter without one goes on to the next step.

Pool `m` (one simulated vLLM of 4096 tokens serving `a1` and `a2`) degrades to pool `s`
(one serving `s1`); `a1` maps to `s1`, `a2` maps to nothing. A stream of 3500 output tokens
for `m` itself fills `m`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Iterator

import httpx
import pytest

from loadtest.sim.config import LoraModule, SimConfig
from tests.support.fleet import Fleet, holding, post_chat, run_fleet, until_ready
from tests.support.metrics import metric_sum
from tests.support.shared_prompt import SLOW_STEPS


def sim(model: str, *adapters: str) -> SimConfig:
    return SimConfig(
        model=model,
        enable_lora=True,
        lora_modules=tuple(LoraModule(name=a, path=f"/{a}") for a in adapters),
        max_loras=2,
        step_cost=dataclasses.replace(SLOW_STEPS, bandwidth_bytes_per_s=250.0),
        kv_tokens=32_768,
    )


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    big = {
        "adapters": [{"name": "a1", "degrade_to": "s1"}, {"name": "a2"}],
        "overflow": ["degrade", "reject"],
        "degrade_to": "s",
        "reservation": {"mode": "max_tokens"},
    }
    small = {"adapters": [{"name": "s1"}], "reservation": {"mode": "max_tokens"}}
    with run_fleet(
        pools={"m": [sim("m", "a1", "a2")], "s": [sim("s", "s1")]},
        pool_options={"m": big, "s": small},
        capacity={"m": 4096, "s": 4096},
    ) as f:
        until_ready(f)
        yield f


def while_full(fleet: Fleet, model: str) -> httpx.Response:
    """`model`'s answer while a stream fills `m`: once the last test's stream left it (else
    that stream, degraded itself, would fill nothing)."""
    deadline = time.monotonic() + 10
    while metric_sum(fleet.url, "spillgate_inflight_tokens", backend="m-0") > 0:
        assert time.monotonic() < deadline, "m-0 still holds the last test's stream"
        time.sleep(0.05)

    async def scenario() -> httpx.Response:
        async with holding(fleet, "m", max_tokens=3500):
            return await asyncio.to_thread(post_chat, fleet, model, max_tokens=1000)

    return asyncio.run(scenario())


def test_an_adapter_with_a_stand_in_is_degraded_to_it(fleet: Fleet) -> None:
    response = while_full(fleet, "a1")
    assert response.status_code == 200, response.text
    assert response.headers["x-spillgate-outcome"] == "degraded"
    assert response.json()["model"] == "s1"  # the answer names the adapter that answered
    served = metric_sum(fleet.url, "spillgate_adapter_requests_total", adapter="a1")
    assert served == 1


def test_an_adapter_without_one_goes_to_the_next_step(fleet: Fleet) -> None:
    response = while_full(fleet, "a2")
    assert response.status_code == 503
    assert response.headers["x-spillgate-outcome"] == "rejected"
    # with room, it is served where it is
    assert post_chat(fleet, "a2").headers["x-spillgate-outcome"] == "local"
