"""The bookkeeping that picks the adapters to unload from a backend past its budget."""

from __future__ import annotations

import asyncio

import pytest

from gateway.admission.adapter_uses import AdapterUses, BudgetFull
from gateway.admission.fleet.backend_load import ReportedLoad
from gateway.admission.fleet.backends import Backend
from gateway.admission.ledger.reservations import Reservation
from gateway.clock import ManualClock


class Releases:
    def __init__(self) -> None:
        self.released: list[Reservation] = []

    async def release(self, reservation: Reservation) -> None:
        self.released.append(reservation)

    async def extend(self, reservation: Reservation, tokens: int) -> Reservation:
        return reservation._replace(tokens=reservation.tokens + tokens)


def backend(*adapters: str) -> Backend:
    return Backend(
        name="b0",
        pool="m",
        url="http://127.0.0.1:1",
        served_model="m",
        configured_capacity=1000,
        adapters=frozenset(adapters),
    )


def test_only_what_the_gateway_loaded_counts_and_the_least_recently_used_goes() -> None:
    clock = ManualClock()
    uses = AdapterUses(clock)
    releases = Releases()
    for name in ("x", "y"):
        uses.loaded("b0", name)
        clock.now += 1
    # a request for x ends on b0: y is now the least recently used
    held = uses.held(releases, "x")
    held.take(Reservation(backend="b0", tokens=10, id="r1"))
    asyncio.run(held.release())
    assert [r.id for r in releases.released] == ["r1"]
    on_b0 = backend("started", "x", "y")  # "started": the engine's own, never counted
    assert uses.to_unload(on_b0, 3) == []
    assert uses.to_unload(on_b0, 2) == ["y"]
    assert uses.to_unload(on_b0, 1) == ["y", "x"]


def test_an_adapter_in_use_there_is_kept_and_one_gone_is_forgotten() -> None:
    clock = ManualClock()
    uses = AdapterUses(clock)
    uses.loaded("b0", "x")
    clock.now += 1
    uses.loaded("b0", "y")
    held = uses.held(Releases(), "x")
    uses.watch("x", held)
    held.take(Reservation(backend="b0", tokens=10, id="r1"))
    assert uses.busy("b0", "x") and not uses.busy("b1", "x")
    assert uses.to_unload(backend("x", "y"), 2) == ["y"]  # x is older, but in use
    with pytest.raises(BudgetFull):
        uses.to_unload(backend("x", "y"), 1)
    uses.done("x", held)
    assert uses.to_unload(backend("x", "y"), 2) == ["x"]
    # y unloaded by other means (the backend no longer lists it): no longer counted
    assert uses.to_unload(backend("x"), 2) == []


def test_an_adapter_the_engine_reports_running_is_kept() -> None:
    """Requests another replica sent hold no reservation here; the engine's own report of
    the adapters its steps run keeps theirs loaded."""
    clock = ManualClock()
    uses = AdapterUses(clock)
    for name in ("x", "y"):
        uses.loaded("b0", name)
        clock.now += 1
    on_b0 = backend("x", "y")
    assert uses.to_unload(on_b0, 1) == ["x", "y"]
    running_x = ReportedLoad(
        kv_usage=0.1, waiting=0, preemptions=None, active_adapters=frozenset({"x"})
    )
    on_b0.report(running_x, now=clock.monotonic())
    assert uses.to_unload(on_b0, 2) == ["y"]
    with pytest.raises(BudgetFull):
        uses.to_unload(on_b0, 1)
