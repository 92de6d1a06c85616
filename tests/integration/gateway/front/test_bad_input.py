"""Bad input gets a 4xx in OpenAI's error shape, never a 5xx."""

from collections.abc import Iterator

import httpx
import orjson
import pytest

from loadtest.sim.config import SimConfig
from tests.support.fleet import run_fleet

MSG = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def client() -> Iterator[httpx.Client]:
    with (
        run_fleet(
            pools={"big": [SimConfig(model="m", kv_tokens=4096, speed=50.0)]},
            extra={"server": {"max_body_bytes": 4096}},
        ) as fleet,
        fleet.client() as c,
    ):
        yield c


def _chat(**fields: object) -> bytes:
    return orjson.dumps({"model": "big", "messages": MSG, **fields})


BIG_MESSAGE = [{"role": "user", "content": "x" * 5000}]
CASES: list[tuple[str, bytes, int, str | None]] = [
    ("malformed json", b'{"model": "big", "messages": [', 400, None),
    ("not an object", b"[1, 2]", 400, None),
    ("empty body", b"", 400, None),
    ("missing model", orjson.dumps({"messages": MSG}), 400, "model"),
    ("missing messages", orjson.dumps({"model": "big"}), 400, "messages"),
    ("model of wrong type", _chat(model=7), 400, "model"),
    ("messages of wrong type", _chat(messages={"a": 1}), 400, "messages"),
    ("negative max_tokens", _chat(max_tokens=-1), 400, "max_tokens"),
    ("absurd max_tokens", _chat(max_tokens=10**12), 400, "max_tokens"),
    ("float max_tokens", _chat(max_tokens=1.5), 400, "max_tokens"),
    ("unknown model", _chat(model="gpt-17"), 404, "model"),
    ("oversized body", _chat(messages=BIG_MESSAGE), 413, None),
    ("non-utf8", b"\xff\xfe{}", 400, None),
    ("stream of wrong type", _chat(stream="yes"), 400, "stream"),
]


@pytest.mark.parametrize(("case", "body", "status", "param"), CASES, ids=[c[0] for c in CASES])
def test_bad_body_gets_openai_shaped_4xx(
    client: httpx.Client, case: str, body: bytes, status: int, param: str | None
) -> None:
    response = client.post(
        "/v1/chat/completions", content=body, headers={"content-type": "application/json"}
    )
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert error["message"]
    assert error["param"] == param


def test_unknown_route_and_wrong_method_are_openai_shaped(client: httpx.Client) -> None:
    missing = client.get("/v1/engines")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    wrong = client.get("/v1/chat/completions")
    assert wrong.status_code == 405 and wrong.json()["error"]["code"] == "method_not_allowed"


def test_missing_key_is_401_even_with_a_bad_body(client: httpx.Client) -> None:
    response = httpx.post(f"{client.base_url}/v1/chat/completions", content=b"{not json")
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "invalid_api_key"
