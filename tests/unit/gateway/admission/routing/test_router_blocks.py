"""Admission in vLLM's units: whole KV blocks per sequence, one sequence per choice, and a
request too large for the target fill served alone on an idle backend."""

import asyncio

from gateway.admission.routing.route import Route
from gateway.admission.routing.router import Router, kv_tokens
from tests.support.routers import local_router


def _router(capacities: list[int], *, target_fill: float = 0.9, block_size: int = 128) -> Router:
    return local_router(capacities, target_fill=target_fill, block_size=block_size)


def test_kv_tokens_rounds_each_sequence_up_to_whole_blocks() -> None:
    assert kv_tokens(518, block_size=128) == 640
    assert kv_tokens(512, block_size=128) == 512
    assert kv_tokens(518, sequences=3, block_size=128) == 1920
    assert kv_tokens(518) == 518


def test_the_real_servers_burst_is_admitted_in_blocks() -> None:
    # 32 blocks of 128, one kept back: 31 x 128 = 3,968 tokens, 3,571 at 0.9. Seven
    # sequences of 106 + 412 tokens took 3,626 of the old 3,686-token limit and needed 35
    # blocks; in blocks each takes 5 (640 tokens), and 5 fit (25 blocks).
    async def scenario() -> list[int]:
        router = _router([31 * 128])
        held = []
        while (r := await router.reserve(Route("p", 106 + 412))) is not None:
            held.append(r.tokens)
        return held

    assert asyncio.run(scenario()) == [640] * 5


def test_n_choices_reserve_a_sequence_each() -> None:
    async def scenario() -> tuple[int, bool]:
        router = _router([31 * 128])
        r = await router.reserve(Route("p", 518, sequences=3))
        assert r is not None
        return r.tokens, router.has_room(Route("p", 518, sequences=3))

    assert asyncio.run(scenario()) == (1920, False)  # 1,920 + 1,920 > 3,571


def test_a_request_over_the_target_fill_runs_alone_on_an_idle_backend() -> None:
    async def scenario() -> None:
        router = _router([31 * 128])  # limit 3,571 of 3,968
        small = await router.reserve(Route("p", 100))
        assert small is not None
        assert await router.reserve(Route("p", 3800)) is None  # not while anything else runs
        assert not router.has_room(Route("p", 3800)) and router.fits_ever(Route("p", 3800))
        await router.release(small)
        assert router.has_room(Route("p", 3800))
        big = await router.reserve(Route("p", 3800))
        assert big is not None and big.tokens == 3840
        assert await router.reserve(Route("p", 100)) is None  # and nothing joins it
        await router.release(big)
        assert router.ledger.snapshot() == {"p-0": (0, 0)}

    asyncio.run(scenario())


def test_an_idle_backend_takes_an_oversized_request_only_if_none_has_room() -> None:
    async def scenario() -> str:
        router = _router([1000, 2000], target_fill=0.5, block_size=1)
        r = await router.reserve(Route("p", 700))  # p-1 holds it under its target fill
        assert r is not None
        return r.backend

    assert asyncio.run(scenario()) == "p-1"


def test_never_fits_needs_every_kv_cache_known_and_too_small() -> None:
    router = _router([31 * 128, 15 * 128])
    assert not router.never_fits("p", 3968)  # the larger backend holds it, alone
    assert router.never_fits("p", 3969)  # 32 blocks: more than either holds
    assert router.never_fits("p", 2000, sequences=2)
    router.backend("p-1").configured_capacity = None  # not yet discovered: unknown
    assert not router.never_fits("p", 3969)
