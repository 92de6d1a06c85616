"""Runs guidellm and inference-perf direct and through Spillgate; one table per run.

    loadtest/tools/setup.sh                      # once: both tools, each in its own venv
    spillgate bench tools demo                   # `spillgate demo`: a backend vs the gateway
    spillgate bench tools vllm                   # a real vLLM (loadtest/real_vllm) vs the
                                                 # gateway in front of it
    spillgate bench tools prefix                 # their shared-prefix workloads through the
                                                 # gateway on 4 simulated backends:
                                                 # routing least_filled vs prefix

Every arm runs the same config (configs/, filled in by configs.py) with a seed of its own:
the backends cache prompt prefixes, and an arm replaying the previous arm's prompts would
find them cached. `--tools guidellm` (or `inference-perf`) runs one tool only; `--rate` and
`--duration` override the configs'; `--out DIR` keeps every config, log and result file
(default: a new folder under /tmp). The tools read a local tokenizer (the tiny Llama's of
loadtest/real_vllm, made here when missing); nothing is downloaded.

Cores, on a two-core machine: `vllm` puts the whole vLLM server on core 0 and this
process, the gateway and the tools (children inherit it) on core 1; the simulators of
`demo` and `prefix` share both cores with the rest.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import secrets
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx

from gateway.config import hash_key
from loadtest import real_vllm
from loadtest.bench import admission_fleet as fleet
from loadtest.bench import prefix as prefix_bench
from loadtest.loadgen.scrape import backend_state
from loadtest.procs import free_port, wait_for_port
from loadtest.tools import TOOLS, configs, results, venv
from loadtest.tools.configs import Target

TOOL_TIMEOUT_S = 900.0
SLO = {  # as the configs state them
    "steady": "TTFT <= 200 ms and ITL <= 20 ms",
    "shared-prefix": "TTFT <= 50 ms and ITL <= 20 ms",
}
# the tools' settings that would otherwise reach for the Hugging Face hub
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "DO_NOT_TRACK": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}  # fmt: skip
PREFIX_BACKENDS = 4
# Each backend's cache holds about half of the 64 prefixes (about 2,100 tokens each, by the
# simulator's count), so least_filled, which sends every prefix everywhere, makes them
# evict; prefix routing's quarter fits. The backends must also be large beside one request:
# the router moves a request off its prefix's backend once that one holds a tenth of its
# capacity more than the others, and at 16,384 tokens that is less than one of these
# requests (a 15 s trial there: hit rate 0.46 with prefix routing, 0.37 without).
PREFIX_KV_TOKENS = 65_536


def check_installed(tools: Sequence[str]) -> None:
    missing = [t for t in tools if not (venv(t) / "bin" / t).exists()]
    if missing:
        raise SystemExit(f"not installed: {', '.join(missing)}; run loadtest/tools/setup.sh")


def run_tool(
    tool: str, workload: str, target: Target, *, out: Path, seed: int, args: argparse.Namespace
) -> results.Figures:
    cmd = configs.write(
        tool, workload, target, out=out, seed=seed, rate=args.rate, duration_s=args.duration
    )
    print(f"  {tool} -> {target.url} ({target.model}): {out}", file=sys.stderr, flush=True)
    with (out / f"{tool}.log").open("wb") as log:
        done = subprocess.run(
            cmd, cwd=out, stdout=log, stderr=subprocess.STDOUT, timeout=TOOL_TIMEOUT_S,
            env={**os.environ, **OFFLINE},
        )  # fmt: skip
    if done.returncode != 0:
        tail = (out / f"{tool}.log").read_text(errors="replace")[-3000:]
        raise RuntimeError(f"{tool} exited {done.returncode}; its log ends:\n{tail}")
    return results.read(tool, out)


# --- demo: `spillgate demo`, one of its backends direct vs the gateway ----------------

BACKENDS_LINE = re.compile(
    r"llama-3\.1-70b: (?P<urls>(?:http\S+\s+)+)\(serving (?P<served>[^)]+)\)"
)


def parse_banner(text: str) -> tuple[list[str], str]:
    """The large pool's backend URLs and their served model, from the demo's banner."""
    found = BACKENDS_LINE.search(text)
    if found is None:
        raise ValueError("no llama-3.1-70b backends line in the demo's banner")
    return found["urls"].split(), found["served"]


@contextlib.contextmanager
def demo(workdir: Path) -> Iterator[tuple[str, str, list[str], str]]:
    """`spillgate demo` (answers run to max_tokens, as both tools ask with ignore_eos):
    yields its URL, API key, the large pool's backends and their served model."""
    port, key = free_port(), "sk-tools-" + secrets.token_hex(8)
    log = workdir / "demo.log"
    cmd = [sys.executable, "-m", "gateway.cli", "demo", "--port", str(port), "--api-key", key,
           "--answer-lengths", "max_tokens"]  # fmt: skip
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while "Press Ctrl-C" not in log.read_text(errors="replace"):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the demo did not start:\n{log.read_text()[-2000:]}")
            time.sleep(0.2)
        wait_for_port(port)
        urls, served = parse_banner(log.read_text())
        fleet.wait_ready(f"http://127.0.0.1:{port}")
        yield f"http://127.0.0.1:{port}", key, urls, served
    finally:
        proc.terminate()  # the demo stops its simulators on SIGTERM
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()


