"""Past a pool's `max_loaded_adapters`, loading one more adapter on a backend unloads the
least recently used of those the gateway loaded there: never one the engine was started
with, never one with a request in flight there.

One simulated vLLM of model `m` that loads adapters at run time, started with `a1`; the pool
declares `a1` and three adapters with a path, which the gateway loads there as asked.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from loadtest.sim.config import LoraModule, SimConfig
from tests.support.fleet import Fleet, admin_status, holding, post_chat, run_fleet, until_ready
from tests.support.metrics import metric_sum
from tests.support.overflow import eventually
from tests.support.shared_prompt import SLOW_STEPS

SIM = SimConfig(
    model="m",
    enable_lora=True,
    allow_runtime_lora_updating=True,
    lora_load_s=0.05,
    lora_modules=(LoraModule(name="a1", path="/a1"),),
    max_loras=4,
    step_cost=dataclasses.replace(SLOW_STEPS, bandwidth_bytes_per_s=250.0),
    kv_tokens=32_768,
)


def start(budget: int) -> Iterator[Fleet]:
    options = {
        "adapters": [{"name": "a1"}, *({"name": a, "path": f"/adapters/{a}"} for a in "bcd")],
        "max_loaded_adapters": budget,
        "overflow": ["reject"],
    }
    with run_fleet(pools={"m": [SIM]}, pool_options={"m": options}) as fleet:
        until_ready(fleet)
        yield fleet


@pytest.fixture
def two() -> Iterator[Fleet]:
    yield from start(2)


@pytest.fixture
def one() -> Iterator[Fleet]:
    yield from start(1)


def unloads(fleet: Fleet, adapter: str) -> float:
    labels = {"adapter": adapter, "backend": "m-0", "result": "unloaded"}
    return metric_sum(fleet.url, "spillgate_adapter_unloads_total", **labels)


def known(fleet: Fleet) -> list[str]:
    """The adapters the gateway knows the backend serves."""
    backends = admin_status(fleet.url)["pools"][0]["backends"]
    return list(backends[0]["adapters"])


def engine_lists(fleet: Fleet) -> list[str]:
    """The adapters the engine itself lists."""
    url = fleet.backends["m"][0].url
    return sorted(m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"] if m["id"] != "m")


def m0_status(fleet: Fleet) -> dict[str, Any]:
    backends = admin_status(fleet.url)["pools"][0]["backends"]
    found: dict[str, Any] = next(b for b in backends if b["name"] == "m-0")
    return found


def ok(fleet: Fleet, model: str) -> None:
    response = post_chat(fleet, model)
    assert response.status_code == 200, response.text
    assert response.json()["model"] == model


def test_the_least_recently_used_adapter_the_gateway_loaded_is_unloaded(two: Fleet) -> None:
    fleet = two
    for model in ("b", "c", "b", "a1", "a1"):  # c is now the least recently used of b, c
        ok(fleet, model)
    assert engine_lists(fleet) == ["a1", "b", "c"]
    ok(fleet, "d")  # a third of its own: c goes; a1, started with the engine, stays
    assert unloads(fleet, "c") == 1
    assert unloads(fleet, "b") == unloads(fleet, "a1") == 0
    assert engine_lists(fleet) == ["a1", "b", "d"]
    assert known(fleet) == ["a1", "b", "d"]
    ok(fleet, "c")  # loaded again, in place of b now
    assert unloads(fleet, "b") == 1
    assert engine_lists(fleet) == ["a1", "c", "d"]


def test_an_adapter_with_a_request_in_flight_is_not_unloaded(one: Fleet) -> None:
    fleet = one
    ok(fleet, "b")

    async def while_b_runs() -> tuple[int, str]:
        async with holding(fleet, "b", max_tokens=1000):
            response = await asyncio.to_thread(post_chat, fleet, "c")
            return response.status_code, response.json()["error"]["message"]

    status, message = asyncio.run(while_b_runs())
    assert status == 503
    assert "m-0: every adapter the gateway loaded there has requests in flight" in message
    assert unloads(fleet, "b") == 0
    assert engine_lists(fleet) == ["a1", "b"]
    # b's request is over; once the engine's scrape no longer names b among the adapters
    # its steps run (requests another replica sent would keep it there), b goes
    eventually(lambda: "b" not in m0_status(fleet)["active_adapters"], within_s=5)
    ok(fleet, "c")
    assert unloads(fleet, "b") == 1
    assert engine_lists(fleet) == ["a1", "c"]
