"""The one explicit map from policy names in config to the classes that implement them."""

from __future__ import annotations

from collections.abc import Mapping

from gateway.config import PoolSettings
from gateway.overflow import AdmissionGate, AnswerObserver, Gate, OverflowPolicy, TapFactory
from policies.batch import BatchPolicy
from policies.cache.policy import CachePolicy
from policies.degrade import DegradePolicy
from policies.deps import PolicyDeps, PolicyFactory
from policies.provider.policy import ProviderPolicy
from policies.queue.policy import QueuePolicy
from policies.reject import RejectPolicy


def registry() -> dict[str, PolicyFactory]:
    """Every policy by its name; the config accepts exactly these (gateway/config.py
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


def answer_taps(chains: Mapping[str, list[OverflowPolicy]]) -> dict[str, TapFactory]:
    """Per pool, what watches its successful answers: the first observer in its chain."""
    taps: dict[str, TapFactory] = {}
    for pool, chain in chains.items():
        observers = [p for p in chain if isinstance(p, AnswerObserver)]
        if observers:
            taps[pool] = observers[0].tap_for
    return taps


def admission_gates(chains: Mapping[str, list[OverflowPolicy]]) -> dict[str, Gate]:
    """Per pool, what may hold new arrivals back from free room: the first gate in its chain."""
    gates: dict[str, Gate] = {}
    for pool, chain in chains.items():
        found = [p for p in chain if isinstance(p, AdmissionGate)]
        if found:
            gates[pool] = found[0].lets_in
    return gates
