"""Tokens in flight per backend: reserve-if-it-fits and release, nothing else.

A reservation's shared prompt blocks are held once per backend, however many requests in
flight hold them (gateway/admission/ledger/holders.py): a backend's tokens in flight are its
requests' own tokens plus each shared block once. The local ledger is the embedded
default; a Redis ledger with leases shares the same truth across replicas.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from gateway.admission.ledger.holders import Holders
from gateway.request import NO_BLOCKS, SharedBlocks


class Reservation(NamedTuple):
    """What one admitted request holds on one backend (a NamedTuple: one per request):
    `tokens`, its whole size, grown as it streams, of which `shared` are prompt blocks it
    holds in common with the other requests in flight there (counted once for all)."""

    backend: str
    tokens: int
    id: str  # unique in the ledger that took it
    shared: SharedBlocks = NO_BLOCKS

    @property
    def own_tokens(self) -> int:
        """Its tokens beyond the shared blocks: what no other request holds with it."""
        return self.tokens - self.shared.tokens


@dataclass(slots=True, eq=False)
class InFlight:
    """The router's one record of a reservation in flight, read by the forecast and the
    prefix herding guard: the reservation as it now stands (grown as its stream grows) and
    when it was taken."""

    reservation: Reservation
    at: float
    adapter: str | None = None  # the LoRA adapter its request asks for
    # the prompt's leading tokens its backend was known to cache when it was routed there,
    # in a pool with prefill backends (gateway/front/prefill.py: what a prefill leg spares)
    cached: int = 0


class Ledger(Protocol):
    """Counts tokens and sessions in flight per backend; never negative, never over a limit."""

    async def reserve(
        self, backend: str, tokens: int, *, limit: int, shared: SharedBlocks = NO_BLOCKS
    ) -> Reservation | None:
        """Reserve `tokens` on `backend`, of which `shared` held once with other holders,
        if in-flight + its cost (`cost`) ≤ limit; else None."""
        ...

    def cost(self, backend: str, tokens: int, shared: SharedBlocks = NO_BLOCKS) -> int:
        """What reserving `tokens` (with `shared`) on `backend` would add to its tokens in
        flight now: the whole, less the shared blocks another holder there holds."""
        ...

    async def release(self, reservation: Reservation) -> None:
        """Give back all the reservation holds, grown or not; a second release is a no-op."""
        ...

    async def extend(self, reservation: Reservation, tokens: int) -> Reservation:
        """Add `tokens` to a held reservation whatever the limit (its request is running already);
        returns the reservation as it now stands (unchanged once released)."""
        ...

    def tokens_in_flight(self, backend: str) -> int:
        """Last known tokens in flight (a snapshot, for routing and metrics)."""
        ...

    def sessions(self, backend: str) -> int: ...

    def snapshot(self) -> Mapping[str, tuple[int, int]]:
        """backend → (tokens in flight, sessions)."""
        ...

    async def close(self) -> None: ...


class LocalLedger:
    def __init__(self) -> None:
        self._tokens: dict[str, int] = {}
        self._sessions: dict[str, int] = {}
        self._open: dict[str, Reservation] = {}
        self._holders = Holders()
        self._ids = itertools.count()

    async def reserve(
        self, backend: str, tokens: int, *, limit: int, shared: SharedBlocks = NO_BLOCKS
    ) -> Reservation | None:
        held = self._tokens.get(backend, 0)
        if held + (self.cost(backend, tokens, shared) if shared.keys else tokens) > limit:
            return None
        reservation = Reservation(backend, tokens, str(next(self._ids)), shared)
        if shared.keys:  # most requests share nothing: that path stays as cheap as it was
            tokens += self._holders.hold(backend, shared) - shared.tokens
        self._tokens[backend] = held + tokens
        self._sessions[backend] = self._sessions.get(backend, 0) + 1
        self._open[reservation.id] = reservation
        return reservation

    def cost(self, backend: str, tokens: int, shared: SharedBlocks = NO_BLOCKS) -> int:
        return self._holders.cost(backend, tokens, shared)

    async def release(self, reservation: Reservation) -> None:
        held = self._open.pop(reservation.id, None)
        if held is None:
            return
        freed = held.tokens
        if held.shared.keys:  # its own tokens, and the blocks it was the last to hold
            freed = held.own_tokens + self._holders.drop(held.backend, held.shared)
        self._tokens[held.backend] -= freed
        self._sessions[held.backend] -= 1

    async def extend(self, reservation: Reservation, tokens: int) -> Reservation:
        held = self._open.get(reservation.id)
        if held is None or tokens <= 0:
            return held or reservation
        grown = held._replace(tokens=held.tokens + tokens)
        self._open[held.id] = grown
        self._tokens[held.backend] += tokens
        return grown

    def tokens_in_flight(self, backend: str) -> int:
        return self._tokens.get(backend, 0)

    def sessions(self, backend: str) -> int:
        return self._sessions.get(backend, 0)

    def snapshot(self) -> Mapping[str, tuple[int, int]]:
        return {b: (t, self._sessions.get(b, 0)) for b, t in self._tokens.items()}

    async def close(self) -> None:
        return None
