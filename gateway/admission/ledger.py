"""Tokens in flight per backend: reserve-if-it-fits and release, nothing else.

The local ledger is the embedded default; a Redis ledger with leases shares the same
truth across replicas.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from typing import NamedTuple, Protocol


class Reservation(NamedTuple):
    """What one admitted request holds on one backend (a NamedTuple: one per request)."""

    backend: str
    tokens: int
    lease: str


class Ledger(Protocol):
    """Counts tokens and sessions in flight per backend; never negative, never over a limit."""

    async def reserve(self, backend: str, tokens: int, *, limit: int) -> Reservation | None:
        """Reserve `tokens` on `backend` if in-flight + tokens ≤ limit; else None."""
        ...

    async def release(self, reservation: Reservation) -> None:
        """Give back exactly what the lease holds, grown or not; releasing twice is a no-op."""
        ...

    async def extend(self, reservation: Reservation, tokens: int) -> Reservation:
        """Add `tokens` to a held lease whatever the limit (its request is running already);
        returns the lease as it now stands (unchanged once released)."""
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
        self._ids = itertools.count()

    async def reserve(self, backend: str, tokens: int, *, limit: int) -> Reservation | None:
        held = self._tokens.get(backend, 0)
        if held + tokens > limit:
            return None
        reservation = Reservation(backend, tokens, str(next(self._ids)))
        self._tokens[backend] = held + tokens
        self._sessions[backend] = self._sessions.get(backend, 0) + 1
        self._open[reservation.lease] = reservation
        return reservation

    async def release(self, reservation: Reservation) -> None:
        held = self._open.pop(reservation.lease, None)
        if held is None:
            return
        self._tokens[held.backend] -= held.tokens
        self._sessions[held.backend] -= 1

    async def extend(self, reservation: Reservation, tokens: int) -> Reservation:
        held = self._open.get(reservation.lease)
        if held is None or tokens <= 0:
            return held or reservation
        grown = held._replace(tokens=held.tokens + tokens)
        self._open[held.lease] = grown
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
