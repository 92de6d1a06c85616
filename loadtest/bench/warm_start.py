"""Full admission from the first request of a burst: a gateway started right before it, a warm
one, and a second replica started while the first is busy, side by side with direct.

    spillgate bench warm-start                # against the simulator (minutes)
    spillgate bench warm-start --real-vllm    # a real vLLM, started by
                                                       # loadtest/real_vllm/serve.sh

Arms, interleaved in each run, each sent the same seeded burst (streaming chats, `max_tokens`
2048, answers that end early; on a real vLLM sixteen stop token ids and a seed per prompt):

- `direct`: straight to the backend;
- `fresh`: a gateway started right before the burst; it has seen no answer of its own, and
  reserves by the backend's histogram of the answers it generated (the earlier arms' and the
  warm-up's);
- `warm`: a gateway that has seen `--warmup` answers of its own;
- `replica`: a second replica, started while the first (warm, sharing Redis) serves a
  trickle; it reserves by the answers every replica saw.

Each run starts from an idle backend (on a real vLLM, an empty prefix cache) and the warm
gateway's effective fill back at its target (another arm's burst may make vLLM preempt,
and the warm gateway back off). Every 0.25 s
the backend's /metrics and the gateway's /admin/status are read. The backend runs on one
core and everything else on the others where the machine has two. Figures go in
BENCHMARKS.md ("A gateway warm from its first request").
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from loadtest.bench import admission_fleet as fleet
from loadtest.bench.admission import Bench, medians
from loadtest.bench.admission_watch import Watch, summarize
from loadtest.bench.machine import logs_dir, progress
from loadtest.loadgen.run import run_schedule
from loadtest.loadgen.workload import LengthDist, PlannedRequest, TenantKey, Workload, plan_requests
from loadtest.procs import RedisProcess

DIRECT, FRESH, WARM, REPLICA = "direct", "fresh", "warm", "replica"
ARMS = (DIRECT, FRESH, WARM, REPLICA)


def workload(model: str, args: argparse.Namespace) -> Workload:
    return Workload(
        model=model,
        prompt_tokens=LengthDist.parse(args.prompt_tokens),
        output_tokens=LengthDist.parse(str(args.max_tokens)),
        tenants=[TenantKey(name=fleet.TENANT, key=fleet.KEY)],
    )


def at_rate(
    count: int, rate: float, model: str, args: argparse.Namespace, *, seed: int
) -> list[PlannedRequest]:
    return plan_requests([i / rate for i in range(count)], workload(model, args), seed=seed)


async def source(bench: Bench, arm: str) -> str | None:
    """Where the arm's gateway takes the lengths it reserves by, as it says."""
    status = await bench.scraper(arm).status()
    found: str | None = status["pools"][0]["reservation"].get("source")
    return found


async def measure(bench: Bench, arm: str, plans: Sequence[PlannedRequest]) -> dict[str, Any]:
    """One burst through `arm` (the backend already idle), watched as the admission bench
    watches it."""
    scraper = bench.scraper(arm)
    watch = Watch(scraper=scraper, backend_url=bench.backend.url)
    before = await scraper.backend(bench.backend.url)
    lengths_from = await source(bench, arm) if arm in bench.gateways else None
    sampling = asyncio.create_task(watch.run())
    try:
        data = await run_schedule(
            plans, target=bench.target(arm, spike=False), duration_s=0.0, sample_interval_s=1.0
        )
    finally:
        sampling.cancel()
        await asyncio.gather(sampling, return_exceptions=True)
    after = await scraper.backend(bench.backend.url)
    ttft = sorted(r.ttft_s for r in data.results if r.ok and r.ttft_s is not None)
    return summarize(
        arm,
        data.results,
        watch,
        preemptions=after["preemptions"] - before["preemptions"],
        lengths_from=lengths_from,
        ttft_p10_s=_quantile(ttft, 0.1),
        ttft_p90_s=_quantile(ttft, 0.9),
    )


