"""Backends and pools as the router sees them: capacity, health, and the loop refreshing both.

A backend is in rotation until a probe or a request shows it cannot serve: nothing
answers at its URL, it answers 5xx, it no longer serves the model the pool names, it
breaks a stream off, or requests to it keep failing. Its health (health.py) decides, and
when it is back: on a probe that passes (an ejected one only once its cool-down is over).
Each change of rotation is logged once, with its reason.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
import orjson

from gateway.admission.fleet.backend_load import (
    LOAD_SIGNALS,
    SCRAPE_S,
    STALE_S,
    MetricsScrape,
    ReportedLoad,
)
from gateway.admission.fleet.demand import PoolDemand
from gateway.admission.fleet.discovery import (
    LengthHistogram,
    ServedModel,
    answer_lengths_from_metrics,
    capacity_from_metrics,
    merged,
    models_from_listing,
)
from gateway.admission.fleet.fill import FillController, FillReason
from gateway.admission.fleet.health import BackendHealth, Change
from gateway.admission.fleet.kv_events import EventsView, KvEvents
from gateway.admission.fleet.output_lengths import WINDOW, LengthSource, OutputLengths
from gateway.admission.prompt_tokens import PromptTokenizer
from gateway.admission.routing.prefix_index import PrefixIndex
from gateway.clock import Clock
from gateway.config import AdapterSettings, BackendSettings, PoolSettings, ReservationSettings
from gateway.config.pools import BackendRole
from gateway.config.references import backend_name
from gateway.config.routing import BUILTIN_PROFILES, RoutingProfileSettings, profile_named
from gateway.errors import BackendUnavailable
from gateway.request import InferenceRequest, PromptEstimator
from gateway.tasks import Periodic
from gateway.upstream.forward import unreachable_reason

log = logging.getLogger("spillgate.backends")

# why a backend whose API is not where its URL says is down (FleetWatcher)
_NO_API = (
    "GET {url}/v1/models answered 404: the url should be the server's root, where "
    "/v1/models is found (without /v1)"
)

# a pool's context limit when it sets none and no backend reports one
FALLBACK_MAX_MODEL_LEN = 32_768


@dataclass(eq=False, kw_only=True)
class Backend:
    name: str
    pool: str
    url: str
    served_model: str
    configured_capacity: int | None  # None: discovered from the backend's metrics
    block_size: int = 16  # tokens per KV block: configured, or discovered with the capacity
    # whether it holds a prompt prefix shared by requests in flight once (discovered with
    # the capacity: vLLM's enable_prefix_caching); unknown counts as not
    prefix_caching: bool = False
    discovered_capacity: int | None = None
    max_model_len: int | None = None  # the served model's context, from the backend's /v1/models
    role: BackendRole = "both"  # BackendSettings.role
    root: str | None = None  # the weights it loaded, from the same listing
    # the LoRA adapters of its model it serves, from the same listing (`parent`)
    adapters: frozenset[str] = frozenset()
    last_scrape: float = float("-inf")
    last_probe: float = float("-inf")
    # in rotation or not, and why: fed by its requests and by the probe (FleetWatcher)
    health: BackendHealth = field(default_factory=BackendHealth)
    fill: FillController = field(default_factory=lambda: FillController(1.0))
    load: ReportedLoad | None = None  # what it last reported holding (backend_load.py)
    # the metrics its scrape keeps: the load's, and those its pool's routing reads
    signals: frozenset[str] = LOAD_SIGNALS
    load_at: float = float("-inf")
    reserved_at_load: int = 0  # what the ledger held on it while that scrape was taken
    # the lengths of the answers it generated, as its metrics last told them; read only
    # while its pool reserves by lengths other than its own answers'
    answers: LengthHistogram | None = None
    # LoRA: the adapters of this process's requests in flight there, each with its count,
    # known at once; and how many adapters a step may run, as its scrape last told it
    running_adapters: dict[str, int] = field(default_factory=dict)
    max_loras: int | None = None

    def report(self, load: ReportedLoad, *, now: float, reserved: int = 0) -> FillReason | None:
        """Take a scrape of the backend's own load, and what the ledger held on it as the
        scrape was taken; the reason its fill backed off, if it did."""
        previous, self.load, self.load_at = self.load, load, now
        self.reserved_at_load = reserved
        if load.max_loras is not None:
            self.max_loras = load.max_loras
        counter = load.preemptions
        before = None if previous is None else previous.preemptions
        preempted = load.retracted > 0 or (
            counter is not None and before is not None and counter > before
        )
        capacity = self.configured_capacity or self.discovered_capacity
        return self.fill.observe(
            now=now,
            preempted=preempted,
            waiting=load.waiting > 0,
            idle=load.running == 0 and load.waiting == 0,  # running unknown: not idle
            held=load.kv_usage,
            reserved=reserved / capacity if capacity else None,
        )

    def reported_load(self, now: float) -> ReportedLoad | None:
        """The backend's last scrape of its load, None when it is stale (or never came)."""
        return self.load if now - self.load_at <= STALE_S else None

    def adapter_room(self, adapter: str, now: float) -> int:
        """How readily it runs a request for `adapter` now: 0 where the adapter runs (this
        process's requests in flight there, or its last fresh scrape says so), 1 where a
        step has a free adapter slot (or the slots are not known yet), 2 where the adapters
        running there take every slot and the request would wait inside the engine for one.
        The process's own requests count at once, where a scrape tells them up to half a
        second late: a burst's requests for adapters running nowhere yet would all take
        the same free slots."""
        load = self.reported_load(now)
        reported = frozenset() if load is None else load.active_adapters
        running = self.running_adapters
        if adapter in running or adapter in reported:
            return 0
        if self.max_loras is None:
            return 1
        return 1 if len(reported.union(running)) < self.max_loras else 2

    def adapter_started(self, adapter: str) -> None:
        """A request of this process for `adapter` holds room here now."""
        self.running_adapters[adapter] = self.running_adapters.get(adapter, 0) + 1

    def adapter_ended(self, adapter: str) -> None:
        left = self.running_adapters.get(adapter, 0) - 1
        if left > 0:
            self.running_adapters[adapter] = left
        else:
            self.running_adapters.pop(adapter, None)

    def capacity(self, *, now: float, stale_after: float) -> int:
        """Tokens the backend can hold; 0 (full) when unknown or its metrics went stale."""
        if self.configured_capacity is not None:
            return self.configured_capacity
        if self.discovered_capacity is None or now - self.last_scrape > stale_after:
            return 0
        return self.discovered_capacity

    def healthy(self, now: float) -> bool:
        """In rotation: routing may send it requests."""
        return self.health.in_rotation(now)

    @property
    def down_reason(self) -> str | None:
        """Why it is out of rotation; None while in rotation."""
        return self.health.reason

    def record_failure(
        self, now: float, *, reason: str = "", unreachable: str | None = None
    ) -> None:
        """A request to the backend failed before its answer. `unreachable` (why nothing
        answered at its address) takes it out of rotation at once."""
        if unreachable is not None:
            self._told(self.health.unreachable(unreachable))
        else:
            self._told(self.health.failed(now, reason))

    def record_success(self, now: float) -> None:
        """A request to the backend was answered in full."""
        self._told(self.health.served(now))

    def broke_off(self) -> None:
        """A stream it was answering broke off mid-answer."""
        self._told(self.health.broke_off())

    def probe_failed(self, reason: str) -> None:
        self._told(self.health.probe_failed(reason))

    def probe_passed(self, now: float) -> None:
        self._told(self.health.probe_passed(now))

    def _told(self, change: Change | None) -> None:
        # a new reason while out is no change of rotation: not logged
        if change is None:
            return
        if change.up:
            log.warning("backend %s is up again (was: %s)", self.name, change.reason)
        else:
            log.warning("backend %s is down: %s", self.name, change.reason)

    def learn(self, models: list[ServedModel]) -> str | None:
        """Take what the backend's /v1/models says; the reason it cannot serve, if any."""
        self.adapters = frozenset(m.id for m in models if m.parent == self.served_model)
        for model in models:
            if model.id == self.served_model:
                self.max_model_len = model.max_model_len or self.max_model_len
                self.root = model.root or self.root
                return None
        names = ", ".join(repr(m.id) for m in models) or "no model"
        return f"it serves {names}, not {self.served_model!r} (check served_model)"


