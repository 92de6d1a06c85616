"""The shared in-flight ledger: every replica admits within a block Redis granted it.

Per backend each replica holds one lease in Redis (ledger.lua): a block of tokens granted to
it, counted against the backend's limit, and what its admitted requests hold. A request
that fits in the block, and under the limit beside the others' blocks as last seen, is
admitted without a call; one that does not asks Redis, which grows the block if the backend
has room. A block is what its requests hold plus a spare: `spare` (an eighth) of the room
left when it was granted, so a replica under steady load seldom asks. The spare is what the ledger
trades for exactness at the margin: room one replica holds spare, another cannot take.
So when Redis refuses an ask, no replica is granted a spare for a while, and each gives
back what it holds beyond its requests at once (the release is published: the queues
elsewhere wake). A replica asks one call at a time per backend; asks made meanwhile go
together in the next. Every `refresh_s` one pipelined call sizes every block to what its
requests hold now (renewing its lease, restoring one Redis lost) and reads every backend's
totals: the snapshot routing and metrics use, also updated by every answer and (through
ReleaseFeed) every published release. A replica killed with kill -9 stops renewing: its
leases expire within the TTL.

Failure mode, "local": a call that fails or outlives its time budget switches the ledger to
local admission, where each process admits against limit ÷ `fallback_share` (replicas ×
workers), so the fleet stays under each limit while Redis is away and no request waits on
Redis meanwhile. The refresh keeps probing; when Redis answers it sizes this replica's
blocks to what is held (restoring what a restart lost), then shared admission resumes, for
RECOVERY_REFRESHES refreshes still capped at the share, until every replica has restored
its own. Mode changes go to `on_mode_change`, failed calls to `on_store_error`.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import math
import secrets
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from importlib import resources
from typing import Any, Literal

import redis.asyncio as aioredis

from gateway.admission.ledger import Reservation
from gateway.clock import Clock
from gateway.redis_batch import BatchScript, RedisBatcher, batcher_of
from gateway.tasks import stop_task

log = logging.getLogger("spillgate.ledger")

LedgerMode = Literal["shared", "local"]
RECOVERY_REFRESHES = 3
REFRESH_BUDGET = 4  # the refresh pipeline may take this many request time budgets
WANTED_REFRESHES = 5  # after a refusal, no spare is granted for this many refreshes


def ledger_script() -> str:
    return resources.files("gateway.admission").joinpath("ledger.lua").read_text("utf-8")


@dataclass(frozen=True, slots=True)
class Seen:
    """A backend's totals as Redis last reported them; `seq` orders the reports."""

    tokens: int = 0
    sessions: int = 0
    seq: int = 0


@dataclass(frozen=True, slots=True)
class Sized:
    """A ledger.lua reply: which asks were admitted, this replica's block, the totals."""

    admitted: str  # "1" or "0" per ask, in order
    block: int
    seen: Seen
    granted: int  # every replica's block together
    restored: bool
    wanted: bool  # a refusal withholds every spare for now


def parse_reply(reply: Any) -> Sized:
    flags, block, tokens, sessions, seq, granted, restored, wanted = reply
    admitted = flags.decode() if isinstance(flags, bytes) else str(flags)
    seen = Seen(int(tokens), int(sessions), int(seq))
    return Sized(admitted, int(block), seen, int(granted), bool(int(restored)), bool(int(wanted)))


_Ask = tuple[int, int, asyncio.Future[bool | None]]  # tokens, limit, the answer awaited


def _ignore(*_: object) -> None:
    return None


def _unanswered(asks: list[_Ask]) -> None:
    """Tell the asks still waiting that Redis did not answer: the share decides."""
    for *_, waiter in asks:
        if not waiter.done():
            waiter.set_result(None)


