"""Keys stay secret, admin stays admin, the client never steers or reaches upstream
credentials, and one tenant cannot read or detect another's cached answers."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import secrets
import socket
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest

from gateway.config import parse_settings
from gateway.errors import Unauthenticated
from gateway.front.auth import Authenticator
from tests.support.fault import (
    async_client,
    backend_requests,
    chat,
    holding,
    provider_stats,
)
from tests.support.fleet import ADMIN_TOKEN, Fleet
from tests.support.secure import HOLD, SecureFleet, secure_fleet


@pytest.fixture(scope="module")
def secure() -> Iterator[SecureFleet]:
    with secure_fleet() as fleet:
        yield fleet


def test_tenant_keys_are_held_only_as_sha256_digests() -> None:
    key = "sk-" + secrets.token_hex(16)
    config = {
        "tenants": [{"name": "acme", "key_env": "ACME_KEY"}],
        "pools": [{"name": "p", "backends": [{"url": "http://127.0.0.1:9", "capacity": 1}]}],
    }
    settings = parse_settings(config)
    auth = Authenticator(settings, {"ACME_KEY": key})
    assert key not in settings.model_dump_json()  # the file names the variable, never the key
    held = list(vars(auth)["_by_hash"])
    assert held == [hashlib.sha256(key.encode()).digest()]
    assert auth.tenant(f"Bearer {key}").name == "acme"
    near_miss = key[:-1] + ("0" if key[-1] != "0" else "1")
    with pytest.raises(Unauthenticated):
        auth.tenant(f"Bearer {near_miss}")


def test_admin_endpoints_refuse_tenant_keys(secure: SecureFleet) -> None:
    url = f"{secure.fleet.url}/admin/status"

    def status(token: str | None) -> int:
        headers = {} if token is None else {"authorization": f"Bearer {token}"}
        return httpx.get(url, headers=headers, timeout=10).status_code

    assert status(secure.fleet.keys["acme"]) == 403
    assert status(secure.fleet.keys["beta"]) == 403
    assert status("not-a-key") == 401
    assert status(None) == 401
    assert status(ADMIN_TOKEN) == 200
    refused = httpx.get(url, headers={"authorization": f"Bearer {secure.fleet.keys['acme']}"})
    assert refused.json()["error"]["type"] == "permission_error"


def test_a_pool_outside_a_tenants_list_looks_exactly_like_one_that_does_not_exist(
    secure: SecureFleet,
) -> None:
    headers = {"authorization": f"Bearer {secure.fleet.keys['gamma']}"}
    url = secure.fleet.url

    def ask(model: str) -> httpx.Response:
        body = chat("hi", model=model)
        return httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=10)

    forbidden, missing = ask("big"), ask("gone")
    assert forbidden.status_code == missing.status_code == 404
    assert (
        forbidden.json()["error"]["message"].replace("big", "gone")
        == (missing.json()["error"]["message"])
    )
    models = httpx.get(f"{url}/v1/models", headers=headers, timeout=10).json()
    assert [m["id"] for m in models["data"]] == ["rec"]
    assert ask("rec").status_code == 200


STEERING_HEADERS = {
    "connection": "keep-alive, x-secret-hop",
    "keep-alive": "timeout=5",
    "proxy-authorization": "Basic c2VjcmV0OnNlY3JldA==",
    "proxy-connection": "keep-alive",
    "te": "trailers",
    "trailer": "x-checksum",
    "x-secret-hop": "named in Connection",
    "cookie": "session=secret",
    "x-forwarded-host": "evil.example",
    "x-forwarded-for": "10.9.8.7",
    "x-api-base": "http://127.0.0.1:1/v1",
    "x-base-url": "http://127.0.0.1:1/v1",
    "openai-organization": "org-evil",
}


def leaked(received: dict[str, str]) -> set[str]:
    """The client's steering headers that arrived upstream as the client sent them.

    The upstream client sends its own `connection: keep-alive` for its own connection;
    only what the client wrote counts as leaked."""
    return {name for name, value in STEERING_HEADERS.items() if received.get(name) == value} | (
        {"x-secret-hop", "proxy-authorization", "cookie"} & set(received)
    )


def steering_body(decoy_url: str, model: str) -> dict[str, Any]:
    return chat(
        "who answers?",
        model=model,
        api_base=decoy_url + "/v1",
        base_url=decoy_url + "/v1",
        api_key="sk-client-chosen-key",
        custom_llm_provider="openai",
        extra_headers={"authorization": "Bearer sk-client-chosen-key"},
    )


def test_client_credentials_hop_headers_and_upstream_choices_never_reach_a_backend(
    secure: SecureFleet,
) -> None:
    key = secure.fleet.keys["acme"]
    headers = {"authorization": f"Bearer {key}", **STEERING_HEADERS}
    response = httpx.post(
        f"{secure.fleet.url}/v1/chat/completions",
        json=steering_body(secure.decoy_url, "rec"),
        headers=headers,
        timeout=10,
    )
    assert response.status_code == 200
    assert "answered by recorder" in response.text
    assert secure.decoy.seen == []
    received, body = secure.recorder.seen[-1]
    assert "authorization" not in received
    assert leaked(received) == set()
    assert received["host"] == secure.fleet.settings.pools[0].backends[0].url.split("//")[1]
    assert key not in orjson.dumps(received).decode()
    assert not {"api_base", "base_url", "api_key", "custom_llm_provider", "extra_headers"} & set(
        body
    )
    assert body["model"] == "r"  # the backend's own served name, chosen by the gateway


def test_a_provider_gets_its_own_key_and_nothing_the_client_chose(secure: SecureFleet) -> None:
    async def spill() -> httpx.Response:
        async with (
            async_client(secure.fleet, "acme") as client,
            holding(client, "big", tokens=HOLD),
        ):
            return await client.post(
                "/v1/chat/completions",
                json=steering_body(secure.decoy_url, "big"),
                headers=STEERING_HEADERS,
            )

    response = asyncio.run(spill())
    assert response.headers["x-spillgate-outcome"] == "provider"
    stats = provider_stats(secure.hosted)
    assert stats["authorizations_seen"] == [f"Bearer {secure.provider_key}"]
    assert leaked(stats["last_headers"]) == set()
    assert secure.decoy.seen == []


def test_keys_never_appear_in_logs_errors_or_metrics(
    secure: SecureFleet, caplog: pytest.LogCaptureFixture
) -> None:
    fleet = secure.fleet
    acme, beta = fleet.keys["acme"], fleet.keys["beta"]
    wrong = acme[:-4] + "0000"
    texts: list[str] = []
    with caplog.at_level(logging.DEBUG):

        def call(method: str, path: str, token: str | None, **kwargs: Any) -> None:
            headers = {} if token is None else {"authorization": f"Bearer {token}"}
            r = httpx.request(method, fleet.url + path, headers=headers, timeout=10, **kwargs)
            texts.append(f"{r.status_code} {dict(r.headers)} {r.text}")

        call("POST", "/v1/chat/completions", acme, json=chat("hi", model="rec"))
        call("POST", "/v1/chat/completions", wrong, json=chat("hi", model="rec"))
        call("POST", "/v1/chat/completions", beta, content=b"{broken")
        call("POST", "/v1/chat/completions", acme, json=chat("hi", model="nope"))
        call("GET", "/admin/status", acme)
        call("GET", "/admin/status", ADMIN_TOKEN)
        call("GET", "/v1/models", wrong)
        httpx.post(f"{secure.hosted.url}/sim/fail", json={"status": 500}, timeout=5)

        async def spill_and_fail() -> None:
            async with async_client(fleet, "beta") as client, holding(client, "big", tokens=HOLD):
                r = await client.post("/v1/chat/completions", json=chat("spill", model="big"))
                texts.append(f"{r.status_code} {dict(r.headers)} {r.text}")

        asyncio.run(spill_and_fail())
        texts.append(fleet.metrics_text())
    assert "500" in provider_stats(secure.hosted)["by_status"]  # the provider path was taken
    logged = "\n".join(f"{r.name} {r.getMessage()} {r.exc_text or ''}" for r in caplog.records)
    assert caplog.records, "nothing was logged: the scan would prove nothing"
    everything = logged + "\n".join(texts)
    for secret in (acme, beta, wrong, secure.provider_key, ADMIN_TOKEN):
        assert secret not in everything


def test_a_cache_hit_is_not_observable_across_tenants(secure: SecureFleet) -> None:
    """acme's answer is cached; with the pool full, beta asking the same question is sent to
    the provider exactly like a question nobody asked before: same outcome, same headers,
    one more provider request each time, and never acme's bytes."""
    fleet = secure.fleet
    question = chat("What is the capital of France?", model="big", temperature=0)
    fresh = chat("A question nobody asked before", model="big", temperature=0)

    async def scenario() -> dict[str, httpx.Response]:
        seen: dict[str, httpx.Response] = {}
        async with async_client(fleet, "acme") as acme, async_client(fleet, "beta") as beta:
            seen["acme_first"] = await acme.post("/v1/chat/completions", json=question)
            async with holding(acme, "big", tokens=HOLD):
                seen["acme_again"] = await acme.post("/v1/chat/completions", json=question)
                before = provider_stats(secure.hosted)["requests"]
                seen["beta_same"] = await beta.post("/v1/chat/completions", json=question)
                middle = provider_stats(secure.hosted)["requests"]
                seen["beta_fresh"] = await beta.post("/v1/chat/completions", json=fresh)
                after = provider_stats(secure.hosted)["requests"]
        assert (middle - before, after - middle) == (1, 1)
        return seen

    backend_before = backend_requests(fleet.backends["big"][0])
    seen = asyncio.run(scenario())
    outcome = {name: r.headers["x-spillgate-outcome"] for name, r in seen.items()}
    assert outcome == {
        "acme_first": "local",
        "acme_again": "cached",
        "beta_same": "provider",
        "beta_fresh": "provider",
    }
    assert seen["acme_again"].content == seen["acme_first"].content
    assert seen["beta_same"].content != seen["acme_first"].content
    assert set(seen["beta_same"].headers) == set(seen["beta_fresh"].headers)
    # only acme's first question and the holding stream reached the backend
    assert backend_requests(fleet.backends["big"][0]) - backend_before == 2


