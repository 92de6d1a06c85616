"""The front door's refusals of oversized requests: a head before any handler runs, a body
as soon as it is known to be too large. Both close the connection."""

from __future__ import annotations

from itertools import chain

from starlette.responses import Response
from starlette.types import Scope

from gateway.errors import BodyTooLarge, HeadersTooLarge, error_response


def head_bytes(scope: Scope) -> int:
    """The size of the request target and headers, as they came on the wire."""
    target = len(scope.get("raw_path") or b"") + len(scope.get("query_string") or b"")
    headers = scope["headers"]  # each "name: value\r\n" adds 4 bytes to its two parts
    return target + sum(map(len, chain.from_iterable(headers))) + 4 * len(headers)


def head_too_large(max_bytes: int) -> Response:
    """The 431 for a request whose target and headers exceed `max_bytes`; the connection
    is closed, and the body never read."""
    error = HeadersTooLarge(
        f"The request headers exceed the limit of {max_bytes} bytes.",
        headers={"connection": "close"},
    )
    return error_response(error)


def body_too_large(max_bytes: int) -> BodyTooLarge:
    """The 413 for a body over `max_bytes`. The connection is closed: the rest of the body
    may still be on its way, and reading it only to throw it away is what the limit stops."""
    return BodyTooLarge(
        f"The request body exceeds the limit of {max_bytes} bytes.",
        headers={"connection": "close"},
    )
