"""Admission by what vLLM really holds: the same seeded bursts, direct and through the gateway.

    spillgate bench admission                # against the simulator (minutes)
    spillgate bench admission --real-vllm    # a real vLLM, started by
                                                      # loadtest/real_vllm/serve.sh (minutes)

The simulator runs at one GPU's speed for an 8B model (`--sim-speed 1`): faster, its
engine's times shrink but the gateway's work of relaying every chunk does not, and the
two stop comparing as they would on a GPU.

Arms, side by side in one run: `direct` to the backend; the gateway with `static`
reservation (prompt + max_tokens held until the last byte, no feedback from the backend);
the gateway with the `learned` admission (the defaults: a stream reserves the most it is
expected to hold at once, from the learned answer lengths, with its share of their spread
at p90, grown as it runs past it, checked against the backend's reported KV use), and
`whole`, the same with each stream's whole expected answer reserved (`hold: whole`). Each arm
gets the same seeded requests: streaming chats with `max_tokens` 2048 whose answers end
early (the simulator's realistic lengths; on a real vLLM sixteen stop token ids and a seed
per prompt, so every arm gets the same answers). Bursts of 24 and 48 (3 runs each, the
table shows medians), then a 5x spike into a pool whose overflow chain ends at a simulated
provider. The learning arms are warmed first with a seeded warm-up, so their figures start
from samples. Each run starts from an idle engine with an empty prefix cache and, through a
gateway, once that gateway aims at its target fill again: the other arms' traffic bypasses
it, and requests waiting inside vLLM make it back off. Every 0.25 s the backend's /metrics
and the gateway's /admin/status are read. The backend runs on one core and everything else
on the others (`off_core`). Figures go in BENCHMARKS.md ("Admission by what the backends
hold").

With `--shared-prompt TOKENS` every chat opens with a system message of about that many
tokens before its user message (`--prompt-tokens` long), the same text on every arm: the
engine holds it once for all the requests in flight, and the gateway should count it so
(issue 49). `--prompt-mix mixed` gives a third of the chats message A, a third message B
and a third a message of their own. `--replicas N` runs the learned arm as N gateways
sharing one redis-server, the requests split between them round-robin.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import sys
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx

from loadtest.bench import admission_fleet as fleet
from loadtest.bench.admission_fleet import ADMIN_TOKEN
from loadtest.bench.admission_plan import PROMPT_MIXES, BenchPlan
from loadtest.bench.admission_report import report, targets
from loadtest.bench.admission_watch import Watch, summarize
from loadtest.bench.machine import logs_dir, progress
from loadtest.loadgen.run import RunTarget, run_schedule
from loadtest.loadgen.scrape import Scraper
from loadtest.loadgen.workload import PlannedRequest
from loadtest.procs import RedisProcess
from loadtest.real_vllm import reset_prefix_cache

IDLE_TIMEOUT_S = 180.0
SETTLE_TIMEOUT_S = 180.0
DIRECT = "direct"
# Direct runs last in each round: the bursts it lets into the engine (requests waiting inside
# vLLM, preemptions) lower the learned gateway's effective fill, which is then let recover.
ARMS = (*fleet.ARMS, DIRECT)
REPLICATED = "learned"  # the arm `--replicas` runs as several gateways


@dataclass(frozen=True, kw_only=True)
class Bench:
    backend: fleet.Backend
    gateways: dict[str, str]  # arm → gateway URL (its first replica's, when several)
    client: httpx.AsyncClient
    # arm → every replica's URL, for an arm run as several gateways sharing one Redis
    replicas: Mapping[str, Sequence[str]] = field(default_factory=dict)

    def scraper(self, arm: str) -> Scraper:
        return self._scraper(self.gateways.get(arm))

    def _scraper(self, gateway_url: str | None) -> Scraper:
        return Scraper(
            client=self.client,
            gateway_url=gateway_url,
            admin_token=ADMIN_TOKEN,
            backend_urls=[self.backend.url],
            with_queue_depth=False,
        )

    def urls(self, arm: str) -> list[str]:
        """The arm's gateways: its replicas, its one gateway, or none (`direct`)."""
        if arm in self.replicas:
            return list(self.replicas[arm])
        return [self.gateways[arm]] if arm in self.gateways else []

    def target(self, arm: str, *, spike: bool) -> RunTarget:
        """Where the arm's requests go: round-robin over its gateways, else the backend."""
        gateways = self.urls(arm)
        model = self.backend.model
        if gateways and spike:
            model += fleet.SPIKE_SUFFIX
        shape = fleet.BenchShape(model=model, extra=self.backend.extra)
        keys = {fleet.TENANT: fleet.KEY} if gateways else {}
        return RunTarget(label=arm, urls=gateways or [self.backend.url], keys=keys, shape=shape)

    async def idle(self) -> None:
        """Until the backend runs nothing, then its prefix cache emptied: a run starts from
        an empty engine."""
        scraper = self.scraper(DIRECT)
        deadline = time.monotonic() + IDLE_TIMEOUT_S
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                state = await scraper.backend(self.backend.url)
                if state["running"] == 0 and state["waiting"] == 0:
                    break
            await asyncio.sleep(0.2)
        # every arm sends the same prompts: a cache left from the arm before would hand
        # the next one its prefill
        await asyncio.to_thread(reset_prefix_cache, self.backend.url)

    async def settle(self, arm: str) -> dict[str, float | None]:
        """Until the arm's gateways aim at their target fill again: another arm's traffic (it
        bypasses them) may have made them back off. Returns the wait and the lowest fill."""
        waited = time.monotonic()
        fill: float | None = None
        scrapers = [self._scraper(url) for url in self.urls(arm)]
        if scrapers:
            while time.monotonic() - waited < SETTLE_TIMEOUT_S:
                fills = [
                    b.get("effective_fill", p["target_fill"]) / p["target_fill"]
                    for scraper in scrapers
                    for p in (await scraper.status())["pools"]
                    for b in p["backends"]
                ]
                fill = min(fills)
                if fill >= 1.0:
                    break
                await asyncio.sleep(0.5)
        return {"settle_s": time.monotonic() - waited, "fill_share_at_start": fill}

    async def measure(
        self, arm: str, plans: Sequence[PlannedRequest], *, spike: bool = False
    ) -> dict[str, Any]:
        await self.idle()
        settled = await self.settle(arm)
        scraper = self.scraper(arm)
        watch = Watch(scraper=scraper, backend_url=self.backend.url)
        before = await scraper.backend(self.backend.url)
        backed_off = await self.backoffs(arm)
        sampling = asyncio.create_task(watch.run())
        try:
            data = await run_schedule(
                plans,
                target=self.target(arm, spike=spike),
                duration_s=max(p.at_s for p in plans),
                sample_interval_s=1.0,
            )
        finally:
            sampling.cancel()
            await asyncio.gather(sampling, return_exceptions=True)
        after = await scraper.backend(self.backend.url)
        preempted = after["preemptions"] - before["preemptions"]
        queried = after["prefix_queries"] - before["prefix_queries"]
        hits = after["prefix_hits"] - before["prefix_hits"]
        backoffs = {
            reason: n - backed_off.get(reason, 0)
            for reason, n in (await self.backoffs(arm)).items()
        }
        return summarize(
            arm,
            data.results,
            watch,
            preemptions=preempted,
            backoffs=sum(backoffs.values()) if self.urls(arm) else None,
            backoffs_by_reason={reason: n for reason, n in backoffs.items() if n},
            prefix_hit_share=hits / queried if queried > 0 else None,
            elapsed_s=data.elapsed_s,
            **settled,
        )

    async def backoffs(self, arm: str) -> dict[str, int]:
        """The arm's gateways' fill back-offs so far, by reason (none for `direct`)."""
        counted: Counter[str] = Counter()
        for url in self.urls(arm):
            status = await self._scraper(url).status()
            for pool in status["pools"]:
                for backend in pool["backends"]:
                    counted.update(backend.get("fill_backoffs", {}))
        return dict(counted)

    async def warm(self, plan: BenchPlan) -> dict[str, Any]:
        """The learning arms see `plan.warmup` seeded answers per pool before they are
        measured, every replica of an arm the whole warm-up; the outcomes per arm and pool."""
        out: dict[str, Any] = {}
        for arm in fleet.LEARNING:
            for spike in (False, True):
                target = self.target(arm, spike=spike)
                plans = plan.warmup_requests(target.shape.model)
                outcomes: Counter[str] = Counter()
                errors: list[str] = []
                for url in target.urls:
                    data = await run_schedule(
                        plans,
                        target=replace(target, urls=[url]),
                        duration_s=plans[-1].at_s,
                        sample_interval_s=1.0,
                    )
                    outcomes.update(r.outcome for r in data.results)
                    errors += [r.error for r in data.results if r.error]
                seen: dict[str, Any] = dict(outcomes)
                if errors:
                    seen["first_error"] = errors[0]
                out.setdefault(arm, {})[target.shape.model] = seen
        return out


