"""The one explicit map from policy names in config to the classes that implement them."""

from __future__ import annotations

from collections.abc import Mapping

from gateway.config import PoolSettings
from gateway.overflow import (
    ArrivalCheck,
    CountsService,
    LetsIn,
    OverflowPolicy,
    RecorderFor,
    RecordsAnswers,
)
from policies.batch import BatchPolicy
from policies.cache.policy import CachePolicy
from policies.degrade import DegradePolicy
from policies.deps import PolicyDeps, PolicyFactory
from policies.provider.policy import ProviderPolicy
from policies.queue.policy import QueuePolicy
from policies.reject import RejectPolicy


def registry() -> dict[str, PolicyFactory]:
    """Every policy by its name; the config accepts exactly these (gateway/config/base.py
    PolicyName), so a chain that loaded builds."""
    return {
        QueuePolicy.name: QueuePolicy.build,
        DegradePolicy.name: DegradePolicy.build,
        ProviderPolicy.name: ProviderPolicy.build,
        CachePolicy.name: CachePolicy.build,
        BatchPolicy.name: BatchPolicy.build,
        RejectPolicy.name: RejectPolicy.build,
    }


def build_chain(pool: PoolSettings, deps: PolicyDeps) -> list[OverflowPolicy]:
    known = registry()
    return [known[name](pool, deps) for name in pool.overflow]


def answer_recorders(chains: Mapping[str, list[OverflowPolicy]]) -> dict[str, RecorderFor]:
    """Per pool, what records its successful answers: the first recording policy in its chain."""
    recorders: dict[str, RecorderFor] = {}
    for pool, chain in chains.items():
        found = [p for p in chain if isinstance(p, RecordsAnswers)]
        if found:
            recorders[pool] = found[0].recorder_for
    return recorders


def arrival_checks(chains: Mapping[str, list[OverflowPolicy]]) -> dict[str, LetsIn]:
    """Per pool, what may hold new arrivals back from free room: the first arrival check
    in its chain."""
    checks: dict[str, LetsIn] = {}
    for pool, chain in chains.items():
        found = [p for p in chain if isinstance(p, ArrivalCheck)]
        if found:
            checks[pool] = found[0].lets_in
    return checks


def service_counters(chains: Mapping[str, list[OverflowPolicy]]) -> dict[str, CountsService]:
    """Per pool, what counts its tenants' service: the first such policy in its chain."""
    counters: dict[str, CountsService] = {}
    for pool, chain in chains.items():
        found = [p for p in chain if isinstance(p, CountsService)]
        if found:
            counters[pool] = found[0]
    return counters
