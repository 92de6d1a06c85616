"""A backend's effective fill: the target fill, lowered while the backend shows it is overfull.

The gateway admits up to capacity × effective fill. When the backend preempts sequences or
keeps requests waiting inside its own scheduler, the gateway's view of its room was too
generous (answers longer than reserved, traffic that bypasses the gateway, a KV cache
smaller than reported): the fill drops at once by BACKOFF_FACTOR, and climbs back by
RECOVERY_PER_S per second while the backend stays calm, up to the target fill.
"""

from __future__ import annotations

from enum import StrEnum

BACKOFF_FACTOR = 0.8
RECOVERY_PER_S = 0.01
MIN_FILL_SHARE = 0.1  # the fill never drops below this share of the target fill


class FillReason(StrEnum):
    """Why the effective fill last moved."""

    TARGET = "target"  # at the target fill
    PREEMPTION = "preemption"  # the backend preempted sequences
    WAITING = "waiting"  # requests waited inside the backend on two scrapes in a row
    RECOVERING = "recovering"  # climbing back after a back-off


class FillController:
    """Holds one backend's effective fill; fed one scrape at a time, with its time."""

    __slots__ = ("_at", "_waited", "backoffs", "fill", "reason", "target")

    def __init__(self, target: float) -> None:
        self.target = target
        self.fill = target
        self.reason = FillReason.TARGET
        self.backoffs: dict[FillReason, int] = {}
        self._at: float | None = None
        self._waited = False

    def observe(self, *, now: float, preempted: bool, waiting: bool) -> FillReason | None:
        """Take one scrape: `preempted` when the backend's preemption count rose since the
        last, `waiting` when requests wait inside it. The reason of a back-off, else None."""
        since = 0.0 if self._at is None else max(0.0, now - self._at)
        self._at = now
        waited, self._waited = self._waited, waiting
        reason = None
        if preempted:
            reason = FillReason.PREEMPTION
        elif waiting and waited:
            reason = FillReason.WAITING
        if reason is not None:
            self.fill = max(self.target * MIN_FILL_SHARE, self.fill * BACKOFF_FACTOR)
            self.reason = reason
            self.backoffs[reason] = self.backoffs.get(reason, 0) + 1
            return reason
        if waiting:  # one scrape may catch requests between two engine steps: hold still
            return None
        if self.fill < self.target:
            self.fill = min(self.target, self.fill + RECOVERY_PER_S * since)
            self.reason = FillReason.RECOVERING if self.fill < self.target else FillReason.TARGET
        return None
