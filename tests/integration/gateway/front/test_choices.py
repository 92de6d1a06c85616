"""`n` choices, as vLLM serves them: reserved one sequence each, relayed unchanged,
accounted from the answer's usage (the official openai client, stream and non-stream)."""

import asyncio
from collections.abc import Iterator

import httpx
import openai
import pytest

from loadtest.sim.config import SimConfig
from tests.support.fleet import ADMIN_TOKEN, Fleet, run_fleet
from tests.support.metrics import text_sum
from tests.support.overflow import sample

MSG = [{"role": "user", "content": "Hi"}]  # the gateway estimates 5 prompt tokens


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    fast = [SimConfig(model="m", kv_tokens=8192, speed=50.0)]
    slow = [SimConfig(model="s", kv_tokens=8192, speed=1.0)]
    with run_fleet(pools={"m": fast, "s": slow}) as f:
        yield f


def _client(fleet: Fleet) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{fleet.url}/v1", api_key=fleet.keys["acme"], max_retries=0, timeout=20
    )


def completion_tokens(fleet: Fleet) -> float:
    return sample(fleet, "spillgate_tokens_total", target="m-0", kind="completion") or 0.0


def test_n_choices_non_streamed(fleet: Fleet) -> None:
    before = completion_tokens(fleet)
    raw = _client(fleet).chat.completions.with_raw_response.create(
        model="m", messages=MSG, max_tokens=7, n=3
    )
    completion = raw.parse()
    assert raw.headers["x-spillgate-outcome"] == "local"
    assert [c.index for c in completion.choices] == [0, 1, 2]
    assert all(len((c.message.content or "").split()) == 7 for c in completion.choices)
    assert completion.usage is not None and completion.usage.completion_tokens == 21
    assert completion.model == "m"
    assert completion_tokens(fleet) - before == 21


def test_n_choices_streamed_with_their_index_and_usage(fleet: Fleet) -> None:
    before = completion_tokens(fleet)
    chunks = list(
        _client(fleet).chat.completions.create(
            model="m",
            messages=MSG,
            max_tokens=6,
            n=3,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    texts: dict[int, str] = {}
    finished: dict[int, str | None] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason is not None:
                finished[choice.index] = choice.finish_reason
    assert sorted(texts) == [0, 1, 2]
    assert all(len(text.split()) == 6 for text in texts.values())
    assert finished == {0: "length", 1: "length", 2: "length"}
    usage = [c.usage for c in chunks if c.usage is not None]
    assert len(usage) == 1 and usage[0].completion_tokens == 18
    assert completion_tokens(fleet) - before == 18


def test_n_choices_streamed_without_usage(fleet: Fleet) -> None:
    chunks = list(
        _client(fleet).chat.completions.create(
            model="m", messages=MSG, max_tokens=4, n=2, stream=True
        )
    )
    assert all(c.usage is None for c in chunks)
    indexes = {choice.index for c in chunks for choice in c.choices}
    assert indexes == {0, 1}


def test_n_choices_reserve_one_sequence_each_in_whole_blocks(fleet: Fleet) -> None:
    async def scenario() -> tuple[int, float]:
        headers = {"authorization": f"Bearer {fleet.keys['acme']}"}
        body = {"model": "s", "messages": MSG, "max_tokens": 300, "n": 3, "stream": True}
        async with (
            httpx.AsyncClient(base_url=fleet.url, headers=headers, timeout=30) as client,
            client.stream("POST", "/v1/chat/completions", json=body) as response,
        ):
            assert response.status_code == 200
            async for _ in response.aiter_bytes():
                break  # the answer has begun: the reservation is held
            status = await client.get(
                "/admin/status", headers={"authorization": f"Bearer {ADMIN_TOKEN}"}
            )
            held = status.json()["pools"][1]["backends"][0]["tokens_in_flight"]
            text = (await client.get(f"{fleet.backends['s'][0].url}/metrics")).text
            running = text_sum(text, "vllm:num_requests_running")
        return held, running

    # 3 x (5 + 300 tokens, in blocks of 16: 320)
    assert asyncio.run(scenario()) == (960, 3.0)


def test_n_out_of_range_is_a_400(fleet: Fleet) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        _client(fleet).chat.completions.create(model="m", messages=MSG, max_tokens=4, n=0)
    assert caught.value.body["param"] == "n"  # type: ignore[index]
