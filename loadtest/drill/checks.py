"""The drill's verdicts: one pass/fail line each, computed from a finished run."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from loadtest.loadgen.client import Result
from loadtest.loadgen.run import RunData
from loadtest.loadgen.stats import prefix_cache
from loadtest.loadgen.workload import PlannedRequest, message_tokens
from loadtest.percentile import percentile

# the outcome each overflow policy records when it serves a request
POLICY_OUTCOME = {
    "queue": "queued",
    "degrade": "degraded",
    "provider": "provider",
    "cache": "cached",
    "reject": "rejected",
}
REFUSALS = (429, 503)
HINTS = {
    "queue": "is queue.max_depth above 0 and max_wait_s long enough for a release?",
    "degrade": "does degrade_to name a pool with room of its own?",
    "provider": "is the provider reachable, within its budget, its breaker closed?",
    "cache": "did a repeated greedy request reach the cache (cache.store, ttl_s)?",
    "reject": "did the spike outlast every path before reject? make it larger",
}


@dataclass(frozen=True, kw_only=True)
class Check:
    passed: bool
    name: str
    detail: str

    def line(self) -> str:
        return f"{'PASS' if self.passed else 'FAIL'}  {self.name}: {self.detail}"


def overflow_engaged(
    results: Sequence[Result],
    chain: Sequence[str],
    *,
    upstream_errors: dict[str, float] | None = None,
) -> list[Check]:
    """One line per configured policy: did any request end with that policy's outcome?"""
    seen = Counter(r.outcome for r in results)
    errors = ", ".join(f"{k} x{v:g}" for k, v in sorted((upstream_errors or {}).items()) if v)
    checks = []
    for policy in chain:
        outcome = POLICY_OUTCOME.get(policy, policy)
        n = seen[outcome]
        detail = f"{n} of {len(results)} requests {outcome}"
        if not n:
            detail = (
                f"no request ended '{outcome}' (0 of {len(results)}); "
                + HINTS.get(policy, "check its config")
                + (f"; gateway upstream errors: {errors}" if errors else "")
            )
        checks.append(Check(passed=n > 0, name=f"overflow path '{policy}' engaged", detail=detail))
    return checks


def honest_refusal(r: Result) -> bool:
    return r.status == 503 and r.outcome in ("rejected", "throttled")


def no_dishonest_5xx(results: Sequence[Result]) -> Check:
    bad = [
        r
        for r in results
        # a broken answer (no response, a broken stream), or a 5xx not an honest refusal
        if (r.error and r.status < 400)
        or r.status == 0
        or (r.status >= 500 and not honest_refusal(r))
    ]
    honest = sum(1 for r in results if honest_refusal(r))
    if not bad:
        detail = f"{honest} refused with 503, no other 5xx or broken stream"
        return Check(passed=True, name="no 5xx other than honest 503s", detail=detail)
    kinds = Counter(f"{r.status or 'no response'} {r.error or r.outcome}" for r in bad)
    sample = "; ".join(f"{k} (x{v})" for k, v in kinds.most_common(3))
    return Check(passed=False, name="no 5xx other than honest 503s",
                 detail=f"{len(bad)} bad answers: {sample}")  # fmt: skip


def retry_after_everywhere(results: Sequence[Result]) -> Check:
    refused = [r for r in results if r.status in REFUSALS]
    missing = [r for r in refused if not r.retry_after]
    detail = f"{len(refused) - len(missing)} of {len(refused)} refusals carried Retry-After"
    if missing:
        detail += f"; missing on {Counter(r.status for r in missing)}"
    return Check(passed=not missing, name="every 429/503 carried Retry-After", detail=detail)


def within_target_fill(samples: Sequence[dict[str, Any]]) -> Check:
    name = "tokens in flight never above capacity x target fill"
    peaks: dict[str, tuple[float, float]] = {}
    over: list[str] = []
    for point in samples:
        for backend, b in point["backends"].items():
            held, limit = float(b["in_flight"]), float(b["limit"])
            if held > peaks.get(backend, (-1.0, 0.0))[0]:
                peaks[backend] = (held, limit)
            if held > limit:
                over.append(f"{backend} {held:g} > {limit:g} at {point['t']:.2f}s")
    if not samples:
        return Check(passed=False, name=name, detail="no sample of /admin/status succeeded")
    shown = ", ".join(f"{k} {v[0]:g}/{v[1]:g}" for k, v in sorted(peaks.items()))
    if over:
        return Check(passed=False, name=name, detail=f"{len(over)} over: {over[0]}; peaks {shown}")
    return Check(passed=True, name=name, detail=f"peaks {shown} over {len(samples)} samples")


