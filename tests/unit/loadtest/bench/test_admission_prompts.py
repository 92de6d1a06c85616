"""The system messages `spillgate bench admission --shared-prompt` opens its chats with."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

from loadtest.bench.admission_plan import BenchPlan, system_text
from loadtest.loadgen.workload import message_tokens
from loadtest.sim.tokens import chat_prompt_tokens

PLAN = BenchPlan(prompt_tokens="uniform:40:80", shared_prompt=1500)


def test_without_a_shared_prompt_the_plans_are_todays() -> None:
    bare = BenchPlan(prompt_tokens="uniform:40:80")
    plans = bare.burst(48, 0, "sim")
    assert all(p.system == "" for p in plans)
    assert [p.prompt_tokens for p in plans] == [chat_prompt_tokens(p.messages()) for p in plans]


def test_a_shared_prompt_opens_every_chat_of_every_burst_with_the_same_message() -> None:
    bursts = [PLAN.burst(size, run, "sim") for size in (24, 48) for run in range(2)]
    systems = {p.system for plans in bursts for p in plans}
    assert len(systems) == 1
    (system,) = systems
    assert message_tokens(system) == 1500
    bare = replace(PLAN, shared_prompt=0).burst(48, 0, "sim")
    shared = PLAN.burst(48, 0, "sim")
    # the same user messages as without it, and prompt lengths as the simulator counts them
    assert [p.text for p in shared] == [p.text for p in bare]
    assert [p.prompt_tokens for p in shared] == [chat_prompt_tokens(p.messages()) for p in shared]
    assert [p.prompt_tokens - b.prompt_tokens for p, b in zip(shared, bare, strict=True)] == [
        1500
    ] * 48


def test_mixed_gives_a_third_each_message_a_b_and_one_of_their_own() -> None:
    mixed = replace(PLAN, prompt_mix="mixed")
    plans = mixed.burst(48, 0, "sim")
    counted = Counter(p.system for p in plans)
    a, b = system_text(1500, label="A", seed=20), system_text(1500, label="B", seed=20)
    assert counted[a] == counted[b] == 16
    assert sorted(counted.values()) == [1] * 16 + [16, 16]
    assert {message_tokens(system) for system in counted} == {1500}
    # no two messages share their first block, so nothing but A and B is shared
    assert len({system[:64] for system in counted}) == 18
    assert mixed.burst(48, 0, "sim") == plans
    assert [p.system for p in mixed.burst(48, 1, "sim")] != [p.system for p in plans]
