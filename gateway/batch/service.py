"""Batches, as OpenAI's API shapes them, each seen only by the tenant that made it (its
files and their records: gateway/batch/files.py).

A record's fields that start with `_` are the gateway's own (its tenant, its size in
tokens) and never leave it. An item's result is its own record (`res-<batch>`, keyed by the
line's index), written once by the process that ran it, so that no two processes write the
batch record at once while items run; the counts are read from the results.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Callable, Mapping
from typing import Any

import orjson

from gateway.admission.fleet.backends import Pool
from gateway.batch.files import Files, NotFound, batch_lines, id_like
from gateway.batch.store import BatchStore, Record
from gateway.clock import Clock
from gateway.config import BatchSettings
from gateway.errors import InvalidRequest, Throttled
from gateway.front.auth import Tenant
from gateway.front.parse import parse_request
from gateway.front.request import check_pool_kind
from gateway.request import Endpoint, InferenceRequest

WINDOWS = {"24h"}
ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")
BATCH = "batch"
ACTIVE_INDEX = "active"  # the ids of the batches not yet ended: what the runner reads


def public(record: Record) -> Record:
    return {k: v for k, v in record.items() if not k.startswith("_")}


def results_kind(batch_id: str) -> str:
    return f"res-{batch_id}"


class Batches:
    def __init__(
        self,
        store: BatchStore,
        *,
        settings: BatchSettings,
        pools: Mapping[str, Pool],
        clock: Clock,
    ) -> None:
        self.store = store
        self.files = Files(store, settings=settings, clock=clock)
        # one change of a batch record at a time in this process: a cancel and the runner's
        # start each load, change and save the record, and must not overwrite each other
        self._changing = asyncio.Lock()
        self.settings = settings
        self._pools = pools
        self._clock = clock

    def now(self) -> int:
        return int(self._clock.wall())

    async def create(self, tenant: Tenant, body: Mapping[str, Any]) -> Record:
        file_id = body.get("input_file_id")
        if not isinstance(file_id, str):
            raise InvalidRequest(
                "Missing required parameter: 'input_file_id'.", param="input_file_id"
            )
        endpoint = body.get("endpoint")
        if endpoint not in ("/v1/chat/completions", "/v1/completions", "/v1/embeddings"):
            raise InvalidRequest(
                "'endpoint' should be one of /v1/chat/completions, /v1/completions, "
                "/v1/embeddings.",
                param="endpoint",
            )
        window = body.get("completion_window")
        if not isinstance(window, str) or window not in WINDOWS:
            raise InvalidRequest("'completion_window' should be '24h'.", param="completion_window")
        metadata = body.get("metadata")
        if metadata is not None and not _metadata_ok(metadata):
            raise InvalidRequest(
                "'metadata' should map at most 16 string keys (64 characters at most) to "
                "string values (512 characters at most).",
                param="metadata",
            )
        content = await self.files.content(tenant, file_id)
        items = batch_lines(content, max_items=self.settings.max_items)
        tokens = sum(self._estimate(tenant, endpoint, item, i) for i, item in enumerate(items, 1))
        await self._check_queued(tenant.name, tokens)
        return await self._save_batch(
            tenant.name,
            input_file_id=file_id,
            endpoint=endpoint,
            metadata=metadata,
            items=len(items),
            tokens=tokens,
        )

    async def create_one(self, request: InferenceRequest) -> Record:
        """A one-item batch holding an interactive request the pool had no room for, as its
        owner sees it: the caller answers the request with it."""
        tenant = request.tenant
        await self._check_queued(tenant, request.charge_tokens)
        line = {"custom_id": "request-1", "method": "POST", "url": str(request.endpoint)}
        content = orjson.dumps({**line, "body": request.body}) + b"\n"
        upload = await self.files.save(tenant, content, filename="request.jsonl", purpose="batch")
        record = await self._save_batch(
            tenant,
            input_file_id=upload["id"],
            endpoint=str(request.endpoint),
            metadata=None,
            items=1,
            tokens=request.charge_tokens,
        )
        return public(record)

    def _estimate(self, tenant: Tenant, endpoint: str, item: Mapping[str, Any], line: int) -> int:
        def bad(message: str) -> InvalidRequest:
            return InvalidRequest(f"Line {line}: {message}", param="input_file_id")

        if item["url"] != endpoint:
            raise bad(f"its url {item['url']!r} is not the batch's endpoint {endpoint!r}.")
        body = item["body"]
        pool = self._pools.get(body["model"])
        if pool is None or not tenant.may_use(pool.name):
            raise bad(f"the model {body['model']!r} does not exist.")
        try:
            check_pool_kind(pool.settings.kind, Endpoint(endpoint), pool.name)
            request = parse_request(
                body,
                endpoint=Endpoint(endpoint),
                tenant=tenant.name,
                pool=pool.name,
                priority="sheddable",
                default_max_tokens=pool.settings.default_max_tokens,
                max_model_len=pool.max_model_len,
                chars_per_token=pool.estimator.chars_per_token,
            )
        except InvalidRequest as exc:
            raise bad(exc.message) from None
        return request.charge_tokens

    async def _check_queued(self, tenant: str, tokens: int) -> None:
        queued = sum(int(b["_tokens"]) for b in await self.active(tenant=tenant))
        limit = self.settings.max_queued_tokens
        if queued + tokens > limit:
            raise Throttled(
                f"Enqueued token limit reached for tenant {tenant!r}: {queued} tokens "
                f"queued, this batch would add {tokens}, the limit is {limit}.",
                code="token_limit_exceeded",
            )

    async def _save_batch(
        self,
        tenant: str,
        *,
        input_file_id: str,
        endpoint: str,
        metadata: Any,
        items: int,
        tokens: int,
    ) -> Record:
        now = self.now()
        record: Record = {
            "id": f"batch_{secrets.token_hex(12)}",
            "object": "batch",
            "endpoint": endpoint,
            "errors": None,
            "input_file_id": input_file_id,
            "completion_window": "24h",
            "status": "validating",
            "output_file_id": None,
            "error_file_id": None,
            "created_at": now,
            "in_progress_at": None,
            "expires_at": now + int(self.settings.window_s),
            "finalizing_at": None,
            "completed_at": None,
            "failed_at": None,
            "expired_at": None,
            "cancelling_at": None,
            "cancelled_at": None,
            "request_counts": {"total": items, "completed": 0, "failed": 0},
            "metadata": metadata,
            "_tenant": tenant,
            "_tokens": tokens,
        }
        await self.store.save(BATCH, record["id"], record)
        await self.store.save(ACTIVE_INDEX, record["id"], {})
        return record

    async def batch(self, tenant: Tenant, batch_id: str) -> Record:
        record = None if not id_like(batch_id) else await self.store.load(BATCH, batch_id)
        if record is None or record["_tenant"] != tenant.name:
            raise NotFound(f"No such Batch object: {batch_id}", param="batch_id")
        return await self.counted(record)

    async def counted(self, record: Record) -> Record:
        """The batch with its request counts read from its results while it runs."""
        if record["status"] not in ("in_progress", "cancelling", "finalizing"):
            return record
        results = await self.results(record["id"])
        failed = sum(1 for r in results.values() if not r["ok"])
        counts = {**record["request_counts"], "completed": len(results) - failed, "failed": failed}
        return {**record, "request_counts": counts}

    async def listed(self, tenant: Tenant, *, after: str | None, limit: int) -> Record:
        mine = []
        for key in await self.store.keys(BATCH):
            record = await self.store.load(BATCH, key)
            if record is not None and record["_tenant"] == tenant.name:
                mine.append(record)
        mine.sort(key=lambda r: (r["created_at"], r["id"]), reverse=True)  # newest first
        if after is not None:
            ids = [r["id"] for r in mine]
            mine = mine[ids.index(after) + 1 :] if after in ids else []
        page = [public(await self.counted(r)) for r in mine[:limit]]
        return {
            "object": "list",
            "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": len(mine) > limit,
        }

    async def change(
        self, batch_id: str, change: Callable[[Record], Record | None]
    ) -> Record | None:
        """The batch as stored after `change` (None: leave it as it is) was applied to it
        afresh; None when there is no such batch."""
        async with self._changing:
            record = await self.store.load(BATCH, batch_id)
            if record is None:
                return None
            changed = change(record)
            if changed is not None:
                await self.store.save(BATCH, batch_id, changed)
            return changed or record

    async def cancel(self, tenant: Tenant, batch_id: str) -> Record:
        record = await self.batch(tenant, batch_id)  # the tenant's own, else 404

        def cancelling(record: Record) -> Record | None:
            if record["status"] not in ("validating", "in_progress"):
                return None
            return {**record, "status": "cancelling", "cancelling_at": self.now()}

        record = await self.change(batch_id, cancelling) or record
        if record["status"] not in ("cancelling", "cancelled"):
            raise InvalidRequest(
                f"Cannot cancel a batch with status {record['status']!r}.",
                code="batch_not_cancellable",
            )
        return await self.counted(record)

    # for the runner

    async def active(self, *, tenant: str | None = None) -> list[Record]:
        found = []
        for key in await self.store.keys(ACTIVE_INDEX):
            record = await self.store.load(BATCH, key)
            if record is None or record["status"] not in ACTIVE:
                await self.store.delete(ACTIVE_INDEX, key)
                continue
            if tenant is None or record["_tenant"] == tenant:
                found.append(record)
        return sorted(found, key=lambda r: (r["created_at"], r["id"]))  # oldest first

    async def items(self, record: Record) -> list[dict[str, Any]]:
        content = await self.store.load_blob(record["input_file_id"])
        return [] if content is None else batch_lines(content, max_items=self.settings.max_items)

    async def results(self, batch_id: str) -> dict[int, Record]:
        kind = results_kind(batch_id)
        found = {}
        for key in await self.store.keys(kind):
            result = await self.store.load(kind, key)
            if result is not None:
                found[int(key)] = result
        return found

    async def finish(self, record: Record, *, status: str, items: list[dict[str, Any]]) -> Record:
        """Write the output and error files from the results, and end the batch as `status`
        (completed, cancelled or expired); items that never ran are errors of that name."""
        now = self.now()
        results = await self.results(record["id"])
        record = {**record, "status": "finalizing", "finalizing_at": now}
        await self.store.save(BATCH, record["id"], record)
        out: list[Record] = []
        err: list[Record] = []
        for index, item in enumerate(items):
            result = results.get(index)
            if result is None:
                err.append(_unrun(record["id"], item, status))
            else:
                (out if result["ok"] else err).append(result["line"])
        ttl = self.settings.results_ttl_s
        tenant = record["_tenant"]
        files: dict[str, str | None] = {"output_file_id": None, "error_file_id": None}
        for field, lines, name in (
            ("output_file_id", out, "output"),
            ("error_file_id", err, "error"),
        ):
            if lines:
                content = b"".join(orjson.dumps(line) + b"\n" for line in lines)
                saved = await self.files.save(
                    tenant, content, filename=f"{record['id']}_{name}.jsonl",
                    purpose="batch_output", ttl_s=ttl,
                )  # fmt: skip
                files[field] = saved["id"]
        failed = sum(1 for r in results.values() if not r["ok"])
        counts = {"total": len(items), "completed": len(results) - failed, "failed": failed}
        stamp = {"completed": "completed_at", "cancelled": "cancelled_at", "expired": "expired_at"}
        record = {
            **record,
            **files,
            "status": status,
            stamp[status]: self.now(),
            "request_counts": counts,
        }
        await self.store.save(BATCH, record["id"], record)
        await self.store.delete(ACTIVE_INDEX, record["id"])
        kind = results_kind(record["id"])
        for key in await self.store.keys(kind):
            await self.store.delete(kind, key)
        return record


def _unrun(batch_id: str, item: Mapping[str, Any], status: str) -> Record:
    code = "batch_expired" if status == "expired" else "batch_cancelled"
    message = (
        "This request could not be executed before the completion window expired."
        if status == "expired"
        else "This request was not executed because the batch was cancelled."
    )
    return {
        "id": f"batch_req_{secrets.token_hex(12)}",
        "custom_id": item["custom_id"],
        "response": None,
        "error": {"code": code, "message": message},
    }


def _metadata_ok(metadata: Any) -> bool:
    if not isinstance(metadata, dict) or len(metadata) > 16:
        return False
    return all(
        isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512
        for k, v in metadata.items()
    )
