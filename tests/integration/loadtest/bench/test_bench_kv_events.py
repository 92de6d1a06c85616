"""`spillgate bench kv-events` and `spillgate bench tokenize` end to end, in tiny sizes:
the plumbing (the simulators with their events, a gateway per arm, the requests sent past
the gateway too, the engines' own counters, the static placement's replay; the tokenizers
and the cases), not a measurement."""

from __future__ import annotations

import json
from pathlib import Path

from gateway.cli import main

ARMS = ["least_filled", "prefix", "events", "sticky", "oracle-static"]


def test_every_arm_runs_on_the_same_requests_and_reads_the_engines_counters(
    tmp_path: Path,
) -> None:
    out = tmp_path / "kv.json"
    args = ["--backends", "2", "--kv-tokens", "8192", "--tenants", "4", "--system-tokens",
            "600", "--requests", "24", "--concurrency", "4", "--max-tokens", "4", "--json",
            str(out)]  # fmt: skip
    assert main(["bench", "kv-events", *args]) == 0
    result = json.loads(out.read_text())
    assert result["backend"] == "simulator"
    assert list(result["rounds"]) == ARMS
    for arm in ARMS:
        (run,) = result["rounds"][arm]
        assert run["requests"] == run["ok"] == 24, (arm, run)
        assert 0 < run["hit_rate"] < 1, (arm, run)  # the engines counted queries and hits
    assert 0 < result["static_expected_hit_rate"] < 1


def test_tokenize_measures_each_tokenizer_chat_and_cache_case(tmp_path: Path) -> None:
    out = tmp_path / "tokenize.json"
    assert main(["bench", "tokenize", "--requests", "10", "--json", str(out)]) == 0
    cases = json.loads(out.read_text())["cases"]
    seen = {(c["tokenizer"], c["size"], c["cached"]) for c in cases}
    assert seen == {(t, s, c) for t in ("tiny", "sim") for s in (1024, 8192) for c in (0, 1)}
    for case in cases:
        assert case["requests"] == 10
        # about the chat's size in tokens, as the tokenizer counted them
        assert 0.9 * case["size"] < case["prompt_tokens_median"] < 1.1 * case["size"], case
        assert case["on_loop_p50_ms"] > 0 and case["total_p50_ms"] > 0, case
