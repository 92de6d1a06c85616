"""The output a request will likely generate, learned from the `usage` of real answers.

A request reserves its prompt and this expected output, not the whole of `max_tokens`: real
answers end at an end-of-sequence token long before it. The figure comes from the completion
lengths the pool's answers had: the tenant's own once it has `min_samples` of them, the
pool's once the pool has. Before that, a gateway borrows the lengths others saw (its
`LengthSource`): with Redis, the pool's answers as every replica saw them
(gateway/shared/length_feed.py); else the backends' own histograms of the answers they
generated (gateway/admission/fleet/discovery.py), read as the fleet is probed; the configured
prior only when neither has `min_samples`. So a replica started in a spike admits from its
first request as a warm one does. A stream whose answer outgrows it grows its reservation
as it goes (gateway/admission/ledger/growth.py).

By default (`quantile_of: backend`) the quantile (p90) bounds the sum of the answers a
backend holds at once, not each answer: answers end independently, so n of them sum to
about n x mean, give or take sqrt(n) x their spread, and each reserves the mean plus its
share of the spread, `mean + z x sd / sqrt(n)` (z the normal quantile), never more than the
quantile of one answer alone. `quantile_of: answer` reserves each answer's own quantile.

A streaming request (`hold: peak`, the default) reserves less than its whole expected
answer: the most it is expected to hold at any one time, since it may end at any token. A
stream of prompt p that has generated t tokens holds p + t if its answer is longer than t,
nothing after, so it is expected to hold (p + t) x S(t) at t, S(t) the share of answers
longer than t: that rises while few answers have ended and falls once many have, and its
highest point is what the stream reserves, with its share of the spread as above. A
stream that lives longer than that grows its reservation with what it really holds
(gateway/admission/ledger/growth.py), keeping that share on top: the growth only ever catches
up with (p + t), so the reservations a backend holds are expected to add up to no more,
later, than they were when admitted, and the shares keep room for the streams that end
later than expected. A request that is not streamed cannot grow and reserves its whole
expected answer.
"""

from __future__ import annotations

import bisect
import itertools
import math
import operator
import statistics
from collections import deque
from collections.abc import Iterable
from enum import StrEnum
from typing import NamedTuple

from gateway.config import ReservationSettings

WINDOW = 1024  # the most recent answers a quantile is taken over: it follows the traffic


class LengthSource(StrEnum):
    """Where the lengths a pool reserves by came from, best first."""

    ANSWERS = "answers"  # this process's own answers
    REPLICAS = "replicas"  # the pool's answers, as every replica saw them (Redis)
    BACKENDS = "backends"  # the backends' histograms of the answers they generated
    PRIOR = "prior"  # none of those yet: the configured `prior_tokens`


BORROWED = (LengthSource.REPLICAS, LengthSource.BACKENDS)  # in the order they are trusted


class Reserve(NamedTuple):
    """What one choice reserves beyond its prompt on admission, and the headroom a stream
    keeps reserved beyond what it holds as it grows (gateway/admission/ledger/growth.py)."""

    output: int
    headroom: int = 0


class LengthQuantile:
    """A quantile of the last WINDOW samples, worked out again only when enough changed."""

    __slots__ = (
        "_dirty",
        "_held",
        "_mean",
        "_ordered",
        "_q",
        "_samples",
        "_sd",
        "_share",
        "_value",
    )

    def __init__(self, q: float) -> None:
        self._q = q
        self._samples: deque[int] = deque(maxlen=WINDOW)
        self._dirty = 0
        self._value = 0
        self._mean = self._sd = 0.0
        self._share = (0, 0)  # (sequences at once, the share worked out for them)
        self._ordered: list[int] = []  # the samples the figures were worked out from, sorted
        self._held: HeldByStream | None = None  # worked out from them when first asked for

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

    def margin(self, z: float, at_once: int) -> int:
        """Each of `at_once` answers' share of their sum's spread: z x sd / sqrt(at_once)."""
        self._update()
        return math.ceil(z * self._sd / math.sqrt(max(1, at_once)))

    def peak(self, prompt_tokens: int) -> int:
        """The most a stream of `prompt_tokens` is expected to hold at once (tokens)."""
        self._update()
        if self._held is None:
            self._held = HeldByStream(self._ordered)
        return self._held.peak(prompt_tokens)

    def _update(self) -> None:
        if self._dirty and (self._dirty * 64 >= len(self._samples) or not self._value):
            ordered = self._ordered = sorted(self._samples)
            rank = max(1, math.ceil(self._q * len(ordered)))
            self._value = ordered[rank - 1]
            # exact integer sums, summed in C: this runs on the request path
            n, total = len(ordered), sum(ordered)
            self._mean = total / n
            self._sd = (
                math.sqrt(max(0, n * sum(map(operator.mul, ordered, ordered)) - total * total)) / n
            )
            self._share = (0, 0)
            self._held = None
            self._dirty = 0


