"""The tables and the targets of `spillgate bench admission` (issue 20's).

Targets, read off the medians: through the gateway with the learned admission, running
concurrency at least 90 % of direct's and TTFT p50 within 1.5x of direct's on the
smallest burst, no refusal on the largest, no preemption anywhere; on the spike, at
least 85 % of the KV cache used at the peak and at most half of the static reservation's
provider spill. With a shared system prompt (issue 49's), the same four on the largest
burst: running concurrency and TTFT p50 against direct's, no refusal, no preemption.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from loadtest.loadgen.text import table

ROWS: tuple[tuple[str, str, Callable[[Any], str]], ...] = (
    ("running_max", "running at once (max)", lambda v: f"{v:.0f}"),
    ("streaming_max", "streaming at once (client)", lambda v: f"{v:.0f}"),
    ("kv_peak", "peak KV used", lambda v: f"{v:.0%}"),
    ("used_per_reserved", "KV used ÷ reserved", lambda v: f"{v:.2f}"),
    ("ttft_p50_s", "TTFT p50 (s)", lambda v: f"{v:.2f}"),
    ("output_tokens_per_s", "output tokens/s", lambda v: f"{v:.0f}"),
    ("preemptions", "preemptions", lambda v: f"{v:.0f}"),
    ("backoffs", "effective fill back-offs", lambda v: f"{v:.0f}"),
    ("queued", "queued", lambda v: f"{v:.0f}"),
    ("refused", "refusals (503)", lambda v: f"{v:.0f}"),
    ("errors", "errors", lambda v: f"{v:.0f}"),
    ("elapsed_s", "total time (s)", lambda v: f"{v:.1f}"),
    ("prompt_tokens_mean", "prompt mean (tokens)", lambda v: f"{v:.0f}"),
    ("prefix_hit_share", "prompt tokens found cached", lambda v: f"{v:.0%}"),
    ("completion_tokens_mean", "answer mean (tokens)", lambda v: f"{v:.0f}"),
)
SPILL_ROWS: tuple[tuple[str, str, Callable[[Any], str]], ...] = (
    ("spill_requests", "provider spill (requests)", lambda v: f"{v:.0f}"),
    ("spill_tokens", "provider spill (tokens)", lambda v: f"{v:,.0f}"),
)


def _cell(section: dict[str, Any], arm: str, key: str, fmt: Callable[[Any], str]) -> str:
    median = section["median"][arm].get(key)
    if median is None:
        return "-"
    runs = [r.get(key) for r in section["runs"][arm]]
    if len(runs) == 1:
        return fmt(median)
    each = "/".join("-" if v is None else fmt(v) for v in runs)
    return f"{fmt(median)} ({each})"


def section_table(title: str, section: dict[str, Any], *, spill: bool = False) -> str:
    arms = list(section["median"])
    rows = [[title, *arms]]
    for key, label, fmt in ROWS + (SPILL_ROWS if spill else ()):
        rows.append([label, *(_cell(section, arm, key, fmt) for arm in arms)])
    return table(rows, ["<"] + [">"] * len(arms))


def _target(name: str, met: bool | None, measured: str) -> dict[str, Any]:
    return {"target": name, "met": met, "measured": measured}


def _compare(
    name: str, value: Any, other: Any, *, factor: float, at_most: bool = False
) -> dict[str, Any]:
    """Met when `value` is at least (or with `at_most`, at most) `factor` x `other`."""
    if value is None or other is None:
        return _target(name, None, "not measured")
    met = value <= factor * other if at_most else value >= factor * other
    return _target(name, met, f"{value:.3g} against {factor:g} × {other:.3g}")


def targets(figures: dict[str, Any]) -> list[dict[str, Any]]:
    sizes = sorted(figures["bursts"], key=int)
    small, large = figures["bursts"][sizes[0]]["median"], figures["bursts"][sizes[-1]]
    spike = figures["spike"]
    learned, static = spike["median"]["learned"], spike["median"]["static"]
    every_run = [r for s in figures["bursts"].values() for r in s["runs"]["learned"]]
    every_run += spike["runs"]["learned"]
    preempted = sum(r["preemptions"] for r in every_run)
    refused = [r["refused"] for r in large["runs"]["learned"]]
    out = [
        _compare(
            f"running at once ≥ 90 % of direct's (burst of {sizes[0]})",
            small["learned"]["running_max"], small["direct"]["running_max"], factor=0.9,
        ),
        _compare(
            f"TTFT p50 ≤ 1.5× direct's (burst of {sizes[0]})",
            small["learned"]["ttft_p50_s"], small["direct"]["ttft_p50_s"], factor=1.5,
            at_most=True,
        ),
        _target(f"0 refusals (burst of {sizes[-1]})", max(refused) == 0, f"{refused} per run"),
        _target("0 preemptions through the gateway", preempted == 0, f"{preempted:g} in all"),
        _target(
            "≥ 85 % of KV capacity used at the spike's peak",
            None if learned["kv_peak"] is None else learned["kv_peak"] >= 0.85,
            "not measured" if learned["kv_peak"] is None else f"{learned['kv_peak']:.0%}",
        ),
        _compare(
            "provider spill ≤ half of static's (requests)",
            learned["spill_requests"], static["spill_requests"], factor=0.5, at_most=True,
        ),
        _compare(
            "provider spill ≤ half of static's (tokens)",
            learned["spill_tokens"], static["spill_tokens"], factor=0.5, at_most=True,
        ),
    ]  # fmt: skip
    if figures["plan"].get("shared_prompt", 0) > 0:
        out += shared_prompt_targets(figures)
    return out


def shared_prompt_targets(figures: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 49's acceptance, on the largest burst of chats opened by system messages:
    through the gateway (learned) nearly as many streams at once as direct and nearly as
    fast a first token, none refused or preempted."""
    size = max(figures["bursts"], key=int)
    burst = figures["bursts"][size]
    learned, direct = burst["median"]["learned"], burst["median"]["direct"]
    refused = [r["refused"] for r in burst["runs"]["learned"]]
    preempted = sum(r["preemptions"] for r in burst["runs"]["learned"])
    where = f"shared prompt of {figures['plan']['shared_prompt']} tokens, burst of {size}"
    if (count := figures.get("replicas", {}).get("learned", 1)) > 1:
        where += f", {count} replicas"
    return [
        _compare(
            f"running at once ≥ 90 % of direct's ({where})",
            learned["running_max"], direct["running_max"], factor=0.9,
        ),
        _compare(
            f"TTFT p50 ≤ 1.5× direct's ({where})",
            learned["ttft_p50_s"], direct["ttft_p50_s"], factor=1.5, at_most=True,
        ),
        _target(f"0 refusals ({where})", max(refused) == 0, f"{refused} per run"),
        _target(f"0 preemptions ({where})", preempted == 0, f"{preempted:g} in all"),
    ]  # fmt: skip


