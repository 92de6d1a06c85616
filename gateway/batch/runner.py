"""The batch runner: one background task per process that runs batch items on spare room.

An item runs only while its pool's fill, counting the item, stays at or below
`batch.max_fill`; it is admitted as the lowest class (`sheddable`) and never waits or
spills: with no room, it goes back to its batch and is tried again on a later pass. So
interactive traffic is never preempted, and takes the room back as soon as batch items
already running end. Each item goes through the same pipeline as an interactive request
(throttle, reserve on the router, forward, release on every path, settle the tenant's
bucket with the real usage), under the tenant that made the batch.

Before it runs an item the process claims it in the store, so that of several processes
sharing a store one runs it; a process that dies holding a claim loses it after
`batch.claim_ttl_s`, and the item runs again elsewhere.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
from collections.abc import Mapping
from typing import Any

import orjson
from starlette.types import Message, Scope

from gateway.batch.service import ACTIVE, BATCH, Batches, results_kind
from gateway.batch.store import Record
from gateway.front.auth import Authenticator, Tenant
from gateway.front.pipeline import EndpointRules, Pipeline, PipelineDeps
from gateway.overflow import LetsIn
from gateway.request import Endpoint, InferenceRequest
from gateway.tasks import Periodic, stop_task

log = logging.getLogger("spillgate.batch")
RETRY_LATER = (429, 503)  # no room, or the tenant's budget is spent for now: run it later


class _OneTenant(Authenticator):
    """The batch's tenant, whatever the (absent) Authorization header says."""

    def __init__(self, tenant: Tenant) -> None:  # no keys: it is never asked for one
        self._tenant = tenant

    def tenant(self, authorization: str | None) -> Tenant:
        return self._tenant


@dataclasses.dataclass(kw_only=True)
class Answer:
    status: int = 0
    request_id: str = ""
    body: bytearray = dataclasses.field(default_factory=bytearray)


