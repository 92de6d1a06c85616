"""One OpenAI request, timed: TTFT, inter-token latency, end-to-end, tokens, status, outcome."""

from __future__ import annotations

import asyncio
import re
import time
from dataclasses import asdict, dataclass
from typing import Any

import orjson

from loadtest.loadgen.http import ConnectionPool, HttpError
from loadtest.loadgen.workload import PlannedRequest

OUTCOME_HEADER = "x-spillgate-outcome"
ERROR_OUTCOME = "error"
DIRECT_OUTCOME = "served"  # a 2xx without the gateway's header: a backend answered directly


@dataclass(slots=True, kw_only=True)
class Result:
    index: int
    tenant: str
    at_s: float  # scheduled send time, from the run's start
    sent_s: float  # when the request was actually written
    stream: bool
    repeated: bool
    prompt_tokens: int  # as planned, or the server's count when it reported usage
    max_tokens: int
    status: int = 0  # 0: no HTTP response at all
    outcome: str = ERROR_OUTCOME
    retry_after: str | None = None
    ttft_s: float | None = None
    itl_s: float | None = None  # mean gap between tokens after the first
    e2e_s: float | None = None
    completion_tokens: int = 0
    error: str | None = None

    @property
    def lag_s(self) -> float:
        return self.sent_s - self.at_s

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300 and self.error is None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, kw_only=True)
class RequestShape:
    model: str
    endpoint: str = "chat"  # chat | completions
    timeout_s: float = 120.0
    headers: tuple[tuple[str, str], ...] = ()  # sent with every request, beside the key

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.endpoint == "chat" else "/v1/completions"

    def body(self, plan: PlannedRequest) -> bytes:
        body: dict[str, Any] = {
            "model": self.model,
            "max_tokens": plan.max_tokens,
            "stream": plan.stream,
            "temperature": 0.0 if plan.repeated else 1.0,
        }
        if plan.repeated:
            body["seed"] = 0
        elif plan.seed is not None:
            body["seed"] = plan.seed
        if plan.ignore_eos:
            body["ignore_eos"] = True
        if plan.stop_token_ids:
            body["stop_token_ids"] = list(plan.stop_token_ids)
        if self.endpoint == "chat":
            body["messages"] = plan.messages()
        else:
            body["prompt"] = plan.prompt()
        if plan.stream:
            body["stream_options"] = {"include_usage": True}
        return orjson.dumps(body)


# A token-bearing event: a non-empty `content` (chat) or `text` (completions) string. Inside
# generated text the quotes are escaped, so these only match the JSON keys themselves.
_TOKEN_EVENT = re.compile(rb'"(?:content|text)":"(?!")')
_DONE = b"data: [DONE]"


class StreamState:
    """Folds SSE events into token timings as they arrive.

    Events are handled a block at a time (all complete events of a read): token events are
    counted with one regex pass; only blocks holding usage or an error are parsed as JSON.
    """

    __slots__ = ("buffer", "done", "error", "events", "first", "last", "usage")

    def __init__(self) -> None:
        self.buffer = b""
        self.events = 0
        self.first: float | None = None
        self.last: float | None = None
        self.usage: dict[str, Any] | None = None
        self.error: str | None = None
        self.done = False

    def feed(self, chunk: bytes, now: float) -> None:
        head, sep, self.buffer = (self.buffer + chunk).rpartition(b"\n\n")
        if not sep:
            self.buffer = head + self.buffer
            return
        tokens = len(_TOKEN_EVENT.findall(head))
        if tokens:
            self.events += tokens
            self.first = self.first or now
            self.last = now
        if b'"usage":{' in head or b'"error"' in head:
            for line in head.split(b"\n"):
                if line.startswith(b"data:"):
                    self._parse(line[5:].strip())
        if _DONE in head:
            self.done = True

    def _parse(self, payload: bytes) -> None:
        if payload == b"[DONE]":
            return
        try:
            data = orjson.loads(payload)
        except orjson.JSONDecodeError:
            self.error = "malformed SSE event"
            return
        if "error" in data:
            error = data["error"]
            self.error = str(error.get("message") if isinstance(error, dict) else error)
        elif data.get("usage"):
            self.usage = data["usage"]


