"""The order in which queued requests get capacity: pure bookkeeping, no waiting.

Priority class first (critical, standard, sheddable), strictly: a lower class is never
admitted while a higher one waits. Within a class, the tenant with the least attained
service goes first (the tokens it was served lately, policies/queue/service.py), so a
tenant that floods the pool falls behind one that asks for little; between tenants with
the same service, the one served least recently. Within a tenant, the earliest deadline
(when it queued plus the lesser of its wait limit and its TTFT objective), then arrival.
The waiter whose turn it is is never overtaken, not even by smaller requests that would
fit sooner: a flood of small requests cannot starve a large one.

Each queue is bounded in waiters (`max_depth`) and in the KV tokens they would reserve
all together (`max_tokens`). A full queue makes room for an arrival by pushing out waiters
that would go after it anyway: first those of lower classes, the newest of the lowest class
first; then, of its own class, the newest waiters of the tenant with the most service, as
long as that tenant was served more than the arrival's. Fair queueing drops from the
fattest flow the same way: whoever fills the queue first cannot keep a light tenant out,
and a heavy tenant loses the requests it sent last, not those about to be served. An
arrival that nobody ranks below is refused.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable, Collection, Iterable, Iterator
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
    EVICTED_DISPLACED = "evicted_displaced"  # a lighter tenant needed its place in a full queue
    REJECTED_FULL = "rejected_full"
    REJECTED_NEVER_FITS = "rejected_never_fits"  # larger than any backend of the pool


@dataclass(eq=False, kw_only=True)
class Waiter(Generic[T]):
    tenant: str
    priority: Priority
    tokens: int
    item: T
    deadline: float = math.inf  # its tenant's line is ordered by it, then by arrival
    seq: int = field(default=0)

    def __lt__(self, other: Waiter[T]) -> bool:
        return (self.deadline, self.seq) < (other.deadline, other.seq)


def _no_service(tenant: str) -> float:
    return 0.0


class FairQueue(Generic[T]):
    def __init__(
        self,
        *,
        max_depth: int,
        max_tokens: int | None = None,
        service: Callable[[str], float] = _no_service,
    ) -> None:
        self.max_depth = max_depth
        self.max_tokens = math.inf if max_tokens is None else max_tokens
        self._service = service
        # per class, per tenant: a heap ordered by deadline, then arrival
        self._classes: dict[Priority, dict[str, list[Waiter[T]]]] = {p: {} for p in PRIORITIES}
        self._last_served: dict[str, int] = {}
        self._turns = itertools.count(1)
        self._arrivals = itertools.count()
        self._depth = 0
        self._tokens = 0

    def __len__(self) -> int:
        return self._depth

    @property
    def tokens_waiting(self) -> int:
        return self._tokens

    def _fits(self, waiter: Waiter[T], *, depth: int, tokens: int) -> bool:
        return depth < self.max_depth and tokens + waiter.tokens <= self.max_tokens

    def push(self, waiter: Waiter[T]) -> bool:
        """Add `waiter` to its tenant's line; False when the queue is full."""
        if not self._fits(waiter, depth=self._depth, tokens=self._tokens):
            return False
        waiter.seq = next(self._arrivals)
        heapq.heappush(self._classes[waiter.priority].setdefault(waiter.tenant, []), waiter)
        self._depth += 1
        self._tokens += waiter.tokens
        return True

    def remove(self, waiter: Waiter[T]) -> bool:
        """Take `waiter` out; False if it was no longer queued."""
        tenants = self._classes[waiter.priority]
        line = tenants.get(waiter.tenant)
        if line is None:
            return False
        if line[0] is waiter:
            heapq.heappop(line)
        else:
            try:
                line.remove(waiter)  # by identity: waiters compare equal only to themselves
            except ValueError:
                return False
            heapq.heapify(line)
        if not line:
            del tenants[waiter.tenant]
        self._depth -= 1
        self._tokens -= waiter.tokens
        return True

    def take(self, waiter: Waiter[T]) -> bool:
        """Remove `waiter` because it got capacity: its tenant's turn is used."""
        if not self.remove(waiter):
            return False
        self._last_served[waiter.tenant] = next(self._turns)
        return True

    def tokens(self) -> list[int]:
        """The tokens of every waiter, highest class first."""
        return [waiter.tokens for waiter in self.waiters()]

    def waiters(self) -> Iterator[Waiter[T]]:
        """Every waiter, highest class first (in no order within a class)."""
        for priority in PRIORITIES:
            for line in self._classes[priority].values():
                yield from line

    def heads(self) -> Iterator[Waiter[T]]:
        """The first waiter of each tenant's line, highest class first."""
        for priority in PRIORITIES:
            for line in self._classes[priority].values():
                yield line[0]

    def lines(self) -> frozenset[tuple[Priority, str]]:
        """Each class and tenant with a waiter."""
        return frozenset((p, tenant) for p in PRIORITIES for tenant in self._classes[p])

    def waiting_at_or_above(self, priority: Priority) -> bool:
        """Whether anyone of class `priority` or a higher one is waiting."""
        rank = PRIORITIES.index(priority)
        return any(self._classes[p] for p in PRIORITIES[: rank + 1])

    def best(self, passed: Collection[tuple[Priority, str]] = ()) -> Waiter[T] | None:
        """The waiter whose turn it is: highest class, then the tenant with the least
        service (the one served least recently among equals), then its earliest deadline;
        the lines `passed` over (class, tenant) left out."""
        for priority in PRIORITIES:
            tenants = self._classes[priority]
            lines: Collection[list[Waiter[T]]] = tenants.values()
            if passed:
                lines = [line for t, line in tenants.items() if (priority, t) not in passed]
            if lines:
                return min(lines, key=self._turn_key)[0]
        return None

    def _turn_key(self, line: list[Waiter[T]]) -> tuple[float, int, int]:
        head = line[0]
        return (self._service(head.tenant), self._last_served.get(head.tenant, 0), head.seq)

    def ahead_of(
        self, tenant: str, priority: Priority, deadline: float, *, service: float | None = None
    ) -> int:
        """How many waiters would go before a request of `tenant` queued now with
        `deadline`, in the order of this moment: every waiter of a higher class; of its
        class, those of tenants with less service (or as much, served no later: among
        equals a newcomer goes last), and its own tenant's with no later a deadline."""
        rank = PRIORITIES.index(priority)
        ahead = sum(len(line) for p in PRIORITIES[:rank] for line in self._classes[p].values())
        mine = (
            self._service(tenant) if service is None else service,
            self._last_served.get(tenant, 0),
        )
        for name, line in self._classes[priority].items():
            if name == tenant:
                ahead += sum(w.deadline <= deadline for w in line)
            elif (self._service(name), self._last_served.get(name, 0)) <= mine:
                ahead += len(line)
        return ahead

    def victims_for(self, waiter: Waiter[T]) -> list[Waiter[T]] | None:
        """The waiters to push out so that `waiter` fits, in the order they go (see the
        module's docstring); [] when it fits already, None when pushing out every waiter
        ranked below it would not make room."""
        depth, tokens = self._depth, self._tokens
        if self._fits(waiter, depth=depth, tokens=tokens):
            return []
        if waiter.tokens > self.max_tokens:
            return None
        victims: list[Waiter[T]] = []
        for victim in self._ranked_below(waiter):
            victims.append(victim)
            depth, tokens = depth - 1, tokens - victim.tokens
            if self._fits(waiter, depth=depth, tokens=tokens):
                return victims
        return None

    def _ranked_below(self, waiter: Waiter[T]) -> Iterator[Waiter[T]]:
        rank = PRIORITIES.index(waiter.priority)
        for lower in reversed(PRIORITIES[rank + 1 :]):
            yield from _newest_first(w for line in self._classes[lower].values() for w in line)
        mine = self._service(waiter.tenant)
        lines = self._classes[waiter.priority]
        heavier = [(self._service(name), name) for name in lines if name != waiter.tenant]
        for service, name in sorted(heavier, reverse=True):
            if service <= mine:
                return
            yield from _newest_first(lines[name])


def _newest_first(waiters: Iterable[Waiter[T]]) -> list[Waiter[T]]:
    return sorted(waiters, key=lambda w: -w.seq)
