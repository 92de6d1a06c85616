"""`spillgate drill`: a scripted spike that proves every overflow path engages, or fails loudly.

Without `--url` (or a `-c FILE` that names one) it starts `spillgate demo` on a free port
and drills that. It prints one PASS/FAIL line per check and exits 1 on any failure, so it
can gate a deploy pipeline.

A drill file is YAML with any of: url, key, admin_token, model, and the DrillScript
fields (baseline_rate, spike_factor, warmup_s, spike_s, recovery_s, prompt_tokens,
output_tokens, repeat_fraction, stream_fraction, shared_prefix_tokens, slo_ttft_ms,
drain_timeout_s, seed).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

from gateway.admission.fleet.metrics_text import samples
from loadtest.drill.batch import BatchProbe
from loadtest.drill.checks import Check, evaluate, shared_prefix_cached
from loadtest.drill.demo import DemoProcess
from loadtest.loadgen.cli import run_loop
from loadtest.loadgen.client import RequestShape
from loadtest.loadgen.run import RunData, RunTarget, run_schedule
from loadtest.loadgen.schedule import ArrivalProfile, arrival_times
from loadtest.loadgen.scrape import Scraper
from loadtest.loadgen.stats import LagVerdict, prefix_cache
from loadtest.loadgen.workload import LengthDist, TenantKey, Workload, plan_requests

DEMO_MODEL = "llama-3.1-70b"


@dataclass(frozen=True, kw_only=True)
class DrillScript:
    """The spike: a baseline, a burst of `spike_factor` x baseline, then recovery.

    A share of requests repeat a few fixed greedy prompts, so the response cache (which
    stores reproducible answers) has something to answer from during the spike. With
    `shared_prefix_tokens`, every request starts with the same system prompt of about that
    many tokens, and a check asks the backends' prefix caches to have found it.
    """

    baseline_rate: float = 3.0
    spike_factor: float = 14.0
    warmup_s: float = 1.5
    spike_s: float = 3.0
    recovery_s: float = 1.5
    prompt_tokens: str = "uniform:400:600"
    output_tokens: str = "uniform:120:200"
    repeat_fraction: float = 0.3
    stream_fraction: float = 0.8
    shared_prefix_tokens: int = 0
    slo_ttft_ms: float = 3000.0
    drain_timeout_s: float = 15.0
    sample_interval_s: float = 0.05
    seed: int = 0

    @property
    def profile(self) -> ArrivalProfile:
        return ArrivalProfile(
            kind="spike", rate=self.baseline_rate, spike_factor=self.spike_factor,
            spike_start_s=self.warmup_s, spike_duration_s=self.spike_s,
            duration_s=self.warmup_s + self.spike_s + self.recovery_s,
        )  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class DrillTarget:
    url: str
    key: str
    admin_token: str
    model: str


TARGET_KEYS = {"url", "key", "admin_token", "model"}


def load_drill_file(path: Path) -> tuple[dict[str, Any], DrillScript]:
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a drill file is a mapping of settings")
    fields = {f.name for f in dataclasses.fields(DrillScript)}
    unknown = sorted(set(data) - fields - TARGET_KEYS)
    if unknown:
        raise ValueError(
            f"{path}: unknown settings {unknown} (known: {sorted(fields | TARGET_KEYS)})"
        )
    target = {k: v for k, v in data.items() if k in TARGET_KEYS}
    return target, DrillScript(**{k: v for k, v in data.items() if k in fields})


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-c", "--config", type=Path, help="drill file (YAML)")
    parser.add_argument("--url", help="gateway to drill (default: start `spillgate demo`)")
    parser.add_argument("--key", help="tenant API key")
    parser.add_argument("--admin-token", help="the gateway's admin token")
    parser.add_argument("--model", help=f"pool to drill (default: {DEMO_MODEL} on the demo)")
    parser.add_argument("--slo-ttft-ms", type=float, help="p99 TTFT bound for local requests")
    parser.add_argument(
        "--shared-prefix-tokens",
        type=int,
        metavar="N",
        help="start every request with one system prompt of about N tokens, and check that "
        "the backends' prefix caches found it",
    )
    parser.add_argument("--demo-speed", type=float, default=1.0, help="demo simulator speed")
    parser.add_argument("--json", type=Path, metavar="FILE", help="write the verdicts as JSON")


async def upstream_errors(scraper: Scraper) -> dict[str, float]:
    """The gateway's failed upstream attempts during its life, as 'target/reason' → count."""
    assert scraper.gateway_url is not None
    response = await scraper.client.get(f"{scraper.gateway_url}/metrics")
    response.raise_for_status()
    return {
        f"{s.labels.get('target')}/{s.labels.get('reason')}": s.value
        for s in samples(response.text, ("spillgate_upstream_errors_total",))
    }


