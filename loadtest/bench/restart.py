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
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from loadtest.bench import admission_fleet as fleet
from loadtest.bench.machine import backend_core, logs_dir, off_core, progress
from loadtest.bench.restart_answers import (
    KINDS,
    Ask,
    Seen,
    Tally,
    WordCount,
    ask,
    send,
)
from loadtest.bench.restart_fleet import (
    READY_TIMEOUT_S,
    REAL_MODEL,
    SIM_MODEL,
    SimBackend,
    back_in_rotation,
    gateway_config,
    gateway_counts,
    stop_server,
)
from loadtest.bench.restart_report import report, setup
from loadtest.real_vllm import RealVllm, install, running


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