@dataclass(eq=False, kw_only=True)
class Pool:
    settings: PoolSettings
    # the backends that serve its requests; those that only prefill prompts for them
    # (`role: prefill`) are `prefillers`, with a ledger, a fill and a queue-free admission
    # of their own (gateway/front/prefill.py)
    backends: list[Backend]
    demand: PoolDemand
    estimator: PromptEstimator = field(default_factory=PromptEstimator)
    outputs: OutputLengths = field(default_factory=lambda: OutputLengths(ReservationSettings()))
    prefixes: PrefixIndex = field(default_factory=PrefixIndex)
    # backends that publish KV events → what their events say they hold
    # (gateway/admission/fleet/kv_events.py), and the model's tokenizer to match prompts against it
    events: dict[str, EventsView] = field(default_factory=dict)
    tokenizer: PromptTokenizer | None = None
    # the routing profile its `routing` names (gateway/config/routing.py), and whether it
    # weighs where a prompt's prefix is cached: its requests' prompts are then keyed, and
    # where they went remembered (worked out once: every request asks)
    routing: RoutingProfileSettings = BUILTIN_PROFILES["prefix"]
    by_prefix: bool = True
    prefillers: list[Backend] = field(default_factory=list)
    # every backend of the pool in its settings' order, prefillers too: what is probed,
    # scraped and shown
    members: list[Backend] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.settings.name

    # the longest request (prompt plus output tokens) the pool accepts: its own setting,
    # else the smallest context its backends reported, else a fallback
    max_model_len: int = field(init=False)
    # the longest context the pool knows its model to have: its setting, or what its
    # backends report, whichever is longer (any backend may serve a request, and one that
    # names no output limit may be answered up to the engine's own context); None where
    # neither is known (no fallback: a guess too short would call true answers lies).
    # Both are read by every request, and change only as a backend's listing is learned
    model_context: int | None = field(init=False)

    def __post_init__(self) -> None:
        self.members = self.members or self.backends + self.prefillers
        self._contexts_learned()

    def learn(self, backend: Backend, models: list[ServedModel]) -> str | None:
        """Take what `backend`'s /v1/models says (Backend.learn): the reason it cannot serve,
        if any."""
        mismatch = backend.learn(models)
        self._contexts_learned()
        return mismatch

    def _contexts_learned(self) -> None:
        known = [b.max_model_len for b in self.backends if b.max_model_len is not None]
        own = self.settings.max_model_len
        fallback = min(known) if known else FALLBACK_MAX_MODEL_LEN
        self.max_model_len = own if own is not None else fallback
        if own is not None:
            known.append(own)
        self.model_context = max(known) if known else None

    @property
    def shared_block_sizes(self) -> frozenset[int]:
        """The block sizes of the pool's backends that hold a prompt prefix shared by
        requests in flight once: a request's shared blocks are keyed at each (none: the
        pool shares nothing, and no request's prompt is keyed for it)."""
        return frozenset(b.block_size for b in self.backends if b.prefix_caching)

    def tokenizes(self, request: InferenceRequest) -> bool:
        """Whether `request` is worth its tokens: the pool has the model's tokenizer, and the
        request may share prompt blocks with requests in flight or is routed by the blocks
        the pool's engines report holding (KV events)."""
        return self.tokenizer is not None and bool(
            request.shared or (request.prefix and self.events)
        )

    def serves(self, adapter: str) -> bool:
        """Whether a backend of the pool serves the LoRA adapter `adapter` now."""
        return any(adapter in b.adapters for b in self.backends)

    def adapter(self, name: str) -> AdapterSettings:
        """The pool's adapter called `name`."""
        return next(a for a in self.settings.adapters if a.name == name)

    def may_serve(self, model: str, tenant: str) -> bool:
        """Whether `tenant` may ask the pool for `model`: the pool's own, or one of its LoRA
        adapters that names no tenants or names this one."""
        if model == self.name:
            return True
        return any(
            a.name == model and (not a.tenants or tenant in a.tenants)
            for a in self.settings.adapters
        )

    @property
    def root(self) -> str | None:
        """The weights the pool's backends serve, as the first to report them said."""
        return next((b.root for b in self.backends if b.root is not None), None)

    def outage(self) -> BackendUnavailable | None:
        """The refusal to give when no backend of the pool is reachable, naming why."""
        down = [b for b in self.backends if b.down_reason is not None]
        if len(down) < len(self.backends):
            return None
        causes = "; ".join(f"{b.name} ({b.url}): {b.down_reason}" for b in down)
        return BackendUnavailable(f"No backend of pool {self.name!r} is available: {causes}.")


