"""Tenant limits through the gateway: separate `spillgate serve` processes share one Redis.

Three gateways run with clocks 30 s apart (libfaketime, where it is installed) in front of
a simulated vLLM backend and a backend that always reports 50 completion tokens. Each test
has its own tenant, so buckets never carry over between tests.
"""

from __future__ import annotations

import asyncio
import email.utils
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest
import redis

from loadtest.procs import RedisProcess
from tests.support.metrics import metric_sum
from tests.support.ratelimit import HANG, LIBFAKETIME, Fleet, gateways, ratelimit_fleet

RATELIMIT_HEADERS = {
    f"x-ratelimit-{what}-{bucket}"
    for what in ("limit", "remaining", "reset")
    for bucket in ("requests", "tokens")
}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    with ratelimit_fleet(tmp_path_factory.mktemp("gateways")) as fleet:
        yield fleet


def chat(content: str, *, model: str = "sim", max_tokens: int = 3, **extra: Any) -> dict[str, Any]:
    messages = [{"role": "user", "content": content}]
    return {"model": model, "messages": messages, "max_tokens": max_tokens, **extra}


def assert_throttled(response: httpx.Response, *, code: str = "rate_limit_exceeded") -> None:
    assert response.status_code == 429, response.text
    assert response.headers["x-spillgate-outcome"] == "throttled"
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "rate_limit_error" and error["code"] == code


# --- concurrency and clocks --------------------------------------------------------------


async def fan_out(
    fleet: Fleet, tenant: str, bodies: list[dict[str, Any]], *, gateways: int = 3
) -> list[httpx.Response]:
    """Send every body at once, spread over the first `gateways` gateways in turn."""
    limits = httpx.Limits(max_connections=len(bodies))
    clients = [
        httpx.AsyncClient(base_url=url, headers=fleet.headers(tenant), timeout=15, limits=limits)
        for url in fleet.urls[:gateways]
    ]
    try:
        return await asyncio.gather(
            *(
                clients[i % len(clients)].post("/v1/chat/completions", json=body)
                for i, body in enumerate(bodies)
            )
        )
    finally:
        await asyncio.gather(*(c.aclose() for c in clients))


@pytest.mark.parametrize("gateways", [3, 1], ids=["three_gateways", "one_gateway"])
def test_200_at_once_admit_exactly_the_tenants_requests_per_minute(
    fleet: Fleet, gateways: int
) -> None:
    # all 200 on one process: more Redis calls at once than its connection pool holds
    tenant = "burst" if gateways == 3 else "burst1"
    bodies = [chat(f"q{i}") for i in range(200)]
    started = time.monotonic()
    responses = asyncio.run(fan_out(fleet, tenant, bodies, gateways=gateways))
    elapsed = time.monotonic() - started
    admitted = [r for r in responses if r.status_code == 200]
    # 10 a minute refills one every 6 s; the burst ends well within that, so exactly 10
    assert 10 <= len(admitted) <= 10 + int(elapsed / 6), [r.status_code for r in responses]
    for r in responses:
        assert set(r.headers) >= RATELIMIT_HEADERS
        assert r.headers["x-ratelimit-limit-requests"] == "10"
    for r in admitted:
        assert r.headers["x-spillgate-outcome"] == "local"
    # every admitted request saw a different level: none spent capacity another had spent
    assert len({r.headers["x-ratelimit-remaining-requests"] for r in admitted}) == len(admitted)
    for r in responses:
        if r.status_code != 200:
            assert_throttled(r)
            assert 1 <= int(r.headers["retry-after"]) <= 6
            assert r.headers["x-ratelimit-remaining-requests"] == "0"
            assert "requests per minute" in r.json()["error"]["message"]
    for url in fleet.urls:  # every decision was a shared one
        assert metric_sum(url, "spillgate_ratelimit_store_errors_total") == 0
    # each request tried for room while the limiter decided: the refused gave theirs back
    assert_nothing_held(fleet)


def assert_nothing_held(fleet: Fleet) -> None:
    """Every gateway's ledger holds no tokens (within its view's refresh)."""
    deadline = time.monotonic() + 5
    held = [metric_sum(url, "spillgate_inflight_tokens") for url in fleet.urls]
    while any(held) and time.monotonic() < deadline:
        time.sleep(0.1)
        held = [metric_sum(url, "spillgate_inflight_tokens") for url in fleet.urls]
    assert held == [0] * len(fleet.urls)


def test_admitted_tokens_stay_within_the_limit_plus_one_request(fleet: Fleet) -> None:
    sizes = [20 + (i * 37) % 100 for i in range(200)]  # 20..119 output tokens
    bodies = [chat(f"t{i}", max_tokens=n) for i, n in enumerate(sizes)]
    responses = asyncio.run(fan_out(fleet, "tokens", bodies))
    used = [r.json()["usage"]["total_tokens"] for r in responses if r.status_code == 200]
    refused = [r for r in responses if r.status_code != 200]
    assert used and refused
    for r in refused:
        assert_throttled(r)
        assert "tokens per minute" in r.json()["error"]["message"]
    assert sum(used) <= 1500 + max(used)
    assert sum(used) >= 1500 - 2 * max(used)  # the bucket was spent, not left unused


