"""An adapter that no backend serves is loaded on one that can, once, then routed to.

Two simulated vLLMs of model `m` that load adapters at run time (vLLM's
VLLM_ALLOW_RUNTIME_LORA_UPDATING=1): the first fails every load, as an engine does whose
storage lacks the adapter; the second loads. The pool declares `a5` and `a6` with the path
the engines load them from, and `a7` without one.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterator

import openai
import pytest

from loadtest.sim.config import LoraLoadFailure, LoraModule, SimConfig
from tests.support.fleet import (
    Fleet,
    admin_status,
    holding,
    post_chat,
    run_fleet,
    until_ready,
)
from tests.support.metrics import metric_sum
from tests.support.shared_prompt import SLOW_STEPS


def sim(fails: LoraLoadFailure | None = None) -> SimConfig:
    return SimConfig(
        model="m",
        enable_lora=True,
        allow_runtime_lora_updating=True,
        lora_load_s=0.2,
        fail_lora_loads=fails,
    )


ADAPTERS = [
    {"name": "a5", "path": "/adapters/a5"},
    {"name": "a6", "path": "/adapters/a6"},
    {"name": "a7"},
]


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    options = {"adapters": ADAPTERS, "overflow": ["reject"]}
    with run_fleet(
        pools={"m": [sim(LoraLoadFailure.NOT_FOUND), sim()]}, pool_options={"m": options}
    ) as f:
        until_ready(f)
        yield f


def loads(fleet: Fleet, adapter: str, **labels: str) -> float:
    return metric_sum(fleet.url, "spillgate_adapter_loads_total", adapter=adapter, **labels)


async def ask(fleet: Fleet, model: str, n: int) -> list[str]:
    async with openai.AsyncOpenAI(
        base_url=fleet.url + "/v1", api_key=fleet.keys["acme"], max_retries=0
    ) as client:
        answers = await asyncio.gather(
            *(
                client.chat.completions.create(
                    model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=5
                )
                for _ in range(n)
            )
        )
    return [a.model for a in answers]


def adapters_of(fleet: Fleet) -> dict[str, list[str]]:
    return {b["name"]: b["adapters"] for b in admin_status(fleet.url)["pools"][0]["backends"]}


def test_an_adapter_served_nowhere_is_loaded_once_where_it_can_be(fleet: Fleet) -> None:
    # eight requests at once: one load, on the second backend once the first refuses it
    assert asyncio.run(ask(fleet, "a5", 8)) == ["a5"] * 8
    assert loads(fleet, "a5", result="loaded") == 1
    assert loads(fleet, "a5", backend="m-0", result="failed") == 1
    assert adapters_of(fleet)["m-1"] == ["a5"]
    # later requests go where it is, with no load
    assert asyncio.run(ask(fleet, "a5", 4)) == ["a5"] * 4
    assert loads(fleet, "a5") == 2


def test_an_adapter_without_a_path_is_never_loaded(fleet: Fleet) -> None:
    response = post_chat(fleet, "a7")
    assert response.status_code == 503
    assert "adapter 'a7'" in response.json()["error"]["message"]
    assert loads(fleet, "a7") == 0


@pytest.fixture
def failing_fleet() -> Iterator[Fleet]:
    options = {"adapters": ADAPTERS, "overflow": ["reject"]}
    sims = [sim(LoraLoadFailure.NOT_FOUND), sim(LoraLoadFailure.ERROR)]
    with run_fleet(pools={"m": sims}, pool_options={"m": options}) as f:
        until_ready(f)
        yield f


def test_when_every_backend_fails_the_load_the_client_is_told_why(failing_fleet: Fleet) -> None:
    fleet = failing_fleet
    response = post_chat(fleet, "a6")
    error = response.json()["error"]
    assert response.status_code == 503
    assert error["code"] == "backend_unavailable"
    # each backend's own words: the first has no such adapter, the second failed (500)
    assert "could load the adapter 'a6'" in error["message"]
    assert "m-0: answered 404" in error["message"]
    assert "m-1: answered 500" in error["message"]
    assert loads(fleet, "a6", result="failed") == 2
    assert adapters_of(fleet) == {"m-0": [], "m-1": []}


def test_an_adapter_is_loaded_where_a_slot_is_free() -> None:
    """Each backend runs one adapter at a time: the first, less filled, runs a1 now, the
    second runs only the model itself. a5 is loaded on the second, where it can run."""
    steps = dataclasses.replace(SLOW_STEPS, bandwidth_bytes_per_s=250.0)
    base = dataclasses.replace(sim(), lora_modules=(LoraModule(name="a1", path="/a1"),))
    sims = [dataclasses.replace(base, step_cost=steps, kv_tokens=32_768) for _ in "01"]
    options = {
        "adapters": [{"name": "a1"}, *ADAPTERS],
        "overflow": ["reject"],
        "reservation": {"mode": "max_tokens"},
    }
    with run_fleet(pools={"m": sims}, pool_options={"m": options}) as fleet:
        until_ready(fleet)

        def active() -> dict[str, list[str]]:
            backends = admin_status(fleet.url)["pools"][0]["backends"]
            return {b["name"]: b["active_adapters"] for b in backends}

        async def scenario() -> list[str]:
            async with (
                holding(fleet, "a1", max_tokens=1000),
                holding(fleet, "m", max_tokens=3000),
            ):
                async with asyncio.timeout(10):
                    while active() != {"m-0": ["a1"], "m-1": []}:  # noqa: ASYNC110
                        await asyncio.sleep(0.05)
                return await ask(fleet, "a5", 1)

        assert asyncio.run(scenario()) == ["a5"]
        assert loads(fleet, "a5", backend="m-1", result="loaded") == 1
        assert loads(fleet, "a5", backend="m-0") == 0


def test_an_adapter_is_loaded_where_fewer_adapters_are_served() -> None:
    """Nothing runs anywhere yet, so both backends have a free slot now; the first serves
    a1 and a2 for its two slots, the second only a3. a5 is loaded on the second, where its
    requests will not have to wait for the others' to leave a slot."""
    first = dataclasses.replace(
        sim(),
        max_loras=2,
        lora_modules=(LoraModule(name="a1", path="/a1"), LoraModule(name="a2", path="/a2")),
    )
    second = dataclasses.replace(
        sim(), max_loras=2, lora_modules=(LoraModule(name="a3", path="/a3"),)
    )
    options = {
        "adapters": [{"name": "a1"}, {"name": "a2"}, {"name": "a3"}, *ADAPTERS],
        "overflow": ["reject"],
    }
    with run_fleet(pools={"m": [first, second]}, pool_options={"m": options}) as fleet:
        until_ready(fleet)
        assert asyncio.run(ask(fleet, "a5", 1)) == ["a5"]
        assert loads(fleet, "a5", backend="m-1", result="loaded") == 1
        assert loads(fleet, "a5", backend="m-0") == 0