def build_pools(
    pools: list[PoolSettings],
    *,
    clock: Clock,
    profiles: list[RoutingProfileSettings] | tuple[()] = (),
) -> dict[str, Pool]:
    """The pools of `pools`, each with the routing profile it names (of `profiles`, or a
    built-in one)."""
    built: dict[str, Pool] = {}
    for pool in pools:
        members = [_backend(pool, i, b) for i, b in enumerate(pool.backends)]
        tokenizer = None if pool.tokenizer is None else PromptTokenizer(pool.tokenizer)
        routing = profile_named(pool.routing, profiles)
        by_prefix = any(s.plugin == "prefix" for s in routing.scorers)
        # the events index matches the prompt's tokens: only with a tokenizer, routing by prefix
        by_events = by_prefix and tokenizer is not None
        built[pool.name] = Pool(
            settings=pool,
            backends=[b for b in members if b.role != "prefill"],
            prefillers=[b for b in members if b.role == "prefill"],
            members=members,
            demand=PoolDemand(clock),
            outputs=OutputLengths(pool.reservation),
            events={
                backend.name: EventsView()
                for backend, b in zip(members, pool.backends, strict=True)
                if b.kv_events is not None and by_events
            },
            tokenizer=tokenizer,
            routing=routing,
            by_prefix=by_prefix,
        )
    return built


