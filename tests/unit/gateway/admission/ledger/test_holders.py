"""Shared prompt blocks counted once per backend, as the engine holds them
(gateway/admission/ledger/holders.py), in the ledger and in the router's choice and guard."""

import asyncio

import orjson

from gateway.admission.ledger.holders import Holders, byte_blocks, token_blocks
from gateway.admission.ledger.reservations import LocalLedger
from gateway.admission.routing.prefix_index import block_keys, prompt_bytes
from gateway.admission.routing.route import Route
from gateway.admission.routing.router import Router
from gateway.clock import ManualClock
from gateway.front.auth import Tenant
from gateway.front.prepare import Preparer
from gateway.ratelimit.base import TenantLimits
from gateway.request import NO_BLOCKS, Endpoint, SharedBlocks
from tests.support.routers import local_router

BLOCK = 16


def chat(system: str, user: str) -> bytes:
    body = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]}
    return prompt_bytes(body)


def test_byte_keyed_blocks_are_the_estimate_s_whole_blocks_less_one_of_margin() -> None:
    prompt = b"x" * (10 * 64 + 5)  # 10 whole keys of 64 bytes, 645 bytes in all
    keys = block_keys(prompt, block_size=BLOCK)

    def shared(tokens: int) -> int:
        found = byte_blocks(keys, prompt_bytes=len(prompt), prompt_tokens=tokens, block_size=BLOCK)
        assert found.keys == keys[: len(found.keys)]
        assert found.block_tokens == (BLOCK if found.keys else 0)
        return len(found.keys)

    # 4 characters a token: 162 tokens, 640 of 645 bytes keyed: 10 blocks, one of margin
    assert shared(162) == 9
    # 5 characters a token: 129 tokens, 128 of them keyed: 8 blocks
    assert shared(129) == 7
    # denser text: never more blocks than keys
    assert shared(323) == 9
    # bytes that are not characters (escapes, multibyte) cover fewer tokens: 81 estimated
    # tokens for 645 bytes, 80 keyed, 5 blocks
    assert shared(81) == 4
    # a prompt of one block shares nothing: its one block is the margin; nor does a prompt
    # of no estimate
    one = block_keys(b"x" * 70, block_size=BLOCK)
    assert byte_blocks(one, prompt_bytes=70, prompt_tokens=18, block_size=BLOCK) == NO_BLOCKS
    assert shared(0) == 0


def test_token_blocks_are_exact_but_for_a_block_that_ends_the_prompt() -> None:
    ids = tuple(range(64))  # exactly 4 blocks: the engine computes the last token again
    exact = token_blocks(ids, block_size=BLOCK)
    assert (len(exact.keys), exact.tokens) == (3, 48)
    longer = token_blocks((*ids, 7), block_size=BLOCK)
    assert (longer.keys[:3], len(longer.keys)) == (exact.keys, 4)


def test_holders_count_each_block_once_and_free_it_with_the_last() -> None:
    holders = Holders()
    a = SharedBlocks((b"1", b"2", b"3"), 16)
    b = SharedBlocks((b"1", b"2", b"4", b"5"), 16)
    assert holders.new_tokens("x", a) == 48
    assert holders.hold("x", a) == 48
    assert (holders.new_tokens("x", b), holders.new_tokens("y", b)) == (32, 64)
    assert holders.hold("x", b) == 32
    assert holders.drop("x", a) == 16  # block 3 had one holder; 1 and 2 stay with b
    assert holders.drop("x", b) == 64
    assert holders.drop("x", b) == 0  # nothing held: nothing freed twice
    assert holders.new_tokens("x", a) == 48


def test_the_local_ledger_holds_shared_blocks_once() -> None:
    async def scenario() -> None:
        ledger = LocalLedger()
        shared = SharedBlocks((b"1", b"2"), 100)
        first = await ledger.reserve("x", 500, limit=1000, shared=shared)
        second = await ledger.reserve("x", 500, limit=1000, shared=shared)
        assert first is not None and second is not None
        assert (ledger.tokens_in_flight("x"), ledger.sessions("x")) == (800, 2)
        assert ledger.cost("x", 500, shared) == 300
        # 1,100 > 1,000 as a whole, 300 beside its siblings: it fits
        assert await ledger.reserve("x", 300, limit=1000, shared=shared) is not None
        await ledger.release(first)
        grown = await ledger.extend(second, 50)
        assert ledger.tokens_in_flight("x") == 300 + 50 + 100 + 200
        await ledger.release(grown)
        assert ledger.tokens_in_flight("x") == 100 + 200  # the third holds the blocks now

    asyncio.run(scenario())


def sharing_router(capacities: list[int], **pool: object) -> Router:
    router = local_router(capacities, target_fill=0.9, block_size=BLOCK, **pool)
    for backend in router.pools["p"].backends:
        backend.prefix_caching = True  # what discovery reads from vLLM's cache_config_info
    return router


