"""A prompt prefix shared by requests in flight is reserved once per backend, as vLLM holds it.

One simulated vLLM (prefix caching on, blocks of 16 tokens) behind a real gateway that
discovers its capacity (`capacity: auto`, so it learns the engine caches prefixes). The
figures are worked out in tests/support/shared_prompt.py.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from contextlib import AsyncExitStack

import httpx
import pytest

from loadtest.sim.config import SimConfig
from tests.support.fleet import Fleet, admin_status, run_fleet
from tests.support.shared_prompt import NEED, OTHER_SYSTEM, SHARED, SLOW_STEPS, streaming


@pytest.fixture
def fleet() -> Iterator[Fleet]:
    sim = SimConfig(model="m", kv_tokens=32_768, block_size=16, step_cost=SLOW_STEPS)
    options = {
        "target_fill": 0.9,
        "reservation": {"mode": "max_tokens"},
        "feedback": False,
        "overflow": ["reject"],
    }
    with run_fleet(pools={"m": [sim]}, pool_options={"m": options}) as f:
        until_ready(f)
        yield f


def until_ready(fleet: Fleet) -> None:
    deadline = time.monotonic() + 20
    while httpx.get(f"{fleet.url}/readyz", timeout=2).status_code != 200:
        assert time.monotonic() < deadline, "the gateway never became ready"
        time.sleep(0.05)


def in_flight(fleet: Fleet) -> tuple[int, int]:
    """(tokens in flight, sessions) on the one backend, as the gateway's ledger holds them."""
    (backend,) = admin_status(fleet.url)["pools"][0]["backends"]
    return backend["tokens_in_flight"], backend["active_sessions"]


async def until(fleet: Fleet, expected: tuple[int, int]) -> None:
    deadline = time.monotonic() + 10
    while (seen := in_flight(fleet)) != expected:
        assert time.monotonic() < deadline, f"in flight {seen}, expected {expected}"
        await asyncio.sleep(0.05)


def test_two_siblings_hold_the_prompt_blocks_once(fleet: Fleet) -> None:
    key = fleet.keys["acme"]

    async def run() -> None:
        async with streaming(fleet.url, key, "q1"):
            assert in_flight(fleet) == (NEED, 1)
            async with streaming(fleet.url, key, "q2"):
                assert in_flight(fleet) == (2 * NEED - SHARED, 2)
            # a prompt of the same length that shares nothing with q1's
            async with streaming(fleet.url, key, "q3", system=OTHER_SYSTEM):
                assert in_flight(fleet) == (2 * NEED, 2)
        await until(fleet, (0, 0))

    asyncio.run(run())


def test_the_last_holder_release_frees_the_shared_blocks(fleet: Fleet) -> None:
    key = fleet.keys["acme"]

    async def run() -> None:
        async with AsyncExitStack() as first:
            await first.enter_async_context(streaming(fleet.url, key, "q1"))
            async with streaming(fleet.url, key, "q2"):
                await first.aclose()  # the first holder leaves: the blocks stay held
                await until(fleet, (NEED, 1))
            await until(fleet, (0, 0))  # the last one leaves: they are free
        async with streaming(fleet.url, key, "q3"):  # and held again, whole, by a new holder
            assert in_flight(fleet) == (NEED, 1)
        await until(fleet, (0, 0))

    asyncio.run(run())
