"""The processes `spillgate bench admission` measures: a backend (the simulator or a
real vLLM), a simulated provider, and one gateway per admission arm, each its own process.

Every gateway has two pools on the same backend: `MODEL` (overflow `[queue, reject]`, for
the bursts) and `MODEL-spike` (overflow `[queue, provider, reject]`, for the spike), so a
spike's spill is counted apart from the bursts' refusals.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import time
import zlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson
import yaml

from gateway.config import hash_key
from loadtest.bench.machine import backend_core, off_core
from loadtest.bench.overhead import serve_command
from loadtest.loadgen.client import RequestShape
from loadtest.loadgen.workload import PlannedRequest
from loadtest.procs import free_port, wait_for_port
from loadtest.real_vllm import STOP_TOKEN_IDS, RealVllm, install, model_dir, running
from loadtest.sim.tokenizer_files import write

TENANT, KEY = "bench", "sk-bench-admission"
ADMIN_TOKEN = "bench-admin-token"
PROVIDER_KEY_ENV, PROVIDER_KEY = "BENCH_PROVIDER_KEY", "sk-bench-provider"
SPIKE_SUFFIX = "-spike"
START_TIMEOUT_S = 60.0
TIMEOUTS = {"connect": 10.0, "first_token": 60.0, "idle": 60.0, "total": 600.0}
# The arms through the gateway: pool options that pick the admission (issue 20's keys).
# `whole` reserves each stream's whole expected answer, as the learned admission did
# before `hold: peak`; `learned` the defaults, what a stream is expected to hold at its peak.
LEARNED = {
    "mode": "learned",
    "quantile": 0.9,
    "quantile_of": "backend",
    "prior_tokens": 512,
    "min_samples": 50,
}
ARMS: dict[str, dict[str, Any]] = {
    "static": {"reservation": {"mode": "max_tokens"}, "feedback": False},
    "whole": {"reservation": {**LEARNED, "hold": "whole"}, "feedback": True},
    "learned": {"reservation": {**LEARNED, "hold": "peak"}, "feedback": True},
}
LEARNING = [arm for arm, options in ARMS.items() if options["reservation"]["mode"] == "learned"]


@dataclass(frozen=True, kw_only=True)
class BenchShape(RequestShape):
    """The load generator's request, plus a seed per prompt (the same answer on every arm)
    and, on a real vLLM, the stop tokens that end its random answers early."""

    extra: Mapping[str, Any] = field(default_factory=dict)

    def body(self, plan: PlannedRequest) -> bytes:
        body = orjson.loads(super().body(plan))
        body["seed"] = zlib.crc32(plan.text.encode()) & 0x7FFFFFFF
        body.update(self.extra)
        return orjson.dumps(body)


@dataclass(frozen=True, kw_only=True)
class Backend:
    url: str
    model: str
    kind: str  # simulator | real-vllm
    extra: Mapping[str, Any] = field(default_factory=dict)  # added to every request body
    # the model's tokenizer files, given to the gateways' pools (`--tokenizer`)
    tokenizer: Path | None = None


@dataclass(frozen=True, kw_only=True)
class SimOptions:
    kv_tokens: int = 16_384
    block_size: int = 16
    max_model_len: int = 4096
    speed: float = 4.0
    core: int | None = None  # the one core it runs on (the bench keeps off it)
    tokenizer: Path | None = None  # tokenizer files it tokenizes prompts with, as an engine


@contextlib.contextmanager
def process(
    cmd: list[str], port: int, *, log: Path, env: Mapping[str, str] | None = None
) -> Iterator[str]:
    """`cmd` as a child process (its output in `log`), yielded as its URL once it listens."""
    with log.open("wb") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
        )
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = log.read_text(errors="replace")[-2000:]
                raise RuntimeError(f"{' '.join(cmd[:4])} did not start; its output:\n{tail}")
            with contextlib.suppress(TimeoutError):
                wait_for_port(port, timeout=0.5)
                break
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def _spillgate(*args: str) -> list[str]:
    return [sys.executable, "-m", "gateway.cli", *args]


@contextlib.contextmanager
def simulator(options: SimOptions, *, workdir: Path) -> Iterator[Backend]:
    port = free_port()
    cmd = _spillgate(
        "sim", "--port", str(port), "--model", "sim", "--kv-tokens", str(options.kv_tokens),
        "--block-size", str(options.block_size), "--max-model-len", str(options.max_model_len),
        "--speed", str(options.speed),
    )  # fmt: skip
    if options.tokenizer is not None:
        cmd += ["--tokenizer", str(options.tokenizer)]
    if options.core is not None:
        cmd = ["taskset", "-c", str(options.core), *cmd]
    with process(cmd, port, log=workdir / "sim.log") as url:
        yield Backend(url=url, model="sim", kind="simulator", tokenizer=options.tokenizer)


@contextlib.contextmanager
def real_vllm(server: RealVllm, *, tokenizer: bool = False) -> Iterator[Backend]:
    with running(server) as url:
        extra = {"stop_token_ids": list(STOP_TOKEN_IDS)}
        files = model_dir() if tokenizer else None
        yield Backend(url=url, model="tiny", kind="real-vllm", extra=extra, tokenizer=files)


@contextlib.contextmanager
def provider(*, workdir: Path) -> Iterator[str]:
    port = free_port()
    cmd = _spillgate(
        "sim", "--provider", "--port", str(port), "--api-key", PROVIDER_KEY,
        "--rpm", "1000000", "--tpm", "1000000000",
    )  # fmt: skip
    with process(cmd, port, log=workdir / "provider.log") as url:
        yield url


def gateway_config(
    *, backend: Backend, provider_url: str, arm: str, queue_wait_s: float | None = None
) -> dict[str, Any]:
    """One gateway: tenant limits out of the way, the arm's admission on both pools, and
    connect timeouts long enough for a starved two-core machine (the default 2 s there
    turned overload into refusals that had nothing to do with admission); the queue's
    longest wait when `queue_wait_s` is given."""
    options: dict[str, Any] = {"target_fill": 0.9, "timeouts": TIMEOUTS, **ARMS[arm]}
    if queue_wait_s is not None:
        options["queue"] = {"max_wait_s": queue_wait_s}
    if backend.tokenizer is not None:
        options["tokenizer"] = str(backend.tokenizer)
    entry = {"url": backend.url, "served_model": backend.model, "capacity": "auto"}
    return {
        "tenants": [
            {
                "name": TENANT,
                "key_sha256": hash_key(KEY),
                "requests_per_minute": 1_000_000,
                "tokens_per_minute": 1_000_000_000,
            }
        ],
        "pools": [
            {
                "name": backend.model,
                "backends": [entry],
                "overflow": ["queue", "reject"],
                **options,
            },
            {
                "name": backend.model + SPIKE_SUFFIX,
                "backends": [entry],
                "overflow": ["queue", "provider", "reject"],
                "provider": "hosted",
                **options,
            },
        ],
        "providers": [
            {
                "name": "hosted",
                "base_url": provider_url + "/v1",
                "api_key_env": PROVIDER_KEY_ENV,
                "models": {backend.model + SPIKE_SUFFIX: backend.model},
                "tokens_per_minute": 1_000_000_000,
                "max_concurrency": 1024,
                "timeouts": TIMEOUTS,
            }
        ],
    }


def wait_ready(url: str, *, timeout_s: float = START_TIMEOUT_S) -> None:
    """Until the gateway's /readyz says every pool has a backend with known capacity."""
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=5.0) as client:
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                if client.get(f"{url}/readyz").status_code == 200:
                    return
            time.sleep(0.2)
    raise RuntimeError(f"gateway {url} not ready after {timeout_s:g}s")


