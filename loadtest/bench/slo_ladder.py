"""Goodput under a spike: the TTFT ladder against the fixed overflow chain, side by side.

    spillgate bench slo-ladder [--rounds 3] [--slo-ttft-ms 500] [--json FILE]

Each arm runs the same seeded spike (`spillgate loadtest --profile spike`) against a fresh
`spillgate demo` (two simulated replicas, a smaller model, a simulated provider, the chain
queue → degrade → provider → cache → reject), so both start from the same state: an empty
fleet, the provider's whole budget, nothing measured. The arms differ in one header:

- `fixed chain`: no objective. A request the pool cannot hold waits in the queue (up to
  `max_wait_s: auto`) and only then moves on, as before objectives existed.
- `slo ladder`: every request sends `x-spillgate-ttft-ms`, the SLO the run is scored by;
  the gateway passes over the steps predicted to miss it and refuses at once when all do.

Goodput is the requests answered within the SLO (TTFT and ITL, the load generator's own
accounting). Arms alternate within a round, their order swapped each round; the figures
are medians over rounds.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import secrets
import statistics
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from loadtest.bench.machine import logs_dir
from loadtest.procs import free_port, serving_process

FIXED, LADDER = "fixed chain", "slo ladder"
ARMS = (FIXED, LADDER)
MODEL = "llama-3.1-70b"


@contextlib.contextmanager
def demo(args: argparse.Namespace, *, key: str, admin: str) -> Iterator[str]:
    """A fresh `spillgate demo`, its URL yielded once it listens."""
    port = free_port()
    cmd = [sys.executable, "-m", "gateway.cli", "demo", "--port", str(port), "--api-key", key,
           "--admin-token", admin, "--speed", str(args.sim_speed)]  # fmt: skip
    with serving_process(cmd, port, timeout=60) as url:
        yield url


def loadtest(args: argparse.Namespace, arm: str, url: str, *, key: str, admin: str,
             out: Path) -> dict[str, Any]:  # fmt: skip
    """One run of the spike through `url`; the load generator's summary of it."""
    cmd = [sys.executable, "-m", "gateway.cli", "loadtest", "--url", url, "--key", key,
           "--model", MODEL, "--admin-token", admin, "--profile", "spike",
           "--rate", str(args.rate), "--spike-factor", str(args.spike_factor),
           "--spike-start", str(args.spike_start), "--spike-duration", str(args.spike_duration),
           "--duration", str(args.duration), "--prompt-tokens", args.prompt_tokens,
           "--output-tokens", args.output_tokens, "--seed", str(args.seed),
           "--slo-ttft-ms", str(args.slo_ttft_ms), "--slo-itl-ms", str(args.slo_itl_ms),
           "--timeout", "60", "--no-progress", "--json", str(out)]  # fmt: skip
    if arm == LADDER:
        cmd += ["--header", f"x-spillgate-ttft-ms: {args.slo_ttft_ms:g}"]
    # exits 1 when requests failed or were late: that is what is being measured
    subprocess.run(
        cmd,
        check=False,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        timeout=args.duration + 180,
    )
    (run,) = json.loads(out.read_text())["runs"]
    summary: dict[str, Any] = run["summary"]
    return summary


def figures(summary: dict[str, Any]) -> dict[str, Any]:
    """What the report compares, from one run's summary."""
    outcomes = summary["outcomes"]
    refused = outcomes.get("rejected", {})
    answered = [o for name, o in outcomes.items() if name not in ("rejected", "throttled", "error")]
    return {
        "requests": summary["requests"],
        "goodput": summary["goodput"]["requests"],
        "answered": sum(o["count"] for o in answered),
        "refused": refused.get("count", 0),
        # how long a refused client waited to hear it: told at once, or after a deadline
        "refused_after_p50_ms": refused.get("e2e_p50_ms"),
        "ttft_p50_ms": summary["all"]["ttft_p50_ms"],
        "ttft_p99_ms": summary["all"]["ttft_p99_ms"],
        "outcomes": {name: o["count"] for name, o in outcomes.items()},
        "failed": summary["failed"],
    }


