"""Uploaded files: the multipart form OpenAI's client sends, and a batch input's lines."""

from __future__ import annotations

import email.parser
import email.policy
from dataclasses import dataclass
from typing import Any

import orjson

from gateway.errors import InvalidRequest

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
