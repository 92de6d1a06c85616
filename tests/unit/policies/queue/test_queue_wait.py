"""The queue on a real router and ledger: releases hand capacity over, waiters leave on
time, nothing leaks."""

from __future__ import annotations

import asyncio

import pytest

from gateway.admission.routing.route import Route
from policies.queue.fair_queue import QueueResult
from policies.queue.policy import AUTO_CEILING_S, AUTO_FLOOR_S
from tests.support.queue import CAPACITY, Setup, request, run, settle


def test_a_release_hands_the_room_to_the_waiter() -> None:
    async def scenario(s: Setup) -> None:
        full = await s.router.reserve(Route("p", CAPACITY))
        assert full is not None
        ex = s.exchange()
        waiting = asyncio.create_task(s.queue.wait(request(tokens=300), ex))
        await settle()
        assert len(s.queue) == 1 and not waiting.done()
        await s.router.release(full)
        assert await waiting is QueueResult.ADMITTED
        assert ex.held.reservation is not None
        assert s.in_flight() == 300 and len(s.queue) == 0
        await ex.held.release()
        assert s.in_flight() == 0

    run(scenario)


def test_a_cancelled_waiter_leaves_at_once_and_gets_nothing() -> None:
    async def scenario(s: Setup) -> None:
        full = await s.router.reserve(Route("p", CAPACITY))
        assert full is not None
        ex = s.exchange()
        waiting = asyncio.create_task(s.queue.wait(request(), ex))
        await settle()
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
        assert waiting.cancelled() and len(s.queue) == 0
        await s.router.release(full)
        await settle()
        assert s.in_flight() == 0 and ex.held.reservation is None

    run(scenario)


def test_a_waiter_moves_on_at_its_tenants_ttft_budget() -> None:
    async def scenario(s: Setup) -> None:
        s.budgets["hurried"] = 0.05
        assert s.queue.max_wait_s(request(tenant="hurried")) == 0.05
        assert s.queue.max_wait_s(request(tenant="patient")) == 5.0
        full = await s.router.reserve(Route("p", CAPACITY))
        assert full is not None
        started = s.clock.monotonic()
        result = await s.queue.wait(request(tenant="hurried"), s.exchange())
        assert result is QueueResult.EVICTED_DEADLINE
        assert s.clock.monotonic() - started == pytest.approx(0.05)  # not the pool's 5 s
        assert len(s.queue) == 0

    run(scenario)


def test_a_request_larger_than_any_backend_is_not_queued() -> None:
    async def scenario(s: Setup) -> None:
        result = await s.queue.wait(request(tokens=CAPACITY + 1), s.exchange())
        assert result is QueueResult.REJECTED_NEVER_FITS
        assert len(s.queue) == 0

    run(scenario)


def test_a_waiter_cancelled_just_as_room_frees_gets_nothing() -> None:
    async def scenario(s: Setup) -> None:
        full = await s.router.reserve(Route("p", CAPACITY))
        assert full is not None
        ex = s.exchange()
        waiting = asyncio.create_task(s.queue.wait(request(), ex))
        await settle()
        await s.router.release(full)  # the drain is scheduled ...
        waiting.cancel()  # ... and the client leaves before it runs
        await asyncio.gather(waiting, return_exceptions=True)
        await settle()
        assert waiting.cancelled() and len(s.queue) == 0
        assert s.in_flight() == 0 and ex.held.reservation is None

    run(scenario)


def test_the_head_of_the_queue_is_not_overtaken_by_a_smaller_request() -> None:
    async def scenario(s: Setup) -> None:
        first = await s.router.reserve(Route("p", 500))
        second = await s.router.reserve(Route("p", 500))
        assert first is not None and second is not None
        big = asyncio.create_task(s.queue.wait(request(tenant="a", tokens=800), s.exchange()))
        await settle()
        small = asyncio.create_task(s.queue.wait(request(tenant="b", tokens=100), s.exchange()))
        await s.router.release(first)
        await settle()
        assert not big.done() and not small.done()  # 500 free: the head needs 800
        await s.router.release(second)
        assert await big is QueueResult.ADMITTED
        assert await small is QueueResult.ADMITTED
        assert s.in_flight() == 900

    run(scenario)


def test_an_auto_wait_is_twice_the_pools_average_answer_within_its_bounds() -> None:
    async def scenario(s: Setup) -> None:
        assert s.queue.max_wait_s(request()) == AUTO_FLOOR_S  # no answer has ended yet
        # the average hold moves a fifth of the way to each new one: 0.5, 1.2, 8.96, 15.168
        for hold_s, wait_s in ((0.5, AUTO_FLOOR_S), (4.0, 2.4), (40.0, 17.92), (40.0, 30.0)):
            held = await s.router.reserve(Route("p", 10))
            assert held is not None
            s.clock.advance(hold_s)
            await s.router.release(held)
            assert s.queue.max_wait_s(request()) == pytest.approx(wait_s)
        assert AUTO_CEILING_S == 30.0
        s.budgets["hurried"] = 0.05
        assert s.queue.max_wait_s(request(tenant="hurried")) == 0.05

    run(scenario, max_wait_s="auto")


def test_an_auto_wait_lets_a_waiter_outwait_a_slow_pools_answers() -> None:
    async def scenario(s: Setup) -> None:
        first = await s.router.reserve(Route("p", 10))
        assert first is not None
        s.clock.advance(6.0)  # the pool's answers take 6 s
        await s.router.release(first)
        full = await s.router.reserve(Route("p", CAPACITY))
        assert full is not None
        ex = s.exchange()
        waiting = asyncio.create_task(s.queue.wait(request(), ex))
        await asyncio.sleep(5.0)  # past a fixed 2 s wait; the loop's time is the clock
        assert not waiting.done()
        await s.router.release(full)
        assert await waiting is QueueResult.ADMITTED
        await ex.held.release()

    run(scenario, max_wait_s="auto")


def test_a_waiter_that_avoids_the_backend_with_room_leaves_it_to_those_behind() -> None:
    """A Responses continuation may go only where its previous response is stored: room on
    another backend is not its, and it must not hold back the waiters behind it."""

    async def scenario(s: Setup) -> None:
        on_0 = await s.router.reserve(Route("p", CAPACITY, exclude={"p-1"}))
        on_1 = await s.router.reserve(Route("p", CAPACITY, exclude={"p-0"}))
        assert on_0 is not None and on_1 is not None
        pinned = request(tenant="a")._replace(avoid=frozenset({"p-1"}))  # p-0 only
        first = asyncio.create_task(s.queue.wait(pinned, s.exchange()))
        await settle()
        behind = asyncio.create_task(s.queue.wait(request(tenant="b"), s.exchange()))
        await settle()
        await s.router.release(on_1)  # room on p-1 alone
        await settle()
        assert behind.done() and behind.result() is QueueResult.ADMITTED
        assert not first.done()
        await s.router.release(on_0)
        assert await first is QueueResult.ADMITTED

    run(scenario, backends=2)
