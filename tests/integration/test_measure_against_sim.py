"""`spillgate measure` against `spillgate sim` agrees with `spillgate plan` on one model and GPU.

The simulator sizes its KV cache and step times from the same replica profile the plan
uses, and runs `SPEED` times faster than real time; the measurement scales the plan's
prediction by the same factor. Sessions at the KV bound must agree exactly (read from the
simulator's own /metrics, as the gateway's capacity discovery does, and seen as the most
requests it ran at once once clients outnumber them); tokens/s within 10 %.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from gateway.cli import main
from loadtest.harness import ServerThread, free_port
from loadtest.sim import SimConfig, create_sim_app

SPEED = 20.0
# Llama-3.1-8B on one L4: 1,719 blocks. Sessions of 2,000 + 32 tokens need 127 blocks, so
# 13 fit; vLLM admits a prompt when its 126 blocks are free, which also gives 13.
MODEL, GPU, MAX_LEN = "llama-3.1-8b", "l4", 8192
WORKLOAD = ["--prompt-tokens", "2000", "--output-tokens", "32"]


@pytest.fixture
def sim() -> Iterator[ServerThread]:
    config = SimConfig(model=MODEL, gpu=GPU, max_model_len=MAX_LEN, speed=SPEED)
    with ServerThread(create_sim_app(config)) as server:
        yield server


def run_json(capsys: pytest.CaptureFixture[str], args: list[str]) -> dict[str, object]:
    assert main(args) == 0
    out: dict[str, object] = json.loads(capsys.readouterr().out)
    return out


def test_measure_agrees_with_plan_on_sessions_and_tokens_per_s(
    sim: ServerThread, capsys: pytest.CaptureFixture[str]
) -> None:
    plan = run_json(
        capsys,
        ["plan", "--model", MODEL, "--gpu", GPU, "--max-model-len", str(MAX_LEN), *WORKLOAD,
         "--json"],
    )  # fmt: skip
    measured = run_json(
        capsys,
        ["measure", "--url", sim.url, "--model", MODEL, "--gpu", GPU, "--speed", str(SPEED),
         "--concurrency", "4,16", *WORKLOAD, "--json"],
    )  # fmt: skip
    sessions = plan["sessions_per_replica"]
    assert sessions == 13
    assert measured["endpoint_sessions_at_kv_bound"] == sessions
    assert measured["plan"]["sessions_at_kv_bound"] == sessions  # type: ignore[index]
    levels = measured["levels"]
    assert isinstance(levels, list) and [lv["concurrency"] for lv in levels] == [4, 16]
    below, saturated = levels
    assert below["errors"] == saturated["errors"] == 0
    assert saturated["peak_running"] == sessions
    for level in levels:
        assert level["tokens_per_s"] == pytest.approx(level["plan_tokens_per_s"], rel=0.10)
    at_bound = plan["decode_tokens_per_s"]
    assert saturated["plan_tokens_per_s"] == pytest.approx(at_bound * SPEED, rel=0.001)  # type: ignore[operator]


def test_unknown_gpu_fails_before_any_load(
    sim: ServerThread, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["measure", "--url", sim.url, "--model", MODEL, "--gpu", "tpu", *WORKLOAD]
    assert main(args) == 2
    assert "unknown GPU 'tpu'" in capsys.readouterr().err
    metrics = httpx.get(f"{sim.url}/metrics", timeout=5).text
    assert 'sim_requests_finished_total{engine="0",model_name="llama-3.1-8b"} 0.0' in metrics


def test_unreachable_endpoint_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    assert main(["measure", "--url", url, "--model", MODEL, "--timeout", "2"]) == 2
    assert "spillgate measure: error:" in capsys.readouterr().err
