"""A router over in-process backends of hand-set capacity, on a manual clock."""

from collections.abc import Sequence
from typing import Any

from gateway.admission.fleet.backends import build_pools
from gateway.admission.ledger.reservations import LocalLedger
from gateway.admission.routing.router import Router
from gateway.clock import ManualClock
from gateway.config import parse_settings


def local_router(
    capacities: Sequence[int],
    *,
    target_fill: float,
    block_size: int,
    clock: ManualClock | None = None,
    routing_profiles: Sequence[dict[str, Any]] = (),
    **pool: Any,
) -> Router:
    """Pool `p` with one backend per capacity (`p-0`, `p-1`, …), a local ledger, the
    `routing_profiles` it may name, and the pool's other settings from `pool`."""
    backends = [
        {"url": f"http://127.0.0.1:{i + 1}", "capacity": c, "block_size": block_size}
        for i, c in enumerate(capacities)
    ]
    settings = parse_settings(
        {
            "tenants": [{"name": "t", "key_env": "K"}],
            "pools": [{"name": "p", "target_fill": target_fill, "backends": backends, **pool}],
            "routing_profiles": list(routing_profiles),
        }
    )
    clock = clock or ManualClock()
    pools = build_pools(settings.pools, clock=clock, profiles=settings.routing_profiles)
    return Router(pools, ledger=LocalLedger(), clock=clock)
