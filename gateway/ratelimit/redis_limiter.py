"""The shared limiter: every gateway process debits the same buckets in Redis.

One Lua script (bucket.lua) per decision checks and debits both buckets atomically, timed
by Redis `TIME` so gateways with disagreeing clocks still agree. Calls go through the
process's RedisBatcher (gateway/redis_io/batch.py): decisions made in the same moment travel
in one pipeline, and the script is reloaded when Redis answers NOSCRIPT (after a restart
or SCRIPT FLUSH). Both keys of a tenant share the hash tag `{tenant}`, so the script also
runs on Redis Cluster.

A decision Redis made after its caller stopped waiting (the caller answered from its
failure mode instead) is undone: an admission nobody used is refunded, so a late call
never leaves the tenant charged for a request twice.

Grants. With `slice_s`, Redis grants a decision that admits up to `slice_s` seconds of the
tenant's refill in both buckets besides (never more than a quarter of what each holds
after the request), and the process spends that grant on its own: the tenant's next
requests here are decided without a round trip until the grant runs out or `slice_s` has
passed, when what is left goes back to Redis. Refunds of a request's unused tokens go to the grant
while it lives, and a decision sent beside the one that took the grant, which Redis then
refuses for what is left, spends the grant instead. Every grant is debited in Redis before
it is spent, so the fleet never admits more than the buckets hold; a tight bucket (under
one request per `slice_s`, or nearly empty) yields no grant, and each request asks Redis
as before. What a grant costs is that the other replicas see its unspent part as used,
for at most `slice_s`.
"""

from __future__ import annotations

import asyncio
import itertools
import secrets
from dataclasses import dataclass
from importlib import resources
from typing import Any

import redis.asyncio as aioredis
from redis.crc import key_slot
from redis.exceptions import RedisError

from gateway.ratelimit import bucket
from gateway.ratelimit.base import Decision, Reason, StoreError, TenantLimits
from gateway.redis_io.batch import BatchScript, RedisBatcher, batcher_of, forget

CLOSE_WAIT_S = 1.0  # what closing waits for the grants' give-back without a time budget
_REASONS: dict[int, Reason] = {0: "", 1: "requests", 2: "tokens", 3: "too_large"}
# A write, not a PING: a Redis that answers but refuses writes (a primary demoted by a
# failover, maxmemory reached) fails every decision as a dead one does. The key is
# touched by nothing else and lapses by itself.
_PROBE = BatchScript("redis.call('SET', KEYS[1], '1', 'PX', 1000) return 1")


def bucket_script() -> str:
    return resources.files("gateway.ratelimit").joinpath("bucket.lua").read_text("utf-8")


@dataclass(slots=True, eq=False)
class _Grant:
    """What Redis granted this process of a tenant's buckets beyond its requests, to spend
    alone: the limiter's grant, as the ledger's `Grant` is a replica's of a backend's room."""

    limits: TenantLimits
    requests: int
    tokens: int
    until: float  # event-loop time; then what is left goes back
    request_level: float  # what the buckets held once the grant was taken
    token_level: float

    def spend(self, tokens: int, now: float) -> bool:
        if self.requests < 1 or self.tokens < tokens or now >= self.until:
            return False
        self.requests -= 1
        self.tokens -= tokens
        return True

    def settle(self, tokens: int, now: float) -> bool:
        """Take a request's settlement: a refund (`tokens` < 0), or an overrun it covers."""
        if now >= self.until or self.tokens < tokens:
            return False
        self.tokens -= tokens
        return True


