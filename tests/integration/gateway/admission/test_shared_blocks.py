"""A prompt prefix shared by requests in flight is reserved once per backend, as vLLM holds it.

One simulated vLLM (prefix caching on, blocks of 16 tokens) behind a real gateway that
discovers its capacity (`capacity: auto`, so it learns the engine caches prefixes). Each
request reserves its whole `max_tokens`, so every figure below is worked out by hand:

- the system message is 4,000 characters: as JSON, `{"role":"system","content":"…"}`,
  4,030 bytes, and the user message's JSON follows it; blocks of 16 tokens are keyed every
  64 bytes (4 characters a token), so the first 62 keys lie wholly in the system message
  and the 63rd spans into the user message (4,030 + 30 bytes: 63 whole keys);
- at the estimator's first 4 characters a token those 63 keys cover 63 blocks, one of which
  is kept back as margin for where the engine's block boundary falls: 62 blocks, 992
  tokens, are shared;
- the prompt is estimated at int((4,000 + 16 + 2 + 16) / 4) + 1 = 1,009 tokens; with
  `max_tokens` 2,000 a request needs ceil(3,009 / 16) = 189 blocks, 3,024 tokens.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import AsyncExitStack, asynccontextmanager

import httpx
import pytest

from gateway.capacity.perf import StepCost
from loadtest.sim.config import SimConfig
from tests.support.fleet import Fleet, admin_status, run_fleet

SYSTEM = {"role": "system", "content": "x" * 4000}
NEED = 3024  # one request's whole reservation
SHARED = 992  # the system message's blocks, held once
MAX_TOKENS = 2000


@pytest.fixture
def fleet() -> Iterator[Fleet]:
    # a decode step of 10 ms: a stream of 2,000 tokens outlasts each test
    step = StepCost(
        weights_bytes_per_rank=1.0,
        kv_bytes_per_token_per_rank=1e-9,
        bandwidth_bytes_per_s=100.0,
        prefill_flops_per_token=1.0,
        flops_per_s=1e9,
    )
    sim = SimConfig(model="m", kv_tokens=32_768, block_size=16, step_cost=step)
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


@asynccontextmanager
async def streaming(fleet: Fleet, question: str, *, system: bool = True) -> AsyncIterator[None]:
    """A stream held open (its first event read) until the block ends; then the client
    leaves, which releases its reservation."""
    messages = [SYSTEM] if system else [{"role": "system", "content": "y" * 4000}]
    body = {
        "model": "m",
        "messages": [*messages, {"role": "user", "content": question}],
        "max_tokens": MAX_TOKENS,
        "stream": True,
    }
    headers = {"authorization": f"Bearer {fleet.keys['acme']}"}
    async with (
        httpx.AsyncClient(base_url=fleet.url, headers=headers, timeout=30) as client,
        client.stream("POST", "/v1/chat/completions", json=body) as response,
    ):
        assert response.status_code == 200
        started = asyncio.Event()

        async def read() -> None:  # to its end, unless the block ends first
            async for line in response.aiter_lines():
                if line.startswith("data:"):
                    started.set()

        reading = asyncio.create_task(read())
        await started.wait()
        try:
            yield
        finally:
            reading.cancel()
            await asyncio.gather(reading, return_exceptions=True)


async def until(fleet: Fleet, expected: tuple[int, int]) -> None:
    deadline = time.monotonic() + 10
    while (seen := in_flight(fleet)) != expected:
        assert time.monotonic() < deadline, f"in flight {seen}, expected {expected}"
        await asyncio.sleep(0.05)


def test_two_siblings_hold_the_prompt_blocks_once(fleet: Fleet) -> None:
    async def run() -> None:
        async with streaming(fleet, "q1"):
            assert in_flight(fleet) == (NEED, 1)
            async with streaming(fleet, "q2"):
                assert in_flight(fleet) == (2 * NEED - SHARED, 2)
            async with streaming(fleet, "q3", system=False):  # shares nothing with q1
                assert in_flight(fleet) == (2 * NEED, 2)
        await until(fleet, (0, 0))

    asyncio.run(run())


def test_the_last_holder_release_frees_the_shared_blocks(fleet: Fleet) -> None:
    async def run() -> None:
        async with AsyncExitStack() as first:
            await first.enter_async_context(streaming(fleet, "q1"))
            async with streaming(fleet, "q2"):
                await first.aclose()  # the first holder leaves: the blocks stay held
                await until(fleet, (NEED, 1))
            await until(fleet, (0, 0))  # the last one leaves: they are free
        async with streaming(fleet, "q3"):  # and held again, whole, by a new holder
            assert in_flight(fleet) == (NEED, 1)
        await until(fleet, (0, 0))

    asyncio.run(run())