@contextlib.contextmanager
def gateway(
    config: dict[str, Any],
    *,
    workdir: Path,
    arm: str,
    redis_url: str | None = None,
    cores: str | None = None,
) -> Iterator[str]:
    """A `spillgate serve` of `config` (sharing `redis_url`, when given), once ready; on
    the cores `cores` lists alone (`taskset -c`), when given."""
    path = workdir / f"gateway-{arm}.yaml"
    path.write_text(yaml.safe_dump(config))
    port = free_port()
    env = {"SPILLGATE_ADMIN_TOKEN": ADMIN_TOKEN, PROVIDER_KEY_ENV: PROVIDER_KEY}
    confine = ["taskset", "-c", cores] if cores is not None else []
    cmd = [*confine, *serve_command(sys.executable, path), "--port", str(port)]
    if redis_url is not None:
        cmd += ["--redis", redis_url]
    with process(cmd, port, log=workdir / f"gateway-{arm}.log", env=env) as url:
        wait_ready(url)
        yield url


@contextlib.contextmanager
def replicas(
    config: dict[str, Any], *, workdir: Path, arm: str, count: int, redis_url: str
) -> Iterator[list[str]]:
    """`count` gateways of `config` sharing `redis_url` (the tenants' local share, should
    Redis fail, sized for them all), their URLs once every one is ready."""
    shared = {**config, "ratelimit": {"replicas": count}}
    with contextlib.ExitStack() as stack:
        yield [
            stack.enter_context(
                gateway(shared, workdir=workdir, arm=f"{arm}-{i}", redis_url=redis_url)
            )
            for i in range(count)
        ]


@contextlib.contextmanager
def backend(args: argparse.Namespace, workdir: Path) -> Iterator[Backend]:
    core = backend_core()
    if args.real_vllm:
        install()
        server = RealVllm(
            port=args.port,
            kv_tokens=args.kv_tokens,
            max_model_len=args.max_model_len,
            cores=None if core is None else str(core),
            confined=core is not None,
        )
        with real_vllm(server, tokenizer=args.tokenizer) as found, off_core(core):
            yield found
    else:
        options = SimOptions(
            kv_tokens=args.kv_tokens,
            block_size=args.sim_block_size,
            max_model_len=args.max_model_len,
            speed=args.sim_speed,
            core=core,
            tokenizer=write(workdir / "tokenizer") if args.tokenizer else None,
        )
        with simulator(options, workdir=workdir) as found, off_core(core):
            yield found


def add_backend_args(p: argparse.ArgumentParser) -> None:
    """The options `backend` reads: which backend, and its size."""
    p.add_argument("--real-vllm", action="store_true", help="a real vLLM instead of the simulator")
    p.add_argument("--port", type=int, default=8101, help="the real vLLM's port")
    p.add_argument("--kv-tokens", type=int, default=16_384, help="the backend's KV cache")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--sim-speed", type=float, default=1.0, help="the simulator's speed-up")
    p.add_argument("--sim-block-size", type=int, default=16)
    p.add_argument(
        "--tokenizer",
        action="store_true",
        help="give the pools the model's tokenizer (the real vLLM's, or one the simulator "
        "then tokenizes with): prompts that share blocks are tokenized, not guessed",
    )
