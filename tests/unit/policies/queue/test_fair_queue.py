"""The order queued requests get capacity in: class first, tenants in turn, arrival within."""

from __future__ import annotations

from gateway.config import Priority
from policies.queue.fair_queue import FairQueue, Waiter


def waiter(tenant: str, priority: Priority = "standard", tokens: int = 10) -> Waiter[str]:
    return Waiter(tenant=tenant, priority=priority, tokens=tokens, item=f"{tenant}-{priority}")


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
    assert q.victim_for("critical") is new_shed
    assert q.victim_for("standard") is new_shed
    assert q.victim_for("sheddable") is None
    assert q.remove(new_shed) and not q.remove(new_shed)
    assert len(q) == 2
