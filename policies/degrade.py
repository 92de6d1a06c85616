"""Answer with the pool's smaller model when that pool has room; the answer names that model.

Its prediction for a request with a TTFT objective: the smaller pool's recent time to first
token when it has room now, else never (gateway/slo.py)."""

from __future__ import annotations

import math
from typing import ClassVar

from gateway.config import PoolSettings
from gateway.errors import UpstreamError
from gateway.outcome import Outcome
from gateway.overflow import Latencies, OverflowContext, PoolRoom, Route, predict
from gateway.request import Endpoint, InferenceRequest
from gateway.upstream.served import Served
from policies.deps import PolicyDeps


class DegradePolicy:
    name: ClassVar[str] = "degrade"
    # another pool's model answers: text only (never another model's vectors), and never a
    # stored response's continuation
    endpoints: ClassVar[frozenset[Endpoint]] = frozenset({Endpoint.CHAT, Endpoint.COMPLETIONS})
    serves_elsewhere: ClassVar[bool] = True

    def __init__(self, *, to_pool: str, room: PoolRoom, latencies: Latencies) -> None:
        self._to = to_pool
        self._room = room
        self._latencies = latencies

    @classmethod
    def build(cls, pool: PoolSettings, deps: PolicyDeps) -> DegradePolicy:
        if pool.degrade_to is None:
            raise ValueError(f"pool {pool.name!r}: the degrade policy needs degrade_to")
        return cls(to_pool=pool.degrade_to, room=deps.room, latencies=deps.latencies)

    def predict_ttft_s(self, request: InferenceRequest) -> float | None:
        route = Route(self._to, request.sequence_tokens, request.n, shared=request.shared)
        if not self._room.has_room(route):
            return math.inf
        return predict(self._latencies.local, self._to, request)

    async def serve(self, request: InferenceRequest, exchange: OverflowContext) -> Served | None:
        smaller = exchange.degraded(request, self._to)
        if smaller is None or not await exchange.admit(smaller):
            return None
        exchange.stop_recording()  # the smaller model's answer must not be cached as this pool's
        try:
            # public model = the smaller pool's name: the client learns which model answered
            return await exchange.serve_local(smaller, Outcome.DEGRADED)
        except UpstreamError:
            await exchange.release()  # nothing was sent: the next policy may answer
            return None
