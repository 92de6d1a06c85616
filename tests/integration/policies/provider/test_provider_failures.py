"""A provider that fails in any way (4xx, 5xx, an answer that is not one) is a failed spill:
counted, logged, and the request passes to the next policy; the client never sees the
provider's error, which names the provider's model.

The pool's one backend is too small for any request, so every request overflows to the
chain provider → cache → reject. The simulated provider serves only `hosted-mini-0613`;
the pool `typo` is mapped to a name it does not serve, as a misconfigured gateway would be.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from loadtest.sim.config import SimConfig
from loadtest.sim.provider import ProviderConfig
from tests.support.fleet import Fleet
from tests.support.harness import ServerThread
from tests.support.overflow import provider_fleet, provider_stats, sample

KEY = "sk-hosted"
SERVED = "hosted-mini-0613"
MISNAMED = "hosted-mini-0614"
BAD_BODY = "<html>hosted-mini-0613 is overloaded, oops</html>"
# what the provider's answers say that the client must never read
LEAKS = ("hosted-mini", "does not exist", "Invalid request", "Sorry about that", "oops")
CUES: dict[str, dict[str, Any]] = {
    "400": {"status": 400},
    "500": {"status": 500},
    "bad body": {"status": 200, "body": BAD_BODY},
}
REASONS = {"400": "status 400", "500": "status 500", "bad body": "bad body"}


@contextlib.contextmanager
def spill_fleet(*, breaker_failures: int) -> Iterator[tuple[Fleet, ServerThread]]:
    def pools(servers: dict[str, ServerThread]) -> list[dict[str, Any]]:
        backend = {"url": servers["tiny"].url, "served_model": "m", "capacity": 10}
        chain = {"overflow": ["provider", "cache", "reject"], "provider": "hosted"}
        return [
            {"name": "tiny", "backends": [backend], **chain},
            {"name": "typo", "backends": [backend], **chain},
        ]

    with provider_fleet(
        provider=ProviderConfig(api_key=KEY, models=(SERVED,)),
        provider_options={
            "models": {"tiny": SERVED, "typo": MISNAMED},
            "timeouts": {"connect": 1, "first_token": 2, "total": 5},
            "breaker_failures": breaker_failures,
        },
        pools=pools,
        tenants={"acme": {}},
        sims={"tiny": SimConfig(model="m", kv_tokens=1024, speed=5.0)},
    ) as built:
        yield built


@pytest.fixture(scope="module")
def spill() -> Iterator[tuple[Fleet, ServerThread]]:
    with spill_fleet(breaker_failures=1000) as built:
        yield built


def openai_client(fleet: Fleet) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{fleet.url}/v1", api_key=fleet.keys["acme"], max_retries=0, timeout=10
    )


def ask(
    fleet: Fleet, *, model: str = "tiny", stream: bool = False, content: str = "same question"
) -> tuple[int, str, str]:
    """Status, outcome header and the whole body the client received."""
    with openai_client(fleet) as client:
        try:
            raw = client.chat.completions.with_raw_response.create(
                model=model,
                messages=[{"role": "user", "content": content}],
                max_tokens=20,
                temperature=0,
                stream=stream,
            )
        except openai.APIStatusError as err:
            return err.status_code, err.response.headers["x-spillgate-outcome"], err.response.text
        return (
            raw.status_code,
            raw.headers["x-spillgate-outcome"],
            raw.http_response.read().decode(),
        )


def cue(hosted: ServerThread, failure: dict[str, Any]) -> None:
    httpx.post(f"{hosted.url}/sim/fail", json={**failure, "count": 1}, timeout=5).raise_for_status()


def failures(fleet: Fleet, reason: str) -> float:
    return sample(fleet, "spillgate_upstream_errors_total", target="hosted", reason=reason) or 0


def assert_nothing_leaked(body: str) -> None:
    assert [leak for leak in LEAKS if leak.lower() in body.lower()] == []


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("name", list(CUES))
def test_a_failed_spill_falls_through_to_the_cache(
    spill: tuple[Fleet, ServerThread], name: str, stream: bool
) -> None:
    fleet, hosted = spill
    status, outcome, _ = ask(fleet)  # the provider's answer, now in the cache
    assert (status, outcome in ("provider", "cached")) == (200, True)
    before, counted = provider_stats(hosted)["requests"], failures(fleet, REASONS[name])
    cue(hosted, CUES[name])
    status, outcome, body = ask(fleet, stream=stream)
    assert (status, outcome) == (200, "cached")
    assert_nothing_leaked(body)
    assert provider_stats(hosted)["requests"] == before + 1
    assert failures(fleet, REASONS[name]) == counted + 1


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("name", ["404", *CUES])
def test_a_failed_spill_falls_through_to_the_gateways_own_refusal(
    spill: tuple[Fleet, ServerThread],
    name: str,
    stream: bool,
    caplog: pytest.LogCaptureFixture,
) -> None:
    fleet, hosted = spill
    caplog.set_level(logging.WARNING, logger="spillgate.provider")
    reason = REASONS.get(name, "status 404")
    counted = failures(fleet, reason)
    if name != "404":
        cue(hosted, CUES[name])
    model = "typo" if name == "404" else "tiny"
    status, outcome, body = ask(fleet, model=model, stream=stream, content=f"{name} {stream}")
    assert (status, outcome) == (503, "rejected")
    error = httpx.Response(503, text=body).json()["error"]
    assert error["message"].startswith(f"Pool '{model}'")  # the gateway's own words
    assert_nothing_leaked(body)
    assert failures(fleet, reason) == counted + 1
    logged = [r.getMessage() for r in caplog.records if r.name == "spillgate.provider"]
    assert len(logged) == 1 and f"pool {model} ({reason})" in logged[0]
    said = {  # the operator reads what the provider said (a 5xx is not read: its status is)
        "404": f"The model `{MISNAMED}` does not exist",
        "400": f"Invalid request for model `{SERVED}`",
        "bad body": BAD_BODY,
    }
    assert said.get(name, "") in logged[0]


def test_a_refusal_of_one_request_leaves_the_breaker_closed_and_a_404_opens_it() -> None:
    with spill_fleet(breaker_failures=1) as (fleet, hosted):
        cue(hosted, CUES["400"])
        assert ask(fleet, content="one")[:2] == (503, "rejected")
        assert sample(fleet, "spillgate_provider_breaker_open", provider="hosted") in (0, None)
        assert ask(fleet, content="two")[:2] == (200, "provider")
        assert ask(fleet, model="typo", content="three")[:2] == (503, "rejected")
        assert sample(fleet, "spillgate_provider_breaker_open", provider="hosted") == 1
        asked = provider_stats(hosted)["requests"]
        assert ask(fleet, content="four")[:2] == (503, "rejected")
        assert provider_stats(hosted)["requests"] == asked  # breaker open: not asked
        assert provider_stats(hosted)["by_status"] == {"200": 1, "400": 1, "404": 1}


def test_a_provider_error_mid_stream_reaches_the_client_in_the_gateways_words(
    spill: tuple[Fleet, ServerThread], caplog: pytest.LogCaptureFixture
) -> None:
    """Past the first byte the request cannot pass on: the stream ends in an error event,
    the gateway's own, not the provider's."""
    fleet, hosted = spill
    caplog.set_level(logging.WARNING, logger="spillgate.provider")
    counted = failures(fleet, "mid-stream")
    cut = {"after_tokens": 3, "count": 1}
    httpx.post(f"{hosted.url}/sim/break", json=cut, timeout=5).raise_for_status()
    status, outcome, body = ask(fleet, stream=True, content="cut short")
    assert (status, outcome) == (200, "provider")
    events = [e.removeprefix("data: ") for e in body.split("\n\n") if e.startswith("data: ")]
    assert len(events) == 1 + 3 + 2  # the role, three tokens, the error, [DONE]
    assert json.loads(events[-2]) == {
        "error": {
            "message": "The provider failed mid-stream; the response is incomplete.",
            "type": "server_error",
            "param": None,
            "code": "upstream_error",
        }
    }
    assert events[-1] == "[DONE]"
    assert_nothing_leaked(body)
    assert failures(fleet, "mid-stream") == counted + 1
    logged = [r.getMessage() for r in caplog.records if r.name == "spillgate.provider"]
    assert len(logged) == 1 and f"while generating with `{SERVED}`" in logged[0]
