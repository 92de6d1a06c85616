"""`spillgate bench slo-ladder` end to end on the demo, in tiny sizes: the plumbing
(a fresh demo per arm, the header on one arm only, the load generator's summaries, the
medians), not a measurement."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gateway.cli import main
from loadtest.bench.slo_ladder import ARMS, LADDER


def test_the_bench_runs_both_arms_on_the_same_spike(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "bench.json"
    args = ["--rounds", "1", "--rate", "4", "--spike-factor", "3", "--spike-start", "0.25",
            "--spike-duration", "0.5", "--duration", "1", "--output-tokens", "uniform:8:16",
            "--sim-speed", "5", "--logs", str(tmp_path / "logs"), "--json", str(out)]  # fmt: skip
    assert main(["bench", "slo-ladder", *args]) == 0
    result = json.loads(out.read_text())
    assert list(result["runs"]) == list(ARMS)
    sent = {arm: [r["requests"] for r in result["runs"][arm]] for arm in ARMS}
    assert sent[ARMS[0]] == sent[ARMS[1]] and sent[ARMS[0]][0] > 0  # the same seeded schedule
    for arm in ARMS:
        (run,) = result["runs"][arm]
        assert run["failed"] == 0
        assert run["answered"] + run["refused"] == run["requests"]
    # only the ladder's arm sent the objective: the gateway counted it
    logs = tmp_path / "logs"
    ladder_run = json.loads((logs / "run-0-slo-ladder.json").read_text())
    assert ladder_run["runs"][0]["summary"]["requests"] == sent[LADDER][0]
    printed = capsys.readouterr().out
    assert "goodput (within SLO)" in printed and "slo ladder" in printed
