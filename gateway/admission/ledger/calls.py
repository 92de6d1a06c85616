"""The shared ledger's calls to Redis: ledger.lua, one call on its way per grant at a time.

Every call runs ledger.lua on the backend's keys (one hash slot) through the process's
RedisBatcher, so calls made in the same moment travel in one pipeline. A `size` call sizes
this replica's grant to what its requests hold now and carries the asks for more room that
were waiting; asks made while it is on its way wait for it and go together in the next.
Its answer sizes the grant, admits or refuses each ask, and tells the backend's totals. A
call that fails or outlives its time budget is reported to `on_failure` (the refresh's
calls by the refresh, once), and the asks it carried are told Redis did not answer.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from typing import Any

import redis.asyncio as aioredis

from gateway.admission.ledger.grants import Ask, Grant, Grants, Seen, unanswered
from gateway.redis_io.batch import BatchScript, RedisBatcher, batcher_of

log = logging.getLogger("spillgate.ledger")

WANTED_REFRESHES = 5  # after a refusal, no spare is granted for this many refreshes


def ledger_script() -> str:
    return resources.files("gateway.admission.ledger").joinpath("ledger.lua").read_text("utf-8")


@dataclass(frozen=True, slots=True)
class Sized:
    """A ledger.lua reply: which asks were admitted, this replica's grant, the totals."""

    admitted: str  # "1" or "0" per ask, in order
    grant: int
    seen: Seen
    granted: int  # every replica's grant together
    restored: bool
    wanted: bool  # a refusal withholds every spare for now


def parse_reply(reply: Any) -> Sized:
    flags, grant, tokens, sessions, seq, granted, restored, wanted = reply
    admitted = flags.decode() if isinstance(flags, bytes) else str(flags)
    seen = Seen(int(tokens), int(sessions), int(seq))
    return Sized(admitted, int(grant), seen, int(granted), bool(int(restored)), bool(int(wanted)))


class GrantCalls:
    """One replica's calls to ledger.lua for the grants it keeps in `grants`.

    `shared` says whether the ledger admits through Redis now: once it does not, an answer
    sends no further call and the asks still waiting are told Redis did not answer.
    """

    def __init__(
        self,
        redis: RedisBatcher | aioredis.Redis,
        *,
        grants: Grants,
        key_prefix: str,
        replica_id: str,
        lease_ttl_s: float,
        refresh_s: float,
        timeout_s: float,
        timeout_max_s: float | None,
        spare_permille: int,
        shared: Callable[[], bool],
        on_failure: Callable[[BaseException], None],
    ) -> None:
        self._batch = batcher_of(redis)
        self._script = BatchScript(ledger_script())
        self._grants = grants
        self._prefix = key_prefix
        self._replica_id = replica_id
        self.channel = f"{key_prefix}:ledger:released"
        self._ttl_ms = max(1, round(lease_ttl_s * 1000))
        self._wanted_ms = max(1, round(refresh_s * WANTED_REFRESHES * 1000))
        self._timeout_s = timeout_s
        self._timeout_max_s = max(timeout_s, timeout_max_s or timeout_s)
        self._spare_permille = spare_permille
        self._shared = shared
        self._on_failure = on_failure

    def keys(self, backend: str) -> list[str]:
        """The leases, tokens, usage and meta keys of a backend; one hash slot for all."""
        base = f"{self._prefix}:ledger:{{{backend}}}"
        return [f"{base}:leases", f"{base}:tokens", f"{base}:usage", f"{base}:meta"]

    def budget_s(self) -> float:
        """How long a call may take: from the round trips seen lately, within the bounds."""
        return self._batch.latency.budget_s(floor_s=self._timeout_s, ceiling_s=self._timeout_max_s)

    async def ask(self, backend: str, grant: Grant, tokens: int, limit: int) -> bool | None:
        """Whether Redis admitted `tokens` into the grant; None when it did not answer.
        Asks wait for the call on its way, then go together in the next."""
        waiter: asyncio.Future[bool | None] = asyncio.get_running_loop().create_future()
        grant.asks.append((tokens, limit, waiter))
        if grant.sent is None:
            self.send(backend, grant)
        try:
            async with asyncio.timeout(2 * self.budget_s()):  # the call on its way, then its own
                try:
                    return await waiter
                except asyncio.CancelledError:  # admitted, but nobody will hold it: give back
                    if waiter.done() and not waiter.cancelled() and waiter.result():
                        grant.give(tokens)
                    raise
        except TimeoutError as exc:  # admitted later, it stays in Redis until the next call
            self._on_failure(exc)
            return None

    def send(
        self, backend: str, grant: Grant, *, budget_s: float | None = None, refresh: bool = False
    ) -> asyncio.Future[Any]:
        """Size the grant to what its requests hold now, with the asks waiting."""
        asks = [ask for ask in grant.asks if not ask[2].done()]  # not given up on
        grant.asks = []
        used, sessions = grant.used, grant.sessions
        spare = self._spare_permille
        argv: list[str | int] = [used, sessions, grant.limit, spare, self._wanted_ms]
        for tokens, limit, _ in asks:
            argv += (tokens, limit)
        future = self.call("size", backend, *argv, budget_s=budget_s or self.budget_s())
        grant.sent = future
        done = functools.partial(self._sized, backend, grant, asks, (used, sessions), refresh)
        future.add_done_callback(done)
        return future

    def _sized(
        self,
        backend: str,
        grant: Grant,
        asks: list[Ask],
        sent: tuple[int, int],
        refresh: bool,
        future: asyncio.Future[Any],
    ) -> None:
        grant.sent = None
        failure = TimeoutError("unanswered") if future.cancelled() else future.exception()
        if failure is not None:
            unanswered(asks + grant.asks)
            grant.asks = []
            if not refresh:  # the refresh reports its own failure, once
                self._on_failure(failure)
            return
        sized = parse_reply(future.result())
        tokens, sessions = sent
        for (asked, _, waiter), flag in zip(asks, sized.admitted, strict=True):
            admitted = flag == "1"
            if admitted:
                tokens, sessions = tokens + asked, sessions + 1
            if not waiter.done():  # one given up on stays in Redis until the next call
                if admitted:
                    grant.take(asked)
                waiter.set_result(admitted)
        grant.granted, grant.others = sized.grant, sized.granted - sized.grant
        grant.reported = (tokens, sessions)
        grant.contended = sized.wanted
        if refresh:
            self._grants.refreshed(backend, sized.seen)
        else:
            self._grants.observe(backend, sized.seen)
        if sized.restored:
            log.info("restored this replica's grant on %s that the store had lost", backend)
        if not self._shared():  # failed elsewhere meanwhile: the share decides
            unanswered(grant.asks)
            grant.asks = []
        elif grant.asks or (grant.contended and grant.excess(self._spare_permille)):
            self.send(backend, grant)

    def call(
        self, op: str, backend: str, *args: str | int, budget_s: float | None = None
    ) -> asyncio.Future[Any]:
        argv = [op, self.channel, self._replica_id, backend, self._ttl_ms, *args]
        keys = self.keys(backend)
        ceiling = self._timeout_max_s
        return self._batch.submit(self._script, keys, argv, budget_s=budget_s, ceiling_s=ceiling)

    async def gather(self, futures: list[asyncio.Future[Any]]) -> list[Any] | BaseException:
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
