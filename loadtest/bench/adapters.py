"""`spillgate bench adapters`: LoRA adapter routing (docs/adapters.md) against round-robin,
on the same two engines, each with `--max-loras` adapter slots.

The same seeded burst in each arm: `--requests` streamed completions, each naming one of
four adapters (as many of each, in a shuffled order), arriving `--rate` a second. Arms:
`gateway`, a `spillgate serve` with one pool over both engines that declares the adapters;
`round-robin`, the client itself alternating the two engines' URLs, as a plain load
balancer does. Each round runs both arms, in turn first; between arms the engines' prefix
caches are emptied. Scenarios (`--scenarios`, adapters_fleet.py): `shared`, both engines
serving all four adapters, so round-robin sends each engine all four for its two slots;
`split`, each engine serving others and one adapter served nowhere, which the pool declares
with a path for the gateway to load.

Reported per arm (medians over the rounds): answers ok, 404s, other errors, answers naming
another adapter than asked; TTFT p50, p90 and mean at the client, and the mean the engines
measure themselves (`vllm:time_to_first_token_seconds`; the difference is what the gateway
adds); each engine's `vllm:num_requests_waiting` at its peak and summed over time
(request-seconds waiting, polled every 0.1 s); on a real vLLM, the requests that waited
over 0.3 s in an engine's queue (`vllm:request_queue_time_seconds`) and the 4xx answers the
engines gave; and the loads the gateway counted (`spillgate_adapter_loads_total`). With the
KV cache far from full and `max_num_seqs` far away, a request waits inside an engine for an
adapter slot, or for the next step.

Placement (`--engine-cores`): by default each real vLLM's worker is bound to a core of its
own and the gateway and the client share the machine with them. `--engine-cores 0` puts
both engines on core 0 (`taskset -c 0`, their workers bound there) and the gateway and
this client on the cores left, as on a GPU host, where the gateway has CPU cores apart
from what drives the GPUs; both arms run so. The report prints the placement and the cores
each process had while the arms ran (`cores_seen` in the JSON).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import os
import random
import shutil
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson
from prometheus_client.parser import text_string_to_metric_families

from loadtest.bench import admission_fleet
from loadtest.bench.adapters_fleet import (
    ADAPTERS,
    KEY,
    MODEL,
    SCENARIOS,
    Fleet,
    Scenario,
    fleet,
    gateway_config,
    reset,
)
from loadtest.bench.engine_metrics import Counts, port_pair
from loadtest.bench.engine_metrics import samples as engine_samples
from loadtest.bench.machine import (
    cores_seen,
    cores_text,
    logs_dir,
    parse_cores,
    pinned,
    print_checked,
    progress,
)
from loadtest.percentile import percentile_or_nan as percentile

ARMS = ("gateway", "round-robin")
POLL_S = 0.1
QUEUED_S = "0.3"  # the first bucket of vLLM's request_queue_time_seconds
WORDS = ("adapter", "slot", "engine", "burst", "route", "token", "prompt", "answer", "rank")


@dataclass(frozen=True, kw_only=True)
class Planned:
    at_s: float
    adapter: str
    prompt: str


@dataclass(frozen=True, kw_only=True)
class Answer:
    adapter: str
    status: int
    ttft_s: float | None = None
    served: str | None = None  # the answer's `model`: the adapter that served it


def plan(*, requests: int, rate: float, prompt_words: int, seed: int) -> list[Planned]:
    """As many requests for each adapter, shuffled; evenly spaced at `rate` (0: at once)."""
    rng = random.Random(seed)
    adapters = [ADAPTERS[i % len(ADAPTERS)] for i in range(requests)]
    rng.shuffle(adapters)
    return [
        Planned(
            at_s=i / rate if rate > 0 else 0.0,
            adapter=adapter,
            prompt=f"request {i}: " + " ".join(rng.choices(WORDS, k=prompt_words)),
        )
        for i, adapter in enumerate(adapters)
    ]


async def ask(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> Answer:
    """One streamed completion: its status, time to the first event, the adapter named."""
    began = time.perf_counter()
    ttft, served = None, None
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                await response.aread()
                return Answer(adapter=body["model"], status=response.status_code)
            async for line in response.aiter_lines():
                if ttft is None and line.startswith("data: {"):
                    ttft = time.perf_counter() - began
                    served = orjson.loads(line[6:]).get("model")
    except httpx.HTTPError:  # no answer, or a stream broken off: an error, not a crash
        return Answer(adapter=body["model"], status=0, ttft_s=ttft, served=served)
    return Answer(adapter=body["model"], status=200, ttft_s=ttft, served=served)


def samples(text: str) -> Counts:
    """A metrics page's samples by name and the label that tells them apart here (`le`,
    `result` or `status`), of the completions route alone."""
    return engine_samples(text, by=("le", "result", "status"), handler="/v1/completions")


class Watch:
    """Each engine's requests waiting, polled: the peak and the sum over time."""

    def __init__(self, client: httpx.AsyncClient, urls: Sequence[str]) -> None:
        self._client, self._urls = client, urls
        self.peak = [0.0] * len(urls)
        self.waiting_s = [0.0] * len(urls)

    async def run(self) -> None:
        last = time.perf_counter()
        while True:
            pages = await asyncio.gather(
                *(self._client.get(f"{url}/metrics") for url in self._urls), return_exceptions=True
            )
            now = time.perf_counter()
            for i, page in enumerate(pages):
                if isinstance(page, httpx.Response):
                    waiting = samples(page.text).get(("vllm:num_requests_waiting", ""), 0.0)
                    self.peak[i] = max(self.peak[i], waiting)
                    self.waiting_s[i] += waiting * (now - last)
            last = now
            await asyncio.sleep(POLL_S)


