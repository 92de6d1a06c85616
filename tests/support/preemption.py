"""What the preemption tests share: streams read as their clients read them, sent one after
another, and what makes one whole."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson

from tests.support.overflow import chat

STREAM_TOKENS = 200  # a sheddable stream's answer: long beside a critical one's
SLOTS = 2  # sheddable streams the pool holds at once
HELD = 208  # what one holds: its answer and the gateway's estimate of its prompt, in blocks
CAPACITY = SLOTS * HELD + 8  # full: less than a block left


@dataclass
class Stream:
    """One streamed answer as its client read it."""

    status: int = 0
    headers: dict[str, str] = field(default_factory=dict)
    ids: set[str] = field(default_factory=set)
    text: str = ""
    comments: list[str] = field(default_factory=list)
    usage: dict[str, Any] | None = None
    error: dict[str, Any] | None = None
    done: bool = False
    first_event: asyncio.Event = field(default_factory=asyncio.Event)


async def stream(client: httpx.AsyncClient, out: Stream, *, max_tokens: int) -> Stream:
    body = chat("go on", max_tokens=max_tokens, stream=True)
    body["stream_options"] = {"include_usage": True}
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        out.status, out.headers = response.status_code, dict(response.headers)
        async for line in response.aiter_lines():
            if line.startswith(":"):
                out.comments.append(line)
            elif line == "data: [DONE]":
                out.done = True
            elif line.startswith("data: "):
                event = orjson.loads(line[6:])
                out.first_event.set()
                if "error" in event:
                    out.error = event["error"]
                    continue
                out.ids.add(event["id"])
                if event.get("usage"):
                    out.usage = event["usage"]
                for choice in event.get("choices", ()):
                    out.text += choice["delta"].get("content") or ""
    out.first_event.set()
    return out


async def one_by_one(
    client: httpx.AsyncClient, count: int, *, max_tokens: int
) -> tuple[list[Stream], list[asyncio.Task[Stream]]]:
    """`count` streams, each sent once the one before it streams (the first is the oldest)."""
    streams = [Stream() for _ in range(count)]
    tasks = []
    for s in streams:
        tasks.append(asyncio.create_task(stream(client, s, max_tokens=max_tokens)))
        await s.first_event.wait()
    return streams, tasks


def whole(s: Stream) -> bool:
    """One stream from one id to [DONE], its answer's every token counted once."""
    return (
        s.status == 200
        and s.done
        and s.error is None
        and len(s.ids) == 1
        and s.usage is not None
        and s.usage["completion_tokens"] == STREAM_TOKENS
    )
