"""The official openai client against the gateway in front of simulated vLLM backends."""

from collections.abc import Iterator

import httpx
import openai
import pytest

from loadtest.sim.config import SimConfig
from tests.support.fleet import Fleet, run_fleet


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    sims = [SimConfig(model="meta/big-served", kv_tokens=8192, speed=50.0) for _ in range(2)]
    small = [SimConfig(model="small-served", kv_tokens=4096, speed=50.0)]
    with run_fleet(pools={"big": sims, "small": small}) as f:
        yield f


def _client(fleet: Fleet, key: str | None = None) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{fleet.url}/v1", api_key=key or fleet.keys["acme"], max_retries=0, timeout=20
    )


def test_non_streaming_chat_has_real_usage_and_the_pool_name(fleet: Fleet) -> None:
    client = _client(fleet)
    raw = client.chat.completions.with_raw_response.create(
        model="big", messages=[{"role": "user", "content": "Hello there!"}], max_tokens=12
    )
    completion = raw.parse()
    assert raw.headers["x-spillgate-outcome"] == "local"
    assert completion.model == "big"  # the served name is swapped back
    assert completion.usage is not None
    assert completion.usage.completion_tokens == 12
    assert completion.usage.prompt_tokens > 0
    assert completion.choices[0].message.content


def test_streaming_chat_relays_chunks_and_hides_usage_unless_asked(fleet: Fleet) -> None:
    client = _client(fleet)
    chunks = list(
        client.chat.completions.create(
            model="big", messages=[{"role": "user", "content": "Hi"}], max_tokens=8, stream=True
        )
    )
    assert all(c.usage is None for c in chunks)
    assert all(c.model == "big" for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len(text.split()) == 8


def test_streaming_with_include_usage_gets_the_usage_chunk(fleet: Fleet) -> None:
    client = _client(fleet)
    chunks = list(
        client.chat.completions.create(
            model="big",
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=5,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    usage = [c.usage for c in chunks if c.usage is not None]
    assert len(usage) == 1 and usage[0].completion_tokens == 5
    assert chunks[-1].choices == []


def test_legacy_completions_stream_and_non_stream(fleet: Fleet) -> None:
    client = _client(fleet)
    done = client.completions.create(model="small", prompt="Once upon a time", max_tokens=6)
    assert done.model == "small" and done.usage and done.usage.completion_tokens == 6
    parts = list(client.completions.create(model="small", prompt="x", max_tokens=4, stream=True))
    assert "".join(p.choices[0].text for p in parts if p.choices).split()


def test_models_lists_pools_in_config_order(fleet: Fleet) -> None:
    models = _client(fleet).models.list()
    assert [m.id for m in models.data] == ["big", "small"]


def test_errors_reach_the_client_in_openai_shape(fleet: Fleet) -> None:
    with pytest.raises(openai.AuthenticationError) as auth:
        _client(fleet, key="sk-wrong").chat.completions.create(
            model="big", messages=[{"role": "user", "content": "x"}]
        )
    assert auth.value.status_code == 401
    assert auth.value.body["code"] == "invalid_api_key"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError) as missing:
        _client(fleet).chat.completions.create(
            model="nope", messages=[{"role": "user", "content": "x"}]
        )
    assert missing.value.body["param"] == "model"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as bad:
        _client(fleet).chat.completions.create(
            model="big", messages=[{"role": "user", "content": "x"}], max_tokens=-5
        )
    assert bad.value.body["param"] == "max_tokens"  # type: ignore[index]


def test_health_readiness_and_admin_status(fleet: Fleet) -> None:
    assert httpx.get(f"{fleet.url}/healthz").json() == {"status": "ok"}
    assert httpx.get(f"{fleet.url}/readyz").status_code == 200
    status = fleet.status()
    big = status["pools"][0]
    assert big["name"] == "big"
    # 512 blocks of 16, one of them kept back by the engine
    assert [b["capacity_tokens"] for b in big["backends"]] == [8176, 8176]
    assert all(b["capacity_source"] == "metrics" for b in big["backends"])
    tenant_key = httpx.get(
        f"{fleet.url}/admin/status", headers={"authorization": f"Bearer {fleet.keys['acme']}"}
    )
    assert tenant_key.status_code == 403
    assert httpx.get(f"{fleet.url}/admin/status").status_code == 401
