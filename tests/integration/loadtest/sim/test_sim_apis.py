"""The simulated replica's embeddings and responses through the official openai client."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from loadtest.sim.apis import unit_vector
from loadtest.sim.app import create_sim_app
from loadtest.sim.config import SimConfig
from tests.support.harness import ServerThread


@pytest.fixture(scope="module")
def sims() -> Iterator[dict[str, ServerThread]]:
    configs = {
        "embed": SimConfig(model="e", kv_tokens=4096, max_model_len=64, embedding_dim=16),
        "chat0": SimConfig(model="m", kv_tokens=4096, speed=50.0),
        "chat1": SimConfig(model="m", kv_tokens=4096, speed=50.0),
    }
    servers = {name: ServerThread(create_sim_app(c)).start() for name, c in configs.items()}
    try:
        yield servers
    finally:
        for server in servers.values():
            server.stop()


def _client(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=10)


def test_embeddings_are_deterministic_unit_vectors_in_either_encoding(
    sims: dict[str, ServerThread],
) -> None:
    client = _client(sims["embed"])
    floats = client.embeddings.create(model="e", input=["one", "two"], encoding_format="float")
    decoded = client.embeddings.create(model="e", input=["one", "two"])  # base64, decoded
    assert [d.embedding for d in floats.data] == [unit_vector(b"one", 16), unit_vector(b"two", 16)]
    assert all(
        abs(x - y) < 1e-6
        for f, d in zip(floats.data, decoded.data, strict=True)
        for x, y in zip(f.embedding, d.embedding, strict=True)
    )
    assert floats.usage.prompt_tokens == 4  # (ceil(3 / 4) + 1) each
    assert floats.data[0].embedding != floats.data[1].embedding


def test_an_input_over_the_context_is_vllms_400(sims: dict[str, ServerThread]) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        _client(sims["embed"]).embeddings.create(model="e", input="x" * 400)
    assert "maximum context length is 64 tokens" in caught.value.message


def test_each_model_refuses_the_api_it_does_not_serve_as_vllm_does(
    sims: dict[str, ServerThread],
) -> None:
    body = {"model": "e", "messages": [{"role": "user", "content": "Hi"}]}
    refused = httpx.post(f"{sims['embed'].url}/v1/chat/completions", json=body)
    assert (refused.status_code, refused.json()) == (
        400,
        {
            "error": {
                "message": "The model does not support Chat Completions API",
                "type": "BadRequestError",
                "param": None,
                "code": 400,
            }
        },
    )
    with pytest.raises(openai.BadRequestError) as caught:
        _client(sims["chat0"]).embeddings.create(model="m", input="Hi")
    assert caught.value.body["message"] == "The model does not support Embeddings API"  # type: ignore[index]


def test_only_the_replica_that_produced_a_response_continues_it(
    sims: dict[str, ServerThread],
) -> None:
    first = _client(sims["chat0"]).responses.create(model="m", input="Hi", max_output_tokens=3)
    assert first.id.startswith("resp_") and first.usage is not None
    assert (first.usage.input_tokens, first.usage.output_tokens) == (8, 3)
    again = _client(sims["chat0"]).responses.create(
        model="m", input="Go on", max_output_tokens=2, previous_response_id=first.id
    )
    assert again.usage is not None and again.usage.input_tokens == 11 + 9
    with pytest.raises(openai.NotFoundError) as caught:
        _client(sims["chat1"]).responses.create(
            model="m", input="Go on", max_output_tokens=2, previous_response_id=first.id
        )
    assert caught.value.body == {  # what vLLM answers
        "message": f"Response with id '{first.id}' not found.",
        "type": "invalid_request_error",
        "param": None,
        "code": 404,
    }
