"""A request with a wrong or missing API key is refused as OpenAI refuses it, and the operator
sees it: a counter by reason and one log line with the key's first characters, never the key."""

from __future__ import annotations

import logging

import httpx
import pytest

from gateway.admission.fleet.metrics_text import samples
from loadtest.sim.config import SimConfig
from tests.support.fleet import run_fleet

WRONG = "sk-wrong-0123456789abcdef0123456789"
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def refused(metrics: str) -> dict[str, float]:
    found = samples(metrics, ("spillgate_refused_keys_total",))
    return {s.labels["reason"]: s.value for s in found}


def test_refused_keys_are_counted_by_reason_and_logged_once_without_the_key(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    with run_fleet(pools={"m": [SimConfig(model="m", kv_tokens=4096, no_delay=True)]}) as fleet:
        before = refused(fleet.metrics_text())
        chat = f"{fleet.url}/v1/chat/completions"
        wrong = [
            httpx.post(chat, json=CHAT, headers={"authorization": f"Bearer {WRONG}"}, timeout=10)
            for _ in range(3)
        ]
        missing = httpx.post(chat, json=CHAT, timeout=10)
        with fleet.client() as client:
            served = client.post("/v1/chat/completions", json=CHAT)
        after = refused(fleet.metrics_text())
    assert [r.status_code for r in wrong] == [401] * 3 and missing.status_code == 401
    assert wrong[0].json()["error"]["message"] == "Incorrect API key provided."
    assert served.status_code == 200
    assert before == {}
    assert after == {"incorrect": 3, "missing": 1}
    lines = [r.getMessage() for r in caplog.records if r.name == "spillgate.auth"]
    # the first refusal is told, the rest fall in the quiet that follows it
    assert lines == ["refused a request: incorrect API key sk-wrong" + "*" * (len(WRONG) - 8)]
    assert all(WRONG not in r.getMessage() for r in caplog.records)