def _date(response: httpx.Response) -> float:
    return email.utils.parsedate_to_datetime(response.headers["date"]).timestamp()


@pytest.mark.skipif(LIBFAKETIME is None, reason="needs libfaketime (apt-get install faketime)")
def test_gateways_with_clocks_a_minute_apart_admit_the_same_amount(fleet: Fleet) -> None:
    clients = [fleet.client("clock", i) for i in range(3)]
    # in turn: each gateway reads a bucket another one wrote
    responses = [clients[i % 3].post("/v1/chat/completions", json=chat("c")) for i in range(12)]
    for client in clients:
        client.close()
    skew = _date(responses[2]) - _date(responses[0])
    assert 55 <= skew <= 65, f"the gateways' clocks should be 60 s apart, saw {skew}"
    assert [r.status_code for r in responses] == [200] * 6 + [429] * 6
    remaining = [r.headers["x-ratelimit-remaining-requests"] for r in responses[:6]]
    assert remaining == ["5", "4", "3", "2", "1", "0"]


# --- charge, then reconcile --------------------------------------------------------------


def remaining_tokens(client: httpx.Client, body: dict[str, Any]) -> tuple[int, int]:
    """x-ratelimit-remaining-tokens of one request read to its end, and the tokens it used."""
    with client.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        text = response.read().decode()
    if body.get("stream"):
        last = [line for line in text.splitlines() if '"usage"' in line][-1]
        usage = orjson.loads(last.removeprefix("data: "))["usage"]
    else:
        usage = orjson.loads(text)["usage"]
    return int(response.headers["x-ratelimit-remaining-tokens"]), usage["total_tokens"]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_an_unused_charge_comes_back_in_the_next_response(fleet: Fleet, stream: bool) -> None:
    tenant = "stream" if stream else "refund"
    body = chat("how are you", model="short", max_tokens=4000, stream=stream)
    if stream:
        body["stream_options"] = {"include_usage": True}
    with fleet.client(tenant, 1) as client:
        first, used = remaining_tokens(client, body)
        charged = 20_000 - first
        assert charged > 4000 and used < 100
        second, _ = remaining_tokens(client, body)
    assert second == 20_000 - used - charged  # the first request's rest came back


