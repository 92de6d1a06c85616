"""`spillgate bench preempt` end to end, in tiny sizes: the plumbing (the simulators and
the gateway it starts, the sheddable flood and the critical sender, the figures and the
targets), not a measurement."""

from __future__ import annotations

import json

import pytest

from gateway.cli import main


def test_the_preempt_arm_stops_sheddable_streams_that_all_end_whole(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # streams of about 3 s: the pool stays full of them while the critical requests come
    args = ["--arms", "preempt", "--sim-speed", "2", "--stream-tokens", "600",
            "--critical", "3", "--every", "0.2", "--fill-s", "1", "--json"]  # fmt: skip
    assert main(["bench", "preempt", *args]) == 0
    result = json.loads(capsys.readouterr().out)
    arm = result["figures"]["preempt"]
    assert arm["critical_sent"] == 3 and arm["critical_failed"] == 0
    assert arm["sheddable_stopped"] > 0
    assert arm["sheddable_stopped_whole"] == arm["sheddable_stopped"]
    assert sum(arm["preemptions"].values()) == arm["sheddable_stopped"]
    assert all(ok for ok, _ in result["targets"])
