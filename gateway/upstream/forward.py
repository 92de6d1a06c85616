"""Send a request to one upstream target and relay its answer; no retry after the first byte."""

from __future__ import annotations

import re
from collections.abc import Awaitable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import orjson
from starlette.types import Send

from gateway.clock import Clock
from gateway.errors import UpstreamUnavailable
from gateway.request import Endpoint, InferenceRequest
from gateway.upstream.answer import (
    JSON_HEADERS,
    SSE_HEADERS,
    AnswerRecorder,
    StreamWatch,
    model_swap,
)
from gateway.upstream.deadline import Deadline
from gateway.upstream.http import Response
from gateway.upstream.http_head import ConnectFailed, ProtocolError, Route, TransportError
from gateway.upstream.pool import UpstreamPool
from gateway.upstream.relay import (
    MAX_EVENT_BYTES,
    MAX_KEPT_BYTES,
    Relayed,
    StreamRelay,
    relay_stream,
    send_json_body,
)
from gateway.upstream.resume import count_body
from gateway.upstream.stop import Stop
from gateway.upstream.target import Target
from gateway.upstream.usage import AnswerFlaws

# Fields some SDKs and proxies read to pick the upstream or its credentials. The gateway
# alone chooses where a request goes and with which key, so they never travel on.
UPSTREAM_CHOOSING_FIELDS = frozenset(
    {"api_base", "base_url", "api_key", "api_version", "custom_llm_provider", "extra_headers"}
)


# answers are relayed as the upstream sent them, so none may come compressed (a
# compressing proxy in front of a backend would hand the client gzip labelled as JSON)
UPSTREAM_HEADERS = {"content-type": "application/json", "accept-encoding": "identity"}


# where a stream tells its usage only when asked to (the Responses API's always ends with it)
USAGE_OPTION_ENDPOINTS = frozenset({Endpoint.CHAT, Endpoint.COMPLETIONS})
# what an answer of each endpoint holds, whoever sent it
ENDPOINT_ANSWER_KEY = {
    Endpoint.CHAT: "choices",
    Endpoint.COMPLETIONS: "choices",
    Endpoint.EMBEDDINGS: "data",
    Endpoint.RESPONSES: "output",
}


@dataclass(frozen=True, slots=True)
class AnswerBounds:
    """What the gateway reads of an upstream's answer at most (ServerSettings'
    `upstream_max_*_bytes`): a body read whole (an answer not streamed, a refusal, a
    count), one event of a stream, and the text a resumable stream keeps."""

    body_bytes: int = 64 << 20
    event_bytes: int = MAX_EVENT_BYTES
    kept_bytes: int = MAX_KEPT_BYTES


def upstream_body(request: InferenceRequest, model: str) -> bytes:
    body = dict(request.body)
    if not UPSTREAM_CHOOSING_FIELDS.isdisjoint(body):
        body = {k: v for k, v in body.items() if k not in UPSTREAM_CHOOSING_FIELDS}
    body["model"] = model
    if request.stream and request.endpoint in USAGE_OPTION_ENDPOINTS:
        options = body.get("stream_options") or {}
        body["stream_options"] = {**options, "include_usage": True}
    return orjson.dumps(body)


# a refusal's Retry-After keeps a provider's breaker open that long: never longer than this,
# whatever it says (a breaker open for a day is an outage the provider did not mean)
RETRY_AFTER_MAX_S = 3600.0
# a refusal's body (a JSON error) is read so that its connection can serve the next request;
# one longer than this, or slower than REFUSAL_READ_S, is not worth it: the connection closes
REFUSAL_BODY_MAX = 64 * 1024
REFUSAL_READ_S = 1.0


def _retry_after(response: Response) -> float | None:
    """`Retry-After` in seconds, at most RETRY_AFTER_MAX_S, when it is delta-seconds: digits
    only (RFC 9110 §10.2.3), so no `inf`, `nan`, `1e400`, `-5` or `1.5e3`. An HTTP-date is
    not read: the providers the gateway forwards to send seconds, and a date would count on
    their clock and ours agreeing. Anything else is None: no pause asked for."""
    value = response.headers.get(b"retry-after")
    if value is None:
        return None
    value = value.strip()
    return min(float(value), RETRY_AFTER_MAX_S) if value.isdigit() else None