def run_demo(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    figures: dict[str, Any] = {}
    with demo(out) as (url, key, backends, served):
        arms = {
            "direct": Target(url=backends[0], model=served),
            "spillgate": Target(url=url, model="llama-3.1-70b", api_key=key),
        }
        for tool in args.tools:
            got = {}
            for seed, (arm, target) in enumerate(arms.items(), start=1):
                got[arm] = run_tool(
                    tool, "steady", target, out=out / tool / arm, seed=seed, args=args
                )
            figures[tool] = {"arms": got}
            print(results.report(f"{tool}, spillgate demo", got, slo=SLO["steady"]), flush=True)
    return figures


# --- vllm: a real vLLM direct vs the gateway in front of it ---------------------------


def vllm_gateway_config(url: str) -> dict[str, Any]:
    backend = {"url": url, "served_model": real_vllm.MODEL, "capacity": "auto"}
    return {
        "tenants": [{"name": fleet.TENANT, "key_sha256": hash_key(fleet.KEY),
                     "requests_per_minute": 1_000_000, "tokens_per_minute": 10**10}],
        "pools": [{"name": real_vllm.MODEL, "backends": [backend], "target_fill": 0.9,
                   "overflow": ["queue", "reject"], "timeouts": fleet.TIMEOUTS}],
    }  # fmt: skip


def run_vllm(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    real_vllm.install()
    server = real_vllm.RealVllm(port=args.vllm_port, cores="0", confined=True)
    figures: dict[str, Any] = {}
    with real_vllm.running(server) as url, contextlib.ExitStack() as stack:
        gateway = stack.enter_context(
            fleet.gateway(vllm_gateway_config(url), workdir=out, arm="tools")
        )
        arms = {
            "direct": Target(url=url, model=real_vllm.MODEL),
            "spillgate": Target(url=gateway, model=real_vllm.MODEL, api_key=fleet.KEY),
        }
        for tool in args.tools:
            got = {}
            for seed, (arm, target) in enumerate(arms.items(), start=1):
                if not real_vllm.reset_prefix_cache(url):
                    raise RuntimeError(f"{url} refused to reset its prefix cache")
                got[arm] = run_tool(
                    tool, "steady", target, out=out / tool / arm, seed=seed, args=args
                )
            figures[tool] = {"arms": got}
            print(results.report(f"{tool}, real vLLM", got, slo=SLO["steady"]), flush=True)
    return figures


# --- prefix: shared prefixes through the gateway, least_filled vs prefix routing ------


def hit_rate(urls: Sequence[str], before: tuple[float, float]) -> float | None:
    queries, hits = prefix_counts(urls)
    asked = queries - before[0]
    return (hits - before[1]) / asked if asked else None


def prefix_counts(urls: Sequence[str]) -> tuple[float, float]:
    states = [backend_state(httpx.get(f"{u}/metrics", timeout=10).text) for u in urls]
    return sum(s["prefix_queries"] for s in states), sum(s["prefix_hits"] for s in states)


def run_prefix(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    plan = prefix_bench.Plan(backends=PREFIX_BACKENDS, kv_tokens=PREFIX_KV_TOKENS, speed=1.0)
    figures: dict[str, Any] = {}
    for tool in args.tools:
        got, rates = {}, {}
        for routing in ("least_filled", "prefix"):
            where = out / tool / routing
            where.mkdir(parents=True, exist_ok=True)
            with prefix_bench.simulators(plan, where, routing) as urls, contextlib.ExitStack() as s:
                config = prefix_bench.gateway_config(urls, "sim", routing)
                gateway = s.enter_context(fleet.gateway(config, workdir=where, arm=routing))
                before = prefix_counts(urls)
                target = Target(url=gateway, model=prefix_bench.POOL, api_key=fleet.KEY)
                # the same seed in both arms: each has fresh simulators, empty caches
                got[routing] = run_tool(tool, "shared-prefix", target, out=where, seed=1, args=args)
                rates[routing] = hit_rate(urls, before)
        figures[tool] = {"arms": got, "hit_rates": rates}
        title = f"{tool}, shared prefixes, {PREFIX_BACKENDS} simulated backends"
        print(results.report(title, got, slo=SLO["shared-prefix"], hit_rates=rates), flush=True)
    return figures


RUNS = {"demo": run_demo, "vllm": run_vllm, "prefix": run_prefix}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="spillgate bench tools", description=__doc__)
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.add_argument("run", choices=sorted(RUNS))
    p.add_argument("--tools", default=",".join(TOOLS), help="comma-separated (default: both)")
    p.add_argument("--rate", type=float, help="requests a second (default: the config's)")
    p.add_argument("--duration", type=int, help="seconds per arm (default: the config's)")
    p.add_argument("--out", type=Path, help="keep configs, logs and results here")
    p.add_argument("--json", type=Path, help="write the figures here")
    p.add_argument("--vllm-port", type=int, default=8101)
    args = p.parse_args(argv)
    args.tools = [t for t in args.tools.split(",") if t]
    unknown = set(args.tools) - set(TOOLS)
    if unknown:
        p.error(f"unknown tool(s): {', '.join(sorted(unknown))}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    check_installed(args.tools)
    real_vllm.model_dir()
    if args.run == "vllm" and len(os.sched_getaffinity(0)) > 1:
        os.sched_setaffinity(0, {1})  # vLLM gets core 0; everything this starts, core 1
    out = args.out or Path(tempfile.mkdtemp(prefix=f"spillgate-tools-{args.run}-"))
    out.mkdir(parents=True, exist_ok=True)
    figures = RUNS[args.run](args, out)
    print(f"results in {out}", file=sys.stderr)
    if args.json:
        plain = {
            tool: {
                **run,
                "arms": {arm: f.as_dict() for arm, f in run["arms"].items()},
            }
            for tool, run in figures.items()
        }
        args.json.write_text(json.dumps({"run": args.run, "tools": plain}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
