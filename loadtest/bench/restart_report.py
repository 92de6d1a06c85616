"""What `spillgate bench restart` prints: a line per fault the clients saw, their latency,
the gateway's own counts, and when each backend was stopped and back."""

from __future__ import annotations

import argparse
from typing import Any

from loadtest.bench.restart_answers import Fault

ROWS = (
    ("non-200 answers", Fault.NON_200),
    ("no answer (connection)", Fault.NO_ANSWER),
    ("SSE error events", Fault.ERROR_EVENT),
    ("cut streams", Fault.CUT),
    ("discontinuous text", Fault.DISCONTINUOUS),
    ("wrong length or finish", Fault.WRONG_LENGTH),
    ("dishonest usage", Fault.DISHONEST_USAGE),
)


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def report(figures: dict[str, Any]) -> str:
    lines = [f"Rolling restarts, {figures['arm']}: {figures['setup']}"]
    lines.append(f"{'requests sent':34}{figures['requests']:>8}")
    lines.append(f"{'ok':34}{figures['ok']:>8}")
    lines.append(f"{'failed (any of the below)':34}{figures['failed']:>8}")
    for label, fault in ROWS:
        count = figures["faults"][fault.value]
        statuses = ", ".join(f"{s}: {n}" for s, n in sorted(figures["statuses"].items()))
        extra = f"  ({statuses})" if fault is Fault.NON_200 and statuses else ""
        lines.append(f"{'  ' + label:34}{count:>8}{extra}")
    lines.append(
        f"{'latency p50 / p99 (s)':34}{_seconds(figures['latency_p50_s']):>8} / "
        f"{_seconds(figures['latency_p99_s'])}"
    )
    lines.append(
        f"{'TTFT p50 / p99 (s), streams':34}{_seconds(figures['ttft_p50_s']):>8} / "
        f"{_seconds(figures['ttft_p99_s'])}"
    )
    kinds = ", ".join(
        f"{kind} {c['requests']} ({c['failed']} failed)" for kind, c in figures["by_kind"].items()
    )
    lines.append(f"by kind: {kinds}")
    if "prompt_tokens_off" in figures:
        lines.append(f"prompt_tokens less vLLM's /tokenize count: {figures['prompt_tokens_off']}")
    for name, counts in figures["gateway"].items():
        told = ", ".join(f"{k}: {n}" for k, n in sorted(counts.items())) or "none"
        lines.append(f"gateway's {name.replace('_', ' ')}: {told}")
    for r in figures["restarts"]:
        line = (
            f"{r['backend']} stopped at {r['at_s']:.1f} s: gone {r['gone_after_s']:.2f} s "
            f"after SIGTERM (by {r['stopped_by']})"
        )
        if "ready_after_s" in r:
            line += f", ready again after {r['ready_after_s']:.1f} s"
        if r.get("in_rotation_after_s") is not None:
            line += f", back in the gateway's rotation after {r['in_rotation_after_s']:.1f} s"
        lines.append(line)
    return "\n".join(lines)


def setup(args: argparse.Namespace) -> str:
    stopping = f"SIGTERM, SIGKILL after {args.grace:g} s"
    if args.real_vllm:
        return (
            f"2 vLLMs, a burst of {args.burst} streams of {args.real_max_tokens} tokens, "
            f"the first vLLM stopped midway ({stopping})"
        )
    return (
        f"2 simulators, {args.clients} clients for {args.duration:g} s, answers of "
        f"{args.max_tokens} tokens, {args.restarts} restarts ({stopping}, "
        f"--shutdown-timeout {args.shutdown_timeout:g})"
    )
