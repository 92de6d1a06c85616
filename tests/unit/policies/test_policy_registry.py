"""The one registry: every policy by its config name, the chain in config order, and the
hooks the pipeline takes from a chain (answer recorders, arrival checks)."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.admission.fleet.backends import build_pools
from gateway.admission.ledger.reservations import LocalLedger
from gateway.admission.routing.router import Router
from gateway.clock import ManualClock
from gateway.config import ConfigError, hash_key, parse_settings
from gateway.metrics import GatewayMetrics
from gateway.ratelimit import LocalRateLimiter
from gateway.ratelimit.budget import provider_budgets
from gateway.request import Endpoint, InferenceRequest
from gateway.slo import Latencies
from policies.deps import PolicyDeps
from policies.provider.gate import build_gates
from policies.registry import answer_recorders, arrival_checks, build_chain, registry

FULL = ["queue", "degrade", "provider", "cache", "batch", "reject"]


def config(**big: Any) -> dict[str, Any]:
    backend = [{"url": "http://127.0.0.1:9", "capacity": 100}]
    return {
        "tenants": [{"name": "acme", "key_sha256": hash_key("k")}],
        "pools": [
            {"name": "big", "backends": backend, **big},
            {"name": "small", "backends": backend},
        ],
        "providers": [{"name": "hosted", "base_url": "http://127.0.0.1:9/v1"}],
    }


def request(**body: Any) -> InferenceRequest:
    return InferenceRequest(
        endpoint=Endpoint.CHAT,
        tenant="acme",
        pool="big",
        priority="standard",
        stream=False,
        client_wants_usage=False,
        prompt_chars=4,
        prompt_tokens=2,
        max_output_tokens=8,
        body={"messages": [{"role": "user", "content": "hi"}], **body},
    )


def test_the_full_chain_is_built_in_config_order_with_its_hooks() -> None:
    settings = parse_settings(
        config(overflow=FULL, degrade_to="small", provider="hosted", cache={"store": "all"})
    )
    clock, metrics = ManualClock(), GatewayMetrics()
    router = Router(build_pools(settings.pools, clock=clock), ledger=LocalLedger(), clock=clock)
    deps = PolicyDeps(
        settings=settings,
        room=router,
        metrics=metrics,
        clock=clock,
        latencies=Latencies(clock),
        providers=build_gates(
            settings.providers,
            environ={},
            clock=clock,
            metrics=metrics,
            budgets=provider_budgets(LocalRateLimiter(clock), settings.providers),
            slots=LocalLedger(),
        ),
    )
    chains = {p.name: build_chain(p, deps) for p in settings.pools}
    assert [p.name for p in chains["big"]] == FULL
    assert [p.name for p in chains["small"]] == ["reject"]
    assert set(registry()) == set(FULL)
    recorders, checks = answer_recorders(chains), arrival_checks(chains)
    assert set(recorders) == {"big"} and set(checks) == {"big"}
    assert recorders["big"](request()) is not None
    assert checks["big"](request())  # nobody waits yet


@pytest.mark.parametrize(
    ("pool", "problem"),
    [
        (
            {"overflow": ["degrade", "reject"]},
            "pools[0].overflow[0]: 'degrade' needs pools[0].degrade_to",
        ),
        ({"overflow": ["provider"]}, "pools[0].overflow[0]: 'provider' needs pools[0].provider"),
        ({"degrade_to": "big"}, "pools[0].degrade_to: a pool cannot degrade to itself"),
    ],
)
def test_a_chain_missing_what_a_policy_needs_is_refused_at_load(
    pool: dict[str, Any], problem: str
) -> None:
    with pytest.raises(ConfigError) as info:
        parse_settings(config(**pool))
    assert problem in str(info.value)
