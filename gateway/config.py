"""Typed gateway configuration, validated at load time with every error reported at once.

Secrets never live in the file: tenant keys are stored as SHA-256 hashes (or read from an
environment variable and hashed at load), and provider keys, the admin token and the Redis
URL are named by the environment variable that holds them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from gateway.config_problems import (
    ConfigDocument,
    Problem,
    Problems,
    describe,
    yaml_syntax,
)
from gateway.config_references import reference_problems

Priority = Literal["critical", "standard", "sheddable"]
PRIORITIES: tuple[Priority, ...] = ("critical", "standard", "sheddable")
# the overflow policies policies/registry.py builds, by the names a pool's chain uses
PolicyName = Literal["queue", "degrade", "provider", "cache", "batch", "reject"]
# what a pool's backends serve: generation (chat, completions, responses) or embeddings
PoolKind = Literal["chat", "embedding"]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Timeouts(_Model):
    """Upstream time budgets, in seconds."""

    connect: float = Field(2.0, gt=0)
    first_token: float = Field(30.0, gt=0)  # request sent → first byte back
    idle: float = Field(30.0, gt=0)  # longest gap between streamed chunks
    total: float = Field(600.0, gt=0)  # whole request, retries included


class BackendSettings(_Model):
    url: str
    served_model: str | None = None  # the name the backend serves; default: the pool's name
    capacity: int | Literal["auto"] = "auto"  # tokens the backend can hold in flight
    block_size: int = Field(16, ge=1)  # KV block size with a hand-set capacity; auto reads it
    name: str | None = None

    @field_validator("url")
    @classmethod
    def _url(cls, url: str) -> str:
        return _http_url(url)

    @field_validator("capacity", mode="before")
    @classmethod
    def _capacity(cls, value: Any) -> Any:
        return _positive_or_auto(value, unit="tokens", kind=int)


class FairnessSettings(_Model):
    """How a pool's queue weighs the tokens its tenants were served lately
    (policies/queue/service.py)."""

    # an output token costs the backend a decode step each; a prompt token a share of one
    # prefill: output counts this many times an input token
    output_weight: float = Field(4.0, ge=1, le=1000)
    # what a tenant was served halves every half_life_s: long enough that a flood is
    # remembered through a spike, short enough that a tenant idle a few minutes is new again
    half_life_s: float = Field(60.0, ge=1, le=86_400)
    # in shared mode, a replica lets room go for at most this long to a tenant with clearly
    # less service waiting at another replica (0: each replica drains in its own order)
    give_way_s: float = Field(0.5, ge=0, le=5)


class QueueSettings(_Model):
    max_depth: int = Field(64, ge=0)
    # the KV tokens the waiters would reserve, all together; None: only max_depth bounds it
    max_tokens: int | None = Field(None, gt=0)
    # seconds, or "auto": twice the pool's average answer time (how long its reservations
    # are held), within [2 s, 30 s]; 2 s until an answer has ended (policies/queue/policy.py)
    max_wait_s: float | Literal["auto"] = "auto"
    fairness: FairnessSettings = FairnessSettings()

    @field_validator("max_wait_s", mode="before")
    @classmethod
    def _max_wait_s(cls, value: Any) -> Any:
        return _positive_or_auto(value, unit="seconds", kind=int | float)


class CacheSettings(_Model):
    ttl_s: float = Field(300.0, gt=0)
    max_entries: int = Field(10_000, gt=0)
    max_entry_bytes: int = Field(256 * 1024, gt=0)
    scope: str | None = None  # share entries across tenants under this name; default per tenant
    store: Literal["deterministic", "all"] = "deterministic"


class ReservationSettings(_Model):
    """How much output a request reserves on admission (CAPACITY.md, admission)."""

    # learned: the expected output, grown while it streams; max_tokens: the whole of
    # max_tokens, held to the end
    mode: Literal["learned", "max_tokens"] = "learned"
    quantile: float = Field(0.9, gt=0, le=1)  # of the completion lengths seen in the pool
    # backend: the quantile bounds the sum of the answers a backend holds at once;
    # answer: each answer's own length (gateway/admission/output_lengths.py)
    quantile_of: Literal["backend", "answer"] = "backend"
    # peak: a streaming request reserves the most its answer is expected to hold at once
    # (it may end at any token) and grows from there; whole: its whole expected answer
    hold: Literal["peak", "whole"] = "peak"
    prior_tokens: int = Field(512, gt=0)  # the expected output until min_samples were seen
    min_samples: int = Field(50, gt=0)  # per pool; a tenant's own figure once it has this many


class PoolSettings(_Model):
    name: str = Field(min_length=1)
    kind: PoolKind = "chat"
    backends: list[BackendSettings] = Field(min_length=1)
    target_fill: float = Field(0.9, gt=0, le=1)
    default_max_tokens: int = Field(256, gt=0)  # reserved when a request names no max_tokens
    # prompt + output tokens a request may ask for; None: what the backends report
    max_model_len: int | None = Field(None, gt=0)
    overflow: list[PolicyName] = Field(default_factory=lambda: list[PolicyName](["reject"]))
    timeouts: Timeouts = Timeouts()
    queue: QueueSettings = QueueSettings()
    degrade_to: str | None = None
    provider: str | None = None
    cache: CacheSettings = CacheSettings()
    sheddable_max_fill: float = Field(1.0, gt=0, le=1)  # sheddable refused above this fill
    capacity_refresh_s: float = Field(5.0, gt=0)
    metrics_stale_s: float = Field(15.0, gt=0)
    reservation: ReservationSettings = ReservationSettings()
    # admit against the backends' reported KV use too; back off on preemption or waiting
    feedback: bool = True
    # least_filled: the backend with the most room; prefix: the one likeliest to hold the
    # prompt's prefix in its cache, unless that piles load on it (gateway/admission/router.py)
    routing: Literal["least_filled", "prefix"] = "prefix"
    # how many times a stream whose backend broke off mid-answer goes on on another backend
    # of the pool (gateway/upstream/resume.py); 0: never (backends with no continuation)
    continue_streams: int = Field(2, ge=0, le=5)


class ProviderSettings(_Model):
    name: str = Field(min_length=1)
    base_url: str
    api_key_env: str | None = None

    @field_validator("base_url")
    @classmethod
    def _base_url(cls, url: str) -> str:
        return _http_url(url)

    models: dict[str, str] = Field(default_factory=dict)  # pool name → provider model
    tokens_per_minute: int = Field(100_000, gt=0)
    max_concurrency: int = Field(16, gt=0)
    prompt_price_per_m: float = Field(0.0, ge=0)
    completion_price_per_m: float = Field(0.0, ge=0)
    timeouts: Timeouts = Timeouts(first_token=20.0, total=120.0)
    breaker_failures: int = Field(3, gt=0)
    breaker_cooldown_s: float = Field(10.0, gt=0)


class TenantSettings(_Model):
    name: str = Field(min_length=1)
    key_sha256: str | None = None
    key_env: str | None = None
    requests_per_minute: int = Field(600, gt=0)
    tokens_per_minute: int = Field(1_000_000, gt=0)
    request_burst: int | None = Field(None, gt=0)
    token_burst: int | None = Field(None, gt=0)
    priority: Priority = "standard"
    pools: list[str] = Field(default_factory=list)  # empty: every pool
    # the tenant's default time-to-first-token target (a request's x-spillgate-ttft-ms wins)
    ttft_budget_ms: float | None = Field(None, gt=0)
    # the same for the time per output token after the first (x-spillgate-tpot-ms)
    tpot_budget_ms: float | None = Field(None, gt=0)
    batchable: bool = False  # overflow may answer its requests 202 with a batch (policy batch)

    @field_validator("key_sha256")
    @classmethod
    def _sha256(cls, value: str | None) -> str | None:
        if value is not None and not _is_sha256(value):
            raise ValueError("should be 64 lowercase hex digits: the key's SHA-256")
        return value

    @model_validator(mode="after")
    def _one_key(self) -> TenantSettings:
        if (self.key_sha256 is None) == (self.key_env is None):
            raise ValueError("give exactly one of key_sha256 or key_env")
        return self

    def key_hash(self, environ: dict[str, str]) -> str:
        if self.key_sha256 is not None:
            return self.key_sha256
        assert self.key_env is not None
        return hash_key(environ[self.key_env])


class RedisSettings(_Model):
    url_env: str = "SPILLGATE_REDIS_URL"
    # a call's time budget follows the waits seen, within these: the floor covers a busy
    # two-core machine's scheduling (a burst's first calls have no waits seen to go by),
    # the ceiling is what a stalled store costs a request before the breaker opens
    timeout_ms: float = Field(250.0, gt=0)
    timeout_max_ms: float = Field(1000.0, gt=0)
    cluster: bool = False  # the URL names one node of a Redis Cluster


class RateLimitSettings(_Model):
    failure_mode: Literal["local", "allow", "deny"] = "local"
    replicas: int = Field(1, gt=0)
    failure_threshold: int = Field(3, gt=0)
    cooldown_s: float = Field(5.0, gt=0)
    # with Redis: a replica takes up to this much of a tenant's refill at once and decides
    # on its own until it is spent (gateway/ratelimit/redis_limiter.py); 0: every request asks
    slice_s: float = Field(0.5, ge=0, le=5)


class LedgerSettings(_Model):
    """The in-flight ledger shared through Redis (when a Redis URL is configured)."""

    lease_ttl_s: float = Field(10.0, gt=0)  # a dead replica's reservations are freed within it
    refresh_s: float = Field(0.2, gt=0)  # how often each block is sized and totals are read
    # a replica's block holds this share of the room left beyond its requests, admitted
    # without a call (gateway/admission/ledger_redis.py); 0: every admission and release asks
    spare: float = Field(0.125, ge=0, le=0.5)

    @model_validator(mode="after")
    def _check(self) -> LedgerSettings:
        if self.refresh_s * 3 > self.lease_ttl_s:
            raise ValueError("refresh_s must be at most a third of lease_ttl_s")
        return self


class ServerSettings(_Model):
    host: str = "127.0.0.1"
    port: int = Field(8080, ge=0, le=65535)
    max_body_bytes: int = Field(1 << 20, gt=0)
    max_header_bytes: int = Field(16 * 1024, gt=0)  # names and values of all request headers
    request_read_timeout_s: float = Field(30.0, gt=0)  # the whole request body must arrive by then
    admin_token_env: str = "SPILLGATE_ADMIN_TOKEN"
    upstream_max_connections: int = Field(1024, gt=0)
    # bounds on each upstream answer's head, trailers included (Envoy's defaults): past
    # either the answer fails and its connection closes (gateway/upstream/http.py)
    upstream_max_header_bytes: int = Field(60 * 1024, gt=0)  # names and values
    upstream_max_headers: int = Field(100, gt=0)  # fields


class TracingSettings(_Model):
    """OpenTelemetry spans, exported over OTLP/HTTP (gateway/tracing.py); off by default."""

    enabled: bool = False
    # the collector's OTLP/HTTP base URL (/v1/traces is added); None: $OTEL_EXPORTER_OTLP_*
    otlp_endpoint: str | None = None
    service_name: str = Field("spillgate", min_length=1)
    sample_ratio: float = Field(1.0, ge=0, le=1)  # of traces the gateway starts itself

    @field_validator("otlp_endpoint")
    @classmethod
    def _endpoint(cls, url: str | None) -> str | None:
        return None if url is None else _http_url(url)


class BatchSettings(_Model):
    """The batch tier (gateway/batch/): OpenAI's files and batches API, run on spare room.

    Files, batches and results live under `dir` (the embedded default; relative to the
    working directory) or, when a Redis URL is configured, in Redis."""

    dir: str = Field(".spillgate/batch", min_length=1)
    max_fill: float = Field(0.6, gt=0, le=1)  # the runner takes items only below this fill
    window_s: float = Field(86_400.0, gt=0)  # what completion_window "24h" means
    results_ttl_s: float = Field(7 * 86_400.0, gt=0)  # output and error files kept this long
    max_files: int = Field(100, gt=0)  # per tenant
    max_file_bytes: int = Field(100 * 1024 * 1024, gt=0)  # per file
    max_total_bytes: int = Field(1024 * 1024 * 1024, gt=0)  # per tenant, all its files
    max_queued_tokens: int = Field(10_000_000, gt=0)  # per tenant, items not yet run
    max_items: int = Field(50_000, gt=0)  # lines per file
    concurrency: int = Field(8, gt=0)  # items one process runs at once
    poll_s: float = Field(0.2, gt=0)  # how often the runner looks for work
    claim_ttl_s: float = Field(600.0, gt=0)  # an item a dead process claimed runs again after
    redis_timeout_s: float = Field(5.0, gt=0)  # each batch-store call, a whole file's included


class Settings(_Model):
    server: ServerSettings = ServerSettings()
    redis: RedisSettings = RedisSettings()
    ratelimit: RateLimitSettings = RateLimitSettings()
    ledger: LedgerSettings = LedgerSettings()
    tenants: list[TenantSettings] = Field(min_length=1)
    pools: list[PoolSettings] = Field(min_length=1)
    providers: list[ProviderSettings] = Field(default_factory=list)
    tracing: TracingSettings = TracingSettings()
    batch: BatchSettings = BatchSettings()

    @model_validator(mode="after")
    def _references(self) -> Settings:
        problems = reference_problems(self.model_dump())
        if problems:
            raise Problems(problems)
        return self


class ConfigError(Exception):
    """Every problem of one config file, one line each (file, line, key path, problem)."""

    def __init__(self, path: str, problems: list[str]) -> None:
        self.path = path
        self.problems = problems
        super().__init__("\n".join(problems))


@dataclass(frozen=True, kw_only=True)
class LoadedConfig:
    settings: Settings
    document: ConfigDocument  # tells a later problem (the environment's) on its line


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def _is_sha256(value: str) -> bool:
    return len(value) == 64 and all(c in "0123456789abcdef" for c in value)


def _positive_or_auto(value: Any, *, unit: str, kind: Any) -> Any:
    positive = isinstance(value, kind) and not isinstance(value, bool) and value > 0
    if not positive and value != "auto":
        raise ValueError(f"should be a positive number of {unit} or 'auto', not {value!r}")
    return value


def _http_url(url: str) -> str:
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"should start with http:// or https://, not {url!r}")
    return url


def validate(data: Any) -> tuple[Settings | None, list[Problem]]:
    """The settings, or every problem of `data` at once: the references between its parts
    are checked even where some part is malformed."""
    if data is None:
        return None, [Problem(loc=(), message="the file is empty: it needs tenants and pools")]
    try:
        return Settings.model_validate(data), []
    except ValidationError as exc:
        problems = describe(exc.errors(), root=Settings)
        if not any(isinstance(e.get("ctx", {}).get("error"), Problems) for e in exc.errors()):
            problems += reference_problems(data)  # the model's own check never ran
        return None, problems


def parse_settings(data: Any, *, source: str = "<config>") -> Settings:
    return _settings(data, ConfigDocument(name=source))


def _settings(data: Any, document: ConfigDocument, *, also: Sequence[Problem] = ()) -> Settings:
    settings, problems = validate(data)
    if settings is None or also:
        raise ConfigError(document.name, document.lines([*also, *problems]))
    return settings


def load_config(path: str | Path) -> LoadedConfig:
    """The file's settings, or a ConfigError with every problem of the file."""
    name = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(name, [f"{name}: cannot be read: {exc.strerror or exc}"]) from None
    except UnicodeDecodeError as exc:
        raise ConfigError(name, [f"{name}: not UTF-8 text (byte {exc.start})"]) from None
    try:
        document = ConfigDocument.parse(name, text)
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(name, [yaml_syntax(name, exc)]) from None
    settings = _settings(data, document, also=document.repeated_keys())
    return LoadedConfig(settings=settings, document=document)


def load_settings(path: str | Path) -> Settings:
    return load_config(path).settings
