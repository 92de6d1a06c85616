"""Files, as OpenAI's API shapes them: the multipart form its client uploads, a batch input's
lines, and the file records, each seen only by the tenant that holds it."""

from __future__ import annotations

import email.parser
import email.policy
import secrets
from dataclasses import dataclass
from typing import Any

import orjson

from gateway.batch.store import BatchStore, Record
from gateway.clock import Clock
from gateway.config import BatchSettings
from gateway.errors import InvalidRequest, Throttled
from gateway.front.auth import Tenant

FILE = "file"
BATCH_URLS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")


@dataclass(frozen=True, kw_only=True)
class Upload:
    filename: str
    purpose: str
    content: bytes


def parse_upload(content_type: str, body: bytes) -> Upload:
    """The `file` and `purpose` fields of a multipart/form-data body (python's own MIME
    parser: the form is small and arrives whole, within the body limit)."""
    if not content_type.lower().startswith("multipart/form-data"):
        raise InvalidRequest("Upload the file as multipart/form-data.", param="file")
    try:
        fields = _form_fields(content_type, body)
    except Exception:  # whatever a malformed form makes the MIME parser raise is a 400
        raise InvalidRequest("The multipart form could not be read.", param="file") from None
    if "file" not in fields:
        raise InvalidRequest("Missing required parameter: 'file'.", param="file")
    if "purpose" not in fields:
        raise InvalidRequest("Missing required parameter: 'purpose'.", param="purpose")
    purpose = fields["purpose"][1].decode("utf-8", "replace").strip()
    if purpose != "batch":
        raise InvalidRequest(
            f"Invalid value for 'purpose': {purpose!r}. This gateway accepts only 'batch'.",
            param="purpose",
        )
    filename, content = fields["file"]
    return Upload(filename=filename or "upload.jsonl", purpose=purpose, content=content)


def _form_fields(content_type: str, body: bytes) -> dict[str, tuple[str | None, bytes]]:
    head = f"Content-Type: {content_type}\r\nMIME-Version: 1.0\r\n\r\n".encode("latin-1")
    message = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(head + body)
    fields: dict[str, tuple[str | None, bytes]] = {}
    if message.is_multipart():
        for part in message.iter_parts():
            name = part.get_param("name", header="content-disposition")
            payload = part.get_payload(decode=True)
            if isinstance(name, str) and isinstance(payload, bytes):
                fields.setdefault(name, (part.get_filename(), payload))
    return fields


def batch_lines(content: bytes, *, max_items: int) -> list[dict[str, Any]]:
    """Each line of a batch input, checked; the first bad line is a 400 naming it."""
    lines = [line for line in content.splitlines() if line.strip()]
    if not lines:
        raise InvalidRequest("The file has no requests: it should hold one JSON object a line.")
    if len(lines) > max_items:
        raise InvalidRequest(f"The file has {len(lines)} requests; at most {max_items} allowed.")
    seen: set[str] = set()
    items = [_line(line, number, seen) for number, line in enumerate(lines, start=1)]
    return items


def _line(raw: bytes, number: int, seen: set[str]) -> dict[str, Any]:
    def bad(message: str) -> InvalidRequest:
        return InvalidRequest(f"Line {number}: {message}", param="file", code="invalid_batch_line")

    try:
        item = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise bad("not valid JSON.") from None
    if not isinstance(item, dict):
        raise bad("should be a JSON object.")
    custom_id = item.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise bad("'custom_id' should be a non-empty string.")
    if custom_id in seen:
        raise bad(f"the custom_id {custom_id!r} is used by an earlier line.")
    seen.add(custom_id)
    if item.get("method") != "POST":
        raise bad("'method' should be 'POST'.")
    if item.get("url") not in BATCH_URLS:
        raise bad(f"'url' should be one of {', '.join(BATCH_URLS)}.")
    if not isinstance(item.get("body"), dict):
        raise bad("'body' should be a JSON object.")
    if not isinstance(item["body"].get("model"), str):
        raise bad("'body.model' should be a string.")
    return {"custom_id": custom_id, "url": item["url"], "body": item["body"]}


class NotFound(InvalidRequest):
    status = 404
    code = "not_found"


class Files:
    """A tenant's files: its uploads, within its limits, and the output and error files its
    batches write; a file past its expiry goes when next read."""

    def __init__(self, store: BatchStore, *, settings: BatchSettings, clock: Clock) -> None:
        self.store = store
        self.settings = settings
        self._clock = clock

    def now(self) -> int:
        return int(self._clock.wall())

    async def upload(self, tenant: Tenant, upload: Upload) -> Record:
        s = self.settings
        if len(upload.content) > s.max_file_bytes:
            raise InvalidRequest(
                f"The file is {len(upload.content)} bytes; at most {s.max_file_bytes} allowed.",
                param="file",
                code="file_too_large",
            )
        batch_lines(upload.content, max_items=s.max_items)
        mine = await self._held(tenant)
        if len(mine) >= s.max_files:
            raise Throttled(
                f"Tenant {tenant.name!r} already holds {len(mine)} files; at most "
                f"{s.max_files}. Delete some, or wait for results to expire.",
                code="file_limit_exceeded",
            )
        held = sum(int(f["bytes"]) for f in mine)
        if held + len(upload.content) > s.max_total_bytes:
            raise Throttled(
                f"Tenant {tenant.name!r} holds {held} bytes of files; this one would pass "
                f"the limit of {s.max_total_bytes}.",
                code="file_limit_exceeded",
            )
        return await self.save(
            tenant.name, upload.content, filename=upload.filename, purpose="batch"
        )

    async def save(
        self,
        tenant: str,
        content: bytes,
        *,
        filename: str,
        purpose: str,
        ttl_s: float | None = None,
    ) -> Record:
        now = self.now()
        record: Record = {
            "id": f"file-{secrets.token_hex(12)}",
            "object": "file",
            "bytes": len(content),
            "created_at": now,
            "expires_at": None if ttl_s is None else now + int(ttl_s),
            "filename": filename,
            "purpose": purpose,
            "status": "processed",
            "status_details": None,
            "_tenant": tenant,
        }
        await self.store.save_blob(record["id"], content)
        await self.store.save(FILE, record["id"], record)
        return record

    async def _held(self, tenant: Tenant) -> list[Record]:
        found = []
        for key in await self.store.keys(FILE):
            record = await self.file(tenant, key, missing_ok=True)
            if record is not None:
                found.append(record)
        return found

    async def file(
        self, tenant: Tenant, file_id: str, *, missing_ok: bool = False
    ) -> Record | None:
        record = None if not id_like(file_id) else await self.store.load(FILE, file_id)
        if record is not None and record["_tenant"] == tenant.name:
            expires = record.get("expires_at")
            if expires is None or expires > self.now():
                return record
            await self.store.delete_blob(file_id)
            await self.store.delete(FILE, file_id)
        if missing_ok:
            return None
        raise NotFound(f"No such File object: {file_id}", param="id")

    async def delete(self, tenant: Tenant, file_id: str) -> Record:
        await self.file(tenant, file_id)
        await self.store.delete_blob(file_id)
        await self.store.delete(FILE, file_id)
        return {"id": file_id, "object": "file", "deleted": True}

    async def content(self, tenant: Tenant, file_id: str) -> bytes:
        await self.file(tenant, file_id)
        data = await self.store.load_blob(file_id)
        if data is None:
            raise NotFound(f"No such File object: {file_id}", param="id")
        return data


def id_like(value: str) -> bool:
    return 0 < len(value) <= 64 and all(c.isalnum() or c in "_-" for c in value)
