"""What an answer says it used, checked against what it could have used.

An answer's `usage` is evidence, not truth: a backend behind someone else's proxy, a
misconfigured server or a compromised provider can say anything there, and the gateway
charges tenants, spends provider budgets, learns its prompt estimates and fills its
metrics from it. So every count is read defensively and bounded by the request:

- the prompt by what its estimate could mean (PROMPT_FACTOR times it, or a whole context,
  whichever is more: images and stored conversations make real prompts far longer than
  their text); the context is the model's where the pool knows it and it is longer than
  PROMPT_FLOOR, else PROMPT_FLOOR;
- the output by what the request could have used: the choices' limit where it named one,
  else the model's context per choice where the pool knows it (PROMPT_FLOOR where not);
  and for a stream, from below by the events the gateway itself relayed (vLLM sends one per
  token; a provider that sends several per event only makes it lower). The charge is never
  above what the request could have used, whatever was streamed: a backend that ignores
  `max_tokens` and streams past it is the operator's to fix, and charging the tenant for it
  would let a backend's events lock a tenant out as a told count could
  (`completion_past_limit`);
- a count that is missing, zero where the answer cannot be empty, negative or not a
  number falls back to the gateway's own count: the estimate for the prompt; for the
  output, the events relayed, or for an answer in one piece what the request was charged.
  Never to a full refund.

Each correction is named (`prompt_too_large`, `completion_missing`, ...): the forwarder
counts them by target in `spillgate_usage_corrections_total` and logs them, at most once a
minute per target (`AnswerFlaws`). A correction that shows the upstream told what cannot be
true (LIES: a count that is negative, not a number, or past what the request could have
used, or a usage that is no object) is a failure of a pool's backend, counted against its
health as a junk answer is (`Corrected.lies`). A count that is missing or zero is not: vLLM
leaves usage out of a stream unless asked, and other servers tell zeros where they do not
count.
"""

from __future__ import annotations

import logging
from typing import Any, NamedTuple

from prometheus_client import Counter

from gateway.clock import Clock
from gateway.request import Endpoint, InferenceRequest
from gateway.upstream.answer import Usage, token_count

log = logging.getLogger("spillgate.usage")

PROMPT_FACTOR = 10
PROMPT_FLOOR = 131_072  # tokens: a prompt that fits a 128k context is never implausible
# a stream's events that carry no output token besides each choice's role and finishing
# events: the usage event, `[DONE]`, the Responses API's framing events around its deltas
FRAMING_EVENTS = 12
LOG_EVERY_S = 60.0
_OUTPUT_LIMITS = ("max_completion_tokens", "max_tokens", "max_output_tokens")
_MISSING: Any = object()
# corrections that show the upstream told what cannot be true, not what it left out
LIES = frozenset({
    "usage_not_an_object",
    "prompt_negative", "prompt_not_a_number", "prompt_too_large",
    "completion_negative", "completion_not_a_number", "completion_too_large",
})  # fmt: skip


class Corrected(NamedTuple):
    """What was corrected in the usage an upstream told (`flaws`), and what it told."""

    flaws: tuple[str, ...]
    reported: Any

    @property
    def lies(self) -> bool:
        """Whether the upstream told what cannot be true (LIES), not merely left it out."""
        return not LIES.isdisjoint(self.flaws)


def checked_usage(
    reported: Any, request: InferenceRequest, *, events: int | None
) -> tuple[Usage, Corrected | None]:
    """The usage `reported` (an answer's `usage`; None where it had none) as the gateway
    takes it for `request`, and what was corrected, if anything. `events`: the data events
    a stream relayed (None: an answer in one piece)."""
    if type(reported) is dict:
        # the usual answer, told in range, costs no more than these comparisons
        prompt = reported.get("prompt_tokens")
        completion = reported.get("completion_tokens")
        if (
            type(prompt) is int
            and type(completion) is int
            and 0 < prompt <= PROMPT_FLOOR  # past it: the slow path knows the whole bound
            and 0 < completion <= request.n * request.max_output_tokens
            and (events is None or completion >= events - 2 * request.n - FRAMING_EVENTS)
        ):
            return Usage(prompt, completion, known=True), None
    elif reported is None:
        return Usage(), None  # none told (a stream cut short): the charge stands
    return _corrected(reported, request, events)


