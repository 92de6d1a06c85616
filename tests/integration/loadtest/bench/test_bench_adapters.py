"""`spillgate bench adapters` on the simulators, in tiny sizes: the plumbing (two engines
with adapter slots, a gateway per arm, round-robin beside it, the engines polled, the
gateway's loads counted, the report and its JSON), not a measurement."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gateway.cli import main
from loadtest.bench.adapters import plan
from loadtest.bench.adapters_fleet import ADAPTERS


def test_the_bench_runs_both_arms_on_both_scenarios(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "adapters.json"
    args = ["--rounds", "1", "--requests", "8", "--rate", "16", "--max-tokens", "8",
            "--json", str(out)]  # fmt: skip
    code = main(["bench", "adapters", *args])
    report = json.loads(out.read_text())
    checks = [ok for scenario in report["checks"].values() for ok in scenario.values()]
    assert code == (0 if all(checks) else 1)
    assert report["backend"] == "simulator"
    assert [(r["scenario"], r["arm"]) for r in report["rounds"]] == [
        ("shared", "gateway"), ("shared", "round-robin"),
        ("split", "gateway"), ("split", "round-robin"),
    ]  # fmt: skip
    shared, split = report["summary"]["shared"], report["summary"]["split"]
    for arms in (shared, split):
        assert arms["gateway"]["ok"] == 8 and arms["gateway"]["wrong_adapter"] == 0
    assert shared["round-robin"]["ok"] == 8
    # round-robin asks each engine for the adapters it lacks: engine 0 serves a1 and a2,
    # engine 1 a3, and a4 is served nowhere until the gateway loads it
    assert split["round-robin"]["not_found"] > 0
    ((where, loaded),) = split["gateway"]["loads"].items()
    assert where in ("loaded on tiny-0", "loaded on tiny-1") and loaded == [1]
    assert len(shared["gateway"]["peak_waiting"]) == 2
    printed = capsys.readouterr().out
    assert "| shared | gateway | round-robin |" in printed and "TTFT p90" in printed


def test_the_burst_asks_for_each_adapter_as_often_and_the_same_every_time() -> None:
    burst = plan(requests=12, rate=4, prompt_words=5, seed=1)
    assert sorted(r.adapter for r in burst) == sorted(ADAPTERS * 3)
    assert [r.at_s for r in burst[:3]] == [0.0, 0.25, 0.5]
    assert burst == plan(requests=12, rate=4, prompt_words=5, seed=1)
