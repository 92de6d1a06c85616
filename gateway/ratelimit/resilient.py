"""The shared limiter with a time budget, a circuit breaker and a configured failure mode.

Every call to the primary (Redis) store is bounded by a time budget: `timeout_max_s` when
given, the ceiling of the budget the primary keeps itself (the waits seen lately, at least
`timeout_s`: gateway/ratelimit/redis_limiter.py), else `timeout_s`; so a loaded process
waits what its own round trips take and a dead store never makes a request wait longer
than the ceiling. A call that fails or runs out of time is answered
by this process's own buckets at the tenant's limits divided by `replicas`, so the fleet
as a whole stays near the tenant's limit instead of multiplying it (with `allow`:
admitted, unlimited).

After `failure_threshold` consecutive failures the circuit opens: the store is left alone
for `cooldown_s`, then one call probes it. Only while the circuit is open does the failure
mode decide: `local` as above, `allow`, or `deny`: refused with reason "store_unavailable"
(a 503, not a 429) and the circuit's remaining cooldown as its Retry-After. So `deny`
never refuses because one call was slow. When the store answers again, shared limiting
resumes by itself: at the first call that finds it back, or (once `start`ed) at the probe
sent every PROBE_S while the mode is not "shared", off the request path, so an idle
replica reports "shared" again too. A probe that fails changes nothing: the requests' own
calls count the failures and keep the circuit.

Never admitting twice. A decision whose outcome is unknown (cut by its budget, or its
connection lost) is undone in Redis if it turns out to have admitted (the Redis limiter
refunds it, once, by its id), and the local share that answers instead starts from what
this replica last heard from the store plus the refill since it heard it (never from 0,
never from full): a tenant whose shared bucket was empty gets nothing more from the share
than its refill, and one idle for minutes gets its share of a full bucket. What the share
admits is owed, and charged to the shared buckets once the store answers again. So, per
tenant, during an outage the fleet admits at most what the shared buckets held when each
replica last heard from them (each replica 1/`replicas` of what it heard; together at most
one bucket) plus their refill over the outage; afterwards the shared buckets carry it as
debt (at most one bucket: gateway/ratelimit/bucket.py).

Degraded, tenant by tenant. On a Redis Cluster a dead master takes only its slots away:
a tenant is degraded from the first decision the store did not answer for it until one
does (or a probe of its slot passes), and the others stay shared. `degraded()` says which
tenants (and their slots) this replica answers on its own, and since when; the mode is
"shared" only while none is. The probe writes to the node of each degraded tenant's slot
(one tenant a node), not to one key on one master.

Every failed call is reported to `on_store_error`; every change of
mode ("shared", "local", "allow", "deny") to `on_mode_change`, starting with "shared".
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Literal, TypeVar

from gateway.breaker import CircuitBreaker
from gateway.clock import Clock
from gateway.ratelimit import bucket
from gateway.ratelimit.base import Decision, StoreError, TenantLimits
from gateway.ratelimit.local import LocalRateLimiter
from gateway.ratelimit.redis_limiter import RedisRateLimiter
from gateway.tasks import Periodic
from gateway.upstream.deadline import Deadline

FailureMode = Literal["local", "allow", "deny"]
Mode = Literal["shared", "local", "allow", "deny"]
FAILURE_MODES: tuple[FailureMode, ...] = ("local", "allow", "deny")
# How soon an idle replica reports Redis back: well within any alert's `for`, and one
# small write a second per process is nothing to a Redis that is back, or still away.
PROBE_S = 1.0

T = TypeVar("T")


class _StoreDown:
    """The primary was not asked, or did not answer in time."""


_STORE_DOWN = _StoreDown()


@dataclass(frozen=True, slots=True)
class Heard:
    """What the store last said was left in a tenant's buckets, and when (clock time)."""

    requests: int
    tokens: int
    at: float


@dataclass(frozen=True, slots=True, kw_only=True)
class Degraded:
    """A tenant this replica answers without the store: its slot, and since when."""

    tenant: str
    slot: int
    since: float  # clock time


