"""`spillgate bench preempt`: critical requests at a steady rate into a pool kept full of
sheddable streams with long answers, with preemption (`preempt: [sheddable]`, the default)
and without it (`preempt: []`), beside the same critical requests on the idle pool.

Two engines: simulators in real time (`spillgate sim`, `--sim-speed 1`), or two real vLLMs
of the CPU build (`--real-vllm`, one core each). The sheddable tenant keeps `--flood`
streams of `--stream-tokens` each outstanding, more than the pool holds, each sent again
as it ends; the critical tenant sends `--critical` short streams one every `--every`
seconds. With `--replicas 3` the gateways share one Redis: the critical requests go to the
first, the flood to the others.

Figures per arm: the critical requests' TTFT p50 and p90; the sheddable streams stopped
(`spillgate_preemptions_total` by result) and how they ended: whole (to `[DONE]`, one
`id`, `usage.completion_tokens` equal to the answer's length, which every answer runs to),
or with an error event; the sheddable goodput, completion tokens of whole streams per
second while the critical requests ran, against the arm without preemption.

Targets (issue 55): the critical TTFT p50 and p90 with preemption within 1.2 × their idle
values + 100 ms; every stopped stream whole.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson

from gateway.admission.fleet.metrics_text import samples, values
from gateway.config import hash_key
from loadtest.bench import admission_fleet
from loadtest.bench.adapters_fleet import start_all
from loadtest.bench.machine import logs_dir, print_targets, progress
from loadtest.percentile import percentile_or_nan
from loadtest.procs import RedisProcess, free_port
from loadtest.real_vllm import RealVllm, install, model_dir, running

MODEL = "tiny"  # the real vLLM's served name; the simulators take it too
KEYS = {"bulk": "sk-bench-preempt-bulk", "vip": "sk-bench-preempt-vip"}
PRIORITY = {"bulk": "sheddable", "vip": "critical"}
ARMS = ("idle", "preempt", "off")
BLOCK = 16
SLACK = 32  # what a stream's prompt may take beyond its answer, in the pool's sizing
# a critical answer: with its prompt, more than the pool's sizing leaves beside the streams
CRITICAL_TOKENS = 64


@dataclass
class Answer:
    """One stream as its client read it."""

    tenant: str
    status: int = 0
    ttft_s: float = float("nan")
    ids: set[str] = field(default_factory=set)
    completion_tokens: int | None = None
    error: str | None = None  # the error event's code
    done: bool = False
    preempted: bool = False  # stopped: the gateway's comment said it paused, or its header
    queue_s: float = 0.0  # its wait in the queue, as `server-timing` tells it

    def whole(self, tokens: int) -> bool:
        return (
            self.status == 200
            and self.done
            and self.error is None
            and len(self.ids) == 1
            and self.completion_tokens == tokens
        )


async def send(
    client: httpx.AsyncClient, url: str, tenant: str, max_tokens: int, extra: dict[str, Any]
) -> Answer:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"{tenant}: tell me a long story"}],
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        **extra,
    }
    answer = Answer(tenant)
    started = time.monotonic()
    headers = {"authorization": f"Bearer {KEYS[tenant]}"}
    async with client.stream(
        "POST", f"{url}/v1/chat/completions", json=body, headers=headers
    ) as response:
        answer.status = response.status_code
        answer.preempted = "x-spillgate-preempted" in response.headers
        for phase in response.headers.get("server-timing", "").split(","):
            name, _, duration = phase.strip().partition(";dur=")
            if name == "queue":
                answer.queue_s = float(duration) / 1000
        async for line in response.aiter_lines():
            if answer.ttft_s != answer.ttft_s and line.startswith("data:"):
                answer.ttft_s = time.monotonic() - started
            if line.startswith(": spillgate preempted"):
                answer.preempted = True
            elif line == "data: [DONE]":
                answer.done = True
            elif line.startswith("data: "):
                event = orjson.loads(line[6:])
                if "error" in event:
                    answer.error = str(event["error"].get("code"))
                    continue
                answer.ids.add(event.get("id", ""))
                if event.get("usage"):
                    answer.completion_tokens = event["usage"].get("completion_tokens")
    return answer


@dataclass(frozen=True)
class Engines:
    urls: list[str]
    extra: dict[str, Any]  # added to every request's body


@contextlib.contextmanager
def engines(args: argparse.Namespace, workdir: Path) -> Iterator[Engines]:
    # every answer runs to its max_tokens: random weights, and the simulator, both honour it
    extra = {"ignore_eos": True}
    if args.real_vllm:
        install()
        model_dir()  # made once here, not by both servers' scripts at once
        servers = [
            RealVllm(port=port, kv_tokens=args.kv_tokens, cores=str(i))
            for i, port in enumerate(args.ports)
        ]
        with start_all([running(server) for server in servers]) as urls:
            yield Engines(urls, extra)
        return
    with contextlib.ExitStack() as stack:
        urls = []
        for i in range(2):
            port = free_port()
            cmd = [
                sys.executable, "-m", "gateway.cli", "sim", "--port", str(port),
                "--model", MODEL, "--kv-tokens", str(args.kv_tokens), "--max-model-len",
                "8192", "--speed", str(args.sim_speed), "--answer-lengths", "max_tokens",
            ]  # fmt: skip
            log = workdir / f"engine-{i}.log"
            urls.append(stack.enter_context(admission_fleet.process(cmd, port, log=log)))
        yield Engines(urls, extra)


def config(args: argparse.Namespace, urls: list[str], *, preempt: bool) -> dict[str, Any]:
    held = -(-(args.stream_tokens + SLACK) // BLOCK) * BLOCK
    pool = {
        "name": MODEL,
        "backends": [
            {"url": url, "served_model": MODEL, "capacity": args.slots * held} for url in urls
        ],
        "target_fill": 1.0,
        "overflow": ["queue", "reject"],
        "queue": {"max_wait_s": args.max_wait},
        # a stream holds its whole answer from admission on: the pool's fill is exact
        "reservation": {"mode": "max_tokens"},
        "timeouts": admission_fleet.TIMEOUTS,
        "preempt": ["sheddable"] if preempt else [],
    }
    tenants = [
        {
            "name": name,
            "key_sha256": hash_key(key),
            "priority": PRIORITY[name],
            "requests_per_minute": 10**9,
            "tokens_per_minute": 10**12,
        }
        for name, key in KEYS.items()
    ]
    shared: dict[str, Any] = {}
    if args.replicas > 1:
        shared = {"redis": {"timeout_ms": 250}, "ledger": {"refresh_s": 0.1}}
    return {"tenants": tenants, "pools": [pool], **shared}


@contextlib.contextmanager
def gateways(
    args: argparse.Namespace, cfg: dict[str, Any], workdir: Path, arm: str
) -> Iterator[list[str]]:
    if args.replicas == 1:
        with admission_fleet.gateway(cfg, workdir=workdir, arm=arm) as url:
            yield [url]
        return
    with (
        RedisProcess() as redis_proc,
        admission_fleet.replicas(
            cfg, workdir=workdir, arm=arm, count=args.replicas, redis_url=redis_proc.url
        ) as urls,
    ):
        yield urls


def metric(url: str, name: str, **labels: str) -> float:
    return sum(values(samples(httpx.get(f"{url}/metrics", timeout=10).text), name, **labels))


async def run_arm(
    args: argparse.Namespace, found: Engines, workdir: Path, arm: str
) -> dict[str, Any]:
    cfg = config(args, found.urls, preempt=arm == "preempt")
    with gateways(args, cfg, workdir, arm) as urls:
        critical_url, flood_urls = urls[0], urls[1:] or urls
        limits = httpx.Limits(max_connections=400, max_keepalive_connections=400)
        async with httpx.AsyncClient(timeout=600, limits=limits) as client:
            flood: list[Answer] = []
            stop = asyncio.Event()

            async def keep_one(i: int) -> None:
                url = flood_urls[i % len(flood_urls)]
                while not stop.is_set():
                    flood.append(await send(client, url, "bulk", args.stream_tokens, found.extra))

            tasks = []
            flood_began = time.monotonic()
            if arm != "idle":
                tasks = [asyncio.create_task(keep_one(i)) for i in range(args.flood)]
                await asyncio.sleep(args.fill_s)  # the pool fills, the rest of the flood queues
            began = time.monotonic()
            critical = []
            for i in range(args.critical):
                critical.append(
                    await send(client, critical_url, "vip", CRITICAL_TOKENS, found.extra)
                )
                await asyncio.sleep(max(0.0, began + (i + 1) * args.every - time.monotonic()))
            stop.set()
            await asyncio.gather(*tasks)
            flood_s = time.monotonic() - flood_began
        preempted = {
            result: sum(metric(url, "spillgate_preemptions_total", result=result) for url in urls)
            for result in ("requeued", "continued", "passed_on", "ended")
        }
    ttfts = [a.ttft_s for a in critical if a.status == 200]
    whole = [a for a in flood if a.whole(args.stream_tokens)]
    stopped = [a for a in flood if a.preempted or a.error == "preempted"]
    return {
        "critical_sent": len(critical),
        "critical_failed": sum(a.status != 200 or not a.done for a in critical),
        "critical_ttft_p50_ms": 1000 * percentile_or_nan(ttfts, 50),
        "critical_ttft_p90_ms": 1000 * percentile_or_nan(ttfts, 90),
        "critical_ttft_ms": [round(1000 * t) for t in ttfts],  # in the order sent
        # of which in the gateway's queue: the rest is the engine's
        "critical_queue_ms": [round(1000 * a.queue_s) for a in critical if a.status == 200],
        "sheddable_streams": len(flood),
        "sheddable_whole": len(whole),
        "sheddable_stopped": len(stopped),
        "sheddable_stopped_whole": sum(a.whole(args.stream_tokens) for a in stopped),
        "sheddable_errors": sorted({a.error for a in flood if a.error is not None}),
        # the completion tokens of whole streams over the flood's whole run
        "sheddable_goodput_tok_s": len(whole) * args.stream_tokens / flood_s,
        "preemptions": preempted,
    }


async def run_bench(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    figures: dict[str, Any] = {}
    with engines(args, workdir) as found:
        for arm in args.arms:
            progress(f"arm {arm}, {args.replicas} replica(s)")
            figures[arm] = await run_arm(args, found, workdir, arm)
    return figures


def targets(figures: dict[str, Any]) -> list[tuple[bool, str]]:
    checks: list[tuple[bool, str]] = []
    if "idle" in figures and "preempt" in figures:
        idle, on = figures["idle"], figures["preempt"]
        for q in ("p50", "p90"):
            got, base = on[f"critical_ttft_{q}_ms"], idle[f"critical_ttft_{q}_ms"]
            checks.append(
                (
                    got <= 1.2 * base + 100,
                    f"critical TTFT {q} {got:.0f} ms ≤ 1.2 × {base:.0f} (idle) + 100",
                )
            )
    if "preempt" in figures:
        on = figures["preempt"]
        checks.append(
            (
                on["sheddable_stopped"] > 0
                and on["sheddable_stopped_whole"] == on["sheddable_stopped"],
                f"stopped sheddable streams whole: {on['sheddable_stopped_whole']} of "
                f"{on['sheddable_stopped']}",
            )
        )
        checks.append((on["critical_failed"] == 0, f"critical failed: {on['critical_failed']}"))
    return checks


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="spillgate bench preempt", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
    p.add_argument("--real-vllm", action="store_true", help="two real vLLMs, one core each")
    p.add_argument("--ports", type=int, nargs=2, default=[8101, 8102], help="the real vLLMs'")
    p.add_argument("--replicas", type=int, default=1, help="gateways on one Redis (1 or 3)")
    p.add_argument("--kv-tokens", type=int, default=16_384, help="each engine's KV cache")
    p.add_argument("--sim-speed", type=float, default=1.0, help="1: real time")
    p.add_argument("--slots", type=int, default=4, help="sheddable streams an engine holds")
    p.add_argument("--flood", type=int, default=10, help="sheddable streams kept outstanding")
    p.add_argument("--stream-tokens", type=int, default=1000, help="a sheddable answer's length")
    p.add_argument("--critical", type=int, default=20, help="critical requests sent")
    p.add_argument("--every", type=float, default=0.5, help="seconds between critical requests")
    p.add_argument("--fill-s", type=float, default=2.0, help="the flood's head start")
    p.add_argument("--max-wait", type=float, default=120.0, help="the queue's max_wait_s")
    p.add_argument("--json", action="store_true", help="the figures as JSON")
    p.add_argument("--logs", type=Path, help="keep the processes' output here")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    with logs_dir(args.logs, prefix="spillgate-bench-preempt-") as workdir:
        figures = asyncio.run(run_bench(args, workdir))
    checks = targets(figures)
    if args.json:
        print(json.dumps({"figures": figures, "targets": checks}, indent=2))
    else:
        for arm, data in figures.items():
            print(arm, json.dumps(data))
        return print_targets(checks)
    return 0 if all(ok for ok, _ in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
