"""Admission by what the backends really hold, against a simulator whose answers end early.

The simulator ends answers at a sampled EOS, as a real model does (loadtest/sim/lengths.py):
the gateway reserves the expected output, grows a stream's reservation as it goes, and
reads the backend's own KV use, so it admits what fits at once and never makes it preempt.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from gateway.admission.fleet.metrics_text import samples, total
from loadtest.sim.config import SimConfig
from tests.support.fleet import Fleet, run_fleet
from tests.support.metrics import metrics_text, text_sum

MSG = [{"role": "user", "content": "Tell me a story"}]


def preemptions(fleet: Fleet, pool: str) -> float:
    found = total(samples(metrics_text(fleet.backends[pool][0].url)), "vllm:num_preemptions_total")
    assert found is not None, "no vllm:num_preemptions_total"
    return found


async def streams(fleet: Fleet, n: int, body: dict[str, Any]) -> list[tuple[int, str, int]]:
    """`n` streaming chats at once: (status, outcome, completion tokens) of each."""
    headers = {"authorization": f"Bearer {fleet.keys['acme']}"}
    limits = httpx.Limits(max_connections=n + 8)
    async with httpx.AsyncClient(
        base_url=fleet.url, headers=headers, timeout=120, limits=limits
    ) as client:

        async def one() -> tuple[int, str, int]:
            request = {"messages": MSG, "stream": True, **body}
            async with client.stream("POST", "/v1/chat/completions", json=request) as response:
                text = (await response.aread()).decode()
            tokens = text.count('"content"')  # one content delta per token
            return response.status_code, response.headers.get("x-spillgate-outcome", ""), tokens

        return list(await asyncio.gather(*(one() for _ in range(n))))


def backend_status(fleet: Fleet, pool: str) -> dict[str, Any]:
    (found,) = (p for p in fleet.status()["pools"] if p["name"] == pool)
    backend: dict[str, Any] = found["backends"][0]
    return backend


def reported(fleet: Fleet, pool: str) -> int | None:
    """The KV tokens the pool's backend reports in use, as the gateway last read them."""
    tokens: int | None = backend_status(fleet, pool)["reported_kv_tokens"]
    return tokens


def released(fleet: Fleet, pool: str) -> int:
    deadline = time.monotonic() + 5
    held = backend_status(fleet, pool)["tokens_in_flight"]
    while held and time.monotonic() < deadline:
        time.sleep(0.05)
        held = backend_status(fleet, pool)["tokens_in_flight"]
    return int(held)


def realistic(model: str, *, kv_tokens: int, mean: float, **options: Any) -> SimConfig:
    return SimConfig(
        model=model,
        kv_tokens=kv_tokens,
        speed=2.0,  # a decode step of ~4 ms: a burst arrives well within one answer
        answer_lengths="geometric",
        answer_mean_tokens=mean,
        seed=20,
        **options,
    )


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    queue = {"max_depth": 512, "max_wait_s": 60}
    with run_fleet(
        pools={
            # the real vLLM: a 16,384-token KV cache, answers of mean ~130 tokens
            "burst": [realistic("burst", kv_tokens=16384, mean=128)],
            "spike": [realistic("spike", kv_tokens=4096, mean=64)],
            # answers of mean 256 tokens, up to the 2,048-token context without max_tokens
            "open": [realistic("open", kv_tokens=4096, mean=256, max_model_len=2048)],
            # exact lengths: long requests sent straight to it hold a known share of its cache
            "bypass": [SimConfig(model="bypass", kv_tokens=4096, speed=1.0)],
            # every answer runs to the simulator's default 256 tokens
            "static": [SimConfig(model="static", kv_tokens=2048, speed=2.0)],
        },
        pool_options={
            name: {
                "overflow": ["queue", "reject"],
                "queue": queue,
                "reservation": {"min_samples": 20},
                # what a request without max_tokens used to reserve, whatever it generated
                "default_max_tokens": 64,
            }
            for name in ("burst", "spike", "open")
        }
        | {
            "bypass": {"overflow": ["reject"]},
            # the old static reservation of a request without max_tokens: prompt + 16
            "static": {"reservation": {"mode": "max_tokens"}, "default_max_tokens": 16},
        },
    ) as f:
        yield f


