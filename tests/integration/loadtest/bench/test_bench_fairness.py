"""`spillgate bench fairness` end to end, in tiny sizes: the plumbing (the simulator and the
gateway it starts, the heavy flood and the light sender, the figures and the targets), not
a measurement."""

from __future__ import annotations

import json

import pytest

from gateway.cli import main


def test_the_door_case_floods_the_queue_and_reports_the_light_tenant(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = ["--cases", "door-depth", "--runs", "1", "--sim-speed", "20", "--light-count", "3",
            "--light-every", "0.2", "--json"]  # fmt: skip
    assert main(["bench", "fairness", *args]) == 0
    result = json.loads(capsys.readouterr().out)
    (run,) = result["figures"]["door-depth/1"]["runs"]
    assert run["light_sent"] == 3
    # the flood went past the queue: its surplus was refused as a full queue, not otherwise
    assert run["heavy_refused"] > 0
    assert run["heavy_refused_queue_full"] == run["heavy_refused"]
    assert [ok for ok, _ in result["targets"]] == [run["light_refused"] == 0]
