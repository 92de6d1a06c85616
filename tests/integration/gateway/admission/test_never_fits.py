"""A request too large for the pool: served alone when a KV cache holds it, else refused for
good (400, no Retry-After) unless the chain can send it elsewhere."""

from collections.abc import Iterator
from typing import Any

import pytest

from loadtest.sim.config import SimConfig
from tests.support.fleet import Fleet, run_fleet

MSG = [{"role": "user", "content": "Hi"}]  # the gateway estimates 5 prompt tokens
STATIC = {"mode": "max_tokens"}


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    # 128 blocks of 16, one kept back: 2,032 tokens, 1,016 under the 0.5 target fill
    small = SimConfig(model="small", kv_tokens=2048, speed=50.0)
    spill = SimConfig(model="spill", kv_tokens=2048, speed=50.0)
    large = SimConfig(model="large", kv_tokens=8192, speed=50.0)
    with run_fleet(
        pools={"m": [small], "d": [spill], "big": [large]},
        # reserving all of max_tokens: a request's whole answer must fit (learned
        # reservations admit what its expected answer needs, and grow as it streams)
        pool_options={
            "m": {"target_fill": 0.5, "overflow": ["queue", "reject"], "reservation": STATIC},
            "d": {
                "target_fill": 0.5,
                "overflow": ["degrade", "reject"],
                "degrade_to": "big",
                "reservation": STATIC,
            },
        },
    ) as f:
        yield f


def chat(
    fleet: Fleet, model: str, max_tokens: int, *, n: int = 1
) -> tuple[int, dict[str, str], Any]:
    with fleet.client() as client:
        body = {"model": model, "messages": MSG, "max_tokens": max_tokens, "n": n}
        response = client.post("/v1/chat/completions", json=body)
    return response.status_code, dict(response.headers), response.json()


def test_over_the_target_fill_but_within_the_kv_cache_runs_alone(fleet: Fleet) -> None:
    status, headers, body = chat(fleet, "m", 1500)  # 1,520 tokens in blocks: > 1,016
    assert (status, headers["x-spillgate-outcome"]) == (200, "local")
    assert body["usage"]["completion_tokens"] == 1500


def test_larger_than_every_kv_cache_is_a_400_without_retry_after(fleet: Fleet) -> None:
    # each choice is within the 2,048-token context, the two together (2 x 1,120 tokens in
    # blocks) are more than the KV cache's 2,032
    status, headers, body = chat(fleet, "m", 1100, n=2)
    assert status == 400
    assert "retry-after" not in headers
    assert body["error"]["code"] == "context_length_exceeded"
    assert body["error"]["type"] == "invalid_request_error"
    assert "2032" in body["error"]["message"]


def test_larger_than_the_pool_spills_where_the_chain_can(fleet: Fleet) -> None:
    status, headers, body = chat(fleet, "d", 1100, n=2)
    assert (status, headers["x-spillgate-outcome"]) == (200, "degraded")
    assert body["model"] == "big"
