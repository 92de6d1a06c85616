"""What an answer says it used, checked against what it could have used.

An answer's `usage` is evidence, not truth: a backend behind someone else's proxy, a
misconfigured server or a compromised provider can say anything there, and the gateway
charges tenants, spends provider budgets, learns its prompt estimates and fills its
metrics from it. So every count is read defensively and bounded by the request:

- the prompt by what its estimate could mean (PROMPT_FACTOR times it, or a whole
  PROMPT_FLOOR context, whichever is more: images and stored conversations make real
  prompts far longer than their text);
- the output by the choices' limit where the request named one, else by PROMPT_FLOOR per
  choice; and for a stream, from below by the events the gateway itself relayed (vLLM
  sends one per token; a provider that sends several per event only makes it lower);
- a count that is missing, zero where the answer cannot be empty, negative or not a
  number falls back to the gateway's own count: the estimate for the prompt; for the
  output, the events relayed, or for an answer in one piece what the request was charged.
  Never to a full refund.

Each correction is named (`prompt_too_large`, `completion_missing`, ...): the forwarder
counts them by target in `spillgate_usage_corrections_total` and logs them, at most once a
minute per target (`Corrections`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client import Counter

from gateway.clock import Clock
from gateway.request import Endpoint, InferenceRequest
from gateway.upstream.answer import Usage

log = logging.getLogger("spillgate.usage")

PROMPT_FACTOR = 10
PROMPT_FLOOR = 131_072  # tokens: a prompt that fits a 128k context is never implausible
# a stream's events that carry no output token besides each choice's role and finishing
# events: the usage event, `[DONE]`, the Responses API's framing events around its deltas
FRAMING_EVENTS = 12
LOG_EVERY_S = 60.0


@dataclass(frozen=True, slots=True)
class UsageCheck:
    """What one request's answer could have used."""

    prompt_estimate: int
    prompt_max: int
    completion_max: int  # all choices together; 0: the endpoint generates nothing
    completion_charged: int  # what the choices were charged: an answer's fallback
    choices: int

    @classmethod
    def of(cls, request: InferenceRequest) -> UsageCheck:
        estimate = request.prompt_tokens
        generates = request.endpoint is not Endpoint.EMBEDDINGS
        per_choice = request.max_output_tokens
        if generates and not _names_output_limit(request.body):
            # the engine may generate up to its context, which the gateway's default
            # (what it reserved) need not reach
            per_choice = max(per_choice, PROMPT_FLOOR)
        return cls(
            prompt_estimate=estimate,
            prompt_max=max(PROMPT_FACTOR * estimate, PROMPT_FLOOR),
            completion_max=request.n * per_choice if generates else 0,
            completion_charged=request.n * request.max_output_tokens if generates else 0,
            choices=request.n,
        )

    def check(self, reported: Any, *, events: int | None) -> tuple[Usage, tuple[str, ...]]:
        """The usage `reported` (the answer's `usage`: None where it had none) as the gateway
        takes it, and what was corrected. `events`: the data events a stream relayed (None:
        an answer in one piece)."""
        if reported is None:
            return Usage(), ()  # none told (a stream cut short): the charge stands
        flaws: list[str] = []
        if not isinstance(reported, dict):
            reported, flaws = {}, ["usage_not_an_object"]
        if "input_tokens" in reported:  # the Responses API's names
            prompt_raw, completion_raw = reported["input_tokens"], reported.get("output_tokens")
        else:
            prompt_raw = reported.get("prompt_tokens", _MISSING)
            completion_raw = reported.get("completion_tokens", _MISSING)
        prompt, why = _bounded(prompt_raw, low=1, high=self.prompt_max)
        if why is not None:
            flaws.append(f"prompt_{why}")
            prompt = self.prompt_max if why == "too_large" else self.prompt_estimate
        completion = self._completion(completion_raw, events, flaws)
        return Usage(prompt_tokens=prompt, completion_tokens=completion, known=True), tuple(flaws)

    def _completion(self, raw: Any, events: int | None, flaws: list[str]) -> int:
        if not self.completion_max:  # embeddings: nothing generated, whatever is said
            if raw is not _MISSING and _count(raw) not in (None, 0):
                flaws.append("completion_too_large")
            return 0
        # the least output a stream's events show, and the fallback: the events relayed
        # (which errs high), or for one piece what was charged
        least = 0 if events is None else max(0, events - 2 * self.choices - FRAMING_EVENTS)
        fallback = self.completion_charged if events is None else events
        fallback = min(fallback, self.completion_max)
        count, why = _bounded(raw, low=1, high=self.completion_max)
        if why == "too_large":
            flaws.append("completion_too_large")
            return self.completion_max
        if why is not None:
            flaws.append(f"completion_{why}")
            return fallback
        if count < least:
            flaws.append("completion_too_small")
            return least
        return count


class _Missing:
    pass


_MISSING: Any = _Missing()


def _count(value: Any) -> int | None:
    """`value` as a count of tokens, if it is a whole number (JSON may write `5.0`)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    return None


def _bounded(value: Any, *, low: int, high: int) -> tuple[int, str | None]:
    """`value` as a count within [low, high], or why it is not one."""
    if value is _MISSING or value is None:
        return 0, "missing"
    count = _count(value)
    if count is None:
        return 0, "not_a_number"
    if count < 0:
        return 0, "negative"
    if count < low:
        return 0, "zero"
    if count > high:
        return 0, "too_large"
    return count, None


def _names_output_limit(body: dict[str, Any]) -> bool:
    return any(
        body.get(key) is not None
        for key in ("max_completion_tokens", "max_tokens", "max_output_tokens")
    )


class Corrections:
    """Counts the usage the gateway corrected, by target and reason, and logs it at most
    once every LOG_EVERY_S per target."""

    def __init__(self, counter: Counter, *, clock: Clock) -> None:
        self._counter = counter
        self._clock = clock
        self._logged: dict[str, float] = {}

    def report(self, target: str, flaws: Sequence[str], reported: Any) -> None:
        for flaw in flaws:
            self._counter.labels(target, flaw).inc()
        now = self._clock.monotonic()
        last = self._logged.get(target)
        if last is None or now - last >= LOG_EVERY_S:
            self._logged[target] = now
            log.warning(
                "%s answered with usage the gateway corrected (%s): %.200r",
                target,
                ", ".join(flaws),
                reported,
            )
