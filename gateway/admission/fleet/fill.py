"""A backend's effective fill: the target fill, lowered while the backend shows it is overfull,
raised while it shows it holds less than the ledger reserved.

The gateway admits up to capacity × effective fill. When the backend preempts sequences, or
keeps requests waiting inside its own scheduler while its KV cache is at least the target
fill full, the gateway's view of its room was too generous (answers longer than reserved,
traffic that bypasses the gateway, a KV cache smaller than reported): the fill drops at
once by BACKOFF_FACTOR, and climbs back by RECOVERY_PER_S per second while the backend
stays busy and calm, up to the target fill. Requests waiting under a roomier cache wait for
the engine's next step or its batch limits, not for memory: a burst's arrivals are caught so
on scrape after scrape, and admitting less would not shorten that wait. A back-off outlives
its cause only while the backend is busy: once it reports nothing running and nothing waiting
on IDLE_SCRAPES scrapes in a row after the back-off, no pressure is left to remember and the
fill is back at the target at once. A backend that does not say what it runs is never idle.

The opposite error is as costly: a reservation is what a stream is expected to hold at its
peak, with a share of the spread, so a full ledger leaves part of the KV cache unused and
the rest of a spike goes to the queue and to paid providers. A scrape taken while the ledger
holds at least EVIDENCE_FILL_SHARE of the target is evidence: it measures what the backend
holds per reserved token. The highest such ratio lately seen (`held_per_reserved`: from 1,
coming down to lower evidence by at most DECAY_PER_S per second of evidence) calibrates the
fill towards target ÷ ratio, so that what the backend really holds at the peak reaches the
target fill. The fill rises towards it by at most OVERBOOK_PER_S × target per second of
evidence, and comes down to it at once when a higher ratio is seen; a scrape of a thinly
filled ledger moves neither. It never passes MAX_FILL, the whole KV cache: the ledger never
reserves more than the backend holds, so where the share it reports is of a cache other than
the capacity the gateway counts (a configured capacity), or streams grow past what their
peaks were expected to be, the evidence cannot admit past the cache. (A shared prompt, the
great over-count, is counted once by the ledger itself: gateway/admission/ledger/holders.py.) At a
target of 0.8 a ratio of 0.8 or less so takes the fill to the whole cache, 1.25x the target.
Any back-off drops the fill from the target, however far it was overbooked, and forgets the
calibration: the ratio starts again from 1.

At most EVIDENCE_STEP_S of evidence counts from one scrape, however far apart scrapes are.
"""

from __future__ import annotations

from enum import StrEnum

BACKOFF_FACTOR = 0.8
RECOVERY_PER_S = 0.01  # the climb back to the target while the backend is busy
IDLE_SCRAPES = 2  # scrapes in a row of an idle backend that end a back-off
MIN_FILL_SHARE = 0.1  # the fill never drops below this share of the target fill
MAX_FILL = 1.0  # the fill never passes the whole KV cache
OVERBOOK_PER_S = 0.1  # the calibrated fill rises by this share of the target per second
EVIDENCE_FILL_SHARE = 0.5  # a scrape calibrates when the ledger holds this share of the target
DECAY_PER_S = 0.03  # how fast the ratio comes down to lower evidence, per second of evidence
EVIDENCE_STEP_S = 1.0  # at most this much evidence from one scrape, however far apart


class FillReason(StrEnum):
    """Why the effective fill last moved."""

    TARGET = "target"  # at the target fill
    PREEMPTION = "preemption"  # the backend preempted sequences
    WAITING = "waiting"  # requests waited inside a full backend on two scrapes in a row
    RECOVERING = "recovering"  # climbing back after a back-off
    CALIBRATED = "calibrated"  # above the target: the backend holds less than reserved


class FillController:
    """Holds one backend's effective fill; fed one scrape at a time, with its time."""

    __slots__ = (
        "_at",
        "_idle_scrapes",
        "_waited",
        "backoffs",
        "fill",
        "held_per_reserved",
        "reason",
        "target",
    )

    def __init__(self, target: float) -> None:
        self.target = target
        self.fill = target
        self.reason = FillReason.TARGET
        self.backoffs: dict[FillReason, int] = {}
        self.held_per_reserved = 1.0
        self._at: float | None = None
        self._waited = False
        self._idle_scrapes = 0

    def observe(
        self,
        *,
        now: float,
        preempted: bool,
        waiting: bool,
        idle: bool = False,
        held: float | None = None,
        reserved: float | None = None,
    ) -> FillReason | None:
        """Take one scrape: `preempted` when the backend's preemption count rose since the
        last, `waiting` when requests wait inside it, `idle` when it reports nothing running
        and nothing waiting (False when it does not say); `held`, the share of its KV cache
        it reports in use (None: unknown), and `reserved`, the share the ledger held on it
        meanwhile. The reason of a back-off, else None."""
        since = 0.0 if self._at is None else max(0.0, now - self._at)
        self._at = now
        waited, self._waited = self._waited, waiting
        self._idle_scrapes = self._idle_scrapes + 1 if idle else 0
        reason = None
        full = held is None or held >= self.target  # unknown: taken as full
        if preempted:
            reason = FillReason.PREEMPTION
        elif waiting and waited and full:
            reason = FillReason.WAITING
        if reason is not None:
            self._back_off(reason)
            return reason
        if waiting:  # one scrape may catch requests between two engine steps: hold still
            return None
        if self.fill < self.target:
            self._recover(since)
        elif held is not None and reserved is not None:
            self._calibrate(held, reserved, since)
        return None

    def _back_off(self, reason: FillReason) -> None:
        self.held_per_reserved = 1.0
        self._idle_scrapes = 0  # the scrape that shows the cause is no sign of its end
        backed_off = min(self.fill, self.target) * BACKOFF_FACTOR
        self.fill = max(self.target * MIN_FILL_SHARE, backed_off)
        self.reason = reason
        self.backoffs[reason] = self.backoffs.get(reason, 0) + 1

    def _recover(self, since: float) -> None:
        if self._idle_scrapes >= IDLE_SCRAPES:
            self.fill = self.target
        else:
            self.fill = min(self.target, self.fill + RECOVERY_PER_S * since)
        self.reason = FillReason.RECOVERING if self.fill < self.target else FillReason.TARGET

    def _calibrate(self, held: float, reserved: float, since: float) -> None:
        if reserved < self.target * EVIDENCE_FILL_SHARE:
            return  # too few streams for their sum to say anything about the next peak
        step = min(since, EVIDENCE_STEP_S)
        decayed = self.held_per_reserved - DECAY_PER_S * step
        lowest = self.target / MAX_FILL  # where target ÷ ratio reaches the whole cache
        self.held_per_reserved = min(1.0, max(held / reserved, decayed, lowest))
        rising = self.fill + self.target * OVERBOOK_PER_S * step
        self.fill = max(self.target, min(self.target / self.held_per_reserved, rising))
        self.reason = FillReason.CALIBRATED if self.fill > self.target else FillReason.TARGET
