"""How the prefix benches tell a failed stream from a model that writes the word "error"."""

from __future__ import annotations

import json

from loadtest.bench.prefix import stream_error


def chunk(content: str) -> str:
    delta = {"choices": [{"index": 0, "delta": {"content": content}, "finish_reason": None}]}
    return "data: " + json.dumps({"object": "chat.completion.chunk", **delta})


def test_a_chunk_whose_text_is_error_is_no_error() -> None:
    assert not stream_error(chunk("error"))
    assert not stream_error(chunk('"error"'))


def test_an_error_event_is_one() -> None:
    event = {"error": {"message": "backend failed", "type": "server_error", "code": None}}
    assert stream_error("data: " + json.dumps(event))


def test_the_end_and_blank_lines_are_none_and_garbage_is_one() -> None:
    assert not stream_error("data: [DONE]")
    assert not stream_error("")
    assert stream_error("data: {not json")
