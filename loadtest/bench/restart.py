"""Rolling restarts: what clients of the gateway see while its backends are stopped in turn.

    spillgate bench restart [--json FILE]               # simulators (under a minute)
    spillgate bench restart --real-vllm [--json FILE]   # two real vLLMs (minutes)

Simulator arm: a gateway in front of a pool of two simulated vLLMs (`spillgate sim`, real
time, every answer `--max-tokens` words long), under steady load: `--clients` clients, each
sending one request after another, in turn a streamed and an unstreamed chat and a streamed
and an unstreamed completion. Meanwhile each backend is restarted in turn, as a pod with a
short terminationGracePeriod is: SIGTERM, SIGKILL after `--grace` seconds if it is still
there, started again on the same port, ready; then, `--interval` seconds after the first
stop, the other. The simulators stop on SIGTERM as vLLM 0.32 does with the same
`--shutdown-timeout` (default 0: the requests in flight end at once with vLLM's error).

Real-vLLM arm: two real vLLMs (loadtest/real_vllm/serve.sh, each on a core of its own), a
gateway in front, and a burst of `--burst` streamed chats (`max_tokens` `--real-max-tokens`,
temperature 0, `ignore_eos`); once a quarter of the burst's tokens have arrived, the first
vLLM is stopped the same way (SIGTERM, SIGKILL of its whole process group after `--grace`
seconds) and not started again.

What every client saw is checked: the status; for a stream, an error event, a cut (no
finish_reason or no [DONE]); the text (on the simulators exactly the filler's first n words,
n the words received, and n = `--max-tokens`); usage (completion_tokens the words received,
prompt_tokens what the simulator counts for the request: loadtest/sim/tokens.py; on a real
vLLM completion_tokens within a token of the events received, and prompt_tokens against
vLLM's own /tokenize, reported but not failed). Any failure a client saw makes the command
exit 1, unless `--allow-failures` (for a figure taken before a fix). Figures go in
BENCHMARKS.md ("Rolling restarts").
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
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

from gateway.config import hash_key
from gateway.metrics_text import samples
from loadtest.bench import admission_fleet as fleet
from loadtest.bench.admission import backend_core, logs_dir, off_core, progress
from loadtest.bench.restart_answers import (
    KINDS,
    Ask,
    Fault,
    Seen,
    Tally,
    WordCount,
    ask,
    send,
)
from loadtest.procs import free_port, wait_for_port
from loadtest.real_vllm import RealVllm, install, running

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


async def steady_load(
    client: httpx.AsyncClient, url: str, tally: Tally, args: argparse.Namespace
) -> None:
    """`--clients` clients, each sending its next request as soon as its last one ended,
    the kinds in turn, until `--duration` is over."""
    numbers = itertools.count()
    until = time.monotonic() + args.duration

    async def one_client(index: int) -> None:
        sent = 0
        while time.monotonic() < until:
            kind = KINDS[(index + sent) % len(KINDS)]
            n = next(numbers)
            asked = ask(kind, n, model=SIM_MODEL, max_tokens=args.max_tokens, real=False)
            seen = Seen()
            await send(client, url, asked, seen)
            tally.add(asked, seen)
            sent += 1

    await asyncio.gather(*(one_client(i) for i in range(args.clients)))


async def restart_in_turn(
    backends: Sequence[SimBackend], client: httpx.AsyncClient, url: str, args: argparse.Namespace
) -> list[dict[str, Any]]:
    """Each backend restarted in turn, `--warmup` s into the load and every `--interval` s
    after; when each step of each restart happened, from the load's start."""
    began = time.monotonic()
    done = []
    for i in range(args.restarts):
        backend = backends[i % len(backends)]
        await asyncio.sleep(max(0.0, began + args.warmup + i * args.interval - time.monotonic()))
        at = time.monotonic() - began
        progress(f"restarting {backend.name} at {at:.1f} s")
        record = await asyncio.to_thread(backend.restart, args.grace)
        try:
            await asyncio.wait_for(back_in_rotation(client, url, backend.name), READY_TIMEOUT_S)
            rotation: float | None = time.monotonic() - began - at
        except TimeoutError:
            rotation = None
        done.append(
            {"backend": backend.name, "at_s": at, **record, "in_rotation_after_s": rotation}
        )
    return done