def _backend(pool: PoolSettings, index: int, b: BackendSettings) -> Backend:
    return Backend(
        name=backend_name(pool.name, index, b.name),
        pool=pool.name,
        url=b.url.rstrip("/"),
        served_model=b.served_model or pool.name,
        configured_capacity=None if b.capacity == "auto" else b.capacity,
        block_size=b.block_size,
        fill=FillController(pool.target_fill),
        role=b.role,
    )


class ProbeFailed(Exception):
    """The backend did not answer a probe as a live server does; `reason` says how."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class FleetWatcher:
    """Probes every backend: its models, its capacity (or its health), and whether it
    answers at all; an out-of-rotation backend is probed on every tick. While a pool has
    too few answers of its own to reserve by, the probe also reads the lengths of the
    answers its backends generated, and the pool borrows them (output_lengths.py).

    Any answer below 500 shows a live server: a backend without `/health` or `/metrics`
    (a 404) is not held against it, only left unchecked. `/v1/models` is the API itself:
    a 404 there means the URL names no OpenAI-compatible server's root (most often it ends
    in `/v1`), so every request would be a 404 too, and the backend is down saying so.
    """

    TICK_S = 1.0

    def __init__(
        self,
        pools: dict[str, Pool],
        *,
        client: httpx.AsyncClient,
        scrape: MetricsScrape,
        clock: Clock,
        on_room: Callable[[str], None] | None = None,
    ) -> None:
        """`on_room(backend)`: a probe found that a backend may now take requests it could
        not before (back in rotation, its capacity known again, an adapter it newly
        serves), so that whoever waits for room looks again."""
        self._pools = pools
        self._client = client
        self._scrape = scrape
        self._clock = clock
        self._on_room = on_room
        self._periodic = Periodic(self.refresh_once, every_s=self.TICK_S, name="fleet-watcher")
        # what the backends that publish KV events say they cache, heard as they say it
        self._events = KvEvents(
            {
                backend.name: (where, pool.events[backend.name])
                for pool in pools.values()
                for backend, b in zip(pool.members, pool.settings.backends, strict=True)
                if (where := b.kv_events) is not None and backend.name in pool.events
            },
            clock=clock,
        )

    async def refresh_once(self) -> None:
        now = self._clock.monotonic()
        learning = {name for name, pool in self._pools.items() if pool.outputs.learning()}
        jobs = [
            self._refresh(backend, pool.settings.capacity_refresh_s, lengths=name in learning)
            for name, pool in self._pools.items()
            for backend in pool.members
            if now - backend.last_probe >= pool.settings.capacity_refresh_s
            or backend.health.probe_due(now)
        ]
        await asyncio.gather(*jobs)
        for name in learning:
            pool = self._pools[name]
            answers = merged(b.answers for b in pool.backends)
            lengths = [] if answers is None else answers.lengths(WINDOW)
            pool.outputs.borrow(LengthSource.BACKENDS, lengths)

    async def _refresh(self, backend: Backend, budget_s: float, *, lengths: bool) -> None:
        before = self._offers(backend)
        try:
            await self._probe(backend, budget_s, lengths=lengths)
        finally:
            if self._on_room is not None and not before >= self._offers(backend):
                self._on_room(backend.name)

    def _offers(self, backend: Backend) -> frozenset[str]:
        """What `backend` may take now: nothing out of rotation or of unknown capacity,
        else its model and the adapters it serves."""
        now = self._clock.monotonic()
        stale = self._pools[backend.pool].settings.metrics_stale_s
        if not backend.healthy(now) or backend.capacity(now=now, stale_after=stale) <= 0:
            return frozenset()
        return backend.adapters | {backend.served_model}

    async def _probe(self, backend: Backend, budget_s: float, *, lengths: bool) -> None:
        now = self._clock.monotonic()
        backend.last_probe = now
        try:
            listing = await self._get(backend, "/v1/models", budget_s)
            models = None if listing is None else models_from_listing(_json(listing))
            if backend.configured_capacity is None or lengths:
                text = await self._get(backend, "/metrics", budget_s, scraped=True)
                if text is not None:
                    self._read_metrics(backend, text, now=now, lengths=lengths)
            else:
                await self._get(backend, "/health", budget_s)
        except ProbeFailed as exc:
            backend.probe_failed(exc.reason)
            return
        pool = self._pools[backend.pool]
        mismatch = None if models is None else pool.learn(backend, models)
        if mismatch is not None:
            backend.probe_failed(mismatch)
        else:
            backend.probe_passed(now)

    @staticmethod
    def _read_metrics(backend: Backend, text: str, *, now: float, lengths: bool) -> None:
        """Its capacity (when it is not configured) and, when asked, its answers' lengths."""
        if backend.configured_capacity is None:
            cache = capacity_from_metrics(text)
            if cache is not None:
                backend.discovered_capacity = cache.tokens
                backend.block_size = cache.block_size
                backend.prefix_caching = cache.prefix_caching
                backend.last_scrape = now
        if lengths:
            try:
                backend.answers = answer_lengths_from_metrics(text, model=backend.served_model)
            except ValueError:
                backend.answers = None  # a page the parser cannot read tells no lengths

    async def _get(
        self, backend: Backend, path: str, budget_s: float, *, scraped: bool = False
    ) -> str | None:
        """The body of `GET path`, None when the server has no such route; `scraped`: the
        metrics page, taken from the load's scrape when it is fresh."""
        try:
            if scraped:
                response = await self._scrape.get(backend.url, timeout_s=budget_s, fresh_s=SCRAPE_S)
            else:
                response = await self._client.get(f"{backend.url}{path}", timeout=budget_s)
        except httpx.TimeoutException:
            raise ProbeFailed(f"no answer from {backend.url} within {budget_s:g} s") from None
        except httpx.ConnectError as exc:
            raise ProbeFailed(unreachable_reason(backend.url, exc)) from None
        except httpx.TransportError as exc:
            raise ProbeFailed(f"GET {path} failed: {type(exc).__name__}") from None
        if response.status_code >= 500:
            raise ProbeFailed(f"GET {path} answered {response.status_code}")
        if response.status_code == 404 and path == "/v1/models":
            raise ProbeFailed(_NO_API.format(url=backend.url))
        return response.text if response.status_code < 400 else None

    async def start(self) -> None:
        """Probe every backend before the first request, then every TICK_S."""
        await self.refresh_once()
        self._periodic.start()
        await self._events.start()

    async def stop(self) -> None:
        await self._events.stop()
        await self._periodic.stop()


def _json(text: str) -> object:
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError:
        return None
