"""A backend's health as one state machine: fed by every way a backend shows it cannot
serve and by the probe, it says whether the backend is in rotation, and why not.

It does no I/O and reads no clock: an event or a question that depends on the time is
given it. The backend (backends.py) logs each change of rotation the events return; the
router, /readyz, the admin status and the `spillgate_backend_healthy` gauge read the rest.

- **up**: in rotation. Requests that fail before their answer are counted, in a row (a
  request served resets the count); the FAILURES_BEFORE_EJECT-th ejects it.
- **draining**: out at once, with no cool-down, because it was seen going away or not
  serving: nothing answered at its address, it broke a stream off mid-answer (a restart,
  a drain, a crash), or a probe failed or found it serving another model. Probed on every
  tick; the first probe that passes brings it back, so a restart that cut many streams is
  back as soon as it serves. Requests it had in flight may still finish there; one served
  does not bring it back, as a draining server finishes what it holds and takes nothing new.
- **ejected**: out for a cool-down (EJECT_S), because its requests kept failing; a probe
  that passes meanwhile does not shorten it, and a request that fails meanwhile lengthens
  it to a full cool-down from then.
- **probing**: the cool-down is over; probed on every tick, it is back on the first probe
  that passes or request it serves. A request that fails ejects it again, for twice the
  cool-down before (up to EJECT_MAX_S); back up, the cool-down is EJECT_S again.

Out of rotation, whatever else happens changes only the reason told: a cool-down running
stands. No state returns to rotation by time alone: a cool-down's end only makes the
backend due for a probe, so `in_rotation(now)` and `probe_due(now)` both ask the time.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

FAILURES_BEFORE_EJECT = 3
EJECT_S = 5.0
EJECT_MAX_S = 60.0
BROKE_OFF = "it broke off a stream mid-answer"


class HealthState(StrEnum):
    UP = "up"
    DRAINING = "draining"
    EJECTED = "ejected"
    PROBING = "probing"


@dataclass(frozen=True, slots=True)
class Change:
    """A backend leaving rotation (`up` False, `reason` why) or coming back (`up` True,
    `reason` why it had been out): what an event returns when it changes rotation."""

    up: bool
    reason: str


class BackendHealth:
    """One backend's health: the events that feed it, and the state they leave it in."""

    __slots__ = (
        "_base_s",
        "_cooldown_s",
        "_ejected",
        "_failures",
        "_max_s",
        "_reason",
        "_threshold",
        "_until",
    )

    def __init__(
        self,
        *,
        failures: int = FAILURES_BEFORE_EJECT,
        cooldown_s: float = EJECT_S,
        max_cooldown_s: float = EJECT_MAX_S,
    ) -> None:
        self._threshold = failures
        self._base_s = cooldown_s
        self._max_s = max_cooldown_s
        self._cooldown_s = cooldown_s  # the next ejection's, grown by each failed probation
        self._failures = 0  # requests failed in a row
        self._reason: str | None = None  # why it is out of rotation; None while in it
        self._ejected = False  # out by an ejection (cool-down, then probing), else draining
        self._until = float("-inf")  # the ejection's cool-down ends then

    @property
    def reason(self) -> str | None:
        """Why the backend is out of rotation; None while it is in rotation."""
        return self._reason

    def state(self, now: float) -> HealthState:
        if self._reason is None:
            return HealthState.UP
        if not self._ejected:
            return HealthState.DRAINING
        return HealthState.EJECTED if now < self._until else HealthState.PROBING

    def in_rotation(self, now: float) -> bool:
        """Up: every state out of rotation has a reason (`now` decides only which)."""
        return self._reason is None

    def probe_due(self, now: float) -> bool:
        """Whether the next probe decides its return: out, with no cool-down left."""
        return self.state(now) in (HealthState.DRAINING, HealthState.PROBING)

    def failed(self, now: float, reason: str = "") -> Change | None:
        """A request failed before its answer: an error status, a refusal, a timeout, an
        answer that is not one; or was answered with a usage that cannot be true
        (gateway/upstream/usage.py). `reason` is the last failure's, told with the ejection."""
        self._failures += 1
        last = f" (last: {reason})" if reason else ""
        if self.state(now) is HealthState.PROBING:
            self._cooldown_s = min(2 * self._cooldown_s, self._max_s)
            return self._eject(now, f"a request failed after its cool-down{last}")
        if self._failures >= self._threshold:
            return self._eject(now, f"{self._threshold} requests in a row failed{last}")
        return None

    def unreachable(self, reason: str) -> Change | None:
        """A request found nothing answering at the backend's address (`reason`, in words
        that stay the same from one try to the next): a failure, and out at once."""
        self._failures += 1
        return self._drain(reason)

    def broke_off(self) -> Change | None:
        """A stream it was answering broke off mid-answer: most likely it is going away."""
        return self._drain(BROKE_OFF)

    def probe_failed(self, reason: str) -> Change | None:
        """A probe found it not answering as a live server does, or serving another model."""
        return self._drain(reason)

    def probe_passed(self, now: float) -> Change | None:
        """A probe found it serving: back, unless a cool-down is still running. While up,
        the count of failed requests stands: a probe does not show that requests succeed."""
        if self.probe_due(now):
            return self._up()
        return None

    def served(self, now: float) -> Change | None:
        """A request was answered in full: the count of failures starts again, and a
        backend on probation is back."""
        self._failures = 0
        if self._reason is not None and self.state(now) is HealthState.PROBING:
            return self._up()
        return None

    def _drain(self, reason: str) -> Change | None:
        if self._reason is not None:
            self._reason = reason
            return None
        self._reason, self._ejected = reason, False
        return Change(up=False, reason=reason)

    def _eject(self, now: float, reason: str) -> Change | None:
        self._until = max(self._until, now + self._cooldown_s)
        self._ejected = True
        was, self._reason = self._reason, reason
        return Change(up=False, reason=reason) if was is None else None

    def _up(self) -> Change | None:
        was = self._reason
        if was is None:
            return None
        self._reason, self._ejected, self._failures = None, False, 0
        self._cooldown_s = self._base_s
        return Change(up=True, reason=was)
