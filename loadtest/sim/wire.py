"""vLLM 0.32's OpenAI-compatible response bytes, built from precomputed templates.

Streams are framed per request once (`StreamFrame`); each token then costs one slice of a
precomputed word list and one `bytes.join`, so hundreds of streams stay cheap.
The shapes follow the captured server in tests/fixtures/vllm-0.32-chat.txt.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from enum import StrEnum

import orjson

from loadtest.sim.tokens import FillerText

SYSTEM_FINGERPRINT = "vllm-0.32.0-sim"
DONE = b"data: [DONE]\n\n"


class Kind(StrEnum):
    CHAT = "chat"
    COMPLETION = "completion"


@dataclass(frozen=True, kw_only=True)
class _KindShape:
    id_prefix: str
    object_full: str
    object_chunk: str
    content_open: bytes  # opens the token's text inside a stream choice
    content_close: bytes


_SHAPES = {
    Kind.CHAT: _KindShape(
        id_prefix="chatcmpl-",
        object_full="chat.completion",
        object_chunk="chat.completion.chunk",
        content_open=b'"delta":{"content":"',
        content_close=b'"}',
    ),
    Kind.COMPLETION: _KindShape(
        id_prefix="cmpl-",
        object_full="text_completion",
        object_chunk="text_completion",
        content_open=b'"text":"',
        content_close=b'"',
    ),
}


def new_id(kind: Kind) -> str:
    return _SHAPES[kind].id_prefix + os.urandom(8).hex()


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
    }


class StreamFrame:
    """The SSE bytes of one streamed response; words come from the shared filler."""

    __slots__ = (
        "_filler",
        "_final",
        "_fingerprint",
        "_head",
        "_include_usage",
        "_index",
        "_join",
        "_open",
        "_tail",
        "_usage_head",
    )

    def __init__(
        self,
        *,
        kind: Kind,
        model: str,
        filler: FillerText,
        include_usage: bool,
        fingerprint: str = SYSTEM_FINGERPRINT,
        index: int = 0,
        response_id: str | None = None,
    ) -> None:
        """`index`: the choice this frame writes, of a request's `n`; the choices of one
        response share its `response_id`."""
        shape = _SHAPES[kind]
        head = (
            b'data: {"id":"'
            + (response_id or new_id(kind)).encode()
            + b'","object":"'
            + shape.object_chunk.encode()
            + b'","created":'
            + str(int(time.time())).encode()
            + b',"model":'
            + orjson.dumps(model)
        )
        self._head = head
        self._index = b'"index":' + str(index).encode()
        self._open = head + b',"choices":[{' + self._index + b"," + shape.content_open
        self._tail = (
            shape.content_close + b',"logprobs":null,"finish_reason":null,"token_ids":null}]}\n\n'
        )
        self._join = self._tail + self._open
        self._final = shape.content_close + b',"logprobs":null,"finish_reason":"'
        self._include_usage = include_usage
        self._fingerprint = b',"system_fingerprint":' + orjson.dumps(fingerprint)
        self._filler = filler
        self._usage_head = head + b',"choices":[],"usage":'

    def role_chunk(self) -> bytes:
        """The first chat chunk: the assistant role and empty content."""
        return (
            self._head
            + b',"choices":[{'
            + self._index
            + b',"delta":{"role":"assistant","content":""},'
            + b'"logprobs":null,"finish_reason":null}],'
            + b'"prompt_token_ids":null,"prompt_text":null}\n\n'
        )

    def tokens(
        self, start: int, stop: int, *, finish_reason: str | None, stop_reason: int | None = None
    ) -> bytes:
        """Events for tokens [start, stop); the last one carries `finish_reason` if given,
        and `stop_reason`: the stop token id that ended the answer, as vLLM reports it."""
        words = self._filler.word_bytes(start, stop)
        if finish_reason is None:
            return self._open + self._join.join(words) + self._tail
        body = self._open + self._join.join(words)
        fingerprint = b"" if self._include_usage else self._fingerprint
        return (
            body
            + self._final
            + finish_reason.encode()
            + b'","stop_reason":'
            + (b"null" if stop_reason is None else str(stop_reason).encode())
            + b',"token_ids":null}]'
            + fingerprint
            + b"}\n\n"
        )

    def end(self, *, prompt_tokens: int, completion_tokens: int) -> bytes:
        """The usage chunk when asked for, then `[DONE]`."""
        if not self._include_usage:
            return DONE
        return (
            self._usage_head
            + orjson.dumps(usage(prompt_tokens, completion_tokens))
            + self._fingerprint
            + b"}\n\n"
            + DONE
        )


Choice = tuple[str, str, int | None]  # text, finish_reason, stop_reason


def _chat_choice(text: str, finish_reason: str, index: int, stop: int | None) -> dict[str, object]:
    message = {
        "role": "assistant",
        "content": text,
        "refusal": None,
        "annotations": None,
        "audio": None,
        "function_call": None,
        "reasoning": None,
    }
    return {
        "index": index,
        "message": message,
        "logprobs": None,
        "finish_reason": finish_reason,
        "stop_reason": stop,
        "token_ids": None,
        "routed_experts": None,
    }


def _completion_choice(
    text: str, finish_reason: str, index: int, stop: int | None
) -> dict[str, object]:
    return {
        "index": index,
        "text": text,
        "logprobs": None,
        "finish_reason": finish_reason,
        "stop_reason": stop,
        "token_ids": None,
        "prompt_logprobs": None,
        "prompt_token_ids": None,
    }


def full_response(
    *,
    kind: Kind,
    model: str,
    text: str,
    finish_reason: str,
    prompt_tokens: int,
    completion_tokens: int,
    fingerprint: str = SYSTEM_FINGERPRINT,
    choices: int = 1,
) -> bytes:
    """A non-streamed response body: `choices` choices of `text` (`completion_tokens`
    counts them all)."""
    return full_response_of(
        kind=kind,
        model=model,
        answers=[(text, finish_reason, None)] * choices,
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        fingerprint=fingerprint,
    )


def full_response_of(
    *,
    kind: Kind,
    model: str,
    answers: list[Choice],
    prompt_tokens: int,
    completion_tokens: int,
    fingerprint: str = SYSTEM_FINGERPRINT,
    kv_transfer_params: dict[str, object] | None = None,
) -> bytes:
    """A non-streamed response body with one choice per answer; `kv_transfer_params` is
    what a prefill leg hands its decode leg (loadtest/sim/kv_transfer.py)."""
    shape = _SHAPES[kind]
    make = _chat_choice if kind is Kind.CHAT else _completion_choice
    body: dict[str, object] = {
        "id": new_id(kind),
        "object": shape.object_full,
        "created": int(time.time()),
        "model": model,
        "choices": [make(text, reason, i, stop) for i, (text, reason, stop) in enumerate(answers)],
        "service_tier": None,
        "system_fingerprint": fingerprint,
        "usage": {
            **usage(prompt_tokens, completion_tokens),
            "prompt_tokens_details": None,
            "completion_tokens_details": None,
        },
    }
    if kind is Kind.CHAT:
        body |= {"prompt_logprobs": None, "prompt_token_ids": None, "prompt_text": None}
    body |= {"kv_transfer_params": kv_transfer_params}
    if kind is Kind.CHAT:
        body |= {"ec_transfer_params": None, "metrics": None}
    return orjson.dumps(body)


def error_body(*, message: str, error_type: str, param: str | None, code: int) -> bytes:
    """vLLM's error shape: the HTTP status as `code`, the exception name as `type`."""
    return orjson.dumps(
        {"error": {"message": message, "type": error_type, "param": param, "code": code}}
    )