def error_message(body: bytes) -> str:
    """The message of an OpenAI-shaped error body, else the start of the body."""
    try:
        error = orjson.loads(body).get("error")
    except (orjson.JSONDecodeError, AttributeError):
        error = None
    if isinstance(error, dict) and error.get("message"):
        return str(error["message"])
    text = body[:200].decode("utf-8", "replace").strip()
    return text or "(empty body)"


async def send(
    pool: ConnectionPool,
    plan: PlannedRequest,
    *,
    shape: RequestShape,
    key: str | None,
    t0: float,
) -> Result:
    """Send one planned request; never raises for a failed request, records it instead."""
    result = Result(
        index=plan.index, tenant=plan.tenant, at_s=plan.at_s, sent_s=time.perf_counter() - t0,
        stream=plan.stream, repeated=plan.repeated, prompt_tokens=plan.prompt_tokens,
        max_tokens=plan.max_tokens,
    )  # fmt: skip
    headers = {"content-type": "application/json", "accept": "text/event-stream"}
    headers.update(shape.headers)
    if key:
        headers["authorization"] = f"Bearer {key}"
    start = t0 + result.sent_s
    try:
        async with asyncio.timeout(shape.timeout_s):
            await _exchange(pool, shape, plan, headers, result, start)
    except TimeoutError:
        result.error = f"timed out after {shape.timeout_s:g}s"
    except HttpError as exc:
        result.error = str(exc)
    result.e2e_s = time.perf_counter() - start
    if result.error is not None:
        result.outcome = ERROR_OUTCOME
    return result


async def _exchange(
    pool: ConnectionPool,
    shape: RequestShape,
    plan: PlannedRequest,
    headers: dict[str, str],
    result: Result,
    start: float,
) -> None:
    async with pool.request("POST", shape.path, headers=headers, body=shape.body(plan)) as resp:
        result.status = resp.status
        result.retry_after = resp.headers.get("retry-after")
        ok = 200 <= resp.status < 300
        result.outcome = resp.headers.get(OUTCOME_HEADER) or (
            DIRECT_OUTCOME if ok else ERROR_OUTCOME
        )
        content_type = resp.headers.get("content-type", "")
        if ok and content_type.startswith("text/event-stream"):
            await _read_stream(resp.chunks(), result, start)
        else:
            _read_whole(await resp.body(), result, start, ok=ok)


async def _read_stream(chunks: Any, result: Result, start: float) -> None:
    state = StreamState()
    async for chunk in chunks:
        state.feed(chunk, time.perf_counter())
    usage = state.usage or {}
    result.completion_tokens = int(usage.get("completion_tokens") or state.events)
    result.prompt_tokens = int(usage.get("prompt_tokens") or result.prompt_tokens)
    if state.first is not None:
        result.ttft_s = state.first - start
        if state.last is not None and result.completion_tokens > 1:
            result.itl_s = (state.last - state.first) / (result.completion_tokens - 1)
    if state.error is not None:
        result.error = f"stream error: {state.error}"
    elif not state.done:
        result.error = "stream ended without [DONE]"


def _read_whole(body: bytes, result: Result, start: float, *, ok: bool) -> None:
    if not ok:
        if result.outcome == ERROR_OUTCOME:  # not a refusal the gateway names (429, 503)
            result.error = f"HTTP {result.status}: {error_message(body)}"
        return
    result.ttft_s = time.perf_counter() - start
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        result.error = "malformed JSON response"
        return
    usage = data.get("usage") or {}
    result.completion_tokens = int(usage.get("completion_tokens") or 0)
    result.prompt_tokens = int(usage.get("prompt_tokens") or result.prompt_tokens)
