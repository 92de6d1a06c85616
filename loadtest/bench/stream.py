"""Streaming client for `spillgate bench`, run in its own process: TTFT, gaps, chunks/s."""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

import httpx
import orjson


async def _one(
    client: httpx.AsyncClient, url: str, body: bytes, out: dict[str, list[float]]
) -> int:
    t0 = time.perf_counter()
    last = None
    chunks = 0
    async with client.stream("POST", url, content=body) as response:
        async for data in response.aiter_raw():
            now = time.perf_counter()
            if last is None:
                out["ttft"].append(now - t0)
            else:
                out["gap"].append(now - last)
            last = now
            chunks += data.count(b"data: ")
    return chunks


async def main(
    url: str, key: str, concurrency: int, seconds: float, gap_ms: float
) -> dict[str, object]:
    request = {"model": "bench", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    body = orjson.dumps({**request, "bench_gap_ms": gap_ms})
    headers = {"authorization": f"Bearer {key}", "content-type": "application/json"}
    out: dict[str, list[float]] = {"ttft": [], "gap": []}
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    total = 0
    async with httpx.AsyncClient(headers=headers, limits=limits, timeout=30) as client:
        await _one(client, url, body, {"ttft": [], "gap": []})
        deadline = time.perf_counter() + seconds
        started = time.perf_counter()

        async def worker() -> int:
            n = 0
            while time.perf_counter() < deadline:
                n += await _one(client, url, body, out)
            return n

        total = sum(await asyncio.gather(*(worker() for _ in range(concurrency))))
        elapsed = time.perf_counter() - started
    return {"chunks_per_s": total / elapsed, "ttft": out["ttft"], "gap": out["gap"]}


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("url")
    parser.add_argument("--key", default="none")
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--gap-ms", type=float, default=0.0)
    a = parser.parse_args()
    result = asyncio.run(main(a.url, a.key, a.concurrency, a.seconds, a.gap_ms))
    sys.stdout.buffer.write(orjson.dumps(result))