def warm(fleet: Fleet, pool: str, *, answers: int = 30, **body: Any) -> None:
    """Answers enough for the pool's learned quantile to replace the prior."""
    for _ in range(answers // 10):
        done = asyncio.run(streams(fleet, 10, {"model": pool, **body}))
        assert {status for status, _, _ in done} == {200}


def test_a_burst_the_backend_holds_at_once_is_admitted_at_once(fleet: Fleet) -> None:
    body = {"model": "burst", "max_tokens": 2048}
    warm(fleet, "burst", max_tokens=2048)
    done = asyncio.run(streams(fleet, 24, body))
    # prompt + max_tokens each, 24 x 2,064 tokens, would have let 7 of them in at once
    assert [(status, outcome) for status, outcome, _ in done] == [(200, "local")] * 24
    assert preemptions(fleet, "burst") == 0
    assert released(fleet, "burst") == 0


def test_realistic_answers_under_a_5x_spike_never_preempt(fleet: Fleet) -> None:
    body = {"model": "spike", "max_tokens": 1024}
    warm(fleet, "spike", max_tokens=1024)
    (pool,) = (p for p in fleet.status()["pools"] if p["name"] == "spike")
    learned = pool["reservation"]["expected_output_tokens"]
    assert pool["reservation"]["samples"] == 30
    assert 64 < learned < 4 * 64  # the p90 of answers of mean 64
    at_once = int(0.9 * 4080) // (16 * -(-(8 + learned) // 16))
    done = asyncio.run(streams(fleet, 5 * at_once, body))
    assert {status for status, _, _ in done} == {200}
    assert {outcome for _, outcome, _ in done} <= {"local", "queued"}  # none spilled or refused
    assert preemptions(fleet, "spike") == 0
    assert released(fleet, "spike") == 0
    # the full ledger held more than the backend did: its ratio calibrates the fill upwards
    status = backend_status(fleet, "spike")
    assert status["held_per_reserved"] < 1
    assert status["effective_fill"] > 0.9
    assert status["fill_reason"] == "calibrated"


def test_requests_without_max_tokens_never_make_the_backend_preempt(fleet: Fleet) -> None:
    done = asyncio.run(streams(fleet, 60, {"model": "open"}))
    assert {status for status, _, _ in done} == {200}
    # answers longer than the pool's default_max_tokens were not cut short
    assert max(tokens for _, _, tokens in done) > 256
    assert preemptions(fleet, "open") == 0
    assert released(fleet, "open") == 0


def test_what_the_backend_holds_for_traffic_that_bypasses_the_gateway_reduces_admission(
    fleet: Fleet,
) -> None:
    backend = fleet.backends["bypass"][0].url
    # two requests straight to the backend: 2 x (1,600 prompt + 400 output) of its 4,080
    # tokens, with prompts of their own so that the prefix cache shares none of it
    direct = [
        {"model": "bypass", "prompt": list(range(first, first + 1600)), "max_tokens": 400}
        for first in (100, 1700)
    ]
    through = {"model": "bypass", "messages": MSG, "max_tokens": 1000}  # reserves 8 + 512

    async def scenario() -> tuple[int, str, int, str]:
        headers = {"authorization": f"Bearer {fleet.keys['acme']}"}
        async with (
            httpx.AsyncClient(base_url=backend, timeout=60) as straight,
            httpx.AsyncClient(base_url=fleet.url, headers=headers, timeout=60) as gateway,
        ):
            bypassing = [
                asyncio.create_task(straight.post("/v1/completions", json=body)) for body in direct
            ]
            await until(
                lambda: (backend_status(fleet, "bypass")["reported_kv_tokens"] or 0) >= 3200
            )
            # the ledger alone has room (3,672 tokens); what the backend holds leaves 472
            refused = await gateway.post("/v1/chat/completions", json=through)
            assert [r.status_code for r in await asyncio.gather(*bypassing)] == [200, 200]
            await until(lambda: reported(fleet, "bypass") == 0)
            served = await gateway.post("/v1/chat/completions", json=through)
        return (
            refused.status_code,
            refused.headers["x-spillgate-outcome"],
            served.status_code,
            served.headers["x-spillgate-outcome"],
        )

    assert asyncio.run(scenario()) == (503, "rejected", 200, "local")


async def until(check: Any, *, within_s: float = 10.0) -> None:
    deadline = time.monotonic() + within_s
    while not await asyncio.to_thread(check):
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.05)


def test_a_backend_that_preempts_lowers_its_effective_fill_and_says_why(fleet: Fleet) -> None:
    """Lowered at once; back at the target once the backend runs and queues nothing."""
    seen: list[tuple[dict[str, int], float, str]] = []  # (back-offs, effective fill, reason)

    async def watch() -> None:
        while "preemption" not in (seen[-1][0] if seen else {}):
            status = await asyncio.to_thread(backend_status, fleet, "static")
            seen.append((status["fill_backoffs"], status["effective_fill"], status["fill_reason"]))
            await asyncio.sleep(0.02)

    async def scenario() -> list[tuple[int, str, int]]:
        watcher = asyncio.create_task(watch())
        # the old reservation of 8 + 16 tokens each while every answer runs to 256: 20 at
        # once outgrow the 2,032-token cache
        done = await streams(fleet, 20, {"model": "static"})
        await asyncio.wait_for(watcher, timeout=3.0)
        return done

    done = asyncio.run(scenario())
    assert {status for status, _, _ in done} == {200}
    assert preemptions(fleet, "static") > 0
    _, lowered, reason = seen[-1]  # the first read after the back-off
    assert lowered == pytest.approx(0.9 * 0.8)  # lowered at once
    assert reason == "preemption"
    text = fleet.metrics_text()
    backoffs = 'spillgate_fill_backoffs_total{backend="static-0",reason="preemption"} '
    assert backoffs in text

    def at_target() -> bool:
        status = backend_status(fleet, "static")
        return bool(status["effective_fill"] == 0.9 and status["fill_reason"] == "target")

    asyncio.run(until(at_target, within_s=3.0))  # two idle scrapes, 0.5 s apart
    fill = text_sum(fleet.metrics_text(), "spillgate_effective_fill_ratio", backend="static-0")
    assert fill == 0.9
