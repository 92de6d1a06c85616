"""`spillgate bench warm-start` end to end on the simulator, in tiny sizes: the
plumbing (processes, arms, the lengths each gateway reserves by, medians, targets, JSON),
not a measurement."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gateway.cli import main
from loadtest.bench.warm_start import ARMS


def test_the_bench_runs_every_arm_on_the_same_requests(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "bench.json"
    args = [
        "--burst", "4", "--runs", "1", "--warmup", "50", "--warmup-rate", "200",
        "--trickle-rate", "5", "--trickle-s", "1", "--max-tokens", "40", "--sim-speed", "50",
        "--json", str(out),
    ]  # fmt: skip
    main(
        ["bench", "warm-start", *args]
    )  # exits 1 when a target is missed: at these sizes that says nothing
    figures = json.loads(out.read_text())
    assert figures["backend"] == "simulator"
    assert figures["warmup"] == {"warm": {"local": 50}, "first": {"local": 50}}
    runs = figures["runs"]
    assert list(runs) == list(ARMS)
    for arm in ARMS:
        assert [(r["ok"], r["refused"], r["errors"]) for r in runs[arm]] == [(4, 0, 0)]
    # where each gateway took the lengths it reserved by, before its burst
    assert [r["lengths_from"] for r in runs["direct"]] == [None]
    assert [r["lengths_from"] for r in runs["fresh"]] == ["backends"]
    assert [r["lengths_from"] for r in runs["warm"]] == ["answers"]
    assert [r["lengths_from"] for r in runs["replica"]] == ["replicas"]
    # the first replica served its trickle meanwhile
    assert [r["trickle_ok"] for r in runs["replica"]] == [5]
    # the same seeded requests on every arm: the same answers
    lengths = {tuple(r["completion_tokens_mean"] for r in runs[arm]) for arm in ARMS}
    assert len(lengths) == 1
    assert len(figures["targets"]) == 13
    printed = capsys.readouterr().out
    assert "lengths reserved by" in printed and "warm: TTFT p10 ≤ 1.5 × direct's" in printed
