"""The reservation one request holds, and the one place that writes it.

A request holds at most one reservation at a time, on one backend. It takes it on
admission (or from the queue's drain, which reserves for it), when a retry or a stream's
continuation moves it to another backend, grows it as its stream outgrows it
(gateway/admission/ledger/growth.py), and releases it once, whatever ends the request. Each of
those goes through this object, so that no path can leak a reservation or release one
twice.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Protocol

from gateway.admission.ledger.reservations import Reservation


class Releases(Protocol):
    """What gives reservations back and grows them (the router)."""

    def release(self, reservation: Reservation) -> Awaitable[None]: ...

    async def extend(self, reservation: Reservation, tokens: int) -> Reservation: ...


async def _nothing() -> None:
    """Nothing to release: the request holds no reservation."""


class HeldReservation:
    __slots__ = ("_releases", "_reservation")  # one per request

    def __init__(self, releases: Releases) -> None:
        self._releases = releases
        self._reservation: Reservation | None = None

    @property
    def reservation(self) -> Reservation | None:
        return self._reservation

    @property
    def backend(self) -> str | None:
        """The backend the request holds room on, if any."""
        return None if self._reservation is None else self._reservation.backend

    def take(self, reservation: Reservation | None) -> bool:
        """Hold `reservation` (None: no room was found); whether the request now holds one.
        It holds none before: a second would leak the first."""
        assert self._reservation is None, "a request holds one reservation at a time"
        self._reservation = reservation
        return reservation is not None

    async def grow(self, tokens: int) -> None:
        """Extend the reservation by `tokens` (a stream that outgrew it)."""
        if self._reservation is not None:
            self._reservation = await self._releases.extend(self._reservation, tokens)

    def release(self) -> Awaitable[None]:
        """The release to await (the router's own: one frame fewer per request); nothing
        to release when the request holds no reservation."""
        reservation, self._reservation = self._reservation, None
        if reservation is None:
            return _nothing()
        return self._releases.release(reservation)