# a request run to its end: vLLM's counter, the simulator's
FINISHED = (("vllm:request_success_total", ""), ("sim_requests_finished_total", ""))


async def _counters(client: httpx.AsyncClient, urls: Sequence[str]) -> list[Counts]:
    return [samples((await client.get(f"{url}/metrics")).text) for url in urls]


def _finished(before: Counts, after: Counts) -> float | None:
    key = next((key for key in FINISHED if key in after), None)
    return None if key is None else after[key] - before.get(key, 0.0)


def _engine_figures(engines_before: list[Counts], engines_after: list[Counts]) -> dict[str, Any]:
    """What the engines count themselves: None where they do not (the simulator times no
    request's queueing and counts no answers by status)."""

    served = [_finished(b, a) for b, a in zip(engines_before, engines_after, strict=True)]
    before, after = _total(engines_before), _total(engines_after)

    def delta(key: tuple[str, str]) -> float | None:
        return after[key] - before.get(key, 0.0) if key in after else None

    ttft_s, ttft_n = (
        delta((f"vllm:time_to_first_token_seconds_{k}", "")) for k in ("sum", "count")
    )
    queued = delta(("vllm:request_queue_time_seconds_count", ""))
    quick = delta(("vllm:request_queue_time_seconds_bucket", QUEUED_S))
    # vLLM counts answers by status class, a class only once it has answered one
    counted = any(name == "http_requests_total" for name, _ in after)
    refused = ("http_requests_total", "4xx")
    return {
        "served": served,
        "engine_ttft_mean_s": ttft_s / ttft_n if ttft_s is not None and ttft_n else None,
        "queued_over_0_3_s": None if queued is None or quick is None else queued - quick,
        "engine_4xx": after.get(refused, 0.0) - before.get(refused, 0.0) if counted else None,
    }


def _total(engines: list[Counts]) -> Counts:
    total: Counts = {}
    for counts in engines:
        for key, value in counts.items():
            total[key] = total.get(key, 0.0) + value
    return total


async def run_arm(
    arm: str, *, fleet_: Fleet, gateway_url: str | None, planned: list[Planned], max_tokens: int
) -> dict[str, Any]:
    engines = [e.url for e in fleet_.engines]
    headers = {"authorization": f"Bearer {KEY}"}
    async with httpx.AsyncClient(timeout=600, headers=headers) as client:
        before = await _counters(client, engines)
        watch = Watch(client, engines)
        watching = asyncio.create_task(watch.run())
        began = time.perf_counter()

        async def send(i: int, request: Planned) -> Answer:
            await asyncio.sleep(max(0.0, began + request.at_s - time.perf_counter()))
            url = gateway_url if gateway_url is not None else engines[i % len(engines)]
            body = {
                "model": request.adapter,
                "prompt": request.prompt,
                "stream": True,
                "max_tokens": max_tokens,
                **fleet_.extra,
            }
            return await ask(client, url, body)

        answers = await asyncio.gather(*(send(i, r) for i, r in enumerate(planned)))
        watching.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watching
        after = await _counters(client, engines)
        loads = await _loads(client, gateway_url) if gateway_url is not None else {}
    return _figures(arm, answers, watch, loads, _engine_figures(before, after))


