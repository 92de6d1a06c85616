"""Admit: the request's first try for room, on the backend routing picks (prefix locality,
then room; gateway/admission/routing/router.py), against what the backends really hold. The
reservation it takes is the request's to release (gateway/admission/ledger/held.py).

An arrival does not take free room while the pool's queue has requests waiting ahead of it
(the queue's arrival check, policies/queue/): it joins them, through the ladder.
"""

from __future__ import annotations

from collections.abc import Mapping

from gateway.front.exchange import Exchange
from gateway.overflow import LetsIn
from gateway.request import InferenceRequest


class Admission:
    def __init__(self, *, arrival_checks: Mapping[str, LetsIn]) -> None:
        self._arrival_checks = arrival_checks  # pool → may arrivals go first

    async def first_try(self, request: InferenceRequest, exchange: Exchange) -> bool:
        """Room in the pool for an arrival, unless the queue's waiting requests go first;
        whether the request now holds a reservation."""
        check = self._arrival_checks.get(request.pool)
        return (check is None or check(request)) and await exchange.admit(request)
