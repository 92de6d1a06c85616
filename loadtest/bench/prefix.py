"""Prefix-aware routing on a shared-prefix workload: where the prompt's prefix is cached.

    spillgate bench prefix                          # 4 simulated vLLM backends (minutes)
    spillgate bench prefix --real-vllm --backends 2 --tenants 8 \\
        --system-tokens 800 --chats 2 --turns 3 --rate 4 --kv-tokens 16384
                                                    # two real vLLM servers, one a core
    spillgate bench prefix --real-vllm --backends 2 --tenants 8 --system-tokens 800 \
        --chats 6 --turns 1 --order rounds --concurrency 4 --kv-tokens 16384 --schedules 3
                                                    # issue 41's: 4 at a time, in rounds

Tenants each have a long system prompt and hold multi-turn chats: every turn resends the
system prompt and the chat so far, so a backend that served the chat's last turn (or any
chat of the tenant) holds most of the next prompt in its prefix cache. The order is a
random chat's next turn each time, or rounds that hold every tenant once in a shuffled
order (`--order`); sent at `--rate`, or `--concurrency` at a time. Each of `--schedules`
seeds is its own workload and order, every arm run on it. Arms, side by side on the same
seeded requests, each on fresh backends (empty caches):

- `least_filled`, `prefix`: through a gateway with `routing` set so;
- `round-robin`: straight to the backends in turn;
- `sticky`: straight to one backend per tenant (it ignores load);
- `oracle` (simulator only): straight to the backend that holds most of the prompt, known
  exactly from every prompt sent so far, ties to the one with the fewest in flight.

Figures per arm: the backends' own prefix-cache hit rate (`vllm:prefix_cache_hits_total`
÷ `queries_total`, in tokens), client-side TTFT, and how evenly the backends ran (each
backend's running requests averaged over the run, sampled every 0.25 s: max ÷ mean), per
schedule, and the arms' hit rates of every schedule side by side. Results go in
BENCHMARKS.md ("Prefix-aware routing").
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import sys
import tempfile
import time
import zlib
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from gateway.config import hash_key
from loadtest import real_vllm
from loadtest.bench import admission_fleet as fleet
from loadtest.bench.prefix_workload import ORDERS, Plan, Turn, schedules, workload
from loadtest.loadgen.client import StreamState, error_message
from loadtest.loadgen.scrape import backend_state
from loadtest.loadgen.text import table
from loadtest.percentile import percentile
from loadtest.sim.blocks import hash_blocks
from loadtest.sim.tokens import chat_prompt_ids

ARMS = ("least_filled", "prefix", "round-robin", "sticky", "oracle")
GATEWAY_ARMS = ("least_filled", "prefix")
SAMPLE_S = 0.25
POOL = "chat"  # the gateways' pool


@dataclass
class Arm:
    name: str
    urls: list[str]  # the backends
    model: str  # the model they serve
    gateway: str | None
    oracle: Oracle | None = None


class Oracle:
    """Knows every simulated backend's prefix cache: the blocks of every prompt sent to it,
    hashed as the simulator hashes them. Exact while nothing is evicted (the default plan's
    caches hold every tenant's chats); sends each request where most of its prompt is
    cached, ties to the backend with the fewest requests in flight."""

    def __init__(self, backends: int, *, block_size: int) -> None:
        self._cached: list[set[int]] = [set() for _ in range(backends)]
        self.in_flight = [0] * backends
        self._block = block_size

    def pick(self, messages: Sequence[dict[str, str]]) -> tuple[int, list[int]]:
        blocks = hash_blocks(chat_prompt_ids(messages), self._block)

        def cached(backend: int) -> int:
            return next((n for n, b in enumerate(blocks) if b not in self._cached[backend]),
                        len(blocks))  # fmt: skip

        best = max(range(len(self._cached)), key=lambda b: (cached(b), -self.in_flight[b]))
        return best, blocks

    def sent(self, backend: int, blocks: Sequence[int]) -> None:
        self._cached[backend].update(blocks)


async def send(
    client: httpx.AsyncClient, arm: Arm, turn: Turn, i: int, plan: Plan
) -> dict[str, Any]:
    if arm.gateway is not None:
        url, model = arm.gateway, POOL
        headers = {"authorization": f"Bearer {fleet.KEY}", "x-spillgate-session": turn.chat}
    else:
        if arm.oracle is not None:
            pick, blocks = arm.oracle.pick(turn.messages)
            arm.oracle.sent(pick, blocks)
        elif arm.name == "sticky":
            pick = zlib.crc32(str(turn.tenant).encode()) % len(arm.urls)
        else:
            pick = i % len(arm.urls)
        url, model, headers = arm.urls[pick], arm.model, {}
    body = {"model": model, "messages": turn.messages, "max_tokens": plan.max_tokens,
            "stream": True, "ignore_eos": True}  # fmt: skip
    start = time.perf_counter()
    if arm.oracle is not None and arm.gateway is None:
        arm.oracle.in_flight[pick] += 1
    try:
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body,
                                 headers=headers) as response:  # fmt: skip
            if response.status_code != 200:
                answer = error_message(await response.aread())
                return {"status": response.status_code, "ttft_s": None,
                        "error": f"{response.status_code} {answer}"[:160]}  # fmt: skip
            stream = StreamState()
            async for chunk in response.aiter_bytes():
                stream.feed(chunk, now=time.perf_counter())
            ttft = None if stream.first is None else stream.first - start
            error = None if stream.error is None else f"200 {stream.error}"[:160]
            return {"status": 200, "ttft_s": ttft, "error": error}
    except httpx.HTTPError as exc:
        return {"status": 0, "ttft_s": None, "error": f"0 {type(exc).__name__}: {exc}"[:160]}
    finally:
        if arm.oracle is not None and arm.gateway is None:
            arm.oracle.in_flight[pick] -= 1


async def sample(client: httpx.AsyncClient, urls: Sequence[str], out: list[list[float]]) -> None:
    while True:
        states = await asyncio.gather(*(client.get(f"{u}/metrics") for u in urls))
        out.append([backend_state(s.text)["running"] for s in states])
        await asyncio.sleep(SAMPLE_S)


Counts = tuple[float, float, float, float]  # prefix queries, hits; engine TTFT sum, count
# a kept-alive connection is dropped by the client well before uvicorn's 5 s keep-alive drops
# it (httpx's default is the same 5 s), so a request is never written to a connection the
# server is closing, which fails it with a ReadError
KEEPALIVE_S = 2.0


def client_limits(connections: int) -> httpx.Limits:
    return httpx.Limits(max_connections=connections, max_keepalive_connections=connections,
                        keepalive_expiry=KEEPALIVE_S)  # fmt: skip


async def prefix_counts(client: httpx.AsyncClient, urls: Sequence[str]) -> Counts:
    """The engines' counters: prompt tokens looked up in and found in their prefix caches,
    and their own time to first token (its sum and count)."""
    states = [backend_state((await client.get(f"{u}/metrics")).text) for u in urls]
    keys = ("prefix_queries", "prefix_hits", "ttft_sum", "ttft_count")
    queries, hits, ttft, answered = (sum(s[k] for s in states) for k in keys)
    return queries, hits, ttft, answered


def arm_figures(results: list[dict[str, Any]], *, before: Counts, after: Counts) -> dict[str, Any]:
    """An arm's answers, its prefix hit rate and the engines' mean TTFT (what of the
    client's TTFT the engines spent, queueing included), from the engines' own counters
    read `before` and `after` it."""
    queries, hits, ttft, answered = (a - b for a, b in zip(after, before, strict=True))
    ttfts = sorted(r["ttft_s"] for r in results if r["ttft_s"] is not None)
    return {
        "requests": len(results),
        "ok": sum(1 for r in results if r["status"] == 200 and r.get("error") is None),
        # what went wrong, by status and the start of its error, with how often
        "failures": dict(Counter(r["error"] for r in results if r.get("error") is not None)),
        "hit_rate": hits / queries if queries else None,
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p90_s": percentile(ttfts, 90),
        "engine_ttft_mean_s": ttft / answered if answered else None,
    }


async def run_arm(arm: Arm, turns: Sequence[Turn], plan: Plan) -> dict[str, Any]:
    limits = client_limits(1024)
    async with httpx.AsyncClient(timeout=120.0, limits=limits) as client:
        before = await prefix_counts(client, arm.urls)
        running: list[list[float]] = []
        sampler = asyncio.create_task(sample(client, arm.urls, running))
        t0 = time.perf_counter()

        gate = asyncio.Semaphore(plan.concurrency or len(turns) or 1)  # waiters go in order

        async def one(i: int, turn: Turn) -> dict[str, Any]:
            if not plan.concurrency:
                await asyncio.sleep(max(0.0, t0 + turn.at_s - time.perf_counter()))
            async with gate:
                return await send(client, arm, turn, i, plan)

        try:
            results = await asyncio.gather(*(one(i, t) for i, t in enumerate(turns)))
        finally:
            sampler.cancel()
            await asyncio.gather(sampler, return_exceptions=True)
        after = await prefix_counts(client, arm.urls)
    per_backend = [statistics.fmean(col) for col in zip(*running, strict=True)] if running else []
    mean = statistics.fmean(per_backend) if per_backend else 0.0
    return {
        **arm_figures(results, before=before, after=after),
        "running_mean_per_backend": per_backend,
        "running_max_over_mean": max(per_backend) / mean if mean else None,
    }


def gateway_config(urls: Sequence[str], model: str, routing: str) -> dict[str, Any]:
    backends = [{"url": u, "served_model": model, "capacity": "auto"} for u in urls]
    return {
        "tenants": [{"name": fleet.TENANT, "key_sha256": hash_key(fleet.KEY),
                     "requests_per_minute": 1_000_000, "tokens_per_minute": 10**10}],
        "pools": [{"name": POOL, "backends": backends, "routing": routing,
                   "overflow": ["queue", "reject"], "timeouts": fleet.TIMEOUTS}],
    }  # fmt: skip


@contextlib.contextmanager
def simulators(plan: Plan, workdir: Path, arm: str) -> Iterator[list[str]]:
    """Fresh simulated backends for one arm: empty caches, nothing left running."""
    options = fleet.SimOptions(
        kv_tokens=plan.kv_tokens, max_model_len=min(32_768, plan.kv_tokens), speed=plan.speed
    )
    with contextlib.ExitStack() as stack:
        urls = []
        for i in range(plan.backends):
            where = workdir / f"{arm}-{i}"
            where.mkdir(parents=True, exist_ok=True)
            urls.append(stack.enter_context(fleet.simulator(options, workdir=where)).url)
        yield urls


@contextlib.contextmanager
def real_servers(plan: Plan) -> Iterator[list[str]]:
    """Real vLLM servers, one per core (loadtest/real_vllm), started once for every arm."""
    real_vllm.install()
    with contextlib.ExitStack() as stack:
        yield [
            stack.enter_context(
                real_vllm.running(
                    real_vllm.RealVllm(
                        port=8101 + i, kv_tokens=plan.kv_tokens, cores=str(i), confined=True
                    )
                )
            )
            for i in range(plan.backends)
        ]


def measure(plan: Plan, workdir: Path, *, real: bool = False) -> dict[str, Any]:
    """Every arm on each schedule (`plan.schedules` seeds), the schedules one after another."""
    out: dict[str, Any] = {"plan": asdict(plan), "backend": "real-vllm" if real else "simulator"}
    out["schedules"] = []
    with contextlib.ExitStack() as fleet_stack:
        shared = fleet_stack.enter_context(real_servers(plan)) if real else None
        for each in schedules(plan):
            arms = measure_schedule(each, workdir / f"seed-{each.seed}", shared)
            out["schedules"].append({"seed": each.seed, "arms": arms})
    return out


def measure_schedule(plan: Plan, workdir: Path, shared: list[str] | None) -> dict[str, Any]:
    """Each arm on one schedule, on fresh simulators or on the `shared` real vLLM servers."""
    turns = workload(plan)
    model = "sim" if shared is None else real_vllm.MODEL
    figures = {}
    for name in ARMS if shared is None else ARMS[:-1]:  # no oracle knows a real vLLM's cache
        print(f"seed {plan.seed}, {name}: {len(turns)} requests", file=sys.stderr, flush=True)
        with contextlib.ExitStack() as stack:
            if shared is None:
                urls = stack.enter_context(simulators(plan, workdir, name))
            else:  # the same servers, their caches emptied
                urls = shared
                for url in urls:
                    if not real_vllm.reset_prefix_cache(url):
                        raise RuntimeError(f"{url} refused to reset its prefix cache")
            gateway = None
            if name in GATEWAY_ARMS:
                workdir.mkdir(parents=True, exist_ok=True)
                config = gateway_config(urls, model, name)
                gateway = stack.enter_context(fleet.gateway(config, workdir=workdir, arm=name))
            oracle = Oracle(len(urls), block_size=16) if name == "oracle" else None
            arm = Arm(name, urls, model, gateway, oracle)
            figures[name] = asyncio.run(run_arm(arm, turns, plan))
    return figures


def targets(arms: dict[str, Any]) -> list[tuple[str, bool | None, str]]:
    prefix, least, sticky = arms["prefix"], arms["least_filled"], arms["sticky"]
    oracle = arms.get("oracle")
    rows: list[tuple[str, bool | None, str]] = []
    if oracle is not None and prefix["hit_rate"] is not None and oracle["hit_rate"]:
        share = prefix["hit_rate"] / oracle["hit_rate"]
        rows.append(("hit rate ≥ 80 % of the oracle's", share >= 0.8, f"{share:.0%}"))
    elif prefix["hit_rate"] is not None and sticky["hit_rate"] is not None:
        gap = sticky["hit_rate"] - prefix["hit_rate"]  # on a real vLLM, sticky is the ceiling
        rows.append(("hit rate within 0.01 of sticky's", gap <= 0.01, f"{gap:+.3f}"))
    if prefix["ttft_p90_s"] is not None and least["ttft_p90_s"]:
        ratio = prefix["ttft_p90_s"] / least["ttft_p90_s"]
        rows.append(("TTFT p90 ≤ 0.5× least_filled's", ratio <= 0.5, f"{ratio:.2f}×"))
    skew = prefix["running_max_over_mean"]
    rows.append(("max/mean running per backend ≤ 1.5", None if skew is None else skew <= 1.5,
                 "-" if skew is None else f"{skew:.2f}"))  # fmt: skip
    return rows


def _cell(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def report(figures: dict[str, Any]) -> str:
    """Each schedule's arms and targets, then every schedule's hit rates side by side."""
    lines = []
    for schedule in figures["schedules"]:
        rows = [["arm", "ok", "hit rate", "TTFT p50 (s)", "TTFT p90 (s)", "max/mean running"]]
        for name, arm in schedule["arms"].items():
            rows.append(
                [name, str(arm["ok"]), _cell(arm["hit_rate"], ".3f"),
                 _cell(arm["ttft_p50_s"], ".3f"), _cell(arm["ttft_p90_s"], ".3f"),
                 _cell(arm["running_max_over_mean"], ".2f")]
            )  # fmt: skip
        lines += [f"seed {schedule['seed']}:", table(rows, ["<", ">", ">", ">", ">", ">"]), ""]
        for target, met, measured in targets(schedule["arms"]):
            verdict = {True: "met", False: "NOT met", None: "not measured"}[met]
            lines.append(f"{verdict:>12}  {target}: {measured}")
        lines.append("")
    names = list(figures["schedules"][0]["arms"])
    rows = [["seed", *names, "prefix - sticky"]]
    for schedule in figures["schedules"]:
        arms = schedule["arms"]
        prefix, sticky = arms["prefix"]["hit_rate"], arms["sticky"]["hit_rate"]
        # rounded, and + 0.0, so that equal rates print +0.000, not -0.000
        gap = None if None in (prefix, sticky) else round(prefix - sticky, 3) + 0.0
        rows.append([str(schedule["seed"]), *(_cell(arms[n]["hit_rate"], ".3f") for n in names),
                     _cell(gap, "+.3f")])  # fmt: skip
    lines += ["hit rate per schedule:", table(rows, ["<"] + [">"] * (len(names) + 1))]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="spillgate bench prefix", description=__doc__)
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    defaults = Plan()
    for key, value in asdict(defaults).items():
        choices = ORDERS if key == "order" else None
        p.add_argument(f"--{key.replace('_', '-')}", type=type(value), default=value,
                       choices=choices)  # fmt: skip
    p.add_argument("--real-vllm", action="store_true", help="real vLLM servers, one per core")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    plan = Plan(**{k: getattr(args, k) for k in asdict(defaults)})
    with tempfile.TemporaryDirectory(prefix="bench-prefix-") as workdir:
        figures = measure(plan, Path(workdir), real=args.real_vllm)
    print(report(figures))
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1) + "\n")
        print(f"wrote {args.json.resolve()}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
