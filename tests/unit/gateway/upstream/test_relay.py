import asyncio
import json

import orjson
import pytest
from starlette.types import Message

from gateway.clock import ManualClock
from gateway.request import Endpoint
from gateway.upstream.answer import Usage, model_swap
from gateway.upstream.relay import (
    HIDDEN_ERROR,
    EventTooLarge,
    Relayed,
    StreamRelay,
    relay_stream,
    send_json_body,
)
from gateway.upstream.resume import ContinuationLeg, read_partial
from tests.vllm_capture import sse

CHUNK = b'data: {"id":"c","model":"served","choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n'
USAGE = (
    b'data: {"id":"c","model":"served","choices":[],'
    b'"usage":{"prompt_tokens":10,"total_tokens":18,"completion_tokens":8}}\n\n'
)
DONE = b"data: [DONE]\n\n"


def _run(
    chunks: list[bytes], *, keep_usage: bool, served: str = "served"
) -> tuple[bytes, StreamRelay]:
    sent: list[bytes] = []

    async def send(message: Message) -> None:
        sent.append(message["body"])

    relay = StreamRelay(
        send=send, swap=model_swap(served, "pool"), keep_usage=keep_usage, recorder=None
    )

    async def go() -> None:
        for c in chunks:
            await relay.feed(c)
        await relay.flush()

    asyncio.run(go())
    return b"".join(sent), relay


def test_relays_events_cut_anywhere_and_swaps_the_model_name() -> None:
    whole = CHUNK + CHUNK + USAGE + DONE
    pieces = [whole[i : i + 7] for i in range(0, len(whole), 7)]
    out, relay = _run(pieces, keep_usage=True)
    assert out == whole.replace(b'"model":"served"', b'"model":"pool"')
    assert relay.checked()[0].prompt_tokens == 10 and relay.checked()[0].completion_tokens == 8


def test_drops_the_usage_chunk_the_client_did_not_ask_for() -> None:
    out, relay = _run([CHUNK, USAGE, DONE], keep_usage=False)
    assert b'"usage"' not in out
    assert out.endswith(DONE)
    assert relay.checked()[0].known and relay.checked()[0].total == 18
    events = [e for e in out.split(b"\n\n") if e.startswith(b"data: {")]
    assert all(orjson.loads(e[6:])["model"] == "pool" for e in events)


def _cuts(whole: bytes, size: int) -> list[bytes]:
    return [whole[i : i + size] for i in range(0, len(whole), size)]


def _events(out: bytes) -> list[dict[str, object]]:
    return [orjson.loads(e[6:]) for e in out.split(b"\n\n") if e.startswith(b"data: {")]


SWAP = model_swap("meta/served", 'pub"lic\\x')


@pytest.mark.parametrize(
    "field",
    [
        b'"model":"meta/served"',
        b'"model": "meta/served"',  # Python's json.dumps
        b'"model" :\t"meta/served"',
        b'"model":\n  "meta/served"',  # json.dumps(indent=2)
        b'"model":"meta\\/served"',  # an escaped solidus
    ],
)
def test_swaps_the_model_field_whatever_its_spacing(field: bytes) -> None:
    assert SWAP is not None
    body = b'{"id":"x",' + field + b',"n":1}'
    assert json.loads(SWAP(body)) == {"id": "x", "model": 'pub"lic\\x', "n": 1}


def test_swaps_only_the_served_name_and_only_a_model_field() -> None:
    assert SWAP is not None
    untouched = [
        b'{"model": "meta/served-2"}',
        b'{"model": "x/meta/served"}',
        b'{"content": "the \\"model\\": \\"meta/served\\" field"}',
        b'{"root": "meta/served"}',
    ]
    assert [SWAP(body) for body in untouched] == untouched
    ascii_only = model_swap("caf\u00e9", "pool")  # json.dumps escapes what orjson writes as is
    assert ascii_only is not None
    assert ascii_only(json.dumps({"model": "caf\u00e9"}).encode()) == b'{"model":"pool"}'
    assert ascii_only(orjson.dumps({"model": "caf\u00e9"})) == b'{"model":"pool"}'
    assert model_swap("same", "same") is None


def test_a_json_body_written_by_pythons_json_is_swapped() -> None:
    sent: list[Message] = []

    async def send(message: Message) -> None:
        sent.append(message)

    body = json.dumps({"model": "served", "choices": [], "usage": {"prompt_tokens": 3}}).encode()
    relayed = asyncio.run(
        send_json_body(
            body,
            send=send,
            status=200,
            headers=[],
            swap=model_swap("served", "pool"),
            recorder=None,
            clock=ManualClock(start=5.0),
        )
    )
    assert json.loads(sent[1]["body"])["model"] == "pool"
    assert b"served" not in sent[1]["body"]
    assert relayed.usage.prompt_tokens == 3
    assert relayed.first_byte_at == 5.0  # read off the Clock it was given


