"""Relay one upstream response to the client: SSE bytes pass through as they arrive.

Only events that carry `"usage"` are parsed (to learn real usage and to drop the usage
chunk a client did not ask for); every other byte is relayed untouched, apart from the
model name, which is swapped back to the name the client asked for.

The gateway always asks the upstream for usage. vLLM then moves `system_fingerprint` from
the chunk that finishes the answer to the usage chunk, so for a client that did not ask
for usage the finishing chunk is held until the next event shows whether the usage chunk
follows, and gets the fingerprint back: the client's stream is the one it would get direct.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol

import orjson
from starlette.types import Send

from gateway.clock import Clock
from gateway.request import Endpoint, InferenceRequest
from gateway.upstream.answer import (
    DONE,
    ERROR_EVENT,
    AnswerRecorder,
    ModelSwap,
    StreamWatch,
    Usage,
    carry_over,
    error_data,
    event_json,
    failure_event,
    preempted_event,
    sse_error_event,
)
from gateway.upstream.deadline import Deadline
from gateway.upstream.http_head import Preempted, ProtocolError, TransportError
from gateway.upstream.resume import NOTHING, Partial, read_partial
from gateway.upstream.usage import Corrected, checked_usage

log = logging.getLogger("spillgate.relay")

# an event that carries a usage object (providers send `"usage":null` on every chunk once
# usage is asked for: only an object is worth parsing), one that finishes a choice, an
# error event, and a choice the engine gave up on (vLLM aborts its requests on SIGTERM)
_USAGE = rb'"usage"\s*:\s*\{'
_FINISH = rb'"finish_reason"\s*:\s*"'
_ERROR = ERROR_EVENT.pattern
_ABORTED = rb'"finish_reason"\s*:\s*"(?:abort|error)"'
# what is worth a look, by (keep_usage, hide_errors, resumable): a finishing event only
# when the usage chunk is dropped, an error event from an upstream whose errors are hidden
# or whose failure a resumable stream goes on from, and an aborted choice for the latter
_NOTABLE = {
    (keep, hide, resume): re.compile(b"|".join(p for p, wanted in parts if wanted))
    for keep in (False, True)
    for hide in (False, True)
    for resume in (False, True)
    for parts in [
        ((_USAGE, True), (_FINISH, not keep), (_ERROR, hide or resume), (_ABORTED, resume))
    ]
}
_USAGE_EVENT, _FINISH_EVENT, _ABORTED_EVENT = map(re.compile, (_USAGE, _FINISH, _ABORTED))
# the Responses API's last event, whichever way the response ended: each carries its usage
FINAL_RESPONSE_TYPES = frozenset(
    b"response." + end for end in (b"completed", b"incomplete", b"failed")
)
# the defaults of ServerSettings.upstream_max_event_bytes and upstream_max_kept_bytes
MAX_EVENT_BYTES = 1 << 20
MAX_KEPT_BYTES = 1 << 20
# what a resumable stream keeps as events, before they are folded into the answer so far
FOLD_BYTES = 256 * 1024
HIDDEN_ERROR = (
    b'data: {"error":{"message":"The provider failed mid-stream; the response is incomplete.",'
    b'"type":"server_error","param":null,"code":"upstream_error"}}'
)


@dataclass(slots=True)
class Relayed:
    usage: Usage  # as the gateway takes it: checked against the request
    first_byte_at: float | None  # Clock time when the first byte reached the client
    completed: bool  # False when the upstream broke mid-stream
    upstream_error: bytes = b""  # an error event the upstream sent, hidden from the client
    # a stream whose upstream broke off, still open to the client: the caller continues it
    # on another backend, or ends it (StreamCut)
    cut: StreamCut | None = None
    # what was corrected in the usage the upstream told (gateway/upstream/usage.py)
    corrected: Corrected | None = None


class StreamRelay:
    """Cuts upstream chunks at event boundaries and relays them; reads the usage event.

    Events are read as the WHATWG spec defines them, whichever of the three line endings
    the upstream uses (CR and CRLF go out as LF, so the client gets each event as it
    completes), with `data:` lines with or without their space, and `id`, `event`,
    `retry` and comment lines. Only a chunk's new bytes are searched for an event's end,
    and one event may hold at most `max_event_bytes`: past it the upstream has failed
    (EventTooLarge), and its stream ends as any broken stream does.

    One relay serves the client's whole stream: where the stream is continued on another
    backend after its own broke off (gateway/upstream/resume.py), each continuation is a
    leg of the same relay (`next_leg`).
    """

    def __init__(
        self,
        *,
        send: Send,
        swap: ModelSwap | None,
        keep_usage: bool,
        recorder: AnswerRecorder | None,
        hide_errors: bool = False,
        growth: StreamWatch | None = None,
        resumable: bool = False,
        request: InferenceRequest | None = None,
        max_event_bytes: int = MAX_EVENT_BYTES,
        max_kept_bytes: int = MAX_KEPT_BYTES,
    ) -> None:
        """`hide_errors`: the upstream's error events (an external provider's, which name
        its model and account) are replaced by the gateway's own; the caller logs them.
        `growth` sees every batch of events before it goes out. `resumable`: the answer
        the client got is kept, so that a stream cut mid-answer can be continued; an answer
        past `max_kept_bytes` of text is not, from there on. `request`: what the usage told
        is checked against (None: taken as told; a chat, where resumable)."""
        self._send = send
        self._growth = growth
        self._swap = swap
        self._keep_usage = keep_usage
        self._recorder = recorder
        self._hide_errors = hide_errors
        self._request = request
        self._max_event = max_event_bytes
        self._max_kept = max_kept_bytes
        # the bytes of the event under way, and their length; whether the last chunk ended
        # in a CR (an LF that begins the next belongs to its line ending)
        self._pending: list[bytes] = []
        self._pending_bytes = 0
        self._cr = False
        # a resumable stream looks for error events too: one of the upstream's own failing
        # (an engine that died or aborted it) breaks the leg off like a lost connection
        self._notable = _NOTABLE[(keep_usage, hide_errors, resumable)]
        self._broken: str | None = None  # why the upstream's own error event broke the leg
        self._held: bytes | None = None  # a finishing event, until the next event arrives
        self._leg: Leg | None = None  # a continuation's rewriting, from its second leg on
        self.reported: Any = None  # the last usage object the upstream told
        self.events = 0  # data events relayed: the gateway's own count of the output
        self.upstream_error = b""  # the error event the upstream sent, hidden from the client
        self.first_byte_at: float | None = None  # Clock time the client got its first byte
        # what the client got (only when resumable): its latest event batches as sent, and
        # the answer in them before those (`partial`)
        self.kept: list[bytes] | None = [] if resumable else None
        self._kept_bytes = 0
        self._folded = NOTHING
        self.kept_too_long = False  # it was resumable, until its answer passed the bound
        # output tokens the client got from earlier legs: the usage event's counts are
        # told as the client's, not the continuation's (whose prompt holds them)
        self.carried = 0
        self._prompt: asyncio.Future[int | None] | None = None

    async def start(self, *, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        await self._send({"type": "http.response.start", "status": status, "headers": headers})

    def next_leg(
        self,
        leg: Leg,
        *,
        carried: int,
        growth: StreamWatch | None,
        prompt: asyncio.Future[int | None] | None = None,
    ) -> None:
        """Relay a continuation from here on: `leg` rewrites its events as the client's
        stream had them, `carried` output tokens came before it, and `prompt` counts the
        original prompt's tokens, if it has by the time the usage event comes."""
        self._pending, self._pending_bytes = [], 0  # the broken leg's unfinished event is lost
        self._cr = False
        self._broken = None
        self._leg = leg
        self.carried = carried
        self._growth = growth
        self._prompt = prompt

    def _counted(self) -> int | None:
        """The original prompt's tokens, where the count asked for them came back in time;
        a count that failed is no reason to break the client's stream."""
        count = self._prompt
        if count is None or not count.done() or count.cancelled():
            return None
        if (failure := count.exception()) is not None:
            log.warning("counting a continued stream's prompt failed: %r", failure)
            return None
        return count.result()

    def checked(self) -> tuple[Usage, Corrected | None]:
        """The usage told, checked against the request; what was corrected."""
        if self._request is None:
            return Usage.from_json(self.reported), None
        return checked_usage(self.reported, self._request, events=self.events)

    def recorded(self, usage: Usage) -> None:
        """The answer ended whole, having used `usage`: the recorder may keep it."""
        if self._recorder is not None:
            self._recorder.finish(usage)

    def partial(self) -> Partial:
        """The answer the client got so far (only when resumable)."""
        endpoint = Endpoint.CHAT if self._request is None else self._request.endpoint
        return read_partial(self.kept or [], endpoint, before=self._folded)

    @property
    def finished(self) -> bool:
        """A finishing event arrived and is held: the answer ended before the cut."""
        return self._held is not None

    async def comment(self, text: bytes) -> None:
        """Tell the client `text` in an SSE comment line, between two events (clients
        ignore comments; a person reading the stream sees it)."""
        await self._send(
            {"type": "http.response.body", "body": b": " + text + b"\n\n", "more_body": True}
        )

    async def end(self, last: bytes = b"") -> None:
        """Close the client's stream with `last`, what is held going first."""
        self._pending, self._pending_bytes = [], 0
        if self._held is not None:
            last = self._outgoing(self._held + b"\n\n") + last
            self._held = None
        await self._send({"type": "http.response.body", "body": last, "more_body": False})

    async def feed(self, chunk: bytes) -> bool:
        """Relay the events `chunk` completes; whether one of them carried data (progress:
        a comment, such as a keep-alive ping, is none)."""
        if self._cr or b"\r" in chunk:
            chunk = self._lf(chunk)
        cut = chunk.rfind(b"\n\n")
        if cut < 0 and chunk[:1] == b"\n" and self._pending and self._pending[-1][-1:] == b"\n":
            cut = -1  # the blank line began in the chunk before
        elif cut < 0:
            if chunk:
                self._pending.append(chunk)
                self._pending_bytes += len(chunk)
                if self._pending_bytes > self._max_event:
                    raise EventTooLarge(
                        f"The upstream sent an event longer than {self._max_event} bytes; "
                        "the response is incomplete."
                    )
            return False
        out = chunk[: cut + 2]
        if self._pending:
            out = b"".join(self._pending) + out
        rest = chunk[cut + 2 :]
        self._pending, self._pending_bytes = ([rest], len(rest)) if rest else ([], 0)
        return await self._emit(out)

    def _lf(self, chunk: bytes) -> bytes:
        """`chunk` with its CRLF and CR line endings as LF. A CR that ends it ends its line
        at once (holding it for the next chunk would hold a CR-only stream's events back);
        an LF that begins the next is then the same line ending, and is dropped."""
        if self._cr:
            self._cr = False
            if chunk.startswith(b"\n"):
                chunk = chunk[1:]
        self._cr = chunk.endswith(b"\r")
        return chunk.replace(b"\r\n", b"\n").replace(b"\r", b"\n")

    async def flush(self) -> None:
        """Relay what is left after the upstream's last blank line, treated like the rest,
        and a finishing event still held (the upstream sent nothing after it)."""
        if self._pending:
            rest = b"".join(self._pending)
            self._pending, self._pending_bytes = [], 0
            await self._emit(rest)
        if self._held is not None:
            held, self._held = self._outgoing(self._held + b"\n\n"), None
            await self._send({"type": "http.response.body", "body": held, "more_body": True})

    async def _emit(self, out: bytes) -> bool:
        if self._leg is not None:
            out = self._leg.rewrite(out)
        if self._held is not None or self._notable.search(out):
            out = self._rewrite(out)
        out = self._outgoing(out)
        data = out.count(b"data:")
        self.events += data
        if self._growth is not None and self._growth.seen(out, data):
            await self._growth.grow()
        if out:
            if self.kept is not None:
                self._keep(out)
            await self._send({"type": "http.response.body", "body": out, "more_body": True})
        if self._broken is not None:
            raise UpstreamFailed(self._broken)
        return data > 0

    def _keep(self, out: bytes) -> None:
        """Keep `out` for a continuation: past FOLD_BYTES of events, they are folded into
        the answer so far, and an answer past `max_kept_bytes` is not kept at all."""
        assert self.kept is not None
        self.kept.append(out)
        self._kept_bytes += len(out)
        if self._kept_bytes <= FOLD_BYTES:
            return
        self._folded = self.partial()
        self.kept.clear()
        self._kept_bytes = 0
        if len(self._folded.text) > self._max_kept:
            self.kept, self._folded = None, NOTHING
            self.kept_too_long = True

    def _outgoing(self, out: bytes) -> bytes:
        """`out` as the client gets it (the model name swapped back), shown to the recorder."""
        if self._swap is not None:
            out = self._swap(out)
        if self._recorder is not None:
            self._recorder.feed(out)
        return out

    def _rewrite(self, out: bytes) -> bytes:
        """Read the usage event; unless the client asked for usage, drop its chunk and give
        its fingerprint to the finishing event before it, held back until now."""
        kept: list[bytes] = []
        for event in out.split(b"\n\n"):
            if self.kept is not None and (failure_event(event) or _ABORTED_EVENT.search(event)):
                self._broken = "The upstream failed mid-stream; the response is incomplete."
                kept.append(b"")  # the events before it end as they came, with a blank line
                break  # what follows it, its [DONE] included, is the broken leg's
            if self._hide_errors and ERROR_EVENT.search(event) and error_data(event):
                event = self._hidden(event)
            payload = self._usage_payload(event)
            if payload is None and b"event:" in event:
                self._typed_event(event)
            if payload is not None:
                if self.carried and isinstance(payload["usage"], dict):
                    carry_over(payload["usage"], self.carried, prompt=self._counted())
                    event = b"data: " + orjson.dumps(payload)
                self.reported = payload["usage"]
                if not self._keep_usage and not payload.get("choices"):
                    if self._held is not None:
                        self._held = _with_fingerprint(self._held, payload)
                    continue
                if not self._keep_usage:
                    payload["usage"] = None
                    event = b"data: " + orjson.dumps(payload)
            if event and self._held is not None:
                kept.append(self._held)
                self._held = None
            if not self._keep_usage and _FINISH_EVENT.search(event):
                self._held = event
                continue
            kept.append(event)
        return b"\n\n".join(kept)

    def _typed_event(self, event: bytes) -> None:
        """A typed event (the Responses API's `event: response.*`): the final one
        (`response.completed`, or `.incomplete`, `.failed`) carries the usage inside its
        response object."""
        kind = next(
            (line[6:].strip() for line in event.split(b"\n") if line.startswith(b"event:")), b""
        )
        if kind not in FINAL_RESPONSE_TYPES:
            return
        payload = event_json(event)
        response = payload.get("response") if payload is not None else None
        if isinstance(response, dict) and "usage" in response:
            self.reported = response["usage"]

    def _hidden(self, event: bytes) -> bytes:
        self.upstream_error = event
        return HIDDEN_ERROR

    @staticmethod
    def _usage_payload(event: bytes) -> dict[str, Any] | None:
        """The event's JSON when it carries a usage object (or what stands in one's
        place: the usage told is checked, gateway/upstream/usage.py), else None."""
        if not _USAGE_EVENT.search(event):
            return None
        payload = event_json(event)
        if payload is not None and payload.get("usage") is not None:
            return payload
        return None


