"""One request's spans: the SERVER span `Tracing.begin` opens (gateway/front/tracing.py), a span
for each overflow policy the chain tries (`spill`), and a CLIENT span for each upstream
attempt, made by the forwarder `forwarder` wraps, whose `traceparent` goes to the
upstream so that vLLM's own spans join the trace. A request that is not sampled records
nothing and only sends its context on.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer, set_span_in_context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from starlette.types import Message

from gateway.errors import SpillgateError, UpstreamUnavailable
from gateway.outcome import Outcome
from gateway.upstream.answer import AnswerRecorder, Usage
from gateway.upstream.forward import Forwards, Leg
from gateway.upstream.relay import Relayed

if TYPE_CHECKING:
    from gateway.front.exchange import Exchange
    from gateway.overflow import OverflowPolicy
    from gateway.request import InferenceRequest
    from gateway.upstream.served import Served
    from gateway.upstream.target import Target

PROPAGATOR = TraceContextTextMapPropagator()
PROVIDER_NAME = "openai"  # the API flavour spoken on both sides (the conventions' discriminator)
_FINISH_REASON = re.compile(rb'"finish_reason"\s*:\s*"([^"\\]{1,64})"')


class RequestTrace:
    """One request's spans: the SERVER span, and the spill and attempt spans under it."""

    __slots__ = (
        "_attempts",
        "_parent",
        "_tracer",
        "finish_reasons",
        "operation",
        "pool",
        "recording",
        "response_model",
        "span",
        "status",
    )  # fmt: skip

    def __init__(self, tracer: Tracer, span: Span, operation: str) -> None:
        self._tracer = tracer
        self.span = span
        self.operation = operation
        self.pool: str | None = None  # the pool the client named
        # not sampled: no attributes and no child spans, only the context sent on
        self.recording = span.is_recording()
        self._parent = set_span_in_context(span)  # the spill span while a policy runs
        self._attempts = 0
        self.status: int | None = None  # the HTTP status the client was sent
        self.response_model: str | None = None
        self.finish_reasons: list[str] = []

    def parsed(self, request: InferenceRequest) -> None:
        """What the client asked for, once its body is read."""
        if not self.recording:
            return
        span = self.span
        self.pool = request.pool
        span.update_name(f"{self.operation} {request.pool}")
        attributes: dict[str, Any] = {
            "gen_ai.request.model": request.pool,
            "spillgate.pool": request.pool,
            "spillgate.tenant": request.tenant,
            "spillgate.priority": request.priority,
            "spillgate.charge_tokens": request.charge_tokens,
            "spillgate.stream": request.stream,
        }
        body = request.body
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        if isinstance(max_tokens, int) and not isinstance(max_tokens, bool):
            attributes["gen_ai.request.max_tokens"] = max_tokens
        for name in ("temperature", "top_p"):
            value = body.get(name)
            if isinstance(value, int | float) and not isinstance(value, bool):
                attributes[f"gen_ai.request.{name}"] = float(value)
        if request.n != 1:
            attributes["gen_ai.request.choice.count"] = request.n
        span.set_attributes(attributes)

    def settled(self, served: Served | None, outcome: Outcome, *, prefill: str | None) -> None:
        """How the request ended, once its reservation is released; `prefill`: in a pool
        with prefill backends, whether one computed its prompt (gateway/front/prefill.py)."""
        if not self.recording:
            return
        span = self.span
        span.set_attribute("spillgate.outcome", outcome.value)
        if prefill is not None:
            span.set_attribute("spillgate.prefill", prefill)
        if served is None:
            return
        span.set_attribute("spillgate.backend", served.target)
        if served.pool != self.pool:
            span.set_attribute("spillgate.served_pool", served.pool)
        _answer_attributes(span, served.relayed.usage, self.response_model, self.finish_reasons)

    def failed(self, error: BaseException, *, status: int, started: bool) -> None:
        """The request ended in `error`; `status` is what the client got (`started`: its
        answer had begun, and was cut)."""
        if not self.recording:
            return
        span = self.span
        if isinstance(error, SpillgateError):
            span.set_attribute("spillgate.outcome", error.outcome.value)
            if error.code is not None:
                span.set_attribute("spillgate.error_code", error.code)
        else:
            span.set_attribute("spillgate.outcome", Outcome.ERROR.value)
        span.set_attribute("error.type", type(error).__name__)
        if not started:  # else the client keeps the status its answer began with
            self.status = status
        if status >= 500 or started:
            span.set_status(Status(StatusCode.ERROR, str(error)[:200]))

    def end(self) -> None:
        if self.status is not None:
            self.span.set_attribute("http.response.status_code", self.status)
        self.span.end()

    async def spill(
        self,
        policy: OverflowPolicy,
        step: Callable[[], Awaitable[Served | None]],
        exchange: Exchange,
    ) -> Served | None:
        """`step`, `policy`'s decision carried out, in a span of its own; upstream attempts
        it makes are its children."""
        if not self.recording:
            return await step()
        span = self._tracer.start_span(
            f"spill {policy.name}",
            context=set_span_in_context(self.span),
            kind=SpanKind.INTERNAL,
            attributes={"spillgate.policy": policy.name},
        )
        self._parent = set_span_in_context(span)
        served: Served | None = None
        try:
            served = await step()
            return served
        except BaseException as exc:
            span.set_attribute("error.type", type(exc).__name__)
            raise
        finally:
            self._parent = set_span_in_context(self.span)
            span.set_attribute("spillgate.served", served is not None)
            if served is not None:
                span.set_attribute("spillgate.outcome", served.outcome.value)
            wait = exchange.timings.get("queue")
            if wait is not None:
                span.set_attribute("spillgate.queue_wait_s", wait)
                self.span.set_attribute("spillgate.queue_wait_s", wait)
            span.end()

    def forwarder(self, inner: Forwards) -> Forwards:
        return _TracedForwarder(inner, self)

    def unsampled_headers(self) -> dict[str, str]:
        """The context an upstream gets from a request that is not sampled: its parent is
        the server span, flagged not sampled, so the upstream records nothing either."""
        carrier: dict[str, str] = {}
        PROPAGATOR.inject(carrier, context=self._parent)
        return carrier

    def attempt(self, target: Target) -> tuple[Span, dict[str, str]]:
        """The CLIENT span of one upstream attempt, and the headers that carry it there."""
        attributes: dict[str, Any] = {
            "gen_ai.operation.name": self.operation,
            "gen_ai.provider.name": PROVIDER_NAME,
            "gen_ai.request.model": target.model,
            "spillgate.backend": target.name,
            "spillgate.external": target.external,
            **_server(target.api_base),
        }
        if self._attempts:
            attributes["http.request.resend_count"] = self._attempts
        self._attempts += 1
        span = self._tracer.start_span(
            f"{self.operation} {target.model}",
            context=self._parent,
            kind=SpanKind.CLIENT,
            attributes=attributes,
        )
        carrier: dict[str, str] = {}
        PROPAGATOR.inject(carrier, context=set_span_in_context(span))
        return span, carrier


