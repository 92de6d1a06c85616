"""What each scheduled request asks for: lengths, tenants, repeats a cache can answer."""

import random

import pytest

from loadtest.loadgen_workload import (
    LengthDist,
    PlannedRequest,
    TenantKey,
    Workload,
    plan_requests,
    prompt_text,
)
from loadtest.sim_tokens import chat_prompt_tokens


@pytest.mark.parametrize(
    ("spec", "kind", "mean"),
    [
        ("128", "fixed", 128),
        ("fixed:64", "fixed", 64),
        ("uniform:10:30", "uniform", 20),
        ("normal:200:20", "normal", 200),
        ("exponential:50", "exponential", 50),
    ],
)
def test_length_specs_parse(spec: str, kind: str, mean: float) -> None:
    dist = LengthDist.parse(spec)
    assert (dist.kind, dist.mean()) == (kind, mean)


@pytest.mark.parametrize("spec", ["zipf:2", "uniform:10", "normal:1:2:3", "fixed:-3", "abc"])
def test_bad_length_specs_name_the_problem(spec: str) -> None:
    with pytest.raises(ValueError, match=r"distribution|takes"):
        LengthDist.parse(spec)


def test_draws_are_whole_tokens_within_bounds() -> None:
    rng = random.Random(0)
    uniform = [LengthDist.parse("uniform:10:30").draw(rng) for _ in range(500)]
    assert min(uniform) >= 10 and max(uniform) <= 30
    capped = [LengthDist.parse("lognormal:100:2", cap=400).draw(rng) for _ in range(500)]
    assert min(capped) >= 1 and max(capped) == 400


@pytest.mark.parametrize("tokens", [8, 50, 128, 600])
def test_prompt_text_has_the_planned_token_count_as_the_simulator_counts(tokens: int) -> None:
    text = prompt_text(tokens, salt="req-0-1")
    assert chat_prompt_tokens([{"role": "user", "content": text}]) == tokens


def test_tenant_keys_may_be_named() -> None:
    assert TenantKey.parse_all(["sk-a", "blue=sk-b"]) == [
        TenantKey(name="t0", key="sk-a"),
        TenantKey(name="blue", key="sk-b"),
    ]


def _workload(**kw: object) -> Workload:
    base: dict[str, object] = {
        "model": "m",
        "prompt_tokens": LengthDist.parse("uniform:20:200"),
        "output_tokens": LengthDist.parse("uniform:5:50"),
        "tenants": TenantKey.parse_all(["a=1", "b=2"]),
    }
    return Workload(**(base | kw))  # type: ignore[arg-type]


def test_plans_spread_tenants_and_streaming_as_asked() -> None:
    times = [i / 100 for i in range(1000)]
    plans = plan_requests(times, _workload(stream_fraction=0.25))
    assert [p.at_s for p in plans] == times
    assert {p.tenant for p in plans} == {"a", "b"}
    assert 180 < sum(p.stream for p in plans) < 320
    assert len({p.text for p in plans}) == 1000  # no accidental cache hits


def test_repeated_requests_copy_a_few_fixed_requests_whole() -> None:
    plans = plan_requests([i / 10 for i in range(400)], _workload(repeat_fraction=0.5))
    repeats = [p for p in plans if p.repeated]
    assert 150 < len(repeats) < 250
    shapes = {(p.tenant, p.text, p.max_tokens, p.stream) for p in repeats}
    assert len(shapes) <= 4


def test_priming_sends_each_fixed_request_first() -> None:
    plans: list[PlannedRequest] = plan_requests(
        [i / 10 for i in range(50)], _workload(repeat_fraction=0.3, prime_repeats=True)
    )
    first = plans[:4]
    assert all(p.repeated for p in first)
    assert len({p.text for p in first}) == 4
    assert {p.text for p in plans if p.repeated} == {p.text for p in first}
