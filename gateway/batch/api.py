"""The HTTP side of the batch tier: OpenAI's /v1/files and /v1/batches, per tenant."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import orjson
import redis.exceptions
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from gateway.batch.files import parse_upload
from gateway.batch.service import Batches, public
from gateway.errors import InvalidRequest, SpillgateError, error_response
from gateway.front.auth import Authenticator, Tenant
from gateway.front.guard import body_too_large

log = logging.getLogger("spillgate.batch")
MAX_LIST = 100


class StoreUnavailable(SpillgateError):
    """The batch store (Redis, or the directory) failed: not the client's doing."""

    status = 503
    code = "batch_store_unavailable"


Handler = Callable[[Request, Tenant], Awaitable[Response]]


def _json(data: object, *, status: int = 200) -> Response:
    return Response(orjson.dumps(data), status_code=status, media_type="application/json")


class BatchEndpoints:
    def __init__(self, batches: Batches, *, auth: Authenticator, max_upload_bytes: int) -> None:
        self._batches = batches
        self._auth = auth
        self._max_upload = max_upload_bytes

    def routes(self) -> list[BaseRoute]:
        return [
            Route("/v1/files", self._guarded(self.upload), methods=["POST"]),
            Route("/v1/files/{file_id}", self._guarded(self.file), methods=["GET"]),
            Route("/v1/files/{file_id}", self._guarded(self.delete), methods=["DELETE"]),
            Route("/v1/files/{file_id}/content", self._guarded(self.content), methods=["GET"]),
            Route("/v1/batches", self._guarded(self.create), methods=["POST"]),
            Route("/v1/batches", self._guarded(self.listed), methods=["GET"]),
            Route("/v1/batches/{batch_id}", self._guarded(self.batch), methods=["GET"]),
            Route("/v1/batches/{batch_id}/cancel", self._guarded(self.cancel), methods=["POST"]),
        ]

    def _guarded(self, handler: Handler) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            try:
                tenant = self._auth.tenant(request.headers.get("authorization"))
                result: Response = await handler(request, tenant)
                return result
            except SpillgateError as exc:
                return error_response(exc)
            except (redis.exceptions.RedisError, OSError):
                log.exception("batch store failed")
                return error_response(StoreUnavailable("The batch store is unavailable."))

        return endpoint

    async def _body(self, request: Request, limit: int) -> bytes:
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise body_too_large(limit)
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise body_too_large(limit)
            chunks.append(chunk)
        return b"".join(chunks)

    async def upload(self, request: Request, tenant: Tenant) -> Response:
        # a multipart body is the file and a little framing
        body = await self._body(request, self._max_upload + 64 * 1024)
        upload = parse_upload(request.headers.get("content-type", ""), body)
        return _json(public(await self._batches.files.upload(tenant, upload)))

    async def file(self, request: Request, tenant: Tenant) -> Response:
        record = await self._batches.files.file(tenant, request.path_params["file_id"])
        assert record is not None
        return _json(public(record))

    async def delete(self, request: Request, tenant: Tenant) -> Response:
        return _json(await self._batches.files.delete(tenant, request.path_params["file_id"]))

    async def content(self, request: Request, tenant: Tenant) -> Response:
        data = await self._batches.files.content(tenant, request.path_params["file_id"])
        return Response(data, media_type="application/jsonl")

    async def create(self, request: Request, tenant: Tenant) -> Response:
        raw = await self._body(request, 64 * 1024)
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError:
            raise InvalidRequest("The request body is not valid JSON.") from None
        if not isinstance(body, dict):
            raise InvalidRequest("The request body should be a JSON object.")
        return _json(public(await self._batches.create(tenant, body)))

    async def batch(self, request: Request, tenant: Tenant) -> Response:
        return _json(public(await self._batches.batch(tenant, request.path_params["batch_id"])))

    async def cancel(self, request: Request, tenant: Tenant) -> Response:
        return _json(public(await self._batches.cancel(tenant, request.path_params["batch_id"])))

    async def listed(self, request: Request, tenant: Tenant) -> Response:
        query = request.query_params
        limit_text = query.get("limit", "20")
        if not limit_text.isdigit() or not 1 <= int(limit_text) <= MAX_LIST:
            raise InvalidRequest(
                f"'limit' should be an integer from 1 to {MAX_LIST}.", param="limit"
            )
        page = await self._batches.listed(tenant, after=query.get("after"), limit=int(limit_text))
        return _json(page)
