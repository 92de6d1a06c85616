"""Admission: reserve a request's tokens on the backend of its pool that its routing profile
puts first among those with room for it."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from gateway.admission.fleet.backend_load import LOAD_SIGNALS
from gateway.admission.fleet.backends import Backend, Pool
from gateway.admission.ledger.reservations import InFlight, Ledger, Reservation
from gateway.admission.routing.forecast import (
    FLOOR_S,
    HoldTimes,
    expected_hold_s,
    seconds_until_fits,
)
from gateway.admission.routing.prefix_route import GroupLoads, Held, group_of
from gateway.admission.routing.profile import RoutingProfile
from gateway.admission.routing.route import Candidate, Route
from gateway.clock import Clock
from gateway.request import NO_BLOCKS, SharedBlocks
from gateway.upstream.target import Target

ReleaseListener = Callable[[str], None]
WaitingTokens = Callable[[], list[int]]  # the KV tokens of each request queued in a pool
FORECAST_REUSE_S = 0.1  # Retry-After counts whole seconds: a burst of refusals shares one
ROOM_REUSE_S = 1.0  # how long a pool's room (Router.room) is reused


def kv_tokens(tokens: int, *, sequences: int = 1, block_size: int = 1) -> int:
    """The KV cache `sequences` sequences of up to `tokens` tokens each may take on a backend
    with blocks of `block_size`: vLLM allocates whole blocks, each sequence its own. The `n`
    choices of one request share their prompt's blocks only through the prefix cache, and
    only its full blocks, so each is counted whole: what vLLM allocates without the prefix
    cache, and never less than it allocates with it."""
    return sequences * -(-tokens // block_size) * block_size


class Router:
    def __init__(self, pools: dict[str, Pool], *, ledger: Ledger, clock: Clock) -> None:
        self.pools = pools
        self.ledger = ledger
        self.clock = clock
        self._backends = {b.name: b for p in pools.values() for b in p.members}
        self._listeners: list[ReleaseListener] = []
        self._holds = {name: HoldTimes() for name in pools}
        # pool → reservation id → its one record: the reservations and ages the forecast reads
        self._held: dict[str, dict[str, InFlight]] = {name: {} for name in pools}
        self._forecasts: dict[tuple[str, int], tuple[float, float]] = {}  # → (at, seconds)
        self._waiting: dict[str, WaitingTokens] = {}
        self._targets: dict[tuple[str, str | None], Target] = {}
        # a LoRA adapter's name → the pool of the model it adapts
        self.adapters = {a.name: p for p in pools.values() for a in p.settings.adapters}
        self._rooms: dict[str, tuple[float, int]] = {}  # pool → (worked out at, room)
        self._groups = GroupLoads()  # what each prefix holds where: prefix routing's guard
        self._profiles = {name: RoutingProfile(p, groups=self._groups) for name, p in pools.items()}
        for name, p in pools.items():  # each backend's scrape keeps what its routing reads
            for b in p.members:
                b.signals = LOAD_SIGNALS | self._profiles[name].signals
        # told of prompt blocks the prefix index learned by routing (shared mode: the
        # replicas' PrefixFeed), as (pool, backend, keys)
        self.on_prefix_routed: Callable[[str, str, Sequence[bytes]], None] | None = None

    def backend(self, name: str) -> Backend:
        return self._backends[name]

    def target(self, name: str, adapter: str | None = None) -> Target:
        """Where requests reserved on backend `name` go (asking for `adapter`, when given, by
        its name); made once, as pools never change."""
        target = self._targets.get((name, adapter))
        if target is None:
            backend = self._backends[name]
            target = self._targets[(name, adapter)] = Target(
                name=name,
                api_base=backend.url + "/v1",
                model=adapter or backend.served_model,
                timeouts=self.pools[backend.pool].settings.timeouts,
            )
        return target

    def on_release(self, listener: ReleaseListener) -> None:
        """Call `listener(pool)` whenever capacity is given back in a pool."""
        self._listeners.append(listener)

    def capacity(self, backend: Backend) -> int:
        stale = self.pools[backend.pool].settings.metrics_stale_s
        return backend.capacity(now=self.clock.monotonic(), stale_after=stale)

    def room(self, pool: str) -> int:
        """The tokens the pool's smallest backend of known capacity admits at its target
        fill (0 when none is known): how many answers share a backend's KV cache. Worked
        out again after ROOM_REUSE_S (capacities move at probes, seconds apart)."""
        now = self.clock.monotonic()
        at, room = self._rooms.get(pool, (-math.inf, 0))
        if now - at < ROOM_REUSE_S:
            return room
        p = self.pools[pool]
        known = [c for b in p.backends if (c := self.capacity(b)) > 0]
        room = _limit(min(known), p.settings.target_fill) if known else 0
        self._rooms[pool] = (now, room)
        return room

    def limit(self, backend: Backend) -> int:
        """Tokens the ledger may hold on this backend: capacity × its effective fill, less
        what the backend reports holding beyond the ledger's view (see `_view`)."""
        capacity = self.capacity(backend)
        return self._view(backend, capacity, self.clock.monotonic())[1]

    def fill(self, backend: Backend) -> float:
        capacity = self.capacity(backend)
        if capacity <= 0:
            return math.inf
        return self._view(backend, capacity, self.clock.monotonic())[0] / capacity

    def effective_fill(self, backend: Backend) -> float:
        """The fill admission aims at on `backend`: the target, less after a back-off, more
        while calibrated (gateway/admission/fleet/fill.py), while the backend's load is fresh."""
        settings = self.pools[backend.pool].settings
        fresh = settings.feedback and backend.reported_load(self.clock.monotonic()) is not None
        return backend.fill.fill if fresh else settings.target_fill

    def reported_tokens(self, backend: Backend) -> int | None:
        """The KV tokens the backend reports in use (fresh scrapes only), else None."""
        if not self.pools[backend.pool].settings.feedback:
            return None
        load = backend.reported_load(self.clock.monotonic())
        return None if load is None else math.ceil(load.kv_usage * self.capacity(backend))

    def unreserved_tokens(self, backend: Backend) -> int:
        """What the backend held beyond the ledger's reservations when last scraped: traffic
        that bypasses this gateway, answers longer than reserved. 0 without a fresh scrape."""
        reported = self.reported_tokens(backend)
        if reported is None or reported <= backend.reserved_at_load:
            return 0
        return reported - backend.reserved_at_load

    def _view(self, backend: Backend, capacity: int, now: float) -> tuple[int, int]:
        """(tokens held, ledger limit) on `backend`.

        Held is the ledger's view plus what the backend held beyond it at the last scrape:
        the larger of the two views, with the ledger's changes since the scrape (releases,
        admissions) taken at once rather than a scrape later. The limit is capacity ×
        effective fill less that excess, so that the ledger's own check admits against
        the larger view.
        """
        held = self.ledger.tokens_in_flight(backend.name)
        settings = self.pools[backend.pool].settings
        load = backend.reported_load(now) if settings.feedback else None
        if load is None:  # no fresh report: the ledger alone
            return held, _limit(capacity, settings.target_fill)
        reported = math.ceil(load.kv_usage * capacity)
        beyond = max(0, reported - backend.reserved_at_load)
        return held + beyond, max(0, _limit(capacity, backend.fill.fill) - beyond)

    def pool_fill(self, pool: str) -> float:
        backends = self.pools[pool].backends
        capacity = sum(self.capacity(b) for b in backends)
        held = sum(self.ledger.tokens_in_flight(b.name) for b in backends)
        return held / capacity if capacity else 1.0

    def candidates(self, route: Route) -> list[Backend]:
        """The backends of the route's pool that may take its request (its profile's
        filters keep them, their capacity is known), least filled first."""
        return [c.backend for c in self._candidates(route, self.clock.monotonic())]

    def in_rotation(self, pool: str, *, prefill: bool = False) -> list[Backend]:
        """The pool's backends in rotation whose capacity is known, least filled first (its
        prefill backends with `prefill`)."""
        return self.candidates(Route(pool, 0, prefill=prefill))

    def _candidates(self, route: Route, now: float) -> list[Candidate]:
        """Each backend the pool's filters keep whose capacity is known, least filled once
        it holds the request first; what it holds and may hold worked out once."""
        p = self.pools[route.pool]
        profile = self._profiles[route.pool]
        plain = not route.exclude and route.adapter is None
        filters = profile.plain_filters if plain else profile.filters
        stale = p.settings.metrics_stale_s
        found: list[Candidate] = []
        for i, b in enumerate(p.prefillers if route.prefill else p.backends):
            for f in filters:
                if not f.keeps(b, route, now):
                    break
            else:
                capacity = b.capacity(now=now, stale_after=stale)
                if capacity <= 0:
                    continue
                held, limit = self._view(b, capacity, now)
                need = kv_tokens(route.tokens, sequences=route.sequences, block_size=b.block_size)
                blocks = _shared(b, route.shared) if route.shared else NO_BLOCKS
                cost = self.ledger.cost(b.name, need, blocks) if blocks.keys else need
                fill = held / capacity
                found.append(
                    Candidate(fill + cost / capacity, i, b, limit, capacity, fill, need, cost)
                )
        if len(found) > 1:
            found.sort()
        return found

    async def reserve(self, route: Route) -> Reservation | None:
        """Reserve the route's request, in whole KV blocks, on the first backend where it
        fits, in the order the pool's routing profile gives (gateway/admission/routing/
        plugins.py: filters, scorers, a picker), else None. Of its shared blocks
        (InferenceRequest.shared), those that requests in flight on a backend already hold
        are not reserved there again (gateway/admission/ledger/holders.py).

        A request larger than the target fill allows but within a backend's KV cache is
        reserved on an idle backend, alone: the ledger's limit is then its own size. A
        `running` request may fill a backend's KV cache past the target fill.
        """
        now = self.clock.monotonic()
        ordered: Sequence[Candidate] = self._candidates(route, now)
        if len(ordered) > 1:
            ordered = self._profiles[route.pool].order(route, ordered, now)
        # where it fits under the target fill first, then where it may run alone
        alone: list[tuple[Candidate, int]] = []
        for c in ordered:
            limit = c.capacity if route.running else c.limit
            fit = self._fit_limit(c.backend, c.need, limit=limit, capacity=c.capacity)
            if fit is None:
                continue
            if fit != limit:
                alone.append((c, fit))
                continue
            blocks = _shared(c.backend, route.shared) if route.shared else NO_BLOCKS
            reservation = await self.ledger.reserve(
                c.backend.name, c.need, limit=limit, shared=blocks
            )
            if reservation is not None:
                return self._hold(reservation, route)
        for c, fit in alone:
            reservation = await self.ledger.reserve(c.backend.name, c.need, limit=fit)
            if reservation is not None:
                return self._hold(reservation, route)
        return None

    def _fit_limit(self, backend: Backend, need: int, *, limit: int, capacity: int) -> int | None:
        """The one rule of where a request of `need` KV tokens fits, which reserving, the
        queue's room check and the forecast all follow: the ledger limit it is reserved
        under on `backend`. The backend's `limit` where the request is within it; where it
        is larger but within the KV cache, its own size less what the backend holds beyond
        the ledger, so that it is reserved only on an idle backend, alone; None where the
        cache can never hold it."""
        if need <= limit:
            return limit
        if need <= capacity:
            return need - self.unreserved_tokens(backend)  # idle means the backend too
        return None

    def shared_in_flight(self, pool: str, shared: Sequence[SharedBlocks]) -> int:
        """The most of a request's `shared` blocks that requests in flight hold on one
        backend of `pool`: tokens it would not reserve again there."""
        most = 0
        for backend in self.pools[pool].backends if shared else ():
            blocks = _shared(backend, shared)
            if blocks.keys:
                new = self.ledger.cost(backend.name, blocks.tokens, blocks)
                most = max(most, blocks.tokens - new)
        return most

    def _hold(self, reservation: Reservation, route: Route) -> Reservation:
        backend = self._backends[reservation.backend]
        pool = backend.pool
        p = self.pools[pool]
        record = InFlight(reservation=reservation, at=self.clock.monotonic(), adapter=route.adapter)
        if p.prefillers and route.prefix:  # before this request is learned there
            held = Held(p.prefixes, route.prefix, events=p.events, token_ids=route.token_ids)
            record.cached = held.tokens(backend)
        if not route.prefill:  # a prefill leg's hold is no answer's: the forecast leaves it
            self._held[pool][reservation.id] = record
        if route.adapter is not None:
            backend.adapter_started(route.adapter)
        group = group_of(route.prefix, route.session)
        if group is not None and p.by_prefix:
            self._groups.add(record, group)
            fresh = p.prefixes.routed(
                backend.name,
                route.prefix,
                session=route.session,
                blocks=self.capacity(backend) // backend.block_size,
            )
            if fresh and self.on_prefix_routed is not None:
                self.on_prefix_routed(pool, backend.name, fresh)
        return reservation

    def cached_tokens(self, reservation: Reservation) -> int:
        """The prompt's leading tokens the reservation's backend was known to cache when the
        request was routed there (kept for pools with prefill backends only)."""
        record = self._held[self._backends[reservation.backend].pool].get(reservation.id)
        return 0 if record is None else record.cached

    def prefix_routed_elsewhere(self, pool: str, backend: str, keys: Sequence[bytes]) -> None:
        """Another replica routed the prompt blocks `keys` of `pool` to `backend`."""
        found = self._backends.get(backend)
        if found is None or found.pool != pool:
            return
        blocks = self.capacity(found) // found.block_size
        self.pools[pool].prefixes.learn(backend, keys, blocks=blocks)

    def has_room(self, route: Route) -> bool:
        """Whether `reserve` would find room for `route` now (from the last known tokens in
        flight), by the same filters and the same rule of where a request fits."""
        return any(short == 0 for _, short in self.shortfalls(route))

    def shortfalls(self, route: Route) -> list[tuple[str, int]]:
        """For each backend the route's filters keep and that could ever hold its request:
        the tokens in flight there that must be released before it fits, by `has_room`'s
        rule (0: it fits now)."""
        held = self.ledger.tokens_in_flight
        short = []
        for c in self._candidates(route, self.clock.monotonic()):
            fit = self._fit_limit(c.backend, c.need, limit=c.limit, capacity=c.capacity)
            if fit is None:
                continue
            cost = c.cost if fit == c.limit else c.need  # alone, it shares nothing
            short.append((c.backend.name, max(0, held(c.backend.name) + cost - fit)))
        return short

    def fits_ever(self, route: Route) -> bool:
        """Whether any backend of the route's pool (serving its adapter, when it names one)
        could hold its request even when idle."""
        adapter = route.adapter
        return any(
            self.capacity(b)
            >= kv_tokens(route.tokens, sequences=route.sequences, block_size=b.block_size)
            for b in self.pools[route.pool].backends
            if adapter is None or adapter in b.adapters
        )

    def never_fits(self, pool: str, tokens: int, *, sequences: int = 1) -> bool:
        """Whether every backend's KV cache is known and too small for this request: waiting
        cannot help. (A backend of unknown capacity might hold it.)"""
        backends = self.pools[pool].backends
        capacities = [self.capacity(b) for b in backends]
        return all(capacities) and not self.fits_ever(Route(pool, tokens, sequences))

    def pool_kv_tokens(self, pool: str, tokens: int, *, sequences: int = 1) -> int:
        """A request's KV tokens on the pool's backend with the largest blocks."""
        size = max((b.block_size for b in self.pools[pool].backends), default=1)
        return kv_tokens(tokens, sequences=sequences, block_size=size)

    def on_waiting(self, pool: str, waiting: WaitingTokens) -> None:
        """Tell the forecast what waits in `pool`'s queue (the queue policy's own count)."""
        self._waiting[pool] = waiting

    def retry_after(self, pool: str, tokens: int, *, sequences: int = 1) -> float:
        """Seconds until a request of `sequences` × `tokens` likely fits in the pool, behind
        the requests already queued there (gateway/admission/routing/forecast.py)."""
        now = self.clock.monotonic()
        need = self.pool_kv_tokens(pool, tokens, sequences=sequences)
        recent = self._forecasts.get((pool, need))
        if recent is not None and now - recent[0] < FORECAST_REUSE_S:
            return recent[1]
        seconds = self._forecast(pool, need, now)
        if len(self._forecasts) > 1024:  # sizes vary without end: keep the table small
            self._forecasts.clear()
        self._forecasts[(pool, need)] = (now, seconds)
        return seconds

    def wait_s(self, pool: str, tokens: int, *, sequences: int = 1) -> float:
        """The same forecast without Retry-After's one-second floor: how long a request
        queued now is expected to wait for room (a TTFT objective's prediction)."""
        need = self.pool_kv_tokens(pool, tokens, sequences=sequences)
        return self._forecast(pool, need, self.clock.monotonic(), floor_s=0.0)

    def _forecast(self, pool: str, need: int, now: float, *, floor_s: float = FLOOR_S) -> float:
        backends = self.pools[pool].backends
        in_flight = self.ledger.tokens_in_flight
        # the room for it on each backend, by the rule reserving follows
        fits = [
            self._fit_limit(b, need, limit=self.limit(b), capacity=self.capacity(b))
            for b in backends
        ]
        pairs = zip(fits, backends, strict=True)
        room = sum(max(0, fit - in_flight(b.name)) for fit, b in pairs if fit is not None)
        # what each request frees as it ends: its own tokens (shared blocks go with the
        # last holder, counted among the unaged)
        held = [(now - r.at, r.reservation.own_tokens) for r in self._held[pool].values()]
        unaged = sum(in_flight(b.name) for b in backends) - sum(size for _, size in held)
        waiting = self._waiting.get(pool)
        return seconds_until_fits(
            tokens=need,
            room=room,
            held=held,
            unaged_tokens=unaged,
            waiting=waiting() if waiting is not None else (),
            hold_s=expected_hold_s(self._holds[pool], (age for age, _ in held)),
            floor_s=floor_s,
        )

    def hold_s(self, pool: str) -> float | None:
        """How long `pool`'s reservations are held, on average over the last released
        (None: none released yet)."""
        return self._holds[pool].mean_s

    async def extend(self, reservation: Reservation, tokens: int) -> Reservation:
        """Grow a running request's reservation by `tokens`, over the limit if need be: it is
        generating already. Returns what it now holds."""
        grown = await self.ledger.extend(reservation, tokens)
        pool = self._backends[reservation.backend].pool
        record = self._held[pool].get(reservation.id)
        if record is not None:
            record.reservation = grown
        return grown

    async def release(self, reservation: Reservation) -> None:
        pool = self._backends[reservation.backend].pool
        record = self._held[pool].pop(reservation.id, None)  # gone even if the release fails
        self._groups.remove(reservation.id)
        if record is not None and record.adapter is not None:
            self._backends[reservation.backend].adapter_ended(record.adapter)
        await self.ledger.release(reservation)
        if record is not None:
            self._holds[pool].observe(self.clock.monotonic() - record.at)
        self._freed(reservation.backend)

    def released_elsewhere(self, backend: str, tokens: int) -> None:
        """Capacity another replica gave back, heard through the shared ledger."""
        self.room_opened(backend)

    def room_opened(self, backend: str) -> None:
        """`backend` may take requests it could not before (back in rotation, say): whoever
        waits for room in its pool looks again."""
        if backend in self._backends:
            self._freed(backend)

    def wake_all(self) -> None:
        """Call every listener for every pool: releases elsewhere may have gone unheard."""
        for pool in self.pools:
            for listener in self._listeners:
                listener(pool)

    def _freed(self, backend: str) -> None:
        pool = self._backends[backend].pool
        for listener in self._listeners:
            listener(pool)


def _shared(backend: Backend, shared: Sequence[SharedBlocks]) -> SharedBlocks:
    """A request's shared blocks on `backend`: those of its block size, none where it does
    not cache prefixes."""
    if backend.prefix_caching:
        for blocks in shared:
            if blocks.block_tokens == backend.block_size:
                return blocks
    return NO_BLOCKS


def _limit(capacity: int, target_fill: float) -> int:
    return math.floor(capacity * target_fill)
