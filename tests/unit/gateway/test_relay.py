import asyncio

import orjson
from starlette.types import Message

from gateway.relay import StreamRelay, model_swap

CHUNK = b'data: {"id":"c","model":"served","choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n'
USAGE = (
    b'data: {"id":"c","model":"served","choices":[],'
    b'"usage":{"prompt_tokens":10,"total_tokens":18,"completion_tokens":8}}\n\n'
)
DONE = b"data: [DONE]\n\n"


def _run(chunks: list[bytes], *, keep_usage: bool) -> tuple[bytes, StreamRelay]:
    sent: list[bytes] = []

    async def send(message: Message) -> None:
        sent.append(message["body"])

    relay = StreamRelay(
        send=send, swap=model_swap("served", "pool"), keep_usage=keep_usage, tap=None
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
    assert relay.usage.prompt_tokens == 10 and relay.usage.completion_tokens == 8


def test_drops_the_usage_chunk_the_client_did_not_ask_for() -> None:
    out, relay = _run([CHUNK, USAGE, DONE], keep_usage=False)
    assert b'"usage"' not in out
    assert out.endswith(DONE)
    assert relay.usage.known and relay.usage.total == 18
    events = [e for e in out.split(b"\n\n") if e.startswith(b"data: {")]
    assert all(orjson.loads(e[6:])["model"] == "pool" for e in events)