def _corrected(
    reported: Any, request: InferenceRequest, events: int | None
) -> tuple[Usage, Corrected | None]:
    flaws: list[str] = []
    told = reported
    if not isinstance(told, dict):
        told, flaws = {}, ["usage_not_an_object"]
    if "input_tokens" in told:  # the Responses API's names
        prompt_raw, completion_raw = told["input_tokens"], told.get("output_tokens", _MISSING)
    else:
        prompt_raw = told.get("prompt_tokens", _MISSING)
        completion_raw = told.get("completion_tokens", _MISSING)
    estimate = request.prompt_tokens
    prompt_max = max(PROMPT_FACTOR * estimate, PROMPT_FLOOR, request.model_context or 0)
    prompt, why = _bounded(prompt_raw, high=prompt_max)
    if why is not None:
        flaws.append(f"prompt_{why}")
        prompt = prompt_max if why == "too_large" else estimate
    completion = _completion(completion_raw, request, events, flaws)
    usage = Usage(prompt_tokens=prompt, completion_tokens=completion, known=True)
    return usage, Corrected(tuple(flaws), reported) if flaws else None


def _completion(raw: Any, request: InferenceRequest, events: int | None, flaws: list[str]) -> int:
    if request.endpoint is Endpoint.EMBEDDINGS:  # nothing generated, whatever is said
        if raw is not _MISSING and token_count(raw) not in (None, 0):
            flaws.append("completion_not_zero")  # odd, but costs nothing: no lie to punish
        return 0
    per_choice = request.max_output_tokens
    if not any(request.body.get(key) is not None for key in _OUTPUT_LIMITS):
        # the engine may generate up to its context, which the gateway's default (what it
        # reserved) need not reach
        per_choice = max(per_choice, request.model_context or PROMPT_FLOOR)
    most = request.n * per_choice
    # the least output a stream's events show, and the fallback: the events relayed
    # (which errs high), or for one piece what was charged; neither above `most`
    least = 0 if events is None else max(0, events - 2 * request.n - FRAMING_EVENTS)
    fallback = request.n * request.max_output_tokens if events is None else events
    count, why = _bounded(raw, high=most)
    if least > most:
        # the backend streamed past the request's limit: a count as high as its events is
        # the truth about a backend that ignores `max_tokens`, not a lie
        flaws.append("completion_past_limit")
        if why == "too_large" and events is not None and count <= events:
            why = None
    if why is not None:
        flaws.append(f"completion_{why}")
        return most if why == "too_large" else min(fallback, most)
    if count < least:
        flaws.append("completion_too_small")
    return min(max(count, least), most)


def _bounded(value: Any, *, high: int) -> tuple[int, str | None]:
    """`value` as a count within [1, high], or why it is not one."""
    if value is _MISSING or value is None:
        return 0, "missing"
    count = token_count(value)
    if count is None:
        return 0, "not_a_number"
    if count < 0:
        return 0, "negative"
    if count == 0:
        return 0, "zero"
    if count > high:
        return count, "too_large"
    return count, None


class AnswerFlaws:
    """What the forwarder tells of answers it could not take as they came: usage the
    gateway corrected, by target and reason (logged at most once every LOG_EVERY_S per
    target), and resumable streams whose answer passed the bound on what is kept."""

    def __init__(self, *, corrections: Counter, not_kept: Counter, clock: Clock) -> None:
        self._corrections = corrections
        self._not_kept = not_kept
        self._clock = clock
        self._logged: dict[str, float] = {}

    def corrected(self, target: str, corrected: Corrected) -> None:
        for flaw in corrected.flaws:
            self._corrections.labels(target, flaw).inc()
        now = self._clock.monotonic()
        last = self._logged.get(target)
        if last is None or now - last >= LOG_EVERY_S:
            self._logged[target] = now
            log.warning(
                "%s answered with usage the gateway corrected (%s): %.200r",
                target,
                ", ".join(corrected.flaws),
                corrected.reported,
            )

    def not_kept(self, target: str) -> None:
        self._not_kept.labels(target).inc()
