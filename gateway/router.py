"""Admission: reserve a request's tokens on the least-filled backend of a pool that has room."""

from __future__ import annotations

import math
from collections.abc import Callable, Collection

from gateway.backends import Backend, Pool
from gateway.clock import Clock
from gateway.demand import RateMeter
from gateway.forward import Target
from gateway.ledger import Ledger, Reservation

ReleaseListener = Callable[[str], None]


class Router:
    def __init__(self, pools: dict[str, Pool], *, ledger: Ledger, clock: Clock) -> None:
        self.pools = pools
        self.ledger = ledger
        self._clock = clock
        self._backends = {b.name: b for p in pools.values() for b in p.backends}
        self._listeners: list[ReleaseListener] = []
        self._drain = {name: RateMeter(clock) for name in pools}
        self._targets: dict[str, Target] = {}

    def backend(self, name: str) -> Backend:
        return self._backends[name]

    def target(self, backend: Backend) -> Target:
        """Where requests reserved on `backend` go; made once, as pools never change."""
        target = self._targets.get(backend.name)
        if target is None:
            target = self._targets[backend.name] = Target(
                name=backend.name,
                api_base=backend.url + "/v1",
                model=backend.served_model,
                timeouts=self.pools[backend.pool].settings.timeouts,
            )
        return target

    def on_release(self, listener: ReleaseListener) -> None:
        """Call `listener(pool)` whenever capacity is given back in a pool."""
        self._listeners.append(listener)

    def capacity(self, backend: Backend) -> int:
        stale = self.pools[backend.pool].settings.metrics_stale_s
        return backend.capacity(now=self._clock.monotonic(), stale_after=stale)

    def limit(self, backend: Backend) -> int:
        """Tokens this backend may hold: capacity × the pool's target fill."""
        return _limit(self.capacity(backend), self.pools[backend.pool].settings.target_fill)

    def fill(self, backend: Backend) -> float:
        capacity = self.capacity(backend)
        if capacity <= 0:
            return math.inf
        return self.ledger.tokens_in_flight(backend.name) / capacity

    def pool_fill(self, pool: str) -> float:
        backends = self.pools[pool].backends
        capacity = sum(self.capacity(b) for b in backends)
        held = sum(self.ledger.tokens_in_flight(b.name) for b in backends)
        return held / capacity if capacity else 1.0

    def candidates(self, pool: str, *, exclude: Collection[str] = ()) -> list[Backend]:
        """The pool's usable backends (healthy, with known capacity), least filled first."""
        return [backend for *_, backend, _ in self._ranked(pool, exclude)]

    def _ranked(self, pool: str, exclude: Collection[str]) -> list[tuple[float, int, Backend, int]]:
        """(fill, index, backend, limit) of each usable backend, least filled first; each
        capacity worked out once."""
        p = self.pools[pool]
        now = self._clock.monotonic()
        stale, target = p.settings.metrics_stale_s, p.settings.target_fill
        tokens = self.ledger.tokens_in_flight
        ranked: list[tuple[float, int, Backend, int]] = []
        for i, b in enumerate(p.backends):
            if b.name in exclude or not b.healthy(now):
                continue
            capacity = b.capacity(now=now, stale_after=stale)
            if capacity > 0:
                ranked.append((tokens(b.name) / capacity, i, b, _limit(capacity, target)))
        if len(ranked) > 1:
            ranked.sort()
        return ranked

    async def admit(
        self, pool: str, tokens: int, *, exclude: Collection[str] = ()
    ) -> Reservation | None:
        """Reserve on the least-filled backend with room under the target fill, else None."""
        for *_, backend, limit in self._ranked(pool, exclude):
            reservation = await self.ledger.reserve(backend.name, tokens, limit=limit)
            if reservation is not None:
                return reservation
        return None

    def most_room(self, pool: str) -> int:
        """The most tokens any usable backend of the pool could take now."""
        tokens = self.ledger.tokens_in_flight
        ranked = self._ranked(pool, ())
        return max((limit - tokens(b.name) for *_, b, limit in ranked), default=0)

    def fits_ever(self, pool: str, tokens: int) -> bool:
        """Whether any backend of the pool could hold this request even when idle."""
        return any(self.limit(b) >= tokens for b in self.pools[pool].backends)

    def retry_after(self, pool: str, tokens: int) -> float:
        """Seconds until the pool has likely drained enough to hold `tokens` more."""
        backends = self.pools[pool].backends
        room = sum(self.limit(b) - self.ledger.tokens_in_flight(b.name) for b in backends)
        return self._drain[pool].seconds_to(max(0, tokens - room))

    async def release(self, reservation: Reservation) -> None:
        await self.ledger.release(reservation)
        self._freed(reservation.backend, reservation.tokens)

    def released_elsewhere(self, backend: str, tokens: int) -> None:
        """Capacity another replica gave back, heard through the shared ledger."""
        if backend in self._backends:
            self._freed(backend, tokens)

    def wake_all(self) -> None:
        """Call every listener for every pool: releases elsewhere may have gone unheard."""
        for pool in self.pools:
            for listener in self._listeners:
                listener(pool)

    def _freed(self, backend: str, tokens: int) -> None:
        pool = self._backends[backend].pool
        self._drain[pool].record(tokens)
        for listener in self._listeners:
            listener(pool)


def _limit(capacity: int, target_fill: float) -> int:
    return math.floor(capacity * target_fill)
