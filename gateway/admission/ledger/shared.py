"""The shared in-flight ledger: every replica admits within the room Redis granted it.

Per backend each replica holds one lease in Redis (ledger.lua): its grant of tokens,
counted against the backend's limit, and what its admitted requests hold. A request
that fits in the grant, and under the limit beside the others' grants as last seen, is
admitted without a call; one that does not asks Redis, which grows the grant if the backend
has room. A grant is what its requests hold plus a spare: `spare` (an eighth) of the room
left when it was granted, so a replica under steady load seldom asks. The spare is what the ledger
trades for exactness at the margin: room one replica holds spare, another cannot take.
So when Redis refuses an ask, no replica is granted a spare for a while, and each gives
back what it holds beyond its requests at once (the release is published: the queues
elsewhere wake). A replica asks one call at a time per backend; asks made meanwhile go
together in the next. Every `refresh_s` one pipelined call sizes every grant to what its
requests hold now (renewing its lease, restoring one Redis lost) and reads every backend's
totals: the snapshot routing and metrics use, also updated by every answer and (through
ReleaseFeed) every published release. A replica killed with kill -9 stops renewing: its
leases expire within the TTL.

Failure mode, "local": a call that fails or outlives its time budget switches the ledger to
local admission, where each process admits against limit ÷ `fallback_share` (replicas ×
workers), so the fleet stays under each limit while Redis is away and no request waits on
Redis meanwhile. The refresh keeps probing; when Redis answers it sizes this replica's
grants to what is held (restoring what a restart lost), then shared admission resumes, for
RECOVERY_REFRESHES refreshes still capped at the share, until every replica has restored
its own. Mode changes go to `on_mode_change`, failed calls to `on_store_error`.

Shared prompt blocks (gateway/admission/ledger/holders.py) are counted once per replica: each
replica's own holders decide what a request adds, and Redis sums the replicas' usage. So a
prompt held on a backend counts at most once per replica that has a holder of it there (with
N replicas, N - 1 copies too many at worst, against one per request without sharing); a
crashed replica's holds expire with its lease, as every reservation does.

The grants and the totals are counted in ledger_grant.py; the calls to ledger.lua, and the
asks that wait for one, are ledger_calls.py's. This module decides when to call.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import secrets
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Literal

import redis.asyncio as aioredis

from gateway.admission.ledger.calls import GrantCalls, parse_reply
from gateway.admission.ledger.grants import Grants, Seen
from gateway.admission.ledger.holders import Holders
from gateway.admission.ledger.reservations import Reservation
from gateway.clock import Clock
from gateway.redis_io.batch import RedisBatcher
from gateway.request import NO_BLOCKS, SharedBlocks
from gateway.tasks import Periodic

log = logging.getLogger("spillgate.ledger")

LedgerMode = Literal["shared", "local"]
RECOVERY_REFRESHES = 3
REFRESH_BUDGET = 4  # the refresh pipeline may take this many request time budgets


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
        spare: float = 0.125,
        replica_id: str | None = None,
        on_store_error: Callable[[], None] = _ignore,
        on_mode_change: Callable[[str], None] = _ignore,
    ) -> None:
        if lease_ttl_s <= 0 or refresh_s <= 0 or timeout_s <= 0 or fallback_share < 1:
            raise ValueError("lease_ttl_s, refresh_s and timeout_s must be > 0, share >= 1")
        if not 0 <= spare < 1:
            raise ValueError("spare must be at least 0 and under 1")
        self._clock = clock
        self._refresh_s = refresh_s
        self._share = fallback_share
        self._spare_permille = round(spare * 1000)
        self.replica_id = replica_id or secrets.token_hex(6)
        self._on_store_error = on_store_error
        self._on_mode_change = on_mode_change
        self._grants = Grants(backends)
        self._calls = GrantCalls(
            redis,
            grants=self._grants,
            key_prefix=key_prefix,
            replica_id=self.replica_id,
            lease_ttl_s=lease_ttl_s,
            refresh_s=refresh_s,
            timeout_s=timeout_s,
            timeout_max_s=timeout_max_s,
            spare_permille=self._spare_permille,
            shared=self._shared,
            on_failure=self._failed,
        )
        self.channel = self._calls.channel
        self._held: dict[str, Reservation] = {}  # admitted here, by id
        self._holders = Holders()  # this replica's holders of shared blocks
        self._ids = itertools.count()
        self._mode: LedgerMode = "shared"
        self._capped_until = -math.inf
        self._refreshes = Periodic(
            self._refresh_pass, every_s=refresh_s, name="ledger-refresh", wait_first=True
        )
        on_mode_change(self._mode)

    @property
    def mode(self) -> LedgerMode:
        return self._mode

    def keys(self, backend: str) -> list[str]:
        """The leases, tokens, usage and meta keys of a backend; one hash slot for all."""
        return self._calls.keys(backend)

    def budget_s(self) -> float:
        """How long a call may take: from the round trips seen lately, within the bounds."""
        return self._calls.budget_s()

    # -- the Ledger role ------------------------------------------------------------------

    async def reserve(
        self, backend: str, tokens: int, *, limit: int, shared: SharedBlocks = NO_BLOCKS
    ) -> Reservation | None:
        grant = self._grants.grant(backend)
        taken = Reservation(backend, tokens, f"{self.replica_id}:{next(self._ids)}", shared)
        cost = self.cost(backend, tokens, shared)
        share = limit // self._share
        capped = self._mode == "local" or self._clock.monotonic() < self._capped_until
        if capped and grant.used + cost > share:
            return None
        if self._mode == "shared":
            grant.limit = limit
            if grant.sent is None and grant.fits(cost, limit):
                grant.take(cost)
                return self._hold(taken, cost)
            admitted = await self._calls.ask(backend, grant, cost, limit)
            if admitted is not None:  # Redis answered; an admitted ask is counted already
                return self._hold(taken, cost) if admitted else None
        if grant.used + cost > share:  # Redis did not answer (or is not asked)
            return None
        grant.take(cost)
        return self._hold(taken, cost)

    def cost(self, backend: str, tokens: int, shared: SharedBlocks = NO_BLOCKS) -> int:
        """Shared blocks count once per replica: each replica's own holders decide, so with
        N replicas a prompt held on one backend counts at most N times, not once per
        request."""
        return self._holders.cost(backend, tokens, shared)

    async def release(self, reservation: Reservation) -> None:
        held = self._held.pop(reservation.id, None)
        if held is None:
            return
        grant = self._grants.grant(held.backend)
        freed = self._holders.drop(held.backend, held.shared)
        grant.give(held.own_tokens + freed)  # what it holds now: grown, perhaps
        if self._mode == "shared" and grant.sent is None and grant.excess(self._spare_permille) > 0:
            await asyncio.wait([self._calls.send(held.backend, grant)])  # published: queues wake

    async def extend(self, reservation: Reservation, tokens: int) -> Reservation:
        """Grow a held reservation: counted here at once, and in Redis by the next call for its
        backend (a stream grows by every KV block it fills: the refresh carries them all, not
        a round trip per block). Until then the grant admits nothing it no longer has room
        for."""
        held = self._held.get(reservation.id)
        if held is None or tokens <= 0:
            return held or reservation
        grown = held._replace(tokens=held.tokens + tokens)
        self._held[held.id] = grown
        self._grants.grant(held.backend).used += tokens
        return grown

    def tokens_in_flight(self, backend: str) -> int:
        return self._in_flight(backend)[0]

    def sessions(self, backend: str) -> int:
        return self._in_flight(backend)[1]

    def snapshot(self) -> Mapping[str, tuple[int, int]]:
        return {b: self._in_flight(b) for b in self._grants}

    def _in_flight(self, backend: str) -> tuple[int, int]:
        """(tokens, sessions) on `backend`; while local, this replica's own times the share."""
        if self._mode == "local":
            grant = self._grants.grant(backend)
            return grant.used * self._share, grant.sessions * self._share
        return self._grants.in_flight(backend)

    async def close(self) -> None:
        """Stop refreshing and give back every grant (within the time budget)."""
        await self.stop()
        self._held.clear()
        self._holders = Holders()
        held = [b for b, grant in self._grants.items() if grant.granted or grant.sessions]
        for grant in self._grants.values():
            grant.used = grant.sessions = grant.granted = 0
        if self._mode == "shared" and held:
            budget = self.budget_s()
            releases = [self._calls.call("release", b, budget_s=budget) for b in held]
            await self._calls.gather(releases)

    # -- background refresh ---------------------------------------------------------------

    async def start(self) -> None:
        """Read the fleet's totals once (bounded), then refresh every `refresh_s`."""
        await self.refresh()
        self._refreshes.start()

    async def stop(self) -> None:
        """Stop refreshing (`close` also gives the grants back)."""
        await self._refreshes.stop()

    async def refresh(self) -> bool:
        """One pipelined call: size (and so renew, or restore) every grant this replica
        holds to what its requests hold, and read every other backend's totals."""
        budget = self.budget_s() * REFRESH_BUDGET
        calls: list[asyncio.Future[Any]] = []
        peeked: list[str] = []
        for backend, grant in self._grants.items():
            if grant.sent is not None:  # its answer renews the lease and tells the totals
                continue
            if grant.granted or grant.sessions or grant.reported != (0, 0):
                calls.append(self._calls.send(backend, grant, budget_s=budget, refresh=True))
            else:
                peeked.append(backend)
        calls += [self._calls.call("peek", backend, budget_s=budget) for backend in peeked]
        replies = await self._calls.gather(calls)
        if isinstance(replies, BaseException):
            self._failed(replies)
            return False
        for backend, reply in zip(peeked, replies[len(calls) - len(peeked) :], strict=True):
            sized = parse_reply(reply)
            self._grants.refreshed(backend, sized.seen)
            self._grants.grant(backend).others = sized.granted
        if self._mode == "local":
            log.info("ledger store answers again: shared admission resumes")
            self._capped_until = self._clock.monotonic() + RECOVERY_REFRESHES * self._refresh_s
            self._set_mode("shared")
        return True

    def wanted(self, backend: str) -> None:
        """Another replica was refused room on `backend`: give back the spare at once."""
        grant = self._grants.get(backend)
        if grant is None:
            return
        grant.contended = True
        if self._mode == "shared" and grant.sent is None and grant.excess(self._spare_permille) > 0:
            self._calls.send(backend, grant)

    def observe(self, backend: str, seen: Seen) -> None:
        """Take a report of a backend's totals unless a later one was already taken."""
        self._grants.observe(backend, seen)

    async def _refresh_pass(self) -> None:
        await self.refresh()  # whether it reached the store, it says itself (mode, metrics)

    # -- helpers --------------------------------------------------------------------------

    def _hold(self, reservation: Reservation, cost: int) -> Reservation:
        """Hold `reservation`, admitted at `cost`: what its shared blocks add is counted as it is
        now (another request may have taken or let go of them while Redis was asked)."""
        self._held[reservation.id] = reservation
        added = self._holders.hold(reservation.backend, reservation.shared)
        self._grants.grant(reservation.backend).used += reservation.own_tokens + added - cost
        return reservation

    def _shared(self) -> bool:
        return self._mode == "shared"

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
