"""A pool's fair queue, the `queue` policy's settings: how deep it is, how long a waiter
waits, and how it weighs what its tenants were served lately."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from gateway.config.base import _Model, _positive_or_auto


class FairnessSettings(_Model):
    """How a pool's queue weighs the tokens its tenants were served lately
    (policies/queue/service.py): a tenant's attained service in the pool is its prompt tokens
    plus `output_weight` × its completion tokens, halving every `half_life_s`. A request
    counts when the pool admits it, with its prompt and expected output, and is corrected by
    the usage its answer reports, so a tenant whose long streams hold the pool counts from
    their start; a request whose usage never came keeps its charge. In shared mode every
    replica adds its counts to `spillgate:service:{POOL}` and reads the fleet's back, every
    0.2 s off the request path, so all replicas order by the same figures; without Redis each
    keeps its own."""

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
            "in shared mode, each replica tells the others the tenants waiting in its queue "
            "(`spillgate:waiting:{POOL}` every 0.2 s, a replica silent for 0.6 s no longer "
            "counting; and at once on the channel `spillgate:waiting` when they change). A "
            "waiter elsewhere of a higher class holds freed room against this replica's "
            "lower class for as long as it waits, if its request could fit in the pool; one "
            "of the same class with at most half the service of the tenant whose turn it is "
            "here, whose request fits the room free now, holds it for at most `give_way_s`, "
            "then the turn here takes it. An arrival here queues rather than take that room. "
            "At most the waiter's own wait, whatever it is set to. `0`: no give-way within "
            "a class"
        ),
    )


class QueueSettings(_Model):
    """The fair queue: priority class first, strictly; within a class the tenant with the
    least attained service (see `queue.fairness`), the one served least recently among
    equals; within a tenant the earliest deadline, then arrival; the waiter whose turn it is
    is never overtaken by a smaller one. A waiter past its deadline (its wait limit, at most
    its TTFT objective: `x-spillgate-ttft-ms`, else its tenant's `ttft_budget_ms`) moves on
    to the next policy."""

    max_depth: int = Field(
        64,
        ge=0,
        description=(
            "waiters the queue holds. A full queue makes room for an arrival that goes before "
            "some of them: the newest waiters of a lower class go first (the lowest class "
            "first), then, of its own class, the newest waiters of the tenant with the most "
            "attained service, if that is more than the arrival's tenant's. A request no "
            "waiter ranks below is refused, and so is a waiter pushed out, each passed to the "
            "next step, else answered 503 `queue_full` with a Retry-After"
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
            "a waiter's wait limit. `auto` waits twice the pool's average answer time (from "
            "admission to release, how long its reservations are held), within 2–30 s, 2 s "
            "until an answer has ended (policies/queue/policy.py): room comes back as answers "
            "end, so a fixed short wait refuses on a slow fleet what it serves a moment later; "
            "a number of seconds fixes it"
        ),
    )
    fairness: FairnessSettings = FairnessSettings()

    @field_validator("max_wait_s", mode="before")
    @classmethod
    def _max_wait_s(cls, value: Any) -> Any:
        return _positive_or_auto(value, unit="seconds", kind=int | float)