class Leg(NamedTuple):
    """One upstream request serving part of a client's request, its answer relayed: to
    `target`, `request` under `public_model` for the client, relayed to `send` with the
    gateway's `headers` (and to `recorder`), within `deadline` (Clock time; by default
    `timeouts.total` from its start), `upstream_headers` sent on besides the gateway's own
    (the trace's context, a decode leg's request id). A stream's `growth` grows its
    reservation; a `resumable` one that breaks off mid-answer is left open (`Relayed.cut`);
    `relay` is such a stream, which this leg continues (gateway/upstream/resume.py); `stop`
    may stop a stream's answer at its upstream (gateway/upstream/stop.py). (A NamedTuple:
    one is made for every request.)"""

    target: Target
    request: InferenceRequest
    public_model: str
    send: Send
    headers: Sequence[tuple[bytes, bytes]]
    recorder: AnswerRecorder | None = None
    deadline: float | None = None
    upstream_headers: Mapping[str, str] | None = None
    growth: StreamWatch | None = None
    resumable: bool = False
    relay: StreamRelay | None = None
    stop: Stop | None = None


class Forwards(Protocol):
    """What an exchange forwards with: the Forwarder, or a traced one around it."""

    async def forward(self, leg: Leg) -> Relayed: ...

    async def prompt_tokens(self, target: Target, request: InferenceRequest) -> int | None: ...

    async def prefill(
        self,
        target: Target,
        request: InferenceRequest,
        *,
        deadline: float,
        upstream_headers: Mapping[str, str] | None = None,
    ) -> dict[str, Any]: ...


# a prompt's count is worth this long: past it, a continued stream's usage does without
COUNT_S = 2.0