def _quantile(ordered: Sequence[float], q: float) -> float | None:
    if not ordered:
        return None
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class Run:
    """The processes one bench holds: the backend, a provider, the warm gateway, Redis and
    the first replica; the fresh gateway and the second replica come and go each run."""

    def __init__(self, args: argparse.Namespace, stack: contextlib.ExitStack, workdir: Path):
        self.args = args
        self.stack = stack
        self.workdir = workdir
        self.backend = stack.enter_context(fleet.backend(args, workdir))
        self.provider = stack.enter_context(fleet.provider(workdir=workdir))
        self.redis = stack.enter_context(RedisProcess())
        self.config = fleet.gateway_config(
            backend=self.backend, provider_url=self.provider, arm="learned"
        )
        self.warm = stack.enter_context(fleet.gateway(self.config, workdir=workdir, arm=WARM))
        self.first = stack.enter_context(
            fleet.gateway(self.config, workdir=workdir, arm="first", redis_url=self.redis.url)
        )

    def bench(self, client: httpx.AsyncClient, **gateways: str) -> Bench:
        return Bench(backend=self.backend, gateways=gateways, client=client)

    async def warm_up(self, client: httpx.AsyncClient) -> dict[str, dict[str, int]]:
        """`--warmup` answers through the warm gateway and through the first replica."""
        bench = self.bench(client, warm=self.warm, first=self.first)
        seen = {}
        for arm in (WARM, "first"):
            plans = at_rate(
                self.args.warmup,
                self.args.warmup_rate,
                self.backend.model,
                self.args,
                seed=self.args.seed - 1,
            )
            data = await run_schedule(
                plans, target=bench.target(arm, spike=False), duration_s=plans[-1].at_s
            )
            seen[arm] = {
                o: sum(r.outcome == o for r in data.results)
                for o in {r.outcome for r in data.results}
            }
        return seen

    async def fresh(
        self, client: httpx.AsyncClient, plans: Sequence[PlannedRequest], run: int
    ) -> dict[str, Any]:
        await self.bench(client).idle()
        with fleet.gateway(self.config, workdir=self.workdir, arm=f"fresh-{run}") as url:
            return await measure(self.bench(client, fresh=url), FRESH, plans)

    async def replica(
        self, client: httpx.AsyncClient, plans: Sequence[PlannedRequest], run: int
    ) -> dict[str, Any]:
        """The second replica starts while the first serves a trickle, and takes the burst."""
        await self.bench(client).idle()
        trickle = at_rate(
            max(1, int(self.args.trickle_rate * self.args.trickle_s)),
            self.args.trickle_rate,
            self.backend.model,
            self.args,
            seed=self.args.seed + 1000 + run,
        )
        busy = asyncio.create_task(
            run_schedule(
                trickle,
                target=self.bench(client, first=self.first).target("first", spike=False),
                duration_s=trickle[-1].at_s,
            )
        )
        try:
            await asyncio.sleep(1.0)  # the first replica is busy before the second starts
            with contextlib.ExitStack() as stack:
                url = await asyncio.to_thread(
                    stack.enter_context,
                    fleet.gateway(
                        self.config,
                        workdir=self.workdir,
                        arm=f"replica-{run}",
                        redis_url=self.redis.url,
                    ),
                )
                figures = await measure(self.bench(client, replica=url), REPLICA, plans)
        finally:
            done = await busy
        figures["trickle_ok"] = sum(r.ok for r in done.results)
        return figures


