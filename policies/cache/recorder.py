"""Answers as documents: assemble a relayed response into one completion, replay it as SSE.

`CompletionRecorder` is an AnswerRecorder: it sees the bytes the client got (JSON, or SSE
events) and, when the response completed, hands over one `chat.completion` or
`text_completion` JSON document. Answers it cannot represent faithfully (tool-call deltas,
several choices, error events, more than `max_bytes`) are not recorded. `replay_sse` turns
such a document back into the events a streaming client expects.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson

from gateway.overflow import Usage, event_data
from gateway.request import Endpoint

Document = dict[str, Any]


class CompletionRecorder:
    def __init__(
        self,
        *,
        endpoint: Endpoint,
        stream: bool,
        max_bytes: int,
        on_answer: Callable[[bytes], None],
        defer: Callable[[Callable[[], None]], object] | None = None,
    ) -> None:
        """`defer` runs the assembly later (e.g. `loop.call_soon`), off the response's path."""
        self._chat = endpoint is Endpoint.CHAT
        self._stream = stream
        self._max = max_bytes
        self._on_answer = on_answer
        self._defer = defer
        self._parts: list[bytes] = []
        self._size = 0
        self._broken = False

    def feed(self, data: bytes) -> None:
        if self._broken:
            return
        self._size += len(data)
        if self._size > 4 * self._max:  # SSE framing is larger than the final document
            self._broken, self._parts = True, []
            return
        self._parts.append(data)

    def finish(self, usage: Usage) -> None:
        if self._broken:
            return
        raw, self._parts = b"".join(self._parts), []
        if self._defer is None:
            self._record(raw, usage)
        else:
            self._defer(lambda: self._record(raw, usage))

    def _record(self, raw: bytes, usage: Usage) -> None:
        doc = self._assemble(raw, usage) if self._stream else _parse(raw)
        if doc is None or not _single_choice(doc):
            return
        body = orjson.dumps(doc)
        if len(body) <= self._max:
            self._on_answer(body)

    def _assemble(self, raw: bytes, usage: Usage) -> Document | None:
        head: Document | None = None
        pieces: list[str] = []
        finish_reason: Any = None
        for event in raw.split(b"\n\n"):
            data = event_data(event)
            if data is None or data == b"[DONE]":
                continue
            chunk = _parse(data)
            if chunk is None or "error" in chunk:
                return None
            choices = chunk.get("choices") or []
            if not choices:
                continue  # the usage chunk
            if len(choices) != 1 or not isinstance(choices[0], dict):
                return None
            choice = choices[0]
            head = head or chunk
            text = _text_of(choice, chat=self._chat)
            if text is None:
                return None
            pieces.append(text)
            finish_reason = choice.get("finish_reason") or finish_reason
        if head is None:
            return None
        return self._document(head, "".join(pieces), finish_reason, usage)

    def _document(self, head: Document, text: str, finish_reason: Any, usage: Usage) -> Document:
        if self._chat:
            choice: Document = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": finish_reason,
            }
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        doc: Document = {
            "id": head.get("id"),
            "object": "chat.completion" if self._chat else "text_completion",
            "created": head.get("created"),
            "model": head.get("model"),
            "choices": [choice],
        }
        if usage.known:
            doc["usage"] = {
                "prompt_tokens": usage.prompt_tokens,
                "completion_tokens": usage.completion_tokens,
                "total_tokens": usage.total,
            }
        return doc


def _parse(raw: bytes) -> Document | None:
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None


def _single_choice(doc: Document) -> bool:
    choices = doc.get("choices")
    return isinstance(choices, list) and len(choices) == 1 and "error" not in doc


def _text_of(choice: Document, *, chat: bool) -> str | None:
    """The text a stream chunk adds, or None when it carries what a replay would lose."""
    if not chat:
        text = choice.get("text")
        return text if isinstance(text, str) else ""
    delta = choice.get("delta") or {}
    if not isinstance(delta, dict) or delta.get("tool_calls") or delta.get("function_call"):
        return None
    content = delta.get("content")
    return content if isinstance(content, str) else ""


def _event(payload: Document) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


def replay_sse(doc: Document, *, include_usage: bool) -> list[bytes]:
    """The events a streaming client would have received for the answer `doc`, up to the
    `[DONE]` that ends the stream (`OverflowContext.send_events` sends it)."""
    chat = doc.get("object") == "chat.completion"
    choice = doc["choices"][0]
    base = {
        "id": doc.get("id"),
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": doc.get("created"),
        "model": doc.get("model"),
    }
    finish = choice.get("finish_reason")
    if chat:
        message = choice.get("message") or {}
        text = message.get("content") or ""
        parts = [
            {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None},
            {"index": 0, "delta": {"content": text}, "finish_reason": None},
            {"index": 0, "delta": {}, "finish_reason": finish},
        ]
    else:
        parts = [
            {"index": 0, "text": choice.get("text") or "", "finish_reason": None},
            {"index": 0, "text": "", "finish_reason": finish},
        ]
    events = [_event({**base, "choices": [part]}) for part in parts]
    if include_usage and doc.get("usage"):
        events.append(_event({**base, "choices": [], "usage": doc["usage"]}))
    return events
