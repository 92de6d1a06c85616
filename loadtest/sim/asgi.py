"""Bare ASGI helpers for the simulators' hot routes: no Request or Response objects."""

from __future__ import annotations

from starlette.types import Receive, Send

JSON_CONTENT_TYPE = b"application/json"
SSE_CONTENT_TYPE = b"text/event-stream; charset=utf-8"


class ClientGone(Exception):
    pass


async def read_body(receive: Receive) -> bytes:
    message = await receive()
    if message["type"] == "http.disconnect":
        raise ClientGone
    body: bytes = message.get("body", b"")
    if not message.get("more_body"):
        return body
    chunks = [body]
    while message.get("more_body"):
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        chunks.append(message.get("body", b""))
    return b"".join(chunks)


async def wait_disconnect(receive: Receive) -> None:
    """Returns once the client has gone (or the response is complete)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def send_json(
    send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]] | None = None
) -> None:
    all_headers = [
        (b"content-type", JSON_CONTENT_TYPE),
        (b"content-length", b"%d" % len(body)),
        *(headers or []),
    ]
    await send({"type": "http.response.start", "status": status, "headers": all_headers})
    await send({"type": "http.response.body", "body": body})


async def start_sse(send: Send, headers: list[tuple[bytes, bytes]] | None = None) -> None:
    all_headers = [(b"content-type", SSE_CONTENT_TYPE), *(headers or [])]
    await send({"type": "http.response.start", "status": 200, "headers": all_headers})


async def send_chunk(send: Send, body: bytes, *, last: bool = False) -> None:
    await send({"type": "http.response.body", "body": body, "more_body": not last})
