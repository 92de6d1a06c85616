"""`spillgate bench hostile`: one tenant's requests, timed while another tenant's upstream
sends an event that never ends (128 MB with no blank line), beside the same requests with
no hostile upstream, rounds alternating; and the gateway's memory while it happens.

The gateway runs as `spillgate serve` in a process of its own with two pools: `sim`, a
simulated vLLM that the timed tenant asks, and `hostile`, a raw server that answers every
stream with `data: ` and then 128 MB without a line break. The hostile tenant asks it again
and again for the whole of each hostile round. What is reported: the timed tenant's
latency p50 and p99 in each arm (medians over the rounds) and their ratio, and the
gateway's resident memory at its highest in a hostile round above its median in the quiet
rounds. Targets (issue 50): p99 within 1.5x of the quiet arm's, memory rise under 32 MB.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import yaml

from gateway.config import hash_key
from loadtest.percentile import percentile_or_nan as percentile
from loadtest.procs import free_port, wait_for_port

TIMED_KEY, HOSTILE_KEY = "sk-bench-timed", "sk-bench-hostile"
EVENT_MB = 128
TARGET_RATIO, TARGET_RISE_MB = 1.5, 32
# what the gateway's error event says when it cuts an event at its bound (relay.py)
CUT_AT_BOUND = b"sent an event longer than"
UNLIMITED = {"requests_per_minute": 10**9, "tokens_per_minute": 10**12}


# `GET /v1/models` as vLLM answers it: the gateway's probe must find the model served, or
# the backend never enters rotation and every hostile request is refused at the door
MODELS = json.dumps({
    "object": "list",
    "data": [{"id": "m", "object": "model", "root": "m", "max_model_len": 8192}],
}).encode()  # fmt: skip


async def _hostile_server(port: int, megabytes: int) -> None:
    """Every POST: a 200 event stream whose one event never ends. `GET /v1/models`: its
    model, so that the gateway takes it into rotation; any other GET, a 404."""
    piece = b"x" * (1 << 20)
    head = (
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    )
    models = (
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
        % len(MODELS)
        + MODELS
    )

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            while True:
                head_in = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head_in.lower().split(b"\r\n"):
                    if line.startswith(b"content-length:"):
                        length = int(line.partition(b":")[2])
                await reader.readexactly(length)
                if head_in.startswith(b"GET /v1/models "):
                    writer.write(models)
                    continue
                if not head_in.startswith(b"POST "):
                    writer.write(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n")
                    continue
                writer.write(head + b"6\r\ndata: \r\n")
                for _ in range(megabytes):
                    writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                    await writer.drain()
                writer.write(b"0\r\n\r\n")
                await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", port)
    async with server:
        await server.serve_forever()


def _config(sim: str, hostile: str, port: int) -> dict[str, Any]:
    return {
        "server": {"host": "127.0.0.1", "port": port},
        "tenants": [
            {"name": "timed", "key_sha256": hash_key(TIMED_KEY), **UNLIMITED},
            {"name": "hostile", "key_sha256": hash_key(HOSTILE_KEY), **UNLIMITED},
        ],
        "pools": [
            {"name": "sim", "backends": [{"url": sim, "served_model": "sim", "capacity": 1 << 20}]},
            {
                "name": "hostile",
                "backends": [{"url": hostile, "served_model": "m", "capacity": 1 << 20}],
                "continue_streams": 0,
                "timeouts": {"first_token": 30, "idle": 30, "total": 600},
            },
        ],
    }


@contextlib.contextmanager
def _process(cmd: list[str], port: int) -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for_port(port, timeout=30)
        yield proc
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


class _Sampler(threading.Thread):
    """The gateway's resident memory every 20 ms, until stopped."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid, self.samples, self._done = pid, list[float](), threading.Event()

    def run(self) -> None:
        while not self._done.wait(0.02):
            self.samples.append(_rss_mb(self.pid))

    def stop(self) -> list[float]:
        self._done.set()
        self.join()
        return self.samples


async def _timed(url: str, seconds: float, concurrency: int) -> list[float]:
    """The timed tenant's requests for `seconds`: each one's latency, in seconds."""
    body = {"model": "sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    headers = {"authorization": f"Bearer {TIMED_KEY}"}
    latencies: list[float] = []
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=30) as client:
        end = time.perf_counter() + seconds

        async def worker() -> None:
            while time.perf_counter() < end:
                began = time.perf_counter()
                response = await client.post("/v1/chat/completions", json=body)
                response.raise_for_status()
                latencies.append(time.perf_counter() - began)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return latencies