async def sim_arm(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    core = backend_core()
    with contextlib.ExitStack() as stack:
        backends = [
            SimBackend(name=f"{SIM_MODEL}-{i}", args=args, workdir=workdir, core=core)
            for i in range(2)
        ]
        for backend in backends:
            stack.callback(backend.close)
            backend.start()
        stack.enter_context(off_core(core))
        config = gateway_config([b.url for b in backends], SIM_MODEL, args)
        url = stack.enter_context(fleet.gateway(config, workdir=workdir, arm="restart"))
        tally = Tally(real=False)
        progress(f"{args.clients} clients for {args.duration:g} s; {args.restarts} restarts")
        async with httpx.AsyncClient(timeout=httpx.Timeout(60.0, connect=10.0)) as client:
            load = asyncio.create_task(steady_load(client, url, tally, args))
            restarts = await restart_in_turn(backends, client, url, args)
            await load
            gateway = await gateway_counts(client, url)
    return {**tally.figures(), "restarts": restarts, "gateway": gateway}


async def real_arm(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """The burst through a gateway in front of two real vLLMs, the first stopped midway."""
    install()
    servers = [
        RealVllm(
            port=args.port + i,
            kv_tokens=args.kv_tokens,
            max_model_len=args.max_model_len,
            cores=str(i),
            confined=True,
        )
        for i in range(2)
    ]
    with contextlib.ExitStack() as stack:
        for server in servers:
            progress(f"starting a real vLLM on port {server.port} (about a minute)")
            stack.enter_context(running(server))
        config = gateway_config([s.url for s in servers], REAL_MODEL, args)
        url = stack.enter_context(fleet.gateway(config, workdir=workdir, arm="restart-real"))
        async with httpx.AsyncClient(timeout=httpx.Timeout(120.0, connect=10.0)) as client:
            asks = [await tokenized(client, servers[0].url, n, args) for n in range(args.burst)]
            streamed = WordCount()
            seen = [Seen(counted=streamed) for _ in asks]
            progress(f"a burst of {args.burst} streams; the first vLLM stopped midway")
            pairs = zip(asks, seen, strict=True)
            burst = asyncio.ensure_future(
                asyncio.gather(*(send(client, url, a, s) for a, s in pairs))
            )
            stopped = await stop_midway(servers[0], streamed, burst, args)
            await burst
            gateway = await gateway_counts(client, url)
    tally = Tally(real=True)
    for asked, one in zip(asks, seen, strict=True):
        tally.add(asked, one)
    return {**tally.figures(), "restarts": [stopped], "gateway": gateway}


async def tokenized(
    client: httpx.AsyncClient, backend: str, n: int, args: argparse.Namespace
) -> Ask:
    """Request `n` of the burst, with its prompt's tokens as the vLLM's own tokenizer counts
    them."""
    asked = ask("chat-stream", n, model=REAL_MODEL, max_tokens=args.real_max_tokens, real=True)
    body = {"model": REAL_MODEL, "messages": asked.body["messages"]}
    count = (await client.post(backend + "/tokenize", json=body)).json()["count"]
    return Ask(kind=asked.kind, body=asked.body, prompt_tokens=count)


async def stop_midway(
    server: RealVllm, streamed: WordCount, burst: asyncio.Future[Any], args: argparse.Namespace
) -> dict[str, Any]:
    """Once a quarter of the burst's tokens have arrived, the server is stopped as a pod
    is: SIGTERM, then SIGKILL of its whole process group (its engine and worker too)."""
    began = time.monotonic()
    quarter = asyncio.ensure_future(streamed.reached(args.burst * args.real_max_tokens // 4))
    await asyncio.wait({quarter, burst}, return_when=asyncio.FIRST_COMPLETED)
    if not quarter.done():
        quarter.cancel()
        raise RuntimeError(f"the burst ended with {streamed.words} tokens, before a quarter")
    at, words = time.monotonic() - began, streamed.words
    progress(f"stopping the vLLM on port {server.port} at {at:.1f} s")
    record = await asyncio.to_thread(stop_server, server, args.grace)
    return {"backend": f"{REAL_MODEL}-0", "at_s": at, "tokens_streamed_before": words, **record}


def stop_server(server: RealVllm, grace_s: float) -> dict[str, Any]:
    """serve.sh's server on its port (the pid it wrote), stopped as a pod is."""
    pid = int(Path(f"/tmp/spillgate-vllm-{server.port}.pid").read_text())
    return stop(pid, grace_s, group=True)


ROWS = (
    ("non-200 answers", Fault.NON_200),
    ("no answer (connection)", Fault.NO_ANSWER),
    ("SSE error events", Fault.ERROR_EVENT),
    ("cut streams", Fault.CUT),
    ("discontinuous text", Fault.DISCONTINUOUS),
    ("wrong length or finish", Fault.WRONG_LENGTH),
    ("dishonest usage", Fault.DISHONEST_USAGE),
)


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def report(figures: dict[str, Any]) -> str:
    lines = [f"Rolling restarts, {figures['arm']}: {figures['setup']}"]
    lines.append(f"{'requests sent':34}{figures['requests']:>8}")
    lines.append(f"{'ok':34}{figures['ok']:>8}")
    lines.append(f"{'failed (any of the below)':34}{figures['failed']:>8}")
    for label, fault in ROWS:
        count = figures["faults"][fault.value]
        statuses = ", ".join(f"{s}: {n}" for s, n in sorted(figures["statuses"].items()))
        extra = f"  ({statuses})" if fault is Fault.NON_200 and statuses else ""
        lines.append(f"{'  ' + label:34}{count:>8}{extra}")
    lines.append(
        f"{'latency p50 / p99 (s)':34}{_seconds(figures['latency_p50_s']):>8} / "
        f"{_seconds(figures['latency_p99_s'])}"
    )
    lines.append(
        f"{'TTFT p50 / p99 (s), streams':34}{_seconds(figures['ttft_p50_s']):>8} / "
        f"{_seconds(figures['ttft_p99_s'])}"
    )
    kinds = ", ".join(
        f"{kind} {c['requests']} ({c['failed']} failed)" for kind, c in figures["by_kind"].items()
    )
    lines.append(f"by kind: {kinds}")
    if "prompt_tokens_off" in figures:
        lines.append(f"prompt_tokens less vLLM's /tokenize count: {figures['prompt_tokens_off']}")
    for name, counts in figures["gateway"].items():
        told = ", ".join(f"{k}: {n}" for k, n in sorted(counts.items())) or "none"
        lines.append(f"gateway's {name.replace('_', ' ')}: {told}")
    for r in figures["restarts"]:
        line = (
            f"{r['backend']} stopped at {r['at_s']:.1f} s: gone {r['gone_after_s']:.2f} s "
            f"after SIGTERM (by {r['stopped_by']})"
        )
        if "ready_after_s" in r:
            line += f", ready again after {r['ready_after_s']:.1f} s"
        if r.get("in_rotation_after_s") is not None:
            line += f", back in the gateway's rotation after {r['in_rotation_after_s']:.1f} s"
        lines.append(line)
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="spillgate bench restart", description=__doc__)
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.add_argument("--real-vllm", action="store_true", help="two real vLLMs, not simulators")
    p.add_argument("--json", type=Path, help="write the figures here")
    p.add_argument("--logs", type=Path, help="keep the gateway's and backends' output here")
    p.add_argument(
        "--allow-failures", action="store_true", help="exit 0 even when clients saw failures"
    )
    p.add_argument("--grace", type=float, default=1.5, help="seconds from SIGTERM to SIGKILL")
    p.add_argument(
        "--continue-streams",
        type=int,
        help="the pool's continue_streams (default: the gateway's own; 0: off)",
    )
    p.add_argument("--kv-tokens", type=int, default=16_384, help="each backend's KV cache")
    p.add_argument("--max-model-len", type=int, default=4096)
    sim = p.add_argument_group("simulator arm")
    sim.add_argument("--clients", type=int, default=8)
    sim.add_argument("--duration", type=float, default=36.0, help="seconds of load")
    sim.add_argument("--warmup", type=float, default=6.0, help="seconds before the first stop")
    sim.add_argument("--interval", type=float, default=14.0, help="seconds between stops")
    sim.add_argument("--restarts", type=int, default=2, help="stops, the backends in turn")
    sim.add_argument("--max-tokens", type=int, default=120, help="every answer's length")
    sim.add_argument("--sim-speed", type=float, default=1.0)
    sim.add_argument(
        "--shutdown-timeout",
        type=float,
        default=0.0,
        help="the simulators' (vLLM's): 0 ends requests in flight at SIGTERM",
    )
    real = p.add_argument_group("real-vLLM arm")
    real.add_argument("--port", type=int, default=8101, help="the first vLLM's; the next, +1")
    real.add_argument("--burst", type=int, default=16)
    real.add_argument("--real-max-tokens", type=int, default=128)
    return p.parse_args(argv)


def setup(args: argparse.Namespace) -> str:
    stopping = f"SIGTERM, SIGKILL after {args.grace:g} s"
    if args.real_vllm:
        return (
            f"2 vLLMs, a burst of {args.burst} streams of {args.real_max_tokens} tokens, "
            f"the first vLLM stopped midway ({stopping})"
        )
    return (
        f"2 simulators, {args.clients} clients for {args.duration:g} s, answers of "
        f"{args.max_tokens} tokens, {args.restarts} restarts ({stopping}, "
        f"--shutdown-timeout {args.shutdown_timeout:g})"
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    with logs_dir(args.logs, prefix="bench-restart-") as logs:
        arm = real_arm if args.real_vllm else sim_arm
        figures = asyncio.run(arm(args, logs))
    figures = {
        "arm": "real-vllm" if args.real_vllm else "simulator",
        "setup": setup(args),
        "continue_streams": args.continue_streams,
        **figures,
        "elapsed_s": time.monotonic() - started,
        "load_average": os.getloadavg()[0],
    }
    print(report(figures))
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1) + "\n")
        progress(f"wrote {args.json.resolve()}")
    if figures["failed"] and not args.allow_failures:
        progress(f"FAILED: {figures['failed']} of {figures['requests']} clients saw a failure")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
