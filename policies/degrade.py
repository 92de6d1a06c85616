"""Answer with the pool's smaller model when that pool has room; the answer names that model.

A request for a LoRA adapter is degraded only where the pool's adapter names one of the
smaller pool's to ask for in its place (`adapters[].degrade_to`); else the next step takes it.

Its prediction for a request with a TTFT objective: the smaller pool's recent time to first
token when it has room now, else never (gateway/slo.py)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import ClassVar

from gateway.config import PoolSettings
from gateway.errors import UpstreamError
from gateway.outcome import Outcome
from gateway.overflow import Latencies, OverflowContext, PoolRoom, Route, ServeHeld, predict
from gateway.request import Endpoint, InferenceRequest
from policies.deps import PolicyDeps


class DegradePolicy:
    name: ClassVar[str] = "degrade"
    # another pool's model answers: text only (never another model's vectors), and never a
    # stored response's continuation
    endpoints: ClassVar[frozenset[Endpoint]] = frozenset({Endpoint.CHAT, Endpoint.COMPLETIONS})
    serves_elsewhere: ClassVar[bool] = True
    # a stream stopped for more urgent work does not go on in another model's words
    moves_streams: ClassVar[bool] = False

    def __init__(
        self,
        *,
        to_pool: str,
        room: PoolRoom,
        latencies: Latencies,
        adapters: Mapping[str, str] | None = None,
    ) -> None:
        """`adapters`: each of the pool's adapters that may be degraded → the smaller pool's
        adapter asked for in its place."""
        self._to = to_pool
        self._room = room
        self._latencies = latencies
        self._adapters = adapters or {}

    @classmethod
    def build(cls, pool: PoolSettings, deps: PolicyDeps) -> DegradePolicy:
        if pool.degrade_to is None:
            raise ValueError(f"pool {pool.name!r}: the degrade policy needs degrade_to")
        adapters = {a.name: a.degrade_to for a in pool.adapters if a.degrade_to is not None}
        return cls(
            to_pool=pool.degrade_to, room=deps.room, latencies=deps.latencies, adapters=adapters
        )

    def predict_ttft_s(self, request: InferenceRequest) -> float | None:
        adapter = self._stand_in(request)
        if adapter is None and request.adapter is not None:
            return math.inf  # it is not degraded at all
        route = Route(
            self._to, request.sequence_tokens, request.n, shared=request.shared, adapter=adapter
        )
        if not self._room.has_room(route):
            return math.inf
        return predict(self._latencies.local, self._to, request)

    def _stand_in(self, request: InferenceRequest) -> str | None:
        """The smaller pool's adapter asked for in place of the request's (None: none)."""
        return None if request.adapter is None else self._adapters.get(request.adapter)

    async def decide(
        self, request: InferenceRequest, exchange: OverflowContext
    ) -> ServeHeld | None:
        adapter = self._stand_in(request)
        if request.adapter is not None and adapter is None:
            return None  # no adapter of the smaller model stands in for this one
        smaller = exchange.degraded(request, self._to, adapter=adapter)
        if smaller is None or not await exchange.admit(smaller):
            return None
        # public model = the smaller pool's name: the client learns which model answered;
        # that answer must not be cached as this pool's; and should the smaller pool fail it
        # before a byte, nothing was sent: the next step may answer
        return ServeHeld(smaller, Outcome.DEGRADED, recorded=False, passes_on=UpstreamError)
