"""/v1/embeddings and /v1/responses through the gateway, with the official openai client:
tenant limits, admission by tokens and accounting from `usage`, the pool's kind, and
continuations (`previous_response_id`) sent to the backend that holds their predecessor.
Each test ends with no tokens reserved anywhere."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from loadtest.sim.app import create_sim_app
from loadtest.sim.config import SimConfig
from tests.support.fleet import Fleet, run_fleet
from tests.support.harness import ServerThread
from tests.support.overflow import sample, wait_for

CHAT, EMBED = "chat", "embed"
DIM = 8


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    chat = [SimConfig(model="served-chat", kv_tokens=8192, speed=5.0) for _ in range(2)]
    embed = [SimConfig(model="served-embed", kv_tokens=8192, embedding_dim=DIM)]
    tenants = {"acme": {}, "small": {"tokens_per_minute": 50}}
    with run_fleet(
        pools={CHAT: chat, EMBED: embed},
        pool_options={EMBED: {"kind": "embedding", "overflow": ["queue", "reject"]}},
        tenants=tenants,
    ) as f:
        yield f


@pytest.fixture(autouse=True)
def nothing_reserved_after(fleet: Fleet) -> Iterator[None]:
    yield
    held = {
        b["name"]: b["tokens_in_flight"] for p in fleet.status()["pools"] for b in p["backends"]
    }
    assert held == {"chat-0": 0, "chat-1": 0, "embed-0": 0}


def _client(fleet: Fleet, tenant: str = "acme") -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{fleet.url}/v1", api_key=fleet.keys[tenant], max_retries=0, timeout=20
    )


def _tokens(fleet: Fleet, target: str, kind: str) -> float:
    return sample(fleet, "spillgate_tokens_total", target=target, kind=kind) or 0.0


def _requests(fleet: Fleet, pool: str, outcome: str) -> float:
    labels = {"pool": pool, "tenant": "acme", "outcome": outcome}
    return sample(fleet, "spillgate_requests_total", **labels) or 0.0


def test_the_models_list_names_the_embedding_pool(fleet: Fleet) -> None:
    assert [m.id for m in _client(fleet).models.list()] == [CHAT, EMBED]


def test_one_embedding_with_usage_accounted(fleet: Fleet) -> None:
    before = _tokens(fleet, "embed-0", "prompt"), _requests(fleet, EMBED, "local")
    raw = _client(fleet).embeddings.with_raw_response.create(model=EMBED, input="hello world")
    answer = raw.parse()
    assert raw.headers["x-spillgate-outcome"] == "local"
    assert answer.model == EMBED  # the served name swapped back
    assert [d.index for d in answer.data] == [0]
    vector = answer.data[0].embedding  # the client asked for base64 and decoded it
    assert len(vector) == DIM
    assert math.isclose(sum(v * v for v in vector), 1.0, rel_tol=1e-4)
    again = _client(fleet).embeddings.create(model=EMBED, input="hello world")
    assert again.data[0].embedding == vector  # deterministic
    # the simulator's tokens: ceil(11 / 4) + 1
    assert (answer.usage.prompt_tokens, answer.usage.total_tokens) == (4, 4)
    after = _tokens(fleet, "embed-0", "prompt"), _requests(fleet, EMBED, "local")
    assert (after[0] - before[0], after[1] - before[1]) == (8, 2)


def test_a_batch_of_inputs_as_floats_and_token_ids(fleet: Fleet) -> None:
    client = _client(fleet)
    texts = client.embeddings.create(
        model=EMBED, input=["a", "bb", "ccccc"], encoding_format="float", dimensions=4
    )
    assert [d.index for d in texts.data] == [0, 1, 2]
    assert all(len(d.embedding) == 4 for d in texts.data)
    assert texts.usage.prompt_tokens == 2 + 2 + 3
    ids = client.embeddings.create(model=EMBED, input=[[1, 2, 3], [4, 5]])
    assert [d.index for d in ids.data] == [0, 1]
    assert ids.usage.prompt_tokens == 5


def test_a_tenant_over_its_token_budget_gets_429(fleet: Fleet) -> None:
    client = _client(fleet, "small")  # 50 tokens a minute
    text = "x" * 76  # 20 tokens, estimated and used
    for _ in range(2):
        assert client.embeddings.create(model=EMBED, input=text).usage.prompt_tokens == 20
    with pytest.raises(openai.RateLimitError) as caught:
        client.embeddings.create(model=EMBED, input=text)
    assert caught.value.response.headers["x-spillgate-outcome"] == "throttled"
    assert "tokens per minute" in caught.value.message


def test_each_kind_of_pool_refuses_the_other_api_with_a_400(fleet: Fleet) -> None:
    client = _client(fleet)
    with pytest.raises(openai.BadRequestError) as chat_to_embed:
        client.chat.completions.create(
            model=EMBED, messages=[{"role": "user", "content": "Hi"}], max_tokens=4
        )
    body: Any = chat_to_embed.value.body
    assert body["code"] == "unsupported_endpoint" and body["param"] == "model"
    assert body["message"] == (
        "The model 'embed' does not support Chat Completions API: it is an embedding model."
    )
    with pytest.raises(openai.BadRequestError) as embed_to_chat:
        client.embeddings.create(model=CHAT, input="Hi")
    assert embed_to_chat.value.body["message"] == (  # type: ignore[index]
        "The model 'chat' does not support Embeddings API: it is not an embedding model."
    )
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model=EMBED, input="Hi", max_output_tokens=4)


def test_bad_embedding_input_is_a_400(fleet: Fleet) -> None:
    response = fleet.client().post("/v1/embeddings", json={"model": EMBED, "input": [[]]})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "input"


def _completion_tokens(fleet: Fleet) -> float:
    return sum(_tokens(fleet, f"chat-{i}", "completion") for i in range(2))


def test_a_response_non_streamed_with_usage_accounted(fleet: Fleet) -> None:
    before = _completion_tokens(fleet)
    raw = _client(fleet).responses.with_raw_response.create(
        model=CHAT, input="Hi", max_output_tokens=7
    )
    response = raw.parse()
    assert raw.headers["x-spillgate-outcome"] == "local"
    assert response.model == CHAT
    assert response.status == "completed"
    assert len(response.output_text.split()) == 7
    assert response.usage is not None
    # the simulator's chat prompt: 3 + (ceil(2 / 4) + 4)
    assert (response.usage.input_tokens, response.usage.output_tokens) == (8, 7)
    assert _completion_tokens(fleet) - before == 7


def test_a_response_streamed_with_its_events_and_usage(fleet: Fleet) -> None:
    before = _completion_tokens(fleet)
    events = list(
        _client(fleet).responses.create(model=CHAT, input="Hi", max_output_tokens=6, stream=True)
    )
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert len(deltas.split()) == 6
    done = events[-1]
    assert done.type == "response.completed"
    assert done.response.model == CHAT
    assert done.response.usage is not None and done.response.usage.output_tokens == 6
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert _completion_tokens(fleet) - before == 6


def _answered_by(fleet: Fleet) -> dict[str, float]:
    return {f"chat-{i}": _tokens(fleet, f"chat-{i}", "completion") for i in range(2)}


def test_a_continuation_goes_to_the_backend_that_holds_its_predecessor(fleet: Fleet) -> None:
    client = _client(fleet)
    body = {"model": CHAT, "input": "hold", "max_output_tokens": 4000, "stream": True}
    # a long answer holds chat-0 (the least filled, first): the next response lands on chat-1
    with (
        fleet.client() as http,
        http.stream("POST", "/v1/responses", json=body) as hold,
    ):
        assert hold.status_code == 200
        chunks = hold.iter_bytes()  # kept: a generator dropped would close the stream
        next(chunks)
        before = _answered_by(fleet)
        first = client.responses.create(model=CHAT, input="Hi", max_output_tokens=3)
        after = _answered_by(fleet)
    assert after["chat-1"] - before["chat-1"] == 3
    # chat-0 is idle again and first in the pool: only the pin sends these to chat-1
    second = client.responses.create(
        model=CHAT, input="More", max_output_tokens=2, previous_response_id=first.id
    )
    assert second.previous_response_id == first.id
    assert second.usage is not None
    # the predecessor's 8 + 3 tokens, then this turn's 3 + ceil(4 / 4) + 4
    assert second.usage.input_tokens == 11 + 8
    events = list(
        client.responses.create(
            model=CHAT,
            input="Again",
            max_output_tokens=2,
            previous_response_id=second.id,
            stream=True,
        )
    )
    assert events[-1].type == "response.completed"
    assert _answered_by(fleet)["chat-1"] - after["chat-1"] == 4
    assert _answered_by(fleet)["chat-0"] == after["chat-0"]


def test_an_unknown_previous_response_is_a_404(fleet: Fleet) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        _client(fleet).responses.create(
            model=CHAT, input="Hi", max_output_tokens=2, previous_response_id="resp_unknown"
        )
    body: Any = caught.value.body
    assert body["message"] == "Response with id 'resp_unknown' not found."
    assert body["param"] == "previous_response_id"


@pytest.fixture
def slow_embeddings() -> Iterator[Fleet]:
    """One slow embedding backend with room for one 200-token input at a time."""
    sims = {EMBED: [SimConfig(model="served-embed", kv_tokens=256, embedding_dim=DIM, speed=0.02)]}
    options = {"kind": "embedding", "overflow": ["queue", "reject"], "queue": {"max_wait_s": 10}}
    with run_fleet(pools=sims, pool_options={EMBED: options}) as f:
        yield f


def test_embeddings_hold_their_tokens_and_queue_for_room(slow_embeddings: Fleet) -> None:
    fleet = slow_embeddings
    body = {"model": EMBED, "input": "x" * 796}  # 200 tokens: 208 in blocks of 16

    def held() -> int:
        backends = fleet.status()["pools"][0]["backends"]
        return int(backends[0]["tokens_in_flight"])

    async def scenario() -> tuple[list[str], int]:
        headers = {"authorization": f"Bearer {fleet.keys['acme']}"}
        async with httpx.AsyncClient(base_url=fleet.url, headers=headers, timeout=30) as client:
            first = asyncio.create_task(client.post("/v1/embeddings", json=body))
            await wait_for(lambda: held() == 208)
            second = asyncio.create_task(client.post("/v1/embeddings", json=body))
            replies = [await first, await second]
        assert [r.status_code for r in replies] == [200, 200]
        return [r.headers["x-spillgate-outcome"] for r in replies], held()

    assert asyncio.run(scenario()) == (["local", "queued"], 0)


def test_embeddings_spill_to_the_pools_provider_when_full() -> None:
    hosted_sim = SimConfig(model="hosted-embed", kv_tokens=8192, embedding_dim=DIM)
    with ServerThread(create_sim_app(hosted_sim)) as hosted:
        slow = SimConfig(model="served-embed", kv_tokens=256, embedding_dim=DIM, speed=0.02)
        options = {"kind": "embedding", "overflow": ["provider", "reject"], "provider": "hosted"}
        provider = {
            "name": "hosted",
            "base_url": f"{hosted.url}/v1",
            "models": {EMBED: "hosted-embed"},
        }
        with run_fleet(
            pools={EMBED: [slow]}, pool_options={EMBED: options}, extra={"providers": [provider]}
        ) as fleet:
            body = {"model": EMBED, "input": "x" * 796}

            async def scenario() -> list[tuple[str, str, int]]:
                headers = {"authorization": f"Bearer {fleet.keys['acme']}"}
                async with httpx.AsyncClient(
                    base_url=fleet.url, headers=headers, timeout=30
                ) as client:
                    first = asyncio.create_task(client.post("/v1/embeddings", json=body))
                    await wait_for(
                        lambda: fleet.status()["pools"][0]["backends"][0]["tokens_in_flight"] > 0
                    )
                    second = await client.post("/v1/embeddings", json=body)
                    replies = [await first, second]
                return [
                    (r.headers["x-spillgate-outcome"], r.json()["model"], len(r.json()["data"]))
                    for r in replies
                ]

            assert asyncio.run(scenario()) == [("local", EMBED, 1), ("provider", EMBED, 1)]
            assert _tokens(fleet, "hosted", "prompt") == 200


def test_a_continuation_whose_backend_is_down_is_a_503_not_a_retry_elsewhere() -> None:
    chat = [SimConfig(model="served-chat", kv_tokens=8192, speed=20.0) for _ in range(2)]
    with run_fleet(pools={CHAT: chat}, pool_options={CHAT: {"capacity_refresh_s": 0.2}}) as fleet:
        client = _client(fleet)
        first = client.responses.create(model=CHAT, input="Hi", max_output_tokens=2)
        fleet.backends[CHAT][0].stop()  # both idle: the first went to chat-0

        def down() -> bool:
            return not fleet.status()["pools"][0]["backends"][0]["healthy"]

        asyncio.run(wait_for(down, within_s=10))
        with pytest.raises(openai.InternalServerError) as caught:
            client.responses.create(
                model=CHAT, input="More", max_output_tokens=2, previous_response_id=first.id
            )
        assert caught.value.status_code == 503
        body: Any = caught.value.body
        assert body["code"] == "backend_unavailable"
        assert body["message"].startswith(
            f"The backend that holds response '{first.id}' (chat-0) is unavailable: "
        )
        assert caught.value.response.headers["x-spillgate-outcome"] == "rejected"
        fresh = client.responses.create(model=CHAT, input="Hi", max_output_tokens=2)
        assert fresh.status == "completed"  # chat-1 serves the rest