async def _status(scraper: Scraper) -> dict[str, Any] | None:
    try:
        status = await scraper.status()
        status["queue_depth"] = await scraper.queue_depth()
    except (httpx.HTTPError, KeyError, ValueError):
        return None
    return status


async def wait_released(
    scraper: Scraper, *, timeout_s: float
) -> tuple[dict[str, Any] | None, float]:
    """Poll /admin/status until nothing is held or queued; the last status and the wait."""
    start = time.monotonic()
    status = await _status(scraper)
    while time.monotonic() - start < timeout_s:
        if status is not None and not _held(status):
            break
        await asyncio.sleep(0.1)
        status = await _status(scraper)
    return status, time.monotonic() - start


def _held(status: dict[str, Any]) -> bool:
    backends = [b for p in status["pools"] for b in p["backends"]]
    busy = any(b["tokens_in_flight"] or b["active_sessions"] for b in backends)
    return busy or any(status.get("queue_depth", {}).values())


async def drill(target: DrillTarget, script: DrillScript) -> tuple[list[Check], RunData]:
    async with httpx.AsyncClient(timeout=5.0) as client:
        scraper = Scraper(client=client, gateway_url=target.url, admin_token=target.admin_token)
        status = await scraper.status()
        errors_before = await upstream_errors(scraper)
    pools = {p["name"]: p for p in status["pools"]}
    if target.model not in pools:
        raise ValueError(f"no pool {target.model!r} at {target.url} (pools: {sorted(pools)})")
    chain = pools[target.model]["overflow"]
    backends = [b["url"] for p in status["pools"] for b in p["backends"]]
    workload = Workload(
        model=target.model,
        prompt_tokens=LengthDist.parse(script.prompt_tokens),
        output_tokens=LengthDist.parse(script.output_tokens),
        tenants=[TenantKey(name="drill", key=target.key)],
        stream_fraction=script.stream_fraction,
        repeat_fraction=script.repeat_fraction,
        prime_repeats=True,
        shared_prefix_tokens=script.shared_prefix_tokens,
    )
    profile = script.profile
    plans = plan_requests(arrival_times(profile, seed=script.seed), workload, seed=script.seed)
    run_target = RunTarget(
        label="drill", urls=[target.url], keys={"drill": target.key},
        shape=RequestShape(model=target.model, timeout_s=60.0), admin_token=target.admin_token,
        backend_urls=backends, sample_queue_depth=False,
    )  # fmt: skip
    # with a `batch` step, requests that may wait go in at the spike's peak (drill/batch.py)
    probe = None
    if "batch" in chain:
        probe = BatchProbe(url=target.url, key=target.key, model=target.model)
    load = run_schedule(
        plans, target=run_target, duration_s=profile.duration_s,
        sample_interval_s=script.sample_interval_s,
    )  # fmt: skip
    if probe is None:
        data = await load
    else:
        peak_s = script.warmup_s + script.spike_s / 2
        data, _ = await asyncio.gather(load, probe.spike(after_s=peak_s))
    async with httpx.AsyncClient(timeout=5.0) as client:
        scraper = Scraper(client=client, gateway_url=target.url, admin_token=target.admin_token)
        final, waited = await wait_released(scraper, timeout_s=script.drain_timeout_s)
        errors = await upstream_errors(scraper)
    checks = evaluate(
        data, chain=[p for p in chain if p != "batch"], slo_ttft_s=script.slo_ttft_ms / 1000,
        final=final, waited_s=waited,
        upstream_errors={k: v - errors_before.get(k, 0.0) for k, v in errors.items()},
    )  # fmt: skip
    if script.shared_prefix_tokens > 0:
        checks.append(shared_prefix_cached(data.prefix_counters, plans=plans))
    if probe is not None:
        checks += probe.checks(await probe.drained(timeout_s=script.drain_timeout_s))
    return checks, data


