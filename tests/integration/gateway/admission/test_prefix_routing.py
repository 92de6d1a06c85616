"""Prefix routing through the gateway, in front of simulated vLLM backends that cache
prompt prefixes as vLLM does: a chat's turns land where its prefix is cached, and
/admin/status shows the index's guess beside each backend's own counters."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from loadtest.loadgen.scrape import backend_state
from loadtest.sim.config import SimConfig
from tests.support.fleet import Fleet, run_fleet

SYSTEM = {"role": "system", "content": "You answer questions about the fleet. " * 60}


@pytest.fixture(params=["prefix", "least_filled"])
def fleet(request: pytest.FixtureRequest) -> Iterator[Fleet]:
    sims = [SimConfig(model="m", kv_tokens=16_384, speed=50.0) for _ in range(2)]
    with run_fleet(pools={"chat": sims}, pool_options={"chat": {"routing": request.param}}) as f:
        yield f


def counters(fleet: Fleet) -> list[tuple[float, float]]:
    """Each backend's own (prefix-cache queries, hits), in tokens."""
    states = [backend_state(httpx.get(f"{b.url}/metrics", timeout=5).text) for b in
              fleet.backends["chat"]]  # fmt: skip
    return [(s["prefix_queries"], s["prefix_hits"]) for s in states]


def pool_status(fleet: Fleet) -> dict[str, Any]:
    (pool,) = fleet.status()["pools"]
    found: dict[str, Any] = pool
    return found


def test_a_chats_turns_go_where_its_prefix_is_cached(fleet: Fleet) -> None:
    """Two turns at once, then the third: with prefix routing the first turn's backend takes
    all three (the second while the first still runs, where least_filled sends it to the
    idle backend), and the backends' own counters show the cached prefix reused."""
    routing = pool_status(fleet)["routing"]
    # long enough to be running still when the second turn comes, on a loaded machine too
    first = {"model": "chat", "messages": [SYSTEM, {"role": "user", "content": "one"}],
             "max_tokens": 2000, "stream": True, "ignore_eos": True}  # fmt: skip
    with fleet.client() as client, client.stream("POST", "/v1/chat/completions", json=first) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        next(lines)  # the first turn runs: its prompt is cached by now
        second = {**first, "messages": [SYSTEM, {"role": "user", "content": "two"}],
                  "max_tokens": 4, "stream": False}  # fmt: skip
        assert client.post("/v1/chat/completions", json=second).status_code == 200
        assert sum(1 for _ in lines) > 0
    two_turns = counters(fleet)
    with fleet.client() as client:
        assert client.post("/v1/chat/completions", json=second).status_code == 200
    (q0, h0), (q1, h1) = counters(fleet)
    if routing == "prefix":
        assert (q1, h1) == (0, 0)  # every turn on the first backend
        assert h0 > 0 and h0 / q0 > 0.5
    else:
        # the second turn went to the idle backend, cold (where the third goes, both
        # backends idle by then, is a tie that says nothing of prefixes)
        (q0, _), (q1, h1) = two_turns
        assert q0 > 0 and q1 > 0
        assert h1 == 0


def test_status_shows_the_index_guess_beside_the_backends_own_hit_rate() -> None:
    sims = [SimConfig(model="m", kv_tokens=16_384, speed=50.0) for _ in range(2)]
    with run_fleet(pools={"chat": sims}) as fleet:  # prefix routing by default
        body = {"model": "chat", "messages": [SYSTEM, {"role": "user", "content": "hi"}],
                "max_tokens": 4}  # fmt: skip
        with fleet.client() as client:
            for _ in range(4):
                assert client.post("/v1/chat/completions", json=body).status_code == 200
        deadline = time.monotonic() + 10
        while True:
            backend, idle = pool_status(fleet)["backends"]
            seen = backend["prefix_cache"]
            if seen["backend_hit_rate"] is not None or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        # the same prompt four times, one after another, all to the first backend: the
        # index expected the last three in full
        assert seen["index_hit_rate"] == pytest.approx(0.75)
        assert idle["prefix_cache"]["index_hit_rate"] is None
        (queries, hits), idle_counts = counters(fleet)
        assert idle_counts == (0, 0)
        assert seen["backend_hit_rate"] == pytest.approx(hits / queries)
        assert 0.5 < hits / queries < 0.75  # vLLM computes the last block of each again
        metrics = fleet.metrics_text()
        assert 'spillgate_prefix_index_hit_ratio{backend="chat-0"} 0.75' in metrics
