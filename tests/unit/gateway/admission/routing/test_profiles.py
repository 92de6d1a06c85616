"""Routing profiles: the registry against the names a config may use, the picker's weighed
order, a profile's weights deciding where a router reserves, the configuration's checks,
and the worked example of docs/routing-plugins.md."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Any, get_args

import pytest

from gateway.admission.fleet.backend_load import LOAD_SIGNALS, ReportedLoad, load_from_metrics
from gateway.admission.routing.plugins import BestPicker, Scorer
from gateway.admission.routing.profile import pickers, scorers
from gateway.admission.routing.route import Candidate, Route
from gateway.clock import ManualClock
from gateway.config import ConfigError, parse_settings
from gateway.config.routing import BUILTIN_PROFILES, PickerName, ScorerName
from tests.support.routers import local_router

PAGE = Path(__file__).resolve().parents[5] / "docs" / "routing-plugins.md"


def test_the_registry_builds_every_name_a_config_may_use() -> None:
    assert set(scorers()) == set(get_args(ScorerName))
    assert set(pickers()) == set(get_args(PickerName))
    for profile in BUILTIN_PROFILES.values():
        assert all(s.plugin in scorers() for s in profile.scorers)


def test_the_picker_orders_by_the_weighed_sum_and_keeps_the_order_of_ties() -> None:
    candidates = [_candidate(place=i) for i in range(4)]
    weighed = [(10.0, [0.0, 1.0, 0.0, 1.0]), (1.0, [1.0, 0.0, 0.5, 0.0])]
    order = BestPicker().order(candidates, weighed)
    # sums 1, 10, 0.5, 10: the two tens as they came, then 1, then 0.5
    assert [c.place for c in order] == [1, 3, 0, 2]


def _router(profile: dict[str, Any]) -> tuple[Any, ManualClock]:
    clock = ManualClock()
    router = local_router(
        [1000, 1000],
        target_fill=0.9,
        block_size=1,
        clock=clock,
        routing="mine",
        routing_profiles=[{"name": "mine", **profile}],
    )
    return router, clock


def _waiting(router: Any, backend: str, waiting: int, now: float) -> None:
    page = f"vllm:kv_cache_usage_perc 0.0\nvllm:num_requests_waiting {waiting}\n"
    load = load_from_metrics(page, router.backend(backend).signals)
    assert load is not None
    router.backend(backend).report(load, now=now)


def test_a_profiles_weights_decide_where_the_router_reserves() -> None:
    """p-1 is the fuller; p-0 has requests waiting inside its engine. Weighing the waiting
    over the fill sends the request to p-1; weighing the fill alone, to p-0."""

    async def where(profile: dict[str, Any]) -> str:
        router, clock = _router(profile)
        held = await router.reserve(Route("p", 300, exclude={"p-0"}))
        assert held is not None and held.backend == "p-1"
        for name, waiting in (("p-0", 3), ("p-1", 0)):
            _waiting(router, name, waiting, clock.monotonic())
        placed = await router.reserve(Route("p", 100))
        assert placed is not None
        return str(placed.backend)

    by_waiting = {"scorers": [{"plugin": "waiting", "weight": 10}, {"plugin": "fill"}]}
    by_fill = {"scorers": [{"plugin": "waiting", "weight": 0.1}, {"plugin": "fill"}]}
    assert asyncio.run(where(by_waiting)) == "p-1"
    assert asyncio.run(where(by_fill)) == "p-0"


def test_a_scorer_asks_the_scrape_for_the_metrics_it_reads() -> None:
    router, _ = _router({"scorers": [{"plugin": "waiting"}]})
    assert router.backend("p-0").signals == LOAD_SIGNALS  # the waiting count is the load's
    page = (
        'vllm:kv_cache_usage_perc{engine="0"} 0.5\n'
        'vllm:num_requests_waiting{engine="0"} 2\n'
        'vllm:num_requests_waiting{engine="1"} 3\n'
        'vllm:cache_config_info{block_size="16"} 1\n'
    )
    load = load_from_metrics(page, LOAD_SIGNALS | {"vllm:cache_config_info"})
    assert load is not None
    assert load.signals.value("vllm:num_requests_waiting") == 5
    assert load.signals.value("vllm:num_requests_waiting", engine="1") == 3
    assert load.signals.value("vllm:cache_config_info", block_size="16") == 1
    assert load_from_metrics(page) is not None
    assert load_from_metrics(page).signals.value("vllm:cache_config_info") is None  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("config", "problem"),
    [
        ({"routing": "nosuch"}, "no routing profile named 'nosuch'"),
        (
            {"routing_profiles": [{"name": "prefix", "scorers": [{"plugin": "fill"}]}]},
            "'prefix' is a built-in routing profile",
        ),
        (
            {"routing_profiles": [{"name": "x", "scorers": [{"plugin": "fil"}]}]},
            "unknown plugin 'fil'; did you mean 'fill'?",
        ),
        ({"routing_profiles": [{"name": "x", "scorers": []}]}, "at least 1 item"),
    ],
)
def test_a_profile_that_names_nothing_known_is_refused(
    config: dict[str, Any], problem: str
) -> None:
    pool = {"name": "p", "backends": [{"url": "http://127.0.0.1:1"}]}
    if "routing" in config:
        pool["routing"] = config.pop("routing")
    with pytest.raises(ConfigError) as raised:
        parse_settings({"tenants": [{"name": "t", "key_env": "K"}], "pools": [pool], **config})
    assert problem in str(raised.value)


def test_the_worked_example_of_the_docs_scores_as_it_says() -> None:
    """The page's scorer, run as written: the lower a backend's own KV use, the higher."""
    code = re.search(r"```python\n(.*?)```", PAGE.read_text(encoding="utf-8"), re.S)
    assert code is not None
    scope: dict[str, Any] = {}
    exec(compile(code.group(1), str(PAGE), "exec"), scope)  # the page's own code, run as written
    scorer: Scorer = scope["KvUsageScorer"]()
    assert scorer.name == "kv-usage" and scorer.signals == {"vllm:kv_cache_usage_perc"}
    router, clock = _router({"scorers": [{"plugin": "fill"}]})
    now = clock.monotonic()
    wanted = LOAD_SIGNALS | scorer.signals
    for name, used in (("p-0", 0.75), ("p-1", 0.25)):
        load = load_from_metrics(f"vllm:kv_cache_usage_perc {used}\n", wanted)
        assert isinstance(load, ReportedLoad)
        router.backend(name).report(load, now=now)
    candidates = [
        _candidate(place=i, backend=router.backend(name)) for i, name in enumerate(("p-0", "p-1"))
    ]
    assert scorer.score(Route("p", 10), candidates, now) == [0.25, 0.75]
    clock.advance(10.0)  # every scrape stale: nothing to say
    assert scorer.score(Route("p", 10), candidates, clock.monotonic()) is None


def _candidate(*, place: int, backend: Any = None) -> Candidate:
    return Candidate(0.0, place, backend, 900, 1000, 0.0, 10, 10)
