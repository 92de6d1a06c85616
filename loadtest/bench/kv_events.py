"""Prefix routing where the gateway's own index goes wrong: caches that evict, and traffic it
never sees. `spillgate bench kv-events`:

    spillgate bench kv-events                       # 8 simulated vLLMs (minutes)
    spillgate bench kv-events --real-vllm --backends 2 --block-size 128 --tenants 40 \\
        --requests 400 --concurrency 4               # two real vLLMs, one core each

The workload (loadtest/bench/kv_events_plan.py): tenants of Zipf weights, each with a long
system prompt, their prompts together 2-3 times the pool's KV cache; each request one
tenant's prompt and a short new message, sent `--concurrency` at a time; `--direct` of them
straight to the tenant's own backend, past the gateway. Every engine publishes its KV events
(the simulator as vLLM 0.32 does; a real vLLM with `--kv-events-config`) and tokenizes with
the same tokenizer the gateway loads. Arms, each on the same requests, on fresh simulators
(a real vLLM's prefix cache reset instead):

- `least_filled`: a gateway with `routing: least_filled`;
- `prefix`: `routing: prefix`, the gateway's index of where it routed;
- `events`: `routing: prefix` with each backend's `kv_events` and the pool's `tokenizer`:
  scored by the blocks each engine reports holding;
- `sticky`: straight to one backend per tenant (a hash of its name);
- `oracle-static`: straight to the best static placement computed beforehand (greedy by
  weight, scored by replaying the workload through LRU caches; `static expected` is that
  replay's hit rate).

Figures per arm: the engines' own prefix-cache hit rate (`vllm:prefix_cache_hits_total` ÷
`queries_total`, in tokens, every request counted, direct ones too) and client-side TTFT
p50/p90 of all requests. Results in BENCHMARKS.md ("Prefix routing by KV events").
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import socket
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from loadtest import real_vllm
from loadtest.bench import admission_fleet as fleet
from loadtest.bench import prefix
from loadtest.bench.kv_events_plan import Plan, Request, best_static, direct_home, sticky_home
from loadtest.bench.kv_events_plan import workload as make_workload
from loadtest.bench.prefix import gateway_config, prefix_counts
from loadtest.bench.prefix_workload import Turn
from loadtest.loadgen.text import table
from loadtest.procs import free_port

ARMS = ("least_filled", "prefix", "events", "sticky", "oracle-static")
REAL_PORT = 8111  # the first real vLLM's; its events on REAL_EVENTS_PORT + 2 i and the next
REAL_EVENTS_PORT = 5611


@dataclass(frozen=True, kw_only=True)
class Engine:
    url: str
    events: int  # its PUB port; the replay ROUTER on the next


def two_free_ports() -> int:
    """A free port whose next is free too."""
    while True:
        port = free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port


@contextlib.contextmanager
def simulators(plan: Plan, tokenizer: Path, workdir: Path) -> Iterator[list[Engine]]:
    """Fresh simulated vLLMs publishing their KV events, tokenizing with `tokenizer`."""
    with contextlib.ExitStack() as stack:
        engines = []
        for i in range(plan.backends):
            port, events = free_port(), two_free_ports()
            cmd = [sys.executable, "-m", "gateway.cli", "sim", "--port", str(port),
                   "--model", "sim", "--kv-tokens", str(plan.kv_tokens),
                   "--block-size", str(plan.block_size), "--max-model-len", "8192",
                   "--speed", str(plan.speed), "--kv-events-port", str(events),
                   "--tokenizer", str(tokenizer)]  # fmt: skip
            url = stack.enter_context(fleet.process(cmd, port, log=workdir / f"sim-{i}.log"))
            engines.append(Engine(url=url, events=events))
        yield engines


@contextlib.contextmanager
def real_servers(plan: Plan) -> Iterator[list[Engine]]:
    """Real vLLMs publishing their KV events, one a core, started by serve.sh (stopped after
    only when started here)."""
    real_vllm.install()
    serve = ["bash", str(real_vllm.SCRIPTS / "serve.sh")]
    started: list[tuple[int, dict[str, str]]] = []
    try:
        engines = []
        for i in range(plan.backends):
            port, events = REAL_PORT + i, REAL_EVENTS_PORT + 2 * i
            server = real_vllm.RealVllm(port=port, kv_tokens=plan.kv_tokens, cores=str(i))
            env = {**server.env(), "MAX_NUM_BATCHED_TOKENS": "16384"}
            if not real_vllm.is_up(server):
                config = {"enable_kv_cache_events": True, "publisher": "zmq",
                          "endpoint": f"tcp://*:{events}",
                          "replay_endpoint": f"tcp://*:{events + 1}"}  # fmt: skip
                subprocess.run(["taskset", "-c", str(i), *serve, str(port),
                                "--kv-events-config", json.dumps(config)],
                               check=True, stdout=subprocess.DEVNULL, env=env,
                               timeout=real_vllm.START_TIMEOUT_S)  # fmt: skip
                started.append((port, env))
            engines.append(Engine(url=server.url, events=events))
        yield engines
    finally:
        for port, env in started:
            subprocess.run([*serve, "stop", str(port)], timeout=60, env=env)


def arm_config(arm: str, engines: Sequence[Engine], model: str, tokenizer: Path) -> dict[str, Any]:
    routing = "least_filled" if arm == "least_filled" else "prefix"
    config = gateway_config([e.url for e in engines], model, routing)
    if arm == "events":
        pool = config["pools"][0]
        pool["tokenizer"] = str(tokenizer)
        for entry, engine in zip(pool["backends"], engines, strict=True):
            entry["kv_events"] = {"endpoint": f"tcp://127.0.0.1:{engine.events}",
                                  "replay": f"tcp://127.0.0.1:{engine.events + 1}"}  # fmt: skip
    return config


async def run_arm(
    arm: str,
    engines: Sequence[Engine],
    model: str,
    gateway: str | None,
    requests: Sequence[Request],
    plan: Plan,
    place: Sequence[int],
) -> dict[str, Any]:
    urls = [e.url for e in engines]
    async with httpx.AsyncClient(timeout=300.0, limits=prefix.client_limits(256)) as client:
        before = await prefix_counts(client, urls)
        gate = asyncio.Semaphore(plan.concurrency)

        async def one(i: int, request: Request) -> dict[str, Any]:
            t = request.tenant
            if request.direct:
                url = urls[direct_home(t, plan.backends)]
            elif arm == "sticky":
                url = urls[sticky_home(t, plan.backends)]
            else:
                url = urls[place[t]]
            # through prefix.py's client: a gateway arm's, or one backend's
            to = prefix.Arm(arm, [url], model, None if request.direct else gateway)
            turn = Turn(at_s=0.0, tenant=t, chat=f"{t}-{i}", messages=request.messages)
            async with gate:
                return await prefix.send(client, to, turn, i, plan)  # type: ignore[arg-type]

        results = await asyncio.gather(*(one(i, r) for i, r in enumerate(requests)))
        after = await prefix_counts(client, urls)
    return prefix.arm_figures(results, before=before, after=after)


def measure(
    plan: Plan,
    workdir: Path,
    tokenizer: Path,
    *,
    real: bool,
    arms: Sequence[str] = ARMS,
    rounds: int = 1,
) -> dict[str, Any]:
    """Every arm on the same requests, in turn, `rounds` times; per arm the median of each
    figure over the rounds (this machine's TTFT drifts more from run to run than between
    arms), and every round's figures."""
    from gateway.admission.prompt_tokens import PromptTokenizer

    prompts = PromptTokenizer(tokenizer)
    requests = make_workload(plan, prompts)
    place, expected = best_static(plan, requests, prompts)
    runs: dict[str, list[dict[str, Any]]] = {arm: [] for arm in arms}
    model = real_vllm.MODEL if real else "sim"
    with contextlib.ExitStack() as shared_stack:
        shared = shared_stack.enter_context(real_servers(plan)) if real else None
        for r, arm in ((r, arm) for r in range(rounds) for arm in arms):
            print(f"round {r + 1}, {arm}: {len(requests)} requests", file=sys.stderr, flush=True)
            with contextlib.ExitStack() as stack:
                if shared is None:
                    where = workdir / f"{arm}-{r}"
                    where.mkdir(parents=True)
                    engines = stack.enter_context(simulators(plan, tokenizer, where))
                else:
                    engines = shared
                    for engine in engines:
                        if not real_vllm.reset_prefix_cache(engine.url):
                            raise RuntimeError(f"{engine.url} refused to reset its prefix cache")
                gateway = None
                if arm in ("least_filled", "prefix", "events"):
                    config = arm_config(arm, engines, model, tokenizer)
                    gateway = stack.enter_context(fleet.gateway(config, workdir=workdir, arm=arm))
                figures = asyncio.run(run_arm(arm, engines, model, gateway, requests, plan, place))
                runs[arm].append(figures)
    return {"plan": asdict(plan), "backend": "real-vllm" if real else "simulator",
            "static_expected_hit_rate": expected, "rounds": runs,
            "arms": {arm: _medians(each) for arm, each in runs.items()}}  # fmt: skip