async def _loads(client: httpx.AsyncClient, gateway_url: str) -> dict[str, float]:
    """The gateway's adapter loads, by result and backend (`loaded on tiny-1`)."""
    page = (await client.get(f"{gateway_url}/metrics")).text
    return {
        f"{s.labels['result']} on {s.labels['backend']}": s.value
        for family in text_string_to_metric_families(page)
        for s in family.samples
        if s.name == "spillgate_adapter_loads_total"
    }


def _figures(
    arm: str,
    answers: list[Answer],
    watch: Watch,
    loads: dict[str, float],
    engine: dict[str, float | None],
) -> dict[str, Any]:
    ttfts = [a.ttft_s for a in answers if a.ttft_s is not None]
    ok = [a for a in answers if a.status == 200]
    return {
        "arm": arm,
        "requests": len(answers),
        "ok": len(ok),
        "not_found": sum(a.status == 404 for a in answers),
        "errors": sum(a.status not in (200, 404) for a in answers),
        # each error's status, and the adapter it asked for (status 0: no answer)
        "error_statuses": dict(
            collections.Counter(
                f"{a.status} {a.adapter}" for a in answers if a.status not in (200, 404)
            )
        ),
        "wrong_adapter": sum(a.served != a.adapter for a in ok),
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p90_s": percentile(ttfts, 90),
        "ttft_mean_s": statistics.fmean(ttfts) if ttfts else None,
        "peak_waiting": watch.peak,
        "waiting_s": [round(w, 2) for w in watch.waiting_s],
        **engine,
        "loads": loads,
    }


def run_scenario(
    scenario: Scenario, args: argparse.Namespace, planned: list[Planned], workdir: Path
) -> list[dict[str, Any]]:
    """Every round of both arms on one pair of engines."""
    rounds: list[dict[str, Any]] = []
    engines = fleet(
        scenario,
        real_vllm=args.real_vllm,
        ports=args.ports,
        max_loras=args.max_loras,
        kv_tokens=args.kv_tokens,
        sim_speed=args.sim_speed,
        workdir=workdir,
        engine_cores=args.placement["engines"] if args.engine_cores is not None else None,
    )
    with engines as found:
        _warm_up(found, args.max_tokens)
        for n in range(args.rounds):
            arms = ARMS if n % 2 == 0 else ARMS[::-1]
            for arm in arms:
                reset(found, scenario)
                result = _one_arm(
                    arm,
                    found=found,
                    scenario=scenario,
                    args=args,
                    planned=planned,
                    workdir=workdir,
                    round_=n,
                )
                rounds.append({"scenario": scenario.name, "round": n, **result})
                progress(json.dumps(rounds[-1]))
    return rounds


def _one_arm(
    arm: str,
    *,
    found: Fleet,
    scenario: Scenario,
    args: argparse.Namespace,
    planned: list[Planned],
    workdir: Path,
    round_: int,
) -> dict[str, Any]:
    def measure(url: str | None, gateway_command: str | None = None) -> dict[str, Any]:
        # where each process may run, as the kernel has it while the arm runs
        seen = {e.name: cores_seen(*e.command) for e in found.engines}
        if gateway_command is not None:
            seen["gateway"] = cores_seen(gateway_command)
        seen["client"] = cores_text(os.sched_getaffinity(0))
        figures = asyncio.run(
            run_arm(arm, fleet_=found, gateway_url=url, planned=planned, max_tokens=args.max_tokens)
        )
        return {**figures, "cores_seen": seen}

    if arm == "round-robin":
        return measure(None)
    config = gateway_config(found, scenario, refresh_s=args.refresh)
    name = f"{scenario.name}-{round_}"
    cores = args.placement["gateway"] if args.engine_cores is not None else None
    with admission_fleet.gateway(config, workdir=workdir, arm=name, cores=cores) as url:
        return measure(url, f"{workdir / f'gateway-{name}.yaml'} ")


def _warm_up(found: Fleet, max_tokens: int) -> None:
    """One request for each adapter each engine serves: first uses out of the arms."""
    with httpx.Client(timeout=300) as client:
        for engine in found.engines:
            for adapter in (MODEL, *engine.adapters):
                body = {
                    "model": adapter,
                    "prompt": "warm up",
                    "max_tokens": max_tokens,
                    **found.extra,
                }
                client.post(f"{engine.url}/v1/completions", json=body).raise_for_status()


