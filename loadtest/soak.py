"""Soak: minutes of mixed load on a `spillgate serve` process while faults are injected,
with its memory, open files, Redis keys and reservations sampled from start to end.

Not part of CI:  spillgate bench soak --minutes 10  (add --json for machine output).

The fleet is real processes on loopback: Redis (reached through a proxy that can delay
it), two simulated vLLM backends, a simulated provider and the gateway. The load mixes
streamed and whole answers, repeated deterministic questions (the cache), clients that
hang up mid-stream or before the first token, and enough demand to overflow now and then.
Every `--fault-every` seconds the next fault in turn: a backend killed with SIGKILL and
restarted, Redis restarted, Redis slowed past the gateway's time budget, a provider
answering 500s. Growth is judged from the sample after warm-up to the one after the load
has drained.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import redis
import yaml

from gateway.config import hash_key
from loadtest.fault_proxy import DelayProxy
from loadtest.procs import RedisProcess, free_port, wait_for_port

ADMIN = "soak-admin-" + secrets.token_hex(4)
KEYS = {"acme": "sk-acme-" + secrets.token_hex(8), "beta": "sk-beta-" + secrets.token_hex(8)}
PROVIDER_KEY = "sk-prov-" + secrets.token_hex(8)
QUESTIONS = [f"Question {i}: what is {i} squared?" for i in range(20)]
BACKENDS = ("b0", "b1")


@dataclass(frozen=True)
class Sample:
    at_s: float
    rss_kib: int
    open_fds: int
    redis_keys: int
    tokens_in_flight: int
    sessions: int
    leases: int


@dataclass
class Tally:
    statuses: Counter[str] = field(default_factory=Counter)
    outcomes: Counter[str] = field(default_factory=Counter)
    faults: Counter[str] = field(default_factory=Counter)


class Child:
    """A child process that can be killed and started again on the same command line."""

    def __init__(self, args: list[str], *, port: int, env: dict[str, str] | None = None) -> None:
        self.args, self.port, self.env = args, port, env
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Child:
        self.proc = subprocess.Popen(
            self.args, env=self.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        wait_for_port(self.port, timeout=30)
        return self

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)
            self.proc = None


def _sim(port: int, *extra: str) -> Child:
    args = [sys.executable, "-m", "gateway.cli", "sim", "--port", str(port), *extra]
    return Child(args, port=port)


def _config(backends: dict[str, int], provider_port: int) -> dict[str, Any]:
    return {
        "server": {"max_body_bytes": 65536, "request_read_timeout_s": 5},
        "redis": {"timeout_ms": 100},
        "ratelimit": {"cooldown_s": 1.0},
        "tenants": [
            {"name": name, "key_sha256": hash_key(key), "requests_per_minute": 100_000,
             "tokens_per_minute": 100_000_000} for name, key in KEYS.items()
        ],
        "pools": [{
            "name": "big", "target_fill": 0.9, "capacity_refresh_s": 2,
            "overflow": ["queue", "cache", "provider", "reject"],
            "queue": {"max_depth": 8, "max_wait_s": 0.5}, "provider": "hosted",
            "cache": {"ttl_s": 60, "max_entries": 100},
            "timeouts": {"connect": 1, "first_token": 5, "idle": 5, "total": 30},
            "backends": [{"url": f"http://127.0.0.1:{port}", "served_model": "m"}
                         for port in backends.values()],
        }],
        "providers": [{
            "name": "hosted", "base_url": f"http://127.0.0.1:{provider_port}/v1",
            "api_key_env": "SOAK_PROVIDER_KEY", "max_concurrency": 4,
            "tokens_per_minute": 200_000, "breaker_cooldown_s": 3,
        }],
    }  # fmt: skip


@dataclass
class Fleet:
    redis: RedisProcess
    proxy: DelayProxy
    backends: dict[str, Child]
    provider: Child
    gateway: Child

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.gateway.port}"


@contextlib.contextmanager
def soak_fleet(workdir: Path, *, speed: float) -> Iterator[Fleet]:
    ports = {name: free_port() for name in BACKENDS}
    provider_port, gateway_port = free_port(), free_port()
    children: list[Child] = []
    with RedisProcess() as redis_proc, DelayProxy(redis_proc.port) as proxy:
        try:
            backends = {
                name: _sim(port, "--model", "m", "--kv-tokens", "1024", "--speed", str(speed))
                for name, port in ports.items()
            }
            provider = _sim(provider_port, "--provider", "--api-key", PROVIDER_KEY)
            for child in [*backends.values(), provider]:
                children.append(child.start())
            config = workdir / "soak.yaml"
            config.write_text(yaml.safe_dump(_config(ports, provider_port)))
            env = {**os.environ, "SPILLGATE_ADMIN_TOKEN": ADMIN,
                   "SPILLGATE_REDIS_URL": proxy.url, "SOAK_PROVIDER_KEY": PROVIDER_KEY}  # fmt: skip
            args = [sys.executable, "-m", "gateway.cli", "serve", "-c", str(config),
                    "--port", str(gateway_port), "--log-level", "warning"]  # fmt: skip
            gateway = Child(args, port=gateway_port, env=env)
            children.append(gateway.start())
            yield Fleet(redis_proc, proxy, backends, provider, gateway)
        finally:
            for child in reversed(children):
                child.kill()


def sample(fleet: Fleet, started: float) -> Sample:
    assert fleet.gateway.proc is not None
    pid = fleet.gateway.proc.pid
    status = Path(f"/proc/{pid}/status").read_text()
    rss = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS"))
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    store = redis.Redis(port=fleet.redis.port, socket_timeout=5)
    keys = int(store.dbsize())
    leases = sum(int(store.zcard(f"spillgate:ledger:{{big-{i}}}:leases")) for i in (0, 1))
    response = httpx.get(
        f"{fleet.url}/admin/status", headers={"authorization": f"Bearer {ADMIN}"}, timeout=10
    )
    backends = [b for pool in response.json()["pools"] for b in pool["backends"]]
    return Sample(
        at_s=round(time.monotonic() - started, 1),
        rss_kib=rss,
        open_fds=fds,
        redis_keys=keys,
        tokens_in_flight=sum(b["tokens_in_flight"] for b in backends),
        sessions=sum(b["active_sessions"] for b in backends),
        leases=leases,
    )


async def one_request(client: httpx.AsyncClient, rng: random.Random, tally: Tally) -> None:
    kind = rng.choices(["stream", "whole", "cut", "cached", "early"], [40, 25, 10, 15, 10])[0]
    question = rng.choice(QUESTIONS) if kind == "cached" else f"story {rng.random()}"
    body: dict[str, Any] = {
        "model": "big",
        "messages": [{"role": "user", "content": question}],
        "max_tokens": rng.randint(40, 300),
        "stream": kind in ("stream", "cut", "early"),
    }
    if kind == "cached":
        body |= {"temperature": 0, "max_tokens": 30}
    timeout = httpx.Timeout(30.0, read=0.02) if kind == "early" else 30.0
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body, timeout=timeout) as r:
            tally.statuses[str(r.status_code)] += 1
            tally.outcomes[r.headers.get("x-spillgate-outcome", "?")] += 1
            async for _ in r.aiter_raw():
                if kind == "cut":
                    break
    except httpx.TimeoutException:
        tally.statuses["client gave up"] += 1
    except httpx.HTTPError as exc:
        tally.statuses[type(exc).__name__] += 1


async def worker(fleet: Fleet, seed: int, stop: asyncio.Event, tally: Tally) -> None:
    rng = random.Random(seed)
    key = KEYS["acme" if seed % 2 else "beta"]
    headers = {"authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(base_url=fleet.url, headers=headers) as client:
        while not stop.is_set():
            await one_request(client, rng, tally)
            await asyncio.sleep(rng.uniform(0.05, 0.25))


async def inject(fleet: Fleet, which: int, tally: Tally) -> None:
    """The next fault in turn; each lasts a few seconds and then heals."""
    fault = which % 4
    if fault == 0:
        name = BACKENDS[(which // 4) % 2]
        tally.faults[f"kill -9 {name}"] += 1
        fleet.backends[name].kill()
        await asyncio.sleep(5)
        await asyncio.to_thread(fleet.backends[name].start)
    elif fault == 1:
        tally.faults["redis restart"] += 1
        await asyncio.to_thread(fleet.redis.restart)
    elif fault == 2:
        tally.faults["redis slow"] += 1
        fleet.proxy.delay_s = 0.3
        await asyncio.sleep(5)
        fleet.proxy.delay_s = 0.0
    else:
        tally.faults["provider 500s"] += 1
        url = f"http://127.0.0.1:{fleet.provider.port}/sim/fail"
        async with httpx.AsyncClient() as client:
            await client.post(url, json={"status": 500, "count": 20}, timeout=5)


async def run_load(fleet: Fleet, args: argparse.Namespace, tally: Tally) -> list[Sample]:
    started = time.monotonic()
    stop = asyncio.Event()
    workers = [asyncio.create_task(worker(fleet, i, stop, tally)) for i in range(args.concurrency)]
    samples: list[Sample] = []
    next_sample = started + args.warmup
    next_fault = started + args.fault_every
    faults = 0
    end = started + args.minutes * 60
    while time.monotonic() < end:
        now = time.monotonic()
        if now >= next_fault:
            await inject(fleet, faults, tally)
            faults += 1
            next_fault = time.monotonic() + args.fault_every
        if now >= next_sample:
            samples.append(await asyncio.to_thread(sample, fleet, started))
            next_sample = now + args.sample_every
        await asyncio.sleep(0.5)
    stop.set()
    await asyncio.gather(*workers)
    await asyncio.sleep(args.drain)
    samples.append(await asyncio.to_thread(sample, fleet, started))
    return samples


def report(samples: list[Sample], tally: Tally) -> str:
    names = [f.replace("_", " ") for f in Sample.__dataclass_fields__]
    lines = ["| " + " | ".join(names) + " |", "|" + "---|" * len(names)]
    lines += ["| " + " | ".join(str(v) for v in asdict(s).values()) + " |" for s in samples]
    first, last = samples[0], samples[-1]
    lines += [
        "",
        f"RSS {first.rss_kib} → {last.rss_kib} KiB (max {max(s.rss_kib for s in samples)}), "
        f"fds {first.open_fds} → {last.open_fds}, Redis keys {first.redis_keys} → "
        f"{last.redis_keys}, in flight at the end: {last.tokens_in_flight} tokens, "
        f"{last.sessions} sessions, {last.leases} leases",
        f"statuses: {dict(tally.statuses)}",
        f"outcomes: {dict(tally.outcomes)}",
        f"faults: {dict(tally.faults)}",
    ]
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--minutes", type=float, default=10.0, help="how long the load runs")
    parser.add_argument("--concurrency", type=int, default=6, help="clients at once")
    parser.add_argument("--fault-every", type=float, default=30.0, help="seconds between faults")
    parser.add_argument(
        "--warmup", type=float, default=60.0, help="seconds before the first sample"
    )
    parser.add_argument("--sample-every", type=float, default=60.0)
    parser.add_argument("--drain", type=float, default=15.0, help="seconds after the load stops")
    parser.add_argument("--speed", type=float, default=1.0, help="simulator speed factor")
    parser.add_argument("--json", action="store_true")


def run(args: argparse.Namespace) -> int:
    tally = Tally()
    with (
        tempfile.TemporaryDirectory(prefix="spillgate-soak-") as tmp,
        soak_fleet(Path(tmp), speed=args.speed) as fleet,
    ):
        samples = asyncio.run(run_load(fleet, args, tally))
    if args.json:
        counts = {name: dict(counter) for name, counter in asdict(tally).items()}
        print(json.dumps({"samples": [asdict(s) for s in samples], **counts}, indent=2))
    else:
        print(report(samples, tally))
    last = samples[-1]
    return 0 if (last.tokens_in_flight, last.sessions, last.leases) == (0, 0, 0) else 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="spillgate bench soak", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
