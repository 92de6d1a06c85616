import asyncio
import math

import pytest

from gateway.admission.fleet.demand import PoolDemand, RateMeter
from gateway.admission.routing.route import Route
from gateway.admission.routing.router import Router
from gateway.clock import ManualClock
from tests.support.routers import local_router


def _router(capacities: list[int], target_fill: float = 0.5, *, block_size: int = 1) -> Router:
    return local_router(capacities, target_fill=target_fill, block_size=block_size)


def test_admits_on_least_filled_backend_and_never_past_target_fill() -> None:
    async def scenario() -> None:
        router = _router([1000, 2000])
        held = []
        while (r := await router.reserve(Route("p", 100))) is not None:
            held.append(r)
        # 500 + 1000 tokens fit under 50% fill; nothing more
        assert sum(r.tokens for r in held) == 1500
        assert router.ledger.tokens_in_flight("p-0") == 500
        assert router.ledger.tokens_in_flight("p-1") == 1000
        for r in held:
            await router.release(r)
        assert router.ledger.snapshot() == {"p-0": (0, 0), "p-1": (0, 0)}

    asyncio.run(scenario())


def test_release_twice_is_a_no_op_and_wakes_listeners() -> None:
    async def scenario() -> None:
        router = _router([1000])
        woken: list[str] = []
        router.on_release(woken.append)
        r = await router.reserve(Route("p", 10))
        assert r is not None
        await router.release(r)
        await router.ledger.release(r)
        assert router.ledger.tokens_in_flight("p-0") == 0
        assert woken == ["p"]

    asyncio.run(scenario())


def test_ejected_and_unknown_capacity_backends_are_skipped() -> None:
    async def scenario() -> None:
        router = _router([1000, 1000])
        clock = ManualClock()
        backend = router.backend("p-0")
        for _ in range(3):
            backend.record_failure(clock.monotonic())
        assert [b.name for b in router.in_rotation("p")] == ["p-1"]

    asyncio.run(scenario())


def test_has_room_looks_at_every_usable_backends_share_under_target_fill() -> None:
    async def scenario() -> None:
        router = _router([1000, 2000])  # limits 500 and 1000
        assert router.has_room(Route("p", 1000)) and not router.has_room(Route("p", 2001))
        held = await router.reserve(Route("p", 700))  # least filled first: p-0 cannot hold 700
        assert held is not None and held.backend == "p-1"
        assert router.has_room(Route("p", 500))
        assert router.has_room(Route("p", 1000))  # alone on idle p-0, within its KV cache
        assert not router.has_room(Route("p", 1001))
        for _ in range(3):
            router.backend("p-0").record_failure(ManualClock().monotonic())
        # an ejected backend offers no room
        assert router.has_room(Route("p", 300)) and not router.has_room(Route("p", 301))

    asyncio.run(scenario())


def test_rate_meter_follows_what_is_recorded() -> None:
    clock = ManualClock()
    meter = RateMeter(clock)
    assert meter.rate() == 0.0
    for _ in range(10):
        meter.record(1000)
        clock.advance(1.0)
    assert 500 < meter.rate() < 1500


def test_rate_meter_records_within_a_step_stay_within_a_percent_of_exact_decay() -> None:
    clock = ManualClock()
    meter = RateMeter(clock, half_life_s=5.0)
    exact = 0.0  # every record decayed from its own instant
    for _ in range(200):  # 100 records a second for 2 s: five to a 50 ms step
        exact = exact * 0.5 ** (0.01 / 5.0) + 10 * math.log(2) / 5.0
        meter.record(10)
        clock.advance(0.01)
    exact *= 0.5 ** (0.01 / 5.0)  # to the reading, 10 ms after the last record
    rate = meter.rate()
    assert rate == pytest.approx(exact, rel=0.01)
    assert rate != pytest.approx(exact, rel=1e-6)  # the steps are real, and this small


def test_desired_backends_counts_spilled_and_refused_demand() -> None:
    clock = ManualClock()
    demand = PoolDemand(clock)
    assert demand.desired_backends(backend_capacity=1000, target_fill=0.5) == 0
    started = [demand.begin(400) for _ in range(5)]  # 2000 tokens in flight
    assert demand.desired_backends(backend_capacity=1000, target_fill=0.5) == 4
    clock.advance(2.0)
    for t in started:
        demand.end(400, started=t, used=300, refused=False)
    assert demand.tokens_in_flight == 0
    for _ in range(10):
        demand.end(500, started=demand.begin(500), used=0, refused=True)
    assert demand.tokens_in_flight == 0
    # refused requests count for as long as a request holds its tokens (~2 s here)
    assert demand.desired_backends(backend_capacity=1000, target_fill=0.5) == 10
    clock.advance(3.0)
    assert demand.desired_backends(backend_capacity=1000, target_fill=0.5) == 0
