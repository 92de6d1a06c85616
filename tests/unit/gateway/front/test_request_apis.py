"""Parsing /v1/embeddings and /v1/responses bodies: what is reserved, and bad input as 400s."""

from typing import Any

import pytest

from gateway.errors import InvalidRequest
from gateway.front.parse import parse_request
from gateway.front.request import check_pool_kind
from gateway.request import Endpoint


def _parse(endpoint: Endpoint, body: dict[str, Any]) -> Any:
    return parse_request(
        body,
        endpoint=endpoint,
        tenant="acme",
        pool="p",
        priority="standard",
        default_max_tokens=100,
        max_model_len=512,
        chars_per_token=4.0,
    )


@pytest.mark.parametrize(
    ("value", "tokens", "chars"),
    [
        ("x" * 40, 11, 40),
        (["x" * 40, "y" * 8], 11 + 3, 48),
        ([1, 2, 3], 3, 0),
        ([[1, 2, 3], [4]], 4, 0),
    ],
)
def test_an_embedding_reserves_its_inputs_tokens_and_nothing_more(
    value: Any, tokens: int, chars: int
) -> None:
    request = _parse(Endpoint.EMBEDDINGS, {"model": "p", "input": value})
    assert (request.prompt_tokens, request.max_output_tokens, request.charge_tokens) == (
        tokens,
        0,
        tokens,
    )
    assert (request.prompt_chars, request.stream, request.endpoint) == (
        chars,
        False,
        Endpoint.EMBEDDINGS,
    )


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "p"}, "input"),
        ({"model": "p", "input": []}, "input"),
        ({"model": "p", "input": [[]]}, "input"),
        ({"model": "p", "input": [True]}, "input"),
        ({"model": "p", "input": ["a", 1]}, "input"),
        ({"model": "p", "input": "x" * 4000}, "input"),
        ({"model": "p", "input": "a", "encoding_format": "hex"}, "encoding_format"),
        ({"model": "p", "input": "a", "dimensions": 0}, "dimensions"),
    ],
)
def test_bad_embedding_input_is_refused_with_its_param(body: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        _parse(Endpoint.EMBEDDINGS, body)
    assert caught.value.param == param


def test_a_response_reserves_its_prompt_and_max_output_tokens() -> None:
    body = {
        "model": "p",
        "instructions": "x" * 8,
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "y" * 24}]}],
        "max_output_tokens": 50,
        "stream": True,
    }
    request = _parse(Endpoint.RESPONSES, body)
    # 8 + 24 + 16 characters: 13 tokens
    assert (request.prompt_chars, request.prompt_tokens, request.max_output_tokens) == (48, 13, 50)
    assert (request.stream, request.client_wants_usage) == (True, True)
    default = _parse(Endpoint.RESPONSES, {"model": "p", "input": "Hi"})
    assert default.max_output_tokens == 100


def test_a_continuation_teaches_the_estimator_nothing() -> None:
    body = {"model": "p", "input": "x" * 40, "previous_response_id": "resp_1"}
    request = _parse(Endpoint.RESPONSES, body)
    assert (request.prompt_chars, request.prompt_tokens) == (0, 11)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "p"}, "input"),
        ({"model": "p", "input": []}, "input"),
        ({"model": "p", "input": [3]}, "input[0]"),
        ({"model": "p", "input": "a", "instructions": 1}, "instructions"),
        ({"model": "p", "input": "a", "previous_response_id": ""}, "previous_response_id"),
        ({"model": "p", "input": "a", "max_output_tokens": 0}, "max_output_tokens"),
        ({"model": "p", "input": "a", "max_output_tokens": 600}, "max_output_tokens"),
        ({"model": "p", "input": "a", "stream": "yes"}, "stream"),
    ],
)
def test_bad_response_input_is_refused_with_its_param(body: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        _parse(Endpoint.RESPONSES, body)
    assert caught.value.param == param


def test_each_pool_kind_serves_its_own_apis() -> None:
    for endpoint in (Endpoint.CHAT, Endpoint.COMPLETIONS, Endpoint.RESPONSES):
        check_pool_kind("chat", endpoint, "m")
        with pytest.raises(InvalidRequest):
            check_pool_kind("embedding", endpoint, "m")
    check_pool_kind("embedding", Endpoint.EMBEDDINGS, "m")
    with pytest.raises(InvalidRequest) as caught:
        check_pool_kind("chat", Endpoint.EMBEDDINGS, "m")
    assert str(caught.value) == (
        "The model 'm' does not support Embeddings API: it is not an embedding model."
    )
