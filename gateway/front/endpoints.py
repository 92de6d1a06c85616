"""POST /v1/embeddings and POST /v1/responses: the completions pipeline, with the overflow
steps that make sense for them, and (responses) continuations sent where they are stored.

Both take the same way as a completion (parse, authenticate, throttle, admit by tokens,
overflow, forward, release, record). What differs:

- an embedding's overflow chain keeps `queue`, `provider` and `reject`: `degrade` would
  answer with another model's vectors and the response cache holds chat and completion
  text, so an embedding pool's config may not name them (`serve --check` refuses it);
- a response's chain keeps `queue` and `reject`: `degrade` would answer with another model
  that holds none of this one's stored responses, the cache holds chat and completion
  text, and a chat pool's provider may not serve the Responses API at all (its 404 would
  count against the provider's breaker, and so against the pool's chat spills);
- a Responses request with `previous_response_id` goes only to the backend that answered
  that response (gateway/front/response_homes.py) and waits for room there through `queue`; an
  id no backend of the pool answered gets vLLM's 404, one whose backend is out of rotation
  a 503 (`backend_unavailable`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Collection
from typing import TYPE_CHECKING

from gateway.admission.ledger import Reservation
from gateway.errors import BackendUnavailable, InvalidRequest
from gateway.front.exchange import Exchange, Served
from gateway.front.pipeline import CompletionsEndpoint, PipelineDeps
from gateway.front.response_homes import ResponseHomes, ResponseIdRecorder
from gateway.request import Endpoint, InferenceRequest

if TYPE_CHECKING:
    from gateway.front.trace import RequestTrace

# the overflow steps that can serve an embedding, and a response
EMBEDDING_POLICIES = frozenset({"queue", "provider", "reject"})
RESPONSE_POLICIES = frozenset({"queue", "reject"})
# the longest response id the gateway remembers (gateway/front/response_homes.py)
MAX_RESPONSE_ID = 205


class ResponseNotFound(InvalidRequest):
    status = 404
    code = "response_not_found"


def _only(deps: PipelineDeps, policies: frozenset[str]) -> PipelineDeps:
    """`deps` with each pool's chain cut to `policies`, and no answer recorders (the cache's)."""
    chains = {pool: [p for p in chain if p.name in policies] for pool, chain in deps.chains.items()}
    return dataclasses.replace(deps, chains=chains, recorders={})


class EmbeddingsEndpoint(CompletionsEndpoint):
    """POST /v1/embeddings, for pools of `kind: embedding`."""

    def __init__(self, deps: PipelineDeps) -> None:
        super().__init__(Endpoint.EMBEDDINGS, _only(deps, EMBEDDING_POLICIES))


class PinnedExchange(Exchange):
    """An exchange whose reservations (admission, queue, retry) avoid `others`: every
    backend of the pool but the one a continuation must go to."""

    __slots__ = ("others",)

    def __init__(
        self, exchange: Exchange, *, recorder: ResponseIdRecorder, others: frozenset[str]
    ) -> None:
        super().__init__(
            send=exchange.send,
            headers=exchange.base_headers,
            router=exchange.router,
            forwarder=exchange.forwarder,  # already traced when the request is
            metrics=exchange.metrics,
            clock=exchange.clock,
            holding=exchange.holding,
            recorder=recorder,
        )
        self.timings = exchange.timings
        self.others = others

    def reserve(
        self, request: InferenceRequest, *, exclude: Collection[str] = (), running: bool = False
    ) -> Awaitable[Reservation | None]:
        return super().reserve(request, exclude=self.others.union(exclude), running=running)


class ResponsesEndpoint(CompletionsEndpoint):
    """POST /v1/responses, for chat pools; remembers which backend answered each response."""

    # the first try for room must know the backend holding the previous response
    admit_early = False

    def __init__(self, deps: PipelineDeps, *, homes: ResponseHomes) -> None:
        super().__init__(Endpoint.RESPONSES, _only(deps, RESPONSE_POLICIES))
        self._homes = homes

    async def _dispatch(
        self,
        request: InferenceRequest,
        exchange: Exchange,
        *,
        admitted: bool | None = None,
        trace: RequestTrace | None = None,
        arrived: float = 0.0,
    ) -> Served:
        previous = request.body.get("previous_response_id")
        others = frozenset[str]()
        if isinstance(previous, str):
            others = await self._elsewhere(request.pool, previous)
        recorder = ResponseIdRecorder(self._homes, exchange.holding)
        pinned = PinnedExchange(exchange, recorder=recorder, others=others)
        try:
            served = await super()._dispatch(request, pinned, trace=trace, arrived=arrived)
        finally:
            exchange.prediction = pinned.prediction
        await recorder.shared()
        return served

    async def _elsewhere(self, pool: str, previous: str) -> frozenset[str]:
        """The backends of `pool` a continuation of `previous` must avoid: all but the one
        that answered it. An id none of them answered (never relayed here, relayed from
        another pool) is vLLM's 404; one whose backend is out of rotation, a 503."""
        home = None
        if len(previous) <= MAX_RESPONSE_ID:
            home = await self._homes.backend_of(previous)
        names = frozenset(b.name for b in self._d.router.pools[pool].backends)
        if home is None or home not in names:
            shown = previous if len(previous) <= MAX_RESPONSE_ID else previous[:MAX_RESPONSE_ID]
            raise ResponseNotFound(
                f"Response with id '{shown}' not found.", param="previous_response_id"
            )
        backend = self._d.router.backend(home)
        if not backend.healthy(self._d.clock.monotonic()):
            # out of rotation for now; once back, it answers for itself (a 404 if it
            # restarted and lost its responses)
            raise BackendUnavailable(
                f"The backend that holds response '{previous}' ({backend.name}) is "
                f"unavailable: {backend.down_reason}."
            )
        return names - {home}
