"""Prepare: the request finished once, before anything is charged or reserved for it.

Its body is parsed (gateway/front/parse.py) for the pool its model names, and the request
is completed with what the later stages read from it and never change: the output it
reserves (the pool's expected output, gateway/admission/fleet/output_lengths.py), the prompt
blocks it may share with requests in flight (reserved once where they are held; its prompt
is keyed once, for these and for prefix routing), where its prefix is cached (prefix
routing), whether it may wait as a batch, its objectives, and, for a Responses
continuation, the one backend it may go to. For a pool whose backends publish KV events,
one awaited step more: the prompt's token ids (`tokenized`), whose blocks then replace
those guessed from its bytes.
"""

from __future__ import annotations

from collections.abc import Mapping

from gateway.admission.fleet.backends import Pool
from gateway.admission.ledger.holders import byte_blocks, token_blocks
from gateway.admission.prompt_tokens import prompt_token_ids
from gateway.admission.routing.prefix_index import block_keys, prompt_bytes
from gateway.admission.routing.router import Router
from gateway.clock import Clock
from gateway.errors import BackendUnavailable, InvalidRequest, ModelNotFound
from gateway.front.auth import Tenant
from gateway.front.parse import decode_body, names_max_tokens, parse_request, requested_model
from gateway.front.request import check_pool_kind, effective_priority, header_text, slo_seconds
from gateway.front.response_homes import ResponseHomes
from gateway.request import (
    BATCHABLE_HEADER,
    PRIORITY_HEADER,
    SESSION_HEADER,
    TPOT_HEADER,
    TTFT_HEADER,
    Endpoint,
    InferenceRequest,
)

PRIORITY_HEADER_BYTES = PRIORITY_HEADER.encode()
BATCHABLE_HEADER_BYTES = BATCHABLE_HEADER.encode()
SESSION_HEADER_BYTES = SESSION_HEADER.encode()
TTFT_HEADER_BYTES = TTFT_HEADER.encode()
TPOT_HEADER_BYTES = TPOT_HEADER.encode()
# the longest response id the gateway remembers (gateway/front/response_homes.py)
MAX_RESPONSE_ID = 205


class ResponseNotFound(InvalidRequest):
    status = 404
    code = "response_not_found"