@functools.lru_cache(maxsize=256)
def _server(api_base: str) -> dict[str, Any]:
    """`server.address` and `server.port` of an upstream, worked out once per upstream."""
    url = urlsplit(api_base)
    port = {} if url.port is None else {"server.port": url.port}
    return {"server.address": url.hostname or "", **port}


def _answer_attributes(
    span: Span, usage: Usage, model: str | None, finish_reasons: Sequence[str]
) -> None:
    if model is not None:
        span.set_attribute("gen_ai.response.model", model)
    if usage.known:
        span.set_attribute("gen_ai.usage.input_tokens", usage.prompt_tokens)
        span.set_attribute("gen_ai.usage.output_tokens", usage.completion_tokens)
    if finish_reasons:
        span.set_attribute("gen_ai.response.finish_reasons", list(finish_reasons))


class _FinishReasons:
    """An AnswerRecorder that notes each choice's finish reason, and passes the bytes on."""

    __slots__ = ("inner", "reasons")

    def __init__(self, inner: AnswerRecorder | None) -> None:
        self.inner = inner
        self.reasons: list[str] = []

    def feed(self, data: bytes) -> None:
        self.reasons += (m.group(1).decode() for m in _FINISH_REASON.finditer(data))
        if self.inner is not None:
            self.inner.feed(data)

    def finish(self, usage: Usage) -> None:
        if self.inner is not None:
            self.inner.finish(usage)


