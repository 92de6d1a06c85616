"""A streaming request's reservation grows with the tokens it relays, in whole blocks."""

import asyncio

from gateway.admission.ledger.growth import Growth
from gateway.admission.ledger.held import HeldReservation
from gateway.admission.ledger.reservations import LocalLedger, Reservation
from gateway.admission.routing.route import Route
from gateway.admission.routing.router import Router
from tests.support.routers import local_router


def _router(capacities: list[int], target_fill: float, *, block_size: int) -> Router:
    return local_router(capacities, target_fill=target_fill, block_size=block_size)


def held_by(router: Router, reservation: Reservation) -> HeldReservation:
    held = HeldReservation(router)
    held.take(reservation)
    return held


def event(index: int = 0) -> bytes:
    return b'data: {"id":"x","choices":[{"index":%d,"delta":{"content":"a"}}]}\n\n' % index


def test_grows_a_block_at_a_time_past_the_reservation_and_releases_it_all() -> None:
    async def scenario() -> None:
        router = _router([1000], 0.1, block_size=16)  # limit 100
        reservation = await router.reserve(Route("p", 10 + 22))  # prompt 10 + 22 expected: 2 blocks
        assert reservation is not None and reservation.tokens == 32
        held = held_by(router, reservation)
        growth = Growth(held=held, prompt_tokens=10, sequences=1, block_size=16)
        assert not growth.seen(event() * 22)  # 10 + 22 = 32: still covered
        assert growth.seen(event())  # the 23rd token needs a third block
        await growth.grow()
        assert held.reservation.tokens == 48
        assert router.ledger.tokens_in_flight("p-0") == 48
        assert growth.seen(event() * 100)  # past the limit: it grows all the same
        await growth.grow()
        assert held.reservation.tokens == 144  # 10 + 123 = 133 tokens: 9 blocks
        assert router.ledger.tokens_in_flight("p-0") == 144
        await held.release()  # all of it goes
        assert router.ledger.snapshot() == {"p-0": (0, 0)}

    asyncio.run(scenario())


def test_choices_are_counted_each_and_every_sequence_grows_with_the_longest() -> None:
    async def scenario() -> None:
        router = _router([1000], 1.0, block_size=16)
        reservation = await router.reserve(Route("p", 16, sequences=2))  # 2 x 1 block
        assert reservation is not None and reservation.tokens == 32
        held = held_by(router, reservation)
        growth = Growth(held=held, prompt_tokens=4, sequences=2, block_size=16)
        assert not growth.seen(event(0) * 12 + event(1) * 5)
        assert growth.seen(event(0))  # choice 0 at 4 + 13 tokens
        await growth.grow()
        assert held.reservation.tokens == 64
        assert growth.generated == 13

    asyncio.run(scenario())


def test_an_extension_after_the_release_holds_nothing() -> None:
    async def scenario() -> None:
        ledger = LocalLedger()
        reservation = await ledger.reserve("b", 16, limit=100)
        assert reservation is not None
        await ledger.release(reservation)
        assert await ledger.extend(reservation, 16) == reservation
        assert ledger.snapshot() == {"b": (0, 0)}

    asyncio.run(scenario())


def test_headroom_stays_reserved_beyond_the_blocks_the_stream_holds() -> None:
    async def scenario() -> None:
        router = _router([1000], 1.0, block_size=16)
        reservation = await router.reserve(Route("p", 10 + 22))  # 2 blocks: prompt 10, 22 beyond
        assert reservation is not None
        held = held_by(router, reservation)
        growth = Growth(
            held=held,
            prompt_tokens=10,
            sequences=1,
            block_size=16,
            headroom=8,
        )
        assert not growth.seen(event() * 14)  # 10 + 14 + 8 = 32: covered
        assert growth.seen(event())  # 10 + 15 + 8 = 33
        await growth.grow()
        # the 25 tokens held take 2 blocks, and 8 tokens on top: not a third block
        assert held.reservation is not None and held.reservation.tokens == 32 + 8
        assert router.ledger.tokens_in_flight("p-0") == 40
        assert not growth.seen(event() * 7)  # 10 + 22 = 32 tokens: still 2 blocks
        assert growth.seen(event())  # the 33rd token takes a third block
        await growth.grow()
        assert held.reservation.tokens == 48 + 8
        await held.release()
        assert router.ledger.snapshot() == {"p-0": (0, 0)}

    asyncio.run(scenario())
