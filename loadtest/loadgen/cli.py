"""`spillgate loadtest`: an open-loop load generator that speaks streaming OpenAI.

Arrivals follow a fixed schedule (constant, Poisson, gamma or spike), so a slow answer
never slows the load; the report says so if the generator itself fell behind. With
`--compare-direct` the same schedule is replayed straight at the backends, no gateway, and
both runs report what the backends' engines said meanwhile (running, KV use, preemptions,
prefix-cache hit rate). `--shared-prefix-tokens` and `--turns` make the workload one a
prefix cache serves: per-tenant system prompts and multi-turn chats.
By default answers end where the model ends them: each request asks a generous max_tokens
and sends its own seed, so both runs get the same answers; `--fixed-lengths` sends
`ignore_eos` so each answer runs to its drawn max_tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections.abc import Coroutine, Sequence
from pathlib import Path
from typing import Any, TypeVar

import httpx

from loadtest.loadgen.client import RequestShape
from loadtest.loadgen.html import write_html
from loadtest.loadgen.progress import Progress
from loadtest.loadgen.run import RunData, RunTarget, run_schedule
from loadtest.loadgen.schedule import PROFILES, ArrivalProfile, arrival_times
from loadtest.loadgen.scrape import Scraper
from loadtest.loadgen.stats import LagVerdict, Slo, report
from loadtest.loadgen.text import comparison_text, first_error_line, summary_text
from loadtest.loadgen.workload import (
    LengthDist,
    PlannedRequest,
    TenantKey,
    Workload,
    parse_token_ids,
    plan_requests,
)

ADMIN_ENV = "SPILLGATE_ADMIN_TOKEN"
DRAIN_TIMEOUT_S = 60.0
# Generous, as real clients are: the answer, not the cap, decides how long it runs
DEFAULT_MAX_TOKENS = 2048
FIXED_OUTPUT_TOKENS = "uniform:32:256"
T = TypeVar("T")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    p = parser
    p.add_argument("--url", required=True, help="gateway (or any OpenAI server) base URL")
    p.add_argument("--key", action="append", default=[], metavar="[NAME=]KEY",
                   help="API key of a tenant; repeat for several tenants")  # fmt: skip
    p.add_argument("--model", required=True, help="the model each request names")
    p.add_argument(
        "--admin-token",
        default=os.environ.get(ADMIN_ENV),
        help=f"gateway admin token, to sample /admin/status (default: ${ADMIN_ENV})",
    )
    a = p.add_argument_group("arrivals")
    a.add_argument("--profile", choices=PROFILES, default="poisson", help="how arrivals come")
    a.add_argument("--rate", type=float, default=10.0, help="arrivals/s (spike: the baseline)")
    a.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals")
    a.add_argument("--cv", type=float, default=2.0, help="gamma: variation of the gaps")
    a.add_argument("--spike-factor", type=float, default=5.0, help="the spike's rate ÷ --rate")
    a.add_argument("--spike-start", type=float, default=10.0, help="seconds")
    a.add_argument("--spike-duration", type=float, default=10.0, help="seconds")
    a.add_argument("--seed", type=int, default=0, help="seeds arrivals, lengths and prompts")
    w = p.add_argument_group("requests")
    w.add_argument("--prompt-tokens", default="uniform:64:256", help="e.g. 128, normal:200:50")
    w.add_argument(
        "--max-tokens",
        type=int,
        default=DEFAULT_MAX_TOKENS,
        help="max_tokens of every request; answers end where the model ends them "
        "(default %(default)s; each request sends a seed, so runs repeat their answers)",
    )
    w.add_argument(
        "--output-tokens",
        help=f"draw each request's max_tokens from this instead, e.g. 128, lognormal:128:0.6 "
        f"(with --fixed-lengths default {FIXED_OUTPUT_TOKENS})",
    )
    w.add_argument(
        "--fixed-lengths",
        action="store_true",
        help="every answer runs to its max_tokens (sends ignore_eos): the old fixed-length "
        "workload",
    )
    w.add_argument(
        "--stop-token-ids",
        type=parse_token_ids,
        default=(),
        metavar="IDS",
        help="send these stop_token_ids, e.g. 8-23 (a random-weight vLLM then ends answers)",
    )
    w.add_argument("--stream-fraction", type=float, default=1.0, help="share streamed")
    w.add_argument(
        "--no-stream",
        dest="stream_fraction",
        action="store_const",
        const=0.0,
        help="whole answers only",
    )
    w.add_argument(
        "--repeat-fraction",
        type=float,
        default=0.0,
        help="share repeating a few fixed greedy requests (exercises a cache)",
    )
    w.add_argument(
        "--shared-prefix-tokens",
        type=int,
        default=0,
        metavar="N",
        help="each tenant's requests start with its own system prompt of about N tokens, the "
        "same text every time (from --seed and the tenant's name): a prefix cache's workload",
    )
    w.add_argument(
        "--turns",
        type=int,
        default=1,
        metavar="K",
        help="chats of K requests: each later turn resends the chat so far (answers made up)",
    )
    w.add_argument(
        "--endpoint", choices=("chat", "completions"), default="chat", help="the API it calls"
    )
    w.add_argument("--timeout", type=float, default=120.0, help="per request, seconds")
    w.add_argument("--header", action="append", default=[], type=header, metavar="NAME:VALUE",
                   help="send this header with every request to the gateway (repeatable), "
                   "e.g. 'x-spillgate-ttft-ms: 2000'")  # fmt: skip
    r = p.add_argument_group("report")
    r.add_argument(
        "--slo-ttft-ms",
        type=float,
        default=2000.0,
        help="TTFT a request must meet to count as good",
    )
    r.add_argument(
        "--slo-itl-ms", type=float, default=100.0, help="inter-token latency, the same way"
    )
    r.add_argument(
        "--lag-tolerance-ms",
        type=float,
        default=20.0,
        help="the p99 lateness of sends past which the report says the generator fell behind",
    )
    r.add_argument("--sample-interval", type=float, default=0.5, help="fleet sampling, seconds")
    r.add_argument("--json", type=Path, metavar="FILE", help="write every figure as JSON")
    r.add_argument("--html", type=Path, metavar="FILE", help="write a self-contained report")
    r.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="live progress on stderr (default: when stderr is a terminal)",
    )
    c = p.add_argument_group("comparison")
    c.add_argument(
        "--compare-direct",
        action="append",
        default=[],
        metavar="URL",
        help="replay the schedule straight at this backend (repeat: round-robin)",
    )
    c.add_argument("--direct-model", help="model name the backend serves (default: its first)")
    c.add_argument("--direct-key", help="API key for the backend, if it wants one")
    c.add_argument(
        "--backend",
        action="append",
        default=[],
        metavar="URL",
        help="backend whose preemptions to count (default: from /admin/status)",
    )


def output_spec(args: argparse.Namespace) -> str | None:
    """The distribution max_tokens is drawn from, or None: every request asks --max-tokens."""
    return args.output_tokens or (FIXED_OUTPUT_TOKENS if args.fixed_lengths else None)


def build_plans(args: argparse.Namespace) -> tuple[ArrivalProfile, list[PlannedRequest]]:
    profile = ArrivalProfile(
        kind=args.profile, rate=args.rate, duration_s=args.duration, cv=args.cv,
        spike_factor=args.spike_factor, spike_start_s=args.spike_start,
        spike_duration_s=args.spike_duration,
    )  # fmt: skip
    tenants = TenantKey.parse_all(args.key) or [TenantKey(name="t0", key="")]
    output = output_spec(args)
    if args.max_tokens < 1:
        raise ValueError("--max-tokens must be positive")
    if args.shared_prefix_tokens < 0 or args.turns < 1:
        raise ValueError("--shared-prefix-tokens must be 0 or more, --turns 1 or more")
    workload = Workload(
        model=args.model,
        prompt_tokens=LengthDist.parse(args.prompt_tokens),
        output_tokens=LengthDist.parse(output or FIXED_OUTPUT_TOKENS),  # drawn either way
        max_tokens=None if output else args.max_tokens,
        ignore_eos=args.fixed_lengths,
        stop_token_ids=args.stop_token_ids,
        seeded=not args.fixed_lengths,
        tenants=tenants,
        stream_fraction=args.stream_fraction,
        repeat_fraction=args.repeat_fraction,
        endpoint=args.endpoint,
        shared_prefix_tokens=args.shared_prefix_tokens,
        turns=args.turns,
    )
    return profile, plan_requests(arrival_times(profile, seed=args.seed), workload, seed=args.seed)


async def gateway_backends(url: str, admin_token: str, model: str) -> list[str]:
    """The URLs of the backends of pool `model`, from the gateway's /admin/status."""
    async with httpx.AsyncClient(timeout=5.0) as client:
        status = await Scraper(client=client, gateway_url=url, admin_token=admin_token).status()
    return [b["url"] for p in status["pools"] if p["name"] == model for b in p["backends"]]