class _TracedForwarder:
    """The request's forwarder, each call an attempt span with `traceparent` sent on."""

    __slots__ = ("_inner", "_trace")

    def __init__(self, inner: Forwards, trace: RequestTrace) -> None:
        self._inner = inner
        self._trace = trace

    async def prompt_tokens(self, target: Target, request: InferenceRequest) -> int | None:
        return await self._inner.prompt_tokens(target, request)

    async def prefill(
        self,
        target: Target,
        request: InferenceRequest,
        *,
        deadline: float,
        upstream_headers: Mapping[str, str] | None = None,
    ) -> dict[str, Any]:
        trace = self._trace
        if not trace.recording:
            headers = _with(upstream_headers, trace.unsampled_headers())
            return await self._inner.prefill(
                target, request, deadline=deadline, upstream_headers=headers
            )
        span, carrier = trace.attempt(target)
        span.set_attribute("spillgate.leg", "prefill")
        try:
            answer = await self._inner.prefill(
                target,
                request,
                deadline=deadline,
                upstream_headers=_with(upstream_headers, carrier),
            )
        except UpstreamUnavailable as exc:
            _unavailable(span, exc)
            raise
        else:
            span.set_attribute("http.response.status_code", 200)
            return answer
        finally:
            span.end()

    async def forward(self, leg: Leg) -> Relayed:
        trace = self._trace
        upstream = leg.upstream_headers
        if not trace.recording:
            unsampled = _with(upstream, trace.unsampled_headers())
            return await self._inner.forward(leg._replace(upstream_headers=unsampled))
        target = leg.target
        span, carrier = trace.attempt(target)
        status: list[int] = []
        send = leg.send

        async def seen(message: Message) -> None:
            if message["type"] == "http.response.start":
                status.append(message["status"])
            await send(message)

        reasons = _FinishReasons(leg.recorder)
        try:
            relayed = await self._inner.forward(
                leg._replace(send=seen, recorder=reasons, upstream_headers=_with(upstream, carrier))
            )
        except UpstreamUnavailable as exc:
            _unavailable(span, exc)
            raise
        except BaseException as exc:
            span.set_attribute("error.type", type(exc).__name__)
            span.set_status(Status(StatusCode.ERROR, str(exc)[:200]))
            raise
        else:
            if status:
                trace.status = status[0]
                span.set_attribute("http.response.status_code", status[0])
                if status[0] >= 500:
                    span.set_status(Status(StatusCode.ERROR))
            if not relayed.completed:
                span.set_attribute("error.type", "stream_cut")
                span.set_status(Status(StatusCode.ERROR, "the upstream broke off mid-answer"))
            trace.response_model = target.model
            trace.finish_reasons = reasons.reasons
            _answer_attributes(span, relayed.usage, target.model, reasons.reasons)
            return relayed
        finally:
            span.end()


def _with(upstream: Mapping[str, str] | None, trace_headers: dict[str, str]) -> dict[str, str]:
    """The headers an attempt sends on: its own (a leg's request id), and the trace's."""
    return trace_headers if not upstream else {**upstream, **trace_headers}


def _unavailable(span: Span, exc: UpstreamUnavailable) -> None:
    """An attempt that failed before its answer, as its span tells it."""
    if exc.status is not None:
        span.set_attribute("http.response.status_code", exc.status)
    # the HTTP conventions' error type: the status when there was one
    kind = exc.reason.split(":")[0] if exc.status is None else str(exc.status)
    span.set_attribute("error.type", kind)
    span.set_status(Status(StatusCode.ERROR, exc.reason))
