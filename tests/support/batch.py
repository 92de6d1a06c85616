"""Helpers for the batch tier's tests: a fleet with a batch store, JSONL inputs, polling."""

from __future__ import annotations

import io
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import openai
import orjson

from gateway.app import create_app
from loadtest.sim.config import SimConfig
from tests.support.fleet import ADMIN_TOKEN, Fleet, run_fleet
from tests.support.harness import ServerThread

POOL = "chat"
TERMINAL = ("completed", "cancelled", "expired", "failed")


@contextmanager
def batch_fleet(
    store: Path,
    *,
    redis_url: str | None = None,
    tenants: dict[str, dict[str, Any]] | None = None,
    pool_options: dict[str, Any] | None = None,
    speed: float = 20.0,
    **batch: Any,
) -> Iterator[Fleet]:
    """One simulated backend (capacity 1000 tokens, set by hand) behind a gateway whose
    batch store is `store` (or Redis); `batch` sets keys of the config's `batch:`."""
    sims = [SimConfig(model="served-chat", kv_tokens=8192, speed=speed)]
    with run_fleet(
        pools={POOL: sims},
        # each request reserves its whole max_tokens: the room a spike takes is exact
        pool_options={POOL: {"reservation": {"mode": "max_tokens"}, **(pool_options or {})}},
        tenants=tenants or {"acme": {}, "other": {}},
        capacity={POOL: 1000},
        extra={"batch": {"dir": str(store), "poll_s": 0.05, **batch}},
        redis_url=redis_url,
    ) as fleet:
        yield fleet


def client(fleet: Fleet, tenant: str = "acme") -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{fleet.url}/v1", api_key=fleet.keys[tenant], max_retries=0, timeout=20
    )


def chat_line(custom_id: str, *, words: str = "hello there", max_tokens: int = 5) -> dict[str, Any]:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {
            "model": POOL,
            "messages": [{"role": "user", "content": words}],
            "max_tokens": max_tokens,
        },
    }


def jsonl(lines: list[dict[str, Any]]) -> io.BytesIO:
    data = b"".join(orjson.dumps(line) + b"\n" for line in lines)
    return io.BytesIO(data)


def submit(api: openai.OpenAI, lines: list[dict[str, Any]]) -> str:
    upload = api.files.create(file=("input.jsonl", jsonl(lines)), purpose="batch")
    batch = api.batches.create(
        input_file_id=upload.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata={"job": "test"},
    )
    assert batch.status == "validating"
    return batch.id


def wait_status(api: openai.OpenAI, batch_id: str, *, within_s: float = 15.0) -> Any:
    deadline = time.monotonic() + within_s
    while True:
        batch = api.batches.retrieve(batch_id)
        if batch.status in TERMINAL:
            return batch
        assert time.monotonic() < deadline, f"batch still {batch.status}"
        time.sleep(0.05)


def lines_of(api: openai.OpenAI, file_id: str) -> list[dict[str, Any]]:
    text = api.files.content(file_id).content
    return [orjson.loads(line) for line in text.splitlines() if line.strip()]


def tokens_held(fleet: Fleet) -> dict[str, int]:
    return {
        b["name"]: b["tokens_in_flight"] for p in fleet.status()["pools"] for b in p["backends"]
    }


@contextmanager
def second_gateway(fleet: Fleet, *, redis_url: str | None = None, **batch: Any) -> Iterator[str]:
    """Another gateway on the fleet's backends and batch store, `batch` keys changed; its URL."""
    settings = fleet.settings.model_copy(
        update={"batch": fleet.settings.batch.model_copy(update=batch)}
    )
    app = create_app(settings, environ={"SPILLGATE_ADMIN_TOKEN": ADMIN_TOKEN}, redis_url=redis_url)
    with ServerThread(app) as server:
        yield server.url


@contextmanager
def spike(fleet: Fleet, *, max_tokens: int) -> Iterator[None]:
    """An interactive stream holding `max_tokens` (plus its prompt) of the pool until the
    block ends, when the client hangs up."""
    started, done = threading.Event(), threading.Event()

    def hold() -> None:
        body = {
            "model": POOL,
            "messages": [{"role": "user", "content": "spike"}],
            "max_tokens": max_tokens,
            "stream": True,
        }
        with fleet.client() as http, http.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()  # held: a dropped iterator closes the response
            next(lines)
            started.set()
            done.wait(30)

    thread = threading.Thread(target=hold, daemon=True)
    thread.start()
    assert started.wait(10)
    try:
        yield
    finally:
        done.set()
        thread.join(10)
