"""What the upstream client sends, and how the upstream hop fails: the head of every
request to one URL (`Route`), checked header by header, and the errors a caller of the
client catches. Security-sensitive, as gateway/upstream/http.py says: a header that is not
checked here is a header an attacker may add to every upstream request."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import NamedTuple
from urllib.parse import urlsplit

# (RFC 9110 §5.1, §5.5): one with a line break would add headers, or end the head early
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_FIELD_VALUE = re.compile(r"[^\x00-\x08\x0a-\x1f\x7f]*")
_REQUEST_TARGET = re.compile(r"[^\x00-\x20\x7f]+")


class TransportError(Exception):
    """The upstream could not be reached, or its connection failed before the answer ended."""


class ConnectFailed(TransportError):
    """No connection could be made; `os_error` says why."""

    def __init__(self, message: str, os_error: OSError) -> None:
        super().__init__(message)
        self.os_error = os_error


class ConnectionClosed(TransportError):
    """The connection closed before the answer ended."""


class Preempted(TransportError):
    """The gateway stopped the request at its upstream: more urgent work took its room
    (gateway/upstream/stop.py)."""

    def __init__(self, retry_after: float) -> None:
        super().__init__(
            "This request was preempted by more urgent work and could not go on; "
            f"retry after {retry_after:.0f} s."
        )
        self.retry_after = retry_after


class ProtocolError(TransportError):
    """The upstream's bytes were not HTTP/1.1, or not within the client's bounds."""


class BodyTooLarge(ProtocolError):
    """An upstream's body, read whole, passed the bound its reader set."""


def header_line(name: str, value: str) -> str:
    """`name: value` and its CRLF; ValueError for a name that is not a token, or a value
    with a line break or another control character in it (HTAB aside)."""
    if not _TOKEN.fullmatch(name):
        raise ValueError(f"not a header name: {name!r}")
    if not _FIELD_VALUE.fullmatch(value):
        # the value is not shown: it may be a key
        raise ValueError(f"header {name!r} has a line break or other control character in it")
    return f"{name}: {value}\r\n"


class Route(NamedTuple):
    """Where requests to one URL go, and the head each of them starts with."""

    origin: tuple[str, int, bool]  # host, port, TLS
    head: bytes  # request line, host, and the fixed headers, each line ending in CRLF
    connect_s: float

    @classmethod
    def post(cls, url: str, headers: Mapping[str, str], *, connect_s: float) -> Route:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {url!r}")
        tls = parts.scheme == "https"
        port = parts.port or (443 if tls else 80)
        host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname  # IPv6
        if parts.port is not None:
            host = f"{host}:{port}"
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        if not _REQUEST_TARGET.fullmatch(target):
            raise ValueError(f"a space or control character in the path of {url!r}")
        # a key read from the environment with a line break in it would add headers
        lines = [f"POST {target} HTTP/1.1\r\n", header_line("host", host)]
        lines += [header_line(name, value) for name, value in headers.items()]
        head = "".join(lines).encode("latin-1")
        return cls(origin=(parts.hostname, port, tls), head=head, connect_s=connect_s)
