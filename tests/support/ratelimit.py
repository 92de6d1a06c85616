"""Gateways for the rate-limit tests: `spillgate serve` processes sharing one Redis, their
clocks apart where libfaketime is installed, in front of a simulator and a backend that
always reports `USED` completion tokens."""

from __future__ import annotations

import asyncio
import contextlib
import glob
import os
import secrets
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import orjson
import redis.asyncio as aioredis
import yaml
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from gateway.config import hash_key
from loadtest.procs import RedisProcess, free_port
from loadtest.sim.app import create_sim_app
from loadtest.sim.config import SimConfig
from tests.support.harness import ServerThread
from tests.support.replica import GatewayProcess, wait_ready
from tests.support.upstream import MODELS_ROUTE

ROOT = Path(__file__).resolve().parents[2]
LIBFAKETIME = next(iter(sorted(glob.glob("/usr/lib/*/faketime/libfaketime.so.1"))), None)
CLOCK_OFFSETS = ["-30s", "+0s", "+30s"]  # the three gateways' clocks, as FAKETIME offsets
USED = 50  # completion tokens the short backend reports, whatever max_tokens says
HANG = "hang"  # this prompt makes the short backend stall its stream after one chunk
TENANTS: dict[str, dict[str, Any]] = {
    "burst": {"requests_per_minute": 10},
    "burst1": {"requests_per_minute": 10},
    "tokens": {"requests_per_minute": 10_000, "tokens_per_minute": 1, "token_burst": 1500},
    "clock": {"requests_per_minute": 6},
    "refund": {"tokens_per_minute": 1, "token_burst": 20_000},
    "stream": {"tokens_per_minute": 1, "token_burst": 20_000},
    "cut": {"tokens_per_minute": 1, "token_burst": 20_000},
    "small": {"tokens_per_minute": 1000},
    # one request a minute refills, so levels stay whole numbers for the whole test
    "ops": {"requests_per_minute": 1, "request_burst": 20},
}


@contextlib.contextmanager
def gateways(
    specs: Sequence[tuple[dict[str, Any], str | None]], *, redis_url: str, workdir: Path
) -> Iterator[list[str]]:
    """`spillgate serve` per (config, clock offset); yields their base URLs."""
    started: list[GatewayProcess] = []
    try:
        for i, (config, offset) in enumerate(specs):
            path = workdir / f"gateway{i}.yaml"
            path.write_text(yaml.safe_dump(config))
            port = free_port()
            env = dict(os.environ)
            if offset is not None and LIBFAKETIME is not None:
                env |= {"LD_PRELOAD": LIBFAKETIME, "FAKETIME": offset}
            cmd = [sys.executable, "-m", "gateway.cli", "serve", "-c", str(path)]
            cmd += ["--port", str(port), "--redis", redis_url, "--log-level", "warning"]
            log = workdir / f"gateway{i}.log"
            with log.open("wb") as out:
                proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=out)
            started.append(GatewayProcess(proc=proc, port=port, log=log))
        for gateway in started:
            wait_ready(gateway)
        yield [gateway.url for gateway in started]
    finally:
        for gateway in started:
            gateway.proc.terminate()
        for gateway in started:
            try:
                gateway.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                gateway.proc.kill()
                gateway.proc.wait(timeout=10)


def short_backend() -> Starlette:
    """Answers every chat request with `USED` completion tokens, streamed or not.

    Its tokenizer counts four characters a token, as the gateway's estimate starts out,
    so a request's reservation stays the same from one request to the next.
    """

    async def chat(request: Request) -> Response:
        body = await request.json()
        prompt = sum(len(m["content"]) + 16 for m in body["messages"]) // 4
        usage = {"prompt_tokens": prompt, "completion_tokens": USED, "total_tokens": prompt + USED}
        base = {"id": "cmpl-1", "created": 1, "model": body["model"]}
        if not body.get("stream"):
            choice = {"index": 0, "message": {"role": "assistant", "content": "ok"}}
            answer = {**base, "object": "chat.completion", "usage": usage}
            return JSONResponse({**answer, "choices": [{**choice, "finish_reason": "stop"}]})
        hang = body["messages"][-1]["content"] == HANG
        return StreamingResponse(_events(base, usage, hang=hang), media_type="text/event-stream")

    return Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"]), MODELS_ROUTE])


async def _events(
    base: dict[str, Any], usage: dict[str, int], *, hang: bool
) -> AsyncIterator[bytes]:
    chunk = {**base, "object": "chat.completion.chunk"}
    delta = {"index": 0, "delta": {"content": "ok"}, "finish_reason": None}
    yield b"data: " + orjson.dumps({**chunk, "choices": [delta]}) + b"\n\n"
    if hang:
        await asyncio.sleep(30)  # until the gateway hangs up
    end = {"index": 0, "delta": {}, "finish_reason": "stop"}
    yield b"data: " + orjson.dumps({**chunk, "choices": [end]}) + b"\n\n"
    yield b"data: " + orjson.dumps({**chunk, "choices": [], "usage": usage}) + b"\n\n"
    yield b"data: [DONE]\n\n"


class Fleet:
    def __init__(self, urls: list[str], keys: dict[str, str], config: dict[str, Any]) -> None:
        self.urls = urls
        self.keys = keys
        self.config = config

    def headers(self, tenant: str) -> dict[str, str]:
        return {"authorization": f"Bearer {self.keys[tenant]}"}

    def client(self, tenant: str, index: int = 0) -> httpx.Client:
        return httpx.Client(base_url=self.urls[index], headers=self.headers(tenant), timeout=15)


@contextlib.contextmanager
def ratelimit_fleet(workdir: Path) -> Iterator[Fleet]:
    """Three `spillgate serve` processes, clocks `CLOCK_OFFSETS` apart, sharing one Redis,
    in front of a simulator (pool `sim`) and the short backend (pool `short`)."""
    keys = {name: f"sk-{name}-{secrets.token_hex(8)}" for name in TENANTS}
    sim = ServerThread(create_sim_app(SimConfig(model="sim", kv_tokens=400_000, speed=50)))
    short = ServerThread(short_backend())
    with RedisProcess() as store, sim, short:
        config = {
            "tenants": [
                {"name": name, "key_sha256": hash_key(keys[name]), **limits}
                for name, limits in TENANTS.items()
            ],
            "pools": [
                {"name": "sim", "backends": [{"url": sim.url, "capacity": 400_000}]},
                {"name": "short", "backends": [{"url": short.url, "capacity": 400_000}]},
            ],
            # 200 requests at once keep each process's event loop busy for longer than the
            # default 50 ms (BENCHMARKS.md): a budget above that keeps these tests shared
            "redis": {"timeout_ms": 2000},
            "ratelimit": {"replicas": 3},
        }
        specs = [(config, offset) for offset in CLOCK_OFFSETS]
        with gateways(specs, redis_url=store.url, workdir=workdir) as urls:
            yield Fleet(urls, keys, config)


@contextlib.asynccontextmanager
async def connected(redis_proc: RedisProcess) -> AsyncIterator[aioredis.Redis]:
    """A client of `redis_proc`, closed after."""
    client = aioredis.Redis.from_url(redis_proc.url, socket_timeout=5)
    try:
        yield client
    finally:
        await client.aclose()
