"""Open-loop arrival schedules: when each request is sent, fixed before the run starts.

Every profile is a unit-rate arrival process (evenly spaced, Poisson, or gamma with a
chosen burstiness) stretched onto a piecewise-constant rate: flat for `constant`,
`poisson` and `gamma`, baseline → N× burst → recovery for `spike`. Because the whole
schedule exists before the first request, a slow response can never delay an arrival.
"""

from __future__ import annotations

import bisect
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

Profile = Literal["constant", "poisson", "gamma", "spike"]
PROFILES: tuple[Profile, ...] = ("constant", "poisson", "gamma", "spike")


@dataclass(frozen=True, kw_only=True)
class Phase:
    """Arrivals at `rate` per second from `start_s` until the next phase (or the end)."""

    start_s: float
    rate: float
    label: str = ""


@dataclass(frozen=True, kw_only=True)
class ArrivalProfile:
    """What the schedule looks like.

    `rate` is the steady rate (the baseline for `spike`). A spike multiplies it by
    `spike_factor` from `spike_start_s` for `spike_duration_s`, then falls back to the
    baseline. `cv` is the coefficient of variation of gamma gaps (1 = Poisson, > 1 bursty).
    """

    kind: Profile = "poisson"
    rate: float = 10.0
    duration_s: float = 30.0
    cv: float = 2.0
    spike_factor: float = 5.0
    spike_start_s: float = 10.0
    spike_duration_s: float = 10.0

    def __post_init__(self) -> None:
        if self.kind not in PROFILES:
            raise ValueError(f"unknown profile {self.kind!r} (known: {', '.join(PROFILES)})")
        if self.rate <= 0 or self.duration_s <= 0:
            raise ValueError("rate and duration must be positive")
        if self.cv <= 0 or self.spike_factor <= 0:
            raise ValueError("cv and spike factor must be positive")
        if self.spike_start_s < 0 or self.spike_duration_s < 0:
            raise ValueError("spike start and duration must not be negative")

    def phases(self) -> list[Phase]:
        if self.kind != "spike":
            return [Phase(start_s=0.0, rate=self.rate, label=self.kind)]
        end = self.spike_start_s + self.spike_duration_s
        phases = []
        if self.spike_start_s > 0:
            phases.append(Phase(start_s=0.0, rate=self.rate, label="baseline"))
        peak = self.rate * self.spike_factor
        phases.append(Phase(start_s=self.spike_start_s, rate=peak, label="spike"))
        if end < self.duration_s:
            phases.append(Phase(start_s=end, rate=self.rate, label="recovery"))
        return phases

    def expected_arrivals(self) -> float:
        return _cumulative(self.phases(), self.duration_s)


def _cumulative(phases: Sequence[Phase], t: float) -> float:
    """Expected arrivals in [0, t]: the integral of the rate."""
    total = 0.0
    for i, phase in enumerate(phases):
        end = phases[i + 1].start_s if i + 1 < len(phases) else float("inf")
        if t <= phase.start_s:
            break
        total += phase.rate * (min(t, end) - phase.start_s)
    return total


def _inverse(phases: Sequence[Phase], starts: Sequence[float], units: float) -> float:
    """The time at which `units` arrivals are expected (inverse of `_cumulative`)."""
    i = max(0, bisect.bisect_right(starts, units) - 1)
    phase = phases[i]
    return phase.start_s + (units - starts[i]) / phase.rate


def unit_gaps(kind: Profile, *, cv: float, rng: random.Random) -> float:
    """One gap of a unit-rate process (mean 1)."""
    if kind == "constant":
        return 1.0
    if kind == "gamma":
        shape = 1.0 / (cv * cv)
        return rng.gammavariate(shape, 1.0 / shape)
    return rng.expovariate(1.0)


def arrival_times(profile: ArrivalProfile, *, seed: int = 0) -> list[float]:
    """Seconds from the start at which each request is sent, ascending, all < duration."""
    rng = random.Random(seed)
    phases = profile.phases()
    starts = [_cumulative(phases, p.start_s) for p in phases]
    process: Profile = "poisson" if profile.kind == "spike" else profile.kind
    limit = _cumulative(phases, profile.duration_s)
    times: list[float] = []
    units = 0.5 if process == "constant" else unit_gaps(process, cv=profile.cv, rng=rng)
    while units < limit:
        times.append(_inverse(phases, starts, units))
        units += unit_gaps(process, cv=profile.cv, rng=rng)
    return times