class Preparer:
    def __init__(self, endpoint: Endpoint, *, router: Router, clock: Clock) -> None:
        self._endpoint = endpoint
        self._router = router
        self._clock = clock

    def request(
        self, tenant: Tenant, fields: Mapping[bytes, bytes], raw: bytes
    ) -> InferenceRequest:
        """The finished request `tenant` sent in `raw`, with the headers `fields`."""
        body = decode_body(raw)
        model = requested_model(body)
        pool = self._pool(tenant, model)
        request = parse_request(
            body,
            endpoint=self._endpoint,
            tenant=tenant.name,
            pool=pool.name,
            priority=effective_priority(
                tenant.priority, header_text(fields, PRIORITY_HEADER_BYTES)
            ),
            default_max_tokens=pool.settings.default_max_tokens,
            max_model_len=pool.max_model_len,
            chars_per_token=pool.estimator.chars_per_token,
            model_context=pool.model_context,
        )
        if model != pool.name:
            request = request._replace(adapter=model)
        # keyed where routing has a choice, or where a pool that splits prefill from decode
        # asks how much of the prompt its decode backend caches (gateway/front/prefill.py)
        by_prefix = pool.by_prefix and (len(pool.backends) > 1 or bool(pool.prefillers))
        request, routed = self._keyed(request, pool, by_prefix=by_prefix)
        request = self._expect(request, pool)
        if by_prefix:
            request = self._locate(request, fields, routed)
        if tenant.batchable or fields.get(BATCHABLE_HEADER_BYTES) == b"true":
            request = request._replace(batchable=True)
        return self._objectives(request, tenant, fields)

    def _pool(self, tenant: Tenant, model: str) -> Pool:
        """The pool serving `model`: a pool's own name, or one of its LoRA adapters'. A
        model the tenant may not use does not exist, as far as it is told."""
        pool = self._router.pools.get(model) or self._router.adapters.get(model)
        if pool is None or not tenant.may_use(pool.name):
            raise ModelNotFound(f"The model {model!r} does not exist.", param="model")
        if model != pool.name:  # an adapter: most requests name the pool's model
            self._check_adapter(tenant, pool, model)
        check_pool_kind(pool.settings.kind, self._endpoint, model)
        return pool

    @staticmethod
    def _check_adapter(tenant: Tenant, pool: Pool, model: str) -> None:
        """Refuse the adapter `model` of `pool` where `tenant` may not use it, or where no
        backend serves it now and it cannot be loaded (it has no `path`)."""
        if not pool.may_serve(model, tenant.name):
            raise ModelNotFound(f"The model {model!r} does not exist.", param="model")
        if not pool.serves(model) and pool.adapter(model).path is None:
            raise BackendUnavailable(
                f"No backend of pool {pool.name!r} serves the adapter {model!r} now.",
                # the backends' listings are read again this often (FleetWatcher)
                retry_after=pool.settings.capacity_refresh_s,
            )

    @staticmethod
    def _keyed(
        request: InferenceRequest, pool: Pool, *, by_prefix: bool
    ) -> tuple[InferenceRequest, tuple[bytes, ...]]:
        """`request` with the blocks it may share with requests in flight (`shared`), and
        its prompt's keys at the block size prefix routing places it by: its prompt is
        keyed once per block size, for both, and only where one of them wants it."""
        sizes = pool.shared_block_sizes if request.n == 1 else frozenset()
        prompted = request.endpoint is Endpoint.CHAT or request.endpoint is Endpoint.COMPLETIONS
        if not (prompted and (by_prefix or sizes)):
            return request, ()
        prompt = prompt_bytes(request.body)
        routed = pool.backends[0].block_size
        keys = {
            size: block_keys(prompt, block_size=size, adapter=request.adapter)
            for size in ({routed, *sizes} if by_prefix else sizes)
        }
        shared = [
            byte_blocks(
                keys[size],
                prompt_bytes=len(prompt),
                prompt_tokens=request.prompt_tokens,
                block_size=size,
            )
            for size in sizes
        ]
        request = request._replace(shared=tuple(blocks for blocks in shared if blocks.keys))
        return request, keys.get(routed, ())

    def _expect(self, request: InferenceRequest, pool: Pool) -> InferenceRequest:
        """`request` with the output it reserves: the smaller of its cap (max_tokens, or
        what the context leaves when it names none) and the pool's expected output; for a
        stream, what it is expected to hold at its peak, and the headroom it keeps as it
        grows (gateway/admission/fleet/output_lengths.py).

        A request that is not streamed cannot grow its reservation as it goes; it reserves
        its whole expected output, and the backends' reported KV use
        (gateway/admission/fleet/backend_load.py) covers an answer longer than that within a scrape.

        What a stream holds of its own, and so how many such streams a backend holds at once
        (its share of their spread), leaves out the prompt blocks that requests in flight
        already hold: those stay held when it ends.
        """
        if pool.settings.reservation.mode == "max_tokens" or not request.max_output_tokens:
            return request  # the whole of max_tokens (or the pool's default); embeddings: 0
        if names_max_tokens(request.body):
            cap = request.max_output_tokens
        else:
            cap = max(1, pool.max_model_len - request.prompt_tokens)
        reserve = pool.outputs.reserve_output(
            tenant=request.tenant,
            cap=cap,
            room=self._router.room(pool.name),
            prompt_tokens=request.prompt_tokens
            - self._router.shared_in_flight(request.pool, request.shared),
            streaming=request.stream,
        )
        return request._replace(output_reserve=reserve.output, headroom=reserve.headroom)

    @staticmethod
    def _locate(
        request: InferenceRequest, fields: Mapping[bytes, bytes], keys: tuple[bytes, ...]
    ) -> InferenceRequest:
        """`request` with what prefix routing places it by: `keys`, those of its prompt's
        leading blocks, and its session (the header, else the body's `user`), within its
        tenant."""
        session = header_text(fields, SESSION_HEADER_BYTES)
        user = request.body.get("user")
        if session is None and isinstance(user, str) and user:
            session = user
        return request._replace(
            prefix=keys,
            session=None if session is None else f"{request.tenant}\0{session}",
        )

    async def tokenized(self, request: InferenceRequest) -> InferenceRequest:
        """`request` with its prompt as the engine's token ids (gateway/admission/
        prompt_tokens.py: new text past a few hundred characters is tokenized off the event
        loop): what the KV-events index matches, the prompt's exact size, and the blocks it
        shares exactly as the engine keys them, in place of those guessed from its bytes."""
        pool = self._router.pools[request.pool]
        token_ids = await prompt_token_ids(request.body, pool.tokenizer)
        if not token_ids:  # not tokenized as the engine would: the guesses stand
            return request
        shared = [
            token_blocks(token_ids, block_size=s.block_tokens, adapter=request.adapter)
            for s in request.shared
        ]
        return request._replace(
            token_ids=token_ids,
            prompt_tokens=len(token_ids),
            shared=tuple(s for s in shared if s.keys),
        )

    @staticmethod
    def _objectives(
        request: InferenceRequest, tenant: Tenant, fields: Mapping[bytes, bytes]
    ) -> InferenceRequest:
        """`request` with its TTFT and TPOT objectives: its headers', else its tenant's."""
        ttft = header_text(fields, TTFT_HEADER_BYTES)
        tpot = header_text(fields, TPOT_HEADER_BYTES)
        if ttft is None and tpot is None and tenant.ttft_budget_s is tenant.tpot_budget_s is None:
            return request  # the common case: no objective at all
        return request._replace(
            ttft_slo_s=slo_seconds(ttft, TTFT_HEADER, tenant.ttft_budget_s),
            tpot_slo_s=slo_seconds(tpot, TPOT_HEADER, tenant.tpot_budget_s),
        )

    async def pinned(self, request: InferenceRequest, homes: ResponseHomes) -> InferenceRequest:
        """A Responses request that continues `previous_response_id`, kept to the backend
        that answered it: every other backend of the pool is one it avoids. An id none of
        them answered (never relayed here, relayed from another pool) is vLLM's 404; one
        whose backend is out of rotation, a 503."""
        previous = request.body.get("previous_response_id")
        if not isinstance(previous, str):
            return request
        home = None
        if len(previous) <= MAX_RESPONSE_ID:
            home = await homes.backend_of(previous)
        names = frozenset(b.name for b in self._router.pools[request.pool].backends)
        if home is None or home not in names:
            shown = previous if len(previous) <= MAX_RESPONSE_ID else previous[:MAX_RESPONSE_ID]
            raise ResponseNotFound(
                f"Response with id '{shown}' not found.", param="previous_response_id"
            )
        backend = self._router.backend(home)
        if not backend.healthy(self._clock.monotonic()):
            # out of rotation for now; once back, it answers for itself (a 404 if it
            # restarted and lost its responses)
            raise BackendUnavailable(
                f"The backend that holds response '{previous}' ({backend.name}) is "
                f"unavailable: {backend.down_reason}."
            )
        return request._replace(avoid=names - {home})
