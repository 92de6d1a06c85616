"""The shared in-flight ledger: every replica reserves on the same per-backend leases in Redis.

A reservation is a lease (ledger.lua): per backend a ZSET of lease → expiry and a HASH of
lease → tokens, the backend's total kept equal to the sum of its live leases inside the
script, so it can neither drift nor go negative. Reserve-if-it-fits and release are single
script calls, timed by Redis TIME. The replica holding a lease renews it every third of the
TTL while the request streams, so a replica killed with kill -9 frees its reservations
within the TTL. Every `refresh_s` one pipelined call renews what is due and the leases of
backends where a stream's lease grew (extend: each lease carries its tokens), retries releases
Redis never confirmed and reads every backend's totals: the snapshot routing and metrics
use, also updated by every reply and (through ReleaseFeed) every published release.

Failure mode, "local": a call that fails or outlives `timeout_s` switches the ledger to
local admission, where each process admits on its own leases against limit ÷
`fallback_share` (replicas × workers), so the fleet stays under each limit while Redis is
away and no request waits on Redis meanwhile. The refresh keeps probing; when Redis answers
it restores this replica's live leases that Redis lost (a restart), then shared admission
resumes, for RECOVERY_REFRESHES refreshes still capped at the share, until every replica
has restored its own. Mode changes go to `on_mode_change`, failed calls to `on_store_error`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import secrets
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from importlib import resources
from typing import Any, Literal, TypeVar

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from gateway.admission.ledger import Reservation
from gateway.clock import Clock
from gateway.redis_batch import BatchScript, RedisBatcher, batcher_of
from gateway.tasks import stop_task
from gateway.upstream.deadline import Deadline

log = logging.getLogger("spillgate.ledger")

LedgerMode = Literal["shared", "local"]
RECOVERY_REFRESHES = 3
REFRESH_BUDGET = 4  # the refresh pipeline may take this many request time budgets
T = TypeVar("T")


def ledger_script() -> str:
    return resources.files("gateway.admission").joinpath("ledger.lua").read_text("utf-8")


@dataclass(frozen=True, slots=True)
class Seen:
    """A backend's totals as Redis last reported them; `seq` orders the reports."""

    tokens: int = 0
    sessions: int = 0
    seq: int = 0


def parse_reply(reply: Any) -> tuple[int, Seen, list[str]]:
    """(status, totals, restored lease ids) from a ledger.lua reply."""
    status, total, sessions, seq, *restored = reply
    ids = [r.decode() if isinstance(r, bytes) else str(r) for r in restored]
    return int(status), Seen(int(total), int(sessions), int(seq)), ids


def _ignore(*_: object) -> None:
    return None


