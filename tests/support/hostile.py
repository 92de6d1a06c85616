"""The gateway in front of raw backends that answer the way they should not
(tests/support/raw_server.py's `Backend`), on asyncio's loop or uvloop's."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from typing import Any

import openai
import uvloop

from gateway.app import create_app
from gateway.config import parse_settings
from tests.support.fleet import ADMIN_TOKEN, tenant
from tests.support.harness import ServerThread
from tests.support.raw_server import Backend

KEY = "sk-hostile-test-key"
OTHER_KEY = "sk-hostile-other-key"


@contextlib.contextmanager
def gateway_before(
    *backends: Backend,
    loop: str,
    limits: dict[str, Any] | None = None,
    server: dict[str, Any] | None = None,
    pool: dict[str, Any] | None = None,
    providers: list[dict[str, Any]] | None = None,
) -> Iterator[str]:
    """The gateway under uvicorn, on `loop`'s event loop, with pool `big` of `backends`
    (named big-0, big-1, ...) and tenants `acme` (KEY, under `limits`) and `other`
    (OTHER_KEY); its URL. ServerThread runs `asyncio.run`, which makes its loop by the
    policy in force as the thread starts."""
    settings = parse_settings({
        "tenants": [tenant("acme", KEY, **(limits or {})), tenant("other", OTHER_KEY)],
        "pools": [{
            "name": "big",
            # a fixed capacity: the gateway probes /health, and needs no /metrics
            "backends": [
                {"url": backend.url, "served_model": "m", "capacity": 65_536}
                for backend in backends
            ],
            **(pool or {}),
        }],
        "server": server or {},
        "providers": providers or [],
    })  # fmt: skip
    app = create_app(settings, environ={"SPILLGATE_ADMIN_TOKEN": ADMIN_TOKEN})
    policy = asyncio.get_event_loop_policy()
    if loop == "uvloop":
        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    try:
        server_thread = ServerThread(app).start()
    finally:
        asyncio.set_event_loop_policy(policy)
    try:
        yield server_thread.url
    finally:
        server_thread.stop()


def client(url: str, *, key: str = KEY, timeout: float = 10) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=timeout)
