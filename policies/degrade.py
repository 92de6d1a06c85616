"""Answer with the pool's smaller model when that pool has room; the answer names that model."""

from __future__ import annotations

from typing import ClassVar

from gateway.config import PoolSettings
from gateway.errors import UpstreamError
from gateway.front.exchange import Served
from gateway.front.request import InferenceRequest
from gateway.outcome import Outcome
from gateway.overflow import OverflowContext
from policies.deps import PolicyDeps


class DegradePolicy:
    name: ClassVar[str] = "degrade"

    def __init__(self, *, to_pool: str) -> None:
        self._to = to_pool

    @classmethod
    def build(cls, pool: PoolSettings, deps: PolicyDeps) -> DegradePolicy:
        if pool.degrade_to is None:
            raise ValueError(f"pool {pool.name!r}: the degrade policy needs degrade_to")
        return cls(to_pool=pool.degrade_to)

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
