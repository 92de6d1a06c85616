"""A hot adapter is loaded on one more backend when those serving it are full; a cold one is
loaded nowhere else.

Two simulated vLLMs of model `m` that load adapters at run time, each holding 4096 tokens
(configured, so that only the ledger decides room): the first serves `a1` from start-up, the
second serves nothing. A stream for `a1` of 3500 output tokens fills the first: a second
request for `a1` finds no room there, while the second backend has room.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from loadtest.sim.config import LoraModule, SimConfig
from tests.support.fleet import Fleet, admin_status, holding, run_fleet, until_ready
from tests.support.metrics import metric_sum
from tests.support.shared_prompt import SLOW_STEPS

STEPS = dataclasses.replace(SLOW_STEPS, bandwidth_bytes_per_s=250.0)  # a held stream lasts


def sim(*adapters: str) -> SimConfig:
    return SimConfig(
        model="m",
        enable_lora=True,
        allow_runtime_lora_updating=True,
        lora_load_s=0.2,
        lora_modules=tuple(LoraModule(name=a, path=f"/{a}") for a in adapters),
        step_cost=STEPS,
        kv_tokens=32_768,
    )


def options(**adapter: Any) -> dict[str, Any]:
    return {
        "adapters": [{"name": "a1", "path": "/adapters/a1", **adapter}],
        "overflow": ["queue", "reject"],
        "queue": {"max_wait_s": 3},
        "reservation": {"mode": "max_tokens"},
    }


def start(**adapter: Any) -> contextlib.AbstractContextManager[Fleet]:
    return run_fleet(
        pools={"m": [sim("a1"), sim()]},
        pool_options={"m": options(**adapter)},
        capacity={"m": 4096},
    )


@pytest.fixture
def fleet() -> Iterator[Fleet]:
    with start() as f:
        until_ready(f)
        yield f


def loads(fleet: Fleet, **labels: str) -> float:
    return metric_sum(fleet.url, "spillgate_adapter_loads_total", adapter="a1", **labels)


def serving(fleet: Fleet) -> list[str]:
    backends = admin_status(fleet.url)["pools"][0]["backends"]
    return [b["name"] for b in backends if "a1" in b["adapters"]]


async def ask(fleet: Fleet, *, max_tokens: int) -> httpx.Response:
    body = {
        "model": "a1",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": max_tokens,
    }
    headers = {"authorization": f"Bearer {fleet.keys['acme']}"}
    async with httpx.AsyncClient(base_url=fleet.url, headers=headers, timeout=30) as http:
        return await http.post("/v1/chat/completions", json=body)


def test_a_full_adapter_is_loaded_on_a_backend_with_room_and_its_waiter_goes_there(
    fleet: Fleet,
) -> None:
    async def scenario() -> httpx.Response:
        async with holding(fleet, "a1", max_tokens=3500):  # m-0 is full for a1 now
            return await ask(fleet, max_tokens=1000)

    response = asyncio.run(scenario())
    assert response.status_code == 200
    assert response.headers["x-spillgate-outcome"] == "queued"
    assert response.json()["model"] == "a1"
    assert loads(fleet, backend="m-1", result="loaded") == 1
    assert loads(fleet) == 1
    assert serving(fleet) == ["m-0", "m-1"]


def test_a_cold_adapter_with_room_where_it_is_is_loaded_nowhere_else(fleet: Fleet) -> None:
    async def scenario() -> list[httpx.Response]:
        async with holding(fleet, "a1", max_tokens=1000):  # m-0 has room for one more
            return await asyncio.gather(*(ask(fleet, max_tokens=1000) for _ in range(2)))

    answers = asyncio.run(scenario())
    assert [a.headers["x-spillgate-outcome"] for a in answers] == ["local", "local"]
    assert loads(fleet) == 0
    assert serving(fleet) == ["m-0"]


def test_an_adapter_is_spread_to_no_more_than_its_max_backends() -> None:
    with start(max_backends=1) as fleet:
        until_ready(fleet)

        async def scenario() -> httpx.Response:
            async with holding(fleet, "a1", max_tokens=3500):
                return await ask(fleet, max_tokens=1000)

        response = asyncio.run(scenario())
        # the one backend it may have is full until the held stream ends: it is refused
        assert response.status_code == 503
        assert response.headers["x-spillgate-outcome"] == "rejected"
        assert loads(fleet) == 0
        assert serving(fleet) == ["m-0"]