class UpstreamFailed(TransportError):
    """The upstream's stream carried an error event of its own failing (a 5xx, or none)."""


class EventTooLarge(ProtocolError):
    """The upstream sent an event longer than the relay's bound, or none that ends."""


class Leg(Protocol):
    """A continuation's events as the client's stream had them (gateway/upstream/resume.py)."""

    def rewrite(self, out: bytes) -> bytes: ...


@dataclass(slots=True)
class StreamCut:
    """A stream whose upstream broke off mid-answer, still open to the client."""

    relay: StreamRelay
    message: str  # why, as the client is told if the stream cannot go on

    async def fail(self) -> None:
        """End the client's stream with an error event: it cannot go on."""
        await self.relay.end(sse_error_event(self.message))

    async def finish(self) -> None:
        """End the client's stream as it would have ended: its answer had finished."""
        await self.relay.end(DONE)


def _with_fingerprint(event: bytes, usage_chunk: dict[str, Any]) -> bytes:
    """`event` with the usage chunk's `system_fingerprint` added, where it has none."""
    fingerprint = usage_chunk.get("system_fingerprint")
    body = event.rstrip()
    if fingerprint is None or b'"system_fingerprint"' in event or not body.endswith(b"}"):
        return event
    return body[:-1] + b',"system_fingerprint":' + orjson.dumps(fingerprint) + b"}"


