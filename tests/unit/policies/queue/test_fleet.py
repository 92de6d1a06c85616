"""Waiters at other replicas: who holds room against the turn here, and for how long."""

from __future__ import annotations

from gateway.admission.routing.route import Route
from gateway.clock import ManualClock
from gateway.overflow import Rival
from policies.queue.fleet import HEARD_S, FleetWaiters

POOL_TOKENS = 1000
SERVICE = {"heavy": 5000.0, "light": 40.0, "mild": 60.0}


class Room:
    """Only what the fleet's view asks: could a request fit the pool now, or ever."""

    free = POOL_TOKENS

    def fits_ever(self, route: Route) -> bool:
        return route.tokens * route.sequences <= POOL_TOKENS

    def has_room(self, route: Route) -> bool:
        return route.tokens * route.sequences <= self.free


def fleet(clock: ManualClock, give_way_s: float = 0.5, room: Room | None = None) -> FleetWaiters:
    return FleetWaiters(
        pool="p",
        room=room or Room(),  # type: ignore[arg-type]
        clock=clock,
        service=lambda t: SERVICE.get(t, 0.0),
        give_way_s=give_way_s,
    )


def test_a_higher_class_elsewhere_holds_the_room_for_as_long_as_it_waits() -> None:
    clock = ManualClock()
    room = Room()
    room.free = 100
    f = fleet(clock, room=room)
    looked: list[float] = []
    f.seen([Rival("critical", "vip", 900, 1, "r1")])  # larger than the room free now
    assert f.ahead_of("standard", "light") is not None
    for _ in range(10):
        assert f.gives_way("standard", "light", lambda: looked.append(clock.now))
        clock.advance(1.0)
    assert looked == []  # no give-way clock runs for a higher class
    assert f.ahead_of("critical", "vip") is None  # never ahead of its own tenant
    f.seen([Rival("critical", "vip", POOL_TOKENS + 1, 1, "r1")])  # could never fit
    assert not f.gives_way("standard", "light", lambda: None)


def test_a_lighter_tenant_elsewhere_holds_the_room_for_at_most_give_way_s() -> None:
    clock = ManualClock()
    f = fleet(clock, give_way_s=0.5)
    looked: list[float] = []
    f.seen([Rival("standard", "light", 20, 1, "r3")])
    start = clock.now
    assert f.gives_way("standard", "heavy", lambda: looked.append(clock.now))
    clock.advance(0.3)
    assert f.gives_way("standard", "heavy", lambda: looked.append(clock.now))
    clock.advance(0.2)
    assert looked == [start + 0.5]
    assert not f.gives_way("standard", "heavy", lambda: None)  # the turn here takes it
    f.served()
    assert f.gives_way("standard", "heavy", lambda: None)  # a new give-way
    # about the same service: no give-way; nor with give_way_s 0
    assert not f.gives_way("standard", "mild", lambda: None)
    assert not fleet(clock, give_way_s=0).gives_way("standard", "heavy", lambda: None)
    # room the lighter one could not take yet stays with the turn here
    room = Room()
    room.free = 10
    f = fleet(clock, room=room)
    f.seen([Rival("standard", "light", 20, 1, "r3")])
    assert not f.gives_way("standard", "heavy", lambda: None)


def test_an_announcement_outranks_the_passes_view_of_its_replica_for_a_while() -> None:
    clock = ManualClock()
    f = fleet(clock)
    f.seen([Rival("standard", "light", 20, 1, "r3"), Rival("critical", "vip", 20, 1, "r2")])
    f.heard("r3", [])  # light was served at r3: it says so at once
    assert f.rivals == [Rival("critical", "vip", 20, 1)]
    f.heard("r1", [Rival("standard", "light", 20, 1, "r1")])
    assert {r.replica for r in f.rivals} == {"r1", "r2"}
    clock.advance(HEARD_S + 0.01)
    f.seen([Rival("standard", "light", 20, 1, "r3")])  # the passes caught up
    assert [r.replica for r in f.rivals] == ["r3"]
