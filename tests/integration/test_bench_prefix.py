"""`spillgate bench prefix` end to end in tiny sizes: the plumbing (backends per
arm, gateways, sampling, counters, targets, JSON), not a measurement."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gateway.cli import main
from loadtest.bench.prefix import ARMS, Plan, workload


def test_every_chat_turn_resends_the_chat_so_far_in_order() -> None:
    turns = workload(Plan(tenants=2, chats=2, turns=3, system_tokens=64, rate=10))
    assert len(turns) == 12
    assert [t.at_s for t in turns] == [i / 10 for i in range(12)]
    for chat in {t.chat for t in turns}:
        mine = [t.messages for t in turns if t.chat == chat]
        assert [len(m) for m in mine] == [2, 4, 6]  # system, then user/assistant pairs
        assert mine[1][:2] == mine[0] and mine[2][:4] == mine[1][:4]
    systems = {t.tenant: t.messages[0]["content"] for t in turns}
    assert len(set(systems.values())) == 2


def test_the_bench_runs_every_arm_on_fresh_backends(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "bench.json"
    args = [
        "--backends", "2", "--tenants", "2", "--chats", "1", "--turns", "2",
        "--system-tokens", "256", "--rate", "20", "--kv-tokens", "8192", "--json", str(out),
    ]  # fmt: skip
    assert main(["bench", "prefix", *args]) == 0
    figures = json.loads(out.read_text())
    assert list(figures["arms"]) == list(ARMS)
    for arm in figures["arms"].values():
        assert (arm["requests"], arm["ok"]) == (4, 4)
        assert len(arm["running_mean_per_backend"]) == 2
        assert arm["ttft_p90_s"] >= arm["ttft_p50_s"] > 0
    # each tenant's second turn finds its first on the backend sticky sends both to, and
    # the oracle expects what the backends then report
    assert figures["arms"]["sticky"]["hit_rate"] > 0
    assert figures["arms"]["oracle"]["hit_rate"] >= figures["arms"]["sticky"]["hit_rate"]
    printed = capsys.readouterr()
    assert "hit rate ≥ 80 % of the oracle's" in printed.out
    assert f"wrote {out.resolve()}" in printed.err
