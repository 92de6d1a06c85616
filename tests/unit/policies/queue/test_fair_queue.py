"""The order queued requests get capacity in: class first, then the tenant with the least
service (in turn among equals), then each tenant's earliest deadline and arrival."""

from __future__ import annotations

import math

from gateway.config import Priority
from policies.queue.fair_queue import FairQueue, Waiter


def waiter(
    tenant: str, priority: Priority = "standard", tokens: int = 10, deadline: float = math.inf
) -> Waiter[str]:
    return Waiter(
        tenant=tenant,
        priority=priority,
        tokens=tokens,
        item=f"{tenant}-{priority}",
        deadline=deadline,
    )


def drain(queue: FairQueue[str]) -> list[Waiter[str]]:
    order = []
    while (w := queue.best()) is not None:
        assert queue.take(w)
        order.append(w)
    return order


def test_higher_classes_go_first_whatever_the_arrival_order() -> None:
    q: FairQueue[str] = FairQueue(max_depth=10)
    for w in [waiter("a", "sheddable"), waiter("b", "standard"), waiter("c", "critical")]:
        assert q.push(w)
    assert [w.priority for w in drain(q)] == ["critical", "standard", "sheddable"]
    assert len(q) == 0


def test_a_flooding_tenant_takes_turns_with_a_steady_one() -> None:
    q: FairQueue[str] = FairQueue(max_depth=100)
    flood = [waiter("flood") for _ in range(10)]
    for w in flood[:5]:
        q.push(w)
    steady = [waiter("steady"), waiter("steady")]
    q.push(steady[0])
    for w in flood[5:]:
        q.push(w)
    q.push(steady[1])
    drained = drain(q)
    # the flood arrived first, so it opens; after that the tenants alternate
    assert [w.tenant for w in drained[:4]] == ["flood", "steady", "flood", "steady"]
    assert [w.tenant for w in drained[4:]] == ["flood"] * 8
    # within a tenant, arrival order is kept
    assert [w for w in drained if w.tenant == "flood"] == flood


def test_the_tenant_served_least_recently_goes_first() -> None:
    q: FairQueue[str] = FairQueue(max_depth=10)
    q.push(waiter("a"))
    assert q.take(q.best() or waiter("none"))
    q.push(waiter("a"))
    q.push(waiter("b"))  # arrives later, but b has never been served
    assert [w.tenant for w in drain(q)] == ["b", "a"]


def test_the_waiter_whose_turn_it_is_is_not_overtaken_by_smaller_ones() -> None:
    q: FairQueue[str] = FairQueue(max_depth=10)
    big = waiter("a", "standard", tokens=500)
    small = waiter("b", "standard", tokens=50)
    lower = waiter("c", "sheddable", tokens=10)
    for w in (big, small, lower):
        q.push(w)
    # the queue offers only the head; the caller waits until it fits
    assert q.best() is big
    q.take(big)
    assert q.best() is small
    q.take(small)
    assert q.best() is lower


def test_depth_is_bounded_and_the_newest_lowest_waiter_is_the_victim() -> None:
    q: FairQueue[str] = FairQueue(max_depth=3)
    old_shed, new_shed, std = waiter("a", "sheddable"), waiter("b", "sheddable"), waiter("c")
    for w in (old_shed, new_shed, std):
        assert q.push(w)
    assert not q.push(waiter("d", "critical"))
    assert q.victims_for(waiter("d", "critical")) == [new_shed]
    assert q.victims_for(waiter("d", "standard")) == [new_shed]
    assert q.victims_for(waiter("d", "sheddable")) is None
    assert q.remove(new_shed) and not q.remove(new_shed)
    assert len(q) == 2
    assert q.victims_for(waiter("d", "sheddable")) == []  # fits now


def test_the_tenant_with_the_least_service_goes_first() -> None:
    service = {"heavy": 5000.0, "light": 40.0}
    q: FairQueue[str] = FairQueue(max_depth=10, service=lambda t: service.get(t, 0.0))
    heavy = [waiter("heavy") for _ in range(3)]
    for w in heavy:
        q.push(w)
    q.push(waiter("light"))  # arrives last, but has been served least
    q.push(waiter("new"))  # never served at all
    assert [w.tenant for w in drain(q)] == ["new", "light", "heavy", "heavy", "heavy"]
    # a higher class still goes first whatever its tenant's service
    q.push(waiter("light"))
    q.push(waiter("heavy", "critical"))
    assert [w.tenant for w in drain(q)] == ["heavy", "light"]


def test_within_a_tenant_the_earliest_deadline_goes_first_then_arrival() -> None:
    q: FairQueue[str] = FairQueue(max_depth=10)
    patient, hurried, also_patient = (
        waiter("a", deadline=30),
        waiter("a", deadline=2),
        waiter("a", deadline=30),
    )
    for w in (patient, hurried, also_patient):
        q.push(w)
    assert drain(q) == [hurried, patient, also_patient]