class BatchRunner:
    def __init__(
        self, batches: Batches, *, deps: PipelineDeps, tenants: Mapping[str, Tenant]
    ) -> None:
        self._batches = batches
        self._deps = deps
        self._tenants = dict(tenants)
        self._settings = batches.settings
        self._running: dict[str, asyncio.Task[None]] = {}  # item key → its task
        self._passes = Periodic(self.tick, every_s=self._settings.poll_s, name="batch runner")
        self._endpoints: dict[tuple[str, str], Pipeline] = {}
        self._items: dict[str, list[dict[str, Any]]] = {}  # batch id → its parsed lines
        self._metrics = deps.metrics

    async def start(self) -> None:
        self._passes.start()

    async def stop(self) -> None:
        await self._passes.stop()
        await asyncio.gather(*(stop_task(t) for t in list(self._running.values())))

    async def tick(self) -> None:
        """One pass over the active batches, oldest first."""
        active = await self._batches.active()
        queued = dict.fromkeys(self._deps.router.pools, 0.0)
        for record in active:
            await self._advance(record)
            await self._count_queued(record, queued)
        for pool, tokens in queued.items():
            self._metrics.batch_queued_tokens.labels(pool).set(tokens)
        ids = {r["id"] for r in active}
        self._items = {k: v for k, v in self._items.items() if k in ids}

    async def _count_queued(self, record: Record, queued: dict[str, float]) -> None:
        """Add the batch's items not yet run to `queued`, each at the batch's average."""
        items = self._items.get(record["id"], [])
        if not items or record["status"] not in ("validating", "in_progress"):
            return
        done = await self._batches.results(record["id"])
        each = int(record["_tokens"]) / len(items)
        for index, item in enumerate(items):
            pool = item["body"].get("model")
            if index not in done and pool in queued:
                queued[pool] += each

    async def _advance(self, record: Record) -> None:
        batches = self._batches
        if record["status"] == "validating":

            def start(fresh: Record) -> Record | None:
                if fresh["status"] != "validating":
                    return None
                return {**fresh, "status": "in_progress", "in_progress_at": batches.now()}

            started = await batches.change(record["id"], start)
            if started is None or started["status"] != "in_progress":
                return  # cancelled meanwhile: the next pass sees it as it is
            record = started
        items = self._items.get(record["id"])
        if items is None:
            items = self._items[record["id"]] = await batches.items(record)
        mine = [k for k in self._running if k.startswith(record["id"] + ".")]
        if record["status"] == "cancelling":
            if not mine:
                await self._finish(record, status="cancelled", items=items)
            return
        if record["status"] == "finalizing":  # a process died finishing it
            await self._finish(record, status="completed", items=items)
            return
        if batches.now() >= record["expires_at"]:
            if not mine:
                await self._finish(record, status="expired", items=items)
            return
        results = await batches.results(record["id"])
        if len(results) >= len(items):
            await self._finish(record, status="completed", items=items)
            return
        await self._take(record, items, results)

    async def _take(
        self, record: Record, items: list[dict[str, Any]], results: Mapping[int, Record]
    ) -> None:
        each = -(-int(record["_tokens"]) // max(1, len(items)))  # the batch's average item
        for index, item in enumerate(items):
            if len(self._running) >= self._settings.concurrency:
                return
            key = f"{record['id']}.{index}"
            if index in results or key in self._running:
                continue
            model = item["body"].get("model")
            if model in self._deps.router.pools and not self._has_room(model, each):
                continue  # no spare room in this item's pool now (another model: a 404)
            if not await self._claim(record["id"], index, key):
                continue
            task = asyncio.create_task(self._run(record, index, item, key))
            self._running[key] = task
            task.add_done_callback(self._done)

    async def _claim(self, batch_id: str, index: int, key: str) -> bool:
        """Claim the item, if it is still to run. What this pass read may be stale: the
        process that ran the item saves its result before it lets the claim go, and a batch
        is marked finalizing before its results are cleared, so once the claim is held
        both checks see the truth."""
        store = self._batches.store
        if not await store.claim(key, ttl_s=self._settings.claim_ttl_s):
            return False
        batch = await store.load(BATCH, batch_id)
        done = await store.load(results_kind(batch_id), str(index))
        if batch is None or batch["status"] != "in_progress" or done is not None:
            await store.unclaim(key)
            return False
        return True

    def _done(self, task: asyncio.Task[None]) -> None:
        for key, running in list(self._running.items()):
            if running is task:
                del self._running[key]

    def _has_room(self, pool: str, tokens: int) -> bool:
        """Whether `pool`, holding `tokens` more, stays within `batch.max_fill`."""
        router = self._deps.router
        backends = router.pools[pool].backends
        capacity = sum(router.capacity(b) for b in backends)
        held = sum(router.ledger.tokens_in_flight(b.name) for b in backends)
        return capacity > 0 and held + tokens <= capacity * self._settings.max_fill

    async def _finish(self, record: Record, *, status: str, items: list[dict[str, Any]]) -> None:
        store = self._batches.store
        key = f"{record['id']}.finish"
        if not await store.claim(key, ttl_s=self._settings.claim_ttl_s):
            return
        try:
            fresh = await store.load(BATCH, record["id"])
            if fresh is not None and fresh["status"] in ACTIVE:
                if fresh["status"] == "cancelling":
                    status = "cancelled"
                done = await self._batches.finish(fresh, status=status, items=items)
                if status == "completed":
                    elapsed = done["completed_at"] - done["created_at"]
                    self._metrics.batch_completion.observe(max(0, elapsed))
        finally:
            await store.unclaim(key)

    async def _run(self, record: Record, index: int, item: dict[str, Any], key: str) -> None:
        store = self._batches.store
        try:
            answer = await self._call(record, item)
            if answer.status in RETRY_LATER:
                return
            line = {
                "id": f"batch_req_{secrets.token_hex(12)}",
                "custom_id": item["custom_id"],
                "response": {
                    "status_code": answer.status,
                    "request_id": answer.request_id,
                    "body": _json(bytes(answer.body)),
                },
                "error": None,
            }
            result = {"ok": 200 <= answer.status < 300, "line": line}
            self._count_tokens(line["response"]["body"])
            now = await store.load(BATCH, record["id"])
            if now is not None and now["status"] in ("in_progress", "cancelling"):
                # a batch that ended meanwhile (cancelled, expired) keeps no late results
                await store.save(results_kind(record["id"]), str(index), result)
        except Exception:
            log.exception("batch item %s failed", key)
        finally:
            await store.unclaim(key)

    async def _call(self, record: Record, item: dict[str, Any]) -> Answer:
        """The item through the pipeline, in-process: the endpoint an interactive request
        of this url takes, with the batch's tenant and the lowest priority."""
        endpoint = self._endpoint(record["_tenant"], item["url"])
        body = {k: v for k, v in item["body"].items() if k != "stream_options"}
        if item["url"] != Endpoint.EMBEDDINGS:
            body["stream"] = False
        raw = orjson.dumps(body)
        scope: Scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": "POST",
            "scheme": "http",
            "path": item["url"],
            "raw_path": item["url"].encode(),
            "query_string": b"",
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(raw)).encode()),
                (b"x-spillgate-priority", b"sheddable"),
            ],
            "client": ("127.0.0.1", 0),
            "server": ("batch", 0),
        }
        answer = Answer(request_id=f"req_{secrets.token_hex(12)}")
        sent = False
        never: asyncio.Future[Message] = asyncio.get_running_loop().create_future()

        async def receive() -> Message:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": raw, "more_body": False}
            return await never  # the batch never hangs up

        async def send(message: Message) -> None:
            if message["type"] == "http.response.start":
                answer.status = message["status"]
                for name, value in message.get("headers", []):
                    if name.lower() == b"x-request-id":
                        answer.request_id = value.decode("latin-1")
            elif message["type"] == "http.response.body":
                answer.body += message.get("body", b"")

        try:
            await endpoint(scope, receive, send)
        finally:
            never.cancel()
        return answer

    def _count_tokens(self, body: Any) -> None:
        usage = body.get("usage") if isinstance(body, dict) else None
        if not isinstance(usage, dict):
            return
        for kind in ("prompt", "completion"):
            value = usage.get(f"{kind}_tokens")
            if isinstance(value, int) and value > 0:
                self._metrics.batch_tokens.labels(kind).inc(value)

    def _endpoint(self, tenant_name: str, url: str) -> Pipeline:
        found = self._endpoints.get((tenant_name, url))
        if found is None:
            tenant = self._tenants[tenant_name]
            # no overflow step (no room is a retry later, not a wait or a spill); refused
            # or answered, it is no interactive request (gateway/front/settle.py)
            rules = EndpointRules(
                endpoint=Endpoint(url), overflow=False, record_answers=False, interactive=False
            )
            found = Pipeline(rules, self._item_deps(tenant))
            self._endpoints[(tenant_name, url)] = found
        return found

    def _item_deps(self, tenant: Tenant) -> PipelineDeps:
        """The pipeline's deps for a batch item: its tenant, and an arrival check that lets
        the item take free room only while the pool, with it, stays within `batch.max_fill`."""
        d = self._deps
        arrival_checks = {pool: self._arrival_check(pool) for pool in d.router.pools}
        return dataclasses.replace(d, auth=_OneTenant(tenant), arrival_checks=arrival_checks)

    def _arrival_check(self, pool: str) -> LetsIn:
        outer = self._deps.arrival_checks.get(pool)

        def lets_in(request: InferenceRequest) -> bool:
            if outer is not None and not outer(request):
                return False  # interactive requests wait in the pool's queue: they go first
            # what admission reserves: each choice's sequence, with its expected output
            return self._has_room(pool, request.n * request.sequence_tokens)

        return lets_in


def _json(raw: bytes) -> Any:
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return {"error": {"message": raw.decode("utf-8", "replace"), "type": "server_error"}}
