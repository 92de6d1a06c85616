"""`spillgate bench admission` end to end on the simulator, in tiny sizes: the
plumbing (processes, arms, sampling, medians, targets, JSON), not a measurement."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
import yaml

from gateway.cli import main
from loadtest.bench.admission_plan import BenchPlan
from loadtest.bench.admission_watch import streaming_at_once
from loadtest.loadgen.client import Result
from loadtest.loadgen.workload import message_tokens

ARMS = ["static", "whole", "learned", "direct"]


def test_the_bench_runs_every_arm_on_the_same_requests(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "bench.json"
    args = [
        "--bursts", "3,4", "--runs", "1", "--spike-factor", "2", "--warmup", "5",
        "--warmup-rate", "100", "--spike-window", "0.2", "--max-tokens", "40",
        "--sim-speed", "50", "--json", str(out),
    ]  # fmt: skip
    assert main(["bench", "admission", *args]) == 0
    figures = json.loads(out.read_text())
    assert figures["backend"] == "simulator"
    assert figures["capacity_tokens"] == 16_384 - 16  # one block held back
    warmed = {"sim": {"local": 5}, "sim-spike": {"local": 5}}
    assert figures["warmup"] == {"whole": warmed, "learned": warmed}
    assert figures["arms"]["static"] == {"reservation": {"mode": "max_tokens"}, "feedback": False}
    for size in ("3", "4"):
        runs = figures["bursts"][size]["runs"]
        assert list(runs) == ARMS
        for arm in ARMS:
            answered = [(r["ok"], r["refused"], r["errors"]) for r in runs[arm]]
            assert answered == [(int(size), 0, 0)]
            assert [r["preemptions"] for r in runs[arm]] == [0]
        # the same seeded requests on every arm: the same answers
        lengths = {arm: [r["completion_tokens_mean"] for r in runs[arm]] for arm in ARMS}
        assert len({tuple(lengths[arm]) for arm in ARMS}) == 1
        assert figures["bursts"][size]["median"]["direct"]["ok"] == int(size)
    spike = figures["spike"]
    assert spike["requests"] == 6
    assert [r["ok"] for r in spike["runs"]["learned"]] == [6]
    assert spike["runs"]["direct"][0]["outcomes"] == {"served": 6}
    assert [t["target"] for t in figures["targets"]] == [
        "running at once ≥ 90 % of direct's (burst of 3)",
        "TTFT p50 ≤ 1.5× direct's (burst of 3)",
        "0 refusals (burst of 4)",
        "0 preemptions through the gateway",
        "≥ 85 % of KV capacity used at the spike's peak",
        "provider spill ≤ half of static's (requests)",
        "provider spill ≤ half of static's (tokens)",
    ]
    printed = capsys.readouterr()
    assert "the learning arms were warmed first: 5 seeded requests" in printed.out
    assert "spike of 6, overflow [queue, provider, reject]" in printed.out
    assert f"wrote {out.resolve()}" in printed.err


def _result(sent_s: float, ttft_s: float, e2e_s: float, outcome: str = "local") -> Result:
    return Result(
        index=0, tenant="t", at_s=0.0, sent_s=sent_s, stream=True, repeated=False,
        prompt_tokens=1, max_tokens=1, status=200, outcome=outcome, ttft_s=ttft_s, e2e_s=e2e_s,
    )  # fmt: skip


def test_streaming_at_once_counts_overlapping_answers_the_backend_gave() -> None:
    results = [
        _result(0.0, 1.0, 3.0),  # streams 1..3
        _result(0.0, 2.0, 4.0),  # 2..4
        _result(3.0, 0.5, 5.0),  # 3.5..8: after the first ended
        _result(0.0, 3.0, 4.0),  # 3..4: starts as the first ends
        _result(0.0, 1.0, 9.0, outcome="provider"),  # not on the backend
    ]
    assert streaming_at_once(results) == 3
    assert streaming_at_once([]) == 0


# one burst of 4 behind a 200-token system message, a spike of 4, on a fast simulator
SHARED_QUICK = [
    "--bursts", "4", "--runs", "1", "--spike-factor", "1", "--warmup", "3",
    "--warmup-rate", "100", "--spike-window", "0.2", "--max-tokens", "40",
    "--sim-speed", "50", "--shared-prompt", "200", "--prompt-tokens", "uniform:10:20",
]  # fmt: skip


def test_a_shared_system_prompt_opens_every_chat_on_every_arm(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "bench.json"
    args = [*SHARED_QUICK, "--json", str(out)]
    assert main(["bench", "admission", *args]) == 0
    figures = json.loads(out.read_text())
    plan = BenchPlan(shared_prompt=200, prompt_tokens="uniform:10:20", max_tokens=40)
    burst = plan.burst(4, 0, "sim")
    assert len({p.system for p in burst}) == 1 and message_tokens(burst[0].system) == 200
    # the backend counted the system message in every prompt, and found it cached
    planned = statistics.fmean(p.prompt_tokens for p in burst)
    runs = figures["bursts"]["4"]["runs"]
    for arm in ARMS:
        (run,) = runs[arm]
        assert (run["ok"], run["refused"], run["queued"]) == (4, 0, 0)
        assert run["prompt_tokens_mean"] == planned
        assert run["prefix_hit_share"] > 0
        assert run["output_tokens_per_s"] > 0
    assert [t["target"] for t in figures["targets"]][-4:] == [
        "running at once ≥ 90 % of direct's (shared prompt of 200 tokens, burst of 4)",
        "TTFT p50 ≤ 1.5× direct's (shared prompt of 200 tokens, burst of 4)",
        "0 refusals (shared prompt of 200 tokens, burst of 4)",
        "0 preemptions (shared prompt of 200 tokens, burst of 4)",
    ]
    printed = capsys.readouterr().out
    assert "every chat opens with the same system message of 200 tokens" in printed
    for row in ("running at once (max)", "refusals (503)", "queued", "TTFT p50 (s)"):
        assert row in printed
    for row in ("peak KV used", "preemptions", "output tokens/s", "prompt tokens found cached"):
        assert row in printed


def test_the_learned_arm_runs_as_replicas_sharing_one_redis(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """With `--tokenizer` too: the simulator and every gateway's pools tokenize alike."""
    out = tmp_path / "bench.json"
    args = [
        *SHARED_QUICK, "--replicas", "2", "--tokenizer",
        "--logs", str(tmp_path / "logs"), "--json", str(out),
    ]  # fmt: skip
    assert main(["bench", "admission", *args]) == 0
    figures = json.loads(out.read_text())
    assert figures["replicas"] == {"learned": 2}
    # every replica learned from the whole warm-up
    assert figures["warmup"]["learned"] == {"sim": {"local": 6}, "sim-spike": {"local": 6}}
    assert figures["warmup"]["whole"] == {"sim": {"local": 3}, "sim-spike": {"local": 3}}
    (run,) = figures["bursts"]["4"]["runs"]["learned"]
    assert (run["ok"], run["refused"], run["errors"], run["preemptions"]) == (4, 0, 0, 0)
    logs = sorted(p.name for p in (tmp_path / "logs").glob("gateway-learned*.yaml"))
    assert logs == ["gateway-learned-0.yaml", "gateway-learned-1.yaml"]
    config = yaml.safe_load((tmp_path / "logs" / logs[0]).read_text())
    tokenizers = {pool["tokenizer"] for pool in config["pools"]}
    assert len(tokenizers) == 1 and Path(tokenizers.pop(), "tokenizer.json").is_file()
    printed = capsys.readouterr().out
    assert "the learned arm runs as 2 gateways sharing one redis-server" in printed
    assert "0 refusals (shared prompt of 200 tokens, burst of 4, 2 replicas)" in printed