async def run_bench(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    with contextlib.ExitStack() as stack:
        run = Run(args, stack, workdir)
        async with httpx.AsyncClient(timeout=5.0) as client:
            progress(
                f"warm-up: {args.warmup} answers through the warm gateway and the first replica"
            )
            warmup = await run.warm_up(client)
            runs: dict[str, list[dict[str, Any]]] = {arm: [] for arm in ARMS}
            for i in range(args.runs):
                plans = plan_requests(
                    [0.0] * args.burst, workload(run.backend.model, args), seed=args.seed + i
                )
                for arm in ARMS:
                    progress(f"burst of {args.burst}, run {i + 1}/{args.runs}: {arm}")
                    if arm == FRESH:
                        figures = await run.fresh(client, plans, i)
                    elif arm == REPLICA:
                        figures = await run.replica(client, plans, i)
                    else:
                        bench = run.bench(client, warm=run.warm)
                        await bench.idle()
                        # the other arms' bursts may have made it back off: its fill
                        # recovers first, as it would between spikes
                        settled = await bench.settle(arm)
                        figures = {**await measure(bench, arm, plans), **settled}
                    runs[arm].append(figures)
    return {
        "backend": run.backend.kind,
        "burst": args.burst,
        "warmup": warmup,
        "runs": runs,
        "median": medians(runs),
    }


ROWS = (
    ("lengths reserved by", "lengths_from", None),
    ("running at once (max, backend)", "running_max", "{:.0f}"),
    ("streaming at once (client)", "streaming_max", "{:.0f}"),
    ("peak KV used", "kv_peak", "{:.0%}"),
    ("TTFT p10 (s)", "ttft_p10_s", "{:.2f}"),
    ("TTFT p50 (s)", "ttft_p50_s", "{:.2f}"),
    ("TTFT p90 (s)", "ttft_p90_s", "{:.2f}"),
    ("refusals (503)", "refused", "{:.0f}"),
    ("errors", "errors", "{:.0f}"),
    ("preemptions", "preemptions", "{:.0f}"),
)


def report(figures: dict[str, Any]) -> str:
    """Medians per arm, each run's figure in brackets, then the targets."""
    runs, median = figures["runs"], figures["median"]
    lines = [
        f"backend: {figures['backend']}; a burst of {figures['burst']}; warm-up {figures['warmup']}"
    ]
    header = f"{'':32}" + "".join(f"{arm:>26}" for arm in ARMS)
    lines += [header, "-" * len(header)]
    for label, key, fmt in ROWS:
        cells = []
        for arm in ARMS:
            each = [r.get(key) for r in runs[arm]]
            if fmt is None:  # a word per run: shown once where every run says the same
                words = sorted({str(v) for v in each if v is not None})
                cells.append("/".join(words) or "-")
                continue
            shown = "/".join("-" if v is None else fmt.format(v) for v in each)
            middle = median[arm].get(key)
            cells.append(f"{'-' if middle is None else fmt.format(middle)} ({shown})")
        lines.append(f"{label:32}" + "".join(f"{c:>26}" for c in cells))
    lines.append("")
    lines += [f"{'met' if ok else 'NOT MET':>9}  {what}" for ok, what in targets(figures)]
    return "\n".join(lines)


def targets(figures: dict[str, Any]) -> list[tuple[bool, str]]:
    """Each gateway arm against direct, on the medians: as many streams at once (0.9 of
    direct's), TTFT within 1.5x, no refusal, no preemption."""
    median, runs = figures["median"], figures["runs"]
    direct = median[DIRECT]
    out = []
    for arm in (FRESH, WARM, REPLICA):
        m = median[arm]
        refused = [r["refused"] for r in runs[arm]]
        preempted = [r["preemptions"] for r in runs[arm]]
        at_once, ttft = m["streaming_max"], m["ttft_p50_s"]
        out += [
            (
                at_once >= 0.9 * direct["streaming_max"],
                f"{arm}: streaming at once ≥ 0.9 × direct's: {at_once:.0f} against "
                f"{direct['streaming_max']:.0f}",
            ),
            (
                ttft <= 1.5 * direct["ttft_p50_s"],
                f"{arm}: TTFT p50 ≤ 1.5 × direct's: {ttft:.3f} against "
                f"{direct['ttft_p50_s']:.3f} s",
            ),
            (not any(refused), f"{arm}: 0 refusals: {refused}"),
            (not any(preempted), f"{arm}: 0 preemptions: {preempted}"),
        ]
    warm, direct_p10 = median[WARM]["ttft_p10_s"], direct["ttft_p10_s"]
    out.append(
        (
            warm <= 1.5 * direct_p10,
            f"warm: TTFT p10 ≤ 1.5 × direct's: {warm:.3f} against {direct_p10:.3f} s",
        )
    )
    return out


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="spillgate bench warm-start", description=__doc__)
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    fleet.add_backend_args(p)
    p.add_argument("--burst", type=int, default=48)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--warmup", type=int, default=72, help="answers the warm gateway has seen")
    p.add_argument("--warmup-rate", type=float, default=8.0)
    p.add_argument(
        "--trickle-rate", type=float, default=1.0, help="per second, through the first replica"
    )
    p.add_argument("--trickle-s", type=float, default=8.0, help="how long the trickle lasts")
    p.add_argument("--max-tokens", type=int, default=2048)
    # chats of about 100 tokens
    p.add_argument("--prompt-tokens", default="uniform:64:128")
    p.add_argument("--seed", type=int, default=33)
    p.add_argument("--json", type=Path)
    p.add_argument("--logs", type=Path, help="keep the gateways' and simulators' output here")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    with logs_dir(args.logs, prefix="bench-warm-") as logs:
        figures = asyncio.run(run_bench(args, logs))
    figures["targets"] = targets(figures)
    figures["elapsed_s"] = time.monotonic() - started
    figures["load_average"] = os.getloadavg()[0]
    print(report(figures))
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1, default=str) + "\n")
        progress(f"wrote {args.json.resolve()}")
    return 0 if all(ok for ok, _ in figures["targets"]) else 1


if __name__ == "__main__":
    sys.exit(main())
