"""`spillgate bench disagg` on the simulators, in tiny sizes: the plumbing (engines in their
roles, a gateway per arm, the engines' and the gateway's counters read around each burst, an
engine stopped mid-burst, the report and its JSON), not a measurement."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gateway.cli import main
from loadtest.bench.disagg import prompts


def test_the_bench_runs_every_scenario_and_reports_what_the_engines_counted(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "disagg.json"
    args = ["--rounds", "1", "--requests", "4", "--prompt-tokens", "400", "--max-tokens", "32",
            "--json", str(out)]  # fmt: skip
    code = main(["bench", "disagg", *args])
    report = json.loads(out.read_text())
    checks = [ok for scenario in report["checks"].values() for ok in scenario.values()]
    assert code == (0 if all(checks) else 1)
    assert report["backend"] == "simulator"
    assert [(r["scenario"], r["arm"]) for r in report["rounds"]] == [
        ("split", "disaggregated"), ("split", "unified"), ("short", "disaggregated"),
        ("decode-killed", "disaggregated"), ("prefill-stopped", "disaggregated"),
    ]  # fmt: skip
    split = report["summary"]["split"]
    for arm in ("disaggregated", "unified"):
        assert split[arm]["whole"] == 4 and split[arm]["ttft_p50_s"] > 0
    disaggregated = split["disaggregated"]
    # the decode engine loaded the prompts' full blocks; the unified pool split none
    assert 0.8 <= disaggregated["decode_external_share"] < 1
    assert disaggregated["prefill_generated_tokens"] == 4
    assert disaggregated["decisions"]["split"] == 4
    assert split["unified"]["decode_external_tokens"] == 0
    assert split["unified"]["decisions"]["split"] == 0
    short = report["summary"]["short"]["disaggregated"]
    assert short["decisions"]["short"] == short["decisions"]["split"] == 2
    killed = report["summary"]["decode-killed"]["disaggregated"]
    assert killed["fault"][0]["stopped_by"] == "SIGKILL"
    stopped = report["summary"]["prefill-stopped"]["disaggregated"]
    assert stopped["fault"][0]["engine"] == "engine-0"
    printed = capsys.readouterr().out
    assert "| split | disaggregated | unified |" in printed
    assert "TTFT p50 disaggregated / unified" in printed


def test_short_prompts_alternate_with_long_ones_and_no_two_share_a_beginning() -> None:
    burst = prompts(count=6, tokens=300, short=20, tokens_per_word=1.0, tag="t", seed=1)
    assert [long for _, long in burst] == [True, False] * 3
    assert [len(text.split()) - 2 for text, _ in burst] == [300, 20] * 3
    assert len({text[:4] for text, _ in burst}) == 6