def test_a_stream_cut_by_its_client_keeps_its_whole_charge(fleet: Fleet) -> None:
    with fleet.client("cut", 2) as client:
        body = chat(HANG, model="short", max_tokens=4000, stream=True)
        body["stream_options"] = {"include_usage": True}
        with client.stream("POST", "/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            charged = 20_000 - int(response.headers["x-ratelimit-remaining-tokens"])
            next(response.iter_raw())
        deadline = time.monotonic() + 5  # settled once the gateway has counted the request
        while metric_sum(fleet.urls[2], "spillgate_requests_total", tenant="cut") < 1:
            assert time.monotonic() < deadline, "the cut stream was never counted"
            time.sleep(0.02)
        same_size = {**body, "messages": [{"role": "user", "content": "fine"}]}
        after, _ = remaining_tokens(client, same_size)
    # how much a cut stream used is unknown: its whole charge stays spent
    assert after == 20_000 - 2 * charged


def test_a_request_larger_than_the_whole_bucket_is_refused_at_once(fleet: Fleet) -> None:
    client = openai.OpenAI(base_url=fleet.urls[0] + "/v1", api_key=fleet.keys["small"], timeout=10)
    with pytest.raises(openai.RateLimitError) as refused:
        client.chat.completions.create(
            model="sim", messages=[{"role": "user", "content": "hi"}], max_tokens=2000
        )
    response = refused.value.response
    assert response.headers["x-spillgate-outcome"] == "throttled"
    assert "retry-after" not in response.headers  # waiting would not help
    assert refused.value.code == "request_too_large"
    assert "holds at most 1000" in refused.value.message
    # the official client took the hint and did not retry
    assert metric_sum(fleet.urls[0], "spillgate_requests_total", tenant="small") == 1
    with fleet.client("small") as http:
        fits = http.post("/v1/chat/completions", json=chat("hi"))
    assert fits.status_code == 200
    assert fits.headers["x-ratelimit-remaining-requests"] == "599"  # the refusal spent nothing


# --- Redis failure -----------------------------------------------------------------------


def outage_config(fleet: Fleet, failure_mode: str) -> dict[str, Any]:
    """The default 50 ms budget; a quick circuit breaker, so the test need not wait 5 s."""
    ratelimit = {"failure_mode": failure_mode, "replicas": 2}
    ratelimit |= {"failure_threshold": 2, "cooldown_s": 0.3}
    return {**fleet.config, "redis": {"timeout_ms": 50}, "ratelimit": ratelimit}


def timed_posts(url: str, key: str, count: int) -> list[tuple[httpx.Response, float]]:
    headers = {"authorization": f"Bearer {key}"}
    answers = []
    with httpx.Client(base_url=url, headers=headers, timeout=15) as http:
        for _ in range(count):
            t0 = time.perf_counter()
            response = http.post("/v1/chat/completions", json=chat("o", max_tokens=2))
            answers.append((response, time.perf_counter() - t0))
    return answers


def assert_answered_in_time(answers: list[tuple[httpx.Response, float]]) -> None:
    # each Redis call of a request gives up after 50 ms; a hang would last the 10 s pause
    slowest = max(seconds for _, seconds in answers)
    assert slowest < 1.0, f"a request waited {slowest:.2f} s for a Redis that is away"


def until_shared(url: str, key: str) -> None:
    """Ask until this gateway answers from the shared bucket (its full limit) again."""
    deadline = time.monotonic() + 10
    while True:
        response = timed_posts(url, key, 1)[0][0]
        if response.status_code == 200 and response.headers["x-ratelimit-limit-requests"] == "20":
            return
        assert time.monotonic() < deadline, "shared limiting did not resume"
        time.sleep(0.05)


def levels(responses: list[httpx.Response]) -> list[int]:
    return [int(r.headers["x-ratelimit-remaining-requests"]) for r in responses]


def check_outage(local: str, deny: str, answers: list[tuple[httpx.Response, float]]) -> None:
    """12 answers of the `local` gateway, then 6 of the `deny` one, while Redis was away."""
    assert_answered_in_time(answers)
    by_local = [r for r, _ in answers[:12]]
    # this process's share, 20 ÷ 2 replicas, held at half the 17 Redis last told it were left
    assert [r.status_code for r in by_local] == [200] * 8 + [429] * 4
    assert {r.headers["x-ratelimit-limit-requests"] for r in by_local} == {"10"}
    assert_throttled(by_local[-1])
    # `deny` refuses once its circuit is open: the first call that fails is answered from
    # the share (one slow call is no outage), its settlement's failure opens the circuit
    by_deny = [r for r, _ in answers[12:]]
    assert [r.status_code for r in by_deny] == [200] + [503] * 5
    for r in by_deny[1:]:
        assert r.headers["x-spillgate-outcome"] == "rejected"
        assert r.json()["error"]["code"] == "ratelimit_store_unavailable"
        assert r.headers["retry-after"] == "1"  # what is left of the 0.3 s cooldown, rounded up
    assert metric_sum(local, "spillgate_ratelimit_mode", mode="local") == 1
    assert metric_sum(deny, "spillgate_ratelimit_mode", mode="deny") == 1
    assert metric_sum(local, "spillgate_ratelimit_store_errors_total") >= 2
    counted = {
        outcome: metric_sum(deny, "spillgate_requests_total", tenant="ops", outcome=outcome)
        for outcome in ("rejected", "throttled")
    }
    assert counted == {"rejected": 5, "throttled": 0}  # as its responses said


def test_redis_paused_killed_and_restarted(
    fleet: Fleet, redis_proc: RedisProcess, tmp_path: Path
) -> None:
    key = fleet.keys["ops"]
    specs = [(outage_config(fleet, "local"), None), (outage_config(fleet, "deny"), None)]
    with gateways(specs, redis_url=redis_proc.url, workdir=tmp_path) as (local, deny):
        shared = [timed_posts(url, key, 1)[0][0] for url in (local, deny, local, deny)]
        assert levels(shared) == [19, 18, 17, 16]  # one bucket for both processes

        with redis.Redis.from_url(redis_proc.url) as admin:
            admin.client_pause(10_000)  # every command now stalls for 10 s
        paused = timed_posts(local, key, 6) + timed_posts(deny, key, 3)
        redis_proc.stop()
        dead = timed_posts(local, key, 6) + timed_posts(deny, key, 3)
        check_outage(local, deny, paused[:6] + dead[:6] + paused[6:] + dead[6:])

        redis_proc.start()  # the gateways keep running
        until_shared(local, key)
        until_shared(deny, key)
        back = [timed_posts(url, key, 1)[0][0] for url in (local, deny, local)]
        assert [r.status_code for r in back] == [200] * 3
        assert {r.headers["x-ratelimit-limit-requests"] for r in back} == {"20"}
        first = levels(back)[0]
        assert levels(back) == [first, first - 1, first - 2]  # one bucket again
        for url in (local, deny):
            assert metric_sum(url, "spillgate_ratelimit_mode", mode="shared") == 1