async def run_bench(bench: Bench, plan: BenchPlan) -> dict[str, Any]:
    out: dict[str, Any] = {"bursts": {}, "spike": {"runs": {arm: [] for arm in ARMS}}}
    if plan.warmup:
        progress(f"warm-up: {plan.warmup} seeded requests through each pool of the learning arms")
        out["warmup"] = await bench.warm(plan)
    for size in plan.bursts:
        runs: dict[str, list[dict[str, Any]]] = {arm: [] for arm in ARMS}
        for run in range(plan.runs):
            plans = plan.burst(size, run, bench.backend.model)
            for arm in ARMS:  # arms interleaved: the machine's drift hits all alike
                progress(f"burst of {size}, run {run + 1}/{plan.runs}: {arm}")
                runs[arm].append(await bench.measure(arm, plans))
        out["bursts"][str(size)] = {"runs": runs, "median": medians(runs)}
    spike_runs = out["spike"]["runs"]
    for run in range(plan.runs):
        plans = plan.spike(run, bench.backend.model)
        for arm in ARMS:
            progress(f"spike of {len(plans)}, run {run + 1}/{plan.runs}: {arm}")
            spike_runs[arm].append(await bench.measure(arm, plans, spike=True))
    out["spike"]["median"] = medians(spike_runs)
    out["spike"]["requests"] = plan.spike_factor * min(plan.bursts)
    return out


