"""The simulated external provider: keyed, rate-limited, failing on cue, recording what it got."""

from collections.abc import Iterator

import httpx
import openai
import pytest

from loadtest.sim.provider import ProviderConfig, create_provider_app
from loadtest.sim.tokens import chat_prompt_tokens
from tests.support.harness import ServerThread

KEY = "sk-provider-test"
MESSAGES = [{"role": "user", "content": "Summarise the spill policy in one line."}]


def provider(**overrides: object) -> ServerThread:
    config = ProviderConfig(api_key=KEY, first_token_latency_s=0.0, token_latency_s=0.0001)
    fields = {**config.__dict__, **overrides}
    return ServerThread(create_provider_app(ProviderConfig(**fields)))  # type: ignore[arg-type]


@pytest.fixture
def server() -> Iterator[ServerThread]:
    with provider() as s:
        yield s


def client(url: str, key: str = KEY) -> openai.OpenAI:
    http = httpx.Client(timeout=10, verify=False)
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, http_client=http)


def test_chat_stream_and_non_stream_with_honest_usage(server: ServerThread) -> None:
    with client(server.url) as c:
        reply = c.chat.completions.create(model="gpt-sim", messages=MESSAGES, max_tokens=9)
        chunks = list(
            c.chat.completions.create(
                model="gpt-sim",
                messages=MESSAGES,
                max_tokens=30,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
    assert reply.model == "gpt-sim" and reply.usage is not None
    assert reply.usage.prompt_tokens == chat_prompt_tokens(MESSAGES)
    assert (
        reply.usage.completion_tokens == 9
        and len((reply.choices[0].message.content or "").split()) == 9
    )
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert len(text.split()) == 30
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 30


def test_wrong_or_missing_key_is_401_in_openai_shape(server: ServerThread) -> None:
    with (
        client(server.url, key="sk-client-key") as c,
        pytest.raises(openai.AuthenticationError) as err,
    ):
        c.chat.completions.create(model="gpt-sim", messages=MESSAGES, max_tokens=1)
    assert err.value.status_code == 401 and err.value.code == "invalid_api_key"
    with httpx.Client(base_url=server.url, timeout=5, verify=False) as http:
        missing = http.post("/v1/chat/completions", json={"model": "m", "messages": MESSAGES})
        stats = http.get("/sim/stats").json()
    assert missing.status_code == 401
    assert set(missing.json()["error"]) == {"message", "type", "param", "code"}
    assert stats["by_status"] == {"401": 2} and stats["completion_tokens"] == 0


def test_requests_per_minute_limit_answers_429_with_retry_after() -> None:
    with provider(requests_per_minute=2) as s, client(s.url) as c:
        for _ in range(2):
            c.chat.completions.create(model="gpt-sim", messages=MESSAGES, max_tokens=1)
        with pytest.raises(openai.RateLimitError) as err:
            c.chat.completions.create(model="gpt-sim", messages=MESSAGES, max_tokens=1)
    response = err.value.response
    assert response.status_code == 429
    assert int(response.headers["retry-after"]) == 30  # one request back at 2 per minute
    assert response.headers["x-ratelimit-remaining-requests"] == "0"
    assert err.value.code == "rate_limit_exceeded" and err.value.type == "requests"


def test_tokens_per_minute_limit_counts_prompt_and_max_tokens() -> None:
    with provider(tokens_per_minute=1000) as s, client(s.url) as c:
        c.chat.completions.create(model="gpt-sim", messages=MESSAGES, max_tokens=900)
        with pytest.raises(openai.RateLimitError) as err:
            c.chat.completions.create(model="gpt-sim", messages=MESSAGES, max_tokens=200)
    assert err.value.type == "tokens" and int(err.value.response.headers["retry-after"]) >= 1


def test_injected_failures_answer_5xx_then_recover(server: ServerThread) -> None:
    with httpx.Client(base_url=server.url, timeout=5, verify=False) as http:
        assert http.post("/sim/fail", json={"status": 503, "count": 2}).status_code == 200
        with client(server.url) as c:
            for _ in range(2):
                with pytest.raises(openai.InternalServerError) as err:
                    c.chat.completions.create(model="gpt-sim", messages=MESSAGES, max_tokens=1)
                assert err.value.status_code == 503
            c.chat.completions.create(model="gpt-sim", messages=MESSAGES, max_tokens=1)
        assert http.get("/sim/stats").json()["by_status"] == {"200": 1, "503": 2}


def test_injected_delay_holds_the_first_token(server: ServerThread) -> None:
    with httpx.Client(base_url=server.url, verify=False, timeout=5) as http:
        http.post("/sim/delay", json={"seconds": 30, "count": 1})
        with pytest.raises(httpx.ReadTimeout):
            http.post(
                "/v1/chat/completions",
                json={"model": "m", "messages": MESSAGES, "max_tokens": 1},
                headers={"authorization": f"Bearer {KEY}"},
                timeout=0.3,
            )
        fast = http.post(
            "/v1/chat/completions",
            json={"model": "m", "messages": MESSAGES, "max_tokens": 1},
            headers={"authorization": f"Bearer {KEY}"},
        )
        stats = http.get("/sim/stats").json()
    assert fast.status_code == 200
    assert stats["aborted"] == 1  # the abandoned one stopped waiting when its client left


def test_stats_record_the_headers_the_provider_received(server: ServerThread) -> None:
    with client(server.url) as c:
        c.chat.completions.create(
            model="gpt-sim", messages=MESSAGES, max_tokens=1, extra_headers={"x-trace": "t-1"}
        )
    with httpx.Client(base_url=server.url, timeout=5, verify=False) as http:
        stats = http.get("/sim/stats").json()
        http.post("/sim/reset")
        reset = http.get("/sim/stats").json()
    assert stats["requests"] == 1 and stats["authorizations_seen"] == [f"Bearer {KEY}"]
    assert stats["last_headers"]["x-trace"] == "t-1"
    assert stats["prompt_tokens"] == chat_prompt_tokens(MESSAGES)
    assert reset["requests"] == 0 and reset["authorizations_seen"] == []
