"""SSE folding: tokens counted however the bytes are cut, usage and errors picked up."""

import pytest

from loadtest.loadgen.client import StreamState
from loadtest.sim.tokens import FillerText
from loadtest.sim.wire import Kind, StreamFrame


def _stream(kind: Kind, tokens: int) -> bytes:
    frame = StreamFrame(kind=kind, model="m", filler=FillerText(), include_usage=True)
    head = frame.role_chunk() if kind is Kind.CHAT else b""
    body = frame.tokens(0, tokens, finish_reason="length")
    return head + body + frame.end(prompt_tokens=12, completion_tokens=tokens)


@pytest.mark.parametrize("kind", [Kind.CHAT, Kind.COMPLETION])
@pytest.mark.parametrize("cut", [1, 7, 64, 100_000])
def test_tokens_and_usage_survive_any_cut(kind: Kind, cut: int) -> None:
    raw = _stream(kind, 9)
    state = StreamState()
    for i in range(0, len(raw), cut):
        state.feed(raw[i : i + cut], now=float(i))
    assert state.events == 9
    assert state.usage == {"prompt_tokens": 12, "total_tokens": 21, "completion_tokens": 9}
    assert state.done and state.error is None
    assert state.first is not None and state.last is not None and state.first <= state.last


def test_role_chunk_alone_is_not_a_token() -> None:
    frame = StreamFrame(kind=Kind.CHAT, model="m", filler=FillerText(), include_usage=False)
    state = StreamState()
    state.feed(frame.role_chunk(), now=1.0)
    assert state.events == 0 and state.first is None


def test_quoted_keys_inside_generated_text_are_not_counted() -> None:
    event = b'data: {"choices":[{"delta":{"content":"say \\"content\\":\\"x\\""}}]}\n\n'
    state = StreamState()
    state.feed(event, now=1.0)
    assert state.events == 1


def test_a_terminal_error_event_is_reported() -> None:
    state = StreamState()
    state.feed(b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n', now=1.0)
    state.feed(b'data: {"error":{"message":"upstream reset","type":"x"}}\n\n', now=2.0)
    assert state.error == "upstream reset"
    assert not state.done


def test_generated_text_that_says_error_is_no_error() -> None:
    state = StreamState()
    state.feed(b'data: {"choices":[{"delta":{"content":"error"}}]}\n\n', now=1.0)
    state.feed(b'data: {"choices":[{"delta":{"content":"\\"error\\""}}]}\n\n', now=2.0)
    state.feed(b"data: [DONE]\n\n", now=3.0)
    assert state.events == 2 and state.error is None and state.done


def test_an_event_that_is_no_json_is_an_error() -> None:
    state = StreamState()
    state.feed(b'data: {"error": not json\n\n', now=1.0)
    assert state.error == "malformed SSE event"
