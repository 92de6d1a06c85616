"""A pool's fair queue, the `queue` policy's settings: how deep it is, how long a waiter
waits, and how it weighs what its tenants were served lately."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from gateway.config.base import _Model, _positive_or_auto


class FairnessSettings(_Model):
    """How the queue weighs the tokens its tenants were served lately: prompt tokens plus
    `output_weight` × completion tokens, halving every `half_life_s`, shared by the replicas
    with Redis ([how](architecture.md#fairness-attained-service))."""

    output_weight: float = Field(
        4.0,
        ge=1,
        le=1000,
        description=(
            "how many input tokens an output token counts as: an output token costs the "
            "backend a decode step each, a prompt token a share of one prefill"
        ),
    )
    half_life_s: float = Field(
        60.0,
        ge=1,
        le=86_400,
        description=(
            "what a tenant was served halves every this many seconds: long enough that a "
            "flood is remembered through a spike, short enough that a tenant idle a few "
            "minutes is new again"
        ),
    )
    give_way_s: float = Field(
        0.5,
        ge=0,
        description=(
            "with Redis, how long freed room here is held for a markedly lighter tenant of the "
            "same class waiting on another replica. `0`: no give-way within a class "
            "([how](architecture.md#giving-way-across-replicas))"
        ),
    )


class QueueSettings(_Model):
    """The fair queue: priority class first, then the tenant served least lately, then the earliest
    deadline; a waiter past its wait limit moves on to the next step
    ([how](architecture.md#the-fair-queue))."""

    max_depth: int = Field(
        64,
        ge=0,
        description=(
            "waiters the queue holds; when full, an arrival that goes first pushes out the newest "
            "waiter of a lower class or of a heavier tenant, who moves on to the next step "
            "([how](architecture.md#a-full-queue))"
        ),
    )
    max_tokens: int | None = Field(
        None,
        gt=0,
        description=(
            "a bound on the KV tokens the queue's waiters would reserve, all together (none: "
            "only `max_depth` bounds it); a request that would pass either bound finds the "
            "queue full, and waiters make room for it as `max_depth` says"
        ),
    )
    max_wait_s: float | Literal["auto"] = Field(
        "auto",
        description=(
            "a waiter's wait limit. `auto`: twice the pool's average answer time, within "
            "2–30 s (2 s until an answer has ended), as room comes back when answers end; a "
            "number of seconds fixes it"
        ),
    )
    fairness: FairnessSettings = FairnessSettings()

    @field_validator("max_wait_s", mode="before")
    @classmethod
    def _max_wait_s(cls, value: Any) -> Any:
        return _positive_or_auto(value, unit="seconds", kind=int | float)
