"""The simulator's bytes have the shapes a real vLLM 0.32 server sent (captured fixture)."""

import json
from typing import Any

from loadtest.sim.tokens import FillerText
from loadtest.sim.wire import DONE, Kind, StreamFrame, full_response
from tests.conftest import VLLM_FIXTURES

FIXTURE = VLLM_FIXTURES / "vllm-0.32-chat.txt"


def shape(value: Any) -> Any:
    """Keys in order, recursively; values reduced to their JSON type."""
    if isinstance(value, dict):
        return [(k, shape(v)) for k, v in value.items()]
    if isinstance(value, list):
        return [shape(v) for v in value]
    return type(value).__name__


def fixture_sections() -> dict[str, list[str]]:
    sections: dict[str, list[str]] = {}
    current = ""
    for line in FIXTURE.read_text().splitlines():
        if line.startswith("## "):
            current = line[3:5].strip(". ")
            sections[current] = []
        elif current:
            sections[current].append(line)
    return sections


def events(raw: bytes) -> list[str]:
    text = raw.decode()
    assert text.endswith("\n\n")
    parts = text[:-2].split("\n\n")
    assert all(p.startswith("data: ") for p in parts)
    return [p[len("data: ") :] for p in parts]


def frame(kind: Kind, *, include_usage: bool) -> StreamFrame:
    return StreamFrame(kind=kind, model="tiny", filler=FillerText(), include_usage=include_usage)


def test_non_streamed_chat_matches_vllm_key_for_key() -> None:
    line = next(x for x in fixture_sections()["1"] if x.startswith("{"))
    ours = full_response(
        kind=Kind.CHAT,
        model="tiny",
        text=" a b",
        finish_reason="length",
        prompt_tokens=10,
        completion_tokens=16,
    )
    assert shape(json.loads(ours)) == shape(json.loads(line))


def test_streamed_chat_with_usage_matches_vllm_event_for_event() -> None:
    theirs = [
        json.loads(x[len("data: ") :]) for x in fixture_sections()["2"] if x.startswith("data: {")
    ]
    f = frame(Kind.CHAT, include_usage=True)
    # vLLM's first token decoded to an empty delta (half a UTF-8 character): 7 events carry text
    raw = f.role_chunk() + f.tokens(0, 6, finish_reason=None)
    raw += f.tokens(6, 7, finish_reason="length") + f.end(prompt_tokens=10, completion_tokens=8)
    ours = events(raw)
    assert ours[-1] == "[DONE]"
    ours_json = [json.loads(x) for x in ours[:-1]]
    their_shapes = [shape(theirs[0]), *[shape(t) for t in theirs[2:]]]
    assert [shape(o) for o in ours_json] == their_shapes
    usage = ours_json[-1]
    assert usage["choices"] == [] and usage["usage"] == {
        "prompt_tokens": 10,
        "total_tokens": 18,
        "completion_tokens": 8,
    }
    assert len({o["id"] for o in ours_json}) == 1 and ours_json[0]["id"].startswith("chatcmpl-")


def test_streamed_chat_without_usage_puts_the_fingerprint_on_the_last_token() -> None:
    theirs = [json.loads(x[6:]) for x in fixture_sections()["3"] if x.startswith("data: {")]
    f = frame(Kind.CHAT, include_usage=False)
    raw = f.role_chunk() + f.tokens(0, 3, finish_reason=None)
    raw += f.tokens(3, 4, finish_reason="length") + f.end(prompt_tokens=10, completion_tokens=4)
    ours = events(raw)
    assert ours[-1] == "[DONE]" and raw.endswith(DONE)
    assert [shape(json.loads(o)) for o in ours[:-1]] == [shape(t) for t in theirs]


def test_several_tokens_in_one_write_are_one_event_each() -> None:
    f = frame(Kind.CHAT, include_usage=False)
    chunks = [json.loads(e) for e in events(f.tokens(0, 5, finish_reason=None))]
    words = [c["choices"][0]["delta"]["content"] for c in chunks]
    assert words == [w.decode() for w in FillerText().word_bytes(0, 5)]
    assert "".join(words) == FillerText().text(0, 5)
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks)


def test_completion_stream_and_body_use_text_completion_shapes() -> None:
    f = frame(Kind.COMPLETION, include_usage=True)
    raw = f.tokens(0, 2, finish_reason="stop") + f.end(prompt_tokens=3, completion_tokens=2)
    chunks = [json.loads(e) for e in events(raw)[:-1]]
    assert all(c["object"] == "text_completion" and c["id"].startswith("cmpl-") for c in chunks)
    assert chunks[1]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["usage"]["total_tokens"] == 5
    body = json.loads(
        full_response(
            kind=Kind.COMPLETION,
            model="m",
            text=" x",
            finish_reason="length",
            prompt_tokens=3,
            completion_tokens=1,
        )
    )
    assert body["object"] == "text_completion" and body["choices"][0]["text"] == " x"
    assert body["usage"]["completion_tokens"] == 1


def test_model_names_are_json_escaped() -> None:
    f = StreamFrame(kind=Kind.CHAT, model='we"ird/m', filler=FillerText(), include_usage=False)
    assert json.loads(events(f.role_chunk())[0])["model"] == 'we"ird/m'
