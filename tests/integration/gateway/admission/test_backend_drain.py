"""A backend that goes away while its pool is full: a request it refuses before its first
byte is never a 502. It goes to another backend, and where none has room it overflows as
an arrival that found none (here it queues, and is answered when room frees)."""

from __future__ import annotations

import secrets
import threading
import time

import httpx

from gateway.app import create_app
from gateway.config import parse_settings
from loadtest.sim.app import create_sim_app
from loadtest.sim.config import SimConfig
from tests.support.fleet import ADMIN_TOKEN, Fleet, tenant
from tests.support.harness import ServerThread
from tests.support.matrix import wait_until_up
from tests.support.metrics import metric_sum

# one answer of this many tokens fills the small backend: a second does not fit beside it
MAX_TOKENS = 200


def test_a_request_refused_by_a_backend_going_away_waits_for_room_not_a_502() -> None:
    key = "sk-" + secrets.token_hex(8)
    small = ServerThread(create_sim_app(SimConfig(model="p", kv_tokens=4096, speed=0.5)))
    going = ServerThread(create_sim_app(SimConfig(model="p", kv_tokens=4096, speed=50.0)))
    with small, going:
        settings = parse_settings(
            {
                "tenants": [tenant("acme", key)],
                "pools": [
                    {
                        "name": "p",
                        "routing": "least_filled",
                        "reservation": {"mode": "max_tokens"},
                        "overflow": ["queue", "reject"],
                        "queue": {"max_wait_s": 20},
                        # probed once a minute: the gateway learns it went from a request
                        "capacity_refresh_s": 60,
                        "backends": [
                            {"url": small.url, "capacity": 256, "name": "small"},
                            {"url": going.url, "capacity": 256, "name": "going"},
                        ],
                    }
                ],
            }
        )
        env = {"SPILLGATE_ADMIN_TOKEN": ADMIN_TOKEN}
        with ServerThread(create_app(settings, environ=env)) as gateway:
            fleet = Fleet(gateway=gateway, backends={}, settings=settings, keys={"acme": key})
            wait_until_up(fleet, "small")
            wait_until_up(fleet, "going")
            headers = {"authorization": f"Bearer {key}"}
            body = {
                "model": "p",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": MAX_TOKENS,
            }
            first: list[httpx.Response] = []
            # both idle: the first request goes to the first backend, and fills it
            holder = threading.Thread(
                target=lambda: first.append(
                    httpx.post(
                        gateway.url + "/v1/chat/completions", json=body, headers=headers, timeout=30
                    )
                )
            )
            holder.start()
            deadline = time.monotonic() + 10
            while metric_sum(gateway.url, "spillgate_active_sessions", backend="small") < 1:
                assert time.monotonic() < deadline, "the first request never reached small"
                time.sleep(0.02)
            going.stop()  # goes away: its port refuses connections from now on
            second = httpx.post(
                gateway.url + "/v1/chat/completions", json=body, headers=headers, timeout=30
            )
            holder.join(timeout=30)
    assert first[0].status_code == 200
    assert second.status_code == 200, second.text
    assert second.headers["x-spillgate-outcome"] == "queued"
