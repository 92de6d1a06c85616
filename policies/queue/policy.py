"""Wait briefly for capacity: a release in the pool hands room to the waiter whose turn it is.

No polling: every release in the pool (PoolRoom.on_release) starts one drain, which reserves
for waiters in `FairQueue` order until the one whose turn it is does not fit. Each waiter
waits at most min(queue.max_wait_s, its tenant's TTFT budget); then it passes to the next
policy. A waiter whose client disconnects is cancelled by the pipeline and leaves the queue
at once; a reservation made for a waiter that has already left is given straight back.

`max_wait_s: auto` follows the pool's answers: room comes back as running answers end, so a
queue shorter than an answer would refuse what the pool serves a moment later, on a slow
fleet most of what it queues. It waits twice the pool's average hold (the time from a
reservation to its release), within [AUTO_FLOOR_S, AUTO_CEILING_S]: long enough for the
running answers to end and the drain to reach a waiter behind others, short enough that a
spike the pool cannot absorb still moves on to the next policy.

Its prediction for a request with a TTFT objective (gateway/slo.py): the pool's forecast of
when the request fits behind those already waiting, plus the pool's recent time to first
token once forwarded. `predicted_wait_s` is the queue's own count: the waiters that would
go before the request, times the measured interval between the queue's admissions.

The order among waiters follows each tenant's attained service (policies/queue/service.py):
the queue counts every request its pool admits, directly (`admitted`, from the request
path) or from the queue, and corrects it when the answer settles (`settled`).

Across replicas (shared mode, gateway/shared/service_feed.py) every replica orders by the
fleet's figures, and each tells the others the tenants waiting in its queue, at every pass
and, when they change, at once. When room frees, every replica's drain competes for it: a
waiter elsewhere of a higher class, or of the same class with clearly less service, holds
it against the turn here (policies/queue/fleet.py), and an arrival here queues rather than
take it. Without Redis, each replica drains in its own order.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

from gateway.clock import Clock
from gateway.config import PoolSettings, Priority
from gateway.errors import QueueFull
from gateway.outcome import Outcome
from gateway.overflow import (
    Latencies,
    OverflowContext,
    PoolRoom,
    Preempts,
    QueueFeed,
    QueueMetrics,
    Rival,
    Route,
    ServeHeld,
    predict,
)
from gateway.request import Endpoint, InferenceRequest
from policies.deps import PolicyDeps
from policies.queue.fair_queue import FairQueue, QueueResult, Waiter
from policies.queue.fleet import FleetWaiters
from policies.queue.service import Service
from policies.reject import RejectPolicy

log = logging.getLogger("spillgate.queue")
AUTO_FLOOR_S = 2.0  # also the wait before any answer has ended
AUTO_CEILING_S = 30.0
AUTO_HOLDS = 2.0  # average holds a waiter may wait
# what a full queue answers: QueueFull when no step after the queue serves
FULL = frozenset(
    {QueueResult.REJECTED_FULL, QueueResult.EVICTED_PREEMPTED, QueueResult.EVICTED_DISPLACED}
)


@dataclass(eq=False, kw_only=True)
class QueueEntry:
    request: InferenceRequest
    exchange: OverflowContext
    decided: asyncio.Future[QueueResult]
    enqueued_at: float


class QueuePolicy:
    name: ClassVar[str] = "queue"
    endpoints: ClassVar[frozenset[Endpoint]] = frozenset(Endpoint)
    serves_elsewhere: ClassVar[bool] = False
    moves_streams: ClassVar[bool] = True

    def __init__(
        self,
        pool: PoolSettings,
        *,
        room: PoolRoom,
        metrics: QueueMetrics,
        clock: Clock,
        ttft_budgets_s: Mapping[str, float],
        latencies: Latencies | None = None,
        feed: QueueFeed | None = None,
        preempts: Preempts | None = None,
    ) -> None:
        self._pool = pool.name
        self._preempts = preempts
        self._max_wait_s = pool.queue.max_wait_s
        self._room = room
        self._metrics = metrics
        self._clock = clock
        self._budgets = ttft_budgets_s
        self._latencies = Latencies(clock) if latencies is None else latencies
        fairness = pool.queue.fairness
        self.service = Service(
            clock=clock, output_weight=fairness.output_weight, half_life_s=fairness.half_life_s
        )
        self._queue: FairQueue[QueueEntry] = FairQueue(
            max_depth=pool.queue.max_depth,
            max_tokens=pool.queue.max_tokens,
            service=self.service.of,
        )
        after = (
            pool.overflow[pool.overflow.index(self.name) + 1 :]
            if self.name in pool.overflow
            else []
        )
        # only a refusal follows: a full queue is why a request it turns away is refused
        self._last_step = all(step == RejectPolicy.name for step in after)
        self._drainer: asyncio.Task[None] | None = None
        self._fleet = FleetWaiters(
            pool=pool.name,
            room=room,
            clock=clock,
            service=self.service.of,
            give_way_s=fairness.give_way_s,
        )
        self._feed = feed
        self._told: frozenset[tuple[Priority, str]] = frozenset()  # the waiting lines told
        self._release_gaps = Gaps()
        self._admission_gaps = Gaps()
        room.on_release(self._on_release)
        room.on_waiting(pool.name, self._queue.tokens)
        if feed is not None:
            feed.register(pool.name, self)

    @classmethod
    def build(cls, pool: PoolSettings, deps: PolicyDeps) -> QueuePolicy:
        budgets = {
            t.name: t.ttft_budget_ms / 1000
            for t in deps.settings.tenants
            if t.ttft_budget_ms is not None
        }
        return cls(
            pool,
            room=deps.room,
            metrics=deps.metrics,
            clock=deps.clock,
            ttft_budgets_s=budgets,
            latencies=deps.latencies,
            feed=deps.service_feed,
            preempts=deps.preempts,
        )

    def __len__(self) -> int:
        return len(self._queue)

    def lets_in(self, request: InferenceRequest) -> bool:
        """Whether a new arrival may take free room at once: nobody of its class or a higher
        one is waiting, here or (clearly ahead of it) at another replica. Otherwise it
        queues, so arrivals never overtake waiters."""
        if self._queue.waiting_at_or_above(request.priority):
            return False
        return (
            not self._fleet.rivals or self._fleet.ahead_of(request.priority, request.tenant) is None
        )

    def admitted(self, request: InferenceRequest) -> None:
        """The pool admitted `request` directly (CountsService)."""
        self.service.attain(request)

    def settled(
        self, request: InferenceRequest, prompt_tokens: int, completion_tokens: int
    ) -> None:
        """An answer of the pool settled with its usage (CountsService)."""
        self.service.settle(request, prompt_tokens, completion_tokens)

    def attained(self) -> dict[str, float]:
        return self.service.figures()

    def waiting_heads(self) -> list[tuple[Priority, str, int, int]]:
        """Each tenant waiting here by class, with its next request's sequence tokens and
        sequences: what the other replicas weigh their own turns against."""
        heads = []
        for waiter in self._queue.heads():
            request = waiter.item.request
            heads.append((waiter.priority, waiter.tenant, request.sequence_tokens, request.n))
        return heads

    def rivals_seen(self, rivals: list[Rival]) -> None:
        """The tenants waiting at the other replicas, as last read ([]: none, or unknown)."""
        self._fleet.seen(rivals)
        self._kick()  # one of them may have left, or been served

    def rivals_heard(self, replica: str, rivals: list[Rival]) -> None:
        """The tenants waiting at `replica` now, as it announced them."""
        self._fleet.heard(replica, rivals)
        self._kick()

    def predicted_wait_s(self, request: InferenceRequest) -> float | None:
        """The queue wait of `request` were it queued now: the waiters that would go before
        it, times the measured interval between the queue's admissions (between the pool's
        releases while none was measured); with none before it, the interval between
        releases. None while neither was measured."""
        now = self._clock.monotonic()
        ahead = self._queue.ahead_of(
            request.tenant, request.priority, now + self.max_wait_s(request)
        )
        release = self._release_gaps.mean_s
        if ahead == 0:
            return release
        interval = self._admission_gaps.mean_s or release
        return None if interval is None else ahead * interval

    def predict_ttft_s(self, request: InferenceRequest) -> float | None:
        # room for its tokens, and its turn: the pool's forecast of when the request fits
        # knows nothing of the waiters the fair order puts before it
        wait = self._room.wait_s(self._pool, request.sequence_tokens, sequences=request.n)
        turn = self.predicted_wait_s(request)
        if turn is not None and turn > wait:
            wait = turn
        forwarded = predict(self._latencies.local, self._pool, request)
        return wait + (forwarded or 0.0)

    def max_wait_s(self, request: InferenceRequest) -> float:
        if self._max_wait_s == "auto":
            hold = self._room.hold_s(self._pool) or 0.0
            wait = min(max(AUTO_HOLDS * hold, AUTO_FLOOR_S), AUTO_CEILING_S)
        else:
            wait = self._max_wait_s
        # the request's own TTFT objective, else its tenant's
        slo = request.ttft_slo_s
        return min(wait, self._budgets.get(request.tenant, math.inf) if slo is None else slo)

    async def decide(
        self, request: InferenceRequest, exchange: OverflowContext
    ) -> ServeHeld | None:
        started = self._clock.monotonic()
        result = await self.wait(request, exchange)
        if result is not QueueResult.ADMITTED:
            log.debug("%s/%s left the queue: %s", request.pool, request.tenant, result)
            if result in FULL and self._last_step:
                raise QueueFull(
                    f"The queue of pool {request.pool!r} is full"
                    + (
                        "."
                        if result is QueueResult.REJECTED_FULL
                        else ", and a request that goes first took this one's place."
                    )
                    + " Retry after the indicated delay.",
                    retry_after=exchange.retry_after(request),
                )
            return None
        exchange.note_time("queue", self._clock.monotonic() - started)
        if not exchange.moving:  # a stopped request's service counted when it first came
            self.service.attain(request)
        # should its backend fail it before a byte while the rest are full, it passes on
        return ServeHeld(request, Outcome.QUEUED)

    async def wait(self, request: InferenceRequest, exchange: OverflowContext) -> QueueResult:
        """Wait until the request holds a reservation in its pool (ADMITTED), or say why not."""
        fits = self._room.fits_ever(Route.of(request))
        if not fits:
            return QueueResult.REJECTED_NEVER_FITS
        entry = QueueEntry(
            request=request,
            exchange=exchange,
            decided=asyncio.get_running_loop().create_future(),
            enqueued_at=self._clock.monotonic(),
        )
        max_wait_s = self.max_wait_s(request)
        waiter = Waiter(
            tenant=request.tenant,
            priority=request.priority,
            tokens=self._room.pool_kv_tokens(
                request.pool, request.sequence_tokens, sequences=request.n
            ),
            item=entry,
            deadline=entry.enqueued_at + max_wait_s,
        )
        if not self._enqueue(waiter):
            return QueueResult.REJECTED_FULL
        # a timer of its own, not the request path's Deadline: one per queued request, off
        # the path every request takes; whichever decides first, the drain or the timer, wins
        expiry = self._clock.call_later(
            max_wait_s, functools.partial(_decide, entry.decided, QueueResult.EVICTED_DEADLINE)
        )
        try:
            return await entry.decided
        except asyncio.CancelledError:
            log.debug("%s/%s: %s", request.pool, request.tenant, QueueResult.EVICTED_CANCELLED)
            raise
        finally:
            expiry.cancel()
            self._leave(waiter)

    def _enqueue(self, waiter: Waiter[QueueEntry]) -> bool:
        if not self._queue.push(waiter):
            victims = self._queue.victims_for(waiter)
            if not victims:  # None: evicting every lower waiter would not make room
                return False
            for victim in victims:
                self._queue.remove(victim)
                _decide(
                    victim.item.decided,
                    QueueResult.EVICTED_PREEMPTED
                    if victim.priority != waiter.priority
                    else QueueResult.EVICTED_DISPLACED,
                )
                self._metrics.queue_displaced.labels(self._pool, victim.tenant).inc()
            self._queue.push(waiter)
        self._depth_changed()
        self._kick()
        return True

    def _leave(self, waiter: Waiter[QueueEntry]) -> None:
        entry = waiter.item
        if self._queue.remove(waiter) and not entry.decided.done():
            entry.decided.cancel()
        self._depth_changed()
        self._metrics.queue_wait.labels(self._pool, waiter.priority).observe(
            self._clock.monotonic() - entry.enqueued_at
        )
        self._kick()  # a waiter that blocked the head may have let others fit

    def _depth_changed(self) -> None:
        self._metrics.queue_depth.labels(self._pool).set(len(self._queue))
        if self._feed is not None:
            lines = self._queue.lines()
            if lines != self._told:  # a tenant started or stopped waiting here
                self._told = lines
                self._feed.announce(self._pool, self.waiting_heads())

    def _on_release(self, pool: str) -> None:
        if pool == self._pool:
            # an idle stretch is no interval of a busy pool: a full pool releases at
            # least once per average hold
            self._release_gaps.note(self._clock.monotonic(), cap_s=self._room.hold_s(pool))
            self._kick()

    def _kick(self) -> None:
        if len(self._queue) and (self._drainer is None or self._drainer.done()):
            self._drainer = asyncio.get_running_loop().create_task(self._drain())

    async def _drain(self) -> None:
        # the lines of waiters for an adapter with no room on the backends serving it: they
        # do not hold back a waiter that may go where they cannot
        passed: set[tuple[Priority, str]] = set()
        try:
            while (waiter := self._queue.best(passed)) is not None:
                entry = waiter.item
                if entry.decided.done():  # cancelled; its own task has not run yet
                    self._queue.remove(waiter)
                    continue
                request = entry.request
                route = Route.of(request)
                if not self._room.has_room(route):
                    if request.adapter is not None or request.avoid:
                        # it may go to some backends only: room on the others is not
                        # its, and its line must not hold back the lines behind it
                        passed.add((waiter.priority, waiter.tenant))
                        continue
                    if waiter.priority != "sheddable":
                        self._make_room(route, waiter.priority)
                    return  # the next release, or this waiter leaving, drains again
                if self._fleet.rivals and self._fleet.gives_way(
                    waiter.priority, waiter.tenant, self._kick
                ):
                    return  # a timer, a release or word from the others drains again
                reservation = await entry.exchange.reserve(entry.request)
                if reservation is None:
                    return  # the room went elsewhere; the next release drains again
                if entry.decided.done() or not self._queue.take(waiter):
                    self._queue.remove(waiter)
                    await self._room.release(reservation)  # it left while we reserved
                    continue
                entry.exchange.take(reservation)
                entry.decided.set_result(QueueResult.ADMITTED)
                self._fleet.served()
                now = self._clock.monotonic()
                self._admission_gaps.note(now)
                if not len(self._queue):  # the next admission's gap would include idle time
                    self._admission_gaps.pause()
                self._depth_changed()
        except Exception:
            log.exception("draining the queue of pool %s failed", self._pool)

    def _make_room(self, route: Route, priority: Priority) -> None:
        """Have lower-class work in flight give way to a waiter of `priority` that does not
        fit: here, else (shared mode) at another replica; its release drains again."""
        if self._preempts is None or self._preempts.make_room(route, priority):
            return
        if self._feed is not None:
            self._feed.call_preemption(self._pool, priority, route.tokens, route.sequences)


def _decide(decided: asyncio.Future[QueueResult], result: QueueResult) -> None:
    if not decided.done():
        decided.set_result(result)


class Gaps:
    """The mean interval between events (an average moving a fifth of the way to each)."""

    def __init__(self) -> None:
        self.mean_s: float | None = None
        self._last: float | None = None

    def note(self, now: float, *, cap_s: float | None = None) -> None:
        if self._last is not None:
            gap = now - self._last if cap_s is None else min(now - self._last, cap_s)
            self.mean_s = gap if self.mean_s is None else self.mean_s + 0.2 * (gap - self.mean_s)
        self._last = now

    def pause(self) -> None:
        """The next event starts a new interval rather than end one."""
        self._last = None
