"""A tenant: its key, held hashed, its token buckets, its priority and what it may use."""

from __future__ import annotations

import hashlib

from pydantic import Field, field_validator, model_validator

from gateway.config.base import Priority, _Model


class TenantSettings(_Model):
    """A caller: its key, its limits (token buckets) and what it may use."""

    name: str = Field(min_length=1, description="tenant name (metrics label)")
    key_sha256: str | None = Field(
        None,
        description="the API key's SHA-256 hex; give exactly one of `key_sha256` or `key_env`",
    )
    key_env: str | None = Field(
        None, description="an env variable holding the API key (hashed at load)"
    )
    requests_per_minute: int = Field(600, gt=0, description="the request bucket's refill rate")
    tokens_per_minute: int = Field(1_000_000, gt=0, description="the token bucket's refill rate")
    request_burst: int | None = Field(
        None, gt=0, description="the request bucket's size; none: `requests_per_minute`"
    )
    token_burst: int | None = Field(
        None, gt=0, description="the token bucket's size; none: `tokens_per_minute`"
    )
    priority: Priority = Field(
        "standard",
        description=(
            "`critical`, `standard` or `sheddable`; a request may lower it with "
            "`x-spillgate-priority`"
        ),
    )
    pools: list[str] = Field(
        default_factory=list, description="pools the tenant may use; empty: every pool"
    )
    ttft_budget_ms: float | None = Field(
        None,
        gt=0,
        description=(
            "the tenant's objective for time to first token, for its requests that send no "
            "`x-spillgate-ttft-ms` (see [Objectives](objectives.md)); it also cuts the "
            "queue's wait short"
        ),
    )
    tpot_budget_ms: float | None = Field(
        None,
        gt=0,
        description=(
            "the tenant's objective for the time per output token after the first, for its "
            "requests that send no `x-spillgate-tpot-ms`"
        ),
    )
    batchable: bool = Field(
        False,
        description=(
            "the tenant's requests may wait: where its pool's chain has `batch`, an "
            "overflowing request is accepted as a one-item batch (202), as with "
            "`x-spillgate-batchable: true`"
        ),
    )

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


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def _is_sha256(value: str) -> bool:
    return len(value) == 64 and all(c in "0123456789abcdef" for c in value)
