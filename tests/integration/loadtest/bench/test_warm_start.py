"""A gateway admits by learned answer lengths from its first request: it borrows them from
the other replicas (Redis), else from the backends' own histograms, else reserves the prior.

The simulator ends answers at a sampled EOS and counts each finished answer in vLLM's
`vllm:request_generation_tokens` histogram, as vLLM does.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import statistics
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import httpx
import redis

from gateway.app import create_app
from gateway.config import parse_settings
from gateway.shared.length_feed import key
from loadtest.procs import RedisProcess
from loadtest.sim.app import create_sim_app
from loadtest.sim.config import SimConfig
from tests.support.fleet import ADMIN_TOKEN, admin_status, tenant
from tests.support.harness import ServerThread

KEY = "sk-" + secrets.token_hex(8)
PRIOR = 512
MIN_SAMPLES = 50


def sim(model: str) -> ServerThread:
    """A 16,384-token backend whose answers have a mean of 100 tokens."""
    config = SimConfig(
        model=model,
        kv_tokens=16_384,
        speed=2.0,  # a decode step of ~4 ms: a burst arrives well within one answer
        answer_lengths="geometric",
        answer_mean_tokens=100,
        seed=33,
    )
    return ServerThread(create_sim_app(config)).start()


@contextlib.contextmanager
def gateway(backend: ServerThread, model: str, *, redis_url: str | None = None) -> Iterator[str]:
    config: dict[str, Any] = {
        "tenants": [tenant("acme", KEY)],
        "pools": [
            {
                "name": model,
                "backends": [{"url": backend.url, "served_model": model, "capacity": "auto"}],
                "overflow": ["queue", "reject"],
                "queue": {"max_depth": 128, "max_wait_s": 30},
                "reservation": {"prior_tokens": PRIOR, "min_samples": MIN_SAMPLES},
            }
        ],
        "batch": {"dir": tempfile.mkdtemp(prefix="spillgate-batch-")},
    }
    app = create_app(
        parse_settings(config), environ={"SPILLGATE_ADMIN_TOKEN": ADMIN_TOKEN}, redis_url=redis_url
    )
    with ServerThread(app) as server:
        yield server.url


def reservation(url: str) -> dict[str, Any]:
    found: dict[str, Any] = admin_status(url)["pools"][0]["reservation"]
    return found


async def burst(url: str, model: str, n: int, *, key: str | None = KEY) -> list[tuple[str, int]]:
    """`n` streaming chats at once: (outcome, completion tokens) of each."""
    headers = {"authorization": f"Bearer {key}"} if key else {}
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Tell me a story"}],
        "max_tokens": 2048,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    limits = httpx.Limits(max_connections=n + 8)
    async with httpx.AsyncClient(headers=headers, timeout=120, limits=limits) as client:

        async def one() -> tuple[str, int]:
            async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
                assert response.status_code == 200, await response.aread()
                text = (await response.aread()).decode()
            tokens = text.count('"content"') - 1  # a content delta per token, after the role's
            return response.headers.get("x-spillgate-outcome", "direct"), tokens

        return list(await asyncio.gather(*(one() for _ in range(n))))


def answered(url: str, model: str, n: int, *, key: str | None = KEY) -> list[int]:
    """The lengths of `n` answers, sent thirty at a time: each batch lasts as long as its
    longest answer, so fewer, larger batches finish sooner, and thirty fit the backend
    even at the prior's reservation."""
    lengths: list[int] = []
    while len(lengths) < n:
        size = min(30, n - len(lengths))
        lengths += [tokens for _, tokens in asyncio.run(burst(url, model, size, key=key))]
    return lengths


def until(check: Any, *, within_s: float = 10.0) -> None:
    deadline = time.monotonic() + within_s
    while not check():
        assert time.monotonic() < deadline, "not within the time allowed"
        time.sleep(0.05)


def test_a_fresh_gateway_reserves_by_what_the_backend_generated() -> None:
    backend = sim("fresh")
    try:
        # answers the backend generated before this gateway existed (another gateway's,
        # a client's sent straight to it)
        lengths = answered(backend.url, "fresh", 60, key=None)
        with gateway(backend, "fresh") as url:
            before = reservation(url)
            assert (before["source"], before["samples"]) == ("backends", 0)
            # about what the answers' lengths give, nowhere near the prior
            assert statistics.mean(lengths) <= before["expected_output_tokens"] < 2.5 * 100
            # 48 streams at once: reserving the prior (48 x 520 tokens) would have let in
            # 28 of them; the backend holds all 48 at once (about 48 x 108)
            done = asyncio.run(burst(url, "fresh", 48))
            assert [outcome for outcome, _ in done] == ["local"] * 48
    finally:
        backend.stop()


def test_without_any_lengths_the_prior_until_its_own_answers() -> None:
    backend = sim("prior")
    try:
        with gateway(backend, "prior") as url:
            before = reservation(url)
            assert (before["source"], before["expected_output_tokens"]) == ("prior", PRIOR)
            answered(url, "prior", MIN_SAMPLES)
            after = reservation(url)
            assert (after["source"], after["samples"]) == ("answers", MIN_SAMPLES)
            assert after["expected_output_tokens"] < PRIOR
    finally:
        backend.stop()


def test_a_replica_started_later_reserves_by_what_the_others_saw() -> None:
    backend = sim("shared")
    try:
        with RedisProcess() as store, gateway(backend, "shared", redis_url=store.url) as first:
            lengths = answered(first, "shared", 60)
            client = redis.Redis.from_url(store.url)
            until(lambda: client.llen(key("shared")) == 60)  # shared within its next pass
            assert sorted(int(x) for x in client.lrange(key("shared"), 0, -1)) == sorted(lengths)
            with gateway(backend, "shared", redis_url=store.url) as second:
                # the replicas' answers, read before its first request, rank above the
                # backend's histogram of the same answers
                warm = reservation(second)
                assert (warm["source"], warm["samples"]) == ("replicas", 0)
                expected = reservation(first)["expected_output_tokens"]
                assert warm["expected_output_tokens"] == expected
                done = asyncio.run(burst(second, "shared", 48))
                assert [outcome for outcome, _ in done] == ["local"] * 48
            client.close()
    finally:
        backend.stop()