def medians(runs: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Per arm, the median of every figure over its runs (a figure missing in all: None)."""
    out = {}
    for arm, rows in runs.items():
        keys = [k for k, v in rows[0].items() if isinstance(v, int | float) or v is None]
        out[arm] = {
            k: statistics.median(values) if (values := [r[k] for r in rows if r[k] is not None])
            else None
            for k in keys
        }  # fmt: skip
    return out


async def _main(args: argparse.Namespace, plan: BenchPlan, workdir: Path) -> dict[str, Any]:
    with contextlib.ExitStack() as stack:
        found = stack.enter_context(fleet.backend(args, workdir))
        provider_url = stack.enter_context(fleet.provider(workdir=workdir))
        redis_url = stack.enter_context(RedisProcess()).url if args.replicas > 1 else None
        gateways: dict[str, list[str]] = {}
        for arm in fleet.ARMS:
            config = fleet.gateway_config(
                backend=found, provider_url=provider_url, arm=arm, queue_wait_s=args.queue_wait
            )
            if arm == REPLICATED and redis_url is not None:
                started = fleet.replicas(
                    config, workdir=workdir, arm=arm, count=args.replicas, redis_url=redis_url
                )
                gateways[arm] = stack.enter_context(started)
            else:
                one = stack.enter_context(fleet.gateway(config, workdir=workdir, arm=arm))
                gateways[arm] = [one]
        async with httpx.AsyncClient(timeout=5.0) as client:
            bench = Bench(
                backend=found,
                gateways={arm: urls[0] for arm, urls in gateways.items()},
                replicas={arm: urls for arm, urls in gateways.items() if len(urls) > 1},
                client=client,
            )
            status = await bench.scraper("learned").status()
            capacity = status["pools"][0]["backends"][0]["capacity_tokens"]
            figures = await run_bench(bench, plan)
    return {
        "backend": found.kind,
        "model": found.model,
        "capacity_tokens": capacity,
        "arms": {arm: fleet.ARMS.get(arm, "no gateway") for arm in ARMS},
        "replicas": {REPLICATED: args.replicas},
        "plan": asdict(plan),
        **figures,
    }


def parse_args(argv: Sequence[str] | None) -> tuple[argparse.Namespace, BenchPlan]:
    p = argparse.ArgumentParser(prog="spillgate bench admission", description=__doc__)
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    fleet.add_backend_args(p)
    p.add_argument("--bursts", default="24,48")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--spike-factor", type=int, default=5)
    p.add_argument("--spike-window", type=float, default=1.0)
    p.add_argument("--warmup", type=int, default=64)
    p.add_argument("--warmup-rate", type=float, default=4.0)
    p.add_argument("--max-tokens", type=int, default=2048)
    p.add_argument(
        "--prompt-tokens", default="uniform:32:256", help="the user message's length, drawn"
    )
    p.add_argument(
        "--shared-prompt",
        type=int,
        default=0,
        metavar="TOKENS",
        help="open every chat with a system message of about TOKENS tokens, the same on "
        "every arm (default 0: none)",
    )
    p.add_argument(
        "--prompt-mix",
        choices=PROMPT_MIXES,
        default="shared",
        help="with --shared-prompt: every chat opens with the same message (shared), or a "
        "third with message A, a third with B and a third each with its own (mixed)",
    )
    p.add_argument("--seed", type=int, default=20)
    p.add_argument(
        "--queue-wait",
        type=float,
        help="the gateways' queue.max_wait_s (default: the gateway's own, auto)",
    )
    p.add_argument(
        "--replicas",
        type=int,
        default=1,
        help=f"run the {REPLICATED} arm as this many gateways sharing one redis-server, the "
        "requests split round-robin (default 1: one gateway, no Redis)",
    )
    p.add_argument("--json", type=Path)
    p.add_argument("--logs", type=Path, help="keep the gateways' and simulators' output here")
    args = p.parse_args(argv)
    if args.replicas < 1:
        p.error("--replicas must be at least 1")
    plan = BenchPlan(
        bursts=tuple(int(b) for b in args.bursts.split(",")),
        runs=args.runs,
        spike_factor=args.spike_factor,
        spike_window_s=args.spike_window,
        warmup=args.warmup,
        warmup_rate=args.warmup_rate,
        max_tokens=args.max_tokens,
        prompt_tokens=args.prompt_tokens,
        seed=args.seed,
        shared_prompt=args.shared_prompt,
        prompt_mix=args.prompt_mix,
    )
    return args, plan


def main(argv: Sequence[str] | None = None) -> int:
    args, plan = parse_args(argv)
    load_before = os.getloadavg()[0]
    with logs_dir(args.logs, prefix="bench-admission-") as logs:
        figures = asyncio.run(_main(args, plan, logs))
    figures["load_average"] = {"before": load_before, "after": os.getloadavg()[0]}
    figures["queue_wait_s"] = args.queue_wait
    figures["targets"] = targets(figures)
    print(report(figures))
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1) + "\n")
        progress(f"wrote {args.json.resolve()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
