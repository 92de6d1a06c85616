"""The front door's first check: an oversized request head is refused before any handler."""

from __future__ import annotations

from itertools import chain

from starlette.responses import Response
from starlette.types import Scope

from gateway.errors import HeadersTooLarge, error_response


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
