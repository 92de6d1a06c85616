"""A request for a LoRA adapter goes only to a backend that serves it.

Two simulated vLLMs behind one pool `m`: the first serves adapters `a1` and `a2`, the
second `a3`; the pool declares those three and `a4`, which nobody serves, and lets only
tenant `acme` use `a2`. Which backend answered is read off the gateway's own count of the
tokens each backend served.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterator
from contextlib import AsyncExitStack
from typing import Any

import openai
import pytest

from loadtest.sim.config import LoraModule, SimConfig
from loadtest.sim.provider import ProviderConfig
from tests.support.fleet import Fleet, admin_status, holding, post_chat, run_fleet, until_ready
from tests.support.harness import ServerThread
from tests.support.metrics import metric_sum
from tests.support.overflow import eventually, provider_fleet
from tests.support.shared_prompt import SLOW_STEPS


def sim(*adapters: str, kv_tokens: int = 32_768, max_loras: int = 2) -> SimConfig:
    modules = tuple(LoraModule(name=a, path=f"/adapters/{a}") for a in adapters)
    return SimConfig(
        model="m",
        kv_tokens=kv_tokens,
        enable_lora=True,
        lora_modules=modules,
        max_loras=max_loras,
    )


PROVIDER_KEY = "sk-provider-only-the-gateway-knows"
ADAPTERS = [{"name": "a1"}, {"name": "a2", "tenants": ["acme"]}, {"name": "a3"}, {"name": "a4"}]


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    options = {"adapters": ADAPTERS, "overflow": ["reject"]}
    with run_fleet(
        pools={"m": [sim("a1", "a2"), sim("a3")]},
        pool_options={"m": options},
        tenants={"acme": {}, "other": {"pools": ["m"]}},
    ) as f:
        until_ready(f)  # both backends' listings read: their adapters
        yield f


def client(fleet: Fleet, tenant: str = "acme") -> openai.OpenAI:
    return openai.OpenAI(base_url=fleet.url + "/v1", api_key=fleet.keys[tenant], max_retries=0)


def served_by(fleet: Fleet) -> dict[str, float]:
    """Completion tokens each backend served so far."""
    return {
        name: metric_sum(fleet.url, "spillgate_tokens_total", target=name, kind="completion")
        for name in ("m-0", "m-1")
    }


def ask(
    fleet: Fleet, model: str, tenant: str = "acme", *, stream: bool = False, max_tokens: int = 5
) -> str | None:
    answer = client(fleet, tenant).chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=max_tokens,
        stream=stream,
    )
    if stream:
        models = {event.model for event in answer}
        assert len(models) == 1
        return models.pop()
    return answer.model


def test_a_request_for_an_adapter_goes_only_where_it_is_served(fleet: Fleet) -> None:
    for model, backend in (("a1", "m-0"), ("a2", "m-0"), ("a3", "m-1")):
        for stream in (False, True):
            before = served_by(fleet)
            answered = [ask(fleet, model, stream=stream) for _ in range(4)]
            after = served_by(fleet)
            grown = {name for name in after if after[name] > before[name]}
            # the answer names the adapter, as the engine's does
            assert (model, stream, answered, grown) == (model, stream, [model] * 4, {backend})


def test_the_pool_model_still_goes_to_every_backend(fleet: Fleet) -> None:
    before = served_by(fleet)

    async def burst() -> None:
        async with openai.AsyncOpenAI(
            base_url=fleet.url + "/v1", api_key=fleet.keys["acme"], max_retries=0
        ) as ask_async:
            await asyncio.gather(
                *(
                    ask_async.chat.completions.create(
                        model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=50
                    )
                    for _ in range(8)
                )
            )

    asyncio.run(burst())
    after = served_by(fleet)
    assert all(after[name] > before[name] for name in after)


def test_an_adapter_the_tenant_may_not_use_does_not_exist_for_it(fleet: Fleet) -> None:
    with pytest.raises(openai.NotFoundError) as refused:
        ask(fleet, "a2", tenant="other")
    with pytest.raises(openai.NotFoundError) as unknown:
        ask(fleet, "a9", tenant="other")
    assert refused.value.code == unknown.value.code == "model_not_found"
    # the same words as for a model that does not exist: no hint that it does
    assert refused.value.message.replace("a2", "a9") == unknown.value.message
    assert ask(fleet, "a1", tenant="other") == "a1"


def test_an_adapter_no_backend_serves_is_refused_saying_so(fleet: Fleet) -> None:
    response = post_chat(fleet, "a4")
    error = response.json()["error"]
    assert response.status_code == 503
    assert error["code"] == "backend_unavailable"
    assert "adapter 'a4'" in error["message"]
    assert "retry-after" in response.headers


def test_status_shows_each_backend_s_adapters(fleet: Fleet) -> None:
    backends = admin_status(fleet.url)["pools"][0]["backends"]
    assert {b["name"]: b["adapters"] for b in backends} == {"m-0": ["a1", "a2"], "m-1": ["a3"]}


def test_the_gateway_lists_the_adapters_a_tenant_may_use(fleet: Fleet) -> None:
    def listed(tenant: str) -> dict[str, str | None]:
        return {m.id: getattr(m, "parent", None) for m in client(fleet, tenant).models.list()}

    assert listed("acme") == {"m": None, "a1": "m", "a2": "m", "a3": "m", "a4": "m"}
    assert listed("other") == {"m": None, "a1": "m", "a3": "m", "a4": "m"}


# -- the queue: a waiter whose adapter has no room holds back no one who may go elsewhere


@pytest.fixture
def queued_fleet() -> Iterator[Fleet]:
    """One backend for `a1` and one for `a3`, each a 4,096-token cache that holds a
    stream of 3,000 tokens or a waiter of 700, not both (every request reserves its whole
    max_tokens); a decode step of 4 ms, so that a stream outlasts the test."""
    steps = dataclasses.replace(SLOW_STEPS, bandwidth_bytes_per_s=250.0)
    sims = [
        dataclasses.replace(sim("a1", kv_tokens=4096), step_cost=steps),
        dataclasses.replace(sim("a3", kv_tokens=4096), step_cost=steps),
    ]
    options = {
        "adapters": [{"name": "a1"}, {"name": "a3"}],
        "overflow": ["queue", "reject"],
        "queue": {"max_wait_s": 30},
        "reservation": {"mode": "max_tokens"},
        "feedback": False,
    }
    tenants = {name: {} for name in ("acme", "x", "y")}
    with run_fleet(pools={"m": sims}, pool_options={"m": options}, tenants=tenants) as f:
        until_ready(f)  # both backends' listings read: their adapters
        yield f


def test_a_waiter_for_a_full_adapter_lets_another_adapter_s_waiter_go(
    queued_fleet: Fleet,
) -> None:
    fleet = queued_fleet

    def waiter(model: str, tenant: str) -> str | None:
        return ask(fleet, model, tenant, max_tokens=700)

    async def scenario() -> None:
        async with AsyncExitStack() as a3_stream, holding(fleet, "a1"):
            await a3_stream.enter_async_context(holding(fleet, "a3"))
            # both backends full: one waiter for each adapter, a1's first in line
            a1_waiter = asyncio.create_task(asyncio.to_thread(waiter, "a1", "x"))
            await until_queued(fleet, 1)
            a3_waiter = asyncio.create_task(asyncio.to_thread(waiter, "a3", "y"))
            await until_queued(fleet, 2)
            await a3_stream.aclose()  # a3's backend frees; a1's is still full
            async with asyncio.timeout(10):
                assert await a3_waiter == "a3"
            assert not a1_waiter.done()
        async with asyncio.timeout(20):  # a1's backend frees in turn
            assert await a1_waiter == "a1"

    asyncio.run(scenario())


async def until_queued(fleet: Fleet, waiting: int) -> None:
    async with asyncio.timeout(10):
        while metric_sum(fleet.url, "spillgate_queue_depth", pool="m") != waiting:  # noqa: ASYNC110
            await asyncio.sleep(0.05)


# -- where an adapter runs: active first, then a free slot, then fill


@pytest.fixture
def slotted_fleet() -> Iterator[Fleet]:
    """Two backends serving a1 and a2, each running one adapter at a time (max_loras 1)."""
    steps = dataclasses.replace(SLOW_STEPS, bandwidth_bytes_per_s=250.0)
    sims = [dataclasses.replace(sim("a1", "a2", max_loras=1), step_cost=steps) for _ in "01"]
    options = {
        "adapters": [{"name": "a1"}, {"name": "a2"}],
        "overflow": ["reject"],
        "reservation": {"mode": "max_tokens"},
    }
    with run_fleet(pools={"m": sims}, pool_options={"m": options}) as f:
        until_ready(f)
        yield f


def test_an_adapter_goes_where_a_slot_is_free_before_where_there_is_room(
    slotted_fleet: Fleet,
) -> None:
    fleet = slotted_fleet

    def active() -> dict[str, list[str]]:
        backends = admin_status(fleet.url)["pools"][0]["backends"]
        return {b["name"]: b["active_adapters"] for b in backends}

    async def scenario() -> None:
        # a2 runs on the first backend (both idle: the first in order), the model itself on
        # the second with more reserved: the first is the less filled, but its one slot is a2's
        async with holding(fleet, "a2", max_tokens=1000), holding(fleet, "m", max_tokens=3000):
            async with asyncio.timeout(10):
                while active() != {"m-0": ["a2"], "m-1": []}:  # noqa: ASYNC110
                    await asyncio.sleep(0.05)
            before = served_by(fleet)
            assert await asyncio.to_thread(ask, fleet, "a1") == "a1"
            after = served_by(fleet)
        assert after["m-1"] > before["m-1"] and after["m-0"] == before["m-0"]

    asyncio.run(scenario())


def test_metrics_count_each_adapter_s_requests_and_where_it_is_served(fleet: Fleet) -> None:
    def requests(adapter: str) -> float:
        name = "spillgate_adapter_requests_total"
        return metric_sum(fleet.url, name, adapter=adapter, outcome="local")

    before = requests("a3")
    for _ in range(3):
        ask(fleet, "a3")
    eventually(lambda: requests("a3") - before == 3)  # counted as each settles
    serving = {
        a: metric_sum(fleet.url, "spillgate_adapter_backends", adapter=a, state="serving")
        for a in ("a1", "a2", "a3", "a4")
    }
    assert serving == {"a1": 1, "a2": 1, "a3": 1, "a4": 0}


# -- overflow: the provider takes an adapter's request only where it maps the adapter


def test_an_adapter_spills_to_the_provider_only_where_the_provider_maps_it() -> None:
    def pools(servers: dict[str, ServerThread]) -> list[dict[str, Any]]:
        # a backend that holds nothing: every request goes down the chain
        backend = {"url": servers["m"].url, "served_model": "m", "capacity": 1}
        adapters = [{"name": "a1"}, {"name": "a2"}]
        chain = {"overflow": ["provider", "reject"], "provider": "hosted"}
        return [{"name": "m", "backends": [backend], "adapters": adapters, **chain}]

    with provider_fleet(
        provider=ProviderConfig(api_key=PROVIDER_KEY, models=("hosted-m", "hosted-a1")),
        provider_options={"models": {"m": "hosted-m", "a1": "hosted-a1"}},
        pools=pools,
        tenants={"acme": {}},
        sims={"m": sim("a1", "a2")},
    ) as (fleet, _):
        until_ready(fleet)
        spilled = post_chat(fleet, "a1")
        passed = post_chat(fleet, "a2")
    assert spilled.status_code == 200
    assert spilled.headers["x-spillgate-outcome"] == "provider"
    assert spilled.json()["model"] == "a1"  # the name the client asked for
    assert passed.status_code == 503
    assert passed.headers["x-spillgate-outcome"] == "rejected"
