"""What each scheduled request asks for: lengths, tenants, repeats a cache can answer."""

import hashlib
import random

import orjson
import pytest

from loadtest.loadgen.client import RequestShape
from loadtest.loadgen.workload import (
    LengthDist,
    PlannedRequest,
    TenantKey,
    Workload,
    message_text,
    plan_requests,
    prompt_text,
    system_prompt,
)
from loadtest.sim.tokens import chat_prompt_tokens


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


def _plan_digest(plans: list[PlannedRequest]) -> str:
    fields = [
        (p.index, p.tenant, p.prompt_tokens, p.max_tokens, p.stream, p.repeated, p.text, p.seed)
        for p in plans
    ]
    return hashlib.sha256(repr(fields).encode()).hexdigest()


def test_without_a_shared_prefix_or_turns_the_plans_are_those_planned_before_them() -> None:
    # the digest of these plans as planned before prefix sharing existed
    workload = _workload(repeat_fraction=0.2, seeded=True, stream_fraction=0.5)
    plans = plan_requests([i / 10 for i in range(200)], workload, seed=7)
    assert _plan_digest(plans) == (
        "35bf233f84d4ed50b014829fb33676e285a732d89701934ec9de09c80196e647"
    )
    assert all(p.system == "" and p.history == () for p in plans)
    assert plans[3].messages() == [{"role": "user", "content": plans[3].text}]
    assert plans[3].prompt() == plans[3].text


def test_each_tenant_has_its_own_system_prompt_the_same_in_every_request() -> None:
    plans = plan_requests(
        [i / 10 for i in range(60)], _workload(shared_prefix_tokens=300, repeat_fraction=0.2)
    )
    systems = {t: {p.system for p in plans if p.tenant == t} for t in ("a", "b")}
    assert all(len(texts) == 1 for texts in systems.values())
    (a,), (b,) = systems["a"], systems["b"]
    assert a != b and a[:40] != b[:40]
    assert a == system_prompt(300, tenant="a", seed=0)
    assert system_prompt(300, tenant="a", seed=1) != a  # another seed, another prompt
    # 300 tokens as a message, as the simulator counts it; every prompt counted in full
    assert chat_prompt_tokens([{"role": "system", "content": a}]) == 300 + 3
    assert all(chat_prompt_tokens(p.messages()) == p.prompt_tokens for p in plans)
    assert all(p.messages()[0] == {"role": "system", "content": p.system} for p in plans)


def test_a_shared_prefix_keeps_the_arrivals_tenants_and_lengths_of_the_seed() -> None:
    times = [i / 10 for i in range(100)]
    plain = plan_requests(times, _workload())
    shared = plan_requests(times, _workload(shared_prefix_tokens=200, turns=3))
    assert [(p.tenant, p.text, p.max_tokens, p.stream) for p in shared] == [
        (p.tenant, p.text, p.max_tokens, p.stream) for p in plain
    ]
    opening = [(p, q) for p, q in zip(shared, plain, strict=True) if not p.history]
    assert len(opening) == 34
    assert all(p.prompt_tokens == q.prompt_tokens + 200 for p, q in opening)


def test_later_turns_resend_the_chat_so_far_in_order() -> None:
    tenants = TenantKey.parse_all(["a=1"])
    plans = plan_requests(
        [i / 10 for i in range(7)],
        _workload(tenants=tenants, turns=3, shared_prefix_tokens=64, max_tokens=16),
    )
    assert [len(p.history) for p in plans] == [0, 2, 4, 0, 2, 4, 0]
    first, second, third = plans[:3]
    assert second.history[0] == ("user", first.text)
    assert [role for role, _ in third.history] == ["user", "assistant", "user", "assistant"]
    assert third.history[:2] == second.history and third.history[2] == ("user", second.text)
    # a made-up answer as long as the mean answer, within max_tokens
    answer = third.history[1][1]
    assert answer == message_text(16, salt="answer-0-0") and len(answer) == 16 * 4
    assert [m["role"] for m in third.messages()] == [
        "system", "user", "assistant", "user", "assistant", "user"
    ]  # fmt: skip
    assert third.messages()[-1]["content"] == third.text
    assert chat_prompt_tokens(third.messages()) == third.prompt_tokens
    assert plans[3].history == () and plans[3].text not in {m for _, m in third.history}
    assert third.prompt() == "\n\n".join(m["content"] for m in third.messages())


def test_the_request_body_sends_the_whole_chat() -> None:
    plan = PlannedRequest(
        index=0, at_s=0.0, tenant="a", prompt_tokens=40, max_tokens=8, stream=False,
        repeated=False, text="now", system="be brief", history=(("user", "hi"),
                                                                 ("assistant", "hello")),
    )  # fmt: skip
    chat = orjson.loads(RequestShape(model="m").body(plan))
    assert chat["messages"] == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "now"},
    ]
    completion = orjson.loads(RequestShape(model="m", endpoint="completions").body(plan))
    assert completion["prompt"] == "be brief\n\nhi\n\nhello\n\nnow"
