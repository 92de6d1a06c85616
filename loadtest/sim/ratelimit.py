"""The simulated provider's own limits: requests/min and tokens/min token buckets."""

from __future__ import annotations

from dataclasses import dataclass

from gateway.clock import Clock


class TokenBucket:
    """Holds up to `capacity`, refilled continuously at `capacity` per `period_s`."""

    def __init__(self, *, capacity: float, clock: Clock, period_s: float = 60.0) -> None:
        if capacity <= 0 or period_s <= 0:
            raise ValueError("capacity and period_s must be positive")
        self.capacity = capacity
        self._rate = capacity / period_s
        self._clock = clock
        self._level = capacity
        self._at = clock.monotonic()

    def level(self) -> float:
        now = self._clock.monotonic()
        self._level = min(self.capacity, self._level + (now - self._at) * self._rate)
        self._at = now
        return self._level

    def wait_s(self, amount: float) -> float:
        """Seconds until `amount` is available; 0 when it is now."""
        missing = amount - self.level()
        return 0.0 if missing <= 0 else missing / self._rate

    def take(self, amount: float) -> None:
        self._level = self.level() - amount

    def refill(self) -> None:
        self._level = self.capacity
        self._at = self._clock.monotonic()


@dataclass(frozen=True, kw_only=True)
class Verdict:
    allowed: bool
    retry_after_s: float = 0.0
    limited_by: str | None = None  # "requests" or "tokens", as OpenAI's error type names it
    too_large: bool = False  # the request alone exceeds the tokens/min limit


class ProviderLimits:
    """Both buckets must have room; a request takes from both or from neither."""

    def __init__(self, *, requests_per_minute: int, tokens_per_minute: int, clock: Clock) -> None:
        self.requests = TokenBucket(capacity=requests_per_minute, clock=clock)
        self.tokens = TokenBucket(capacity=tokens_per_minute, clock=clock)

    def admit(self, tokens: int) -> Verdict:
        if tokens > self.tokens.capacity:
            return Verdict(allowed=False, retry_after_s=60.0, limited_by="tokens", too_large=True)
        wait_requests = self.requests.wait_s(1)
        wait_tokens = self.tokens.wait_s(tokens)
        if wait_requests > 0 or wait_tokens > 0:
            limited_by = "requests" if wait_requests >= wait_tokens else "tokens"
            return Verdict(
                allowed=False,
                retry_after_s=max(wait_requests, wait_tokens),
                limited_by=limited_by,
            )
        self.requests.take(1)
        self.tokens.take(tokens)
        return Verdict(allowed=True)

    def headers(self) -> list[tuple[bytes, bytes]]:
        """OpenAI's x-ratelimit-* headers for the current levels."""
        return [
            (b"x-ratelimit-limit-requests", b"%d" % self.requests.capacity),
            (b"x-ratelimit-remaining-requests", b"%d" % max(0, int(self.requests.level()))),
            (b"x-ratelimit-limit-tokens", b"%d" % self.tokens.capacity),
            (b"x-ratelimit-remaining-tokens", b"%d" % max(0, int(self.tokens.level()))),
        ]

    def refill(self) -> None:
        self.requests.refill()
        self.tokens.refill()
