"""`spillgate bench ops`: the bytecode each arm runs per request, against the real
zero-delay backend."""

from __future__ import annotations

from loadtest.bench.ops import TRACED, count


def test_counts_each_arms_own_bytecode_by_package() -> None:
    result = count(requests=20, warmup=5)
    raw, gateway = result["raw relay"], result["spillgate"]
    # the raw relay forwards with aiohttp; the gateway with its own client, and runs its
    # own pipeline
    assert raw["by_package"]["aiohttp"] > 1000
    assert gateway["by_package"].get("aiohttp", 0) == 0
    assert raw["by_package"].get("gateway", 0) == 0
    assert gateway["by_package"]["gateway"] > 1000
    assert any(name.startswith("gateway:") for name in gateway["top_functions"])


def test_counts_are_stable_from_run_to_run() -> None:
    first = count(("spillgate",), requests=20, warmup=5)["spillgate"]["opcodes_per_request"]
    second = count(("spillgate",), requests=20, warmup=5)["spillgate"]["opcodes_per_request"]
    assert abs(first - second) / first < 0.05


def test_with_tracing_off_no_tracing_code_runs_and_on_it_does() -> None:
    result = count(("spillgate", TRACED), requests=20, warmup=5)
    assert result["spillgate"]["by_package"].get("opentelemetry", 0) == 0
    assert not any("Trace" in name for name in result["spillgate"]["top_functions"])
    assert result[TRACED]["by_package"]["opentelemetry"] > 1000