def test_a_spaced_stream_is_swapped_in_every_event() -> None:
    spaced = b"".join(
        b"data: " + json.dumps({"model": "served", "choices": [{"index": 0}]}).encode() + b"\n\n"
        for _ in range(3)
    )
    out, _ = _run(_cuts(spaced + DONE, 5), keep_usage=False)
    assert b"served" not in out
    assert [e["model"] for e in _events(out)] == ["pool", "pool", "pool"]


# vLLM 0.32, asked for usage, puts `system_fingerprint` on the usage chunk alone; not asked,
# on the chunk that finishes the answer (captured in tests/fixtures/vllm-0.32-chat.txt)
WITH_USAGE, WITHOUT_USAGE = sse("2"), sse("3")


@pytest.mark.parametrize("size", [7, 64, len(WITH_USAGE)])
def test_a_client_without_usage_gets_the_fingerprint_on_the_finishing_chunk(size: int) -> None:
    out, relay = _run(_cuts(WITH_USAGE, size), keep_usage=False, served="tiny")
    ours, upstream = _events(out), _events(WITH_USAGE)
    assert ours == [{**e, "model": "pool"} for e in upstream[:-2]] + [
        {**upstream[-2], "model": "pool", "system_fingerprint": "vllm-0.32.0-3c666876"}
    ]
    direct = _events(WITHOUT_USAGE)  # what the client gets asking vLLM itself
    assert [list(e) for e in ours[-1:]] == [list(e) for e in direct[-1:]]
    assert [list(e) for e in ours[:-1]] == [list(direct[0])] + [list(direct[1])] * (len(ours) - 2)
    assert out.endswith(b"data: [DONE]\n\n")
    assert relay.checked()[0].prompt_tokens == 10 and relay.checked()[0].completion_tokens == 8


def test_a_client_that_asked_for_usage_gets_the_stream_as_sent() -> None:
    out, _ = _run(_cuts(WITH_USAGE, 11), keep_usage=True, served="tiny")
    assert out == WITH_USAGE.replace(b'"model":"tiny"', b'"model":"pool"')


def test_a_finishing_chunk_is_held_only_until_the_next_event() -> None:
    finish = b'data: {"model":"served","choices":[{"index":0,"finish_reason":"stop"}]}\n\n'
    other = b'data: {"model":"served","choices":[{"index":1,"finish_reason":null}]}\n\n'
    sent: list[bytes] = []

    async def send(message: Message) -> None:
        sent.append(message["body"])

    async def go() -> None:
        relay = StreamRelay(send=send, swap=None, keep_usage=False, recorder=None)
        await relay.feed(finish)
        assert sent == []  # held: the usage chunk may follow
        await relay.feed(other)
        assert sent == [finish + other]  # another choice's event came first: sent as it was
        await relay.feed(finish)
        await relay.flush()  # the stream ended without a usage chunk
        assert sent == [finish + other, finish]

    asyncio.run(go())


PROVIDER_ERROR = b'data: {"error":{"message":"gpt-secret broke","type":"server_error"}}\n\n'


@pytest.mark.parametrize("hide", [False, True])
def test_an_error_event_is_replaced_only_where_the_upstreams_errors_are_hidden(
    hide: bool,
) -> None:
    sent: list[bytes] = []

    async def send(message: Message) -> None:
        sent.append(message["body"])

    relay = StreamRelay(send=send, swap=None, keep_usage=True, recorder=None, hide_errors=hide)

    async def go() -> None:
        for chunk in _cuts(CHUNK + PROVIDER_ERROR + DONE, 9):
            await relay.feed(chunk)
        await relay.flush()

    asyncio.run(go())
    if hide:
        assert b"".join(sent) == CHUNK + HIDDEN_ERROR + b"\n\n" + DONE
        assert relay.upstream_error == PROVIDER_ERROR.strip()
    else:
        assert b"".join(sent) == CHUNK + PROVIDER_ERROR + DONE
        assert relay.upstream_error == b""