class ResilientRateLimiter:
    """A RateLimiter over a shared primary that answers within `timeout_s`, whatever Redis does.

    A charge taken in one mode and reconciled in another settles with whichever store
    answers at reconcile time; the drift is bounded by the requests in flight at the change.
    """

    def __init__(
        self,
        primary: RedisRateLimiter,
        *,
        fallback: LocalRateLimiter,
        failure_mode: FailureMode,
        replicas: int,
        timeout_s: float,
        timeout_max_s: float | None = None,
        failure_threshold: int,
        cooldown_s: float,
        clock: Clock,
        on_store_error: Callable[[], None],
        on_mode_change: Callable[[str], None],
    ) -> None:
        if failure_mode not in FAILURE_MODES:
            raise ValueError(f"failure_mode must be one of {FAILURE_MODES}, got {failure_mode!r}")
        if replicas < 1 or failure_threshold < 1 or timeout_s <= 0 or cooldown_s < 0:
            raise ValueError("replicas and failure_threshold must be >= 1, timeout_s > 0")
        self._primary = primary
        self._fallback = fallback
        self._failure_mode: FailureMode = failure_mode
        self._replicas = replicas
        self._timeout_s = timeout_s
        self._timeout_max_s = max(timeout_s, timeout_max_s or timeout_s)
        self._cooldown_s = cooldown_s
        self._clock = clock
        self._on_store_error = on_store_error
        self._on_mode_change = on_mode_change
        # half-open, the breaker lets one call through: the probe of the store
        self._breaker = CircuitBreaker(
            failures=failure_threshold, cooldown_s=cooldown_s, clock=clock
        )
        self._mode: Mode = "shared"
        self._known: dict[str, Heard] = {}  # tenant: what the store last reported
        self._degraded: dict[str, float] = {}  # tenant: since when it is answered here
        self._owed: dict[str, tuple[TenantLimits, int, int]] = {}  # admitted by the share
        self._settling: set[asyncio.Task[None]] = set()
        self._probes = Periodic(self.probe, every_s=PROBE_S, name="ratelimit-probe")
        on_mode_change(self._mode)

    @property
    def mode(self) -> Mode:
        return self._mode

    @property
    def circuit_open(self) -> bool:
        return self._breaker.is_open

    def degraded(self) -> list[Degraded]:
        """The tenants this replica answers without the store now, the longest first."""
        return [
            Degraded(tenant=tenant, slot=self._primary.slot(tenant), since=since)
            for tenant, since in sorted(self._degraded.items(), key=lambda item: item[1])
        ]

    def _heard(self, tenant: str, shared: Decision) -> Decision:
        self._known[tenant] = Heard(
            shared.remaining_requests, shared.remaining_tokens, self._clock.monotonic()
        )
        return shared

    async def acquire(self, limits: TenantLimits, tokens: int) -> Decision:
        bucket.check_tokens(tokens=tokens)
        tenant = limits.tenant
        shared = await self._ask_primary(tenant, lambda: self._primary.acquire(limits, tokens))
        if not isinstance(shared, _StoreDown):
            return self._heard(tenant, shared)
        if tokens > limits.token_capacity:
            return bucket.judged(limits, requests=0, tokens=0, cost=tokens)
        mode = self._degraded_mode()
        if mode == "local":
            return await self._acquire_share(limits, tokens)
        if mode == "allow":
            return bucket.full(limits)
        return self._unavailable(limits)

    def _share(self, limits: TenantLimits) -> TenantLimits:
        """This replica's share, started (once a report) from its part of what the store
        last reported, refilled since."""
        share = limits.divided(self._replicas)
        heard = self._known.pop(limits.tenant, None)
        if heard is not None:
            self._fallback.resume(
                share,
                requests=min(heard.requests / self._replicas, share.request_capacity),
                tokens=min(heard.tokens / self._replicas, share.token_capacity),
                at=heard.at,
            )
        return share

    def _owe(self, limits: TenantLimits, *, requests: int, tokens: int) -> None:
        _, owed_requests, owed_tokens = self._owed.get(limits.tenant, (limits, 0, 0))
        self._owed[limits.tenant] = (limits, owed_requests + requests, owed_tokens + tokens)

    async def _settle_owed(self) -> None:
        """Charge the shared buckets with what the shares admitted while Redis was away."""
        owed, self._owed = self._owed, {}
        for limits, requests, tokens in owed.values():
            try:  # a tenant whose slot is still away is charged at its next answer
                await self._primary.charge(limits, requests=requests, tokens=tokens)
            except StoreError:
                self._owe(limits, requests=requests, tokens=tokens)

    def _degraded_mode(self) -> FailureMode:
        """How to answer without the store: `deny` only while the circuit is open."""
        if self._failure_mode == "deny" and not self._breaker.is_open:
            return "local"
        return self._failure_mode

    async def _acquire_share(self, limits: TenantLimits, tokens: int) -> Decision:
        """Debit this replica's share; a request the whole bucket holds but the share does
        not waits for a full share and leaves the rest as debt, rather than never fitting."""
        share = self._share(limits)
        if tokens <= share.token_capacity:
            decision = await self._fallback.acquire(share, tokens)
        else:
            decision = await self._fallback.acquire(share, share.token_capacity)
            if decision.allowed:
                beyond = tokens - share.token_capacity
                self._fallback.charge(share, tokens=beyond, debt=limits.token_capacity)
        if decision.allowed:
            self._owe(limits, requests=1, tokens=tokens)
        return decision

    async def reconcile(self, limits: TenantLimits, *, charged: int, used: int) -> None:
        charge = bucket.settlement(limits, charged=charged, used=used)
        if charge == 0:
            return
        # what reaches the stores below is a count whatever `used` was: checked once here
        used = charged + charge
        shared = await self._ask_primary(
            limits.tenant, lambda: self._primary.reconcile(limits, charged=charged, used=used)
        )
        if isinstance(shared, _StoreDown) and self._degraded_mode() == "local":
            await self._fallback.reconcile(
                limits.divided(self._replicas), charged=charged, used=used
            )
            self._owe(limits, requests=0, tokens=charge)

    async def peek(self, limits: TenantLimits) -> Decision:
        tenant = limits.tenant
        shared = await self._ask_primary(tenant, lambda: self._primary.peek(limits))
        if not isinstance(shared, _StoreDown):
            return self._heard(tenant, shared)
        mode = self._degraded_mode()
        if mode == "local":
            return await self._fallback.peek(self._share(limits))
        if mode == "allow":
            return bucket.full(limits)
        return self._unavailable(limits)

    async def start(self) -> None:
        """Probe the store every PROBE_S while degraded, until `stop`."""
        self._probes.start()

    async def stop(self) -> None:
        await self._probes.stop()

    async def probe(self) -> None:
        """While degraded, ask the store whether it is back: the store at large, and the
        node of each degraded tenant (one tenant a node); the tenants of each node that
        answers, and the mode once none is left, resume as a decision that found it would."""
        if self._mode == "shared":
            return
        nodes: dict[str, list[str]] = {}
        for tenant in self._degraded:
            nodes.setdefault(self._primary.node(tenant), []).append(tenant)
        asked = [None, *(tenants[0] for tenants in nodes.values())]
        answers = await asyncio.gather(*(self._probe(tenant) for tenant in asked))
        back = [t for ts, ok in zip(nodes.values(), answers[1:], strict=True) if ok for t in ts]
        for tenant in back:
            self._degraded.pop(tenant, None)
        if answers[0]:
            self._answered()

    async def _probe(self, tenant: str | None) -> bool:
        try:
            async with asyncio.timeout(self._timeout_max_s):
                await self._primary.probe(tenant)
        except (TimeoutError, StoreError):
            return False
        return True

    async def close(self) -> None:
        await self.stop()
        try:
            await self._primary.close()
        finally:
            await self._fallback.close()

    async def _ask_primary(self, tenant: str, call: Callable[[], Awaitable[T]]) -> T | _StoreDown:
        """The store's answer for `tenant`, or _STORE_DOWN: then the tenant is degraded."""
        if not self._breaker.allow():
            self._degraded.setdefault(tenant, self._clock.monotonic())
            self._set_mode(self._degraded_mode())
            return _STORE_DOWN
        answered = False
        try:
            with Deadline.after(self._timeout_max_s):
                result = await call()
            answered = True
        except (TimeoutError, StoreError):
            self._failed(tenant)
            return _STORE_DOWN
        finally:
            if not answered:
                self._breaker.release_trial()  # a cancelled call tried nothing
        self._degraded.pop(tenant, None)
        self._answered()
        return result

    def _failed(self, tenant: str) -> None:
        self._on_store_error()
        self._degraded.setdefault(tenant, self._clock.monotonic())
        self._breaker.record_failure()
        self._set_mode(self._degraded_mode())

    def _answered(self) -> None:
        """The store answered: the circuit closes, and with no tenant left degraded the
        mode is shared again."""
        self._breaker.record_success()
        if not self._degraded:
            self._set_mode("shared")
        if self._owed and not self._settling:
            task = asyncio.get_running_loop().create_task(self._settle_owed())
            self._settling.add(task)
            task.add_done_callback(self._settling.discard)

    def _set_mode(self, mode: Mode) -> None:
        if mode != self._mode:
            self._mode = mode
            self._on_mode_change(mode)

    def _unavailable(self, limits: TenantLimits) -> Decision:
        wait = self._breaker.open_for() if self._breaker.is_open else self._cooldown_s
        return bucket.decision(
            limits, requests=0, tokens=0, reason="store_unavailable", retry_after=wait
        )