def run_bench(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    key, admin = "sk-bench-" + secrets.token_hex(8), secrets.token_hex(16)
    runs: dict[str, list[dict[str, Any]]] = {arm: [] for arm in ARMS}
    for round_no in range(args.rounds):
        order = ARMS if round_no % 2 == 0 else tuple(reversed(ARMS))
        for arm in order:
            with demo(args, key=key, admin=admin) as url:
                out = workdir / f"run-{round_no}-{arm.replace(' ', '-')}.json"
                runs[arm].append(figures(loadtest(args, arm, url, key=key, admin=admin, out=out)))
            print(f"round {round_no + 1}/{args.rounds} {arm}: goodput "
                  f"{runs[arm][-1]['goodput']}", file=sys.stderr, flush=True)  # fmt: skip
    return {
        "slo": {"ttft_ms": args.slo_ttft_ms, "itl_ms": args.slo_itl_ms},
        "spike": {
            "rate": args.rate,
            "factor": args.spike_factor,
            "start_s": args.spike_start,
            "duration_s": args.spike_duration,
            "total_s": args.duration,
        },
        "runs": runs,
    }


ROWS = (
    ("requests", "requests"),
    ("goodput (within SLO)", "goodput"),
    ("answered", "answered"),
    ("refused (503)", "refused"),
    ("refused after, p50 (ms)", "refused_after_p50_ms"),
    ("TTFT p50 (ms)", "ttft_p50_ms"),
    ("TTFT p99 (ms)", "ttft_p99_ms"),
    ("failed", "failed"),
)


def _median(values: Sequence[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def _cell(values: Sequence[float | None]) -> str:
    median = _median(values)
    shown = "/".join("-" if v is None else f"{v:g}" for v in values)
    return "-" if median is None else f"{median:g} ({shown})"


def report(result: dict[str, Any]) -> str:
    runs = result["runs"]
    slo = result["slo"]
    lines = [f"SLO: TTFT ≤ {slo['ttft_ms']:g} ms, ITL ≤ {slo['itl_ms']:g} ms; medians (each round)"]
    lines.append(f"{'':28}" + "".join(f"{arm:>30}" for arm in ARMS))
    for label, key in ROWS:
        cells = [_cell([r[key] for r in runs[arm]]) for arm in ARMS]
        lines.append(f"{label:28}" + "".join(f"{c:>30}" for c in cells))
    names = sorted({name for arm in ARMS for r in runs[arm] for name in r["outcomes"]})
    for name in names:
        cells = [_cell([r["outcomes"].get(name, 0) for r in runs[arm]]) for arm in ARMS]
        lines.append(f"{'  ' + name:28}" + "".join(f"{c:>30}" for c in cells))
    fixed, ladder = (_median([r["goodput"] for r in runs[arm]]) for arm in ARMS)
    if fixed and ladder is not None:
        lines.append(f"goodput, ladder ÷ fixed chain: {ladder / fixed:.2f}")
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="spillgate bench slo-ladder", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--rounds", type=int, default=3)
    # an interactive objective, shorter than the demo queue's 1 s wait
    p.add_argument("--slo-ttft-ms", type=float, default=500.0)
    p.add_argument("--slo-itl-ms", type=float, default=100.0)
    # the README's spike on the demo: 5x what its large pool holds, for 10 s
    p.add_argument("--rate", type=float, default=3.0)
    p.add_argument("--spike-factor", type=float, default=12.5)
    p.add_argument("--spike-start", type=float, default=5.0)
    p.add_argument("--spike-duration", type=float, default=10.0)
    p.add_argument("--duration", type=float, default=25.0)
    p.add_argument("--prompt-tokens", default="uniform:400:600")
    p.add_argument("--output-tokens", default="uniform:120:200")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--sim-speed", type=float, default=1.0)
    p.add_argument("--json", type=Path, help="write the figures here")
    p.add_argument("--logs", type=Path, help="keep each run's load generator JSON here")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    with logs_dir(args.logs, prefix="slo-ladder-") as workdir:
        result = run_bench(args, workdir)
    print(report(result))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
