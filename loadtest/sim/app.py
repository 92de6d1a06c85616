"""The simulated vLLM replica as an ASGI app: OpenAI routes over one continuous-batching engine.

The completion routes are in loadtest/sim/completions.py, the other APIs in apis.py and
responses.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import httpx
import orjson
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.admission.prompt_tokens import PromptTokenizer
from loadtest.sim.apis import EmbeddingsEndpoint, json_body, unsupported
from loadtest.sim.completions import CompletionsEndpoint
from loadtest.sim.config import KvTransfer, ResolvedSim, SimConfig, resolve
from loadtest.sim.engine import Engine, LiveSequence
from loadtest.sim.kv_events import EventLog, Publisher
from loadtest.sim.kv_transfer import (
    ENGINE_ROUTE,
    KvConnector,
    ParamsConnector,
    SharedStorageConnector,
)
from loadtest.sim.lengths import DEFAULT_VOCAB_SIZE, AnswerLengths, LengthSampler
from loadtest.sim.lora import Adapters, LoraRoutes
from loadtest.sim.metrics import SimMetrics
from loadtest.sim.protocol import Limits, SimRequestError, tokenized
from loadtest.sim.responses import ResponsesEndpoint
from loadtest.sim.scheduler import Scheduler, SchedulerLimits
from loadtest.sim.shutdown import RefuseWhileStopping, Shutdown
from loadtest.sim.tokens import FillerText
from loadtest.sim.wire import Kind


def _models_body(
    config: SimConfig, resolved: ResolvedSim, adapters: Adapters | None
) -> dict[str, Any]:
    """vLLM's model list: the base model, then each adapter with its path as `root` and the
    base model as `parent` (an adapter's card has no `max_model_len`)."""
    created = int(time.time())
    permission = {
        "id": "modelperm-sim",
        "object": "model_permission",
        "created": created,
        "allow_create_engine": False,
        "allow_sampling": True,
        "allow_logprobs": True,
        "allow_search_indices": False,
        "allow_view": True,
        "allow_fine_tuning": False,
        "organization": "*",
        "group": None,
        "is_blocking": False,
    }
    model = {
        "id": config.model,
        "object": "model",
        "created": created,
        "owned_by": "vllm",
        "root": config.model,
        "parent": None,
        "max_model_len": resolved.max_model_len,
        "permission": [permission],
    }
    cards = [
        {
            **model,
            "id": adapter.name,
            "root": adapter.path,
            "parent": config.model,
            "max_model_len": None,
        }
        for adapter in adapters or ()
    ]
    return {"object": "list", "data": [model, *cards]}


class Unsupported:
    """An API the replica's model does not serve (an ASGI app: Starlette would take a
    plain function for a request handler)."""

    def __init__(self, api: str) -> None:
        self._api = api

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await unsupported(send, self._api)


def _api_routes(
    config: SimConfig,
    *,
    limits: Limits,
    engine: Engine,
    filler: FillerText,
    endpoint: Callable[[Kind], CompletionsEndpoint],
) -> list[Route]:
    """The OpenAI routes: an embedding model serves /v1/embeddings and refuses the rest, a
    generating one the reverse, each refusal vLLM's 400."""

    paths = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/embeddings")
    apis = ("Chat Completions API", "Completions API", "Responses API", "Embeddings API")
    apps: list[ASGIApp] = [Unsupported(api) for api in apis]
    if config.embedding_dim is not None:
        apps[3] = EmbeddingsEndpoint(
            limits=limits, dim=config.embedding_dim, engine=engine, no_delay=config.no_delay
        )
    else:
        apps[:3] = [
            endpoint(Kind.CHAT),
            endpoint(Kind.COMPLETION),
            ResponsesEndpoint(limits=limits, engine=engine, filler=filler),
        ]
    return [Route(path, app, methods=["POST"]) for path, app in zip(paths, apps, strict=True)]


@dataclass(frozen=True, kw_only=True)
class SimReplica:
    """A replica's app, and what its server calls on SIGTERM (loadtest/sim/shutdown.py)."""

    app: Starlette
    shutdown: Shutdown


def create_sim_app(config: SimConfig) -> Starlette:
    """One simulated vLLM replica; its engine loop runs for the app's lifespan."""
    return create_sim_replica(config).app


def create_sim_replica(config: SimConfig) -> SimReplica:
    """The replica of `create_sim_app`, with its `Shutdown` for the server to call."""
    resolved = resolve(config)
    adapters = _adapters(config)
    events = EventLog(resolved.block_size) if config.kv_events_port is not None else None
    scheduler: Scheduler[LiveSequence] = Scheduler(
        SchedulerLimits(
            num_blocks=resolved.num_blocks,
            block_size=resolved.block_size,
            max_num_seqs=resolved.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            prefix_caching=config.enable_prefix_caching,
            max_loras=config.max_loras if adapters is not None else 0,
            kv_connector=config.kv_transfer is not None,
        ),
        events=events,
    )
    metrics = SimMetrics(config=config, resolved=resolved, scheduler=scheduler)
    engine = Engine(
        scheduler=scheduler,
        step_cost=resolved.step_cost,
        speed=config.speed,
        flush_interval_s=config.flush_interval_s,
        on_first_token=metrics.observe_ttft,
        on_finished=metrics.observe_generated,
        on_step=None if metrics.lora is None else metrics.lora.observe_step,
    )
    capped = config.answer_lengths is AnswerLengths.MAX_TOKENS
    limits = Limits(
        model=config.model,
        max_model_len=resolved.max_model_len,
        default_max_tokens=config.default_max_tokens if capped else None,
        tokenizer=None if config.tokenizer is None else PromptTokenizer(config.tokenizer),
        adapters=adapters,
    )
    lengths = LengthSampler(
        mode=config.answer_lengths,
        mean_tokens=config.answer_mean_tokens,
        sigma=config.answer_sigma,
        vocab_size=config.vocab_size or DEFAULT_VOCAB_SIZE,
        rng=random.Random(config.seed),
    )
    filler = FillerText()
    engine_id = config.engine_id or str(uuid.uuid4())  # vLLM's default: a random one
    # the decoder's side of the params handshake; closed with the app
    client = httpx.AsyncClient(timeout=httpx.Timeout(5.0), trust_env=False)
    connector = _connector(
        config, engine_id=engine_id, block_size=resolved.block_size, client=client
    )
    shutdown = Shutdown(engine=engine, timeout_s=config.shutdown_timeout_s)
    models = [orjson.dumps(_models_body(config, resolved, adapters))]

    def models_changed() -> None:
        models[0] = orjson.dumps(_models_body(config, resolved, adapters))

    def endpoint(kind: Kind) -> CompletionsEndpoint:
        return CompletionsEndpoint(
            kind=kind,
            config=config,
            limits=limits,
            engine=engine,
            filler=filler,
            lengths=lengths,
            connector=connector,
            on_fatal=shutdown.engine_died,
        )

    async def list_models(request: Request) -> Response:
        return Response(models[0], media_type="application/json")

    async def health(request: Request) -> Response:
        return Response(b"", status_code=200)

    async def tokenize(request: Request) -> Response:
        try:
            ids = tokenized(json_body(await request.body()))
        except SimRequestError as exc:
            error = {"message": exc.message, "type": exc.error_type, "param": exc.param}
            return JSONResponse({"error": {**error, "code": exc.status}}, status_code=exc.status)
        body = {"count": len(ids), "max_model_len": limits.max_model_len, "tokens": ids}
        return Response(orjson.dumps(body), media_type="application/json")

    async def reset_prefix_cache(request: Request) -> Response:
        # vLLM's (with VLLM_SERVER_DEV_MODE=1): refused while sequences hold blocks
        done = scheduler.pool.reset()
        return Response(b"", status_code=200 if done else 400)

    async def kv_engine(request: Request) -> Response:
        # the NIXL side channel's handshake, as far as a decoder needs it
        return Response(orjson.dumps({"engine_id": engine_id}), media_type="application/json")

    async def metrics_endpoint(request: Request) -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def not_found(request: Request, exc: Exception) -> Response:
        body = {
            "error": {"message": "Not Found", "type": "NotFoundError", "param": None, "code": 404}
        }
        return JSONResponse(body, status_code=404)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        task = asyncio.create_task(engine.run(), name=f"sim-engine:{config.model}")
        publisher = None if events is None else _publisher(config, events)
        published = None if publisher is None else asyncio.create_task(publisher.run())
        try:
            yield
        finally:
            engine.close()
            for running in (task, published):
                if running is not None:
                    running.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await running
            if publisher is not None:
                publisher.close()
            await client.aclose()

    routes = [
        *_api_routes(config, limits=limits, engine=engine, filler=filler, endpoint=endpoint),
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/metrics", metrics_endpoint, methods=["GET"]),
        Route("/reset_prefix_cache", reset_prefix_cache, methods=["POST"]),
    ]
    if config.kv_transfer is KvTransfer.PARAMS:
        routes.append(Route(ENGINE_ROUTE, kv_engine, methods=["GET"]))
    if adapters is not None and config.allow_runtime_lora_updating:
        lora = LoraRoutes(
            config=config, adapters=adapters, hold=engine.hold, changed=models_changed
        )
        routes += lora.routes()
    app = Starlette(
        routes=routes,
        lifespan=lifespan,
        exception_handlers={404: not_found},
        middleware=[Middleware(RefuseWhileStopping, shutdown=shutdown)],
    )
    return SimReplica(app=app, shutdown=shutdown)


def _connector(
    config: SimConfig, *, engine_id: str, block_size: int, client: httpx.AsyncClient
) -> KvConnector | None:
    if config.kv_transfer is KvTransfer.PARAMS:
        return ParamsConnector(engine_id=engine_id, block_size=block_size, client=client)
    if config.kv_transfer is KvTransfer.SHARED:
        assert config.kv_shared_path is not None
        return SharedStorageConnector(
            path=config.kv_shared_path, model=config.model, block_size=block_size
        )
    return None


def _adapters(config: SimConfig) -> Adapters | None:
    if not config.enable_lora:
        return None
    return Adapters(
        base_model=config.model,
        modules=config.lora_modules,
        runtime_updating=config.allow_runtime_lora_updating,
    )


def _publisher(config: SimConfig, events: EventLog) -> Publisher:
    port = config.kv_events_port
    assert port is not None
    return Publisher(
        events,
        host="127.0.0.1",
        port=port,
        replay_port=port + 1,
        drop_every=config.kv_events_drop_every,
    )