def summary(rounds: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each scenario's arms: the medians over the rounds (lists, element by element)."""
    out: dict[str, dict[str, Any]] = {}
    for r in rounds:
        out.setdefault(r["scenario"], {}).setdefault(r["arm"], []).append(r)
    return {
        scenario: {arm: _median(runs) for arm, runs in arms.items()}
        for scenario, arms in out.items()
    }


def _median(runs: list[dict[str, Any]]) -> dict[str, Any]:
    first = runs[0]
    merged: dict[str, Any] = {"rounds": len(runs)}
    for key, value in first.items():
        if key in ("scenario", "round", "arm", "cores_seen"):
            continue
        values = [r[key] for r in runs]
        if isinstance(value, list):
            merged[key] = [
                None if None in v else statistics.median(v) for v in zip(*values, strict=True)
            ]
        elif isinstance(value, dict):  # each key's value in every round
            keys = sorted({k for r in runs for k in r[key]})
            merged[key] = {k: [r[key].get(k, 0) for r in runs] for k in keys}
        elif value is None:
            merged[key] = None
        else:
            merged[key] = statistics.median(values)
    return merged


def met(scenario: str, arms: dict[str, Any]) -> dict[str, bool]:
    """Issue 53's acceptance, as far as this scenario shows it."""
    gw, rr = arms.get("gateway"), arms.get("round-robin")
    if gw is None:
        return {}
    checks = {
        "gateway: no 404, no error, no wrong adapter": gw["not_found"] == 0
        and gw["errors"] == 0
        and gw["wrong_adapter"] == 0
    }
    if SCENARIOS[scenario].loaded is not None:
        loads, rounds = gw["loads"], range(gw["rounds"])
        loaded = [sum(v[n] for k, v in loads.items() if k.startswith("loaded")) for n in rounds]
        checks["gateway: the unserved adapter loaded once a round, no load failed"] = all(
            count == 1 for count in loaded
        ) and not any(k.startswith("failed") for k in loads)
    if rr is not None and scenario == "shared":
        checks["gateway: lower TTFT p90"] = gw["ttft_p90_s"] < rr["ttft_p90_s"]
        if gw["queued_over_0_3_s"] is not None:  # a real vLLM times each request's wait
            fewer = gw["queued_over_0_3_s"] < rr["queued_over_0_3_s"]
        else:
            fewer = sum(gw["waiting_s"]) < sum(rr["waiting_s"])
        checks["gateway: fewer requests waiting in the engines"] = fewer
    return checks


ROWS = (
    ("ok", "answers ok", "{:g}"),
    ("not_found", "404s", "{:g}"),
    ("errors", "other errors", "{:g}"),
    ("error_statuses", "other errors by status and adapter, by round", "{:g}"),
    ("wrong_adapter", "answered by another adapter", "{:g}"),
    ("ttft_p50_s", "TTFT p50 (s)", "{:.3f}"),
    ("ttft_p90_s", "TTFT p90 (s)", "{:.3f}"),
    ("ttft_mean_s", "TTFT mean (s)", "{:.3f}"),
    ("engine_ttft_mean_s", "TTFT mean inside the engines (s)", "{:.3f}"),
    ("served", "requests served, engine 0 / 1", "{:g}"),
    ("peak_waiting", "peak requests waiting, engine 0 / 1", "{:g}"),
    ("waiting_s", "requests waiting x s, engine 0 / 1", "{:.1f}"),
    ("queued_over_0_3_s", "queued over 0.3 s in an engine", "{:g}"),
    ("engine_4xx", "4xx answers by the engines", "{:g}"),
    ("loads", "adapter loads by the gateway, by round", "{:g}"),
)


def table(scenario: str, arms: dict[str, Any]) -> str:
    names = [arm for arm in ARMS if arm in arms]
    lines = [f"| {scenario} | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for key, label, fmt in ROWS:
        cells = []
        for arm in names:
            value = arms[arm][key]
            if value is None or (key == "loads" and arm != "gateway"):
                cells.append("")
            elif isinstance(value, dict):
                cells.append(
                    "; ".join(f"{k}: {', '.join(map(fmt.format, v))}" for k, v in value.items())
                    or "none"
                )
            elif isinstance(value, list):
                cells.append(" / ".join("" if v is None else fmt.format(v) for v in value))
            else:
                cells.append(fmt.format(value))
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def placement(engine_cores: str | None) -> dict[str, str]:
    """Where the engines, the gateway and this client run. `engine_cores` (a `taskset -c`
    list): both engines confined there, the gateway and the client on the cores left to
    this process. None: as before, each real vLLM's worker bound to a core of its own (0
    and 1), everything else wherever the kernel puts it."""
    if engine_cores is None:
        return {
            "engines": "engine 0's worker on core 0, engine 1's on core 1, servers unconfined",
            "gateway": "any core",
            "client": "any core",
        }
    engines = parse_cores(engine_cores)
    allowed = os.sched_getaffinity(0)
    rest = allowed - engines
    if not engines <= allowed or not rest or not shutil.which("taskset"):
        raise SystemExit(
            f"--engine-cores {engine_cores}: needs `taskset` and cores of {cores_text(allowed)}"
            " with at least one left for the gateway and the client"
        )
    return {"engines": cores_text(engines), "gateway": cores_text(rest), "client": cores_text(rest)}


def _placement_line(engine_cores: str | None, where: dict[str, str]) -> str:
    if engine_cores is None:
        return f"placement: {where['engines']}; the gateway and the client on any core"
    return (
        f"placement: both engines on core(s) {where['engines']} (taskset, worker bound there);"
        f" the gateway and the client on core(s) {where['gateway']}"
    )


def _seen_line(rounds: list[dict[str, Any]]) -> str:
    """Each process's cores as the kernel had them while the arms ran, over every round."""
    seen: dict[str, set[str]] = {}
    for r in rounds:
        for name, cores in r["cores_seen"].items():
            seen.setdefault(name, set()).add("?" if cores is None else cores)
    return "cores seen: " + ", ".join(f"{k} {' | '.join(sorted(v))}" for k, v in seen.items())


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="spillgate bench adapters", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--real-vllm", action="store_true", help="two real vLLMs, not simulators")
    p.add_argument("--scenarios", default="shared,split", help=f"of {', '.join(SCENARIOS)}")
    p.add_argument("--rounds", type=int, default=3, help="rounds of both arms, in turn first")
    p.add_argument("--requests", type=int, default=48, help="the burst's requests")
    p.add_argument("--rate", type=float, default=6.0, help="arrivals a second (0: at once)")
    p.add_argument("--max-tokens", type=int, default=64, help="every answer's length")
    p.add_argument("--prompt-words", type=int, default=40)
    p.add_argument("--max-loras", type=int, default=2, help="each engine's adapter slots")
    p.add_argument("--kv-tokens", type=int, default=16_384, help="each engine's KV cache")
    p.add_argument("--refresh", type=float, default=1.0, help="the pool's capacity_refresh_s")
    p.add_argument("--sim-speed", type=float, default=1.0, help="the simulators' speed-up")
    p.add_argument("--ports", type=port_pair, default=(8121, 8122), help="the real vLLMs' ports")
    p.add_argument(
        "--engine-cores",
        metavar="CORES",
        help="both engines confined to these cores (a `taskset -c` list, such as 0; a real"
        " vLLM's worker bound there too), the gateway and this client on the others, as on a"
        " GPU host, where the gateway has CPU cores of its own; default: each real vLLM's"
        " worker on a core of its own (0, 1), the rest anywhere",
    )
    p.add_argument("--seed", type=int, default=53)
    p.add_argument("--json", type=Path, help="write every round and the summary here")
    p.add_argument("--logs", type=Path, help="keep the processes' output in this folder")
    args = p.parse_args(argv)
    args.placement = placement(args.engine_cores)
    line = _placement_line(args.engine_cores, args.placement)
    progress(line)
    scenarios = [SCENARIOS[name] for name in args.scenarios.split(",")]
    planned = plan(
        requests=args.requests, rate=args.rate, prompt_words=args.prompt_words, seed=args.seed
    )
    rounds: list[dict[str, Any]] = []
    client = parse_cores(args.placement["client"]) if args.engine_cores is not None else None
    with logs_dir(args.logs, prefix="spillgate-bench-adapters-") as workdir, pinned(client):
        for scenario in scenarios:
            rounds += run_scenario(scenario, args, planned, workdir)
    figures = summary(rounds)
    checks = {name: met(name, arms) for name, arms in figures.items()}
    print(line)
    print(_seen_line(rounds), end="\n\n")
    status = print_checked(figures, checks, table)
    if args.json is not None:
        report = {
            "backend": "real-vllm" if args.real_vllm else "simulator",
            "options": {k: v for k, v in vars(args).items() if k not in ("json", "placement")},
            "placement": args.placement,
            "summary": figures,
            "checks": checks,
            "rounds": rounds,
        }
        args.json.write_text(json.dumps(report, indent=2, default=str))
    return status


if __name__ == "__main__":
    sys.exit(main())
