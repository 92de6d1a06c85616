"""`spillgate plan --disaggregated` end to end: its JSON, its table, and how it moves."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gateway.cli import main

WORKLOAD = ["plan", "--model", "llama-3.1-8b", "--gpu", "h100",
            "--prompt-tokens", "1536", "--output-tokens", "512", "--disaggregated"]  # fmt: skip


def _split(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, Any]:
    assert main([*WORKLOAD, *args, "--json"]) == 0
    out: dict[str, Any] = json.loads(capsys.readouterr().out)
    return out


def test_json_carries_both_deployments(capsys: pytest.CaptureFixture[str]) -> None:
    out = _split(capsys, "--rps", "40", "--itl-slo-ms", "30", "--ttft-slo-ms", "300")
    split = out["disaggregated"]
    prefill, decode, moved, unified = (
        split["prefill"],
        split["decode"],
        split["kv_transfer"],
        split["unified"],
    )
    assert split["requests_per_s"] == 40 and split["kv_transfer_gbps"] == 100
    assert split["gpus"] == prefill["gpus"] + decode["gpus"]
    assert unified["gpus"] == out["gpus_needed"]
    assert split["gpus_saved"] == abs(split["gpus"] - unified["gpus"])
    assert split["cheaper"] in ("disaggregated", "unified", "equal")
    # 40 prompts/s of 1,536 tokens each take 2 x 8.03 G x 1,536 FLOP at 494.5 TFLOPS
    assert prefill["prefill_ms"] == pytest.approx(2 * 8.03e9 * 1536 / 494.5e12 * 1e3, rel=0.01)
    assert prefill["utilization"] <= prefill["utilization_cap"] <= 0.9
    assert decode["itl_ms"] <= 30 and decode["sessions_per_replica"] <= decode["itl_sessions"]
    assert unified["itl_ms"] <= 30 and out["itl_sessions"] is not None
    # 131,072 bytes a token x 1,536 tokens a request x 40 a second
    assert moved["bytes_per_request"] == 131_072 * 1536
    assert moved["bytes_per_s"] == 40 * 131_072 * 1536
    assert moved["gbps_needed"] == pytest.approx(40 * 131_072 * 1536 * 8 / 1e9, abs=1e-3)
    assert split["ttft_ms"] <= 300
    assert split["warnings"] == []


def test_doubling_the_rate_about_doubles_the_gpus(capsys: pytest.CaptureFixture[str]) -> None:
    once = _split(capsys, "--rps", "100")["disaggregated"]
    twice = _split(capsys, "--rps", "200")["disaggregated"]
    for part in ("prefill", "decode"):
        assert 2 * once[part]["gpus"] - 1 <= twice[part]["gpus"] <= 2 * once[part]["gpus"] + 1
    assert twice["kv_transfer"]["bytes_per_s"] == 2 * once["kv_transfer"]["bytes_per_s"]


def test_a_tight_itl_raises_the_decode_gpus_only(capsys: pytest.CaptureFixture[str]) -> None:
    loose = _split(capsys, "--rps", "100")["disaggregated"]
    tight = _split(capsys, "--rps", "100", "--itl-slo-ms", "10")["disaggregated"]
    assert tight["decode"]["gpus"] > loose["decode"]["gpus"]
    assert tight["decode"]["itl_ms"] <= 10
    assert tight["prefill"]["gpus"] == loose["prefill"]["gpus"]
    assert tight["unified"]["gpus"] > loose["unified"]["gpus"]


def test_a_tight_ttft_raises_the_prefill_gpus(capsys: pytest.CaptureFixture[str]) -> None:
    loose = _split(capsys, "--rps", "100", "--ttft-slo-ms", "1000")["disaggregated"]
    tight = _split(capsys, "--rps", "100", "--ttft-slo-ms", "130")["disaggregated"]
    assert tight["prefill"]["gpus"] > loose["prefill"]["gpus"]
    assert tight["prefill"]["utilization_cap"] < loose["prefill"]["utilization_cap"]
    assert tight["decode"]["gpus"] == loose["decode"]["gpus"]
    assert tight["ttft_ms"] <= 130


def test_a_slow_link_is_warned_of(capsys: pytest.CaptureFixture[str]) -> None:
    split = _split(capsys, "--rps", "100", "--kv-transfer-gbps", "1")["disaggregated"]
    assert split["kv_transfer"]["link_load"] > 1
    assert any("Gbit/s" in w for w in split["warnings"])


def test_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*WORKLOAD, "--rps", "80", "--itl-slo-ms", "30"]) == 0
    out = capsys.readouterr().out
    for line in (
        "Prefill engines, prompts of 1,536 tokens",
        "Decode engines, each stream holding 2,048 tokens for its life",
        "KV transfer, a prompt's KV from prefill to decode engine",
        "  bytes per request                      201,326,592",
    ):
        assert line in out.splitlines()
    side = out[out.index("  Side by side") :].splitlines()
    assert side[0].split() == ["Side", "by", "side", "disaggregated", "unified"]
    assert side[1].split()[0] == "GPUs"
    assert "cheaper" in side[-1] or side[-1] == "the same GPUs either way"


def test_needs_a_rate(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*WORKLOAD, "--sessions", "100"]) == 2
    assert "give --rps" in capsys.readouterr().err


def test_itl_objective_caps_the_unified_plan(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["plan", "--model", "llama-3.1-8b", "--gpu", "h100", "--rps", "3", "--json"]
    assert main(args) == 0
    free = json.loads(capsys.readouterr().out)
    assert main([*args, "--itl-slo-ms", "20"]) == 0
    capped = json.loads(capsys.readouterr().out)
    assert free["itl_sessions"] is None and "disaggregated" not in free
    assert capped["itl_sessions"] < free["sessions_at_fill"]
    assert capped["sessions_at_fill"] == capped["itl_sessions"]
    assert capped["itl_ms_at_fill"] <= 20
