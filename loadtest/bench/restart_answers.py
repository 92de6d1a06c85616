"""What the clients of `spillgate bench restart` send, and how each answer they got is
judged: the status, a stream's error event or cut, the text, the length, the usage.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import httpx
import orjson

from loadtest.bench import admission_fleet as fleet
from loadtest.percentile import percentile
from loadtest.sim.tokens import chat_prompt_tokens, completion_prompt_tokens, filler_words


class Fault(StrEnum):
    """What went wrong with one request, as its client saw it."""

    NON_200 = "non_200"  # an error status (counted by status too)
    NO_ANSWER = "no_answer"  # no status at all: the connection failed or broke first
    ERROR_EVENT = "error_event"  # a stream that carried an error event
    CUT = "cut"  # a stream without a finish_reason or without [DONE]
    DISCONTINUOUS = "discontinuous"  # text that is not the filler's first n words
    WRONG_LENGTH = "wrong_length"  # not the max_tokens words every answer runs to
    DISHONEST_USAGE = "dishonest_usage"  # usage missing, or not what was received and sent


@dataclass(frozen=True, kw_only=True)
class Ask:
    """One request, and what a correct answer to it holds."""

    kind: str  # chat-stream, chat, completion-stream, completion
    body: dict[str, Any]
    prompt_tokens: int | None  # None: not known in advance (a real vLLM's tokenizer)

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.kind.startswith("chat") else "/v1/completions"

    @property
    def stream(self) -> bool:
        return self.kind.endswith("stream")


class WordCount:
    """Words streamed so far by several requests, to wait on."""

    def __init__(self) -> None:
        self.words = 0
        self._grew = asyncio.Event()

    def add(self, words: int) -> None:
        self.words += words
        self._grew.set()

    async def reached(self, words: int) -> None:
        while self.words < words:
            self._grew.clear()
            await self._grew.wait()


@dataclass(kw_only=True)
class Seen:
    """What the client of one request saw."""

    status: int | None = None
    text: str = ""
    events: int = 0  # stream events that carried text
    finish_reason: str | None = None
    done: bool = False
    error_event: bool = False
    usage: dict[str, int] | None = None
    latency_s: float = 0.0
    ttft_s: float | None = None
    counted: WordCount | None = None  # where the words streamed are counted too


KINDS = ("chat-stream", "chat", "completion-stream", "completion")


def ask(kind: str, n: int, *, model: str, max_tokens: int, real: bool) -> Ask:
    """Request `n` of `kind`: a question of its own (no prefix cache in play), every answer
    `max_tokens` long."""
    question = f"Request {n}: tell me about the fleet."
    body: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "ignore_eos": True}
    if real:
        body["temperature"] = 0
    if kind.startswith("chat"):
        messages = [{"role": "user", "content": question}]
        body["messages"] = messages
        expected = chat_prompt_tokens(messages)
    else:
        body["prompt"] = question
        expected = completion_prompt_tokens(question)
    if kind.endswith("stream"):
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    return Ask(kind=kind, body=body, prompt_tokens=None if real else expected)


async def send(client: httpx.AsyncClient, url: str, asked: Ask, seen: Seen) -> None:
    """Sends `asked` through the gateway at `url`, writing what comes back into `seen` as
    it comes (a burst's watcher counts the words streamed so far)."""
    started = time.monotonic()
    headers = {"authorization": f"Bearer {fleet.KEY}"}
    try:
        async with client.stream("POST", url + asked.path, json=asked.body, headers=headers) as r:
            seen.status = r.status_code
            if r.status_code == 200 and asked.stream:
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        _read_event(line[6:], seen, started)
            elif r.status_code == 200:
                _read_whole(orjson.loads(await r.aread()), seen)
            else:
                await r.aread()
    except (httpx.HTTPError, ValueError):  # a broken connection, or bytes that are no JSON
        pass  # what was seen so far stands: a stream without its end is cut
    seen.latency_s = time.monotonic() - started


def _read_event(data: str, seen: Seen, started: float) -> None:
    if data == "[DONE]":
        seen.done = True
        return
    event = orjson.loads(data)
    if "error" in event:
        seen.error_event = True
        return
    seen.usage = event.get("usage") or seen.usage
    for choice in event.get("choices") or []:
        text = choice.get("text") or (choice.get("delta") or {}).get("content")
        if text:
            seen.events += 1
            seen.text += text
            if seen.counted is not None:
                seen.counted.add(1)
            seen.ttft_s = seen.ttft_s or time.monotonic() - started
        seen.finish_reason = choice.get("finish_reason") or seen.finish_reason


def _read_whole(body: Any, seen: Seen) -> None:
    if not isinstance(body, dict):
        return
    choice = (body.get("choices") or [{}])[0]
    seen.text = choice.get("text") or (choice.get("message") or {}).get("content") or ""
    seen.finish_reason = choice.get("finish_reason")
    seen.done = True
    seen.usage = body.get("usage")


def faults(asked: Ask, seen: Seen, *, real: bool) -> list[Fault]:
    """Everything wrong with one answer; none for a good one. On a real vLLM the text is
    no filler and its events are not always one token each, so its usage is checked
    against max_tokens and, within a token, the events received."""
    if seen.status is None:
        return [Fault.NO_ANSWER]
    if seen.status != 200:
        return [Fault.NON_200]
    if seen.error_event:
        return [Fault.ERROR_EVENT]
    if seen.finish_reason is None or not seen.done:
        return [Fault.CUT]
    found = []
    usage = seen.usage or {}
    completion = usage.get("completion_tokens")
    if real:
        length = completion
        honest = completion is not None and abs(completion - seen.events) <= 1
    else:
        if filler_words(seen.text) is None:
            found.append(Fault.DISCONTINUOUS)
        length = seen.text.count(" ")  # every filler word has its one leading space
        honest = (completion, usage.get("prompt_tokens")) == (length, asked.prompt_tokens)
    if length != asked.body["max_tokens"] or seen.finish_reason != "length":
        found.append(Fault.WRONG_LENGTH)
    if not honest:
        found.append(Fault.DISHONEST_USAGE)
    return found


@dataclass
class Tally:
    """What the clients saw, counted."""

    real: bool
    requests: int = 0
    failed: int = 0
    faults: Counter[str] = field(default_factory=Counter)
    statuses: Counter[str] = field(default_factory=Counter)
    by_kind: dict[str, Counter[str]] = field(default_factory=dict)
    latencies: list[float] = field(default_factory=list)
    ttfts: list[float] = field(default_factory=list)
    prompt_tokens_off: list[int] = field(default_factory=list)  # real vLLM: usage − /tokenize

    def add(self, asked: Ask, seen: Seen) -> None:
        found = faults(asked, seen, real=self.real)
        self.requests += 1
        self.failed += bool(found)
        self.faults.update(found)
        if seen.status is not None and seen.status != 200:
            self.statuses[str(seen.status)] += 1
        kind = self.by_kind.setdefault(asked.kind, Counter())
        kind.update({"requests": 1, "failed": int(bool(found))})
        self.latencies.append(seen.latency_s)
        if seen.ttft_s is not None:
            self.ttfts.append(seen.ttft_s)
        counted = (seen.usage or {}).get("prompt_tokens")
        if self.real and counted is not None and asked.prompt_tokens is not None:
            self.prompt_tokens_off.append(counted - asked.prompt_tokens)

    def figures(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "ok": self.requests - self.failed,
            "failed": self.failed,
            "faults": {fault.value: self.faults[fault] for fault in Fault},
            "statuses": dict(self.statuses),
            "by_kind": {k: dict(v) for k, v in sorted(self.by_kind.items())},
            "latency_p50_s": percentile(self.latencies, 50),
            "latency_p99_s": percentile(self.latencies, 99),
            "ttft_p50_s": percentile(self.ttfts, 50),
            "ttft_p99_s": percentile(self.ttfts, 99),
            **({"prompt_tokens_off": dict(Counter(self.prompt_tokens_off))} if self.real else {}),
        }