@dataclass(slots=True, eq=False)
class _Block:
    """This replica's share of one backend: what Redis granted it, what its requests hold."""

    granted: int = 0  # as of Redis's last answer
    used: int = 0  # tokens of the requests admitted here
    sessions: int = 0
    others: int = 0  # granted to the other replicas, as of the last answer
    limit: int = 0  # the limit the last reservation was asked under
    reported: tuple[int, int] = (0, 0)  # (tokens, sessions) of this replica in Redis's totals
    contended: bool = False  # an ask was refused lately: spare goes back at once
    asks: list[_Ask] = field(default_factory=list)
    sent: asyncio.Future[Any] | None = None  # the call on its way (one at a time)

    def take(self, tokens: int) -> None:
        self.used += tokens
        self.sessions += 1

    def give(self, tokens: int) -> None:
        self.used -= tokens
        self.sessions -= 1

    def fits(self, tokens: int, limit: int) -> bool:
        """Whether `tokens` more fit in the block and under `limit` beside the others."""
        used = self.used + tokens
        return used <= self.granted and self.others + used <= limit

    def excess(self, spare_permille: int) -> int:
        """What the block holds beyond its requests that it should give back now: all of
        it when contended, else once it is over twice the spare it would be granted now."""
        excess = self.granted - self.used
        if excess <= 0 or self.contended:
            return max(0, excess)
        free = max(0, self.limit - self.others - self.used)
        return excess if excess > 2 * free * spare_permille // 1000 else 0


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
        self._batch = batcher_of(redis)
        self._script = BatchScript(ledger_script())
        self._clock = clock
        self._prefix = key_prefix
        self._ttl_ms = max(1, round(lease_ttl_s * 1000))
        self._wanted_ms = max(1, round(refresh_s * WANTED_REFRESHES * 1000))
        self._refresh_s = refresh_s
        self._timeout_s = timeout_s
        self._timeout_max_s = max(timeout_s, timeout_max_s or timeout_s)
        self._share = fallback_share
        self._spare_permille = round(spare * 1000)
        self.replica_id = replica_id or secrets.token_hex(6)
        self.channel = f"{key_prefix}:ledger:released"
        self._on_store_error = on_store_error
        self._on_mode_change = on_mode_change
        self._seen: dict[str, Seen] = {b: Seen() for b in backends}
        self._blocks: dict[str, _Block] = {b: _Block() for b in self._seen}
        self._held: dict[str, Reservation] = {}  # admitted here, by lease id
        self._ids = itertools.count()
        self._mode: LedgerMode = "shared"
        self._capped_until = -math.inf
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        on_mode_change(self._mode)

    @property
    def mode(self) -> LedgerMode:
        return self._mode

    def keys(self, backend: str) -> list[str]:
        """The leases, tokens, usage and meta keys of a backend; one hash slot for all."""
        base = f"{self._prefix}:ledger:{{{backend}}}"
        return [f"{base}:leases", f"{base}:tokens", f"{base}:usage", f"{base}:meta"]

    # -- the Ledger role ------------------------------------------------------------------

    async def reserve(self, backend: str, tokens: int, *, limit: int) -> Reservation | None:
        block = self._block(backend)
        lease = Reservation(backend, tokens, f"{self.replica_id}:{next(self._ids)}")
        share = limit // self._share
        capped = self._mode == "local" or self._clock.monotonic() < self._capped_until
        if capped and block.used + tokens > share:
            return None
        if self._mode == "shared":
            block.limit = limit
            if block.sent is None and block.fits(tokens, limit):
                block.take(tokens)
                return self._hold(lease)
            admitted = await self._ask(backend, block, tokens, limit)
            if admitted is not None:  # Redis answered; an admitted ask is counted already
                return self._hold(lease) if admitted else None
        if block.used + tokens > share:  # Redis did not answer (or is not asked)
            return None
        block.take(tokens)
        return self._hold(lease)

    async def release(self, reservation: Reservation) -> None:
        held = self._held.pop(reservation.lease, None)
        if held is None:
            return
        block = self._block(held.backend)
        block.give(held.tokens)  # what the lease holds now: grown, perhaps
        if self._mode == "shared" and block.sent is None and block.excess(self._spare_permille) > 0:
            await asyncio.wait([self._send(held.backend, block)])  # published: queues wake

    async def extend(self, reservation: Reservation, tokens: int) -> Reservation:
        """Grow a held lease: counted here at once, and in Redis by the next call for its
        backend (a stream grows every block: the refresh carries them all, not a round
        trip per block). Until then the block admits nothing it no longer has room for."""
        held = self._held.get(reservation.lease)
        if held is None or tokens <= 0:
            return held or reservation
        grown = held._replace(tokens=held.tokens + tokens)
        self._held[held.lease] = grown
        self._block(held.backend).used += tokens
        return grown

    def tokens_in_flight(self, backend: str) -> int:
        return self._in_flight(backend)[0]

    def sessions(self, backend: str) -> int:
        return self._in_flight(backend)[1]

    def snapshot(self) -> Mapping[str, tuple[int, int]]:
        return {b: self._in_flight(b) for b in self._seen}

    def _in_flight(self, backend: str) -> tuple[int, int]:
        """(tokens, sessions) on `backend`: this replica's own as they stand, the others'
        as Redis last reported them; while local, the own times the share."""
        block = self._block(backend)
        if self._mode == "local":
            return block.used * self._share, block.sessions * self._share
        seen = self._seen.get(backend, Seen())
        tokens, sessions = block.reported
        return (
            max(0, seen.tokens - tokens) + block.used,
            max(0, seen.sessions - sessions) + block.sessions,
        )

    async def close(self) -> None:
        """Stop refreshing and give back every block (within the time budget)."""
        self._stopping = True
        if self._task is not None:
            await stop_task(self._task)
            self._task = None
        self._held.clear()
        held = [b for b, block in self._blocks.items() if block.granted or block.sessions]
        for block in self._blocks.values():
            block.used = block.sessions = block.granted = 0
        if self._mode == "shared" and held:
            budget = self.budget_s()
            await self._gather([self._call("release", b, budget_s=budget) for b in held])

    # -- background refresh ---------------------------------------------------------------

    async def start(self) -> None:
        """Read the fleet's totals once (bounded), then refresh every `refresh_s`."""
        await self.refresh()
        self._task = asyncio.create_task(self._loop(), name="ledger-refresh")

    async def refresh(self) -> bool:
        """One pipelined call: size (and so renew, or restore) every block this replica
        holds to what its requests hold, and read every other backend's totals."""
        budget = self.budget_s() * REFRESH_BUDGET
        calls: list[asyncio.Future[Any]] = []
        peeked: list[str] = []
        for backend, block in self._blocks.items():
            if block.sent is not None:  # its answer renews the lease and tells the totals
                continue
            if block.granted or block.sessions or block.reported != (0, 0):
                calls.append(self._send(backend, block, budget_s=budget, refresh=True))
            else:
                peeked.append(backend)
        calls += [self._call("peek", backend, budget_s=budget) for backend in peeked]
        replies = await self._gather(calls)
        if isinstance(replies, BaseException):
            self._failed(replies)
            return False
        for backend, reply in zip(peeked, replies[len(calls) - len(peeked) :], strict=True):
            sized = parse_reply(reply)
            self._seen[backend] = sized.seen  # fresh: taken even when Redis restarted
            self._blocks[backend].others = sized.granted
        if self._mode == "local":
            log.info("ledger store answers again: shared admission resumes")
            self._capped_until = self._clock.monotonic() + RECOVERY_REFRESHES * self._refresh_s
            self._set_mode("shared")
        return True

    def wanted(self, backend: str) -> None:
        """Another replica was refused room on `backend`: give back the spare at once."""
        block = self._blocks.get(backend)
        if block is None:
            return
        block.contended = True
        if self._mode == "shared" and block.sent is None and block.excess(self._spare_permille) > 0:
            self._send(backend, block)

    def observe(self, backend: str, seen: Seen) -> None:
        """Take a report of a backend's totals unless a later one was already taken."""
        if seen.seq >= self._seen.get(backend, Seen()).seq:
            self._seen[backend] = seen

    async def _loop(self) -> None:
        while not self._stopping:
            await asyncio.sleep(self._refresh_s)
            try:
                await self.refresh()
            except Exception:
                log.exception("ledger refresh failed")

    # -- asking Redis ---------------------------------------------------------------------

    async def _ask(self, backend: str, block: _Block, tokens: int, limit: int) -> bool | None:
        """Whether Redis admitted `tokens` into the block; None when it did not answer.
        Asks wait for the call on its way, then go together in the next."""
        waiter: asyncio.Future[bool | None] = asyncio.get_running_loop().create_future()
        block.asks.append((tokens, limit, waiter))
        if block.sent is None:
            self._send(backend, block)
        try:
            async with asyncio.timeout(2 * self.budget_s()):  # the call on its way, then its own
                try:
                    return await waiter
                except asyncio.CancelledError:  # admitted, but nobody will hold it: give back
                    if waiter.done() and not waiter.cancelled() and waiter.result():
                        block.give(tokens)
                    raise
        except TimeoutError as exc:  # admitted later, it stays in Redis until the next call
            self._failed(exc)
            return None

    def _send(
        self, backend: str, block: _Block, *, budget_s: float | None = None, refresh: bool = False
    ) -> asyncio.Future[Any]:
        """Size the block to what its requests hold now, with the asks waiting."""
        asks = [ask for ask in block.asks if not ask[2].done()]  # not given up on
        block.asks = []
        used, sessions = block.used, block.sessions
        spare = self._spare_permille
        argv: list[str | int] = [used, sessions, block.limit, spare, self._wanted_ms]
        for tokens, limit, _ in asks:
            argv += (tokens, limit)
        future = self._call("size", backend, *argv, budget_s=budget_s or self.budget_s())
        block.sent = future
        done = functools.partial(self._sized, backend, block, asks, (used, sessions), refresh)
        future.add_done_callback(done)
        return future

    def _sized(
        self,
        backend: str,
        block: _Block,
        asks: list[_Ask],
        sent: tuple[int, int],
        refresh: bool,
        future: asyncio.Future[Any],
    ) -> None:
        block.sent = None
        failure = TimeoutError("unanswered") if future.cancelled() else future.exception()
        if failure is not None:
            _unanswered(asks + block.asks)
            block.asks = []
            if not refresh:  # the refresh reports its own failure, once
                self._failed(failure)
            return
        sized = parse_reply(future.result())
        tokens, sessions = sent
        for (asked, _, waiter), flag in zip(asks, sized.admitted, strict=True):
            admitted = flag == "1"
            if admitted:
                tokens, sessions = tokens + asked, sessions + 1
            if not waiter.done():  # one given up on stays in Redis until the next call
                if admitted:
                    block.take(asked)
                waiter.set_result(admitted)
        block.granted, block.others = sized.block, sized.granted - sized.block
        block.reported = (tokens, sessions)
        block.contended = sized.wanted
        if refresh:
            self._seen[backend] = sized.seen  # fresh: taken even when Redis restarted
        else:
            self.observe(backend, sized.seen)
        if sized.restored:
            log.info("restored this replica's block on %s that the store had lost", backend)
        if self._mode != "shared":  # failed elsewhere meanwhile: the share decides
            _unanswered(block.asks)
            block.asks = []
        elif block.asks or (block.contended and block.excess(self._spare_permille)):
            self._send(backend, block)

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

    def _block(self, backend: str) -> _Block:
        block = self._blocks.get(backend)
        if block is None:
            block = self._blocks[backend] = _Block()
            self._seen[backend] = Seen()
        return block

    def _hold(self, lease: Reservation) -> Reservation:
        self._held[lease.lease] = lease
        return lease

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
