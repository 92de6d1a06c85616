"""The last word: a polite 503 whose Retry-After says how fast the pool is draining."""

from __future__ import annotations

from typing import ClassVar

from gateway.config import PoolSettings
from gateway.errors import Rejected
from gateway.overflow import Decision, OverflowContext
from gateway.request import Endpoint, InferenceRequest
from policies.deps import PolicyDeps


class RejectPolicy:
    name: ClassVar[str] = "reject"
    endpoints: ClassVar[frozenset[Endpoint]] = frozenset(Endpoint)
    serves_elsewhere: ClassVar[bool] = False
    moves_streams: ClassVar[bool] = False

    async def decide(self, request: InferenceRequest, exchange: OverflowContext) -> Decision | None:
        raise Rejected(
            f"Pool {request.pool!r} is at capacity and every overflow path is spent; "
            "retry after the indicated delay.",
            retry_after=exchange.retry_after(request),
        )

    @classmethod
    def build(cls, pool: PoolSettings, deps: PolicyDeps) -> RejectPolicy:
        return cls()
