"""Preemption: a critical request never waits behind sheddable streams already running. The
gateway stops the fewest of them, the engine frees their blocks, and each stopped stream
waits in the pool's queue and goes on where it was: one stream, one id, usage counted once.
Real processes: a simulated vLLM and the gateway under uvicorn, clients over loopback."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterator
from typing import Any

import pytest

from gateway.admission.fleet.metrics_text import samples, total
from gateway.capacity.perf import StepCost
from loadtest.sim.config import DEFAULT_STEP_COST, SimConfig
from tests.support.fleet import Fleet, run_fleet
from tests.support.metrics import metrics_text
from tests.support.overflow import async_client, sample, wait_for
from tests.support.preemption import (
    CAPACITY,
    SLOTS,
    STREAM_TOKENS,
    Stream,
    one_by_one,
    stream,
    whole,
)


def pool_options(**extra: Any) -> dict[str, Any]:
    return {
        "target_fill": 1.0,
        "overflow": ["queue", "reject"],
        "queue": {"max_wait_s": 30},
        # the whole answer reserved up front: the pool is full with SLOTS streams
        "reservation": {"mode": "max_tokens"},
        **extra,
    }


def start(
    *, step_cost: StepCost | None = None, bulk: dict[str, Any] | None = None, **extra: Any
) -> Iterator[Fleet]:
    with run_fleet(
        pools={"big": [SimConfig(model="m", kv_tokens=8192, step_cost=step_cost)]},
        pool_options={"big": pool_options(**extra)},
        capacity={"big": CAPACITY},
        tenants={
            "bulk": {"priority": "sheddable", "requests_per_minute": 100_000, **(bulk or {})},
            "steady": {"priority": "standard", "requests_per_minute": 100_000},
            "vip": {"priority": "critical", "requests_per_minute": 100_000},
        },
    ) as f:
        yield f


@pytest.fixture
def fleet() -> Iterator[Fleet]:
    yield from start()


def preemptions(fleet: Fleet, result: str) -> float:
    return (
        sample(
            fleet, "spillgate_preemptions_total", pool="big", priority="sheddable", result=result
        )
        or 0.0
    )


def running_on_engine(fleet: Fleet) -> float:
    found = total(samples(metrics_text(fleet.backends["big"][0].url)), "vllm:num_requests_running")
    assert found is not None
    return found


async def flood_then(
    fleet: Fleet, *, urgent_tenant: str, urgent_tokens: int = 5, urgent_count: int = 1
) -> tuple[list[Stream], list[Stream]]:
    """SLOTS sheddable streams fill the pool; once each streams, `urgent_count` requests of
    `urgent_tenant` come one after another; every answer as its client read it."""
    async with (
        async_client(fleet, "bulk", timeout=60) as bulk,
        async_client(fleet, urgent_tenant, timeout=60) as urgent,
    ):
        flood, tasks = await one_by_one(bulk, SLOTS, max_tokens=STREAM_TOKENS)
        urgents = []
        for _ in range(urgent_count):
            urgents.append(await stream(urgent, Stream(), max_tokens=urgent_tokens))
        await asyncio.gather(*tasks)
    return flood, urgents


def test_a_critical_request_stops_one_sheddable_stream_which_goes_on_whole(fleet: Fleet) -> None:
    flood, (vip,) = asyncio.run(flood_then(fleet, urgent_tenant="vip"))
    assert vip.status == 200 and vip.done and vip.headers["x-spillgate-outcome"] == "queued"
    # it did not wait for a sheddable stream to end by itself
    assert all(s.done for s in flood) and all(whole(s) for s in flood), flood
    stopped = [s for s in flood if s.comments]
    assert len(stopped) == 1  # the fewest: one stream's room was enough
    assert stopped[0].comments[0].startswith(": spillgate preempted; resumed after ")
    assert stopped[0] is flood[-1]  # the newest, fewest tokens sent
    assert preemptions(fleet, "continued") == 1
    assert preemptions(fleet, "ended") == 0


def test_the_engine_frees_a_stopped_streams_blocks_while_it_waits(fleet: Fleet) -> None:
    async def scenario() -> None:
        async with (
            async_client(fleet, "bulk", timeout=60) as bulk,
            async_client(fleet, "vip", timeout=60) as vip,
        ):
            flood, tasks = await one_by_one(bulk, SLOTS, max_tokens=STREAM_TOKENS)
            assert running_on_engine(fleet) == SLOTS
            # a long critical stream: the stopped one waits until it ends
            held = Stream()
            urgent = asyncio.create_task(stream(vip, held, max_tokens=STREAM_TOKENS))
            await wait_for(lambda: bool(held.text))
            # the engine runs the critical stream and the one left: the stopped one was
            # aborted there when its connection closed
            await wait_for(lambda: running_on_engine(fleet) == SLOTS)
            assert not flood[-1].done
            await asyncio.gather(urgent, *tasks)
            assert all(whole(s) for s in flood)

    asyncio.run(scenario())


def test_no_preemption_within_a_class_nor_of_standard_work(fleet: Fleet) -> None:
    async def same_class() -> list[Stream]:
        async with async_client(fleet, "bulk", timeout=60) as bulk:
            streams = [Stream() for _ in range(SLOTS + 1)]
            tasks = [asyncio.create_task(stream(bulk, s, max_tokens=40)) for s in streams]
            return list(await asyncio.gather(*tasks))

    answers = asyncio.run(same_class())
    assert all(s.done and not s.comments for s in answers)
    assert total(samples(fleet.metrics_text()), "spillgate_preemptions_total") is None

    async def standard_then_critical() -> tuple[list[Stream], Stream]:
        async with (
            async_client(fleet, "steady", timeout=60) as steady,
            async_client(fleet, "vip", timeout=60) as vip,
        ):
            _, tasks = await one_by_one(steady, SLOTS, max_tokens=60)
            urgent = await stream(vip, Stream(), max_tokens=5)
            return list(await asyncio.gather(*tasks)), urgent

    streams, urgent = asyncio.run(standard_then_critical())
    assert urgent.done and all(s.done and not s.comments for s in streams)
    assert total(samples(fleet.metrics_text()), "spillgate_preemptions_total") is None


def test_a_stream_is_preempted_at_most_once(fleet: Fleet) -> None:
    flood, urgents = asyncio.run(flood_then(fleet, urgent_tenant="vip", urgent_count=2))
    assert all(u.done and u.status == 200 for u in urgents)
    assert all(whole(s) for s in flood)
    # the first critical request stopped the newest stream; the second found it marked and
    # stopped the other
    assert [len(s.comments) for s in flood] == [1, 1]
    assert preemptions(fleet, "continued") == 2


@pytest.fixture
def short_wait_fleet() -> Iterator[Fleet]:
    yield from start(queue={"max_wait_s": 0.5})


def test_a_stream_with_no_room_back_within_its_wait_ends_with_a_clean_error(
    short_wait_fleet: Fleet,
) -> None:
    fleet = short_wait_fleet
    flood, (vip,) = asyncio.run(flood_then(fleet, urgent_tenant="vip", urgent_tokens=STREAM_TOKENS))
    assert vip.done and vip.error is None
    stopped = [s for s in flood if s.error is not None]
    assert len(stopped) == 1
    error = stopped[0].error
    assert error is not None and error["code"] == "preempted"
    assert error["retry_after"] >= 1 and "retry after" in error["message"]
    assert stopped[0].done  # ended, not cut: [DONE] follows the error event
    assert preemptions(fleet, "ended") == 1


@pytest.fixture
def slow_prefill_fleet() -> Iterator[Fleet]:
    # a prompt takes about a second to prefill: a stream admitted a moment ago has sent no
    # byte yet (decoding keeps its usual pace)
    yield from start(step_cost=dataclasses.replace(DEFAULT_STEP_COST, flops_per_s=1e11))


def test_a_request_stopped_before_its_first_byte_is_served_later_from_the_start(
    slow_prefill_fleet: Fleet,
) -> None:
    fleet = slow_prefill_fleet
    flood, urgent = asyncio.run(admitted_then(fleet, urgent_tokens=5))
    assert urgent.done and urgent.headers["x-spillgate-outcome"] == "queued"
    assert all(whole(s) for s in flood)
    requeued = [s for s in flood if "x-spillgate-preempted" in s.headers]
    assert len(requeued) == 1 and requeued[0].headers["x-spillgate-preempted"] == "requeued"
    assert not requeued[0].comments  # its client saw only a later first token
    assert preemptions(fleet, "requeued") == 1


@pytest.fixture
def slow_prefill_short_wait_fleet() -> Iterator[Fleet]:
    # a prompt prefills in about 0.75 s (two at once in 1.5): the simulator, unlike vLLM,
    # sends an answer's head with its first token, so a stream stopped in its prefill
    # gives its room back only then; the critical request waits that within the queue's
    # 3 s and then holds the room for about 3 s, while the sheddable tenant's requests
    # wait at most 0.5 s (its TTFT budget)
    yield from start(
        step_cost=dataclasses.replace(DEFAULT_STEP_COST, flops_per_s=3e11),
        queue={"max_wait_s": 3},
        bulk={"ttft_budget_ms": 500},
    )


def test_a_request_stopped_before_its_first_byte_with_no_room_back_passes_on(
    slow_prefill_short_wait_fleet: Fleet,
) -> None:
    """No room back within its wait (the critical stream holds it longer): the stopped
    request, which sent no byte, goes down its chain past the queue; here the refusal, a
    503 with Retry-After."""
    fleet = slow_prefill_short_wait_fleet
    flood, urgent = asyncio.run(admitted_then(fleet, urgent_tokens=STREAM_TOKENS))
    assert urgent.done and urgent.error is None
    refused = [s for s in flood if s.status == 503]
    assert len(refused) == 1 and int(refused[0].headers["retry-after"]) >= 1
    assert [whole(s) for s in flood].count(True) == 1
    assert preemptions(fleet, "passed_on") == 1


async def admitted_then(fleet: Fleet, *, urgent_tokens: int) -> tuple[list[Stream], Stream]:
    """SLOTS sheddable streams admitted at once, and before any sends a byte (a slow
    prefill), a critical one; every answer as its client read it."""
    async with (
        async_client(fleet, "bulk", timeout=60) as bulk,
        async_client(fleet, "vip", timeout=60) as vip,
    ):
        flood = [Stream() for _ in range(SLOTS)]
        tasks = [asyncio.create_task(stream(bulk, s, max_tokens=STREAM_TOKENS)) for s in flood]
        await wait_for(lambda: active_sessions(fleet) == SLOTS)
        assert not any(s.first_event.is_set() for s in flood)
        urgent = await stream(vip, Stream(), max_tokens=urgent_tokens)
        return list(await asyncio.gather(*tasks)), urgent


def active_sessions(fleet: Fleet) -> float:
    return sample(fleet, "spillgate_active_sessions", backend="big-0") or 0.0


@pytest.fixture
def no_continuation_fleet() -> Iterator[Fleet]:
    yield from start(continue_streams=0)


def test_a_stream_that_cannot_go_on_ends_with_a_clean_error_at_once(
    no_continuation_fleet: Fleet,
) -> None:
    """With continuation off a stopped stream cannot resume: it ends at once with the
    preempted error event and [DONE], never cut, and its room goes to the critical request."""
    fleet = no_continuation_fleet
    flood, (vip,) = asyncio.run(flood_then(fleet, urgent_tenant="vip"))
    assert vip.done and vip.error is None
    stopped = [s for s in flood if s.error is not None]
    assert len(stopped) == 1 and not stopped[0].comments
    error = stopped[0].error
    assert error is not None and error["code"] == "preempted" and error["retry_after"] >= 1
    assert stopped[0].done
    assert stopped[0].usage is None  # no usage event: the answer did not end
    assert preemptions(fleet, "ended") == 1 and preemptions(fleet, "continued") == 0
