"""`spillgate bench disagg`: prefill and decode on different engines (issue 54), measured
through the gateway, on simulators (`kv_transfer_params`, as vLLM's NixlConnector) or on
two real vLLMs of the CPU build (`--real-vllm`: ExampleConnector, one shared folder).

    spillgate bench disagg                      # simulators in real time (a minute)
    spillgate bench disagg --real-vllm          # two real vLLMs (minutes)

Each scenario sends bursts of `--requests` streamed completions at once, each prompt about
`--prompt-tokens` tokens long and unique to its arm and round (no engine finds one cached),
every answer `--max-tokens` long (`ignore_eos`). Scenarios (`--scenarios`):

- `split`: engine 0 `role: prefill`, engine 1 `role: decode` (the `disaggregated` arm),
  against the same two engines as a unified pool, both `both` (the `unified` arm); each
  round runs both arms, in turn first, a fresh gateway each, the engines' prefix caches
  (and the shared folder) emptied between.
- `short`: the disaggregated pool, half the burst short prompts (`--short-tokens`): each
  short one decided `short` and served by the decode engine alone, each long one split.
- `decode-killed` (simulators only): one prefill and two decode engines; once a quarter of
  the burst's tokens have arrived, the first decode engine is SIGKILLed: its streams go on
  on the other (`continue_streams`).
- `prefill-stopped`: the disaggregated pool; once a quarter of the streams have their first
  token, the prefill engine is stopped as a pod is (SIGTERM, SIGKILL after `--grace` s) and
  not started again: the prefill legs in flight fail, the ones after find it out of
  rotation, and the decode engine prefills those prompts itself. On real vLLMs it runs
  last, on the engines `split` used.

Per arm: answers whole (status 200, no error event, a finish_reason, [DONE], usage with
every token asked for), client-visible failures (the others), TTFT p50 and p90 at the
client, the decode engines' prompt tokens loaded from elsewhere
(`vllm:prompt_tokens_by_source_total{source="external_kv_transfer"}`) over the prompt tokens
they were sent (`vllm:prompt_tokens_total`), the prefill engine's prompt tokens, the
gateway's decisions (`spillgate_prefill_decisions_total`) and continued streams
(`spillgate_stream_continuations_total`). Medians over the rounds. The command exits 1
when a check of issue 54's acceptance does not hold.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import statistics
import sys
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson

from loadtest.bench import admission_fleet
from loadtest.bench.disagg_fleet import KEY, MODEL, Fleet, fleet, gateway_config, reset
from loadtest.bench.engine_metrics import Counts, port_pair
from loadtest.bench.engine_metrics import samples as engine_samples
from loadtest.bench.machine import logs_dir, print_checked, progress
from loadtest.percentile import percentile_or_nan as percentile

SCENARIOS = ("split", "short", "decode-killed", "prefill-stopped")
SIM_ONLY = ("decode-killed",)
# the roles of each scenario's engines; None: the unified arm's pool
ROLES: dict[str, tuple[str, ...]] = {
    "split": ("prefill", "decode"),
    "short": ("prefill", "decode"),
    "decode-killed": ("prefill", "decode", "decode"),
    "prefill-stopped": ("prefill", "decode"),
}
WORDS = ("prefill", "decode", "engine", "block", "cache", "stream", "token", "prompt", "leg")
DECISIONS = ("split", "short", "no_room", "failed", "whole")
EXTERNAL = ("vllm:prompt_tokens_by_source_total", "external_kv_transfer")
PROMPT = ("vllm:prompt_tokens_total", "")
GENERATED = ("vllm:generation_tokens_total", "")
MIN_LOADED = 0.8  # of the prompt tokens a decode engine was sent: issue 54's bar


@dataclass(frozen=True, kw_only=True)
class Answer:
    status: int  # 0: no answer, or a stream broken off
    ttft_s: float | None = None
    whole: bool = False
    prompt_tokens: int | None = None
    problem: str | None = None  # what made it not whole


@dataclass
class Burst:
    """What a burst's streams have given so far, to wait on."""

    first_tokens: int = 0
    tokens: int = 0
    grew: asyncio.Event = field(default_factory=asyncio.Event)

    def add(self, *, first: bool) -> None:
        self.tokens += 1
        self.first_tokens += first
        self.grew.set()

    async def until(self, test: Callable[[Burst], bool]) -> None:
        while not test(self):
            self.grew.clear()
            await self.grew.wait()


