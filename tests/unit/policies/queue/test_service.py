"""Attained service on a virtual clock: weighting, decay, correction, and the shared side."""

from __future__ import annotations

import pytest

from gateway.clock import ManualClock
from gateway.request import InferenceRequest
from policies.queue import service as service_module
from policies.queue.service import Service
from tests.support.upstream import chat_request


def request(
    tenant: str = "t", *, prompt: int = 100, max_tokens: int = 50, reserve: int = 0, n: int = 1
) -> InferenceRequest:
    made = chat_request(stream=True, max_tokens=max_tokens, n=n, output_reserve=reserve)
    return made._replace(tenant=tenant, prompt_tokens=prompt)


def account(clock: ManualClock, *, weight: float = 4.0, half_life_s: float = 60.0) -> Service:
    return Service(clock=clock, output_weight=weight, half_life_s=half_life_s)


def test_admission_counts_the_prompt_and_the_weighted_expected_output() -> None:
    s = account(ManualClock())
    s.attain(request("a", prompt=100, max_tokens=50))
    assert s.of("a") == pytest.approx(100 + 4 * 50)
    s.attain(request("b", prompt=10, max_tokens=500, reserve=20, n=2))  # the reserve, per choice
    assert s.of("b") == pytest.approx(10 + 4 * 2 * 20)
    assert s.of("never") == 0.0


def test_settlement_corrects_the_count_to_the_usage() -> None:
    s = account(ManualClock())
    r = request("a", prompt=100, max_tokens=50)
    s.attain(r)
    s.settle(r, prompt_tokens=120, completion_tokens=10)  # ended early
    assert s.of("a") == pytest.approx(120 + 4 * 10)


def test_service_halves_every_half_life() -> None:
    clock = ManualClock()
    s = account(clock, half_life_s=10.0)
    s.attain(request("a", prompt=400, max_tokens=0))
    clock.advance(10.0)
    assert s.of("a") == pytest.approx(200)
    s.attain(request("a", prompt=200, max_tokens=0))
    clock.advance(20.0)
    assert s.of("a") == pytest.approx(100)
    assert s.figures() == {"a": pytest.approx(100)}


def test_a_long_running_account_rescales_without_losing_its_figures(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(service_module, "REBASE_GROWTH", 4.0)  # rescale after two half-lives
    clock = ManualClock()
    s = account(clock, half_life_s=1.0)
    s.attain(request("a", prompt=800, max_tokens=0))
    clock.advance(3.0)
    s.attain(request("b", prompt=10, max_tokens=0))  # rescales first
    assert s.of("a") == pytest.approx(100)
    assert s.of("b") == pytest.approx(10)
    clock.advance(1.0)
    assert s.of("a") == pytest.approx(50)


def test_a_correction_larger_than_what_is_left_reads_as_nothing() -> None:
    clock = ManualClock()
    s = account(clock, half_life_s=1.0)
    r = request("a", prompt=100, max_tokens=100)
    s.attain(r)
    clock.advance(10.0)  # the admission's count has all but decayed
    s.settle(r, prompt_tokens=100, completion_tokens=0)
    assert s.of("a") == 0.0


def test_shared_figures_replace_the_base_and_local_counts_add_to_them() -> None:
    clock = ManualClock()
    s = account(clock, half_life_s=10.0)
    s.attain(request("a", prompt=100, max_tokens=0))
    sent = s.take_unshared()
    assert sent == {"a": pytest.approx(100)}
    assert s.of("a") == pytest.approx(100)  # still counted while the pass is on the wire
    s.attain(request("a", prompt=50, max_tokens=0))  # counted during the pass
    s.replace_base({"a": 1000.0, "b": 300.0})  # the fleet's, this replica's 100 included
    assert s.of("a") == pytest.approx(1050)
    assert s.of("b") == pytest.approx(300)
    clock.advance(10.0)
    assert s.of("b") == pytest.approx(150)
    assert s.take_unshared() == {"a": pytest.approx(25)}


def test_a_failed_pass_keeps_what_was_sent_in_the_local_figures_once() -> None:
    s = account(ManualClock())
    s.attain(request("a", prompt=100, max_tokens=0))
    s.take_unshared()
    s.keep_sent()
    assert s.of("a") == pytest.approx(100)
    assert s.take_unshared() == {}  # not sent again: Redis may have counted it
    assert s.of("a") == pytest.approx(100)
