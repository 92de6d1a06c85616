"""The shared ledger's bookkeeping: this replica's grant of each backend, and the totals.

A grant is what Redis granted this replica of one backend's room, counted here: what its
admitted requests hold, what the other replicas were granted, and what this replica's part
of Redis's totals was when Redis last answered. The totals (`Seen`) are every replica's
requests on a backend as Redis last reported them; this replica's own part of them is
replaced by what its grant holds now, so its own admissions and releases count at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import ItemsView, Iterable, Iterator, ValuesView
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class Seen:
    """A backend's totals as Redis last reported them; `seq` orders the reports."""

    tokens: int = 0
    sessions: int = 0
    seq: int = 0


Ask = tuple[int, int, asyncio.Future[bool | None]]  # tokens, limit, the answer awaited


def unanswered(asks: list[Ask]) -> None:
    """Tell the asks still waiting that Redis did not answer: the share decides."""
    for *_, waiter in asks:
        if not waiter.done():
            waiter.set_result(None)


@dataclass(slots=True, eq=False)
class Grant:
    """This replica's share of one backend: what Redis granted it, what its requests hold."""

    granted: int = 0  # as of Redis's last answer
    used: int = 0  # tokens of the requests admitted here
    sessions: int = 0
    others: int = 0  # granted to the other replicas, as of the last answer
    limit: int = 0  # the limit the last reservation was asked under
    reported: tuple[int, int] = (0, 0)  # (tokens, sessions) of this replica in Redis's totals
    contended: bool = False  # an ask was refused lately: spare goes back at once
    asks: list[Ask] = field(default_factory=list)
    sent: asyncio.Future[Any] | None = None  # the call on its way (one at a time)

    def take(self, tokens: int) -> None:
        self.used += tokens
        self.sessions += 1

    def give(self, tokens: int) -> None:
        self.used -= tokens
        self.sessions -= 1

    def fits(self, tokens: int, limit: int) -> bool:
        """Whether `tokens` more fit in the grant and under `limit` beside the others."""
        used = self.used + tokens
        return used <= self.granted and self.others + used <= limit

    def excess(self, spare_permille: int) -> int:
        """What the grant holds beyond its requests that it should give back now: all of
        it when contended, else once it is over twice the spare it would be granted now."""
        excess = self.granted - self.used
        if excess <= 0 or self.contended:
            return max(0, excess)
        free = max(0, self.limit - self.others - self.used)
        return excess if excess > 2 * free * spare_permille // 1000 else 0


class Grants:
    """Per backend, this replica's grant and the totals Redis last reported."""

    def __init__(self, backends: Iterable[str]) -> None:
        self._seen: dict[str, Seen] = {b: Seen() for b in backends}
        self._grants: dict[str, Grant] = {b: Grant() for b in self._seen}

    def __iter__(self) -> Iterator[str]:
        """Every backend with totals known here."""
        return iter(self._seen)

    def items(self) -> ItemsView[str, Grant]:
        return self._grants.items()

    def values(self) -> ValuesView[Grant]:
        return self._grants.values()

    def get(self, backend: str) -> Grant | None:
        return self._grants.get(backend)

    def grant(self, backend: str) -> Grant:
        """The backend's grant, a new empty one for a backend not known yet."""
        grant = self._grants.get(backend)
        if grant is None:
            grant = self._grants[backend] = Grant()
            self._seen[backend] = Seen()
        return grant

    def observe(self, backend: str, seen: Seen) -> None:
        """Take a report of a backend's totals unless a later one was already taken."""
        if seen.seq >= self._seen.get(backend, Seen()).seq:
            self._seen[backend] = seen

    def refreshed(self, backend: str, seen: Seen) -> None:
        """Take the totals this replica's refresh read: fresh, so taken even when Redis
        restarted and numbers its reports from the start again."""
        self._seen[backend] = seen

    def in_flight(self, backend: str) -> tuple[int, int]:
        """(tokens, sessions) on `backend`: this replica's own as they stand, the others'
        as Redis last reported them."""
        grant = self.grant(backend)
        seen = self._seen.get(backend, Seen())
        tokens, sessions = grant.reported
        return (
            max(0, seen.tokens - tokens) + grant.used,
            max(0, seen.sessions - sessions) + grant.sessions,
        )
