"""What the gateway knows about each external provider: budget, concurrency and breaker.

One `ProviderGate` per configured provider, shared by every pool that spills to it, built
once in `create_app`. A gate lets a request through only while the provider's breaker is
closed (or half-open for one trial), one of its `max_concurrency` slots is free and the
provider's tokens-per-minute budget holds the request's reservation. The budget is a
token bucket of a limiter like the tenants' buckets (gateway/ratelimit/budget.py), and the
slots are leases of a ledger like the backends' in-flight tokens (one token a request), so
with Redis every replica spends from one budget and one cap. The app hands both in.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING

from gateway.breaker import BreakerState, CircuitBreaker
from gateway.clock import Clock
from gateway.config import ProviderSettings
from gateway.errors import SpillgateError
from gateway.overflow import ProviderMetrics, Slots, Target, TokenBudget
from gateway.request import InferenceRequest

if TYPE_CHECKING:
    from gateway.overflow import Reservation


class Refusal(StrEnum):
    """Why a gate did not let a request through."""

    BREAKER_OPEN = "breaker_open"
    CONCURRENCY = "concurrency"
    BUDGET = "budget"


@dataclass(frozen=True, slots=True)
class Claim:
    """A request's claim on a provider: a concurrency slot and `tokens` of budget."""

    tokens: int
    slot: Reservation


class ProviderGate:
    def __init__(
        self,
        settings: ProviderSettings,
        *,
        api_key: str | None,
        clock: Clock,
        budget: TokenBudget,
        slots: Slots,
        on_breaker: Callable[[str, BreakerState], None] | None = None,
    ) -> None:
        self.settings = settings
        self.name = settings.name
        self._api_key = api_key
        self.budget = budget
        self.slots = slots
        self.breaker = CircuitBreaker(
            failures=settings.breaker_failures,
            cooldown_s=settings.breaker_cooldown_s,
            clock=clock,
            on_change=None if on_breaker is None else lambda s: on_breaker(self.name, s),
        )

    @property
    def in_flight(self) -> int:
        """Requests at this provider, over the whole fleet when the slots are shared."""
        return self.slots.sessions(self.name)

    def serves(self, request: InferenceRequest) -> bool:
        """Whether the provider answers `request`: any of its pool's, but one for a LoRA
        adapter only where `models` names a model of its own for that adapter."""
        return request.adapter is None or request.adapter in self.settings.models

    def target(self, pool: str) -> Target:
        headers = {} if self._api_key is None else {"authorization": f"Bearer {self._api_key}"}
        return Target(
            name=self.name,
            api_base=self.settings.base_url.rstrip("/"),
            model=self.settings.models.get(pool, pool),
            timeouts=self.settings.timeouts,
            headers=headers,
            external=True,
        )

    def redact(self, text: str) -> str:
        """`text` without the provider's key: its errors may echo what they were sent."""
        return text.replace(self._api_key, "***") if self._api_key else text

    async def acquire(self, tokens: int) -> Claim | Refusal:
        """Claim a slot and budget for one request, or say why not (claiming nothing).

        The slot is a lease of one in the slots ledger, capped at `max_concurrency`: with
        Redis, one cap for every process of the fleet (a dead one's slots expire with
        its leases), as the budget is one budget."""
        if self.in_flight >= self.settings.max_concurrency:
            return Refusal.CONCURRENCY
        if not self.breaker.allow():
            return Refusal.BREAKER_OPEN
        try:
            slot = await self.slots.reserve(self.name, 1, limit=self.settings.max_concurrency)
        except BaseException:
            self.breaker.release_trial()
            raise
        if slot is None:
            self.breaker.release_trial()
            return Refusal.CONCURRENCY
        try:
            afforded = await self.budget.spend(tokens)
        except BaseException:
            await self._unclaim(slot)
            raise
        if not afforded:
            await self._unclaim(slot)
            return Refusal.BUDGET
        return Claim(tokens, slot)

    async def _unclaim(self, slot: Reservation) -> None:
        self.breaker.release_trial()
        await self.slots.release(slot)

    async def release(self, claim: Claim, *, used: int | None) -> None:
        """Give the slot back, and the budget the answer did not use (none if unknown, or
        if `used` is no count); each is given back whatever giving back the other does."""
        try:
            await self.slots.release(claim.slot)
        finally:
            spent = self.counted(used)
            if spent is None:
                spent = claim.tokens
            if spent != claim.tokens:
                await self.budget.settle(spent=claim.tokens, used=spent)

    def counted(self, tokens: object) -> int | None:
        """A token count the provider's answer gave, as the gate accounts it: at most a
        minute of the provider's budget (the most a claim can hold: one answer that says
        it used more cannot take the budget from every tenant for longer), or None for
        what is not a count (a negative number, a float, a string)."""
        if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 0:
            return None
        return min(tokens, self.settings.tokens_per_minute)

    def cost(self, *, prompt_tokens: int, completion_tokens: int) -> float:
        s = self.settings
        return (
            prompt_tokens * s.prompt_price_per_m + completion_tokens * s.completion_price_per_m
        ) / 1e6


def build_gates(
    providers: list[ProviderSettings],
    *,
    environ: Mapping[str, str],
    clock: Clock,
    metrics: ProviderMetrics,
    budgets: Mapping[str, TokenBudget],
    slots: Slots,
) -> dict[str, ProviderGate]:
    """One gate per provider, spending its budget in `budgets`; a key named but missing from
    the environment is an error. The gates share `slots`, each under its provider's name."""

    def on_breaker(name: str, state: BreakerState) -> None:
        metrics.provider_breaker_open.labels(name).set(1.0 if state is BreakerState.OPEN else 0.0)

    gates: dict[str, ProviderGate] = {}
    for p in providers:
        key = None
        if p.api_key_env is not None:
            if p.api_key_env not in environ:
                raise SpillgateError(f"provider {p.name!r}: ${p.api_key_env} is not set")
            key = environ[p.api_key_env]
        gates[p.name] = ProviderGate(
            p,
            api_key=key,
            clock=clock,
            budget=budgets[p.name],
            slots=slots,
            on_breaker=on_breaker,
        )
    return gates