def no_preemption(preemptions: dict[str, dict[str, float | None]]) -> Check:
    name = "no preemption at the backends"
    unread = [url for url, c in preemptions.items() if c["before"] is None or c["after"] is None]
    if not preemptions or unread:
        return Check(
            passed=False,
            name=name,
            detail=f"could not read vllm:num_preemptions_total at {unread or 'any'}",
        )
    delta = {url: (c["after"] or 0) - (c["before"] or 0) for url, c in preemptions.items()}
    hit = {url: d for url, d in delta.items() if d > 0}
    if hit:
        return Check(passed=False, name=name, detail=f"preemptions during the drill: {hit}")
    return Check(passed=True, name=name, detail=f"0 at {len(delta)} backends")  # fmt: skip


def local_ttft(results: Sequence[Result], *, slo_s: float) -> Check:
    name = "p99 TTFT of locally served requests within the SLO"
    ttft = [r.ttft_s for r in results if r.outcome == "local" and r.stream and r.ttft_s]
    p99 = percentile(ttft, 99)
    if p99 is None:
        return Check(passed=False, name=name, detail="no streamed request was served locally")
    verdict = "<=" if p99 <= slo_s else ">"
    return Check(
        passed=p99 <= slo_s,
        name=name,
        detail=f"{p99 * 1000:.0f} ms {verdict} {slo_s * 1000:.0f} ms (n={len(ttft)})",
    )


def released(final: dict[str, Any] | None, *, waited_s: float) -> Check:
    name = "everything reserved was released"
    if final is None:
        return Check(passed=False, name=name, detail="could not read /admin/status after drain")
    held = {b["name"]: (b["tokens_in_flight"], b["active_sessions"])
            for p in final["pools"] for b in p["backends"]}  # fmt: skip
    left = {k: v for k, v in held.items() if v != (0, 0)}
    queues = {k: v for k, v in final.get("queue_depth", {}).items() if v}
    if left or queues:
        return Check(passed=False, name=name, detail=(
            f"after {waited_s:.1f}s still held (tokens, sessions): {left}; queued: {queues}"
        ))  # fmt: skip
    return Check(passed=True, name=name, detail=(
        f"0 tokens and 0 sessions at {len(held)} backends, queues empty, {waited_s:.1f}s after "
        "the last answer"
    ))  # fmt: skip


def shared_prefix_cached(
    counters: dict[str, dict[str, dict[str, float] | None]], *, plans: Sequence[PlannedRequest]
) -> Check:
    """Did the backends' prefix caches find the system prompt every request starts with?

    Of the prompt tokens planned, the shared system prompt is some share; where caching and
    routing work, all but each backend's first sight of it is found cached, so the hit rate
    comes near that share. Half of it is the bar: a broken cache finds nothing, and what
    evictions under the spike cost stays far from halving it."""
    name = "backends' prefix caches found the shared system prompt"
    shared = sum(message_tokens(p.system) for p in plans if p.system)
    planned = sum(p.prompt_tokens for p in plans)
    share = shared / planned if planned else 0.0
    cache = prefix_cache(counters)
    rate = cache["hit_rate"]
    if rate is None:
        detail = "no backend reported vllm:prefix_cache_queries_total (prefix caching off?)"
        return Check(passed=False, name=name, detail=detail)
    passed = rate >= share / 2
    detail = (
        f"hit rate {rate * 100:.1f} % {'>=' if passed else '<'} {share * 50:.1f} %, half the "
        f"share of the prompts the system prompt is ({cache['hits']:,.0f} of "
        f"{cache['queries']:,.0f} tokens)"
    )
    if not passed:
        detail += "; is prefix caching on at the backends, and the pool's routing `prefix`?"
    return Check(passed=passed, name=name, detail=detail)


def evaluate(
    data: RunData,
    *,
    chain: Sequence[str],
    slo_ttft_s: float,
    final: dict[str, Any] | None,
    waited_s: float,
    upstream_errors: dict[str, float] | None = None,
) -> list[Check]:
    rs = data.results
    return [
        *overflow_engaged(rs, chain, upstream_errors=upstream_errors),
        no_dishonest_5xx(rs),
        retry_after_everywhere(rs),
        within_target_fill(data.samples),
        no_preemption(data.preemptions),
        local_ttft(rs, slo_s=slo_ttft_s),
        released(final, waited_s=waited_s),
    ]