class _Chunks:
    """An upstream's chunks, then the connection failing (as the client's relay sees it)."""

    def __init__(self, chunks: list[bytes], *, fails: bool) -> None:
        self._chunks = list(chunks)
        self._fails = fails

    def __aiter__(self) -> "_Chunks":
        return self

    async def __anext__(self) -> bytes:
        if self._chunks:
            return self._chunks.pop(0)
        if self._fails:
            raise ConnectionResetError
        raise StopAsyncIteration


def test_a_resumable_stream_cut_mid_event_stays_open_and_goes_on_as_one_stream() -> None:
    """The cut leg's unfinished event never reaches the client; the continuation's role
    event is dropped, its id is the first leg's, and its usage counts the text the
    client got before the cut as output, once."""
    sent: list[Message] = []

    async def send(message: Message) -> None:
        sent.append(message)

    async def go() -> tuple[Relayed, Relayed, StreamRelay]:
        relay = StreamRelay(send=send, swap=None, keep_usage=True, recorder=None, resumable=True)
        await relay.start(status=200, headers=[])
        first = await relay_stream(
            _Chunks([CHUNK, CHUNK[:20]], fails=True),
            relay=relay, first_chunk=CHUNK, idle_s=5, deadline=2000, clock=ManualClock(),
        )  # fmt: skip
        assert first.cut is not None and not first.completed
        partial = read_partial(relay.kept or [], Endpoint.CHAT)
        assert (partial.text, partial.tokens) == ("hihi", 2)
        relay.next_leg(ContinuationLeg(partial), carried=partial.tokens, growth=None)
        role = b'data: {"id":"d","choices":[{"index":0,"delta":{"role":"assistant"}}]}\n\n'
        usage = USAGE.replace(b'"c"', b'"d"')  # the continuation's prompt held the 2 tokens
        second = await relay_stream(
            _Chunks([CHUNK.replace(b'"c"', b'"d"'), usage, DONE], fails=False),
            relay=relay, first_chunk=role, idle_s=5, deadline=2000, clock=ManualClock(),
        )  # fmt: skip
        return first, second, relay

    first, second, relay = asyncio.run(go())
    assert second.completed and second.cut is None
    assert second.first_byte_at == first.first_byte_at
    body = b"".join(m.get("body", b"") for m in sent)
    assert (
        body
        == CHUNK * 3
        + USAGE.replace(
            b'"prompt_tokens":10,"total_tokens":18,"completion_tokens":8',
            b'"prompt_tokens":8,"total_tokens":18,"completion_tokens":10',
        )
        + DONE
    )
    assert (relay.checked()[0].prompt_tokens, relay.checked()[0].completion_tokens) == (8, 10)
    assert [m["type"] for m in sent].count("http.response.start") == 1
    assert sent[-1]["more_body"] is False


def test_a_stream_that_is_not_resumable_ends_with_the_error_event_at_the_cut() -> None:
    sent: list[Message] = []

    async def send(message: Message) -> None:
        sent.append(message)

    async def go() -> Relayed:
        relay = StreamRelay(send=send, swap=None, keep_usage=True, recorder=None)
        return await relay_stream(
            _Chunks([], fails=True),
            relay=relay, first_chunk=CHUNK, idle_s=5, deadline=2000, clock=ManualClock(),
        )  # fmt: skip

    relayed = asyncio.run(go())
    assert relayed.cut is None and not relayed.completed
    assert b"mid-stream" in sent[-1]["body"] and sent[-1]["more_body"] is False


def test_an_upstream_error_event_of_its_own_failing_cuts_a_resumable_stream() -> None:
    """vLLM tells a request its engine aborted in an error event, code 500: for a stream
    that can go on elsewhere that is a cut, not the answer; a 400 is the request's own."""
    failing = b'data: {"error":{"message":"engine died","type":"x","param":null,"code":500}}\n\n'
    refused = failing.replace(b"500", b"400")

    async def go(event: bytes) -> tuple[Relayed, bytes]:
        sent: list[bytes] = []

        async def send(message: Message) -> None:
            sent.append(message.get("body", b""))

        relay = StreamRelay(send=send, swap=None, keep_usage=True, recorder=None, resumable=True)
        relayed = await relay_stream(
            _Chunks([CHUNK + event + DONE], fails=False),
            relay=relay, first_chunk=CHUNK, idle_s=5, deadline=2000, clock=ManualClock(),
        )  # fmt: skip
        return relayed, b"".join(sent)

    cut, out = asyncio.run(go(failing))
    assert cut.cut is not None and out == CHUNK * 2
    whole, out = asyncio.run(go(refused))
    assert whole.cut is None and out == CHUNK * 2 + refused + DONE