async def served_model(url: str, key: str | None) -> str:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    async with httpx.AsyncClient(timeout=5.0) as client:
        response = await client.get(f"{url.rstrip('/')}/v1/models", headers=headers)
        response.raise_for_status()
        return str(response.json()["data"][0]["id"])


async def wait_idle(urls: Sequence[str], *, timeout_s: float = DRAIN_TIMEOUT_S) -> bool:
    """Until no backend runs or queues anything (so the next run starts on an idle fleet)."""
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(timeout=2.0) as client:
        scraper = Scraper(client=client, backend_urls=urls)
        while time.monotonic() < deadline:
            states = await scraper.backends()
            if all(s["running"] + s["waiting"] == 0 for s in states.values()):
                return True
            await asyncio.sleep(0.2)
    return False


async def _replay(
    args: argparse.Namespace, plans: list[PlannedRequest], target: RunTarget, duration_s: float
) -> RunData:
    show = args.progress if args.progress is not None else sys.stderr.isatty()
    progress = Progress(total=len(plans), duration_s=duration_s, label=target.label)
    return await run_schedule(
        plans,
        target=target,
        duration_s=duration_s,
        sample_interval_s=args.sample_interval,
        progress=progress if show else None,
    )


def header(text: str) -> tuple[str, str]:
    """`NAME:VALUE` as a header pair."""
    name, colon, value = text.partition(":")
    if not colon or not name.strip():
        raise argparse.ArgumentTypeError(f"expected NAME:VALUE, not {text!r}")
    return name.strip().lower(), value.strip()


