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
token once forwarded.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

from gateway.clock import Clock
from gateway.config import PoolSettings
from gateway.front.exchange import Served
from gateway.front.request import InferenceRequest
from gateway.outcome import Outcome
from gateway.overflow import Latencies, OverflowContext, PoolRoom, QueueMetrics, predict
from policies.deps import PolicyDeps
from policies.queue.fair_queue import FairQueue, QueueResult, Waiter

log = logging.getLogger("spillgate.queue")
AUTO_FLOOR_S = 2.0  # also the wait before any answer has ended
AUTO_CEILING_S = 30.0
AUTO_HOLDS = 2.0  # average holds a waiter may wait


@dataclass(eq=False, kw_only=True)
class QueueEntry:
    request: InferenceRequest
    exchange: OverflowContext
    decided: asyncio.Future[QueueResult]
    enqueued_at: float


class QueuePolicy:
    name: ClassVar[str] = "queue"

    def __init__(
        self,
        pool: PoolSettings,
        *,
        room: PoolRoom,
        metrics: QueueMetrics,
        clock: Clock,
        ttft_budgets_s: Mapping[str, float],
        latencies: Latencies | None = None,
    ) -> None:
        self._pool = pool.name
        self._max_wait_s = pool.queue.max_wait_s
        self._room = room
        self._metrics = metrics
        self._clock = clock
        self._budgets = ttft_budgets_s
        self._latencies = Latencies(clock) if latencies is None else latencies
        self._queue: FairQueue[QueueEntry] = FairQueue(max_depth=pool.queue.max_depth)
        self._drainer: asyncio.Task[None] | None = None
        room.on_release(self._on_release)
        room.on_waiting(pool.name, self._queue.tokens)

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
        )

    def __len__(self) -> int:
        return len(self._queue)

    def lets_in(self, request: InferenceRequest) -> bool:
        """Whether a new arrival may take free room at once: nobody of its class or a higher
        one is waiting. Otherwise it queues, so arrivals never overtake waiters."""
        return not self._queue.waiting_at_or_above(request.priority)

    def predict_ttft_s(self, request: InferenceRequest) -> float | None:
        wait = self._room.wait_s(self._pool, request.sequence_tokens, sequences=request.n)
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

    async def serve(self, request: InferenceRequest, exchange: OverflowContext) -> Served | None:
        started = self._clock.monotonic()
        result = await self.wait(request, exchange)
        if result is not QueueResult.ADMITTED:
            log.debug("%s/%s left the queue: %s", request.pool, request.tenant, result)
            return None
        exchange.note_time("queue", self._clock.monotonic() - started)
        return await exchange.serve_local(request, Outcome.QUEUED)

    async def wait(self, request: InferenceRequest, exchange: OverflowContext) -> QueueResult:
        """Wait until the request holds a reservation in its pool (ADMITTED), or say why not."""
        if not self._room.fits_ever(request.pool, request.sequence_tokens, sequences=request.n):
            return QueueResult.REJECTED_NEVER_FITS
        entry = QueueEntry(
            request=request,
            exchange=exchange,
            decided=asyncio.get_running_loop().create_future(),
            enqueued_at=self._clock.monotonic(),
        )
        waiter = Waiter(
            tenant=request.tenant,
            priority=request.priority,
            tokens=self._room.pool_kv_tokens(
                request.pool, request.sequence_tokens, sequences=request.n
            ),
            item=entry,
        )
        if not self._enqueue(waiter):
            return QueueResult.REJECTED_FULL
        try:
            # asyncio's own timeout, not the request path's Deadline: one per queued
            # request, off the path every request takes
            async with asyncio.timeout(self.max_wait_s(request)):
                await entry.decided
        except TimeoutError:
            pass
        except asyncio.CancelledError:
            log.debug("%s/%s: %s", request.pool, request.tenant, QueueResult.EVICTED_CANCELLED)
            raise
        finally:
            self._leave(waiter)
        if entry.decided.done() and not entry.decided.cancelled():
            return entry.decided.result()  # decided even if the deadline fired meanwhile
        return QueueResult.EVICTED_DEADLINE

    def _enqueue(self, waiter: Waiter[QueueEntry]) -> bool:
        if not self._queue.push(waiter):
            victim = self._queue.victim_for(waiter.priority)
            if victim is None:
                return False
            self._queue.remove(victim)
            victim.item.decided.set_result(QueueResult.EVICTED_PREEMPTED)
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

    def _on_release(self, pool: str) -> None:
        if pool == self._pool:
            self._kick()

    def _kick(self) -> None:
        if len(self._queue) and (self._drainer is None or self._drainer.done()):
            self._drainer = asyncio.get_running_loop().create_task(self._drain())

    async def _drain(self) -> None:
        try:
            while (waiter := self._queue.best()) is not None:
                entry = waiter.item
                if entry.decided.done():  # cancelled; its own task has not run yet
                    self._queue.remove(waiter)
                    continue
                request = entry.request
                if not self._room.has_room(
                    self._pool, request.sequence_tokens, sequences=request.n
                ):
                    return  # the next release, or this waiter leaving, drains again
                reservation = await entry.exchange.reserve(entry.request)
                if reservation is None:
                    return  # the room went elsewhere; the next release drains again
                if entry.decided.done() or not self._queue.take(waiter):
                    self._queue.remove(waiter)
                    await self._room.release(reservation)  # it left while we reserved
                    continue
                entry.exchange.hold(reservation)
                entry.decided.set_result(QueueResult.ADMITTED)
                self._depth_changed()
        except Exception:
            log.exception("draining the queue of pool %s failed", self._pool)
