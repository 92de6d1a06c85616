"""`spillgate bench prefix` end to end in tiny sizes: the plumbing (backends per
arm, gateways, sampling, counters, targets, JSON), not a measurement."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gateway.cli import main
from loadtest.bench.prefix import ARMS, Plan, workload
from loadtest.bench.prefix_workload import schedules


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


def test_rounds_hold_every_tenant_once_in_a_shuffled_order_and_seeds_vary_it() -> None:
    plan = Plan(tenants=4, chats=3, turns=2, system_tokens=32, order="rounds", schedules=2)
    first, second = (workload(p) for p in schedules(plan))
    assert [p.seed for p in schedules(plan)] == [23, 24]
    rounds = [[t.tenant for t in first[i : i + 4]] for i in range(0, len(first), 4)]
    assert len(rounds) == 6 and all(sorted(r) == [0, 1, 2, 3] for r in rounds)
    assert len({tuple(r) for r in rounds}) > 1  # shuffled, not one order repeated
    assert [t.tenant for t in first] != [t.tenant for t in second]
    for chat in {t.chat for t in first}:  # a chat's turns still in order
        assert [len(t.messages) for t in first if t.chat == chat] == [2, 4]


def test_the_bench_runs_every_arm_on_fresh_backends(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "bench.json"
    args = [
        "--backends", "2", "--tenants", "2", "--chats", "1", "--turns", "2",
        "--system-tokens", "256", "--kv-tokens", "8192", "--order", "rounds",
        "--concurrency", "2", "--json", str(out),
    ]  # fmt: skip
    # one schedule: every arm starts its own backends, so each schedule costs a dozen
    # process starts; `schedules` (above) covers the seeds a second one would get
    assert main(["bench", "prefix", *args]) == 0
    figures = json.loads(out.read_text())
    assert [s["seed"] for s in figures["schedules"]] == [23]
    for schedule in figures["schedules"]:
        arms = schedule["arms"]
        assert list(arms) == list(ARMS)
        for arm in arms.values():
            assert (arm["requests"], arm["ok"]) == (4, 4)
            assert len(arm["running_mean_per_backend"]) == 2
            assert arm["ttft_p90_s"] >= arm["ttft_p50_s"] > 0
        # each tenant's second turn finds its first on the backend sticky sends both to,
        # and the oracle expects what the backends then report
        assert arms["sticky"]["hit_rate"] > 0
        assert arms["oracle"]["hit_rate"] >= arms["sticky"]["hit_rate"]
    printed = capsys.readouterr()
    assert printed.out.count("hit rate ≥ 80 % of the oracle's") == 1
    assert "hit rate per schedule:" in printed.out
    assert f"wrote {out.resolve()}" in printed.err
