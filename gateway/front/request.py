"""The headers that shape a request, the objectives they set, and which endpoints a pool
serves (the request itself is gateway/request.py's `InferenceRequest`)."""

from __future__ import annotations

from collections.abc import Mapping

from starlette.types import Scope

from gateway.config import PRIORITIES, PoolKind, Priority
from gateway.errors import InvalidRequest
from gateway.request import API_NAMES, Endpoint

MAX_SLO_MS = 3_600_000.0  # an hour: beyond it a target is a typo, not an objective


def request_headers(scope: Scope) -> dict[bytes, bytes]:
    """The request's headers by name, read in one pass; a repeated header counts once,
    as it first came (built from the end, so the earliest is written last)."""
    return dict(reversed(scope["headers"]))


def header_text(headers: Mapping[bytes, bytes], name: bytes) -> str | None:
    value = headers.get(name)
    return None if value is None else value.decode("latin-1")


def slo_seconds(header: str | None, name: str, default_s: float | None) -> float | None:
    """A request's objective from its header (milliseconds), else `default_s`; a value that
    is not a positive number of milliseconds up to an hour is a 400 naming the header."""
    if header is None:
        return default_s
    try:
        ms = float(header)
    except ValueError:
        ms = -1.0
    if not 0 < ms <= MAX_SLO_MS:  # also false for NaN
        raise InvalidRequest(
            f"The header {name} should be a positive number of milliseconds up to "
            f"{MAX_SLO_MS:.0f}, not {header!r}.",
            param=name,
            code="invalid_header",
        )
    return ms / 1000


def effective_priority(tenant_priority: Priority, header: str | None) -> Priority:
    """A request may lower its own priority class, never raise it."""
    if header is None or header not in PRIORITIES:
        return tenant_priority
    requested: Priority = header
    return max(tenant_priority, requested, key=PRIORITIES.index)


def check_pool_kind(kind: PoolKind, endpoint: Endpoint, model: str) -> None:
    """Embedding pools serve /v1/embeddings only; every other pool serves all but it. The
    400 says what vLLM says when a model does not serve an API."""
    if (kind == "embedding") == (endpoint is Endpoint.EMBEDDINGS):
        return
    raise InvalidRequest(
        f"The model {model!r} does not support {API_NAMES[endpoint]}: it is "
        + ("an embedding model." if kind == "embedding" else "not an embedding model."),
        param="model",
        code="unsupported_endpoint",
    )