def _medians(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out = dict(runs[0], ok=min(r["ok"] for r in runs))
    for key in ("hit_rate", "ttft_p50_s", "ttft_p90_s", "engine_ttft_mean_s"):
        values = [r[key] for r in runs if r.get(key) is not None]
        out[key] = statistics.median(values) if values else None
    return out


def _cell(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def report(figures: dict[str, Any]) -> str:
    rows = [["arm", "ok", "hit rate", "TTFT p50 (s)", "TTFT p90 (s)", "engine TTFT mean (s)"]]
    for name, arm in figures["arms"].items():
        rows.append([name, f"{arm['ok']}/{arm['requests']}", _cell(arm["hit_rate"], ".3f"),
                     _cell(arm["ttft_p50_s"], ".3f"), _cell(arm["ttft_p90_s"], ".3f"),
                     _cell(arm.get("engine_ttft_mean_s"), ".3f")])  # fmt: skip
    rows.append(["static expected", "", f"{figures['static_expected_hit_rate']:.3f}", "", "", ""])
    lines = [
        f"{figures['backend']} (medians of {len(next(iter(figures['rounds'].values())))} rounds):",
        table(rows, ["<", ">", ">", ">", ">", ">"]),
        "",
    ]
    for name, runs in figures["rounds"].items():
        each = ", ".join(f"{_cell(r['hit_rate'], '.3f')} / {_cell(r['ttft_p90_s'], '.3f')}"
                         for r in runs)  # fmt: skip
        lines.append(f"  {name} hit rate / TTFT p90 (s) by round: {each}")
        for r, run in enumerate(runs):
            for error, count in run.get("failures", {}).items():
                lines.append(f"  {name} round {r + 1}: {count} x {error}")
    lines.append("")
    arms = figures["arms"]
    if not {"events", "prefix", "oracle-static"} <= set(arms):
        return "\n".join(lines)
    events, prefix = arms["events"], arms["prefix"]
    best = max(figures["static_expected_hit_rate"], arms["oracle-static"]["hit_rate"] or 0.0)
    checks = [
        ("events hit rate > prefix's", (events["hit_rate"] or 0) > (prefix["hit_rate"] or 0)),
        ("events TTFT p90 < prefix's",
         (events["ttft_p90_s"] or 1e9) < (prefix["ttft_p90_s"] or 1e9)),
        ("events hit rate within 0.03 of the best static placement",
         (events["hit_rate"] or 0) >= best - 0.03),
    ]  # fmt: skip
    lines += [f"{'met' if ok else 'NOT met':>8}  {what}" for what, ok in checks]
    return "\n".join(lines)


def tokenizer_dir(real: bool, workdir: Path) -> Path:
    if real:
        return real_vllm.model_dir()
    from loadtest.sim.tokenizer_files import write

    return write(workdir / "tokenizer")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="spillgate bench kv-events", description=__doc__)
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    defaults = Plan()
    for key, value in asdict(defaults).items():
        p.add_argument(f"--{key.replace('_', '-')}", type=type(value), default=value)
    p.add_argument("--real-vllm", action="store_true", help="real vLLM servers, one a core")
    p.add_argument("--arms", default=",".join(ARMS), help="which arms, comma-separated")
    p.add_argument("--rounds", type=int, default=1, help="every arm this many times, in turn")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    plan = Plan(**{k: getattr(args, k) for k in asdict(defaults)})
    with tempfile.TemporaryDirectory(prefix="bench-kv-events-") as workdir:
        tokenizer = tokenizer_dir(args.real_vllm, Path(workdir))
        arms = [a for a in args.arms.split(",") if a in ARMS]
        figures = measure(plan, Path(workdir), tokenizer, real=args.real_vllm, arms=arms,
                          rounds=args.rounds)  # fmt: skip
    print(report(figures))
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