def shared_of(prompt: bytes, *, tokens: int) -> tuple[SharedBlocks, ...]:
    """What prepare works out for a prompt of `tokens` estimated tokens, at BLOCK."""
    keys = block_keys(prompt, block_size=BLOCK)
    return (byte_blocks(keys, prompt_bytes=len(prompt), prompt_tokens=tokens, block_size=BLOCK),)


def test_a_sibling_goes_where_its_prompt_is_held_as_the_engine_would_count_it() -> None:
    async def scenario() -> None:
        router = sharing_router([10_000, 10_000], routing="least_filled")
        system = "S" * 64 * 40
        # 2,621 bytes, 40 keys; 649 tokens estimated, 2,560 bytes of them keyed: 39 blocks,
        # 38 shared (608 tokens); 700 tokens reserve 44 blocks, 704
        first = await router.reserve(
            Route("p", 700, shared=shared_of(chat(system, "one"), tokens=649))
        )
        assert first is not None and first.shared.tokens == 38 * BLOCK
        other = await router.reserve(Route("p", 300))  # the other backend: 304 against 704
        assert other is not None and other.backend != first.backend
        # least filled as they stand, the other backend; once it is held, the first: there
        # the request adds 704 - 608 = 96 tokens, 8.0 % against the other's 10.08 %
        second = await router.reserve(
            Route("p", 700, shared=shared_of(chat(system, "two"), tokens=649))
        )
        assert second is not None and second.backend == first.backend
        assert router.ledger.tokens_in_flight(first.backend) == 704 + 96
        # where the backend does not cache prefixes, nothing is shared
        router.pools["p"].backends[0].prefix_caching = False
        router.pools["p"].backends[1].prefix_caching = False
        third = await router.reserve(
            Route("p", 700, shared=shared_of(chat(system, "three"), tokens=649))
        )
        assert third is not None and third.shared == NO_BLOCKS

    asyncio.run(scenario())


def test_the_herding_guard_sees_a_stream_at_the_size_it_has_grown_to() -> None:
    async def scenario() -> None:
        router = local_router([10_000] * 2, target_fill=0.9, block_size=BLOCK, routing="prefix")
        prefix = block_keys(b"P" * 64 * 8, block_size=BLOCK)
        first = await router.reserve(Route("p", 300, prefix=prefix))
        assert first is not None
        # a second request of the prefix joins the first where its prompt is cached
        second = await router.reserve(Route("p", 300, prefix=prefix))
        assert second is not None and second.backend == first.backend
        await router.release(second)
        # the first stream grows to 2,304 tokens: the prefix alone now holds 0.26 of its
        # backend's cache with the next request, over 1.25 x and 0.1 above the pool's
        # mean of 0.13; at its admitted 304 it would hold 0.06
        await router.extend(first, 2000)
        third = await router.reserve(Route("p", 300, prefix=prefix))
        assert third is not None and third.backend != first.backend

    asyncio.run(scenario())


def test_what_a_request_would_find_held_of_its_prompt_in_flight() -> None:
    async def scenario() -> None:
        router = sharing_router([10_000, 10_000], routing="least_filled")
        system = "S" * 64 * 40  # as above: 38 blocks shared, 608 tokens
        shared = shared_of(chat(system, "two"), tokens=651)
        assert router.shared_in_flight("p", shared) == 0  # nothing in flight holds it
        first = await router.reserve(
            Route("p", 700, shared=shared_of(chat(system, "one"), tokens=649))
        )
        assert first is not None
        assert router.shared_in_flight("p", shared) == 38 * BLOCK
        await router.release(first)
        assert router.shared_in_flight("p", shared) == 0

    asyncio.run(scenario())


def test_a_prompt_is_keyed_once_as_it_is_prepared_and_only_where_it_may_share() -> None:
    router = sharing_router([10_000])  # one backend: no prefix routing to key it for
    preparer = Preparer(Endpoint.CHAT, router=router, clock=ManualClock())
    limits = TenantLimits(tenant="t", requests_per_minute=10, tokens_per_minute=10**6)
    tenant = Tenant(name="t", key_hash=b"", priority="standard", pools=frozenset(),
                    limits=limits, ttft_budget_s=None)  # fmt: skip
    messages = [{"role": "system", "content": "S" * 64 * 40}, {"role": "user", "content": "two"}]
    body = {"model": "p", "messages": messages, "max_tokens": 50}
    request = preparer.request(tenant, {}, orjson.dumps(body))
    # its estimate: int((2,560 + 16 + 3 + 16) / 4) + 1 = 649 tokens, as above
    assert request.prompt_tokens == 649
    assert request.shared == shared_of(chat(messages[0]["content"], "two"), tokens=649)
    # several choices: each is reserved whole, so nothing is keyed
    several = preparer.request(tenant, {}, orjson.dumps({**body, "n": 2}))
    assert several.shared == ()
    # a pool that caches no prefixes keys nothing
    router.pools["p"].backends[0].prefix_caching = False
    assert preparer.request(tenant, {}, orjson.dumps(body)).shared == ()
