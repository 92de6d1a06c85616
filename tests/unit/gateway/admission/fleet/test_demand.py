"""Refused demand is remembered only as long as it would have held capacity."""

from gateway.admission.fleet.demand import PoolDemand
from gateway.clock import ManualClock


def test_refusals_are_forgotten_even_when_nobody_reads_the_demand() -> None:
    clock = ManualClock()
    demand = PoolDemand(clock)
    for _ in range(10_000):  # an hour of refusals, one every 0.36 s, and no metrics scrape
        started = demand.begin(100)
        demand.end(100, started=started, used=0, refused=True)
        clock.advance(0.36)
    assert len(demand._refused_held) <= 5  # only those within one hold time of now
    assert demand.refused_tokens_held() <= 5 * 100
