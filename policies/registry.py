"""The one explicit map from policy names in config to the classes that implement them."""

from __future__ import annotations

from gateway.config import PoolSettings
from policies.base import OverflowPolicy, PolicyDeps, PolicyFactory
from policies.reject import RejectPolicy


def registry() -> dict[str, PolicyFactory]:
    return {
        RejectPolicy.name: RejectPolicy.build,
    }


def unknown_policies(pools: list[PoolSettings]) -> list[str]:
    known = registry()
    return [
        f"pools.{i}.overflow: unknown policy {name!r} (known: {', '.join(sorted(known))})"
        for i, pool in enumerate(pools)
        for name in pool.overflow
        if name not in known
    ]


def build_chain(pool: PoolSettings, deps: PolicyDeps) -> list[OverflowPolicy]:
    known = registry()
    return [known[name](pool, deps) for name in pool.overflow]