def prompt_line(plan: dict[str, Any]) -> str:
    """What each chat holds: its user message, and the system message before it, if any."""
    user = f"user messages of {plan['prompt_tokens']} tokens"
    tokens = plan.get("shared_prompt", 0)
    if tokens <= 0:
        return f"each chat: {user}, no system message"
    if plan.get("prompt_mix") == "mixed":
        opening = (
            f"a third open with system message A of {tokens} tokens, a third with B (as long), "
            "a third each with its own"
        )
    else:
        opening = f"every chat opens with the same system message of {tokens} tokens"
    return f"{opening}, then {user}"


def report(figures: dict[str, Any]) -> str:
    load = figures.get("load_average", {})
    lines = [
        f"backend: {figures['backend']} ({figures['model']}), KV capacity for admission "
        f"{figures['capacity_tokens']:,} tokens; max_tokens {figures['plan']['max_tokens']}, "
        f"target_fill 0.9; load average {load.get('before', 0):.1f} before, "
        f"{load.get('after', 0):.1f} after (other work on the machine)",
    ]
    lines.append(prompt_line(figures["plan"]))
    for arm, count in figures.get("replicas", {}).items():
        if count > 1:
            lines.append(
                f"the {arm} arm runs as {count} gateways sharing one redis-server, the requests "
                "split round-robin"
            )
    if figures.get("queue_wait_s") is not None:
        lines.append(f"the gateways' queue waits up to {figures['queue_wait_s']:g} s (not 2 s)")
    if figures.get("warmup"):
        lines.append(
            f"the learning arms were warmed first: {figures['plan']['warmup']} seeded requests "
            f"through each of their pools ({figures['warmup']})"
        )
    settled = [
        r["settle_s"]
        for section in (*figures["bursts"].values(), figures["spike"])
        for runs in section["runs"].values()
        for r in runs
    ]
    lines.append(
        "each run starts from an idle backend and, through a gateway, once its effective fill "
        f"is back at target (waited up to {max(settled):.1f} s: other arms' traffic bypasses it)"
    )
    for size, section in figures["bursts"].items():
        lines += ["", section_table(f"burst of {size}, overflow [queue, reject]", section)]
    title = f"spike of {figures['spike']['requests']}, overflow [queue, provider, reject]"
    lines += ["", section_table(title, figures["spike"], spill=True), ""]
    for t in figures["targets"]:
        verdict = {True: "met", False: "NOT met", None: "not measured"}[t["met"]]
        lines.append(f"{verdict:>12}  {t['target']}: {t['measured']}")
    return "\n".join(lines)
