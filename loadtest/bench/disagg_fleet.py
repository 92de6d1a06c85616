"""The engines and gateways `spillgate bench disagg` measures: engines that play both
roles of vLLM's disaggregated serving (simulators with the `kv_transfer_params` protocol,
or real vLLMs of the CPU build with ExampleConnector and one shared folder), and a gateway
per arm whose one pool gives each engine its role (`prefill`, `decode`), or none (a
unified pool of the same engines, every backend `both`).

An engine can be stopped mid-burst: a simulator by a signal to its process, a real vLLM as
a pod is (SIGTERM, then SIGKILL of its process group).
"""

from __future__ import annotations

import contextlib
import json
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from gateway.config import hash_key
from loadtest.bench import admission_fleet
from loadtest.bench.adapters_fleet import start_all
from loadtest.bench.restart_fleet import stop, stop_server
from loadtest.procs import free_port, wait_for_port
from loadtest.real_vllm import RealVllm, install, model_dir, running

MODEL = "tiny"  # the real vLLM's served name; the simulators take it too
TENANT, KEY = "bench", "sk-bench-disagg"
UNLIMITED = {"requests_per_minute": 10**9, "tokens_per_minute": 10**12}
START_TIMEOUT_S = 60.0


@dataclass(kw_only=True)
class Engine:
    name: str
    url: str
    # a simulator's process; a real vLLM's server is serve.sh's, stopped by its pid file
    process: subprocess.Popen[bytes] | None = None
    server: RealVllm | None = None
    stopped: dict[str, Any] = field(default_factory=dict)

    def stop(self, *, kill: bool, grace_s: float) -> dict[str, Any]:
        """SIGKILL at once (`kill`), or as a pod is stopped: SIGTERM, SIGKILL after
        `grace_s`. What happened, and when."""
        began = time.monotonic()
        if self.server is not None:
            record = stop_server(self.server, 0.0 if kill else grace_s)
        else:
            assert self.process is not None
            if kill:
                self.process.send_signal(signal.SIGKILL)
                record = {"stopped_by": "SIGKILL"}
            else:
                record = stop(self.process.pid, grace_s, group=False)
            self.process.wait(timeout=10)
        self.stopped = {**record, "gone_after_s": time.monotonic() - began}
        return self.stopped


@dataclass(frozen=True, kw_only=True)
class Fleet:
    engines: tuple[Engine, ...]
    kind: str  # simulator | real-vllm
    kv_transfer: str  # params | shared
    extra: dict[str, Any]  # added to every request's body
    shared_path: Path | None = None  # where ExampleConnector's engines keep prompts' KV


@contextlib.contextmanager
def _simulator(i: int, *, kv_tokens: int, speed: float, workdir: Path) -> Iterator[Engine]:
    port = free_port()
    cmd = [
        sys.executable, "-m", "gateway.cli", "sim", "--port", str(port), "--model", MODEL,
        "--kv-tokens", str(kv_tokens), "--max-model-len", "4096", "--speed", str(speed),
        "--answer-lengths", "max_tokens", "--kv-transfer", "params",
        "--engine-id", f"engine-{i}",
    ]  # fmt: skip
    with (workdir / f"engine-{i}.log").open("ab") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_for_port(port, timeout=START_TIMEOUT_S)
        yield Engine(name=f"engine-{i}", url=f"http://127.0.0.1:{port}", process=proc)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)


def kv_transfer_config(path: Path) -> str:
    """vLLM's `--kv-transfer-config` for ExampleConnector: every engine stores each prompt's
    KV in `path` and loads what is there for a prompt it is sent."""
    return json.dumps(
        {
            "kv_connector": "ExampleConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": str(path)},
        }
    )


@contextlib.contextmanager
def fleet(
    count: int,
    *,
    real_vllm: bool,
    ports: Sequence[int],
    kv_tokens: int,
    sim_speed: float,
    workdir: Path,
) -> Iterator[Fleet]:
    """`count` engines, started together; stopped after."""
    if not real_vllm:
        with contextlib.ExitStack() as stack:
            engines = tuple(
                stack.enter_context(
                    _simulator(i, kv_tokens=kv_tokens, speed=sim_speed, workdir=workdir)
                )
                for i in range(count)
            )
            yield Fleet(
                engines=engines, kind="simulator", kv_transfer="params", extra={"ignore_eos": True}
            )
        return
    install()
    model_dir()  # made once here, not by both servers' scripts at once
    shared = Path(tempfile.mkdtemp(prefix="spillgate-bench-disagg-kv-"))
    servers = [
        RealVllm(
            port=port,
            kv_tokens=kv_tokens,
            # vLLM binds every worker to core 0; the second one's to core 1
            cores=str(i),
            args=("--kv-transfer-config", kv_transfer_config(shared)),
        )
        for i, port in enumerate(ports[:count])
    ]
    try:
        with start_all([running(server) for server in servers]) as urls:
            engines = tuple(
                Engine(name=f"engine-{i}", url=url, server=server)
                for i, (url, server) in enumerate(zip(urls, servers, strict=True))
            )
            # random weights almost never end an answer: every one runs to max_tokens
            yield Fleet(
                engines=engines,
                kind="real-vllm",
                kv_transfer="shared",
                extra={"ignore_eos": True},
                shared_path=shared,
            )
    finally:
        shutil.rmtree(shared, ignore_errors=True)


def gateway_config(
    fleet_: Fleet,
    roles: Sequence[str] | None,
    *,
    min_prompt_tokens: int,
    refresh_s: float,
) -> dict[str, Any]:
    """One pool over the engines, each with its role in `roles` (None: a unified pool, every
    backend `both`); the tenant's limits out of the way."""
    backends = [
        {
            "url": e.url,
            "name": e.name,
            "served_model": MODEL,
            "capacity": "auto",
            **({"role": role} if roles is not None else {}),
        }
        for e, role in zip(fleet_.engines, roles or ["both"] * len(fleet_.engines), strict=True)
    ]
    pool: dict[str, Any] = {
        "name": MODEL,
        "backends": backends,
        "overflow": ["queue", "reject"],
        "capacity_refresh_s": refresh_s,
        "timeouts": admission_fleet.TIMEOUTS,
    }
    if roles is not None:
        pool["prefill"] = {
            "kv_transfer": fleet_.kv_transfer,
            "min_prompt_tokens": min_prompt_tokens,
        }
    return {
        "tenants": [{"name": TENANT, "key_sha256": hash_key(KEY), **UNLIMITED}],
        "pools": [pool],
    }


def reset(fleet_: Fleet) -> None:
    """Between arms: each engine's prefix cache emptied and the shared folder too, so no arm
    finds what one before it computed (the prompts differ by arm and round as well)."""
    with httpx.Client(timeout=30) as client:
        for engine in fleet_.engines:
            if engine.stopped:
                continue
            with contextlib.suppress(httpx.HTTPError):
                client.post(f"{engine.url}/reset_prefix_cache")
    if fleet_.shared_path is not None:
        for entry in fleet_.shared_path.iterdir():
            shutil.rmtree(entry, ignore_errors=True)
