"""Answer from the response cache: an exact match on who asked, which pool, and what.

The key is a SHA-256 of the scope (the tenant's own name, unless the pool's `cache.scope`
names a scope its tenants share), the pool, the endpoint, and the request body normalised:
the model name, `stream`, `stream_options` and `user` dropped, text-only content parts
joined into one string, sampling numbers as floats, `max_tokens` as the effective value.
So one tenant can never read, or detect, another tenant's entries.

Which answers are stored (`cache.store`): `deterministic` (the default) stores only answers
to requests that ask for a reproducible answer, i.e. `temperature` is 0 or a `seed` is
given; `all` stores every answer. Requests for logprobs are never stored. Answers are
recorded from every successful response of the pool (local or overflow), and a hit is
served as JSON or replayed as SSE, whichever the client asked for.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Callable
from typing import Any, ClassVar

import orjson

from gateway.config import CacheSettings, PoolSettings
from gateway.outcome import Outcome
from gateway.overflow import OverflowContext, Served, Usage
from gateway.request import Endpoint, InferenceRequest
from policies.cache.recorder import CompletionRecorder, replay_sse
from policies.cache.store import LocalResponseCache, RedisResponseCache, ResponseCache
from policies.deps import PolicyDeps

IGNORED_KEYS = frozenset({"model", "stream", "stream_options", "user"})
FLOAT_KEYS = ("temperature", "top_p", "presence_penalty", "frequency_penalty")
CACHE_TARGET = "cache"  # the `target` label of tokens served from the cache


def _message(message: dict[str, Any]) -> dict[str, Any]:
    content = message.get("content")
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" for p in content
    ):
        message = {**message, "content": "".join(str(p.get("text", "")) for p in content)}
    return {k: v for k, v in message.items() if v is not None}


def normalised_body(request: InferenceRequest) -> dict[str, Any]:
    body = {k: v for k, v in request.body.items() if k not in IGNORED_KEYS and v is not None}
    body.pop("max_completion_tokens", None)
    body["max_tokens"] = request.max_output_tokens
    for key in FLOAT_KEYS:
        if key in body:
            body[key] = float(body[key])
    messages = body.get("messages")
    if isinstance(messages, list):
        body["messages"] = [_message(m) if isinstance(m, dict) else m for m in messages]
    return body


def cache_key(request: InferenceRequest, *, scope: str) -> str:
    material = {
        "scope": scope,
        "pool": request.pool,
        "endpoint": request.endpoint.value,
        "request": normalised_body(request),
    }
    if request.adapter is not None:  # an adapter's answers are its own
        material["adapter"] = request.adapter
    return hashlib.sha256(orjson.dumps(material, option=orjson.OPT_SORT_KEYS)).hexdigest()


def is_deterministic(request: InferenceRequest) -> bool:
    """temperature 0, or a seed: the client asked for a reproducible answer."""
    body = request.body
    seed = body.get("seed")
    temperature = body.get("temperature")
    return (isinstance(seed, int) and not isinstance(seed, bool)) or temperature == 0


def storable(request: InferenceRequest, settings: CacheSettings) -> bool:
    body = request.body
    if body.get("logprobs") or body.get("top_logprobs"):
        return False
    return settings.store == "all" or is_deterministic(request)


class CachePolicy:
    name: ClassVar[str] = "cache"
    # the cache holds chat and completion text
    endpoints: ClassVar[frozenset[Endpoint]] = frozenset({Endpoint.CHAT, Endpoint.COMPLETIONS})
    serves_elsewhere: ClassVar[bool] = False
    moves_streams: ClassVar[bool] = False

    def __init__(self, settings: CacheSettings, *, store: ResponseCache) -> None:
        self._settings = settings
        self._store = store
        self._writes: set[asyncio.Task[None]] = set()

    @classmethod
    def build(cls, pool: PoolSettings, deps: PolicyDeps) -> CachePolicy:
        s = pool.cache
        store: ResponseCache
        if deps.redis is not None:
            store = RedisResponseCache(
                deps.redis, namespace=pool.name, max_entries=s.max_entries, ttl_s=s.ttl_s
            )
        else:
            store = LocalResponseCache(max_entries=s.max_entries, ttl_s=s.ttl_s, clock=deps.clock)
        return cls(s, store=store)

    def key(self, request: InferenceRequest) -> str:
        return cache_key(request, scope=self._settings.scope or "tenant:" + request.tenant)

    def recorder_for(self, request: InferenceRequest) -> CompletionRecorder | None:
        """A recorder for the answer to `request`, if that answer may be stored."""
        if not storable(request, self._settings):
            return None
        # the key and the document are worked out only once an answer is complete, after
        # the response has been handed on: the client does not wait for the cache
        return CompletionRecorder(
            endpoint=request.endpoint,
            stream=request.stream,
            max_bytes=self._settings.max_entry_bytes,
            on_answer=lambda body: self._write(self.key(request), body),
            defer=_soon,
        )

    def _write(self, key: str, body: bytes) -> None:
        task = asyncio.get_running_loop().create_task(self._store.put(key, body))
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)

    async def decide(self, request: InferenceRequest, exchange: OverflowContext) -> Served | None:
        if not storable(request, self._settings):
            return None
        raw = await self._store.get(self.key(request))
        if raw is None:
            return None
        if request.stream:
            doc = orjson.loads(raw)
            relayed = await exchange.send_events(
                replay_sse(doc, include_usage=request.client_wants_usage),
                outcome=Outcome.CACHED,
                usage=Usage.from_json(doc.get("usage")),
            )
        else:
            relayed = await exchange.send_json(raw, status=200, outcome=Outcome.CACHED)
        return Served(
            outcome=Outcome.CACHED, target=CACHE_TARGET, pool=request.pool, relayed=relayed
        )


def _soon(work: Callable[[], None]) -> None:
    asyncio.get_running_loop().call_soon(work)
