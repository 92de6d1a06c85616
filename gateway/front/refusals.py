"""What the gateway says when it turns a request away before serving it, in OpenAI's shape."""

from __future__ import annotations

from gateway.errors import ContextLengthExceeded, LimiterUnavailable, SpillgateError, Throttled
from gateway.ratelimit import Decision
from gateway.request import InferenceRequest


def limiter_refusal(
    decision: Decision, *, tenant: str, request: InferenceRequest
) -> SpillgateError:
    """The error for a decision the limiter refused: why, and when to come back."""
    if decision.reason == "store_unavailable":
        return LimiterUnavailable(
            "Rate limiting is unavailable and this gateway is configured to refuse meanwhile.",
            retry_after=decision.retry_after_s,  # the breaker's remaining cooldown
        )
    if decision.reason == "too_large":
        # no Retry-After: waiting cannot help, and clients (openai's) honour x-should-retry
        return Throttled(
            f"Request too large for tenant {tenant!r}: it needs "
            f"{request.charge_tokens} tokens (prompt estimate plus max_tokens) but the "
            f"tenant's token bucket holds at most {decision.limit_tokens}. Lower max_tokens "
            "or shorten the prompt; retrying will not help.",
            code="request_too_large",
            headers={"x-should-retry": "false"},
        )
    return Throttled(
        f"Rate limit reached for tenant {tenant!r} on {decision.reason} per minute.",
        retry_after=decision.retry_after_s,
    )


def never_fits(request: InferenceRequest, *, need: int, largest: int) -> ContextLengthExceeded:
    """The error for a request that needs `need` tokens of KV cache where the largest
    backend of its pool holds `largest`: 400, for good."""
    output = request.sequence_tokens - request.prompt_tokens
    return ContextLengthExceeded(
        f"The request needs about {need} tokens of KV cache ({request.n} x (about "
        f"{request.prompt_tokens} prompt tokens + {output} output "
        f"tokens), in whole blocks), more than any backend of pool {request.pool!r} can "
        f"hold ({largest} tokens). Lower max_tokens or n, or shorten the prompt.",
        param="max_tokens",
    )
