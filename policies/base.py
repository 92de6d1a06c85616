"""The overflow policy role: what runs when no backend of a pool has room."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, Protocol

from gateway.clock import Clock
from gateway.config import PoolSettings, Settings
from gateway.exchange import Exchange, Served
from gateway.metrics import GatewayMetrics
from gateway.request import InferenceRequest
from gateway.router import Router


class OverflowPolicy(Protocol):
    """Tries to serve a request the pool had no room for.

    Returns what it served, or None to pass the request to the next policy.
    Raises a SpillgateError to refuse the request outright.
    Must release anything it reserved, on every path.
    """

    name: ClassVar[str]

    async def serve(self, request: InferenceRequest, exchange: Exchange) -> Served | None: ...


@dataclass(frozen=True, kw_only=True)
class PolicyDeps:
    """Everything a policy factory may draw on; built once in the app's lifespan."""

    settings: Settings
    router: Router
    metrics: GatewayMetrics
    clock: Clock


PolicyFactory = Callable[[PoolSettings, PolicyDeps], OverflowPolicy]