def test_a_removed_waiter_leaves_its_tenants_order_intact() -> None:
    q: FairQueue[str] = FairQueue(max_depth=10)
    ws = [waiter("a", deadline=d) for d in (5, 1, 4, 2, 3)]
    for w in ws:
        q.push(w)
    assert q.remove(ws[2]) and q.tokens_waiting == 40
    assert [w.deadline for w in drain(q)] == [1, 2, 3, 5]
    assert q.tokens_waiting == 0


def test_the_tokens_waiting_are_bounded_and_lower_classes_make_room() -> None:
    q: FairQueue[str] = FairQueue(max_depth=10, max_tokens=100)
    shed_old, shed_new = waiter("s", "sheddable", tokens=30), waiter("s", "sheddable", tokens=30)
    std = waiter("t", tokens=30)
    for w in (shed_old, shed_new, std):
        assert q.push(w)
    assert q.tokens_waiting == 90
    big = waiter("u", tokens=20)
    assert not q.push(big)  # 110 > 100, though only 3 of 10 places are taken
    assert q.victims_for(big) == [shed_new]
    # 60 tokens must go: both sheddable waiters, the newest first
    assert q.victims_for(waiter("u", "standard", tokens=70)) == [shed_new, shed_old]
    # a critical one may also displace the standard one
    assert q.victims_for(waiter("u", "critical", tokens=80)) == [shed_new, shed_old, std]
    # none would do: evicting every lower waiter leaves too little, or it exceeds the bound
    assert q.victims_for(waiter("u", "standard", tokens=90)) is None
    assert q.victims_for(waiter("u", "critical", tokens=101)) is None
    assert q.push(waiter("u", tokens=10))


def test_ahead_of_counts_who_would_go_before_a_request_queued_now() -> None:
    service = {"heavy": 5000.0, "light": 40.0}
    q: FairQueue[str] = FairQueue(max_depth=20, service=lambda t: service.get(t, 0.0))
    for deadline in (1, 2, 3):
        q.push(waiter("heavy", deadline=deadline))
    q.push(waiter("light", deadline=9))
    q.push(waiter("vip", "critical"))
    q.push(waiter("light", "sheddable"))
    # the critical one, then light's one, then heavy's with earlier deadlines
    assert q.ahead_of("heavy", "standard", deadline=2.5) == 1 + 1 + 2
    assert q.ahead_of("light", "standard", deadline=10) == 1 + 1  # heavy comes after it
    assert q.ahead_of("new", "standard", deadline=10) == 1  # never served: only the class above
    assert q.ahead_of("light", "sheddable", deadline=1) == 5
    assert q.ahead_of("vip", "critical", deadline=math.inf) == 1


def test_a_lighter_tenant_displaces_the_heaviest_tenants_newest_waiter() -> None:
    service = {"heavy": 5000.0, "middle": 900.0, "light": 40.0}
    q: FairQueue[str] = FairQueue(max_depth=4, service=lambda t: service.get(t, 0.0))
    heavy_old, heavy_new = waiter("heavy"), waiter("heavy")
    middle, light = waiter("middle"), waiter("light")
    for w in (heavy_old, middle, heavy_new, light):
        assert q.push(w)
    assert q.victims_for(waiter("light")) == [heavy_new]
    assert q.victims_for(waiter("middle")) == [heavy_new]
    assert q.victims_for(waiter("new")) == [heavy_new]
    # the heaviest has nobody heavier to push out; a lower class displaces nobody
    assert q.victims_for(waiter("heavy")) is None
    assert q.victims_for(waiter("light", "sheddable")) is None
    # a lower class's waiter goes before a heavy tenant's of the arrival's class
    shed = waiter("light", "sheddable")
    assert q.remove(light) and q.push(shed)
    assert q.victims_for(waiter("middle")) == [shed]


def test_displacing_by_tokens_goes_from_the_heaviest_down_to_the_arrivals_own_service() -> None:
    service = {"heavy": 5000.0, "middle": 900.0, "light": 40.0}
    q: FairQueue[str] = FairQueue(
        max_depth=10, max_tokens=100, service=lambda t: service.get(t, 0.0)
    )
    heavy, middle, light = (
        waiter("heavy", tokens=30),
        waiter("middle", tokens=30),
        waiter("light", tokens=30),
    )
    for w in (heavy, middle, light):
        assert q.push(w)
    assert q.victims_for(waiter("light", tokens=50)) == [heavy, middle]
    assert q.victims_for(waiter("middle", tokens=50)) is None  # only heavy is heavier
    assert q.victims_for(waiter("middle", tokens=40)) == [heavy]
    # a critical arrival pushes out anyone of a lower class, light or heavy
    assert q.victims_for(waiter("heavy", "critical", tokens=70)) == [light, middle]
