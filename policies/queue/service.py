"""Attained service: the tokens each tenant of a pool was served lately, the queue's measure
of who goes first within a priority class (policies/queue/fair_queue.py).

A tenant's figure is its prompt tokens plus `output_weight` × its completion tokens, each
halving every `half_life_s` after it counted. A request counts when the pool admits it,
with what it reserves (its prompt and its expected output), and is corrected when its
answer settles with the usage the backend reported: a tenant whose long streams hold the
pool counts from their start, not only once they end, so it never looks idle while it
holds most of the room. A request whose usage never came (the client left mid-stream, the
backend failed) keeps what it counted on admission: it held the room.

Counting costs one dict update: figures are kept in units that grow with time (a token
counted at t is stored as 2^((t - epoch) / half_life)), so nothing decays in place; a
figure is read by dividing by the growth of now. The epoch moves forward, rescaling every
figure once, long before the growth could overflow.

In shared mode (gateway/shared/service_feed.py) a replica's own counts since its last
pass are sent to Redis, and `base` becomes the fleet's figures as read back; until the
next pass a figure is the fleet's at the last read plus what this replica counted since.
"""

from __future__ import annotations

import math

from gateway.clock import Clock
from gateway.request import InferenceRequest

REBASE_GROWTH = 2.0**32  # rescale when the stored units have grown this much


class Service:
    """One pool's attained service per tenant, in weighted tokens."""

    def __init__(self, *, clock: Clock, output_weight: float, half_life_s: float) -> None:
        self._clock = clock
        self.output_weight = output_weight
        self.half_life_s = half_life_s
        self._rate = math.log(2) / half_life_s
        self._epoch = clock.monotonic()
        self._base: dict[str, float] = {}  # the fleet's at the last read; locally, empty
        self._sent: dict[str, float] = {}  # sent to the fleet, its figures not read back yet
        self._own: dict[str, float] = {}  # counted here since the last pass (locally: all)

    def _growth(self, now: float) -> float:
        return math.exp(self._rate * (now - self._epoch))

    def _count(self, tenant: str, weighted: float) -> None:
        growth = self._growth(self._clock.monotonic())
        if growth > REBASE_GROWTH:
            self._rebase()
            growth = 1.0
        own = self._own
        own[tenant] = own.get(tenant, 0.0) + weighted * growth

    def attain(self, request: InferenceRequest) -> None:
        """Count the service an admitted request attains: its prompt and its expected output,
        until its answer settles."""
        self._count(request.tenant, self.attained(request))

    def attained(self, request: InferenceRequest) -> float:
        """What an admitted request counts on admission, in weighted tokens."""
        output = request.n * (request.output_reserve or request.max_output_tokens)
        return request.prompt_tokens + self.output_weight * output

    def settle(self, request: InferenceRequest, prompt_tokens: int, completion_tokens: int) -> None:
        """Correct what an admitted request counted by the usage its answer reported."""
        used = prompt_tokens + self.output_weight * completion_tokens
        self._count(request.tenant, used - self.attained(request))

    def of(self, tenant: str) -> float:
        """The tenant's attained service now, in weighted tokens."""
        stored = self._base.get(tenant, 0.0) + self._sent.get(tenant, 0.0)
        stored += self._own.get(tenant, 0.0)
        return max(0.0, stored / self._growth(self._clock.monotonic()))

    def figures(self) -> dict[str, float]:
        """Every tenant's attained service now."""
        names = self._base.keys() | self._sent.keys() | self._own.keys()
        return {name: self.of(name) for name in sorted(names)}

    # the shared mode's side (gateway/shared/service_feed.py)

    def take_unshared(self) -> dict[str, float]:
        """What this replica counted since its last pass, as of now; held as sent until
        the fleet's figures come back (`replace_base`) or the pass fails (`keep_sent`)."""
        self._keep(self._sent)
        self._sent, self._own = self._own, {}
        scale = 1.0 / self._growth(self._clock.monotonic())
        return {tenant: value * scale for tenant, value in self._sent.items() if value}

    def replace_base(self, fleet: dict[str, float]) -> None:
        """The fleet's figures as of now (this replica's sent counts included)."""
        growth = self._growth(self._clock.monotonic())
        self._base = {tenant: value * growth for tenant, value in fleet.items()}
        self._sent = {}

    def keep_sent(self) -> None:
        """The pass failed: what was sent stays in this replica's own figures. It is not
        sent again, as Redis may have counted it before the reply was lost."""
        self._keep(self._sent)
        self._sent = {}

    def _keep(self, counts: dict[str, float]) -> None:
        base = self._base
        for tenant, value in counts.items():
            base[tenant] = base.get(tenant, 0.0) + value

    def _rebase(self) -> None:
        now = self._clock.monotonic()
        scale = 1.0 / self._growth(now)
        for figures in (self._base, self._sent, self._own):
            for tenant in list(figures):
                figures[tenant] *= scale
        self._epoch = now