async def _hostile(url: str, stop: asyncio.Event) -> tuple[dict[int, int], int]:
    """The hostile tenant's streams, one after another until `stop`: how many got each
    status (a 200 is a stream the gateway started; a 503, one refused while the backend
    was out of rotation for it), and how many of the 200s the gateway cut at its event
    bound (they end with its error event)."""
    body = {"model": "hostile", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    headers = {"authorization": f"Bearer {HOSTILE_KEY}"}
    statuses: dict[int, int] = {}
    cut = 0
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=600) as client:
        while not stop.is_set():
            tail = b""
            async with client.stream("POST", "/v1/chat/completions", json=body) as response:
                async for chunk in response.aiter_raw():
                    tail = (tail + chunk)[-4096:]
            statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
            cut += response.status_code == 200 and CUT_AT_BOUND in tail
    return statuses, cut


async def _round(
    url: str, pid: int, *, hostile: bool, seconds: float, concurrency: int
) -> dict[str, Any]:
    sampler = _Sampler(pid)
    sampler.start()
    stop = asyncio.Event()
    attack = asyncio.create_task(_hostile(url, stop)) if hostile else None
    if attack is not None:
        await asyncio.sleep(0.5)  # the first hostile stream under way
    latencies = await _timed(url, seconds, concurrency)
    stop.set()
    statuses, cut = (await attack) if attack is not None else ({}, 0)
    rss = sampler.stop()
    return {
        "hostile": hostile,
        "requests": len(latencies),
        "p50_ms": percentile(latencies, 50) * 1000,
        "p99_ms": percentile(latencies, 99) * 1000,
        "rss_median_mb": statistics.median(rss),
        "rss_max_mb": max(rss),
        "hostile_statuses": statuses,
        "hostile_cut_at_bound": cut,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    sim_port, hostile_port, port = free_port(), free_port(), free_port()
    sim_cmd = [
        sys.executable,
        "-m",
        "gateway.cli",
        "sim",
        "--port",
        str(sim_port),
        "--model",
        "sim",
    ]
    hostile_cmd = [
        sys.executable,
        "-m",
        "loadtest.bench.hostile",
        "--serve-hostile",
        str(hostile_port),
    ]
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "gateway.yaml"
        sim, hostile = f"http://127.0.0.1:{sim_port}", f"http://127.0.0.1:{hostile_port}"
        config.write_text(yaml.safe_dump(_config(sim, hostile, port)))
        serve = [
            sys.executable,
            "-m",
            "gateway.cli",
            "serve",
            "-c",
            str(config),
            "--log-level",
            "error",
        ]
        with (
            _process(sim_cmd, sim_port),
            _process(hostile_cmd, hostile_port),
            _process(serve, port) as gateway,
        ):
            url = f"http://127.0.0.1:{port}"
            asyncio.run(_timed(url, 1.0, args.concurrency))  # warm up
            rounds = []
            for _ in range(args.rounds):
                for hostile_arm in (False, True):
                    rounds.append(
                        asyncio.run(
                            _round(
                                url,
                                gateway.pid,
                                hostile=hostile_arm,
                                seconds=args.seconds,
                                concurrency=args.concurrency,
                            )
                        )
                    )
                    print(json.dumps(rounds[-1]), file=sys.stderr)
    quiet = [r for r in rounds if not r["hostile"]]
    loud = [r for r in rounds if r["hostile"]]
    p99_quiet = statistics.median(r["p99_ms"] for r in quiet)
    p99_loud = statistics.median(r["p99_ms"] for r in loud)
    rise = max(r["rss_max_mb"] for r in loud) - statistics.median(r["rss_median_mb"] for r in quiet)
    return {
        "rounds": rounds,
        "p50_ms": {
            "quiet": statistics.median(r["p50_ms"] for r in quiet),
            "hostile": statistics.median(r["p50_ms"] for r in loud),
        },
        "p99_ms": {"quiet": p99_quiet, "hostile": p99_loud},
        "p99_ratio": p99_loud / p99_quiet,
        "rss_rise_mb": rise,
        "hostile_statuses": _summed(r["hostile_statuses"] for r in loud),
        "hostile_cut_at_bound": sum(r["hostile_cut_at_bound"] for r in loud),
        "met": p99_loud <= TARGET_RATIO * p99_quiet and rise < TARGET_RISE_MB,
    }


def _summed(counts: Iterator[dict[int, int]]) -> dict[str, int]:
    total: dict[str, int] = {}
    for count in counts:
        for status, n in count.items():
            total[str(status)] = total.get(str(status), 0) + n
    return total


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="spillgate bench hostile", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--rounds", type=int, default=3, help="rounds of each arm, alternating")
    parser.add_argument("--seconds", type=float, default=10.0, help="each round's length")
    parser.add_argument(
        "--concurrency", type=int, default=4, help="the timed tenant's requests at once"
    )
    parser.add_argument("--event-mb", type=int, default=EVENT_MB, help=argparse.SUPPRESS)
    parser.add_argument("--serve-hostile", type=int, metavar="PORT", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve_hostile is not None:
        asyncio.run(_hostile_server(args.serve_hostile, args.event_mb))
        return 0
    result = run(args)
    print(json.dumps({k: v for k, v in result.items() if k != "rounds"}, indent=2))
    return 0 if result["met"] else 1


if __name__ == "__main__":
    sys.exit(main())
