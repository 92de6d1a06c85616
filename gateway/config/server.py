"""The process around the pools: its listener and upstream connections, its traces, and
the batch tier it runs on spare room."""

from __future__ import annotations

from pydantic import Field, field_validator

from gateway.config.base import _http_url, _Model


class ServerSettings(_Model):
    """The gateway's listener, the bounds on what clients send, and its upstream connections."""

    host: str = Field("127.0.0.1", description="listen address")
    port: int = Field(8080, ge=0, le=65535, description="listen port")
    max_body_bytes: int = Field(
        1 << 20,
        gt=0,
        description="larger request bodies get 413 and a closed connection",
    )
    max_header_bytes: int = Field(
        16 * 1024,
        gt=0,
        description=(
            "names and values of all request headers; larger request heads get 431 and a "
            "closed connection"
        ),
    )
    request_read_timeout_s: float = Field(
        30.0, gt=0, description="the whole request body must arrive by then, else 408"
    )
    admin_token_env: str = Field(
        "SPILLGATE_ADMIN_TOKEN", description="env variable holding the admin token"
    )
    upstream_max_connections: int = Field(
        1024,
        gt=0,
        description=(
            "upstream connections in use at once, over all backends and providers (a request "
            "past it waits for one to be given back); an idle connection is kept 4 s for the "
            "next request, under uvicorn's 5 s, after which vLLM and SGLang close it"
        ),
    )
    upstream_max_header_bytes: int = Field(
        60 * 1024,
        gt=0,
        description=(
            "a bound on each upstream answer's head, as Envoy's: bytes of header names and "
            "values, 1xx answers and trailers counted in; an answer past it fails that attempt "
            "and its connection is closed"
        ),
    )
    upstream_max_headers: int = Field(
        100,
        gt=0,
        description="the same bound in header fields, 1xx answers and trailers counted in",
    )
    upstream_max_body_bytes: int = Field(
        64 << 20,
        gt=0,
        description=(
            "a bound on an upstream body read whole: an answer not streamed (an embeddings "
            "batch of 2,048 inputs at 1,024 dimensions is about 40 MiB as JSON), a count from "
            "`/tokenize`; a refusal of a stream is read up to 64 KiB. Past it the attempt "
            "fails (a protocol error naming the bound's size), and is tried on another backend"
        ),
    )
    upstream_max_event_bytes: int = Field(
        1 << 20,
        gt=0,
        description=(
            "a bound on one server-sent event of an upstream's stream; past it (an event "
            "that never ends) the stream ends with an error event, or goes on on another "
            "backend where it can (`continue_streams`), and the backend's failure is counted"
        ),
    )
    upstream_max_kept_bytes: int = Field(
        1 << 20,
        gt=0,
        description=(
            "the answer's text that a resumable stream keeps to continue from "
            "(`continue_streams`); a stream past it is no longer continued if its backend "
            "breaks off (`spillgate_streams_not_kept_total`), and is relayed to its end as before"
        ),
    )


class TracingSettings(_Model):
    """OpenTelemetry spans, exported over OTLP/HTTP (see [Traces](traces.md)); off by
    default."""

    enabled: bool = Field(
        False,
        description=(
            "OpenTelemetry spans for every completion request, exported over OTLP/HTTP; off, "
            "a request makes one check and no span"
        ),
    )
    otlp_endpoint: str | None = Field(
        None,
        description=(
            "the collector's OTLP/HTTP base URL, e.g. `http://otel-collector:4318` "
            "(`/v1/traces` is added); none: `$OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` as it is, "
            "else `$OTEL_EXPORTER_OTLP_ENDPOINT` + `/v1/traces`, else "
            "`http://localhost:4318/v1/traces`"
        ),
    )
    service_name: str = Field(
        "spillgate",
        min_length=1,
        description=(
            "the `service.name` resource attribute (`$OTEL_RESOURCE_ATTRIBUTES` adds others)"
        ),
    )
    sample_ratio: float = Field(
        1.0,
        ge=0,
        le=1,
        description=(
            "share of traces the gateway starts that are recorded; a client's `traceparent` "
            "decides for its own trace (parent-based)"
        ),
    )

    @field_validator("otlp_endpoint")
    @classmethod
    def _endpoint(cls, url: str | None) -> str | None:
        return None if url is None else _http_url(url)


class BatchSettings(_Model):
    """The batch tier (gateway/batch/; see [Batches](batches.md)): OpenAI's files and
    batches API, run on spare room. Files, batches and results live under `dir` or, when a
    Redis URL is configured, in Redis, shared by every replica."""

    dir: str = Field(
        ".spillgate/batch",
        min_length=1,
        description=(
            "where files, batches and results live without Redis (relative to the working "
            "directory, so they survive a restart; give a volume's path in a container)"
        ),
    )
    max_fill: float = Field(
        0.6,
        gt=0,
        le=1,
        description=(
            "batch items run only while their pool's fill, counting the item, stays at or "
            "below this"
        ),
    )
    window_s: float = Field(
        86_400.0,
        gt=0,
        description=(
            'what `completion_window: "24h"` means: a batch not done by then ends `expired`'
        ),
    )
    results_ttl_s: float = Field(
        7 * 86_400.0, gt=0, description="how long output and error files are kept"
    )
    max_files: int = Field(
        100, gt=0, description="per tenant: files held (over: 429 `file_limit_exceeded`)"
    )
    max_file_bytes: int = Field(
        100 * 1024 * 1024,
        gt=0,
        description=(
            "per tenant: bytes per file (over: 429 `file_limit_exceeded`, 413 for one file "
            "over the body limit)"
        ),
    )
    max_total_bytes: int = Field(
        1024 * 1024 * 1024,
        gt=0,
        description="per tenant: bytes in all its files (over: 429 `file_limit_exceeded`)",
    )
    max_queued_tokens: int = Field(
        10_000_000,
        gt=0,
        description=(
            "per tenant: estimated tokens (prompt + max_tokens) of batches not yet ended "
            "(over: 429 `token_limit_exceeded`)"
        ),
    )
    max_items: int = Field(50_000, gt=0, description="lines per file")
    concurrency: int = Field(8, gt=0, description="items one process runs at once")
    poll_s: float = Field(0.2, gt=0, description="how often the runner looks for work")
    claim_ttl_s: float = Field(
        600.0,
        gt=0,
        description=("how long an item a dead process claimed waits before it runs elsewhere"),
    )
    redis_timeout_s: float = Field(
        5.0,
        gt=0,
        description=(
            "with Redis, the time budget of each batch-store call (on connections of its own: "
            "a whole file moves in one call)"
        ),
    )
