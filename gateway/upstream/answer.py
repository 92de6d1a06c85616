"""What relaying an answer hands back, and what every relay shares: the answer's usage and
what it was (`Relayed`), what watches and records it, the swap of the served model name
for the public one, and the relay of an answer that is one JSON document. The streaming
relay is gateway/upstream/relay.py."""

from __future__ import annotations

import functools
import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import orjson

SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]
JSON_HEADERS = [(b"content-type", b"application/json")]
DONE = b"data: [DONE]\n\n"


@dataclass(slots=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    known: bool = False

    @classmethod
    def from_json(cls, usage: Any) -> Usage:
        """The usage of an answer the gateway made itself (a cached one); an upstream's is
        checked against its request (gateway/upstream/usage.py)."""
        if not isinstance(usage, dict):
            return cls()
        if "input_tokens" in usage:  # the Responses API's names
            prompt, completion = usage["input_tokens"], usage.get("output_tokens")
        else:
            prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
        return cls(
            prompt_tokens=max(0, token_count(prompt) or 0),
            completion_tokens=max(0, token_count(completion) or 0),
            known=True,
        )

    @property
    def total(self) -> int:
        return self.prompt_tokens + self.completion_tokens


def token_count(value: Any) -> int | None:
    """`value` as a whole number, if it is one (JSON may write `5.0`); None otherwise."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    return None


class StreamWatch(Protocol):
    """Counts what a stream relays (admission/ledger/growth.py); `grow` when `seen` says so."""

    def seen(self, out: bytes, events: int | None = None) -> bool: ...

    async def grow(self) -> None: ...


class AnswerRecorder(Protocol):
    """Sees the bytes of one successful response as the client gets them, and its usage at
    the end (the response cache fills this way)."""

    def feed(self, data: bytes) -> None: ...

    def finish(self, usage: Usage) -> None: ...


# puts the public model name in place of the served one in every `"model"` field of the
# data it is given; returns the data unchanged where there is none
ModelSwap = Callable[[bytes], bytes]


@functools.lru_cache(maxsize=256)
def model_swap(served: str, public: str) -> ModelSwap | None:
    """The swap from `served` to `public`, or None when the names are the same.

    Upstreams differ in spacing (`"model":"x"`, `"model": "x"`) and in escaping (`\\/`,
    `\\u00e9`), so the field is matched by one compiled pattern for them all; the field
    goes out compact. A fixed replacement keeps the substitution as cheap as a search.
    """
    if served == public:
        return None
    compact = orjson.dumps(served)
    spellings = {compact, json.dumps(served).encode(), compact.replace(b"/", b"\\/")}
    names = b"|".join(re.escape(s) for s in sorted(spellings, key=len, reverse=True))
    pattern = re.compile(rb'"model"\s*:\s*(?:' + names + rb")")
    # a replacement template: the public name's own backslashes must stay literal
    replacement = b'"model":' + orjson.dumps(public).replace(b"\\", b"\\\\")
    return functools.partial(pattern.sub, replacement)


def sse_error_event(message: str, *, code: str = "upstream_error") -> bytes:
    error = {"error": {"message": message, "type": "server_error", "param": None, "code": code}}
    return b"data: " + orjson.dumps(error) + b"\n\n" + DONE


def preempted_event(retry_after: float) -> bytes:
    """The end of a stream the gateway stopped for more urgent work and could not go on
    with: an error event whose `retry_after` (seconds) says when to send it again, the
    hint a 503's `Retry-After` header gives where headers can still be sent."""
    seconds = max(1, round(retry_after))
    error = {
        "error": {
            "message": "This stream was preempted by more urgent work and could not go on; "
            f"retry after {seconds} s.",
            "type": "server_error",
            "param": None,
            "code": "preempted",
            "retry_after": seconds,
        }
    }
    return b"data: " + orjson.dumps(error) + b"\n\n" + DONE


# an event's data that carries an error instead of a chunk of the answer
ERROR_DATA = re.compile(rb'\s*\{\s*"error"\s*:')
# a batch of events where one may carry an error (a cheap first look)
ERROR_EVENT = re.compile(rb'data:\s*\{\s*"error"\s*:')


def event_data(event: bytes) -> bytes | None:
    """The data of one server-sent event (its `\\n`-separated lines, without the blank line
    that ended it), as the WHATWG spec reads it: the values of its `data` fields, with or
    without the space after the colon, joined by line breaks; `id`, `event`, `retry` and
    comment lines aside. None when it has no data (a comment: a keep-alive ping)."""
    if event.startswith(b"data: ") and b"\n" not in event:  # how vLLM and OpenAI send them
        return event[6:]
    data = [
        line[6:] if line.startswith(b"data: ") else line[5:]
        for line in event.split(b"\n")
        if line.startswith(b"data:")
    ]
    return b"\n".join(data) if data else None


def event_json(event: bytes) -> dict[str, Any] | None:
    """The JSON object one event's data holds, else None."""
    data = event_data(event)
    if data is None:
        return None
    try:
        payload = orjson.loads(data)
    except orjson.JSONDecodeError:
        return None
    return payload if isinstance(payload, dict) else None


def error_data(event: bytes) -> bytes | None:
    """The data of an error event (one that carries an error instead of a chunk of the
    answer), else None."""
    data = event_data(event)
    return data if data is not None and ERROR_DATA.match(data) else None


def failure_event(event: bytes) -> bool:
    """An error event for a failure of the upstream's, not of the request: its code is a
    5xx, or it has none."""
    data = error_data(event)
    if data is None:
        return False
    try:
        error = orjson.loads(data).get("error")
    except (orjson.JSONDecodeError, AttributeError):
        return True
    code = error.get("code") if isinstance(error, dict) else None
    if isinstance(code, str) and code.isdigit():
        code = int(code)
    return not isinstance(code, int) or code >= 500


def carry_over(usage: dict[str, Any], carried: int, *, prompt: int | None) -> None:
    """A continuation's usage as the client's: the `carried` tokens the client got before
    it are output, once. Its prompt held them, re-tokenized: the client's prompt is
    `prompt` where the backend counted it, else the continuation's less the carried."""
    prompt_c = usage.get("prompt_tokens")
    completion = usage.get("completion_tokens")
    if isinstance(prompt_c, int) and isinstance(completion, int):
        if prompt is None:
            prompt = max(0, prompt_c - carried)
        usage["prompt_tokens"] = prompt
        usage["completion_tokens"] = completion + carried
        usage["total_tokens"] = prompt + completion + carried
