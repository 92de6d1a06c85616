"""Shared prompt blocks counted once per backend, as the engine holds them
(gateway/admission/holders.py), in the ledger and in the router's choice and guard."""

import asyncio

from gateway.admission.holders import NO_BLOCKS, Holders, SharedBlocks, shared_blocks
from gateway.admission.ledger import LocalLedger
from gateway.admission.prefix_index import block_keys, prompt_bytes
from gateway.admission.router import Router
from tests.support.routers import local_router

BLOCK = 16


def chat(system: str, user: str) -> bytes:
    body = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]}
    return prompt_bytes(body)


def test_byte_keyed_blocks_keep_one_block_of_margin() -> None:
    prompt = b"x" * (10 * 64 + 5)  # 10 whole keys of 64 bytes at 4 characters a token
    assert shared_blocks(prompt=prompt, token_ids=(), block_size=BLOCK, chars_per_token=4.0) == (
        SharedBlocks(block_keys(prompt, block_size=BLOCK)[:9], BLOCK)
    )
    # 5 characters a token: the 640 bytes are 128 tokens, 8 blocks; one of margin
    longer = shared_blocks(prompt=prompt, token_ids=(), block_size=BLOCK, chars_per_token=5.0)
    assert len(longer.keys) == 7
    # fewer characters a token: never more blocks than the keys cover, less the margin
    shorter = shared_blocks(prompt=prompt, token_ids=(), block_size=BLOCK, chars_per_token=2.0)
    assert len(shorter.keys) == 9
    # a prompt of one block shares nothing: its one block is the margin
    one = shared_blocks(prompt=b"x" * 70, token_ids=(), block_size=BLOCK, chars_per_token=4.0)
    assert one == NO_BLOCKS


def test_token_blocks_are_exact_but_for_a_block_that_ends_the_prompt() -> None:
    ids = tuple(range(64))  # exactly 4 blocks: the engine computes the last token again
    exact = shared_blocks(prompt=b"", token_ids=ids, block_size=BLOCK, chars_per_token=4.0)
    assert (len(exact.keys), exact.tokens) == (3, 48)
    longer = shared_blocks(prompt=b"", token_ids=(*ids, 7), block_size=BLOCK, chars_per_token=4.0)
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


def test_a_sibling_goes_where_its_prompt_is_held_as_the_engine_would_count_it() -> None:
    async def scenario() -> None:
        router = sharing_router([10_000, 10_000], routing="least_filled")
        system = "S" * 64 * 40  # 40 keyed blocks: 39 shared, 624 tokens
        first = await router.reserve("p", 700, prompt=chat(system, "one"))
        assert first is not None and first.shared.tokens == 39 * BLOCK
        other = await router.reserve("p", 100)  # the other backend: 100 against 704
        assert other is not None and other.backend != first.backend
        # least filled as they stand, the other backend; once it is held, the first: there
        # the request adds 704 - 624 = 80 tokens, 0.8 % against the other's 1 % + 7 %
        second = await router.reserve("p", 700, prompt=chat(system, "two"))
        assert second is not None and second.backend == first.backend
        assert router.ledger.tokens_in_flight(first.backend) == 704 + 80
        # where the backend does not cache prefixes, nothing is shared
        router.pools["p"].backends[0].prefix_caching = False
        router.pools["p"].backends[1].prefix_caching = False
        third = await router.reserve("p", 700, prompt=chat(system, "three"))
        assert third is not None and third.shared == NO_BLOCKS

    asyncio.run(scenario())


def test_the_herding_guard_sees_a_stream_at_the_size_it_has_grown_to() -> None:
    async def scenario() -> None:
        router = local_router([10_000] * 2, target_fill=0.9, block_size=BLOCK, routing="prefix")
        prefix = block_keys(b"P" * 64 * 8, block_size=BLOCK)
        first = await router.reserve("p", 300, prefix=prefix)
        assert first is not None
        # a second request of the prefix joins the first where its prompt is cached
        second = await router.reserve("p", 300, prefix=prefix)
        assert second is not None and second.backend == first.backend
        await router.release(second)
        # the first stream grows to 2,304 tokens: the prefix alone now holds 0.26 of its
        # backend's cache with the next request, over 1.25 x and 0.1 above the pool's
        # mean of 0.13; at its admitted 304 it would hold 0.06
        await router.extend(first, 2000)
        third = await router.reserve("p", 300, prefix=prefix)
        assert third is not None and third.backend != first.backend

    asyncio.run(scenario())
