"""What a pool is asked for, wherever it ends up served: the numbers autoscalers act on."""

from __future__ import annotations

import math
from collections import deque

from gateway.clock import Clock


class RateMeter:
    """An exponentially weighted rate (units per second) with a half-life.

    Recording decays the rate in steps of `STEP_S`: amounts recorded within one step count
    as recorded together, which moves the rate by under 1 % at a half-life of 5 s and
    spares the request path a power per record. Reading it decays it exactly.
    """

    STEP_S = 0.05

    def __init__(self, clock: Clock, *, half_life_s: float = 5.0) -> None:
        self._clock = clock
        self._half_life = half_life_s
        self._per_unit = math.log(2) / half_life_s  # one unit's weight in the rate
        self._rate = 0.0
        self._last = clock.monotonic()

    def _decay(self, now: float) -> None:
        elapsed = max(0.0, now - self._last)
        self._rate *= 0.5 ** (elapsed / self._half_life)
        self._last = now

    def record(self, amount: float) -> None:
        now = self._clock.monotonic()
        if now - self._last >= self.STEP_S:
            self._decay(now)
        self._rate += amount * self._per_unit

    def rate(self) -> float:
        self._decay(self._clock.monotonic())
        return self._rate


class PoolDemand:
    """Tokens a pool's requests hold wherever they are served, and what was turned away.

    Desired backends follow Little's law: the tokens the pool would hold if it served
    everything itself — what is in flight now, locally or spilled, plus each refused
    request's tokens for as long as a request typically holds them — over one backend's
    share at the target fill.
    """

    BUCKET_S = 0.1  # refusals expiring within one bucket are kept together

    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self.tokens_in_flight = 0
        self.served = RateMeter(clock, half_life_s=30.0)  # real tokens served per second
        self.refused = RateMeter(clock, half_life_s=30.0)  # reserved tokens refused per second
        self._hold_s = 1.0  # EWMA of how long a request holds its reservation
        self._refused_held: deque[list[float]] = deque()  # [expires_at, tokens]
        self._refused_tokens = 0.0

    def begin(self, tokens: int) -> float:
        self.tokens_in_flight += tokens
        return self._clock.monotonic()

    def end(self, tokens: int, *, started: float, used: int, refused: bool) -> None:
        self.tokens_in_flight -= tokens
        now = self._clock.monotonic()
        if refused:
            self.refused.record(tokens)
            self._hold_refused(now + self._hold_s, tokens)
            return
        self.served.record(used)
        self._hold_s += 0.1 * (now - started - self._hold_s)

    def _hold_refused(self, expires_at: float, tokens: int) -> None:
        self.refused_tokens_held()  # drop what expired, so the deque stays bounded unscraped
        last = self._refused_held[-1] if self._refused_held else None
        if last is not None and expires_at - last[0] < self.BUCKET_S:
            last[1] += tokens
        else:
            self._refused_held.append([expires_at, float(tokens)])
        self._refused_tokens += tokens

    def refused_tokens_held(self) -> float:
        now = self._clock.monotonic()
        while self._refused_held and self._refused_held[0][0] <= now:
            self._refused_tokens -= self._refused_held.popleft()[1]
        return self._refused_tokens

    def tokens_per_s(self) -> float:
        """Observed demand: tokens served plus tokens turned away, per second."""
        return self.served.rate() + self.refused.rate()

    def desired_backends(self, *, backend_capacity: float, target_fill: float) -> int:
        share = backend_capacity * target_fill
        if share <= 0:
            return 0
        wanted = self.tokens_in_flight + self.refused_tokens_held()
        return math.ceil(wanted / share) if wanted > 0 else 0
