"""Whatever usage a provider's answer reports, its concurrency slot comes back, its budget owes
no more than a minute of itself, and its spend counts no negative or absurd dollars."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from gateway.admission.ledger.reservations import LocalLedger, Reservation
from gateway.clock import ManualClock
from gateway.config import ProviderSettings
from gateway.metrics import GatewayMetrics
from gateway.outcome import Outcome
from gateway.ratelimit import LocalRateLimiter
from gateway.ratelimit.budget import BucketBudget
from gateway.request import InferenceRequest
from gateway.slo import Latencies
from gateway.upstream.answer import Usage
from gateway.upstream.relay import Relayed
from gateway.upstream.served import Served
from policies.provider.gate import Claim, ProviderGate
from policies.provider.policy import ProviderPolicy
from tests.support.upstream import chat_request

BUDGET = 6_000  # tokens a minute
CLAIM = 1_000  # what each request below claims: its prompt and its output's limit


def settings() -> ProviderSettings:
    return ProviderSettings.model_validate(
        {
            "name": "hosted",
            "base_url": "https://api.example/v1/",
            "tokens_per_minute": BUDGET,
            "max_concurrency": 1,
            "prompt_price_per_m": 1.0,
            "completion_price_per_m": 3.0,
        }
    )


class Slots(LocalLedger):
    """The gate's slots, whose next `release` fails (before releasing) when told to."""

    fail_next = False

    async def release(self, reservation: Reservation) -> None:
        if self.fail_next:
            self.fail_next = False
            raise ConnectionError("the slots' store went away")
        await super().release(reservation)


def gate_and_budget() -> tuple[ProviderGate, BucketBudget]:
    clock = ManualClock()
    budget = BucketBudget(LocalRateLimiter(clock), key="hosted", tokens_per_minute=BUDGET)
    gate = ProviderGate(settings(), api_key=None, clock=clock, budget=budget, slots=Slots())
    return gate, budget


def budget_left(budget: BucketBudget) -> float:
    return asyncio.run(budget.limiter.peek(budget.limits)).remaining_tokens


def request() -> InferenceRequest:
    """A request that claims CLAIM tokens: 100 of prompt and the rest of output."""
    return chat_request(max_tokens=CLAIM - 100)._replace(prompt_tokens=100)


async def answered(policy: ProviderPolicy, usage: Usage) -> None:
    """The policy's decision for one request, told that the provider answered with `usage`."""
    decision = await policy.decide(request(), None)  # type: ignore[arg-type]
    assert decision is not None
    relayed = Relayed(usage, first_byte_at=None, completed=True)
    served = Served(Outcome.PROVIDER, decision.target.name, decision.request.pool, relayed)
    await decision.spill.answered(served)


def spill(usage: Usage, *, metrics: Any = None) -> tuple[ProviderGate, BucketBudget, Any]:
    """One request spilled to a provider that answers with `usage`."""
    gate, budget = gate_and_budget()
    metrics = metrics or GatewayMetrics()
    policy = ProviderPolicy(gate=gate, metrics=metrics, latencies=Latencies(ManualClock()))
    asyncio.run(answered(policy, usage))
    return gate, budget, metrics


def spent_dollars(metrics: GatewayMetrics) -> float:
    value = metrics.registry.get_sample_value(
        "spillgate_provider_cost_dollars_total", {"provider": "hosted"}
    )
    return value or 0.0


@pytest.mark.parametrize(
    ("prompt", "completion"), [(10, -500), (-10, 50), (-(10**18), 10**18)], ids=str
)
def test_a_negative_usage_frees_the_slot_keeps_the_claim_spent_and_costs_nothing(
    prompt: int, completion: int
) -> None:
    gate, budget, metrics = spill(
        Usage(prompt_tokens=prompt, completion_tokens=completion, known=True)
    )
    assert gate.in_flight == 0
    assert budget_left(budget) == BUDGET - CLAIM
    assert spent_dollars(metrics) == 0.0


def test_a_huge_usage_costs_the_budget_a_minute_of_itself_at_most() -> None:
    gate, budget, metrics = spill(Usage(prompt_tokens=10, completion_tokens=10**18, known=True))
    assert gate.in_flight == 0
    assert budget_left(budget) == 0  # spent, not owed for ever
    refused = asyncio.run(budget.limiter.acquire(budget.limits, CLAIM))
    assert refused.retry_after_s == pytest.approx(10.0)  # 1,000 tokens at 6,000 a minute
    # each count believed up to the budget's minute: 10 prompt and 6,000 completion tokens
    assert spent_dollars(metrics) == pytest.approx((10 * 1.0 + BUDGET * 3.0) / 1e6)


class BrokenCost:
    """Metrics whose spend counter fails: what the answer's recording does may raise."""

    def __init__(self) -> None:
        self.real = GatewayMetrics()
        self.upstream_errors = self.real.upstream_errors
        self.provider_breaker_open = self.real.provider_breaker_open

    @property
    def provider_cost(self) -> Any:
        raise RuntimeError("the spend counter broke")


def test_an_error_recording_the_answer_still_frees_the_slot_and_settles_the_budget() -> None:
    gate, budget = gate_and_budget()
    policy = ProviderPolicy(gate=gate, metrics=BrokenCost(), latencies=Latencies(ManualClock()))
    with pytest.raises(RuntimeError, match="spend counter"):
        asyncio.run(answered(policy, Usage(prompt_tokens=10, completion_tokens=90, known=True)))
    assert gate.in_flight == 0
    assert budget_left(budget) == BUDGET - 100  # what was not used came back


def test_a_failed_slot_release_still_settles_the_budget() -> None:
    gate, budget = gate_and_budget()

    async def scenario() -> None:
        claim = await gate.acquire(CLAIM)
        assert isinstance(claim, Claim)
        gate.slots.fail_next = True  # type: ignore[attr-defined]
        with pytest.raises(ConnectionError):
            await gate.release(claim, used=100)

    asyncio.run(scenario())
    assert budget_left(budget) == BUDGET - 100


@pytest.mark.parametrize("used", [-5, 1e300, "lots", [5], True], ids=repr)
def test_a_used_count_that_is_no_count_keeps_the_claim_spent(used: object) -> None:
    gate, budget = gate_and_budget()

    async def scenario() -> None:
        claim = await gate.acquire(CLAIM)
        assert isinstance(claim, Claim)
        await gate.release(claim, used=used)  # type: ignore[arg-type]

    asyncio.run(scenario())
    assert (gate.in_flight, budget_left(budget)) == (0, BUDGET - CLAIM)
