"""The order in which queued requests get capacity: pure bookkeeping, no waiting.

Priority class first (critical, standard, sheddable), strictly: a lower class is never
admitted while a higher one waits. Within a class, tenants take turns: the tenant served
least recently goes first, so a tenant that floods the queue gets one turn per round like
everyone else. Within a tenant, arrival order. The waiter whose turn it is is never
overtaken, not even by smaller requests that would fit sooner: a flood of small requests
cannot starve a large one.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Generic, TypeVar

from gateway.config import PRIORITIES, Priority

T = TypeVar("T")


class QueueResult(StrEnum):
    """How a request's stay in the queue ended."""

    ADMITTED = "admitted"
    EVICTED_DEADLINE = "evicted_deadline"  # waited its whole budget
    EVICTED_CANCELLED = "evicted_cancelled"  # the client went away
    EVICTED_PREEMPTED = "evicted_preempted"  # a higher class needed its place in a full queue
    REJECTED_FULL = "rejected_full"
    REJECTED_NEVER_FITS = "rejected_never_fits"  # larger than any backend of the pool


@dataclass(eq=False, kw_only=True)
class Waiter(Generic[T]):
    tenant: str
    priority: Priority
    tokens: int
    item: T
    seq: int = field(default=0)


class FairQueue(Generic[T]):
    def __init__(self, *, max_depth: int) -> None:
        self.max_depth = max_depth
        self._classes: dict[Priority, dict[str, deque[Waiter[T]]]] = {p: {} for p in PRIORITIES}
        self._last_served: dict[str, int] = {}
        self._turns = itertools.count(1)
        self._arrivals = itertools.count()
        self._depth = 0

    def __len__(self) -> int:
        return self._depth

    def push(self, waiter: Waiter[T]) -> bool:
        """Add `waiter` at the back of its tenant's line; False when the queue is full."""
        if self._depth >= self.max_depth:
            return False
        waiter.seq = next(self._arrivals)
        self._classes[waiter.priority].setdefault(waiter.tenant, deque()).append(waiter)
        self._depth += 1
        return True

    def remove(self, waiter: Waiter[T]) -> bool:
        """Take `waiter` out; False if it was no longer queued."""
        tenants = self._classes[waiter.priority]
        line = tenants.get(waiter.tenant)
        if line is None or waiter not in line:
            return False
        line.remove(waiter)
        if not line:
            del tenants[waiter.tenant]
        self._depth -= 1
        return True

    def take(self, waiter: Waiter[T]) -> bool:
        """Remove `waiter` because it got capacity: its tenant's turn is used."""
        if not self.remove(waiter):
            return False
        self._last_served[waiter.tenant] = next(self._turns)
        return True

    def tokens(self) -> list[int]:
        """The tokens of every waiter, highest class first."""
        return [
            waiter.tokens
            for priority in PRIORITIES
            for line in self._classes[priority].values()
            for waiter in line
        ]

    def waiting_at_or_above(self, priority: Priority) -> bool:
        """Whether anyone of class `priority` or a higher one is waiting."""
        rank = PRIORITIES.index(priority)
        return any(self._classes[p] for p in PRIORITIES[: rank + 1])

    def best(self) -> Waiter[T] | None:
        """The waiter whose turn it is: highest class, then the tenant served least recently."""
        for priority in PRIORITIES:
            tenants = self._classes[priority]
            if tenants:
                return min(tenants.values(), key=self._turn_key)[0]
        return None

    def _turn_key(self, line: deque[Waiter[T]]) -> tuple[int, int]:
        return (self._last_served.get(line[0].tenant, 0), line[0].seq)

    def victim_for(self, priority: Priority) -> Waiter[T] | None:
        """The newest waiter of the lowest class below `priority`, to make room for it."""
        rank = PRIORITIES.index(priority)
        for lower in reversed(PRIORITIES[rank + 1 :]):
            lines = self._classes[lower].values()
            if lines:
                return max((line[-1] for line in lines), key=lambda w: w.seq)
        return None
