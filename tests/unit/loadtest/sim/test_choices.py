"""`n` choices in the simulator's bytes: one index each, one id, usage counting them all."""

import orjson

from loadtest.sim.tokens import FillerText
from loadtest.sim.wire import Kind, StreamFrame, full_response


def events(raw: bytes) -> list[dict[str, object]]:
    return [orjson.loads(line[6:]) for line in raw.split(b"\n\n") if line.startswith(b"data: {")]


def test_each_choice_streams_under_its_index_with_one_id() -> None:
    filler = FillerText()
    frames = [
        StreamFrame(
            kind=Kind.CHAT,
            model="m",
            filler=filler,
            include_usage=True,
            index=i,
            response_id="chatcmpl-x",
        )
        for i in range(2)
    ]
    raw = b"".join(f.role_chunk() + f.tokens(0, 2, finish_reason="length") for f in frames)
    raw += frames[0].end(prompt_tokens=5, completion_tokens=4)
    got = events(raw)
    assert {e["id"] for e in got} == {"chatcmpl-x"}
    indexes = [c["index"] for e in got for c in e["choices"]]  # type: ignore[attr-defined]
    assert indexes == [0, 0, 0, 1, 1, 1]
    assert got[-1]["usage"] == {"prompt_tokens": 5, "total_tokens": 9, "completion_tokens": 4}


def test_a_full_response_has_n_choices() -> None:
    body = orjson.loads(
        full_response(
            kind=Kind.COMPLETION,
            model="m",
            text="a b",
            finish_reason="length",
            prompt_tokens=5,
            completion_tokens=6,
            choices=3,
        )
    )
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert body["usage"]["completion_tokens"] == 6