async def relay_stream(
    chunks: AsyncIterator[bytes],
    *,
    relay: StreamRelay,
    first_chunk: bytes,
    idle_s: float,
    deadline: float,  # Clock time
    clock: Clock,
) -> Relayed:
    """Relay one upstream's stream through `relay`, its response already started. An
    upstream that breaks off leaves a resumable relay's stream open (`Relayed.cut`), and
    ends any other with an error event. Idle is the time since the last event with data:
    comments and keep-alive pings are relayed, but show no progress."""
    if relay.first_byte_at is None:
        relay.first_byte_at = clock.monotonic()
    try:
        await relay.feed(first_chunk)
        with Deadline.after(min(idle_s, deadline - clock.monotonic())) as budget:
            async for chunk in chunks:
                if await relay.feed(chunk):
                    budget.push(min(idle_s, deadline - clock.monotonic()))
    except (TimeoutError, TransportError, OSError) as exc:
        message = "The upstream stopped responding mid-stream; the response is incomplete."
        if isinstance(exc, UpstreamFailed | EventTooLarge | Preempted):
            message = str(exc)
        elif not isinstance(exc, TimeoutError):
            message = f"The upstream connection failed mid-stream: {type(exc).__name__}."
        if relay.kept is not None:
            return _relayed(relay, completed=False, cut=StreamCut(relay, message))
        await relay.flush()
        if isinstance(exc, Preempted):
            await relay.end(preempted_event(exc.retry_after))
        else:
            await relay.end(sse_error_event(message))
        return _relayed(relay, completed=False)
    await relay.flush()
    failed = bool(relay.upstream_error)
    relayed = _relayed(relay, completed=not failed, upstream_error=relay.upstream_error)
    if not failed:
        relay.recorded(relayed.usage)
    await relay.end()
    return relayed