class RedisRateLimiter:
    """Token buckets in Redis. Raises StoreError when Redis cannot answer, or (given
    `timeout_s`) does not within the time budget: the waits seen lately (Latency), at least
    `timeout_s`, at most `timeout_max_s`, counted from when the call went out; a loop too
    busy to send or read it does not use it up (RedisBatcher).

    The client belongs to whoever created it (it may be shared with other components);
    `close` leaves it open.
    """

    def __init__(
        self,
        redis: RedisBatcher | aioredis.Redis,
        *,
        key_prefix: str = "spillgate",
        timeout_s: float | None = None,
        timeout_max_s: float | None = None,
        slice_s: float = 0.0,
    ) -> None:
        self._batch = batcher_of(redis)
        self._slice_s = slice_s
        self._grants: dict[str, _Grant] = {}
        self._taking: set[str] = set()  # tenants whose grant is being asked for
        self._timeout_s = timeout_s
        self._timeout_max_s = max(timeout_s or 0.0, timeout_max_s or 0.0)
        self._script = BatchScript(bucket_script())
        self._prefix = key_prefix
        self.late_refunds = 0  # admissions made after their caller stopped waiting
        self._ids = itertools.count()
        self._id_prefix = secrets.token_hex(6)

    def keys(self, tenant: str) -> tuple[str, str]:
        """The request and token bucket keys of a tenant; one hash slot for both."""
        base = f"{self._prefix}:ratelimit:{{{tenant}}}"
        return f"{base}:requests", f"{base}:tokens"

    def _args(self, op: str, limits: TenantLimits, cost: int, *extra: int) -> tuple[str | int, ...]:
        return (
            op,
            limits.requests_per_minute,
            limits.request_capacity,
            limits.tokens_per_minute,
            limits.token_capacity,
            cost,
            *extra,
        )

    def _decision_keys(self, tenant: str) -> tuple[str, str, str]:
        """The bucket keys and a new decision's id key, in the tenant's hash slot."""
        requests, tokens = self.keys(tenant)
        decided = f"{self._prefix}:ratelimit:{{{tenant}}}:decided:{self._id_prefix}"
        return requests, tokens, f"{decided}:{next(self._ids)}"

    def _budget_s(self) -> float | None:
        if self._timeout_s is None:
            return None
        return self._batch.latency.budget_s(floor_s=self._timeout_s, ceiling_s=self._timeout_max_s)

    async def _run(
        self, op: str, limits: TenantLimits, cost: int, *extra: int
    ) -> tuple[Reason, float, float, int, int]:
        keys: tuple[str, ...] = self.keys(limits.tenant)
        on_late = None
        if op == "acquire":
            keys = self._decision_keys(limits.tenant)

            def on_late(reply: Any) -> None:
                if reply and reply[0] == 0:  # admitted, but nobody used it: give it back
                    self.late_refunds += 1
                    refund = self._args("refund", limits, cost)  # its grant included
                    forget(self._batch.submit(self._script, keys, refund))

        future = self._batch.submit(
            self._script,
            keys,
            self._args(op, limits, cost, *extra),
            on_late=on_late,
            budget_s=self._budget_s(),
            ceiling_s=self._timeout_max_s,
        )
        try:
            reply: Any = await future
        except (RedisError, OSError, TimeoutError) as exc:
            raise StoreError(f"rate-limit store failed: {exc}") from exc
        try:
            code, requests, tokens, *granted = reply
            g_requests, g_tokens = (int(g) for g in granted) if granted else (0, 0)
            return _REASONS[int(code)], float(requests), float(tokens), g_requests, g_tokens
        except (TypeError, ValueError, KeyError) as exc:
            raise StoreError(f"rate-limit store sent an unexpected reply: {reply!r}") from exc

    async def acquire(self, limits: TenantLimits, tokens: int) -> Decision:
        bucket.check_tokens(tokens=tokens)
        if (spent := self._spend(limits, tokens)) is not None:
            return spent
        # one grant asked for at a time: decisions made meanwhile go without
        want = () if limits.tenant in self._taking else self._wanted(limits)
        if want:
            self._taking.add(limits.tenant)
        try:
            reason, requests, left, granted_requests, granted_tokens = await self._run(
                "acquire", limits, tokens, *want
            )
        finally:
            if want:
                self._taking.discard(limits.tenant)
        if granted_requests:
            self._hold(limits, granted_requests, granted_tokens, requests, left)
        retry = 0.0
        if reason in ("requests", "tokens"):
            # refused by what is left in Redis, while this process holds a grant (taken
            # beside a decision sent with this one): the grant was debited already
            if (spent := self._spend(limits, tokens)) is not None:
                return spent
            retry = bucket.retry_after_s(limits, requests=requests, tokens=left, cost=tokens)
        return bucket.decision(
            limits,
            requests=requests + granted_requests,
            tokens=left + granted_tokens,
            reason=reason,
            retry_after=retry,
        )

    def _spend(self, limits: TenantLimits, tokens: int) -> Decision | None:
        """The request admitted from this process's grant of the tenant's buckets, else
        None when there is none or it does not cover the request."""
        held = self._grants.get(limits.tenant)
        if held is None or not held.spend(tokens, asyncio.get_running_loop().time()):
            return None
        return bucket.decision(
            limits,
            requests=held.request_level + held.requests,
            tokens=held.token_level + held.tokens,
            reason="",
            retry_after=0.0,
        )

    def _wanted(self, limits: TenantLimits) -> tuple[int, ...]:
        """The grant to ask for beside a decision: `slice_s` of the tenant's refill."""
        if self._slice_s <= 0:
            return ()
        return (
            int(limits.requests_per_minute * self._slice_s / 60),
            int(limits.tokens_per_minute * self._slice_s / 60),
        )

    def _hold(
        self, limits: TenantLimits, requests: int, tokens: int, r_level: float, t_level: float
    ) -> None:
        """Keep a grant just made; one still held is given back (an older take's rest)."""
        loop = asyncio.get_running_loop()
        taken = _Grant(limits, requests, tokens, loop.time() + self._slice_s, r_level, t_level)
        self._give_back(self._grants.get(limits.tenant))
        self._grants[limits.tenant] = taken
        loop.call_at(taken.until, self._expire, taken)

    def _expire(self, taken: _Grant) -> None:
        if self._grants.get(taken.limits.tenant) is taken:
            del self._grants[taken.limits.tenant]
            self._give_back(taken)

    def _give_back(self, taken: _Grant | None) -> asyncio.Future[Any] | None:
        """What is left of a grant goes back to Redis (sent and forgotten: a lost give-back
        leaves the buckets lower for one refill of at most `slice_s`, never higher)."""
        if taken is None or not (taken.requests or taken.tokens):
            return None
        taken.until = 0.0  # spent no more
        back = self._args("adjust", taken.limits, -taken.tokens, -taken.requests)
        taken.requests = taken.tokens = 0
        sent = self._batch.submit(self._script, self.keys(taken.limits.tenant), back)
        forget(sent)
        return sent

    async def reconcile(self, limits: TenantLimits, *, charged: int, used: int) -> None:
        charge = bucket.settlement(limits, charged=charged, used=used)
        if charge == 0:
            return
        held = self._grants.get(limits.tenant)
        now = asyncio.get_running_loop().time()
        if held is None or not held.settle(charge, now):
            await self._run("adjust", limits, charge)

    async def charge(self, limits: TenantLimits, *, requests: int, tokens: int) -> None:
        """Debit what was admitted elsewhere (a replica's own admissions while Redis was
        away), whether or not the buckets hold it: what they lack becomes debt, at most
        one bucket."""
        if requests or tokens:
            await self._run("adjust", limits, tokens, requests)

    async def peek(self, limits: TenantLimits) -> Decision:
        _, requests, tokens, _, _ = await self._run("peek", limits, 0)
        held = self._grants.get(limits.tenant)
        if held is not None:  # this process's unspent grant is the tenant's still
            requests, tokens = requests + held.requests, tokens + held.tokens
        return bucket.judged(limits, requests=requests, tokens=tokens, cost=0)

    def slot(self, tenant: str) -> int:
        """The Redis Cluster hash slot of the tenant's keys (one slot for all of them)."""
        return key_slot(self.keys(tenant)[0].encode())

    def node(self, tenant: str) -> str:
        """The node that holds the tenant's keys now ("" on a single Redis)."""
        return self._batch.node_of(self.keys(tenant)[0])

    async def probe(self, tenant: str | None = None) -> None:
        """Raises StoreError unless Redis takes a write (within the time budget, given
        `timeout_s`): whether decisions can be made here again; given a tenant, on the
        node that holds its slot."""
        tag = "" if tenant is None else f"{{{tenant}}}:"
        future = self._batch.submit(
            _PROBE,
            (f"{self._prefix}:ratelimit:{tag}probe",),
            (),
            budget_s=self._budget_s(),
            ceiling_s=self._timeout_max_s,
        )
        try:
            await future
        except (RedisError, OSError, TimeoutError) as exc:
            raise StoreError(f"rate-limit store failed a probe: {exc}") from exc

    async def close(self) -> None:
        """Give back every grant still held, within the time budget's ceiling."""
        sent = [f for taken in self._grants.values() if (f := self._give_back(taken))]
        self._grants.clear()
        if sent:
            await asyncio.wait(sent, timeout=self._timeout_max_s or CLOSE_WAIT_S)
