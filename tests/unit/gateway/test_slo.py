"""What the TTFT ladder predicts by: recent means per place, forgotten once stale."""

from __future__ import annotations

import math

import pytest

from gateway.clock import ManualClock
from gateway.request import Endpoint, InferenceRequest
from gateway.slo import STALE_S, WEIGHT, Latencies, predict, unattainable


def request(*, tpot_slo_s: float | None = None) -> InferenceRequest:
    return InferenceRequest(
        endpoint=Endpoint.CHAT, tenant="t", pool="p", priority="standard", stream=True,
        client_wants_usage=False, prompt_chars=4, prompt_tokens=1, max_output_tokens=16,
        body={}, tpot_slo_s=tpot_slo_s,
    )  # fmt: skip


def test_a_place_predicts_the_weighted_mean_of_its_recent_answers() -> None:
    latencies = Latencies(ManualClock())
    assert predict(latencies.local, "p", request()) is None  # nothing measured yet
    latencies.local.observe("p", 1.0)
    latencies.local.observe("p", 2.0)
    assert predict(latencies.local, "p", request()) == pytest.approx(1.0 + WEIGHT * 1.0)
    assert predict(latencies.provider, "p", request()) is None  # another kind of place


def test_a_stale_mean_predicts_nothing_and_the_next_answer_starts_anew() -> None:
    clock = ManualClock()
    latencies = Latencies(clock)
    latencies.local.observe("p", 5.0)
    clock.advance(STALE_S + 1)
    assert latencies.local.ttft_s("p") is None  # passed over while slow: tried again
    latencies.local.observe("p", 0.1)
    assert latencies.local.ttft_s("p") == pytest.approx(0.1)
    assert latencies.snapshot()["local"]["p"]["answers"] == 2


def test_a_place_slower_per_token_than_the_objective_is_predicted_never() -> None:
    latencies = Latencies(ManualClock())
    latencies.provider.observe("hosted", 0.2, 0.05)
    assert predict(latencies.provider, "hosted", request(tpot_slo_s=0.02)) == math.inf
    assert predict(latencies.provider, "hosted", request(tpot_slo_s=0.1)) == pytest.approx(0.2)


def test_the_refusal_names_each_tiers_prediction_and_the_header() -> None:
    error = unattainable("big", 0.3, [("queue", 2.5), ("provider", math.inf)], retry_after=3.0)
    assert error.status == 503 and error.code == "slo_unattainable"
    assert "within 300 ms" in str(error)
    assert "queue ~2500 ms, provider ~never now" in str(error)
    assert "x-spillgate-ttft-ms" in str(error)