def _relayed(
    relay: StreamRelay,
    *,
    completed: bool,
    cut: StreamCut | None = None,
    upstream_error: bytes = b"",
) -> Relayed:
    usage, corrected = relay.checked()
    return Relayed(
        usage,
        relay.first_byte_at,
        completed,
        upstream_error=upstream_error,
        cut=cut,
        corrected=corrected,
    )


async def send_json_body(
    body: bytes,
    *,
    send: Send,
    status: int,
    headers: list[tuple[bytes, bytes]],
    swap: ModelSwap | None,
    recorder: AnswerRecorder | None,
    clock: Clock,
    request: InferenceRequest | None = None,
    parsed: Any = None,
) -> Relayed:
    """Answer with one JSON document (`parsed` already, where given), its usage read, and
    checked against `request` where given."""
    if parsed is None:
        try:
            parsed = orjson.loads(body)
        except orjson.JSONDecodeError:
            parsed = None
    reported = parsed.get("usage") if isinstance(parsed, dict) else None
    if request is not None and status == 200:
        usage, corrected = checked_usage(reported, request, events=None)
    else:
        usage, corrected = Usage.from_json(reported), None
    if swap is not None:
        body = swap(body)
    all_headers = [*headers, (b"content-length", b"%d" % len(body))]
    await send({"type": "http.response.start", "status": status, "headers": all_headers})
    if recorder is not None:
        recorder.feed(body)
        recorder.finish(usage)
    await send({"type": "http.response.body", "body": body, "more_body": False})
    return Relayed(usage, clock.monotonic(), True, corrected=corrected)
