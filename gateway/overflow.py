"""The overflow policy role: what runs when no backend of a pool has room, the decisions a
policy hands back for the serve stage to carry out, the hooks a policy may offer the request
path (recording answers, holding new arrivals back), and the narrow roles of the gateway's
parts a policy is handed (room in the pools, the metric families it keeps, the batch tier's
intake, a provider's slots and token budget).

A policy decides; it never forwards. It finds room (the queue waits for it, `degrade` takes
it in another pool) or a target (`provider`), and says so as a `ServeHeld` or a
`ServeTarget`; the ladder (gateway/front/ladder.py) carries the decision out, so the serve
stage alone talks to the upstream, and one decision serves a request as it arrives or a
stream the gateway has to move. A step that answers by itself from what it keeps (`cache`,
`batch`) hands back what it `Served`.

The gateway sees the policies only through these, and the policies see the gateway only
through these and the values they name, which a policy imports from here (never from
gateway/upstream/, whose client a policy reaches only through `OverflowContext`);
`gateway/app.py` builds the chains and hands each the concrete parts.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Collection, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, TypeAlias, runtime_checkable

from gateway.admission.routing.route import Route as Route
from gateway.config import Priority
from gateway.errors import NoRoomToRetry, UpstreamError, UpstreamUnavailable
from gateway.outcome import Outcome
from gateway.request import Endpoint, InferenceRequest

# The values a policy names, re-exported (with `Route` above): a policy builds the `Route`
# it asks a pool's room about; predicts its time to first token from the targets' recent
# answers (PredictsTtft); hands back what it served (`Served`: what was relayed and its
# usage); builds the `Target` a `ServeTarget` names; and a recorder reads the events it
# is fed as the relay reads them (`event_data`).
from gateway.slo import Latencies as Latencies
from gateway.slo import predict as predict
from gateway.upstream.answer import AnswerRecorder as AnswerRecorder
from gateway.upstream.answer import Usage as Usage
from gateway.upstream.answer import event_data as event_data
from gateway.upstream.relay import Relayed as Relayed
from gateway.upstream.served import Served as Served
from gateway.upstream.target import Target as Target

if TYPE_CHECKING:
    from prometheus_client import Counter, Gauge, Histogram

    from gateway.admission.ledger.reservations import Reservation as Reservation


class OverflowContext(Protocol):
    """What a policy may do with the request it was handed: the exchange's methods a
    policy uses (gateway/front/exchange.py), and nothing it could overwrite."""

    def reserve(
        self, request: InferenceRequest, *, exclude: Collection[str] = ()
    ) -> Awaitable[Reservation | None]: ...

    async def admit(self, request: InferenceRequest) -> bool: ...

    def take(self, reservation: Reservation) -> None:
        """Hold `reservation`, made for this request elsewhere (the queue's drain)."""

    def release(self) -> Awaitable[None]: ...

    def stop_recording(self) -> None: ...

    def note_time(self, phase: str, seconds: float) -> None: ...

    @property
    def moving(self) -> bool:
        """Whether the request is one the gateway stopped for more urgent work and now
        finds room for again (a step that `moves_streams`): its service was counted when it
        was first admitted."""
        ...

    def retry_after(self, request: InferenceRequest) -> float: ...

    def degraded(
        self, request: InferenceRequest, pool: str, *, adapter: str | None = None
    ) -> InferenceRequest | None:
        """`request` sent to `pool`, asking there for `adapter` in place of its own; None
        where that pool's model cannot hold it, or nothing stands in for its adapter."""

    def send_json(self, body: bytes, *, status: int, outcome: Outcome) -> Awaitable[Relayed]:
        """Answer the client with the JSON document `body`, told as `outcome`; what was
        relayed carries the usage the document tells (a cached answer's)."""
        ...

    async def send_events(
        self, events: Iterable[bytes], *, outcome: Outcome, usage: Usage
    ) -> Relayed:
        """Answer a streaming client with the server-sent `events` (a kept answer replayed),
        told as `outcome`, and end the stream; `usage` is what the events carried."""
        ...


@dataclass(frozen=True, slots=True)
class ServeHeld:
    """Serve `request` from the backend of the reservation the exchange now holds for it
    (the step took it: the queue's turn, room in the smaller pool), told as `outcome`."""

    request: InferenceRequest  # as sent: the smaller pool's where it was degraded
    outcome: Outcome
    # whether the answer may be recorded as the pool's (the cache): not another model's
    recorded: bool = True
    # a failure before the first byte that passes the request to the next step, its
    # reservation given back (the rest of the pool was full: `NoRoomToRetry`); any other
    # failure is the client's answer
    passes_on: type[UpstreamError] = NoRoomToRetry


class Spill(Protocol):
    """What a step that sends a request outside the pools keeps of it (a provider's claim on
    its slots and budget), told how the sending went: exactly one of these is called."""

    async def refused(self, error: UpstreamUnavailable) -> None:
        """The target failed before the first byte: the request passes to the next step."""
        ...

    async def abandoned(self) -> None:
        """The request ended while the target answered (cancelled, the client gone)."""
        ...

    async def answered(self, served: Served) -> None:
        """The target answered (in full, or cut mid-stream with the gateway's error event)."""
        ...


@dataclass(frozen=True, slots=True)
class ServeTarget:
    """Send `request` once to `target`, outside the pools, its answer naming `public_model`
    and told as `outcome`; `spill` hears how it went."""

    target: Target
    request: InferenceRequest
    outcome: Outcome
    public_model: str
    spill: Spill


# what a step decides: serve on the reservation it took, serve at a target, or (the cache,
# the batch tier) the answer it already gave
Decision: TypeAlias = ServeHeld | ServeTarget | Served


class OverflowPolicy(Protocol):
    """Decides how to serve a request the pool had no room for.

    Returns its decision, which the ladder carries out, or None to pass the request to the
    next policy. Raises a SpillgateError to refuse the request outright.
    Must release anything it reserved on every path that returns no decision.
    """

    name: ClassVar[str]
    # the endpoints whose requests it can serve: a chain built for an endpoint keeps only
    # these steps (an embedding is never degraded to another model's vectors, nor cached)
    endpoints: ClassVar[frozenset[Endpoint]]
    # whether it serves from capacity outside the pool (another pool, a provider): such a
    # step may serve a request no backend of the pool could ever hold, and the TTFT ladder
    # may send a request there while the pool's own backends are too slow for it
    serves_elsewhere: ClassVar[bool]
    # whether it may find room again on the pool for a request the gateway stopped for
    # more urgent work, so that its stream goes on where it was (the queue): its decision
    # for such a request is a `ServeHeld` on the request's own pool
    moves_streams: ClassVar[bool]

    async def decide(
        self, request: InferenceRequest, exchange: OverflowContext
    ) -> Decision | None: ...


@runtime_checkable
class RecordsAnswers(Protocol):
    """A policy that also records its pool's successful answers (the cache fills this way)."""

    def recorder_for(self, request: InferenceRequest) -> AnswerRecorder | None: ...


RecorderFor = Callable[[InferenceRequest], AnswerRecorder | None]


@runtime_checkable
class ArrivalCheck(Protocol):
    """A policy that decides whether new arrivals may take free room directly (the queue:
    not while others wait ahead of them)."""

    def lets_in(self, request: InferenceRequest) -> bool: ...


LetsIn = Callable[[InferenceRequest], bool]


@runtime_checkable
class CountsService(Protocol):
    """A policy that keeps what each tenant of its pool was served lately (the queue, which
    orders by it): told of each request the pool admits directly, and of each answer of
    the pool's backends as it settles with its usage."""

    def admitted(self, request: InferenceRequest) -> None: ...

    def settled(
        self, request: InferenceRequest, prompt_tokens: int, completion_tokens: int
    ) -> None: ...

    def attained(self) -> dict[str, float]:
        """Each tenant's attained service now, in weighted tokens (/admin/status)."""
        ...


@runtime_checkable
class PredictsTtft(Protocol):
    """A policy that can tell how long a request would wait for its first token if it served
    it now, so that a request with a TTFT objective passes over it when it would miss
    (gateway/slo.py)."""

    def predict_ttft_s(self, request: InferenceRequest) -> float | None:
        """Seconds to the first token; math.inf when it cannot serve the request now; None
        when nothing is measured yet to predict by (the request tries it)."""
        ...


@dataclass(frozen=True, slots=True)
class Rival:
    """A tenant waiting in another replica's queue for the same pool."""

    priority: Priority
    tenant: str
    tokens: int  # its next request's sequence tokens
    sequences: int
    replica: str = field(default="", compare=False)  # the replica it waits at


class SharedService(Protocol):
    """A pool's attained service as the replicas share it (policies/queue/service.py)."""

    @property
    def half_life_s(self) -> float: ...

    def take_unshared(self) -> dict[str, float]:
        """What this replica counted since its last pass, held as sent until one of:"""
        ...

    def replace_base(self, fleet: dict[str, float]) -> None:
        """The fleet's figures came back (this replica's sent counts included)."""
        ...

    def keep_sent(self) -> None:
        """The pass failed: what was sent stays in this replica's own figures."""
        ...


class SharedQueue(Protocol):
    """A pool's queue as the replicas' shared view of the queues sees it."""

    @property
    def service(self) -> SharedService: ...

    def waiting_heads(self) -> list[tuple[Priority, str, int, int]]:
        """Each tenant waiting here: class, tenant, next request's sequence tokens and n."""
        ...

    def rivals_seen(self, rivals: list[Rival]) -> None:
        """The tenants waiting at the other replicas ([]: none, or unknown)."""
        ...

    def rivals_heard(self, replica: str, rivals: list[Rival]) -> None:
        """The tenants now waiting at `replica`, as it announced them between passes."""
        ...


class QueueFeed(Protocol):
    """Where the queues share their service and waiters with the other replicas
    (gateway/shared/service_feed.py); only in shared mode."""

    def register(self, pool: str, queue: SharedQueue) -> None: ...

    def announce(self, pool: str, heads: list[tuple[Priority, str, int, int]]) -> None:
        """Tell the other replicas at once who waits here now (`waiting_heads`), without
        waiting for the next pass; never waits itself."""
        ...

    def call_preemption(self, pool: str, priority: Priority, tokens: int, sequences: int) -> None:
        """Ask the other replicas to stop lower-class work of theirs so that a waiter here
        of `priority` and `sequences` × `tokens` fits in `pool`; one of them answers (the
        first to claim the call); never waits itself."""
        ...


class Preempts(Protocol):
    """The requests in flight that more urgent work may stop (gateway/front/preemption.py)."""

    def make_room(self, route: Route, priority: Priority) -> bool:
        """Stop the fewest requests of a class below `priority` in the route's pool whose
        room lets the route fit; whether room is made or coming. False: nothing this
        replica runs would make room."""
        ...

    def could_make_room(self, route: Route, priority: Priority) -> bool:
        """Whether `make_room` would stop any request here now."""
        ...


class PoolRoom(Protocol):
    """Room in the pools as a policy that waits for it sees it (admission/routing/router.py's
    Router): what a request takes, whether it fits now or ever, and word of every release.
    """

    def on_release(self, listener: Callable[[str], None]) -> None:
        """Call `listener(pool)` whenever capacity is given back in a pool."""
        ...

    def on_waiting(self, pool: str, waiting: Callable[[], list[int]]) -> None:
        """Tell the forecast what waits in `pool`: the KV tokens of each waiting request."""
        ...

    def has_room(self, route: Route) -> bool:
        """Whether a reservation for `route` would find room now (from the last known tokens
        in flight): on a backend its pool's routing filters keep, by the rule reserving
        follows, its shared blocks counted as the reservation counts them."""
        ...

    def fits_ever(self, route: Route) -> bool:
        """Whether any backend of the route's pool (serving its adapter, when it names one)
        could hold its request even when idle."""
        ...

    def pool_kv_tokens(self, pool: str, tokens: int, *, sequences: int = 1) -> int:
        """The request's KV tokens on the pool's backend with the largest blocks."""
        ...

    async def release(self, reservation: Reservation) -> None:
        """Give back a reservation no request holds (one made for a waiter that left)."""
        ...

    def hold_s(self, pool: str) -> float | None:
        """How long the pool's reservations are held on average (None: none ended yet)."""
        ...

    def wait_s(self, pool: str, tokens: int, *, sequences: int = 1) -> float:
        """Seconds until a request of `sequences` × `tokens` likely fits in the pool, behind
        the requests already waiting there."""
        ...


class QueueMetrics(Protocol):
    """The metric families a queue keeps (gateway/metrics.py names them)."""

    @property
    def queue_depth(self) -> Gauge: ...

    @property
    def queue_wait(self) -> Histogram: ...

    @property
    def queue_displaced(self) -> Counter: ...


class ProviderMetrics(Protocol):
    """The metric families a provider's gate and policy keep (gateway/metrics.py names them)."""

    @property
    def upstream_errors(self) -> Counter: ...

    @property
    def provider_cost(self) -> Counter: ...

    @property
    def provider_breaker_open(self) -> Gauge: ...


class PolicyMetrics(QueueMetrics, ProviderMetrics, Protocol):
    """Every metric family a policy keeps: GatewayMetrics, as the policies see it."""


class Slots(Protocol):
    """Leases counted and capped per key (an in-flight Ledger, admission/ledger/reservations.py): a
    provider's concurrency slots, a lease of one token per request, shared by the fleet when
    the ledger is."""

    async def reserve(self, backend: str, tokens: int, *, limit: int) -> Reservation | None:
        """Take `tokens` under `backend` if what it holds stays within `limit`; else None."""
        ...

    async def release(self, reservation: Reservation) -> None:
        """Give back what the lease holds; releasing twice is a no-op."""
        ...

    def sessions(self, backend: str) -> int:
        """Leases held under `backend` (last known, over the fleet when shared)."""
        ...


class TokenBudget(Protocol):
    """Tokens per minute for one spender (a provider), spent before a request is sent and
    settled with what it used (gateway/ratelimit/budget.py)."""

    async def spend(self, tokens: int) -> bool:
        """Take `tokens` if the budget holds them, in one atomic check-and-debit."""
        ...

    async def settle(self, *, spent: int, used: int) -> None:
        """Give back what a spend of `spent` did not use, or charge what it used beyond."""
        ...


class BatchIntake(Protocol):
    """The batch tier's door for one request that may wait (gateway/batch/service.py)."""

    async def create_one(self, request: InferenceRequest) -> dict[str, Any]:
        """A one-item batch holding `request`, as its owner sees it (OpenAI's batch object);
        raises a SpillgateError when the tenant's batch limits refuse it."""
        ...