def _header(target: DrillTarget, script: DrillScript, n: int) -> str:
    peak = script.baseline_rate * script.spike_factor
    return (
        f"spillgate drill: pool {target.model} at {target.url}: {n} requests, "
        f"{script.baseline_rate:g}/s for {script.warmup_s:g}s, {peak:g}/s for {script.spike_s:g}s,"
        f" {script.baseline_rate:g}/s for {script.recovery_s:g}s"
    )


def verdicts(
    target: DrillTarget, script: DrillScript, checks: list[Check], data: RunData
) -> dict[str, Any]:
    """What `--json` writes: the verdict, each check, and what the spike saw."""
    lag = LagVerdict(tolerance_s=0.05).check([r.lag_s for r in data.results])
    return {
        "passed": all(c.passed for c in checks),
        "target": {"url": target.url, "model": target.model},
        "script": dataclasses.asdict(script),
        "checks": [dataclasses.asdict(c) for c in checks],
        "requests": len(data.results),
        "outcomes": dict(Counter(r.outcome for r in data.results)),
        "lag": lag,
        "prefix_cache": prefix_cache(data.prefix_counters),
    }


def prefix_note(cache: dict[str, Any]) -> str:
    if cache["hit_rate"] is None:
        return "backends' prefix-cache hit rate: - (no backend reported its counters)"
    return (
        f"backends' prefix-cache hit rate {cache['hit_rate'] * 100:.1f} % "
        f"({cache['hits']:,.0f} of {cache['queries']:,.0f} prompt tokens)"
    )


def report(
    target: DrillTarget,
    script: DrillScript,
    checks: list[Check],
    data: RunData,
    *,
    json_path: Path | None = None,
) -> int:
    result = verdicts(target, script, checks, data)
    if json_path is not None:
        json_path.write_text(json.dumps(result, indent=1) + "\n", "utf-8")
        print(f"wrote {json_path.resolve()}", file=sys.stderr)
    print(_header(target, script, len(data.results)))
    for check in checks:
        print(check.line())
    lag = result["lag"]
    state = "as scripted" if lag["kept_schedule"] else "LATE (the generator fell behind)"
    print(f"note  spike delivered {state}: send lag p99 {lag['p99_ms']} ms")
    print(f"note  {prefix_note(result['prefix_cache'])}")
    failed = [c for c in checks if not c.passed]
    if failed:
        print(f"drill FAILED: {len(failed)} of {len(checks)} checks failed")
        return 1
    print(f"drill passed: {len(checks)} checks")
    return 0


def resolve_inputs(args: argparse.Namespace) -> tuple[dict[str, Any], DrillScript]:
    given: dict[str, Any] = {}
    script = DrillScript()
    if args.config is not None:
        given, script = load_drill_file(args.config)
    for name in TARGET_KEYS:
        if getattr(args, name, None) is not None:
            given[name] = getattr(args, name)
    if args.slo_ttft_ms is not None:
        script = dataclasses.replace(script, slo_ttft_ms=args.slo_ttft_ms)
    if args.shared_prefix_tokens is not None:
        script = dataclasses.replace(script, shared_prefix_tokens=args.shared_prefix_tokens)
    return given, script


def run(args: argparse.Namespace) -> int:
    try:
        given, script = resolve_inputs(args)
        if given.get("url"):
            missing = sorted({"key", "admin_token", "model"} - set(given))
            if missing:
                print(f"spillgate drill: with a URL, also give {missing}", file=sys.stderr)
                return 2
            target = DrillTarget(**given)
            return report(target, script, *run_loop(drill(target, script)), json_path=args.json)
        with DemoProcess(speed=args.demo_speed) as demo:
            target = DrillTarget(url=demo.url, key=demo.api_key, admin_token=demo.admin_token,
                                 model=given.get("model", DEMO_MODEL))  # fmt: skip
            return report(target, script, *run_loop(drill(target, script)), json_path=args.json)
    except (ValueError, TypeError, OSError, httpx.HTTPError, TimeoutError) as exc:
        print(f"spillgate drill: {exc}", file=sys.stderr)
        return 2
