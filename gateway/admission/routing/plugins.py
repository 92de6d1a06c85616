"""Routing's plug-ins: filters say which backends may take a request, scorers weigh the
ones left, a picker orders them by the weighed scores; the router then reserves on the
first where the request fits (Router.fit). A pool's routing profile names its scorers,
their weights and its picker (gateway/config/routing.py); routing/profile.py builds them
from the one registry. docs/routing-plugins.md tells how to write one.

Every plug-in runs on every routing decision, on the event loop: it reads what the
backends last told (their scrape, their model listing, the ledger) and does no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar, Protocol

from gateway.admission.fleet.backends import Backend, Pool
from gateway.admission.routing.prefix_route import GroupLoads, Held, by_prefix
from gateway.admission.routing.route import Candidate, Route

Scores = list[float] | None  # a score per candidate, or nothing to say


class Filter(Protocol):
    """Whether a backend may take a request at all."""

    name: ClassVar[str]
    # True when it passes over backends only for a request that names backends to exclude
    # or a LoRA adapter: for any other request it is not run (most requests name neither)
    conditional: ClassVar[bool]

    def keeps(self, backend: Backend, route: Route, now: float) -> bool:
        """False passes `backend` over for this request."""
        ...


class Scorer(Protocol):
    """How well each candidate suits a request, from 0 (worst) to 1 (best)."""

    name: ClassVar[str]
    # the metrics it reads from each backend's scrape (ReportedLoad.signals): the scrape
    # keeps them, labels and all, for the pools whose profile has this scorer
    signals: ClassVar[frozenset[str]]
    # True when its scores alone rank the candidates as they come, least filled first:
    # a profile whose other scorers have nothing to say then keeps that order as it is
    follows_fill: ClassVar[bool]

    def score(
        self, route: Route, candidates: Sequence[Candidate], now: float
    ) -> list[float] | None:
        """A score per candidate, in their order (least filled first; two or more), or None
        when it has nothing to say about this request: it then weighs nothing."""
        ...


class Picker(Protocol):
    """The order in which reserving tries the candidates, from the weighed scores."""

    name: ClassVar[str]

    def order(
        self, candidates: Sequence[Candidate], weighed: Sequence[tuple[float, list[float]]]
    ) -> Sequence[Candidate]:
        """`weighed`: (weight, scores) of each scorer that had something to say."""
        ...


class InRotation:
    """A backend its health keeps in rotation (not draining, ejected or probing)."""

    name: ClassVar[str] = "in-rotation"
    conditional: ClassVar[bool] = False

    def keeps(self, backend: Backend, route: Route, now: float) -> bool:
        return backend.health.in_rotation(now)


class Serves:
    """A backend that serves the request's LoRA adapter, when it names one."""

    name: ClassVar[str] = "serves"
    conditional: ClassVar[bool] = True

    def keeps(self, backend: Backend, route: Route, now: float) -> bool:
        return route.adapter is None or route.adapter in backend.adapters


class NotExcluded:
    """A backend the request has not tried already and does not avoid."""

    name: ClassVar[str] = "not-excluded"
    conditional: ClassVar[bool] = True

    def keeps(self, backend: Backend, route: Route, now: float) -> bool:
        return backend.name not in route.exclude


class FillScorer:
    """The least filled once it holds the request scores highest: 1 − that fill."""

    name: ClassVar[str] = "fill"
    signals: ClassVar[frozenset[str]] = frozenset()
    follows_fill: ClassVar[bool] = True

    def score(self, route: Route, candidates: Sequence[Candidate], now: float) -> list[float]:
        return [1.0 - c.after for c in candidates]


class PrefixScorer:
    """1 for the backend likeliest to hold the request's prompt prefix or its session that
    the herding guard does not pass over (routing/prefix_route.py), 0 for the others. It
    has nothing to say about a request with neither."""

    name: ClassVar[str] = "prefix"
    signals: ClassVar[frozenset[str]] = frozenset()
    follows_fill: ClassVar[bool] = False

    def __init__(self, pool: Pool, *, groups: GroupLoads) -> None:
        self._pool = pool
        self._groups = groups

    def score(
        self, route: Route, candidates: Sequence[Candidate], now: float
    ) -> list[float] | None:
        if not route.prefix and route.session is None:
            return None
        pool = self._pool
        held = Held(pool.prefixes, route.prefix, events=pool.events, token_ids=route.token_ids)
        best = by_prefix(
            candidates,
            tokens=route.tokens * route.sequences,
            prefix=route.prefix,
            session=route.session,
            held=held,
            loads=self._groups,
            target_fill=pool.settings.target_fill,
        )
        return [1.0 if i == best else 0.0 for i in range(len(candidates))]


class AdapterScorer:
    """For a LoRA adapter's request: 1 where the adapter is active now, 0.5 where a step has
    a free adapter slot (or the backend does not say), 0 where every slot runs other
    adapters and the request would wait inside the engine for one (Backend.adapter_room,
    from `vllm:lora_requests_info`)."""

    name: ClassVar[str] = "adapter"
    signals: ClassVar[frozenset[str]] = frozenset()
    follows_fill: ClassVar[bool] = False

    def score(
        self, route: Route, candidates: Sequence[Candidate], now: float
    ) -> list[float] | None:
        adapter = route.adapter
        if adapter is None:
            return None
        return [1.0 - c.backend.adapter_room(adapter, now) / 2 for c in candidates]


class WaitingScorer:
    """Fewer requests waiting inside the engine scores higher: 1 − waiting ÷ the most any
    candidate has waiting, by each backend's last fresh scrape (ReportedLoad.waiting). It
    has nothing to say while no candidate reports any waiting."""

    name: ClassVar[str] = "waiting"
    signals: ClassVar[frozenset[str]] = frozenset()  # the load's own: every scrape keeps them
    follows_fill: ClassVar[bool] = False

    def score(self, route: Route, candidates: Sequence[Candidate], now: float) -> Scores:
        loads = [c.backend.reported_load(now) for c in candidates]
        waiting = [0 if load is None else load.waiting for load in loads]
        most = max(waiting)
        if most <= 0:
            return None
        return [1.0 - w / most for w in waiting]


class BestPicker:
    """The highest weighed sum first; ties keep the candidates' order, least filled first."""

    name: ClassVar[str] = "best"

    def order(
        self, candidates: Sequence[Candidate], weighed: Sequence[tuple[float, list[float]]]
    ) -> Sequence[Candidate]:
        totals = [0.0] * len(candidates)
        for weight, scores in weighed:
            for i, s in enumerate(scores):
                totals[i] += weight * s
        ranks = sorted(range(len(candidates)), key=lambda i: -totals[i])
        return [candidates[i] for i in ranks]


# the filters every profile runs, in this order
FILTERS: tuple[Filter, ...] = (InRotation(), NotExcluded(), Serves())