async def ask(client: httpx.AsyncClient, url: str, body: dict[str, Any], burst: Burst) -> Answer:
    """One streamed completion, judged whole or not."""
    began = time.perf_counter()
    ttft: float | None = None
    done = finished = False
    usage: dict[str, Any] | None = None
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                await response.aread()
                return Answer(status=response.status_code, problem=f"status {response.status_code}")
            async for line in response.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: {"):
                    event = orjson.loads(line[6:])
                    if "error" in event:
                        return Answer(status=200, ttft_s=ttft, problem="error event")
                    usage = event.get("usage") or usage
                    for choice in event.get("choices") or ():
                        finished = finished or bool(choice.get("finish_reason"))
                        if choice.get("text"):
                            burst.add(first=ttft is None)
                            ttft = ttft if ttft is not None else time.perf_counter() - began
    except httpx.HTTPError as exc:
        return Answer(status=0, ttft_s=ttft, problem=type(exc).__name__)
    problem = None
    if not done or not finished:
        problem = "cut"
    elif usage is None or usage.get("completion_tokens") != body["max_tokens"]:
        problem = f"usage {usage}"
    prompt = usage.get("prompt_tokens") if usage else None
    return Answer(status=200, ttft_s=ttft, whole=problem is None, prompt_tokens=prompt,
                  problem=problem)  # fmt: skip


def samples(text: str) -> Counts:
    """A metrics page's samples by name and the label that tells them apart here (`source`,
    `decision`, `result`), summed over the others."""
    return engine_samples(text, by=("source", "decision", "result"))


async def counters(client: httpx.AsyncClient, url: str) -> Counts:
    """An engine's counters; none from one that is gone."""
    try:
        return samples((await client.get(f"{url}/metrics")).text)
    except httpx.HTTPError:
        return {}


def _delta(before: Counts, after: Counts, key: tuple[str, str]) -> float | None:
    return after[key] - before.get(key, 0.0) if key in after else None


def prompts(
    *, count: int, tokens: int, short: int | None, tokens_per_word: float, tag: str, seed: int
) -> list[tuple[str, bool]]:
    """`count` prompts of about `tokens` tokens, each beginning with its own tag (no two
    share a block); with `short`, every other one of about `short` tokens. Each with
    whether it is long."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        long = short is None or i % 2 == 0
        size = tokens if long else short or tokens
        words = max(1, round(size / tokens_per_word))
        out.append((f"{tag} {i}: " + " ".join(rng.choices(WORDS, k=words)), long))
    return out


def tokens_per_word(url: str) -> float:
    """What one of WORDS costs the engine's tokenizer, on average: prompts sized in words
    come out near the tokens asked for on the simulator and on the tiny Llama alike."""
    sample = " ".join(random.Random(0).choices(WORDS, k=400))
    with httpx.Client(timeout=60) as client:
        body = {"model": MODEL, "prompt": sample}
        count = client.post(f"{url}/tokenize", json=body).raise_for_status().json()["count"]
    return float(count) / 400


Fault = Callable[[Fleet, Burst], Awaitable[dict[str, Any]]]


async def run_arm(
    fleet_: Fleet,
    gateway_url: str,
    burst_prompts: list[tuple[str, bool]],
    *,
    roles: Sequence[str] | None,
    max_tokens: int,
    fault: Fault | None = None,
) -> dict[str, Any]:
    """The burst through the gateway at `gateway_url`, `fault` done meanwhile; figures."""
    headers = {"authorization": f"Bearer {KEY}"}
    engines = fleet_.engines
    async with httpx.AsyncClient(timeout=600, headers=headers) as client:
        before = [await counters(client, e.url) for e in engines]
        gateway_before = await counters(client, gateway_url)
        burst = Burst()
        bodies = [
            {
                "model": MODEL,
                "prompt": prompt,
                "stream": True,
                "stream_options": {"include_usage": True},
                "max_tokens": max_tokens,
                **fleet_.extra,
            }
            for prompt, _ in burst_prompts
        ]
        sent = asyncio.gather(*(ask(client, gateway_url, body, burst) for body in bodies))
        answers_future = asyncio.ensure_future(sent)
        faulted: dict[str, Any] = {}
        if fault is not None:
            faulted = await fault(fleet_, burst)
        answers = await answers_future
        after = [await counters(client, e.url) for e in engines]
        gateway_after = await counters(client, gateway_url)
    return figures(
        answers,
        burst_prompts,
        roles=roles,
        engines=(before, after),
        gateway=(gateway_before, gateway_after),
        fault=faulted,
    )


def figures(
    answers: list[Answer],
    burst_prompts: list[tuple[str, bool]],
    *,
    roles: Sequence[str] | None,
    engines: tuple[list[Counts], list[Counts]],
    gateway: tuple[Counts, Counts],
    fault: dict[str, Any],
) -> dict[str, Any]:
    ttfts = [a.ttft_s for a in answers if a.ttft_s is not None]
    roles_ = roles or ("both",) * len(engines[0])
    decode = [i for i, role in enumerate(roles_) if role != "prefill"]
    prefill = [i for i, role in enumerate(roles_) if role == "prefill"]

    def summed(indices: list[int], key: tuple[str, str]) -> float | None:
        values = [_delta(engines[0][i], engines[1][i], key) for i in indices]
        known = [v for v in values if v is not None]
        return sum(known) if known else None

    sent, loaded = summed(decode, PROMPT), summed(decode, EXTERNAL)
    gw_before, gw_after = gateway
    decisions = {
        d: _delta(gw_before, gw_after, ("spillgate_prefill_decisions_total", d)) or 0.0
        for d in DECISIONS
    }
    continued = {
        r: _delta(gw_before, gw_after, ("spillgate_stream_continuations_total", r)) or 0.0
        for r in ("succeeded", "failed")
    }
    problems: dict[str, int] = {}
    for a in answers:
        if a.problem is not None:
            problems[a.problem] = problems.get(a.problem, 0) + 1
    prompt_tokens = [a.prompt_tokens for a in answers if a.prompt_tokens is not None]
    return {
        "requests": len(answers),
        "long_prompts": sum(long for _, long in burst_prompts),
        "whole": sum(a.whole for a in answers),
        "failed": sum(not a.whole for a in answers),
        "problems": problems,
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p90_s": percentile(ttfts, 90),
        "prompt_tokens_mean": statistics.fmean(prompt_tokens) if prompt_tokens else None,
        "decode_prompt_tokens": sent,
        "decode_external_tokens": loaded,
        "decode_external_share": loaded / sent if sent and loaded is not None else None,
        # engine by engine: the prefill engine's are what it computed and its one token each
        "prefill_prompt_tokens": summed(prefill, PROMPT) if prefill else None,
        "prefill_generated_tokens": summed(prefill, GENERATED) if prefill else None,
        "decisions": decisions,
        "continued": continued,
        "fault": fault,
    }


def stop_prefill(grace_s: float, quarter_of: int) -> Fault:
    """Once a quarter of the streams have their first token, the prefill engine stopped as a
    pod is."""

    async def fault(fleet_: Fleet, burst: Burst) -> dict[str, Any]:
        await burst.until(lambda b: b.first_tokens >= max(1, quarter_of // 4))
        started = burst.first_tokens
        progress(f"stopping the prefill engine after {started} streams' first tokens")
        record = await asyncio.to_thread(fleet_.engines[0].stop, kill=False, grace_s=grace_s)
        return {"engine": fleet_.engines[0].name, "after_first_tokens": started, **record}

    return fault


def kill_decode(tokens: int) -> Fault:
    """Once a quarter of the burst's tokens have arrived, the first decode engine SIGKILLed."""

    async def fault(fleet_: Fleet, burst: Burst) -> dict[str, Any]:
        await burst.until(lambda b: b.tokens >= tokens // 4)
        at = burst.tokens
        progress(f"killing {fleet_.engines[1].name} after {at} tokens")
        record = await asyncio.to_thread(fleet_.engines[1].stop, kill=True, grace_s=0.0)
        return {"engine": fleet_.engines[1].name, "after_tokens": at, **record}

    return fault


@contextlib.contextmanager
def _gateway(config: dict[str, Any], *, workdir: Path, arm: str) -> Iterator[str]:
    with admission_fleet.gateway(config, workdir=workdir, arm=arm) as url:
        yield url


def run_scenario(
    scenario: str, fleet_: Fleet, args: argparse.Namespace, workdir: Path, per_word: float
) -> list[dict[str, Any]]:
    """Every round of the scenario's arms on `fleet_`."""
    rounds: list[dict[str, Any]] = []
    roles = ROLES[scenario]
    arms: tuple[tuple[str, tuple[str, ...] | None], ...] = (("disaggregated", roles),)
    if scenario == "split":
        arms = (("disaggregated", roles), ("unified", None))
    count = args.rounds if scenario in ("split", "short") else 1
    for n in range(count):
        for arm, arm_roles in arms if n % 2 == 0 else arms[::-1]:
            reset(fleet_)
            burst_prompts = prompts(
                count=args.requests,
                tokens=args.prompt_tokens,
                short=args.short_tokens if scenario == "short" else None,
                tokens_per_word=per_word,
                tag=f"{scenario} {arm} {n}",
                seed=args.seed + n,
            )
            fault: Fault | None = None
            if scenario == "prefill-stopped":
                fault = stop_prefill(args.grace, args.requests)
            elif scenario == "decode-killed":
                fault = kill_decode(args.requests * args.max_tokens)
            config = gateway_config(
                fleet_, arm_roles, min_prompt_tokens=args.min_prompt_tokens, refresh_s=args.refresh
            )
            with _gateway(config, workdir=workdir, arm=f"{scenario}-{arm}-{n}") as url:
                result = asyncio.run(
                    run_arm(
                        fleet_,
                        url,
                        burst_prompts,
                        roles=arm_roles,
                        max_tokens=args.max_tokens,
                        fault=fault,
                    )
                )
            rounds.append({"scenario": scenario, "arm": arm, "round": n, **result})
            progress(json.dumps(rounds[-1], default=str))
    return rounds


def _engines(args: argparse.Namespace, scenario: str, workdir: Path) -> Any:
    return fleet(
        len(ROLES[scenario]),
        real_vllm=args.real_vllm,
        ports=args.ports,
        kv_tokens=args.kv_tokens,
        sim_speed=args.sim_speed,
        workdir=workdir,
    )


def run_all(args: argparse.Namespace, scenarios: list[str], workdir: Path) -> list[dict[str, Any]]:
    """Each scenario on engines of its own (simulators start in a second); on real vLLMs
    every scenario on the same two, which `prefill-stopped`, last, stops."""
    rounds: list[dict[str, Any]] = []
    if args.real_vllm:
        with _engines(args, "split", workdir) as found:
            per_word = tokens_per_word(found.engines[0].url)
            _warm_up(found)
            for scenario in scenarios:
                rounds += run_scenario(scenario, found, args, workdir, per_word)
        return rounds
    for scenario in scenarios:
        with _engines(args, scenario, workdir) as found:
            per_word = tokens_per_word(found.engines[0].url)
            rounds += run_scenario(scenario, found, args, workdir, per_word)
    return rounds


def _warm_up(found: Fleet) -> None:
    """One short request to each engine: first uses out of the arms."""
    with httpx.Client(timeout=300) as client:
        for engine in found.engines:
            body = {"model": MODEL, "prompt": "warm up", "max_tokens": 4, **found.extra}
            client.post(f"{engine.url}/v1/completions", json=body).raise_for_status()


def summary(rounds: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each scenario's arms: medians over the rounds (a dict's values key by key)."""
    grouped: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for r in rounds:
        grouped.setdefault(r["scenario"], {}).setdefault(r["arm"], []).append(r)
    return {
        scenario: {arm: _median(runs) for arm, runs in arms.items()}
        for scenario, arms in grouped.items()
    }


def _median(runs: list[dict[str, Any]]) -> dict[str, Any]:
    merged: dict[str, Any] = {"rounds": len(runs)}
    for key, value in runs[0].items():
        if key in ("scenario", "round", "arm"):
            continue
        if key in ("problems", "fault"):  # every round's, as they were
            merged[key] = [r[key] for r in runs]
        elif isinstance(value, dict):
            merged[key] = {k: statistics.median(r[key][k] for r in runs) for k in value}
        else:
            values = [r[key] for r in runs]
            merged[key] = None if None in values else statistics.median(values)
    return merged


def met(scenario: str, arms: dict[str, Any]) -> dict[str, bool]:
    """Issue 54's acceptance, as far as this scenario shows it (every round's worst)."""
    d = arms["disaggregated"]
    checks = {f"{scenario}: every answer whole in every round": d["failed"] == 0}
    if scenario == "split":
        u = arms["unified"]
        checks["unified: every answer whole in every round"] = u["failed"] == 0
        share = d["decode_external_share"]
        checks[f"the decode engine loaded >= {MIN_LOADED} of the prompt tokens it was sent"] = (
            share is not None and share >= MIN_LOADED
        )
        checks["every request split"] = d["decisions"]["split"] == d["requests"]
    elif scenario == "short":
        short = d["requests"] - d["long_prompts"]
        checks["each short prompt decided short, each long one split"] = (
            d["decisions"]["short"] == short and d["decisions"]["split"] == d["long_prompts"]
        )
        checks["the prefill engine computed the long prompts alone"] = (
            d["prefill_generated_tokens"] == d["long_prompts"]
        )
    elif scenario == "decode-killed":
        checks["streams continued on the other decode engine"] = d["continued"]["succeeded"] > 0
    elif scenario == "prefill-stopped":
        decided = d["decisions"]
        checks["the stop mattered: requests decoded alone"] = (
            decided["failed"] + decided["no_room"] > 0
        )
    return checks


def _worst(rounds: list[dict[str, Any]], summary_: dict[str, dict[str, Any]]) -> None:
    """A check on answers holds only when it held in every round: the medians' failures
    are each arm's most."""
    for r in rounds:
        arm = summary_[r["scenario"]][r["arm"]]
        arm["failed"] = max(arm["failed"], r["failed"])


ROWS = (
    ("requests", "requests a round", "{:g}"),
    ("whole", "answers whole", "{:g}"),
    ("failed", "client-visible failures (most in a round)", "{:g}"),
    ("ttft_p50_s", "TTFT p50 (s)", "{:.3f}"),
    ("ttft_p90_s", "TTFT p90 (s)", "{:.3f}"),
    ("prompt_tokens_mean", "prompt tokens, mean", "{:.0f}"),
    ("decode_prompt_tokens", "prompt tokens sent to the decode engine(s)", "{:g}"),
    ("decode_external_tokens", "of them loaded (external_kv_transfer)", "{:g}"),
    ("decode_external_share", "share loaded", "{:.3f}"),
    ("prefill_prompt_tokens", "prompt tokens the prefill engine computed", "{:g}"),
    ("decisions", "gateway decisions", "{:g}"),
    ("continued", "streams continued", "{:g}"),
)


def table(scenario: str, arms: dict[str, Any]) -> str:
    names = list(arms)
    lines = [f"| {scenario} | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for key, label, fmt in ROWS:
        cells = []
        for arm in names:
            value = arms[arm][key]
            if value is None:
                cells.append("")
            elif isinstance(value, dict):
                cells.append(", ".join(f"{k} {fmt.format(v)}" for k, v in value.items() if v))
            else:
                cells.append(fmt.format(value))
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    if "unified" in arms:
        d, u = arms["disaggregated"]["ttft_p50_s"], arms["unified"]["ttft_p50_s"]
        lines.append(f"\nTTFT p50 disaggregated / unified: {d / u:.2f}x" if u else "")
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="spillgate bench disagg", description=__doc__)
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.add_argument("--real-vllm", action="store_true", help="two real vLLMs, not simulators")
    p.add_argument(
        "--scenarios",
        help=f"of {', '.join(SCENARIOS)} (default: all; with --real-vllm all but "
        f"{', '.join(SIM_ONLY)})",
    )
    p.add_argument("--rounds", type=int, default=3, help="rounds of split's and short's arms")
    p.add_argument("--requests", type=int, default=24, help="the burst's streams, sent at once")
    p.add_argument("--prompt-tokens", type=int, default=1500, help="a long prompt's length")
    p.add_argument("--short-tokens", type=int, default=60, help="a short prompt's (short)")
    p.add_argument("--max-tokens", type=int, default=64, help="every answer's length")
    p.add_argument(
        "--min-prompt-tokens", type=int, default=256, help="the pool's prefill.min_prompt_tokens"
    )
    p.add_argument("--grace", type=float, default=1.5, help="seconds from SIGTERM to SIGKILL")
    p.add_argument(
        "--kv-tokens", type=int, default=49_152, help="each engine's KV cache (a burst fits)"
    )
    p.add_argument("--refresh", type=float, default=1.0, help="the pool's capacity_refresh_s")
    p.add_argument("--sim-speed", type=float, default=1.0, help="the simulators' speed-up")
    p.add_argument("--ports", type=port_pair, default=(8131, 8132), help="the real vLLMs' ports")
    p.add_argument("--seed", type=int, default=54)
    p.add_argument("--json", type=Path, help="write every round and the summary here")
    p.add_argument("--logs", type=Path, help="keep the processes' output in this folder")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.scenarios is None:
        chosen = [s for s in SCENARIOS if not (args.real_vllm and s in SIM_ONLY)]
    else:
        chosen = args.scenarios.split(",")
    unknown = [s for s in chosen if s not in SCENARIOS]
    if unknown or (args.real_vllm and any(s in SIM_ONLY for s in chosen)):
        progress(f"--scenarios: of {', '.join(SCENARIOS)}; not {', '.join(SIM_ONLY)} on vLLM")
        return 2
    # the run's order, not the option's: stopping the prefill engine comes last
    scenarios = [s for s in SCENARIOS if s in chosen]
    with logs_dir(args.logs, prefix="spillgate-bench-disagg-") as workdir:
        rounds = run_all(args, scenarios, workdir)
    figures = summary(rounds)
    _worst(rounds, figures)
    checks = {name: met(name, arms) for name, arms in figures.items()}
    backend = "real-vllm" if args.real_vllm else "simulator"
    print(
        f"{backend}: bursts of {args.requests} streams at once, prompts of ~{args.prompt_tokens}"
        f" tokens, answers of {args.max_tokens}",
        end="\n\n",
    )
    status = print_checked(figures, checks, table)
    if args.json is not None:
        report = {
            "backend": backend,
            "options": {k: v for k, v in vars(args).items() if k != "json"},
            "summary": figures,
            "checks": checks,
            "rounds": rounds,
        }
        args.json.write_text(json.dumps(report, indent=2, default=str))
    return status


if __name__ == "__main__":
    sys.exit(main())
