"""Answers recorded from what the client got, and replayed as the events a stream expects."""

from __future__ import annotations

import orjson

from gateway.overflow import Usage
from gateway.request import Endpoint
from policies.cache.recorder import CompletionRecorder, replay_sse

ID = '"id":"chatcmpl-1","object":"chat.completion.chunk","created":7,"model":"big"'


def chunk(delta: str, finish: str | None = None) -> bytes:
    reason = "null" if finish is None else f'"{finish}"'
    choice = f'{{"index":0,"delta":{delta},"finish_reason":{reason}}}'
    return f'data: {{{ID},"choices":[{choice}]}}\n\n'.encode()


STREAM = [
    chunk('{"role":"assistant","content":""}'),
    chunk('{"content":"Hel"}') + chunk('{"content":"lo"}'),
    chunk('{"content":"!"}', "stop"),
    b'data: {"id":"chatcmpl-1","choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2}}\n\n',
    b"data: [DONE]\n\n",
]


def record(
    parts: list[bytes], *, stream: bool, max_bytes: int = 10_000, usage: Usage | None = None
) -> list[bytes]:
    got: list[bytes] = []
    recorder = CompletionRecorder(
        endpoint=Endpoint.CHAT, stream=stream, max_bytes=max_bytes, on_answer=got.append
    )
    for part in parts:
        recorder.feed(part)
    recorder.finish(usage or Usage(prompt_tokens=3, completion_tokens=2, known=True))
    return got


def test_a_stream_is_assembled_into_one_chat_completion() -> None:
    [body] = record(STREAM, stream=True)
    doc = orjson.loads(body)
    assert (
        doc["object"] == "chat.completion" and doc["model"] == "big" and doc["id"] == "chatcmpl-1"
    )
    assert doc["choices"][0]["message"] == {"role": "assistant", "content": "Hello!"}
    assert doc["choices"][0]["finish_reason"] == "stop"
    assert doc["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}


def test_replay_carries_the_same_text_and_usage_only_when_asked() -> None:
    [body] = record(STREAM, stream=True)
    events = replay_sse(orjson.loads(body), include_usage=True)
    again = record(events, stream=True)
    assert orjson.loads(again[0])["choices"] == orjson.loads(body)["choices"]
    payloads = [orjson.loads(e[6:]) for e in events]  # the context sends the [DONE]
    assert payloads[-1]["usage"]["total_tokens"] == 5
    assert all(p["object"] == "chat.completion.chunk" for p in payloads)
    plain = replay_sse(orjson.loads(body), include_usage=False)
    assert not any(b'"usage"' in e for e in plain)


def test_unfaithful_or_oversized_answers_are_not_recorded() -> None:
    tool = chunk('{"tool_calls":[{"index":0,"function":{"name":"f"}}]}')
    error = b'data: {"error":{"message":"boom"}}\n\n'
    assert record([STREAM[0], tool, STREAM[-1]], stream=True) == []
    assert record([STREAM[0], error], stream=True) == []
    assert record(STREAM, stream=True, max_bytes=50) == []
    assert record([b'{"choices":[{"index":0},{"index":1}]}'], stream=False) == []
    assert record([b"not json"], stream=False) == []
    whole = b'{"object":"chat.completion","choices":[{"index":0,"message":{"content":"x"}}]}'
    assert record([whole], stream=False) == [orjson.dumps(orjson.loads(whole))]