async def _direct_target(
    args: argparse.Namespace, keys: dict[str, str], pool_backends: list[str]
) -> RunTarget:
    urls = [u for u in args.compare_direct if u != "auto"]
    if "auto" in args.compare_direct:
        if not pool_backends:
            raise ValueError("--compare-direct auto needs --admin-token to find the backends")
        urls += pool_backends
    model = args.direct_model or await served_model(urls[0], args.direct_key)
    shape = RequestShape(model=model, endpoint=args.endpoint, timeout_s=args.timeout)
    direct_keys = {t: args.direct_key for t in keys} if args.direct_key else {}
    return RunTarget(label="direct", urls=urls, keys=direct_keys, shape=shape, backend_urls=urls)


async def run_all(args: argparse.Namespace) -> tuple[ArrivalProfile, list[RunData]]:
    profile, plans = build_plans(args)
    keys = {t.name: t.key for t in TenantKey.parse_all(args.key)}
    pool_backends = []
    if args.admin_token:
        pool_backends = await gateway_backends(args.url, args.admin_token, args.model)
    backends = list(args.backend) or pool_backends
    shape = RequestShape(model=args.model, endpoint=args.endpoint, timeout_s=args.timeout,
                         headers=tuple(args.header))  # fmt: skip
    gateway = RunTarget(label="gateway", urls=[args.url], keys=keys, shape=shape,
                     admin_token=args.admin_token, backend_urls=backends)  # fmt: skip
    runs = [await _replay(args, plans, gateway, profile.duration_s)]
    if args.compare_direct:
        direct = await _direct_target(args, keys, pool_backends)
        await wait_idle(direct.urls)
        runs.append(await _replay(args, plans, direct, profile.duration_s))
    return profile, runs


def run_loop(coro: Coroutine[Any, Any, T]) -> T:
    """uvloop when installed (it roughly halves the generator's cost per stream)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    result: T = uvloop.run(coro)
    return result


def config_of(args: argparse.Namespace, profile: ArrivalProfile, n: int) -> dict[str, Any]:
    return {
        "url": args.url, "model": args.model, "profile": profile.kind, "rate": profile.rate,
        "duration_s": profile.duration_s, "spike_factor": profile.spike_factor if
        profile.kind == "spike" else None, "requests": n, "prompt_tokens": args.prompt_tokens,
        "output_tokens": output_spec(args), "max_tokens": None if output_spec(args) else
        args.max_tokens, "fixed_lengths": args.fixed_lengths,
        "stop_token_ids": list(args.stop_token_ids), "stream_fraction": args.stream_fraction,
        "shared_prefix_tokens": args.shared_prefix_tokens, "turns": args.turns,
        "tenants": [t.name for t in TenantKey.parse_all(args.key)], "seed": args.seed,
        "compare_direct": args.compare_direct,
    }  # fmt: skip


def run(args: argparse.Namespace) -> int:
    try:
        profile, runs = run_loop(run_all(args))
    except (ValueError, httpx.HTTPError) as exc:
        print(f"spillgate loadtest: {exc}", file=sys.stderr)
        return 2
    slo = Slo(ttft_s=args.slo_ttft_ms / 1000, itl_s=args.slo_itl_ms / 1000)
    lag = LagVerdict(tolerance_s=args.lag_tolerance_ms / 1000)
    data = report(runs, slo=slo, lag=lag, config=config_of(args, profile, len(runs[0].results)))
    summaries = [r["summary"] for r in data["runs"]]
    print("\n\n".join(summary_text(s) for s in summaries))
    if len(summaries) == 2:
        print("\n" + comparison_text(summaries[0], summaries[1]))
    if args.json:
        args.json.write_text(json.dumps(data, indent=1) + "\n", "utf-8")
        print(f"wrote {args.json.resolve()}", file=sys.stderr)
    if args.html:
        write_html(args.html, data)
        print(f"wrote {args.html.resolve()}", file=sys.stderr)
    return _verdict(summaries)


def _verdict(summaries: list[dict[str, Any]]) -> int:
    """1 when most requests of a run failed (refused by the gateway is not failed)."""
    failing = [s for s in summaries if s["failed"] * 2 > s["requests"]]
    for s in failing:
        print(f"spillgate loadtest: {s['label']}: {first_error_line(s)}", file=sys.stderr)
    return 1 if failing else 0