class RedisLedger:
    def __init__(
        self,
        redis: RedisBatcher | aioredis.Redis,
        *,
        backends: Iterable[str],
        clock: Clock,
        key_prefix: str = "spillgate",
        lease_ttl_s: float = 10.0,
        refresh_s: float = 0.2,
        timeout_s: float = 0.05,
        timeout_max_s: float | None = None,
        fallback_share: int = 1,
        replica_id: str | None = None,
        on_store_error: Callable[[], None] = _ignore,
        on_mode_change: Callable[[str], None] = _ignore,
    ) -> None:
        if lease_ttl_s <= 0 or refresh_s <= 0 or timeout_s <= 0 or fallback_share < 1:
            raise ValueError("lease_ttl_s, refresh_s and timeout_s must be > 0, share >= 1")
        self._batch = batcher_of(redis)
        self._script = BatchScript(ledger_script())
        self._clock = clock
        self._prefix = key_prefix
        self._ttl_ms = max(1, round(lease_ttl_s * 1000))
        self._renew_every_s = lease_ttl_s / 3
        self._refresh_s = refresh_s
        self._timeout_s = timeout_s
        self._timeout_max_s = max(timeout_s, timeout_max_s or timeout_s)
        self._share = fallback_share
        self.replica_id = replica_id or secrets.token_hex(6)
        self.channel = f"{key_prefix}:ledger:released"
        self._on_store_error = on_store_error
        self._on_mode_change = on_mode_change
        self._seen: dict[str, Seen] = {b: Seen() for b in backends}
        self._held: dict[str, Reservation] = {}  # admitted leases of this process: renewed
        self._own: dict[str, tuple[int, int]] = {}  # held and being reserved, per backend
        self._in_store: set[str] = set()  # held leases Redis has (or may have) seen
        self._unconfirmed: dict[str, tuple[Reservation, float]] = {}  # released here only
        self._growing: set[str] = set()  # backends with leases grown since the last refresh
        self._ids = itertools.count()
        self._mode: LedgerMode = "shared"
        self._capped_until = -math.inf
        self._renew_due = -math.inf
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        on_mode_change(self._mode)

    @property
    def mode(self) -> LedgerMode:
        return self._mode

    def keys(self, backend: str) -> list[str]:
        """The leases, tokens and meta keys of a backend; one hash slot for all three."""
        base = f"{self._prefix}:ledger:{{{backend}}}"
        return [f"{base}:leases", f"{base}:tokens", f"{base}:meta"]

    # -- the Ledger role ------------------------------------------------------------------

    async def reserve(self, backend: str, tokens: int, *, limit: int) -> Reservation | None:
        lease = Reservation(backend, tokens, f"{self.replica_id}:{next(self._ids)}")
        capped = self._mode == "local" or self._clock.monotonic() < self._capped_until
        self._claim(lease, +1)  # counted as this process's own while Redis is asked
        admitted: bool | None = None
        if not (capped and self._over_share(backend, limit)):
            try:
                admitted = await self._reserve_shared(lease, limit)
            except BaseException:  # cancelled: give back whatever Redis may have reserved
                self._refused(lease)
                raise
            if admitted is None:  # Redis did not answer (or is not asked): the share decides
                admitted = not self._over_share(backend, limit)
        if not admitted:
            self._refused(lease)
            return None
        self._held[lease.lease] = lease
        return lease

    def _refused(self, lease: Reservation) -> None:
        self._claim(lease, -1)
        if lease.lease in self._in_store:  # unanswered: it may hold a lease in Redis
            self._in_store.discard(lease.lease)
            self._unconfirmed[lease.lease] = (lease, self._clock.monotonic())

    async def release(self, reservation: Reservation) -> None:
        held = self._held.pop(reservation.lease, None)
        if held is None:
            return
        reservation = held  # what the lease holds now: grown, perhaps
        self._claim(reservation, -1)
        if reservation.lease not in self._in_store:
            return
        self._in_store.discard(reservation.lease)
        self._unconfirmed[reservation.lease] = (reservation, self._clock.monotonic())
        reply = await self._ask(
            lambda: self._call(
                "release", reservation.backend, reservation.lease, budget_s=self.budget_s()
            )
        )
        if reply is not None:
            self._unconfirmed.pop(reservation.lease, None)
            self.observe(reservation.backend, parse_reply(reply)[1])

    async def extend(self, reservation: Reservation, tokens: int) -> Reservation:
        """Grow a held lease: counted here at once, and in Redis by the next refresh, which
        renews the backend's leases with their tokens (a stream grows every block: one
        pipelined call per refresh carries them all, not a round trip per block)."""
        held = self._held.get(reservation.lease)
        if held is None or tokens <= 0:
            return held or reservation
        grown = held._replace(tokens=held.tokens + tokens)
        self._held[held.lease] = grown
        own, sessions = self._own.get(held.backend, (0, 0))
        self._own[held.backend] = (own + tokens, sessions)
        self._growing.add(held.backend)
        return grown

    def tokens_in_flight(self, backend: str) -> int:
        own = self._own.get(backend, (0, 0))[0]
        if self._mode == "local":
            return own * self._share
        return max(own, self._seen.get(backend, Seen()).tokens)

    def sessions(self, backend: str) -> int:
        own = self._own.get(backend, (0, 0))[1]
        if self._mode == "local":
            return own * self._share
        return max(own, self._seen.get(backend, Seen()).sessions)

    def snapshot(self) -> Mapping[str, tuple[int, int]]:
        return {b: (self.tokens_in_flight(b), self.sessions(b)) for b in self._seen}

    async def close(self) -> None:
        """Stop refreshing and give back whatever is still held (within the time budget)."""
        self._stopping = True
        if self._task is not None:
            await stop_task(self._task)
            self._task = None
        for reservation in list(self._held.values()):
            await self.release(reservation)

    # -- background refresh ---------------------------------------------------------------

    async def start(self) -> None:
        """Read the fleet's totals once (bounded), then refresh every `refresh_s`."""
        await self.refresh()
        self._task = asyncio.create_task(self._loop(), name="ledger-refresh")

    async def refresh(self) -> bool:
        """One pipelined call: retry releases, renew (or restore) leases, read every total."""
        now = self._clock.monotonic()
        renew = self._mode == "local" or now >= self._renew_due
        self._unconfirmed = {
            k: v for k, v in self._unconfirmed.items() if now - v[1] < self._ttl_ms / 1000
        }
        growing, self._growing = self._growing, set()
        renewed = [r for r in self._held.values() if renew or r.backend in growing]
        calls = self._refresh_calls(renewed)
        budget = self.budget_s() * REFRESH_BUDGET
        replies = await self._gather(
            [self._call(op, b, *args, budget_s=budget) for op, b, args in calls]
        )
        if isinstance(replies, BaseException):
            self._growing |= growing  # still to be carried
            self._failed(replies)
            return False
        for (op, backend, args), reply in zip(calls, replies, strict=True):
            self._refreshed(op, backend, args, reply, now)
        self._in_store.update(r.lease for r in renewed if r.lease in self._held)
        if renew:
            self._renew_due = now + self._renew_every_s
        if self._mode == "local":
            log.info("ledger store answers again: shared admission resumes")
            self._capped_until = now + RECOVERY_REFRESHES * self._refresh_s
            self._renew_due = now  # restore, next time too, what was admitted meanwhile
            self._set_mode("shared")
        return True

    def observe(self, backend: str, seen: Seen) -> None:
        """Take a report of a backend's totals unless a later one was already taken."""
        if seen.seq >= self._seen.get(backend, Seen()).seq:
            self._seen[backend] = seen

    def _refresh_calls(self, renewed: list[Reservation]) -> list[tuple[str, str, list[str | int]]]:
        """Retry the unconfirmed releases, renew `renewed` with their tokens (restoring or
        raising what Redis lacks), and peek at every other backend."""
        calls: list[tuple[str, str, list[str | int]]] = [
            ("release", r.backend, [r.lease]) for r, _ in self._unconfirmed.values()
        ]
        leases: dict[str, list[str | int]] = {b: [] for b in self._seen}
        for r in renewed:
            leases.setdefault(r.backend, []).extend((r.lease, r.tokens))
        for backend, pairs in leases.items():
            calls.append(("renew", backend, pairs) if pairs else ("peek", backend, []))
        return calls

    def _refreshed(
        self, op: str, backend: str, args: list[str | int], reply: Any, now: float
    ) -> None:
        _, seen, restored = parse_reply(reply)
        self._seen[backend] = seen  # a fresh read: taken even when Redis restarted (seq reset)
        if op == "release":
            self._unconfirmed.pop(str(args[0]), None)
        for lease in restored:
            if lease not in self._held:  # released while the renewal was on its way
                self._unconfirmed[lease] = (Reservation(backend, 0, lease), now)
        if restored:
            log.info("restored %d lease(s) on %s that the store had lost", len(restored), backend)

    async def _loop(self) -> None:
        while not self._stopping:
            await asyncio.sleep(self._refresh_s)
            try:
                await self.refresh()
            except Exception:
                log.exception("ledger refresh failed")

    # -- helpers --------------------------------------------------------------------------

    def budget_s(self) -> float:
        """How long a call may take: from the round trips seen lately, within the bounds."""
        return self._batch.latency.budget_s(floor_s=self._timeout_s, ceiling_s=self._timeout_max_s)

    def _call(
        self, op: str, backend: str, *args: str | int, budget_s: float | None = None
    ) -> asyncio.Future[Any]:
        argv = [op, self.channel, self.replica_id, backend, self._ttl_ms, *args]
        keys = self.keys(backend)
        ceiling = self._timeout_max_s
        return self._batch.submit(self._script, keys, argv, budget_s=budget_s, ceiling_s=ceiling)

    async def _gather(self, futures: list[asyncio.Future[Any]]) -> list[Any] | BaseException:
        """Every reply, or why not all came within the refresh's budget (each call keeps
        its own, RedisBatcher). Waiting is never cancelled into the client: a call not
        yet sent is withdrawn, one sent runs out."""
        if not futures:
            return []
        _, late = await asyncio.wait(futures, timeout=self._timeout_max_s * 2)
        for future in late:
            future.cancel()
        if late:
            return TimeoutError(f"{len(late)} of {len(futures)} refresh calls unanswered")
        failures = [e for e in (f.exception() for f in futures) if e is not None]
        if failures:
            return failures[0]
        return [future.result() for future in futures]

    async def _reserve_shared(self, lease: Reservation, limit: int) -> bool | None:
        """Whether Redis admitted the lease; None when Redis did not answer or is not asked."""
        if self._mode == "local":
            return None
        backend = lease.backend
        self._in_store.add(lease.lease)  # from here on the call may reach Redis
        reply = await self._ask(
            lambda: self._call(
                "reserve", backend, lease.lease, lease.tokens, limit, budget_s=self.budget_s()
            )
        )
        if reply is None:
            return None
        status, seen, _ = parse_reply(reply)
        self.observe(backend, seen)
        if not status:
            self._in_store.discard(lease.lease)
        return bool(status)

    async def _ask(self, call: Callable[[], Awaitable[T]]) -> T | None:
        if self._mode == "local":
            return None
        try:
            with Deadline.after(self._timeout_max_s):  # the call keeps its own budget
                return await call()
        except (RedisError, OSError, TimeoutError) as exc:
            self._failed(exc)
            return None

    def _over_share(self, backend: str, limit: int) -> bool:
        """Whether this process's own tokens on `backend` exceed its share of `limit`."""
        return self._own.get(backend, (0, 0))[0] > limit // self._share

    def _claim(self, lease: Reservation, sign: int) -> None:
        held, sessions = self._own.get(lease.backend, (0, 0))
        self._own[lease.backend] = (held + sign * lease.tokens, sessions + sign)

    def _failed(self, exc: BaseException) -> None:
        self._on_store_error()
        if self._mode != "local":
            log.warning(
                "ledger store failed (%r): admitting locally at 1/%d of each limit",
                exc,
                self._share,
            )
            self._set_mode("local")

    def _set_mode(self, mode: LedgerMode) -> None:
        if mode != self._mode:
            self._mode = mode
            self._on_mode_change(mode)
