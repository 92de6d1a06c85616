"""The output a request will likely generate, learned from the `usage` of real answers.

A request reserves its prompt and this expected output, not the whole of `max_tokens`: real
answers end at an end-of-sequence token long before it. The figure is a quantile (p90 by
default) of the completion lengths the pool's answers had, the tenant's own once it has
`min_samples` of them, the pool's once the pool has, and a configured prior before that. A
stream whose answer outgrows it grows its reservation as it goes (gateway/growth.py).
"""

from __future__ import annotations

import math
from collections import deque

from gateway.config import ReservationSettings

WINDOW = 1024  # the most recent answers a quantile is taken over: it follows the traffic


class LengthQuantile:
    """A quantile of the last WINDOW samples, worked out again only when enough changed."""

    __slots__ = ("_dirty", "_q", "_samples", "_value")

    def __init__(self, q: float) -> None:
        self._q = q
        self._samples: deque[int] = deque(maxlen=WINDOW)
        self._dirty = 0
        self._value = 0

    def __len__(self) -> int:
        return len(self._samples)

    def observe(self, tokens: int) -> None:
        self._samples.append(tokens)
        self._dirty += 1

    def value(self) -> int:
        """The `q` quantile (nearest rank, rounded up): at least that share of the samples
        is at or below it. Sorting is skipped until a 64th of the window is new."""
        if self._dirty and (self._dirty * 64 >= len(self._samples) or not self._value):
            ordered = sorted(self._samples)
            rank = max(1, math.ceil(self._q * len(ordered)))
            self._value = ordered[rank - 1]
            self._dirty = 0
        return self._value


class OutputLengths:
    """One pool's completion lengths, overall and per tenant."""

    def __init__(self, settings: ReservationSettings) -> None:
        self.settings = settings
        self._pool = LengthQuantile(settings.quantile)
        self._tenants: dict[str, LengthQuantile] = {}

    def observe(self, *, tenant: str, completion_tokens: int, choices: int = 1) -> None:
        """One finished answer: its completion tokens over `choices` choices, each choice a
        sample of its mean length."""
        if completion_tokens < 0 or choices < 1:
            return
        per_choice = -(-completion_tokens // choices)
        self._pool.observe(per_choice)
        own = self._tenants.get(tenant)
        if own is None:
            own = self._tenants[tenant] = LengthQuantile(self.settings.quantile)
        own.observe(per_choice)

    def expected(self, tenant: str | None = None) -> int:
        """The output tokens one choice of `tenant`'s next request (None: any tenant's) will
        likely need."""
        need = self.settings.min_samples
        own = None if tenant is None else self._tenants.get(tenant)
        if own is not None and len(own) >= need:
            return max(1, own.value())
        if len(self._pool) >= need:
            return max(1, self._pool.value())
        return self.settings.prior_tokens

    def samples(self, tenant: str | None = None) -> int:
        if tenant is None:
            return len(self._pool)
        own = self._tenants.get(tenant)
        return 0 if own is None else len(own)

    def reserve_output(self, *, tenant: str, cap: int) -> int:
        """What one choice reserves: the expected output, never more than `cap` (the request's
        max_tokens, or what its context leaves), or the whole cap in `max_tokens` mode."""
        if self.settings.mode == "max_tokens":
            return cap
        return min(cap, self.expected(tenant))
