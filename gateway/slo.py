"""Per-request objectives: what each step is measured to take, and the ladder that picks one.

A request may name a time to first token (`x-spillgate-ttft-ms`) and a time per output
token after it (`x-spillgate-tpot-ms`), or inherit its tenant's (`ttft_budget_ms`,
`tpot_budget_ms`). When its pool has no room, the overflow chain is then walked as a ladder:
each step that can predict says how long this request would wait for its first token there
(the queue: the later of the pool's forecast of when the request fits and its turn in
the fair order, plus the pool's own time to first token; a smaller model: its pool's, if
it has room; a provider: its measured latency, if its gate would let the request
through), and a step predicted to miss the time left is passed
over. The chain's order is the operator's order of cost, so the first step predicted to
meet the objective is the cheapest that will. A step with nothing measured yet is tried, as
without an objective. When every step was passed over, the request is refused at once with
the pool's Retry-After rather than after its deadline. A pool with room but measured slower
than the time left (a backend whose own queue has grown) is a step like the others: the
request goes down the ladder.

`Latencies` keeps what the predictions stand on: per target (a pool's backends, a provider),
the recent time from forwarding to the first byte and per output token after it, as
exponentially weighted means of the answers served there. A TPOT objective passes over a
target measured slower per token than it allows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gateway.clock import Clock
from gateway.errors import Rejected
from gateway.request import TTFT_HEADER, InferenceRequest

WEIGHT = 0.2  # an answer's share of the mean: the last ten or so answers count most
# A mean no answer has refreshed for this long says nothing: a target the ladder passed over
# because it was slow gets tried again, and its next answer starts a new mean.
STALE_S = 30.0


@dataclass(slots=True)
class _Mean:
    value: float
    at: float  # when the last answer came in
    count: int = 1

    def add(self, sample: float, now: float) -> None:
        if now - self.at > STALE_S:
            self.value = sample
        else:
            self.value += WEIGHT * (sample - self.value)
        self.at = now
        self.count += 1


class Targets:
    """Recent time to first token and per output token at each target of one kind."""

    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self._ttft: dict[str, _Mean] = {}
        self._tpot: dict[str, _Mean] = {}

    def observe(self, target: str, ttft_s: float, tpot_s: float | None = None) -> None:
        now = self._clock.monotonic()
        _add(self._ttft, target, ttft_s, now)
        if tpot_s is not None:
            _add(self._tpot, target, tpot_s, now)

    def ttft_s(self, target: str) -> float | None:
        """The recent time to first token at `target`; None when nothing recent is known."""
        return self._recent(self._ttft.get(target))

    def tpot_s(self, target: str) -> float | None:
        """The recent time per output token after the first; None when nothing recent."""
        return self._recent(self._tpot.get(target))

    def _recent(self, mean: _Mean | None) -> float | None:
        if mean is None or self._clock.monotonic() - mean.at > STALE_S:
            return None
        return mean.value

    def snapshot(self) -> dict[str, dict[str, float | int | None]]:
        """Every target's means and the answers behind them (for /admin/status)."""
        return {
            target: {
                "ttft_s": round(mean.value, 4),
                "tpot_s": None if target not in self._tpot else round(self._tpot[target].value, 5),
                "answers": mean.count,
            }
            for target, mean in sorted(self._ttft.items())
        }


class Latencies:
    """What the predictions stand on, measured from forwarding to the first byte (so a
    queue's wait is not in it) and per output token after it: per pool, of its own
    backends' answers (`local`), and per external provider (`provider`)."""

    def __init__(self, clock: Clock) -> None:
        self.local = Targets(clock)
        self.provider = Targets(clock)

    def snapshot(self) -> dict[str, dict[str, dict[str, float | int | None]]]:
        return {"local": self.local.snapshot(), "provider": self.provider.snapshot()}


def _add(means: dict[str, _Mean], target: str, sample: float, now: float) -> None:
    mean = means.get(target)
    if mean is None:
        means[target] = _Mean(sample, now)
    else:
        mean.add(sample, now)


def predict(targets: Targets, target: str, request: InferenceRequest) -> float | None:
    """The time to first token `target` is measured to give, or math.inf when it is measured
    slower per output token than the request's TPOT objective allows; None: nothing
    measured yet."""
    if request.tpot_slo_s is not None:
        tpot = targets.tpot_s(target)
        if tpot is not None and tpot > request.tpot_slo_s:
            return math.inf
    return targets.ttft_s(target)


@dataclass(slots=True)
class Prediction:
    """What the ladder predicted for the step that served a request, to measure its error."""

    step: str
    ttft_s: float  # predicted from `at`, the Clock time it was made
    at: float


class SloUnattainable(Rejected):
    """No step of the pool's ladder is predicted to give the first token in time."""

    code = "slo_unattainable"


def unattainable(
    pool: str, slo_s: float, predictions: list[tuple[str, float]], *, retry_after: float
) -> SloUnattainable:
    """The refusal of a request that no step can serve within its objective, naming each
    step's prediction, so the client can retry later or relax its objective."""
    told = ", ".join(f"{step} ~{_ms(s)}" for step, s in predictions) or "no step"
    return SloUnattainable(
        f"No step of pool {pool!r} is predicted to give a first token within "
        f"{slo_s * 1000:.0f} ms ({told}); retry after the indicated delay, or relax "
        f"{TTFT_HEADER}.",
        retry_after=retry_after,
    )


def _ms(seconds: float) -> str:
    return "never now" if math.isinf(seconds) else f"{seconds * 1000:.0f} ms"
