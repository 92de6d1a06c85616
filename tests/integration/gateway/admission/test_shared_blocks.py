"""A prompt prefix shared by requests in flight is reserved once per backend, as vLLM holds it.

One simulated vLLM (prefix caching on, blocks of 16 tokens) behind a real gateway that
discovers its capacity (`capacity: auto`, so it learns the engine caches prefixes). The
figures are worked out in tests/support/shared_prompt.py.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Iterator
from contextlib import AsyncExitStack
from pathlib import Path

import pytest

from gateway.admission.prompt_tokens import PromptTokenizer
from loadtest.sim.config import SimConfig
from loadtest.sim.tokenizer_files import write
from tests.support.fleet import Fleet, admin_status, run_fleet, until_ready
from tests.support.shared_prompt import (
    MAX_TOKENS,
    NEED,
    OTHER_SYSTEM,
    SHARED,
    SLOW_STEPS,
    SYSTEM,
    streaming,
)

BLOCK = 16
OPTIONS = {
    "target_fill": 0.9,
    "reservation": {"mode": "max_tokens"},
    "feedback": False,
    "overflow": ["reject"],
}


@pytest.fixture
def fleet() -> Iterator[Fleet]:
    sim = SimConfig(model="m", kv_tokens=32_768, block_size=BLOCK, step_cost=SLOW_STEPS)
    with run_fleet(pools={"m": [sim]}, pool_options={"m": OPTIONS}) as f:
        until_ready(f)
        yield f


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture
def tokenizing_fleet(tokenizer_dir: Path) -> Iterator[Fleet]:
    """The same, with the model's tokenizer given to the pool and to the engine alike."""
    sim = SimConfig(
        model="m",
        kv_tokens=32_768,
        block_size=BLOCK,
        step_cost=SLOW_STEPS,
        tokenizer=str(tokenizer_dir),
    )
    options = {**OPTIONS, "tokenizer": str(tokenizer_dir)}
    with run_fleet(pools={"m": [sim]}, pool_options={"m": options}) as f:
        until_ready(f)
        yield f


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


def test_with_the_tokenizer_siblings_share_the_engine_blocks_exactly(
    tokenizing_fleet: Fleet, tokenizer_dir: Path
) -> None:
    """A pool that has the model's tokenizer reserves a prompt's exact size, and shares
    the prompt's whole blocks as the engine keys them (all but the block holding its last
    token): no block of margin, as the bytes' guess keeps."""
    fleet, key = tokenizing_fleet, tokenizing_fleet.keys["acme"]
    tokenizer = PromptTokenizer(tokenizer_dir)

    def ids(question: str) -> list[int]:
        body = {"messages": [SYSTEM, {"role": "user", "content": question}]}
        found = tokenizer.chat(body)
        assert found is not None
        return found

    first, second = ids("q1"), ids("q2")
    assert len(first) == len(second)
    need = math.ceil((len(first) + MAX_TOKENS) / BLOCK) * BLOCK
    common = next(i for i, (a, b) in enumerate(zip(first, second, strict=True)) if a != b)
    shared = min(common, len(first) - 1) // BLOCK * BLOCK
    assert shared > SHARED  # more than the bytes' guess credits

    async def run() -> None:
        async with streaming(fleet.url, key, "q1"):
            assert in_flight(fleet) == (need, 1)
            async with streaming(fleet.url, key, "q2"):
                assert in_flight(fleet) == (2 * need - shared, 2)
        await until(fleet, (0, 0))

    asyncio.run(run())
