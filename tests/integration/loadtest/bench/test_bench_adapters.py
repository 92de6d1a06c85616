"""`spillgate bench adapters` on the simulators, in tiny sizes: the plumbing (two engines
with adapter slots, a gateway per arm, round-robin beside it, the engines polled, the
gateway's loads counted, the report and its JSON), not a measurement."""

from __future__ import annotations

import json
import os
import shutil
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
    assert report["placement"]["gateway"] == "any core"


@pytest.mark.skipif(
    len(os.sched_getaffinity(0)) < 2 or not shutil.which("taskset"),
    reason="needs taskset and two cores",
)
def test_engine_cores_puts_both_engines_on_one_core_and_the_rest_on_the_others(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = os.sched_getaffinity(0)
    engines = min(before)
    rest = ",".join(map(str, sorted(before - {engines})))
    out = tmp_path / "adapters.json"
    args = ["--scenarios", "shared", "--rounds", "1", "--requests", "4", "--rate", "0",
            "--max-tokens", "4", "--engine-cores", str(engines), "--json", str(out)]  # fmt: skip
    main(["bench", "adapters", *args])
    report = json.loads(out.read_text())
    assert report["placement"] == {"engines": str(engines), "gateway": rest, "client": rest}
    # what the kernel had while each arm ran: the engines' servers on their core alone,
    # the gateway (only in its arm) and the client on the others
    seen = {r["arm"]: r["cores_seen"] for r in report["rounds"]}
    on_engines = {"engine-0": str(engines), "engine-1": str(engines)}
    assert seen["gateway"] == {**on_engines, "gateway": rest, "client": rest}
    assert seen["round-robin"] == {**on_engines, "client": rest}
    assert report["summary"]["shared"]["gateway"]["ok"] == 4
    assert os.sched_getaffinity(0) == before  # the bench's own, as it was
    printed = capsys.readouterr().out
    assert f"both engines on core(s) {engines}" in printed
    assert f"cores seen: engine-0 {engines}, engine-1 {engines}, gateway {rest}" in printed


def test_the_burst_asks_for_each_adapter_as_often_and_the_same_every_time() -> None:
    burst = plan(requests=12, rate=4, prompt_words=5, seed=1)
    assert sorted(r.adapter for r in burst) == sorted(ADAPTERS * 3)
    assert [r.at_s for r in burst[:3]] == [0.0, 0.25, 0.5]
    assert burst == plan(requests=12, rate=4, prompt_words=5, seed=1)