def test_a_choice_the_engine_aborted_cuts_a_resumable_stream() -> None:
    """vLLM's answer to SIGTERM (no --shutdown-timeout): every running request finishes
    with `"finish_reason":"abort"`; that is no end of the answer for the client."""
    aborted = CHUNK.replace(b'"delta":{"content":"hi"}', b'"delta":{},"finish_reason":"abort"')

    async def go() -> Relayed:
        relay = StreamRelay(send=_ignore, swap=None, keep_usage=True, recorder=None, resumable=True)
        return await relay_stream(
            _Chunks([aborted, USAGE, DONE], fails=False),
            relay=relay, first_chunk=CHUNK, idle_s=5, deadline=2000, clock=ManualClock(),
        )  # fmt: skip

    assert asyncio.run(go()).cut is not None


async def _ignore(message: Message) -> None:
    pass


def test_a_continuation_tells_the_prompt_the_backend_counted_for_the_original() -> None:
    """vLLM re-tokenizes the text so far into more tokens than were streamed (or fewer):
    the client's prompt is the original's as the backend counts it, when it did in time."""
    sent: list[bytes] = []

    async def send(message: Message) -> None:
        sent.append(message.get("body", b""))

    async def go(counted: int | Exception | None) -> Usage:
        relay = StreamRelay(send=send, swap=None, keep_usage=True, recorder=None, resumable=True)
        count: asyncio.Future[int | None] = asyncio.get_running_loop().create_future()
        if isinstance(counted, Exception):
            count.set_exception(counted)
        else:
            count.set_result(counted)
        leg = ContinuationLeg(read_partial([CHUNK], Endpoint.CHAT))
        relay.next_leg(leg, carried=3, growth=None, prompt=count)
        await relay_stream(
            _Chunks([USAGE, DONE], fails=False),
            relay=relay, first_chunk=CHUNK, idle_s=5, deadline=2000, clock=ManualClock(),
        )  # fmt: skip
        return relay.checked()[0]

    exact = asyncio.run(go(6))  # the continuation's 10 prompt tokens held 4 of the text
    assert (exact.prompt_tokens, exact.completion_tokens) == (6, 11)
    assert b'"prompt_tokens":6,"total_tokens":17,"completion_tokens":11' in b"".join(sent)
    guessed = asyncio.run(go(None))  # no count: the continuation's less what was streamed
    assert (guessed.prompt_tokens, guessed.completion_tokens) == (7, 11)
    failed = asyncio.run(go(RuntimeError("no count")))  # a failed count breaks nothing
    assert (failed.prompt_tokens, failed.completion_tokens) == (7, 11)


@pytest.mark.parametrize("ending", [b"\r\n", b"\r"], ids=["crlf", "cr"])
@pytest.mark.parametrize("step", [1, 2, 5, 64])
def test_every_line_ending_is_read_however_the_chunks_cut_it(ending: bytes, step: int) -> None:
    """CRLF and CR streams go out as LF, each event whole, wherever a chunk ends (a CR at
    one chunk's end and its LF at the next's start are one line ending, not two)."""
    whole = (CHUNK + CHUNK + USAGE + DONE).replace(b"\n", ending)
    pieces = [whole[i : i + step] for i in range(0, len(whole), step)]
    out, relay = _run(pieces, keep_usage=True, served="pool")
    assert out == CHUNK + CHUNK + USAGE + DONE
    assert relay.checked()[0].total == 18


def test_a_data_line_without_its_space_or_after_an_id_line_is_read() -> None:
    usage = USAGE.replace(b"data: ", b"id: 4\nevent: message\ndata:")
    out, relay = _run([CHUNK, usage, DONE], keep_usage=False, served="pool")
    assert relay.checked()[0].total == 18
    assert b'"usage"' not in out


def test_an_event_past_the_bound_fails_the_upstream() -> None:
    async def go() -> None:
        relay = StreamRelay(
            send=_ignore, swap=None, keep_usage=True, recorder=None, max_event_bytes=1000
        )
        await relay.feed(CHUNK)
        for _ in range(20):
            await relay.feed(b"data: " + b"x" * 100)

    with pytest.raises(EventTooLarge, match="longer than 1000 bytes"):
        asyncio.run(go())


def test_a_comment_is_relayed_but_is_no_progress() -> None:
    async def go() -> list[bool]:
        relay = StreamRelay(send=_ignore, swap=None, keep_usage=True, recorder=None)
        return [await relay.feed(c) for c in (b": ping\n\n", CHUNK, b"data: {", b"}\n\n")]

    assert asyncio.run(go()) == [False, True, False, True]
