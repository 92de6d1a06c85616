"""The prefill leg: in a pool with prefill backends (`role: prefill`), a request's prompt is
computed on one of them before the decode backend it was admitted on serves its answer.

Admission reserves on the decode backend first (routing picks it as for any request: the
prefix it caches, its fill). Then the split is decided: a prompt with fewer than
`prefill.min_prompt_tokens` tokens not already cached on that backend goes to it alone (a
short prefill costs less there than a second leg); so does one no prefill backend in rotation
has room for. Otherwise the prompt is reserved on the least filled prefill backend for the
leg's length only, and sent there as vLLM's disaggregated proxies send it: not streamed,
one output token, the same `x-request-id` as the decode leg. With `kv_transfer: params`
(vLLM's NixlConnector and the connectors like it) the prefill leg asks the engine to keep the
prompt's KV for a remote decode, and its answer's `kv_transfer_params` go into the decode
leg's body: the decode engine loads the blocks from there. With `kv_transfer: shared` (vLLM's
ExampleConnector, LMCache) nothing is handed on: both engines read a store keyed by the
prompt's tokens.

A prefill leg that fails, is refused or answers without what the decode leg needs is never
the client's failure: the decode backend prefills the prompt itself, as it does for a short
prompt, and the prefill backend's failure counts against its health like any other.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import orjson

from gateway.admission.fleet.backends import Backend
from gateway.admission.ledger.reservations import Reservation
from gateway.admission.routing.route import Route
from gateway.admission.routing.router import Router
from gateway.clock import Clock
from gateway.errors import UpstreamUnavailable
from gateway.metrics import GatewayMetrics
from gateway.request import KV_TRANSFER_FIELD, Endpoint, InferenceRequest
from gateway.upstream.forward import Forwards
from gateway.upstream.usage import checked_usage

# where vLLM's disaggregated proxies split a request; a Responses request is served whole
SPLIT_ENDPOINTS = frozenset({Endpoint.CHAT, Endpoint.COMPLETIONS})
# what a prefill leg asks a NixlConnector-style engine for: keep the prompt's KV for a decode
# elsewhere, whose engine is not known yet (vLLM's toy_proxy_server sends the same)
REMOTE_DECODE = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
# a prefill answer's `kv_transfer_params` goes on to the decode engine: one larger than this
# (a block id per block of the longest prompts is a few tens of kB) is no engine's
MAX_PARAMS_BYTES = 1 << 20
# what a prefill leg must not carry: it streams nothing, and generates its one token
DROPPED_FIELDS = ("stream_options", "min_tokens")
REQUEST_ID_HEADER = "x-request-id"


class Split(StrEnum):
    """What became of a request in a pool with prefill backends (the metric's `decision`)."""

    SPLIT = "split"  # prefilled on a prefill backend, decoded on its own
    SHORT = "short"  # too few tokens to compute that its decode backend does not cache
    NO_ROOM = "no_room"  # no prefill backend in rotation with room for its prompt
    FAILED = "failed"  # its prefill leg failed: decoded alone
    WHOLE = "whole"  # served whole by its nature: an adapter, several choices, Responses


@dataclass(frozen=True, slots=True)
class DecodeLeg:
    """What the decode leg sends: the request (with the prefill's `kv_transfer_params`
    where the pool hands them on) and the headers it shares with its prefill leg."""

    request: InferenceRequest
    split: Split
    headers: dict[str, str] | None = None
    prefill_s: float | None = None  # how long its prefill leg took, where one ran


def prefill_body(body: dict[str, Any], *, kv_transfer: str) -> dict[str, Any]:
    """A request's body as its prefill leg sends it."""
    leg = {k: v for k, v in body.items() if k not in DROPPED_FIELDS}
    leg["stream"] = False
    leg["max_tokens"] = 1
    if "max_completion_tokens" in leg:
        leg["max_completion_tokens"] = 1
    if kv_transfer == "params":
        leg[KV_TRANSFER_FIELD] = dict(REMOTE_DECODE)
    return leg


def handed_on(answer: dict[str, Any]) -> dict[str, Any] | None:
    """The `kv_transfer_params` of a prefill answer, where they are an object of a sane size
    (vLLM sends them only when the leg stopped at its one token)."""
    params = answer.get(KV_TRANSFER_FIELD)
    if not isinstance(params, dict) or len(orjson.dumps(params)) > MAX_PARAMS_BYTES:
        return None
    return params


class PrefillLeg:
    """Decides whether a request admitted in a pool with prefill backends is split, and runs
    its prefill leg when it is."""

    def __init__(
        self, *, router: Router, forwarder: Forwards, metrics: GatewayMetrics, clock: Clock
    ) -> None:
        self._router = router
        self._forwarder = forwarder
        self._metrics = metrics
        self._clock = clock

    async def run(
        self, request: InferenceRequest, reservation: Reservation, *, deadline: float
    ) -> DecodeLeg:
        """The decode leg of `request`, admitted on `reservation`: after a prefill leg where
        the pool's rule splits it, else the request as it came."""
        leg = await self._decide(request, reservation, deadline=deadline)
        self._metrics.prefill_decisions.labels(request.pool, leg.split.value).inc()
        return leg

    async def _decide(
        self, request: InferenceRequest, reservation: Reservation, *, deadline: float
    ) -> DecodeLeg:
        if request.endpoint not in SPLIT_ENDPOINTS or request.n != 1 or request.adapter:
            return DecodeLeg(request, Split.WHOLE)
        router = self._router
        settings = router.pools[request.pool].settings.prefill
        uncached = request.prompt_tokens - router.cached_tokens(reservation)
        if uncached < settings.min_prompt_tokens:
            return DecodeLeg(request, Split.SHORT)
        route = Route(
            request.pool,
            request.prompt_tokens + 1,
            prefix=request.prefix,
            session=request.session,
            token_ids=request.token_ids,
            prefill=True,
        )
        held = await router.reserve(route)
        if held is None:
            return DecodeLeg(request, Split.NO_ROOM)
        prefiller = router.backend(held.backend)
        headers = {REQUEST_ID_HEADER: secrets.token_hex(16)}
        leg = request._replace(
            stream=False,
            max_output_tokens=1,
            body=prefill_body(request.body, kv_transfer=settings.kv_transfer),
        )
        started = self._clock.monotonic()
        try:
            answer = await self._forwarder.prefill(
                router.target(prefiller.name), leg, deadline=deadline, upstream_headers=headers
            )
        except UpstreamUnavailable as exc:
            if not _refuses_the_request(exc.status):
                self._failed(prefiller, exc.reason, unreachable=exc.unreachable)
            return DecodeLeg(request, Split.FAILED)
        finally:
            await router.release(held)
        took = self._clock.monotonic() - started
        self._count_prompt(prefiller, leg, answer)
        if settings.kv_transfer == "shared":
            prefiller.record_success(self._clock.monotonic())
            return DecodeLeg(request, Split.SPLIT, headers, took)
        params = handed_on(answer)
        if params is None:
            # vLLM hands none on when the one token ended the answer; one that stopped at it
            # and hands none on has no connector, or a broken one: a failure of the backend
            if _stopped_by_length(answer):
                self._failed(prefiller, "no kv_transfer_params", unreachable=None)
            return DecodeLeg(request, Split.FAILED)
        prefiller.record_success(self._clock.monotonic())
        body = {**request.body, KV_TRANSFER_FIELD: params}
        return DecodeLeg(request._replace(body=body), Split.SPLIT, headers, took)

    def _failed(self, prefiller: Backend, reason: str, *, unreachable: str | None) -> None:
        now = self._clock.monotonic()
        prefiller.record_failure(now, reason=reason, unreachable=unreachable)
        self._metrics.upstream_errors.labels(prefiller.name, reason.split(":")[0]).inc()

    def _count_prompt(self, prefiller: Backend, leg: InferenceRequest, answer: Any) -> None:
        """The prompt tokens the prefill backend computed for `leg`, as its usage tells
        within bounds."""
        usage, _ = checked_usage(answer.get("usage"), leg, events=None)
        if usage.known:
            self._metrics.tokens.labels(prefiller.name, "prompt").inc(usage.prompt_tokens)


def _refuses_the_request(status: int | None) -> bool:
    """A 4xx (not 429) refuses what the client sent, which the decode leg will be told too: no
    failure of the backend, or a client could take prefill backends out of rotation."""
    return status is not None and 400 <= status < 500 and status != 429


def _stopped_by_length(answer: dict[str, Any]) -> bool:
    choices = answer.get("choices")
    first = choices[0] if isinstance(choices, list) and choices else None
    return isinstance(first, dict) and first.get("finish_reason") == "length"