class Forwarder:
    def __init__(
        self,
        pool: UpstreamPool,
        *,
        clock: Clock,
        bounds: AnswerBounds = AnswerBounds(),
        flaws: AnswerFlaws | None = None,
    ) -> None:
        """`flaws` is told of answers not taken as they came: usage corrected
        (gateway/upstream/usage.py), a resumable stream past `bounds.kept_bytes`."""
        self._pool = pool
        self._clock = clock
        self._bounds = bounds
        self._flaws = flaws
        # by target name, base and endpoint: a target's headers and timeouts never change
        self._routes: dict[tuple[str, str, str], Route] = {}

    def _route(self, target: Target, endpoint: str, *, url: str | None = None) -> Route:
        """Make and keep the route to `target`'s `endpoint`, by default under its API base
        (callers look in `_routes` first: the request path spares itself the call)."""
        # the connect budget only: the caller's deadline bounds the rest
        route = self._routes[(target.name, target.api_base, endpoint)] = Route.post(
            url or target.api_base + endpoint.removeprefix("/v1"),
            {**UPSTREAM_HEADERS, **target.headers},
            connect_s=target.timeouts.connect,
        )
        return route

    def _post(
        self,
        target: Target,
        request: InferenceRequest,
        upstream_headers: Mapping[str, str] | None,
    ) -> Awaitable[Response]:
        route = self._routes.get((target.name, target.api_base, request.endpoint))
        if route is None:
            route = self._route(target, request.endpoint)
        # `traceparent` (gateway/front/tracing.py) only when tracing is on
        return self._pool.post(route, upstream_body(request, target.model), upstream_headers)

    async def prompt_tokens(self, target: Target, request: InferenceRequest) -> int | None:
        """`request`'s prompt tokens as `target` counts them (`POST /tokenize`, vLLM's and
        SGLang's), None when it cannot tell: no such route, an error, no answer in time."""
        route = self._routes.get((target.name, target.api_base, "/tokenize"))
        if route is None:  # at the server's root, beside /v1
            url = target.api_base.removesuffix("/v1") + "/tokenize"
            route = self._route(target, "/tokenize", url=url)
        response: Response | None = None
        try:
            with Deadline.after(COUNT_S):
                response = await self._pool.post(route, count_body(request, target.model))
                body = await response.read(limit=self._bounds.body_bytes)
        except (TimeoutError, TransportError):
            return None
        finally:
            if response is not None:
                response.release()
        try:
            count = orjson.loads(body).get("count") if response.status == 200 else None
        except (orjson.JSONDecodeError, AttributeError):
            return None
        # a count is evidence too: none that is not a positive whole number (the usage it
        # goes into is checked against the request, gateway/upstream/usage.py)
        return count if type(count) is int and count > 0 else None

    async def prefill(
        self,
        target: Target,
        request: InferenceRequest,
        *,
        deadline: float,
        upstream_headers: Mapping[str, str] | None = None,
    ) -> dict[str, Any]:
        """The answer of a prefill leg (`request`, not streamed), read whole within
        `deadline` and relayed to no one; UpstreamUnavailable when it is no success."""
        status, _, answer = await self._whole(
            target, request, deadline=deadline, upstream_headers=upstream_headers
        )
        if status != 200:
            raise UpstreamUnavailable(f"status {status}", status=status)
        assert isinstance(answer, dict)  # a 200 that is no answer raised in _whole
        return answer

    async def forward(self, leg: Leg) -> Relayed:
        """Relay `leg` to the client; raise UpstreamUnavailable before any byte.

        Its `deadline` ends the whole exchange, earlier attempts included.
        """
        (target, request, public_model, send, headers, recorder, deadline, upstream_headers,
         growth, resumable, relay, stop) = leg  # fmt: skip
        clock = self._clock
        now = clock.monotonic()
        t = target.timeouts
        end = now + t.total
        if deadline is None or deadline > end:
            deadline = end
        swap = model_swap(target.model, public_model)
        if target.external and request.model_context is not None:
            # the pool's model's context says nothing of a provider's model: its answers'
            # usage is bounded as where no context is known (gateway/upstream/usage.py)
            request = request._replace(model_context=None)
        if not request.stream:
            status, body, answer = await self._whole(
                target, request, deadline=deadline, upstream_headers=upstream_headers
            )
            if target.external:
                _check_external_body(status, body, answer)
            relayed = await send_json_body(
                body,
                send=send,
                status=status,
                headers=[*JSON_HEADERS, *headers],
                swap=swap,
                recorder=recorder if status == 200 else None,
                clock=clock,
                request=request,
                parsed=answer,
            )
            return self._told(target, relayed)
        try:
            with Deadline.after(min(t.first_token, deadline - now)):
                response = await self._post(target, request, upstream_headers)
        except (TimeoutError, TransportError) as exc:
            raise _unavailable(exc, answered=False, target=target) from None
        done = False
        if stop is not None:
            stop.watch(response)
        try:
            if stop is not None and stop.fired:  # stopped while its head was on the way
                raise UpstreamUnavailable("preempted")
            if _refused(response):
                # its connection serves the next request if the refusal is read to its end
                await self._drain(response, deadline)
                done = response.complete
                raise _refusal(response)
            if response.status >= 400:
                body = await self._read_body(response, deadline, idle_s=t.idle)
                done = True
                if target.external or relay is not None:  # a continuation: nothing to relay
                    _check_external_body(response.status, body, None)
                return await send_json_body(
                    body,
                    send=send,
                    status=response.status,
                    headers=[*JSON_HEADERS, *headers],
                    swap=swap,
                    recorder=None,
                    clock=clock,
                )
            try:
                if target.external:
                    _check_encoding(response)  # the rest is read from its first bytes, below
                else:
                    _check_stream_head(response)
            except UnusableAnswer as exc:
                raise _unavailable(exc, answered=True, target=target) from None
            chunks = aiter(response)
            try:
                with Deadline.after(min(t.first_token, deadline - clock.monotonic())):
                    first = await anext(chunks)
            except (TimeoutError, StopAsyncIteration, TransportError) as exc:
                raise UpstreamUnavailable(
                    f"no first token: {type(exc).__name__}", timed_out=isinstance(exc, TimeoutError)
                ) from None
            if target.external:
                _check_external_first_chunk(first)
            if relay is None:
                bounds = self._bounds
                relay = StreamRelay(
                    send=send,
                    swap=swap,
                    keep_usage=request.client_wants_usage,
                    recorder=recorder,
                    hide_errors=target.external,
                    growth=growth,
                    resumable=resumable,
                    request=request,
                    max_event_bytes=bounds.event_bytes,
                    max_kept_bytes=bounds.kept_bytes,
                )
                await relay.start(status=200, headers=[*SSE_HEADERS, *headers])
            if stop is not None:
                stop.relay = relay
            relayed = await relay_stream(
                chunks,
                relay=relay,
                first_chunk=first,
                idle_s=t.idle,
                deadline=deadline,
                clock=clock,
            )
            done = relayed.completed
            if relay.kept_too_long and self._flaws is not None:
                self._flaws.not_kept(target.name)  # no leg follows: it cannot be continued
            return self._told(target, relayed)
        finally:
            if stop is not None:
                stop.unwatch()
            # a fully read response gives its connection back; anything else closes it,
            # which is also how an abandoned request is cancelled at the upstream
            if done:
                response.release()
            else:
                response.close()

    def _told(self, target: Target, relayed: Relayed) -> Relayed:
        """`relayed`, its usage's corrections counted against `target`."""
        if relayed.corrected is not None and self._flaws is not None:
            self._flaws.corrected(target.name, relayed.corrected)
        return relayed

    async def _whole(
        self,
        target: Target,
        request: InferenceRequest,
        *,
        deadline: float,
        upstream_headers: Mapping[str, str] | None,
    ) -> tuple[int, bytes, Any]:
        """A non-streaming answer: its status, its body, and its body's JSON where it is a
        success (a 4xx is relayed as it came). Its head is its first byte, which vLLM
        sends once the whole answer is generated: the head must come within `first_token`,
        and then no gap in the body may exceed `idle`. A backend that holds a request
        longer has hung, and the request may go elsewhere, as nothing reached the client;
        so may a success that is not one (`_answer`)."""
        clock = self._clock
        t = target.timeouts
        response: Response | None = None
        try:
            with Deadline.after(min(t.first_token, deadline - clock.monotonic())) as budget:
                response = await self._post(target, request, upstream_headers)
                if _refused(response):
                    await self._drain(response, deadline)  # see forward
                    raise _refusal(response)
                if response.status < 400:
                    _check_encoding(response)
                budget.push(min(t.idle, deadline - clock.monotonic()))
                body = await response.read(
                    limit=self._bounds.body_bytes,
                    progress=lambda: budget.push(min(t.idle, deadline - clock.monotonic())),
                )
                try:
                    answer = _answer(response.status, body, request.endpoint)
                except UnusableAnswer:
                    if not target.external:
                        raise
                    answer = None  # a provider's: told with its body (_check_external_body)
                return response.status, body, answer
        except (TimeoutError, TransportError) as exc:
            raise _unavailable(exc, answered=response is not None, target=target) from None
        finally:
            if response is not None:  # see forward: an unread response closes its connection
                response.release()

    async def _drain(self, response: Response, deadline: float) -> None:
        """Read a refusal's body to its end, if it is short and comes soon; else leave it."""
        read = 0
        try:
            with Deadline.after(min(REFUSAL_READ_S, deadline - self._clock.monotonic())):
                async for chunk in response:
                    read += len(chunk)
                    if read > REFUSAL_BODY_MAX:
                        return
        except (TimeoutError, TransportError):
            return

    async def _read_body(self, response: Response, deadline: float, *, idle_s: float) -> bytes:
        """A refusal of a stream (a 4xx with its JSON error), read under the idle timer."""
        clock = self._clock
        try:
            with Deadline.after(min(idle_s, deadline - clock.monotonic())) as budget:
                return await response.read(
                    limit=REFUSAL_BODY_MAX,
                    progress=lambda: budget.push(min(idle_s, deadline - clock.monotonic())),
                )
        except (TimeoutError, TransportError) as exc:
            raise _unavailable(exc, answered=True, target=None) from None


