"""Typed gateway configuration, validated at load time with every error reported at once.

Secrets never live in the file: tenant keys are stored as SHA-256 hashes (or read from an
environment variable and hashed at load), and provider keys, the admin token and the Redis
URL are named by the environment variable that holds them.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

Priority = Literal["critical", "standard", "sheddable"]
PRIORITIES: tuple[Priority, ...] = ("critical", "standard", "sheddable")


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

    @model_validator(mode="after")
    def _check(self) -> BackendSettings:
        if not self.url.startswith(("http://", "https://")):
            raise ValueError("url must start with http:// or https://")
        if isinstance(self.capacity, int) and self.capacity <= 0:
            raise ValueError("capacity must be a positive number of tokens or 'auto'")
        return self


class QueueSettings(_Model):
    max_depth: int = Field(64, ge=0)
    max_wait_s: float = Field(2.0, gt=0)


class CacheSettings(_Model):
    ttl_s: float = Field(300.0, gt=0)
    max_entries: int = Field(10_000, gt=0)
    max_entry_bytes: int = Field(256 * 1024, gt=0)
    scope: str | None = None  # share entries across tenants under this name; default per tenant
    store: Literal["deterministic", "all"] = "deterministic"


class PoolSettings(_Model):
    name: str = Field(min_length=1)
    backends: list[BackendSettings] = Field(min_length=1)
    target_fill: float = Field(0.9, gt=0, le=1)
    default_max_tokens: int = Field(256, gt=0)  # reserved when a request names no max_tokens
    max_model_len: int = Field(32_768, gt=0)
    overflow: list[str] = Field(default_factory=lambda: ["reject"])
    timeouts: Timeouts = Timeouts()
    queue: QueueSettings = QueueSettings()
    degrade_to: str | None = None
    provider: str | None = None
    cache: CacheSettings = CacheSettings()
    sheddable_max_fill: float = Field(1.0, gt=0, le=1)  # sheddable refused above this fill
    capacity_refresh_s: float = Field(5.0, gt=0)
    metrics_stale_s: float = Field(15.0, gt=0)


class ProviderSettings(_Model):
    name: str = Field(min_length=1)
    base_url: str
    api_key_env: str | None = None
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
    ttft_budget_ms: float | None = Field(None, gt=0)

    @model_validator(mode="after")
    def _check(self) -> TenantSettings:
        if (self.key_sha256 is None) == (self.key_env is None):
            raise ValueError("give exactly one of key_sha256 or key_env")
        if self.key_sha256 is not None and not _is_sha256(self.key_sha256):
            raise ValueError("key_sha256 must be 64 lowercase hex digits")
        return self

    def key_hash(self, environ: dict[str, str]) -> str:
        if self.key_sha256 is not None:
            return self.key_sha256
        assert self.key_env is not None
        return hash_key(environ[self.key_env])


class RedisSettings(_Model):
    url_env: str = "SPILLGATE_REDIS_URL"
    timeout_ms: float = Field(50.0, gt=0)


class RateLimitSettings(_Model):
    failure_mode: Literal["local", "allow", "deny"] = "local"
    replicas: int = Field(1, gt=0)
    failure_threshold: int = Field(3, gt=0)
    cooldown_s: float = Field(5.0, gt=0)


class LedgerSettings(_Model):
    """The in-flight ledger shared through Redis (when a Redis URL is configured)."""

    lease_ttl_s: float = Field(10.0, gt=0)  # a dead replica's reservations are freed within it
    refresh_s: float = Field(0.2, gt=0)  # how often totals are read and due leases renewed

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


class Settings(_Model):
    server: ServerSettings = ServerSettings()
    redis: RedisSettings = RedisSettings()
    ratelimit: RateLimitSettings = RateLimitSettings()
    ledger: LedgerSettings = LedgerSettings()
    tenants: list[TenantSettings] = Field(min_length=1)
    pools: list[PoolSettings] = Field(min_length=1)
    providers: list[ProviderSettings] = Field(default_factory=list)

    @model_validator(mode="after")
    def _cross_check(self) -> Settings:
        pools = {p.name for p in self.pools}
        providers = {p.name for p in self.providers}
        problems: list[str] = []
        if len(pools) != len(self.pools):
            problems.append("pools: names must be unique")
        for i, pool in enumerate(self.pools):
            if pool.degrade_to is not None and pool.degrade_to not in pools:
                problems.append(f"pools.{i}.degrade_to: no pool named {pool.degrade_to!r}")
            if pool.provider is not None and pool.provider not in providers:
                problems.append(f"pools.{i}.provider: no provider named {pool.provider!r}")
            if pool.degrade_to == pool.name:
                problems.append(f"pools.{i}.degrade_to: a pool cannot degrade to itself")
            if "degrade" in pool.overflow and pool.degrade_to is None:
                problems.append(f"pools.{i}.overflow: 'degrade' needs pools.{i}.degrade_to")
            if "provider" in pool.overflow and pool.provider is None:
                problems.append(f"pools.{i}.overflow: 'provider' needs pools.{i}.provider")
        for i, tenant in enumerate(self.tenants):
            for name in tenant.pools:
                if name not in pools:
                    problems.append(f"tenants.{i}.pools: no pool named {name!r}")
        if problems:
            raise ValueError("; ".join(problems))
        return self


class ConfigError(Exception):
    """Every problem of one config file, each with its key path."""

    def __init__(self, path: str, problems: list[str]) -> None:
        self.path = path
        self.problems = problems
        super().__init__(f"{path}: invalid config\n" + "\n".join(f"  - {p}" for p in problems))


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def _is_sha256(value: str) -> bool:
    return len(value) == 64 and all(c in "0123456789abcdef" for c in value)


def _loc(loc: tuple[int | str, ...]) -> str:
    return ".".join(str(part) for part in loc) or "(top level)"


def parse_settings(data: Any, *, source: str = "<config>") -> Settings:
    try:
        return Settings.model_validate(data)
    except ValidationError as exc:
        problems = [f"{_loc(e['loc'])}: {e['msg']}" for e in exc.errors()]
        raise ConfigError(source, problems) from None


def load_settings(path: str | Path) -> Settings:
    text = Path(path).read_text()
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(str(path), [f"not valid YAML: {exc}"]) from None
    return parse_settings(data, source=str(path))


def check_environment(settings: Settings, environ: dict[str, str] | None = None) -> list[str]:
    """Environment variables the config names but the process lacks."""
    env = dict(os.environ) if environ is None else environ
    missing = [
        f"tenants.{i}.key_env: ${t.key_env} is not set"
        for i, t in enumerate(settings.tenants)
        if t.key_env is not None and t.key_env not in env
    ]
    missing += [
        f"providers.{i}.api_key_env: ${p.api_key_env} is not set"
        for i, p in enumerate(settings.providers)
        if p.api_key_env is not None and p.api_key_env not in env
    ]
    return missing
