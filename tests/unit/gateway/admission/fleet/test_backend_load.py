"""Reading a backend's own load from its metrics page, and admitting against it."""

import asyncio
import json
from pathlib import Path

import pytest

from gateway.admission.fleet.backend_load import STALE_S, ReportedLoad, load_from_metrics
from gateway.admission.fleet.backends import Backend
from gateway.admission.fleet.fill import FillReason
from gateway.admission.routing.route import Route
from gateway.admission.routing.router import Router
from gateway.clock import ManualClock
from tests.support.routers import local_router

METRICS_FIXTURE = Path(__file__).resolve().parents[4] / "fixtures" / "vllm-0.32-metrics.txt"

SGLANG = """\
# HELP sglang:token_usage The token usage
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="m"} 0.28
sglang:num_running_reqs{model_name="m"} 2.0
sglang:num_queue_reqs{model_name="m"} 3.0
sglang:num_retracted_reqs{model_name="m"} 0.0
"""


def test_reads_vllm_0_32s_own_page() -> None:
    load = load_from_metrics(METRICS_FIXTURE.read_text())
    assert load == ReportedLoad(
        kv_usage=0.0,
        running=0,
        waiting=0,
        preemptions=0.0,
        prefix_queries=1732.0,
        prefix_hits=0.0,
    )
    assert load is not None and load.prefix_hit_rate == 0.0


def test_averages_the_usage_of_engines_and_adds_up_the_rest() -> None:
    text = (
        'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.2\n'
        'vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.4\n'
        'vllm:num_requests_waiting{engine="0",model_name="m"} 1.0\n'
        'vllm:num_requests_waiting{engine="1",model_name="m"} 2.0\n'
        'vllm:num_preemptions_total{engine="0",model_name="m"} 5.0\n'
        'vllm:num_preemptions_total{engine="1",model_name="m"} 7.0\n'
        'vllm:num_requests_waiting_by_reason{engine="0",model_name="m",reason="x"} 9.0\n'
    )
    load = load_from_metrics(text)
    assert load is not None
    assert (round(load.kv_usage, 6), load.waiting, load.preemptions) == (0.3, 3, 12.0)


def test_reads_sglangs_equivalents() -> None:
    assert load_from_metrics(SGLANG) == ReportedLoad(
        kv_usage=0.28, running=2, waiting=3, preemptions=None, retracted=0
    )


def test_a_page_without_a_running_count_leaves_it_unknown() -> None:
    load = load_from_metrics("vllm:kv_cache_usage_perc 0.0\nvllm:num_requests_waiting 0.0\n")
    assert load is not None and load.running is None


def test_a_page_without_kv_use_reports_nothing() -> None:
    assert load_from_metrics("vllm:num_requests_waiting 1.0\n") is None
    assert load_from_metrics("") is None


def _router(*, feedback: bool = True) -> tuple[Router, ManualClock]:
    clock = ManualClock()
    return local_router(
        [1000], target_fill=0.5, block_size=1, clock=clock, feedback=feedback
    ), clock


def test_admission_counts_the_larger_of_the_ledger_and_the_backends_report() -> None:
    async def scenario() -> None:
        router, clock = _router()
        backend = router.pools["p"].backends[0]

        def report(usage: float) -> None:
            load = ReportedLoad(kv_usage=usage, waiting=0, preemptions=0.0)
            backend.report(load, now=clock.now, reserved=router.ledger.tokens_in_flight("p-0"))

        held = await router.reserve(Route("p", 100))
        assert held is not None
        # the backend holds 300 tokens: 200 the ledger does not know of (bypassing traffic)
        report(0.3)
        assert router.limit(backend) == 500 - 200
        assert router.fill(backend) == 0.3
        assert await router.reserve(Route("p", 201)) is None  # 300 + 201 > 500
        second = await router.reserve(Route("p", 200))
        assert second is not None
        assert router.fill(backend) == 0.5
        # a release counts at once, not a scrape later: the 200 beyond stay, the 100 go
        await router.release(held)
        assert router.fill(backend) == 0.4
        assert router.limit(backend) == 300
        # a report below the ledger's view changes nothing: the ledger is the larger
        report(0.1)
        assert router.limit(backend) == 500
        # a stale report: the ledger alone
        report(0.45)
        assert router.limit(backend) == 500 - 250
        clock.advance(STALE_S + 0.1)
        assert router.limit(backend) == 500
        assert router.reported_tokens(backend) is None

    asyncio.run(scenario())


