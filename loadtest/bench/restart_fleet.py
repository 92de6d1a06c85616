"""The processes `spillgate bench restart` runs and stops: simulated vLLMs stopped as a pod
is and started again on their own port, a real vLLM stopped the same way, and the gateway in
front of them, with its config and its own counts of what it did about their failures."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from gateway.admission.fleet.metrics_text import samples
from gateway.config import hash_key
from loadtest.bench import admission_fleet as fleet
from loadtest.procs import free_port, wait_for_port
from loadtest.real_vllm import RealVllm

SIM_MODEL, REAL_MODEL = "sim", "tiny"
READY_TIMEOUT_S = 60.0


def gateway_config(urls: Sequence[str], model: str, args: argparse.Namespace) -> dict[str, Any]:
    """A pool of the backends at `urls`, capacity read from their metrics, the default
    overflow chain; connect timeouts long enough for a starved two-core machine."""
    pool: dict[str, Any] = {
        "name": model,
        "backends": [
            {"url": url, "served_model": model, "capacity": "auto", "name": f"{model}-{i}"}
            for i, url in enumerate(urls)
        ],
        "timeouts": {"connect": 10.0},
    }
    if args.continue_streams is not None:
        pool["continue_streams"] = args.continue_streams
    tenant = {
        "name": fleet.TENANT,
        "key_sha256": hash_key(fleet.KEY),
        "requests_per_minute": 1_000_000,
        "tokens_per_minute": 1_000_000_000,
    }
    return {"tenants": [tenant], "pools": [pool]}


def _alive(pid: int) -> bool:
    """Running, not a zombie waiting for a parent that may never reap it."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def stop(pid: int, grace_s: float, *, group: bool) -> dict[str, Any]:
    """SIGTERM, then SIGKILL (of the process group, with `group`) if it is still there
    after `grace_s`, as the kubelet stops a pod."""
    signalled = time.monotonic()
    os.kill(pid, signal.SIGTERM)
    while _alive(pid) and time.monotonic() - signalled < grace_s:
        time.sleep(0.02)
    if not _alive(pid):
        return {"stopped_by": "SIGTERM", "gone_after_s": time.monotonic() - signalled}
    with contextlib.suppress(ProcessLookupError):
        if group:
            os.killpg(pid, signal.SIGKILL)
        else:
            os.kill(pid, signal.SIGKILL)
    return {"stopped_by": "SIGKILL", "gone_after_s": time.monotonic() - signalled}


class SimBackend:
    """A `spillgate sim` on a port of its own, stopped and started again there."""

    def __init__(self, *, name: str, args: argparse.Namespace, workdir: Path, core: int | None):
        self.name = name
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._cmd = [
            sys.executable, "-m", "gateway.cli", "sim", "--port", str(self.port),
            "--model", SIM_MODEL, "--answer-lengths", "max_tokens",
            "--speed", str(args.sim_speed), "--kv-tokens", str(args.kv_tokens),
            "--max-model-len", str(args.max_model_len),
            "--shutdown-timeout", str(args.shutdown_timeout),
        ]  # fmt: skip
        if core is not None:
            self._cmd = ["taskset", "-c", str(core), *self._cmd]
        self._log = workdir / f"{name}.log"
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with self._log.open("ab") as out:
            self._proc = subprocess.Popen(self._cmd, stdout=out, stderr=subprocess.STDOUT)
        wait_for_port(self.port, timeout=READY_TIMEOUT_S)
        with httpx.Client(timeout=5) as client:
            client.get(self.url + "/health").raise_for_status()

    def restart(self, grace_s: float) -> dict[str, Any]:
        """Stopped as a pod is, started again, ready: when each happened."""
        assert self._proc is not None
        began = time.monotonic()
        stopped = stop(self._proc.pid, grace_s, group=False)
        self._proc.wait(timeout=10)
        self.start()
        return {**stopped, "ready_after_s": time.monotonic() - began}

    def close(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait(timeout=10)


async def back_in_rotation(client: httpx.AsyncClient, url: str, name: str) -> None:
    """Until the gateway at `url` routes to backend `name` again."""
    headers = {"authorization": f"Bearer {fleet.ADMIN_TOKEN}"}
    while True:
        with contextlib.suppress(httpx.HTTPError):
            status = (await client.get(url + "/admin/status", headers=headers)).json()
            backends = [b for pool in status["pools"] for b in pool["backends"]]
            if any(b["name"] == name and b["healthy"] for b in backends):
                return
        await asyncio.sleep(0.1)


# what the gateway says it did about the backends' failures: counter → the label it is told by
GATEWAY_COUNTERS = {
    "spillgate_upstream_errors_total": "reason",
    "spillgate_stream_continuations_total": "result",
    "spillgate_stream_continuations_refused_total": "reason",
}


async def gateway_counts(client: httpx.AsyncClient, url: str) -> dict[str, dict[str, int]]:
    """The gateway's own counts of upstream errors and continued streams, by reason (none
    where its build has no such counter)."""
    text = (await client.get(url + "/metrics")).text
    counts: dict[str, Counter[str]] = {name: Counter() for name in GATEWAY_COUNTERS}
    for sample in samples(text, GATEWAY_COUNTERS):
        counts[sample.name][sample.labels[GATEWAY_COUNTERS[sample.name]]] += int(sample.value)
    return {name.removeprefix("spillgate_").removesuffix("_total"): dict(c)
            for name, c in counts.items()}  # fmt: skip


def stop_server(server: RealVllm, grace_s: float) -> dict[str, Any]:
    """serve.sh's server on its port (the pid it wrote), stopped as a pod is."""
    pid = int(Path(f"/tmp/spillgate-vllm-{server.port}.pid").read_text())
    return stop(pid, grace_s, group=True)
