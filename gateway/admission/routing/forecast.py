"""When a pool will have room: the figure a refusal's `Retry-After` tells.

The router knows every reservation this process holds and when it was made, and learns how
long reservations are held (an average over those released). A reservation is expected to
end one average hold after it began; one held longer already may end at any moment. The
forecast replays those ends in order, handing freed room to the requests waiting in the
queue first and then to the refused request, and a waiter admitted on the way is itself
expected to end one hold later. Tokens in flight that other replicas hold (the shared
ledger counts them, this process does not know their age) are expected half a hold away.

With no hold observed yet (a cold gateway), the reservations' ages stand in for it: a
reservation is expected to run twice as long as it has so far, and at least one second.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable
from dataclasses import dataclass

FLOOR_S = 1.0
CEILING_S = 60.0
COLD_HOLD_S = 1.0  # the least a reservation is expected to last before any was seen to end
OVERDUE = 0.1  # of a hold: what is left to a reservation older than the average hold


@dataclass(slots=True)
class HoldTimes:
    """How long one pool's reservations are held, averaged over those released."""

    mean_s: float | None = None
    weight: float = 0.2

    def observe(self, seconds: float) -> None:
        if self.mean_s is None:
            self.mean_s = seconds
        else:
            self.mean_s += self.weight * (seconds - self.mean_s)


def expected_hold_s(hold: HoldTimes, ages: Iterable[float]) -> float:
    """The average hold, or, before any was seen, twice the mean age of those in flight."""
    if hold.mean_s is not None:
        return max(hold.mean_s, 0.001)
    seen = list(ages)
    mean_age = sum(seen) / len(seen) if seen else 0.0
    return max(COLD_HOLD_S, 2 * mean_age)


def seconds_until_fits(
    *,
    tokens: int,
    room: int,
    held: Iterable[tuple[float, int]],
    unaged_tokens: int,
    waiting: Iterable[int],
    hold_s: float,
    floor_s: float = FLOOR_S,
) -> float:
    """Seconds until `tokens` more fit, clamped to [floor_s, CEILING_S] (a Retry-After is
    at least FLOOR_S; a prediction of a queue's wait may be shorter).

    `room`: tokens free now (under the target fill); `held`: (age in seconds, tokens) of the
    reservations this process holds; `unaged_tokens`: tokens in flight of unknown age;
    `waiting`: the tokens of each request queued ahead, served first.
    """
    ends = [(_remaining(age, hold_s), size) for age, size in held]
    if unaged_tokens > 0:
        ends.append((hold_s / 2, unaged_tokens))
    heapq.heapify(ends)
    ahead = [*waiting, tokens]
    free, t, i = room, 0.0, 0
    while True:
        while i < len(ahead) and ahead[i] <= free:
            free -= ahead[i]
            if i == len(ahead) - 1:
                return min(CEILING_S, max(floor_s, t))
            heapq.heappush(ends, (t + hold_s, ahead[i]))
            i += 1
        if not ends or t >= CEILING_S:
            return CEILING_S
        t, size = heapq.heappop(ends)
        free += size


def _remaining(age: float, hold_s: float) -> float:
    left = hold_s - age
    return left if left > OVERDUE * hold_s else OVERDUE * hold_s