def test_a_preemption_lowers_the_limit_until_the_fill_recovers() -> None:
    router, clock = _router()
    backend = router.pools["p"].backends[0]
    calm = ReportedLoad(kv_usage=0.0, waiting=0, preemptions=4.0)
    assert backend.report(calm, now=clock.now) is None
    clock.advance(0.5)
    preempted = ReportedLoad(kv_usage=0.0, waiting=0, preemptions=5.0)
    reason = backend.report(preempted, now=clock.now)
    assert reason is FillReason.PREEMPTION
    assert router.effective_fill(backend) == 0.4
    assert router.limit(backend) == 400
    clock.advance(STALE_S + 0.1)  # no fresh scrape: the target fill again
    assert router.effective_fill(backend) == 0.5


def test_only_a_backend_that_says_it_runs_nothing_and_queues_nothing_ends_a_back_off() -> None:
    router, clock = _router()
    backend = router.pools["p"].backends[0]

    def report(*, running: int | None, waiting: int = 0, preemptions: float = 5.0) -> None:
        clock.advance(0.5)
        load = ReportedLoad(kv_usage=0.0, running=running, waiting=waiting, preemptions=preemptions)
        backend.report(load, now=clock.now)

    report(running=0, preemptions=4.0)
    report(running=0)  # the counter rose: backed off to 0.4
    assert router.effective_fill(backend) == 0.4
    report(running=None)  # a page without a running count: unknown, the slow climb
    report(running=None)
    assert router.effective_fill(backend) == pytest.approx(0.41)
    report(running=0, waiting=1)  # queued is not idle (one scrape of it: held still)
    report(running=3)
    assert router.effective_fill(backend) == pytest.approx(0.415)
    report(running=0)
    assert router.effective_fill(backend) == pytest.approx(0.42)
    report(running=0)
    assert router.effective_fill(backend) == 0.5
    assert backend.fill.reason is FillReason.TARGET


def test_feedback_off_ignores_the_backends_report() -> None:
    router, clock = _router(feedback=False)
    backend = router.pools["p"].backends[0]
    backend.report(ReportedLoad(kv_usage=0.4, waiting=0, preemptions=0.0), now=clock.now)
    assert router.limit(backend) == 500
    assert router.reported_tokens(backend) is None


LORA_FIXTURE = METRICS_FIXTURE.with_name("vllm-0.32-lora.json")
KV_LINE = 'vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.1'


def lora_page(entry: str, *, newest: str | None = None) -> str:
    """A captured page's lines (vllm-0.32-lora.json), with a KV line, and a series for the
    adapters `newest` newer than all of them, when given."""
    lines = [KV_LINE, *json.loads(LORA_FIXTURE.read_text())[entry]]
    if newest is not None:
        series = f'max_lora="2",running_lora_adapters="{newest}",waiting_lora_adapters="{newest}"'
        lines.append(f"vllm:lora_requests_info{{{series}}} 1.8e+09")
    return "\n".join(lines) + "\n"


def test_the_newest_lora_series_names_the_active_adapters() -> None:
    # idle after a run of several adapters: the newest series names none
    idle = load_from_metrics(lora_page("metrics_idle_after"))
    assert idle is not None
    assert (idle.active_adapters, idle.max_loras) == (frozenset(), 2)
    busy = load_from_metrics(lora_page("metrics_idle_after", newest="a1,a2"))
    assert busy is not None
    assert busy.active_adapters == {"a1", "a2"}
    # where a request for each adapter would run soonest
    assert [reported(busy).adapter_room(a, NOW) for a in ("a1", "a3")] == [0, 2]
    assert [reported(idle).adapter_room(a, NOW) for a in ("a1", "a3")] == [1, 1]


def test_the_processs_own_requests_take_adapter_slots_at_once() -> None:
    """A scrape tells the adapters running up to half a second late: the requests this
    process has in flight there count at once, and free their slot as they end."""
    backend = reported(load_from_metrics(lora_page("metrics_idle_after")))
    backend.adapter_started("a1")
    backend.adapter_started("a2")
    assert [backend.adapter_room(a, NOW) for a in ("a1", "a2", "a3")] == [0, 0, 2]
    backend.adapter_ended("a2")
    assert [backend.adapter_room(a, NOW) for a in ("a1", "a2", "a3")] == [0, 1, 1]
    backend.adapter_started("a3")
    backend.adapter_started("a3")
    backend.adapter_ended("a3")
    assert backend.adapter_room("a2", NOW) == 2  # a3 has one request left there


def test_a_page_before_any_adapter_ran_tells_no_adapters() -> None:
    load = load_from_metrics(lora_page("metrics_before_any_request"))
    assert load is not None
    assert (load.active_adapters, load.max_loras) == (frozenset(), None)
    assert reported(load).adapter_room("a1", NOW) == 1


NOW = 100.0


def reported(load: ReportedLoad | None) -> Backend:
    """A backend whose last scrape, at NOW, read `load`."""
    assert load is not None
    backend = Backend(
        name="b", pool="p", url="http://127.0.0.1:1", served_model="m", configured_capacity=1000
    )
    backend.report(load, now=NOW)
    return backend
