"""The simulated provider's mutable state and the /sim/* routes that inspect and steer it."""

from __future__ import annotations

from dataclasses import dataclass, field

import orjson
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from loadtest.sim.ratelimit import ProviderLimits


@dataclass(kw_only=True)
class ProviderState:
    requests: int = 0
    by_status: dict[int, int] = field(default_factory=dict)
    last_headers: dict[str, str] = field(default_factory=dict)
    authorizations: list[str] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    aborted: int = 0
    fail_status: int = 500
    fail_count: int = 0
    fail_body: bytes | None = None  # answered as is; None: an error naming the model
    delay_s: float = 0.0
    delay_count: int = 0
    break_after: int = 0
    break_count: int = 0

    def record(self, status: int) -> None:
        self.by_status[status] = self.by_status.get(status, 0) + 1

    def snapshot(self) -> dict[str, object]:
        return {
            "requests": self.requests,
            "by_status": {str(k): v for k, v in sorted(self.by_status.items())},
            "last_headers": self.last_headers,
            "authorizations_seen": self.authorizations,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "aborted": self.aborted,
        }


async def _json_object(request: Request) -> dict[str, object]:
    try:
        body = orjson.loads(await request.body() or b"{}")
    except orjson.JSONDecodeError:
        body = None
    return body if isinstance(body, dict) else {}


def _count(body: dict[str, object], default: int = 1) -> int:
    value = body.get("count", default)
    return value if isinstance(value, int) and value >= 0 else default


def admin_routes(state: ProviderState, limits: ProviderLimits) -> list[Route]:
    async def stats(request: Request) -> Response:
        return Response(orjson.dumps(state.snapshot()), media_type="application/json")

    async def fail(request: Request) -> Response:
        body = await _json_object(request)
        status, raw = body.get("status", 500), body.get("body")
        if not isinstance(status, int) or not 200 <= status <= 599:
            return JSONResponse({"error": "status must be an HTTP status code"}, status_code=400)
        if not isinstance(raw, str | None) or (raw is None and status < 400):
            return JSONResponse({"error": "body must be a string, given below 400"}, 400)
        state.fail_status, state.fail_count = status, _count(body)
        state.fail_body = None if raw is None else raw.encode()
        return JSONResponse({"status": status, "count": state.fail_count})

    async def delay(request: Request) -> Response:
        body = await _json_object(request)
        seconds = body.get("seconds", 0.0)
        if not isinstance(seconds, int | float) or seconds < 0:
            return JSONResponse({"error": "seconds must be a non-negative number"}, status_code=400)
        state.delay_s, state.delay_count = float(seconds), _count(body)
        return JSONResponse({"seconds": state.delay_s, "count": state.delay_count})

    async def break_stream(request: Request) -> Response:
        body = await _json_object(request)
        after = body.get("after_tokens", 1)
        if not isinstance(after, int) or after < 1:
            return JSONResponse({"error": "after_tokens must be a positive integer"}, 400)
        state.break_after, state.break_count = after, _count(body)
        return JSONResponse({"after_tokens": after, "count": state.break_count})

    async def reset(request: Request) -> Response:
        fresh = ProviderState()
        for name in state.__dataclass_fields__:
            setattr(state, name, getattr(fresh, name))
        limits.refill()
        return JSONResponse({"reset": True})

    return [
        Route("/sim/stats", stats, methods=["GET"]),
        Route("/sim/fail", fail, methods=["POST"]),
        Route("/sim/delay", delay, methods=["POST"]),
        Route("/sim/break", break_stream, methods=["POST"]),
        Route("/sim/reset", reset, methods=["POST"]),
    ]