class HeldByStream:
    """The highest point over t of (p + t) x S(t), for any prompt p, from answer lengths.

    With the lengths sorted, l_0 <= ... <= l_{n-1}, a stream is still running at
    t = l_k - 1 with probability (n - k) / n, so each k is a line in p,
    ((n - k) x p + (n - k) x (l_k - 1)) / n, and the peak is the highest of them at p: their
    upper envelope, built once per set of samples and looked up by bisection.
    """

    __slots__ = ("_breaks", "_lines", "_n")

    def __init__(self, ordered: list[int]) -> None:
        n = self._n = len(ordered)
        lines: list[tuple[int, int]] = []  # (slope, intercept), both x n; slopes rising
        for k in range(n - 1, -1, -1):
            line = (n - k, (n - k) * max(0, ordered[k] - 1))
            while len(lines) >= 2 and _hidden(lines[-2], lines[-1], line):
                lines.pop()
            lines.append(line)
        self._lines = lines
        # from each break on, the next line is the highest
        self._breaks = [_crossing(a, b) for a, b in itertools.pairwise(lines)]

    def peak(self, prompt_tokens: int) -> int:
        if not self._lines:
            return prompt_tokens
        slope, intercept = self._lines[bisect.bisect_right(self._breaks, prompt_tokens)]
        return -(-(slope * prompt_tokens + intercept) // self._n)


def _crossing(a: tuple[int, int], b: tuple[int, int]) -> float:
    """Where line `b` (the steeper) rises above line `a`."""
    return (a[1] - b[1]) / (b[0] - a[0])


def _hidden(a: tuple[int, int], b: tuple[int, int], c: tuple[int, int]) -> bool:
    """Whether `b` is nowhere above both `a` and `c` (slopes rising a, b, c)."""
    return (a[1] - c[1]) * (b[0] - a[0]) <= (a[1] - b[1]) * (c[0] - a[0])


class OutputLengths:
    """One pool's completion lengths, overall and per tenant."""

    def __init__(self, settings: ReservationSettings) -> None:
        self.settings = settings
        self._pool = LengthQuantile(settings.quantile)
        self._tenants: dict[str, LengthQuantile] = {}
        self._borrowed: dict[LengthSource, LengthQuantile] = {}
        # this process's answers not yet shared with the other replicas
        self._unshared: deque[int] = deque(maxlen=WINDOW)
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
        self._unshared.append(per_choice)
        own = self._tenants.get(tenant)
        if own is None:
            own = self._tenants[tenant] = LengthQuantile(self.settings.quantile)
        own.observe(per_choice)

    def expected(self, tenant: str | None = None, *, room: int = 0, prompt_tokens: int = 0) -> int:
        """The output tokens one choice of `tenant`'s next request (None: any tenant's) will
        likely need, on a backend with `room` tokens to admit into (0: one answer alone)."""
        lengths = self._lengths(tenant)
        if lengths is None:
            return self.settings.prior_tokens
        return self._share(lengths, room, prompt_tokens)

    def borrow(self, source: LengthSource, lengths: Iterable[int]) -> None:
        """Take the answer lengths `source` saw (its last WINDOW), in place of what it told
        before; too few of them (under `min_samples`) tell nothing."""
        quantile = LengthQuantile(self.settings.quantile)
        for tokens in lengths:
            if tokens >= 0:
                quantile.observe(tokens)
        if len(quantile) >= self.settings.min_samples:
            self._borrowed[source] = quantile
        else:
            self._borrowed.pop(source, None)

    def learns(self) -> bool:
        """Whether the pool reserves by learned lengths at all (not all of `max_tokens`)."""
        return self.settings.mode == "learned"

    def learning(self) -> bool:
        """Whether the pool still reserves by lengths other than its own answers'."""
        return self.learns() and len(self._pool) < self.settings.min_samples

    def unshared(self) -> list[int]:
        """The answer lengths observed since the last call (at most WINDOW), to share."""
        taken = list(self._unshared)
        self._unshared.clear()
        return taken

    def source(self, tenant: str | None = None) -> LengthSource:
        """Where the lengths that `tenant`'s (None: any tenant's) next request reserves by
        come from."""
        return self._found(tenant)[1]

    def _lengths(self, tenant: str | None) -> LengthQuantile | None:
        return self._found(tenant)[0]

    def _found(self, tenant: str | None) -> tuple[LengthQuantile | None, LengthSource]:
        """The tenant's own lengths once it has enough, else the pool's, else those
        borrowed, else None (the prior)."""
        need = self.settings.min_samples
        own = None if tenant is None else self._tenants.get(tenant)
        if own is not None and len(own) >= need:
            return own, LengthSource.ANSWERS
        if len(self._pool) >= need:
            return self._pool, LengthSource.ANSWERS
        for source in BORROWED:
            borrowed = self._borrowed.get(source)
            if borrowed is not None:
                return borrowed, source
        return None, LengthSource.PRIOR

    def _share(self, lengths: LengthQuantile, room: int, prompt_tokens: int) -> int:
        if self._per_answer:
            return max(1, lengths.value())
        mean, _ = lengths.spread()
        at_once = room // max(1, prompt_tokens + math.ceil(mean))  # sequences like this one
        if at_once <= 1:
            return max(1, lengths.value())
        return lengths.share(self._z, at_once)

    def held_at_peak(self, tenant: str | None = None, *, room: int, prompt_tokens: int) -> Reserve:
        """What one choice of a streaming request reserves with `hold: peak`: beyond its
        prompt, the most it is expected to hold at once and its share of the spread, which
        it keeps as headroom while it grows; never more than `expected` (its whole expected
        answer), and no headroom where that is what it reserves."""
        lengths = self._lengths(tenant)
        if lengths is None:
            return Reserve(output=self.settings.prior_tokens)
        whole = self._share(lengths, room, prompt_tokens)
        if self._per_answer:
            return Reserve(output=whole)
        peak = lengths.peak(prompt_tokens)
        at_once = room // max(1, peak)
        if at_once <= 1:
            return Reserve(output=whole)
        headroom = lengths.margin(self._z, at_once)
        beyond = peak - prompt_tokens + headroom
        if beyond >= whole:
            return Reserve(output=whole)
        return Reserve(output=max(1, beyond), headroom=headroom)

    def samples(self, tenant: str | None = None) -> int:
        if tenant is None:
            return len(self._pool)
        own = self._tenants.get(tenant)
        return 0 if own is None else len(own)

    def reserve_output(
        self,
        *,
        tenant: str,
        cap: int,
        room: int = 0,
        prompt_tokens: int = 0,
        streaming: bool = False,
    ) -> Reserve:
        """What one choice reserves: the expected output (what a stream is expected to hold
        at its peak, with `hold: peak`), never more than `cap` (the request's max_tokens, or
        what its context leaves), or the whole cap in `max_tokens` mode."""
        if self.settings.mode == "max_tokens":
            return Reserve(output=cap)
        if streaming and self.settings.hold == "peak":
            held = self.held_at_peak(tenant, room=room, prompt_tokens=prompt_tokens)
            if held.output >= cap:
                return Reserve(output=cap)  # the whole answer is held: nothing to grow into
            return held
        return Reserve(
            output=min(cap, self.expected(tenant, room=room, prompt_tokens=prompt_tokens))
        )
