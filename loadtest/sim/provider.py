"""A simulated external provider: OpenAI-compatible, keyed, rate-limited, able to fail on cue.

Control and inspection endpoints (loopback test tooling, no key needed):
  GET  /sim/stats   requests seen, statuses, the last request's headers, every distinct
                    Authorization value seen (so tests prove a client's key never got here)
  POST /sim/fail    {"status": 500, "count": N, "body": "..."}: the next N requests answer
                    that status with `body` as is, or by default with an OpenAI-shaped error
                    that, as real providers' do, names the model for a 4xx (404: no such model)
  POST /sim/delay   {"seconds": S, "count": N}: the next N requests wait S more before answering
  POST /sim/break   {"after_tokens": K, "count": N}: the next N streams end after K tokens
                    with an error event naming the model, then `[DONE]`
  POST /sim/reset   forget stats and cues, refill the rate-limit buckets
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import math
import random
from dataclasses import dataclass

import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from gateway.clock import Clock, SystemClock
from loadtest.sim.asgi import (
    ClientGone,
    read_body,
    send_chunk,
    send_json,
    start_sse,
    wait_disconnect,
)
from loadtest.sim.protocol import Limits, SimRequest, SimRequestError, parse_request
from loadtest.sim.provider_state import ProviderState, admin_routes
from loadtest.sim.ratelimit import ProviderLimits, Verdict
from loadtest.sim.tokens import FillerText
from loadtest.sim.wire import DONE, Kind, StreamFrame, full_response

FINGERPRINT = "fp_sim_provider"
DEFAULT_API_KEY = "sk-sim-provider"
MIN_TICK_S = 0.005  # a stream wakes at most this often; faster tokens go out in batches
MAX_AUTHORIZATIONS_KEPT = 64


@dataclass(frozen=True, kw_only=True)
class ProviderConfig:
    """One simulated provider account.

    Requests take 1 from the requests/min bucket and prompt + max_tokens from the
    tokens/min bucket, both or neither. A non-streamed answer arrives after
    first_token_latency_s + max_tokens x token_latency_s; a stream sends its first token
    after first_token_latency_s and the rest at token_latency_s each.
    """

    api_key: str = DEFAULT_API_KEY
    models: tuple[str, ...] = ()  # served names; empty accepts any name
    requests_per_minute: int = 600
    tokens_per_minute: int = 1_000_000
    first_token_latency_s: float = 0.005
    token_latency_s: float = 0.0005
    max_context: int = 32768
    default_max_tokens: int = 256
    fail_rate: float = 0.0  # fraction of requests answered `fail_status` at random
    fail_status: int = 500
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.api_key:
            raise ValueError("the provider needs an api_key")
        if min(self.requests_per_minute, self.tokens_per_minute, self.max_context) < 1:
            raise ValueError("rate limits and max_context must be positive")
        if self.first_token_latency_s < 0 or self.token_latency_s < 0:
            raise ValueError("latencies cannot be negative")
        if not 0 <= self.fail_rate <= 1:
            raise ValueError("fail_rate must be in [0, 1]")


def _openai_error(message: str, *, error_type: str, code: str | None = None) -> bytes:
    return orjson.dumps(
        {"error": {"message": message, "type": error_type, "param": None, "code": code}}
    )


def _failure_body(status: int, model: str) -> bytes:
    """The error a real provider answers with `status`; its 4xx name the model asked for."""
    if status == 404:
        message = f"The model `{model}` does not exist or you do not have access to it."
        return _openai_error(message, error_type="invalid_request_error", code="model_not_found")
    if status < 500:
        message = f"Invalid request for model `{model}`: 'max_tokens' is not supported."
        return _openai_error(message, error_type="invalid_request_error")
    return _openai_error(
        "The server had an error while processing your request. Sorry about that!",
        error_type="server_error",
    )


def _error_event(model: str) -> bytes:
    message = f"The server had an error while generating with `{model}`. Sorry about that!"
    return b"data: " + _openai_error(message, error_type="server_error") + b"\n\n" + DONE


async def _client_left_during(seconds: float, gone: asyncio.Event) -> bool:
    """Wait `seconds`, or less if the client leaves; True when it left."""
    if seconds > 0:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(gone.wait(), timeout=seconds)
    return gone.is_set()


def _rate_limited_body(verdict: Verdict, model: str, limits: ProviderLimits, tokens: int) -> bytes:
    if verdict.too_large:
        message = (
            f"Request too large for {model} on tokens per min (TPM): "
            f"Limit {int(limits.tokens.capacity)}, Requested {tokens}."
        )
    else:
        which = "requests per min (RPM)" if verdict.limited_by == "requests" else "tokens per min"
        message = (
            f"Rate limit reached for {model} on {which}. "
            f"Please try again in {verdict.retry_after_s:.3f}s."
        )
    return _openai_error(
        message, error_type=verdict.limited_by or "requests", code="rate_limit_exceeded"
    )


class ProviderEndpoint:
    """POST /v1/chat/completions or /v1/completions on the provider."""

    def __init__(
        self,
        *,
        kind: Kind,
        config: ProviderConfig,
        state: ProviderState,
        limits: ProviderLimits,
        filler: FillerText,
        rng: random.Random,
    ) -> None:
        self._kind = kind
        self._config = config
        self._state = state
        self._limits = limits
        self._filler = filler
        self._rng = rng
        self._parse_limits = Limits(
            model=None,
            max_model_len=config.max_context,
            default_max_tokens=config.default_max_tokens,
        )
        self._expected_auth = f"Bearer {config.api_key}".encode()

    def _observe(self, scope: Scope) -> bytes:
        state = self._state
        state.requests += 1
        headers: dict[str, str] = {
            k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]
        }
        state.last_headers = headers
        auth = headers.get("authorization", "")
        if auth not in state.authorizations and len(state.authorizations) < MAX_AUTHORIZATIONS_KEPT:
            state.authorizations.append(auth)
        return auth.encode("latin-1")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        auth = self._observe(scope)
        try:
            raw = await read_body(receive)
        except ClientGone:
            return
        if not hmac.compare_digest(auth, self._expected_auth):
            await self._unauthorized(send, present=bool(auth))
            return
        try:
            req = parse_request(self._kind, raw, self._parse_limits)
            model = self._check_model(req)
        except SimRequestError as exc:
            self._state.record(exc.status)
            body = _openai_error(exc.message, error_type="invalid_request_error")
            await send_json(send, exc.status, body)
            return
        if await self._injected_failure(send, model):
            return
        tokens = req.prompt_tokens + req.max_tokens
        verdict = self._limits.admit(tokens)
        if not verdict.allowed:
            await self._rate_limited(send, verdict, model, tokens)
            return
        self._state.record(200)
        self._state.prompt_tokens += req.prompt_tokens
        self._state.completion_tokens += req.max_tokens
        await self._serve(req, model, receive, send)

    def _check_model(self, req: SimRequest) -> str:
        if req.model is None:
            raise SimRequestError("you must provide a model parameter")
        if self._config.models and req.model not in self._config.models:
            raise SimRequestError(
                f"The model `{req.model}` does not exist or you do not have access to it.",
                status=404,
            )
        return req.model

    async def _unauthorized(self, send: Send, *, present: bool) -> None:
        self._state.record(401)
        if present:
            body = _openai_error(
                "Incorrect API key provided.",
                error_type="invalid_request_error",
                code="invalid_api_key",
            )
        else:
            body = _openai_error(
                "You didn't provide an API key. You need to provide your API key in an "
                "Authorization header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY).",
                error_type="invalid_request_error",
            )
        await send_json(send, 401, body)

    async def _injected_failure(self, send: Send, model: str) -> bool:
        state, config = self._state, self._config
        body = None
        if state.fail_count > 0:
            state.fail_count -= 1
            status, body = state.fail_status, state.fail_body
        elif config.fail_rate > 0 and self._rng.random() < config.fail_rate:
            status = config.fail_status
        else:
            return False
        state.record(status)
        await send_json(send, status, body or _failure_body(status, model))
        return True

    async def _rate_limited(self, send: Send, verdict: Verdict, model: str, tokens: int) -> None:
        self._state.record(429)
        retry_after = max(1, math.ceil(verdict.retry_after_s))
        headers = [
            (b"retry-after", b"%d" % retry_after),
            (b"retry-after-ms", b"%d" % math.ceil(verdict.retry_after_s * 1000)),
            *self._limits.headers(),
        ]
        body = _rate_limited_body(verdict, model, self._limits, tokens)
        await send_json(send, 429, body, headers)

    def _breaks(self) -> bool:
        """Whether this stream is one /sim/break asked to end in an error event."""
        state = self._state
        if state.break_count <= 0:
            return False
        state.break_count -= 1
        return True

    def _extra_delay(self) -> float:
        state = self._state
        if state.delay_count <= 0:
            return 0.0
        state.delay_count -= 1
        return state.delay_s

    async def _serve(self, req: SimRequest, model: str, receive: Receive, send: Send) -> None:
        gone = asyncio.Event()

        async def watch() -> None:
            await wait_disconnect(receive)
            gone.set()

        watcher = asyncio.create_task(watch())
        try:
            if req.stream:
                await self._stream(req, model, send, gone)
            else:
                await self._complete(req, model, send, gone)
        finally:
            watcher.cancel()
        if gone.is_set():
            self._state.aborted += 1

    async def _complete(self, req: SimRequest, model: str, send: Send, gone: asyncio.Event) -> None:
        config = self._config
        latency = config.first_token_latency_s + req.max_tokens * config.token_latency_s
        if await _client_left_during(latency + self._extra_delay(), gone):
            return
        body = full_response(
            kind=self._kind,
            model=model,
            text=self._filler.text(0, req.max_tokens),
            finish_reason=req.finish_reason,
            prompt_tokens=req.prompt_tokens,
            completion_tokens=req.max_tokens,
            fingerprint=FINGERPRINT,
        )
        await send_json(send, 200, body, self._limits.headers())

    async def _stream(self, req: SimRequest, model: str, send: Send, gone: asyncio.Event) -> None:
        config = self._config
        if await _client_left_during(config.first_token_latency_s + self._extra_delay(), gone):
            return
        frame = StreamFrame(
            kind=self._kind,
            model=model,
            filler=self._filler,
            include_usage=req.include_usage,
            fingerprint=FINGERPRINT,
        )
        await start_sse(send, self._limits.headers())
        per_token, total = config.token_latency_s, req.max_tokens
        broken = self._breaks()
        if broken:
            total = min(total, self._state.break_after)
        loop = asyncio.get_running_loop()
        started_at = loop.time()
        sent = 0
        head = frame.role_chunk() if self._kind is Kind.CHAT else b""
        while True:
            due = total if per_token == 0 else 1 + int((loop.time() - started_at) / per_token)
            due = min(total, max(due, sent + 1))
            done = due == total
            finish = req.finish_reason if done and not broken else None
            body = head + frame.tokens(sent, due, finish_reason=finish)
            if done and broken:
                body += _error_event(model)
            elif done:
                body += frame.end(prompt_tokens=req.prompt_tokens, completion_tokens=total)
            await send_chunk(send, body, last=done)
            sent, head = due, b""
            if done:
                return
            await asyncio.sleep(max(per_token, MIN_TICK_S))
            if gone.is_set():
                return


def create_provider_app(config: ProviderConfig, *, clock: Clock | None = None) -> Starlette:
    """The simulated provider; `clock` drives its rate-limit buckets (default: system time)."""
    state = ProviderState()
    limits = ProviderLimits(
        requests_per_minute=config.requests_per_minute,
        tokens_per_minute=config.tokens_per_minute,
        clock=clock or SystemClock(),
    )
    filler = FillerText()
    rng = random.Random(config.seed)

    def endpoint(kind: Kind) -> ProviderEndpoint:
        return ProviderEndpoint(
            kind=kind, config=config, state=state, limits=limits, filler=filler, rng=rng
        )

    models = {
        "object": "list",
        "data": [
            {"id": name, "object": "model", "created": 0, "owned_by": "sim-provider"}
            for name in config.models
        ],
    }

    async def list_models(request: Request) -> Response:
        return JSONResponse(models)

    routes = [
        Route("/v1/chat/completions", endpoint(Kind.CHAT), methods=["POST"]),
        Route("/v1/completions", endpoint(Kind.COMPLETION), methods=["POST"]),
        Route("/v1/models", list_models, methods=["GET"]),
        *admin_routes(state, limits),
    ]
    return Starlette(routes=routes)
