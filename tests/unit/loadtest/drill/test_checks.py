"""The drill's verdicts: each check passes on a healthy run and fails with a clear line."""

from typing import Any

from loadtest.drill.checks import (
    local_ttft,
    no_dishonest_5xx,
    no_preemption,
    overflow_engaged,
    released,
    retry_after_everywhere,
    shared_prefix_cached,
    within_target_fill,
)
from loadtest.loadgen.client import Result
from loadtest.loadgen.workload import PlannedRequest


def result(outcome: str, status: int = 200, **kw: Any) -> Result:
    base: dict[str, Any] = {
        "index": 0, "tenant": "t", "at_s": 0.0, "sent_s": 0.0, "stream": True,
        "repeated": False, "prompt_tokens": 10, "max_tokens": 10, "status": status,
        "outcome": outcome, "ttft_s": 0.1,
    }  # fmt: skip
    return Result(**(base | kw))


CHAIN = ["queue", "degrade", "provider", "cache", "reject"]


def test_every_configured_path_engaged_passes_line_by_line() -> None:
    rs = [result(o) for o in ("local", "queued", "degraded", "provider", "cached")]
    rs.append(result("rejected", 503, retry_after="1"))
    checks = overflow_engaged(rs, CHAIN)
    assert [c.passed for c in checks] == [True] * 5
    assert checks[2].line() == "PASS  overflow path 'provider' engaged: 1 of 6 requests provider"


def test_a_path_that_never_served_fails_naming_it() -> None:
    rs = [result("local"), result("queued"), result("rejected", 503)]
    errors = {"hosted/connect": 12.0, "big-0/timeout": 0.0}
    failed = [c for c in overflow_engaged(rs, CHAIN, upstream_errors=errors) if not c.passed]
    assert [c.name for c in failed] == [
        "overflow path 'degrade' engaged",
        "overflow path 'provider' engaged",
        "overflow path 'cache' engaged",
    ]
    line = failed[1].line()
    assert line.startswith("FAIL  overflow path 'provider' engaged: no request ended")
    assert "is the provider reachable" in line
    assert line.endswith("gateway upstream errors: hosted/connect x12")


def test_only_honest_503s_are_allowed() -> None:
    honest = [result("rejected", 503, retry_after="2"), result("local")]
    assert no_dishonest_5xx(honest).passed
    for bad in (
        result("error", 502),
        result("error", 0, error="connect: refused"),
        result("error", 200, error="stream error: upstream reset"),
        result("local", 500),
    ):
        check = no_dishonest_5xx([*honest, bad])
        assert not check.passed
        assert "1 bad answers" in check.detail


def test_a_refusal_without_retry_after_fails() -> None:
    assert retry_after_everywhere([result("throttled", 429, retry_after="3")]).passed
    check = retry_after_everywhere([result("rejected", 503, retry_after="1"),
                                    result("rejected", 503)])  # fmt: skip
    assert not check.passed
    assert check.detail.startswith("1 of 2 refusals carried Retry-After")


def _sample(t: float, held: int, limit: int = 900) -> dict[str, Any]:
    return {"t": t, "backends": {"b0": {"in_flight": held, "limit": limit, "capacity": 1000}}}


def test_tokens_in_flight_over_the_limit_fail_with_when_and_where() -> None:
    assert within_target_fill([_sample(0.0, 100), _sample(0.1, 900)]).passed
    check = within_target_fill([_sample(0.0, 100), _sample(0.25, 901)])
    assert not check.passed
    assert "b0 901 > 900 at 0.25s" in check.detail
    assert not within_target_fill([]).passed


def test_preemption_counts_must_be_readable_and_unchanged() -> None:
    assert no_preemption({"http://b0": {"before": 2.0, "after": 2.0}}).passed
    moved = no_preemption({"http://b0": {"before": 2.0, "after": 5.0}})
    assert not moved.passed and "3.0" in moved.detail
    assert not no_preemption({"http://b0": {"before": None, "after": 1.0}}).passed


def test_local_ttft_p99_against_the_slo() -> None:
    rs = [result("local", ttft_s=0.01 * i) for i in range(1, 101)]
    assert local_ttft(rs, slo_s=1.0).passed
    slow = local_ttft(rs, slo_s=0.5)
    assert not slow.passed and slow.detail == "990 ms > 500 ms (n=100)"
    assert not local_ttft([result("provider")], slo_s=1.0).passed


def test_release_check_reads_the_final_status() -> None:
    def status(held: int, sessions: int) -> dict[str, Any]:
        backend = {"name": "b0", "tokens_in_flight": held, "active_sessions": sessions}
        return {"pools": [{"backends": [backend]}], "queue_depth": {"p": 0.0}}

    assert released(status(0, 0), waited_s=0.2).passed
    stuck = released(status(120, 1), waited_s=15.0)
    assert not stuck.passed and "{'b0': (120, 1)}" in stuck.detail
    assert not released(None, waited_s=1.0).passed


def _plan(system: str, prompt_tokens: int) -> PlannedRequest:
    return PlannedRequest(
        index=0, at_s=0.0, tenant="drill", prompt_tokens=prompt_tokens, max_tokens=8,
        stream=True, repeated=False, text="x", system=system,
    )  # fmt: skip


def _moved(queries: float, hits: float) -> dict[str, dict[str, float] | None]:
    return {"before": {"queries": 0.0, "hits": 0.0}, "after": {"queries": queries, "hits": hits}}


def test_the_shared_prefix_check_asks_half_the_share_the_system_prompt_is() -> None:
    # a system prompt of 96 + 4 template tokens in prompts of 400: a quarter of the tokens
    plans = [_plan("s" * 96 * 4, 400)] * 4
    ok = shared_prefix_cached({"http://a": _moved(1000, 125)}, plans=plans)
    assert ok.passed and ok.detail == (
        "hit rate 12.5 % >= 12.5 %, half the share of the prompts the system prompt is "
        "(125 of 1,000 tokens)"
    )
    low = shared_prefix_cached({"http://a": _moved(1000, 124)}, plans=plans)
    assert not low.passed and low.detail.startswith("hit rate 12.4 % < 12.5 %")
    unread = shared_prefix_cached({"http://a": _moved(0, 0)}, plans=plans)
    assert not unread.passed and "no backend reported" in unread.detail
