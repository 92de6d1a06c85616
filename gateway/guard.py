"""Pure ASGI middleware that refuses oversized request heads before any handler runs."""

from __future__ import annotations

from itertools import chain

from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.errors import HeadersTooLarge, error_response


def head_bytes(scope: Scope) -> int:
    """The size of the request target and headers, as they came on the wire."""
    target = len(scope.get("raw_path") or b"") + len(scope.get("query_string") or b"")
    headers = scope["headers"]  # each "name: value\r\n" adds 4 bytes to its two parts
    return target + sum(map(len, chain.from_iterable(headers))) + 4 * len(headers)


class HeaderLimit:
    """A request whose target and headers exceed `max_bytes` gets a 431 and a closed
    connection; its body is never read."""

    def __init__(self, app: ASGIApp, *, max_bytes: int) -> None:
        self._app = app
        self._max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or head_bytes(scope) <= self._max_bytes:
            await self._app(scope, receive, send)
            return
        error = HeadersTooLarge(
            f"The request headers exceed the limit of {self._max_bytes} bytes.",
            headers={"connection": "close"},
        )
        await error_response(error)(scope, receive, send)
