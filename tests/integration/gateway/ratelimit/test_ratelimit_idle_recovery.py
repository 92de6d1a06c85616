"""A replica that no request reaches reports its rate limiter shared again once Redis is
back: the limiter probes Redis off the request path while degraded, so an alert on
`spillgate_ratelimit_mode` ends with the outage, not with the next request.

A real redis-server, stopped and started again on its port; the gateway under uvicorn.
"""

from __future__ import annotations

import secrets
import time

import httpx

from gateway.app import create_app
from gateway.config import Settings, parse_settings
from gateway.ratelimit.resilient import PROBE_S
from loadtest.procs import RedisProcess
from loadtest.sim.app import create_sim_app
from loadtest.sim.config import SimConfig
from tests.support.fault import chat
from tests.support.fleet import ADMIN_TOKEN, tenant
from tests.support.harness import ServerThread
from tests.support.metrics import metric_sum, metrics_text, text_sum

KEY = "sk-" + secrets.token_hex(8)
# Far longer than the test: once the circuit is open no request's call would reach Redis
# anyway, so only the background probe can find Redis back.
COOLDOWN_S = 600.0
# A probe's period and its time budget, with slack for a loaded two-core machine.
RESUMES_WITHIN_S = PROBE_S + 1.0 + 3.0


def test_an_idle_gateway_reports_shared_once_redis_is_back(redis_proc: RedisProcess) -> None:
    sim = create_sim_app(SimConfig(model="m", kv_tokens=8192, no_delay=True))
    with ServerThread(sim) as backend:
        app = create_app(
            settings(backend.url),
            environ={"SPILLGATE_ADMIN_TOKEN": ADMIN_TOKEN},
            redis_url=redis_proc.url,
        )
        with ServerThread(app) as gateway:
            assert mode(gateway.url) == "shared"
            redis_proc.stop()
            with httpx.Client(base_url=gateway.url, timeout=10) as client:
                response = client.post(
                    "/v1/chat/completions",
                    json=chat("hi", model="big"),
                    headers={"authorization": f"Bearer {KEY}"},
                )
            assert response.status_code == 200, response.text
            assert mode(gateway.url) == "local"

            redis_proc.start()  # on the same port; from here on, no request
            started = time.monotonic()
            while mode(gateway.url) != "shared":
                assert time.monotonic() - started < RESUMES_WITHIN_S, "the gauge stayed local"
                time.sleep(0.05)
            assert metric_sum(gateway.url, "spillgate_requests_total") == 1


def settings(backend_url: str) -> Settings:
    return parse_settings(
        {
            "tenants": [tenant("acme", KEY, requests_per_minute=600, tokens_per_minute=10**6)],
            "pools": [
                {
                    "name": "big",
                    "backends": [{"url": backend_url, "served_model": "m", "capacity": 4096}],
                }
            ],
            "redis": {"timeout_ms": 250},
            "ratelimit": {
                "failure_mode": "local",
                "failure_threshold": 1,
                "cooldown_s": COOLDOWN_S,
            },
        }
    )


def mode(url: str) -> str:
    """The one mode the gauge reads 1 for, in one scrape: a mode can change between two."""
    text = metrics_text(url)
    on = [
        name
        for name in ("shared", "local", "allow", "deny")
        if text_sum(text, "spillgate_ratelimit_mode", mode=name) == 1
    ]
    assert len(on) == 1, on
    return on[0]