def raw_exchange(fleet: Fleet, request: bytes) -> tuple[bytes, bytes, bool]:
    """Send `request` as bytes on a fresh connection and read until the gateway closes it
    (3 s at most): the response head, its body, and whether the gateway closed."""
    with socket.create_connection((fleet.gateway.host, fleet.gateway.port), timeout=3) as sock:
        sock.sendall(request)
        received = b""
        closed = False
        with contextlib.suppress(TimeoutError):
            while chunk := sock.recv(65536):
                received += chunk
            closed = True
    head, _, body = received.partition(b"\r\n\r\n")
    return head, body, closed


TRAILING_SLASH_REQUESTS = {
    "dashboard": f"GET /dashboard/?token={ADMIN_TOKEN} HTTP/1.1",
    "admin status": "GET /admin/status/ HTTP/1.1",
    "chat completions": "POST /v1/chat/completions/ HTTP/1.1",
    "completions": "POST /v1/completions/ HTTP/1.1",
    "models": "GET /v1/models/ HTTP/1.1",
}


@pytest.mark.parametrize("path", list(TRAILING_SLASH_REQUESTS))
def test_a_trailing_slash_is_a_404_never_a_redirect_to_the_requests_host(
    secure: SecureFleet, path: str
) -> None:
    """A redirect built from the Host header would send the admin token (in the dashboard's
    query string) or a tenant's request to whatever host the request named."""
    body = orjson.dumps(chat("hi", model="rec"))
    request = "\r\n".join(
        [
            TRAILING_SLASH_REQUESTS[path],
            "host: evil.example.com",
            f"authorization: Bearer {ADMIN_TOKEN}",
            "content-type: application/json",
            f"content-length: {len(body)}",
            "connection: close",
            "",
            "",
        ]
    ).encode()
    head, answer, _ = raw_exchange(secure.fleet, request + body)
    assert head.split(b"\r\n")[0] == b"HTTP/1.1 404 Not Found"
    assert b"location:" not in head.lower()
    assert b"evil" not in head + answer
    error = orjson.loads(answer)["error"]
    assert (error["type"], error["code"]) == ("invalid_request_error", "not_found")


def test_a_413_says_connection_close_and_the_gateway_closes_it(secure: SecureFleet) -> None:
    """The rest of an oversized body is never read: the connection it would come on ends."""
    limit = secure.fleet.settings.server.max_body_bytes
    request = "\r\n".join(
        [
            "POST /v1/chat/completions HTTP/1.1",
            f"host: {secure.fleet.gateway.host}",
            f"authorization: Bearer {secure.fleet.keys['acme']}",
            "content-type: application/json",
            f"content-length: {limit + 1}",
            "",
            "",
        ]
    ).encode()
    head, answer, closed = raw_exchange(secure.fleet, request + b'{"model": "rec"')
    lines = head.lower().split(b"\r\n")
    assert lines[0] == b"http/1.1 413 request entity too large"
    assert b"connection: close" in lines
    assert orjson.loads(answer)["error"]["code"] == "request_too_large"
    assert closed, "the gateway kept the connection open after the 413"