def _check_encoding(response: Response) -> None:
    """Answers are asked for uncompressed (UPSTREAM_HEADERS) and relayed as they come: one
    compressed anyway would reach the client as bytes labelled JSON or events."""
    encoding = response.headers.get(b"content-encoding")
    if encoding is not None and encoding.strip().lower() != b"identity":
        raise UnusableAnswer(f"content-encoding {encoding.decode('latin-1')[:40]!r}")


def _check_stream_head(response: Response) -> None:
    """A stream's success: events, uncompressed."""
    if response.status != 200:
        raise UnusableAnswer(f"status {response.status}: not an answer")
    _check_encoding(response)
    kind = response.headers.get(b"content-type", b"").split(b";")[0].strip().lower()
    if kind != b"text/event-stream":
        raise UnusableAnswer(f"not an event stream: content-type {kind.decode('latin-1')[:60]!r}")


def _answer(status: int, body: bytes, endpoint: Endpoint) -> Any:
    """A success's JSON: an OpenAI answer for `endpoint`, UnusableAnswer otherwise (an HTML
    page, JSON that is not an answer); None for a refusal (4xx), relayed as it came."""
    if status >= 400:
        return None
    if status != 200:
        raise UnusableAnswer(f"status {status}: not an answer")
    try:
        answer = orjson.loads(body)
    except orjson.JSONDecodeError:
        raise UnusableAnswer("a 200 that is not JSON") from None
    key = ENDPOINT_ANSWER_KEY.get(endpoint)
    if not isinstance(answer, dict) or (key is not None and key not in answer):
        raise UnusableAnswer(f"a 200 that is not an answer of {endpoint}")
    return answer


