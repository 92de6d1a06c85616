"""What serving a request hands back: how it was served, by whom, and what was relayed."""

from __future__ import annotations

from dataclasses import dataclass

from gateway.outcome import Outcome
from gateway.upstream.relay import Relayed


@dataclass(slots=True)
class Served:
    outcome: Outcome
    target: str
    pool: str  # the pool whose model answered
    relayed: Relayed
    started_at: float = 0.0  # Clock time when it was forwarded (after any wait for room)

    def ended(self, *, completed: bool) -> Served:
        """This answer, its stream ended by the gateway after its upstream broke off."""
        relayed = self.relayed
        ended = Relayed(relayed.usage, relayed.first_byte_at, completed)
        return Served(self.outcome, self.target, self.pool, ended, self.started_at)
