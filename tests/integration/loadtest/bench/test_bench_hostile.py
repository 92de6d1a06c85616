"""`spillgate bench hostile` in tiny sizes: the plumbing (a simulator, a hostile server, a
gateway in processes of their own, both arms, the memory sampled), not a measurement."""

from __future__ import annotations

import json

import pytest

from gateway.cli import main


def test_the_bench_times_a_tenant_beside_an_event_that_never_ends(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code = main(["bench", "hostile", "--rounds", "1", "--seconds", "0.5", "--event-mb", "4"])
    printed = capsys.readouterr()
    figures = json.loads(printed.out)
    assert code == (0 if figures["met"] else 1)
    assert set(figures["p99_ms"]) == {"quiet", "hostile"}
    assert figures["p50_ms"]["quiet"] > 0 and figures["p99_ratio"] > 0
    rounds = [json.loads(line) for line in printed.err.splitlines() if line.startswith("{")]
    assert [r["hostile"] for r in rounds] == [False, True]
    # the hostile tenant's streams reached its backend: at least one started (a 200) and
    # was cut at the event bound. A backend the gateway's probe never took into rotation
    # would have every one refused at the door (503), and the bench would time nothing
    assert rounds[1]["hostile_statuses"].get("200", 0) >= 1
    assert rounds[1]["hostile_cut_at_bound"] >= 1
    assert figures["hostile_cut_at_bound"] >= 1
    assert rounds[0]["requests"] > 0 and rounds[1]["requests"] > 0
