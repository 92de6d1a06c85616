"""One exception tree; each class knows its HTTP status, OpenAI error type and Retry-After.

Handlers raise; `error_response` renders, in one place.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import orjson
from starlette.responses import Response

from gateway.outcome import OUTCOME_HEADER, Outcome


class SpillgateError(Exception):
    status: int = 500
    type: str = "server_error"
    code: str | None = None
    outcome: Outcome = Outcome.ERROR

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        retry_after: float | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code
        self.retry_after = retry_after
        self.headers = dict(headers or {})

    def body(self) -> dict[str, object]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


class InvalidRequest(SpillgateError):
    status = 400
    type = "invalid_request_error"
    code = "invalid_request"


class ModelNotFound(InvalidRequest):
    status = 404
    code = "model_not_found"


class ContextLengthExceeded(InvalidRequest):
    """The request can never be served: longer than the model's context, or than every
    backend's KV cache could hold with nowhere to spill. Retrying cannot help."""

    code = "context_length_exceeded"


class BodyTooLarge(InvalidRequest):
    status = 413
    code = "request_too_large"


class HeadersTooLarge(InvalidRequest):
    status = 431
    code = "request_headers_too_large"


class RequestTimeout(InvalidRequest):
    """The client did not send its whole request within the server's read deadline."""

    status = 408
    code = "request_timeout"


class Unauthenticated(SpillgateError):
    status = 401
    type = "invalid_request_error"
    code = "invalid_api_key"


class Forbidden(SpillgateError):
    status = 403
    type = "permission_error"
    code = "forbidden"


class Throttled(SpillgateError):
    status = 429
    type = "rate_limit_error"
    code = "rate_limit_exceeded"
    outcome = Outcome.THROTTLED


class Rejected(SpillgateError):
    """The fleet and every overflow path are full: a polite, honest 503."""

    status = 503
    type = "server_error"
    code = "capacity_exhausted"
    outcome = Outcome.REJECTED


class QueueFull(Rejected):
    """The pool's queue is full (its waiters, or the tokens they would reserve) and no step
    after it serves: an arrival that no waiter ranks below, or a waiter pushed out of the
    queue by one that goes first (policies/queue/fair_queue.py). The pool and the rest of
    the fleet may well be serving; the Retry-After says when the pool likely has room.
    A 503 like every full-pool refusal, which OpenAI's clients retry after that delay."""

    code = "queue_full"


class LimiterUnavailable(Rejected):
    """The shared rate-limit store failed and the configured mode is `deny`."""

    code = "ratelimit_store_unavailable"


class BackendUnavailable(Rejected):
    """No backend of the pool can be reached (or serves its model), and no overflow path
    answered: not a full pool. No Retry-After: when it comes back is not known here."""

    code = "backend_unavailable"


class UpstreamError(SpillgateError):
    status = 502
    type = "server_error"
    code = "upstream_error"


class UpstreamTimeout(UpstreamError):
    status = 504
    code = "upstream_timeout"


class NoRoomToRetry(UpstreamError):
    """A backend failed a request before its first byte (it is going away, or failing) and
    no other backend of the pool has room for it now. Nothing reached the client: the
    pipeline passes the request on to its pool's overflow chain, as an arrival that found
    no room, and so does a policy that passes on an UpstreamError; what nothing catches is
    a 502."""


class UpstreamUnavailable(Exception):
    """The upstream failed before the first byte: safe to try elsewhere.

    Not a SpillgateError: no client sees it. The exchange tries another backend, or an
    overflow policy passes the request on, and what the client gets is decided there.
    """

    def __init__(
        self,
        reason: str,
        *,
        status: int | None = None,
        retry_after: float | None = None,
        timed_out: bool = False,
        detail: bytes = b"",
        unreachable: str | None = None,
    ):
        super().__init__(reason)
        self.reason = reason  # "<kind>: <detail>"; the kind labels the upstream error metric
        self.status = status
        self.retry_after = retry_after
        self.timed_out = timed_out
        self.detail = detail  # what the upstream said, for the log only
        self.unreachable = unreachable  # nothing answered at its address: in these words


def error_response(
    exc: SpillgateError, extra_headers: Sequence[tuple[bytes, bytes]] = ()
) -> Response:
    """The error in OpenAI's shape; `extra_headers` (the rate-limit headers the request
    was already given) go out as they are."""
    headers = {OUTCOME_HEADER: exc.outcome.value, **exc.headers}
    if exc.retry_after is not None:
        headers["retry-after"] = str(max(1, math.ceil(exc.retry_after)))
    response = Response(
        orjson.dumps(exc.body()),
        status_code=exc.status,
        headers=headers,
        media_type="application/json",
    )
    response.raw_headers.extend(extra_headers)
    return response
