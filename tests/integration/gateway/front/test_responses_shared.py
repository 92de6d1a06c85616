"""Two gateways sharing a Redis: a continuation sent to either finds the backend that
answered its predecessor through the other."""

from __future__ import annotations

import time
from collections.abc import Iterator

import openai
import pytest

from gateway.app import create_app
from gateway.config import parse_settings
from loadtest.procs import RedisProcess
from loadtest.sim.app import create_sim_app
from loadtest.sim.config import SimConfig
from tests.support.fleet import ADMIN_TOKEN, admin_status, tenant
from tests.support.harness import ServerThread

KEY = "sk-shared-responses"


@pytest.fixture
def gateways(redis_proc: RedisProcess) -> Iterator[list[ServerThread]]:
    sims = [
        ServerThread(create_sim_app(SimConfig(model="m", kv_tokens=8192, speed=20.0))).start()
        for _ in range(2)
    ]
    started = list(sims)
    try:
        settings = parse_settings(
            {
                "tenants": [tenant("acme", KEY)],
                "pools": [
                    {
                        "name": "chat",
                        "backends": [{"url": s.url, "served_model": "m"} for s in sims],
                    }
                ],
            }
        )
        env = {"SPILLGATE_ADMIN_TOKEN": ADMIN_TOKEN}
        pair = [
            ServerThread(create_app(settings, environ=env, redis_url=redis_proc.url)).start()
            for _ in range(2)
        ]
        started += pair
        yield pair
    finally:
        for server in reversed(started):
            server.stop()


def _client(gateway: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=KEY, max_retries=0, timeout=20)


def test_a_continuation_through_another_replica_reaches_the_same_backend(
    gateways: list[ServerThread],
) -> None:
    a, b = gateways
    first = _client(a).responses.create(model="chat", input="Hi", max_output_tokens=3)
    # both backends idle: the first goes to chat-0; a miss on b would be a 404
    second = _client(b).responses.create(
        model="chat", input="More", max_output_tokens=2, previous_response_id=first.id
    )
    assert second.previous_response_id == first.id
    assert second.usage is not None and second.usage.input_tokens == 11 + 8
    third = _client(a).responses.create(
        model="chat", input="Again", max_output_tokens=2, previous_response_id=second.id
    )
    assert third.status == "completed"
    # another replica's releases reach a gateway's snapshot with that replica's next refresh
    deadline = time.monotonic() + 2.0
    while (held := _held(gateways)) != [[0, 0], [0, 0]] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert held == [[0, 0], [0, 0]]


def _held(gateways: list[ServerThread]) -> list[list[int]]:
    """Each gateway's view of the tokens in flight on each backend."""
    return [
        [b["tokens_in_flight"] for p in admin_status(g.url)["pools"] for b in p["backends"]]
        for g in gateways
    ]