class UnusableAnswer(ProtocolError):
    """A success that is none: not JSON, not an answer of its endpoint, compressed."""


def _unavailable(exc: Exception, *, answered: bool, target: Target | None) -> UpstreamUnavailable:
    """A timeout or connection error before the answer's head arrived, or while its body
    was read (`answered`), as the failure the caller may try elsewhere."""
    timed_out = isinstance(exc, TimeoutError)
    if isinstance(exc, ProtocolError):  # what the upstream broke: a bound, bad HTTP, junk
        return UpstreamUnavailable(f"{type(exc).__name__}: {exc}")
    if answered:
        return UpstreamUnavailable(f"body not read: {type(exc).__name__}", timed_out=timed_out)
    if timed_out:
        return UpstreamUnavailable("timeout before the first byte", timed_out=True)
    if isinstance(exc, ConnectFailed) and target is not None:
        why = unreachable_reason(target.api_base.removesuffix("/v1"), exc.os_error)
        return UpstreamUnavailable(f"{type(exc).__name__}: {why}", unreachable=why)
    return UpstreamUnavailable(type(exc).__name__)


def unreachable_reason(url: str, exc: BaseException) -> str:
    """Why nothing answered at `url`, in words that stay the same from one try to the next."""
    cause: BaseException | None = exc
    while cause is not None:
        if isinstance(cause, ConnectionRefusedError):
            return f"connection refused at {url}"
        cause = cause.__cause__ or cause.__context__
    return f"cannot connect to {url}"


def _refused(response: Response) -> bool:
    """5xx and 429 are the upstream's failures before the answer: worth trying elsewhere."""
    return response.status >= 500 or response.status == 429


def _refusal(response: Response) -> UpstreamUnavailable:
    """A refusal (`_refused`) as the failure the caller may try elsewhere."""
    return UpstreamUnavailable(
        f"status {response.status}", status=response.status, retry_after=_retry_after(response)
    )


# an answer that opens with an error event instead of tokens
_ERROR_EVENT = re.compile(rb'\s*data:\s*\{\s*"error"\s*:')


def _check_external_body(status: int, body: bytes, answer: Any) -> None:
    """A provider's refusal (any status but 200), or a 200 that is not an answer of its
    endpoint (`answer` None: `_answer` found none) or that carries an error."""
    if status != 200:
        raise UpstreamUnavailable(f"status {status}", status=status, detail=body)
    if answer is None or "error" in answer:
        raise UpstreamUnavailable("bad body", status=status, detail=body)


def _check_external_first_chunk(first: bytes) -> None:
    """A provider's stream that opens with an error event, or is a JSON or HTML page."""
    if _ERROR_EVENT.match(first) or first.lstrip()[:1] in (b"{", b"[", b"<"):
        raise UpstreamUnavailable("bad body", status=200, detail=first)
