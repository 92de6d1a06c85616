"""A provider's gate: tokens-per-minute budget, concurrency cap and circuit breaker
(the breaker itself: tests/unit/gateway/test_breaker.py)."""

from __future__ import annotations

import asyncio

import pytest

from gateway.admission.ledger.reservations import LocalLedger
from gateway.clock import ManualClock
from gateway.config import ProviderSettings
from gateway.errors import SpillgateError
from gateway.metrics import GatewayMetrics
from gateway.ratelimit import LocalRateLimiter
from gateway.ratelimit.budget import BucketBudget, provider_budgets
from policies.provider.gate import (
    Claim,
    ProviderGate,
    Refusal,
    build_gates,
)


def settings(**overrides: object) -> ProviderSettings:
    base: dict[str, object] = {
        "name": "hosted",
        "base_url": "https://api.example/v1/",
        "api_key_env": "HOSTED_KEY",
        "models": {"big": "vendor/big-model"},
        "tokens_per_minute": 6000,
        "max_concurrency": 2,
        "breaker_failures": 2,
        "breaker_cooldown_s": 10.0,
        "prompt_price_per_m": 1.0,
        "completion_price_per_m": 3.0,
    }
    return ProviderSettings.model_validate({**base, **overrides})


def hosted_budget(clock: ManualClock) -> BucketBudget:
    provider = settings()
    return BucketBudget(
        LocalRateLimiter(clock), key=provider.name, tokens_per_minute=provider.tokens_per_minute
    )


def hosted_gate(
    clock: ManualClock, *, api_key: str | None, budget: BucketBudget | None = None
) -> ProviderGate:
    return ProviderGate(
        settings(),
        api_key=api_key,
        clock=clock,
        budget=budget or hosted_budget(clock),
        slots=LocalLedger(),
    )


def test_gate_refuses_without_claiming_and_settles_the_budget_with_real_usage() -> None:
    clock = ManualClock()
    budget = hosted_budget(clock)
    gate = hosted_gate(clock, api_key="sk-x", budget=budget)

    async def scenario() -> None:
        a, b = await gate.acquire(1000), await gate.acquire(1000)
        assert isinstance(a, Claim) and isinstance(b, Claim)
        assert await gate.acquire(1) is Refusal.CONCURRENCY
        await gate.release(a, used=200)  # 800 of 1000 come back
        await gate.release(b, used=None)  # usage unknown: the reservation stays spent
        assert gate.in_flight == 0
        left = (await budget.limiter.peek(budget.limits)).remaining_tokens
        assert left == 6000 - 200 - 1000
        assert await gate.acquire(6000) is Refusal.BUDGET
        clock.advance(60)  # a minute refills the whole budget, never beyond it
        assert isinstance(await gate.acquire(6000), Claim)
        assert await gate.acquire(1) is Refusal.BUDGET
        gate.breaker.record_failure(retry_after=5)
        assert await gate.acquire(10) is Refusal.BREAKER_OPEN
        assert gate.in_flight == 1

    asyncio.run(scenario())


def test_target_carries_the_providers_own_key_and_model_mapping() -> None:
    clock = ManualClock()
    gate = hosted_gate(clock, api_key="sk-provider")
    target = gate.target("big")
    assert target.api_base == "https://api.example/v1"
    assert target.model == "vendor/big-model"
    assert target.headers == {"authorization": "Bearer sk-provider"}
    assert gate.target("other").model == "other"  # unmapped pools keep their name
    assert target.external  # its refusals are its failures, never relayed
    assert gate.cost(prompt_tokens=1_000_000, completion_tokens=500_000) == pytest.approx(2.5)


def test_what_the_provider_said_is_logged_without_its_key() -> None:
    clock = ManualClock()
    gate = hosted_gate(clock, api_key="sk-provider")
    said = "Incorrect API key provided: sk-provider. Again: sk-provider"
    assert gate.redact(said) == "Incorrect API key provided: ***. Again: ***"
    keyless = hosted_gate(clock, api_key=None)
    assert keyless.redact(said) == said


def test_a_missing_key_is_refused_at_build_and_the_breaker_drives_its_gauge() -> None:
    metrics = GatewayMetrics()
    clock = ManualClock()
    with pytest.raises(SpillgateError, match="HOSTED_KEY"):
        build_gates(
            [settings()],
            environ={},
            clock=clock,
            metrics=metrics,
            budgets={"hosted": hosted_budget(clock)},
            slots=LocalLedger(),
        )
    gates = build_gates(
        [settings()],
        environ={"HOSTED_KEY": "k"},
        clock=clock,
        metrics=metrics,
        budgets=provider_budgets(LocalRateLimiter(clock), [settings()]),
        slots=LocalLedger(),
    )
    gates["hosted"].breaker.record_failure(retry_after=1)
    value = metrics.registry.get_sample_value(
        "spillgate_provider_breaker_open", {"provider": "hosted"}
    )
    assert value == 1.0
