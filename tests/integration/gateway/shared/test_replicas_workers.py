"""`spillgate serve --workers N`: worker processes share one ledger and their metrics add up."""

from __future__ import annotations

import asyncio
import os
import re
import signal
from pathlib import Path

import httpx
import pytest

from gateway.cli import main
from loadtest.procs import RedisProcess
from loadtest.sim.app import create_sim_app
from loadtest.sim.config import SimConfig
from tests.support.harness import ServerThread
from tests.support.metrics import text_sum
from tests.support.replica import (
    KV_TOKENS,
    backend_stats,
    spike,
    start_gateways,
    until,
    write_config,
)


def test_more_than_one_worker_without_redis_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("SPILLGATE_REDIS_URL", raising=False)
    config = write_config(tmp_path / "gateway.yaml", ["http://127.0.0.1:9"], redis=False)
    assert main(["serve", "-c", str(config), "--workers", "2", "--check"]) == 2
    assert "--workers 2 needs Redis" in capsys.readouterr().err
    assert main(["serve", "-c", str(config), "--workers", "1", "--check"]) == 0


def test_workers_share_one_ledger_and_their_metrics_add_up(tmp_path: Path) -> None:
    metrics_dir = tmp_path / "metrics"
    sim = ServerThread(create_sim_app(SimConfig(model="m", kv_tokens=KV_TOKENS, speed=2.0)))
    with RedisProcess() as redis_proc, sim:
        config = write_config(tmp_path / "gateway.yaml", [sim.url], redis=True)
        (gateway,) = start_gateways(
            config,
            1,
            redis_url=redis_proc.url,
            workers=2,
            PROMETHEUS_MULTIPROC_DIR=str(metrics_dir),
        )
        try:
            until(lambda: len(worker_pids(metrics_dir)) == 2, within_s=30, what="both workers")
            answers = asyncio.run(spike([gateway.url] * 3, 30, max_tokens=60))
            until(
                lambda: gateway.metric("spillgate_inflight_tokens", backend="big-0") == 0,
                within_s=3,
                what="nothing in flight",
            )
            until(  # each worker hands its request counts to the shared files every second
                lambda: gateway.metric("spillgate_requests_total", pool="big") == 30,
                within_s=3,
                what="both workers' counts published",
            )
            scrapes = [httpx.get(f"{gateway.url}/metrics", timeout=5).text for _ in range(6)]
            stats = backend_stats(sim)
        finally:
            gateway.stop()
    assert [a for a in answers if a.status != 200 or not a.complete] == []
    for text in scrapes:  # whichever worker answers, it reports all of them
        assert text_sum(text, "spillgate_requests_total", pool="big") == 30
        assert text_sum(text, "spillgate_ledger_mode", mode="shared") == 2  # one per worker
        assert text_sum(text, "spillgate_capacity_tokens", backend="big-0") == KV_TOKENS
    assert stats["vllm:num_preemptions_total"] == 0
    assert stats["sim_peak_reserved_tokens"] <= KV_TOKENS  # two workers, one budget
    assert not metrics_dir.exists() or not list(metrics_dir.glob("gauge_live*"))


def worker_pids(metrics_dir: Path) -> set[int]:
    """Workers that have written metrics: their files carry their process ids."""
    pattern = re.compile(r"\w+_(\d+)\.db")
    found = (pattern.fullmatch(f.name) for f in metrics_dir.glob("*.db"))
    return {int(m.group(1)) for m in found if m is not None}


def test_a_killed_workers_live_gauges_are_gone_once_the_gateway_stops(tmp_path: Path) -> None:
    """uvicorn's supervisor kills a worker that stops answering its pings and starts
    another; the killed one never ran its shutdown, so the supervisor's own exit must
    take its live gauges out, or the next run's sums would count them."""
    metrics_dir = tmp_path / "metrics"
    sim = ServerThread(create_sim_app(SimConfig(model="m", kv_tokens=KV_TOKENS)))
    with RedisProcess() as redis_proc, sim:
        config = write_config(tmp_path / "gateway.yaml", [sim.url], redis=True)
        (gateway,) = start_gateways(
            config,
            1,
            redis_url=redis_proc.url,
            workers=2,
            PROMETHEUS_MULTIPROC_DIR=str(metrics_dir),
        )
        try:
            until(lambda: len(worker_pids(metrics_dir)) == 2, within_s=30, what="both workers")
            victim = min(worker_pids(metrics_dir))
            os.kill(victim, signal.SIGKILL)
            until(lambda: len(worker_pids(metrics_dir)) == 3, within_s=30, what="a new worker")
            assert list(metrics_dir.glob(f"gauge_live*_{victim}.db")) != []
        finally:
            gateway.stop()
    assert gateway.proc.returncode == 0
    assert list(metrics_dir.glob("gauge_live*")) == []
