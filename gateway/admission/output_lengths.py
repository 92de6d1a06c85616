"""The output a request will likely generate, learned from the `usage` of real answers.

A request reserves its prompt and this expected output, not the whole of `max_tokens`: real
answers end at an end-of-sequence token long before it. The figure comes from the completion
lengths the pool's answers had, the tenant's own once it has `min_samples` of them, the
pool's once the pool has, and a configured prior before that. A stream whose answer
outgrows it grows its reservation as it goes (gateway/admission/growth.py).

By default (`quantile_of: backend`) the quantile (p90) bounds the sum of the answers a
backend holds at once, not each answer: answers end independently, so n of them sum to
about n x mean, give or take sqrt(n) x their spread, and each reserves the mean plus its
share of the spread, `mean + z x sd / sqrt(n)` (z the normal quantile), never more than the
quantile of one answer alone. `quantile_of: answer` reserves each answer's own quantile.
"""

from __future__ import annotations

import math
import operator
import statistics
from collections import deque

from gateway.config import ReservationSettings

WINDOW = 1024  # the most recent answers a quantile is taken over: it follows the traffic


class LengthQuantile:
    """A quantile of the last WINDOW samples, worked out again only when enough changed."""

    __slots__ = ("_dirty", "_mean", "_q", "_samples", "_sd", "_share", "_value")

    def __init__(self, q: float) -> None:
        self._q = q
        self._samples: deque[int] = deque(maxlen=WINDOW)
        self._dirty = 0
        self._value = 0
        self._mean = self._sd = 0.0
        self._share = (0, 0)  # (sequences at once, the share worked out for them)

    def __len__(self) -> int:
        return len(self._samples)

    def observe(self, tokens: int) -> None:
        self._samples.append(tokens)
        self._dirty += 1

    def value(self) -> int:
        """The `q` quantile (nearest rank, rounded up): at least that share of the samples
        is at or below it. Worked out again once a 64th of the window is new."""
        self._update()
        return self._value

    def spread(self) -> tuple[float, float]:
        """The samples' mean and (population) standard deviation."""
        self._update()
        return self._mean, self._sd

    def share(self, z: float, at_once: int) -> int:
        """What each of `at_once` answers reserves for their sum to stay within the normal
        quantile `z`: mean + z x sd / sqrt(at_once), at most the quantile of one answer.
        Kept for the last `at_once` until the samples move (it runs on every request)."""
        self._update()
        if self._share[0] != at_once:
            share = math.ceil(self._mean + z * self._sd / math.sqrt(at_once))
            self._share = (at_once, max(1, min(self._value, share)))
        return self._share[1]

    def _update(self) -> None:
        if self._dirty and (self._dirty * 64 >= len(self._samples) or not self._value):
            ordered = sorted(self._samples)
            rank = max(1, math.ceil(self._q * len(ordered)))
            self._value = ordered[rank - 1]
            # exact integer sums, summed in C: this runs on the request path
            n, total = len(ordered), sum(ordered)
            self._mean = total / n
            self._sd = (
                math.sqrt(max(0, n * sum(map(operator.mul, ordered, ordered)) - total * total)) / n
            )
            self._share = (0, 0)
            self._dirty = 0


class OutputLengths:
    """One pool's completion lengths, overall and per tenant."""

    def __init__(self, settings: ReservationSettings) -> None:
        self.settings = settings
        self._pool = LengthQuantile(settings.quantile)
        self._tenants: dict[str, LengthQuantile] = {}
        # q = 1 has no normal quantile: each answer reserves the longest seen
        q = settings.quantile
        self._per_answer = settings.quantile_of == "answer" or q >= 1
        self._z = 0.0 if self._per_answer else statistics.NormalDist().inv_cdf(q)

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

    def expected(self, tenant: str | None = None, *, room: int = 0, prompt_tokens: int = 0) -> int:
        """The output tokens one choice of `tenant`'s next request (None: any tenant's) will
        likely need, on a backend with `room` tokens to admit into (0: one answer alone)."""
        need = self.settings.min_samples
        own = None if tenant is None else self._tenants.get(tenant)
        if own is not None and len(own) >= need:
            return self._share(own, room, prompt_tokens)
        if len(self._pool) >= need:
            return self._share(self._pool, room, prompt_tokens)
        return self.settings.prior_tokens

    def _share(self, lengths: LengthQuantile, room: int, prompt_tokens: int) -> int:
        if self._per_answer:
            return max(1, lengths.value())
        mean, _ = lengths.spread()
        at_once = room // max(1, prompt_tokens + math.ceil(mean))  # sequences like this one
        if at_once <= 1:
            return max(1, lengths.value())
        return lengths.share(self._z, at_once)

    def samples(self, tenant: str | None = None) -> int:
        if tenant is None:
            return len(self._pool)
        own = self._tenants.get(tenant)
        return 0 if own is None else len(own)

    def reserve_output(
        self, *, tenant: str, cap: int, room: int = 0, prompt_tokens: int = 0
    ) -> int:
        """What one choice reserves: the expected output, never more than `cap` (the request's
        max_tokens, or what its context leaves), or the whole cap in `max_tokens` mode."""
        if self.settings.mode == "max_tokens":
            return cap
        return min(cap, self.expected(tenant, room=room, prompt_tokens=prompt_tokens))
