"""What every part of the configuration shares: the models' base, the names a config may
use for priorities, overflow policies and pool kinds, the upstream time budgets pools and
providers both have, and the checks of a URL and of a number that may be `auto`."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

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

    connect: float = Field(2.0, gt=0, description="opening a connection to the upstream")
    first_token: float = Field(
        30.0,
        gt=0,
        description=(
            "from sending the request to the first byte back (not streamed, that byte is the "
            "answer's head, which vLLM sends once the whole answer is generated: set it above "
            "your longest non-streaming generation)"
        ),
    )
    idle: float = Field(
        30.0,
        gt=0,
        description=(
            "the longest gap in an answer after its first byte: between chunks of a body, "
            "between events with data in a stream (comments and keep-alive pings, such as "
            "`: ping`, relay but do not count as progress: a hung engine that only pings is "
            "idle)"
        ),
    )
    total: float = Field(600.0, gt=0, description="the whole request, all attempts together")


def _positive_or_auto(value: Any, *, unit: str, kind: Any) -> Any:
    positive = isinstance(value, kind) and not isinstance(value, bool) and value > 0
    if not positive and value != "auto":
        raise ValueError(f"should be a positive number of {unit} or 'auto', not {value!r}")
    return value


def _http_url(url: str) -> str:
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"should start with http:// or https://, not {url!r}")
    return url
